//! An adversarial pass on large blocks (over `small_max`, up to `large_max`) served by the
//! arenas from large superblocks: large and small blocks mixed in one superblock; remote and
//! cross-stream frees racing the owner's return of the superblock; ranges lent as a large
//! superblock and then as normal ones (registry entries replaced) while frees of old blocks are
//! in flight; bad frees from the owner and from others; out-of-memory under a tight cap with
//! many threads and idle ones; thread exit with live large blocks; trim; user streams; the
//! stranded-memory bound; and `large_max = small_max`. Every test ends with
//! `assert_all_returned` (which also asks the simulator's race checker).

use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use cuarena::{Device, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned};

mod common;
use common::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// `small()`'s normal superblock and `small_max`.
const S: usize = 256 * KIB;
const SMALL_MAX: usize = 64 * KIB;
/// The spare the return rule keeps while large superblocks are held (`arena.rs`).
const L: usize = 128 * MIB;

#[test]
fn small_blocks_carved_from_a_large_superblock_and_large_ones_interleaved_never_overlap() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let live = Live::default();
    // One large block first: the arena's only superblock is then a large one (8 MiB), and the
    // small requests after it are carved from its free space.
    let first = a.allocate_per_thread(SMALL_MAX + 1).unwrap();
    assert_eq!(lent(&a).len(), 1);
    assert_eq!(lent(&a)[0].1, 8 * MIB, "one large superblock: {:?}", lent(&a));
    live.insert(first, SMALL_MAX + 1);
    let mut held: Vec<(DeviceAddr, usize, Stream, u32)> = vec![(first, SMALL_MAX + 1, Stream::PER_THREAD, 0)];
    tag(&sim, first, SMALL_MAX + 1, 0, Stream::PER_THREAD);
    let mut x = 0x1234_5678_9abc_def1u64;
    for i in 1..3000u32 {
        let r = rng(&mut x);
        if held.len() > 40 || (r % 5 < 2 && !held.is_empty()) {
            let (p, size, s, t) = held.swap_remove((r >> 8) as usize % held.len());
            check(&sim, p, size, t, s);
            live.remove(p);
            a.deallocate(p, size, s).unwrap();
            continue;
        }
        // Sizes on both sides of small_max, one granule apart, and up to 3 MiB.
        let size = match r % 6 {
            0 => SMALL_MAX,
            1 => SMALL_MAX + 1,
            2 => 1 + (r >> 12) as usize % 4096,
            3 => SMALL_MAX + 256 * (1 + (r >> 12) as usize % 64),
            4 => (1 + (r >> 12) as usize % 3) * MIB,
            _ => 1 + (r >> 12) as usize % SMALL_MAX,
        };
        let s = if r & 64 == 0 { Stream::PER_THREAD } else { Stream::LEGACY };
        let p = a.allocate(size, s).unwrap();
        assert_eq!(p.0 % 256, 0);
        live.insert(p, size);
        tag(&sim, p, size, i, s);
        held.push((p, size, s, i));
    }
    live.assert_clean();
    let s = a.stats();
    assert!(s.large_allocations > 500 && s.pool_allocations == 0, "{s:?}");
    for (p, size, s, t) in held {
        check(&sim, p, size, t, s);
        a.deallocate(p, size, s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// The owner allocates large and small blocks, hands some to two other threads that free them
/// (on their per-thread stream, the legacy stream or a user stream made to wait), while it keeps
/// freeing its own so that the return rule gives its superblocks back and borrows again. Each
/// block is used on the owner's stream until an event the freer waits on: a reuse under that
/// use is a checker violation.
#[test]
fn remote_and_cross_stream_large_frees_race_the_owners_return_of_the_superblock() {
    let sim = host(20);
    // Remote frees gathered 3 at a time: some wait in outboxes while superblocks go back.
    let a = alloc_with(&sim, small().batch_blocks(3).keep_empty(0));
    let live = Arc::new(Live::default());
    type Msg = (DeviceAddr, usize, cuarena::Event);
    let mut txs: Vec<mpsc::Sender<Msg>> = Vec::new();
    let mut freers = Vec::new();
    for f in 0..2u64 {
        let (tx, rx) = mpsc::channel::<Msg>();
        txs.push(tx);
        let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
        freers.push(std::thread::spawn(move || {
            let u = sim.create_stream();
            let mut n = 0u64;
            for (p, size, e) in rx {
                n += 1;
                let s = match (n + f) % 3 {
                    0 => Stream::PER_THREAD,
                    1 => Stream::LEGACY,
                    _ => u,
                };
                sim.stream_wait_event(s, e).unwrap();
                live.remove(p);
                a.deallocate(p, size, s).unwrap();
                // A second free from here: refused at once (the flag), never sent.
                if n.is_multiple_of(7) {
                    assert!(is_double(&a.deallocate(p, size, s)), "a second remote free of {p:?}");
                }
                if n.is_multiple_of(11) {
                    a.flush().unwrap();
                }
            }
            a.release_thread().unwrap();
            sim.destroy_stream(u).unwrap();
            n / 7
        }));
    }
    let mut x = 0xdead_beef_1357_9bdfu64;
    let mut held: Vec<(DeviceAddr, usize, u32)> = Vec::new();
    let mut sent = 0;
    for i in 0..1500u32 {
        let r = rng(&mut x);
        if i % 150 == 149 {
            // Now and then the owner frees all it holds first, so that the trim below finds
            // superblocks without a used block (the owner's return rule alone may give none
            // back: it keeps slack while it holds large superblocks, and a remote batch's
            // completion does not apply it).
            for (p, size, t) in held.drain(..) {
                check(&sim, p, size, t, Stream::PER_THREAD);
                live.remove(p);
                a.deallocate_per_thread(p, size).unwrap();
            }
        }
        if i % 50 == 49 {
            // Everything without a used block goes back now, remote frees in flight or not.
            a.trim(false).unwrap();
        }
        if held.len() > 12 || (r.is_multiple_of(3) && !held.is_empty()) {
            let (p, size, t) = held.swap_remove((r >> 8) as usize % held.len());
            check(&sim, p, size, t, Stream::PER_THREAD);
            if r.is_multiple_of(2) {
                // To another thread, used on our stream until the event.
                sim.hold_and_check(p.0, 256, t, Duration::from_micros(50), Stream::PER_THREAD).unwrap();
                let e = sim.create_event().unwrap();
                sim.record_event(e, Stream::PER_THREAD).unwrap();
                txs[(r >> 4) as usize % 2].send((p, size, e)).unwrap();
                sent += 1;
            } else {
                live.remove(p);
                a.deallocate_per_thread(p, size).unwrap();
            }
            continue;
        }
        let size = if r.is_multiple_of(4) {
            1 + (r >> 16) as usize % SMALL_MAX
        } else {
            SMALL_MAX + 1 + (r >> 16) as usize % (3 * MIB)
        };
        let p = a.allocate_per_thread(size).unwrap();
        live.insert(p, size);
        tag(&sim, p, size, i, Stream::PER_THREAD);
        held.push((p, size, i));
    }
    for (p, size, t) in held {
        check(&sim, p, size, t, Stream::PER_THREAD);
        live.remove(p);
        a.deallocate_per_thread(p, size).unwrap();
    }
    drop(txs);
    let doubles: u64 = freers.into_iter().map(|h| h.join().unwrap()).sum();
    live.assert_clean();
    let s = a.stats();
    // Most sent blocks reach their owner as cross-thread frees; one whose superblock the owner
    // gave back (dissolved) before the freer got to it goes to the pool instead, uncounted
    // there, which a loaded machine makes more likely.
    assert!(sent > 300 && s.cross_thread_frees > sent / 2, "{sent} {s:?}");
    assert!(s.superblocks_returned + s.superblocks_dissolved > 0, "the owner gave superblocks back: {s:?}");
    assert_all_returned(&a, Some(&sim), doubles);
}

/// A range lent as a large superblock goes back (its owner exits with a live block: dissolved)
/// and its free slots are lent again as normal superblocks, re-entered in the registry, while a
/// remote free of the old block waits in an outbox. A second free of that block is refused; a
/// stale wrong-size free of an old address that now lies in a new owner's block is refused by
/// that owner and never applied; the in-flight free lands in the pool; then the range, whole
/// again, is lent as a large superblock once more.
#[test]
fn a_range_relent_with_another_layout_refuses_stale_frees_of_old_blocks() {
    let sim = host(0);
    // One 16 MiB chunk: every superblock comes from the same range.
    let a = alloc_with(&sim, small().chunk(16 * MIB).max_bytes(16 * MIB).batch_blocks(64));
    let big = 3 * MIB; // a large superblock of 8 MiB (halved from 16 under the cap if need be)
    let freer = Worker::new(&a);
    let owner = Worker::new(&a);
    let sim2 = sim.clone();
    let (x, y) = owner.run(move |a| {
        let x = a.allocate_per_thread(big).unwrap();
        let y = a.allocate_per_thread(big).unwrap();
        tag(&sim2, x, big, 1, Stream::PER_THREAD);
        tag(&sim2, y, big, 2, Stream::PER_THREAD);
        (x, y)
    });
    let large: Vec<(u64, usize)> = lent(&a);
    assert!(large.len() == 1 && large[0].1 > S, "one large superblock: {large:?}");
    let (lbase, llen) = large[0];
    // The freer frees x: accepted, its flag taken, waiting in its outbox (batch of 64).
    freer.run(move |a| a.deallocate_per_thread(x, big).unwrap());
    // The owner frees y and exits: the large superblock goes back dissolved around x.
    owner.run(move |a| a.deallocate_per_thread(y, big).unwrap());
    owner.exit();
    assert!(lent(&a).is_empty());
    // A second free of x, by anyone: refused (its first free is on its way).
    assert!(is_double(&a.deallocate_per_thread(x, big)));
    assert!(is_double(&on_thread(&a, move |a| a.deallocate(x, big, Stream::LEGACY))));
    // New owners take normal superblocks: they are carved from the old large range, around x.
    let newcomer = Worker::new(&a);
    let sim2 = sim.clone();
    let blocks: Vec<(DeviceAddr, usize)> = newcomer.run(move |a| {
        let mut v = Vec::new();
        for i in 0..40u32 {
            let size = SMALL_MAX;
            let p = a.allocate_per_thread(size).unwrap();
            tag(&sim2, p, size, 100 + i, Stream::PER_THREAD);
            v.push((p, size));
        }
        v
    });
    let normals = lent(&a);
    let inside = normals.iter().filter(|&&(b, l)| l == S && b >= lbase && b < lbase + llen as u64).count();
    assert!(inside > 0, "normal superblocks over the old large range: {normals:?} vs {lbase:#x}+{llen}");
    // Nothing new overlaps x (still live in the pool until its free lands).
    for &(p, size) in &blocks {
        assert!(p.0 + size as u64 <= x.0 || p.0 >= x.0 + big as u64, "{p:?} overlaps x {x:?}");
    }
    // Stale frees of old addresses that now lie in the newcomer's blocks: the old block y began
    // there (freed long ago). Wrong sizes for the new block: refused by its owner, not applied.
    let victims: Vec<(DeviceAddr, usize)> = blocks
        .iter()
        .skip(3)
        .copied()
        .filter(|&(p, _)| p.0 == y.0 || p.0 == y.0 + 4096 || p.0 == y.0 + big as u64 / 2)
        .collect();
    let mut bad = 2u64;
    for &(p, _) in blocks.iter().take(3) {
        // Stale frees as the old large size, by another thread (accepted, then refused).
        let r = on_thread(&a, move |a| a.deallocate_per_thread(p, big));
        assert!(r.is_ok(), "{p:?} {r:?} {:?} {lbase:#x} {x:?} {y:?}", lent(&a));
        bad += 1;
    }
    if let Some(&(p, _)) = victims.first() {
        let r = on_thread(&a, move |a| a.deallocate_per_thread(p, big));
        assert!(r.is_ok(), "{r:?}");
        bad += 1;
    }
    // The owner drains them (refusing each), then its blocks are intact and freed normally.
    let sim2 = sim.clone();
    newcomer.run(move |a| {
        a.flush().unwrap();
        for (i, &(p, size)) in blocks.iter().enumerate() {
            check(&sim2, p, size, 100 + i as u32, Stream::PER_THREAD);
            a.deallocate_per_thread(p, size).unwrap();
        }
    });
    assert_eq!(a.stats().invalid_frees, bad, "{:?}", a.stats());
    assert!(a.take_deferred_error().is_some());
    // The in-flight free of x lands in the pool.
    freer.run(|a| a.flush().unwrap());
    assert!(is_double(&a.deallocate_per_thread(x, big)));
    bad += 1;
    newcomer.exit();
    // The range is whole again: a large superblock over it.
    a.trim(false).unwrap();
    let again = a.allocate_per_thread(big).unwrap();
    assert!(lent(&a).iter().any(|&(_, l)| l > S), "{:?}", lent(&a));
    tag(&sim, again, big, 7, Stream::PER_THREAD);
    a.deallocate_per_thread(again, big).unwrap();
    freer.exit();
    assert_all_returned(&a, Some(&sim), bad);
}

/// Many rounds of short-lived threads with live large and small blocks, whose blocks a
/// long-lived thread frees remotely (some waiting in its outbox) after they exit or while they
/// run, under a cap so that ranges are taken back and lent again in other layouts. Checks that
/// the layouts did change (normal superblocks over a range once lent large) and that nothing
/// overlapped.
#[test]
fn layout_churn_with_remote_frees_in_flight_never_hands_out_a_byte_twice() {
    let sim = host(10);
    let a = alloc_with(&sim, small().chunk(32 * MIB).max_bytes(64 * MIB).batch_blocks(5));
    let live = Arc::new(Live::default());
    let (tx, rx) = mpsc::channel::<(DeviceAddr, usize, cuarena::Event)>();
    let freer = {
        let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
        std::thread::spawn(move || {
            for (i, (p, size, e)) in rx.into_iter().enumerate() {
                sim.stream_wait_event(Stream::PER_THREAD, e).unwrap();
                live.remove(p);
                a.deallocate_per_thread(p, size).unwrap();
                if i.is_multiple_of(13) {
                    a.flush().unwrap();
                }
            }
            a.release_thread().unwrap();
        })
    };
    let large_ranges = Arc::new(Mutex::new(Vec::<(u64, usize)>::new()));
    let mut ooms = 0;
    for round in 0..40u64 {
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let (a, sim, live, tx, lr) =
                    (a.clone(), sim.clone(), live.clone(), tx.clone(), large_ranges.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15 ^ (round * 7 + t + 1);
                    let mut held = Vec::new();
                    let mut ooms = 0;
                    for i in 0..30u32 {
                        let r = rng(&mut x);
                        let size = if r.is_multiple_of(3) {
                            1 + (r >> 20) as usize % SMALL_MAX
                        } else {
                            SMALL_MAX + (r >> 20) as usize % (4 * MIB)
                        };
                        let p = match a.allocate_per_thread(size) {
                            Ok(p) => p,
                            Err(Error::OutOfMemory { .. }) => {
                                ooms += 1;
                                continue;
                            }
                            Err(e) => panic!("{e}"),
                        };
                        live.insert(p, size);
                        tag(&sim, p, size, i, Stream::PER_THREAD);
                        held.push((p, size, i));
                        if r.is_multiple_of(4) {
                            let (p, size, t) = held.swap_remove(0);
                            check(&sim, p, size, t, Stream::PER_THREAD);
                            live.remove(p);
                            a.deallocate_per_thread(p, size).unwrap();
                        }
                    }
                    lr.lock().unwrap().extend(lent(&a));
                    // Half the rest to the freer now (their owner then exits with them live).
                    for (k, (p, size, t)) in held.into_iter().enumerate() {
                        check(&sim, p, size, t, Stream::PER_THREAD);
                        if k.is_multiple_of(2) {
                            let e = sim.create_event().unwrap();
                            sim.record_event(e, Stream::PER_THREAD).unwrap();
                            tx.send((p, size, e)).unwrap();
                        } else {
                            live.remove(p);
                            a.deallocate_per_thread(p, size).unwrap();
                        }
                    }
                    a.release_thread().unwrap();
                    ooms
                })
            })
            .collect();
        ooms += workers.into_iter().map(|h| h.join().unwrap()).sum::<u32>();
        if round % 10 == 9 {
            a.trim(false).unwrap();
        }
    }
    drop(tx);
    freer.join().unwrap();
    live.assert_clean();
    // The layouts changed: a range sampled once as a large superblock was sampled at another
    // time as a normal one inside it (its registry entry replaced), or the reverse.
    let seen = large_ranges.lock().unwrap().clone();
    let relaid = seen
        .iter()
        .filter(|&&(b, l)| l == S && seen.iter().any(|&(lb, ll)| ll > S && b >= lb && b < lb + ll as u64))
        .count();
    let s = a.stats();
    eprintln!("relaid {relaid}, ooms {ooms}, {s:?}");
    assert!(s.large_allocations > 1000, "{s:?}");
    assert!(relaid > 0, "no range changed layout: the test exercised no entry replacement");
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn bad_frees_of_large_blocks_from_the_owner_and_from_others_are_refused_and_lose_nothing() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(1));
    let size = 2 * MIB + 1000; // granule-rounded: 2 MiB + 1024
    let ps: Vec<DeviceAddr> = (0..6).map(|_| a.allocate_per_thread(size).unwrap()).collect();
    for (i, &p) in ps.iter().enumerate() {
        tag(&sim, p, size, i as u32, Stream::PER_THREAD);
    }
    let bad = std::cell::Cell::new(0u64);
    let refused = |r: cuarena::Result<()>| {
        assert!(is_invalid(&r), "{r:?}");
        bad.set(bad.get() + 1);
    };
    let p = ps[0];
    // The owner, at once: rounded sizes that differ by one granule, a small size, a size over
    // large_max, interior pointers (aligned and not), one past the end, on each arena stream.
    for s in [Stream::PER_THREAD, Stream::LEGACY] {
        refused(a.deallocate(p, size + 256, s));
        refused(a.deallocate(p, size - 1024, s));
        refused(a.deallocate(p, 4096, s));
        refused(a.deallocate(p, 65 * MIB, s));
        refused(a.deallocate(DeviceAddr(p.0 + 256), size - 256, s));
        refused(a.deallocate(DeviceAddr(p.0 + 100), size, s));
    }
    // The same rounded size is the same block: accepted (size + 24 rounds to the same granules).
    a.deallocate_per_thread(p, size + 24).unwrap();
    refused(a.deallocate_per_thread(p, size));
    refused(a.deallocate(p, size, Stream::LEGACY));
    let u = sim.create_stream();
    refused(a.deallocate(p, size, u));
    // Another thread: unaligned interior and over-large_max refused at once; a double free of a
    // block the owner freed refused at once; wrong size and aligned interior accepted, then
    // refused by the owner's drain (deferred).
    let (q, r) = (ps[1], ps[2]);
    let (now, later) = on_thread(&a, move |a| {
        let mut now = 0;
        for res in [
            a.deallocate_per_thread(DeviceAddr(q.0 + 8), size),
            a.deallocate_per_thread(q, 100 * MIB),
            a.deallocate_per_thread(p, size),
            a.deallocate(p, size, Stream::LEGACY),
        ] {
            assert!(is_invalid(&res), "{res:?}");
            now += 1;
        }
        let mut later = 0;
        for res in [
            a.deallocate_per_thread(q, size + MIB),
            a.deallocate_per_thread(DeviceAddr(r.0 + 4096), size - 4096),
        ] {
            assert!(res.is_ok(), "accepted, checked by the owner: {res:?}");
            later += 1;
        }
        (now, later)
    });
    bad.set(bad.get() + now + later);
    // The owner drains the wrong frees (refusing them, clearing the flags they took); its
    // blocks are intact and its own frees of them work.
    a.flush().unwrap();
    assert_eq!(a.stats().invalid_frees, bad.get());
    assert!(a.take_deferred_error().is_some());
    for (i, &p) in ps.iter().enumerate().skip(1) {
        check(&sim, p, size, i as u32, Stream::PER_THREAD);
    }
    // Cross-stream (owner, user stream) and remote (other thread, user stream) correct frees,
    // each followed by a refused second free.
    sim.stream_wait_event(u, {
        let e = sim.create_event().unwrap();
        sim.record_event(e, Stream::PER_THREAD).unwrap();
        e
    })
    .unwrap();
    a.deallocate(ps[1], size, u).unwrap();
    refused(a.deallocate(ps[1], size, Stream::PER_THREAD));
    let p3 = ps[3];
    let r2 = on_thread(&a, move |a| {
        a.deallocate(p3, size, Stream::LEGACY).unwrap();
        a.deallocate_per_thread(p3, size)
    });
    refused(r2);
    for &p in &ps[2..] {
        if p != p3 {
            a.deallocate_per_thread(p, size).unwrap();
        }
    }
    a.flush().unwrap();
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), bad.get());
}

