"""A spilling layer over cuarena's OOM hook (issue 11, item 4), on PyTorch.

With CUARENA_CONF=max=512MiB (set here, before cuarena is loaded), a `Spiller` keeps named GPU
tensors ("layers"). cuarena.set_oom_hook() registers its hook: when an allocation is out of
memory after cuarena's own reclaim, the hook moves the least recently registered tensors to host
memory until enough is freed (their GPU storage goes back through the plug-in allocator's free
at once) and asks cuarena to retry. Checks:
  (a) filling ~400 MiB with layers, then asking for a 256 MiB tensor succeeds through spilling;
      the spilled layers are on the CPU with their values intact, the new tensor works;
  (b) cuarena.stats(): oom_hook_calls >= 1, ooms == 0, alloc_retries >= 1; memory_stats() has
      torch-style keys;
  (c) with a hook that refuses (returns False), an impossible allocation raises
      torch.OutOfMemoryError or a RuntimeError mentioning cuarena, and the process goes on.
Prints one line per check and "oom_spill: OK"; exits non-zero on any failure.

Run: CUARENA_LIB=target/release/libcuarena.so python3 examples/oom_spill.py
"""
import os
import sys

os.environ["CUARENA_CONF"] = "max=512MiB"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402

import cuarena  # noqa: E402
import cuarena.torch  # noqa: E402

MIB = 1 << 20


class Spiller:
    """Named tensors that may be moved to host memory when the device is out of memory."""

    def __init__(self):
        self.layers = {}  # name -> tensor (on the GPU until spilled), oldest first
        self.spilled = []
        self.calls = 0

    def register(self, name, tensor):
        self.layers[name] = tensor

    def on_oom(self, requested, device):
        self.calls += 1
        freed = 0
        for name in list(self.layers):
            t = self.layers[name]
            if not t.is_cuda:
                continue
            self.layers[name] = t.to("cpu")  # the GPU tensor's last reference goes: freed now
            del t
            self.spilled.append(name)
            freed += self.layers[name].numel() * self.layers[name].element_size()
            if freed >= requested:
                break
        print(f"  hook: requested {requested / MIB:.0f} MiB on device {device}, spilled {freed / MIB:.0f} MiB",
              flush=True)
        return freed > 0


failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def main():
    cuarena.torch.use()
    sp = Spiller()
    cuarena.set_oom_hook(sp.on_oom)
    for i in range(8):
        sp.register(f"layer{i}", torch.full((50 * MIB // 4,), float(i), device="cuda"))
    torch.cuda.synchronize()
    cuarena.reset_counters()
    big = torch.ones((256 * MIB // 4,), device="cuda")  # needs spilling
    big.mul_(3)
    torch.cuda.synchronize()
    check(float(big[0]) == 3.0 and float(big[-1]) == 3.0, "(a) the 256 MiB tensor allocated through spilling works")
    check(len(sp.spilled) >= 1, f"(a) layers spilled to host: {sp.spilled}")
    intact = all(float(sp.layers[n][0]) == float(n[5:]) and not sp.layers[n].is_cuda for n in sp.spilled)
    check(intact, "(a) spilled layers are on the CPU with their values")
    s = cuarena.stats()
    check(s["oom_hook_calls"] >= 1 and s["ooms"] == 0 and s["alloc_retries"] >= 1,
          f"(b) stats: oom_hook_calls={s['oom_hook_calls']} ooms={s['ooms']} alloc_retries={s['alloc_retries']}")
    m = cuarena.memory_stats()
    check(m["allocated_bytes.all.current"] == s["live_bytes"] and "reserved_bytes.all.peak" in m
          and m["num_ooms"] == 0, "(b) memory_stats() has torch's keys")

    cuarena.set_oom_hook(lambda requested, device: False)
    try:
        torch.empty((1 << 40,), dtype=torch.uint8, device="cuda")
        check(False, "(c) an impossible allocation raised")
    except (torch.OutOfMemoryError, RuntimeError) as e:
        check(isinstance(e, torch.OutOfMemoryError) or "cuarena" in str(e), f"(c) refused: {type(e).__name__}")
    cuarena.set_oom_hook(None)
    x = torch.ones(1024, device="cuda") * 2
    check(float(x.sum()) == 2048.0, "(c) the process goes on")
    check(cuarena.stats()["ooms"] >= 1, "(c) ooms counted")
    if failures:
        print(f"oom_spill: FAILED ({len(failures)})")
        sys.exit(1)
    print("oom_spill: OK")


if __name__ == "__main__":
    main()
