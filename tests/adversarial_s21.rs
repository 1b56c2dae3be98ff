//! Adversarial tests of the twenty-first session's work: parked user arenas adopted by their
//! own stream (`Zombies::adopt`, `Slot::new_user_arena`), lean user arenas past four per
//! thread (`Arena::set_lean`, and their large requests sent to the pool), remote frees on a
//! user stream past the sixteen batched ones sent alone (`Outbox::push_user`), and a graph
//! pool's capture free that keeps the fences its block was taken behind.
//!
//! Every test ends with `assert_all_returned` (no live byte, no race, no tag error, no stale
//! handle, every byte back after a blocking trim).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Live, Worker, alloc_with, host, no_violations, on_thread, rng, small};
use cuarena::{Allocator, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

/// 64 KiB: the largest small class of `small()`, four to a 256 KiB superblock, never cached.
const BIG_SMALL: usize = 64 << 10;
/// A normal superblock of `small()`.
const SB: u64 = 256 << 10;

fn overlaps(x: (u64, usize), y: (u64, usize)) -> bool {
    x.0 < y.0 + y.1 as u64 && y.0 < x.0 + x.1 as u64
}

/// Makes the calling thread's user arenas lean: one small block allocated and freed on each
/// of `streams` (more than four of them).
fn touch_all(a: &Allocator, streams: &[Stream]) {
    for &s in streams {
        let p = a.allocate(512, s).unwrap();
        a.deallocate(p, 512, s).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Lean arenas.

/// A lean user arena's large request (over `small_max`) goes to the pool
/// (`Slot::alloc_slow_in`, `lean_large`). Under a cap, with memory idle in an idle thread's
/// arena (blocks freed towards it by another thread, waiting in its inbox), the request must
/// get the out-of-memory reclaim every other request gets (`Allocator::allocate`: "memory idle
/// in this thread's and idle threads' arenas is taken back and the request tried once more").
/// The same request from a thread with one user arena (not lean) succeeds; see
/// `control_a_non_lean_large_request_reclaims_idle_memory`.
///
/// Found: failed on commit 2716dc4 (the lean large request went to the pool with no reclaim:
/// `OutOfMemory { requested: 1 MiB, in_use: 4 MiB, .. }` while 2.5 MiB sat idle in the idle
/// thread's arena); passes with the reclaim added to that path.
#[test]
fn a_lean_arenas_large_request_reclaims_idle_memory_before_out_of_memory() {
    lean_or_not_large_request_under_cap(6);
}

/// The control of the test above: one user arena (not lean), the same memory idle elsewhere.
#[test]
fn control_a_non_lean_large_request_reclaims_idle_memory() {
    lean_or_not_large_request_under_cap(1);
}

fn lean_or_not_large_request_under_cap(streams: usize) {
    let sim = host(0);
    let a = alloc_with(&sim, small().max_bytes(4 << 20));
    // An idle thread whose arena holds 2.5 MiB of superblocks whose every block was freed by
    // another thread: the frees wait in its inbox, which only its own slow path or a reclaim
    // takes in.
    let idle = Worker::new(&a);
    let blocks: Vec<DeviceAddr> =
        idle.run(|a| (0..40).map(|_| a.allocate(BIG_SMALL, Stream::PER_THREAD).unwrap()).collect());
    for p in &blocks {
        a.deallocate(*p, BIG_SMALL, Stream::LEGACY).unwrap();
    }
    a.flush().unwrap();
    let got = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let ss: Vec<Stream> = (0..streams).map(|_| sim.create_stream()).collect();
            let keep: Vec<(DeviceAddr, Stream)> =
                ss.iter().map(|&s| (a.allocate(512, s).unwrap(), s)).collect();
            let s = *ss.last().unwrap();
            let r = a.allocate(1 << 20, s);
            if let Ok(p) = r {
                sim.write_tag(p.0, 1 << 20, 0x21, s).unwrap();
                a.deallocate(p, 1 << 20, s).unwrap();
            }
            for (p, s) in keep {
                a.deallocate(p, 512, s).unwrap();
            }
            a.release_thread().unwrap();
            for s in ss {
                sim.destroy_stream(s).unwrap();
            }
            r.map(|_| ())
        }
    });
    assert!(got.is_ok(), "{streams} user arenas: {got:?}; {:?}", a.stats());
    drop(idle);
    assert_all_returned(&a, Some(&sim), 0);
}

/// "A lean arena strands no empty superblock" (`arena.rs`, "Lean arenas"): an arena "gives back
/// every superblock its own frees empty, within the call that empties it". A thread with six
/// user arenas (lean) fills two superblocks on one stream and frees every block of the second
/// on that stream: the emptied superblock must go back within the last of those frees.
///
/// Found: failed on commit 2716dc4 (the lean rule still had Hoard's `u < (1 - f)·a`: with one
/// full superblock live and one empty, `u = a / 2` and the empty one stayed, held 1.5 MiB
/// before and after the frees); passes with the lean rule "free granules of a superblock or
/// more".
#[test]
fn a_lean_arena_gives_back_the_superblock_its_own_frees_empty() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let (held_before, held_after) = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let ss: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
            touch_all(a, &ss);
            let s = ss[5];
            let v: Vec<DeviceAddr> = (0..8).map(|_| a.allocate(BIG_SMALL, s).unwrap()).collect();
            let sbs: std::collections::BTreeSet<u64> = v.iter().map(|p| p.0 / SB).collect();
            assert_eq!(sbs.len(), 2, "eight 64 KiB blocks fill two superblocks");
            let second = *sbs.iter().next_back().unwrap();
            let before = a.stats().arena_held_bytes;
            for p in v.iter().filter(|p| p.0 / SB == second) {
                a.deallocate(*p, BIG_SMALL, s).unwrap();
            }
            let after = a.stats().arena_held_bytes;
            for p in v.iter().filter(|p| p.0 / SB != second) {
                a.deallocate(*p, BIG_SMALL, s).unwrap();
            }
            a.release_thread().unwrap();
            for s in ss {
                sim.destroy_stream(s).unwrap();
            }
            (before, after)
        }
    });
    assert_eq!(
        held_before - held_after,
        SB,
        "the superblock emptied by the arena's own frees stayed: held {held_before} then {held_after}"
    );
    assert_all_returned(&a, Some(&sim), 0);
}

