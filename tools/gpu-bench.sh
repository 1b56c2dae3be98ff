#!/usr/bin/env bash
# Runs on the GPU machine after tools/gpu-bundle.sh: the stream-mode benchmark, the PyTorch
# training comparison (3 interleaved runs each), and, if gpu-bundle/cuarena-old exists (an older
# build to compare with), PTDS churn and handoff of both builds interleaved. Writes to OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/cuarena-bench}"; mkdir -p "$out"
export CUARENA_LIB="$PWD/gpu-bundle/libcuarena.so" PYTHONUNBUFFERED=1
./gpu-bundle/cuarena --json --secs 0.5 --threads 1,16 --workloads churn,large,mixed,handoff,handoff_msg \
  --streams ptds,legacy,own --allocators cuarena,cuMemAllocAsync --no-touch > "$out/streams.jsonl" 2> "$out/streams.err"
echo "streams: $(wc -l < "$out/streams.jsonl") rows, exit $?"
if [ -x gpu-bundle/cuarena-old ]; then
  for i in 1 2; do
    for b in cuarena cuarena-old; do
      extra=""; [ $b = cuarena ] && extra="--streams ptds"
      ./gpu-bundle/$b --json --secs 0.5 --threads 1,16 --workloads churn,handoff --allocators cuarena --no-touch $extra 2>/dev/null |
        sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"$b\",\"round\":$i/" >> "$out/old-vs-new.jsonl"
    done
  done
  echo "old-vs-new: $(wc -l < "$out/old-vs-new.jsonl") rows"
fi
for i in 1 2 3; do
  for a in native cuarena; do
    python3 examples/torch_train.py --allocator $a 2>>"$out/train.err" | tail -1 >> "$out/train.jsonl"
  done
done
python3 - "$out" <<'PY'
import json, sys, statistics as st
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/train.jsonl")]
for a in ("native", "cuarena"):
    t = [r["step_ms"] for r in rows if r["allocator"] == a]
    print(a, "step ms", [round(x, 2) for x in t], "median", round(st.median(t), 2))
n = [r for r in rows if r["allocator"] == "native"][0]; c = [r for r in rows if r["allocator"] == "cuarena"]
print("losses identical:", all(r["losses"] == n["losses"] for r in c), "paths:", {k: c[-1].get(k) for k in ("allocations", "arena_allocations", "pool_allocations", "driver_calls")})
PY
