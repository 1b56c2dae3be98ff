"""CuPy work on a non-blocking stream must not see its memory reused early (issue 8, bug D).

Each round, on a `cupy.cuda.Stream(non_blocking=True)`: allocate a 256 KiB array, launch a kernel
that writes a tag over it, spins ~0.1 ms, then counts the words that no longer hold the tag;
delete the array; then, on the legacy default stream (which does not wait for non-blocking
streams), allocate the same size and fill it. If the allocator hands the first block to the
second array before the kernel is done, the fill lands during the spin and words change.

Runs each allocator in its own process and prints the corrupted words per allocator:
  cuarena  - cuarena through cuarena.cupy.use() (must be 0: exit 1 otherwise)
  cupy     - CuPy's own pool (for comparison)
  legacy   - a control: cuarena with every block allocated and freed on the legacy stream, the
             glue before the fix; it should show corruption, proving the check can see the bug
Also times N allocate+free pairs of small arrays (the glue's cost per allocation) for cuarena and
for CuPy's pool.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

KERNEL = r"""
extern "C" __global__ void tag_spin_check(unsigned int *buf, int n, unsigned int tag, long long spin,
                                          unsigned long long *changed) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    volatile unsigned int *v = buf;
    if (i < n) v[i] = tag;
    long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    if (i < n && v[i] != tag) atomicAdd(changed, 1ULL);
}
"""


def spin_kernel(cp, nbytes):
    """The tag-spin-check kernel over `nbytes`: (words, grid, block, spin cycles for ~0.1 ms, the
    kernel, the device counter of changed words), the device synchronised."""
    n = nbytes // 4
    threads = 256
    blocks = (n + threads - 1) // threads
    try:
        clock_khz = int(cp.cuda.Device().attributes.get("ClockRate", 0)) or 1_800_000
    except Exception:
        clock_khz = 1_800_000
    spin = clock_khz // 10  # cycles in 0.1 ms
    kern = cp.RawKernel(KERNEL, "tag_spin_check")
    changed = cp.zeros(1, dtype=cp.uint64)
    cp.cuda.Device().synchronize()
    return n, blocks, threads, spin, kern, changed


def install_legacy_control(cp):
    """The glue before the fix: every block on the legacy stream, whatever stream is current."""
    import ctypes

    import cuarena

    lib = cuarena.load()

    class Owner:
        __slots__ = ("ptr", "size", "dev")

        def __init__(self, ptr, size, dev):
            self.ptr, self.size, self.dev = ptr, size, dev

        def __del__(self):
            lib.cuarena_free(self.ptr, self.size, self.dev, None)

    def malloc(size):
        dev = cp.cuda.runtime.getDevice()
        if size == 0:
            return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(0, 0, None, dev), 0)
        ptr = lib.cuarena_malloc(ctypes.c_size_t(size), dev, None)
        if not ptr:
            raise MemoryError(cuarena.last_error())
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, size, Owner(ptr, size, dev), dev), 0)

    cp.cuda.set_allocator(malloc)


def run_one(allocator, rounds, pairs):
    import numpy as np
    import cupy as cp

    if allocator == "cuarena":
        import cuarena.cupy

        cuarena.cupy.use()
    elif allocator == "legacy":
        install_legacy_control(cp)
    else:
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)

    nbytes = 256 << 10
    n, blocks, threads, spin, kern, changed = spin_kernel(cp, nbytes)

    s = cp.cuda.Stream(non_blocking=True)
    t0 = time.perf_counter()
    for i in range(rounds):
        tag = np.uint32(0xA5000000 | (i & 0xFFFFFF))
        with s:
            a = cp.empty(n, dtype=cp.uint32)
            kern((blocks,), (threads,), (a, np.int32(n), tag, np.int64(spin), changed))
            del a  # freed while the kernel still spins
        b = cp.empty(n, dtype=cp.uint32)  # legacy default stream
        b.fill(0)
        del b
    s.synchronize()
    cp.cuda.Device().synchronize()
    loop_s = time.perf_counter() - t0
    corrupted = int(changed.get()[0])

    # The glue's cost: allocate+free pairs of small arrays on the current (legacy) stream.
    for _ in range(1000):
        x = cp.empty(64, dtype=cp.float32)
        del x
    t0 = time.perf_counter()
    for _ in range(pairs):
        x = cp.empty(64, dtype=cp.float32)
        del x
    pair_us = (time.perf_counter() - t0) / pairs * 1e6

    out = {"allocator": allocator, "rounds": rounds, "corrupted_words": corrupted, "spin_cycles": spin,
           "loop_s": round(loop_s, 3), "alloc_free_pair_us": round(pair_us, 3)}
    if allocator in ("cuarena", "legacy"):
        import cuarena

        del changed
        cp.cuda.Device().synchronize()
        st = cuarena.stats()
        out["invalid_frees"] = st["invalid_frees"]
        out["live_bytes_at_end"] = st["live_bytes"]
    print(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--allocator", choices=["cuarena", "cupy", "legacy"])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--pairs", type=int, default=20000)
    args = p.parse_args()
    if args.allocator:
        run_one(args.allocator, args.rounds, args.pairs)
        return 0
    res = {}
    for a in ("cuarena", "cupy", "legacy"):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--allocator", a, "--rounds", str(args.rounds),
                            "--pairs", str(args.pairs)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{a}: FAILED (exit {r.returncode})\n{r.stdout}{r.stderr}")
            res[a] = None
            continue
        res[a] = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(res[a]))
    ok = True
    c, n, l = res.get("cuarena"), res.get("cupy"), res.get("legacy")
    if c is None or c["corrupted_words"] != 0 or c.get("invalid_frees", 0) != 0 or c.get("live_bytes_at_end", 0) != 0:
        ok = False
    print(f"cupy stream check: corrupted words over {args.rounds} rounds: cuarena "
          f"{c['corrupted_words'] if c else '?'}, CuPy pool {n['corrupted_words'] if n else '?'}, "
          f"control (legacy-stream glue) {l['corrupted_words'] if l else '?'}; "
          f"alloc+free pair: cuarena {c['alloc_free_pair_us'] if c else '?'} us, "
          f"CuPy pool {n['alloc_free_pair_us'] if n else '?'} us; {'OK' if ok else 'FAILED'}")
    if l is not None and l["corrupted_words"] == 0:
        print("note: the control showed no corruption this run, so this run could not have seen the bug")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
