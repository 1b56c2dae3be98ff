#!/usr/bin/env bash
# Session 22, call 1: the lean arenas' flag (1377a39) and helper-21's two mends (05ff83d) on the
# H200 with the GPU required: the GPU tests that drive lean arenas (the many-streams fence
# torture, the pool of streams) and the rest of the bundle; the pool-of-streams test new
# (1377a39) against old (7d22b02, the same test file), twice, interleaved, now with driver calls
# and events per pair; churn on own and per-thread streams new against old (the fast path's free
# gained a test), two interleaved rounds; the Python package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_stream_pool test-gpu test-gpu_capture test-ffi test-user_streams test-adversarial_s21
for r in 1 2; do
  ( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 ./test-gpu_stream_pool --include-ignored --nocapture ) > $O/new-pool-$r.log 2>&1
  echo "new pool $r rc=$?" >> $O/summary.txt; grep -h "pool-of-streams" $O/new-pool-$r.log | sed 's/^/  new /' >> $O/summary.txt
  ( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 CUARENA_MEASURE_ONLY=1 ./old-gpu_stream_pool --include-ignored --nocapture ) > $O/old-pool-$r.log 2>&1
  echo "old pool $r rc=$?" >> $O/summary.txt; grep -h "pool-of-streams" $O/old-pool-$r.log | sed 's/^/  old /' >> $O/summary.txt
done
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
        r = d.get("pairs_per_sec", d.get("pairs_s"))
        print(f.rsplit("/",1)[1], d.get("workload"), d.get("streams"), d.get("threads"), round(r/1e6, 3) if isinstance(r, (int, float)) else d)
PY
python_checks
cat $O/summary.txt
