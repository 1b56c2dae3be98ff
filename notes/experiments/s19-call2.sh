#!/usr/bin/env bash
# Session 19, call 2: CUDA graph pools on the H200. The PyTorch API probe (graphs, MemPool,
# graphed callables, torch.compile's reduce-overhead), the Python package's tests with the GPU
# required (test_torch_cuda_graphs_capture_into_cuarenas_graph_pools among them), and the bundled
# GPU tests: gpu_capture (a capture into a graph pool through the Rust API), ffi (through the C
# ABI), gpu (the fence torture in all three stream modes).
source "$(dirname "$0")/gpu-checks.sh"
PYTHONPATH=$PWD/python timeout 200 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err
echo "probe rc=$?" >> $O/summary.txt
grep '"ok": false' $O/probe-cuarena.jsonl | cut -c1-400 >> $O/summary.txt
echo "probe ok: $(grep -c '"ok": true' $O/probe-cuarena.jsonl) of $(wc -l < $O/probe-cuarena.jsonl)" >> $O/summary.txt
tail -5 $O/probe-cuarena.err >> $O/summary.txt
python_checks
rust_tests test-gpu_capture test-ffi test-gpu
