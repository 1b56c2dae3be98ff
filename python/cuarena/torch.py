"""cuarena as PyTorch's CUDA allocator:

    import torch, cuarena.torch
    cuarena.torch.use()          # before the first CUDA allocation
    x = torch.ones(1 << 20, device="cuda")

malloc and free go through a small C++ shim (torch_shim.cpp, compiled with the system `c++` on
first use and cached, or CUARENA_TORCH_SHIM), so that a failed allocation raises instead of giving
PyTorch a tensor at address 0: out of memory raises torch.OutOfMemoryError (torch.cuda's too) as
PyTorch's own allocator does, with cuarena's figures in the message, where the shim builds against
PyTorch's headers (TorchInstall.oom_error says), and a RuntimeError starting "CUDA out of memory."
where it does not; other failures raise a RuntimeError naming cuarena. The
optional hooks PyTorch offers are installed too: record_stream (Tensor.record_stream fences the
free after the other stream's work; it raises a RuntimeError where cuarena cannot keep the
declaration, past its caps, and skips memory cuarena did not allocate), reset (torch.cuda.empty_cache) and memory fraction
(torch.cuda.set_per_process_memory_fraction). Where the shim builds with its own allocator
(TorchInstall.torch_stats), torch.cuda.memory_allocated() and PyTorch's other memory statistics
are cuarena's figures for the device (every user of cuarena there, CuPy's too); otherwise they
raise, as under any plug-in: use cuarena.stats(). use() gives the library cuarena.FRAMEWORK_CONF
as defaults under CUARENA_CONF (a key set there wins).

Importing this module does not import torch; use() does.
"""
import ctypes
import glob
import hashlib
import os
import re
import shlex
import shutil
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


def _file_id(path):
    """What identifies a file's contents cheaply: its real path, size, mtime and inode."""
    st = os.stat(path)
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _torch_dirs(torch):
    """(PyTorch's package directory, its include/, its lib/, the site-packages holding it)."""
    base = os.path.dirname(os.path.abspath(torch.__file__))
    return base, os.path.join(base, "include"), os.path.join(base, "lib"), os.path.dirname(base)


