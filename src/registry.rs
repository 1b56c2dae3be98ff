//! The superblock registry: from any device address to the superblock that holds it, lock-free.
//!
//! A two-level radix table indexed by `addr >> superblock_shift`: one *slot* per normal
//! superblock's span of address space. A superblock spans one slot (a normal superblock) or
//! several (a large superblock, see `arena.rs`); it is entered in every slot it covers.
//!
//! Leaves and entries are written only under the global pool's lock (one writer at a time)
//! with `Release` stores; readers on the free path use `Acquire` loads and take no lock.
//! Superblock objects are never freed while the registry lives: a superblock returned to the
//! pool keeps its entries with no owner, so a reader can never see a freed superblock.
//!
//! **Entries are never removed, but may be replaced**: when the pool lends a range laid out
//! differently from the superblock last entered there (a large superblock over what were normal
//! ones, or the reverse), it enters the new superblock in each slot the range covers. It does so
//! only for a range that is wholly free in the pool, so no live block lies in it, and:
//! - an entry always names a superblock whose span covers the entry's slot;
//! - a live block's slot is not rewritten while the block lives (a range that covers the slot
//!   covers the block), so a free of a live block finds the superblock that handed it out, or,
//!   once that superblock went back to the pool, one with no owner;
//! - a reader racing a rewrite of a *free* range sees the old or the new superblock, both
//!   valid objects; its free is invalid anyway and is refused by the owner's tags or the pool.
//!
//! Superblock objects are kept per `(base, granules)` and reused when the same layout is lent
//! again, so the number of objects is bounded by the layouts ever lent. The freed flags (one
//! byte per 256-byte granule, see `superblock.rs`) belong to the address, not to the object:
//! one page of flags per slot, made once and shared by every superblock that covers the slot.
//! A page is also made for a slot never lent when the pool takes back a block that started
//! there (`Registry::mark_freed_unlent`). Host memory for the flags is thus one byte per
//! granule of address space ever lent (0.4%), whatever the layouts, plus a page per other slot
//! a freed pool block started in. The owner-only boundary tags are not per address: a normal
//! superblock object keeps its own, and a large one gets them at each lending (`superblock.rs`).
//! Loom model: `loom-tests/tests/registry.rs`.

use crate::superblock::{ARRIVED, Superblock};
use crate::sync::{AtomicPtr, AtomicU8, Mutex, Ordering, lock, ordering};
use std::collections::HashMap;
use std::sync::Arc;

#[cfg(not(loom))]
const LEVEL_BITS: u32 = 16;
#[cfg(loom)]
const LEVEL_BITS: u32 = 2;

struct Leaf {
    slots: Box<[AtomicPtr<Superblock>]>,
}

/// The objects behind the entries. Touched only by writers (under the pool lock, and this
/// mutex, uncontended, for safe access).
#[derive(Default)]
struct Store {
    /// Every superblock object ever made, by `(base, granules)`.
    units: HashMap<(u64, usize), Arc<Superblock>>,
    /// The freed-flag page of each slot ever covered, by slot base.
    pages: HashMap<u64, Arc<[AtomicU8]>>,
}

/// Address → superblock.
pub(crate) struct Registry {
    shift: u32,
    root: Box<[AtomicPtr<Leaf>]>,
    store: Mutex<Store>,
}

fn table<T>() -> Box<[AtomicPtr<T>]> {
    (0..1usize << LEVEL_BITS).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect()
}

impl Registry {
    pub(crate) fn new(superblock: usize) -> Registry {
        Registry { shift: superblock.trailing_zeros(), root: table(), store: Mutex::new(Store::default()) }
    }

    fn split(&self, addr: u64) -> Option<(usize, usize)> {
        let key = addr >> self.shift;
        if key >> (2 * LEVEL_BITS) != 0 {
            return None;
        }
        let mask = (1u64 << LEVEL_BITS) - 1;
        Some(((key >> LEVEL_BITS) as usize, (key & mask) as usize))
    }

    /// True if superblocks at `addr` can be registered.
    pub(crate) fn covers(&self, addr: u64) -> bool {
        self.split(addr).is_some()
    }

    /// The superblock whose range holds `addr`, if one was ever registered there.
    #[inline]
    pub(crate) fn lookup(&self, addr: u64) -> Option<&Superblock> {
        let (r, l) = self.split(addr)?;
        let leaf = self.root[r].load(Ordering::Acquire);
        if leaf.is_null() {
            return None;
        }
        // SAFETY: leaves are installed once and freed only in Drop (no reader then).
        let sb = unsafe { &*leaf }.slots[l].load(Ordering::Acquire);
        // SAFETY: entries point into `store.units`, whose objects are never removed and are
        // released only in Drop.
        (!sb.is_null()).then(|| unsafe { &*sb })
    }

