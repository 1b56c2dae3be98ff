//! Fences: a CUDA event recorded on the stream of a free, and the rule for reusing the block.
//!
//! **The rule.** A block freed on stream `F` may be handed to stream `N` only if
//! - `N` and `F` are the same stream (equal [`StreamKey`]s: work on one stream is ordered), or
//! - the fence's event has completed (seen by `cuEventQuery`), or
//! - `N` has been made to wait on the event (`cuStreamWaitEvent`) before the block is returned.
//!
//! [`Fence::order_before`] applies the rule for the pool ([`FenceSet::order_before`]). Arenas
//! never touch a fence on their fast path: they keep fenced blocks aside, and their slow path
//! takes them back once a fence is on their stream or seen complete, or behind a stream wait
//! ([`Fence::wait_for`], no event query); only an explicit `flush` queries ([`Fence::poll`];
//! see `arena.rs`).
//!
//! Three kinds of free carry no event: an arena's own frees on the legacy stream, reused after
//! a [`LegacyAction`]; pool frees on the legacy stream, ordered only at reuse, by a legacy
//! action on the legacy stream or an event recorded there for another stream (a lazy legacy
//! fence, [`FenceSet`]); and remote frees parked from user streams, delivered
//! after a device synchronise (`allocator.rs`, `Zombies`).
//!
//! Fences are shared (`Arc`) between the blocks of one batch and the pieces of a split extent.
//! The event goes back to the [`EventPool`] when the last reference drops; recording it again
//! later is safe because a stream wait captures the event's state at the time of the wait.

use crate::device::counted::Counted;
use crate::device::{Device, Event};
use crate::error::Result;
use crate::stream::{Stream, StreamKey};
use crate::sync::{AtomicBool, AtomicU64, Mutex, Ordering, lock, thread_id};
use std::sync::Arc;

/// Reusable events (creating one is a driver call).
///
/// Invariant: every event in `free` was created by `device`, is not destroyed, and is held by
/// nothing else (no [`Fence`], no [`LegacyAction`]); one whose last record may still be
/// pending is fine to record again or to destroy (a stream wait already queued keeps the state
/// it captured, and CUDA frees a destroyed event's resources once its work completes).
///
/// `free` keeps the most events that were ever idle at once, so a burst (many batches of
/// remote frees in flight) leaves them all here; [`EventPool::shrink`], on `trim`, destroys
/// them. Nothing shrinks it on the way: a bound on `free` would make a workload whose fences
/// in flight swing past it create and destroy an event per batch, two driver calls each.
pub(crate) struct EventPool {
    device: Arc<dyn Device>,
    free: Mutex<Vec<Event>>,
    /// Numbers the records. Taken after the record was issued, so it orders the records of
    /// **one thread** (program order), and nothing across threads.
    next_seq: AtomicU64,
}

impl EventPool {
    pub(crate) fn new(device: Arc<dyn Device>) -> EventPool {
        EventPool { device, free: Mutex::new(Vec::new()), next_seq: AtomicU64::new(0) }
    }

    fn get(&self, dev: &Counted<'_>) -> Result<Event> {
        if let Some(e) = lock(&self.free).pop() {
            return Ok(e);
        }
        dev.create_event()
    }

    fn put(&self, e: Event) {
        lock(&self.free).push(e);
    }

    /// Destroys every idle event (a `trim`). Events held by fences and by the legacy action
    /// are not idle and stay; they come back here when released.
    pub(crate) fn shrink(&self, dev: &Counted<'_>) {
        // Taken out under the lock, destroyed without it (a driver call each).
        let idle = std::mem::take(&mut *lock(&self.free));
        if !cfg!(cuarena_mutant = "shrink_leaks_events") {
            for e in idle {
                dev.destroy_event(e);
            }
        }
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let free = std::mem::take(&mut *lock(&self.free));
        for e in free {
            self.device.destroy_event(e);
        }
    }
}

