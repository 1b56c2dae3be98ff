#!/usr/bin/env bash
# Session 17, call 2 (two GPUs): the multi-GPU tests with both GPUs required, PyTorch on both
# devices through the plug-in (examples/torch_multi_gpu.py), the C ABI's tests, and the Python
# package's tests after the shim's cache mends and the memory fraction's pool fix.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi -L > $O/gpus.txt 2>&1
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
( cd gpu-bundle && CUARENA_REQUIRE_GPUS=2 timeout 200 bash run.sh test-gpu -- multi_gpu ) > $O/multi.log 2>&1; echo "multi rc=$?" >> $O/summary.txt
grep -E "^test |test result" $O/multi.log >> $O/summary.txt
CUARENA_REQUIRE_GPUS=2 timeout 120 python3 examples/torch_multi_gpu.py > $O/torch_multi.log 2>&1; echo "torch_multi rc=$?" >> $O/summary.txt
tail -4 $O/torch_multi.log >> $O/summary.txt
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
timeout 90 python3 examples/oom_check.py > $O/oom.log 2>&1; echo "oom rc=$?" >> $O/summary.txt; grep "OOM:" $O/oom.log >> $O/summary.txt
( cd gpu-bundle && timeout 200 bash run.sh test-ffi test-adversarial_s16 test-adversarial_s16c ) > $O/tests.log 2>&1; echo "tests rc=$?" >> $O/summary.txt
grep -E "^== |test result|FAILED|panicked" $O/tests.log >> $O/summary.txt
