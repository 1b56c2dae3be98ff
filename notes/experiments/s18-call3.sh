#!/usr/bin/env bash
# Session 18, call 3: after helper-16's review and the cap in the statistics: the Python
# package's tests with the GPU required (get_per_process_memory_fraction, cacheInfo under the
# cap, record_stream past the caps), test-ffi and test-passthrough with their GPU tests.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cuarena-cache
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
grep -E "FAIL|ERROR|Error:|error:|assert" $O/python.log | cut -c1-600 | head -20 >> $O/summary.txt
bash gpu-bundle/run.sh test-ffi test-passthrough > $O/rust.log 2>&1; echo "rust rc=$?" >> $O/summary.txt; grep -E "test result|FAILED|panicked" $O/rust.log | head >> $O/summary.txt
PYTHONPATH=$PWD/python timeout 150 python3 notes/experiments/torch_api_probe.py > $O/probe.jsonl 2> $O/probe.err; echo "probe rc=$? ok $(grep -c '"ok": true' $O/probe.jsonl) of $(grep -c probe $O/probe.jsonl)" >> $O/summary.txt
PYTHONPATH=$PWD/python timeout 60 python3 -c '
import torch, cuarena, cuarena.torch
cuarena.torch.use(); x = torch.ones(10, device="cuda")
print("fraction", torch.cuda.get_per_process_memory_fraction())
torch.cuda.set_per_process_memory_fraction(0.5); print("fraction", torch.cuda.get_per_process_memory_fraction())
s = cuarena.stats(); print("limit", s["limit_bytes"], "total", s["device_total_bytes"])
' >> $O/summary.txt 2>&1
