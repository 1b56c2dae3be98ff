"""cuarena for Python: PyTorch and CuPy allocate CUDA memory through cuarena, a multi-threaded
device-memory allocator written in Rust. This package is glue over its C ABI (include/cuarena.h).

    import cuarena.torch; cuarena.torch.use()   # PyTorch, before its first CUDA allocation
    import cuarena.cupy; cuarena.cupy.use()     # CuPy
    cuarena.stats()                             # counters, as a dict

libcuarena.so is found whatever the working directory, the first of:
  1. the file named by the environment variable CUARENA_LIB;
  2. cuarena/lib/libcuarena.so inside this package (`pip install ./python` ships it: see
     python/README.md);
  3. target/release/ or target/debug/ of the repository this package sits in (a checkout).
If none is there, load() raises LibraryNotFoundError (an ImportError) listing what it tried.

A failure raises CuarenaError (a RuntimeError) carrying cuarena's message, or OutOfMemoryError
(also a MemoryError) when out of memory; no call returns a null pointer silently.
"""
import ctypes
import os
import threading
import warnings

__version__ = "0.1.0"

__all__ = ["CuarenaError", "OutOfMemoryError", "LibraryNotFoundError", "library_path", "load", "version",
           "malloc", "free", "stats", "last_error", "install_torch", "torch_shim_path", "TorchInstall",
           "install_cupy"]

# The fields of cuarena_stats after its leading `size`, in order: the Rust Stats and
# include/cuarena.h (tests/header.rs checks that the three agree).
_FIELDS = [
    "live_bytes", "peak_live_bytes", "reserved_bytes", "peak_reserved_bytes", "pool_in_use_bytes",
    "largest_free_block", "free_extents", "allocations", "deallocations", "cross_thread_frees",
    "cross_stream_frees", "fences_recorded", "fence_waits", "fence_polls", "driver_calls", "host_syncs",
    "invalid_frees", "superblocks_taken", "superblocks_returned", "superblocks_dissolved",
    "arena_held_bytes", "arenas", "arena_allocations", "pool_allocations",
    "large_allocations",
]

# include/cuarena.h's CUARENA_ERR_STATS_SIZE.
_ERR_STATS_SIZE = -2


class CuarenaError(RuntimeError):
    """A cuarena call failed; the message is cuarena's."""


class OutOfMemoryError(CuarenaError, MemoryError):
    """cuarena is out of device memory (after reclaiming what idle threads held); the message
    gives the requested, reserved, in-use and largest-free figures."""


class LibraryNotFoundError(ImportError):
    """libcuarena.so is not where this package looks, or cannot be loaded."""


class _Stats(ctypes.Structure):
    """cuarena_stats: a leading size (in: this struct's size; out: the bytes filled), then _FIELDS."""
    _fields_ = [("size", ctypes.c_uint64)] + [(name, ctypes.c_uint64) for name in _FIELDS]


_HERE = os.path.dirname(os.path.abspath(__file__))
_LIB_NAME = "libcuarena.so"
_lib = None
_lib_lock = threading.Lock()


def _candidates():
    """(path, what it is) in the order library_path() tries them, after CUARENA_LIB."""
    out = [(os.path.join(_HERE, "lib", _LIB_NAME), "shipped inside the package")]
    repo = os.path.dirname(os.path.dirname(_HERE))  # python/cuarena -> the repository
    if os.path.isfile(os.path.join(repo, "Cargo.toml")):
        for profile in ("release", "debug"):
            out.append((os.path.join(repo, "target", profile, _LIB_NAME), f"this checkout's {profile} build"))
    else:
        out.append((None, f"no repository checkout around the package ({repo} has no Cargo.toml)"))
    return out


def library_path():
    """The path of the libcuarena.so this package uses (see the module's doc for the order).
    Raises LibraryNotFoundError, listing every place tried, if there is none."""
    env = os.environ.get("CUARENA_LIB")
    if env:
        if os.path.isfile(env):
            return os.path.abspath(env)
        raise LibraryNotFoundError(f"cuarena: CUARENA_LIB={env!r} is not a file (it must name libcuarena.so)")
    tried = ["CUARENA_LIB: not set"]
    for path, what in _candidates():
        if path is None:
            tried.append(what)
            continue
        if os.path.isfile(path):
            return os.path.abspath(path)
        tried.append(f"{path} ({what}): not there")
    raise LibraryNotFoundError(
        "cuarena: libcuarena.so not found. Tried:\n  " + "\n  ".join(tried) + "\n"
        "Build it with `cargo build --release` and either set CUARENA_LIB to "
        "target/release/libcuarena.so or reinstall with `pip install ./python` from the repository "
        "(which ships it; see python/README.md).")


