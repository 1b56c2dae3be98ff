#!/usr/bin/env bash
# Session 25, call 1: PyTorch step time through the plug-in, native against cuarena with the
# glue's defaults and three variants set through CUARENA_CONF (which overrides the glue's
# FRAMEWORK_CONF, key by key): is the gap the allocator's host time, its statistics, the kept-back
# legacy frees (reuse of a block just freed, warm in the L2), or the pool path for blocks over 1 MiB?
# ROUNDS rounds, the order of the five runs rotated each round. Rows: $O/train.jsonl.
source "$(dirname "$0")/gpu-checks.sh"
ROUNDS=${ROUNDS:-5}
names=(native glue sampled kept1m arenas)
confs=("" "" "stats=sampled" "legacy_batch=16,legacy_batch_bytes=1MiB" "large_max=64MiB")
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> $O/summary.txt
for i in $(seq $ROUNDS); do
  for k in 0 1 2 3 4; do
    j=$(( (k + i) % 5 ))
    a=cuarena; [ $j -eq 0 ] && a=native
    r=$(CUARENA_CONF="${confs[$j]}" timeout 150 python3 examples/torch_train.py --allocator $a --steps ${STEPS:-300} 2>>$O/train.err | tail -1)
    echo "{\"round\": $i, \"variant\": \"${names[$j]}\", \"run\": $r}" >> $O/train.jsonl
  done
done
python3 - "$O/train.jsonl" >> $O/summary.txt <<'PY'
import json, sys, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault(r["variant"], []).append(r["run"])
base = by.get("native", [])
ref = base[0]["losses"] if base else None
for v, runs in by.items():
    mean = [x["step_ms"] for x in runs]; p50 = [x["step_ms_p50"] for x in runs]
    same = all(x["losses"] == ref for x in runs)
    extra = {k: runs[-1].get(k) for k in ("peak_reserved_bytes", "allocations", "arena_allocations", "pool_allocations", "driver_calls")}
    print(v, "mean ms", [round(x, 2) for x in mean], "median", round(st.median(mean), 2),
          "p50 ms", [round(x, 2) for x in p50], "median", round(st.median(p50), 2), "losses same:", same, extra)
PY
cat $O/summary.txt
