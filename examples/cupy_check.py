"""CuPy array operations with cuarena as the allocator give the same results as with CuPy's own
pool. Run twice (--allocator cupy | cuarena) or once with --both (two subprocesses)."""
import argparse, hashlib, json, os, subprocess, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
p = argparse.ArgumentParser()
p.add_argument("--allocator", choices=["cupy", "cuarena"])
p.add_argument("--both", action="store_true")
args = p.parse_args()
if args.both:
    outs = [json.loads(subprocess.check_output([sys.executable, __file__, "--allocator", a]).decode().strip().splitlines()[-1])
            for a in ("cupy", "cuarena")]
    print(outs)
    assert outs[0]["digest"] == outs[1]["digest"], "results differ"
    print("OK")
    sys.exit(0)

import cupy as cp
if args.allocator == "cuarena":
    import cuarena.cupy
    cuarena.cupy.use()
rs = cp.random.RandomState(seed=42)
acc = []
for i in range(200):
    n = 1000 + 37 * i
    a = rs.standard_normal((n,), dtype=cp.float64)
    b = rs.standard_normal((n,), dtype=cp.float64)
    c = cp.sort(a * b + cp.sin(a)) + cp.cumsum(b)
    m = rs.standard_normal((64 + i % 64, 64), dtype=cp.float64)
    acc.append(float(c.sum()) + float((m @ m.T).trace()))
    del a, b, c, m
digest = hashlib.sha256(json.dumps(acc).encode()).hexdigest()
extra = {}
if args.allocator == "cuarena":
    import cuarena
    extra = {"allocations": cuarena.stats()["allocations"]}
print(json.dumps({"allocator": args.allocator, "digest": digest, **extra}))
