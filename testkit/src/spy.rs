//! A call-counting device for tests that count or fail driver calls: [`Spy`] forwards every
//! call to another device, counts each (a failed one too), can fail the call with a chosen
//! index, counts the records, waits and frees that succeeded, notes uses of the legacy stream
//! while watching, and can run a hook right after the legacy stream's identity is asked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use cuarena::{Device, Error, Event, Result, Stream, StreamKey};

use crate::HostDevice;
use crate::interpose::{Interpose, Interposed};

/// A hook run once, after the legacy stream's identity was asked while it is set.
pub type Hook = Box<dyn FnOnce() + Send>;

/// A device that counts every call made of it, and can fail the call with a chosen index,
/// note every use of the legacy stream while watching (its capture query excepted: CUDA allows
/// it during any capture), and run a hook right after a lookup of the legacy stream's
/// identity.
pub struct Spy {
    pub base: Arc<dyn Device>,
    /// Every call, a failed one too.
    pub calls: AtomicU64,
    /// The index (a value of `calls` before the call) of the call to fail; `u64::MAX`: none.
    pub fail_at: AtomicU64,
    /// Calls that succeeded, by kind.
    pub records: AtomicU64,
    pub waits: AtomicU64,
    pub frees: AtomicU64,
    pub watch: AtomicBool,
    pub legacy_uses: Mutex<Vec<String>>,
    pub after_legacy_key: Mutex<Option<Hook>>,
}

impl Spy {
    pub fn over(base: Arc<dyn Device>) -> Arc<Interposed<Spy>> {
        Arc::new(Interposed(Spy {
            base,
            calls: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            records: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            watch: AtomicBool::new(false),
            legacy_uses: Mutex::new(Vec::new()),
            after_legacy_key: Mutex::new(None),
        }))
    }
    pub fn new(sim: &HostDevice) -> Arc<Interposed<Spy>> {
        Spy::over(Arc::new(sim.clone()))
    }
    pub fn calls(&self) -> u64 {
        self.calls.load(SeqCst)
    }
    /// Counts a call; fails it if it is the chosen one.
    pub fn tick(&self, what: &'static str) -> Result<()> {
        let n = self.calls.fetch_add(1, SeqCst);
        if self.fail_at.load(SeqCst) == n {
            return Err(Error::Driver { call: what, code: 999 });
        }
        Ok(())
    }
    fn legacy(&self, s: Stream, what: &str) {
        if s.is_legacy() && self.watch.load(SeqCst) {
            self.legacy_uses.lock().unwrap().push(what.to_string());
        }
    }
    pub fn legacy_uses(&self) -> Vec<String> {
        self.legacy_uses.lock().unwrap().clone()
    }
}

impl Interpose for Spy {
    fn base(&self) -> &dyn Device {
        &*self.base
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.tick("reserve")?;
        self.base.reserve(bytes)
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.tick("release")?;
        // SAFETY: forwarded from the caller.
        unsafe { self.base.release(ptr, bytes) }
    }
    fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<Option<u64>> {
        self.legacy(stream, "alloc_async");
        self.tick("alloc_async")?;
        self.base.alloc_async(bytes, stream)
    }
    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> Result<()> {
        self.legacy(stream, "free_async");
        self.tick("free_async")?;
        // SAFETY: forwarded from the caller.
        let r = unsafe { self.base.free_async(ptr, bytes, stream) };
        if r.is_ok() {
            self.frees.fetch_add(1, SeqCst);
        }
        r
    }
    fn create_event(&self) -> Result<Event> {
        self.tick("create_event")?;
        self.base.create_event()
    }
    fn destroy_event(&self, event: Event) {
        // Cannot fail: counted, never failed.
        self.calls.fetch_add(1, SeqCst);
        self.base.destroy_event(event)
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.legacy(stream, "record_event");
        self.tick("record_event")?;
        let r = self.base.record_event(event, stream);
        if r.is_ok() {
            self.records.fetch_add(1, SeqCst);
        }
        r
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        self.tick("query_event")?;
        self.base.query_event(event)
    }
    fn sync_event(&self, event: Event) -> Result<()> {
        self.tick("sync_event")?;
        self.base.sync_event(event)
    }
    fn synchronize(&self) -> Result<()> {
        self.tick("synchronize")?;
        self.base.synchronize()
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.legacy(stream, "stream_wait_event");
        self.tick("stream_wait_event")?;
        let r = self.base.stream_wait_event(stream, event);
        if r.is_ok() {
            self.waits.fetch_add(1, SeqCst);
        }
        r
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        self.legacy(stream, "stream_key");
        self.tick("stream_key")?;
        let r = self.base.stream_key(stream);
        if stream.is_legacy()
            && r.is_ok()
            && let Some(hook) = self.after_legacy_key.lock().unwrap().take()
        {
            hook();
        }
        r
    }
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        self.tick("stream_capturing")?;
        self.base.stream_capturing(stream)
    }
}
