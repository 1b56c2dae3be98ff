//! Models of large superblocks (`src/arena.rs`, "Large superblocks") driving the real
//! allocator: a request over `small_max` makes the arena borrow a superblock that spans several
//! normal ones (entered in each registry slot it covers), and its blocks' remote frees race the
//! superblock's way back to the pool. The superblock is lent under the model's cap (8 normal
//! superblocks), so the arena halves its first ask (8 MiB) down to what fits, as it does under
//! any cap. The mutation `exit_close_first` (the inbox closed before the superblocks go back)
//! must fail both models, and `owner_cleared_early` (the superblock's owner cleared before the
//! pool knows its blocks) the second.
#![cfg(loom)]

use cuarena::DeviceAddr;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use loom_tests::common::{SB, assert_all_returned, model, setup, wait_for};
use std::sync::Arc;

/// Over `small_max` (`SB / 2`): a large block.
const LARGE: usize = SB / 2 + 4096;

/// Thread exit: the owner gives back its large superblock, dissolving it around a large block
/// another thread is freeing. The free reaches the owner before its inbox closes, or the pool
/// after it knows the block; every byte comes back, nothing is refused.
#[test]
fn a_large_block_freed_remotely_while_its_owner_exits_is_adopted() {
    model(|| {
        let (dev, a) = setup(8, 0.9);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let owner = thread::spawn(move || {
            let q = a2.allocate_per_thread(LARGE).unwrap();
            let s = a2.stats();
            assert_eq!(s.large_allocations, 1, "served from a large superblock: {s:?}");
            s2.store(q.0, Ordering::Release);
            a2.release_thread().unwrap();
        });
        let q = wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&q| q != 0));
        a.deallocate_per_thread(DeviceAddr(q), LARGE).unwrap();
        a.release_thread().unwrap();
        owner.join().unwrap();
        dev.complete_all();
        assert_all_returned(&a);
    });
}

/// The return rule and a remote free: the owner frees one of its two large blocks (its large
/// superblock keeps the other, live or on its way back), then exits, while the main thread
/// frees the other remotely. Whichever comes first, the superblock goes back whole once, the
/// remote free lands in the inbox or the pool, and every byte comes back.
#[test]
fn a_large_superblock_given_back_with_a_remote_free_in_flight_loses_nothing() {
    model(|| {
        let (dev, a) = setup(0, 0.5);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let owner = thread::spawn(move || {
            let b1 = a2.allocate_per_thread(LARGE).unwrap();
            let b2 = a2.allocate_per_thread(LARGE).unwrap();
            s2.store(b1.0, Ordering::Release);
            a2.deallocate_per_thread(b2, LARGE).unwrap();
            a2.release_thread().unwrap();
        });
        let b1 = wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&b| b != 0));
        a.deallocate_per_thread(DeviceAddr(b1), LARGE).unwrap();
        a.release_thread().unwrap();
        owner.join().unwrap();
        dev.complete_all();
        assert_all_returned(&a);
        let s = a.stats();
        assert!(s.large_allocations == 2 && s.superblocks_taken >= 1, "{s:?}");
    });
}
