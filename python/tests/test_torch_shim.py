"""The PyTorch shim's three builds (python/cuarena/torch_shim.cpp), without PyTorch: a stand-in
`torch` module whose directory holds c10 headers and a libc10.so made here, and, for the shim's
own allocator (level 2), stand-ins shaped like PyTorch 2.11's plug-in header, libtorch_cuda.so
and a libcudart.

- Headers that compile without the plug-in header: level 1, which says so
  (cuarena_torch_shim_level), warns what level 2 would add, and throws the c10 type for a failed
  allocation, checked by a C++ program that catches it.
- With the plug-in header: level 2, no warning, installed through cuarena_torch_install (from C++
  and from use()), answering the calls the plug-in refuses.
- Headers that do not compile: a RuntimeWarning, the shim built without them, and the failed
  build remembered, so the next start does not compile it again.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import unittest
import warnings

import cuarena
from cuarena import torch as glue

CXX = os.environ.get("CXX") or "c++"

# A stand-in for c10/util/Exception.h: the names the shim uses, with PyTorch's shapes (a class
# hierarchy rooted at std::exception whose constructors live in libc10.so).
_HEADER = r'''
#pragma once
#include <cstdint>
#include <exception>
#include <string>
namespace c10 {
struct SourceLocation { const char *function; const char *file; uint32_t line; };
class Error : public std::exception {
  public:
    Error(SourceLocation loc, std::string msg);
    const char *what() const noexcept override;
    const char *what_without_backtrace() const noexcept;
  private:
    std::string msg_;
};
class OutOfMemoryError : public Error { using Error::Error; };
}
#define C10_THROW_ERROR(err_type, msg) \
    throw ::c10::err_type({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg)
'''
_LIBC10 = r'''
#include <c10/util/Exception.h>
c10::Error::Error(SourceLocation, std::string msg) : msg_(std::move(msg)) {}
const char *c10::Error::what() const noexcept { return msg_.c_str(); }
const char *c10::Error::what_without_backtrace() const noexcept { return msg_.c_str(); }
'''
# Calls the shim's malloc with an impossible size and names the type it caught.
_CATCHER = r'''
#include <c10/util/Exception.h>
#include <cstdio>
#include <cstddef>
extern "C" void *cuarena_torch_malloc(size_t, int, void *);
int main() {
    try {
        cuarena_torch_malloc(size_t(1) << 60, 0, nullptr);
        std::puts("returned");
    } catch (c10::OutOfMemoryError &e) {
        std::printf("OutOfMemoryError: %s\n", e.what());
    } catch (c10::Error &e) {
        std::printf("Error: %s\n", e.what());
    } catch (std::exception &e) {
        std::printf("other: %s\n", e.what());
    }
    return 0;
}
'''


# Stand-ins for level 2 (the shim's own allocator): CUDA's runtime header, PyTorch's plug-in
# header with the shapes of PyTorch 2.11's (the methods the shim overrides and calls, DeviceStats),
# and a libtorch_cuda.so whose changeCurrentAllocator keeps the allocator for the test to call.
_CUDA_RUNTIME = r"""
#pragma once
#include <cstddef>
typedef struct CUstream_st *cudaStream_t;
enum cudaError { cudaSuccess = 0, cudaErrorInitializationError = 3 };
typedef enum cudaError cudaError_t;
extern "C" cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
extern "C" cudaError_t cudaGetLastError(void);
"""
# A CUDA runtime with no device: cudaMemGetInfo fails, and the error is left for cudaGetLastError.
_LIBCUDART = r"""
#include <cuda_runtime_api.h>
static cudaError_t last = cudaSuccess;
extern "C" cudaError_t cudaMemGetInfo(size_t *, size_t *) { return last = cudaErrorInitializationError; }
extern "C" cudaError_t cudaGetLastError(void) { cudaError_t e = last; last = cudaSuccess; return e; }
extern "C" int cudart_pending_error_for_test(void) { return last; }
"""
_PLUGGABLE_HEADER = r"""
#pragma once
#include <cuda_runtime_api.h>
#include <c10/util/Exception.h>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>
namespace c10 {
using DeviceIndex = int8_t;
enum class DeviceType : int8_t { CPU = 0, CUDA = 1 };
struct Device {
    Device(DeviceType t, DeviceIndex i) : type(t), index(i) {}
    DeviceType type;
    DeviceIndex index;
};
using DeleterFnPtr = void (*)(void *);
class DataPtr {
  public:
    DataPtr(void *data, void *ctx, DeleterFnPtr deleter, Device device)
        : data_(data), ctx_(ctx), deleter_(deleter), device_(device) {}
    void *get() const { return data_; }
    DeleterFnPtr get_deleter() const { return deleter_; }
    Device device() const { return device_; }
  private:
    void *data_;
    void *ctx_;
    DeleterFnPtr deleter_;
    Device device_;
};
namespace cuda {
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;
namespace CUDACachingAllocator {
struct CUDAAllocator;
struct AllocatorState { virtual ~AllocatorState() = default; };
struct CheckpointDelta {
    std::vector<void *> ptrs_freed;
    std::vector<c10::DataPtr> dataptrs_allocd;
};
}
}
namespace CachingDeviceAllocator {
struct Stat { int64_t current = 0, peak = 0, allocated = 0, freed = 0; };
using StatArray = std::array<Stat, 3>;
struct DeviceStats {
    StatArray allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
        inactive_split_bytes, requested_bytes;
    int64_t num_alloc_retries = 0, num_ooms = 0;
    Stat oversize_allocations, oversize_segments;
    int64_t num_sync_all_streams = 0, num_device_alloc = 0, num_device_free = 0, max_split_size = 0;
};
}
}
namespace torch::cuda::CUDAPluggableAllocator {
struct _AllocationMetadata {
    _AllocationMetadata();
    _AllocationMetadata(size_t size, c10::DeviceIndex device_idx, cudaStream_t stream);
    size_t size;
    c10::DeviceIndex device_idx;
    cudaStream_t stream{};
};
struct CUDAPluggableAllocator {
    CUDAPluggableAllocator(std::function<void *(size_t, int, cudaStream_t)> alloc_fn,
                           std::function<void(void *, size_t, int, cudaStream_t)> free_fn);
    virtual ~CUDAPluggableAllocator();
    void set_reset_fn(std::function<void()> f);
    void set_memory_fraction_fn(std::function<void(double, int)> f);
    void set_record_stream_fn(std::function<void(void *, cudaStream_t)> f);
    void set_begin_allocate_to_pool(
        std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> f);
    void set_end_allocate_to_pool_fn(std::function<void(int, c10::cuda::MempoolId_t)> f);
    void set_release_pool(std::function<void(int, c10::cuda::MempoolId_t)> f);
    // PyTorch 2.11's CUDAAllocator virtuals the shim answers (they throw in the plug-in).
    virtual void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                    std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator = nullptr);
    virtual bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                          const std::unordered_set<void *> &expected_live_allocations);
    virtual void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id, bool use_on_oom);
    virtual void setNoSplit(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id);
    virtual int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id);
    virtual void cacheInfo(c10::DeviceIndex device, size_t *largestBlock);
    virtual c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device);
    virtual void resetAccumulatedStats(c10::DeviceIndex device);
    virtual void resetPeakStats(c10::DeviceIndex device);
    virtual void init(int device_count);
    virtual double getMemoryFraction(c10::DeviceIndex device);  // PyTorch 2.11; absent before
    virtual std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
        c10::DeviceIndex device, c10::cuda::MempoolId_t id);
    virtual c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
        c10::DeviceIndex device, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps);
    c10::DeleterFnPtr raw_deleter() const;
    std::mutex allocator_mutex_;
    std::unordered_map<void *, _AllocationMetadata> allocation_metadata_;
    bool initialized_ = false;
    std::function<void *(size_t, int, cudaStream_t)> alloc_fn_;
    std::function<void(void *, size_t, int, cudaStream_t)> free_fn_;
    std::function<void()> reset_fn_;
    std::function<void(double, int)> memory_fraction_fn_;
    std::function<void(void *, cudaStream_t)> record_stream_fn_;
    std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> begin_allocate_to_pool_fn_;
    std::function<void(int, c10::cuda::MempoolId_t)> end_allocate_to_pool_fn_;
    std::function<void(int, c10::cuda::MempoolId_t)> release_pool_fn_;
};
void changeCurrentAllocator(const std::shared_ptr<CUDAPluggableAllocator> &allocator);
std::shared_ptr<CUDAPluggableAllocator> current_for_test();
_AllocationMetadata metadata_for_test(size_t size, c10::DeviceIndex device, cudaStream_t stream);
}
"""
_CUDA_FUNCTIONS = "#pragma once\n#include <cstdint>\nnamespace c10::cuda { inline int8_t device_count() noexcept { return 1; } }\n"
_LIBTORCH_CUDA = r"""
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <utility>
namespace torch::cuda::CUDAPluggableAllocator {
static std::shared_ptr<CUDAPluggableAllocator> current;
CUDAPluggableAllocator::CUDAPluggableAllocator(std::function<void *(size_t, int, cudaStream_t)> a,
                                               std::function<void(void *, size_t, int, cudaStream_t)> f)
    : alloc_fn_(std::move(a)), free_fn_(std::move(f)) {}
CUDAPluggableAllocator::~CUDAPluggableAllocator() = default;
void CUDAPluggableAllocator::set_reset_fn(std::function<void()> f) { reset_fn_ = std::move(f); }
void CUDAPluggableAllocator::set_memory_fraction_fn(std::function<void(double, int)> f) { memory_fraction_fn_ = std::move(f); }
void CUDAPluggableAllocator::set_record_stream_fn(std::function<void(void *, cudaStream_t)> f) { record_stream_fn_ = std::move(f); }
void CUDAPluggableAllocator::set_begin_allocate_to_pool(
    std::function<void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)> f) { begin_allocate_to_pool_fn_ = std::move(f); }