/// A tight cap (four 8 MiB large superblocks' worth) and six threads that want large blocks at
/// once, two of which go idle holding large superblocks with nothing live. Out-of-memory may
/// happen while every thread is busy (each busy arena keeps what the return rule allows), but
/// nothing is corrupted, and once all are idle a single request for most of the cap succeeds.
#[test]
fn a_tight_cap_with_many_threads_and_idle_holders_of_large_superblocks() {
    let sim = host(5);
    let cap = 32 * MIB;
    let a = alloc_with(&sim, small().max_bytes(cap));
    let idle: Vec<Worker> = (0..2).map(|_| Worker::new(&a)).collect();
    for w in &idle {
        w.run(|a| {
            let ps: Vec<DeviceAddr> = (0..2).map(|_| a.allocate_per_thread(3 * MIB).unwrap()).collect();
            for p in ps {
                a.deallocate_per_thread(p, 3 * MIB).unwrap();
            }
        });
    }
    let live = Arc::new(Live::default());
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
            std::thread::spawn(move || {
                let mut x = 0x5151_7272_9393_a4a4 ^ t;
                let (mut ok, mut oom) = (0u32, 0u32);
                let mut held: Vec<(DeviceAddr, usize, u32)> = Vec::new();
                for i in 0..300u32 {
                    let r = rng(&mut x);
                    if held.len() >= 2 || (r.is_multiple_of(2) && !held.is_empty()) {
                        let (p, size, tg) = held.swap_remove(0);
                        check(&sim, p, size, tg, Stream::PER_THREAD);
                        live.remove(p);
                        a.deallocate_per_thread(p, size).unwrap();
                    }
                    let size = if r.is_multiple_of(5) {
                        1 + (r >> 20) as usize % SMALL_MAX
                    } else {
                        SMALL_MAX + (r >> 20) as usize % (3 * MIB)
                    };
                    match a.allocate_per_thread(size) {
                        Ok(p) => {
                            ok += 1;
                            live.insert(p, size);
                            tag(&sim, p, size, i, Stream::PER_THREAD);
                            held.push((p, size, i));
                        }
                        Err(Error::OutOfMemory { .. }) => oom += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                for (p, size, tg) in held {
                    check(&sim, p, size, tg, Stream::PER_THREAD);
                    live.remove(p);
                    a.deallocate_per_thread(p, size).unwrap();
                }
                a.release_thread().unwrap();
                (ok, oom)
            })
        })
        .collect();
    let (mut ok, mut oom) = (0, 0);
    for h in threads {
        let (o, e) = h.join().unwrap();
        ok += o;
        oom += e;
    }
    live.assert_clean();
    eprintln!("{ok} served, {oom} out of memory, {:?}", a.stats());
    // A reclaim skips arenas whose owners are inside a call, so how many are served depends on
    // scheduling (1,793 of 1,800 on two idle cores here); the requests below are the oracle.
    assert!(ok > 600, "requests served: {ok} ({oom} out of memory)");
    assert!(a.stats().reserved_bytes <= cap as u64);
    // All idle now (the two workers hold large superblocks, nothing live): one request for
    // three quarters of the cap succeeds after the reclaim.
    let big = 24 * MIB;
    // Out-of-memory never blocks the host: chunks whose free ranges carry fences recorded by
    // the reclaim itself may not be released in time for this request, which needs a chunk
    // bigger than any reserved so far. After a blocking trim it must succeed.
    let p = match a.allocate_per_thread(big) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("first try: {e}");
            a.trim(true).unwrap();
            a.allocate_per_thread(big).expect("everything idle is reclaimed")
        }
    };
    tag(&sim, p, big, 9, Stream::PER_THREAD);
    check(&sim, p, big, 9, Stream::PER_THREAD);
    a.deallocate_per_thread(p, big).unwrap();
    drop(idle);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Threads exit with live large and small blocks (their superblocks dissolve); the blocks are
