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

use crate::arena::ArenaShell;
use crate::sync::{AtomicPtr, UnsafeCell};

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
        Superblock { base, owner: AtomicPtr::new(std::ptr::null_mut()), local: UnsafeCell::new(local) }
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
