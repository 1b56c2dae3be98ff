"""Threaded inference under cuarena: 8 Python threads, each on its own CUDA stream, run a model;
intermediate tensors are handed to the next thread, which uses them on its own stream after
Tensor.record_stream. Every result is compared with a single-threaded run. Also checks
torch.empty(0), torch.cuda.empty_cache() and cuarena's stats. Prints OK or fails."""
import os, sys, threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import torch
import cuarena.torch

cuarena.torch.use()
dev = torch.device("cuda")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).to(dev).eval()
N, ITERS = 8, 40
inputs = [[torch.randn(64 + 8 * t, 512, generator=torch.Generator().manual_seed(100 * t + i)) for i in range(ITERS)] for t in range(N)]

def reference(x):
    with torch.no_grad():
        return model(model(x.to(dev))).cpu()

expected = [[reference(x) for x in xs] for xs in inputs]
handoff = [[] for _ in range(N)]
cv = threading.Condition()
results = [[None] * ITERS for _ in range(N)]
errors = []

def worker(t):
    try:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s), torch.no_grad():
            for i in range(ITERS):
                h = model(inputs[t][i].to(dev, non_blocking=False))      # first half on stream s
                ev = torch.cuda.Event()
                ev.record(s)
                with cv:
                    handoff[(t + 1) % N].append((t, i, h, ev))
                    cv.notify_all()
                with cv:                                                  # take one from the previous thread
                    while not handoff[t]:
                        cv.wait()
                    src, j, h2, ev2 = handoff[t].pop(0)
                s.wait_event(ev2)
                h2.record_stream(s)                                       # used here, freed after this work
                out = model(h2)
                del h2
                results[src][j] = out.cpu()
                if i % 10 == 0:
                    z = torch.empty(0, device=dev)                        # size 0 reaches the plug-in
                    assert z.numel() == 0
    except Exception as e:  # noqa: BLE001
        errors.append(repr(e))

threads = [threading.Thread(target=worker, args=(t,)) for t in range(N)]
[th.start() for th in threads]
[th.join() for th in threads]
torch.cuda.synchronize()
assert not errors, errors
bad = sum(not torch.allclose(results[t][i], expected[t][i], rtol=1e-4, atol=1e-5) for t in range(N) for i in range(ITERS))
torch.cuda.empty_cache()
s = cuarena.stats()
print(f"threaded inference: {N} threads x {ITERS} iterations, mismatches {bad}; stats {s}")
assert bad == 0
assert s["invalid_frees"] == 0, s
print("OK")
