"""The level-2 shim's getMemoryFraction and cacheInfo against cuarena's cap (limit_bytes,
device_total_bytes), without a GPU: the shim is compiled against test_torch_shim's stand-in
PyTorch headers and linked with a stand-in libcuarena whose cuarena_peek_stats answers what the
test sets, and a stand-in libcudart whose cudaMemGetInfo succeeds (test_torch_shim's fails, so
there the clamp is never reached). helper-17 wrote it: a cap of 0 offered cuDNN the device's
free memory."""
import os
import shutil
import subprocess
import tempfile
import unittest

from test_torch_shim import CXX, _HEADER, _fake_torch, _write

_SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuarena", "torch_shim.cpp")

# libcuarena stand-in: cuarena_peek_stats reports stub_* (used or not, which fields are filled).
_STUB = r"""
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstring>
extern "C" {
static int used = 0;
static uint64_t filled = 0, vals[64];
void stub_set(int u, uint64_t bytes_filled, uint64_t reserved, uint64_t largest, uint64_t limit, uint64_t total) {
    used = u; filled = bytes_filled; std::memset(vals, 0, sizeof vals);
    vals[3] = reserved; vals[6] = largest; vals[31] = limit; vals[32] = total;
}
int cuarena_peek_stats(int, void *out) {
    uint64_t size; std::memcpy(&size, out, 8);
    uint64_t n = size < filled ? size : filled;
    vals[0] = n;
    std::memcpy(out, vals, n);
    return used ? 0 : 1;
}
void *cuarena_malloc(size_t n, int, void *) { return n == 4242 ? reinterpret_cast<void *>(0x4000) : nullptr; }
void cuarena_free(void *, size_t, int, void *) {}
int cuarena_free_or_hold(void *, size_t, int, void *) { return 0; }
int cuarena_record_stream_checked(void *, void *) { return 0; }
const char *cuarena_last_error(void) { return "stub"; }
int cuarena_reset_peak(int) { return 0; }
int cuarena_reset_counters(int) { return 0; }
void cuarena_empty_cache(void) {}
void cuarena_set_memory_fraction(double, int) {}
// Graph pools (test_shim_graph.py): each call is logged; a pool's "blocks" are fake addresses.
static char glog[4096];
static uint64_t live_blocks[32];
static size_t live_n = 0;
static int retain_result = 0;
static void glog_add(const char *s) { std::strncat(glog, s, sizeof glog - std::strlen(glog) - 1); }
const char *stub_graph_log(void) { return glog; }
void stub_graph_set(int retain_ok, size_t n, const uint64_t *blocks) {
    retain_result = retain_ok ? 0 : -1; live_n = n; std::memcpy(live_blocks, blocks, n * 8); glog[0] = 0;
}
int cuarena_graph_pool_retain(uint64_t a, uint64_t b, int d) {
    char m[64]; std::snprintf(m, sizeof m, "retain %llu,%llu@%d;", (unsigned long long)a, (unsigned long long)b, d); glog_add(m);
    return retain_result;
}
int cuarena_graph_pool_release(uint64_t a, uint64_t b, int d) {
    char m[64]; std::snprintf(m, sizeof m, "release %llu,%llu@%d;", (unsigned long long)a, (unsigned long long)b, d); glog_add(m);
    return -1;  // answered as for a pool not retained: the shim must not throw
}
void *cuarena_graph_malloc(uint64_t a, uint64_t b, size_t n, int d, void *s) {
    char m[96]; std::snprintf(m, sizeof m, "gmalloc %llu,%llu %zu@%d s%p;", (unsigned long long)a, (unsigned long long)b, n, d, s); glog_add(m);
    return n == 999 ? nullptr : reinterpret_cast<void *>(0x5000);
}
int64_t cuarena_graph_pool_use_count(uint64_t, uint64_t, int) { return retain_result == 0 ? 2 : -1; }
int cuarena_graph_capture_begin(int d) { char m[32]; std::snprintf(m, sizeof m, "begin@%d;", d); glog_add(m); return 0; }
int cuarena_graph_capture_end(int d) { char m[32]; std::snprintf(m, sizeof m, "end@%d;", d); glog_add(m); return 0; }
int cuarena_graph_pool_live(uint64_t, uint64_t, int, void **out, size_t n, size_t *count) {
    for (size_t i = 0; i < n && i < live_n; i++) out[i] = reinterpret_cast<void *>(live_blocks[i]);
    *count = live_n;
    return 0;
}
// Checkpoints: a checkpoint holds the live blocks (512 bytes each); a restore reports the live
// blocks as freed (or, with too little room, how many) and makes the checkpoint's live.
struct cuarena_graph_checkpoint { size_t n; uint64_t blocks[32]; };
cuarena_graph_checkpoint *cuarena_graph_pool_checkpoint(uint64_t a, uint64_t b, int d) {
    char m[64]; std::snprintf(m, sizeof m, "checkpoint %llu,%llu@%d;", (unsigned long long)a, (unsigned long long)b, d); glog_add(m);
    if (retain_result != 0) return nullptr;
    auto *c = new cuarena_graph_checkpoint{live_n, {}};
    std::memcpy(c->blocks, live_blocks, live_n * 8);
    return c;
}
ptrdiff_t cuarena_graph_checkpoint_blocks(const cuarena_graph_checkpoint *c, void **p, size_t *s, size_t n) {
    for (size_t i = 0; i < n && i < c->n; i++) { p[i] = reinterpret_cast<void *>(c->blocks[i]); s[i] = 512; }
    return static_cast<ptrdiff_t>(c->n);
}
void cuarena_graph_checkpoint_free(cuarena_graph_checkpoint *c) { glog_add("checkpoint freed;"); delete c; }
int cuarena_graph_pool_restore(const cuarena_graph_checkpoint *c, void **freed, size_t n, size_t *count) {
    char m[32]; std::snprintf(m, sizeof m, "restore room %zu;", n); glog_add(m);
    if (retain_result != 0) return -1;
    *count = live_n;
    if (live_n > n) return 1;
    for (size_t i = 0; i < live_n; i++) freed[i] = reinterpret_cast<void *>(live_blocks[i]);
    live_n = c->n;
    std::memcpy(live_blocks, c->blocks, c->n * 8);
    return 0;
}
}
"""

