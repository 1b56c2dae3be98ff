//! Models that drive the real allocator (`Allocator` over the model device): remote frees into
//! an inbox the owner drains, the fence life cycle, superblock return with remote frees in
//! flight, thread exit racing a remote free, and statistics read while a thread retires.
#![cfg(loom)]

use cuarena::{Allocator, DeviceAddr};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use loom_tests::common::{SB, assert_all_returned, model, setup, setup_batched, setup_sized, wait_for};
use std::sync::Arc;

/// Fills the owner's superblock with two half blocks and frees the first from another thread.
fn fill_and_free_remotely(a: &Allocator) -> (usize, DeviceAddr, DeviceAddr, thread::JoinHandle<()>) {
    let half = SB / 2;
    let p1 = a.allocate_per_thread(half).unwrap();
    let p2 = a.allocate_per_thread(half).unwrap();
    let a2 = a.clone();
    let freer = thread::spawn(move || {
        a2.deallocate_per_thread(p1, half).unwrap();
        a2.release_thread().unwrap();
    });
    (half, p1, p2, freer)
}

/// Fence life cycle, pending: while no GPU work completes, a remotely freed block must not be
/// handed out again unless the owner's stream was made to wait on its fence. The owner's
/// superblock is full, so a new allocation could only reuse it.
#[test]
fn a_remotely_freed_block_is_not_reused_while_its_fence_is_pending() {
    model(|| {
        let (dev, a) = setup(8, 0.9);
        let (half, p1, p2, freer) = fill_and_free_remotely(&a);
        let q = a.allocate_per_thread(half).unwrap();
        // Reuse is allowed only behind a stream wait on the fence (no GPU work completes here).
        assert!(q != p1 || dev.waits() > 0, "reused while its fence was pending, without a wait");
        freer.join().unwrap();
        dev.complete_all();
        for p in [q, p2] {
            a.deallocate_per_thread(p, half).unwrap();
        }
        assert_all_returned(&a);
    });
}

/// Fence life cycle, pending → complete → reusable, with the GPU as a thread: once the GPU has
/// completed the fence, the owner takes the block back and can hand it out again.
#[test]
fn a_remotely_freed_block_becomes_reusable_once_its_fence_completes() {
    model(|| {
        let (dev, a) = setup(8, 0.9);
        let (half, p1, p2, freer) = fill_and_free_remotely(&a);
        let d2 = dev.clone();
        let gpu = thread::spawn(move || d2.complete_all());
        a.flush().unwrap(); // may or may not see the free or its completion
        freer.join().unwrap();
        gpu.join().unwrap();
        dev.complete_all(); // the GPU may have run before the free recorded its fence
        a.flush().unwrap(); // now the owner must take the block back
        let q = a.allocate_per_thread(half).unwrap();
        assert_eq!(q, p1, "the completed block is reused first (the superblock is otherwise full)");
        for p in [q, p2] {
            a.deallocate_per_thread(p, half).unwrap();
        }
        assert_all_returned(&a);
    });
}

/// Thread exit: the owner gives its arena back while another thread frees one of its blocks.
/// The free must reach the owner before it closes, or the pool after it knows the block.
#[test]
fn a_remote_free_racing_the_owners_exit_is_adopted() {
    model(|| {
        let (dev, a) = setup(8, 0.9);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let owner = thread::spawn(move || {
            let q = a2.allocate_per_thread(4096).unwrap();
            s2.store(q.0, Ordering::Release);
            a2.release_thread().unwrap();
        });
        let q = wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&q| q != 0));
        a.deallocate_per_thread(DeviceAddr(q), 4096).unwrap();
        a.release_thread().unwrap();
        owner.join().unwrap();
        dev.complete_all();
        assert_all_returned(&a);
    });
}

/// Superblock return: the owner frees its other block, which makes the return rule give the
/// superblock back (dissolving it around the remote block), while another thread frees the
/// remote block through the owner's inbox or the pool. The freer is the main thread so that
/// loom's first schedule runs it first (see loom-tests/README.md).
#[test]
fn a_superblock_given_back_with_a_remote_free_in_flight_loses_nothing() {
    model(|| {
        let (dev, a) = setup(0, 0.5);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let owner = thread::spawn(move || {
            let b1 = a2.allocate_per_thread(SB / 4).unwrap();
            let b2 = a2.allocate_per_thread(SB / 4).unwrap();
            s2.store(b1.0, Ordering::Release);
            a2.deallocate_per_thread(b2, SB / 4).unwrap(); // the return rule gives the superblock back
            let s = a2.stats();
            assert!(s.superblocks_returned + s.superblocks_dissolved >= 1, "{s:?}");
            a2.release_thread().unwrap();
        });
        let b1 = wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&b| b != 0));
        a.deallocate_per_thread(DeviceAddr(b1), SB / 4).unwrap();
        a.release_thread().unwrap();
        owner.join().unwrap();
        dev.complete_all();
        assert_all_returned(&a);
    });
}

