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
import atexit
import ctypes
import os
import sys
import threading
import warnings

__version__ = "0.1.0"

__all__ = ["CuarenaError", "OutOfMemoryError", "LibraryNotFoundError", "library_path", "load", "version",
           "malloc", "free", "stats", "last_error", "install_torch", "torch_shim_path", "TorchInstall",
           "install_cupy", "FRAMEWORK_CONF", "reset_peak", "reset_counters", "size_histogram", "memory_stats", "set_oom_hook"]

# The fields of cuarena_stats after its leading `size`, in order: the Rust Stats and
# include/cuarena.h (tests/header.rs checks that the three agree).
_FIELDS = [
    "live_bytes", "peak_live_bytes", "reserved_bytes", "peak_reserved_bytes", "pool_in_use_bytes",
    "largest_free_block", "free_extents", "allocations", "deallocations", "cross_thread_frees",
    "cross_stream_frees", "fences_recorded", "fence_waits", "fence_polls", "driver_calls", "host_syncs",
    "invalid_frees", "superblocks_taken", "superblocks_returned", "superblocks_dissolved",
    "arena_held_bytes", "arenas", "arena_allocations", "pool_allocations",
    "large_allocations", "peak_live_bytes_upper", "peak_exact", "alloc_retries", "ooms", "oom_hook_calls",
    "limit_bytes", "device_total_bytes",
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


# include/cuarena.h's OOM hook type: int (*)(size_t requested, int device, void *user).
_OOM_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

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
        "cuarena_record_stream_checked": ([c.c_void_p, c.c_void_p], c.c_int),
        "cuarena_empty_cache": ([], None),
        "cuarena_set_memory_fraction": ([c.c_double, c.c_int], None),
        "cuarena_get_stats": ([c.c_int, c.POINTER(_Stats)], c.c_int),
        "cuarena_reset_peak": ([c.c_int], c.c_int),
        "cuarena_reset_counters": ([c.c_int], c.c_int),
        "cuarena_get_size_histogram": ([c.c_int, c.POINTER(c.c_uint64), c.c_size_t], c.c_int),
        "cuarena_set_oom_hook": ([c.c_int, _OOM_HOOK, c.c_void_p], c.c_int),
        "cuarena_last_error": ([], c.c_char_p),
        "cuarena_version": ([], c.c_int),
        "cuarena_version_string": ([], c.c_char_p),
        "cuarena_set_defaults": ([c.c_char_p], c.c_int),
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
    include/cuarena.h). Asked of a device cuarena has not used yet, this makes its allocator
    (with the configuration of that moment). Under PyTorch, torch.cuda.memory_allocated() and
    its other memory statistics read these where the shim builds with its own allocator
    (cuarena.torch.TorchInstall.torch_stats); this dict has every field either way."""
    s = _Stats()
    s.size = ctypes.sizeof(_Stats)
    r = load().cuarena_get_stats(device, ctypes.byref(s))
    if r != 0:
        raise _error(f"statistics of CUDA device {device} unavailable")
    filled = (s.size - 8) // 8  # a library older than this glue fills fewer fields
    return {name: getattr(s, name) for name in _FIELDS[:filled]}


# ---- Resets, the size histogram and torch-style memory_stats (issue 11, item 3) ----


def reset_peak(device=0):
    """Restarts `device`'s peaks (peak_live_bytes, peak_live_bytes_upper, peak_reserved_bytes) at
    their values now, like torch.cuda.reset_peak_memory_stats()."""
    if load().cuarena_reset_peak(device) != 0:
        raise _error(f"reset_peak of CUDA device {device} failed")


def reset_counters(device=0):
    """Restarts `device`'s accumulated counters (allocations, frees, fences, driver calls, retries,
    ooms, the size histogram, ...) at zero, like torch.cuda.reset_accumulated_memory_stats().
    Gauges (live_bytes, reserved_bytes, ...) are kept."""
    if load().cuarena_reset_counters(device) != 0:
        raise _error(f"reset_counters of CUDA device {device} failed")


def size_histogram(device=0):
    """Allocations since the last reset_counters by block size, as a list of (limit, count): each
    bucket counts blocks of at most `limit` bytes and more than the previous bucket's limit (the
    last bucket's limit is None: everything larger)."""
    lib = load()
    n = lib.cuarena_get_size_histogram(device, None, 0)
    if n < 0:
        raise _error(f"size histogram of CUDA device {device} unavailable")
    buf = (ctypes.c_uint64 * n)()
    if lib.cuarena_get_size_histogram(device, buf, n) < 0:
        raise _error(f"size histogram of CUDA device {device} unavailable")
    return [(256 << k if k + 1 < n else None, buf[k]) for k in range(n)]


