//! The error type: every failure a caller can cause or meet is a value here.
//!
//! What that guarantees:
//! - Public APIs return errors, not panics, for bad input (sizes, pointers and sizes of frees,
//!   streams, device ordinals, configuration) and for what the device does (no driver, driver
//!   failures, out of memory). Once process exit has begun, the C ABI's allocations fail with
//!   [`Error::ShutDown`].
//! - Internal invariants are checked by `debug_assert!`s, and by `expect`s and `unreachable!`s
//!   on states the code makes impossible (an entry just validated or just inserted, a fresh
//!   superblock that fits every small class). One firing is a bug in cuarena, not a misuse.
//!   The hidden test aid `Allocator::check_invariants` panics on a violation by design, and
//!   the simulated device of the tests (`HostDevice`) panics if the OS refuses it a thread.
//! - No panic crosses the C ABI: every entry point of the C ABI (`capi/src/lib.rs`, through its
//!   `guard`) runs under `catch_unwind` and turns a panic into a failed call whose
//!   `cuarena_last_error` begins "internal error (caught panic)".

use std::fmt;

use crate::stream::Stream;

/// Why a free was refused. A refused free changes nothing: the block, if it exists, stays live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidFree {
    /// The pointer is not the start of a live block of this allocator.
    UnknownPointer,
    /// The block exists but was already freed (or its free is still waiting for its fence).
    DoubleFree,
    /// The size given to the free does not match the size the block was allocated with.
    SizeMismatch { allocated: usize, given: usize },
    /// Size 0 with a non-null pointer: no block has size 0 (an allocation of 0 bytes gives
    /// null), so the free names no block, whatever the pointer.
    ZeroSize,
}

/// Every error cuarena returns.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The request cannot be met within the configured cap or the device's free memory.
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// Bytes reserved from the device at the time.
        reserved: usize,
        /// Bytes handed out by the pool (live blocks plus superblocks lent to arenas).
        in_use: usize,
        /// The largest free block in the pool.
        largest_free: usize,
        /// The configured cap in bytes.
        limit: usize,
    },
    /// A CUDA driver call failed.
    Driver { call: &'static str, code: u32 },
    /// A free was refused (see [`InvalidFree`]).
    InvalidFree { ptr: u64, size: usize, reason: InvalidFree },
    /// No CUDA driver library could be loaded on this machine.
    NoDriver,
    /// The device ordinal does not exist.
    NoDevice { ordinal: i32, count: i32 },
    /// A configuration string or value is invalid.
    Config(String),
    /// The allocator has been shut down: process exit has begun, and no driver call is made
    /// any more (the C ABI's allocations fail with this error from then on).
    ShutDown,
    /// The allocator was made before this process forked, and this is the child: it is not
    /// used there (its locks may be held by threads the child does not have, and its device
    /// memory belongs to the parent). Allocators made after the fork work.
    Forked,
    /// The device did something cuarena cannot work with (the message says what).
    Unsupported(String),
    /// An allocation or free on a stream that is being captured into a CUDA graph (or a free
    /// declared used on one): refused, nothing changed (see README, "CUDA graphs"). `stream`
    /// is the raw handle. The legacy stream's handle means that the call needed the legacy
    /// stream (or a device synchronise) while a blocking stream was being captured, whose
    /// capture that would have invalidated.
    StreamCapturing { stream: usize },
    /// An allocation for, or a release of, a CUDA graph pool that is not retained (never
    /// retained, or released as often as retained): see [`crate::GraphPoolId`].
    UnknownGraphPool { id: (u64, u64) },
    // --- traces (issue 11) ---
    /// Recording or reading an allocation trace failed (the message says what and where).
    Trace(String),
}

impl Error {
    /// True for a refusal to use the legacy stream (or to synchronise) while a blocking stream
    /// is being captured: `StreamCapturing` of the legacy stream (see its comment).
    pub(crate) fn is_legacy_refusal(&self) -> bool {
        matches!(self, Error::StreamCapturing { stream } if Stream::from_raw(*stream).is_legacy())
    }