def _missing(paths):
    """Why a build cannot be tried: the first of `paths` that is not a file, or None."""
    return next((f"this PyTorch has no {p}" for p in paths if not os.path.isfile(p)), None)


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _c10_build(torch):
    """How to build the shim against this PyTorch's headers and libc10, so that out of memory
    throws c10::OutOfMemoryError (torch_shim.cpp): (compile flags, link flags, identity), the
    identity being what the cached build depends on (PyTorch's version, its Exception.h, its
    libc10.so: an in-place upgrade changes them, and a shim built against one c10::Error must
    not run against another). Or (None, None, why not) where this PyTorch lacks either."""
    _, inc, libdir, _ = _torch_dirs(torch)
    header, libc10 = os.path.join(inc, "c10", "util", "Exception.h"), os.path.join(libdir, "libc10.so")
    why = _missing((header, libc10))
    if why:
        return None, None, why
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    identity = f"torch {getattr(torch, '__version__', '?')} {_digest(header)} {_file_id(libc10)}"
    # -Xlinker: a comma in the directory would split a -Wl list.
    return (["-DCUARENA_C10", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{inc}"],
            [f"-L{libdir}", "-lc10", "-Xlinker", "-rpath", "-Xlinker", libdir], identity)


def _cuda_include(torch):
    """A directory holding CUDA's cuda_runtime_api.h (which PyTorch's allocator header includes),
    or None: CUDA_HOME, CUDA_PATH, the toolkit of the nvcc on PATH, /usr/local/cuda, then the
    NVIDIA runtime packages PyTorch's wheels install beside it (nvidia/*/include)."""
    dirs = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    dirs.append("/usr/local/cuda")
    cands = [os.path.join(d, "include") for d in dirs if d]
    cands += sorted(glob.glob(os.path.join(_torch_dirs(torch)[3], "nvidia", "*", "include")))
    for c in cands:
        if os.path.isfile(os.path.join(c, "cuda_runtime_api.h")):
            return c
    return None


def _allocator_build(torch, c10, libs, identity):
    """How to build the shim's own PyTorch allocator (torch_shim.cpp, CUARENA_TORCH_ALLOCATOR) on
    top of the c10 build's flags: (compile flags, link flags, identity), or (None, None, why not).
    The identity adds PyTorch's allocator header, libtorch_cuda.so, the cuda_runtime_api.h used
    (by its real path and file) and the libcudart linked."""
    _, inc, libdir, _ = _torch_dirs(torch)
    header = os.path.join(inc, "torch", "csrc", "cuda", "CUDAPluggableAllocator.h")
    libtorch_cuda = os.path.join(libdir, "libtorch_cuda.so")
    why = _missing((header, libtorch_cuda, os.path.join(libdir, "libc10_cuda.so")))
    if why:
        return None, None, why
    cuda = _cuda_include(torch)
    if cuda is None:
        return None, None, "no CUDA runtime headers (cuda_runtime_api.h) found: set CUDA_HOME"
    cudart = _loaded_cudart(torch)
    if cudart is None:
        return None, None, "PyTorch's libcudart is not loaded in this process (/proc/self/maps)"
    runtime_h = _file_id(os.path.join(cuda, "cuda_runtime_api.h"))
    identity += f" {_digest(header)} {_file_id(libtorch_cuda)} {runtime_h} {_file_id(cudart)}"
    # The very libcudart PyTorch loaded (by path: its soname is then the one already loaded, and
    # the headers' inline functions that call it resolve there, under -z defs).
    return ([*c10, "-DCUARENA_TORCH_ALLOCATOR", f"-I{cuda}"],
            [f"-L{libdir}", "-ltorch_cuda", "-lc10_cuda", cudart, *libs], identity)


def _loaded_cudart(torch):
    """The path of the CUDA runtime library mapped into this process, or None: PyTorch's where
    more than one is (one beside torch, or in the NVIDIA packages of its site-packages), else
    the first. A mapping of a deleted file is passed over."""
    site = _torch_dirs(torch)[3]
    found = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if re.search(r"/libcudart[^/]*\.so[^/]*$", path) and os.path.isfile(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    ours = [p for p in found if os.path.realpath(p).startswith(os.path.realpath(site) + os.sep)]
    return (ours or found or [None])[0]


def _compile(compiler, extra, libs, out, libdir, libname):
    """Compiles torch_shim.cpp into `out` (atomically). Returns (None, False), or (why it failed,
    whether the compiler itself reported it: only such a failure is worth remembering; one that
    ran no compiler, or was killed, or could not write the cache, may go at the next start)."""
    # Libraries after the source; `-z defs`: a symbol the libraries lack (an older libcuarena, a
    # PyTorch that does not export a class) fails this build, which steps down, not the load.
    cmd = [*compiler, "-O2", "-shared", "-fPIC", *extra, _SHIM_SOURCE, "-o", "<tmp>", f"-L{libdir}",
           f"-l:{libname}", "-Xlinker", "-rpath", "-Xlinker", libdir, *libs, "-Xlinker", "-z", "-Xlinker", "defs"]
    try:
        # A name of its own per call: two threads (or processes) building at once each write
        # their own file, and os.replace below makes one of them the shim.
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(out) + ".", suffix=".tmp", dir=os.path.dirname(out))
        os.close(fd)
    except OSError as e:
        return f"cannot write the PyTorch shim into {os.path.dirname(out)}: {e}", False
    cmd[cmd.index("<tmp>")] = tmp
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent first uses each build, one wins
            return None, False
        # Remembered only where the compiler refused the code: not where it, or a program under
        # it, was killed (out of memory, say: the driver then exits 1 and says so) or the disk
        # was full; those may go at the next start.
        transient = re.search(r"Killed signal|terminated program|internal compiler error|No space left", r.stderr)
        failure = (f"compiling the PyTorch shim failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stderr.strip()}",
                   r.returncode > 0 and transient is None)
    except OSError as e:
        failure = (f"cannot compile the PyTorch shim ({' '.join(cmd)}): {e}. Install a C++ compiler, set CXX, "
                   "or set CUARENA_TORCH_SHIM to a prebuilt libcuarena_torch .so", False)
    try:
        os.unlink(tmp)
    except OSError:
        pass
    return failure


def _remember_failure(failed, failure):
    """Writes `failure` to `failed` atomically (a reader never sees half of it); a cache that
    cannot be written just does not remember."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(failed) + ".", suffix=".tmp",
                                   dir=os.path.dirname(failed))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(failure)
        os.replace(tmp, failed)
    except OSError:
        pass


def _compiler():
    """CXX (split as a shell would: "ccache g++" works) or c++, and what identifies it: the
    real path and file of its program where it is found, so that a compiler installed or changed
    later is a new cache key."""
    compiler = shlex.split(os.environ.get("CXX") or "c++") or ["c++"]
    found = shutil.which(compiler[0])
    return compiler, "\0".join([*compiler, _file_id(found) if found else "not found"])


def shim_path(torch=None, *, stacklevel=2):
    """The PyTorch shim library (torch_shim.cpp compiled against this libcuarena.so).

    CUARENA_TORCH_SHIM names a prebuilt one. Otherwise it is compiled on first use with CXX (or
    the system `c++`) into ~/.cache/cuarena/ (XDG_CACHE_HOME is honoured), keyed by a hash of
    the source, of libcuarena.so's identity (path, size, mtime, inode: a rebuilt library gets a
    rebuilt shim; old shims stay in the cache until deleted), of the compiler and, given the `torch` module, of
    that PyTorch (its version, headers and libraries). Given `torch`, it is built against that
    PyTorch's headers and libraries and CUDA's runtime headers (C++20, else C++17) with an
    allocator of its own, which answers PyTorch's memory statistics and cuDNN's cacheInfo
    (torch_shim.cpp); else against PyTorch's headers alone, so that out of memory still raises
    torch.OutOfMemoryError; else without them (out of memory then raises a RuntimeError whose
    message starts "CUDA out of memory."). Each step down gives a RuntimeWarning (at
    `stacklevel`, as warnings.warn counts) saying what is lost and why. A header build the compiler
    itself refused is remembered (a `.failed` file beside the shim's name in the cache, which
    may be deleted) and not tried again for the same PyTorch and compiler. Raises RuntimeError
    if no shim can be had: there is no fallback, because PyTorch would turn a failed allocation
    into a tensor at address 0.
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
    compiler, compiler_id = _compiler()
    # (compile flags, link flags, identity, level): the shim's own PyTorch allocator (level 2),
    # then PyTorch's exception types alone (1), then neither (0); C++20, else C++17.
    builds, failures = [], []
    if torch is not None:
        c10, libs, identity = _c10_build(torch)
        if c10 is None:
            failures.append(identity)
        else:
            full, full_libs, full_identity = _allocator_build(torch, c10, libs, identity)
            if full is None:
                failures.append(full_identity)
            else:
                builds += [([std, *full], full_libs, full_identity, 2) for std in ("-std=c++20", "-std=c++17")]
            builds += [([std, *c10], libs, identity, 1) for std in ("-std=c++20", "-std=c++17")]
    builds.append(([], [], "", 0))
    cache = _cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cuarena: cannot make the PyTorch shim's cache {cache}: {e}; set XDG_CACHE_HOME, "
                           "or CUARENA_TORCH_SHIM to a prebuilt libcuarena_torch .so") from e
    for extra, libs, identity, level in builds:
        # The library's file id too: a rebuilt libcuarena.so at the same path may add what the
        # source calls.
        key = hashlib.sha256(b"\0".join([source, _file_id(lib).encode(), compiler_id.encode(), identity.encode(),
                                          *map(str.encode, extra + libs)]))
        out = os.path.join(cache, f"libcuarena_torch-{key.hexdigest()[:16]}.so")
        failed = out + ".failed"
        if not os.path.isfile(out):
            if os.path.isfile(failed):
                with open(failed, encoding="utf-8", errors="replace") as f:
                    failures.append(f"{f.read()}\n(remembered in {failed})")
                continue
            failure, remember = _compile(compiler, extra, libs, out, libdir, libname)
            if failure is not None:
                failures.append(failure)
                if remember and extra:  # a build with PyTorch's headers is not tried at every start
                    _remember_failure(failed, failure)
                continue
        if torch is not None and level < 2:
            lost = ("torch.cuda.memory_allocated() and PyTorch's other memory statistics raise, as does "
                    "cuDNN's benchmark under autocast")
            if level == 0:
                lost = "out of memory raises RuntimeError, not torch.OutOfMemoryError; " + lost
            what = "its own PyTorch allocator" if level else "PyTorch's headers"
            warnings.warn(f"cuarena: the PyTorch shim is built without {what}, so {lost} (PyTorch's plug-in "
                          "refuses them): " + failures[-1][-2000:],
                          RuntimeWarning, stacklevel=stacklevel)
        return out
    raise RuntimeError("cuarena: " + failures[-1])


