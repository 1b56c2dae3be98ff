//! An owning device buffer, freed on its stream when dropped.

use crate::allocator::Allocator;
use crate::error::Result;
use crate::ptr::DeviceAddr;
use crate::stream::{Stream, StreamUse};

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
/// streams, its free is fenced through the legacy stream instead ([`StreamUse::fence_stream`];
/// the free itself is made on the dropping thread's per-thread stream, for a buffer on
/// `PER_THREAD`).
pub struct DeviceBuffer {
    alloc: Allocator,
    ptr: DeviceAddr,
    len: usize,
    stream: Stream,
    /// Other streams that used the buffer (`record_stream`); the free fences them too.
    used_on: UsedOn,
    /// Invariant: `Some` exactly when `stream` is `PER_THREAD`: that stream as the thread that
    /// made the buffer (or called `set_stream`) named it.
    home: Option<StreamUse>,
}

impl DeviceBuffer {
    pub(crate) fn from_parts(alloc: Allocator, ptr: DeviceAddr, len: usize, stream: Stream) -> DeviceBuffer {
        let home = stream.is_per_thread().then(|| StreamUse::here(stream));
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
        self.home = stream.is_per_thread().then(|| StreamUse::here(stream));
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
        // A free refused by a capture is held and made again after it (`free_or_hold`); any
        // other failure keeps the block (never reused), its error kept for
        // `take_deferred_error` rather than lost.
        self.used_on.free(&self.alloc, self.ptr, self.len, self.stream, self.home);
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
/// too, each as the declaring thread named it ([`StreamUse`]): one rule for [`DeviceBuffer`]
/// and `CudaBuffer`. Invariant: no duplicate, and no declaration of the buffer's own stream as
/// it was when declared (other than `PER_THREAD`, which may name another thread's).
#[derive(Default, Debug)]
pub(crate) struct UsedOn(Vec<StreamUse>);

impl UsedOn {
    /// Declares `s` for a buffer on stream `own`, by the calling thread.
    pub(crate) fn record(&mut self, s: Stream, own: Stream) {
        let u = StreamUse::here(s);
        if (s.is_per_thread() || s != own) && !self.0.contains(&u) {
            self.0.push(u);
        }
    }

    /// Frees `ptr` (`len` bytes) on `stream`, fenced after every declared stream and after
    /// `home`, the buffer's own stream as its maker named it if that is `PER_THREAD` (dropped
    /// on another thread, the free's `0x2` is not that one): another thread's per-thread stream
    /// through the legacy stream ([`StreamUse::fence_stream`]).
    pub(crate) fn free(
        &self,
        alloc: &Allocator,
        ptr: DeviceAddr,
        len: usize,
        stream: Stream,
        home: Option<StreamUse>,
    ) {
        let fence = StreamUse::fence_streams(home.iter().chain(&self.0), stream);
        alloc.free_or_hold(ptr, len, stream, &fence);
    }
}
