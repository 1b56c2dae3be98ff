//! Statistics that cost nothing under many threads.
//!
//! Each thread has its own `Counters` block per allocator, written only by that thread with
//! plain load + store (no read-modify-write, no shared cache line). `CounterRegistry`
//! lists the blocks; reading the stats locks the list and sums them. When a thread exits its
//! block is folded into `retired` and unlisted, so the list does not grow with dead threads.
//!
//! ## Resets without writing another thread's counters
//! A thread's counters are written by that thread alone with load + store: if another thread
//! stored into them, the owner's next load + store could overwrite the reset (a lost update).
//! So `reset_counters` writes nothing of theirs: under the list lock it copies every block's
//! accumulated counters into that block's *baseline*, kept beside it in the list, and reads
//! report `counter − baseline`. A read racing the owner's bump sees the value before or after
//! it, both whole (each counter is one atomic word), so every baseline is a value the counter
//! really had, and a later read (ordered after the reset by the lock) never sees less. Gauges
//! (`live_bytes`, `arena_held_bytes`) are never reset.
//!
//! A block's counters are read one word at a time, not as one snapshot: an operation racing a
//! read or a reset may have one of its counters counted before it and another after it. So an
//! allocation bumps one counter only: its size bucket in the histogram of the path that served
//! it (arena, arena large block, pool). `allocations`, `pool_allocations`, `large_allocations`
//! and the size histogram are sums of these, and can never disagree (with counters of their
//! own, a reset racing an allocation took their baselines on either side of it, and the
//! figures stayed apart until the next reset: `arena_allocations`, `allocations −
//! pool_allocations`, counted a pool allocation, or missed one).
//!
//! ## The peak of live bytes, from both sides
//! - **Lower bound** (`peak_live_bytes`): the largest sum of the per-thread live counters
//!   sampled (on one slow path in 64 per thread, in every `stats()` call and at every reset).
//! - **Upper bound** (`peak_live_bytes_upper`): each thread keeps the peak of its *own* live
//!   counter (a signed delta: its allocations minus its frees) on its own block, with no
//!   read-modify-write; the sum over threads of these peaks is at least the peak of the sum.
//!   Every change that raises a thread's live counter (an allocation, a refused remote free
//!   put back) updates its peak.
//! - **Exact** (`stats=exact`): one shared counter updated with `fetch_add` on every allocation
//!   and free, and its maximum; `peak_live_bytes` is then that maximum. This breaks the
//!   fast path's no-read-modify-write rule, by the user's choice. An allocation raises the
//!   thread's counter before the shared one, a free lowers the shared one first (with the
//!   ordering `count_free` explains), so the shared count never exceeds the sum of the thread
//!   counters and the exact peak stays within the upper bound, across resets too.
//!
//! `reset_peak` restarts all three. A thread's peak is a *window* tagged with the reset epoch
//! it started in, which only the thread itself restarts: after its live counter rises, it loads
//! the registry's epoch and, if it changed, restarts its window at its live value. The reset
//! stores the new epoch, then, per thread, reads its live counter as the window's *base* `B`:
//! the thread's bound is `max(B, its peak)` once it has restarted, `B` before (until it
//! allocates, its live counter only falls). For that, no allocation whose new live value the
//! reset did not read may also miss the new epoch: a store-then-load race on two words (Dekker).
//! The thread orders its store before its load with the light half of the asymmetric barrier
//! (`sync.rs`: a compiler fence where `membarrier` works), the reset with the heavy half, so at
//! least one side sees the other. `loom-tests/tests/stats.rs` models it; the mutation
//! `stats_peak_no_barrier` drops the thread's barrier and must fail, as must
//! `stats_reset_stores_counters`, a reset that zeroes the threads' counters instead of keeping
//! baselines.

use crate::sync::{AtomicU64, Mutex, Ordering, heavy_barrier, light_barrier, lock};
use std::sync::Arc;

