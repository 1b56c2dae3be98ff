#!/usr/bin/env bash
# Session 17, call 3: which PyTorch APIs work under cuarena's plug-in (notes/experiments/torch_api_probe.py),
# against PyTorch's own allocator.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1
timeout 250 python3 notes/experiments/torch_api_probe.py --native > $O/probe-native.jsonl 2> $O/probe-native.err; echo "native rc=$?" >> $O/summary.txt
timeout 250 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err; echo "cuarena rc=$?" >> $O/summary.txt
python3 - "$O" >> $O/summary.txt <<'PY'
import json, sys
o = sys.argv[1]
rows = {}
for kind in ("native", "cuarena"):
    for l in open(f"{o}/probe-{kind}.jsonl"):
        try:
            r = json.loads(l)
        except ValueError:
            continue
        rows.setdefault(r["probe"], {})[kind] = r
for p, k in rows.items():
    n, c = k.get("native", {}), k.get("cuarena", {})
    print(f"{p}: native {'ok' if n.get('ok') else n.get('error')} ({n.get('secs')}s) | cuarena {'ok' if c.get('ok') else c.get('error')} ({c.get('secs')}s)")
PY
