// PyTorch's CUDAPluggableAllocator does not check the pointer its malloc hook returns: a NULL
// from cuarena_malloc (out of memory, or any other failure) would become a tensor whose
// data_ptr() is 0. This shim turns that NULL into a C++ exception, which PyTorch raises in
// Python.
//
// Three builds of this one file; python/cuarena/torch.py compiles it on first use and keeps the
// first of these that builds:
// - CUARENA_TORCH_ALLOCATOR (with CUARENA_C10), against PyTorch's headers, CUDA's runtime
//   headers and libtorch_cuda: cuarena_torch_install() makes a CUDAPluggableAllocator of its
//   own PyTorch's allocator, whose statistics calls PyTorch's plug-in refuses are answered from
//   cuarena's: getDeviceStats (torch.cuda.memory_allocated, max_memory_allocated,
//   memory_stats, memory_summary), resetPeakStats, resetAccumulatedStats, getMemoryFraction
//   (torch.cuda.get_per_process_memory_fraction), and cacheInfo (cuDNN's benchmark asks it how
//   large a workspace to try; the plug-in's refusal failed every benchmarked convolution under
//   autocast). CUDA graphs: a capture's allocations go to cuarena's graph pools (PyTorch's
//   private pools: torch.cuda.graph, make_graphed_callables, MemPool, and graph trees'
//   checkPoolLiveAllocations, getCheckpointState and setCheckpointPoolState, which
//   torch.compile's reduce-overhead mode uses). At every level PyTorch's record_stream hook is
//   cuarena_torch_record_stream, which raises where cuarena cannot keep the declaration.
// - CUARENA_C10 alone, against PyTorch's headers and libc10: the plug-in is made from Python;
//   out of memory throws c10::OutOfMemoryError, the type PyTorch's caching allocator throws.
//   Python sees torch.OutOfMemoryError (torch.cuda.OutOfMemoryError), and PyTorch's C++
//   fallbacks that catch that type run (cuDNN's convolution retries with a smaller workspace,
//   for one). Other failures throw c10::Error, a RuntimeError in Python.
// - Neither (no PyTorch headers, or they did not compile): std::runtime_error for every
//   failure, a RuntimeError in Python whose message starts "CUDA out of memory." when out of
//   memory, as PyTorch's own message does (code that retries with a smaller batch looks for it).
//
// cuarena's functions are resolved from libcuarena.so (linked with -l and an rpath); streams
// are void* here, the same size as cudaStream_t.

#include <cstddef>
#include <stdexcept>
#include <string>

#ifdef CUARENA_C10
#include <c10/util/Exception.h>
#endif

extern "C" {
void *cuarena_malloc(size_t size, int device, void *stream);
int cuarena_free_or_hold(void *ptr, size_t size, int device, void *stream);
int cuarena_record_stream_checked(void *ptr, void *stream);
const char *cuarena_last_error(void);
}

// Throws for an allocation of `size` bytes that failed (NULL): out of memory as PyTorch's own
// allocator does, anything else as an error with cuarena's reason.
[[noreturn]] static void throw_alloc_failure(size_t size, int device) {
    const char *e = cuarena_last_error();
    std::string why = e != nullptr ? e : "no reason recorded";
    // cuarena's Error::OutOfMemory displays as "out of device memory: ..." (src/error.rs).
    bool oom = why.rfind("out of device memory", 0) == 0;
    std::string what = oom ? "CUDA out of memory. cuarena: out of memory: " : "cuarena: ";
    what += "cannot allocate " + std::to_string(size) + " bytes on CUDA device " + std::to_string(device) + ": " + why;
#ifdef CUARENA_C10
    if (oom) {
        C10_THROW_ERROR(OutOfMemoryError, what);
    }
    C10_THROW_ERROR(Error, what);
#else
    throw std::runtime_error(what);
#endif
}

extern "C" void *cuarena_torch_malloc(size_t size, int device, void *stream) {
    void *p = cuarena_malloc(size, device, stream);
    if (p == nullptr && size > 0) {
        throw_alloc_failure(size, device);
    }
    return p;
}

// PyTorch's deleter cannot free again, and its streams are pooled (never destroyed; a
// torch.cuda.ExternalStream is the program's, and must outlive the captures): a free that
// a CUDA graph capture refuses (its stream, or a record_stream stream, being captured; or the
// legacy stream it needs while a capture is announced) is held by cuarena and made again when
// the capture ends (endAllocateToPool: cuarena_graph_capture_end) or at the next empty_cache,
// as PyTorch's own allocator frees such a block rather than lose it. Any other refusal is
// cuarena's to count and report (cuarena_last_error); the block stays live.
extern "C" void cuarena_torch_free(void *ptr, size_t size, int device, void *stream) {
    (void)cuarena_free_or_hold(ptr, size, device, stream);
}

