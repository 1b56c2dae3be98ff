#!/usr/bin/env bash
# Session 19, call 4: graph pools after helper-18's attack (fenced frees outside captures,
# 512-byte aligned segments, pass-through mending). The Python package's tests with the GPU
# required, the PyTorch API probe, torch_graph.py, and the bundled tests: gpu_capture, ffi, gpu
# (the fence torture in all three stream modes), and the host-side graph_pool and
# adversarial_s19 tests.
source "$(dirname "$0")/gpu-checks.sh"
python_checks
PYTHONPATH=$PWD/python timeout 200 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err
echo "probe rc=$?" >> $O/summary.txt
grep '"ok": false' $O/probe-cuarena.jsonl | cut -c1-300 >> $O/summary.txt
echo "probe ok: $(grep -c '"ok": true' $O/probe-cuarena.jsonl) of $(wc -l < $O/probe-cuarena.jsonl)" >> $O/summary.txt
PYTHONPATH=$PWD/python timeout 120 python3 examples/torch_graph.py > $O/torch_graph.log 2>&1
echo "torch_graph rc=$? $(tail -1 $O/torch_graph.log)" >> $O/summary.txt
rust_tests test-gpu_capture test-ffi test-graph_pool test-adversarial_s19 test-gpu