void CUDAPluggableAllocator::set_end_allocate_to_pool_fn(std::function<void(int, c10::cuda::MempoolId_t)> f) { end_allocate_to_pool_fn_ = std::move(f); }
void CUDAPluggableAllocator::set_release_pool(std::function<void(int, c10::cuda::MempoolId_t)> f) { release_pool_fn_ = std::move(f); }
void CUDAPluggableAllocator::createOrIncrefPool(c10::DeviceIndex, c10::cuda::MempoolId_t,
                                                std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>) {
    C10_THROW_ERROR(Error, "does not yet support createOrIncrefPool");
}
bool CUDAPluggableAllocator::checkPoolLiveAllocations(c10::DeviceIndex, c10::cuda::MempoolId_t, const std::unordered_set<void *> &) {
    C10_THROW_ERROR(Error, "does not yet support checkPoolLiveAllocations");
}
void CUDAPluggableAllocator::setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t, bool) { C10_THROW_ERROR(Error, "does not yet support setUseOnOOM"); }
void CUDAPluggableAllocator::setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) { C10_THROW_ERROR(Error, "does not yet support setNoSplit"); }
int CUDAPluggableAllocator::getPoolUseCount(c10::DeviceIndex, c10::cuda::MempoolId_t) { C10_THROW_ERROR(Error, "does not yet support getPoolUseCount"); }
void CUDAPluggableAllocator::init(int) { initialized_ = true; }
void CUDAPluggableAllocator::cacheInfo(c10::DeviceIndex, size_t *) { C10_THROW_ERROR(Error, "does not yet support cacheInfo"); }
c10::CachingDeviceAllocator::DeviceStats CUDAPluggableAllocator::getDeviceStats(c10::DeviceIndex) { C10_THROW_ERROR(Error, "does not yet support getDeviceStats"); }
void CUDAPluggableAllocator::resetAccumulatedStats(c10::DeviceIndex) { C10_THROW_ERROR(Error, "does not yet support resetAccumulatedStats"); }
void CUDAPluggableAllocator::resetPeakStats(c10::DeviceIndex) { C10_THROW_ERROR(Error, "does not yet support resetPeakStats"); }
double CUDAPluggableAllocator::getMemoryFraction(c10::DeviceIndex) { C10_THROW_ERROR(Error, "does not yet support getMemoryFraction"); }
// Hidden, as in PyTorch's libtorch_cuda (the struct is not exported): the shim must not call them.
__attribute__((visibility("hidden"))) _AllocationMetadata::_AllocationMetadata() : size(0), device_idx(0) {}
__attribute__((visibility("hidden"))) _AllocationMetadata::_AllocationMetadata(size_t s, c10::DeviceIndex d, cudaStream_t st)
    : size(s), device_idx(d), stream(st) {}