/// Statistics: per-thread single-writer counters folded into `retired` when a thread exits,
/// read concurrently. A reading never counts a thread twice (each counter stays within its
/// final value) and, once the thread is done, every counter is exact. (A reading taken while a
/// thread runs is not atomic across counters: it may see a free and not yet its allocation.)
#[test]
fn stats_read_while_a_thread_retires_are_consistent() {
    model(|| {
        let (_dev, a) = setup(8, 0.9);
        let a2 = a.clone();
        let worker = thread::spawn(move || {
            let p = a2.allocate_per_thread(4096).unwrap();
            a2.deallocate_per_thread(p, 4096).unwrap();
            a2.release_thread().unwrap();
        });
        let s = a.stats();
        assert!(s.allocations <= 1 && s.deallocations <= 1 && s.superblocks_taken <= 1, "{s:?}");
        worker.join().unwrap();
        let s = a.stats();
        assert_eq!((s.allocations, s.deallocations, s.live_bytes), (1, 1, 0));
    });
}

/// Reclaim from an idle arena (`claim.rs`, `Arena::reclaim`): the main thread frees the owner's
/// block and calls `trim`, which takes superblocks with no used block back from the owner's
/// arena without its help, while the owner allocates and frees again. Owner and reclaimer never
/// touch the arena at once (the superblocks' owner-only state is a tracked cell), and nothing
/// is lost or handed out twice.
#[test]
fn a_reclaim_racing_the_owner_loses_nothing() {
    model(|| {
        let (dev, a) = setup(8, 0.9);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let d2 = dev.clone();
        let owner = thread::spawn(move || {
            let p = a2.allocate_per_thread(SB / 2).unwrap();
            s2.store(p.0, Ordering::Release);
            let q = a2.allocate_per_thread(SB / 4).unwrap();
            // No GPU work completes in this model before the join: p can come back only if
            // it was freed and reclaimed, and then only behind a stream wait on its fence.
            assert!(q != p || d2.waits() > 0, "reused without its fence");
            a2.deallocate_per_thread(q, SB / 4).unwrap();
            a2.release_thread().unwrap();
        });
        let p = wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&p| p != 0));
        a.deallocate_per_thread(DeviceAddr(p), SB / 2).unwrap();
        a.trim(false).unwrap();
        owner.join().unwrap();
        dev.complete_all();
        assert_all_returned(&a);
    });
}

/// Transit bits (`superblock.rs`): a free waiting in this thread's outbox while the owner exits
/// (its superblock dissolving around the block), then a second free of the same block. The
/// second must be refused, and the block never handed out twice.
#[test]
fn a_second_free_while_the_first_waits_in_an_outbox_is_refused() {
    model(|| {
        let (dev, a) = setup_batched(8, 0.9, 4);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let owner = thread::spawn(move || {
            let b = a2.allocate_per_thread(4096).unwrap();
            s2.store(b.0, Ordering::Release);
            a2.release_thread().unwrap();
        });
        let b = DeviceAddr(wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&b| b != 0)));
        a.deallocate_per_thread(b, 4096).unwrap(); // waits in the outbox (batch of 4)
        let second = a.deallocate_per_thread(b, 4096);
        assert!(second.is_err(), "a double free was accepted");
        owner.join().unwrap();
        let c = a.allocate(4096, cuarena::Stream::LEGACY).unwrap();
        a.flush().unwrap();
        dev.complete_all();
        let d = a.allocate(4096, cuarena::Stream::LEGACY).unwrap();
        assert_ne!(c, d, "a live block handed out twice");
        for p in [c, d] {
            a.deallocate(p, 4096, cuarena::Stream::LEGACY).unwrap();
        }
        a.release_thread().unwrap();
        a.check_invariants();
        let s = a.stats();
        assert_eq!((s.invalid_frees, s.live_bytes), (1, 0), "{:?}", a.take_deferred_error());
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
    });
}

/// Freed flags (`superblock.rs`), the owner's side: the owner frees its block on its fast path
/// (a plain store of the flag), then another thread frees it again, then the owner allocates.
/// The second free must be refused, and no block handed out twice.
#[test]
fn a_remote_free_after_the_owners_local_free_is_refused() {
    model(|| {
        let (dev, a) = setup_batched(8, 0.9, 4);
        let shared = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicU64::new(0));
        let (a2, s2, d2) = (a.clone(), shared.clone(), done.clone());
        let other = thread::spawn(move || {
            let b = DeviceAddr(wait_for(|| Some(s2.load(Ordering::Acquire)).filter(|&b| b != 0)));
            let r = a2.deallocate_per_thread(b, 4096);
            d2.store(1, Ordering::Release);
            a2.release_thread().unwrap();
            r
        });
        let b = a.allocate_per_thread(4096).unwrap();
        a.deallocate_per_thread(b, 4096).unwrap();
        shared.store(b.0, Ordering::Release);
        wait_for(|| Some(done.load(Ordering::Acquire)).filter(|&d| d != 0));
        let c = a.allocate_per_thread(4096).unwrap();
        let second = other.join().unwrap();
        assert!(second.is_err(), "a double free of a free block was accepted");
        a.flush().unwrap();
        dev.complete_all();
        a.flush().unwrap();
        let d = a.allocate_per_thread(4096).unwrap();
        assert_ne!(c, d, "a live block handed out twice");
        for p in [c, d] {
            a.deallocate_per_thread(p, 4096).unwrap();
        }
        a.release_thread().unwrap();
        a.check_invariants();
        assert_eq!(a.stats().live_bytes, 0);
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
    });
}