/// One counter. Single-writer unless `Counters::shared` is set.
#[derive(Default, Debug)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    #[inline]
    fn add(&self, n: u64, shared: bool) {
        self.add_ordered(n, shared, Ordering::Relaxed);
    }

    /// `add` with a `Release` store (or read-modify-write): see `Counters::count_free`.
    #[inline]
    fn add_release(&self, n: u64, shared: bool) {
        self.add_ordered(n, shared, Ordering::Release);
    }

    /// Adds `n`, the write made with `order` (`Relaxed` or `Release`).
    #[inline(always)]
    fn add_ordered(&self, n: u64, shared: bool, order: Ordering) {
        if shared {
            self.0.fetch_add(n, order);
        } else {
            // Only the owning thread writes: load + store is exact and needs no RMW.
            self.0.store(self.0.load(Ordering::Relaxed).wrapping_add(n), order);
        }
    }

    #[inline]
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// `get` with `Acquire`: see `Counters::count_free`.
    #[inline]
    fn get_acquire(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    #[inline]
    fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
}

/// Buckets of the allocation-size histogram ([`Stats`] has none: see
/// [`crate::Allocator::size_histogram`]). Bucket 0 counts blocks of up to 256 B, bucket `k`
/// blocks of `2^(7+k) + 1 ..= 2^(8+k)` bytes, the last one everything over 2^(8+HIST-2) B
/// (over 2 GiB).
pub const SIZE_HISTOGRAM_BUCKETS: usize = 25;

/// The histogram bucket of a block of `bytes` (> 0) bytes (see [`SIZE_HISTOGRAM_BUCKETS`]).
#[inline]
pub fn size_bucket(bytes: usize) -> usize {
    let bits = (usize::BITS - (bytes.max(1) - 1).leading_zeros()) as usize; // ceil(log2(bytes))
    bits.saturating_sub(8).min(SIZE_HISTOGRAM_BUCKETS - 1)
}

/// The largest block size bucket `k` counts (`u64::MAX` for the last, open one).
pub fn size_bucket_limit(k: usize) -> u64 {
    if k + 1 >= SIZE_HISTOGRAM_BUCKETS { u64::MAX } else { 1u64 << (8 + k) }
}

/// The path that served an allocation: each has its own size histogram (module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AllocPath {
    /// A small block of an arena.
    Arena = 0,
    /// A large block (over `small_max`) of an arena.
    Large = 1,
    /// A block of the global pool.
    Pool = 2,
}

/// Histograms kept per block, one per [`AllocPath`].
const PATHS: usize = 3;

/// What every thread's block of one registry shares: the reset epoch and, with `stats=exact`,
/// the shared live counter and its maximum.
#[derive(Default, Debug)]
pub(crate) struct Shared {
    /// Bumped by every `reset_peak`; each thread restarts its peak window when it sees a new one.
    epoch: AtomicU64,
    /// `stats=exact`.
    exact: bool,
    /// With `exact`: bytes live now (a wrapping signed value), changed by `fetch_add`.
    exact_live: AtomicU64,
    /// With `exact`: the largest `exact_live` since the last reset.
    exact_peak: AtomicU64,
}

