//! An owning device buffer, freed on its stream when dropped.

use crate::allocator::Allocator;
use crate::error::Result;
use crate::ptr::DeviceAddr;
use crate::stream::Stream;

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
/// A buffer on [`Stream::PER_THREAD`] is freed on the per-thread stream of the thread that
/// drops it. If it moves to another thread, first call [`DeviceBuffer::set_stream`] or make sure
/// the old thread's work on it has finished: the free promises that every earlier use is
/// ordered before later work on the stream it names.
pub struct DeviceBuffer {
    alloc: Allocator,
    ptr: DeviceAddr,
    len: usize,
    stream: Stream,
    /// Other streams that used the buffer (`record_stream`); the free fences them too.
    used_on: Vec<Stream>,
}

impl DeviceBuffer {
    pub(crate) fn from_parts(alloc: Allocator, ptr: DeviceAddr, len: usize, stream: Stream) -> DeviceBuffer {
        DeviceBuffer { alloc, ptr, len, stream, used_on: Vec::new() }
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

    /// Frees on `stream` instead. The caller promises that every use so far is ordered before
    /// later work on `stream`.
    pub fn set_stream(&mut self, stream: Stream) {
        self.stream = stream;
    }

    /// Declares that work on `stream` uses the buffer: the free will be fenced after that work
    /// as well as after the work on the buffer's own stream (like PyTorch's `record_stream`).
    pub fn record_stream(&mut self, stream: Stream) {
        if stream != self.stream && !self.used_on.contains(&stream) {
            self.used_on.push(stream);
        }
    }

    /// Gives up ownership: the caller must free the block with `deallocate`.
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
        if let Err(e) = self.alloc.deallocate_used_on(self.ptr, self.len, self.stream, &self.used_on) {
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
