//! Statistics that cost nothing under many threads.
//!
//! Each thread has its own `Counters` block per allocator, written only by that thread with
//! plain load + store (no read-modify-write, no shared cache line). `CounterRegistry`
//! lists the blocks; reading the stats locks the list and sums them. When a thread exits its
//! block is folded into `retired` and unlisted, so the list does not grow with dead threads.

use crate::sync::{AtomicU64, Mutex, Ordering, lock};
use std::sync::Arc;

/// One counter. Single-writer unless `Counters::shared` is set.
#[derive(Default, Debug)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    #[inline]
    fn add(&self, n: u64, shared: bool) {
        if shared {
            self.0.fetch_add(n, Ordering::Relaxed);
        } else {
            // Only the owning thread writes: load + store is exact and needs no RMW.
            self.0.store(self.0.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        }
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Per-thread event counts. `live_bytes` is a wrapping signed delta: a thread that frees
        /// blocks allocated elsewhere goes negative, and the sum over threads is exact.
        #[derive(Default, Debug)]
        pub(crate) struct Counters {
            shared: bool,
            $(pub(crate) $name: Counter,)*
        }

        impl Counters {
            fn fold_into(&self, to: &Counters) {
                $(to.$name.add(self.$name.get(), true);)*
            }
            /// Adds this block into the [`Stats`] field of the same name.
            fn sum_into(&self, s: &mut Stats) {
                $(s.$name = s.$name.wrapping_add(self.$name.get());)*
            }
        }
    };
}

counters!(
    allocations,
    deallocations,
    live_bytes,
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
    arena_held_bytes,
    pool_allocations,
    large_allocations,
);

impl Counters {
    /// A block that any thread may write (used when a thread has no slot of its own).
    pub(crate) fn new_shared() -> Counters {
        Counters { shared: true, ..Counters::default() }
    }

    #[inline]
    pub(crate) fn bump(&self, c: &Counter, n: u64) {
        c.add(n, self.shared);
    }
}

/// A snapshot of an allocator's state.
///
/// Counters are kept per thread and summed when read, so reading costs the threads nothing.
/// A snapshot taken while other threads allocate is not atomic across counters: it may count
/// an operation in one counter and not yet in another. Every counter is exact once the threads
/// that change it are quiescent, and none ever counts an exiting thread twice.
///
/// The layout is C's (`#[repr(C)]`, 25 `u64`s in this order): `cuarena_stats` in
/// `include/cuarena.h` is a leading `size` then these fields (`tests/header.rs` checks the order
/// against the header and the Python package). New fields go at the end.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Bytes in live blocks (after size-class rounding).
    pub live_bytes: u64,
    /// The largest `live_bytes` seen. Sampled on one slow path in 64 per thread and in every
    /// `stats()` call, so a peak reached and left between two samples can be missed: a lower
    /// bound.
    pub peak_live_bytes: u64,
    /// Bytes reserved from the device.
    pub reserved_bytes: u64,
    /// The largest `reserved_bytes` seen (exact).
    pub peak_reserved_bytes: u64,
    /// Bytes the global pool has handed out: live large blocks plus lent superblocks.
    pub pool_in_use_bytes: u64,
    /// The largest free block in the global pool.
    pub largest_free_block: u64,
    /// Free extents in the global pool (a fragmentation figure).
    pub free_extents: u64,
    /// Successful allocations.
    pub allocations: u64,
    /// Successful deallocations (remote ones counted when handed off).
    pub deallocations: u64,
    /// Frees of small blocks owned by another thread's arena.
    pub cross_thread_frees: u64,
    /// Frees of a thread's own small blocks that went the batched, fenced way: on a stream other
    /// than the arena's, or on the legacy stream (see `arena_index` in `allocator.rs`).
    pub cross_stream_frees: u64,
    /// CUDA events recorded as fences.
    pub fences_recorded: u64,
    /// Times a stream was made to wait on a fence (`cuStreamWaitEvent`).
    pub fence_waits: u64,
    /// Fence queries (`cuEventQuery`).
    pub fence_polls: u64,
    /// Driver calls of every kind.
    pub driver_calls: u64,
    /// Host-blocking synchronisations (only `trim(blocking)` and shutdown make them).
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
    /// Arenas alive now (a thread has one per stream it allocates small blocks on: its
    /// per-thread stream and the legacy stream).
    pub arenas: u64,
    /// Allocations served by a thread's arena (requests up to `large_max` on the per-thread or
    /// the legacy stream): the path with no lock and no CUDA call. `allocations -
    /// pool_allocations`.
    pub arena_allocations: u64,
    /// Allocations served by the global pool (requests over `large_max`, smaller ones on user
    /// streams, and those made while a reclaimer briefly holds the thread's arena).
    pub pool_allocations: u64,
    /// Of `arena_allocations`, those over `small_max`: large blocks served by an arena from its
    /// large superblocks.
    pub large_allocations: u64,
}

/// The list of per-thread counter blocks of one allocator.
pub(crate) struct CounterRegistry {
    live: Mutex<Vec<Arc<Counters>>>,
    retired: Counters,
    peak_live: AtomicU64,
}

impl CounterRegistry {
    pub(crate) fn new() -> CounterRegistry {
        CounterRegistry {
            live: Mutex::new(Vec::new()),
            retired: Counters::new_shared(),
            peak_live: AtomicU64::new(0),
        }
    }

    /// A new block for the calling thread.
    pub(crate) fn register(&self) -> Arc<Counters> {
        let c = Arc::new(Counters::default());
        lock(&self.live).push(Arc::clone(&c));
        c
    }

    /// Folds a dead thread's block into `retired`. Under the list lock, so a reader never
    /// counts the block twice (in `retired` and in the list) or not at all.
    pub(crate) fn retire(&self, c: &Arc<Counters>) {
        #[cfg(cuarena_mutant = "stats_retire_unlocked")]
        c.fold_into(&self.retired);
        let mut l = lock(&self.live);
        #[cfg(cuarena_mutant = "stats_retire_unlocked")]
        if let Some(i) = l.iter().position(|x| Arc::ptr_eq(x, c)) {
            l.swap_remove(i);
            return;
        }
        if let Some(i) = l.iter().position(|x| Arc::ptr_eq(x, c)) {
            c.fold_into(&self.retired);
            l.swap_remove(i);
        }
    }

    /// Every thread's counters summed into `s` (its other fields untouched), and the sampled
    /// peak updated.
    pub(crate) fn fill(&self, s: &mut Stats) {
        {
            let l = lock(&self.live);
            self.retired.sum_into(s);
            l.iter().for_each(|c| c.sum_into(s));
        }
        s.peak_live_bytes = self.sample_peak(s.live_bytes);
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
}
