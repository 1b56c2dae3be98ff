#!/usr/bin/env bash
# Session 26, call 1: a release qualification of the current code on the H200. tools/gpu-demos.sh
# (the GPU tests gpu/ffi/host, the C ABI's GPU-only tests, the C programs, the pip-installed
# Python package, PyTorch training native vs cuarena, threaded inference with record_stream, CuPy,
# CuPy on a non-blocking stream, out of memory under a cap, graph captures, the OOM hook's
# spilling layer, torch.cuda.graph), then the remaining GPU-capable test binaries with the GPU
# required.
source "$(dirname "$0")/gpu-checks.sh"
timeout 400 bash tools/gpu-demos.sh $O/demos > $O/demos.txt 2>&1
echo "demos rc=$?" >> $O/summary.txt
grep -E "^== |FAILED|test result|rc=|Ran |^OK" $O/demos.txt | head -60 >> $O/summary.txt
rust_tests test-gpu_capture test-gpu_stream_pool test-capture test-legacy_frees test-adversarial_streams test-regressions test-bad_input
cat $O/summary.txt