# A CUDA runtime whose device has 8 GiB free of 80 GiB.
_CUDART = r"""
#include <cuda_runtime_api.h>
extern "C" cudaError_t cudaMemGetInfo(size_t *f, size_t *t) { *f = size_t(8) << 30; *t = size_t(80) << 30; return cudaSuccess; }
extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
"""

_PROG = r"""
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <cstdio>
extern "C" int cuarena_torch_install(char *err, size_t n);
extern "C" void stub_set(int, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
using namespace torch::cuda::CUDAPluggableAllocator;
const uint64_t MiB = 1 << 20, GiB = 1 << 30, V3 = 8 + 32 * 8, V2 = 8 + 30 * 8;
int main() {
    char err[256];
    if (cuarena_torch_install(err, sizeof err) != 0) { std::printf("install failed %s\n", err); return 1; }
    auto a = current_for_test();
    struct { const char *name; int used; uint64_t filled, reserved, largest, limit, total; } cases[] = {
        {"unused", 0, V3, 0, 0, 0, 0},
        {"cap 1GiB, 512MiB reserved", 1, V3, 512 * MiB, 0, GiB, 80 * GiB},
        {"cap under reserved", 1, V3, 2 * GiB, 64 * MiB, GiB, 80 * GiB},
        {"cap over total", 1, V3, 0, 0, 1024 * GiB, 80 * GiB},
        {"fraction 0", 1, V3, 0, 0, 0, 80 * GiB},
        {"fraction 0 with reserved", 1, V3, GiB, 32 * MiB, 0, 80 * GiB},
        {"old library", 1, V2, 0, 0, 0, 0},
    };
    for (auto &c : cases) {
        stub_set(c.used, c.filled, c.reserved, c.largest, c.limit, c.total);
        size_t l = 0;
        a->cacheInfo(0, &l);
        std::printf("%s: largest %llu fraction %.6f\n", c.name, (unsigned long long)l, a->getMemoryFraction(0));
    }
    return 0;
}
"""


