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
    let x = o.run(four_blocks);
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
    let live = Live::of(&blocks);
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
    let live = Live::of(&blocks);
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

/// Large superblocks: W frees an interior pointer of the owner's 4 MiB block at 1 MiB, with a
/// large size (2 MiB). The owner frees the block, takes 1 MiB from the front of the large
/// superblock (so a free range starts at the bad free's address), then asks twice for 2 MiB:
/// both come from the range's end. After the bad free arrives (refused: the head of a free
/// range), 2 MiB requests may start there again. Nothing overlaps; every byte comes back.
#[test]
fn a_large_block_is_carved_from_the_end_of_a_range_a_bad_large_free_holds() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), Config::builder().batch_blocks(64).build().unwrap()).unwrap();
    let w = Worker::new(&a);
    let live = Live::default();
    let big = a.allocate_per_thread(4 * MIB).unwrap();
    let q = DeviceAddr(big.0 + MIB as u64);
    w.run(move |a| a.deallocate(q, 2 * MIB, Stream::PER_THREAD).unwrap());
    tag(&sim, big, 4 * MIB, 0x42, Stream::PER_THREAD);
    a.deallocate_per_thread(big, 4 * MIB).unwrap();
    let mut got = Vec::new();
    let mut alloc = |size: usize| {
        let p = a.allocate_per_thread(size).unwrap();
        live.insert(p, size);
        tag(&sim, p, size, got.len() as u32, Stream::PER_THREAD);
        got.push((p, size));
        p
    };
    assert_eq!(alloc(MIB), big, "the front of the large superblock");
    let (p1, p2) = (alloc(2 * MIB), alloc(2 * MIB));
    // The large superblock is 16 MiB (four times 4 MiB): its last 2 MiB, then the 2 before.
    assert_eq!((p1.0, p2.0), (big.0 + 14 * MIB as u64, big.0 + 12 * MIB as u64), "carved from the end");
    w.run(|a| a.flush().unwrap());
    a.flush().unwrap();
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
    let more: Vec<_> = (0..4).map(|_| alloc(2 * MIB)).collect();
    assert!(more.contains(&q), "the range is used from its head again once the bad free is refused");
    live.assert_clean();
    for (i, &(p, size)) in got.iter().enumerate() {
        check(&sim, p, size, i as u32, Stream::PER_THREAD);
        a.deallocate_per_thread(p, size).unwrap();
    }
    drop(w);
    assert_all_returned(&a, Some(&sim), 1);
}

/// The legacy stream's arena: W's bad interior free on the legacy stream; the owner's free of
/// the block on the legacy stream is kept back, released by the next slow path, and the
/// carving goes around the bad free (tail, then quarantine). The owner then frees a block of
/// the same superblock on the legacy stream (kept back) and exits: the superblock goes back with
/// a kept-back free and a quarantined range in it. The bad free then reaches the pool, which
/// refuses it. Nothing overlaps, no race, every byte comes back.
#[test]
fn legacy_kept_back_frees_and_a_quarantine_in_one_superblock_at_exit() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small_cfg().build().unwrap()).unwrap();
    let (o, w) = (Worker::new(&a), Worker::new(&a));
    let leg = Stream::LEGACY;
    let sim1 = sim.clone();
    let (q, blocks) = o.run(move |a| {
        let x: Vec<_> = (0..4).map(|_| a.allocate(64 * KIB, leg).unwrap()).collect();
        for (i, &p) in x.iter().enumerate() {
            tag(&sim1, p, 64 * KIB, i as u32, leg);
        }
        (DeviceAddr(x[1].0 + 32 * KIB as u64), x)
    });
    w.run(move |a| a.deallocate(q, 16 * KIB, leg).unwrap());
    let sim1 = sim.clone();
    let kept = o.run(move |a| {
        a.deallocate(blocks[1], 64 * KIB, leg).unwrap();
        let p0 = a.allocate(32 * KIB, leg).unwrap();
        let p1 = a.allocate(16 * KIB, leg).unwrap();
        let p2 = a.allocate(16 * KIB, leg).unwrap();
        assert_eq!((p0, p1.0), (blocks[1], q.0 + 16 * KIB as u64), "front, then the range's tail");
        assert_ne!(p2, q, "a block handed out at a bad free's address on its way");
        for p in [p0, p1, p2] {
            tag(&sim1, p, 16 * KIB, 0x99, leg);
        }
        // A kept-back free in the same superblock, then the owner exits.
        a.deallocate(p0, 32 * KIB, leg).unwrap();
        vec![
            (blocks[0], 64 * KIB),
            (blocks[2], 64 * KIB),
            (blocks[3], 64 * KIB),
            (p1, 16 * KIB),
            (p2, 16 * KIB),
        ]
    });
    o.exit();
    w.exit();
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
    let live = Live::of(&kept);
    // Another thread allocates over the returned ranges on its per-thread stream.
    let got: Vec<_> = (0..32)
        .map(|_| {
            let p = a.allocate_per_thread(16 * KIB).unwrap();
            live.insert(p, 16 * KIB);
            sim.write_tag(p.0, 16 * KIB, 7, Stream::PER_THREAD).unwrap();
            p
        })
        .collect();
    live.assert_clean();
    for p in got {
        a.deallocate_per_thread(p, 16 * KIB).unwrap();
    }
    for (p, size) in kept {
        a.deallocate(p, size, leg).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 1);
}