// PyTorch's record_stream hook. A pointer outside cuarena's memory is skipped, as PyTorch's own
// allocator skips blocks it did not allocate (shared from another process, from DLPack). A
// declaration cuarena refuses (past its caps, include/cuarena.h) throws: the block's free would
// not wait for that stream, and Tensor.record_stream raises a RuntimeError instead of letting the
// block be reused under the stream's work.
extern "C" void cuarena_torch_record_stream(void *ptr, void *stream) {
    if (cuarena_record_stream_checked(ptr, stream) >= 0) {
        return;
    }
    const char *e = cuarena_last_error();
    std::string what = std::string("cuarena: record_stream not honoured (the block's free would not wait for that stream's "
                                   "work; keep the tensor alive until the stream is done): ") +
                       (e != nullptr ? e : "no reason recorded");
#ifdef CUARENA_C10
    C10_THROW_ERROR(Error, what);
#else
    throw std::runtime_error(what);
#endif
}

// The cuarena_malloc this shim calls, so the Python side can check that the shim and its own
// ctypes handle use one and the same copy of libcuarena.so (one allocator per device).
extern "C" void *cuarena_torch_target(void) { return reinterpret_cast<void *>(&cuarena_malloc); }

// What this build is: 2 with CUARENA_TORCH_ALLOCATOR (cuarena_torch_install exists), 1 with
// CUARENA_C10 alone (out of memory throws c10::OutOfMemoryError), 0 without either.
extern "C" int cuarena_torch_shim_level(void) {
#if defined(CUARENA_TORCH_ALLOCATOR)
    return 2;
#elif defined(CUARENA_C10)
    return 1;
#else
    return 0;
#endif
}

#ifdef CUARENA_TORCH_ALLOCATOR
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

extern "C" {
// include/cuarena.h's cuarena_stats: a leading size, then these counters in this order (the
// struct only grows at its end; a library that fills fewer sets `size` so).
struct cuarena_stats_v2 {
    uint64_t size, live_bytes, peak_live_bytes, reserved_bytes, peak_reserved_bytes, pool_in_use_bytes,
        largest_free_block, free_extents, allocations, deallocations, cross_thread_frees, cross_stream_frees,
        fences_recorded, fence_waits, fence_polls, driver_calls, host_syncs, invalid_frees, superblocks_taken,
        superblocks_returned, superblocks_dissolved, arena_held_bytes, arenas, arena_allocations, pool_allocations,
        large_allocations, peak_live_bytes_upper, peak_exact, alloc_retries, ooms, oom_hook_calls, limit_bytes,
        device_total_bytes;
};
int cuarena_peek_stats(int device, cuarena_stats_v2 *out);
int cuarena_graph_pool_retain(uint64_t id_a, uint64_t id_b, int device);
int cuarena_graph_pool_release(uint64_t id_a, uint64_t id_b, int device);
void *cuarena_graph_malloc(uint64_t id_a, uint64_t id_b, size_t size, int device, void *stream);
int cuarena_graph_pool_live(uint64_t id_a, uint64_t id_b, int device, void **out, size_t n, size_t *count);
int64_t cuarena_graph_pool_use_count(uint64_t id_a, uint64_t id_b, int device);
int cuarena_graph_capture_begin(int device);
int cuarena_graph_capture_end(int device);
struct cuarena_graph_checkpoint;
cuarena_graph_checkpoint *cuarena_graph_pool_checkpoint(uint64_t id_a, uint64_t id_b, int device);
ptrdiff_t cuarena_graph_checkpoint_blocks(const cuarena_graph_checkpoint *c, void **ptrs, size_t *sizes, size_t n);
void cuarena_graph_checkpoint_free(cuarena_graph_checkpoint *c);
int cuarena_graph_pool_restore(const cuarena_graph_checkpoint *c, void **freed, size_t n, size_t *count);
int cuarena_reset_peak(int device);
int cuarena_reset_counters(int device);
void cuarena_empty_cache(void);
void cuarena_set_memory_fraction(double fraction, int device);
}