/// then freed by another thread on each kind of stream, each after a refused second free, while
/// other threads take the ranges again. The exited threads' blocks are used on a user stream
/// until an event, so an early reuse is a checker violation.
#[test]
fn thread_exit_with_large_superblocks_holding_live_blocks() {
    let sim = host(20);
    let a = alloc_with(&sim, small().max_bytes(256 * MIB));
    let mut orphans: Vec<(DeviceAddr, usize, u32, cuarena::Event)> = Vec::new();
    for t in 0..6u32 {
        let sim2 = sim.clone();
        let mut v = on_thread(&a, move |a| {
            let u = sim2.create_stream();
            let mut v = Vec::new();
            for i in 0..8u32 {
                let size = if i.is_multiple_of(3) {
                    1000 * (i as usize + 1)
                } else {
                    (1 + i as usize % 4) * MIB + 512
                };
                let p = a.allocate_per_thread(size).unwrap();
                let tg = t * 100 + i;
                tag(&sim2, p, size, tg, Stream::PER_THREAD);
                let ready = sim2.create_event().unwrap();
                sim2.record_event(ready, Stream::PER_THREAD).unwrap();
                sim2.stream_wait_event(u, ready).unwrap();
                sim2.hold_and_check(p.0, 256, tg, Duration::from_micros(300), u).unwrap();
                let e = sim2.create_event().unwrap();
                sim2.record_event(e, u).unwrap();
                v.push((p, size, tg, e));
            }
            v
        });
        orphans.append(&mut v);
    }
    assert!(a.stats().superblocks_dissolved >= 6, "{:?}", a.stats());
    // Others borrow over the dissolved ranges meanwhile.
    let churn = {
        let (a, sim) = (a.clone(), sim.clone());
        std::thread::spawn(move || {
            for i in 0..200u32 {
                let size = if i.is_multiple_of(2) { 3 * MIB } else { 4096 };
                let p = a.allocate_per_thread(size).unwrap();
                tag(&sim, p, size, 10_000 + i, Stream::PER_THREAD);
                check(&sim, p, size, 10_000 + i, Stream::PER_THREAD);
                a.deallocate_per_thread(p, size).unwrap();
            }
            a.release_thread().unwrap();
        })
    };
    let u = sim.create_stream();
    let mut bad = 0;
    for (k, (p, size, tg, e)) in orphans.into_iter().enumerate() {
        let s = [Stream::PER_THREAD, Stream::LEGACY, u][k % 3];
        sim.stream_wait_event(s, e).unwrap();
        check(&sim, p, size, tg, s);
        // A wrong size first: refused, the block kept.
        assert!(is_invalid(&a.deallocate(p, size + MIB, s)));
        bad += 1;
        a.deallocate(p, size, s).unwrap();
        assert!(is_double(&a.deallocate(p, size, s)));
        bad += 1;
    }
    churn.join().unwrap();
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

#[test]
fn trim_keeps_large_superblocks_with_live_blocks_and_takes_the_rest() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let keep = a.allocate_per_thread(5 * MIB).unwrap();
    tag(&sim, keep, 5 * MIB, 1, Stream::PER_THREAD);
    // Other large superblocks, emptied (kept by the return rule's spare).
    let ps: Vec<DeviceAddr> = (0..12).map(|_| a.allocate_per_thread(5 * MIB).unwrap()).collect();
    for p in ps {
        a.deallocate_per_thread(p, 5 * MIB).unwrap();
    }
    let idle = Worker::new(&a);
    let idle_held = idle.run(|a| {
        let p = a.allocate_per_thread(2 * MIB).unwrap();
        let q = a.allocate_per_thread(2 * MIB).unwrap();
        a.deallocate_per_thread(p, 2 * MIB).unwrap();
        (q, a.stats().arena_held_bytes)
    });
    let held = a.stats().arena_held_bytes;
    assert!(held > 40 * MIB as u64, "large superblocks kept: {held}");
    for blocking in [false, true] {
        a.trim(blocking).unwrap();
        let s = a.stats();
        // What is left: the superblock of `keep` (32 MiB for a 5 MiB request, or less) and the
        // idle thread's with its live block.
        assert!(s.arena_held_bytes <= 2 * 32 * MIB as u64, "trim({blocking}) left {s:?}");
        assert_eq!(lent(&a).len(), 2, "{:?}", lent(&a));
        check(&sim, keep, 5 * MIB, 1, Stream::PER_THREAD);
    }
    let q = idle_held.0;
    idle.run(move |a| a.deallocate_per_thread(q, 2 * MIB).unwrap());
    a.deallocate_per_thread(keep, 5 * MIB).unwrap();
    idle.exit();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Large requests on user streams come from the thread's arena for that stream (large
/// superblocks); their frees on other streams and by other threads are fenced; bad frees are
/// refused.
#[test]
fn large_blocks_on_user_streams_come_from_their_arena_and_are_fenced_across_streams() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let (u1, u2) = (sim.create_stream(), sim.create_stream());
    let size = 3 * MIB;
    let before = a.stats();
    let p = a.allocate(size, u1).unwrap();
    let s = a.stats();
    assert_eq!((s.pool_allocations - before.pool_allocations, s.large_allocations), (0, 1), "{s:?}");
    // Used on u1 for a while, freed on u2 after an event: reused only after that use.
    sim.hold_and_check(p.0, size, 0x77, Duration::from_millis(100), u1).unwrap();
    let e = sim.create_event().unwrap();
    sim.record_event(e, u1).unwrap();
    sim.stream_wait_event(u2, e).unwrap();
    assert!(is_invalid(&a.deallocate(p, size + MIB, u2)));
    assert!(is_invalid(&a.deallocate(DeviceAddr(p.0 + 256), size, u2)));
    a.deallocate(p, size, u2).unwrap();
    assert!(is_double(&a.deallocate(p, size, u1)));
    // Reallocated on u1, or as a per-thread large block, it is written only after the hold.
    let q = a.allocate(size, u1).unwrap();
    sim.write_tag(q.0, size, 1, u1).unwrap();
    let r = a.allocate_per_thread(size).unwrap();
    sim.write_tag(r.0, size, 2, Stream::PER_THREAD).unwrap();
    // Another thread frees q on its per-thread stream (batched) and r remotely.
    let e = sim.create_event().unwrap();
    sim.record_event(e, u1).unwrap();
    let e2 = sim.create_event().unwrap();
    sim.record_event(e2, Stream::PER_THREAD).unwrap();
    let sim2 = sim.clone();
    let second = on_thread(&a, move |a| {
        sim2.stream_wait_event(Stream::PER_THREAD, e).unwrap();
        sim2.stream_wait_event(Stream::PER_THREAD, e2).unwrap();
        a.deallocate_per_thread(q, size).unwrap();
        a.deallocate_per_thread(r, size).unwrap();
        [a.deallocate_per_thread(q, size), a.deallocate(r, size, Stream::LEGACY)]
    });
    assert!(second.iter().all(is_double), "{second:?}");
    a.flush().unwrap();
    sim.destroy_stream(u1).unwrap();
    sim.destroy_stream(u2).unwrap();
    assert_all_returned(&a, Some(&sim), 5);
}

