"""Host time of one PyTorch allocation and free (torch.empty + del) through the native caching
allocator or through cuarena's plug-in (CUDAPluggableAllocator + cuarena_torch_malloc/free),
per size, on the current stream (the legacy stream). Prints one JSON line.
Run once per allocator (the allocator is chosen before the first CUDA allocation):
  python3 notes/experiments/torch_alloc_cost.py --allocator native|cuarena"""
import argparse, json, os, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
p = argparse.ArgumentParser()
p.add_argument("--allocator", choices=["native", "cuarena"], required=True)
p.add_argument("--n", type=int, default=20000)
args = p.parse_args()
import torch

if args.allocator == "cuarena":
    import cuarena.torch
    cuarena.torch.use()
dev = torch.device("cuda")
torch.empty(1, device=dev)
out = {"allocator": args.allocator}
for size in (512, 65536, 1 << 20, 8 << 20):
    for _ in range(1000):  # warm
        x = torch.empty(size, dtype=torch.uint8, device=dev)
        del x
    t0 = time.perf_counter()
    for _ in range(args.n):
        x = torch.empty(size, dtype=torch.uint8, device=dev)
        del x
    out[f"ns_{size}"] = round(1e9 * (time.perf_counter() - t0) / args.n)
    # Eight live at once, freed in another order: closer to a training step's pattern.
    xs = []
    t0 = time.perf_counter()
    for i in range(args.n):
        xs.append(torch.empty(size + 256 * (i % 5), dtype=torch.uint8, device=dev))
        if len(xs) > 8:
            xs.pop(3)
    del xs
    out[f"ns8_{size}"] = round(1e9 * (time.perf_counter() - t0) / args.n)
torch.cuda.synchronize()
print(json.dumps(out))
