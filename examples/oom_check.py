"""Out of memory through cuarena raises, never yields a null tensor, and recovers (issue 8).

With CUARENA_CONF=max=256MiB (set here, before cuarena is loaded):
  (a) PyTorch: allocate 16 MiB tensors until one fails. The failure must be
      torch.OutOfMemoryError naming cuarena (or, where the shim was built without PyTorch's
      headers, a RuntimeError whose message contains "cuarena"); no tensor with
      numel() > 0 may have data_ptr() == 0; an absurd size must fail the same way; after the
      tensors are deleted an allocation succeeds again and its memory works.
  (b) CuPy, in a subprocess of this script (--part cupy): the same, with
      cupy.cuda.memory.OutOfMemoryError required.
Prints one summary line per part; exits non-zero if any check fails.
"""
import argparse
import os
import subprocess
import sys

CONF = "max=256MiB"
os.environ["CUARENA_CONF"] = CONF
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

CHUNK = 16 << 20
LIMIT = 256 << 20
HUGE = 1 << 40


def cuarena_stats():
    import cuarena

    try:
        return cuarena.stats()
    except Exception as e:
        print(f"cuarena.stats() failed: {e}", flush=True)
        return {"live_bytes": "?", "reserved_bytes": "?", "invalid_frees": "?"}


class Checks:
    def __init__(self, part):
        self.part = part
        self.failed = []

    def check(self, ok, what):
        if not ok:
            self.failed.append(what)
            print(f"{self.part}: FAILED CHECK: {what}", flush=True)
        return ok


def torch_part():
    import cuarena.torch

    c = Checks("torch")
    inst = cuarena.torch.use()
    print(f"torch: {inst}", flush=True)
    import torch

    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)

    def acceptable(e):
        # The shim built with PyTorch's headers throws PyTorch's own type (TorchInstall.oom_error).
        if inst.oom_error == "torch.OutOfMemoryError":
            return isinstance(e, oom_types) and "cuarena" in str(e)
        return isinstance(e, oom_types) or (isinstance(e, RuntimeError) and "cuarena" in str(e))

    tensors, null_tensors, err = [], 0, None
    for _ in range(4 * LIMIT // CHUNK):
        try:
            t = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
        except Exception as e:  # judged below: any other type is a failure
            err = e
            break
        if t.numel() > 0 and t.data_ptr() == 0:
            null_tensors += 1
        tensors.append(t)
    got = len(tensors)
    c.check(err is not None, f"no allocation failed after {got} x 16 MiB under {CONF}")
    if err is not None:
        c.check(acceptable(err), f"failure is {type(err).__name__}: {err}")
    c.check(null_tensors == 0, f"{null_tensors} tensors with data_ptr() == 0")
    c.check(got * CHUNK <= LIMIT, f"{got} x 16 MiB exceeds the {LIMIT >> 20} MiB cap")

    try:
        t = torch.empty(HUGE, dtype=torch.uint8, device="cuda")
        c.check(False, f"a 1 TiB tensor was created (data_ptr {t.data_ptr():#x})")
        del t
    except Exception as e:
        c.check(acceptable(e), f"1 TiB failure is {type(e).__name__}: {e}")

    del tensors
    recovered = False
    try:
        t = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
        c.check(t.data_ptr() != 0, "the allocation after freeing has data_ptr() == 0")
        t.fill_(3)
        recovered = c.check(int(t.sum().item()) == 3 * CHUNK,
                            "the memory allocated after recovery does not hold its values")
        del t
        torch.cuda.synchronize()
    except Exception as e:
        c.check(False, f"allocation after freeing failed: {type(e).__name__}: {e}")
    st = cuarena_stats()
    first = str(err).splitlines()[0] if err is not None else "none"
    print(f"torch OOM: {'OK' if not c.failed else 'FAILED'}: {got} x 16 MiB then {type(err).__name__}: "
          f"{first[:160]}; 0 null tensors: {null_tensors == 0}; recovered: {recovered}; "
          f"raises {inst.oom_error}; hooks installed {list(inst.hooks_installed)}, missing {list(inst.hooks_missing)}; "
          f"live now {st['live_bytes']} B, reserved {st['reserved_bytes']} B", flush=True)
    return 0 if not c.failed else 1


def cupy_part():
    import cupy as cp

    import cuarena.cupy

    c = Checks("cupy")
    cuarena.cupy.use()
    OOM = cp.cuda.memory.OutOfMemoryError

    arrays, null_arrays, err = [], 0, None
    for _ in range(4 * LIMIT // CHUNK):
        try:
            a = cp.empty(CHUNK, dtype=cp.uint8)
        except Exception as e:
            err = e
            break
        if a.size > 0 and a.data.ptr == 0:
            null_arrays += 1
        arrays.append(a)
    got = len(arrays)
    c.check(err is not None, f"no allocation failed after {got} x 16 MiB under {CONF}")
    if err is not None:
        c.check(isinstance(err, OOM), f"failure is {type(err).__name__}, not cupy OutOfMemoryError: {err}")
        c.check("cuarena" in str(err), f"the error does not carry cuarena's reason: {err}")
    c.check(null_arrays == 0, f"{null_arrays} arrays at address 0")
    try:
        a = cp.empty(HUGE, dtype=cp.uint8)
        c.check(False, f"a 1 TiB array was created (ptr {a.data.ptr:#x})")
        del a
    except Exception as e:
        c.check(isinstance(e, OOM), f"1 TiB failure is {type(e).__name__}: {e}")
    z = cp.empty(0, dtype=cp.float32)  # size 0 works
    c.check(z.size == 0, "size-0 array")
    del z

    del arrays
    recovered = False
    try:
        a = cp.empty(CHUNK, dtype=cp.uint8)
        a.fill(3)
        recovered = c.check(int(a.sum(dtype=cp.uint64)) == 3 * CHUNK,
                            "the memory allocated after recovery does not hold its values")
        del a
        cp.cuda.Device().synchronize()
    except Exception as e:
        c.check(False, f"allocation after freeing failed: {type(e).__name__}: {e}")
    st = cuarena_stats()
    first = str(err).splitlines()[0] if err is not None else "none"
    print(f"cupy OOM: {'OK' if not c.failed else 'FAILED'}: {got} x 16 MiB then {type(err).__name__}: {first[:160]}; "
          f"0 null arrays: {null_arrays == 0}; recovered: {recovered}; invalid frees {st['invalid_frees']}; live now {st['live_bytes']} B",
          flush=True)
    return 0 if not c.failed else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["all", "torch", "cupy"], default="all")
    args = p.parse_args()
    if args.part == "cupy":
        return cupy_part()
    if args.part == "torch":
        return torch_part()
    rc_cupy = subprocess.run([sys.executable, os.path.abspath(__file__), "--part", "cupy"]).returncode
    if rc_cupy != 0:
        print(f"cupy part exited {rc_cupy}", flush=True)
    try:
        rc_torch = torch_part()
    except Exception as e:
        print(f"torch OOM: FAILED: {type(e).__name__}: {e}", flush=True)
        rc_torch = 1
    return 0 if rc_cupy == 0 and rc_torch == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
