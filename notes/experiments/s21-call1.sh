#!/usr/bin/env bash
# Session 21, call 1: the user-stream changes (16 arenas and batches, adoption of parked arenas,
# lean arenas, frees sent alone) and the graph-pool fence fix, on the H200 with the GPU required:
# the fence torture in every mode (many streams new), the pool-of-streams test new against the
# old commit 4823772 (measure only), one-thread and 16-thread churn new against old on own
# streams and per-thread streams, the graph and ffi tests, the Python package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_stream_pool test-user_streams test-user_stream_batches test-adversarial_user_batches test-graph_pool test-graph_checkpoint test-gpu_capture test-ffi test-gpu
( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 CUARENA_MEASURE_ONLY=1 ./old-gpu_stream_pool --include-ignored --nocapture ) > $O/old-pool.log 2>&1
echo "old pool rc=$?" >> $O/summary.txt
grep -h "pool-of-streams" $O/rust.log $O/old-pool.log | sed 's/^/  /' >> $O/summary.txt
for r in 1 2; do for b in cuarena cuarena-old; do
  ./gpu-bundle/$b --json --workloads churn --streams own,ptds --threads 1,16 --allocators cuarena --no-touch --secs 0.5 > $O/bench-$b-$r.jsonl 2>/dev/null
done; done
python3 - "$O" >> $O/summary.txt <<'PY'
import json, sys, glob
o = sys.argv[1]
for f in sorted(glob.glob(o + "/bench-*.jsonl")):
    for l in open(f):
        try: d = json.loads(l)
        except Exception: continue
        print(f.rsplit("/",1)[1], d.get("workload"), d.get("streams"), d.get("threads"), round(d.get("pairs_per_sec", d.get("pairs_s", 0))/1e6, 3) if isinstance(d.get("pairs_per_sec", d.get("pairs_s", 0)), (int,float)) else d)
PY
python_checks
cat $O/summary.txt