/// Sizes the race allocates: mostly powers of two from 1 KiB to 64 KiB (so that a block split
/// in halves lands blocks at its middle, where the receivers' bad frees point), some other
/// whole KiBs, some large. All at least 4 granules: no block of 3 granules (768 bytes) is ever
/// handed out, so a free of that size is always invalid.
fn race_size(r: u64) -> usize {
    match r % 16 {
        0..=10 => KIB << ((r >> 8) % 7),
        11..=13 => KIB * (1 + (r >> 8) as usize % 64),
        _ => 64 * KIB + KIB * (1 + (r >> 8) as usize % 1024),
    }
}

/// Many threads race: they allocate on their per-thread and the legacy stream, hand blocks to
/// each other, and every receiver makes bad frees before it frees or returns the block:
/// interior pointers with the size of the block's rest (what a block carved there would
/// have), wrong-size frees of the head, and 768-byte frees (no such block exists) of pointers
/// freed earlier by anyone (merged away, reused, or in trimmed chunks). Threads also flush,
/// trim (taking idle arenas' superblocks, quarantined ranges included) and release their
/// arenas. Every bad free must be refused, exactly once (counted synchronously or later);
/// correct frees may be refused only as a double free (the README's stated limit: a
/// wrong-size free of that block's head on its way), and must succeed once everything is
/// flushed. No overlap, no race, every
/// byte back.
fn race(threads: usize, ops: usize, seed: u64, cap: Option<usize>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Barrier, Mutex};
    let sim = host(20);
    let mut cfg = small().batch_blocks(16);
    if let Some(c) = cap {
        cfg = cfg.max_bytes(c);
    }
    let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
    let live = Arc::new(Live::default());
    // Per thread: blocks sent to it, with the sender and whether to hand them back.
    type Mailbox = Mutex<Vec<(Held, usize, bool)>>;
    let boxes: Arc<Vec<Mailbox>> = Arc::new((0..threads).map(|_| Mutex::new(Vec::new())).collect());
    // Addresses freed earlier (by anyone), for stale frees.
    let stale = Arc::new(Mutex::new(Vec::<u64>::new()));
    let bad = Arc::new(AtomicU64::new(0));
    let limit_refusals = Arc::new(AtomicU64::new(0));
    let ooms = Arc::new(AtomicU64::new(0));
    let bar = Arc::new(Barrier::new(threads));
    let mut hs = Vec::new();
    for t in 0..threads {
        let (a, sim, live, boxes, stale) =
            (a.clone(), sim.clone(), live.clone(), boxes.clone(), stale.clone());
        let (bad, limit_refusals, ooms, bar) =
            (bad.clone(), limit_refusals.clone(), ooms.clone(), bar.clone());
        hs.push(std::thread::spawn(move || {
            let mut x = seed ^ 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t as u64 + 1);
            let mut held: Vec<Held> = Vec::new();
            // Correct frees refused for now (the limit): retried at the end.
            let mut retry: Vec<Held> = Vec::new();
            let mut tagn = (t as u32) << 24;
            // A bad free: any result but acceptance-for-now or an invalid-free refusal fails.
            let bad_free = |p: u64, size: usize, s: Stream| {
                bad.fetch_add(1, Ordering::Relaxed);
                match a.deallocate(DeviceAddr(p), size, s) {
                    Ok(()) => {}
                    Err(Error::InvalidFree { .. }) => {}
                    Err(e) => panic!("bad free {p:#x} {size}: {e:?}"),
                }
            };
            // A correct free: accepted, or refused as a double free while a wrong-size free of
            // the block's head is on its way (then retried at the end, where it must succeed):
            // a receiver's, or a stale 768-byte free of a pointer that is this block's head now.
            let good_free = |h: Held, s: Stream, retry: &mut Vec<Held>| {
                live.remove(h.p);
                match a.deallocate(h.p, h.size, s) {
                    Ok(()) => {
                        stale.lock().unwrap().push(h.p.0);
                        true
                    }
                    Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }) => {
                        limit_refusals.fetch_add(1, Ordering::Relaxed);
                        live.insert(h.p, h.size);
                        retry.push(h);
                        false
                    }
                    Err(e) => panic!("correct free of {:#x} {}: {e:?}", h.p.0, h.size),
                }
            };
            bar.wait();
            for i in 0..ops {
                let r = rng(&mut x);
                let inbox: Vec<_> = std::mem::take(&mut *boxes[t].lock().unwrap());
                for (h, from, back) in inbox {
                    // Legacy work follows every per-thread stream's earlier work.
                    check(&sim, h.p, h.size, h.t, Stream::LEGACY);
                    let g = h.size.div_ceil(256);
                    if from != usize::MAX {
                        let k = 1 + (rng(&mut x) as usize % (g - 1));
                        let s =
                            if rng(&mut x).is_multiple_of(2) { Stream::LEGACY } else { Stream::PER_THREAD };
                        match rng(&mut x) % 6 {
                            // The middle, with half the size: the second of two halves.
                            0 | 1 => bad_free(h.p.0 + 128 * g as u64, 128 * g, s),
                            // The last quarter, with its size.
                            2 => bad_free(h.p.0 + 192 * g as u64, 64 * g, s),
                            // Anywhere inside, with the size of the rest of the block.
                            3 => bad_free(h.p.0 + 256 * k as u64, (g - k) * 256, s),
                            // Anywhere inside, with a size of some other class.
                            4 => bad_free(h.p.0 + 256 * k as u64, 256 * k, s),
                            // The head with a wrong size (768 B: no block has it).
                            _ => bad_free(h.p.0, 768, s),
                        }
                    }
                    if back && from != usize::MAX {
                        // Back to its owner; our bad free is sent first, or stays in our
                        // outbox while the owner frees the block and carves it again.
                        if rng(&mut x).is_multiple_of(2) {
                            let _ = a.flush();
                        }
                        boxes[from].lock().unwrap().push((h, usize::MAX, false));
                    } else if from == usize::MAX {
                        // Our own block, handed back: freed, then its two halves allocated
                        // (where a bad free of its middle may be on its way).
                        if good_free(h, Stream::PER_THREAD, &mut retry) && h.size >= 2 * KIB {
                            for _ in 0..2 {
                                if let Ok(p) = a.allocate_per_thread(h.size / 2) {
                                    let s = Stream::PER_THREAD;
                                    held.push(Held::taken(&sim, &live, p, h.size / 2, s, &mut tagn));
                                }
                            }
                        }
                    } else {
                        let _ = good_free(h, Stream::LEGACY, &mut retry);
                    }
                }
                match r % 32 {
                    0..=12 => {
                        let size = race_size(rng(&mut x));
                        let s = if r & 0x100 == 0 { Stream::LEGACY } else { Stream::PER_THREAD };
                        match a.allocate(size, s) {
                            Ok(p) => held.push(Held::taken(&sim, &live, p, size, s, &mut tagn)),
                            Err(Error::OutOfMemory { .. }) => {
                                ooms.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("allocate {size}: {e:?}"),
                        }
                    }
                    13..=22 if !held.is_empty() => {
                        let h = held.swap_remove((r >> 8) as usize % held.len());
                        check(&sim, h.p, h.size, h.t, h.s);
                        let s = if (r >> 40).is_multiple_of(3) { Stream::PER_THREAD } else { Stream::LEGACY };
                        let _ = good_free(h, s, &mut retry);
                    }
                    23..=27 if !held.is_empty() && threads > 1 => {
                        let h = held.swap_remove((r >> 8) as usize % held.len());
                        let to = (t + 1 + (r >> 20) as usize % (threads - 1)) % threads;
                        boxes[to].lock().unwrap().push((h, t, (r >> 30).is_multiple_of(2)));
                    }
                    28 => {
                        // A stale pointer, freed earlier by anyone, with a size no block has.
                        let p = {
                            let v = stale.lock().unwrap();
                            (!v.is_empty()).then(|| v[(r >> 8) as usize % v.len()])
                        };
                        if let Some(p) = p {
                            let s =
                                if (r >> 50).is_multiple_of(2) { Stream::LEGACY } else { Stream::PER_THREAD };
                            bad_free(p + 256 * ((r >> 20) % 4), 768, s);
                        }
                    }
                    29 => {
                        let _ = a.flush();
                    }
                    30 if i % 4 == 0 => {
                        a.trim(false).unwrap();
                    }
                    31 if i % 8 == 0 => a.release_thread().unwrap(),
                    _ => {}
                }
            }
            // Everything still sent to us is freed; two rounds of flushes take every bad free
            // in (sent in the first, drained in the second), then the refused frees go again.
            bar.wait();
            for (h, _, _) in std::mem::take(&mut *boxes[t].lock().unwrap()) {
                check(&sim, h.p, h.size, h.t, Stream::LEGACY);
                let _ = good_free(h, Stream::LEGACY, &mut retry);
            }
            a.flush().unwrap();
            bar.wait();
            a.flush().unwrap();
            bar.wait();
            for h in retry.drain(..) {
                live.remove(h.p);
                a.deallocate(h.p, h.size, Stream::LEGACY).expect("a refused correct free succeeds later");
            }
            for h in held {
                check(&sim, h.p, h.size, h.t, h.s);
                let _ = good_free(h, Stream::LEGACY, &mut retry);
            }
            assert!(retry.is_empty());
            a.release_thread().unwrap();
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    let st = a.stats();
    let (bad, lim) = (bad.load(Ordering::Relaxed), limit_refusals.load(Ordering::Relaxed));
    eprintln!(
        "seed {seed} cap {cap:?}: bad frees {bad}, correct frees refused for now {lim}, ooms {}, dissolved {}, allocs {}",
        ooms.load(Ordering::Relaxed),
        st.superblocks_dissolved,
        st.allocations
    );
    assert!(bad > 0);
    assert_all_returned(&a, Some(&sim), bad + lim);
}

#[test]
fn race_bad_frees_roomy() {
    within(120, || {
        for seed in 1..=2 {
            race(4, 1500, seed, None);
        }
    });
}

#[test]
fn race_bad_frees_under_a_tight_cap() {
    within(120, || {
        for seed in 11..=12 {
            race(4, 1500, seed, Some(32 * MIB));
        }
    });
}

/// Bad frees of pointers into a range already freed and merged: its head (whose flag says a
/// free was accepted: refused at once) and its middle (a clear flag: accepted for now, on its
/// way). The owner then splits the range in halves: the second half, starting at the bad
/// free's address with the bad free's size, must not be handed out while it is on its way;
/// once it arrives it is refused, and the half is handed out again. Exactly two refusals.
#[test]
fn bad_frees_into_a_freed_and_merged_range() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small_cfg().build().unwrap()).unwrap();
    let x = four_blocks(&a);
    a.deallocate_per_thread(x[1], 64 * KIB).unwrap();
    let q = DeviceAddr(x[1].0 + 32 * KIB as u64);
    let w = Worker::new(&a);
    let (head, mid) = w.run(move |a| {
        (a.deallocate(x[1], 64 * KIB, Stream::PER_THREAD), a.deallocate(q, 32 * KIB, Stream::PER_THREAD))
    });
    assert!(is_double(&head), "the freed block's head: refused at once: {head:?}");
    assert!(mid.is_ok(), "the middle of a free range: on its way, checked by the owner: {mid:?}");
    let live = Live::default();
    let halves: Vec<_> = (0..2).map(|_| a.allocate_per_thread(32 * KIB).unwrap()).collect();
    for &p in &halves {
        live.insert(p, 32 * KIB);
    }
    assert_eq!(halves[0], x[1]);
    assert_ne!(halves[1], q, "a block handed out at a bad free's address on its way");
    w.run(|a| a.flush().unwrap());
    a.flush().unwrap();
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { ptr, .. }) if ptr == q.0), "reported: {e:?}");
    let third = a.allocate_per_thread(32 * KIB).unwrap();
    live.insert(third, 32 * KIB);
    assert_eq!(third, q, "the half, taken back from the quarantine");
    live.assert_clean();
    for p in halves.into_iter().chain([third]) {
        a.deallocate_per_thread(p, 32 * KIB).unwrap();
    }
    for p in [x[0], x[2], x[3]] {
        a.deallocate_per_thread(p, 64 * KIB).unwrap();
    }
    drop(w);
    assert_all_returned(&a, Some(&sim), 2);
}
