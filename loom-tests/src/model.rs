//! A minimal device for the loom models: fake addresses, no memory, and events that complete
//! only when the model's "GPU" thread calls [`ModelDevice::complete_all`].
//!
//! Every call is a handful of atomic operations (the facade's, so loom sees them), which keeps
//! the models' state space small. It records whether a stream was made to wait on an event, so
//! a model can tell "reused after completion" from "reused behind a stream wait".

use cuarena::{Device, DeviceKind, Error, Event, Result, Stream, StreamKey};
#[cfg(loom)]
use loom::{
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
    thread_local,
};
#[cfg(not(loom))]
use std::{
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
    thread_local,
};

const EVENTS: usize = 16;

thread_local! {
    // Not `const { .. }`: loom's `thread_local!` has no such form.
    #[allow(clippy::missing_const_for_thread_local)]
    static THREAD_KEY: std::cell::Cell<u64> = std::cell::Cell::new(0);
}

/// The model device.
pub struct ModelDevice {
    base: u64,
    capacity: u64,
    next: AtomicU64,
    events: Vec<(AtomicU64, AtomicU64)>,
    made: AtomicUsize,
    waits: AtomicUsize,
    keys: AtomicU64,
    /// The handle of the one user stream a model destroyed (0: none).
    destroyed: AtomicUsize,
    /// Device synchronises so far.
    syncs: AtomicUsize,
    /// Times the GPU caught up with all work (`complete_all` or a synchronise).
    caught_up: AtomicUsize,
    /// Uses of memory a model marked before freeing it on the legacy stream
    /// ([`ModelDevice::mark_legacy_use`]), and the highest mark a legacy-stream action (an
    /// event record or a stream wait on the legacy stream) was issued after. Both change only
    /// by read-modify-writes, as the driver's own lock orders calls: an action issued after a
    /// mark in the model's order reads it.
    legacy_marks: AtomicU64,
    legacy_covered: AtomicU64,
    /// Open captures of a blocking stream ([`ModelDevice::begin_capture`]): while one is open,
    /// the legacy stream reads as capturing, and a device synchronise or a legacy-stream action
    /// would break the capture, so the model device panics at one.
    captures: AtomicUsize,
}

impl ModelDevice {
    /// Addresses start at `base` (keep it aligned to the superblock size).
    pub fn new(base: u64, capacity: u64) -> ModelDevice {
        ModelDevice {
            base,
            capacity,
            next: AtomicU64::new(base),
            events: (0..EVENTS).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect(),
            made: AtomicUsize::new(0),
            waits: AtomicUsize::new(0),
            keys: AtomicU64::new(10),
            destroyed: AtomicUsize::new(0),
            syncs: AtomicUsize::new(0),
            caught_up: AtomicUsize::new(0),
            legacy_marks: AtomicU64::new(0),
            legacy_covered: AtomicU64::new(0),
            captures: AtomicUsize::new(0),
        }
    }

    /// Marks a use of memory the caller is about to free on the legacy stream (a kernel that
    /// wrote it, on any blocking stream): its number, for [`ModelDevice::legacy_covered`].
    pub fn mark_legacy_use(&self) -> u64 {
        self.legacy_marks.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The highest use mark some legacy-stream action was issued after: a use with a mark up to
    /// this is ordered before all later work of every blocking stream.
    pub fn legacy_covered(&self) -> u64 {
        self.legacy_covered.load(Ordering::Acquire)
    }

    /// A legacy-stream action: it follows every use marked before it.
    fn legacy_action(&self, s: Stream) {
        if s.is_legacy() {
            self.not_during_a_capture("a legacy-stream action");
            let m = self.legacy_marks.fetch_add(0, Ordering::AcqRel);
            self.legacy_covered.fetch_max(m, Ordering::AcqRel);
        }
    }

    /// A capture of some blocking stream begins (a model announces it to the allocator first,
    /// as PyTorch does): see `captures`.
    pub fn begin_capture(&self) {
        self.captures.fetch_add(1, Ordering::AcqRel);
    }

    /// The capture begun by [`ModelDevice::begin_capture`] ends.
    pub fn end_capture(&self) {
        self.captures.fetch_sub(1, Ordering::AcqRel);
    }

    /// Panics if a capture is open: `what` would break it.
    fn not_during_a_capture(&self, what: &str) {
        assert_eq!(self.captures.load(Ordering::Acquire), 0, "{what} during a capture breaks it");
    }

    /// Destroys the user stream `s`: its identity is gone, and recording on it fails.
    pub fn destroy_stream(&self, s: Stream) {
        assert!(s.is_user(), "only a user stream can be destroyed");
        self.destroyed.store(s.as_raw(), Ordering::Release);
    }

    /// Device synchronises so far.
    pub fn syncs(&self) -> usize {
        self.syncs.load(Ordering::Acquire)
    }

    /// True once the GPU has caught up with all work at least once (every stream's work,
    /// including work queued with no event, as a user stream's local frees are).
    pub fn caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire) > 0
    }

    fn check_stream(&self, s: Stream) -> Result<()> {
        if s.is_user() && self.destroyed.load(Ordering::Acquire) == s.as_raw() {
            return Err(Error::Driver { call: "model: destroyed stream", code: 400 });
        }
        Ok(())
    }

    /// The GPU catches up: every event recorded so far completes.
    pub fn complete_all(&self) {
        for (recorded, done) in &self.events {
            done.store(recorded.load(Ordering::Acquire), Ordering::Release);
        }
        self.caught_up.fetch_add(1, Ordering::AcqRel);
    }

    /// True if every event recorded so far has completed.
    pub fn all_complete(&self) -> bool {
        self.events.iter().all(|(r, d)| d.load(Ordering::Acquire) >= r.load(Ordering::Acquire))
    }

    /// Stream waits issued so far.
    pub fn waits(&self) -> usize {
        self.waits.load(Ordering::Acquire)
    }

    fn event(&self, e: Event) -> Result<&(AtomicU64, AtomicU64)> {
        self.events.get(e.0 as usize).ok_or(Error::Driver { call: "model event", code: 400 })
    }
}

