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
//! ## Freed flags (shared)
//! One byte per granule, read and written by every thread: at the first granule of a block
//! handed out by the owner, it says whether a free of that block has been **accepted** since,
//! and where that free is: `0` none, [`IN_TRANSIT`] (on its way to the owner or the pool), or
//! [`ARRIVED`] (taken in by the owner, or applied by the pool). The tags, being owner-only,
//! cannot tell another thread so; the flag can:
//! - a free away from the owner's fast path (by another thread, or on another stream) takes
//!   the flag with one `compare_exchange(0, IN_TRANSIT)`: if it was set, the block was freed
//!   already (the first free may still be in an outbox, an inbox, waiting for its fence, or
//!   done) and this free is refused at once;
//! - the owner's local free reads it (refusing a set one) and stores `ARRIVED`, a plain store;
//! - the owner's drain, taking in a free on its way, stores `ARRIVED`; refusing it, `0` where a
//!   live block starts (a wrong size) and `ARRIVED` elsewhere (a block the pool took back at
//!   that address while the bad free was on its way left the flag to it, below); the pool,
//!   receiving one (a dissolved superblock's block), the same, under its lock;
//! - the owner clears an `ARRIVED` flag, with a plain store, when it hands the block out again;
//!   the owner's fast path thus does no read-modify-write. It never hands out a block that
//!   would start at an `IN_TRANSIT` flag: that free is a bad one (a wrong size or an interior
//!   pointer when it was made, or a pointer no block started at), and the block would take it
//!   when it arrives. It hands out the end of that free range instead, or keeps the range aside
//!   until the bad free arrives and is refused (`Arena::carve`, "quarantine");
//! - when a superblock leaves its arena, the flags stay: the pool reads one only at the head of
//!   a used block the arena had handed out (`from_arena` in `global_pool.rs`), where it says
//!   that the block's arena free is on its way, and refuses a free of it from anyone else
//!   meanwhile, and refuses a free on its way for any block an arena did not hand out;
//! - every free the pool applies at an address a superblock once covered leaves the flag
//!   `ARRIVED` (a caller's free only where it was `0`, so that a bad free's `IN_TRANSIT`
//!   stays): when the pool lends the range again, the new arena's carve clears it at the
//!   blocks it hands out, and until then another thread's second free of the old block is
//!   refused at once, as it would be in the arena the block came from. At an address no
//!   superblock has covered yet (a pool block over `large_max`, or one its first fit served
//!   after an arena's out-of-memory retry, in a range never lent), the slot's page of flags is
//!   made for it (`Registry::mark_freed_unlent`).
//!
//! The flags belong to addresses, not to superblock objects: a large superblock and the normal
//! ones lent earlier or later over the same range share them (`registry.rs`).
//!
//! Invariant: for a block handed out by the owner, the flag is set exactly while an accepted
//! free of it exists and the block has not been handed out again. `IN_TRANSIT` is never stale:
//! it lasts until its free arrives (a batch whose fence could not be made is parked and
//! arrives after the next device synchronise, `outbox.rs`; no block starting at that flag is
//! handed out meanwhile). `ARRIVED` may be stale (a block freed and merged away, then
//! the range kept, given back or lent again: clearing them all at each lending cost a store per
//! granule): the owner clears it whenever it hands out a block starting there, so a stale one is
//! only ever read for a pointer that is not a live block, whose free is refused either way (a
//! block the pool itself hands out may start at a stale one: the pool reads the flag only for
//! blocks an arena handed out, and no arena owns a range while a pool block lives in it). Two
//! frees of one block that race each other (neither ordered before the other) may both be
//! accepted, as with any allocator; ordered double frees are refused at once. A wrong-size or
//! interior free by another thread is accepted until the owner checks it; while it is on its
//! way, it holds the flag, and a correct free of the same block is refused as a double free
//! (the README states this limit). An aligned interior pointer freed by another thread at a
//! stale flag is refused as a double free rather than as an unknown pointer; it is refused
//! either way.

use crate::shell::ArenaShell;
use crate::sync::{AtomicPtr, AtomicU8, Mutex, Ordering, UnsafeCell, lock};
use std::ptr::NonNull;
use std::sync::Arc;

