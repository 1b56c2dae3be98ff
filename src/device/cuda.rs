//! The CUDA backend: the driver API through cudarc, loaded at run time.
//!
//! `cudarc` panics if libcuda is missing, so [`CudaDevice::new`] calls
//! `sys::is_culib_present()` before any other driver call and returns [`Error::NoDriver`]
//! instead. The device uses the primary context of its ordinal, made current around each call
//! (and the caller's context restored after), so it works from any thread and leaves the
//! thread's current context as it found it; a thread with none current keeps it current
//! ([`CudaDevice::enter`]). The queries of a user stream's handle, made on every user-stream
//! operation, are first made without that (`CudaDevice::query`).

use cudarc::driver::sys;

use super::{Device, DeviceKind, Event};
use crate::error::{Error, Result};
use crate::stream::{Stream, StreamKey};

/// A CUDA GPU, through its primary context.
pub struct CudaDevice {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: usize,
    total: usize,
}

// SAFETY: the primary context handle may be used from any thread; the driver API is
// thread-safe.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the struct has no interior mutability.
unsafe impl Sync for CudaDevice {}

/// Turns a `CUresult` into a `Result`.
#[doc(hidden)]
pub fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(Error::Driver { call, code: r as u32 }) }
}

/// True if the CUDA driver library can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library; makes no driver call.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, or an error if there is no driver.
pub fn device_count() -> Result<i32> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    // SAFETY: the library is present; cuInit may be called any number of times.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

/// Makes a context current for its lifetime and restores the previous one on drop; also puts
/// the thread in the relaxed stream-capture mode meanwhile (see [`CudaDevice::enter`]).
#[doc(hidden)]
pub struct CtxGuard {
    pushed: bool,
    /// The thread's capture mode before, to put back.
    mode: Option<sys::CUstreamCaptureMode>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(mut m) = self.mode {
            // SAFETY: `m` is a valid in/out pointer; this restores the caller's mode.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) };
        }
        if self.pushed {
            let mut old = std::ptr::null_mut();
            // SAFETY: we pushed a context in `enter`; popping restores the caller's.
            unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

impl CudaDevice {
    /// Opens device `ordinal` through its primary context.
    pub fn new(ordinal: i32) -> Result<CudaDevice> {
        let count = device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let mut dev = 0;
        // SAFETY: out-pointers are valid; the ordinal was checked.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        let mut total = 0;
        // SAFETY: `dev` is a valid device.
        check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) })?;
        Ok(CudaDevice { ordinal, dev, ctx: ctx as usize, total })
    }

    /// The primary context handle.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx as sys::CUcontext
    }

    /// Makes this device's context current until the guard drops, with the thread in the
    /// *relaxed* stream-capture mode meanwhile (`cuThreadExchangeStreamCaptureMode`, what CUDA
    /// provides for allocators): while some stream is being captured in the global or
    /// thread-local mode, CUDA forbids "potentially unsafe" calls such as `cuMemAlloc` and
    /// `cuEventQuery`, and one made anyway invalidates that capture. In the relaxed mode they
    /// are allowed; cuarena itself never records, waits on or queries an event on a capturing
    /// stream (see README, "CUDA graphs").
    ///
    /// A thread with no current context gets this device's primary context made current for
    /// good (`cuCtxSetCurrent`, what the runtime API does on a thread's first call), so that
    /// its later calls need no push and pop: a push and pop per call serialised threads that
    /// call the driver on every operation (user streams' `cuStreamGetId`). A thread with
    /// another context current gets ours pushed, and its own back when the guard drops.
    #[doc(hidden)]
    pub fn enter(&self) -> Result<CtxGuard> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer; the call only swaps a per-thread setting.
        let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        let g = CtxGuard { pushed: false, mode: (swapped == sys::CUresult::CUDA_SUCCESS).then_some(mode) };
        self.enter_context(g)
    }

    /// [`CudaDevice::enter`] without the capture-mode switch (two more calls): for the queries
    /// CUDA allows in every capture mode, `cuStreamIsCapturing` (alone, for a free;
    /// `Device::stream_capturing`) and then `cuStreamGetId` if the stream is not being captured
    /// (`Device::stream_key`), when [`CudaDevice::query`] needs a context current for them.
    fn enter_light(&self) -> Result<CtxGuard> {
        self.enter_context(CtxGuard { pushed: false, mode: None })
    }

    fn enter_context(&self, mut g: CtxGuard) -> Result<CtxGuard> {
        let mut cur = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur as usize == self.ctx {
            return Ok(g);
        }
        if cur.is_null() {
            // SAFETY: the primary context is retained for our lifetime.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.context()) })?;
            return Ok(g);
        }
        // SAFETY: the primary context is retained for our lifetime.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(self.context()) })?;
        g.pushed = true;
        Ok(g)
    }

    /// Makes `call`, a query of `stream` that CUDA allows in every capture mode. A user
    /// stream's handle names its own context, so its query is first made as the thread is,
    /// with whatever context current or none: that saves the `cuCtxGetCurrent` of
    /// [`CudaDevice::enter_light`] on every user-stream operation (two of a pair's five
    /// calls). If it fails (a driver that wants a context current, a handle it refuses), it is
    /// made again inside [`CudaDevice::enter_light`], and that answer stands. The legacy and
    /// per-thread streams are the current context's, so theirs is always made inside it.
    fn query(
        &self,
        name: &'static str,
        stream: Stream,
        mut call: impl FnMut() -> sys::CUresult,
    ) -> Result<()> {
        if stream.is_user() && call() == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let _g = self.enter_light()?;
        check(name, call())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if !crate::shutdown::process_exiting() {
            // SAFETY: balances the retain in `new`.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        }
    }
}