/// A *legacy action*: `cuStreamWaitEvent` on the legacy stream, on an event recorded there
/// once. CUDA documents such a wait as an action of the legacy stream ("Stream synchronization
/// behavior": an action "such as a kernel launch or cudaStreamWaitEvent()" in the legacy stream
/// first waits on all blocking streams, and then all blocking streams wait on it), and the H200
/// does so for a wait on an event completed long before (`notes/experiments/
/// legacy_wait_is_an_action.py`: 20 of 20 trials ordered, as an event record, 0 without). So it
/// orders what an event record on the legacy stream orders for the legacy and the per-thread
/// streams, at the cost of a wait. On the legacy stream a wait serialises across threads as a
/// record there does (183 ns alone, 19.0 µs when 16 threads issue one at once, against an
/// event record's 270 ns and 21.8 µs: `BENCHMARKS.md`, eleventh measurement), so actions are
/// batched and shared (below). It orders nothing for a non-blocking stream.
///
/// ## One action for every thread's kept-back frees
/// An action orders *all* earlier work of every blocking stream before all later work, so one
/// thread's action also serves another thread's frees on the legacy stream, if it was issued
/// after them. On 16 threads at once a legacy action costs about 20 µs (the legacy stream is
/// one object for all of them), so an arena does not issue its own for a batch that another
/// thread's has covered. The rule, with two counters:
/// - a thread *publishes* a batch of its kept-back frees with [`LegacyAction::request`]: a
///   ticket `t` from `requests` (an `AcqRel` read-modify-write, after the frees);
/// - [`LegacyAction::issue`] reads `requests` (`Acquire`) as `r` **before** its call, makes the
///   call, and only then raises `covered` to `r` (`fetch_max`, `Release`);
/// - the batch is reusable once `covered >= t` ([`LegacyAction::covers`], `Acquire`).
///
/// Why that is enough: the issuer's `Acquire` load of `requests` reads a value at least `t`,
/// written by the publisher's read-modify-write or by a later one in its release sequence, so
/// the frees (and every use the free's contract covers, issued before them) happen before the
/// issuer's call; and a publisher that reads `covered >= t` synchronises with the `fetch_max`
/// after that call, so the call happens before the reuse. Tickets are never reused, so a
/// ticket not yet covered is never taken for one that was. Loom model:
/// `loom-tests/tests/legacy.rs`; the mutation `legacy_covered_early` (raised before the call)
/// must fail it.
pub(crate) struct LegacyAction {
    /// The event waited on (its raw value), [`NO_EVENT`] until the first action records it.
    event: AtomicU64,
    pool: Arc<EventPool>,
    /// Tickets handed out by [`LegacyAction::request`] (the last one's number).
    requests: AtomicU64,
    /// Every ticket up to this is covered by an action issued after it was handed out.
    covered: AtomicU64,
}

/// [`LegacyAction::event`] before the first action.
const NO_EVENT: u64 = u64::MAX;

impl LegacyAction {
    pub(crate) fn new(pool: Arc<EventPool>) -> LegacyAction {
        LegacyAction {
            event: AtomicU64::new(NO_EVENT),
            pool,
            requests: AtomicU64::new(0),
            covered: AtomicU64::new(0),
        }
    }