macro_rules! counters {
    (gauges: $($g:ident),* ; accumulated: $($name:ident),* $(,)?) => {
        /// Per-thread event counts. `live_bytes` is a wrapping signed delta: a thread that frees
        /// blocks allocated elsewhere goes negative, and the sum over threads is exact.
        ///
        /// `repr(C, align(64))`, in this order: what every allocation and free touches
        /// (`live_bytes`, the peak window, `deallocations`) shares the first cache line, which
        /// no other thread's block shares; the histograms follow the rest.
        #[derive(Debug)]
        #[repr(C, align(64))]
        pub(crate) struct Counters {
            shared: bool,
            reg: Arc<Shared>,
            $(pub(crate) $g: Counter,)*
            /// The largest `live_bytes` (signed) of this thread's current peak window.
            peak: Counter,
            /// The reset epoch the current peak window started in.
            peak_epoch: Counter,
            $(pub(crate) $name: Counter,)*
            /// Allocations by path ([`AllocPath`]) and block size (see
            /// [`SIZE_HISTOGRAM_BUCKETS`]).
            size_hist: [[Counter; SIZE_HISTOGRAM_BUCKETS]; PATHS],
        }

        /// A plain copy of a block's counters (summed, or kept as a baseline).
        #[derive(Clone, Copy, Debug, Default)]
        pub(crate) struct Totals {
            $($g: u64,)*
            $($name: u64,)*
            size_hist: [[u64; SIZE_HISTOGRAM_BUCKETS]; PATHS],
        }

        impl Counters {
            fn totals(&self) -> Totals {
                let mut t = Totals::default();
                $(t.$g = self.$g.get();)*
                $(t.$name = self.$name.get();)*
                for (d, c) in t.size_hist.iter_mut().flatten().zip(self.size_hist.iter().flatten()) {
                    *d = c.get();
                }
                t
            }

            /// The naive reset the loom model of resets must catch: storing into the owner's
            /// counters races its load + store.
            #[cfg(cuarena_mutant = "stats_reset_stores_counters")]
            fn zero_accumulated(&self) {
                $(self.$name.set(0);)*
                self.size_hist.iter().flatten().for_each(|c| c.set(0));
            }

            fn fold_into(&self, to: &Counters) {
                $(to.$g.add(self.$g.get(), true);)*
                $(to.$name.add(self.$name.get(), true);)*
                for (d, c) in to.size_hist.iter().flatten().zip(self.size_hist.iter().flatten()) {
                    d.add(c.get(), true);
                }
            }
        }

        impl Totals {
            /// Adds `other`'s gauges and its accumulated counters less `base`'s.
            fn add_since(&mut self, other: &Totals, base: &Totals) {
                $(self.$g = self.$g.wrapping_add(other.$g);)*
                $(self.$name = self.$name.wrapping_add(other.$name.wrapping_sub(base.$name));)*
                for ((d, o), b) in self
                    .size_hist
                    .iter_mut()
                    .flatten()
                    .zip(other.size_hist.iter().flatten())
                    .zip(base.size_hist.iter().flatten())
                {
                    *d = d.wrapping_add(o.wrapping_sub(*b));
                }
            }

            /// Adds the accumulated counters of `other` (a baseline), gauges untouched.
            fn add_base(&mut self, other: &Totals) {
                $(self.$name = self.$name.wrapping_add(other.$name);)*
                for (d, o) in self.size_hist.iter_mut().flatten().zip(other.size_hist.iter().flatten()) {
                    *d = d.wrapping_add(*o);
                }
            }

            /// Into the [`Stats`] fields of the same names, and `allocations`,
            /// `large_allocations` and `pool_allocations`, sums of the histograms.
            fn write_to(&self, s: &mut Stats) {
                $(s.$g = self.$g;)*
                $(s.$name = self.$name;)*
                let sum = |h: &[u64]| h.iter().fold(0u64, |a, &b| a.wrapping_add(b));
                s.allocations = sum(self.size_hist.as_flattened());
                s.large_allocations = sum(&self.size_hist[AllocPath::Large as usize]);
                s.pool_allocations = sum(&self.size_hist[AllocPath::Pool as usize]);
            }

            /// The size histogram over all paths.
            fn histogram(&self) -> [u64; SIZE_HISTOGRAM_BUCKETS] {
                std::array::from_fn(|k| {
                    self.size_hist.iter().fold(0u64, |a, h| a.wrapping_add(h[k]))
                })
            }
        }
    };
}

counters!(
    gauges: live_bytes, arena_held_bytes;
    accumulated:
    deallocations,
    cross_thread_frees,
    cross_stream_frees,
    fences_recorded,
    fence_waits,
    fence_polls,
    driver_calls,
    host_syncs,
    invalid_frees,
    superblocks_taken,
    superblocks_returned,
    superblocks_dissolved,
    alloc_retries,
    ooms,
    oom_hook_calls,
);

