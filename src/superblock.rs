//! A superblock: an aligned span lent by the global pool to one arena, carved into blocks.
//!
//! ## Shared part
//! `owner` is the owning arena's shell, or null while the pool owns the span (never lent, given
//! back, or dissolved). Only the pool writes it, under its lock: set when lending, cleared when
//! taking back. Free paths read it with `Acquire` to route a free: to the owner's fast path, to
//! the owner's inbox, or to the pool.
//!
//! ## Owner-only part ([`SbLocal`])
//! Boundary tags, one `u32` per 256-byte granule, touched only by the owning thread.
//! Invariant: a tag is non-zero exactly at the first and last granule of every block (free,
//! used or pending); the first carries [`HEAD`]. So a pointer into the middle of a block, or to
//! a block already merged away, reads a tag without `HEAD` and is refused, and the neighbours of
//! a block are found in O(1) at `first - 1` and `first + len`.
//!
//! ## Transit bits (shared)
//! One bit per granule, set at a block's first granule while a free of it made **away from the
//! owner's fast path** (by another thread, or on another stream) has been accepted but not yet
//! applied: the free may sit in the freeing thread's outbox, in the owner's inbox, or wait for
//! its fence in the owner's pending list. The tags, being owner-only, cannot say so; the bit
//! can, to every thread:
//! - the remote free sets it with one `fetch_or`: if it was set already, the free is a second
//!   free of a block whose first free is still on its way, and is refused at once;
//! - the owner's local free reads it (a load, no read-modify-write) and refuses a set one;
//! - a free that reaches the global pool for a block of a dissolved superblock reads it under
//!   the pool lock: set means the block's first free is still on its way, so this one is a
//!   double free;
//! - it is cleared once the free is applied and the block can be handed out again: by the owner
//!   when a pending block is merged free or a refused free is dropped, by the owner when a
//!   pending block leaves with its superblock, and by the pool (under its lock) when a free on
//!   its way reaches it after the superblock was dissolved.
//!
//! Invariant: a set bit is at the head of a block that is not free and not handed out again;
//! a superblock is lent only with every bit clear (a used block's set bit keeps its range out
//! of the pool's free extents, so a lent range has none but stale bits of refused frees, which
//! `lend` clears). Two frees of one block that race each other (neither ordered before the
//! other) may both be accepted, as with any allocator; ordered double frees are always refused.

use crate::arena::ArenaShell;
use crate::sync::{AtomicPtr, AtomicU64, Ordering, UnsafeCell};

/// Tag state: a live block; payload is its length in granules.
pub(crate) const USED: u32 = 1 << 30;
/// Tag state: freed remotely, waiting for its fence; payload is its length.
pub(crate) const PENDING: u32 = 2 << 30;
/// Tag state: free; payload is its free-list node.
pub(crate) const FREE: u32 = 3 << 30;
/// Marks a block's first granule.
pub(crate) const HEAD: u32 = 1 << 29;
const STATE: u32 = 3 << 30;
const PAYLOAD: u32 = HEAD - 1;

/// Owner-only state of a superblock.
pub(crate) struct SbLocal {
    pub(crate) tags: Vec<u32>,
    /// Granules in used or pending blocks.
    pub(crate) live: usize,
    /// Index in the owner's list of superblocks.
    pub(crate) slot: usize,
    /// Index in the owner's list of sparse superblocks, or `usize::MAX`.
    pub(crate) sparse_slot: usize,
}

impl SbLocal {
    /// Resets to `granules` of untagged space (the caller then marks one free block).
    pub(crate) fn init(&mut self, granules: usize) {
        self.tags.clear();
        self.tags.resize(granules, 0);
        self.live = 0;
        self.slot = usize::MAX;
        self.sparse_slot = usize::MAX;
    }

    /// Tags `[first, first+len)` as one block in `state` with `payload`.
    #[inline]
    pub(crate) fn mark(&mut self, first: usize, len: usize, state: u32, payload: usize) {
        debug_assert!(payload as u32 <= PAYLOAD && len >= 1);
        self.tags[first + len - 1] = state | payload as u32;
        self.tags[first] = state | HEAD | payload as u32;
    }

    /// Changes the state of the block starting at `first`, keeping its payload. For a cached
    /// block only the head changes: its tail still reads as not free, so no neighbour merges
    /// into it.
    #[inline]
    pub(crate) fn restate(&mut self, first: usize, state: u32) {
        let t = &mut self.tags[first];
        *t = (*t & !STATE) | state;
    }