/// Freed flag: a free of the block that starts here was accepted by its owner (its local free,
/// or a remote free its drain took in) or applied by the pool, a bad free on its way arrived
/// here and was refused where no live block starts, or the flag is stale (the block was merged
/// away since).
pub(crate) const ARRIVED: u8 = 1;
/// Freed flag: a free away from the owner's fast path took the flag and is on its way to the
/// owner (an outbox, an inbox) or to the pool. Never stale: it becomes [`ARRIVED`] when the
/// free arrives (or `0`, if it is refused where a live block starts; a free whose fence failed
/// arrives after a device synchronise, parked till then), so the owner never hands out a block
/// starting here meanwhile
/// (`Arena::carve`): a bad free on its way would otherwise be taken as a free of it.
pub(crate) const IN_TRANSIT: u8 = 2;

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
///
/// Invariant: while no arena owns the superblock, `tags` is empty or all zeros, `granules`
/// long: the arena giving it back clears the two tags of every block as it walks them
/// (`Arena::give_back`), so a lending never zeroes a whole tag array again.
pub(crate) struct SbLocal {
    pub(crate) tags: Vec<u32>,
    /// Granules in used or pending blocks.
    pub(crate) live: usize,
}

impl SbLocal {
    /// Readies `granules` of untagged space for a new owner (the caller then marks one free
    /// block): the tags left zeroed by the last owner, the room a normal superblock reserved
    /// (`Superblock::new`), a zeroed buffer from `stash`, or a fresh one.
    pub(crate) fn init(&mut self, granules: usize, stash: &TagStash) {
        if self.tags.len() != granules {
            debug_assert!(self.tags.is_empty(), "tags of another size");
            if self.tags.capacity() >= granules {
                self.tags.resize(granules, 0);
            }
        }
        if self.tags.len() != granules {
            self.tags = match stash.take(granules) {
                Some(t) => t,
                // Zeroed memory from the allocator (for a large span, fresh pages that are zero
                // until touched; only block ends are ever written).
                None => vec![0; granules],
            };
        }
        debug_assert!(self.tags.iter().all(|&t| t == 0), "a superblock lent with stale tags");
        self.live = 0;
    }

