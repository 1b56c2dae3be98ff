"""torch_train.py's loop, sampling cuarena's statistics after every step: where the peak reserved
memory is (arena-held, pool in use, pool free), with CUARENA_CONF from the environment."""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "python"))
import torch
alloc = sys.argv[1]
if alloc == "cuarena":
    import cuarena, cuarena.torch
    cuarena.torch.use()
torch.manual_seed(0)
dev = torch.device("cuda")
layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator(device="cpu").manual_seed(1)
best = None
for step in range(300):
    seq = 16 + (step * 7) % 48
    batch = 8 + (step * 5) % 24
    x = torch.randn(batch, seq, 256, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    out = model(x).mean(dim=1)
    loss = torch.nn.functional.cross_entropy(out, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    loss.item()
    if alloc == "cuarena":
        s = cuarena.stats()
        if best is None or s["reserved_bytes"] > best["reserved_bytes"]:
            best = dict(s, step=step)
M = 1 << 20
if alloc == "cuarena":
    s = cuarena.stats()
    keys = ["step", "reserved_bytes", "arena_held_bytes", "pool_in_use_bytes", "live_bytes", "largest_free_block", "free_extents", "arenas"]
    print(json.dumps({"conf": os.environ.get("CUARENA_CONF", ""), "peak_reserved": s["peak_reserved_bytes"] / M,
                      "peak_live": s["peak_live_bytes"] / M, "peak_live_upper": s["peak_live_bytes_upper"] / M,
                      "at_max_reserved_sample": {k: (best[k] / M if k.endswith("bytes") or k == "largest_free_block" else best[k]) for k in keys},
                      "allocs": s["allocations"], "arena": s["arena_allocations"], "pool": s["pool_allocations"], "large": s["large_allocations"],
                      "taken": s["superblocks_taken"], "returned": s["superblocks_returned"], "dissolved": s["superblocks_dissolved"],
                      "calls": s["driver_calls"], "cross_thread": s["cross_thread_frees"], "cross_stream": s["cross_stream_frees"]}))
else:
    print(json.dumps({"native": True, "peak_reserved": torch.cuda.max_memory_reserved() / M, "peak_live": torch.cuda.max_memory_allocated() / M}))
