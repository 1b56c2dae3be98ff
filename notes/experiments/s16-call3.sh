#!/usr/bin/env bash
# Session 16, calls 3 and 4 (call 4, at the record_stream mends, with ROUNDS=3): the C ABI's tests and the Python package with the GPU required, after this
# session's fixes and the glue's new defaults (legacy_batch_bytes=16MiB,large_max=off); then
# examples/torch_train.py, native against the glue's defaults, ROUNDS (5) interleaved rounds; the other
# framework examples.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}; mkdir -p $O
( cd gpu-bundle && bash run.sh $(ls test-*) ) > $O/tests.log 2>&1; echo "tests rc=$?" >> $O/summary.txt
grep -E "^== |test result|FAILED|panicked" $O/tests.log >> $O/summary.txt
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
bash notes/experiments/train-rounds.sh "$O" "${ROUNDS:-5}"
for e in torch_threads.py torch_graph.py "cupy_check.py --both" "cupy_stream_check.py --allocator cuarena" oom_check.py; do
  echo "== $e" >> $O/examples.log
  timeout 120 python3 examples/$e >> $O/examples.log 2>&1; echo "rc=$?" >> $O/examples.log
done
