#!/usr/bin/env bash
# Session 17, call 4: the PyTorch shim's own allocator (level 2: PyTorch's memory statistics and
# cuDNN's cacheInfo from cuarena's): the Python package's tests, the API probe against native,
# the framework examples, and examples/torch_train.py, ROUNDS (3) interleaved rounds.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1; echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
grep -E "FAIL|ERROR|Error|assert" $O/python.log | head -20 >> $O/summary.txt
timeout 200 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err; echo "probe rc=$?" >> $O/summary.txt
grep '"ok": false' $O/probe-cuarena.jsonl >> $O/summary.txt
tail -3 $O/probe-cuarena.err >> $O/summary.txt
( cd gpu-bundle && timeout 60 bash run.sh test-ffi ) > $O/ffi.log 2>&1; echo "ffi rc=$? $(grep "test result" $O/ffi.log)" >> $O/summary.txt
for e in oom_check.py torch_threads.py torch_graph.py torch_multi_gpu.py; do
  echo "== $e" >> $O/examples.log
  timeout 90 python3 examples/$e >> $O/examples.log 2>&1; echo "rc=$?" >> $O/examples.log
done
grep -E "^== |^rc=|OOM:|OK" $O/examples.log >> $O/summary.txt
bash notes/experiments/train-rounds.sh "$O" "${ROUNDS:-3}"
tail -3 $O/train.err >> $O/summary.txt
