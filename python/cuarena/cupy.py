"""cuarena as CuPy's device allocator, stream-ordered like cudaMallocAsync:

    import cupy, cuarena.cupy
    cuarena.cupy.use()
    x = cupy.ones(1 << 20)

Each block is allocated for the stream current at allocation (cupy.cuda.get_current_stream())
and freed on that same stream when CuPy drops it; its owner keeps the Stream object alive until
then. So work CuPy queued on a non-blocking stream is ordered before the block's reuse (CuPy's
own pool makes the same promise). A free that cuarena refuses because a stream is being captured
into a CUDA graph (CuPy's Stream.begin_capture) is held here, with its Stream, and made again by
a later allocation (every 64th) or by release_held(), once the capture has ended: the C library
cannot hold it, as it could not keep the stream alive. Size 0 gives a null pointer without calling cuarena. A failure
raises cupy.cuda.memory.OutOfMemoryError (out of memory, with cuarena's figures in the message)
or cuarena.CuarenaError (anything else). use() gives the library cuarena.FRAMEWORK_CONF as defaults
under CUARENA_CONF (a key set there wins).

Importing this module does not import cupy; use() does.
"""
import threading

from . import CuarenaError, _framework_defaults, _is_oom, last_error, load, stats

__all__ = ["use", "release_held"]

# cudaStreamPerThread and cudaStreamLegacy: CuPy's Stream.ptds (and its default stream under
# CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) has the handle 0x2, which names the calling thread's
# own per-thread stream.
_PER_THREAD, _LEGACY = 2, 1
_thread = threading.local()


def _thread_token():
    """An object unique to the calling thread for as long as it lives (thread ids are reused)."""
    t = getattr(_thread, "token", None)
    if t is None:
        t = _thread.token = object()
    return t


def _free_on(ptr, size, device, stream, home):
    """Frees a block on `stream` (a cupy Stream) as cuarena_free_checked does; 0x2 of another
    thread than `home` is freed on the legacy stream. True if taken, or refused for any reason
    but a capture; False if a capture refused it (the caller holds it)."""
    s = stream.ptr
    if s == _PER_THREAD and home is not _thread_token():
        s = _LEGACY
    if _Block._free(ptr, size, device, s) == 0:
        return True
    return "being captured" not in (last_error() or "")


class _Block:
    """Owner of one CuPy block: frees it, on the stream it was allocated on, when CuPy drops
    the last reference. Holds the cupy Stream so that stream outlives the free. A block of a
    per-thread stream (0x2) remembers its thread: dropped on another thread (CuPy frees where
    the last reference goes, or where the garbage collector runs), where 0x2 names another
    stream, it is freed on the legacy stream instead, whose event follows all earlier work on
    every per-thread stream (the C ABI's rule for record_stream of 0x2, include/cuarena.h). A
    free a capture refuses is held in _held, with the Stream (a finaliser runs once, so the
    block's fields are kept, not the block)."""

    __slots__ = ("ptr", "size", "device", "stream", "home")
    _free = None  # cuarena_free_checked, set by use() (a class attribute survives module teardown)

    def __init__(self, ptr, size, device, stream):
        self.ptr = ptr
        self.size = size
        self.device = device
        self.stream = stream
        self.home = _thread_token() if stream.ptr == _PER_THREAD else None

    def __del__(self):
        try:
            held = (self.ptr, self.size, self.device, self.stream, self.home)
            if not _free_on(*held):
                with _held_lock:
                    _held.append(held)
        except Exception:  # a finaliser must not raise; a refused free is in cuarena's stats
            pass


# Frees a capture refused: (ptr, size, device, Stream, home), each made again by release_held().
_held = []
_held_lock = threading.Lock()
_RETRY_EVERY = 64
_countdown = [_RETRY_EVERY]


def release_held():
    """Makes again the frees a CUDA graph capture refused (held by the glue with their
    streams); those a capture still refuses stay held. Returns how many are still held. Called
    by every 64th allocation through the glue; call it after a capture ends to free at once."""
    with _held_lock:
        todo = list(_held)
        _held.clear()
    still = [h for h in todo if not _free_on(*h)]
    with _held_lock:
        _held.extend(still)
        return len(_held)


def _error(cupy, size, device):
    msg = last_error() or "no reason recorded"
    if not _is_oom(msg):
        return CuarenaError(f"cuarena: cannot allocate {size} bytes on CUDA device {device}: {msg}")
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


_malloc = None


def use():
    """Makes cuarena CuPy's allocator (cupy.cuda.set_allocator). Calling it again installs the
    same allocator again. Returns the allocator function."""
    global _malloc
    import cupy

    if _malloc is None:
        _framework_defaults()
        lib = load()
        _Block._free = lib.cuarena_free_checked
        malloc = lib.cuarena_malloc
        memory = cupy.cuda.memory
        Unowned, MemoryPointer = memory.UnownedMemory, memory.MemoryPointer
        current_stream = cupy.cuda.get_current_stream
        try:
            from cupy.cuda.device import get_device_id
        except ImportError:
            get_device_id = cupy.cuda.runtime.getDevice

        def cuarena_cupy_malloc(size):
            if _held:
                _countdown[0] -= 1
                if _countdown[0] <= 0:
                    _countdown[0] = _RETRY_EVERY
                    release_held()
            device = get_device_id()
            if size == 0:
                return MemoryPointer(Unowned(0, 0, None, device), 0)
            stream = current_stream()
            ptr = malloc(size, device, stream.ptr)
            if not ptr:
                raise _error(cupy, size, device)
            return MemoryPointer(Unowned(ptr, size, _Block(ptr, size, device, stream), device), 0)

        _malloc = cuarena_cupy_malloc
    cupy.cuda.set_allocator(_malloc)
    return _malloc