    /// The tags, all zero (see the invariant), taken out (a large superblock leaving its arena).
    pub(crate) fn take_tags(&mut self) -> Vec<u32> {
        debug_assert!(self.tags.iter().all(|&t| t == 0), "tags taken before they were cleared");
        std::mem::take(&mut self.tags)
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

/// Zeroed tag buffers of large superblocks that went back to the pool, kept for their next
/// lending: zeroing 4 bytes per granule (2 MiB for 128 MiB) at every lending cost more than
/// the rest of a large block's path. Holds at most [`TAG_STASH_GRANULES`] granules of tags
/// (8 MiB of host memory); a buffer that does not fit is dropped. Invariant: every buffer in it
/// is all zeros. Its lock is a leaf: nothing else is locked while it is held.
#[derive(Default)]
pub(crate) struct TagStash(Mutex<Vec<Vec<u32>>>);

/// The most granules of tags a [`TagStash`] keeps.
pub(crate) const TAG_STASH_GRANULES: usize = 2 << 20;

impl TagStash {
    /// A zeroed buffer of exactly `granules` tags, if one is kept.
    pub(crate) fn take(&self, granules: usize) -> Option<Vec<u32>> {
        let mut v = lock(&self.0);
        let i = v.iter().position(|t| t.len() == granules)?;
        Some(v.swap_remove(i))
    }

    /// Keeps `tags` (all zeros) if there is room.
    pub(crate) fn put(&self, tags: Vec<u32>) {
        if tags.is_empty() {
            return;
        }
        let mut v = lock(&self.0);
        let kept: usize = v.iter().map(Vec::len).sum();
        if kept + tags.len() <= TAG_STASH_GRANULES {
            v.push(tags);
        }
    }
}

/// A superblock: a normal one (one registry slot) or a large one (several slots, see
/// `arena.rs`). Lives as long as the registry, which keeps one per `(base, granules)`.
pub(crate) struct Superblock {
    pub(crate) base: u64,
    /// Its span in granules (fixed for the object).
    pub(crate) granules: usize,
    pub(crate) owner: AtomicPtr<ArenaShell>,
    /// Freed flags (see the module comment), one page per registry slot covered: shared with
    /// every superblock object that covers the same slot, since a flag belongs to its address.
    /// Held for `first_flag` and `page_base`, which point into it.
    _pages: Box<[Arc<[AtomicU8]>]>,
    /// The first flag of the first page: a normal superblock's flags are all on it.
    first_flag: NonNull<AtomicU8>,
    /// The first flag of each page, so that a flag beyond the first page is one table load and
    /// an offset away, with no `Arc` to follow (each flag is read or written on the fast path
    /// four times a pair; through the pages, a large superblock's cost a dozen instructions
    /// each). Invariant: `page_base[i]` is `_pages[i]` as a pointer to its first flag, made from
    /// the whole page (so `first_flag` is `page_base[0]`), and every page holds `page_mask + 1`
    /// flags (checked in `new`).
    page_base: Box<[NonNull<AtomicU8>]>,
    /// `log2` of the granules per page.
    page_shift: u32,
    /// Granules per page, less one.
    page_mask: usize,
    local: UnsafeCell<SbLocal>,
}

// SAFETY: `owner` is atomic and the flag pages are atomics (`first_flag` and `page_base` point
// at them, in pages the superblock holds, and are never written); `local` is touched only by the
// thread whose shell is `owner` (or by the pool while `owner` is null and the pool lock is
// held), and ownership changes only under the pool lock, which orders the accesses of
// successive owners.
unsafe impl Send for Superblock {}
// SAFETY: as above.
unsafe impl Sync for Superblock {}

impl Superblock {
    /// A superblock of `granules` at `base` whose freed flags are `pages`, `per_page` (a power
    /// of two) granules each. Normal superblocks (one page) get their tags' room now, filled at
    /// their first lending (`SbLocal::init`) and kept for life (4 bytes a granule, about 1.6%
    /// of the range; the loom model of the registry reads that room as the state `new` set);
    /// large ones get theirs at each lending, and give them back when they leave their arena.
    pub(crate) fn new(
        base: u64,
        granules: usize,
        pages: Box<[Arc<[AtomicU8]>]>,
        per_page: usize,
    ) -> Superblock {
        debug_assert!(per_page.is_power_of_two() && pages.len() * per_page >= granules);
        // `flag` relies on it (`page_base`'s invariant).
        assert!(pages.iter().all(|p| p.len() == per_page), "every page holds per_page flags");
        // From each whole page, not its first flag: a pointer made from `&p[0]` may reach that
        // one flag only (Stacked Borrows), and `flag` steps up to a page past it.
        let page_base: Box<[NonNull<AtomicU8>]> =
            pages.iter().map(|p| NonNull::from(&**p).cast::<AtomicU8>()).collect();
        let mut local = SbLocal { tags: Vec::new(), live: 0 };
        if pages.len() == 1 {
            local.tags.reserve_exact(granules);
        }
        Superblock {
            base,
            granules,
            owner: AtomicPtr::new(std::ptr::null_mut()),
            _pages: pages,
            first_flag: page_base[0],
            page_base,
            page_shift: per_page.trailing_zeros(),
            page_mask: per_page - 1,
            local: UnsafeCell::new(local),
        }
    }

    /// The freed flag of granule `g`.
    #[inline]
    fn flag(&self, g: usize) -> &AtomicU8 {
        let (first, i) = if g <= self.page_mask {
            (self.first_flag, g)
        } else {
            // Bounds-checked: a granule beyond the pages panics, as indexing them would.
            (self.page_base[g >> self.page_shift], g & self.page_mask)
        };
        // SAFETY: `first` was made from a whole page of `page_mask + 1` flags (so it may reach
        // each of them), which `_pages` keeps alive as long as `self` (`page_base`'s
        // invariant), and `i` is at most `page_mask`.
        unsafe { &*first.as_ptr().add(i) }
    }

    /// Asks the CPU to bring the line of granule `g`'s freed flag into its cache, so that the
    /// load that comes a little later does not wait for memory (a hint: it reads nothing and
    /// cannot fault; a no-op under loom and off x86-64). Does nothing for `g` outside.
    #[inline(always)]
    pub(crate) fn prefetch_flag(&self, g: usize) {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        if g < self.granules {
            let f: *const AtomicU8 = self.flag(g);
            // SAFETY: SSE, which `_mm_prefetch` needs, is part of every x86-64 CPU; a prefetch
            // is a hint that reads no memory the program can observe and cannot fault.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(f.cast()) };
        }
        #[cfg(not(all(target_arch = "x86_64", not(loom))))]
        let _ = g;
    }

    /// The granule of `ptr` in this superblock, if `ptr` lies in it on a granule boundary.
    pub(crate) fn granule_of(&self, ptr: u64) -> Option<usize> {
        let off = ptr.checked_sub(self.base)?;
        let g = (off >> crate::size_class::GRANULE_SHIFT) as usize;
        (off.is_multiple_of(crate::size_class::GRANULE as u64) && g < self.granules).then_some(g)
    }

    /// A free away from the owner's fast path takes the flag of the block at granule `g`,
    /// marking it [`IN_TRANSIT`]. False if it was set (either value): the block was freed
    /// already (the free is a double free), and nothing is written. `AcqRel`: of two ordered
    /// frees, the later sees the earlier.
    pub(crate) fn claim_free(&self, g: usize) -> bool {
        // Mutation for the loom model of the freed flags: a free that marks nothing.
        if cfg!(cuarena_mutant = "transit_unmarked") {
            return true;
        }
        self.flag(g).compare_exchange(0, IN_TRANSIT, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// True if a free of the block at granule `g` has been accepted and the block not handed
    /// out again (or, at a granule that starts no block, the flag is stale or a bad free of it
    /// is on its way).
    #[inline]
    pub(crate) fn is_freed(&self, g: usize) -> bool {
        self.flag(g).load(Ordering::Acquire) != 0
    }

    /// True if a free away from the owner's fast path took the flag at granule `g` and has not
    /// reached the owner (or the pool) yet.
    #[inline]
    pub(crate) fn in_transit(&self, g: usize) -> bool {
        self.freed_flag(g) == IN_TRANSIT
    }

    /// The freed flag at granule `g`: 0, [`ARRIVED`] or [`IN_TRANSIT`] (one load, for the
    /// owner's carve, which needs both tests).
    #[inline]
    pub(crate) fn freed_flag(&self, g: usize) -> u8 {
        self.flag(g).load(Ordering::Acquire)
    }

    /// The owner accepted a free that took the flag at `g` on its way (its drain): the flag
    /// says [`ARRIVED`] from now on. A plain store, as the owner's.
    #[inline]
    pub(crate) fn mark_arrived(&self, g: usize) {
        self.flag(g).store(ARRIVED, Ordering::Release);
    }

    /// A free on its way, which took the flag at `g`, was refused on arrival (by the owner's
    /// drain or by the pool). Where a live block starts at `g` (a wrong-size free), the flag is
    /// cleared, so that the block's own free is taken; elsewhere it says `ARRIVED`: a block
    /// the pool took back at that address while the bad free was on its way left the flag to
    /// it, and a second free of that block must still be refused once the range is lent again
    /// (a stale `ARRIVED` is harmless, see the module comment).
    pub(crate) fn refuse_transit(&self, g: usize, live_block_here: bool) {
        if live_block_here { self.unfree(g) } else { self.mark_arrived(g) }
    }

    /// The pool applied a caller's free of the block at granule `g` (a pool block in a range a
    /// superblock once covered): `ARRIVED`, unless a bad free on its way holds the flag (it
    /// stays `IN_TRANSIT` until that free arrives). Under the pool's lock, off the fast path.
    pub(crate) fn mark_pool_freed(&self, g: usize) {
        let _ = self.flag(g).compare_exchange(0, ARRIVED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The owner's local free of the block at granule `g` (after `is_freed` was false). A
    /// plain store: the owner's fast path does no read-modify-write.
    #[inline]
    pub(crate) fn set_freed(&self, g: usize) {
        // Mutation for the loom model of the owner's side: a local free that marks nothing.
        if cfg!(cuarena_mutant = "owner_free_unmarked") {
            return;
        }
        self.flag(g).store(ARRIVED, Ordering::Release);
    }

    /// The block at granule `g` is handed out again (by its owner), or a free that set the
    /// flag was refused where a live block starts, or was not taken after all. `Release`: a
    /// free that reads the cleared flag was ordered after it (the pointer reached that thread
    /// by the caller's own synchronisation, or by the pool's lock).
    #[inline]
    pub(crate) fn unfree(&self, g: usize) {
        self.flag(g).store(0, Ordering::Release);
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