impl Default for Counters {
    fn default() -> Counters {
        Counters::with(false, Arc::new(Shared::default()))
    }
}

impl Counters {
    fn with(shared: bool, reg: Arc<Shared>) -> Counters {
        let z = || Counter::default();
        Counters {
            shared,
            reg,
            live_bytes: z(),
            arena_held_bytes: z(),
            deallocations: z(),
            cross_thread_frees: z(),
            cross_stream_frees: z(),
            fences_recorded: z(),
            fence_waits: z(),
            fence_polls: z(),
            driver_calls: z(),
            host_syncs: z(),
            invalid_frees: z(),
            superblocks_taken: z(),
            superblocks_returned: z(),
            superblocks_dissolved: z(),
            alloc_retries: z(),
            ooms: z(),
            oom_hook_calls: z(),
            size_hist: std::array::from_fn(|_| std::array::from_fn(|_| z())),
            peak: z(),
            peak_epoch: z(),
        }
    }

    /// A block that any thread may write (used when a thread has no slot of its own).
    pub(crate) fn new_shared() -> Counters {
        Counters::with(true, Arc::new(Shared::default()))
    }

    #[inline]
    pub(crate) fn bump(&self, c: &Counter, n: u64) {
        c.add(n, self.shared);
    }

    /// Counts an allocation of a block of `bytes` bytes served by `path`.
    #[inline]
    pub(crate) fn count_alloc(&self, bytes: usize, path: AllocPath) {
        // One counter is the count: `allocations` and the per-path counts are sums of the
        // histograms (see `Totals::write_to`).
        self.bump(&self.size_hist[path as usize][size_bucket(bytes)], 1);
        self.add_live(bytes as u64);
    }

    /// Counts a free of a block of `bytes` bytes.
    #[inline]
    pub(crate) fn count_free(&self, bytes: usize) {
        self.bump(&self.deallocations, 1);
        let neg = (bytes as u64).wrapping_neg();
        if !self.reg.exact {
            return self.bump(&self.live_bytes, neg);
        }
        // `stats=exact`: the shared counter first, then this thread's with `Release`, which
        // `reset_peak` reads with `Acquire`. A reset that sees the free in the thread's counter
        // (its window's base) then sees it in the shared one (the exact peak it restarts from),
        // so the exact peak never ends above the upper bound. The other order, or relaxed
        // accesses, let a reset take the thread's low value and the shared high one (found by
        // an adversarial pass; `loom-tests/tests/stats.rs`, mutation `stats_exact_free_local_first`).
        #[cfg(not(cuarena_mutant = "stats_exact_free_local_first"))]
        self.reg.exact_live.fetch_sub(bytes as u64, Ordering::SeqCst);
        self.live_bytes.add_release(neg, self.shared);
        #[cfg(cuarena_mutant = "stats_exact_free_local_first")]
        self.reg.exact_live.fetch_sub(bytes as u64, Ordering::SeqCst);
    }

    /// Raises `live_bytes` by `n`, and this thread's peak with it (see the module comment).
    #[inline]
    pub(crate) fn add_live(&self, n: u64) {
        if self.shared {
            // A shared block is never listed: it keeps no peak.
            self.live_bytes.add(n, true);
        } else {
            let live = self.live_bytes.get().wrapping_add(n);
            self.live_bytes.set(live);
            // Orders the store of `live` before the load of the epoch (Dekker with
            // `CounterRegistry::reset_peak`'s heavy barrier).
            #[cfg(not(cuarena_mutant = "stats_peak_no_barrier"))]
            light_barrier();
            let epoch = self.reg.epoch.load(Ordering::Relaxed);
            if epoch != self.peak_epoch.get() {
                self.peak_epoch.set(epoch);
                self.peak.set(live);
            } else if (live as i64) > (self.peak.get() as i64) {
                self.peak.set(live);
            }
        }
        if self.reg.exact {
            let v = self.reg.exact_live.fetch_add(n, Ordering::SeqCst).wrapping_add(n);
            if (v as i64) > (self.reg.exact_peak.load(Ordering::SeqCst) as i64) {
                self.reg.exact_peak.fetch_max(v, Ordering::SeqCst);
            }
        }
    }

