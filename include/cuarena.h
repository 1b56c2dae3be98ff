/*
 * cuarena.h: the C ABI of cuarena, a multi-threaded CUDA device-memory allocator.
 *
 * Link with -lcuarena (target/release/libcuarena.so). One allocator per device is created on
 * first use, configured by the environment variable CUARENA_CONF
 * (e.g. "small_max=1MiB,superblock=2MiB,max=80%").
 *
 * STREAM CONTRACT (as cudaMallocAsync / cudaFreeAsync)
 *  - cuarena_malloc(size, device, stream) returns memory ready for use on `stream`, aligned to
 *    256 bytes. Any stream works: the legacy NULL stream, cudaStreamLegacy (0x1),
 *    cudaStreamPerThread (0x2) and user streams. Streams are identified by cuStreamGetId, so a
 *    destroyed stream whose handle CUDA gives to a new stream is never confused with it.
 *  - cuarena_free(ptr, size, device, stream) promises that every earlier use of the block is
 *    ordered before later work on `stream`. The block is handed to another stream only after a
 *    CUDA event recorded at the free has completed, or after that stream has been made to wait
 *    on it. The host is never blocked.
 *  - cuarena_record_stream(ptr, stream) declares that work on another `stream` uses the block;
 *    its free is then fenced after that work too (PyTorch's record_stream). A pointer outside
 *    the memory cuarena has reserved, or off a 256-byte boundary, is refused (error set, nothing
 *    kept), as is a declaration beyond 2^20 live blocks with declarations or 1024 streams per
 *    block. A declaration
 *    survives a refused free, and one accepted but found invalid later by the block's owner (a
 *    wrong size freed by another thread), so a corrected free is still fenced after those
 *    streams; it goes when a block is next handed out at that address.
 *    cudaStreamPerThread names the declaring thread's per-thread stream: a free made by
 *    another thread, which cannot name that stream, is fenced through the legacy stream
 *    instead (an event there follows all earlier per-thread-stream work; no host block). A
 *    declared stream must not be destroyed before the block's free, whose fence is recorded
 *    on it (as PyTorch's streams, which live as long as the process). A pointer inside
 *    reserved memory where no live block starts (a freed block, an interior pointer) cannot
 *    be told from a live block's start by every thread, so it is accepted; its declaration
 *    belongs to no block and is dropped when a block is next handed out at that address.
 *
 * OWNERSHIP AND ERRORS
 *  - A block belongs to the caller from cuarena_malloc until cuarena_free; free it once, with
 *    the size it was allocated with and the device it came from.
 *  - size == 0 returns NULL, and freeing NULL with size 0 does nothing (torch.empty(0)); both
 *    on any device, even with no driver, and neither sets an error.
 *  - No call aborts or lets a panic escape. A failed cuarena_malloc returns NULL; a refused
 *    free (unknown pointer, double free, wrong size) changes nothing. Either way the reason is
 *    in cuarena_last_error(). A free of a block allocated on another thread is checked by that
 *    thread later; if found invalid it is counted in cuarena_stats.invalid_frees. A double
 *    free is caught while the block has not been handed out again (after that, as with
 *    cudaFree, a stale free of the same address and size looks like a valid one).
 *  - Out of memory reports the requested, reserved, in-use and largest-free figures in
 *    cuarena_last_error() (the message begins "out of device memory"). No CUDA driver on the
 *    machine is an error, not a crash ("no CUDA driver: ..."); so is a device ordinal the driver
 *    does not have (the message gives the driver's device count). A failed creation of a
 *    device's allocator (no driver, bad ordinal, invalid CUARENA_CONF) is retried by later calls.
 *  - Once process exit has begun, cuarena makes no CUDA call: frees do nothing and
 *    allocations return NULL.
 *  - In a child of fork(), a device's allocator made before the fork is not used: calls fail
 *    ("the allocator was made before this process forked ..."), frees return -1, and the
 *    child's exit touches nothing of it. One is made in the child for a device not used before
 *    the fork (CUDA itself is unusable in a child whose parent initialised it).
 *
 * THREADS: every function may be called from any thread at any time.
 */
#ifndef CUARENA_H
#define CUARENA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the library this header belongs to; cuarena_version() gives the version of
 * the library actually loaded. CUARENA_VERSION is major * 1000000 + minor * 1000 + patch. */
