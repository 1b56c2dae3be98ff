#!/usr/bin/env bash
# Session 22, call 3 (8c62548): the bundled GPU tests with the GPU required, the many-streams
# fence torture now bounding synchronises at one per thread (a thread's exit buries once,
# e67ba25; one synchronise per out-of-memory for the caller's user arenas, 8c62548); the
# Python package.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu test-gpu_stream_pool test-gpu_capture test-ffi test-user_streams
grep -E "gpu torture many|host_syncs" $O/rust.log | grep -A1 "gpu torture many:" | cut -c1-700 | sed 's/^/  /' >> $O/summary.txt
python_checks
cat $O/summary.txt
