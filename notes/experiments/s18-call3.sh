#!/usr/bin/env bash
# Session 18, call 3: after helper-16's review and the cap in the statistics: the Python
# package's tests with the GPU required (get_per_process_memory_fraction, cacheInfo under the
# cap, record_stream past the caps), test-ffi and test-passthrough with their GPU tests.
source "$(dirname "$0")/gpu-checks.sh"
python_checks
rust_tests test-ffi test-passthrough
PYTHONPATH=$PWD/python timeout 150 python3 notes/experiments/torch_api_probe.py > $O/probe.jsonl 2> $O/probe.err; echo "probe rc=$? ok $(grep -c '"ok": true' $O/probe.jsonl) of $(grep -c probe $O/probe.jsonl)" >> $O/summary.txt
PYTHONPATH=$PWD/python timeout 60 python3 -c '
import torch, cuarena, cuarena.torch
cuarena.torch.use(); x = torch.ones(10, device="cuda")
print("fraction", torch.cuda.get_per_process_memory_fraction())
torch.cuda.set_per_process_memory_fraction(0.5); print("fraction", torch.cuda.get_per_process_memory_fraction())
s = cuarena.stats(); print("limit", s["limit_bytes"], "total", s["device_total_bytes"])
' >> $O/summary.txt 2>&1