#define CUARENA_VERSION_MAJOR 0
#define CUARENA_VERSION_MINOR 1
#define CUARENA_VERSION_PATCH 0
#define CUARENA_VERSION (CUARENA_VERSION_MAJOR * 1000000 + CUARENA_VERSION_MINOR * 1000 + CUARENA_VERSION_PATCH)

/* cudaStream_t is declared by CUDA's driver_types.h (which cuda_runtime_api.h and cuda_runtime.h
 * include). Without those headers, it is declared here as the same type, so that cuarena.h
 * stands alone. Include CUDA's headers first: a repeated typedef is an error before C11. */
#if !defined(__CUDA_RUNTIME_API_H__) && !defined(__DRIVER_TYPES_H__)
/* The same type as CUstream and cudaStream_t. */
typedef struct CUstream_st *cudaStream_t;
#endif

/* Statistics of one device's allocator. Counters are kept per thread and summed when read.
 * The struct may grow at the end in later versions; `size` keeps old and new callers working:
 * set it to sizeof(cuarena_stats) before calling cuarena_get_stats, which writes at most that
 * many bytes and sets it to the bytes it filled (a library older than this header fills fewer:
 * the fields past `size` are then not filled). */
typedef struct cuarena_stats {
    uint64_t size;                  /* in: sizeof(cuarena_stats); out: the bytes filled */
    uint64_t live_bytes;            /* bytes in live blocks (after size-class rounding) */
    uint64_t peak_live_bytes;       /* largest live_bytes sampled (a lower bound) */
    uint64_t reserved_bytes;        /* bytes reserved from the driver */
    uint64_t peak_reserved_bytes;   /* largest reserved_bytes (exact) */
    uint64_t pool_in_use_bytes;     /* pool bytes handed out: large blocks and superblocks */
    uint64_t largest_free_block;    /* largest free block in the pool */
    uint64_t free_extents;          /* free blocks in the pool (fragmentation) */
    uint64_t allocations;
    uint64_t deallocations;
    uint64_t cross_thread_frees;    /* arena blocks freed by a thread other than their owner */
    uint64_t cross_stream_frees;    /* own arena blocks freed the batched way, on another stream than the arena's */
    uint64_t fences_recorded;       /* CUDA events recorded as fences */
    uint64_t fence_waits;           /* cuStreamWaitEvent calls that succeeded */
    uint64_t fence_polls;           /* cuEventQuery calls */
    uint64_t driver_calls;          /* CUDA driver calls of every kind */
    uint64_t host_syncs;            /* host-blocking waits: out-of-memory reclaim, empty_cache, thread exit past the parked bound */
    uint64_t invalid_frees;         /* refused frees */
    uint64_t superblocks_taken;
    uint64_t superblocks_returned;  /* empty superblocks given back by arenas */
    uint64_t superblocks_dissolved; /* partly used superblocks given back */
    uint64_t arena_held_bytes;      /* superblock bytes held by per-thread arenas now */
    uint64_t arenas;                /* live arenas (per thread: one per-thread-stream, one legacy-stream) */
    uint64_t arena_allocations;     /* allocations served by an arena (no lock, no CUDA call) */
    uint64_t pool_allocations;      /* allocations served by the global pool */
    uint64_t large_allocations;     /* of arena_allocations, those over small_max (large superblocks) */
    /* Added after CUARENA_STATS_SIZE_V1 (filled only if out->size covers them): */
    uint64_t peak_live_bytes_upper; /* upper bound of the peak of live_bytes (sum of per-thread peaks); UINT64_MAX if unknown */
    uint64_t peak_exact;            /* 1 if peak_live_bytes is exact (CUARENA_CONF stats=exact, or passthrough) */
    uint64_t alloc_retries;         /* allocations retried after out-of-memory (reclaim or OOM hook) */
    uint64_t ooms;                  /* allocations that failed out of memory */
    uint64_t oom_hook_calls;        /* calls of the OOM hook (cuarena_set_oom_hook) */
    uint64_t limit_bytes;           /* the cap on reserved_bytes now (CUARENA_CONF max, or the memory fraction or limit set last; may exceed the total) */
    uint64_t device_total_bytes;    /* the device's total memory, as the driver reported it */
} cuarena_stats;

