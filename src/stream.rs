//! Stream handles and stream identity.
//!
//! A [`Stream`] is a raw handle as the caller passes it. Handles are not identities:
//! - `0x2` (the per-thread default stream, PTDS) names a **different stream in every thread**;
//! - NULL and `0x1` name the one legacy stream shared by every thread;
//! - the handle of a destroyed stream is reused by CUDA for a new one.
//!
//! So the allocator never compares handles. It asks the device for a [`StreamKey`]
//! (`cuStreamGetId` on CUDA), which is unique for the life of the process, and only decides
//! that no fence is needed when two keys are equal.

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
