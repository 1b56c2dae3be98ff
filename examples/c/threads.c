/* cuarena from C: 8 threads, each on its own stream plus its per-thread stream, allocate,
 * memset, free, and hand blocks to the next thread, which frees them on its own stream after
 * waiting on an event. Checks every block's contents. Build (on a CUDA machine):
 *   cc -O2 -I include examples/c/threads.c -L target/release -lcuarena -lcuda -lpthread -o threads
 */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cuarena.h"

#define THREADS 8
#define ITERS 2000
#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { fprintf(stderr, "%s failed: %d\n", #x, r_); exit(1); } } while (0)

typedef struct { void *ptr; size_t size; CUevent ev; } handed;
static handed slots[THREADS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctx;
static long bad = 0;

static void *worker(void *arg) {
    long t = (long)arg;
    CHECK(cuCtxSetCurrent(ctx));
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned char *host = malloc((1 << 20) + 256); /* sizes reach 1 MiB + 255 */
    for (int i = 0; i < ITERS; i++) {
        size_t size = 256 + ((size_t)(i * 7919 + t * 104729) % (1 << 20));
        cudaStream_t st = (i % 2) ? (cudaStream_t)s : (cudaStream_t)0x2;
        void *p = cuarena_malloc(size, 0, st);
        if (!p) { fprintf(stderr, "malloc failed: %s\n", cuarena_last_error()); exit(1); }
        unsigned char v = (unsigned char)(t * 31 + i);
        CHECK(cuMemsetD8Async((CUdeviceptr)p, v, size, (CUstream)st));
        if (i % 64 == 0) { /* check the contents now and then */
            CHECK(cuStreamSynchronize((CUstream)st));
            CHECK(cuMemcpyDtoH(host, (CUdeviceptr)p, size));
            for (size_t k = 0; k < size; k++) if (host[k] != v) { __sync_fetch_and_add(&bad, 1); break; }
        }
        if (i % 3 == 0) { /* hand it to the next thread */
            CUevent ev;
            CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
            CHECK(cuEventRecord(ev, (CUstream)st));
            pthread_mutex_lock(&lock);
            handed old = slots[(t + 1) % THREADS];
            slots[(t + 1) % THREADS] = (handed){p, size, ev};
            pthread_mutex_unlock(&lock);
            if (old.ptr) { /* the slot was full: free the previous block here, after its event */
                CHECK(cuStreamWaitEvent(s, old.ev, 0));
                cuarena_free(old.ptr, old.size, 0, (cudaStream_t)s);
                CHECK(cuEventDestroy(old.ev));
            }
        } else {
            cuarena_free(p, size, 0, st);
        }
        pthread_mutex_lock(&lock);
        handed mine = slots[t];
        slots[t] = (handed){0};
        pthread_mutex_unlock(&lock);
        if (mine.ptr) {
            CHECK(cuStreamWaitEvent(s, mine.ev, 0));
            cuarena_free(mine.ptr, mine.size, 0, (cudaStream_t)s);
            CHECK(cuEventDestroy(mine.ev));
        }
        if (cuarena_last_error() && i == 0) { /* nothing may have failed */ }
    }
    CHECK(cuStreamSynchronize(s));
    CHECK(cuStreamDestroy(s));
    free(host);
    return 0;
}

int main(void) {
    CHECK(cuInit(0));
    CUdevice d;
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    pthread_t th[THREADS];
    for (long t = 0; t < THREADS; t++) pthread_create(&th[t], 0, worker, (void *)t);
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], 0);
    for (int t = 0; t < THREADS; t++)
        if (slots[t].ptr) { CHECK(cuEventSynchronize(slots[t].ev)); cuarena_free(slots[t].ptr, slots[t].size, 0, (cudaStream_t)0x2); }
    /* Bad input is refused, not fatal. */
    cuarena_free((void *)0x1234, 100, 0, 0);
    const char *e = cuarena_last_error();
    printf("foreign free refused: %s\n", e ? e : "(no error!)");
    if (!e) return 1;
    cuarena_stats s;
    s.size = sizeof s; /* the struct may grow: cuarena fills at most this many bytes */
    if (cuarena_get_stats(0, &s) != 0) { fprintf(stderr, "stats: %s\n", cuarena_last_error()); return 1; }
    printf("C threads: %d threads x %d iterations, bad blocks %ld, allocations %llu, cross-thread frees %llu, "
           "cross-stream frees %llu, fences %llu, invalid frees %llu\n", THREADS, ITERS, bad,
           (unsigned long long)s.allocations, (unsigned long long)s.cross_thread_frees,
           (unsigned long long)s.cross_stream_frees, (unsigned long long)s.fences_recorded,
           (unsigned long long)s.invalid_frees);
    if (bad || s.invalid_frees != 1) return 1;
    cuarena_empty_cache();
    printf("OK\n");
    return 0;
}