# memory_stats(): torch.cuda.memory_stats() keys -> cuarena's counterpart. cuarena has one pool
# per device, so "all" is the only pool kind; "small_pool" is the arenas (requests up to
# small_max on a stream with an arena) and "large_pool" the global pool, where cuarena counts
# them per path. A torch key with no counterpart is left out rather than invented.
_MEMORY_STATS_MAP = {
    "allocated_bytes.all.current": "live_bytes",
    "allocated_bytes.all.peak": "peak_live_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "peak_reserved_bytes",
    "active_bytes.all.current": "live_bytes",
    "active_bytes.all.peak": "peak_live_bytes",
    "allocation.all.allocated": "allocations",
    "allocation.all.freed": "deallocations",
    "allocation.large_pool.allocated": "pool_allocations",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
    "num_sync_all_streams": "host_syncs",
}


def memory_stats(device=0):
    """`device`'s statistics under the keys torch.cuda.memory_stats() users know, where cuarena
    has a counterpart (see _MEMORY_STATS_MAP and python/README.md for the mapping), plus the
    cuarena-only figures under "cuarena.<field>" (every field of stats()). The "current" values
    are exact at quiescent points; "allocated_bytes.all.peak" is exact with CUARENA_CONF
    stats=exact and otherwise a lower bound whose upper bound is "cuarena.peak_live_bytes_upper"."""
    s = stats(device)
    out = {}
    for key, field in _MEMORY_STATS_MAP.items():
        if field in s:
            out[key] = s[field]
    if "arena_allocations" in s:
        out["allocation.small_pool.allocated"] = s["arena_allocations"]
    for name, value in s.items():
        out["cuarena." + name] = value
    return out


# ---- The OOM hook (issue 11, item 4) ----


def set_oom_hook(fn, device=0):
    """Sets `device`'s OOM hook: `fn(requested_bytes, device) -> bool` is called on the allocating
    thread when an allocation is out of memory after cuarena's own reclaim, with no cuarena lock
    held. It may free memory (move tensors to the host, drop caches) and return True to have the
    allocation retried (at most 3 times), or False to let it fail. `None` removes the hook.

    An exception raised by `fn` counts as False (a RuntimeWarning says so; nothing is raised into
    the allocation). The library holds one callback per device, made once and kept for the
    process, which calls the `fn` set last: replacing or removing the hook lets the old `fn`
    (and what it holds) go. Once the interpreter is finalizing, the callback returns False
    without calling Python code, and at exit the hooks are removed from the library."""
    with _oom_lock:
        if fn is None:
            _oom_fns.pop(device, None)
            if device in _oom_thunks and load().cuarena_set_oom_hook(device, _OOM_HOOK(), None) != 0:
                raise _error(f"cannot remove the OOM hook of CUDA device {device}")
            return
        thunk = _oom_thunks.get(device)
        if thunk is None:
            thunk = _OOM_HOOK(_oom_call)
        _oom_fns[device] = fn
        if load().cuarena_set_oom_hook(device, thunk, None) != 0:
            _oom_fns.pop(device, None)
            raise _error(f"cannot set the OOM hook of CUDA device {device}")
        if device not in _oom_thunks:
            _oom_thunks[device] = thunk  # kept for the process: an allocation may be calling it
            if len(_oom_thunks) == 1:
                atexit.register(_remove_oom_hooks)