namespace {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using Metadata = torch::cuda::CUDAPluggableAllocator::_AllocationMetadata;
namespace cca = c10::cuda::CUDACachingAllocator;

// cuarena's statistics of `device` (all 0 for a device cuarena has not used: asking makes no
// allocator and no CUDA context there), or c10::Error with cuarena's reason. `*used` says
// whether cuarena has an allocator for `device`.
cuarena_stats_v2 read_stats(int device, bool *used = nullptr) {
    cuarena_stats_v2 s{};
    s.size = sizeof s;
    const int r = cuarena_peek_stats(device, &s);
    if (used != nullptr) {
        *used = r == 0;
    }
    if (r != 0 && r != 1) {
        const char *e = cuarena_last_error();
        C10_THROW_ERROR(Error, std::string("cuarena: statistics of CUDA device ") + std::to_string(device) +
                                   " unavailable: " + (e != nullptr ? e : "no reason recorded"));
    }
    return s;
}

// Whether the library filled `field` of `s` (one older than this shim fills fewer, and says so
// in `size`).
bool filled(const cuarena_stats_v2 &s, const uint64_t *field) {
    return static_cast<size_t>(reinterpret_cast<const char *>(field + 1) - reinterpret_cast<const char *>(&s)) <=
           s.size;
}

int64_t i64(uint64_t v) { return static_cast<int64_t>(std::min<uint64_t>(v, INT64_MAX)); }

void check(int r, const char *what, int device) {
    if (r != 0) {
        const char *e = cuarena_last_error();
        C10_THROW_ERROR(Error, std::string("cuarena: ") + what + " of CUDA device " + std::to_string(device) +
                                   " failed: " + (e != nullptr ? e : "no reason recorded"));
    }
}

// CUDA graph pools (cuarena's src/graph_pool.rs; include/cuarena.h). PyTorch routes a capture's
// allocations to a private pool: beginAllocateToPool(device, pool, filter) before the capture,
// endAllocateToPool after it, releasePool when a graph using the pool is destroyed (and
// createOrIncrefPool / releasePool for a torch.cuda.MemPool). While a route is open, an
// allocation whose stream the filter accepts (PyTorch's: the stream is in that capture) goes to
// cuarena_graph_malloc; every other allocation takes the ordinary path. Frees need nothing here:
// cuarena finds a pool's block by its address.
struct Route {
    int device;
    c10::cuda::MempoolId_t pool;
    std::function<bool(cudaStream_t)> filter;
};

struct Routes {
    std::mutex m;
    std::vector<Route> open;  // under m
    // open.size(), read without the lock: 0 lets every allocation skip the lock. Written under
    // m; an allocation racing a begin may miss a route opened by another thread for a capture
    // it is not part of, or see one being closed, whose filter then answers for itself.
    std::atomic<size_t> count{0};

    // The pool an allocation of `stream` on `device` goes to, if any.
    bool route(int device, cudaStream_t stream, c10::cuda::MempoolId_t *pool) {
        if (count.load(std::memory_order_acquire) == 0) {
            return false;
        }
        std::lock_guard<std::mutex> g(m);
        for (const Route &r : open) {
            if (r.device == device && r.filter(stream)) {
                *pool = r.pool;
                return true;
            }
        }
        return false;
    }
};

void *route_malloc(Routes &routes, size_t size, int device, cudaStream_t stream) {
    c10::cuda::MempoolId_t pool;
    if (size == 0 || !routes.route(device, stream, &pool)) {
        return cuarena_torch_malloc(size, device, reinterpret_cast<void *>(stream));
    }
    void *p = cuarena_graph_malloc(pool.first, pool.second, size, device, reinterpret_cast<void *>(stream));
    if (p == nullptr) {
        throw_alloc_failure(size, device);
    }
    return p;
}

void retain_pool(int device, c10::cuda::MempoolId_t pool) {
    if (cuarena_graph_pool_retain(pool.first, pool.second, device) != 0) {
        const char *e = cuarena_last_error();
        C10_THROW_ERROR(Error, std::string("cuarena: graph pool of CUDA device ") + std::to_string(device) +
                                   " unavailable: " + (e != nullptr ? e : "no reason recorded"));
    }
}

// A graph pool's checkpoint (getCheckpointState): cuarena's, and for each of its blocks what the
// plug-in's bookkeeping said of it then (the size asked, the stream), which a restore puts back:
// the block's deleter frees it with them.
struct Checkpoint : cca::AllocatorState {
    cuarena_graph_checkpoint *c = nullptr;
    c10::DeviceIndex device = 0;
    std::vector<std::pair<void *, Metadata>> blocks;
    ~Checkpoint() override { cuarena_graph_checkpoint_free(c); }
};

// PyTorch's plug-in with the statistics calls answered from cuarena's (the file's comment).
// Only fields with a cuarena counterpart are set; the rest stay 0.
class CuarenaAllocator : public Pluggable {
  public:
    using Pluggable::Pluggable;

