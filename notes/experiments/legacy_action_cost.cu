// What one "legacy action" costs on the GPU: the driver calls cuarena could make on the legacy
// stream to order kept-back legacy frees (arena.rs, "Frees on the legacy stream"), timed one
// call type at a time, with T threads each having used its per-thread stream (so the legacy
// stream has blocking streams to synchronise with). Build: nvcc -O2 -o lac legacy_action_cost.cu -lcuda -lpthread
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("%s failed: %d at %d\n", #x, r, __LINE__); exit(1);} } while (0)
static CUcontext ctx;
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int N = 20000;
static int MODE;
static const char *NAMES[] = {"wait(legacy, old event)", "record(legacy, event)", "wait(ptds, old event)", "record(ptds, event)", "wait(user, old event)", "query(old event)", "getid(legacy)", "memsetD8Async(legacy, 0 bytes)"};
static pthread_barrier_t bar;
static double per_call[64];
static void *worker(void *arg) {
    long t = (long)arg;
    CK(cuCtxSetCurrent(ctx));
    CUevent old, ev; CUstream user;
    CK(cuEventCreate(&old, CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CK(cuStreamCreate(&user, CU_STREAM_NON_BLOCKING));
    CK(cuEventRecord(old, CU_STREAM_PER_THREAD));
    CK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    CUdeviceptr d; CK(cuMemAlloc(&d, 256));
    pthread_barrier_wait(&bar);
    double t0 = now();
    for (int i = 0; i < N; i++) {
        switch (MODE) {
        case 0: CK(cuStreamWaitEvent(CU_STREAM_LEGACY, old, 0)); break;
        case 1: CK(cuEventRecord(ev, CU_STREAM_LEGACY)); break;
        case 2: CK(cuStreamWaitEvent(CU_STREAM_PER_THREAD, old, 0)); break;
        case 3: CK(cuEventRecord(ev, CU_STREAM_PER_THREAD)); break;
        case 4: CK(cuStreamWaitEvent(user, old, 0)); break;
        case 5: CK(cuEventQuery(old)); break;
        case 6: { unsigned long long id; CK(cuStreamGetId(CU_STREAM_LEGACY, &id)); break; }
        case 7: CK(cuMemsetD8Async(d, 0, 0, CU_STREAM_LEGACY)); break;
        }
    }
    per_call[t] = (now() - t0) / N * 1e9;
    CK(cuCtxSynchronize());
    return 0;
}
int main() {
    CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    int threads[] = {1, 16};
    for (int m = 0; m < 8; m++) for (int k = 0; k < 2; k++) {
        int T = threads[k]; MODE = m;
        pthread_barrier_init(&bar, 0, T);
        pthread_t th[64];
        for (long t = 0; t < T; t++) pthread_create(&th[t], 0, worker, (void *)t);
        for (int t = 0; t < T; t++) pthread_join(th[t], 0);
        double s = 0; for (int t = 0; t < T; t++) s += per_call[t];
        printf("%-32s threads %2d: %8.0f ns a call (mean over threads)\n", NAMES[m], T, s / T);
        pthread_barrier_destroy(&bar);
    }
    return 0;
}
