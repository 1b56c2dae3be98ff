"""cuarena as PyTorch's CUDA allocator:

    import torch, cuarena.torch
    cuarena.torch.use()          # before the first CUDA allocation
    x = torch.ones(1 << 20, device="cuda")

malloc and free go through a small C++ shim (torch_shim.cpp, compiled with the system `c++` on
first use and cached, or CUARENA_TORCH_SHIM), so that a failed allocation raises a RuntimeError
whose message starts with "cuarena:" instead of giving PyTorch a tensor at address 0. The
optional hooks PyTorch offers are installed too: record_stream (Tensor.record_stream fences the
free after the other stream's work), reset (torch.cuda.empty_cache) and memory fraction
(torch.cuda.set_per_process_memory_fraction). PyTorch's own memory statistics are not kept under
a plug-in allocator: use cuarena.stats(). use() gives the library cuarena.FRAMEWORK_CONF as defaults
under CUARENA_CONF (a key set there wins).

Importing this module does not import torch; use() does.
"""
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import warnings

from . import _fn_addr, _framework_defaults, library_path, load

__all__ = ["use", "shim_path", "TorchInstall"]

_SHIM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_shim.cpp")


def _cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuarena")


def shim_path():
    """The PyTorch shim library (torch_shim.cpp compiled against this libcuarena.so).

    CUARENA_TORCH_SHIM names a prebuilt one. Otherwise it is compiled on first use with the
    system `c++` (or CXX) into ~/.cache/cuarena/ (XDG_CACHE_HOME is honoured), keyed by a hash of
    the source, of libcuarena.so's location and of the compiler. Raises RuntimeError if that
    fails: there is no fallback, because PyTorch would turn a failed allocation into a tensor at
    address 0.
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
    # A name of its own per call: two threads (or processes) building at once each write their
    # own file, and os.replace below makes one of them the shim.
    fd, tmp = tempfile.mkstemp(prefix=f"libcuarena_torch-{key}.", suffix=".tmp", dir=cache)
    os.close(fd)
    cmd = [compiler, "-O2", "-shared", "-fPIC", _SHIM_SOURCE, "-o", tmp,
           f"-L{libdir}", f"-l:{libname}", f"-Wl,-rpath,{libdir}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
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


def _checked_shim():
    """shim_path(), loaded and checked to call this process's one copy of libcuarena.so."""
    load()  # this process's one copy of libcuarena.so, which the shim must share
    shim = shim_path()
    check = ctypes.CDLL(shim)
    check.cuarena_torch_target.restype = ctypes.c_void_p
    if check.cuarena_torch_target() != _fn_addr("cuarena_malloc"):
        raise RuntimeError(
            f"cuarena: the PyTorch shim {shim} resolved a different libcuarena.so than {library_path()} "
            "(two copies would be two allocators); remove the shim or fix CUARENA_TORCH_SHIM")
    return shim


class TorchInstall:
    """What use() did: `allocator` (the CUDAPluggableAllocator), `shim` (its .so),
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
_HOOKS = (
    ("set_record_stream_fn", "cuarena_record_stream",
     "Tensor.record_stream is not honoured: a block used on another stream may be reused too early"),
    ("set_reset_fn", "cuarena_empty_cache", "torch.cuda.empty_cache does not release cuarena's memory"),
    ("set_memory_fraction_fn", "cuarena_set_memory_fraction",
     "torch.cuda.set_per_process_memory_fraction does not cap cuarena"),
)

_installed = None
_lock = threading.Lock()


def use():
    """Makes cuarena PyTorch's CUDA allocator; call it before the first CUDA allocation (PyTorch
    refuses to change its allocator after one). Calling it again returns the first result.
    Warns about each optional hook this PyTorch does not offer. Returns a TorchInstall.
    """
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        import torch

        shim = _checked_shim()
        alloc = torch.cuda.memory.CUDAPluggableAllocator(shim, "cuarena_torch_malloc", "cuarena_torch_free")
        hooks = alloc.allocator() if callable(getattr(alloc, "allocator", None)) else alloc._allocator
        installed, missing = [], []
        for setter, fn, loss in _HOOKS:
            if callable(getattr(hooks, setter, None)):
                getattr(hooks, setter)(_fn_addr(fn))
                installed.append(setter)
            else:
                missing.append(setter)
                warnings.warn(f"cuarena: this PyTorch ({torch.__version__}) offers no {setter}: {loss}",
                              RuntimeWarning, stacklevel=2)
        _framework_defaults()  # before the framework's first allocation, after what may fail first
        torch.cuda.memory.change_current_allocator(alloc)
        _installed = TorchInstall(alloc, shim, installed, missing)
        return _installed