/// A thread's arena for one stream holds large superblocks (large blocks live) when the
/// thread's fifth user arena makes it lean. Its large requests that fit the superblock's free
/// space are still served there, one that does not goes to the pool; a wrong-size free of the
/// pool's block and a double free of the arena's are refused; once every large block is
/// freed on its stream the empty large superblock goes back within the call, under an event
/// there, and another stream's request that reuses it waits for that work.
#[test]
fn lean_switch_while_large_superblocks_are_held() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let bad = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let ss: Vec<Stream> = (0..5).map(|_| sim.create_stream()).collect();
            let s0 = ss[0];
            let live = Live::default();
            let mut big: Vec<(DeviceAddr, usize)> = Vec::new();
            for i in 0..3u32 {
                let p = a.allocate(1 << 20, s0).unwrap();
                live.insert(p, 1 << 20);
                sim.hold_and_check(p.0, 1 << 20, 0x100 | i, Duration::from_millis(3), s0).unwrap();
                big.push((p, 1 << 20));
            }
            let held_large = a.stats().arena_held_bytes;
            assert!(held_large >= 8 << 20, "a large superblock: {:?}", a.stats());
            touch_all(a, &ss[1..]); // five user arenas: all lean now
            let before = a.stats();
            // Fits the large superblock's free space: served there.
            let p = a.allocate(1 << 20, s0).unwrap();
            live.insert(p, 1 << 20);
            sim.write_tag(p.0, 1 << 20, 0x200, s0).unwrap();
            big.push((p, 1 << 20));
            // Does not: the pool serves it.
            let q = a.allocate(6 << 20, s0).unwrap();
            live.insert(q, 6 << 20);
            sim.write_tag(q.0, 6 << 20, 0x201, s0).unwrap();
            let after = a.stats();
            assert_eq!(after.pool_allocations - before.pool_allocations, 1, "{after:?}");
            assert_eq!(
                after.superblocks_taken, before.superblocks_taken,
                "no large superblock borrowed: {after:?}"
            );
            let mut bad = 0;
            let r = a.deallocate(q, 5 << 20, s0);
            assert!(matches!(r, Err(Error::InvalidFree { .. })), "{r:?}");
            bad += 1;
            live.remove(q);
            a.deallocate(q, 6 << 20, s0).unwrap();
            let (p0, n0) = big[0];
            live.remove(p0);
            a.deallocate(p0, n0, s0).unwrap();
            let r = a.deallocate(p0, n0, s0);
            assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
            bad += 1;
            for &(p, n) in &big[1..] {
                live.remove(p);
                a.deallocate(p, n, s0).unwrap();
            }
            let end = a.stats();
            assert!(
                end.arena_held_bytes + (8 << 20) <= held_large + (4 * SB),
                "the empty large superblock went back: {end:?}"
            );
            // Another stream takes the memory at once: it must wait for s0's running work.
            let r: Vec<DeviceAddr> = (0..3).map(|_| a.allocate(2 << 20, ss[1]).unwrap()).collect();
            for p in &r {
                live.insert(*p, 2 << 20);
                sim.write_tag(p.0, 2 << 20, 0x300, ss[1]).unwrap();
            }
            for p in r {
                live.remove(p);
                a.deallocate(p, 2 << 20, ss[1]).unwrap();
            }
            live.assert_clean();
            a.release_thread().unwrap();
            for s in ss {
                sim.destroy_stream(s).unwrap();
            }
            bad
        }
    });
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), bad);
}

/// Threads each cycling through eight user streams (lean arenas) under a tight cap, small and
/// large requests mixed, some threads releasing (parking) midway: every request succeeds or
/// fails with a clean out-of-memory error, the cap holds, no block is handed out twice or
/// under running work, and everything comes back.
#[test]
fn lean_arenas_under_a_tight_cap() {
    let sim = host(10);
    let cap = 6 << 20;
    let a = alloc_with(&sim, small().max_bytes(cap));
    let live = Live::default();
    let ooms = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for t in 0..3u64 {
            let (a, sim, live, ooms) = (&a, &sim, &live, &ooms);
            sc.spawn(move || {
                let ss: Vec<Stream> = (0..8).map(|_| sim.create_stream()).collect();
                let mut x = 0x5eed_0000_0000_0001u64 ^ (t << 40);
                let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                for i in 0..400u32 {
                    let s = ss[rng(&mut x) as usize % ss.len()];
                    let size = if rng(&mut x) % 10 < 7 {
                        256 + (rng(&mut x) % (64 << 10)) as usize
                    } else {
                        (64 << 10) + 1 + (rng(&mut x) % (1 << 20)) as usize
                    };
                    match a.allocate(size, s) {
                        Ok(p) => {
                            live.insert(p, size);
                            let tag = ((t as u32) << 24) | i;
                            sim.hold_and_check(p.0, size.min(4096), tag, Duration::from_micros(30), s)
                                .unwrap();
                            held.push((p, size, s));
                        }
                        Err(Error::OutOfMemory { .. }) => {
                            ooms.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("not a clean out-of-memory: {e}"),
                    }
                    while held.len() > 5 || (!held.is_empty() && rng(&mut x).is_multiple_of(3)) {
                        let (p, n, s) = held.swap_remove(rng(&mut x) as usize % held.len());
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    assert!(sim.reserved_bytes() <= cap);
                    if i % 50 == 49 && t == 1 {
                        a.release_thread().unwrap();
                    }
                }
                for (p, n, s) in held {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                a.release_thread().unwrap();
                for s in ss {
                    sim.destroy_stream(s).unwrap();
                }
            });
        }
    });
    live.assert_clean();
    eprintln!("out-of-memory errors: {}; {:?}", ooms.load(Ordering::Relaxed), a.stats());
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// Adoption.

/// A thread whose table is full (sixteen user arenas) allocates on the stream whose arena it
/// replaced a moment ago (parked with live blocks): it adopts that arena while the
/// replacement parks another. Its own blocks there are its own again: the one it freed while
/// the arena was parked (a remote free, waiting in its outbox) is refused as a double free,
/// a wrong size is refused at once, the rest free on the fast path; reuse on the same stream
/// needs no wait, and no stream gets another's memory early. No device synchronise.
#[test]
fn adoption_by_a_thread_whose_table_is_full() {
    let n = cuarena::MAX_USER_ARENAS + 1;
    let sim = host(10);
    let a = alloc_with(&sim, small());
    let ss: Vec<Stream> = (0..n).map(|_| sim.create_stream()).collect();
    let bad = on_thread(&a, {
        let (sim, ss) = (sim.clone(), ss.clone());
        move |a| {
            let live = Live::default();
            let mut kept: Vec<Vec<DeviceAddr>> = Vec::new();
            let mut freed0: Vec<DeviceAddr> = Vec::new();
            for (i, &s) in ss.iter().enumerate() {
                let v: Vec<DeviceAddr> = (0..4).map(|_| a.allocate(4096, s).unwrap()).collect();
                for (k, p) in v.iter().enumerate() {
                    live.insert(*p, 4096);
                    let tag = ((i as u32) << 8) | k as u32;
                    sim.hold_and_check(p.0, 4096, tag, Duration::from_millis(2), s).unwrap();
                }
                for p in &v[2..] {
                    live.remove(*p);
                    a.deallocate(*p, 4096, s).unwrap();
                }
                if i == 0 {
                    freed0 = v[2..].to_vec();
                }
                kept.push(v[..2].to_vec());
            }
            // The seventeenth stream replaced the first stream's arena: parked, holding memory.
            let parked = a.parked_bytes();
            assert!(parked > 0, "the replaced arena holds live blocks: parked");
            let st = a.stats();
            assert_eq!(st.arenas, cuarena::MAX_USER_ARENAS as u64, "{st:?}");
            // A free of a parked arena's block on its stream: a remote free now.
            let (s0, b0, b1) = (ss[0], kept[0][0], kept[0][1]);
            live.remove(b0);
            a.deallocate(b0, 4096, s0).unwrap();
            // Adopted by the next allocation on s0, while the second stream's arena is parked.
            let fresh: Vec<DeviceAddr> = (0..6).map(|_| a.allocate(4096, s0).unwrap()).collect();
            for p in &fresh {
                live.insert(*p, 4096);
                sim.write_tag(p.0, 4096, 0xa0a0, s0).unwrap(); // ordered after s0's earlier work
            }
            assert!(fresh.iter().any(|p| freed0.contains(p)), "s0's arena was adopted, with its frees");
            let st = a.stats();
            assert_eq!(st.arenas, cuarena::MAX_USER_ARENAS as u64, "{st:?}");
            assert!(a.parked_bytes() > 0, "the second stream's arena is parked now");
            let mut bad = 0;
            // b0's free is on its way: a second free is refused, whoever owns the arena now.
            let r = a.deallocate(b0, 4096, s0);
            assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
            bad += 1;
            let r = a.deallocate(b1, 8192, s0);
            assert!(
                matches!(r, Err(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. })),
                "{r:?}"
            );
            bad += 1;
            live.remove(b1);
            let fences = a.stats().fences_recorded;
            a.deallocate(b1, 4096, s0).unwrap();
            // The owner's free on the arena's handle: taken locally, no event of its own.
            assert_eq!(
                a.stats().cross_thread_frees,
                1,
                "only b0's free went the remote way: {:?}",
                a.stats()
            );
            assert!(a.stats().fences_recorded <= fences + 1, "{:?}", a.stats());
            // Every other stream takes memory at once: none of it may be s0's or s1's parked
            // memory under their running work.
            for (i, &s) in ss.iter().enumerate().skip(1) {
                let p = a.allocate(4096, s).unwrap();
                live.insert(p, 4096);
                sim.write_tag(p.0, 4096, 0xb000 | i as u32, s).unwrap();
                live.remove(p);
                a.deallocate(p, 4096, s).unwrap();
            }
            for p in fresh {
                live.remove(p);
                a.deallocate(p, 4096, s0).unwrap();
            }
            for (i, v) in kept.iter().enumerate().skip(1) {
                for p in v {
                    live.remove(*p);
                    a.deallocate(*p, 4096, ss[i]).unwrap();
                }
            }
            live.assert_clean();
            assert_eq!(a.stats().host_syncs, 0, "{:?}", a.stats());
            a.release_thread().unwrap();
            bad
        }
    });
    no_violations(&sim);
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), bad);
}

