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

/// The small layout (`small_max` 64 KiB, 256 KiB superblocks), frees batched by 64.
fn small_cfg() -> cuarena::ConfigBuilder {
    small().batch_blocks(64)
}

/// Fills one fresh superblock of the calling thread's per-thread arena with four 64 KiB
/// blocks, in address order.
fn four_blocks(a: &cuarena::Allocator) -> [DeviceAddr; 4] {
    let v: Vec<_> = (0..4).map(|_| a.allocate_per_thread(64 * KIB).unwrap()).collect();
    for w in v.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 64 * KIB as u64, "the test expects blocks carved in order");
    }
    [v[0], v[1], v[2], v[3]]
}

/// The owner carves around a bad free on its way: a free range starting at the bad free's
/// address gives its tail when it is longer than the request, and is quarantined when it is
/// exactly the request; once the bad free has arrived (refused), the range is merged back and
/// handed out again. No block ever starts at the bad free's address meanwhile, the bad free is
/// reported, nothing overlaps, every byte comes back.
#[test]
fn the_owner_carves_the_tail_then_quarantines_then_takes_the_range_back() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small_cfg().build().unwrap()).unwrap();
    let live = Live::default();
    let x = four_blocks(&a);
    for &p in &x {
        live.insert(p, 64 * KIB);
    }
    // W frees an interior pointer of x[1] (its second half) with the size of that half: the
    // size a block carved at that address would have.
    let q = DeviceAddr(x[1].0 + 32 * KIB as u64);
    let w = Worker::new(&a);
    w.run(move |a| a.deallocate(q, 32 * KIB, Stream::PER_THREAD).unwrap());
    tag(&sim, x[1], 64 * KIB, 0x11, Stream::PER_THREAD);
    live.remove(x[1]);
    a.deallocate_per_thread(x[1], 64 * KIB).unwrap();
    // [x1, x1+64K) is the only free range of the superblock.
    let mut got = Vec::new();
    let mut alloc = |size: usize, t: u32| {
        let p = a.allocate_per_thread(size).unwrap();
        live.insert(p, size);
        tag(&sim, p, size, t, Stream::PER_THREAD);
        got.push((p, size, t));
        p
    };
    let p0 = alloc(32 * KIB, 1);
    assert_eq!(p0, x[1], "the front of the range, before the bad free's address");
    // 16 KiB from [q, q+32K): its tail.
    let p1 = alloc(16 * KIB, 2);
    assert_eq!(p1.0, q.0 + 16 * KIB as u64, "the tail of a range whose head a bad free holds");
    // 16 KiB again: [q, q+16K) is exactly the request: quarantined; a new superblock serves it.
    let p2 = alloc(16 * KIB, 3);
    assert!(p2.0 < x[0].0 || p2.0 >= x[3].0 + 64 * KIB as u64, "served from another superblock");
    assert!([p0, p1, p2].iter().all(|&p| p != q), "a block handed out at a bad free's address on its way");
    // The bad free arrives; the owner's flush refuses it and takes the range back.
    w.run(|a| a.flush().unwrap());
    a.flush().unwrap();
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
    assert_eq!(a.stats().invalid_frees, 1);
    // The quarantined range is handed out again (16 KiB blocks: the exact fit first).
    let mut seen = false;
    for i in 0..64 {
        let p = alloc(16 * KIB, 100 + i);
        seen |= p == q;
    }
    assert!(seen, "the quarantined range never came back");
    live.assert_clean();
    for (p, size, t) in got {
        check(&sim, p, size, t, Stream::PER_THREAD);
        live.remove(p);
        a.deallocate_per_thread(p, size).unwrap();
    }
    for p in [x[0], x[2], x[3]] {
        a.deallocate_per_thread(p, 64 * KIB).unwrap();
    }
    drop(w);
    assert_all_returned(&a, Some(&sim), 1);
}