/* The size of the first cuarena_stats: `size` and 25 counters. A smaller `size` is refused. */
#define CUARENA_STATS_SIZE_V1 208
/* cuarena_get_stats's result when out->size is below CUARENA_STATS_SIZE_V1. */
#define CUARENA_ERR_STATS_SIZE (-2)

/* PyTorch CUDAPluggableAllocator: alloc and free. */
void *cuarena_malloc(size_t size, int device, cudaStream_t stream);
void cuarena_free(void *ptr, size_t size, int device, cudaStream_t stream);
/* cuarena_free that says whether the free was accepted: 0 if it was (or was a no-op: NULL with
 * size 0, or after process exit began), -1 if it was refused (see cuarena_last_error). A free of
 * another thread's block that its owner later finds invalid still returns 0 (invalid_frees). */
int cuarena_free_checked(void *ptr, size_t size, int device, cudaStream_t stream);
/* cuarena_free for a caller that cannot free again and whose streams outlive the free (PyTorch's
 * deleter, through the shim: its streams are pooled, never destroyed; a torch.cuda.ExternalStream
 * must outlive every capture running when its tensor is freed). A free refused because its
 * stream, or a stream declared with cuarena_record_stream, is being captured into a CUDA graph
 * (or a capture announced with cuarena_graph_capture_begin forbids the legacy stream it needs) is
 * held and made again, on the same stream handles, by the next cuarena_graph_capture_end or
 * cuarena_empty_cache, until no capture refuses it; the block stays live until then. A stream
 * destroyed before that could have its handle given to a new stream, whose work the retry would
 * order the block's reuse after: callers that destroy streams use cuarena_free_checked and free
 * again themselves. 0 if the free was taken (or was a no-op), 1 if it was held (a capture that
 * ended meanwhile may have had it made already), -1 if it was refused otherwise (see
 * cuarena_last_error; nothing changed: a bad free is refused, not held, except a wrong size of
 * another thread's block, which that thread finds when the retry reaches it, as with
 * cuarena_free_checked). While a free is held, another free of that block is refused (-1) as a
 * double free; one made while the held free is being retried waits for it, then is judged
 * afresh. A free racing the hold itself may be accepted too, as two racing frees may be. */
int cuarena_free_or_hold(void *ptr, size_t size, int device, cudaStream_t stream);
/* PyTorch set_record_stream_fn. A refusal sets cuarena_last_error and nothing else. */
void cuarena_record_stream(void *ptr, cudaStream_t stream);
/* cuarena_record_stream, answering what came of the declaration: 0 kept (or ptr NULL, or the
 * process exiting), 1 no block of cuarena's can start at ptr: it is outside the memory cuarena
 * has reserved on every device, or not on a 256-byte boundary (nothing of cuarena's to fence, as
 * PyTorch's own allocator skips memory it did not allocate; reason in cuarena_last_error), -1
 * refused at the caps above, or failed: the declaration is lost and the block's free will NOT
 * wait for `stream`, so do not free it before that stream's work is done (reason in
 * cuarena_last_error). PyTorch's shim raises a RuntimeError from Tensor.record_stream on -1.
 * A declaration is read by the free of the block starting at ptr: one at an aligned pointer
 * inside a block fences nothing, and stays (counting toward the caps) until a block is handed
 * out at that address. */
int cuarena_record_stream_checked(void *ptr, cudaStream_t stream);
/* PyTorch set_reset_fn (torch.cuda.empty_cache): sends this thread's pending remote frees,
 * releases every wholly free chunk to the driver, waiting for pending fences (host sync), and
 * destroys the CUDA events kept for reuse that no fence holds. */
void cuarena_empty_cache(void);
/* PyTorch set_memory_fraction_fn: caps the device's reserved memory at fraction [0, 1] of its total
   (0: nothing more is reserved); another fraction is refused (cuarena_last_error) and changes nothing. */
void cuarena_set_memory_fraction(double fraction, int device);
/* CuPy: python/cuarena's install_cupy() uses cuarena_malloc / cuarena_free_checked on the stream
 * that is current at allocation (CuPy's CFunctionAllocator passes no stream, so the former
 * cuarena_cupy_malloc / cuarena_cupy_free pair, which assumed the legacy stream, is removed); a
 * free a capture refuses is held by the glue itself and made again after the capture
 * (python/cuarena/cupy.py, release_held). */
