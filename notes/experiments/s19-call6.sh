#!/usr/bin/env bash
# Session 19, call 6: after the capture gate (no device synchronise while a capture is underway;
# the shim announces captures) and the pass-through mends. The bundled gpu_capture, ffi,
# graph_pool, adversarial_s19 and adversarial_s19b tests, the Python package's tests with the
# GPU required, and torch_graph.py.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-ffi test-graph_pool test-adversarial_s19 test-adversarial_s19b
python_checks
PYTHONPATH=$PWD/python timeout 120 python3 examples/torch_graph.py > $O/torch_graph.log 2>&1
echo "torch_graph rc=$? $(tail -1 $O/torch_graph.log)" >> $O/summary.txt
