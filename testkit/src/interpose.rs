//! A test device that changes a few calls of another device and forwards the rest: implement
//! [`Interpose`] with [`Interpose::base`] and the calls the test changes, and hand
//! `Arc::new(Interposed(it))` to `Allocator::new`. Every call not overridden goes to `base()` as it is,
//! the defaulted ones (`device_id`, `stream_key_calls`, `stream_capturing`) included, so a
//! wrapper never silently answers with the trait's default where its base answers otherwise.

use std::ops::Deref;

use cuarena::{Device, DeviceKind, Event, Result, Stream, StreamKey};

/// The calls of [`Device`], each forwarded to [`Interpose::base`] unless overridden.
pub trait Interpose: Send + Sync {
    /// The device every call not overridden goes to.
    fn base(&self) -> &dyn Device;

    fn kind(&self) -> DeviceKind {
        self.base().kind()
    }
    fn ordinal(&self) -> i32 {
        self.base().ordinal()
    }
    fn device_id(&self) -> u64 {
        self.base().device_id()
    }
    fn total_memory(&self) -> Result<usize> {
        self.base().total_memory()
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.base().reserve(bytes)
    }
    /// # Safety
    /// As [`Device::release`].
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: forwarded from the caller, who gives `Device::release`'s guarantees.
        unsafe { self.base().release(ptr, bytes) }
    }
    fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<Option<u64>> {
        self.base().alloc_async(bytes, stream)
    }
    /// # Safety
    /// As [`Device::free_async`].
    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> Result<()> {
        // SAFETY: forwarded from the caller, who gives `Device::free_async`'s guarantees.
        unsafe { self.base().free_async(ptr, bytes, stream) }
    }
    fn create_event(&self) -> Result<Event> {
        self.base().create_event()
    }
    fn destroy_event(&self, event: Event) {
        self.base().destroy_event(event)
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.base().record_event(event, stream)
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        self.base().query_event(event)
    }
    fn sync_event(&self, event: Event) -> Result<()> {
        self.base().sync_event(event)
    }
    fn synchronize(&self) -> Result<()> {
        self.base().synchronize()
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.base().stream_wait_event(stream, event)
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        self.base().stream_key(stream)
    }
    fn stream_key_calls(&self, stream: Stream, answer: &Result<StreamKey>) -> u64 {
        self.base().stream_key_calls(stream, answer)
    }
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        self.base().stream_capturing(stream)
    }
}

/// An [`Interpose`] as a [`Device`]; derefs to it, so a test reaches its own fields and methods.
pub struct Interposed<T>(pub T);

impl<T> Deref for Interposed<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Interpose + 'static> Device for Interposed<T> {
    fn kind(&self) -> DeviceKind {
        self.0.kind()
    }
    fn ordinal(&self) -> i32 {
        self.0.ordinal()
    }
    fn device_id(&self) -> u64 {
        self.0.device_id()
    }
    fn total_memory(&self) -> Result<usize> {
        self.0.total_memory()
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.0.reserve(bytes)
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: forwarded from the caller, who gives `Device::release`'s guarantees.
        unsafe { self.0.release(ptr, bytes) }
    }
    fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<Option<u64>> {
        self.0.alloc_async(bytes, stream)
    }
    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> Result<()> {
        // SAFETY: forwarded from the caller, who gives `Device::free_async`'s guarantees.
        unsafe { self.0.free_async(ptr, bytes, stream) }
    }
    fn create_event(&self) -> Result<Event> {
        self.0.create_event()
    }
    fn destroy_event(&self, event: Event) {
        self.0.destroy_event(event)
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.0.record_event(event, stream)
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        self.0.query_event(event)
    }
    fn sync_event(&self, event: Event) -> Result<()> {
        self.0.sync_event(event)
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.0.stream_wait_event(stream, event)
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        self.0.stream_key(stream)
    }
    fn stream_key_calls(&self, stream: Stream, answer: &Result<StreamKey>) -> u64 {
        self.0.stream_key_calls(stream, answer)
    }
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        self.0.stream_capturing(stream)
    }
}
