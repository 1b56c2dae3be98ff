#!/usr/bin/env bash
# Session 20, call 2: the shim without _AllocationMetadata's constructors (PyTorch does not export
# them; call 1's level-2 build failed to link). The Python package's tests with the GPU required
# (the reduce-overhead test among them), and the PyTorch API probe.
source "$(dirname "$0")/gpu-checks.sh"
python_checks
PYTHONPATH=$PWD/python timeout 300 python3 notes/experiments/torch_api_probe.py > $O/probe.log 2>&1
echo "probe rc=$? $(grep -c '"ok": true' $O/probe.log) ok" >> $O/summary.txt; grep '"ok": false' $O/probe.log >> $O/summary.txt
cat $O/summary.txt
