/* Threads that outlive main: 4 detached threads allocate and free through cuarena in a loop,
 * some on the per-thread stream and some on their own stream, while main returns. Once exit
 * has begun cuarena makes no CUDA call (frees do nothing, allocations return NULL), so the
 * process must end cleanly with status 0. Build like threads.c. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
#include "cuarena.h"

static CUcontext ctx;

static void *spin(void *arg) {
    long t = (long)arg;
    cuCtxSetCurrent(ctx);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    for (unsigned long i = 0;; i++) {
        size_t size = 256 + (i * 7919 + t * 104729) % (4 << 20);
        cudaStream_t st = (i % 2) ? (cudaStream_t)s : (cudaStream_t)0x2;
        void *p = cuarena_malloc(size, 0, st);
        if (p) cuarena_free(p, size, 0, st);
    }
    return 0;
}

int main(void) {
    cuInit(0);
    CUdevice d;
    cuDeviceGet(&d, 0);
    cuDevicePrimaryCtxRetain(&ctx, d);
    cuCtxSetCurrent(ctx);
    void *warm = cuarena_malloc(4096, 0, 0); /* creates the allocator (and its exit hook) */
    cuarena_free(warm, 4096, 0, 0);
    for (long t = 0; t < 4; t++) {
        pthread_t th;
        pthread_create(&th, 0, spin, (void *)t);
        pthread_detach(th);
    }
    usleep(200 * 1000);
    printf("main returns while 4 threads still allocate\n");
    fflush(stdout);
    return 0;
}
