#!/usr/bin/env bash
# Session 26, call 4: the final code (the return rule on the recent peak, halving below an
# eighth; Arena::grow's small test): the GPU tests (the fence torture in all three stream modes
# among them), the return-rule tests, the Python package, and one round of the table for churn,
# large and mixed on every stream mode, with cuMemAllocAsync.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu test-gpu_capture test-capture test-legacy_frees test-regressions test-ffi test-adversarial_streams test-return_rule test-adversarial_s26 test-host
gpu-bundle/cuarena --json --workloads churn,large,mixed --streams ptds,legacy,own --threads 1,16 \
  --allocators cuarena,cuMemAllocAsync --no-touch --secs 0.5 > $O/bench.jsonl 2>$O/bench.err
python3 - "$O/bench.jsonl" >> $O/summary.txt <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
base = {(r["workload"], r["streams"], r["threads"]): r for r in rows if r["allocator"] == "cuMemAllocAsync"}
for r in rows:
    if r["allocator"] != "cuarena":
        continue
    b = base.get((r["workload"], r["streams"], r["threads"]))
    print(r["workload"], r["streams"], r["threads"], "cuarena M/s", round(r["pairs_per_sec"] / 1e6, 2),
          "÷ cuMemAllocAsync", round(r["pairs_per_sec"] / b["pairs_per_sec"], 1) if b else "-",
          "calls/Mop", round(r["driver_calls_per_mop"]), "res/peak", r["memory_ratio"],
          "cuMemAllocAsync res/peak", b["memory_ratio"] if b else "-")
PY
python_checks
cat $O/summary.txt
