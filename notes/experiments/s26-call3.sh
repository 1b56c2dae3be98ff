#!/usr/bin/env bash
# Session 26, call 3: the return rule on a decaying recent peak (notes/experiments/
# s26-recent-peak-rule.patch, not landed) against the rule on live bytes, side by side: churn
# and mixed on per-thread and own streams, 1 and 16 threads, four interleaved rounds (order
# reversed every other round). gpu-bundle/cuarena-base is da02c25's build (this session's code
# before the docs), gpu-bundle/cuarena-decay the same with the patch.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then order="base decay"; else order="decay base"; fi
  for b in $order; do
    gpu-bundle/cuarena-$b --json --workloads churn,mixed --streams ptds,own --threads 1,16 \
      --allocators cuarena --no-touch --secs 0.5 2>>$O/bench.err | sed "s/^/{\"round\": $i, \"build\": \"$b\", \"row\": /; s/\$/}/" >> $O/bench.jsonl
  done
done
python3 - "$O/bench.jsonl" > $O/summary.txt <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    x = r["row"]
    by.setdefault((x["workload"], x["streams"], x["threads"], r["build"]), []).append(x)
for (w, s, t, b), xs in sorted(by.items()):
    print(w, s, t, b, "M pairs/s", [round(x["pairs_per_sec"] / 1e6, 2) for x in xs],
          "calls/Mop", [round(x["driver_calls_per_mop"]) for x in xs],
          "reserved/peak", [x["memory_ratio"] for x in xs])
PY
cat $O/summary.txt