    // How large a block could be had now: the device's free memory (PyTorch's caching allocator
    // starts from it too) or the pool's largest free block, whichever is larger. cuDNN's
    // benchmark tries workspaces up to it; one that then fails is out of memory, which it
    // catches (c10::OutOfMemoryError) and tries the next.
    void cacheInfo(c10::DeviceIndex device, size_t *largest) override {
        size_t free_bytes = 0, total = 0;
        // PyTorch's own libcudart (torch.py links the one loaded in the process), on the device
        // PyTorch made current for this call.
        if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
            free_bytes = 0;
            (void)cudaGetLastError();  // leave no error behind for the caller's next check
        }
        bool used = false;
        const cuarena_stats_v2 s = read_stats(device, &used);
        // A cap of 0 (PyTorch's fraction 0) is a cap: only an unused device has none yet.
        if (used && filled(s, &s.limit_bytes)) {
            // No more than cuarena's cap lets it reserve (CUARENA_CONF max, the memory fraction).
            free_bytes = std::min<uint64_t>(free_bytes, s.limit_bytes - std::min(s.limit_bytes, s.reserved_bytes));
        }
        *largest = std::max({*largest, free_bytes, static_cast<size_t>(s.largest_free_block)});
    }

    // torch.cuda.get_per_process_memory_fraction: cuarena's cap over the device's total (1 for a
    // device cuarena has not used yet, PyTorch's default, whatever CUARENA_CONF's max will make
    // it). Declared without `override`: it overrides the virtual of the PyTorch versions that
    // have one (2.11 does; its plug-in refuses it) and is a method of this class alone in older
    // ones, which then still build at this level.
    double getMemoryFraction(c10::DeviceIndex device) {
        bool used = false;
        const cuarena_stats_v2 s = read_stats(device, &used);
        if (!used || !filled(s, &s.device_total_bytes) || s.device_total_bytes == 0) {
            return 1.0;
        }
        return std::min(1.0, static_cast<double>(s.limit_bytes) / static_cast<double>(s.device_total_bytes));
    }

    auto getDeviceStats(c10::DeviceIndex device) -> decltype(std::declval<Pluggable &>().getDeviceStats(device)) override {
        const cuarena_stats_v2 s = read_stats(device);
        decltype(std::declval<Pluggable &>().getDeviceStats(device)) d{};
        // [0]: every pool; [1]: the small pool, here the arenas; [2]: the large pool, here the
        // global pool (cuarena counts allocations per path, not bytes).
        d.allocated_bytes[0].current = i64(s.live_bytes);
        d.allocated_bytes[0].peak = i64(s.peak_live_bytes);
        d.active_bytes[0] = d.allocated_bytes[0];
        d.reserved_bytes[0].current = i64(s.reserved_bytes);
        d.reserved_bytes[0].peak = i64(s.peak_reserved_bytes);
        // Counts since the last reset; cuarena keeps no count of live blocks, so no current or
        // peak. Small: the arenas' small blocks; large: the pool's and the arenas' large ones.
        d.allocation[0].allocated = i64(s.allocations);
        d.allocation[0].freed = i64(s.deallocations);
        d.allocation[1].allocated = i64(s.arena_allocations - std::min(s.large_allocations, s.arena_allocations));
        d.allocation[2].allocated = i64(s.pool_allocations + s.large_allocations);
        d.num_alloc_retries = i64(s.alloc_retries);
        d.num_ooms = i64(s.ooms);
        d.num_sync_all_streams = i64(s.host_syncs);
        return d;
    }

    void resetAccumulatedStats(c10::DeviceIndex device) override {
        reset_if_used(device, cuarena_reset_counters, "reset_counters");
    }

    void resetPeakStats(c10::DeviceIndex device) override { reset_if_used(device, cuarena_reset_peak, "reset_peak"); }

