#!/usr/bin/env bash
# Session 18, call 2: record_stream refusals raise through PyTorch (the Python package's tests
# with the GPU required, test-ffi's GPU tests), and 3 interleaved torch_train rounds with the
# shim's own allocator (level 2).
source "$(dirname "$0")/gpu-checks.sh"
python_checks
rust_tests test-ffi
T=/tmp/train; mkdir -p $T
bash notes/experiments/train-rounds.sh $T 3; cp $T/train.jsonl $O/train.jsonl; tail -c 3000 $T/train.err > $O/train-err-tail.txt
python3 - $O/train.jsonl >> $O/summary.txt <<'PY'
import json, sys, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1])]
for a in ("native", "cuarena"):
    ms = [r["run"]["step_ms"] for r in rows if r["run"].get("allocator") == a]
    res = [r["run"]["peak_reserved_bytes"] >> 20 for r in rows if r["run"].get("allocator") == a]
    print(a, "step ms", [round(m, 2) for m in ms], "median", round(st.median(ms), 2), "peak reserved MiB", res)
losses = {r["run"]["allocator"]: r["run"]["losses"] for r in rows}
print("losses identical", len({json.dumps(r["run"]["losses"]) for r in rows}) == 1)
print({k: v for k, v in rows[-1]["run"].items() if k != "losses"})
PY
grep -rn "getMemoryFraction\|virtual.*MemoryFraction" /opt/torch/.venv/lib/python3.12/site-packages/torch/include/c10/cuda/CUDACachingAllocator.h /opt/torch/.venv/lib/python3.12/site-packages/torch/include/torch/csrc/cuda/CUDAPluggableAllocator.h 2>/dev/null | head -5 >> $O/summary.txt