    /// The page of freed flags of the slot at `base` (`per_slot` granules), made if new.
    fn page(pages: &mut HashMap<u64, Arc<[AtomicU8]>>, base: u64, per_slot: usize) -> Arc<[AtomicU8]> {
        Arc::clone(pages.entry(base).or_insert_with(|| (0..per_slot).map(|_| AtomicU8::new(0)).collect()))
    }

    /// Marks the freed flag of the granule at `addr` [`ARRIVED`] (where it is `0`) in a slot
    /// no superblock has been entered in yet, making the slot's page of flags now: the pool took
    /// back a block it had handed out there (a request over `large_max`, or one its first fit
    /// served after an arena's out-of-memory retry), and once the slot is lent, the page the
    /// superblock gets (`get_or_insert`) says so, so that a second free of the block is refused
    /// at once.
    ///
    /// Must be called with the global pool's lock held (it orders this store before the
    /// superblock that publishes the page is entered). Does nothing for an address the
    /// registry cannot cover or one off a granule boundary.
    pub(crate) fn mark_freed_unlent(&self, addr: u64) {
        if !self.covers(addr) {
            return;
        }
        let slot_bytes = 1u64 << self.shift;
        let granule = crate::size_class::GRANULE as u64;
        let (base, off) = (addr & !(slot_bytes - 1), addr & (slot_bytes - 1));
        if !off.is_multiple_of(granule) {
            return;
        }
        let page = Self::page(&mut lock(&self.store).pages, base, (slot_bytes / granule) as usize);
        let _ =
            page[(off / granule) as usize].compare_exchange(0, ARRIVED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The superblock of `granules` granules at `base`, made if new, and entered in every slot
    /// it covers (replacing what was there: see the module comment for when that is allowed).
    ///
    /// Must be called with the global pool's lock held (it is the only writer), for a range
    /// that holds no live block. Every slot of the range must be covered ([`Registry::covers`]).
    pub(crate) fn get_or_insert(&self, base: u64, granules: usize) -> &Superblock {
        let slot_bytes = 1u64 << self.shift;
        let per_slot = (slot_bytes / crate::size_class::GRANULE as u64) as usize;
        debug_assert!(base.is_multiple_of(slot_bytes) && granules.is_multiple_of(per_slot));
        let slots = (granules / per_slot).max(1);
        let sb: *const Superblock = {
            let mut st = lock(&self.store);
            let Store { units, pages } = &mut *st;
            let unit = units.entry((base, granules)).or_insert_with(|| {
                let pages =
                    (0..slots as u64).map(|i| Self::page(pages, base + i * slot_bytes, per_slot)).collect();
                Arc::new(Superblock::new(base, granules, pages, per_slot))
            });
            Arc::as_ptr(unit)
        };
        for i in 0..slots as u64 {
            let (r, l) = self.split(base + i * slot_bytes).expect("caller checked covers()");
            let mut leaf = self.root[r].load(Ordering::Acquire);
            if leaf.is_null() {
                leaf = Box::into_raw(Box::new(Leaf { slots: table() }));
                self.root[r].store(leaf, Ordering::Release);
            }
            // SAFETY: installed above or earlier; freed only in Drop.
            let slot = &unsafe { &*leaf }.slots[l];
            let old = slot.load(Ordering::Relaxed);
            if !std::ptr::eq(old, sb) {
                // `Release` both for a first entry and for a replacement (a lock-free reader
                // of the new entry must see the new superblock initialised). The mutations
                // weaken the one or the other for the loom models (`loom-tests/tests/registry.rs`).
                #[cfg(not(cuarena_mutant = "registry_replace_relaxed"))]
                let publish = ordering!(Ordering::Release, "registry_publish_relaxed" => Ordering::Relaxed);
                #[cfg(cuarena_mutant = "registry_replace_relaxed")]
                let publish = if old.is_null() { Ordering::Release } else { Ordering::Relaxed };
                slot.store(sb as *mut Superblock, publish);
            }
        }
        // SAFETY: as in `lookup`.
        unsafe { &*sb }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        for r in self.root.iter() {
            let leaf = r.load(Ordering::Acquire);
            if !leaf.is_null() {
                // SAFETY: `&mut self`: no reader remains; the leaf came from Box::into_raw.
                drop(unsafe { Box::from_raw(leaf) });
            }
        }
        // The superblock objects go with `store`.
    }
}