/* Fills *out. Set out->size = sizeof(cuarena_stats) first. Returns 0 on success (out->size is
 * then the bytes filled: the smaller of the caller's size and the library's struct, in whole
 * fields), CUARENA_ERR_STATS_SIZE if out->size is below CUARENA_STATS_SIZE_V1, -1 on any other
 * failure. On failure nothing is written and the reason is in cuarena_last_error. Never writes
 * past out->size bytes. */
int cuarena_get_stats(int device, cuarena_stats *out);
/* cuarena_get_stats that never creates the device's allocator (no driver call, no CUDA context):
 * for a device not used through cuarena yet (or a device number it could not use) it returns 1
 * with every statistic 0. Otherwise as cuarena_get_stats (0, CUARENA_ERR_STATS_SIZE, or -1 for
 * a NULL out). */
int cuarena_peek_stats(int device, cuarena_stats *out);
/* Restarts the peaks (peak_live_bytes, peak_live_bytes_upper, peak_reserved_bytes) at their
 * values now (torch.cuda.reset_peak_memory_stats). 0 on success, -1 on failure. */
int cuarena_reset_peak(int device);
/* Restarts the accumulated counters (allocations, deallocations, frees by kind, fences, driver
 * calls, invalid frees, retries, ooms, the size histogram, ...) at zero; gauges such as
 * live_bytes and reserved_bytes are kept. Safe while other threads allocate. 0 or -1. */
int cuarena_reset_counters(int device);
/* The allocation-size histogram since the last reset: bucket 0 counts blocks (requests rounded
 * to their size class, or to 256 B above small_max) of up to 256 B, bucket k those of
 * 2^(7+k)+1 .. 2^(8+k) B, the last bucket everything larger. Writes min(n, buckets) counts to
 * out and returns the library's number of buckets, or -1 on failure. */
#define CUARENA_SIZE_HISTOGRAM_BUCKETS 25
int cuarena_get_size_histogram(int device, uint64_t *out, size_t n);
/* The OOM hook of `device`: when an allocation is out of memory after cuarena's own reclaim,
 * cb(requested_bytes, device, user) is called on the allocating thread, with no cuarena lock
 * held (it may free, allocate, or read stats; an out-of-memory inside it fails at once without
 * calling it again). A non-zero return retries the allocation, at most CUARENA_MAX_OOM_RETRIES
 * times per allocation; zero (or the retries spent) fails it. `user` is passed back as given and
 * must be usable from any thread that allocates. cb == NULL removes the hook. An allocation
 * already in its out-of-memory path may still call a hook after it is replaced: keep cb and user
 * valid. 0 or -1. */
#define CUARENA_MAX_OOM_RETRIES 3
int cuarena_set_oom_hook(int device, int (*cb)(size_t requested, int device, void *user), void *user);
/* The loaded library's version: major * 1000000 + minor * 1000 + patch (see CUARENA_VERSION). */
int cuarena_version(void);
/* The loaded library's version as a string, e.g. "0.1.0". Static: never freed. */
const char *cuarena_version_string(void);
/* Defaults under CUARENA_CONF for the allocators of devices first used after this call: items in
 * CUARENA_CONF's form ("legacy_batch_bytes=16MiB"), which CUARENA_CONF's own items override; ""
 * clears them. No environment variable is changed. Returns how many devices' allocators exist
 * already (they keep their configuration; 0: the defaults apply to every device), or -1 if items
 * is NULL, not UTF-8, not a valid configuration or holds trace= (nothing changes; see
 * cuarena_last_error). An error in the configuration a device is then made with names the
 * defaults too. */
int cuarena_set_defaults(const char *items);
/* Allocation traces (the format: cuarena's src/trace.rs; `cuarena trace-csv IN OUT` writes CSV).
 * cuarena_trace_start records every allocation and free of device's allocator (but a graph pool's)
 * into the file at
 * path (created or truncated); cuarena_trace_stop writes every thread's records and closes it.
 * CUARENA_CONF=trace=PATH starts one at the allocator's creation; a trace still running at
 * process exit is ended then. Both return 0 on success, -1 on failure (a trace already running
 * or none running, a file error; the reason is in cuarena_last_error). */
