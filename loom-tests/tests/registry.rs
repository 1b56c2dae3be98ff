//! The superblock registry (`src/registry.rs`): a writer (holding the pool lock) installs a
//! leaf and an entry while a free looks the address up without a lock. A reader that finds the
//! entry must see the superblock fully initialised.
#![cfg(loom)]

use cuarena::loom_api::RegistryModel;
use loom::thread;

#[test]
fn a_lock_free_lookup_sees_an_initialised_superblock_or_nothing() {
    loom::model(|| {
        let r = RegistryModel::new(64 << 10);
        let r2 = r.clone();
        // The writer runs first in loom's first schedule, so the reader's loads are checked
        // against its stores (see loom-tests/README.md).
        let reader = thread::spawn(move || {
            for addr in [(2 << 16) + 256, 3 << 16] {
                if let Some(tags) = r2.lookup(addr) {
                    assert_eq!(tags, r2.granules(), "a published superblock is initialised");
                }
            }
        });
        r.insert(2 << 16);
        r.insert(3 << 16);
        reader.join().unwrap();
        assert_eq!(r.lookup(2 << 16), Some(r.granules()));
        assert_eq!(r.lookup(5 << 16), None);
    });
}

/// Entry replacement: the pool lends a range laid out differently from the superblocks last
/// entered there (a large superblock over normal ones, or normal ones over a large one), and
/// re-enters each slot it covers, while a free looks an address in it up without a lock. The
/// reader must find, in each slot, the old or the new superblock, whole: a span that covers the
/// address, and the state `Superblock::new` set (read through the tracked cell, so an entry
/// published before its object is visible fails the model).
fn replacement(before: &'static [(u64, usize)], after: &'static [(u64, usize)]) {
    const SLOT: u64 = 1 << 16;
    loom::model(move || {
        let r = RegistryModel::new(SLOT as usize);
        let per_slot = r.granules();
        for &(slot, n) in before {
            r.insert_span(slot * SLOT, n);
        }
        let r2 = r.clone();
        let reader = thread::spawn(move || {
            let mut seen = Vec::new();
            for addr in [2 * SLOT + 256, 3 * SLOT + SLOT / 2] {
                let (base, granules, cap) = r2.lookup_span(addr).expect("the slot was entered before");
                let end = base + (granules as u64) * 256;
                assert!(base <= addr && addr < end, "{addr:#x} outside the span [{base:#x}, {end:#x})");
                let known = |set: &[(u64, usize)]| {
                    set.iter().any(|&(s, n)| s * SLOT == base && n * per_slot == granules)
                };
                assert!(known(before) || known(after), "a superblock never entered: {base:#x} +{granules}");
                let want = if granules == per_slot { per_slot } else { 0 };
                assert_eq!(cap, want, "a published superblock is initialised");
                seen.push(base);
            }
            seen
        });
        for &(slot, n) in after {
            r.insert_span(slot * SLOT, n);
        }
        reader.join().unwrap();
        // After the writer: every slot names the new layout.
        for &(slot, n) in after {
            for i in 0..n as u64 {
                let (base, granules, _) = r.lookup_span((slot + i) * SLOT).unwrap();
                assert_eq!((base, granules), (slot * SLOT, n * per_slot));
            }
        }
    });
}

#[test]
fn a_lookup_racing_a_large_superblock_over_normal_ones_sees_the_old_or_the_new() {
    replacement(&[(2, 1), (3, 1)], &[(2, 2)]);
}

#[test]
fn a_lookup_racing_normal_superblocks_over_a_large_one_sees_the_old_or_the_new() {
    replacement(&[(2, 2)], &[(3, 1), (2, 1)]);
}