/// Sets up, on the worker `o`, a quarantined range at `x[1] + 32 KiB` (16 KiB: a bad free of
/// W's on its way at its head), with `x[0]`, `x[2]`, `x[3]`, a 32 KiB block at `x[1]` and a
/// 16 KiB block at `x[1] + 48 KiB` live; returns those blocks (address, size).
fn quarantine_on(o: &Worker, w: &Worker) -> (DeviceAddr, Vec<(DeviceAddr, usize)>) {
    let x = o.run(|a| four_blocks(a));
    let q = DeviceAddr(x[1].0 + 32 * KIB as u64);
    w.run(move |a| a.deallocate(q, 16 * KIB, Stream::PER_THREAD).unwrap());
    let v = o.run(move |a| {
        a.deallocate_per_thread(x[1], 64 * KIB).unwrap();
        let p0 = a.allocate_per_thread(32 * KIB).unwrap();
        let p1 = a.allocate_per_thread(16 * KIB).unwrap();
        assert_eq!((p0, p1.0), (x[1], q.0 + 16 * KIB as u64));
        vec![(x[0], 64 * KIB), (x[2], 64 * KIB), (x[3], 64 * KIB), (p0, 32 * KIB), (p1, 16 * KIB)]
    });
    (q, v)
}

/// The owner exits while a bad free of the head of a range it quarantined is on its way: the
/// range goes to the pool with the superblock (dissolved: it holds live blocks), the late bad
/// free is refused by the pool, the live blocks are freed through the pool, and everything
/// comes back. Another thread then allocates over the same addresses: nothing overlaps.
#[test]
fn the_owner_exits_with_a_range_quarantined() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small_cfg().build().unwrap()).unwrap();
    let (o, w) = (Worker::new(&a), Worker::new(&a));
    let (q, blocks) = quarantine_on(&o, &w);
    // The owner also asks for the quarantined size: another superblock serves it.
    let extra = o.run(|a| a.allocate_per_thread(16 * KIB).unwrap());
    assert_ne!(extra, q);
    o.exit();
    let e = a.take_deferred_error();
    assert!(e.is_none(), "nothing refused yet: {e:?}");
    // W exits too: its thread exit sends the bad free, which finds no owner.
    w.exit();
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
    // The old owner's blocks are freed by another thread now (pool blocks).
    let live = Live::default();
    for &(p, size) in &blocks {
        live.insert(p, size);
    }
    let got: Vec<_> = (0..48)
        .map(|i| {
            let size = [16, 32, 48][i % 3] * KIB;
            let p = a.allocate_per_thread(size).unwrap();
            live.insert(p, size);
            (p, size)
        })
        .collect();
    live.assert_clean();
    for (p, size) in blocks.into_iter().chain(got).chain([(extra, 16 * KIB)]) {
        a.deallocate_per_thread(p, size).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 1);
}