std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> CUDAPluggableAllocator::getCheckpointState(
    c10::DeviceIndex, c10::cuda::MempoolId_t) { C10_THROW_ERROR(Error, "does not yet support getCheckpointState"); }
c10::cuda::CUDACachingAllocator::CheckpointDelta CUDAPluggableAllocator::setCheckpointPoolState(
    c10::DeviceIndex, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState>) {
    C10_THROW_ERROR(Error, "does not yet support setCheckpointPoolState");
}
_AllocationMetadata metadata_for_test(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    return _AllocationMetadata(size, device, stream);
}
static void stand_in_raw_delete(void *) {}
c10::DeleterFnPtr CUDAPluggableAllocator::raw_deleter() const { return &stand_in_raw_delete; }
void changeCurrentAllocator(const std::shared_ptr<CUDAPluggableAllocator> &a) {
    if (current) C10_THROW_ERROR(Error, "Can't swap an already initialized allocator");
    current = a;
}
std::shared_ptr<CUDAPluggableAllocator> current_for_test() { return current; }
}
"""
# Installs the shim's allocator twice (the second is refused), then calls what PyTorch would.
_INSTALLER = r"""
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <algorithm>
#include <cstdio>
#include <cstring>
extern "C" int cuarena_torch_install(char *err, size_t n);
extern "C" int cuarena_peek_stats(int device, void *out);
extern "C" int cudart_pending_error_for_test(void);
extern "C" void *cuarena_malloc(size_t size, int device, void *stream);
extern "C" void cuarena_free(void *ptr, size_t size, int device, void *stream);
using namespace torch::cuda::CUDAPluggableAllocator;
template <class F> void call(const char *what, F f) {
    try { f(); std::printf("%s: returned\n", what); }
    catch (c10::OutOfMemoryError &e) { std::printf("%s: OutOfMemoryError: %s\n", what, e.what()); }
    catch (c10::Error &e) { std::printf("%s: Error: %s\n", what, e.what()); }
}
int main() {
    char err[256] = "untouched";
    std::printf("install: %d\n", cuarena_torch_install(err, sizeof err));
    std::printf("again: %d %s\n", cuarena_torch_install(err, sizeof err), err);
    auto a = current_for_test();
    std::printf("hooks: %d %d %d %d\n", bool(a->reset_fn_), bool(a->memory_fraction_fn_), bool(a->record_stream_fn_),
                a->initialized_);
    // Asked of a device cuarena has not used, the statistics are 0 and make no allocator.
    uint64_t raw[64] = {sizeof raw};
    std::printf("unused: %d\n", cuarena_peek_stats(0, raw));
    call("getDeviceStats unused", [&] { auto d = a->getDeviceStats(0); std::printf("%lld\n", (long long)d.reserved_bytes[0].current); });
    call("resetPeakStats unused", [&] { a->resetPeakStats(0); });
    std::printf("still unused: %d\n", cuarena_peek_stats(0, raw));
    void *p = cuarena_malloc(4096, 0, nullptr);  // makes device 0's allocator, on a GPU
    bool gpu = p != nullptr;
    raw[0] = sizeof raw;
    cuarena_peek_stats(0, raw);
    call("getDeviceStats", [&] {
        auto d = a->getDeviceStats(0);
        if (gpu) std::printf("live %lld = %llu, reserved %lld = %llu\n", (long long)d.allocated_bytes[0].current,
                             (unsigned long long)raw[1], (long long)d.reserved_bytes[0].current, (unsigned long long)raw[3]);
    });
    call("resetPeakStats", [&] { a->resetPeakStats(0); });
    call("resetAccumulatedStats", [&] { a->resetAccumulatedStats(0); });
    call("cacheInfo", [&] { size_t l = 0; a->cacheInfo(0, &l); if (gpu) std::printf("largest %zu\n", l); });
    call("getMemoryFraction", [&] { std::printf("fraction %.3f\n", a->getMemoryFraction(0)); });
    if (gpu) {  // the fraction reads cuarena's cap back (cacheInfo under it: test_shim_cap.py)
        a->memory_fraction_fn_(0.25, 0);
        call("getMemoryFraction quarter", [&] { std::printf("fraction %.3f\n", a->getMemoryFraction(0)); });
        a->memory_fraction_fn_(1.0, 0);
    }
    std::printf("cudart error left: %d\n", cudart_pending_error_for_test());
    // record_stream skips memory that is not cuarena's, as PyTorch's own allocator does.
    call("record_stream foreign", [&] { a->record_stream_fn_(reinterpret_cast<void *>(0x7000), nullptr); });
    call("record_stream", [&] { a->record_stream_fn_(p, nullptr); });
    call("malloc", [&] { a->alloc_fn_(size_t(1) << 60, 0, nullptr); });
    if (p != nullptr) cuarena_free(p, 4096, 0, nullptr);
    return 0;
}
"""


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _run_program(workdir, name, source, root, shim, libs=("-lc10",)):
    """Builds `source` (C++) as a program linked with `shim`, the stand-in torch at `root`
    (its lib/ `libs`) and this libcuarena.so, runs it, and returns the CompletedProcess."""
    prog = os.path.join(workdir, name)
    _write(prog + ".cpp", source)
    lib = os.path.realpath(cuarena.library_path())
    subprocess.run([CXX, "-std=c++17", f"-I{root}/include", f"-I{root}/cuda/include", prog + ".cpp", "-o", prog,
                    shim, f"-Wl,-rpath,{os.path.dirname(shim)}", f"-L{root}/lib", *libs,
                    f"-Wl,-rpath,{root}/lib", lib, f"-Wl,-rpath,{os.path.dirname(lib)}"],
                   check=True, capture_output=True)
    return subprocess.run([prog], capture_output=True, text=True, timeout=600)


def _fake_torch(root, header, pluggable=False):
    """A stand-in torch module rooted at `root`, with `header` as c10/util/Exception.h and a
    libc10.so built from _LIBC10 against the working header; with `pluggable`, also the plug-in
    header, libtorch_cuda.so and libc10_cuda.so of level 2 (CUDA's header: `root`/cuda/include,
    for CUDA_HOME)."""
    _write(os.path.join(root, "include", "c10", "util", "Exception.h"), _HEADER)
    _write(os.path.join(root, "libc10.cpp"), _LIBC10)
    os.makedirs(os.path.join(root, "lib"))
    lib = os.path.join(root, "lib")
    subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", f"-I{root}/include", os.path.join(root, "libc10.cpp"),
                    "-o", os.path.join(lib, "libc10.so")], check=True, capture_output=True)
    if pluggable:
        _write(os.path.join(root, "cuda", "include", "cuda_runtime_api.h"), _CUDA_RUNTIME)
        # "before 2.11": PyTorch's plug-in without getMemoryFraction, which the shim must not need.
        drop = (lambda t: "\n".join(l for l in t.splitlines() if "getMemoryFraction" not in l)) \
            if pluggable == "before 2.11" else (lambda t: t)
        _write(os.path.join(root, "include", "torch", "csrc", "cuda", "CUDAPluggableAllocator.h"), drop(_PLUGGABLE_HEADER))
        _write(os.path.join(root, "include", "c10", "cuda", "CUDAFunctions.h"), _CUDA_FUNCTIONS)
        _write(os.path.join(root, "libtorch_cuda.cpp"), drop(_LIBTORCH_CUDA))
        _write(os.path.join(root, "empty.cpp"), "")
        inc = [f"-I{root}/include", f"-I{root}/cuda/include"]
        subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", *inc, os.path.join(root, "libtorch_cuda.cpp"),
                        "-o", os.path.join(lib, "libtorch_cuda.so"), f"-L{lib}", "-lc10"], check=True, capture_output=True)
        subprocess.run([CXX, "-shared", "-fPIC", os.path.join(root, "empty.cpp"), "-o", os.path.join(lib, "libc10_cuda.so")],
                       check=True, capture_output=True)
        # Named as a CUDA runtime is, and loaded into this process as PyTorch's would be.
        _write(os.path.join(root, "libcudart.cpp"), _LIBCUDART)
        subprocess.run([CXX, "-shared", "-fPIC", *inc, os.path.join(root, "libcudart.cpp"),
                        "-o", os.path.join(lib, "libcudart.so.99")], check=True, capture_output=True)
        ctypes.CDLL(os.path.join(lib, "libcudart.so.99"))
    _write(os.path.join(root, "include", "c10", "util", "Exception.h"), header)
    return types.SimpleNamespace(__file__=os.path.join(root, "__init__.py"),
                                 _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))


def _use_stand_in(root, body, **env):
    """Runs `body` in a fresh interpreter where `torch` is the stand-in at `root` (with
    _fake_torch's pluggable parts: its libcudart loaded, as PyTorch's import maps it, and the
    Python plug-in path refused, so only the shim's own allocator can be installed); `env` is
    added to the environment. Returns the CompletedProcess."""
    prelude = f"""
import ctypes, os, sys, types, warnings
ctypes.CDLL({os.path.join(root, "lib", "libcudart.so.99")!r})
torch = types.ModuleType("torch")
torch.__file__ = {os.path.join(root, "__init__.py")!r}
torch.__version__ = "0.0-stand-in"
torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
torch.cuda = types.ModuleType("torch.cuda")
torch.cuda.memory = types.ModuleType("torch.cuda.memory")
torch.cuda.memory._get_current_allocator = lambda: "the current allocator"
def refuse(*a):
    raise AssertionError("the Python plug-in path was taken")
torch.cuda.memory.CUDAPluggableAllocator = torch.cuda.memory.change_current_allocator = refuse
sys.modules.update({{"torch": torch, "torch.cuda": torch.cuda, "torch.cuda.memory": torch.cuda.memory}})
"""
    env = dict(os.environ, CUDA_HOME=os.path.join(root, "cuda"), **env)
    return subprocess.run([sys.executable, "-c", prelude + body], capture_output=True, text=True, env=env,
                          timeout=600)


@unittest.skipIf(shutil.which(CXX) is None, "no C++ compiler")
class TorchShim(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.old_cache = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = os.path.join(self.dir, "cache")

    def tearDown(self):
        if self.old_cache is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = self.old_cache
        shutil.rmtree(self.dir)

    def test_with_headers_that_compile_out_of_memory_throws_the_c10_type(self):
        torch = _fake_torch(os.path.join(self.dir, "torch"), _HEADER)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            shim, level = glue._checked_shim(torch)
        self.assertEqual(level, 1, shim)
        # The stand-in has no allocator header: one warning says what that loses, and why.
        msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
        self.assertEqual(len(msgs), 1, msgs)
        self.assertIn("without its own PyTorch allocator", msgs[0])
        self.assertIn("CUDAPluggableAllocator.h", msgs[0])
        self.assertNotIn("not torch.OutOfMemoryError", msgs[0])
        plain, plain_level = glue._checked_shim()  # without torch: the other build, its own file
        self.assertNotEqual(plain, shim)
        self.assertEqual(plain_level, 0)

        out = _run_program(self.dir, "catcher", _CATCHER, os.path.join(self.dir, "torch"), shim).stdout
        # 2^60 bytes: out of memory on a GPU; without a driver, cuarena's "no CUDA driver" error.
        try:
            cuarena.stats(0)
            gpu = True
        except cuarena.CuarenaError:
            gpu = False
        if gpu:
            self.assertTrue(out.startswith("OutOfMemoryError: CUDA out of memory. cuarena: out of memory: "), out)
        else:
            self.assertTrue(out.startswith("Error: cuarena: cannot allocate"), out)
            self.assertIn("no CUDA driver", out)

    def test_use_installs_the_shims_own_allocator_through_its_c_entry_point(self):
        """cuarena.torch.use() at level 2, in a fresh interpreter with the stand-in torch: the
        allocator is made and installed by cuarena_torch_install (the stand-in's
        changeCurrentAllocator keeps it), with every hook and no warning; a second use() is the
        first's result."""
        root = os.path.join(self.dir, "torch")
        # A PyTorch before 2.11, whose plug-in has no getMemoryFraction: still level 2.
        _fake_torch(root, _HEADER, pluggable="before 2.11")
        r = _use_stand_in(root, """
warnings.simplefilter("error")
import cuarena.torch
inst = cuarena.torch.use()
assert inst is cuarena.torch.use()
print(inst.torch_stats, inst.oom_error, ",".join(inst.hooks_installed), inst.hooks_missing, inst.allocator)
""")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.strip(), "True torch.OutOfMemoryError set_record_stream_fn,set_reset_fn,"
                                           "set_memory_fraction_fn () the current allocator", r.stderr)

    def test_with_the_plugin_header_the_shims_own_allocator_answers_what_the_plugin_refuses(self):
        root = os.path.join(self.dir, "torch")
        torch = _fake_torch(root, _HEADER, pluggable=True)
        old = os.environ.get("CUDA_HOME")
        os.environ["CUDA_HOME"] = os.path.join(root, "cuda")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no step down, no warning
                shim, level = glue._checked_shim(torch)
        finally:
            if old is None:
                del os.environ["CUDA_HOME"]
            else:
                os.environ["CUDA_HOME"] = old
        self.assertEqual(level, 2, shim)
        out = _run_program(self.dir, "installer", _INSTALLER, root, shim,
                           ("-ltorch_cuda", "-lc10", os.path.join(root, "lib", "libcudart.so.99"))).stdout
        lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
        self.assertEqual(lines.get("install"), "0", out)
        self.assertTrue(lines.get("again", "").startswith("-1 Can't swap"), out)  # PyTorch's refusal, passed on
        self.assertEqual(lines.get("hooks"), "1 1 1 1", out)  # and init() called, as PyTorch's own does
        try:
            cuarena.stats(0)
            gpu = True
        except cuarena.CuarenaError:
            gpu = False
        # Answered by cuarena, never the plug-in's refusal, and without making an allocator for a
        # device cuarena has not used (1: none; its figures 0).
        self.assertEqual((lines.get("unused"), lines.get("still unused")), ("1", "1"), out)
        self.assertEqual(lines.get("getDeviceStats unused"), "returned", out)
        self.assertEqual(lines.get("resetPeakStats unused"), "returned", out)
        self.assertIn("\n0\ngetDeviceStats unused: returned", out)
        for call in ("getDeviceStats", "resetPeakStats", "resetAccumulatedStats", "cacheInfo", "getMemoryFraction"):
            self.assertEqual(lines.get(call), "returned", out)
        # cacheInfo's failed cudaMemGetInfo leaves no error for PyTorch's next check.
        self.assertEqual(lines.get("cudart error left"), "0", out)
        self.assertEqual((lines.get("record_stream foreign"), lines.get("record_stream")), ("returned", "returned"), out)
        self.assertIn("fraction 1.000\n", out)  # PyTorch's default, not the plug-in's refusal
        if gpu:
            self.assertIn("fraction 0.250\n", out)
        if gpu:  # PyTorch's figures are cuarena's
            m = re.search(r"live (\d+) = (\d+), reserved (\d+) = (\d+)", out)
            self.assertTrue(m and m[1] == m[2] and m[3] == m[4], out)
        self.assertTrue(lines.get("malloc", "").startswith("OutOfMemoryError: CUDA out of memory." if gpu
                                                           else "Error: cuarena: cannot allocate"), out)

    def test_an_old_level2_prebuilt_shim_warns_that_record_stream_refusals_do_not_raise(self):
        """CUARENA_TORCH_SHIM naming a level-2 shim built from the source before e20ca0f (no
        cuarena_torch_record_stream): its own allocator keeps the old hook, whose refusals never
        reach PyTorch, and use() says so as it does at levels 0 and 1 (helper-16 found it
        silent)."""
        repo = os.environ.get("CUARENA_TEST_REPO") or os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        old = subprocess.run(["git", "-C", repo, "show", "e20ca0f~1:python/cuarena/torch_shim.cpp"],
                             capture_output=True)
        if old.returncode != 0:
            self.skipTest("the repository's history is not at hand: " + old.stderr.decode(errors="replace"))
        root = os.path.join(self.dir, "torch")
        torch = _fake_torch(root, _HEADER, pluggable=True)
        old_src = os.path.join(self.dir, "torch_shim.cpp")
        with open(old_src, "wb") as f:
            f.write(old.stdout)
        os.environ["CUDA_HOME"] = os.path.join(root, "cuda")
        real = glue._SHIM_SOURCE
        glue._SHIM_SOURCE = old_src
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                old_shim, level = glue._checked_shim(torch)
        finally:
            glue._SHIM_SOURCE = real
            del os.environ["CUDA_HOME"]
        self.assertEqual(level, 2)
        r = _use_stand_in(root, """
import cuarena.torch
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    cuarena.torch.use()
print("WARNED" if any("cuarena_torch_record_stream" in str(x.message) for x in w) else "SILENT")
""", CUARENA_TORCH_SHIM=old_shim)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.strip().splitlines()[-1], "WARNED",
                         "level 2 with a pre-e20ca0f shim installs the silent hook without a warning")

    def test_headers_that_do_not_compile_fall_back_with_a_warning_and_are_not_tried_again(self):
        torch = _fake_torch(os.path.join(self.dir, "torch"), '#error "not this PyTorch"\n')
        calls = []
        real_run = glue.subprocess.run

        def counted(cmd, **kw):
            calls.append(cmd)
            return real_run(cmd, **kw)

        glue.subprocess.run = counted
        try:
            for start in range(2):
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    shim, level = glue._checked_shim(torch)
                self.assertEqual(level, 0)
                msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
                self.assertEqual(len(msgs), 1, msgs)
                self.assertIn("not torch.OutOfMemoryError", msgs[0])
                self.assertIn("not this PyTorch", msgs[0])  # the compiler's reason
                ctypes.CDLL(shim)  # loads
                if start == 0:
                    # C++20 and C++17 with the headers, then without them.
                    self.assertEqual(len(calls), 3, calls)
                    self.assertTrue(all("-DCUARENA_C10" in c for c in calls[:2]), calls)
                    self.assertNotIn("-DCUARENA_C10", calls[2])
            self.assertEqual(len(calls), 3, "the second start compiled again")
        finally:
            glue.subprocess.run = real_run


if __name__ == "__main__":
    unittest.main()