/// Freed flags of a range lent again (`superblock.rs`, `GlobalPool::free`): the owner exits
/// holding a block (its superblock dissolves around it), this thread frees the block (the pool
/// takes it) and then frees it again, while another thread borrows the whole range for its
/// arena. Whether the borrow comes before, between or after the two frees, the second must be
/// refused at once, and nothing handed out twice. The mutation `pool_free_unmarked` (the pool
/// leaves the flag clear) must fail this: the new arena's flag would take the second free.
#[test]
fn a_second_free_after_the_range_is_lent_again_is_refused() {
    model(|| {
        let (_dev, a) = setup(8, 0.9);
        let quarter = SB / 4;
        let a2 = a.clone();
        let p = thread::spawn(move || {
            let q = a2.allocate_per_thread(quarter).unwrap();
            let p = a2.allocate_per_thread(quarter).unwrap();
            a2.deallocate_per_thread(q, quarter).unwrap();
            a2.release_thread().unwrap();
            p
        })
        .join()
        .unwrap();
        let a3 = a.clone();
        let lender = thread::spawn(move || {
            let b = a3.allocate_per_thread(256).unwrap();
            a3.deallocate_per_thread(b, 256).unwrap();
            a3.release_thread().unwrap();
            b
        });
        a.deallocate(p, quarter, cuarena::Stream::LEGACY).unwrap(); // a batch of one: sent now
        let second = a.deallocate(p, quarter, cuarena::Stream::LEGACY);
        assert!(second.is_err(), "a double free was accepted");
        let b = lender.join().unwrap();
        assert!(b.0 + 256 <= p.0 || p.0 + quarter as u64 <= b.0, "a freed block handed out twice");
        a.release_thread().unwrap();
        a.check_invariants();
        let s = a.stats();
        assert_eq!((s.invalid_frees, s.live_bytes), (1, 0), "{:?}", a.take_deferred_error());
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
    });
}

/// Freed flags in transit (`superblock.rs`, `Arena::carve`): another thread frees an interior
/// pointer `q` of the owner's block (a bad free: it takes the clear flag at `q` and waits in its
/// outbox), then sends it while the owner frees the block and allocates two blocks of the bad
/// free's size, the second of which would start at `q`. The owner must never hand out a block
/// starting at a free on its way: when the bad free arrives it must be refused and reported,
/// and the owner's own free of each block accepted. The mutation `carve_ignores_transit`
/// (hand such a block out) must fail this.
#[test]
fn a_bad_free_on_its_way_is_never_taken_as_a_free_of_a_later_block() {
    const SB2: usize = 128 << 10;
    model(|| {
        // Superblocks of 128 KiB, so a 64 KiB block (above the cached classes) merges back
        // into its free range when freed, and the 4 KiB blocks are carved from its start.
        // The return rule's defaults (keep 2 empty, sparse 0.6).
        let (dev, a) = setup_sized(SB2, 4, 2, 0.6, 4);
        let shared = Arc::new(AtomicU64::new(0));
        let freed = Arc::new(AtomicU64::new(0));
        let (a2, s2, f2) = (a.clone(), shared.clone(), freed.clone());
        let other = thread::spawn(move || {
            let q = DeviceAddr(wait_for(|| Some(s2.load(Ordering::Acquire)).filter(|&b| b != 0)));
            // Accepted for now: only the owner can tell it is bad. It waits in the outbox.
            a2.deallocate_per_thread(q, 4096).unwrap();
            f2.store(1, Ordering::Release);
            a2.flush().unwrap(); // sent to the owner, racing the owner's allocations
            a2.release_thread().unwrap();
        });
        let x = a.allocate_per_thread(SB2 / 2).unwrap();
        let q = x.0 + 4096;
        shared.store(q, Ordering::Release);
        wait_for(|| Some(freed.load(Ordering::Acquire)).filter(|&f| f != 0));
        a.deallocate_per_thread(x, SB2 / 2).unwrap();
        let first = a.allocate_per_thread(4096).unwrap();
        let second = a.allocate_per_thread(4096).unwrap();
        assert_ne!(second.0, q, "a block handed out at a bad free on its way");
        other.join().unwrap();
        a.flush().unwrap(); // the owner drains the bad free
        let e = a.take_deferred_error();
        assert!(e.is_some(), "the bad free was not reported");
        dev.complete_all();
        let third = a.allocate_per_thread(4096).unwrap();
        assert!(third != first && third != second, "a live block handed out twice");
        for p in [first, second, third] {
            a.deallocate_per_thread(p, 4096).unwrap();
        }
        a.release_thread().unwrap();
        a.check_invariants();
        let s = a.stats();
        assert_eq!((s.invalid_frees, s.live_bytes), (1, 0), "{:?}", a.take_deferred_error());
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
    });
}
