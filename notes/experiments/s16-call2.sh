#!/usr/bin/env bash
# Session 16, call 2 (run as gpu-bundle/s16-call2.sh): examples/torch_train.py step time, native
# against the glue's default and against CUARENA_CONF=large_max=1MiB, 5 interleaved rounds; then
# the other framework examples with large_max=1MiB.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
for i in 1 2 3 4 5; do
  for v in native default lm1; do
    case $v in native) a=native c="";; default) a=cuarena c="";; lm1) a=cuarena c="large_max=1MiB";; esac
    r=$(CUARENA_CONF="$c" timeout 120 python3 examples/torch_train.py --allocator $a 2>>$O/train.err | tail -1)
    echo "{\"round\": $i, \"variant\": \"$v\", \"run\": $r}" >> $O/train.jsonl
  done
done
for e in torch_threads.py torch_graph.py "cupy_check.py --both" "cupy_stream_check.py --allocator cuarena"; do
  echo "== $e (large_max=1MiB)" >> $O/examples.log
  CUARENA_CONF=large_max=1MiB timeout 120 python3 examples/$e >> $O/examples.log 2>&1; echo "rc=$?" >> $O/examples.log
done
