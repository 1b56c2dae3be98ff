"""Install cuarena into PyTorch or CuPy, and read its statistics.

cuarena is a Rust library; this is only glue over its C ABI (include/cuarena.h).
The shared library is found from CUARENA_LIB, then next to this package, then in the
repository's target/release.
"""
import ctypes
import hashlib
import os
import subprocess
import warnings

__all__ = ["library_path", "load", "install_torch", "torch_shim_path", "TorchInstall", "install_cupy", "stats",
           "last_error"]

_FIELDS = [
    "live_bytes", "peak_live_bytes", "reserved_bytes", "peak_reserved_bytes", "pool_in_use_bytes",
    "largest_free_block", "free_extents", "allocations", "deallocations", "cross_thread_frees",
    "cross_stream_frees", "fences_recorded", "fence_waits", "fence_polls", "driver_calls", "host_syncs",
    "invalid_frees", "superblocks_taken", "superblocks_returned", "superblocks_dissolved",
    "arena_held_bytes", "arenas", "arena_allocations", "pool_allocations",
    "large_allocations",
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
        lib = ctypes.CDLL(library_path())
        lib.cuarena_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cuarena_malloc.restype = ctypes.c_void_p
        lib.cuarena_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cuarena_free.restype = None
        lib.cuarena_get_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats)]
        lib.cuarena_get_stats.restype = ctypes.c_int
        lib.cuarena_last_error.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def _fn_addr(name):
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value


def _is_oom(msg):
    # The Display of cuarena's Error::OutOfMemory (src/error.rs).
    return bool(msg) and msg.startswith("out of device memory")


# ---------------------------------------------------------------------------------------------
# PyTorch


_SHIM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_shim.cpp")


def _cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuarena")