def build_and_run(workdir, source):
    """Builds the level-2 shim in `workdir` against test_torch_shim's stand-in PyTorch, the
    stand-in libcuarena (_STUB) and libcudart (_CUDART), then the C++ program `source` linked with
    them, runs it, and returns its output (it must exit 0)."""
    root = os.path.join(workdir, "torch")
    _fake_torch(root, _HEADER, pluggable=True)
    lib = os.path.join(root, "lib")
    inc = [f"-I{root}/include", f"-I{root}/cuda/include"]
    for name, src in (("libcuarena_stub.so", _STUB), ("libcudart_ok.so", _CUDART)):
        _write(os.path.join(workdir, name + ".cpp"), src)
        subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", *inc, os.path.join(workdir, name + ".cpp"),
                        "-o", os.path.join(lib, name)], check=True, capture_output=True)
    shim = os.path.join(lib, "libshim.so")
    subprocess.run([CXX, "-std=c++17", "-O2", "-shared", "-fPIC", "-DCUARENA_C10", "-DCUARENA_TORCH_ALLOCATOR",
                    *inc, _SHIM, "-o", shim, f"-L{lib}", "-l:libcuarena_stub.so", "-ltorch_cuda", "-lc10",
                    "-l:libcudart_ok.so", f"-Wl,-rpath,{lib}"], check=True, capture_output=True, text=True)
    prog = os.path.join(workdir, "prog")
    _write(prog + ".cpp", source)
    subprocess.run([CXX, "-std=c++17", *inc, prog + ".cpp", "-o", prog, shim, f"-L{lib}",
                    "-l:libcuarena_stub.so", "-ltorch_cuda", "-lc10", f"-Wl,-rpath,{lib}"],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([prog], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@unittest.skipIf(shutil.which(CXX) is None, "no C++ compiler")
class ShimCap(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.dir)

    def run_cases(self):
        return dict(line.split(": ", 1) for line in build_and_run(self.dir, _PROG).splitlines())

    def test_what_holds(self):
        r = self.run_cases()
        gib = 1 << 30
        self.assertEqual(r["unused"], f"largest {8 * gib} fraction 1.000000", r)
        self.assertEqual(r["cap 1GiB, 512MiB reserved"], f"largest {512 << 20} fraction 0.012500", r)
        self.assertEqual(r["cap under reserved"], f"largest {64 << 20} fraction 0.012500", r)
        self.assertEqual(r["cap over total"], f"largest {8 * gib} fraction 1.000000", r)
        self.assertEqual(r["old library"], f"largest {8 * gib} fraction 1.000000", r)

    def test_a_cap_of_zero_offers_cudnn_nothing_beyond_the_pool(self):
        """torch.cuda.set_per_process_memory_fraction(0) makes limit_bytes 0: cuarena then reserves
        nothing more, so cacheInfo offers only the pool's largest free block (a `limit_bytes != 0`
        guard, meant for a device cuarena has not used, skipped the clamp here)."""
        r = self.run_cases()
        self.assertTrue(r["fraction 0"].endswith("fraction 0.000000"), r)
        self.assertEqual(r["fraction 0"], "largest 0 fraction 0.000000", r)
        self.assertEqual(r["fraction 0 with reserved"], f"largest {32 << 20} fraction 0.000000", r)


if __name__ == "__main__":
    unittest.main()
