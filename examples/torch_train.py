"""Trains a small transformer encoder on random data with fixed seeds and prints one JSON line:
losses, mean step time and peak memory. Run it once with --allocator native and once with
--allocator cuarena (separate processes: the allocator is chosen before the first CUDA
allocation) and compare the losses. With --compile reduce-overhead the loss is computed by
torch.compile(mode="reduce-overhead") (CUDA graph trees: the forward and backward are recorded
into a graph pool and replayed), on inputs of one shape."""
import argparse, json, os, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
p = argparse.ArgumentParser()
p.add_argument("--allocator", choices=["native", "cuarena"], required=True)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--compile", choices=["none", "reduce-overhead"], default="none")
p.add_argument("--counters", action="store_true",
               help="with --allocator cuarena: also print every cuarena counter that changed "
                    "after step 10, per step (per_step_after_10)")
args = p.parse_args()
if args.counters and args.steps <= 10:
    p.error("--counters needs more than 10 steps")
compiled = args.compile != "none"

import torch

if args.allocator == "cuarena":
    import cuarena
    import cuarena.torch
    cuarena.torch.use()
counting = args.counters and args.allocator == "cuarena"

torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)
dev = torch.device("cuda")
layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = lambda x, y: torch.nn.functional.cross_entropy(model(x).mean(dim=1), y)  # noqa: E731
if compiled:
    loss_fn = torch.compile(loss_fn, mode=args.compile)
g = torch.Generator(device="cpu").manual_seed(1)
losses, times = [], []
for step in range(args.steps):
    # Varying shapes exercise many block sizes; a compiled run keeps one (no re-recording).
    seq = 32 if compiled else 16 + (step * 7) % 48
    batch = 16 if compiled else 8 + (step * 5) % 24
    x = torch.randn(batch, seq, 256, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if compiled:
        torch.compiler.cudagraph_mark_step_begin()
    loss = loss_fn(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    times.append(time.perf_counter() - t0)
    if counting and step == 9:
        counters_at_10 = cuarena.stats()
if args.allocator == "cuarena":
    s = cuarena.stats()
    peak, reserved = s["peak_live_bytes"], s["peak_reserved_bytes"]
    paths = {k: s[k] for k in ("allocations", "arena_allocations", "pool_allocations", "driver_calls")}
    if counting:  # where the driver calls go, per steady step (BENCHMARKS.md, 28th measurement)
        n = args.steps - 10
        paths["per_step_after_10"] = {k: round((s[k] - counters_at_10[k]) / n, 2)
                                      for k in s if s[k] != counters_at_10[k]}
else:
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    paths = {}
steady = times[20 if compiled else 10:]  # after warm-up (and the graphs' recording)
mid = sorted(steady)[len(steady) // 2]
print(json.dumps({"allocator": args.allocator, "losses": losses, "step_ms": 1000 * sum(steady) / len(steady),
                  "step_ms_p50": 1000 * mid,
                  "peak_live_bytes": peak, "peak_reserved_bytes": reserved, **paths}))
