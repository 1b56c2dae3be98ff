#!/usr/bin/env bash
# Session 24, call 7 (the final code, de232b7): as call 6, after helper-27's mend of
# `Slot::release_arena` (a per-thread arena parked when its thread exits during its own
# capture), with helper-27's tests; the Python package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-gpu test-capture test-adversarial_s24 test-adversarial_s24c \
  test-legacy_frees test-user_streams test-ffi
( CUARENA_REQUIRE_GPU=1 gpu-bundle/test-gpu_capture --include-ignored --nocapture --test-threads=1 \
    survives_other_threads_work ) > $O/blocking.log 2>&1
echo "blocking rc=$?" >> $O/summary.txt
grep -E "Blocking /|PerThread /" $O/blocking.log | sed 's/^test .*\.\.\. //' | cut -c1-200 >> $O/summary.txt
python_checks
cat $O/summary.txt
