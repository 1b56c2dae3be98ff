//! Interop with cudarc: a typed buffer that cudarc's copies and kernel launches accept.
//!
//! [`CudaBuffer<T>`] is a cuarena block on a cudarc [`CudaStream`]. It implements cudarc's
//! `DeviceSlice`, `DevicePtr` and `DevicePtrMut` (so `memcpy_htod`, `memcpy_dtov` and friends
//! take it) and `PushKernelArg` (so `launch_builder(..).arg(&buf)` takes it). Copies on another
//! stream are remembered and fenced at the free, like `record_stream`. Kernel launches cannot
//! report their stream through cudarc's API: for a launch on another stream, call
//! [`CudaBuffer::record_stream`].
//!
//! cudarc's views (`CudaView`, `CudaViewMut`) have private fields, so no type outside cudarc
//! can make one. [`CudaBuffer::with_cuda_slice`] instead lends the buffer as a cudarc
//! `CudaSlice` for the length of a closure (cudarc's own `upgrade_device_ptr`), from which
//! `slice(..)`, `as_view()` and `as_view_mut()` give views; the slice is leaked back, never
//! freed by cudarc, also if the closure panics. A `&CudaStream` converts into a [`Stream`].

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr as CudarcDevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs,
    PushKernelArg, SyncOnDrop, sys,
};

use crate::allocator::Allocator;
use crate::buffer::UsedOn;
use crate::error::{Error, Result};
use crate::ptr::DeviceAddr;
use crate::stream::{Stream, StreamUse};

/// `len` values of `T` in cuarena memory, on a cudarc stream; freed on that stream on drop.
pub struct CudaBuffer<T> {
    alloc: Allocator,
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    /// `stream` as the thread that made the buffer named it, if it is cudarc's per-thread
    /// stream (`0x2`; see [`crate::DeviceBuffer`]).
    home: Option<StreamUse>,
    used_on: Mutex<UsedOn>,
    _t: PhantomData<T>,
}

// SAFETY: the buffer is a device address plus handles that may be used from any thread; `T`
// values live on the device, never on the host.
unsafe impl<T> Send for CudaBuffer<T> {}
// SAFETY: as above; the only interior mutability is the mutex.
unsafe impl<T> Sync for CudaBuffer<T> {}

impl Allocator {
    /// A buffer of `len` values of `T` for `stream`.
    pub fn cuda_buffer<T>(&self, len: usize, stream: &Arc<CudaStream>) -> Result<CudaBuffer<T>> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or(Error::OutOfMemory {
            requested: usize::MAX,
            reserved: 0,
            in_use: 0,
            largest_free: 0,
            limit: 0,
        })?;
        let own = Stream::from(&**stream);
        let ptr = self.allocate(bytes, own)?;
        Ok(CudaBuffer {
            alloc: self.clone(),
            ptr: ptr.0,
            len,
            stream: Arc::clone(stream),
            home: own.is_per_thread().then(|| StreamUse::here(own)),
            used_on: Mutex::new(UsedOn::default()),
            _t: PhantomData,
        })
    }
}

impl<T> CudaBuffer<T> {
    fn own(&self) -> Stream {
        Stream::from_raw(self.stream.cu_stream() as usize)
    }

    /// Declares that work on `stream` uses the buffer: the free is fenced after it too.
    /// cudarc's per-thread stream names the calling thread's (see [`crate::DeviceBuffer`]).
    /// The stream must not be destroyed (its last `Arc` dropped) before the buffer is freed:
    /// the free records its fence there, by the stream's handle, which CUDA gives to the next
    /// stream made once it is destroyed. The same holds for every stream passed to the
    /// buffer's `device_ptr` and `device_ptr_mut` (cudarc's launches), which declare it; on
    /// the per-thread stream they declare the launching thread's. Work that
    /// [`CudaBuffer::with_cuda_slice`] queues on the buffer's own per-thread stream from a
    /// thread other than the one that made the buffer must be declared from that thread.
    pub fn record_stream(&self, stream: &CudaStream) {
        let mut v = self.used_on.lock().unwrap_or_else(|p| p.into_inner());
        v.record(Stream::from(stream), self.own());
    }

    /// The device address.
    pub fn device_address(&self) -> u64 {
        self.ptr
    }

    /// Runs `f` with the buffer lent as a cudarc `CudaSlice<T>` on the buffer's stream, so that
    /// cudarc's views (`slice(..)`, `as_view()`, `as_view_mut()`) and every cudarc API that
    /// takes a slice or a view can use cuarena memory. The slice is handed back with cudarc's
    /// `leak` (which frees nothing) when `f` returns or unwinds; work `f` queues on other
    /// streams must be declared with [`CudaBuffer::record_stream`], as for launches. `f` must
    /// not move the lent slice out (`std::mem::replace` or `swap` with another): cudarc would
    /// then free cuarena's memory, so the process is aborted when it is handed back.
    pub fn with_cuda_slice<R>(&mut self, f: impl FnOnce(&mut CudaSlice<T>) -> R) -> R {
        /// Gives the lent slice back without freeing it, on return and on unwinding alike.
        struct Lent<T> {
            slice: std::mem::ManuallyDrop<CudaSlice<T>>,
            ptr: u64,
        }
        impl<T> Drop for Lent<T> {
            fn drop(&mut self) {
                // SAFETY: taken once, here, and never used after.
                let s = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
                if s.leak() != self.ptr {
                    // `f` swapped the lent slice out (`std::mem::replace`): its caller holds a
                    // cudarc slice over cuarena's block, which cudarc would free while cuarena
                    // hands the block out again. Nothing safe can follow; stop here.
                    eprintln!(
                        "cuarena: the CudaSlice lent by CudaBuffer::with_cuda_slice was swapped out of it; aborting \
                         (cudarc would free cuarena's memory)"
                    );
                    std::process::abort();
                }
            }
        }
        // SAFETY: `ptr` is a live cuarena allocation of `len` values of `T` (this buffer, which
        // the `&mut self` borrow keeps alive and unshared for the closure's length); the slice
        // is never dropped as cudarc's own (so never freed by cudarc), only leaked by `Lent`,
        // which aborts the process if the closure swapped it for another.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(self.ptr, self.len) };
        let mut lent = Lent { slice: std::mem::ManuallyDrop::new(slice), ptr: self.ptr };
        f(&mut lent.slice)
    }
}

impl From<&CudaStream> for Stream {
    /// The stream's raw handle (cudarc's default stream is the legacy stream, NULL).
    fn from(s: &CudaStream) -> Stream {
        Stream::from_raw(s.cu_stream() as usize)
    }
}

impl<T> DeviceSlice<T> for CudaBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> CudarcDevicePtr<T> for CudaBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.record_stream(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for CudaBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.record_stream(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

// SAFETY: pushes a pointer to the buffer's device address, which lives as long as the borrow;
// the kernel receives a `T*` into a live allocation of `len` values.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaBuffer<T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b CudaBuffer<T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaBuffer<T>> for LaunchArgs<'a> {
    fn arg(&mut self, arg: &'b mut CudaBuffer<T>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}

impl<T> Drop for CudaBuffer<T> {
    fn drop(&mut self) {
        let own = self.own();
        let used = self.used_on.get_mut().unwrap_or_else(|p| p.into_inner());
        let bytes = self.len * size_of::<T>();
        used.free(&self.alloc, DeviceAddr(self.ptr), bytes, own, self.home);
    }
}
