#!/usr/bin/env bash
# Session 23, call 4 (the final code, with the pool's retry avoiding lazy legacy fences): the blocking-capture tests and the GPU tests the change
# touches, with the GPU required; the Python package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-gpu test-ffi test-legacy_frees test-user_streams test-capture \
  test-adversarial_s23 test-graph_pool
( CUARENA_REQUIRE_GPU=1 gpu-bundle/test-gpu_capture --include-ignored --nocapture --test-threads=1 \
    survives_other_threads_work ) > $O/blocking.log 2>&1
echo "blocking rc=$?" >> $O/summary.txt
grep -E "Blocking /|PerThread /" $O/blocking.log | sed 's/^test .*\.\.\. //' | cut -c1-300 >> $O/summary.txt
python_checks
cat $O/summary.txt