    /// This error as the answer to a request of `size` bytes: out of memory reports the size
    /// asked for, not the rounding of it that the path which ran out used.
    pub(crate) fn for_request(self, size: usize) -> Error {
        match self {
            Error::OutOfMemory { reserved, in_use, largest_free, limit, .. } => {
                Error::OutOfMemory { requested: size, reserved, in_use, largest_free, limit }
            }
            e => e,
        }
    }

    /// True for a refusal because `stream` itself is being captured (its capture query).
    pub(crate) fn is_capture_of(&self, stream: Stream) -> bool {
        matches!(self, Error::StreamCapturing { stream: s } if *s == stream.as_raw())
    }

    /// True for a refusal that more room may cure: out of memory, or a legacy refusal, which
    /// the global pool returns only when no memory apart from what waits on the legacy stream
    /// fits under the cap (`global_pool.rs`, `out_of_other`). An allocation retries both after
    /// the out-of-memory reclaim (its synchronises are gated on their own), and an arena's
    /// growth with a smaller superblock.
    pub(crate) fn is_out_of_room(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. }) || self.is_legacy_refusal()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory { requested, reserved, in_use, largest_free, limit } => write!(
                f,
                "out of device memory: requested {requested} B; reserved {reserved} B of a {limit} B cap, \
                 {in_use} B in use, largest free block {largest_free} B"
            ),
            Error::Driver { call, code } => {
                write!(f, "CUDA driver call {call} failed with CUresult {code}")
            }
            Error::InvalidFree { ptr, size, reason } => match reason {
                InvalidFree::UnknownPointer => {
                    write!(f, "invalid free of {ptr:#x} ({size} B): not a live block of this allocator")
                }
                InvalidFree::DoubleFree => {
                    write!(f, "invalid free of {ptr:#x} ({size} B): double free")
                }
                InvalidFree::SizeMismatch { allocated, given } => write!(
                    f,
                    "invalid free of {ptr:#x}: size {given} B does not match the allocation ({allocated} B after rounding)"
                ),
                InvalidFree::ZeroSize => write!(
                    f,
                    "invalid free of {ptr:#x}: size 0 with a non-null pointer (a free takes the size the block was allocated with)"
                ),
            },
            Error::NoDriver => write!(f, "no CUDA driver: libcuda could not be loaded"),
            Error::NoDevice { ordinal, count } => {
                write!(f, "no CUDA device {ordinal}: the driver reports {count} device(s)")
            }
            Error::Config(msg) => write!(f, "invalid cuarena configuration: {msg}"),
            Error::ShutDown => write!(f, "the allocator has shut down: process exit has begun"),
            Error::Forked => write!(
                f,
                "the allocator was made before this process forked: it is unusable in the child (make one after the fork)"
            ),
            Error::Unsupported(msg) => write!(f, "unsupported: {msg}"),
            e if e.is_legacy_refusal() => write!(
                f,
                "a blocking stream (a per-thread default stream among them) is being captured into a CUDA graph, or \
                 a capture is announced to a cuarena allocator of this device (graph_capture_begin), and this needed \
                 the legacy stream (or a device synchronise), whose use would invalidate such a capture: refused, \
                 nothing changed (try again after the capture)"
            ),
            Error::StreamCapturing { stream } => write!(
                f,
                "stream {stream:#x} is being captured into a CUDA graph: cuarena does not allocate or free on a \
                 capturing stream (allocate before the capture, or on a stream not being captured)"
            ),
            Error::UnknownGraphPool { id } => write!(
                f,
                "graph pool ({}, {}) is not retained: retain it before allocating in it, and release it once per retain",
                id.0, id.1
            ),
            Error::Trace(msg) => write!(f, "trace: {msg}"),
        }
    }
}

impl std::error::Error for Error {}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