    /// Clears the boundary tags of `[first, first+len)` (it is being merged away).
    #[inline]
    pub(crate) fn clear(&mut self, first: usize, len: usize) {
        self.tags[first] = 0;
        self.tags[first + len - 1] = 0;
    }

    /// `(state, payload)` if a block starts at `first`.
    #[inline]
    pub(crate) fn head(&self, first: usize) -> Option<(u32, usize)> {
        let t = *self.tags.get(first)?;
        (t & HEAD != 0).then_some((t & STATE, (t & PAYLOAD) as usize))
    }

    /// The free-list node of a free block ending just before `first`.
    #[inline]
    pub(crate) fn free_before(&self, first: usize) -> Option<usize> {
        let t = *self.tags.get(first.checked_sub(1)?)?;
        (t & STATE == FREE).then_some((t & PAYLOAD) as usize)
    }

    /// The free-list node of a free block starting at `first`.
    #[inline]
    pub(crate) fn free_at(&self, first: usize) -> Option<usize> {
        match self.head(first) {
            Some((FREE, node)) => Some(node),
            _ => None,
        }
    }
}

/// A superblock. Registered once per aligned address; lives as long as the registry.
pub(crate) struct Superblock {
    pub(crate) base: u64,
    pub(crate) owner: AtomicPtr<ArenaShell>,
    /// Transit bits, one per granule (see the module comment).
    transit: Box<[AtomicU64]>,
    local: UnsafeCell<SbLocal>,
}

// SAFETY: `owner` is atomic; `local` is touched only by the thread whose shell is `owner`
// (or by the pool while `owner` is null and the pool lock is held), and ownership changes
// only under the pool lock, which orders the accesses of successive owners.
unsafe impl Send for Superblock {}
// SAFETY: as above.
unsafe impl Sync for Superblock {}

impl Superblock {
    pub(crate) fn new(base: u64, granules: usize) -> Superblock {
        let mut local = SbLocal { tags: Vec::new(), live: 0, slot: usize::MAX, sparse_slot: usize::MAX };
        local.tags.reserve_exact(granules);
        Superblock {
            base,
            owner: AtomicPtr::new(std::ptr::null_mut()),
            transit: (0..granules.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            local: UnsafeCell::new(local),
        }
    }

    /// The granule of `ptr` in this superblock, if `ptr` lies in it on a granule boundary.
    pub(crate) fn granule_of(&self, ptr: u64) -> Option<usize> {
        let off = ptr.checked_sub(self.base)?;
        let g = (off >> crate::size_class::GRANULE_SHIFT) as usize;
        (off.is_multiple_of(crate::size_class::GRANULE as u64) && g < self.transit.len() * 64).then_some(g)
    }

    fn bit(&self, g: usize) -> (&AtomicU64, u64) {
        (&self.transit[g / 64], 1 << (g % 64))
    }

    /// Marks a free of the block at granule `g` as on its way. False if one already is (the
    /// free is then a double free). `AcqRel`: of two ordered frees, the later sees the earlier.
    pub(crate) fn mark_transit(&self, g: usize) -> bool {
        let (w, m) = self.bit(g);
        // Mutation for the loom model of transit bits: a free that marks nothing.
        if cfg!(cuarena_mutant = "transit_unmarked") {
            return true;
        }
        w.fetch_or(m, Ordering::AcqRel) & m == 0
    }

    /// True while a free of the block at granule `g` is on its way.
    #[inline]
    pub(crate) fn in_transit(&self, g: usize) -> bool {
        let (w, m) = self.bit(g);
        w.load(Ordering::Acquire) & m != 0
    }

    /// The free on its way of the block at granule `g` has been applied (or refused).
    pub(crate) fn clear_transit(&self, g: usize) {
        let (w, m) = self.bit(g);
        w.fetch_and(!m, Ordering::Release);
    }

    /// Clears every transit bit: called by the pool, under its lock, when it lends the
    /// superblock (only stale bits of refused frees can be set then; see the module comment).
    pub(crate) fn clear_all_transit(&self) {
        for w in self.transit.iter() {
            w.store(0, Ordering::Relaxed);
        }
    }

    /// Runs `f` on the owner-only state.
    ///
    /// # Safety
    /// The calling thread must own the superblock (its shell is `owner`) and no other call
    /// of `with_local` on it may be active.
    #[inline]
    pub(crate) unsafe fn with_local<R>(&self, f: impl FnOnce(&mut SbLocal) -> R) -> R {
        // SAFETY: the caller is the only thread that touches `local`.
        self.local.with_mut(|p| f(unsafe { &mut *p }))
    }
}