/// Blocks of a thread's user arena still live when the thread exits (the arena is parked
/// holding them), freed by another thread on that stream: its frees go in batches, under
/// events on the stream, to the parked arena's inbox. A third thread's allocation on the
/// stream adopts the arena and takes them in; the blocks are handed out again only after
/// their frees (same stream: no wait), never twice; the remaining live blocks are freed by
/// the adopter on the fast path. No device synchronise.
#[test]
fn remote_frees_towards_a_parked_arena_drain_when_it_is_adopted() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let s = sim.create_stream();
    let blocks: Vec<DeviceAddr> = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let v: Vec<DeviceAddr> = (0..12).map(|_| a.allocate(8192, s).unwrap()).collect();
            for (i, p) in v.iter().enumerate() {
                sim.hold_and_check(p.0, 8192, 0x500 | i as u32, Duration::from_millis(2), s).unwrap();
            }
            v
        }
    });
    let parked = a.parked_bytes();
    assert!(parked > 0);
    // Another thread frees eight of them on s: two batches of four, each sent under an event
    // on s into the parked arena's inbox.
    let fences = a.stats().fences_recorded;
    on_thread(&a, {
        let v = blocks[..8].to_vec();
        move |a| {
            for p in v {
                a.deallocate(p, 8192, s).unwrap();
            }
        }
    });
    assert_eq!(a.stats().fences_recorded - fences, 2, "{:?}", a.stats());
    assert_eq!(a.parked_free_bytes(), 0, "nothing parked: both batches were sent");
    let rest = blocks[8..].to_vec();
    let freed = blocks[..8].to_vec();
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let live = Live::of(&rest.iter().map(|p| (*p, 8192)).collect::<Vec<_>>());
            let got: Vec<DeviceAddr> = (0..16).map(|_| a.allocate(8192, s).unwrap()).collect();
            assert_eq!(a.parked_bytes(), 0, "the arena was adopted");
            for p in &got {
                live.insert(*p, 8192);
                sim.write_tag(p.0, 8192, 0x600, s).unwrap();
            }
            assert!(got.iter().any(|p| freed.contains(p)), "the adopted arena took in the remote frees");
            live.assert_clean();
            for p in rest {
                a.deallocate(p, 8192, s).unwrap(); // the adopter's own now: the fast path
            }
            for p in got {
                a.deallocate(p, 8192, s).unwrap();
            }
        }
    });
    assert_eq!(a.stats().host_syncs, 0, "{:?}", a.stats());
    no_violations(&sim);
    sim.destroy_stream(s).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Bad frees of a parked arena's blocks, made by another thread on its stream before and
/// after the arena is adopted: a double free refused at once, a wrong-size free accepted and
/// then refused when the batch it went in reaches the arena (a flush takes in a parked arena's
/// inbox), an interior pointer refused; each counted once, the blocks freed properly after,
/// and nothing lost.
#[test]
fn bad_frees_of_a_parked_arenas_blocks_around_adoption() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(2));
    let s = sim.create_stream();
    let b: Vec<DeviceAddr> = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let v: Vec<DeviceAddr> = (0..6).map(|_| a.allocate(4096, s).unwrap()).collect();
            for p in &v {
                sim.write_tag(p.0, 4096, 0x77, s).unwrap();
            }
            v
        }
    });
    assert!(a.parked_bytes() > 0);
    let bad = on_thread(&a, {
        let b = b.clone();
        move |a| {
            let mut bad = 0u64;
            let is = |r: &cuarena::Result<()>, what: fn(&InvalidFree) -> bool| matches!(r, Err(Error::InvalidFree { reason, .. }) if what(reason));
            a.deallocate(b[0], 4096, s).unwrap();
            let r = a.deallocate(b[0], 4096, s);
            assert!(is(&r, |r| matches!(r, InvalidFree::DoubleFree)), "{r:?}");
            bad += 1;
            // Wrong size: taken (the owner checks it), sent with b[0]'s free (two in a batch).
            let r = a.deallocate(b[1], 8192, s);
            match r {
                Ok(()) => {}
                Err(Error::InvalidFree { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            bad += 1;
            assert_eq!(a.parked_free_bytes(), 0, "the batch was sent, not parked");
            // The parked arena's inbox is taken in by a flush: the wrong size is refused there.
            a.flush().unwrap();
            let st = a.stats();
            assert_eq!(st.invalid_frees, bad, "{st:?}");
            let e = a.take_deferred_error();
            assert!(
                matches!(e, Some(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. }))
                    || r.is_err(),
                "{e:?}"
            );
            // An interior pointer of a live block, sent in a batch with b[3]'s (valid) free.
            let r = a.deallocate(DeviceAddr(b[2].0 + 1024), 1024, s);
            if r.is_err() {
                assert!(is(&r, |_| true), "{r:?}");
            }
            bad += 1;
            a.deallocate(b[3], 4096, s).unwrap();
            assert_eq!(a.parked_free_bytes(), 0, "the batch was sent, not parked");
            a.flush().unwrap();
            let _ = a.take_deferred_error();
            assert_eq!(a.stats().invalid_frees, bad, "{:?}", a.stats());
            bad
        }
    });
    // A thread adopts the arena, frees the rest properly, and tries two double frees.
    let bad = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let mut bad = bad;
            let p = a.allocate(4096, s).unwrap(); // adopts
            sim.write_tag(p.0, 4096, 0x78, s).unwrap();
            assert_eq!(a.parked_bytes(), 0, "adopted");
            for &q in [1, 2, 4, 5].iter().map(|&i| &b[i]) {
                a.deallocate(q, 4096, s).unwrap();
            }
            for &q in &b[1..3] {
                let r = a.deallocate(q, 4096, s);
                assert!(
                    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })),
                    "{r:?}"
                );
                bad += 1;
            }
            a.deallocate(p, 4096, s).unwrap();
            bad
        }
    });
    assert_eq!(a.stats().invalid_frees, bad);
    let _ = a.take_deferred_error();
    no_violations(&sim);
    sim.destroy_stream(s).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

