#!/usr/bin/env bash
# Session 22, call 2: a full table of user arenas makes room without a synchronise (7cf8fb6).
# The bundled GPU tests with the GPU required (the many-streams fence torture now bounds its
# synchronises at one per thread); the many-streams torture of the old code (7d22b02, its own
# test file, no bound) once for its figures, side by side with the new one's; the Python package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu test-gpu_stream_pool test-gpu_capture test-ffi test-user_streams test-adversarial_s8_user_fast_free test-adversarial_s22
( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 ./test-gpu --include-ignored --test-threads=1 --nocapture gpu_torture_many_streams ) > $O/new-many.log 2>&1
echo "new many rc=$?" >> $O/summary.txt
( cd gpu-bundle && CUARENA_REQUIRE_GPU=1 ./old-gpu --include-ignored --test-threads=1 --nocapture gpu_torture_many_streams ) > $O/old-many.log 2>&1
echo "old many rc=$?" >> $O/summary.txt
for f in new-many old-many; do
  grep -E "gpu torture many|host_syncs" $O/$f.log | sed "s/^/  $f /" | cut -c1-900 >> $O/summary.txt
done
python_checks
cat $O/summary.txt
