// Test and benchmark kernels for cuarena. The crate ships the PTX that
// `nvcc -ptx -arch=compute_80` makes from this file (kernels.ptx beside it),
// so building cuarena needs no CUDA toolkit; the driver JIT-compiles the PTX.
#include <stdint.h>

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Writes `tag` over `nwords` 32-bit words, spins for `hold_ns`, then re-reads
// every word and adds the number that no longer hold `tag` to `*errors`.
// Another stream that writes the block while this kernel runs is caught.
extern "C" __global__ void tag_hold_check(uint32_t* p, uint64_t nwords, uint32_t tag,
                                          uint64_t hold_ns, unsigned long long* errors) {
    uint64_t i0 = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = i0; i < nwords; i += step) p[i] = tag;
    if (hold_ns) {
        uint64_t t0 = now_ns();
        while (now_ns() - t0 < hold_ns) { }
    }
    unsigned long long bad = 0;
    for (uint64_t i = i0; i < nwords; i += step) bad += (p[i] != tag);
    if (bad) atomicAdd(errors, bad);
}

// Adds to `*errors` the number of words that do not hold `tag`.
extern "C" __global__ void check_tag(const uint32_t* p, uint64_t nwords, uint32_t tag,
                                     unsigned long long* errors) {
    uint64_t i0 = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    unsigned long long bad = 0;
    for (uint64_t i = i0; i < nwords; i += step) bad += (p[i] != tag);
    if (bad) atomicAdd(errors, bad);
}

// Spins for `ns` nanoseconds; `*live` counts how many spin kernels overlap.
extern "C" __global__ void spin(uint64_t ns, unsigned int* live, unsigned int* max_live) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        unsigned int l = atomicAdd(live, 1u) + 1u;
        atomicMax(max_live, l);
        uint64_t t0 = now_ns();
        while (now_ns() - t0 < ns) { }
        atomicSub(live, 1u);
    }
}
