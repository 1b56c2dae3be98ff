#!/usr/bin/env bash
# Session 20, call 5 (call 4 again, after the compiled run moved into examples/torch_train.py): training through torch.compile(mode="reduce-overhead") with PyTorch's own
# allocator and with cuarena's shim, 3 interleaved rounds of
#   python3 examples/torch_train.py --compile reduce-overhead --steps 200 --allocator native
#   python3 examples/torch_train.py --compile reduce-overhead --steps 200 --allocator cuarena
source "$(dirname "$0")/gpu-checks.sh"
for r in 1 2 3; do
  for a in native cuarena; do
    PYTHONPATH=$PWD/python timeout 240 python3 examples/torch_train.py --compile reduce-overhead --steps 200 --allocator $a > $O/ro-$a-$r.json 2> $O/ro-$a-$r.err
    echo "round $r $a rc=$?" >> $O/summary.txt
  done
done
python3 - "$O" >> $O/summary.txt <<'PY'
import json, sys, glob, statistics
o = sys.argv[1]
rows = {}
for a in ("native", "cuarena"):
    rows[a] = [json.loads(open(f"{o}/ro-{a}-{r}.json").read().strip().splitlines()[-1]) for r in (1, 2, 3)]
for a, rs in rows.items():
    print(a, "step_ms", [round(r["step_ms"], 3) for r in rs], "reserved MiB", [r["peak_reserved_bytes"] >> 20 for r in rs])
print("ratios", [round(c["step_ms"] / n["step_ms"], 3) for n, c in zip(rows["native"], rows["cuarena"])])
print("losses identical", all(n["losses"] == c["losses"] for n, c in zip(rows["native"], rows["cuarena"])),
      "max loss diff", max(abs(a - b) for n, c in zip(rows["native"], rows["cuarena"]) for a, b in zip(n["losses"], c["losses"])))
PY
cat $O/summary.txt