    /// This thread's bound on its live counter since the reset with window base `base`.
    fn window_max(&self, base: i64, epoch: u64) -> i64 {
        if self.peak_epoch.get() == epoch { base.max(self.peak.get() as i64) } else { base }
    }
}

/// A snapshot of an allocator's state.
///
/// Counters are kept per thread and summed when read, so reading costs the threads nothing.
/// A snapshot taken while other threads allocate is not atomic across counters: it may count
/// an operation in one counter and not yet in another. Every counter is exact once the threads
/// that change it are quiescent, and none ever counts an exiting thread twice.
///
/// Accumulated counters (allocations, frees, fences, driver calls, ...) count since the
/// allocator was made or since the last [`Allocator::reset_counters`](crate::Allocator::reset_counters);
/// peaks since the last [`Allocator::reset_peak`](crate::Allocator::reset_peak). Gauges
/// (`live_bytes`, `reserved_bytes`, `arena_held_bytes`, ...) are never reset.
///
/// The layout is C's (`#[repr(C)]`, `u64`s in this order): `cuarena_stats` in
/// `include/cuarena.h` is a leading `size` then these fields (`tests/header.rs` checks the order
/// against the header and the Python package). New fields go at the end.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Bytes in live blocks (after size-class rounding). Exact whenever no allocator call is
    /// running (at any quiescent point), and with `stats=exact` always; read while blocks pass
    /// between threads, a sum that would be negative reads 0. Except while an invalid free of
    /// another thread's block (or of a block on another stream) is on its way to the owner
    /// that will refuse it: a remote free is counted when handed off, with the size it names,
    /// and uncounted when refused (README, "The contract": such a free is checked there).
    pub live_bytes: u64,
    /// The largest `live_bytes` since the last peak reset. With `stats=exact`: exact (one shared
    /// counter). By default: the largest sum of the per-thread live counters sampled (on one
    /// slow path in 64 per thread, in every `stats()` call and at `reset_peak`), so a peak
    /// reached and left between two samples is missed: a lower bound, except that a sum read
    /// while blocks pass between threads is not a snapshot and can exceed every real state (a
    /// free counted on one thread, its block's new allocation on another); it never exceeds
    /// `peak_live_bytes_upper` at a quiescent point.
    pub peak_live_bytes: u64,
    /// Bytes reserved from the device.
    pub reserved_bytes: u64,
    /// The largest `reserved_bytes` since the last peak reset (exact).
    pub peak_reserved_bytes: u64,
    /// Bytes the global pool has handed out: live large blocks plus lent superblocks.
    pub pool_in_use_bytes: u64,
    /// The largest free block in the global pool.
    pub largest_free_block: u64,
    /// Free extents in the global pool (a fragmentation figure).
    pub free_extents: u64,
    /// Successful allocations.
    pub allocations: u64,
    /// Successful deallocations (remote ones counted when handed off, and uncounted if their
    /// owner then refuses them as invalid).
    pub deallocations: u64,
    /// Frees of arena blocks (up to `large_max`) owned by another thread's arena, counted when
    /// handed off (one its owner then refuses as invalid stays counted here).
    pub cross_thread_frees: u64,
    /// Frees of a thread's own arena blocks (up to `large_max`) on a stream other than the
    /// arena's, sent the batched, fenced way (counted as `cross_thread_frees` are). The legacy
    /// arena's own frees on the legacy stream are kept back in it (`Arena::free_legacy`) and
    /// not counted here.
    pub cross_stream_frees: u64,
    /// CUDA events recorded as fences.
    pub fences_recorded: u64,
    /// Times a stream was made to wait on a fence (`cuStreamWaitEvent`).
    pub fence_waits: u64,
    /// Fence queries (`cuEventQuery`).
    pub fence_polls: u64,
    /// Driver calls of every kind.
    pub driver_calls: u64,
    /// Host-blocking waits: device synchronises (the out-of-memory reclaim of user-stream or
    /// parked memory, a thread exit past the parked bound, `trim(true)`, the allocator's drop,
    /// out of memory in pass-through mode) and host waits on events (`trim(true)`, the last try
    /// before out of memory, a graph pool's restore). None on any allocation or free that does not run out of memory.
    pub host_syncs: u64,
    /// Frees refused as invalid (including remote ones found invalid by their owner).
    pub invalid_frees: u64,
    /// Superblocks lent to arenas.
    pub superblocks_taken: u64,
    /// Empty superblocks given back by arenas.
    pub superblocks_returned: u64,
    /// Partly used superblocks given back by arenas (their live blocks move to the pool).
    pub superblocks_dissolved: u64,
    /// Bytes of superblocks held by arenas now.
    pub arena_held_bytes: u64,
    /// Arenas alive now (a thread has one per stream it allocates on through an arena: its
    /// per-thread stream, the legacy stream and up to 16 user streams; parked arenas are not
    /// counted).
    pub arenas: u64,
    /// Allocations served by a thread's arena (requests up to `large_max`, on any stream): the
    /// path with no lock (and no CUDA call on the per-thread and legacy streams; one identity
    /// lookup on a user stream). `allocations - pool_allocations`.
    pub arena_allocations: u64,
    /// Allocations served by the global pool (requests over `large_max`, those made while a
    /// reclaimer briefly holds the thread's arena, those for which the arena could not grow
    /// even after an out-of-memory reclaim, a user stream's when its thread has no room for
    /// another arena, and requests over `small_max` on a lean user arena: `allocator.rs`).
    pub pool_allocations: u64,
    /// Of `arena_allocations`, those over `small_max`: large blocks served by an arena from its
    /// large superblocks.
    pub large_allocations: u64,
    /// An upper bound of the peak of `live_bytes` since the last peak reset, at any quiescent
    /// point: the sum over threads of each thread's own peak (see `stats.rs`). `u64::MAX` if no
    /// bound is known (only after a `reset_peak` whose `membarrier` failed). With
    /// `stats=exact` and in pass-through mode it is kept too (pass-through: the exact peak).
    pub peak_live_bytes_upper: u64,
    /// 1 if `peak_live_bytes` is exact (`stats=exact`, or pass-through mode), else 0.
    pub peak_exact: u64,
    /// Allocations that met out-of-memory, took memory back (reclaim from idle arenas, parked
    /// arenas, or an OOM hook) and were tried again.
    pub alloc_retries: u64,
    /// Allocations that failed with [`Error::OutOfMemory`](crate::Error::OutOfMemory).
    pub ooms: u64,
    /// Calls of the OOM hook ([`Allocator::set_oom_hook`](crate::Allocator::set_oom_hook)).
    pub oom_hook_calls: u64,
    /// The cap on `reserved_bytes` now: the configuration's `max`, or what was set last by
    /// [`Allocator::set_memory_fraction`](crate::Allocator::set_memory_fraction) (a fraction of
    /// `device_total_bytes`) or [`Allocator::set_limit_bytes`](crate::Allocator::set_limit_bytes).
    /// It may exceed `device_total_bytes` (a `max` in bytes over the device's size).
    pub limit_bytes: u64,
    /// The device's total memory, as the driver reported it when the allocator was made.
    pub device_total_bytes: u64,
}

