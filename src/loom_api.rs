//! Entry points for the loom models in `loom-tests/` to reach internals that have no public
//! API. Built only with `--cfg loom`.

use std::sync::Arc;

use crate::registry::Registry;
use crate::sync::{Mutex, lock};

/// The superblock registry with the pool lock its writers hold.
pub struct RegistryModel {
    registry: Registry,
    writers: Mutex<()>,
    granules: usize,
}

impl RegistryModel {
    /// A registry for superblocks of `superblock` bytes.
    pub fn new(superblock: usize) -> Arc<RegistryModel> {
        Arc::new(RegistryModel {
            registry: Registry::new(superblock),
            writers: Mutex::new(()),
            granules: superblock / 256,
        })
    }

    /// Registers the superblock at `base` under the writers' lock, as the pool does.
    pub fn insert(&self, base: u64) {
        let _g = lock(&self.writers);
        self.registry.get_or_insert(base, self.granules);
    }

    /// Looks `addr` up without a lock, as a free does, and reads state that `Superblock::new`
    /// set before publication: `Some(tag capacity)` if found.
    pub fn lookup(&self, addr: u64) -> Option<usize> {
        let sb = self.registry.lookup(addr)?;
        // SAFETY: nobody owns the superblock in this model, so nothing writes `local` after
        // its creation; the read checks that the creation is visible (the property under test).
        Some(unsafe { sb.with_local(|l| l.tags.capacity()) })
    }

    /// The tag capacity a registered superblock has.
    pub fn granules(&self) -> usize {
        self.granules
    }

    /// Registers the superblock of `slots` registry slots at `base` under the writers' lock, as
    /// the pool does when it lends a range (one slot: a normal superblock; more: a large one).
    /// Its entries replace what the slots named before (the range is free in the model).
    pub fn insert_span(&self, base: u64, slots: usize) {
        let _g = lock(&self.writers);
        self.registry.get_or_insert(base, slots * self.granules);
    }

    /// Looks `addr` up without a lock, as a free does, and reads what `Superblock::new` set
    /// before publication: `Some((base, granules, tag capacity))` if found. A normal
    /// superblock is made with room for its tags, a large one with none (see `superblock.rs`).
    pub fn lookup_span(&self, addr: u64) -> Option<(u64, usize, usize)> {
        let sb = self.registry.lookup(addr)?;
        // SAFETY: as in `lookup`: nobody owns a superblock in this model.
        let cap = unsafe { sb.with_local(|l| l.tags.capacity()) };
        Some((sb.base, sb.granules, cap))
    }
}

/// The claim protocol of `claim.rs` over a tracked cell standing for an arena's owner-only
/// state: the owner and a reclaimer must never both be inside.
pub struct ClaimModel {
    claim: crate::claim::Claim,
    state: crate::sync::UnsafeCell<u64>,
}

// SAFETY: `state` is written only inside the claim (owner) or a held claim (reclaimer), which
// the protocol makes exclusive; loom checks exactly that on every access of the tracked cell.
unsafe impl Sync for ClaimModel {}

impl ClaimModel {
    /// A fresh arena: no owner inside, no reclaimer.
    pub fn new() -> Arc<ClaimModel> {
        Arc::new(ClaimModel { claim: crate::claim::Claim::default(), state: crate::sync::UnsafeCell::new(0) })
    }

    /// The owner's operation: inside its claim, bumps the state. False if a reclaimer held it.
    pub fn owner_op(&self) -> bool {
        if !self.claim.enter() {
            return false;
        }
        // SAFETY: inside the owner's claim (the property under test).
        self.state.with_mut(|p| unsafe { *p += 1 });
        self.claim.leave();
        true
    }

    /// A reclaimer's operation: if it can take the claim, bumps the state. False if not.
    pub fn reclaim_op(&self) -> bool {
        let Some(_held) = self.claim.try_claim() else { return false };
        // SAFETY: inside a held claim (the property under test).
        self.state.with_mut(|p| unsafe { *p += 100 });
        true
    }

    /// The owner at exit: waits out a reclaimer, then bumps the state.
    pub fn owner_exit(&self) {
        self.claim.enter_waiting();
        // SAFETY: inside the owner's claim.
        self.state.with_mut(|p| unsafe { *p += 1 });
        self.claim.leave();
    }

    /// The state (read after every thread joined).
    pub fn state(&self) -> u64 {
        // SAFETY: called after all threads are joined.
        self.state.with_mut(|p| unsafe { *p })
    }
}

/// The statistics registry of `stats.rs` with one worker thread's counter block: the worker
/// counts allocations and frees as the allocator does, while another thread resets and reads.
pub struct StatsModel {
    registry: crate::stats::CounterRegistry,
}

/// A worker thread's counter block (written by that thread only).
pub struct StatsThread(Arc<crate::stats::Counters>);

impl StatsModel {
    /// A registry in the default (sampled) mode.
    pub fn new() -> Arc<StatsModel> {
        Arc::new(StatsModel { registry: crate::stats::CounterRegistry::new(false) })
    }

