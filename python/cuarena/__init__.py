"""Install cuarena into PyTorch or CuPy, and read its statistics.

cuarena is a Rust library; this is only glue over its C ABI (include/cuarena.h).
The shared library is found from CUARENA_LIB, then next to this package, then in the
repository's target/release.
"""
import ctypes
import os

__all__ = ["library_path", "load", "install_torch", "install_cupy", "stats", "last_error"]

_FIELDS = [
    "live_bytes", "peak_live_bytes", "reserved_bytes", "peak_reserved_bytes", "pool_in_use_bytes",
    "largest_free_block", "free_extents", "allocations", "deallocations", "cross_thread_frees",
    "cross_stream_frees", "fences_recorded", "fence_waits", "fence_polls", "driver_calls", "host_syncs",
    "invalid_frees", "superblocks_taken", "superblocks_returned", "superblocks_dissolved",
    "arena_held_bytes", "arenas",
]


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _FIELDS]


_lib = None


def library_path():
    """Where libcuarena.so is."""
    env = os.environ.get("CUARENA_LIB")
    if env:
        return os.path.abspath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (
        os.path.join(here, "libcuarena.so"),
        os.path.join(here, "..", "libcuarena.so"),
        os.path.join(here, "..", "..", "target", "release", "libcuarena.so"),
    ):
        if os.path.exists(cand):
            return os.path.abspath(cand)
    raise FileNotFoundError("libcuarena.so not found: build with `cargo build --release` or set CUARENA_LIB")


def load():
    """The loaded library (ctypes.CDLL), loaded once."""
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(library_path())
        _lib.cuarena_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats)]
        _lib.cuarena_get_stats.restype = ctypes.c_int
        _lib.cuarena_last_error.restype = ctypes.c_char_p
    return _lib


def _fn_addr(name):
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value


def install_torch():
    """Makes cuarena PyTorch's CUDA allocator. Call before the first CUDA allocation.

    Installs malloc/free and the hooks PyTorch offers: record_stream (Tensor.record_stream
    fences the free after the other stream's work), reset (torch.cuda.empty_cache) and
    memory fraction (torch.cuda.set_per_process_memory_fraction). Returns the allocator object.
    """
    import torch

    path = library_path()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "cuarena_malloc", "cuarena_free")
    hooks = alloc._allocator
    for setter, fn in (
        ("set_record_stream_fn", "cuarena_record_stream"),
        ("set_reset_fn", "cuarena_empty_cache"),
        ("set_memory_fraction_fn", "cuarena_set_memory_fraction"),
    ):
        if hasattr(hooks, setter):
            getattr(hooks, setter)(_fn_addr(fn))
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def install_cupy():
    """Makes cuarena CuPy's device allocator (blocks on the legacy default stream)."""
    import cupy

    lib = load()
    allocator = cupy.cuda.memory.CFunctionAllocator(0, _fn_addr("cuarena_cupy_malloc"), _fn_addr("cuarena_cupy_free"), lib)
    cupy.cuda.set_allocator(allocator.malloc)
    return allocator


def stats(device=0):
    """cuarena's statistics for `device` as a dict (PyTorch's own raise under a plug-in)."""
    s = _Stats()
    if load().cuarena_get_stats(device, ctypes.byref(s)) != 0:
        raise RuntimeError(last_error())
    return {name: getattr(s, name) for name in _FIELDS}


def last_error():
    """This thread's last cuarena error, or None."""
    e = load().cuarena_last_error()
    return e.decode() if e else None
