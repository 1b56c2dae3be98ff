//! Adversarial pass on the freed flags' `IN_TRANSIT` state and the arenas' quarantine
//! (`Arena::carve`, `carve_around_transit`, `release_quarantine`, `give_back`): bad remote frees
//! (interior pointers, wrong sizes, pointers into merged free ranges) made by other threads or
//! on other streams, parked in an outbox while the owner carves at exactly their address; the
//! owner exiting, trimming, dissolving on out-of-memory meanwhile; large superblocks whose
//! interior addresses become normal superblocks' heads; many threads racing. Every test checks
//! that bad frees are refused (counted, reported), that no live block is handed out twice, the
//! race checker of the simulated device, and that every byte comes back.

use std::sync::Arc;
use std::time::Duration;

use cuarena::{Config, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{assert_all_returned, host_allocator};

mod common;
use common::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// 256 KiB superblocks, each its own chunk, and `small_max` a whole superblock: a request of
/// exactly one superblock is carved from a fresh superblock with nothing left over.
fn whole_sb_cfg() -> cuarena::ConfigBuilder {
    Config::builder().superblock(256 * KIB).small_max(256 * KIB).large_max(MIB).chunk(256 * KIB)
}

/// A range quarantined by an arena (a bad free of its first granule on its way) goes back to
/// the pool when the arena gives its superblock back. The range may have been used on the
/// arena's stream, or lent to it behind a wait on another stream's fence: it must go back
/// behind a fence on the arena's stream, as its other free ranges do, or the next borrower on
/// another stream may use it under work still running.
///
/// T1 holds a large superblock (8 MiB) with one large block, works on its second 256 KiB slot
/// (held on the device), and W frees an interior pointer at that slot (a bad free, parked in
/// W's outbox: the flag of that address is `IN_TRANSIT`). T1 frees the block and exits: the
/// large superblock goes back behind T1's fence. A then borrows normal superblocks over it:
/// the first slot, then the second, which it quarantines (a whole-superblock request starting
/// at the bad free's address), then the third; A's stream waited for T1's fence each time. A
/// exits. The bad free arrives (refused by the pool: the flag is cleared). B borrows the
/// second slot and writes it: B must be ordered after T1's held work.
#[test]
fn a_quarantined_range_goes_back_fenced() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), whole_sb_cfg().batch_blocks(64).build().unwrap()).unwrap();
    let t1 = Worker::new(&a);
    let w = Worker::new(&a);
    let hold = Duration::from_millis(400);
    let sim1 = sim.clone();
    let big = t1.run(move |a| {
        let big = a.allocate_per_thread(MIB).unwrap();
        // Work on the second slot that runs on after T1 has freed the block and exited.
        sim1.hold_and_check(big.0 + 256 * KIB as u64, 256 * KIB, 0x7777, hold, Stream::PER_THREAD).unwrap();
        big
    });
    let q = DeviceAddr(big.0 + 256 * KIB as u64);
    // The bad free (an interior pointer of T1's block), parked in W's outbox.
    w.run(move |a| a.deallocate(q, 256 * KIB, Stream::PER_THREAD).unwrap());
    t1.run(move |a| a.deallocate_per_thread(big, MIB).unwrap());
    t1.exit();
    let ta = Worker::new(&a);
    let blocks = ta.run(|a| {
        let v: Vec<_> = (0..2).map(|_| a.allocate_per_thread(256 * KIB).unwrap()).collect();
        a.release_thread().unwrap();
        v
    });
    assert!(!blocks.contains(&q), "a block handed out at a bad free's address on its way");
    // The bad free arrives: refused by the pool, which clears the flag.
    w.run(|a| a.flush().unwrap());
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { .. })), "the bad free is reported: {e:?}");
    // B borrows the range (the lowest free superblock-aligned one) and writes it.
    let p = a.allocate_per_thread(256 * KIB).unwrap();
    assert_eq!(p, q, "the test expects B to get the quarantined slot");
    sim.write_tag(p.0, 256 * KIB, 0x1234, Stream::PER_THREAD).unwrap();
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "B used the range under T1's running work: {:?}", &v[..v.len().min(2)]);
    a.deallocate_per_thread(p, 256 * KIB).unwrap();
    for b in blocks {
        a.deallocate_per_thread(b, 256 * KIB).unwrap();
    }
    drop((ta, w));
    assert_all_returned(&a, Some(&sim), 1);
}
