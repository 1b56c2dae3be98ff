"""PyTorch CUDA graph capture through the cuarena plug-in (issue 11, item 5).

What cuarena promises (README, "CUDA graphs"): an allocation or free on a stream being captured
never breaks the capture or corrupts memory: the ones cuarena detects are refused with "stream
... is being captured into a CUDA graph"; cuarena never records, waits on or polls an event on a
capturing stream, and its own driver calls run in the relaxed capture mode, so other threads
allocating meanwhile do not invalidate a global-mode capture. Checks:
  (a) a graph whose tensors are all allocated before the capture (static inputs and outputs,
      in-place and out= ops) captures, replays and computes the right values, while another
      thread allocates and frees through cuarena (pool growth included) during the capture;
  (b) a graph that allocates during the capture: either the capture works (and replays right),
      or it fails with a clear error (cuarena's "captured into a CUDA graph", or PyTorch's own
      refusal for plug-in allocators); either way the process goes on with correct results and
      no sticky CUDA error;
  (c) cuarena.stats() after all that: no invalid free;
  (d) tensors allocated before a capture on the stream then captured (small, arena-large and
      pool blocks) and one on the legacy stream (a pool block, whose free needs the legacy
      stream, refused while a capture is announced), dropped during the capture: cuarena
      refuses those frees during the capture and holds them (cuarena_free_or_hold), and makes
      them when the capture ends (PyTorch's endAllocateToPool): their bytes are no longer live
      after the capture, with no empty_cache. Before the thirty-third session they stayed live
      for the process's life.
Prints one line per check and "torch_graph: OK"; exits non-zero on any failure.

Run: CUARENA_LIB=target/release/libcuarena.so python3 examples/torch_graph.py
"""
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch  # noqa: E402

import cuarena  # noqa: E402
import cuarena.torch  # noqa: E402

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def background_allocations(errors):
    try:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for i in range(50):
                t = torch.empty(((1 + i % 7) << 20,), dtype=torch.uint8, device="cuda")
                del t
            big = torch.empty((300 << 20,), dtype=torch.uint8, device="cuda")  # grows the pool
            del big
    except Exception as e:  # reported by the main thread
        errors.append(e)


def part_a():
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph's documentation asks
        torch.mul(x, 2, out=y)
        y.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    errors = []
    with torch.cuda.graph(g):
        torch.mul(x, 2, out=y)
        y.add_(1)
        t = threading.Thread(target=background_allocations, args=(errors,))
        t.start()
        t.join()
    check(not errors, f"(a) another thread allocated during the capture: {errors or 'no error'}")
    x.copy_(torch.ones_like(x))
    g.replay()
    torch.cuda.synchronize()
    check(bool((y == 3).all()), "(a) the captured graph replays with the right values")


def part_b():
    x = torch.ones(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        z = x * 2
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    outcome = None
    try:
        with torch.cuda.graph(g):
            z = x * 2 + 1  # allocates on the capture stream
        x.fill_(5)
        g.replay()
        torch.cuda.synchronize()
        outcome = "captured"
        check(bool((z == 11).all()), "(b) the capture with allocations replays with the right values")
    except Exception as e:
        msg = str(e)
        clear = "captured into a CUDA graph" in msg or "Pluggable" in msg or "pluggable" in msg \
            or "beginAllocateToPool" in msg or "capture" in msg.lower()
        outcome = f"refused: {type(e).__name__}: {msg.splitlines()[0][:200]}"
        check(clear, f"(b) refused with a clear error: {msg.splitlines()[0][:200]}")
    print(f"  (b) outcome: {outcome}", flush=True)
    w = torch.ones(1 << 20, device="cuda") * 3
    torch.cuda.synchronize()
    check(float(w.sum()) == 3.0 * (1 << 20), "(b) the process goes on: no sticky CUDA error")


def part_d():
    cap = torch.cuda.Stream()
    sizes = [4 << 10, 300 << 10, 4 << 20, 96 << 20]
    with torch.cuda.stream(cap):
        dropped = [torch.empty((n,), dtype=torch.uint8, device="cuda") for n in sizes]
        for t in dropped:
            t.fill_(7)
    legacy = torch.empty((80 << 20,), dtype=torch.uint8, device="cuda")
    legacy.fill_(9)
    x = torch.ones(1 << 16, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    before = cuarena.stats()["live_bytes"]
    freed = sum(sizes) + (80 << 20)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=cap):
        torch.mul(x, 3, out=y)
        del dropped, legacy, t  # their frees: on the capturing stream, or needing the legacy one
    after = cuarena.stats()["live_bytes"]
    g.replay()
    torch.cuda.synchronize()
    check(bool((y == 3).all()), "(d) the graph replays with the right values")
    check(after <= before - freed,
          f"(d) frees refused during the capture were made when it ended: live {before} -> {after} "
          f"(dropped {freed} B)")
    for n in (4 << 10, 300 << 10, 4 << 20, 96 << 20):  # the memory is usable again
        z = torch.full((n,), 5, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        check(int(z[-1]) == 5, f"(d) a {n} B tensor after the capture")


def main():
    cuarena.torch.use()
    part_a()
    part_b()
    part_d()
    s = cuarena.stats()
    check(s["invalid_frees"] == 0, f"(c) invalid_frees={s['invalid_frees']}")
    print(f"  stats: live={s['live_bytes']} reserved={s['reserved_bytes']} driver_calls={s['driver_calls']}")
    if failures:
        print(f"torch_graph: FAILED ({len(failures)})")
        sys.exit(1)
    print("torch_graph: OK")


if __name__ == "__main__":
    main()
