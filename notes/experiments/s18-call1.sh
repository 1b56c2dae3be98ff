#!/usr/bin/env bash
# Session 18, call 1: the shim's own PyTorch allocator (level 2) on the H200. Its level and
# warnings first, then the Python package's tests with the GPU required, the API probe, the OOM
# check, 3 interleaved torch_train rounds, and the bundled GPU and FFI tests.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1 XDG_CACHE_HOME=$O/cache
PYTHONPATH=$PWD/python timeout 240 python3 -W always -c '
import torch, cuarena.torch as ct
inst = ct.use(); print("install", inst)
x = torch.empty(1 << 20, device="cuda"); y = torch.empty(300, device="cuda")
print("allocated", torch.cuda.memory_allocated(), "max", torch.cuda.max_memory_allocated())
torch.cuda.reset_peak_memory_stats(); print(torch.cuda.memory_summary()[:400])
' > $O/level.log 2>&1; echo "level rc=$?" >> $O/summary.txt; grep -E "install|allocated|Warning" $O/level.log | cut -c1-500 >> $O/summary.txt
find $O/cache -name "*.log" -o -name "*.failed" 2>/dev/null | head >> $O/summary.txt
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
grep -E "FAIL|ERROR|Error:|error:|assert" $O/python.log | cut -c1-600 | head -20 >> $O/summary.txt
PYTHONPATH=$PWD/python timeout 150 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err; echo "probe rc=$?" >> $O/summary.txt
grep '"ok": false' $O/probe-cuarena.jsonl | cut -c1-300 >> $O/summary.txt
echo "probe ok: $(grep -c '"ok": true' $O/probe-cuarena.jsonl)" >> $O/summary.txt
PYTHONPATH=$PWD/python timeout 60 python3 examples/oom_check.py > $O/oom.log 2>&1; echo "oom rc=$?" >> $O/summary.txt; grep "torch OOM" $O/oom.log | cut -c1-200 >> $O/summary.txt
PYTHONPATH=$PWD/python bash notes/experiments/train-rounds.sh $O 3; echo "train done" >> $O/summary.txt
bash gpu-bundle/run.sh test-gpu test-ffi > $O/rust.log 2>&1; echo "rust rc=$?" >> $O/summary.txt; grep -E "test result|FAILED|panicked" $O/rust.log | head >> $O/summary.txt
