"""CuPy arrays of a per-thread default stream handed to another thread, which drops them: their
memory must not be reused before the first thread's work on them is done.

CuPy's `Stream.ptds` (and its default stream under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) has
the handle 0x2, which names the *calling* thread's per-thread stream. A block allocated on
thread A's 0x2 and dropped on thread B would be freed on B's own per-thread stream, whose
event does not follow A's kernels; the glue frees it on the legacy stream instead, whose event
follows every per-thread stream's earlier work (python/cuarena/cupy.py).

Each round: thread A allocates an array on its per-thread stream, launches a kernel that writes
a tag over it, spins ~0.1 ms and counts the words that changed; it hands the array to thread B,
which drops it and, on its own per-thread stream, allocates the same size and fills it. If the
block is reused before A's kernel is done, the fill lands during the spin. Run per size:
  --mode fixed   the glue as it is (must report 0 corrupted words: exit 1 otherwise)
  --mode naive   a control: the free on the dropping thread's 0x2, as before the fix (shows
                 that this run could see the bug)
Needs a GPU and CuPy; runs each mode in its own process (CUARENA_CONF from the environment).
"""
import argparse
import json
import os
import queue
import subprocess
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from cupy_stream_check import spin_kernel  # noqa: E402  (this script's directory is on sys.path)


def run_one(mode, rounds, nbytes):
    import numpy as np
    import cupy as cp

    import cuarena
    import cuarena.cupy

    cuarena.cupy.use()
    if mode == "naive":
        def free_on_dropping_thread(self):
            cuarena.cupy._Block._free(self.ptr, self.size, self.device, self.stream.ptr)
        cuarena.cupy._Block.__del__ = free_on_dropping_thread

    n, blocks, threads, spin, kern, changed = spin_kernel(cp, nbytes)
    handoff, done = queue.Queue(maxsize=1), queue.Queue(maxsize=1)

    def a():
        with cp.cuda.Stream.ptds:
            for i in range(rounds):
                tag = np.uint32(0xA5000000 | (i & 0xFFFFFF))
                x = cp.empty(n, dtype=cp.uint32)
                kern((blocks,), (threads,), (x, np.int32(n), tag, np.int64(spin), changed))
                handoff.put(x)
                del x
                done.get()  # B has dropped it and reused the memory
            cp.cuda.Stream.ptds.synchronize()

    def b():
        with cp.cuda.Stream.ptds:
            for _ in range(rounds):
                x = handoff.get()
                del x  # the last reference: freed here, on thread B
                y = cp.empty(n, dtype=cp.uint32)
                y.fill(0)
                del y
                done.put(None)
            cp.cuda.Stream.ptds.synchronize()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(), tb.start()
    ta.join(), tb.join()
    cp.cuda.Device().synchronize()
    corrupted = int(changed.get()[0])
    del changed
    cp.cuda.Device().synchronize()
    st = cuarena.stats()
    print(json.dumps({"mode": mode, "bytes": nbytes, "rounds": rounds, "corrupted_words": corrupted,
                      "invalid_frees": st["invalid_frees"], "live_bytes_at_end": st["live_bytes"]}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fixed", "naive"])
    p.add_argument("--rounds", type=int, default=500)
    p.add_argument("--bytes", type=int, default=0, help="one size (default: 256 KiB and 4 MiB)")
    args = p.parse_args()
    if args.mode:
        run_one(args.mode, args.rounds, args.bytes)
        return 0
    ok, seen = True, False
    for nbytes in ([args.bytes] if args.bytes else [256 << 10, 4 << 20]):
        for mode in ("fixed", "naive"):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode, "--rounds",
                                str(args.rounds), "--bytes", str(nbytes)], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{mode} {nbytes} B: FAILED (exit {r.returncode})\n{r.stdout}{r.stderr}")
                ok = False
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print(json.dumps(res))
            if mode == "fixed" and (res["corrupted_words"] or res["invalid_frees"] or res["live_bytes_at_end"]):
                ok = False
            seen |= mode == "naive" and res["corrupted_words"] > 0
    if not seen:
        print("note: the control showed no corruption at any size, so this run could not have seen the bug")
    print(f"cupy ptds handoff check: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
