#!/usr/bin/env bash
# Session 20, call 3: after helper-20's mends (live blocks keep the fences they were taken
# behind; pass-through statistics count refused graph frees). The bundled graph tests, ffi and
# gpu_capture, the Python package's tests with the GPU required (the reduce-overhead inference
# and training tests among them), torch_graph.py.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-ffi test-graph_checkpoint test-adversarial_s20 test-graph_pool test-adversarial_s19 test-adversarial_s19b test-gpu_capture
python_checks
PYTHONPATH=$PWD/python timeout 120 python3 examples/torch_graph.py > $O/torch_graph.log 2>&1
echo "torch_graph rc=$? $(tail -1 $O/torch_graph.log)" >> $O/summary.txt
cat $O/summary.txt
