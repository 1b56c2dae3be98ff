//! The superblock registry: from any device address to the superblock that holds it, lock-free.
//!
//! A two-level radix table indexed by `addr >> superblock_shift`. Leaves and entries are
//! installed only under the global pool's lock (one writer at a time) with `Release` stores;
//! readers on the free path use `Acquire` loads and take no lock. Entries are never removed
//! while the registry lives: a superblock returned to the pool keeps its entry with no owner,
//! so a reader can never see a freed superblock. Loom model: `loom-tests/tests/registry.rs`.

use crate::superblock::Superblock;
use crate::sync::{AtomicPtr, Ordering, ordering};
use std::sync::Arc;

#[cfg(not(loom))]
const LEVEL_BITS: u32 = 16;
#[cfg(loom)]
const LEVEL_BITS: u32 = 2;

struct Leaf {
    slots: Box<[AtomicPtr<Superblock>]>,
}

/// Address → superblock.
pub(crate) struct Registry {
    shift: u32,
    root: Box<[AtomicPtr<Leaf>]>,
}

fn table<T>() -> Box<[AtomicPtr<T>]> {
    (0..1usize << LEVEL_BITS).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect()
}

impl Registry {
    pub(crate) fn new(superblock: usize) -> Registry {
        Registry { shift: superblock.trailing_zeros(), root: table() }
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
        // SAFETY: entries are installed once from Arc::into_raw and released only in Drop.
        (!sb.is_null()).then(|| unsafe { &*sb })
    }

    /// The superblock at `base`, created and registered if absent.
    ///
    /// Must be called with the global pool's lock held (it is the only writer). `base` must be
    /// covered (see [`Registry::covers`]).
    pub(crate) fn get_or_insert(&self, base: u64, granules: usize) -> &Superblock {
        let (r, l) = self.split(base).expect("caller checked covers()");
        let mut leaf = self.root[r].load(Ordering::Acquire);
        if leaf.is_null() {
            leaf = Box::into_raw(Box::new(Leaf { slots: table() }));
            self.root[r].store(leaf, Ordering::Release);
        }
        // SAFETY: installed above or earlier; freed only in Drop.
        let slot = &unsafe { &*leaf }.slots[l];
        let mut sb = slot.load(Ordering::Acquire);
        if sb.is_null() {
            sb = Arc::into_raw(Arc::new(Superblock::new(base, granules))) as *mut Superblock;
            slot.store(sb, ordering!(Ordering::Release, "registry_publish_relaxed" => Ordering::Relaxed));
        }
        // SAFETY: as in `lookup`.
        unsafe { &*sb }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        for r in self.root.iter() {
            let leaf = r.load(Ordering::Acquire);
            if leaf.is_null() {
                continue;
            }
            // SAFETY: `&mut self`: no reader remains; the leaf came from Box::into_raw.
            let leaf = unsafe { Box::from_raw(leaf) };
            for s in leaf.slots.iter() {
                let sb = s.load(Ordering::Acquire);
                if !sb.is_null() {
                    // SAFETY: the entry came from Arc::into_raw and is released once.
                    drop(unsafe { Arc::from_raw(sb) });
                }
            }
        }
    }
}