    // torch.cuda.MemPool: one more user of the pool (its destructor's releasePool balances it).
    // A MemPool with an allocator of its own (ncclMemAlloc, say) is refused: its memory would
    // be cuarena's. These four are declared without `override`, as getMemoryFraction, for
    // PyTorch versions without them.
    void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t pool,
                            std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator = nullptr) {
        if (allocator != nullptr) {
            C10_THROW_ERROR(Error, "cuarena: a torch.cuda.MemPool with an allocator of its own is not supported "
                                   "while cuarena is PyTorch's allocator");
        }
        retain_pool(device, pool);
    }

    // MemPool(use_on_oom=True) would lend the pool's memory to other allocations when out of
    // memory; cuarena does not, and refuses it in the constructor. False (what ~MemPool says)
    // is what cuarena does: accepted, and never throws (a destructor calls it).
    void setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t, bool use_on_oom) {
        if (use_on_oom) {
            C10_THROW_ERROR(Error, "cuarena: MemPool(use_on_oom=True) is not supported: cuarena does not lend a "
                                   "pool's memory to other allocations");
        }
    }

    // MemPool(no_split=True): cuarena splits segments in every pool, so it refuses this.
    void setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) {
        C10_THROW_ERROR(Error, "cuarena: MemPool(no_split=True) is not supported: cuarena splits a pool's segments");
    }

    // MemPool.use_count().
    int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) {
        const int64_t n = cuarena_graph_pool_use_count(pool.first, pool.second, device);
        check(n < 0 ? -1 : 0, "graph_pool_use_count", device);
        return static_cast<int>(std::min<int64_t>(n, INT32_MAX));
    }

    // CUDA graph trees (torch.compile's reduce-overhead mode) ask whether a pool's live blocks
    // are exactly the tensors they expect. Declared without `override`, as above.
    bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t pool,
                                  const std::unordered_set<void *> &expected) {
        size_t count = 0;
        check(cuarena_graph_pool_live(pool.first, pool.second, device, nullptr, 0, &count), "graph_pool_live", device);
        if (count != expected.size()) {
            return false;
        }
        std::vector<void *> live(count);
        check(cuarena_graph_pool_live(pool.first, pool.second, device, live.data(), live.size(), &count),
              "graph_pool_live", device);
        return count == live.size() &&
               std::all_of(live.begin(), live.end(), [&](void *p) { return expected.count(p) != 0; });
    }

    // CUDA graph trees (torch.compile's reduce-overhead mode) checkpoint a pool after each
    // recording and restore it to record a new graph after replaying others (cuarena's
    // graph_pool.rs states the rule).
    std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                            c10::cuda::MempoolId_t id) override {
        auto st = std::make_shared<Checkpoint>();
        st->device = device;
        st->c = cuarena_graph_pool_checkpoint(id.first, id.second, device);
        check(st->c == nullptr ? -1 : 0, "graph pool checkpoint", device);
        const ptrdiff_t n = cuarena_graph_checkpoint_blocks(st->c, nullptr, nullptr, 0);
        check(n < 0 ? -1 : 0, "graph pool checkpoint", device);
        std::vector<void *> ptrs(static_cast<size_t>(n));
        std::vector<size_t> sizes(ptrs.size());  // the bookkeeping's own sizes are kept
        cuarena_graph_checkpoint_blocks(st->c, ptrs.data(), sizes.data(), ptrs.size());
        std::lock_guard<std::mutex> g(allocator_mutex_);
        for (void *p : ptrs) {
            auto it = allocation_metadata_.find(p);
            // Every block of a pool comes through this plug-in's malloc, which keeps its entry
            // (PyTorch does not export _AllocationMetadata's constructors: none can be made
            // here). One without (freed by PyTorch, its free refused by cuarena) is refused: its
            // restored tensor's deleter would throw.
            if (it == allocation_metadata_.end()) {
                C10_THROW_ERROR(Error, "cuarena: getCheckpointState: a live block of the graph pool was not allocated "
                                       "through PyTorch's allocator");
            }
            st->blocks.emplace_back(p, it->second);
        }
        return st;
    }

    // Frees every block of the checkpoint's pool (PyTorch's ptrs_freed) and makes the
    // checkpoint's blocks live again (dataptrs_allocd, each with this plug-in's deleter), and
    // keeps the plug-in's bookkeeping in step. A refusal throws and changes nothing.
    cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) override {
        auto st = std::dynamic_pointer_cast<Checkpoint>(pps);
        if (st == nullptr || st->device != device) {
            C10_THROW_ERROR(Error, std::string("cuarena: setCheckpointPoolState: not a checkpoint cuarena took of CUDA "
                                               "device ") + std::to_string(device));
        }
        cca::CheckpointDelta d;
        d.dataptrs_allocd.reserve(st->blocks.size());
        std::vector<void *> freed(16);
        size_t count = 0;
        for (;;) {
            const int r = cuarena_graph_pool_restore(st->c, freed.data(), freed.size(), &count);
            if (r != 1) {
                check(r, "graph pool restore", device);
                break;
            }
            freed.resize(count + 16);  // more blocks live than room: nothing changed, so again
        }
        freed.resize(count);
        std::lock_guard<std::mutex> g(allocator_mutex_);
        for (void *p : freed) {
            allocation_metadata_.erase(p);
        }
        for (const auto &b : st->blocks) {
            allocation_metadata_.insert_or_assign(b.first, b.second);
            d.dataptrs_allocd.emplace_back(b.first, b.first, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
        }
        d.ptrs_freed = std::move(freed);
        return d;
    }

  private:
    // A device cuarena has not used has nothing to reset (and resetting would make its
    // allocator, and a CUDA context there).
    static void reset_if_used(c10::DeviceIndex device, int (*reset)(int), const char *what) {
        bool used = false;
        read_stats(device, &used);
        if (used) {
            check(reset(device), what, device);
        }
    }
};