/// A listed block with its baselines (see the module comment).
struct Entry {
    c: Arc<Counters>,
    /// The accumulated counters at the last `reset_counters` (zero before one).
    base: Totals,
    /// The thread's live counter at the last `reset_peak` (its window's base; 0 before one).
    peak_base: i64,
}

struct List {
    live: Vec<Entry>,
    /// `retired`'s accumulated counters at the last `reset_counters`, and the baselines of the
    /// blocks folded into it since.
    retired_base: Totals,
    /// The sum over retired blocks of their bound since the last `reset_peak` (see `retire`).
    retired_peak: i64,
    /// False after a `reset_peak` whose heavy barrier failed: no upper bound is known.
    upper_known: bool,
}

/// The list of per-thread counter blocks of one allocator.
pub(crate) struct CounterRegistry {
    list: Mutex<List>,
    retired: Counters,
    peak_live: AtomicU64,
    reg: Arc<Shared>,
}

impl CounterRegistry {
    /// A registry; with `exact`, the shared live counter of `stats=exact` is kept.
    pub(crate) fn new(exact: bool) -> CounterRegistry {
        let reg = Arc::new(Shared { exact, ..Shared::default() });
        CounterRegistry {
            list: Mutex::new(List {
                live: Vec::new(),
                retired_base: Totals::default(),
                retired_peak: 0,
                upper_known: true,
            }),
            retired: Counters::with(true, Arc::new(Shared::default())),
            peak_live: AtomicU64::new(0),
            reg,
        }
    }