def _checked_shim(torch=None, stacklevel=2):
    """shim_path(torch), loaded and checked to call this process's one copy of libcuarena.so.
    Returns (the shim's path, its level: 2 with its own PyTorch allocator, 1 with PyTorch's
    exception types alone, 0 with neither; torch_shim.cpp). A warning is given at `stacklevel`
    from the caller, as warnings.warn counts."""
    load()  # this process's one copy of libcuarena.so, which the shim must share
    shim = shim_path(torch, stacklevel=stacklevel + 1)
    check = ctypes.CDLL(shim)
    check.cuarena_torch_target.restype = ctypes.c_void_p
    if check.cuarena_torch_target() != _fn_addr("cuarena_malloc"):
        raise RuntimeError(
            f"cuarena: the PyTorch shim {shim} resolved a different libcuarena.so than {library_path()} "
            "(two copies would be two allocators); remove the shim or fix CUARENA_TORCH_SHIM")
    level = getattr(check, "cuarena_torch_shim_level", None)  # absent from a shim built before it
    return shim, level() if level is not None else 0


class TorchInstall:
    """What use() did: `allocator` (PyTorch's allocator object), `shim` (its .so), `oom_error`
    (what out of memory raises: "torch.OutOfMemoryError", or "RuntimeError" where the shim could
    not be built with PyTorch's headers), `torch_stats` (whether torch.cuda.memory_allocated()
    and PyTorch's other memory statistics, and cuDNN's cacheInfo, are answered from cuarena's:
    only by the shim's own allocator), `hooks_installed` and `hooks_missing` (optional hooks
    this PyTorch does not offer)."""

    def __init__(self, allocator, shim, oom_error, hooks_installed, hooks_missing, torch_stats=False):
        self.allocator = allocator
        self.shim = shim
        self.oom_error = oom_error
        self.torch_stats = torch_stats
        self.hooks_installed = tuple(hooks_installed)
        self.hooks_missing = tuple(hooks_missing)

    def __repr__(self):
        return (f"TorchInstall(shim={self.shim!r}, oom_error={self.oom_error!r}, torch_stats={self.torch_stats}, "
                f"hooks_installed={self.hooks_installed}, hooks_missing={self.hooks_missing})")


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


