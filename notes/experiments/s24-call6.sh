#!/usr/bin/env bash
# Session 24, call 6 (the final code): the GPU tests the session's two fixes touch (a legacy
# refusal reclaims and retries; a thread's per-thread remote frees sent during its own capture
# are parked), with the GPU required, the blocking-capture scenarios listed, and the Python
# package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-gpu test-capture test-adversarial_s23 test-adversarial_s24 \
  test-legacy_frees test-user_streams test-ffi test-graph_pool
( CUARENA_REQUIRE_GPU=1 gpu-bundle/test-gpu_capture --include-ignored --nocapture --test-threads=1 \
    survives_other_threads_work ) > $O/blocking.log 2>&1
echo "blocking rc=$?" >> $O/summary.txt
grep -E "Blocking /|PerThread /" $O/blocking.log | sed 's/^test .*\.\.\. //' | cut -c1-300 >> $O/summary.txt
python_checks
cat $O/summary.txt
