#!/usr/bin/env bash
# Session 17, call 1: every bundled GPU test with the GPU required (the sixteenth session's
# changes had not run there: held frees under real capture, the with_cuda_slice abort, the CLI
# with --host), the Python package's tests (the PyTorch shim built against PyTorch's headers:
# torch.OutOfMemoryError, memory fraction 0) and the framework examples.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
for e in oom_check.py "cupy_ptds_handoff_check.py --rounds 300" torch_graph.py torch_threads.py "cupy_check.py --both"; do
  echo "== $e" >> $O/examples.log
  timeout 90 python3 examples/$e >> $O/examples.log 2>&1; echo "rc=$?" >> $O/examples.log
done
grep -E "^== |^rc=|OOM:" $O/examples.log >> $O/summary.txt
( cd gpu-bundle && timeout 400 bash run.sh $(ls test-*) ) > $O/tests.log 2>&1; echo "tests rc=$?" >> $O/summary.txt
grep -E "^== |test result|FAILED|panicked" $O/tests.log >> $O/summary.txt