    /// Publishes a batch of frees made on the legacy stream before this call: its ticket (at
    /// least 1), covered by any action issued from now on.
    pub(crate) fn request(&self) -> u64 {
        // `AcqRel`: `Release` so that an issuer's `Acquire` load of a later value follows the
        // frees (see "One action for every thread's kept-back frees").
        self.requests.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// True if an action issued after ticket `t` was handed out has been queued.
    pub(crate) fn covers(&self, t: u64) -> bool {
        self.covered.load(Ordering::Acquire) >= t
    }

    /// Queues one legacy action (the first also records the event it waits on), covering every
    /// ticket handed out before it.
    pub(crate) fn issue(&self, dev: &Counted<'_>) -> Result<()> {
        // Read before the call: the tickets this action is issued after. The mutation
        // `legacy_read_after_call` reads after it, covering tickets handed out while the call
        // was made (their frees not ordered before it): the loom model `legacy_roles.rs` and
        // the test `legacy_actions::an_action_queued_before_a_ticket_does_not_cover_it_even_if_raised_after`
        // must then fail.
        #[cfg(not(cuarena_mutant = "legacy_read_after_call"))]
        let r = self.requests.load(Ordering::Acquire);
        // The mutation `legacy_covered_early` says so before the call: the loom model
        // `legacy.rs` must then fail.
        #[cfg(not(cuarena_mutant = "legacy_read_after_call"))]
        if cfg!(cuarena_mutant = "legacy_covered_early") {
            self.covered.fetch_max(r, Ordering::Release);
        }
        self.issue_call(dev)?;
        #[cfg(cuarena_mutant = "legacy_read_after_call")]
        let r = self.requests.load(Ordering::Acquire);
        // `Release`: a publisher that reads this follows the call.
        self.covered.fetch_max(r, Ordering::Release);
        Ok(())
    }

    /// The action's driver calls.
    fn issue_call(&self, dev: &Counted<'_>) -> Result<()> {
        let mut e = self.event.load(Ordering::Acquire);
        if e == NO_EVENT {
            let fresh = self.pool.get(dev)?;
            if let Err(err) = dev.record_fence(fresh, Stream::LEGACY) {
                self.pool.put(fresh);
                return Err(err);
            }
            e = match self.event.compare_exchange(NO_EVENT, fresh.0, Ordering::AcqRel, Ordering::Acquire) {
                // The mutation `legacy_event_lent` also puts it back as idle, for a trim to
                // destroy while it is still waited on: the test
                // `events::a_trim_destroys_no_event_a_fence_or_the_legacy_action_still_holds`
                // must then fail.
                Ok(_) if cfg!(cuarena_mutant = "legacy_event_lent") => {
                    self.pool.put(fresh);
                    fresh.0
                }
                Ok(_) => fresh.0,
                Err(theirs) => {
                    self.pool.put(fresh); // another thread's came first
                    theirs
                }
            };
        }
        dev.wait_fence(Stream::LEGACY, Event(e))
    }
}

impl Drop for LegacyAction {
    fn drop(&mut self) {
        let e = self.event.load(Ordering::Acquire);
        if e != NO_EVENT {
            self.pool.put(Event(e));
        }
    }
}

/// An event recorded at a free, on the freeing stream.
pub(crate) struct Fence {
    event: Event,
    stream: StreamKey,
    /// The thread that recorded it ([`thread_id`]).
    recorder: u64,
    /// Taken after the record was issued. Among fences of one stream **recorded by one
    /// thread**, the highest was recorded last (the thread issued them in that order), so its
    /// completion implies the others'. Across threads it says nothing: two threads recording on
    /// one shared stream (the legacy stream, a shared user stream) can take their numbers in
    /// the opposite order to their records.
    seq: u64,
    /// Set once a query has seen the event complete; never cleared.
    done: AtomicBool,
    pool: Arc<EventPool>,
}

impl Fence {
    /// Records a fence on `stream` (whose identity is `key`).
    pub(crate) fn record(
        pool: &Arc<EventPool>,
        dev: &Counted<'_>,
        stream: Stream,
        key: StreamKey,
    ) -> Result<Arc<Fence>> {
        let event = pool.get(dev)?;
        if let Err(e) = dev.record_fence(event, stream) {
            pool.put(event);
            return Err(e);
        }
        let seq = pool.next_seq.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(Fence {
            event,
            stream: key,
            recorder: thread_id(),
            seq,
            done: AtomicBool::new(false),
            pool: Arc::clone(pool),
        }))
    }

    /// The identity of the stream the fence was recorded on.
    pub(crate) fn stream(&self) -> StreamKey {
        self.stream
    }

