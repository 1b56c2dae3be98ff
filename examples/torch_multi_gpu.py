"""PyTorch on every visible GPU through cuarena (a machine with two or more GPUs; exits 0 with a
"skipped" line on one, or 1 with CUARENA_REQUIRE_GPUS=2).

- one Python thread per device, each on a stream of its own and on the device's default stream,
  runs a model replica and compares every result with the same model run on the CPU;
- tensors cross devices (cuda:i -> cuda:i+1, .to() on the receiving device's stream) and are
  freed there, by another thread than the one that made them;
- torch.cuda.set_per_process_memory_fraction(0.0, device=last) makes out of memory
  (torch.OutOfMemoryError) on that device only, while the others go on; 1.0 lifts it;
- at the end every device's allocator has no invalid frees and its own allocations (each device
  is its own allocator); live bytes are printed (PyTorch keeps cuBLAS workspaces allocated).
Prints one line per device and OK, or fails.
"""
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import torch

import cuarena
import cuarena.torch

inst = cuarena.torch.use()
n = torch.cuda.device_count()
if n < 2:
    print(f"skipped: {n} GPU(s), need 2")
    sys.exit(1 if os.environ.get("CUARENA_REQUIRE_GPUS") == "2" else 0)

torch.manual_seed(0)
cpu_model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
models = []
for d in range(n):
    m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    m.load_state_dict(cpu_model.state_dict())
    models.append(m.to(f"cuda:{d}").eval())
before = [cuarena.stats(d) for d in range(n)]
ITERS = 60
inputs = [torch.randn(32 + d, 256, generator=torch.Generator().manual_seed(7 + d)) for d in range(n)]
with torch.no_grad():
    expected = [cpu_model(x) for x in inputs]
    expected2 = [cpu_model(cpu_model(x)) for x in inputs]
errors, inbox = [], [[] for _ in range(n)]
cv = threading.Condition()
barrier = threading.Barrier(n)


def worker(d):
    try:
        torch.cuda.set_device(d)
        s = torch.cuda.Stream(device=d)
        with torch.no_grad():
            for i in range(ITERS):
                with torch.cuda.stream(s):
                    y = models[d](inputs[d].to(f"cuda:{d}"))
                    if not torch.allclose(y.cpu(), expected[d], rtol=1e-4, atol=1e-5):
                        errors.append(f"device {d} round {i}: wrong result")
                # Hand y to the next device's thread, which copies it over and frees ours.
                s.synchronize()
                with cv:
                    inbox[(d + 1) % n].append((d, y))
                    cv.notify_all()
                    while not inbox[d]:
                        cv.wait()
                    src, h = inbox[d].pop(0)
                z = h.to(f"cuda:{d}")  # on this device's current (default) stream
                del h                  # another thread's tensor of device src, freed here
                w = models[d](z)
                if not torch.allclose(w.cpu(), expected2[src], rtol=1e-4, atol=1e-5):
                    errors.append(f"device {d} round {i}: wrong result for device {src}'s tensor")
        barrier.wait()
    except Exception as e:  # noqa: BLE001
        errors.append(f"device {d}: {e!r}")
        barrier.abort()


threads = [threading.Thread(target=worker, args=(d,)) for d in range(n)]
[t.start() for t in threads]
[t.join() for t in threads]
for d in range(n):
    torch.cuda.synchronize(d)
assert not errors, errors[:5]

# Fraction 0 on the last device: out of memory there, the others unaffected.
last = n - 1
torch.cuda.set_per_process_memory_fraction(0.0, device=last)
try:
    torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{last}")
    raise AssertionError(f"1 GiB on cuda:{last} at fraction 0 did not fail")
except torch.OutOfMemoryError as e:
    assert "of a 0 B cap" in str(e), e
ok0 = torch.ones(1 << 28, dtype=torch.uint8, device="cuda:0")
assert int(ok0.sum().item()) == 1 << 28
del ok0
torch.cuda.set_per_process_memory_fraction(1.0, device=last)
t = torch.ones(1 << 28, dtype=torch.uint8, device=f"cuda:{last}")
assert int(t.sum().item()) == 1 << 28
del t

del models
if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
    torch._C._cuda_clearCublasWorkspaces()
torch.cuda.empty_cache()
for d in range(n):
    s = cuarena.stats(d)
    print(f"cuda:{d}: allocations {s['allocations'] - before[d]['allocations']}, live {s['live_bytes']} B "
          f"(at start {before[d]['live_bytes']} B, the model), invalid frees {s['invalid_frees']}")
    assert s["allocations"] > before[d]["allocations"], f"device {d} allocated nothing through cuarena"
    assert s["invalid_frees"] == 0, s
print(f"torch multi-GPU: OK on {n} devices ({inst.oom_error} on out of memory)")