    /// A block for the calling thread.
    pub fn register(&self) -> StatsThread {
        StatsThread(self.registry.register())
    }

    /// A registry with `stats=exact` (one shared live counter and its maximum).
    pub fn exact() -> Arc<StatsModel> {
        Arc::new(StatsModel { registry: crate::stats::CounterRegistry::new(true) })
    }

    /// `reset_peak`.
    pub fn reset_peak(&self) {
        self.registry.reset_peak();
    }

    /// `reset_counters`.
    pub fn reset_counters(&self) {
        self.registry.reset_counters();
    }

    /// `(allocations, live_bytes, peak_live_bytes, peak_live_bytes_upper)` as `stats()` reads them.
    pub fn read(&self) -> (u64, u64, u64, u64) {
        let mut s = crate::stats::Stats::default();
        self.registry.fill(&mut s);
        (s.allocations, s.live_bytes, s.peak_live_bytes, s.peak_live_bytes_upper)
    }
}

impl StatsThread {
    /// Counts an allocation of `bytes`, as the allocator's paths do.
    pub fn alloc(&self, bytes: usize) {
        self.0.count_alloc(bytes, crate::stats::AllocPath::Arena);
    }

    /// Counts a free of `bytes`.
    pub fn free(&self, bytes: usize) {
        self.0.count_free(bytes);
    }
}

// --- Allocation traces (issue 11) ---

/// The trace buffers' hand-off of `trace.rs` (owner appends and writes out vs. `stop`
/// collecting), over an in-memory file.
pub struct TraceModel {
    shared: Arc<crate::trace::Shared>,
    file: Arc<std::sync::Mutex<Vec<u8>>>,
}

/// One owner thread's buffer in a [`TraceModel`].
pub struct TraceLog(Arc<crate::trace::ThreadLog>);

/// The in-memory file (a std lock, always taken under the tracer's own loom lock).
struct MemFile(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for MemFile {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl TraceModel {
    /// A tracer with buffers of `cap` records, recording.
    pub fn new(cap: usize) -> Arc<TraceModel> {
        let m = TraceModel::stopped(cap);
        m.start();
        m
    }

    /// A tracer with buffers of `cap` records, not recording yet.
    pub fn stopped(cap: usize) -> Arc<TraceModel> {
        let shared = crate::trace::Shared::new(cap);
        Arc::new(TraceModel { shared, file: Arc::new(std::sync::Mutex::new(Vec::new())) })
    }

    /// Starts recording (into the in-memory file).
    pub fn start(&self) {
        self.shared.start_writer(Box::new(MemFile(self.file.clone()))).unwrap();
    }

    /// An allocation as `Allocator::allocate` makes it: `take` finds a block (`None`: none),
    /// then it is recorded if a trace runs (`trace::allocation`). Returns the block and whether
    /// it was recorded.
    pub fn allocate(&self, log: &TraceLog, take: impl FnOnce() -> Option<u64>) -> (Option<u64>, bool) {
        let mut recorded = false;
        let got = crate::trace::allocation(&self.shared, take, |got| {
            if let Some(v) = got {
                recorded = self.push(log, v, crate::trace::Action::Alloc);
            }
            got
        });
        (got, recorded)
    }

    /// A thread's buffer, registered (before its first record, as `trace::record` does).
    pub fn register(&self) -> TraceLog {
        TraceLog(self.shared.register())
    }

    /// The owner records a free of address `v`, as `trace::record` does; true if recorded.
    pub fn record(&self, log: &TraceLog, v: u64) -> bool {
        self.push(log, v, crate::trace::Action::Free)
    }

    /// One record made as `trace::record` makes it; true if recorded.
    fn push(&self, log: &TraceLog, v: u64, action: crate::trace::Action) -> bool {
        if !self.shared.enter(&log.0) {
            return false;
        }
        let r = crate::trace::Record {
            time_ns: self.shared.time(),
            ptr: v,
            size: 256,
            stream: crate::stream::StreamKey(2),
            thread: 0,
            action,
            path: crate::trace::TracePath::Arena,
            stream_kind: crate::trace::StreamKind::PerThread,
        };
        self.shared.push(&log.0, r);
        self.shared.leave(&log.0);
        true
    }

    /// The owner's thread exits.
    pub fn exit(&self, log: TraceLog) {
        self.shared.exit(&log.0);
    }

    /// Ends the trace; the addresses the file holds, in file order.
    pub fn stop(&self) -> Vec<u64> {
        self.stop_records().into_iter().map(|(_, v)| v).collect()
    }

    /// Ends the trace; the file's records as (is an allocation, address), in file order.
    pub fn stop_records(&self) -> Vec<(bool, u64)> {
        self.shared.stop().unwrap();
        let bytes = self.file.lock().unwrap().clone();
        let recs = crate::trace::parse(&bytes).unwrap();
        recs.iter().map(|r| (r.action == crate::trace::Action::Alloc, r.ptr)).collect()
    }
}
