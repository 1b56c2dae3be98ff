//! What the allocator needs from a device, and the device that provides it.
//!
//! - [`cuda::CudaDevice`]: a real GPU through the CUDA driver API (cudarc, loaded at run time).
//! - Any other [`Device`], given to [`Allocator::new`](crate::Allocator::new): the workspace's
//!   `cuarena-testkit` crate has a simulated device in host memory with asynchronous streams,
//!   events and a race checker (`HostDevice`), for CI and machines without a GPU, and
//!   `loom-tests` a minimal device for the loom models.
//!
//! The allocator calls a device only on slow paths. It never blocks the host on the device except
//! in [`Device::sync_event`], which `trim(blocking)`, the last try before out of memory and a
//! graph pool's restore use, and in [`Device::synchronize`], used where memory waits for one:
//! memory freed on a user stream that must leave an arena after that stream may be gone
//! (`Env::home_fence`), parked arenas and frees and retired graph pools' segments
//! (`Inner::bury_zombies`), and the pool's drop.

pub(crate) mod counted;
pub mod cuda;

use crate::error::Result;
use crate::stream::{Stream, StreamKey};

/// An event handle (`CUevent` on CUDA, a table index on the host device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// Which backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceKind {
    /// A CUDA GPU.
    Cuda,
    /// The host-simulated device.
    Host,
}

impl DeviceKind {
    /// `"cuda"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Host => "host",
        }
    }
}

/// Upstream memory and stream-ordering primitives.
///
/// Every method may be called from any thread. Implementations make whatever per-thread
/// preparation they need (the CUDA device makes its context current) inside each call.
pub trait Device: Send + Sync + 'static {
    /// Which backend this is.
    fn kind(&self) -> DeviceKind;
    /// The device ordinal.
    fn ordinal(&self) -> i32;
    /// Names the physical device among every [`Device`] of the process: allocators whose
    /// devices give the same number share process-wide state (a capture announced to one spares
    /// the device the others' synchronises, `Allocator::graph_capture_begin`). The default is
    /// the ordinal, CUDA's meaning; a wrapper forwards its inner device's, and a simulated
    /// device gives its own (see `cuarena_testkit::HostDevice`), never one a CUDA ordinal has.
    fn device_id(&self) -> u64 {
        u64::from(self.ordinal().cast_unsigned())
    }
    /// Total device memory in bytes.
    fn total_memory(&self) -> Result<usize>;
    /// Reserves `bytes` of device memory. `Ok(None)` means the device is out of memory.
    fn reserve(&self, bytes: usize) -> Result<Option<u64>>;
    /// Releases memory from [`Device::reserve`].
    ///
    /// # Safety
    /// `ptr` and `bytes` must come from one earlier `reserve`, and no work may still use it.
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()>;
    /// Allocates `bytes` (> 0) ordered on `stream`, from the device's own stream-ordered pool
    /// (`cuMemAllocAsync` on CUDA; a fresh reservation on the host device). `Ok(None)` means the
    /// device is out of memory. Only pass-through mode uses it.
    fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<Option<u64>>;
    /// Frees memory from [`Device::alloc_async`], ordered on `stream` like `cuMemFreeAsync`:
    /// the memory is released once the work queued on `stream` so far has completed. An error
    /// (for example a destroyed stream) frees nothing.
    ///
    /// # Safety
    /// `ptr` and `bytes` must come from one earlier `alloc_async` of this device, and it must be
    /// freed once only. Every earlier use of the memory must be ordered before the work queued
    /// on `stream` so far (the contract of `cuMemFreeAsync`).
    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> Result<()>;
    /// Creates an event (no timing).
    fn create_event(&self) -> Result<Event>;
    /// Destroys an event.
    fn destroy_event(&self, event: Event);
    /// Records `event` on `stream`: it completes when the work queued on `stream` so far has.
    fn record_event(&self, event: Event, stream: Stream) -> Result<()>;
    /// True once the work before the last record of `event` has completed. Never blocks.
    fn query_event(&self, event: Event) -> Result<bool>;
    /// Blocks the host until `event` has completed.
    fn sync_event(&self, event: Event) -> Result<()>;
    /// Blocks the host until all work queued so far on every stream of the device, destroyed
    /// streams included, has completed (`cuCtxSynchronize` on CUDA).
    fn synchronize(&self) -> Result<()>;
    /// Makes later work on `stream` wait for `event`. Never blocks the host.
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()>;
    /// The identity of `stream` as seen from the calling thread. A stream being captured may
    /// be refused (`Error::StreamCapturing`), as CUDA's is.
    fn stream_key(&self, stream: Stream) -> Result<StreamKey>;
    /// The driver calls one [`Device::stream_key`] of `stream` made, given its `answer`, for
    /// the statistics' `driver_calls`: 1 unless a device says otherwise (CUDA asks
    /// `cuStreamIsCapturing` before `cuStreamGetId`: 2, or 1 where that first query refused
    /// the lookup or failed).
    fn stream_key_calls(&self, stream: Stream, answer: &Result<StreamKey>) -> u64 {
        let _ = (stream, answer);
        1
    }
    /// True while `stream` is being captured into a CUDA graph (`cuStreamIsCapturing`): an
    /// event recorded or waited on it would become a graph node instead of a fence. Of the
    /// legacy stream (which cannot be captured): true while it may not be used at all, because
    /// a blocking stream (a per-thread stream among them) is being captured, which any use of
    /// the legacy stream would invalidate. The default, for devices without graphs, is `false`.
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        let _ = stream;
        Ok(false)
    }
}
