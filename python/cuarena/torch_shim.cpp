// PyTorch's CUDAPluggableAllocator does not check the pointer its malloc hook returns: a NULL
// from cuarena_malloc (out of memory, or any other failure) would become a tensor whose
// data_ptr() is 0. This shim turns that NULL into a C++ exception, which PyTorch raises in
// Python.
//
// Two builds of this one file (python/cuarena/torch.py compiles it on first use):
// - CUARENA_C10 defined, against PyTorch's own headers and libc10: out of memory throws
//   c10::OutOfMemoryError, the type PyTorch's caching allocator throws. Python sees
//   torch.OutOfMemoryError (torch.cuda.OutOfMemoryError), and PyTorch's C++ fallbacks that catch
//   that type run (cuDNN's convolution retries with a smaller workspace, for one). Other
//   failures throw c10::Error, a RuntimeError in Python.
// - Without it (no PyTorch headers, or they did not compile): std::runtime_error for every
//   failure, a RuntimeError in Python whose message starts "CUDA out of memory." when out of
//   memory, as PyTorch's own message does (code that retries with a smaller batch looks for it).
//
// No CUDA headers: streams are void*, the same size as cudaStream_t. cuarena's functions are
// resolved from libcuarena.so (linked with -l and an rpath).

#include <cstddef>
#include <stdexcept>
#include <string>

#ifdef CUARENA_C10
#include <c10/util/Exception.h>
#endif

extern "C" {
void *cuarena_malloc(size_t size, int device, void *stream);
void cuarena_free(void *ptr, size_t size, int device, void *stream);
const char *cuarena_last_error(void);
}

extern "C" void *cuarena_torch_malloc(size_t size, int device, void *stream) {
    void *p = cuarena_malloc(size, device, stream);
    if (p == nullptr && size > 0) {
        const char *e = cuarena_last_error();
        std::string why = e != nullptr ? e : "no reason recorded";
        // cuarena's Error::OutOfMemory displays as "out of device memory: ..." (src/error.rs).
        bool oom = why.rfind("out of device memory", 0) == 0;
        std::string what = oom ? "CUDA out of memory. cuarena: out of memory: " : "cuarena: ";
        what += "cannot allocate " + std::to_string(size) + " bytes on CUDA device " + std::to_string(device) + ": " +
                why;
#ifdef CUARENA_C10
        if (oom) {
            C10_THROW_ERROR(OutOfMemoryError, what);
        }
        C10_THROW_ERROR(Error, what);
#else
        throw std::runtime_error(what);
#endif
    }
    return p;
}

extern "C" void cuarena_torch_free(void *ptr, size_t size, int device, void *stream) {
    cuarena_free(ptr, size, device, stream);
}

// The cuarena_malloc this shim calls, so the Python side can check that the shim and its own
// ctypes handle use one and the same copy of libcuarena.so (one allocator per device).
extern "C" void *cuarena_torch_target(void) { return reinterpret_cast<void *>(&cuarena_malloc); }

// 1 if out of memory throws c10::OutOfMemoryError (built with CUARENA_C10), else 0.
extern "C" int cuarena_torch_shim_c10(void) {
#ifdef CUARENA_C10
    return 1;
#else
    return 0;
#endif
}