    /// True if a query has already seen the event complete (no driver call).
    pub(crate) fn known_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// True once the work before the fence has completed. Never blocks.
    pub(crate) fn poll(&self, dev: &Counted<'_>) -> Result<bool> {
        if self.known_done() || cfg!(cuarena_mutant = "fence_skip_check") {
            return Ok(true);
        }
        let done = dev.query_fence(self.event)?;
        if done {
            self.done.store(true, Ordering::Release);
        }
        Ok(done)
    }

    /// Blocks the host until the fence completes (a blocking trim, the last try before out of
    /// memory, and a graph pool's restore).
    pub(crate) fn wait_host(&self, dev: &Counted<'_>) -> Result<()> {
        if !self.known_done() {
            dev.sync_fence(self.event)?;
            self.done.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Orders later work on `stream` (identity `key`) after the fence with one stream wait,
    /// unless none is needed (the same stream, or seen complete): the reuse rule without an
    /// event query, for paths that would rather wait than ask (the arenas' slow path).
    pub(crate) fn wait_for(&self, dev: &Counted<'_>, stream: Stream, key: StreamKey) -> Result<()> {
        if self.stream == key || self.known_done() || cfg!(cuarena_mutant = "fence_skip_check") {
            return Ok(());
        }
        dev.wait_fence(stream, self.event)
    }

    /// Applies the reuse rule for handing the fenced block to `stream` (identity `key`).
    pub(crate) fn order_before(&self, dev: &Counted<'_>, stream: Stream, key: StreamKey) -> Result<()> {
        if self.stream == key || self.poll(dev)? {
            return Ok(());
        }
        dev.wait_fence(stream, self.event)
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        self.pool.put(self.event);
    }
}

/// The fences guarding one free extent: all must be satisfied before it is reused.
///
/// Invariant: at most one fence per (stream, recording thread), the one that thread recorded
/// last, and none known complete. Work on one stream completes in the order it was queued, and
/// one thread queues its records in program order, so that thread's latest fence on a stream
/// implies its earlier ones there. Fences of *different* threads on one stream are all kept:
/// which of them was queued last is not known (see [`Fence::seq`]). The set is bounded by the
/// (stream, thread) pairs that freed into the extent and whose fences are not yet known done.
///
/// `legacy`: some of the extent was freed on the legacy stream with no event recorded (a
/// *lazy* fence), and this is the highest [`LegacyAction`] ticket taken after those frees (0:
/// none). The legacy stream is one stream for every thread, so whoever hands the memory out
/// again can order it then, with a legacy-stream operation queued after the frees: that
/// follows every use the free's contract covers (legacy work waits for earlier work on the
/// blocking streams, CUDA's implicit synchronisation), and any work queued later on a blocking
/// stream waits for it ([`FenceSet::order_before`]):
/// - reuse on the legacy stream needs a legacy action issued after the ticket, by any thread
///   (none is issued when one already covers it: no driver call). It cannot skip the action:
///   the block may next be used on a per-thread stream, which orders itself only after legacy
///   *operations*;
/// - reuse on another stream records an event on the legacy stream, and that stream waits on it
///   (a non-blocking stream orders itself after no legacy action).
///
/// Tickets only grow, and an action covers every ticket taken before it, so the highest ticket
/// of a merged set stands for all of them.
#[derive(Default, Clone)]
pub(crate) struct FenceSet {
    fences: Vec<Arc<Fence>>,
    legacy: u64,
}

/// What a fence set needs to order a lazy legacy fence: the event pool, the legacy stream's
/// identity and its actions.
pub(crate) struct Legacy<'a> {
    pub(crate) events: &'a Arc<EventPool>,
    pub(crate) key: StreamKey,
    pub(crate) action: &'a LegacyAction,
}

impl FenceSet {
    pub(crate) fn one(f: Option<Arc<Fence>>) -> FenceSet {
        FenceSet { fences: f.into_iter().collect(), legacy: 0 }
    }

