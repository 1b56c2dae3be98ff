#!/usr/bin/env bash
# Session 21, call 2: the pool-of-streams test new and old side by side with its figures
# printed, twice each, interleaved; the many-streams torture with its host waits not bounded.
source "$(dirname "$0")/gpu-checks.sh"
for r in 1 2; do
  ( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 ./test-gpu_stream_pool --include-ignored --nocapture ) > $O/new-pool-$r.log 2>&1
  echo "new pool $r rc=$?" >> $O/summary.txt; grep -h "pool-of-streams" $O/new-pool-$r.log | sed 's/^/  new /' >> $O/summary.txt
  ( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 CUARENA_MEASURE_ONLY=1 ./old-gpu_stream_pool --include-ignored --nocapture ) > $O/old-pool-$r.log 2>&1
  echo "old pool $r rc=$?" >> $O/summary.txt; grep -h "pool-of-streams" $O/old-pool-$r.log | sed 's/^/  old /' >> $O/summary.txt
done
( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 ./test-gpu --include-ignored --test-threads=1 gpu_torture_many ) > $O/rust.log 2>&1; echo "rust rc=$?" >> $O/summary.txt; grep -E "test result|FAILED|panicked|gpu torture many" $O/rust.log >> $O/summary.txt
cat $O/summary.txt
