#!/usr/bin/env bash
# Session 16, call 1 (run as gpu-bundle/s16-call1.sh after tools/gpu-bundle.sh): every bundled GPU
# test, the Python package, and torch_train's memory under several CUARENA_CONF settings, with
# two traces recorded for host replay.
set -u
cd "$(dirname "$0")"
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/gpu.txt 2>&1
( time bash run.sh $(ls test-*) ) > $O/tests.log 2>&1; echo "tests rc=$?" >> $O/summary.txt
grep -E "test result|FAILED|panicked" $O/tests.log | sort | uniq -c >> $O/summary.txt
( CUARENA_REQUIRE_GPU=1 bash ../tools/python-check.sh libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$?" >> $O/summary.txt
cp ../notes/experiments/torch_train_memory.py .
export CUARENA_LIB=$PWD/libcuarena.so
python3 torch_train_memory.py native >> $O/mem.jsonl 2>>$O/mem.err
for c in "" "large_max=1MiB" "large_max=1MiB,chunk=8MiB" "large_max=1MiB,batch_bytes=4MiB" "large_max=4MiB" "large_max=1MiB,keep_empty=0" "large_max=1MiB,legacy_batch_bytes=8MiB"; do
  CUARENA_CONF="$c" timeout 120 python3 torch_train_memory.py cuarena >> $O/mem.jsonl 2>>$O/mem.err
done
CUARENA_CONF="trace=$O/torch-default.trace" timeout 120 python3 torch_train_memory.py cuarena >> $O/mem.jsonl 2>>$O/mem.err
CUARENA_CONF="large_max=1MiB,trace=$O/torch-lm1.trace" timeout 120 python3 torch_train_memory.py cuarena >> $O/mem.jsonl 2>>$O/mem.err
ls -la $O >> $O/summary.txt
