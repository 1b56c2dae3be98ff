#!/usr/bin/env bash
# Session 23, call 2: captures of blocking streams. The old code's gpu_capture binary (built at
# 9f809d0's source with this session's new tests and its `Watch` device, which names the first
# call after which the capture was found invalidated), then the new code's: gpu_capture, the
# fence torture, ffi, legacy frees, user streams, capture; the Python package.
source "$(dirname "$0")/gpu-checks.sh"
( CUARENA_REQUIRE_GPU=1 timeout 200 gpu-bundle/test-gpu_capture-old --include-ignored --nocapture \
    --test-threads=1 blocking_streams ) > $O/old.log 2>&1
echo "old rc=$?" >> $O/summary.txt
grep -E "^Blocking|^PerThread" $O/old.log | cut -c1-600 >> $O/summary.txt
rust_tests test-gpu_capture test-gpu test-ffi test-legacy_frees test-user_streams test-capture
grep -E "^Blocking|^PerThread" $O/rust.log | cut -c1-400 >> $O/summary.txt
python_checks
cat $O/summary.txt
