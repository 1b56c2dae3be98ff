"""Trains a small transformer encoder through torch.compile(mode="reduce-overhead") (CUDA graph
trees: the forward and backward are recorded into a graph pool and replayed) on random data of
one shape, with fixed seeds, and prints one JSON line: losses, mean step time (after warm-up and
recording) and peak memory. Run it once with --allocator native and once with --allocator
cuarena (separate processes) and compare."""
import argparse, json, os, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
p = argparse.ArgumentParser()
p.add_argument("--allocator", choices=["native", "cuarena"], required=True)
p.add_argument("--steps", type=int, default=200)
args = p.parse_args()

import torch

if args.allocator == "cuarena":
    import cuarena.torch
    cuarena.torch.use()

torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loss_fn = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x).mean(dim=1), y),
                        mode="reduce-overhead")
g = torch.Generator(device="cpu").manual_seed(1)
losses, times = [], []
for step in range(args.steps):
    x = torch.randn(16, 32, 256, generator=g).to(dev)
    y = torch.randint(0, 10, (16,), generator=g).to(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.compiler.cudagraph_mark_step_begin()
    loss = loss_fn(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
    times.append(time.perf_counter() - t0)
if args.allocator == "cuarena":
    import cuarena
    s = cuarena.stats()
    peak, reserved = s["peak_live_bytes"], s["peak_reserved_bytes"]
else:
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
steady = times[20:]
print(json.dumps({"allocator": args.allocator, "losses": losses, "step_ms": 1000 * sum(steady) / len(steady),
                  "peak_live_bytes": peak, "peak_reserved_bytes": reserved}))
