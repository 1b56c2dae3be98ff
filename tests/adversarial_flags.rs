//! Freed flags of pool blocks (`superblock.rs`, "Freed flags"; `GlobalPool::mark_freed`): a
//! block the pool handed out and took back is marked freed at its address, so that once the
//! range is lent to an arena, another thread's second free of it is refused at once, whatever
//! path served the block.

mod common;

use common::*;
use cuarena::{Allocator, DeviceAddr, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

const KIB: usize = 1 << 10;
const SB: u64 = 256 << 10;

/// Another thread frees the 4 KiB block `p` again on `s2` (what that returned is returned);
/// then the lender frees its block `b` and exits, the 768 KiB pool block `hold` is freed, and
/// every byte must come back, with `bad` frees refused.
#[allow(clippy::too_many_arguments)]
fn free_again_and_clean_up(
    a: &Allocator,
    sim: &HostDevice,
    lender: Worker,
    b: DeviceAddr,
    hold: DeviceAddr,
    p: DeviceAddr,
    s2: Stream,
    bad: u64,
) -> cuarena::Result<()> {
    let r = on_thread(a, move |a| a.deallocate(p, 4096, s2));
    lender.run(move |a| a.deallocate_per_thread(b, 256).unwrap());
    lender.exit();
    a.deallocate(hold, 768 * KIB, Stream::PER_THREAD).unwrap();
    a.flush().unwrap();
    a.trim(true).unwrap();
    let _ = a.take_deferred_error();
    assert_all_returned(a, Some(sim), bad);
    r
}

/// Under a cap of one chunk, a pool block (over `large_max`) takes all but 128 KiB of it, so a
/// small request finds no superblock to borrow and is served by the pool's first fit
/// (`alloc_slow_in`) at the chunk's last slot, which no superblock has covered yet. The block
/// is freed; the big one too; another thread's arena then borrows that last slot (the first
/// three are held by a pool block). A second free of the small block, by a third thread, must
/// be refused at once, on every stream, as it is for a block an arena handed out.
#[test]
fn a_double_free_of_a_first_fit_block_in_a_slot_never_lent_is_refused_at_once() {
    let mut failures = Vec::new();
    for first in 0..3 {
        for second in 0..3 {
            let sim = host(0);
            let cfg = small().large_max(64 * KIB).max_bytes(1 << 20).build().unwrap();
            let a = host_allocator(sim.clone(), cfg).unwrap();
            let user = sim.create_stream();
            let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
            let big = a.allocate(896 * KIB, Stream::PER_THREAD).unwrap();
            let base = big.0;
            assert_eq!(base % SB, 0);
            // Out of memory for a superblock: served by first fit behind the big block.
            let p = on_thread(&a, |a| a.allocate_per_thread(4096).unwrap());
            assert_eq!(p.0, base + 896 * KIB as u64, "served by first fit after the big block");
            let s1 = streams[first];
            on_thread(&a, move |a| {
                a.deallocate(p, 4096, s1).unwrap();
                a.flush().unwrap();
            });
            a.deallocate(big, 896 * KIB, Stream::PER_THREAD).unwrap();
            a.flush().unwrap();
            // No trim: it would release the chunk, and the next might lie elsewhere.
            a.device().synchronize().unwrap();
            // The first three slots are a pool block again; an arena borrows the last one.
            let hold = a.allocate(768 * KIB, Stream::PER_THREAD).unwrap();
            assert_eq!(hold.0, base);
            let lender = Worker::new(&a);
            let b = lender.run(|a| a.allocate_per_thread(256).unwrap());
            assert_eq!(b.0, base + 3 * SB, "the last slot was lent ({first}, {second})");
            let r = free_again_and_clean_up(&a, &sim, lender, b, hold, p, streams[second], 1);
            if !is_double(&r) {
                failures.push(format!("first free on {first}, second on {second}: {r:?}"));
            }
            sim.destroy_stream(user).unwrap();
        }
    }
    assert!(failures.is_empty(), "double frees accepted: {failures:#?}");
}

/// As above, but the small block is served by first fit at an address where another thread's
/// bad free (an interior pointer of an arena block freed since) is still on its way: the pool's
/// free of the block keeps that flag `IN_TRANSIT`, and the bad free, arriving after it, is
/// refused. The block's second free, after the range is lent again, must still be refused at
/// once: the flag the bad free leaves must not read "never freed". The bad free arrives
/// before the range is lent again (the pool refuses it) or after (it reaches the borrowing
/// arena, which took the exited owner's shell, and its drain refuses it).
#[test]
fn a_double_free_after_a_bad_free_on_its_way_at_the_same_address_is_refused_at_once() {
    let mut failures = Vec::new();
    for (late, first, second) in (0..18).map(|i| (i >= 9, i % 9 / 3, i % 3)) {
        let sim = host(0);
        let cfg = small().large_max(64 * KIB).max_bytes(1 << 20).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let user = sim.create_stream();
        let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
        // The owner borrows the first slot; a pool block takes the other three.
        let owner = Worker::new(&a);
        let blocks =
            owner.run(|a| (0..3).map(|_| a.allocate_per_thread(64 * KIB).unwrap()).collect::<Vec<_>>());
        let base = blocks[0].0;
        assert_eq!(base % SB, 0);
        let big = a.allocate(768 * KIB, Stream::PER_THREAD).unwrap();
        assert_eq!(big.0, base + SB);
        // A bad free (an interior pointer of the third block) waits in another thread's
        // outbox.
        let q = cuarena::DeviceAddr(blocks[2].0 + 4 * KIB as u64);
        let bad = Worker::new(&a);
        bad.run(move |a| a.deallocate_per_thread(q, 4096).unwrap());
        owner.run(move |a| {
            for p in blocks {
                a.deallocate_per_thread(p, 64 * KIB).unwrap();
            }
        });
        owner.exit();
        // A pool block ends at `q`; a small request is then served there by first fit.
        let z = a.allocate(132 * KIB, Stream::PER_THREAD).unwrap();
        assert_eq!(z.0, base);
        let p = on_thread(&a, |a| a.allocate_per_thread(4096).unwrap());
        assert_eq!(p, q, "served by first fit at the bad free's address");
        let s1 = streams[first];
        on_thread(&a, move |a| {
            a.deallocate(p, 4096, s1).unwrap();
            a.flush().unwrap();
        });
        // The bad free arrives (and is refused) before the range is lent again, or after.
        if !late {
            bad.run(|a| a.flush().unwrap());
        }
        a.deallocate(z, 132 * KIB, Stream::PER_THREAD).unwrap();
        a.flush().unwrap();
        a.trim(true).unwrap();
        a.device().synchronize().unwrap();
        let lender = Worker::new(&a);
        let b = lender.run(|a| a.allocate_per_thread(256).unwrap());
        assert_eq!(b.0, base, "the first slot was lent again ({first}, {second})");
        bad.run(|a| a.flush().unwrap());
        bad.exit();
        if late {
            let refused = a.stats().invalid_frees;
            lender.run(|a| a.flush().unwrap()); // its drain takes the bad free in
            assert_eq!(a.stats().invalid_frees, refused + 1, "the lender's drain refused the bad free");
        }
        let r = free_again_and_clean_up(&a, &sim, lender, b, big, p, streams[second], 2);
        if !is_double(&r) {
            failures.push(format!("bad free late {late}, first free on {first}, second on {second}: {r:?}"));
        }
        sim.destroy_stream(user).unwrap();
    }
    assert!(failures.is_empty(), "double frees accepted: {failures:#?}");
}