int cuarena_trace_start(int device, const char *path);
int cuarena_trace_stop(int device);
/* CUDA graph pools (PyTorch's private pools; id_a, id_b: its MempoolId_t). Memory allocated
 * while a stream is being captured must stay out of general use while the graph may be replayed:
 * route such allocations to a retained pool with cuarena_graph_malloc (freed with cuarena_free,
 * back into the pool). A pool grows only by memory needing no stream wait, and during a capture
 * no event is recorded or waited on, so the capture is not broken. A free made during a capture
 * is reused, with no fence, by captures on the same stream handle (PyTorch's rule: graphs
 * sharing a pool are replayed in capture order); one made outside a capture is reused at once by
 * its stream, by another behind a wait on a fence recorded at the free, and by a capture once
 * that fence is complete. A block declared used on another stream (record_stream) and freed
 * during a capture is not reused while the pool lives. Retain once per capture (or other user),
 * release as often; after the last release and the last free the memory returns after the next
 * device synchronise (cuarena_empty_cache, out of memory). retain/release: 0 or -1 (release of
 * a pool not retained). cuarena_graph_malloc: NULL on failure (out of memory: during a capture
 * at once, otherwise after the ordinary reclaim; never the OOM hook). cuarena_graph_pool_live: writes the number of live blocks to *count and
 * the first min(n, count) addresses to out; 0 or -1. Graph-pool blocks are not traced. */
int cuarena_graph_pool_retain(uint64_t id_a, uint64_t id_b, int device);
int cuarena_graph_pool_release(uint64_t id_a, uint64_t id_b, int device);
void *cuarena_graph_malloc(uint64_t id_a, uint64_t id_b, size_t size, int device, cudaStream_t stream);
int cuarena_graph_pool_live(uint64_t id_a, uint64_t id_b, int device, void **out, size_t n, size_t *count);
/* How many times the pool is retained now (0 if not retained), or -1. */
int64_t cuarena_graph_pool_use_count(uint64_t id_a, uint64_t id_b, int device);
/* A capture begins / ends on `device` (the PyTorch shim calls these as routes to pools open and
 * close). While any is underway cuarena makes no device synchronise (which could break it): out of
 * memory and cuarena_empty_cache leave memory waiting for one parked. 0 or -1 (an end with none
 * underway). */
int cuarena_graph_capture_begin(int device);
int cuarena_graph_capture_end(int device);
/* Checkpoints of a graph pool (PyTorch's getCheckpointState / setCheckpointPoolState, used by
 * CUDA graph trees, torch.compile's reduce-overhead mode). cuarena_graph_pool_checkpoint: the
 * pool's live blocks now, or NULL (a pool not retained); free it with
 * cuarena_graph_checkpoint_free. cuarena_graph_checkpoint_blocks: returns their number and
 * writes the first min(n, number) addresses and sizes (multiples of 512), by address; -1 on bad
 * arguments. cuarena_graph_pool_restore: frees every block live in the pool and makes exactly the
 * checkpoint's blocks live again at their addresses (each later freed with cuarena_free); the
 * caller declares every earlier use of the blocks it frees ordered before the pool's next use.
 * Another stream's work on memory it freed outside a capture is waited for on the host first,
 * where a restored block covers that memory or a live block was taken from it (refused instead
 * while a capture is underway). Writes the number freed to
 * *count and their addresses to freed; returns 0, 1 if more than n blocks are live (nothing
 * changed; *count says how many), or -1 if refused (nothing changed: a pool not retained, or
 * released and made again since the checkpoint, a block over memory held for another stream). */
typedef struct cuarena_graph_checkpoint cuarena_graph_checkpoint;
cuarena_graph_checkpoint *cuarena_graph_pool_checkpoint(uint64_t id_a, uint64_t id_b, int device);
ptrdiff_t cuarena_graph_checkpoint_blocks(const cuarena_graph_checkpoint *c, void **ptrs, size_t *sizes, size_t n);
void cuarena_graph_checkpoint_free(cuarena_graph_checkpoint *c);
int cuarena_graph_pool_restore(const cuarena_graph_checkpoint *c, void **freed, size_t n, size_t *count);
/* This thread's last error message, or NULL if no call has failed on this thread. Valid until
 * the next failing call on this thread. */
const char *cuarena_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* CUARENA_H */
