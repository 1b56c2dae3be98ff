#!/usr/bin/env bash
# Session 17, call 5: the shim's own allocator (level 2) after linking PyTorch's libcudart: the
# Python package's tests and the API probe.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
grep -E "FAIL|ERROR|Error:|error:|assert" $O/python.log | cut -c1-600 | head -20 >> $O/summary.txt
timeout 150 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err; echo "probe rc=$?" >> $O/summary.txt
grep '"ok": false' $O/probe-cuarena.jsonl | cut -c1-300 >> $O/summary.txt
grep -c '"ok": true' $O/probe-cuarena.jsonl >> $O/summary.txt
timeout 60 python3 examples/oom_check.py > $O/oom.log 2>&1; echo "oom rc=$?" >> $O/summary.txt; grep "torch OOM" $O/oom.log | cut -c1-200 >> $O/summary.txt