    /// A new block for the calling thread.
    pub(crate) fn register(&self) -> Arc<Counters> {
        let c = Arc::new(Counters::with(false, Arc::clone(&self.reg)));
        let mut l = lock(&self.list);
        // Under the lock no reset runs: the window starts now, at 0 live bytes.
        c.peak_epoch.set(self.reg.epoch.load(Ordering::Relaxed));
        l.live.push(Entry { c: Arc::clone(&c), base: Totals::default(), peak_base: 0 });
        c
    }

    /// Folds a dead thread's block into `retired`. Under the list lock, so a reader never
    /// counts the block twice (in `retired` and in the list) or not at all.
    pub(crate) fn retire(&self, c: &Arc<Counters>) {
        #[cfg(cuarena_mutant = "stats_retire_unlocked")]
        c.fold_into(&self.retired);
        let mut l = lock(&self.list);
        #[cfg(cuarena_mutant = "stats_retire_unlocked")]
        if let Some(i) = l.live.iter().position(|x| Arc::ptr_eq(&x.c, c)) {
            l.live.swap_remove(i);
            return;
        }
        if let Some(i) = l.live.iter().position(|x| Arc::ptr_eq(&x.c, c)) {
            let epoch = self.reg.epoch.load(Ordering::Relaxed);
            let e = l.live.swap_remove(i);
            // Its live counter stays at its last value from now on, at most this bound.
            l.retired_peak = l.retired_peak.wrapping_add(c.window_max(e.peak_base, epoch));
            l.retired_base.add_base(&e.base);
            c.fold_into(&self.retired);
        }
    }

    /// Every thread's counters summed into `s` (its other fields untouched), and the sampled
    /// peak updated.
    pub(crate) fn fill(&self, s: &mut Stats) {
        let upper = {
            let l = lock(&self.list);
            let epoch = self.reg.epoch.load(Ordering::Relaxed);
            let mut t = Totals::default();
            t.add_since(&self.retired.totals(), &l.retired_base);
            let mut upper = l.retired_peak;
            for e in &l.live {
                t.add_since(&e.c.totals(), &e.base);
                upper = upper.wrapping_add(e.c.window_max(e.peak_base, epoch));
            }
            t.write_to(s);
            // A remote free is counted by its sender and, if its owner refuses it, taken back by
            // the owner (`Env::refuse_remote`): a reset between the two leaves the count since
            // the reset below zero. Then 0 is reported, never a wrapped value (the count stays
            // low by the remote frees counted before the reset and refused after it).
            if (s.deallocations as i64) < 0 {
                s.deallocations = 0;
            }
            // The per-thread gauges are read one thread after another while threads run: a free
            // counted on the freeing thread may be read without its allocation on the
            // allocating thread, and the sum go below zero. A snapshot reports 0 then, never a
            // wrapped value (at a quiescent point the sum is exact).
            for g in [&mut s.live_bytes, &mut s.arena_held_bytes] {
                if (*g as i64) < 0 {
                    *g = 0;
                }
            }
            // Sampled under the list lock: a `reset_peak` (which stores the peak under it)
            // is not undone by a sum read before it.
            s.peak_live_bytes = self.sample_peak(s.live_bytes);
            if l.upper_known { upper.max(0) as u64 } else { u64::MAX }
        };
        s.peak_live_bytes_upper = upper;
        if self.reg.exact {
            let live = self.reg.exact_live.load(Ordering::SeqCst) as i64;
            let peak = self.reg.exact_peak.load(Ordering::SeqCst) as i64;
            // The one shared counter: exact at every moment, not only at quiescent points.
            s.live_bytes = live.max(0) as u64;
            s.peak_live_bytes = peak.max(live).max(0) as u64;
            s.peak_exact = 1;
        }
    }

