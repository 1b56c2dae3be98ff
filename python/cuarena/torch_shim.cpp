// PyTorch's CUDAPluggableAllocator does not check the pointer its malloc hook returns: a NULL
// from cuarena_malloc (out of memory, or any other failure) would become a tensor whose
// data_ptr() is 0. This shim turns that NULL into a C++ exception, which PyTorch raises in
// Python as a RuntimeError carrying the message (as RMM's allocator does).
//
// No CUDA or PyTorch headers: streams are void*, the same size as cudaStream_t. cuarena's
// functions are resolved from libcuarena.so (linked with -l and an rpath by
// python/cuarena/__init__.py, which compiles this file on first use).

#include <cstddef>
#include <stdexcept>
#include <string>

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
        // "CUDA out of memory." as PyTorch's own message starts, which code that retries with a
        // smaller batch looks for (a c10::OutOfMemoryError would need PyTorch's headers here).
        std::string what =
            why.rfind("out of device memory", 0) == 0 ? "CUDA out of memory. cuarena: out of memory: " : "cuarena: ";
        what += "cannot allocate " + std::to_string(size) + " bytes on CUDA device " + std::to_string(device) + ": " +
                why;
        throw std::runtime_error(what);
    }
    return p;
}

extern "C" void cuarena_torch_free(void *ptr, size_t size, int device, void *stream) {
    cuarena_free(ptr, size, device, stream);
}

// The cuarena_malloc this shim calls, so the Python side can check that the shim and its own
// ctypes handle use one and the same copy of libcuarena.so (one allocator per device).
extern "C" void *cuarena_torch_target(void) { return reinterpret_cast<void *>(&cuarena_malloc); }