    /// A lazy fence for frees made on the legacy stream, with `ticket`, a [`LegacyAction`]
    /// ticket taken after them (see the type's comment).
    pub(crate) fn lazy_legacy(ticket: u64) -> FenceSet {
        debug_assert!(ticket > 0, "tickets start at 1 (0 is no lazy fence)");
        FenceSet { fences: Vec::new(), legacy: ticket }
    }

    /// True if memory guarded by this set may be used on any stream now, with no wait and no
    /// query: no lazy legacy fence, and every fence already known complete.
    pub(crate) fn is_clear(&self) -> bool {
        self.legacy == 0 && self.fences.iter().all(|f| f.known_done())
    }

    /// True if the set holds a lazy legacy fence.
    pub(crate) fn has_lazy_legacy(&self) -> bool {
        self.legacy != 0
    }

    /// Adds the fences of `other`, keeping the invariant.
    pub(crate) fn merge(&mut self, other: FenceSet) {
        self.legacy = self.legacy.max(other.legacy);
        self.fences.retain(|f| !f.known_done());
        for f in other.fences {
            if f.known_done() {
                continue;
            }
            match self.fences.iter_mut().find(|g| g.stream == f.stream && g.recorder == f.recorder) {
                Some(g) if g.seq >= f.seq => {}
                Some(g) => *g = f,
                None => self.fences.push(f),
            }
        }
    }

    /// Orders every fence before `stream` (identity `key`); see [`Fence::order_before`]. A
    /// lazy legacy fence is ordered now: on the legacy stream by a legacy action issued after
    /// its ticket (none if one already was), on another stream by an event recorded on the
    /// legacy stream and waited on. `legacy` is asked for only then.
    pub(crate) fn order_before<'a>(
        &self,
        dev: &Counted<'_>,
        stream: Stream,
        key: StreamKey,
        legacy: impl FnOnce() -> Result<Legacy<'a>>,
    ) -> Result<()> {
        self.fences.iter().try_for_each(|f| f.order_before(dev, stream, key))?;
        if self.legacy != 0 {
            let l = legacy()?;
            if key == l.key {
                // Any legacy action issued after the ticket is a legacy-stream operation queued
                // after the frees (`LegacyAction`). The mutation `pool_legacy_no_action` skips
                // it: `legacy_frees::a_pool_block_freed_on_the_legacy_stream_is_reused_there_behind_an_action`
                // must then fail.
                if !l.action.covers(self.legacy) && !cfg!(cuarena_mutant = "pool_legacy_no_action") {
                    l.action.issue(dev)?;
                }
            } else {
                // The record is a legacy-stream operation queued after the frees; a stream that
                // is not the legacy stream also waits on it.
                let f = Fence::record(l.events, dev, Stream::LEGACY, l.key)?;
                f.wait_for(dev, stream, key)?;
            }
        }
        Ok(())
    }

