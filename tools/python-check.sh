#!/usr/bin/env bash
# Installs the Python package (python/) with pip into a temporary directory, shipping a built
# libcuarena.so inside it, and runs its tests (python/tests) from a directory outside the
# repository with CUARENA_LIB unset, so the shipped library must be found on its own.
# Usage: bash tools/python-check.sh [path/to/libcuarena.so]   (default: target/release/libcuarena.so)
# Needs python3 with pip; no network, setuptools or Rust toolchain. On a GPU machine the GPU,
# PyTorch and CuPy parts run too (CUARENA_REQUIRE_GPU=1 makes the GPU required).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
lib=${1:-$repo/target/release/libcuarena.so}
[ -f "$lib" ] || { echo "python-check: no $lib (cargo build --release, or pass a libcuarena.so)" >&2; exit 1; }
lib=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
CUARENA_LIB="$lib" python3 -m pip install --quiet --no-build-isolation --no-deps --target "$tmp/site" "$repo/python"
cd "$tmp"
env -u CUARENA_LIB PYTHONPATH="$tmp/site" XDG_CACHE_HOME="$tmp/cache" CUARENA_EXPECT_SHIPPED=1 \
  CUARENA_TEST_REPO="$repo" python3 -m unittest discover -v -s "$repo/python/tests" -t "$repo/python/tests"
