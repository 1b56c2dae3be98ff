#!/usr/bin/env bash
# One device-tool call's worth of verification and measurement, on the GPU machine, after
# tools/gpu-bundle.sh (with GPU_BUNDLE_TESTS naming the tests to run) and, for the old-against-
# new rounds, other builds of the benchmark copied to gpu-bundle/cuarena-NAME (cuarena-old, say;
# every such binary takes part, in the order `ls` gives). Writes to OUTDIR:
#   tests.log      every bundled test binary, the GPU required (gpu-bundle/run.sh)
#   python.log     the Python package's tests against gpu-bundle/libcuarena.so
#   ovn.jsonl      interleaved rounds of the new build and every gpu-bundle/cuarena-NAME,
#                  cuarena only, at 1 and 16 threads (rows tagged "round", "allocator" naming the
#                  binary): AB_ROUNDS rounds (2) of AB_WORKLOADS (every workload below) on
#                  AB_STREAMS (ptds,legacy,own)
#   conf.jsonl     with CONF_AB set (a CUARENA_CONF string): interleaved rounds of the new build
#                  with the defaults and with CONF_AB, cuarena only (rows tagged "round" and
#                  "conf"): AB_ROUNDS rounds of CONF_WORKLOADS (handoff,handoff_msg), every mode
#   table.jsonl    one run of cuarena, cuMemAllocAsync and `harness` (no allocator: the harness's
#                  own ceiling) side by side, every workload and mode
#   train.jsonl    examples/torch_train.py, native and cuarena interleaved, TRAIN_RUNS each (3)
# It replaces tools/gpu-bench.sh, which the measurements of 2026-11-30 and 2026-12-01 in
# BENCHMARKS.md ran (in git history at the commits named there): the same table, old-against-new
# rounds and PyTorch runs, now after the tests, with the rounds' workloads chosen.
# TESTS=0 skips the tests and the Python package, TABLE=0 the table (to fit one call's ten
# minutes when the rounds are many).
# Usage: [AB_ROUNDS=N AB_WORKLOADS=W,.. AB_STREAMS=S,.. CONF_AB=K=V,.. CONF_WORKLOADS=W,..
#         TRAIN_RUNS=N TESTS=0|1 TABLE=0|1] bash tools/gpu-measure.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu-measure.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" != 0 ]; then
  tests=$(cd gpu-bundle && ls test-* | tr '\n' ' ')
  bash gpu-bundle/run.sh $tests > "$out/tests.log" 2>&1
  echo "tests exit $?"
  grep -E '^== |test result|FAILED|panicked' "$out/tests.log"
  bash tools/python-check.sh gpu-bundle/libcuarena.so > "$out/python.log" 2>&1
  echo "python exit $?: $(tail -1 "$out/python.log")"
fi
all=churn,large,mixed,handoff,handoff_msg
bench="--json --secs 0.5 --threads 1,16 --workloads $all --streams ptds,legacy,own --no-touch"
ab="--json --secs 0.5 --threads 1,16 --workloads ${AB_WORKLOADS:-$all} --streams ${AB_STREAMS:-ptds,legacy,own} --no-touch"
others=$(cd gpu-bundle && ls cuarena-* 2>/dev/null | tr '\n' ' ')
if [ -n "$others" ]; then
  for i in $(seq "${AB_ROUNDS:-2}"); do
    for b in cuarena $others; do
      ./gpu-bundle/$b $ab --allocators cuarena 2>/dev/null |
        sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"$b\",\"round\":$i/" >> "$out/ovn.jsonl"
    done
  done
  echo "old-vs-new: $(wc -l < "$out/ovn.jsonl") rows"
fi
if [ -n "${CONF_AB:-}" ]; then
  cb="--json --secs 0.5 --threads 1,16 --workloads ${CONF_WORKLOADS:-handoff,handoff_msg} --streams ptds,legacy,own --no-touch"
  for i in $(seq "${AB_ROUNDS:-2}"); do
    for c in default "$CONF_AB"; do
      if [ "$c" = default ]; then env -u CUARENA_CONF ./gpu-bundle/cuarena $cb --allocators cuarena; else
        CUARENA_CONF="$c" ./gpu-bundle/cuarena $cb --allocators cuarena; fi 2>/dev/null |
        sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"cuarena\",\"round\":$i,\"conf\":\"$c\"/" >> "$out/conf.jsonl"
    done
  done
  echo "conf: $(wc -l < "$out/conf.jsonl") rows"
fi
if [ "${TABLE:-1}" != 0 ]; then
  ./gpu-bundle/cuarena $bench --allocators cuarena,cuMemAllocAsync,harness > "$out/table.jsonl" 2>/dev/null
  echo "table: $(wc -l < "$out/table.jsonl") rows"
fi
export CUARENA_LIB="$PWD/gpu-bundle/libcuarena.so"
if [ "${TRAIN_RUNS:-3}" != 0 ]; then
  for i in $(seq "${TRAIN_RUNS:-3}"); do
    for a in native cuarena; do
      python3 examples/torch_train.py --allocator $a 2>>"$out/train.err" | tail -1 >> "$out/train.jsonl"
    done
  done
  echo "train: $(wc -l < "$out/train.jsonl") rows"
fi
