#!/usr/bin/env bash
# Session 16, call 5: the Python glue's mends on the GPU: the package's tests, the CuPy
# per-thread-stream hand-off check (with its control), the OOM hook and OOM examples.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
for e in "cupy_ptds_handoff_check.py --rounds 300" oom_spill.py oom_check.py; do
  echo "== $e" >> $O/examples.log
  timeout 60 python3 examples/$e >> $O/examples.log 2>&1; echo "rc=$?" >> $O/examples.log
done
