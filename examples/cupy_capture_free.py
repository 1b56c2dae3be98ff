"""CuPy arrays freed while their stream is being captured into a CUDA graph: cuarena refuses a
free on a capturing stream, so the glue holds it (with its Stream) and makes it after the
capture (cuarena.cupy.release_held(), or a later allocation). Checks that the memory comes back
and that nothing is freed during the capture. Needs a GPU, CuPy and libcuarena.so (CUARENA_LIB).

    python3 examples/cupy_capture_free.py
"""
import gc
import os
import sys

import cupy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import cuarena
import cuarena.cupy

cuarena.cupy.use()
s = cupy.cuda.Stream(non_blocking=True)
with s:
    arrays = [cupy.ones(n, dtype=cupy.float32) for n in (64, 1 << 16, 1 << 20)]
    s.synchronize()
    live = cuarena.stats()["live_bytes"]
    s.begin_capture()
    del arrays  # three frees on the capturing stream: refused by cuarena, held by the glue
    gc.collect()
    during = cuarena.stats()["live_bytes"]
    held = len(cuarena.cupy._held)
    graph = s.end_capture()
still = cuarena.cupy.release_held()
after = cuarena.stats()["live_bytes"]
ok = held == 3 and during == live and still == 0 and after < live
print(f"cupy capture free: live {live} B before, {during} B during the capture ({held} held), "
      f"{after} B after release_held ({still} still held); {'OK' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