    /// The allocation-size histogram since the last `reset_counters`.
    pub(crate) fn size_histogram(&self) -> [u64; SIZE_HISTOGRAM_BUCKETS] {
        let l = lock(&self.list);
        let mut t = Totals::default();
        t.add_since(&self.retired.totals(), &l.retired_base);
        for e in &l.live {
            t.add_since(&e.c.totals(), &e.base);
        }
        t.histogram()
    }

    /// Raises the peak to `live` if higher and returns the peak.
    pub(crate) fn sample_peak(&self, live: u64) -> u64 {
        // A live sum read while other threads race can be transiently "negative" (wrapped);
        // such readings are not a peak.
        if (live as i64) < 0 {
            return self.peak_live.load(Ordering::Relaxed);
        }
        self.peak_live.fetch_max(live, Ordering::Relaxed).max(live)
    }

    /// Samples the peak from the live-byte sum now (slow paths call this now and then).
    pub(crate) fn sample(&self) {
        self.fill(&mut Stats::default());
    }

    /// Restarts every accumulated counter at zero, without writing any thread's block: each
    /// block's baseline becomes its value now (see the module comment).
    pub(crate) fn reset_counters(&self) {
        let mut l = lock(&self.list);
        l.retired_base = self.retired.totals();
        for e in &mut l.live {
            #[cfg(cuarena_mutant = "stats_reset_stores_counters")]
            e.c.zero_accumulated();
            #[cfg(not(cuarena_mutant = "stats_reset_stores_counters"))]
            {
                e.base = e.c.totals();
            }
        }
    }

    /// Restarts the peaks (sampled, per-thread windows, exact) at the live bytes now.
    pub(crate) fn reset_peak(&self) {
        let mut l = lock(&self.list);
        let epoch = self.reg.epoch.load(Ordering::Relaxed).wrapping_add(1);
        self.reg.epoch.store(epoch, Ordering::Relaxed);
        // Orders the store of the epoch before the loads of the live counters (Dekker with
        // `Counters::add_live`); the threads' side is the light barrier.
        let ordered = heavy_barrier() || heavy_barrier();
        let mut sum: i64 = self.retired.live_bytes.get() as i64;
        l.retired_peak = sum;
        for e in &mut l.live {
            // `Acquire`: pairs with the `Release` of a free in `stats=exact` (`count_free`).
            e.peak_base = e.c.live_bytes.get_acquire() as i64;
            sum = sum.wrapping_add(e.peak_base);
        }
        l.upper_known = ordered;
        self.peak_live.store(sum.max(0) as u64, Ordering::Relaxed);
        if self.reg.exact {
            // Zeroed first, then raised to the live count: an allocation's `fetch_max` either
            // lands after the zero, or its `fetch_add` is in the live count read after it
            // (all SeqCst, one total order).
            self.reg.exact_peak.store(0, Ordering::SeqCst);
            let live = self.reg.exact_live.load(Ordering::SeqCst);
            if (live as i64) > 0 {
                self.reg.exact_peak.fetch_max(live, Ordering::SeqCst);
            }
        }
    }
}