    /// True if the set needs no call on the legacy stream before a reuse there
    /// ([`FenceSet::order_before`] with the legacy stream would make none): its lazy legacy
    /// fence, if any, is covered by a legacy action already queued, and every recorded fence
    /// has completed (queried: an event query is no stream operation). For the pool's
    /// allocations on the legacy stream while a capture is announced (`GlobalPool::alloc_clear`).
    pub(crate) fn settled_for_legacy(&self, dev: &Counted<'_>, action: &LegacyAction) -> Result<bool> {
        if self.legacy != 0 && !action.covers(self.legacy) {
            return Ok(false);
        }
        for f in &self.fences {
            if !f.poll(dev)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Replaces a lazy legacy fence by a recorded one, so that it can be polled or waited for
    /// (the pool's trim).
    pub(crate) fn materialize(&mut self, dev: &Counted<'_>, legacy: Legacy<'_>) -> Result<()> {
        if self.legacy != 0 {
            let f = Fence::record(legacy.events, dev, Stream::LEGACY, legacy.key)?;
            self.fences.push(f);
            self.legacy = 0;
        }
        Ok(())
    }

    /// True if every fence has completed (queries each pending one). A set with a lazy legacy
    /// fence must be [`FenceSet::materialize`]d first.
    pub(crate) fn poll_all(&self, dev: &Counted<'_>) -> Result<bool> {
        debug_assert!(self.legacy == 0, "materialize a lazy fence before polling");
        for f in &self.fences {
            if !f.poll(dev)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Blocks until every fence has completed (after [`FenceSet::materialize`]).
    pub(crate) fn wait_host(&self, dev: &Counted<'_>) -> Result<()> {
        debug_assert!(self.legacy == 0, "materialize a lazy fence before waiting");
        self.wait_host_recorded(dev)
    }

    /// Blocks until every recorded fence has completed; a lazy legacy fence is the caller's to
    /// materialize first ([`FenceSet::wait_host`] asserts it).
    pub(crate) fn wait_host_recorded(&self, dev: &Counted<'_>) -> Result<()> {
        self.fences.iter().try_for_each(|f| f.wait_host(dev))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::DeviceKind;
    use crate::stats::Counters;

    /// A device that only hands out events and names streams by their handle: the fence set
    /// under test never waits for an event.
    #[derive(Default)]
    struct Names(AtomicU64);

    impl Device for Names {
        fn kind(&self) -> DeviceKind {
            DeviceKind::Host
        }
        fn ordinal(&self) -> i32 {
            0
        }
        fn total_memory(&self) -> Result<usize> {
            Ok(0)
        }
        fn reserve(&self, _: usize) -> Result<Option<u64>> {
            Ok(None)
        }
        unsafe fn release(&self, _: u64, _: usize) -> Result<()> {
            Ok(())
        }
        fn alloc_async(&self, _: usize, _: Stream) -> Result<Option<u64>> {
            Ok(None)
        }
        unsafe fn free_async(&self, _: u64, _: usize, _: Stream) -> Result<()> {
            Ok(())
        }
        fn create_event(&self) -> Result<Event> {
            Ok(Event(self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)))
        }
        fn destroy_event(&self, _: Event) {}
        fn record_event(&self, _: Event, _: Stream) -> Result<()> {
            Ok(())
        }
        fn query_event(&self, _: Event) -> Result<bool> {
            Ok(false)
        }
        fn sync_event(&self, _: Event) -> Result<()> {
            Ok(())
        }
        fn synchronize(&self) -> Result<()> {
            Ok(())
        }
        fn stream_wait_event(&self, _: Stream, _: Event) -> Result<()> {
            Ok(())
        }
        fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
            Ok(StreamKey(stream.as_raw() as u64))
        }
    }

    #[test]
    fn a_set_keeps_one_fence_per_stream_the_latest() {
        let dev_arc: Arc<dyn Device> = Arc::new(Names::default());
        let pool = Arc::new(EventPool::new(Arc::clone(&dev_arc)));
        let c = Counters::default();
        let dev = Counted::new(&*dev_arc, &c);
        let (a, b) = (Stream::from_raw(0x100), Stream::from_raw(0x200));
        let (ka, kb) = (dev.stream_key(a).unwrap(), dev.stream_key(b).unwrap());
        let mut set = FenceSet::default();
        for _ in 0..100 {
            let f = Fence::record(&pool, &dev, a, ka).unwrap();
            let g = Fence::record(&pool, &dev, b, kb).unwrap();
            set.merge(FenceSet { fences: vec![f, g], legacy: 0 });
        }
        assert_eq!(set.fences.len(), 2);
        let latest = Fence::record(&pool, &dev, a, ka).unwrap();
        set.merge(FenceSet::one(Some(Arc::clone(&latest))));
        assert!(set.fences.iter().any(|f| Arc::ptr_eq(f, &latest)));
        assert_eq!(set.fences.len(), 2);
    }
}
