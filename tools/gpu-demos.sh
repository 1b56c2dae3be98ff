#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after tools/gpu-bundle.sh built gpu-bundle/:
#   bash tools/gpu-demos.sh [OUTDIR]
# The bundle must hold the test binaries it runs (the device tool carries at most 64 MiB, so bundle
# just these): GPU_BUNDLE_TESTS="gpu ffi host gpu_capture capture stats oom_hook" bash tools/gpu-bundle.sh
# The GPU tests (required), the C ABI tests with the GPU-only ones, the pip-installed Python
# package, PyTorch training (native vs cuarena), PyTorch threaded inference, CuPy, CuPy on a
# non-blocking stream, CuPy frees during a capture, out of memory under PyTorch and CuPy, and the C programs. Prints a summary; writes logs to OUTDIR (default /tmp/cuarena-demos).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/cuarena-demos}"
mkdir -p "$out"
export CUARENA_LIB="$PWD/gpu-bundle/libcuarena.so" PYTHONUNBUFFERED=1
status=0
step() { echo "== $1"; }
fail() { echo "FAILED: $1"; status=1; }

step "GPU tests (CUARENA_REQUIRE_GPU=1)"
bash gpu-bundle/run.sh test-gpu test-ffi test-host >"$out/tests.log" 2>&1 || fail tests
grep -E "^== |test result" "$out/tests.log"

step "C ABI tests, GPU-only ones included (bad-input table, record_stream, stats add up)"
(cd gpu-bundle && CUARENA_REQUIRE_GPU=1 ./test-ffi --include-ignored --test-threads=1) >"$out/ffi.log" 2>&1 || fail ffi-tests
grep -E "test result" "$out/ffi.log"

step "C: include/cuarena.h from 8 threads on several streams"
cuda_inc=$(dirname "$(command -v nvcc)")/../include
if cc -O2 -I include -I "$cuda_inc" examples/c/threads.c -L gpu-bundle -lcuarena -lcuda -lpthread -o "$out/threads" 2>"$out/c-build.log"; then
  LD_LIBRARY_PATH=gpu-bundle "$out/threads" >"$out/c.log" 2>&1 || fail c
  tail -3 "$out/c.log"
else
  fail c-build; tail -5 "$out/c-build.log"
fi

step "C: threads that outlive main (5 runs, each must exit 0)"
if cc -O2 -I include -I "$cuda_inc" examples/c/exit_race.c -L gpu-bundle -lcuarena -lcuda -lpthread -o "$out/exit_race" 2>>"$out/c-build.log"; then
  for i in 1 2 3 4 5; do LD_LIBRARY_PATH=gpu-bundle timeout 30 "$out/exit_race" >>"$out/exit.log" 2>&1 || fail "exit-race run $i"; done
  echo "exit race: $(grep -c 'main returns' "$out/exit.log") clean runs"
else
  fail exit-race-build
fi

step "Python package: pip-installed, tested from outside the repository (the 3-line PyTorch and CuPy switch)"
CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so >"$out/python.log" 2>&1 || fail python-package
grep -E "^(Ran|OK|FAILED)|\.\.\. (FAIL|ERROR|skipped)" "$out/python.log"

step "PyTorch training: native vs cuarena"
python3 examples/torch_train.py --allocator native >"$out/train-native.json" 2>"$out/train-native.err" || fail train-native
python3 examples/torch_train.py --allocator cuarena >"$out/train-cuarena.json" 2>"$out/train-cuarena.err" || fail train-cuarena
python3 - "$out" <<'PY' || status=1
import json, sys
d = sys.argv[1]
n = json.loads(open(f"{d}/train-native.json").read().strip().splitlines()[-1])
c = json.loads(open(f"{d}/train-cuarena.json").read().strip().splitlines()[-1])
same = n["losses"] == c["losses"]
maxdiff = max(abs(a - b) for a, b in zip(n["losses"], c["losses"]))
print(f"steps {len(n['losses'])}; losses identical: {same} (max |diff| {maxdiff:.3g}); final loss {n['losses'][-1]:.6f} vs {c['losses'][-1]:.6f}")
for r in (n, c):
    print(f"  {r['allocator']:8s} step {r['step_ms']:.2f} ms, peak live {r['peak_live_bytes']/2**20:.1f} MiB, peak reserved {r['peak_reserved_bytes']/2**20:.1f} MiB")
sys.exit(0 if same else 1)
PY

step "PyTorch threaded inference with record_stream"
python3 examples/torch_threads.py >"$out/threads.log" 2>&1 || fail torch-threads
tail -2 "$out/threads.log"

step "CuPy: cuarena vs CuPy's pool"
python3 examples/cupy_check.py --both >"$out/cupy.log" 2>&1 || fail cupy
tail -2 "$out/cupy.log"
step "CuPy on a non-blocking stream: no early reuse (cuarena must show 0 corrupted words)"
python3 examples/cupy_stream_check.py >"$out/cupy-stream.log" 2>&1 || fail cupy-stream
grep -E "^cupy stream check:|^note:|FAILED" "$out/cupy-stream.log" || tail -5 "$out/cupy-stream.log"

step "CuPy: arrays freed during a stream capture are held by the glue and freed after it"
python3 examples/cupy_capture_free.py >"$out/cupy-capture.log" 2>&1 || fail cupy-capture
tail -1 "$out/cupy-capture.log"

step "Out of memory under a 256 MiB cap: PyTorch and CuPy raise, no null tensor, then recover"
python3 examples/oom_check.py >"$out/oom.log" 2>&1 || fail oom
grep -E "^(torch|cupy) OOM:|FAILED" "$out/oom.log" || tail -5 "$out/oom.log"

step "Issue 11: graph capture (driver API, global and thread-local), stats, OOM hook tests"
bash gpu-bundle/run.sh test-gpu_capture test-capture test-stats test-oom_hook >"$out/issue11.log" 2>&1 || fail issue11-tests
grep -E "^== |test result" "$out/issue11.log"
step "PyTorch: a spilling layer on the OOM hook (examples/oom_spill.py)"
python3 examples/oom_spill.py >"$out/oom-spill.log" 2>&1 || fail oom-spill
tail -8 "$out/oom-spill.log"
step "PyTorch: torch.cuda.graph capture through the plug-in (examples/torch_graph.py)"
python3 examples/torch_graph.py >"$out/torch-graph.log" 2>&1 || fail torch-graph
tail -10 "$out/torch-graph.log"
exit $status
