#!/usr/bin/env bash
# Builds everything the GPU machine needs into gpu-bundle/ (ignored by git): the release test
# binaries, the main binary, libcuarena.so and run.sh. Carry `gpu-bundle` with the device tool and
# run `bash gpu-bundle/run.sh` there (it has no Rust toolchain).
# The device tool carries at most 64 MiB, and every test binary is about 2 MiB: set
# GPU_BUNDLE_TESTS to the tests to bundle (names without `test-`, space-separated, for example
# GPU_BUNDLE_TESTS="gpu ffi user_streams"); unset, every test binary is bundled.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf gpu-bundle && mkdir -p gpu-bundle
# The workspace's default members: the benchmark binary `cuarena` (cuarena-bench) and
# libcuarena.so (cuarena-c, capi/).
cargo build --release --bins --lib
cargo build --release -p cuarena-bench --example rayon_pool
# Test binaries: integration tests as test-NAME (test-cli is cuarena-bench's), each crate's unit
# tests as test-PACKAGE (test-cuarena: the allocator's; test-cuarena-bench also holds the binary's).
# Only the wanted test binaries are built when each is an integration test of the allocator
# (tests/NAME.rs): a test file being written elsewhere in the tree then does not stop the bundle.
only=()
for n in ${GPU_BUNDLE_TESTS:-}; do
  if [ -f "tests/$n.rs" ]; then only+=(--test "$n"); else only=(); break; fi
done
cargo test --release --no-run --message-format=json "${only[@]}" 2>/dev/null |
  python3 -c '
import json, os, sys, shutil
wanted = set(os.environ.get("GPU_BUNDLE_TESTS", "").split())
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        kind, name = m["target"]["kind"], m["target"]["name"]
        url, _, frag = m["package_id"].partition("#")  # path+file:///DIR#NAME@VERSION, or #VERSION
        pkg = frag.split("@")[0] if "@" in frag else url.rstrip("/").rsplit("/", 1)[-1]
        if pkg == "loom-tests":
            continue  # empty without --cfg loom
        if kind == ["test"]:
            out = name
        else:
            out = pkg if kind != ["bin"] else pkg + "-bin"
        if wanted and out not in wanted:
            continue
        shutil.copy(m["executable"], f"gpu-bundle/test-{out}")
        print("bundled test", out)
'
cp target/release/cuarena gpu-bundle/
cp target/release/libcuarena.so gpu-bundle/
cp target/release/examples/rayon_pool gpu-bundle/
[ -d python ] && cp -r python gpu-bundle/
[ -d include ] && cp -r include gpu-bundle/
[ -d examples ] && cp -r examples gpu-bundle/
cat > gpu-bundle/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs the bundled tests with the GPU required, GPU-only (ignored) tests included.
# Usage: bash gpu-bundle/run.sh [test-binary ...] [-- test-harness arguments]
#   bash gpu-bundle/run.sh                                   # every bundled test binary
#   bash gpu-bundle/run.sh test-gpu -- gpu_torture_ptds       # one test (a name filter)
#   CUARENA_REQUIRE_GPUS=2 bash gpu-bundle/run.sh test-gpu -- multi_gpu   # on a 2-GPU machine
set -uo pipefail
cd "$(dirname "$0")"
export CUARENA_REQUIRE_GPU=1
# The CLI tests of adversarial_s16 run this bundle's binary (there is no cargo to build one).
[ -x cuarena ] && export CUARENA_CLI="$PWD/cuarena"
bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do bins+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#bins[@]} -eq 0 ] && bins=(test-gpu test-ffi test-host test-torture test-cli test-cuarena test-cuarena-testkit test-cuarena-bench)
status=0
for t in "${bins[@]}"; do
  echo "== $t"
  ./$t --include-ignored --test-threads=1 "$@" 2>&1 || status=1
done
exit $status
RUN
chmod +x gpu-bundle/run.sh
for f in gpu-bundle/test-* gpu-bundle/cuarena gpu-bundle/libcuarena.so gpu-bundle/rayon_pool; do [ -f "$f" ] && strip --strip-debug "$f"; done
du -sh gpu-bundle
if [ "$(du -sm gpu-bundle | cut -f1)" -gt 60 ]; then
  echo "gpu-bundle: over 60 MiB, more than the device tool carries with the tree: set GPU_BUNDLE_TESTS" >&2
fi