fn raw_stream(s: Stream) -> sys::CUstream {
    s.0 as sys::CUstream
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn total_memory(&self) -> Result<usize> {
        Ok(self.total)
    }

    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        let _g = self.enter()?;
        let mut p = 0;
        // SAFETY: `p` is a valid out-pointer and the context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Ok(None);
        }
        check("cuMemAlloc", r)?;
        Ok(Some(p))
    }

    unsafe fn release(&self, ptr: u64, _bytes: usize) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: the caller guarantees `ptr` came from `reserve` and is no longer used.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
    }

    fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<Option<u64>> {
        let _g = self.enter()?;
        let mut p = 0;
        // SAFETY: `p` is a valid out-pointer and the context is current; the stream handle is
        // the caller's (NULL, 0x1 and 0x2 are valid handles). The memory comes from the
        // device's current (by default its default) memory pool.
        let r = unsafe { sys::cuMemAllocAsync(&mut p, bytes, raw_stream(stream)) };
        if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Ok(None);
        }
        check("cuMemAllocAsync", r)?;
        Ok(Some(p))
    }

    unsafe fn free_async(&self, ptr: u64, _bytes: usize, stream: Stream) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: the caller guarantees `ptr` came from `alloc_async`, is freed once, and that
        // its earlier uses are ordered before `stream`'s queued work.
        check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(ptr, raw_stream(stream)) })
    }

    fn create_event(&self) -> Result<Event> {
        let _g = self.enter()?;
        let mut e = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `e` is a valid out-pointer and the context is current.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags) })?;
        Ok(Event(e as u64))
    }

    fn destroy_event(&self, event: Event) {
        if crate::shutdown::process_exiting() {
            return;
        }
        if let Ok(_g) = self.enter() {
            // SAFETY: the event came from `create_event` and is destroyed once.
            unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) };
        }
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: the event is live; the stream handle is the caller's, valid per the contract.
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.0 as sys::CUevent, raw_stream(stream)) })
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        let _g = self.enter()?;
        // SAFETY: the event is live.
        let r = unsafe { sys::cuEventQuery(event.0 as sys::CUevent) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|_| true)
    }

    fn sync_event(&self, event: Event) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: the event is live.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) })
    }

    fn synchronize(&self) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: no arguments; the context is current (`enter`).
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: the event is live; the stream is the caller's.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(raw_stream(stream), event.0 as sys::CUevent, 0)
        })
    }

    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        // The one query CUDA allows during any capture: no capture-mode switch needed.
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut implicated = false;
        self.query("cuStreamIsCapturing", stream, || {
            // SAFETY: `status` is a valid out-pointer; NULL, 0x1 and 0x2 are accepted handles.
            let r = unsafe { sys::cuStreamIsCapturing(raw_stream(stream), &mut status) };
            // Of the legacy stream while a blocking stream (a per-thread stream among them) is
            // being captured: CUDA's "implicit" error, which harms nothing, where any use of
            // the legacy stream would invalidate that capture (measured on the H200:
            // `notes/experiments/s23_blocking_capture_probe.py`).
            if stream.is_legacy() && r == sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT {
                implicated = true;
                return sys::CUresult::CUDA_SUCCESS;
            }
            r
        })?;
        // An invalidated capture is still open until cuStreamEndCapture: treated as capturing.
        Ok(implicated || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn stream_key_calls(&self, _stream: Stream, answer: &Result<StreamKey>) -> u64 {
        key_calls(answer)
    }

    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        // `cuStreamGetId` on a stream being captured fails and invalidates the capture
        // (measured on the H200, global and thread-local modes), and so does it on the legacy
        // stream while a blocking stream is captured: ask first, with the one query CUDA
        // allows during any capture.
        if self.stream_capturing(stream)? {
            return Err(Error::StreamCapturing { stream: stream.as_raw() });
        }
        let mut id = 0;
        self.query("cuStreamGetId", stream, || {
            // SAFETY: `id` is a valid out-pointer; NULL, 0x1 and 0x2 are accepted handles.
            unsafe { sys::cuStreamGetId(raw_stream(stream), &mut id) }
        })?;
        Ok(StreamKey(id))
    }
}

/// The driver calls one `CudaDevice::stream_key` made, given its answer: `cuStreamIsCapturing`
/// first, then `cuStreamGetId` only where that query let the lookup on.
fn key_calls(answer: &Result<StreamKey>) -> u64 {
    match answer {
        Err(Error::StreamCapturing { .. }) | Err(Error::Driver { call: "cuStreamIsCapturing", .. }) => 1,
        _ => 2,
    }
}

#[cfg(all(test, not(loom)))]
mod key_calls_tests {
    use super::*;

    #[test]
    fn a_lookup_the_capture_query_stopped_made_one_call() {
        assert_eq!(key_calls(&Ok(StreamKey(7))), 2);
        assert_eq!(key_calls(&Err(Error::Driver { call: "cuStreamGetId", code: 400 })), 2);
        assert_eq!(key_calls(&Err(Error::StreamCapturing { stream: 0x1 })), 1);
        assert_eq!(key_calls(&Err(Error::Driver { call: "cuStreamIsCapturing", code: 400 })), 1);
    }
}