_oom_lock = threading.Lock()
_oom_fns = {}     # device -> the hook set last
_oom_thunks = {}  # device -> its ctypes callback (never released)


def _oom_call(requested, dev, _user):
    """The library's callback: the device's current hook, never raising into the allocator."""
    try:
        if sys.is_finalizing():
            return 0
        fn = _oom_fns.get(dev)
        return 1 if fn is not None and fn(requested, dev) else 0
    except BaseException as e:  # never unwind into the allocator
        try:
            warnings.warn(f"cuarena: the OOM hook raised {e!r}; the allocation fails", RuntimeWarning,
                          stacklevel=1)
        except BaseException:  # warnings turned into errors: still nothing may escape
            pass
        return 0


def _remove_oom_hooks():
    """At interpreter exit, before finalization: no thread may call into Python afterwards."""
    for device in list(_oom_thunks):
        try:
            load().cuarena_set_oom_hook(device, _OOM_HOOK(), None)
        except BaseException:
            pass


# The defaults the framework glue (cuarena.torch.use, cuarena.cupy.use) gives the library, under
# CUARENA_CONF (cuarena_set_defaults: the user's own CUARENA_CONF items override them; no
# environment variable is changed). Frameworks allocate thousands of blocks a second, not
# millions, so the library's defaults, made for many threads churning, trade memory for speed
# they do not need:
# - PyTorch and CuPy free tensors of megabytes on the legacy stream, where a thread's frees are
#   kept back until a legacy action (the library's cap, 64 MiB a thread, suits many threads
#   freeing small blocks there): 16 MiB;
# - blocks over small_max (1 MiB) come from the global pool instead of the arenas' large
#   superblocks (each 4 times the request or more, and kept while the thread may reuse them).
# - stats=exact: one shared live-byte counter, so the peak is exact. PyTorch's
#   torch.cuda.max_memory_allocated() reads it (python/cuarena/torch_shim.cpp), and people size
#   batches by it: the default's sampled peak is a lower bound. The counter's atomic per call
#   (about 2 µs at 16 threads churning, BENCHMARKS.md) is nothing at a framework's rate.
# examples/torch_train.py peaked at 480 MiB reserved with the library's defaults, 416 with the
# first and 320 with the first two (PyTorch's own allocator: 274), at a step time within the
# noise of the machine (H200, 2026-12-02 and 2026-12-03, BENCHMARKS.md).
FRAMEWORK_CONF = "legacy_batch_bytes=16MiB,large_max=off,stats=exact"


_defaults_given = False
_defaults_lock = threading.Lock()


def _framework_defaults():
    """Gives the library FRAMEWORK_CONF as its defaults under CUARENA_CONF, once per process (a
    second glue's use() finds them given, and devices made since have them). They apply to the
    devices whose allocator is made after this (the glue calls it just before installing
    itself, so before the framework's first allocation), replacing any defaults set through
    cuarena_set_defaults before; a device already used in this process (by cuarena.malloc,
    stats, ...) keeps its configuration, and a RuntimeWarning says so."""
    global _defaults_given
    with _defaults_lock:
        if _defaults_given:
            return
        made = load().cuarena_set_defaults(FRAMEWORK_CONF.encode())
        if made < 0:
            raise _error("cuarena_set_defaults")
        _defaults_given = True
    if made > 0:
        warnings.warn(f"cuarena: {made} device(s) were used through cuarena before the framework glue was "
                      f"installed and keep their configuration; the glue's defaults ({FRAMEWORK_CONF}) apply "
                      "to devices used from now on", RuntimeWarning, stacklevel=3)


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
