//! Stream handles and stream identity.
//!
//! A [`Stream`] is a raw handle as the caller passes it. Handles are not identities:
//! - `0x2` (the per-thread default stream, PTDS) names a **different stream in every thread**;
//! - NULL and `0x1` name the one legacy stream shared by every thread;
//! - the handle of a destroyed stream is reused by CUDA for a new one.
//!
//! So the allocator never takes a handle for an identity. It asks the device for a
//! [`StreamKey`] (`cuStreamGetId` on CUDA), which is unique for the life of the process, and
//! only decides that no fence is needed when two keys are equal. (One handle comparison stands
//! on its own proof: the owner's fast free on a user arena's handle, `allocator.rs`, "A user
//! arena's own frees".)

/// A raw CUDA stream handle (`CUstream`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stream(pub(crate) usize);

impl Stream {
    /// The legacy default stream, as NULL.
    pub const NULL: Stream = Stream(0);
    /// The legacy default stream, as `CU_STREAM_LEGACY` (`0x1`).
    pub const LEGACY: Stream = Stream(0x1);
    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`, `0x2`).
    pub const PER_THREAD: Stream = Stream(0x2);

    /// Wraps a raw `CUstream`/`cudaStream_t` value.
    pub fn from_raw(handle: usize) -> Stream {
        Stream(handle)
    }

    /// The raw handle.
    pub fn as_raw(self) -> usize {
        self.0
    }

    /// True for the calling thread's per-thread default stream.
    #[inline]
    pub fn is_per_thread(self) -> bool {
        self.0 == 0x2
    }

    /// True for the legacy default stream (NULL or `0x1`).
    pub fn is_legacy(self) -> bool {
        self.0 <= 0x1
    }

    /// True for a user stream: neither the legacy nor the per-thread default stream. Its
    /// handle names it only until it is destroyed; CUDA may then give the handle to a new one.
    #[inline]
    pub fn is_user(self) -> bool {
        self.0 > 0x2
    }
}

/// A stream's identity, unique for the life of the process (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamKey(pub u64);

/// A stream as a thread named it: the handle, and for [`Stream::PER_THREAD`] the thread whose
/// per-thread stream it names. What a `record_stream` declaration keeps (the C ABI,
/// [`crate::DeviceBuffer`], [`crate::CudaBuffer`]): the block may be freed by another thread,
/// whose `0x2` names its own stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamUse {
    stream: Stream,
    /// `crate::sync::thread_id` of the naming thread, for `PER_THREAD` only.
    thread: Option<u64>,
}

impl StreamUse {
    /// `stream` as the calling thread names it.
    pub fn here(stream: Stream) -> StreamUse {
        StreamUse { stream, thread: stream.is_per_thread().then(crate::sync::thread_id) }
    }

    /// The handle as it was given.
    pub fn stream(self) -> Stream {
        self.stream
    }

    /// The stream whose event, recorded by the calling thread now, follows the work queued on
    /// this one so far: the stream itself, except another thread's per-thread stream, which the
    /// calling thread cannot name; then the legacy stream. The per-thread streams are blocking
    /// streams, so an event recorded on the legacy stream follows all work queued before it on
    /// every one of them (CUDA's implicit synchronisation with the legacy stream; `fence.rs`
    /// relies on the same rule for its lazy legacy fences): no host block, and no capture
    /// broken (the legacy stream cannot be captured). The mutation `per_thread_anywhere` takes
    /// every thread's per-thread stream as the caller's: the tests
    /// `a_per_thread_stream_declared_by_one_thread_is_waited_for_when_another_frees`
    /// (`tests/ffi.rs`) and `a_buffer_used_on_one_threads_per_thread_stream_and_dropped_on_another_waits_for_it`
    /// (`tests/adversarial_s15.rs`) must then fail.
    pub fn fence_stream(self) -> Stream {
        match self.thread {
            Some(t) if !cfg!(cuarena_mutant = "per_thread_anywhere") && t != crate::sync::thread_id() => {
                Stream::LEGACY
            }
            _ => self.stream,
        }
    }

    /// What `Allocator::deallocate_used_on` needs for a free on `free_on` of a block used on
    /// `uses`: each use's [`StreamUse::fence_stream`], once, leaving out `free_on` itself.
    pub fn fence_streams<'a>(uses: impl IntoIterator<Item = &'a StreamUse>, free_on: Stream) -> Vec<Stream> {
        let mut v = Vec::new();
        for u in uses {
            let s = u.fence_stream();
            if s != free_on && !v.contains(&s) {
                v.push(s);
            }
        }
        v
    }
}
