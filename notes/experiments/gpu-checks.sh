# Sourced by the eighteenth session's GPU call scripts (notes/experiments/s18-call*.sh), run from
# their own directory on the GPU machine: goes to the repository root, sets O (the device tool's
# $OUT, else /tmp/out) and the environment for the bundle in gpu-bundle/, and defines the two
# checks every call made. Each appends its result to $O/summary.txt.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cuarena-cache

# The Python package's tests with the GPU required (log: $O/python.log).
python_checks() {
    ( CUARENA_REQUIRE_GPU=1 bash tools/python-check.sh gpu-bundle/libcuarena.so ) > $O/python.log 2>&1
    echo "python rc=$? $(tail -1 $O/python.log)" >> $O/summary.txt
    grep -E "FAIL|ERROR|Error:|error:|assert" $O/python.log | cut -c1-600 | head -20 >> $O/summary.txt
}

# The bundled test binaries named, GPU-only tests included (log: $O/rust.log).
rust_tests() {
    bash gpu-bundle/run.sh "$@" > $O/rust.log 2>&1
    echo "rust rc=$?" >> $O/summary.txt
    grep -E "test result|FAILED|panicked" $O/rust.log | head >> $O/summary.txt
}