/// Out of memory in another thread takes the superblock with the quarantined range from the
/// idle owner (dissolving it); the bad free then arrives at the owner, which no longer holds
/// the superblock, and goes to the pool, which refuses it. The owner carries on: its blocks
/// are pool blocks now, its next allocations come from new superblocks; nothing overlaps and
/// every byte comes back; no out-of-memory error once memory is free again.
#[test]
fn out_of_memory_elsewhere_takes_a_quarantined_range_from_an_idle_owner() {
    let sim = host(20);
    // Two superblocks' worth of memory (chunks of one superblock).
    let cfg = small_cfg().chunk(256 * KIB).max_bytes(512 * KIB).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let (o, w, m) = (Worker::new(&a), Worker::new(&a), Worker::new(&a));
    let (q, blocks) = quarantine_on(&o, &w);
    // O's 16 KiB request needs a second superblock: the cap is reached.
    let extra = o.run(|a| a.allocate_per_thread(16 * KIB).unwrap());
    // M wants a whole superblock's worth in 64 KiB blocks: out of memory, so it takes back the
    // idle O's superblocks (dissolving the one with the quarantined range) and retries.
    let r = m.run(|a| {
        let mut v = Vec::new();
        for _ in 0..4 {
            match a.allocate_per_thread(64 * KIB) {
                Ok(p) => v.push(p),
                Err(Error::OutOfMemory { .. }) => break,
                Err(e) => panic!("{e:?}"),
            }
        }
        v
    });
    let st = a.stats();
    assert!(st.superblocks_dissolved >= 1, "the quarantined superblock was dissolved: {st:?}");
    let live = Live::default();
    for &(p, size) in &blocks {
        live.insert(p, size);
    }
    live.insert(extra, 16 * KIB);
    for &p in &r {
        live.insert(p, 64 * KIB);
    }
    // The bad free arrives at O, which no longer holds its superblock: to the pool, refused.
    w.run(|a| a.flush().unwrap());
    o.run(|a| a.flush().unwrap());
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
    // Everything freed by its holder; then O allocates the cap's worth again.
    o.run(move |a| {
        for (p, size) in blocks.into_iter().chain([(extra, 16 * KIB)]) {
            a.deallocate_per_thread(p, size).unwrap();
        }
    });
    m.run(move |a| {
        for p in r {
            a.deallocate_per_thread(p, 64 * KIB).unwrap();
        }
        a.release_thread().unwrap();
    });
    let again = o.run(|a| {
        let v: cuarena::Result<Vec<_>> = (0..8).map(|_| a.allocate_per_thread(64 * KIB)).collect();
        let v = v.expect("the cap's worth fits once everything is free");
        for &p in &v {
            a.deallocate_per_thread(p, 64 * KIB).unwrap();
        }
        v
    });
    let live2 = Live::default();
    for p in again {
        live2.insert(p, 64 * KIB);
    }
    live.assert_clean();
    live2.assert_clean();
    drop((o, w, m));
    assert_all_returned(&a, Some(&sim), 1);
}

/// A whole-superblock request under a cap, while a bad free holds the head of the one
/// superblock the cap still allows (W's interior free of an earlier large block, parked in
/// W's outbox: W is idle). The arena quarantines that superblock and cannot grow: out of
/// memory although the memory is free (the bad free is on its way, and only its arrival can
/// tell that no block is at that address); the reclaim and retry find the same. That is
/// accepted here (a program that frees pointers it does not own), but it must not last: once
/// the bad free arrives, the same request succeeds, at that very address, and the grow loop
/// never spins (the test would time out).
#[test]
fn a_request_of_a_quarantined_superblocks_size_succeeds_once_the_bad_free_arrives() {
    within(20, || {
        let sim = host(0);
        let cfg = whole_sb_cfg().max_bytes(512 * KIB).batch_blocks(64).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let (t1, w) = (Worker::new(&a), Worker::new(&a));
        // A large block of the cap's size: a large superblock of two slots.
        let big = t1.run(|a| a.allocate_per_thread(512 * KIB).unwrap());
        let q = DeviceAddr(big.0 + 256 * KIB as u64);
        w.run(move |a| a.deallocate(q, 256 * KIB, Stream::PER_THREAD).unwrap());
        t1.run(move |a| a.deallocate_per_thread(big, 512 * KIB).unwrap());
        t1.exit();
        let ta = Worker::new(&a);
        let first = ta.run(|a| a.allocate_per_thread(256 * KIB).unwrap());
        assert_eq!(first, big, "the first slot");
        let r = ta.run(|a| a.allocate_per_thread(256 * KIB));
        let oom = match r {
            Err(Error::OutOfMemory { .. }) => true,
            Ok(p) => {
                assert_ne!(p, q, "a block handed out at a bad free's address on its way");
                ta.run(move |a| a.deallocate_per_thread(p, 256 * KIB).unwrap());
                false
            }
            Err(e) => panic!("{e:?}"),
        };
        eprintln!("out of memory while the bad free was on its way: {oom}");
        w.run(|a| a.flush().unwrap());
        let p = ta.run(|a| a.allocate_per_thread(256 * KIB)).expect("the bad free has arrived");
        assert_eq!(p, q, "the range the bad free held");
        let e = a.take_deferred_error();
        assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
        ta.run(move |a| {
            a.deallocate_per_thread(p, 256 * KIB).unwrap();
            a.deallocate_per_thread(first, 256 * KIB).unwrap();
        });
        drop((ta, w));
        assert_all_returned(&a, Some(&sim), 1);
    });
}