def _bind(lib):
    c = ctypes
    sigs = {
        "cuarena_malloc": ([c.c_size_t, c.c_int, c.c_void_p], c.c_void_p),
        "cuarena_free": ([c.c_void_p, c.c_size_t, c.c_int, c.c_void_p], None),
        "cuarena_free_checked": ([c.c_void_p, c.c_size_t, c.c_int, c.c_void_p], c.c_int),
        "cuarena_record_stream": ([c.c_void_p, c.c_void_p], None),
        "cuarena_empty_cache": ([], None),
        "cuarena_set_memory_fraction": ([c.c_double, c.c_int], None),
        "cuarena_get_stats": ([c.c_int, c.POINTER(_Stats)], c.c_int),
        "cuarena_last_error": ([], c.c_char_p),
        "cuarena_version": ([], c.c_int),
        "cuarena_version_string": ([], c.c_char_p),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def load():
    """The loaded library (ctypes.CDLL), loaded once per process. Raises LibraryNotFoundError if
    it is not found, cannot be loaded, or is older than this package's C ABI."""
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = library_path()
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryNotFoundError(f"cuarena: cannot load {path}: {e}") from e
        try:
            _bind(lib)
        except AttributeError as e:
            raise LibraryNotFoundError(
                f"cuarena: {path} lacks a function this package needs ({e}): it is older than this "
                f"package ({__version__}); rebuild it with `cargo build --release`") from e
        v = lib.cuarena_version_string().decode()
        if v != __version__:
            warnings.warn(f"cuarena: {path} is version {v}, this Python package {__version__}", RuntimeWarning,
                          stacklevel=2)
        _lib = lib
    return _lib


def version():
    """The loaded library's version string, e.g. "0.1.0"."""
    return load().cuarena_version_string().decode()


def last_error():
    """This thread's last cuarena error message, or None if no call has failed on this thread."""
    e = load().cuarena_last_error()
    return e.decode(errors="replace") if e else None


def _is_oom(msg):
    # The Display of cuarena's Error::OutOfMemory (src/error.rs).
    return bool(msg) and msg.startswith("out of device memory")


def _error(what):
    msg = last_error() or "no reason recorded"
    cls = OutOfMemoryError if _is_oom(msg) else CuarenaError
    return cls(f"cuarena: {what}: {msg}")


def malloc(size, device=0, stream=0):
    """Allocates `size` bytes on `device`, ready for use on `stream` (a CUDA stream handle as an
    int; 0 is the legacy default stream). Returns the device address as an int; 0 for size 0.
    Raises OutOfMemoryError or CuarenaError; never returns 0 for a failure."""
    if size == 0:
        return 0
    p = load().cuarena_malloc(size, device, stream or None)
    if not p:
        raise _error(f"cannot allocate {size} bytes on CUDA device {device}")
    return p


def free(ptr, size, device=0, stream=0):
    """Frees a block from malloc(): `size` is its size, `stream` orders the free after the
    block's uses (as cudaFreeAsync). Raises CuarenaError if cuarena refuses it (unknown pointer,
    double free, wrong size), and then nothing has changed. (0, 0) does nothing."""
    if load().cuarena_free_checked(ptr or None, size, device, stream or None) != 0:
        raise _error(f"free of {size} bytes at {(ptr or 0):#x} on CUDA device {device} refused")


def stats(device=0):
    """cuarena's statistics for `device` as a dict of ints (field names as in
    include/cuarena.h). Under PyTorch, its own memory statistics are not kept: use this."""
    s = _Stats()
    s.size = ctypes.sizeof(_Stats)
    r = load().cuarena_get_stats(device, ctypes.byref(s))
    if r != 0:
        raise _error(f"statistics of CUDA device {device} unavailable")
    filled = (s.size - 8) // 8  # a library older than this glue fills fewer fields
    return {name: getattr(s, name) for name in _FIELDS[:filled]}


def _fn_addr(name):
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value


# The functions from before cuarena.torch and cuarena.cupy, kept for existing callers.


def install_torch():
    """Same as cuarena.torch.use()."""
    from . import torch as glue
    return glue.use()


def torch_shim_path():
    """Same as cuarena.torch.shim_path()."""
    from . import torch as glue
    return glue.shim_path()


def install_cupy():
    """Same as cuarena.cupy.use()."""
    from . import cupy as glue
    return glue.use()


def __getattr__(name):
    if name == "TorchInstall":
        from .torch import TorchInstall
        return TorchInstall
    raise AttributeError(f"module 'cuarena' has no attribute {name!r}")