def torch_shim_path():
    """The PyTorch shim library (torch_shim.cpp compiled against this libcuarena.so).

    CUARENA_TORCH_SHIM names a prebuilt one. Otherwise it is compiled on first use with the
    system `c++` into ~/.cache/cuarena/ (XDG_CACHE_HOME is honoured), keyed by a hash of the
    source and of libcuarena.so's location. Raises RuntimeError if that fails: there is no
    fallback, because PyTorch would turn a failed allocation into a tensor at address 0.
    """
    env = os.environ.get("CUARENA_TORCH_SHIM")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(f"CUARENA_TORCH_SHIM={env!r} does not name a file")
        return os.path.abspath(env)
    lib = os.path.realpath(library_path())
    libdir, libname = os.path.split(lib)
    with open(_SHIM_SOURCE, "rb") as f:
        source = f.read()
    compiler = os.environ.get("CXX") or "c++"
    key = hashlib.sha256(source + b"\0" + lib.encode() + b"\0" + compiler.encode()).hexdigest()[:16]
    cache = _cache_dir()
    out = os.path.join(cache, f"libcuarena_torch-{key}.so")
    if os.path.isfile(out):
        return out
    os.makedirs(cache, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    cmd = [compiler, "-O2", "-shared", "-fPIC", _SHIM_SOURCE, "-o", tmp,
           f"-L{libdir}", f"-l:{libname}", f"-Wl,-rpath,{libdir}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(
            f"cuarena: cannot compile the PyTorch shim ({' '.join(cmd)}): {e}. Install a C++ compiler "
            "or set CUARENA_TORCH_SHIM to a prebuilt libcuarena_torch .so") from e
    if r.returncode != 0:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise RuntimeError(
            f"cuarena: compiling the PyTorch shim failed (exit {r.returncode}): {' '.join(cmd)}\n"
            f"{r.stderr.strip()}")
    os.replace(tmp, out)  # atomic: concurrent first uses each build, one wins
    return out


class TorchInstall:
    """What install_torch() did: `allocator` (the CUDAPluggableAllocator), `shim` (its .so),
    `hooks_installed` and `hooks_missing` (optional hooks this PyTorch does not offer)."""

    def __init__(self, allocator, shim, hooks_installed, hooks_missing):
        self.allocator = allocator
        self.shim = shim
        self.hooks_installed = tuple(hooks_installed)
        self.hooks_missing = tuple(hooks_missing)

    def __repr__(self):
        return (f"TorchInstall(shim={self.shim!r}, hooks_installed={self.hooks_installed}, "
                f"hooks_missing={self.hooks_missing})")


# Optional CUDAPluggableAllocator hooks: (setter, cuarena function, what is lost without it).
_TORCH_HOOKS = (
    ("set_record_stream_fn", "cuarena_record_stream",
     "Tensor.record_stream is not honoured: a block used on another stream may be reused too early"),
    ("set_reset_fn", "cuarena_empty_cache", "torch.cuda.empty_cache does not release cuarena's memory"),
    ("set_memory_fraction_fn", "cuarena_set_memory_fraction",
     "torch.cuda.set_per_process_memory_fraction does not cap cuarena"),
)


def install_torch():
    """Makes cuarena PyTorch's CUDA allocator. Call before the first CUDA allocation.

    malloc/free go through a small C++ shim (see torch_shim_path) so that a failed allocation
    raises a RuntimeError whose message starts with "cuarena:" instead of yielding a tensor at
    address 0. Installs the optional hooks this PyTorch offers: record_stream
    (Tensor.record_stream fences the free after the other stream's work), reset
    (torch.cuda.empty_cache) and memory fraction (torch.cuda.set_per_process_memory_fraction);
    warns about each one it does not offer. Returns a TorchInstall.
    """
    import torch

    load()  # this process's one copy of libcuarena.so, which the shim must share
    shim = torch_shim_path()
    check = ctypes.CDLL(shim)
    check.cuarena_torch_target.restype = ctypes.c_void_p
    if check.cuarena_torch_target() != _fn_addr("cuarena_malloc"):
        raise RuntimeError(
            f"cuarena: the PyTorch shim {shim} resolved a different libcuarena.so than {library_path()} "
            "(two copies would be two allocators); remove the shim or fix CUARENA_TORCH_SHIM")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(shim, "cuarena_torch_malloc", "cuarena_torch_free")
    hooks = alloc.allocator() if callable(getattr(alloc, "allocator", None)) else alloc._allocator
    installed, missing = [], []
    for setter, fn, loss in _TORCH_HOOKS:
        if callable(getattr(hooks, setter, None)):
            getattr(hooks, setter)(_fn_addr(fn))
            installed.append(setter)
        else:
            missing.append(setter)
            warnings.warn(f"cuarena: this PyTorch ({torch.__version__}) offers no {setter}: {loss}",
                          RuntimeWarning, stacklevel=2)
    torch.cuda.memory.change_current_allocator(alloc)
    return TorchInstall(alloc, shim, installed, missing)


# ---------------------------------------------------------------------------------------------
# CuPy


class _CupyBlock:
    """Owner of one CuPy block: frees it, on the stream it was allocated on, when CuPy drops
    the last reference. Holds the cupy Stream so that stream outlives the free."""

    __slots__ = ("ptr", "size", "device", "stream")
    _free = None  # cuarena_free, set by install_cupy (a class attribute survives module teardown)

    def __init__(self, ptr, size, device, stream):
        self.ptr = ptr
        self.size = size
        self.device = device
        self.stream = stream

    def __del__(self):
        try:
            _CupyBlock._free(self.ptr, self.size, self.device, self.stream.ptr)
        except Exception:  # a finaliser must not raise; a refused free is in cuarena's stats
            pass


def _cupy_error(cupy, size, device):
    msg = last_error() or "no reason recorded"
    if not _is_oom(msg):
        return RuntimeError(f"cuarena: cannot allocate {size} bytes on CUDA device {device}: {msg}")
    OOM = cupy.cuda.memory.OutOfMemoryError
    total = -1
    try:
        total = stats(device)["live_bytes"]
    except Exception:
        pass
    text = f"cuarena: {msg}"
    try:
        e = OOM(size, total)  # cupy: OutOfMemoryError(size, total, limit=0)
        e.args = (f"{e.args[0]}; {text}" if e.args else text,)
    except Exception:
        e = OOM.__new__(OOM)
        MemoryError.__init__(e, f"Out of memory allocating {size:,} bytes; {text}")
    return e


def install_cupy():
    """Makes cuarena CuPy's device allocator, stream-ordered like cudaMallocAsync.

    Each block is allocated for the stream current at allocation (cupy.cuda.get_current_stream())
    and freed on that same stream when CuPy drops it; its owner keeps the Stream object alive
    until then. So work CuPy queued on a non-blocking stream is ordered before the block's reuse
    (CuPy's own pool makes the same promise). Size 0 gives a null pointer without calling
    cuarena. A failure raises cupy.cuda.memory.OutOfMemoryError (out of memory, with cuarena's
    figures in the message) or RuntimeError (anything else). Returns the allocator function.
    """
    import cupy

    lib = load()
    _CupyBlock._free = lib.cuarena_free
    malloc = lib.cuarena_malloc
    memory = cupy.cuda.memory
    Unowned, MemoryPointer = memory.UnownedMemory, memory.MemoryPointer
    current_stream = cupy.cuda.get_current_stream
    try:
        from cupy.cuda.device import get_device_id
    except ImportError:
        get_device_id = cupy.cuda.runtime.getDevice

    def cuarena_cupy_malloc(size):
        device = get_device_id()
        if size == 0:
            return MemoryPointer(Unowned(0, 0, None, device), 0)
        stream = current_stream()
        ptr = malloc(size, device, stream.ptr)
        if not ptr:
            raise _cupy_error(cupy, size, device)
        return MemoryPointer(Unowned(ptr, size, _CupyBlock(ptr, size, device, stream), device), 0)

    cupy.cuda.set_allocator(cuarena_cupy_malloc)
    return cuarena_cupy_malloc


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