/// Over and over, a thread uses a stream (work held back behind a gate), frees its blocks
/// there and exits (its arena parked), the stream is destroyed and the next stream created
/// gets its handle; a thread on the new stream (cycling through five streams, so lean) must
/// adopt nothing and get none of the dead stream's blocks. Parked arenas pile up until
/// `trim(true)`.
#[test]
fn a_reused_handle_never_adopts_the_dead_streams_arena() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let others: Vec<Stream> = (0..4).map(|_| sim.create_stream()).collect();
    let mut gates = Vec::new();
    for round in 0..12u32 {
        let t = sim.create_stream();
        gates.push(sim.gate(t).unwrap());
        let dead: Vec<(u64, usize)> = on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let v: Vec<(u64, usize)> =
                    (0..6).map(|k| (a.allocate(1024 << k, t).unwrap().0, 1024usize << k)).collect();
                for &(p, n) in &v {
                    sim.hold_and_check(p, n, round | 1, Duration::from_micros(100), t).unwrap();
                    a.deallocate(DeviceAddr(p), n, t).unwrap();
                }
                v
            }
        });
        sim.destroy_stream(t).unwrap();
        let u = sim.create_stream();
        assert_eq!(u, t, "the handle is reused");
        let (got, parked, still) = on_thread(&a, {
            let (sim, others) = (sim.clone(), others.clone());
            move |a| {
                // (These may adopt the arenas the previous round's thread parked for them.)
                touch_all(a, &others);
                let parked = a.parked_bytes();
                let v: Vec<(u64, usize)> =
                    (0..6).map(|k| (a.allocate(1024 << k, u).unwrap().0, 1024usize << k)).collect();
                for &(p, n) in &v {
                    sim.write_tag(p, n, 0xf00 | round, u).unwrap();
                }
                let still = a.parked_bytes();
                for &(p, n) in &v {
                    a.deallocate(DeviceAddr(p), n, u).unwrap();
                }
                (v, parked, still)
            }
        });
        assert_eq!(still, parked, "round {round}: the new stream adopted a dead stream's arena");
        assert!(
            !got.iter().any(|&x| dead.iter().any(|&y| overlaps(x, y))),
            "round {round}: the dead stream's memory reached the new stream"
        );
        sim.destroy_stream(u).unwrap();
    }
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    for g in gates {
        g.open();
    }
    for s in others {
        sim.destroy_stream(s).unwrap();
    }
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Threads that come and go on a shared set of streams: each allocates on them, hands half its
/// blocks to the others (freed on the stream they were used on, by another thread), frees the
/// rest, and releases itself now and then (parking its arenas, which the next allocation on
/// each stream adopts, by whichever thread). Meanwhile another thread keeps flushing (which
/// takes in parked arenas' inboxes) and trimming without blocking (which takes idle arenas'
/// claims). No overlap, no race, no device synchronise, and the parked bytes stay small.
#[test]
fn thread_exits_racing_adoption_on_shared_streams() {
    let sim = host(5);
    let a = alloc_with(&sim, small());
    let streams: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
    let live = Live::default();
    let handoff: Mutex<Vec<(DeviceAddr, usize, Stream)>> = Mutex::new(Vec::new());
    let max_parked = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let (a_, stop_) = (&a, &stop);
        sc.spawn(move || {
            while !stop_.load(Ordering::Relaxed) {
                a_.flush().unwrap();
                a_.trim(false).unwrap();
                std::thread::sleep(Duration::from_micros(200));
            }
            a_.release_thread().unwrap();
        });
        let mut workers = Vec::new();
        for t in 0..4u64 {
            let (a, sim, streams, live, handoff, max_parked) =
                (&a, &sim, &streams, &live, &handoff, &max_parked);
            workers.push(sc.spawn(move || {
                let mut x = 0xfeed_0000_0000_0001u64 ^ (t << 32);
                for i in 0..400u32 {
                    let s = streams[rng(&mut x) as usize % streams.len()];
                    let k = 1 + rng(&mut x) as usize % 6;
                    let mut mine = Vec::new();
                    for j in 0..k {
                        let n = 256 * (1 + rng(&mut x) as usize % 128);
                        let p = a.allocate(n, s).unwrap();
                        live.insert(p, n);
                        let tag = ((t as u32) << 28) | (i << 8) | j as u32;
                        sim.hold_and_check(p.0, n.min(2048), tag, Duration::from_micros(20), s).unwrap();
                        mine.push((p, n, s));
                    }
                    for (j, b) in mine.into_iter().enumerate() {
                        if j % 2 == 0 {
                            handoff.lock().unwrap().push(b);
                        } else {
                            live.remove(b.0);
                            a.deallocate(b.0, b.1, b.2).unwrap();
                        }
                    }
                    for _ in 0..3 {
                        let Some((p, n, s)) = handoff.lock().unwrap().pop() else { break };
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    if rng(&mut x).is_multiple_of(8) {
                        a.release_thread().unwrap();
                        max_parked.fetch_max(a.parked_bytes() as u64, Ordering::Relaxed);
                    }
                }
                a.release_thread().unwrap();
            }));
        }
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    for (p, n, s) in handoff.into_inner().unwrap() {
        live.remove(p);
        a.deallocate(p, n, s).unwrap();
    }
    live.assert_clean();
    let st = a.stats();
    eprintln!("max parked {} KiB; {st:?}", max_parked.load(Ordering::Relaxed) >> 10);
    assert_eq!(st.host_syncs, 0, "parked arenas were adopted, not buried: {st:?}");
    no_violations(&sim);
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Parked arenas adopted while reclaimers work on them: a thread that keeps trimming with
/// `trim(true)` (burying parked arenas after a synchronise, taking idle arenas' memory) and a
/// thread that keeps running into out-of-memory under the cap (the reclaim that dissolves),
/// against threads that park and adopt arenas on three shared streams. Every request succeeds
/// or fails cleanly with out-of-memory, no block is handed out twice or under running work.
#[test]
fn adoption_races_reclaimers() {
    let sim = host(5);
    let cap = 24 << 20;
    let a = alloc_with(&sim, small().max_bytes(cap));
    let streams: Vec<Stream> = (0..3).map(|_| sim.create_stream()).collect();
    let live = Live::default();
    let stop = AtomicBool::new(false);
    let ooms = AtomicU64::new(0);
    std::thread::scope(|sc| {
        let (a_, stop_) = (&a, &stop);
        sc.spawn(move || {
            while !stop_.load(Ordering::Relaxed) {
                a_.trim(true).unwrap();
                std::thread::sleep(Duration::from_micros(300));
            }
            a_.release_thread().unwrap();
        });
        let (a_, sim_, live_, stop_, ooms_) = (&a, &sim, &live, &stop, &ooms);
        sc.spawn(move || {
            let mut round = 0u32;
            while !stop_.load(Ordering::Relaxed) {
                let mut v = Vec::new();
                loop {
                    match a_.allocate(2 << 20, Stream::PER_THREAD) {
                        Ok(p) => {
                            live_.insert(p, 2 << 20);
                            sim_.write_tag(p.0, 4096, round, Stream::PER_THREAD).unwrap();
                            v.push(p);
                        }
                        Err(Error::OutOfMemory { .. }) => {
                            ooms_.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                    if v.len() >= 16 {
                        break;
                    }
                }
                for p in v {
                    live_.remove(p);
                    a_.deallocate(p, 2 << 20, Stream::PER_THREAD).unwrap();
                }
                round += 1;
                // The simulator's synchronise waits for every stream to be idle at once: a
                // thread that never pauses its submissions would starve the others' (a real
                // device synchronise waits only for work queued before it).
                std::thread::sleep(Duration::from_millis(1));
            }
            a_.release_thread().unwrap();
        });
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let (a, sim, streams, live, ooms) = (&a, &sim, &streams, &live, &ooms);
                sc.spawn(move || {
                    let mut x = 0xabcd_0000_0000_0001u64 ^ (t << 36);
                    let mut carried: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                    for round in 0..300u32 {
                        let s = streams[(t as usize + round as usize) % streams.len()];
                        let mut v = Vec::new();
                        for j in 0..4u32 {
                            let n = 512 * (1 + rng(&mut x) as usize % 100);
                            match a.allocate(n, s) {
                                Ok(p) => {
                                    live.insert(p, n);
                                    let tag = ((t as u32) << 28) | (round << 4) | j;
                                    sim.hold_and_check(p.0, n.min(1024), tag, Duration::from_micros(50), s)
                                        .unwrap();
                                    v.push((p, n, s));
                                }
                                Err(Error::OutOfMemory { .. }) => {
                                    ooms.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => panic!("{e}"),
                            }
                        }
                        // One block lives on across the release: freed by this thread after
                        // its arena was parked (and maybe adopted by another, or buried).
                        if let Some(b) = v.pop() {
                            carried.push(b);
                        }
                        for (p, n, s) in v {
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        }
                        if round % 3 == 2 {
                            a.release_thread().unwrap();
                            for (p, n, s) in carried.drain(..) {
                                live.remove(p);
                                a.deallocate(p, n, s).unwrap();
                            }
                        }
                    }
                    for (p, n, s) in carried {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    live.assert_clean();
    eprintln!("out-of-memory errors: {}; {:?}", ooms.load(Ordering::Relaxed), a.stats());
    no_violations(&sim);
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Statistics through parking and adoption: a parked arena counts in no thread's arenas but
/// its bytes stay in `arena_held_bytes` (as `parked_bytes`); an adopted one counts again, in
/// its adopter's, and its bytes leave the parked count; the pool's invariants hold throughout.
#[test]
fn statistics_follow_parking_and_adoption() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let ss: Vec<Stream> = (0..3).map(|_| sim.create_stream()).collect();
    let keep: Vec<(DeviceAddr, Stream)> = on_thread(&a, {
        let ss = ss.clone();
        move |a| ss.iter().map(|&s| (a.allocate(20_000, s).unwrap(), s)).collect()
    });
    let st = a.stats();
    let parked = a.parked_bytes() as u64;
    assert_eq!((st.arenas, st.arena_held_bytes), (0, parked), "{st:?}");
    assert_eq!(parked, 3 * SB, "three arenas of one superblock each, parked: {st:?}");
    a.check_invariants();
    let adopter = Worker::new(&a);
    let (s0, s1) = (ss[0], ss[1]);
    let mine = adopter.run(move |a| {
        let p = a.allocate(20_000, s0).unwrap();
        let q = a.allocate(20_000, s1).unwrap();
        (p, q)
    });
    let st = a.stats();
    let now = a.parked_bytes() as u64;
    assert_eq!(st.arenas, 2, "both adopted arenas count again: {st:?}");
    assert_eq!(now, SB, "one arena still parked: {st:?}");
    assert_eq!(st.arena_held_bytes, now + 2 * SB, "adopted arenas grew nothing: {st:?}");
    assert_eq!(st.live_bytes, 5 * 20_480, "{st:?}");
    a.check_invariants();
    // The adopter frees its blocks and the parked arena's live blocks on their streams.
    adopter.run(move |a| {
        a.deallocate(mine.0, 20_000, s0).unwrap();
        a.deallocate(mine.1, 20_000, s1).unwrap();
        for (p, s) in keep {
            a.deallocate(p, 20_000, s).unwrap();
        }
        a.flush().unwrap();
    });
    adopter.exit();
    let st = a.stats();
    assert_eq!(st.live_bytes, 0, "{st:?}");
    assert_eq!(st.allocations, st.deallocations, "{st:?}");
    assert_eq!(st.arenas, 0, "{st:?}");
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// Frees sent alone past the sixteen batched streams.

/// The owner allocates `n` blocks of 4 KiB on its per-thread stream and tags them there;
/// returns them with an event after the tags.
fn owned(owner: &Worker, sim: &HostDevice, n: usize) -> (Vec<DeviceAddr>, cuarena::Event) {
    use cuarena::Device;
    let sim = sim.clone();
    owner.run(move |a| {
        let v: Vec<DeviceAddr> = (0..n)
            .map(|_| {
                let p = a.allocate(4096, Stream::PER_THREAD).unwrap();
                sim.write_tag(p.0, 4096, 0x5a, Stream::PER_THREAD).unwrap();
                p
            })
            .collect();
        let e = sim.create_event().unwrap();
        sim.record_event(e, Stream::PER_THREAD).unwrap();
        (v, e)
    })
}

/// The owner allocates every block it can get back at once and overwrites it on its
/// per-thread stream (a reuse before a block's fence is a race the checker reports).
fn owner_reuses(owner: &Worker, sim: &HostDevice, n: usize) {
    let sim = sim.clone();
    owner.run(move |a| {
        a.flush().unwrap();
        let v: Vec<DeviceAddr> = (0..n).map(|_| a.allocate(4096, Stream::PER_THREAD).unwrap()).collect();
        for p in &v {
            sim.write_tag(p.0, 4096, 0xdead, Stream::PER_THREAD).unwrap();
        }
        for p in v {
            a.deallocate(p, 4096, Stream::PER_THREAD).unwrap();
        }
    });
}

/// With sixteen streams' batches held, a free on a seventeenth stream that is being captured
/// is refused before it is taken (the free that would go alone): no event recorded on the
/// capturing stream, no batch evicted or parked, nothing counted; refused again, not as a
/// double free, while the capture lasts; after it, taken and sent alone, and a second free is
/// a double free. The owner's reuse waits for the stream's work.
#[test]
fn a_free_past_the_batched_streams_on_a_capturing_stream_is_refused_and_changes_nothing() {
    use cuarena::Device;
    let n = cuarena::MAX_USER_BATCHES + 1;
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned(&owner, &sim, n);
    let ss: Vec<Stream> = (0..n).map(|_| sim.create_stream()).collect();
    for (p, &s) in blocks.iter().zip(&ss).take(n - 1) {
        sim.stream_wait_event(s, ready).unwrap();
        sim.hold_and_check(p.0, 4096, 0x5a, Duration::from_millis(2), s).unwrap();
        a.deallocate(*p, 4096, s).unwrap();
    }
    let last = ss[n - 1];
    let x = blocks[n - 1];
    sim.stream_wait_event(last, ready).unwrap();
    let gate = sim.gate(last).unwrap();
    sim.hold_and_check(x.0, 4096, 0x5a, Duration::from_millis(1), last).unwrap();
    let before = a.stats();
    sim.begin_capture(last).unwrap();
    for _ in 0..2 {
        let r = a.deallocate(x, 4096, last);
        assert!(matches!(r, Err(Error::StreamCapturing { .. })), "{r:?}");
    }
    let during = a.stats();
    assert_eq!(
        (during.deallocations, during.invalid_frees, during.fences_recorded, during.cross_thread_frees),
        (before.deallocations, before.invalid_frees, before.fences_recorded, before.cross_thread_frees),
        "a refused free changed something: {during:?}"
    );
    assert_eq!(a.parked_free_bytes(), 0, "no batch was parked");
    sim.end_capture(last).unwrap();
    assert!(sim.violations().is_empty(), "an event on a capturing stream: {:?}", sim.violations());
    a.deallocate(x, 4096, last).unwrap();
    let after = a.stats();
    assert_eq!(after.fences_recorded - before.fences_recorded, 1, "sent alone under one event: {after:?}");
    let r = a.deallocate(x, 4096, last);
    assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
    // The owner takes it in and reuses what it can while `last`'s work is held back.
    owner_reuses(&owner, &sim, 2 * n);
    assert!(sim.violations().is_empty(), "reused under held work: {:?}", sim.violations());
    gate.open();
    a.flush().unwrap(); // the sixteen batches parked
    a.trim(true).unwrap();
    owner_reuses(&owner, &sim, 2 * n);
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    drop(owner);
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 1);
}

/// With sixteen streams' batches held, the free that goes alone on a seventeenth stream finds
/// that no event can be recorded there (a driver error): it is not lost and not sent unfenced
/// but parked until a device synchronise, the error kept for `take_deferred_error`; the owner
/// never gets the block under the stream's running work.
#[test]
fn a_free_sent_alone_whose_event_fails_is_parked_not_lost() {
    use cuarena::Device;
    use cuarena_testkit::{HookedDevice, Hooks};
    let n = cuarena::MAX_USER_BATCHES + 1;
    let sim = host(0);
    let fail_on = Arc::new(AtomicU64::new(0));
    let hooks = Hooks {
        record_event: Some(Box::new({
            let fail_on = fail_on.clone();
            move |sim: &HostDevice, e, s: Stream| {
                if s.as_raw() as u64 == fail_on.load(Ordering::Relaxed) {
                    return Err(Error::Driver { call: "cuEventRecord", code: 999 });
                }
                sim.record_event(e, s)
            }
        })),
        ..Hooks::default()
    };
    let a = Allocator::new(HookedDevice::new(sim.clone(), hooks), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let (blocks, ready) = owned(&owner, &sim, n);
    let ss: Vec<Stream> = (0..n).map(|_| sim.create_stream()).collect();
    for (p, &s) in blocks.iter().zip(&ss).take(n - 1) {
        sim.stream_wait_event(s, ready).unwrap();
        a.deallocate(*p, 4096, s).unwrap();
    }
    let last = ss[n - 1];
    let x = blocks[n - 1];
    sim.stream_wait_event(last, ready).unwrap();
    let gate = sim.gate(last).unwrap();
    sim.hold_and_check(x.0, 4096, 0x5a, Duration::from_millis(1), last).unwrap();
    fail_on.store(last.as_raw() as u64, Ordering::Relaxed);
    let r = a.deallocate(x, 4096, last);
    fail_on.store(0, Ordering::Relaxed);
    let bad = u64::from(r.is_ok());
    match r {
        Ok(()) => {
            assert_eq!(a.parked_free_bytes(), 4096, "the free is parked, not lost");
            let e = a.take_deferred_error();
            assert!(matches!(e, Some(Error::Driver { .. })), "the error is kept: {e:?}");
            let r = a.deallocate(x, 4096, last);
            assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
        }
        Err(e) => {
            // Refused: then nothing may have changed, and the free is made again.
            assert!(matches!(e, Error::Driver { .. }), "{e}");
            assert_eq!(a.parked_free_bytes(), 0);
            a.deallocate(x, 4096, last).unwrap();
        }
    }
    owner_reuses(&owner, &sim, 2 * n);
    assert!(sim.violations().is_empty(), "reused under held work: {:?}", sim.violations());
    gate.open();
    a.flush().unwrap();
    a.trim(true).unwrap();
    assert_eq!(a.parked_free_bytes(), 0);
    owner_reuses(&owner, &sim, 2 * n);
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    drop(owner);
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), bad);
}

// ---------------------------------------------------------------------------------------------
// Many threads, many streams.

/// Four threads on a shared pool of twenty user streams (more than a thread batches for, and
/// lean), in three phases; between phases a quarter of the streams are destroyed and new
/// ones made on their handles. In a phase each thread allocates on random streams, hands
/// blocks to the others, and frees what it is handed on the stream the block was last used on
/// or on another one (`deallocate_used_on`, which orders the first before the second), and
/// releases itself now and then. No overlap, no race, no stale handle, everything back.
#[test]
fn many_threads_many_streams_with_stream_turnover() {
    let sim = host(5);
    let a = alloc_with(&sim, small());
    let mut streams: Vec<Stream> = (0..20).map(|_| sim.create_stream()).collect();
    let live = Live::default();
    for phase in 0..3u64 {
        let handoff: Mutex<Vec<(DeviceAddr, usize, Stream)>> = Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for t in 0..4u64 {
                let (a, sim, streams, live, handoff) = (&a, &sim, &streams, &live, &handoff);
                sc.spawn(move || {
                    let mut x = 0x1234_5678_9abc_def1u64 ^ (t << 20) ^ (phase << 40);
                    for i in 0..400u32 {
                        let s = streams[rng(&mut x) as usize % streams.len()];
                        let n = match rng(&mut x) % 10 {
                            0 => (64 << 10) + 256 * (1 + rng(&mut x) as usize % 1024),
                            _ => 256 * (1 + rng(&mut x) as usize % 200),
                        };
                        let p = a.allocate(n, s).unwrap();
                        live.insert(p, n);
                        let tag = ((t as u32) << 28) | ((phase as u32) << 24) | i;
                        sim.hold_and_check(p.0, n.min(2048), tag, Duration::from_micros(10), s).unwrap();
                        if rng(&mut x).is_multiple_of(2) {
                            handoff.lock().unwrap().push((p, n, s));
                        } else {
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        }
                        let got = {
                            let mut h = handoff.lock().unwrap();
                            let k = rng(&mut x) as usize % (h.len() + 1);
                            if k < h.len() { Some(h.swap_remove(k)) } else { None }
                        };
                        if let Some((p, n, used)) = got {
                            live.remove(p);
                            if rng(&mut x).is_multiple_of(3) {
                                let on = streams[rng(&mut x) as usize % streams.len()];
                                a.deallocate_used_on(p, n, on, &[used]).unwrap();
                            } else {
                                a.deallocate(p, n, used).unwrap();
                            }
                        }
                        if rng(&mut x).is_multiple_of(40) {
                            a.release_thread().unwrap();
                        }
                    }
                    a.release_thread().unwrap();
                });
            }
        });
        for (p, n, s) in handoff.into_inner().unwrap() {
            live.remove(p);
            a.deallocate(p, n, s).unwrap();
        }
        a.release_thread().unwrap();
        // Turnover: five streams destroyed, five made (on their handles).
        for k in 0..5 {
            let i = (phase as usize * 7 + k * 3) % streams.len();
            sim.destroy_stream(streams[i]).unwrap();
            streams[i] = sim.create_stream();
        }
        assert!(sim.violations().is_empty(), "phase {phase}: {:?}", &sim.violations()[..1]);
    }
    live.assert_clean();
    eprintln!("{:?}; parked {} KiB", a.stats(), a.parked_bytes() >> 10);
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// Graph pools: a capture's free keeps the fences its block was taken behind.

/// A pool's segment full with `[x 8 KiB][y 8 KiB][rest]`, x used on s1 behind a closed gate
/// and freed there; s2 takes x (behind a wait on s1's fence) and y (fresh), then frees both
/// during a capture: the two ranges merge, and the merged range keeps s1's fence. The
/// capture's next allocations on s2 of either size get no byte of x while s1's work is held;
/// a restore with a capture underway that would make x live again is refused, changing
/// nothing; once the work is done a capture reuses the range, and the restore succeeds.
#[test]
fn merged_capture_frees_keep_the_fence_and_a_restore_under_capture_changes_nothing() {
    use cuarena::GraphPoolId;
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(2101, 0);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 8192, s1).unwrap();
    let y = a.graph_allocate(pool, 8192, s2).unwrap();
    let rest = (2 << 20) - 16384;
    let fill = a.graph_allocate(pool, rest, s1).unwrap();
    assert_eq!((y.0, fill.0), (x.0 + 8192, x.0 + 16384), "one segment, full");
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 8192, 0x2101, Duration::from_millis(1), s1).unwrap();
    a.deallocate(x, 8192, s1).unwrap();
    let l = a.graph_allocate(pool, 8192, s2).unwrap();
    assert_eq!(l, x, "s2 took s1's free behind a wait");
    dev.begin_capture(s2).unwrap();
    a.deallocate(l, 8192, s2).unwrap();
    a.deallocate(y, 8192, s2).unwrap();
    let mut got = Vec::new();
    for n in [8192usize, 16384, 4096, 512] {
        let p = a.graph_allocate(pool, n, s2).unwrap();
        assert!(
            !overlaps((p.0, n), (x.0, 8192)),
            "a capture got {n} bytes at {p:?} over x under s1's held work"
        );
        got.push((p, n));
    }
    for (p, n) in got.drain(..) {
        a.deallocate(p, n, s2).unwrap();
    }
    dev.end_capture(s2).unwrap();
    // A restore while a capture is underway must not wait on the host: refused, nothing changed.
    let live_before = a.graph_pool_live(pool).unwrap();
    let st = a.stats();
    a.graph_capture_begin();
    let r = a.graph_pool_restore(&c);
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    a.graph_capture_end().unwrap();
    assert_eq!(a.graph_pool_live(pool).unwrap(), live_before, "a refused restore changed the pool");
    let st2 = a.stats();
    assert_eq!((st2.allocations, st2.deallocations), (st.allocations, st.deallocations));
    a.check_invariants();
    gate.open();
    dev.synchronize();
    // s1's work done: the capture's own merged free serves a capture again.
    dev.begin_capture(s2).unwrap();
    let z = a.graph_allocate(pool, 16384, s2).unwrap();
    assert_eq!(z, x, "the merged capture free is reused once its fence is complete");
    a.deallocate(z, 16384, s2).unwrap();
    dev.end_capture(s2).unwrap();
    let freed = a.graph_pool_restore(&c).unwrap();
    assert_eq!(freed, vec![(fill, rest)]);
    let mut live = a.graph_pool_live(pool).unwrap();
    live.sort();
    assert_eq!(live, vec![x, y, fill]);
    dev.write_tag(x.0, 8192, 0x2102, s2).unwrap();
    a.deallocate(x, 8192, s2).unwrap();
    a.deallocate(y, 8192, s2).unwrap();
    a.deallocate(fill, rest, s2).unwrap();
    a.graph_pool_release(pool).unwrap();
    no_violations(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// A chain across captures: s2 takes x behind s1's fence (gate closed) and frees it in a
/// capture; a capture on s3 frees a block carved from fresh memory; a non-capturing stream
/// s4 allocates the pool's memory at once: it may take only fresh memory or frees its fences
/// allow (never x, a capture's free, while s1's work is held). Then a capture on s2 with the
/// gate still closed asks for x's size many times: never x. The race checker stays clean.
#[test]
fn a_captures_fenced_free_is_never_taken_by_other_streams_or_early_by_its_own() {
    use cuarena::GraphPoolId;
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2, s3, s4) =
        (dev.create_stream(), dev.create_stream(), dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(2102, 7);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 8192, s1).unwrap();
    let rest = (2 << 20) - 8192;
    let fill = a.graph_allocate(pool, rest, s1).unwrap();
    assert_eq!(fill.0, x.0 + 8192, "one segment, full");
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 8192, 0x77, Duration::from_millis(1), s1).unwrap();
    a.deallocate(x, 8192, s1).unwrap();
    let l = a.graph_allocate(pool, 8192, s2).unwrap();
    assert_eq!(l, x, "s2 took s1's free behind a wait");
    dev.begin_capture(s2).unwrap();
    a.deallocate(l, 8192, s2).unwrap();
    dev.end_capture(s2).unwrap();
    dev.begin_capture(s3).unwrap();
    let w = a.graph_allocate(pool, 8192, s3).unwrap();
    assert!(!overlaps((w.0, 8192), (x.0, 8192)));
    a.deallocate(w, 8192, s3).unwrap();
    dev.end_capture(s3).unwrap();
    let mut held = Vec::new();
    for i in 0..40usize {
        let n = 512 * (1 + i % 24);
        let p = a.graph_allocate(pool, n, s4).unwrap();
        assert!(!overlaps((p.0, n), (x.0, 8192)), "s4 got x, a capture's free: {p:?}");
        dev.write_tag(p.0, n, 0x400 + i as u32, s4).unwrap();
        held.push((p, n));
    }
    dev.begin_capture(s2).unwrap();
    for _ in 0..8 {
        let p = a.graph_allocate(pool, 8192, s2).unwrap();
        assert!(!overlaps((p.0, 8192), (x.0, 8192)), "s2's capture got x early: {p:?}");
        held.push((p, 8192));
    }
    for (p, n) in held.drain(..) {
        a.deallocate(p, n, s2).unwrap_or_else(|e| panic!("{e}"));
    }
    dev.end_capture(s2).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    gate.open();
    a.deallocate(fill, rest, s1).unwrap();
    a.graph_pool_release(pool).unwrap();
    no_violations(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// "A lean arena strands no empty superblock ... one given up later holds only superblocks
/// with live blocks" (`arena.rs`, "Lean arenas"), for arenas made lean by the switch: a thread
/// uses four user streams (each arena keeps its emptied superblock, as a non-lean arena may),
/// then a fifth, which makes all five lean; it then exits holding no block. Nothing may be
/// left parked: every arena was lean and held no live block when it was given up.
///
/// DEFECT (commit 2716dc4, and with the working tree's new lean rule): `set_lean` only changes
/// the rule, which runs at the arena's next own free; the four arenas made lean by the fifth
/// stream keep the empty superblock each kept while not lean (`keep_empty`), and the thread's
/// exit parks them: 1 MiB parked (4 x 256 KiB) with no live block, waiting for an adoption or a
/// device synchronise. Their memory cannot leave outside a call on their own streams, so the
/// claim cannot hold as written; either the README/arena.rs claim is narrowed to "from the
/// arena's next own free on", or the switch happens before the arenas keep anything.
#[test]
#[ignore = "known limit (arena.rs, \"Lean arenas\"): arenas made lean by the switch keep their empty superblocks until their next own free, and are parked with them at exit"]
fn arenas_made_lean_by_the_switch_strand_no_empty_superblock() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let ss: Vec<Stream> = (0..5).map(|_| sim.create_stream()).collect();
    let (held_before_switch, held_after_switch) = on_thread(&a, {
        let ss = ss.clone();
        move |a| {
            touch_all(a, &ss[..4]);
            let before = a.stats().arena_held_bytes;
            touch_all(a, &ss[4..]);
            (before, a.stats().arena_held_bytes)
        }
    });
    let parked = a.parked_bytes();
    eprintln!("held {held_before_switch} before the switch, {held_after_switch} after; parked {parked}");
    assert_eq!(parked, 0, "lean arenas holding no live block were parked with {parked} bytes");
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A thread's free of one of its own blocks, made on another stream past the sixteen batched
/// ones: it goes alone, under an event on that stream, into the thread's own arena. The
/// thread's next allocations on the block's stream get it only behind that event (the race
/// checker, with the freeing stream's work on the block held by a gate), never twice.
#[test]
fn an_own_cross_stream_free_sent_alone_is_fenced_for_its_arena() {
    use cuarena::Device;
    let n = cuarena::MAX_USER_BATCHES;
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned(&owner, &sim, n);
    let ss: Vec<Stream> = (0..n + 2).map(|_| sim.create_stream()).collect();
    for (p, &s) in blocks.iter().zip(&ss) {
        sim.stream_wait_event(s, ready).unwrap();
        a.deallocate(*p, 4096, s).unwrap(); // sixteen batches held
    }
    let (home, other) = (ss[n], ss[n + 1]);
    let mine: Vec<DeviceAddr> = (0..4).map(|_| a.allocate(4096, home).unwrap()).collect();
    for p in &mine {
        sim.write_tag(p.0, 4096, 0x99, home).unwrap();
    }
    let written = sim.create_event().unwrap();
    sim.record_event(written, home).unwrap();
    sim.stream_wait_event(other, written).unwrap();
    let gate = sim.gate(other).unwrap();
    let x = mine[0];
    sim.hold_and_check(x.0, 4096, 0x99, Duration::from_millis(1), other).unwrap();
    let before = a.stats();
    a.deallocate(x, 4096, other).unwrap();
    let after = a.stats();
    assert_eq!(after.fences_recorded - before.fences_recorded, 1, "sent alone: {after:?}");
    assert_eq!(after.cross_stream_frees - before.cross_stream_frees, 1, "{after:?}");
    assert_eq!(a.parked_free_bytes(), 0);
    let live = Live::of(&mine[1..].iter().map(|p| (*p, 4096)).collect::<Vec<_>>());
    let got: Vec<DeviceAddr> = (0..200).map(|_| a.allocate(4096, home).unwrap()).collect();
    for p in &got {
        live.insert(*p, 4096);
        sim.write_tag(p.0, 4096, 0x9a, home).unwrap();
    }
    live.assert_clean();
    assert!(got.contains(&x), "x never came back: the test checks nothing");
    assert!(sim.violations().is_empty(), "x reused under the freeing stream's work: {:?}", sim.violations());
    gate.open();
    for p in got.into_iter().chain(mine[1..].iter().copied()) {
        a.deallocate(p, 4096, home).unwrap();
    }
    a.flush().unwrap();
    a.trim(true).unwrap();
    drop(owner);
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
}

/// A parked arena's block used on another stream and freed there by a thread that holds
/// sixteen streams' batches already: the free goes alone,
/// under an event on that stream, into the parked arena's inbox. The thread that adopts the
/// arena on its own stream gets the block back only behind that event (the race checker, with
/// the freeing stream's work held by a gate), and no device synchronise is made.
#[test]
fn a_free_sent_alone_to_a_parked_arena_is_fenced_for_its_adopter() {
    use cuarena::Device;
    let n = cuarena::MAX_USER_BATCHES;
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned(&owner, &sim, n);
    let ss: Vec<Stream> = (0..n + 2).map(|_| sim.create_stream()).collect();
    let (home, other) = (ss[n], ss[n + 1]);
    // A thread's arena for `home`, parked at its exit with live blocks.
    let mine: Vec<DeviceAddr> = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let v: Vec<DeviceAddr> = (0..6).map(|_| a.allocate(4096, home).unwrap()).collect();
            for p in &v {
                sim.write_tag(p.0, 4096, 0x42, home).unwrap();
            }
            v
        }
    });
    assert!(a.parked_bytes() > 0);
    for (p, &s) in blocks.iter().zip(&ss) {
        sim.stream_wait_event(s, ready).unwrap();
        a.deallocate(*p, 4096, s).unwrap(); // sixteen batches held by this thread
    }
    let x = mine[0];
    // x is used on `other` (after home's writes), behind a gate, then freed there.
    let written = sim.create_event().unwrap();
    sim.record_event(written, home).unwrap();
    sim.stream_wait_event(other, written).unwrap();
    let gate = sim.gate(other).unwrap();
    sim.hold_and_check(x.0, 4096, 0x42, Duration::from_millis(1), other).unwrap();
    let before = a.stats();
    a.deallocate(x, 4096, other).unwrap();
    let after = a.stats();
    assert_eq!(after.fences_recorded - before.fences_recorded, 1, "sent alone: {after:?}");
    assert_eq!(a.parked_free_bytes(), 0, "sent alone, not parked");
    let rest = mine[1..].to_vec();
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let live = Live::of(&rest.iter().map(|p| (*p, 4096)).collect::<Vec<_>>());
            let got: Vec<DeviceAddr> = (0..200).map(|_| a.allocate(4096, home).unwrap()).collect();
            assert_eq!(a.parked_bytes(), 0, "adopted");
            for p in &got {
                live.insert(*p, 4096);
                sim.write_tag(p.0, 4096, 0x43, home).unwrap();
            }
            live.assert_clean();
            assert!(got.contains(&x), "x never came back: the test checks nothing");
            for p in got.into_iter().chain(rest) {
                a.deallocate(p, 4096, home).unwrap();
            }
        }
    });
    let v = sim.violations();
    gate.open();
    assert!(v.is_empty(), "the adopter reused x under the freeing stream's work: {v:?}");
    assert_eq!(a.stats().host_syncs, 0, "{:?}", a.stats());
    a.flush().unwrap();
    a.trim(true).unwrap();
    drop(owner);
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Same-stream churn in a lean arena whose superblocks are half used (free space of more than
/// a superblock in all, but no superblock empty): the owner's frees on the arena's handle cost
/// one capture query each, and its allocations one identity lookup each, as in any user arena
/// (`allocator.rs`, "A user arena's own frees": the identity is asked again only "when the
/// return rule fires", about once per 10^4 frees in steady churn, to give a superblock back).
///
/// Was a defect (from `05ff83d`, the lean rule "a superblock's worth free", to the fix of
/// `may_hold_empty` in `arena.rs`): a lean arena's rule fired on every free although it had no
/// empty superblock to give back (`over_held` true, `shrink` finding none), so every own free
/// asked the stream's identity (`Arena::free_local` -> `handle_names_home`: a `cuStreamGetId`),
/// flushed the block cache and scanned every superblock: 6,000 driver calls for 2,000 pairs
/// instead of 4,000.
#[test]
fn lean_arena_churn_over_half_used_superblocks_asks_the_driver_nothing_more() {
    lean_churn_driver_calls(2);
}

/// The same with a quarter of each superblock used.
///
/// Was a defect (already on 2716dc4, whose lean rule fired below 40% use): the same failure,
/// 6,000 driver calls for 2,000 pairs instead of 4,000. A non-lean arena dissolves a superblock when
/// its rule fires, so the rule stops firing; a lean arena dissolves none, so it fires again on
/// the next free, and the next.
#[test]
fn lean_arena_churn_over_quarter_used_superblocks_asks_the_driver_nothing_more() {
    lean_churn_driver_calls(4);
}

/// A thread with six user arenas (lean) fills eight superblocks with 8 KiB blocks on one
/// stream, keeps one block in `keep_every`, then churns one 8 KiB block there 2,000 times;
/// checks the driver calls of the churn: one per allocation and one per free.
fn lean_churn_driver_calls(keep_every: usize) {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let (calls, ops, st) = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let ss: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
            touch_all(a, &ss); // lean
            let s = ss[5];
            let v: Vec<DeviceAddr> = (0..256).map(|_| a.allocate(8192, s).unwrap()).collect();
            let mut kept = Vec::new();
            for (i, p) in v.into_iter().enumerate() {
                if i % keep_every == 0 {
                    kept.push(p);
                } else {
                    a.deallocate(p, 8192, s).unwrap();
                }
            }
            let held = a.stats().arena_held_bytes;
            assert!(held >= 8 * SB, "no superblock was empty: {held}");
            let before = a.stats();
            let steady = 2000u64;
            for i in 0..steady {
                let p = a.allocate(8192, s).unwrap();
                sim.write_tag(p.0, 64, i as u32 | 1, s).unwrap();
                a.deallocate(p, 8192, s).unwrap();
            }
            let after = a.stats();
            for p in kept {
                a.deallocate(p, 8192, s).unwrap();
            }
            a.release_thread().unwrap();
            for s in ss {
                sim.destroy_stream(s).unwrap();
            }
            (after.driver_calls - before.driver_calls, 2 * steady, after)
        }
    });
    assert_eq!(
        calls, ops,
        "one identity lookup per allocation, one capture query per free, nothing else: {st:?}"
    );
    assert_all_returned(&a, Some(&sim), 0);
}
