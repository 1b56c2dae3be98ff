//! An owning device buffer, freed on its stream when dropped.

use crate::allocator::Allocator;
use crate::error::Result;
use crate::ptr::DeviceAddr;
use crate::stream::Stream;
use std::thread::ThreadId;

// Here rather than in `allocator.rs`, so that the allocator does not name the buffer built on it.
impl Allocator {
    /// An owning buffer of `size` bytes on `stream`, freed on that stream when dropped.
    pub fn buffer(&self, size: usize, stream: Stream) -> Result<DeviceBuffer> {
        let ptr = self.allocate(size, stream)?;
        Ok(DeviceBuffer::from_parts(self.clone(), ptr, size, stream))
    }
}

/// `size` bytes of device memory, freed on [`DeviceBuffer::stream`] when dropped.
///
/// [`Stream::PER_THREAD`] names a different stream in every thread: a buffer on it, or declared
/// on it ([`DeviceBuffer::record_stream`]), was used on the per-thread stream of the thread
/// that made it (or moved it there with [`DeviceBuffer::set_stream`]) or declared it, and the
/// buffer remembers which threads those are. Dropped on another thread, which cannot name their
/// streams, its free is fenced through the legacy stream instead (see `UsedOn::free`; the
/// free itself is made on the dropping thread's per-thread stream, for a buffer on
/// `PER_THREAD`).
pub struct DeviceBuffer {
    alloc: Allocator,
    ptr: DeviceAddr,
    len: usize,
    stream: Stream,
    /// Other streams that used the buffer (`record_stream`); the free fences them too.
    used_on: UsedOn,
    /// Invariant: `Some` exactly when `stream` is `PER_THREAD`: the thread whose per-thread
    /// stream that is (the one that made the buffer, or called `set_stream`).
    home: Option<ThreadId>,
}

impl DeviceBuffer {
    pub(crate) fn from_parts(alloc: Allocator, ptr: DeviceAddr, len: usize, stream: Stream) -> DeviceBuffer {
        let home = (stream == Stream::PER_THREAD).then(|| std::thread::current().id());
        DeviceBuffer { alloc, ptr, len, stream, used_on: UsedOn::default(), home }
    }

    /// The device address (null for an empty buffer).
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    /// Size in bytes, as requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the buffer will be freed on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Frees on `stream` instead (`PER_THREAD`: the calling thread's). The caller promises
    /// that every use so far on the buffer's stream is ordered before later work on `stream`;
    /// streams declared with [`DeviceBuffer::record_stream`] stay declared.
    pub fn set_stream(&mut self, stream: Stream) {
        self.stream = stream;
        self.home = (stream == Stream::PER_THREAD).then(|| std::thread::current().id());
    }

    /// Declares that work on `stream` uses the buffer: the free will be fenced after that work
    /// as well as after the work on the buffer's own stream (like PyTorch's `record_stream`).
    /// `PER_THREAD` names the calling thread's per-thread stream (see [`DeviceBuffer`]). The
    /// stream must not be destroyed before the buffer is freed: the free records its fence
    /// there.
    pub fn record_stream(&mut self, stream: Stream) {
        self.used_on.record(stream, self.stream);
    }

    /// Gives up ownership: the caller must free the block with `deallocate`, ordering the
    /// streams declared with [`DeviceBuffer::record_stream`] itself (they are dropped here,
    /// with the threads whose per-thread streams used the buffer).
    pub fn into_raw(self) -> (DeviceAddr, usize, Stream) {
        let me = std::mem::ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so its allocator handle and stream list are moved out
        // exactly once.
        drop(unsafe { (std::ptr::read(&me.alloc), std::ptr::read(&me.used_on)) });
        (me.ptr, me.len, me.stream)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // A failed free keeps the block (never reused): the error is kept for
        // `take_deferred_error` rather than lost.
        if let Err(e) = self.used_on.free(&self.alloc, self.ptr, self.len, self.stream, self.home) {
            self.alloc.defer_error(e);
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("stream", &self.stream)
            .finish()
    }
}

/// The streams a buffer was used on besides its own (`record_stream`), which its free fences
/// too: one rule for [`DeviceBuffer`] and `CudaBuffer`.
///
/// [`Stream::PER_THREAD`] names the calling thread's per-thread stream, a different stream in
/// every thread, so a declaration of it is kept as the declaring thread (`per_thread`), never
/// in `streams`. Invariant: `streams` holds no duplicate, not `PER_THREAD`, and not the
/// buffer's own stream as it was when declared.
#[derive(Default, Debug)]
pub(crate) struct UsedOn {
    streams: Vec<Stream>,
    per_thread: Vec<ThreadId>,
}

impl UsedOn {
    /// Declares `s` for a buffer on stream `own`, by the calling thread.
    pub(crate) fn record(&mut self, s: Stream, own: Stream) {
        if s == Stream::PER_THREAD {
            let me = std::thread::current().id();
            if !self.per_thread.contains(&me) {
                self.per_thread.push(me);
            }
        } else if s != own && !self.streams.contains(&s) {
            self.streams.push(s);
        }
    }

    /// Frees `ptr` (`len` bytes) on `stream`, fenced after every declared stream. `home` is
    /// the thread whose per-thread stream `stream` is, if it is `PER_THREAD`. The calling
    /// thread's own per-thread stream, if declared, is fenced as any stream; another thread's
    /// (`home`, or a declaration) cannot be named from here, and is fenced through the legacy
    /// stream ([`per_thread_elsewhere`]). The mutation `buffer_per_thread_anywhere` skips that:
    /// the test `a_buffer_used_on_one_threads_per_thread_stream_and_dropped_on_another_waits_for_it`
    /// in `tests/adversarial_s15.rs` must then fail.
    pub(crate) fn free(
        &self,
        alloc: &Allocator,
        ptr: DeviceAddr,
        len: usize,
        stream: Stream,
        home: Option<ThreadId>,
    ) -> Result<()> {
        let me = std::thread::current().id();
        let elsewhere = home.iter().chain(&self.per_thread).any(|&t| t != me);
        let mut used = self.streams.clone();
        if self.per_thread.contains(&me) {
            used.push(Stream::PER_THREAD);
        }
        if !cfg!(cuarena_mutant = "buffer_per_thread_anywhere")
            && elsewhere
            && !used.contains(&Stream::LEGACY)
        {
            used.push(per_thread_elsewhere());
        }
        alloc.deallocate_used_on(ptr, len, stream, &used)
    }
}

/// The stream whose fence covers work already queued on *another* thread's per-thread stream,
/// which no other thread can name (each thread's `0x2` is its own): the legacy stream. The
/// per-thread streams are blocking streams, so an event recorded on the legacy stream follows
/// all work queued before it on every one of them (CUDA's implicit synchronisation with the
/// legacy stream; `fence.rs` relies on the same rule for its lazy legacy fences), and the
/// free's stream is made to wait on it (`Allocator::deallocate_used_on`): no host block, and no
/// capture broken (the legacy stream cannot be captured; a free on a capturing stream is still
/// refused first). The work is queued before the free by the contract of `record_stream` and
/// of the buffer's stream.
pub(crate) fn per_thread_elsewhere() -> Stream {
    Stream::LEGACY
}
