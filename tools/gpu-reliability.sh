#!/usr/bin/env bash
# Runs on the GPU machine after tools/gpu-bundle.sh: the reliability suite's GPU parts. Writes
# logs to OUTDIR (default /tmp/cuarena-rel) and prints a summary. Usage: bash tools/gpu-reliability.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/cuarena-rel}"; mkdir -p "$out"
export CUARENA_LIB="$PWD/gpu-bundle/libcuarena.so" PYTHONUNBUFFERED=1 CUARENA_REQUIRE_GPU=1
status=0
run() { local name=$1; shift; echo "== $name"; if "$@" >"$out/$name.log" 2>&1; then echo "ok: $name"; else echo "FAILED: $name"; status=1; fi; tail -4 "$out/$name.log"; }
for t in gpu ffi torture; do
  [ -x gpu-bundle/test-$t ] && run "test-$t" gpu-bundle/test-$t --include-ignored --test-threads=1 --nocapture
done
grep -hE "^(gpu torture|torture|gpu stress|unfenced|thread churn)" "$out"/test-*.log | cut -c1-400 || true
run cupy-stream python3 examples/cupy_stream_check.py
run oom python3 examples/oom_check.py
san="compute-sanitizer --tool memcheck --error-exitcode 9"
CUARENA_CONF=passthrough $san python3 examples/passthrough_oob.py >"$out/oob-passthrough.log" 2>&1; pr=$?
$san python3 examples/passthrough_oob.py >"$out/oob-pooled.log" 2>&1; nr=$?
echo "== passthrough OOB: passthrough exit $pr ($(grep -c 'Invalid __global__ write' "$out/oob-passthrough.log") invalid writes reported), pooled exit $nr ($(grep -c 'Invalid __global__ write' "$out/oob-pooled.log") reported)"
[ "$pr" = 9 ] || status=1
exit $status