impl Device for ModelDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Host
    }
    fn ordinal(&self) -> i32 {
        0
    }
    fn total_memory(&self) -> Result<usize> {
        Ok(self.capacity as usize)
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        let p = self.next.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok((p + bytes as u64 <= self.base + self.capacity).then_some(p))
    }
    unsafe fn release(&self, _ptr: u64, _bytes: usize) -> Result<()> {
        Ok(())
    }
    fn alloc_async(&self, bytes: usize, _s: Stream) -> Result<Option<u64>> {
        self.reserve(bytes)
    }
    unsafe fn free_async(&self, _ptr: u64, _bytes: usize, _s: Stream) -> Result<()> {
        Ok(())
    }
    fn create_event(&self) -> Result<Event> {
        let i = self.made.fetch_add(1, Ordering::Relaxed);
        if i >= EVENTS {
            return Err(Error::Driver { call: "model: out of events", code: 2 });
        }
        Ok(Event(i as u64))
    }
    fn destroy_event(&self, _event: Event) {}
    fn record_event(&self, e: Event, s: Stream) -> Result<()> {
        self.check_stream(s)?;
        self.event(e)?.0.fetch_add(1, Ordering::AcqRel);
        self.legacy_action(s);
        Ok(())
    }
    fn query_event(&self, e: Event) -> Result<bool> {
        let (r, d) = self.event(e)?;
        Ok(d.load(Ordering::Acquire) >= r.load(Ordering::Acquire))
    }
    /// A host wait: the GPU catches up with this event.
    fn sync_event(&self, e: Event) -> Result<()> {
        let (r, d) = self.event(e)?;
        d.fetch_max(r.load(Ordering::Acquire), Ordering::AcqRel);
        Ok(())
    }
    /// A host wait for all work: the GPU catches up with every event.
    fn synchronize(&self) -> Result<()> {
        self.not_during_a_capture("a device synchronise");
        self.syncs.fetch_add(1, Ordering::AcqRel);
        self.complete_all();
        Ok(())
    }
    fn stream_wait_event(&self, s: Stream, e: Event) -> Result<()> {
        self.check_stream(s)?;
        self.event(e)?;
        self.waits.fetch_add(1, Ordering::AcqRel);
        self.legacy_action(s);
        Ok(())
    }
    /// Only the legacy stream is ever captured here, and only as a blocking stream's capture
    /// makes it read (`begin_capture`).
    fn stream_capturing(&self, s: Stream) -> Result<bool> {
        Ok(s.is_legacy() && self.captures.load(Ordering::Acquire) > 0)
    }
    fn stream_key(&self, s: Stream) -> Result<StreamKey> {
        if s.is_legacy() {
            return Ok(StreamKey(1));
        }
        if s.is_per_thread() {
            return Ok(StreamKey(THREAD_KEY.with(|k| {
                if k.get() == 0 {
                    k.set(self.keys.fetch_add(1, Ordering::Relaxed));
                }
                k.get()
            })));
        }
        self.check_stream(s)?;
        Ok(StreamKey(s.as_raw() as u64 + 1_000_000))
    }
}
