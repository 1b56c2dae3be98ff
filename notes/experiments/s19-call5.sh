#!/usr/bin/env bash
# Session 19, call 5: after the out-of-memory reclaim for graph pools outside a capture (call 4's
# adversarial_s19 ran out of memory with retired pools parked). The bundled gpu_capture, ffi,
# graph_pool and adversarial_s19 tests, then the Python package's tests with the GPU required.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-ffi test-graph_pool test-adversarial_s19
python_checks