void copy_out(const char *what, char *err, size_t n) {
    if (err != nullptr && n > 0) {
        std::strncpy(err, what, n - 1);
        err[n - 1] = '\0';
    }
}

}  // namespace

// Makes the allocator above PyTorch's, with cuarena's record_stream, empty_cache and memory
// fraction hooks. 0, or -1 with the reason in err (PyTorch refuses once a CUDA allocation was
// made). Never throws.
extern "C" int cuarena_torch_install(char *err, size_t n) {
    try {
        // Kept alive by the allocator's functions, which hold it.
        auto routes = std::make_shared<Routes>();
        auto a = std::make_shared<CuarenaAllocator>(
            [routes](size_t size, int device, cudaStream_t stream) {
                return route_malloc(*routes, size, device, stream);
            },
            [](void *ptr, size_t size, int device, cudaStream_t stream) {
                cuarena_torch_free(ptr, size, device, reinterpret_cast<void *>(stream));
            });
        a->set_record_stream_fn(
            [](void *ptr, cudaStream_t stream) { cuarena_torch_record_stream(ptr, reinterpret_cast<void *>(stream)); });
        a->set_reset_fn([] { cuarena_empty_cache(); });
        a->set_memory_fraction_fn([](double fraction, int device) { cuarena_set_memory_fraction(fraction, device); });
        a->set_begin_allocate_to_pool(
            [routes](int device, c10::cuda::MempoolId_t pool, std::function<bool(cudaStream_t)> filter) {
                retain_pool(device, pool);  // PyTorch's own allocator counts a capture as a user
                // No device synchronise while the route is open (it could break the capture).
                if (cuarena_graph_capture_begin(device) != 0) {
                    (void)cuarena_graph_pool_release(pool.first, pool.second, device);
                    const char *e = cuarena_last_error();
                    C10_THROW_ERROR(Error, std::string("cuarena: graph capture on CUDA device ") + std::to_string(device) +
                                               " not begun: " + (e != nullptr ? e : "no reason recorded"));
                }
                std::lock_guard<std::mutex> g(routes->m);
                routes->open.push_back(Route{device, pool, std::move(filter)});
                routes->count.store(routes->open.size(), std::memory_order_release);
            });
        a->set_end_allocate_to_pool_fn([routes](int device, c10::cuda::MempoolId_t pool) {
            std::lock_guard<std::mutex> g(routes->m);
            auto it = std::find_if(routes->open.begin(), routes->open.end(),
                                   [&](const Route &r) { return r.device == device && r.pool == pool; });
            if (it != routes->open.end()) {
                routes->open.erase(it);
                (void)cuarena_graph_capture_end(device);  // never throws: a capture's end hook
            }
            routes->count.store(routes->open.size(), std::memory_order_release);
        });
        // Called from a graph's destructor: never throws (a pool not retained is cuarena's
        // error to keep, in cuarena_last_error).
        a->set_release_pool([](int device, c10::cuda::MempoolId_t pool) {
            (void)cuarena_graph_pool_release(pool.first, pool.second, device);
        });
        a->init(c10::cuda::device_count());  // as PyTorch's own createCustomAllocator does
        torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
        return 0;
    } catch (const c10::Error &e) {
        copy_out(e.what_without_backtrace(), err, n);
    } catch (const std::exception &e) {
        copy_out(e.what(), err, n);
    }
    return -1;
}
#endif