/// The stranded-memory bound with large superblocks (`arena.rs`): after every free,
/// held <= max(peak + K·S + L, peak / (1 - f)) + the non-empty large superblocks, each at most
/// 128 MiB (counted here as at most one per live block over small_max, and one for the small
/// blocks); and once everything is freed and the recent peak has decayed (many small frees),
/// held <= K·S + L.
#[test]
fn the_stranded_memory_bound_holds_with_large_superblocks() {
    let sim = HostDevice::new(cuarena_testkit::HostConfig { capacity: 2 << 30, ..Default::default() });
    let a = alloc_with(&sim, small());
    let (k, f) = (2.0, 0.6);
    let mut x = 0x0bad_cafe_f00d_d00du64;
    let mut held: Vec<(DeviceAddr, usize)> = Vec::new();
    let (mut live, mut peak) = (0usize, 0usize);
    let check_bound = |live_large: usize, peak: usize, what: &str| {
        let s = a.stats();
        let rule = (peak as f64 + k * S as f64 + L as f64).max(peak as f64 / (1.0 - f));
        let bound = rule + ((live_large + 1) * L) as f64;
        assert!(
            (s.arena_held_bytes as f64) <= bound,
            "{what}: held {} > bound {bound} (peak {peak})",
            s.arena_held_bytes
        );
    };
    for round in 0..3 {
        // Grow to a working set of ~200 MiB, mostly large, then shrink to a few blocks.
        for _ in 0..150 {
            let r = rng(&mut x);
            let size = if r.is_multiple_of(3) {
                1 + (r >> 20) as usize % SMALL_MAX
            } else {
                SMALL_MAX + (r >> 20) as usize % (3 * MIB)
            };
            let p = a.allocate_per_thread(size).unwrap();
            held.push((p, size));
            live += size;
            peak = peak.max(live);
        }
        while held.len() > 3 {
            let r = rng(&mut x);
            let (p, size) = held.swap_remove((r >> 8) as usize % held.len());
            a.deallocate_per_thread(p, size).unwrap();
            live -= size;
            let live_large = held.iter().filter(|h| h.1 > SMALL_MAX).count();
            check_bound(live_large, peak, &format!("round {round}"));
        }
    }
    for (p, size) in held.drain(..) {
        a.deallocate_per_thread(p, size).unwrap();
    }
    // Decay the recent peak: small allocate/free pairs.
    for _ in 0..4000 {
        let p = a.allocate_per_thread(256).unwrap();
        a.deallocate_per_thread(p, 256).unwrap();
    }
    let s = a.stats();
    assert!(s.arena_held_bytes <= (2 * S + L) as u64, "after the peak decayed: {s:?}");
    assert_all_returned(&a, Some(&sim), 0);
}

