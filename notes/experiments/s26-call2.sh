#!/usr/bin/env bash
# Session 26, call 2: the test binaries call 1's bundle lacked (gpu-demos.sh's "issue 11" step:
# stats and oom_hook, with gpu_capture and capture again), and the other test files with GPU
# parts: adversarial_issue11, adversarial_s16, adversarial_s25b, host.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-capture test-stats test-oom_hook test-adversarial_issue11 test-adversarial_s16 test-adversarial_s25b test-host
grep -E "skipped|no CUDA" $O/rust.log | head -5 >> $O/summary.txt
cat $O/summary.txt
