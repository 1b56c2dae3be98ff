#!/usr/bin/env bash
# Session 25, call 3 (a3fbd4e): the GPU tests after the legacy pool path's tickets (pool memory
# freed on the legacy stream and reused there goes behind a legacy action issued after the
# free's ticket, not an event recorded at every reuse), and the legacy pool path side by side
# with 8396152 (gpu-bundle/cuarena-old): CUARENA_CONF=large_max=off sends every request over
# 1 MiB to the pool, as the framework glue does. Three interleaved rounds.
source "$(dirname "$0")/gpu-checks.sh"
rust_tests test-gpu_capture test-gpu test-capture test-legacy_frees test-adversarial_streams test-regressions test-ffi
for i in 1 2 3; do
  for b in cuarena cuarena-old; do
    CUARENA_CONF=large_max=off gpu-bundle/$b --json --workloads large,mixed --streams legacy --threads 1,16 \
      --allocators cuarena --no-touch --secs 0.5 2>>$O/bench.err | sed "s/^/{\"round\": $i, \"build\": \"$b\", \"row\": /; s/\$/}/" >> $O/bench.jsonl
  done
done
python3 - "$O/bench.jsonl" >> $O/summary.txt <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    x = r["row"]
    by.setdefault((x["workload"], x["threads"], r["build"]), []).append(x)
for (w, t, b), xs in sorted(by.items()):
    print(w, t, b, "M pairs/s", [round(x["pairs_per_sec"] / 1e6, 3) for x in xs],
          "calls/Mop", [round(x["driver_calls_per_mop"]) for x in xs],
          "events/Mop", [round(1e6 * x["fences_recorded"] / (2 * x["pairs"])) for x in xs],
          "reserved/peak", [x["memory_ratio"] for x in xs])
PY
python_checks
cat $O/summary.txt