def _record_stream_hook(shim):
    """The address of the shim's record_stream hook, which raises where cuarena refuses a
    declaration (past its caps; the block's free would not wait for that stream), or None, with
    a warning, for a prebuilt shim (CUARENA_TORCH_SHIM) from a source without it: its own older
    hook (level 2) or libcuarena's (levels 0 and 1) is used then, whose refusals PyTorch never
    sees."""
    record = getattr(ctypes.CDLL(shim), "cuarena_torch_record_stream", None)
    if record is None:
        warnings.warn(f"cuarena: the PyTorch shim {shim} has no cuarena_torch_record_stream, so a "
                      "Tensor.record_stream that cuarena refuses (past its caps) does not raise: rebuild it",
                      RuntimeWarning, stacklevel=3)
        return None
    return ctypes.cast(record, ctypes.c_void_p).value


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

        shim, level = _checked_shim(torch, stacklevel=3)  # warnings name use()'s caller
        oom_error = "torch.OutOfMemoryError" if level >= 1 else "RuntimeError"
        if level == 2:
            # The shim's own allocator, hooks included, made and installed in C++.
            # Its record_stream hook is inside; this only warns for a prebuilt shim without it.
            _record_stream_hook(shim)
            install = ctypes.CDLL(shim).cuarena_torch_install
            install.argtypes, install.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int
            err = ctypes.create_string_buffer(4096)
            _framework_defaults()  # before the framework's first allocation, after what may fail first
            if install(err, len(err)) != 0:
                raise RuntimeError("cuarena: installing the PyTorch allocator failed: "
                                   + err.value.decode(errors="replace"))
            current = getattr(torch.cuda.memory, "_get_current_allocator", None)
            _installed = TorchInstall(current() if current else None, shim, oom_error,
                                      [setter for setter, _, _ in _HOOKS], [], torch_stats=True)
            return _installed
        alloc = torch.cuda.memory.CUDAPluggableAllocator(shim, "cuarena_torch_malloc", "cuarena_torch_free")
        hooks = alloc.allocator() if callable(getattr(alloc, "allocator", None)) else alloc._allocator
        record = _record_stream_hook(shim)
        installed, missing = [], []
        for setter, fn, loss in _HOOKS:
            if callable(getattr(hooks, setter, None)):
                getattr(hooks, setter)(record if fn == "cuarena_record_stream" and record else _fn_addr(fn))
                installed.append(setter)
            else:
                missing.append(setter)
                warnings.warn(f"cuarena: this PyTorch ({torch.__version__}) offers no {setter}: {loss}",
                              RuntimeWarning, stacklevel=2)
        _framework_defaults()  # before the framework's first allocation, after what may fail first
        torch.cuda.memory.change_current_allocator(alloc)
        _installed = TorchInstall(alloc, shim, oom_error, installed, missing, torch_stats=False)
        return _installed
