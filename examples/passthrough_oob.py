"""A planted out-of-bounds write, for compute-sanitizer: run it with CUARENA_CONF=passthrough and
memcheck reports the write (each allocation is the driver's own); in the normal pooling mode the
write lands inside cuarena's pool and no tool can see it. Usage:
  CUARENA_CONF=passthrough compute-sanitizer --tool memcheck python3 examples/passthrough_oob.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import cupy  # noqa: E402
import cuarena.cupy  # noqa: E402

cuarena.cupy.use()
a = cupy.zeros(1000, dtype=cupy.float32)  # 4,000 bytes
b = cupy.zeros(1 << 20, dtype=cupy.float32)  # a neighbour, so the pooled write has somewhere to land
k = cupy.RawKernel(r'''
extern "C" __global__ void past_the_end(float* p, int n) { p[n + threadIdx.x] = 1.0f; }
''', "past_the_end")
k((1,), (32,), (a, cupy.int32(1000)))  # 32 floats past the end of `a`
cupy.cuda.Device().synchronize()
print("planted write done; mode:", __import__("os").environ.get("CUARENA_CONF", "pooled"))
