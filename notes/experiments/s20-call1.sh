#!/usr/bin/env bash
# Session 20, call 1: graph-pool checkpoints (getCheckpointState / setCheckpointPoolState for
# torch.compile's reduce-overhead mode). The bundled ffi, graph_checkpoint, graph_pool and
# gpu_capture tests, the Python package's tests with the GPU required (its new
# reduce-overhead test among them), the PyTorch API probe, and the fence torture (test-gpu).
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-ffi test-graph_checkpoint test-graph_pool test-gpu_capture
mv $O/rust.log $O/rust-graph.log
python_checks
PYTHONPATH=$PWD/python timeout 300 python3 notes/experiments/torch_api_probe.py > $O/probe.log 2>&1
echo "probe rc=$? $(grep -c '"ok": true' $O/probe.log) ok" >> $O/summary.txt; grep '"ok": false' $O/probe.log >> $O/summary.txt
rust_tests test-gpu
cat $O/summary.txt
