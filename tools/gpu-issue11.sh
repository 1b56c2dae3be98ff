#!/usr/bin/env bash
# Runs on the GPU machine after tools/gpu-bundle.sh: issue 11's measurements. Writes to OUTDIR.
# - a trace recorded through the PyTorch plug-in in a threaded-inference run, then replayed;
# - a memory snapshot of a PyTorch training run (native allocator), converted and replayed;
# - trace overhead (cuarena against cuarena+trace, same run) and stats=exact against the default.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/cuarena-issue11}"; mkdir -p "$out"
export CUARENA_LIB="$PWD/gpu-bundle/libcuarena.so" PYTHONUNBUFFERED=1
b=./gpu-bundle/cuarena
CUARENA_CONF=trace=$out/threads.bin python3 examples/torch_threads.py > "$out/threads.log" 2>&1
echo "threads trace: exit $?, $(stat -c %s "$out/threads.bin" 2>/dev/null) bytes"
$b trace-csv "$out/threads.bin" "$out/threads.csv" && echo "csv: $(wc -l < "$out/threads.csv") lines"
$b replay "$out/threads.bin" --format cuarena --allocators cuarena,cuMemAllocAsync --json > "$out/replay-threads.jsonl" 2> "$out/replay-threads.err"
echo "replay threads: exit $?"
python3 examples/torch_snapshot_train.py "$out/train.pickle" --steps 200 > "$out/snapshot.log" 2>&1
echo "snapshot: exit $?"
python3 tools/torch_snapshot_to_csv.py "$out/train.pickle" "$out/train.csv" > "$out/snapshot-csv.log" 2>&1
echo "snapshot csv: exit $?, $(wc -l < "$out/train.csv") lines"
$b replay "$out/train.csv" --format rmm-csv --allocators cuarena,cuMemAllocAsync --json > "$out/replay-train.jsonl" 2> "$out/replay-train.err"
echo "replay train: exit $?"
$b --json --secs 0.5 --allocators cuarena,cuarena+trace --workloads churn,handoff --streams ptds,legacy,own \
  --threads 1,16 --no-touch > "$out/trace-overhead.jsonl" 2> "$out/trace-overhead.err"
echo "trace overhead: exit $?"
for i in 1 2; do
  for conf in "" "stats=exact"; do
    CUARENA_CONF=$conf $b --json --secs 0.5 --threads 1,16 --workloads churn --streams ptds --allocators cuarena --no-touch 2>/dev/null |
      sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"cuarena${conf:+ ($conf)}\",\"round\":$i/" >> "$out/stats-exact.jsonl"
  done
done
echo "stats exact: $(wc -l < "$out/stats-exact.jsonl") rows"
# One archive of the small results (the device tool returns few files).
tar czf "$out.tgz" -C "$out" --exclude='*.pickle' --exclude='*.csv' --exclude='*.bin' . && rm -rf "$out"