/// `large_max = small_max`: every request over small_max goes to the pool, on every stream;
/// no large superblock is ever lent; frees of pool blocks from every path work and bad ones
/// are refused.
#[test]
fn large_max_equal_to_small_max_sends_every_large_request_to_the_pool() {
    let sim = host(0);
    let a = alloc_with(&sim, small().large_max(SMALL_MAX));
    let u = sim.create_stream();
    let mut ps = Vec::new();
    for (i, s) in [Stream::PER_THREAD, Stream::LEGACY, u, Stream::PER_THREAD].into_iter().enumerate() {
        for size in [SMALL_MAX + 1, 3 * MIB, SMALL_MAX] {
            let p = a.allocate(size, s).unwrap();
            tag(&sim, p, size, i as u32, s);
            ps.push((p, size, s, i as u32));
        }
    }
    let st = a.stats();
    assert_eq!((st.large_allocations, st.pool_allocations), (0, 8), "{st:?}");
    assert!(lent(&a).iter().all(|&(_, l)| l == S), "only normal superblocks: {:?}", lent(&a));
    let e = sim.create_event().unwrap();
    sim.record_event(e, u).unwrap();
    let e2 = sim.create_event().unwrap();
    sim.record_event(e2, Stream::PER_THREAD).unwrap();
    let (mine, theirs): (Vec<_>, Vec<_>) = ps.into_iter().enumerate().partition(|(k, _)| k.is_multiple_of(2));
    let sim2 = sim.clone();
    let refused = on_thread(&a, move |a| {
        sim2.stream_wait_event(Stream::PER_THREAD, e).unwrap();
        sim2.stream_wait_event(Stream::PER_THREAD, e2).unwrap();
        let mut refused = 0;
        for (_, (p, size, s, t)) in theirs {
            check(&sim2, p, size, t, Stream::PER_THREAD);
            if size > SMALL_MAX {
                assert!(is_invalid(&a.deallocate_per_thread(p, size + 256)));
                refused += 1;
            }
            a.deallocate_per_thread(p, size).unwrap();
            assert!(is_double(&a.deallocate(p, size, s)));
            refused += 1;
        }
        refused
    });
    let mut bad = refused;
    sim.stream_wait_event(Stream::LEGACY, e).unwrap();
    for (_, (p, size, s, t)) in mine {
        check(&sim, p, size, t, Stream::LEGACY);
        a.deallocate(p, size, Stream::LEGACY).unwrap();
        assert!(is_double(&a.deallocate(p, size, s)));
        bad += 1;
    }
    a.flush().unwrap();
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

/// A large request whose size class is bigger than the request rounded up to whole normal
/// superblocks (4 MiB + 1 byte: class 4.5 MiB, 17 superblocks of 256 KiB = 4.25 MiB), under a
/// cap that lets the pool lend only that rounding: the arena's halving reaches the request
/// rounded to whole superblocks, and the fresh superblock must serve it (it once failed the
/// fit by class and panicked: "a fresh superblock fits the request").
#[test]
fn a_large_request_under_a_cap_of_its_superblock_rounding_is_served_without_a_panic() {
    let sim = host(0);
    let size = 4 * MIB + 1;
    let a = alloc_with(&sim, small().max_bytes(4 * MIB + S));
    let p = a.allocate_per_thread(size).expect("4.25 MiB of room holds 4 MiB + 1");
    assert_eq!(lent(&a), vec![(p.0, 4 * MIB + S)]);
    tag(&sim, p, size, 3, Stream::PER_THREAD);
    check(&sim, p, size, 3, Stream::PER_THREAD);
    a.deallocate_per_thread(p, size).unwrap();
    // Again from another thread (the first one's arena keeps the superblock: reclaimed).
    on_thread(&a, move |a| {
        let q = a.allocate_per_thread(size).unwrap();
        a.deallocate_per_thread(q, size).unwrap();
    });
    assert_all_returned(&a, Some(&sim), 0);
}
