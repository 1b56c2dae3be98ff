//! Adversarial tests of commit 59783b9 (per-(stream, thread) fences, transit bits, reclaim from
//! idle arenas): double frees of every kind interleaved with owner exit and reclaim, races of
//! owners against `trim` and out-of-memory reclaimers under a small cap, fences of many threads on
//! the shared legacy stream. After each: no race-checker violation, no tag error, the pool's
//! invariants, statistics that add up, and every byte back.

#![allow(clippy::manual_is_multiple_of, clippy::type_complexity)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, RwLock};
use std::time::{Duration, Instant};

use cuarena::{Allocator, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

fn is_invalid(r: &cuarena::Result<()>) -> bool {
    matches!(r, Err(Error::InvalidFree { .. }))
}

// ---------------------------------------------------------------------------------------------
// Double frees, deterministic
// ---------------------------------------------------------------------------------------------

/// Every double free that can be told at once is refused at once, in every combination of
/// freeing thread and stream, with owner exit and reclaim in between.
#[test]
fn double_free_matrix() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small().batch_blocks(64).build().unwrap()).unwrap();
    let user = sim.create_stream();
    let mut bad = 0u64;
    let o = Worker::new(&a);
    for size in [256usize, 4096, 48 << 10, 64 << 10] {
        // 1. Owner, per-thread, twice (cached class and merged class).
        let r = o.run(move |a| {
            let p = a.allocate_per_thread(size).unwrap();
            a.deallocate_per_thread(p, size).unwrap();
            a.deallocate_per_thread(p, size)
        });
        assert!(is_invalid(&r), "owner PT twice, {size}: {r:?}");
        bad += 1;
        // 2. Owner on legacy (cross-stream, in transit), then again on PT, legacy and user.
        let (r1, r2, r3) = o.run(move |a| {
            let p = a.allocate_per_thread(size).unwrap();
            a.deallocate(p, size, Stream::LEGACY).unwrap();
            (
                a.deallocate_per_thread(p, size),
                a.deallocate(p, size, Stream::LEGACY),
                a.deallocate(p, size, user),
            )
        });
        assert!(is_invalid(&r1) && is_invalid(&r2) && is_invalid(&r3), "{size}: {r1:?} {r2:?} {r3:?}");
        bad += 3;
        // 3. Remote thread frees (parked in its outbox), owner then frees; remote again.
        let p = o.run(move |a| a.allocate_per_thread(size).unwrap());
        let rb = on_thread(&a, move |a| {
            a.deallocate_per_thread(p, size).unwrap();
            a.deallocate(p, size, Stream::LEGACY)
        });
        assert!(is_invalid(&rb), "remote twice, {size}: {rb:?}");
        bad += 1;
        let r = o.run(move |a| a.deallocate_per_thread(p, size));
        // The first free may have arrived by now (the remote thread exited and flushed): then
        // the owner sees it pending or free; either way refused.
        assert!(is_invalid(&r), "owner after remote, {size}: {r:?}");
        bad += 1;
        // 4. Remote free parked in an outbox, reclaim by trim from a third thread, again.
        let p = o.run(move |a| a.allocate_per_thread(size).unwrap());
        let remote = Worker::new(&a);
        remote.run(move |a| a.deallocate_per_thread(p, size).unwrap());
        on_thread(&a, |a| a.trim(false).map(|_| ())).unwrap();
        let r = remote.run(move |a| a.deallocate_per_thread(p, size));
        assert!(is_invalid(&r), "remote after trim, {size}: {r:?}");
        bad += 1;
        remote.run(|a| a.flush().unwrap());
        on_thread(&a, |a| a.trim(true).map(|_| ())).unwrap();
        let r = remote.run(move |a| a.deallocate(p, size, user));
        assert!(is_invalid(&r), "remote after flush+trim, {size}: {r:?}");
        bad += 1;
        remote.exit();
    }
    // 5. Remote free parked, owner exits (dissolving), remote again; then after exit.
    let o2 = Worker::new(&a);
    let p = o2.run(|a| a.allocate_per_thread(4096).unwrap());
    let q = o2.run(|a| a.allocate_per_thread(4096).unwrap());
    let remote = Worker::new(&a);
    remote.run(move |a| a.deallocate_per_thread(p, 4096).unwrap());
    o2.exit();
    let r = remote.run(move |a| a.deallocate(p, 4096, Stream::LEGACY));
    assert!(is_invalid(&r), "remote after owner exit: {r:?}");
    bad += 1;
    // q: a pool block now. Free once remotely on a user stream, twice refused.
    remote.run(move |a| a.deallocate(q, 4096, user).unwrap());
    let r = remote.run(move |a| a.deallocate(q, 4096, user));
    assert!(is_invalid(&r), "pool block twice: {r:?}");
    bad += 1;
    let r = a.deallocate_per_thread(q, 4096);
    assert!(is_invalid(&r), "pool block third time: {r:?}");
    bad += 1;
    remote.exit();
    o.exit();
    assert!(sim.destroy_stream(user).is_ok());
    assert_all_returned(&a, Some(&sim), bad);
}

/// Interior pointers and wrong sizes, locally and remotely, of arena and pool blocks.
#[test]
fn interior_pointers_and_wrong_sizes_are_refused_and_change_nothing() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small().batch_blocks(2).build().unwrap()).unwrap();
    let o = Worker::new(&a);
    let mut bad = 0;
    let p = o.run(|a| a.allocate_per_thread(8192).unwrap());
    // Local interior pointer, unaligned pointer, wrong sizes.
    for (ptr, size) in [(p.0 + 256, 256), (p.0 + 1, 8192), (p.0, 4096), (p.0, 16384), (p.0, 1 << 20)] {
        let r = o.run(move |a| a.deallocate_per_thread(DeviceAddr(ptr), size));
        assert!(is_invalid(&r), "local ({:#x}, {size}): {r:?}", ptr - p.0);
        bad += 1;
    }
    // Remote interior pointer and unaligned ones: refused at once when possible, else later.
    for (ptr, size) in [(p.0 + 256, 256), (p.0 + 4, 8192), (p.0 + 512, 7680)] {
        let _ = on_thread(&a, move |a| a.deallocate_per_thread(DeviceAddr(ptr), size));
        bad += 1;
    }
    o.run(|a| a.flush().unwrap()); // drains: the deferred ones are counted now
    // The block is intact and freed once, legitimately.
    sim.write_tag(p.0, 8192, 77, Stream::PER_THREAD).ok();
    o.run(move |a| a.deallocate_per_thread(p, 8192)).unwrap();
    // Pool block: interior, wrong size, overflow-prone addresses.
    let big = a.allocate(1 << 20, Stream::LEGACY).unwrap();
    for (ptr, size) in
        [(big.0 + 256, 256), (big.0, 512 << 10), (big.0, 2 << 20), (u64::MAX - 255, 256), (u64::MAX, 1)]
    {
        assert!(is_invalid(&a.deallocate(DeviceAddr(ptr), size, Stream::LEGACY)), "({ptr:#x}, {size})");
        bad += 1;
    }
    a.deallocate(big, 1 << 20, Stream::LEGACY).unwrap();
    assert!(a.take_deferred_error().is_some());
    o.exit();
    assert_all_returned(&a, Some(&sim), bad);
}

/// A remote free with the wrong size is invalid; while it travels, it must not make the
/// owner's correct free of the same block fail ("a bad free changes nothing").
#[test]
#[ignore = "known limitation (README): a wrong-size free still on its way holds the block's transit bit, so a correct free made before it is processed is refused as a double free"]
fn a_wrong_size_remote_free_does_not_block_the_correct_free() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small().batch_blocks(64).build().unwrap()).unwrap();
    let o = Worker::new(&a);
    let p = o.run(|a| a.allocate_per_thread(4096).unwrap());
    let remote = Worker::new(&a);
    // 8192 is a different class: invalid, but only the owner can tell (later).
    let r = remote.run(move |a| a.deallocate_per_thread(p, 8192));
    let mut bad = 1;
    if r.is_err() {
        // Refused at once: fine.
        assert!(is_invalid(&r));
    }
    let legit = o.run(move |a| a.deallocate_per_thread(p, 4096));
    let legit_ok = legit.is_ok();
    if !legit_ok {
        bad += 1; // counted as invalid
    }
    remote.run(|a| a.flush().unwrap());
    o.run(|a| a.flush().unwrap());
    remote.exit();
    if !legit_ok {
        // Free it again so the rest of the checks run; report the failure after.
        o.run(move |a| a.deallocate_per_thread(p, 4096)).unwrap();
    }
    o.exit();
    assert_all_returned(&a, Some(&sim), bad);
    assert!(legit_ok, "the owner's correct free was refused because of a wrong-size remote free: {legit:?}");
}

/// Same, with a third thread's correct free after the wrong-size remote one.
#[test]
#[ignore = "known limitation (README): a wrong-size free still on its way holds the block's transit bit, so a correct free made before it is processed is refused as a double free"]
fn a_wrong_size_remote_free_does_not_block_a_correct_remote_free() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small().batch_blocks(64).build().unwrap()).unwrap();
    let o = Worker::new(&a);
    let p = o.run(|a| a.allocate_per_thread(4096).unwrap());
    let r1 = Worker::new(&a);
    let r2 = Worker::new(&a);
    r1.run(move |a| a.deallocate_per_thread(p, 256)).unwrap();
    let legit = r2.run(move |a| a.deallocate_per_thread(p, 4096));
    let legit_ok = legit.is_ok();
    r1.run(|a| a.flush().unwrap());
    r2.run(|a| a.flush().unwrap());
    o.run(|a| a.flush().unwrap());
    let bad = if legit_ok { 1 } else { 2 };
    if !legit_ok {
        o.run(move |a| a.deallocate_per_thread(p, 4096)).unwrap();
    }
    r1.exit();
    r2.exit();
    o.exit();
    assert_all_returned(&a, Some(&sim), bad);
    assert!(legit_ok, "a correct remote free was refused because of a wrong-size one: {legit:?}");
}

/// Blocks handed between threads, freed by the receiver on each kind of stream, while the
/// owner is idle and a third thread trims; then the owner exits with frees still parked.
#[test]
fn handed_blocks_freed_on_every_stream_with_reclaim_and_exit() {
    let sim = host(200);
    let a = host_allocator(sim.clone(), small().batch_blocks(16).build().unwrap()).unwrap();
    for round in 0..6u32 {
        let o = Worker::new(&a);
        let blocks: Vec<(DeviceAddr, usize)> = o.run(move |a| {
            (0..200)
                .map(|i| {
                    let n = 256 << (i % 9);
                    let p = a.allocate_per_thread(n).unwrap();
                    (p, n)
                })
                .collect()
        });
        // The owner's own work on them, on its per-thread stream.
        let (b2, sim1) = (blocks.clone(), sim.clone());
        o.run(move |_| {
            for &(p, n) in &b2 {
                sim1.hold_and_check(p.0, n.min(4096), round, Duration::from_micros(50), Stream::PER_THREAD)
                    .unwrap();
            }
        });
        // The owner's per-thread work is the receiver's: order it by an event.
        let ev = o.run(|a| {
            let d = a.device();
            let e = d.create_event().unwrap();
            d.record_event(e, Stream::PER_THREAD).unwrap();
            e
        });
        let sim2 = sim.clone();
        let (recv_tx, recv_rx) = mpsc::channel::<()>();
        let a2 = a.clone();
        let receiver = std::thread::spawn(move || {
            let user = sim2.create_stream();
            for s in [Stream::PER_THREAD, Stream::LEGACY, user] {
                a2.device().stream_wait_event(s, ev).unwrap();
            }
            for (i, &(p, n)) in blocks.iter().enumerate() {
                let s = [Stream::PER_THREAD, Stream::LEGACY, user][i % 3];
                sim2.hold_and_check(p.0, n.min(4096), 1000 + round, Duration::from_micros(30), s).unwrap();
                a2.deallocate(p, n, s).unwrap();
                if i == 100 {
                    recv_tx.send(()).unwrap();
                }
            }
            sim2.destroy_stream(user).unwrap(); // right after the frees
            a2.release_thread().unwrap();
        });
        recv_rx.recv().unwrap();
        let t = on_thread(&a, move |a| a.trim(round % 2 == 0));
        t.unwrap();
        if round % 3 == 0 {
            o.exit();
            receiver.join().unwrap();
        } else {
            receiver.join().unwrap();
            o.exit();
        }
        // New blocks on user streams must not land on running work.
        let user = sim.create_stream();
        let v: Vec<_> = (0..50).map(|_| a.allocate(64 << 10, user).unwrap()).collect();
        for &p in &v {
            sim.write_tag(p.0, 64 << 10, 5, user).unwrap();
        }
        for p in v {
            a.deallocate(p, 64 << 10, user).unwrap();
        }
        sim.destroy_stream(user).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// Races
// ---------------------------------------------------------------------------------------------

/// One owner-thread loop: random small blocks on its per-thread stream, tagged, checked before
/// each free, some freed on legacy. OOM is allowed (the cap is small).
fn owner_loop(a: &Allocator, sim: &HostDevice, live: &Live, seed: u64, stop: &AtomicBool, hold_us: u64) {
    let mut x = seed | 1;
    let mut mine: Vec<(DeviceAddr, usize, u32)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let r = rng(&mut x);
        if mine.len() < 48 && (r % 3 != 0 || mine.is_empty()) {
            let n = 256 << (rng(&mut x) % 9); // 256 B .. 64 KiB
            let n = n - (rng(&mut x) % 4) as usize * 64;
            match a.allocate_per_thread(n) {
                Ok(p) => {
                    live.insert(p, n);
                    let tag = rng(&mut x) as u32 | 1;
                    let len = n.min(2048) & !3;
                    sim.hold_and_check(
                        p.0,
                        len,
                        tag,
                        Duration::from_micros(rng(&mut x) % (hold_us + 1)),
                        Stream::PER_THREAD,
                    )
                    .unwrap();
                    mine.push((p, n, tag));
                }
                Err(Error::OutOfMemory { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        } else if !mine.is_empty() {
            let i = (rng(&mut x) % mine.len() as u64) as usize;
            let (p, n, tag) = mine.swap_remove(i);
            let len = n.min(2048) & !3;
            sim.check_tag(p.0, len, tag, Stream::PER_THREAD).unwrap();
            live.remove(p);
            let s = if rng(&mut x) % 8 == 0 { Stream::LEGACY } else { Stream::PER_THREAD };
            a.deallocate(p, n, s).unwrap();
        }
        if rng(&mut x) % 500 == 0 {
            // Sometimes exit and come back (a new arena, maybe on a recycled shell).
            for (p, n, _) in mine.drain(..) {
                live.remove(p);
                a.deallocate_per_thread(p, n).unwrap();
            }
            a.release_thread().unwrap();
        }
    }
    for (p, n, tag) in mine {
        sim.check_tag(p.0, n.min(2048) & !3, tag, Stream::PER_THREAD).unwrap();
        live.remove(p);
        a.deallocate_per_thread(p, n).unwrap();
    }
    a.release_thread().unwrap();
}

/// Owners allocate and free while pressure threads fill the cap with large blocks on user
/// streams (their OOM reclaims the owners' arenas, dissolving) and trim in loops.
fn owners_vs_reclaimers(owners: usize, pressers: usize, secs: u64, seed: u64) {
    let sim = host(30);
    let cfg = small().max_bytes(6 << 20).batch_blocks(8).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicBool::new(false));
    let ooms = Arc::new(AtomicU64::new(0));
    let mut hs = Vec::new();
    for t in 0..owners {
        let (a, sim, live, stop) = (a.clone(), sim.clone(), live.clone(), stop.clone());
        hs.push(std::thread::spawn(move || {
            owner_loop(&a, &sim, &live, seed ^ (t as u64 * 0x9e37_79b9), &stop, 40)
        }));
    }
    for t in 0..pressers {
        let (a, sim, live, stop, ooms) = (a.clone(), sim.clone(), live.clone(), stop.clone(), ooms.clone());
        hs.push(std::thread::spawn(move || {
            let user = sim.create_stream();
            let mut x = seed.wrapping_add(t as u64 * 77) | 1;
            while !stop.load(Ordering::Relaxed) {
                let mut v = Vec::new();
                loop {
                    let n = (256 << 10) << (rng(&mut x) % 3);
                    let s = if rng(&mut x) % 2 == 0 { user } else { Stream::LEGACY };
                    match a.allocate(n, s) {
                        Ok(p) => {
                            live.insert(p, n);
                            sim.write_tag(p.0, 4096, 9, s).unwrap();
                            v.push((p, n, s));
                        }
                        Err(Error::OutOfMemory { .. }) => {
                            ooms.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                    if v.len() > 64 {
                        break;
                    }
                }
                for (p, n, s) in v {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                match rng(&mut x) % 4 {
                    0 => drop(a.trim(false).unwrap()),
                    1 => drop(a.trim(true).unwrap()),
                    _ => {}
                }
            }
            a.release_thread().unwrap();
            sim.destroy_stream(user).unwrap();
        }));
    }
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    assert!(ooms.load(Ordering::Relaxed) > 0, "the cap was never hit");
    let s = a.stats();
    eprintln!(
        "ooms {} dissolved {} returned {} taken {} allocations {}",
        ooms.load(Ordering::Relaxed),
        s.superblocks_dissolved,
        s.superblocks_returned,
        s.superblocks_taken,
        s.allocations
    );
    assert!(a.take_deferred_error().is_none(), "{:?}", a.take_deferred_error());
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn race_owners_against_oom_reclaim_and_trim_2x2() {
    owners_vs_reclaimers(2, 2, 3, 11);
}

#[test]
fn race_owners_against_oom_reclaim_and_trim_6x3() {
    owners_vs_reclaimers(6, 3, 4, 12);
}

/// Owners only, under a cap they fill together: each one's OOM reclaims (and dissolves) the
/// others' arenas while they run.
#[test]
fn race_owners_reclaiming_each_other() {
    let sim = host(30);
    let cfg = small().max_bytes(3 << 20).batch_blocks(8).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..6)
        .map(|t| {
            let (a, sim, live, stop) = (a.clone(), sim.clone(), live.clone(), stop.clone());
            std::thread::spawn(move || owner_loop(&a, &sim, &live, 1234 + t * 99, &stop, 0))
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    let s = a.stats();
    eprintln!(
        "dissolved {} returned {} taken {}",
        s.superblocks_dissolved, s.superblocks_returned, s.superblocks_taken
    );
    assert!(a.take_deferred_error().is_none(), "{:?}", a.take_deferred_error());
    assert_all_returned(&a, Some(&sim), 0);
}

/// Threads that allocate a little, hand it on, and exit at once, while others trim: exit
/// must wait out a reclaimer holding its arena, and recycled shells must work.
#[test]
fn race_thread_exit_against_trim() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small().batch_blocks(4).build().unwrap()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let trimmers: Vec<_> = (0..2)
        .map(|t| {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    a.trim(t == 0).unwrap();
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    let (tx, rx) = mpsc::channel::<Vec<(DeviceAddr, usize)>>();
    let sink = {
        let a = a.clone();
        std::thread::spawn(move || {
            for v in rx {
                for (p, n) in v {
                    a.deallocate(p, n, Stream::LEGACY).unwrap();
                }
            }
            a.release_thread().unwrap();
        })
    };
    let live = Arc::new(Live::default());
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < Duration::from_secs(3) {
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let (a, tx, live) = (a.clone(), tx.clone(), live.clone());
                std::thread::spawn(move || {
                    let mut v = Vec::new();
                    for i in 0..40 {
                        let sz = 256 << ((i + t) % 8);
                        let p = a.allocate_per_thread(sz).unwrap();
                        live.insert(p, sz);
                        v.push((p, sz));
                    }
                    // Free half locally, hand half on; exit without release_thread (TLS drop).
                    let hand = v.split_off(20);
                    for (p, sz) in v {
                        live.remove(p);
                        a.deallocate_per_thread(p, sz).unwrap();
                    }
                    for &(p, _) in &hand {
                        live.remove(p);
                    }
                    tx.send(hand).unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        n += 1;
    }
    drop(tx);
    sink.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    for t in trimmers {
        t.join().unwrap();
    }
    assert!(n > 5);
    live.assert_clean();
    assert!(a.take_deferred_error().is_none(), "{:?}", a.take_deferred_error());
    assert_all_returned(&a, Some(&sim), 0);
}

/// 2..8 threads free neighbouring pool blocks on the shared legacy stream behind long work;
/// other threads reuse the coalesced memory on user streams. Any reuse before a legacy
/// free's work completes is a race-checker violation or a tag error.
#[test]
fn fences_of_many_threads_on_the_legacy_stream() {
    for threads in [2usize, 3, 5, 8] {
        let sim = host(0);
        let cfg = small().chunk(4 << 20).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        for round in 0..4u64 {
            let blocks: Vec<DeviceAddr> =
                (0..threads).map(|_| a.allocate(128 << 10, Stream::LEGACY).unwrap()).collect();
            let start = Arc::new(Barrier::new(threads + 1));
            let hs: Vec<_> = blocks
                .iter()
                .enumerate()
                .map(|(i, &p)| {
                    let (a, sim, start) = (a.clone(), sim.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        // Staggered: later threads queue longer work, but may free first.
                        std::thread::sleep(Duration::from_micros(((threads - i) as u64 * 300) % 1000));
                        let hold = Duration::from_millis(5 + ((i as u64 * 7 + round) % 4) * 10);
                        sim.hold_and_check(p.0, 128 << 10, 0x100 + i as u32, hold, Stream::LEGACY).unwrap();
                        a.deallocate(p, 128 << 10, Stream::LEGACY).unwrap();
                        a.release_thread().unwrap();
                    })
                })
                .collect();
            start.wait();
            // Reuse as soon as anything is free, from user streams on other threads.
            let reusers: Vec<_> = (0..2)
                .map(|r| {
                    let (a, sim) = (a.clone(), sim.clone());
                    std::thread::spawn(move || {
                        let user = sim.create_stream();
                        let deadline = Instant::now() + Duration::from_millis(80);
                        while Instant::now() < deadline {
                            let n = (64 << 10) * (1 + r);
                            let p = a.allocate(n, user).unwrap();
                            sim.write_tag(p.0, n, 0xdead, user).unwrap();
                            a.deallocate(p, n, user).unwrap();
                        }
                        sim.destroy_stream(user).unwrap();
                        a.release_thread().unwrap();
                    })
                })
                .collect();
            for h in hs.into_iter().chain(reusers) {
                h.join().unwrap();
            }
        }
        sim.synchronize();
        assert!(sim.violations().is_empty(), "{threads} threads: {:?}", &sim.violations()[..1]);
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Small blocks of idle owners freed by many threads on the legacy stream behind long work;
/// trim and OOM reclaim hand the superblocks to the pool, where user streams reuse them.
#[test]
fn legacy_frees_of_arena_blocks_then_reclaim_then_user_stream_reuse() {
    let sim = host(0);
    let cfg = small().max_bytes(4 << 20).batch_blocks(4).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    for round in 0..3u32 {
        let owners: Vec<Worker> = (0..3).map(|_| Worker::new(&a)).collect();
        let mut all = Vec::new();
        for o in &owners {
            all.extend(
                o.run(|a| (0..40).map(|_| a.allocate_per_thread(16 << 10).unwrap()).collect::<Vec<_>>()),
            );
        }
        let chunks: Vec<Vec<DeviceAddr>> = all.chunks(all.len().div_ceil(6)).map(<[_]>::to_vec).collect();
        let hs: Vec<_> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                let (a, sim) = (a.clone(), sim.clone());
                std::thread::spawn(move || {
                    for p in v {
                        let hold = Duration::from_micros(200 + (i as u64 * 131) % 800);
                        sim.hold_and_check(p.0, 16 << 10, 7 + round, hold, Stream::LEGACY).unwrap();
                        a.deallocate(p, 16 << 10, Stream::LEGACY).unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        // Owners idle: fill the cap on a user stream (OOM reclaim), then trim.
        let user = sim.create_stream();
        let mut v = Vec::new();
        while let Ok(p) = a.allocate(256 << 10, user) {
            sim.write_tag(p.0, 256 << 10, 3, user).unwrap();
            v.push(p);
        }
        assert!(v.len() >= 10, "reclaim gave the cap back: {}", v.len());
        for p in v {
            a.deallocate(p, 256 << 10, user).unwrap();
        }
        a.trim(false).unwrap();
        sim.destroy_stream(user).unwrap();
        for o in owners {
            o.exit();
        }
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A heavy random mix: stress-style threads with hand-offs, double frees injected (counted),
/// trims and OOMs, under a small cap.
#[test]
fn heavy_random_mix_with_injected_bad_frees() {
    let sim = host(40);
    let cfg = small().max_bytes(8 << 20).batch_blocks(6).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let bad = Arc::new(AtomicU64::new(0));
    let live = Arc::new(Live::default());
    let threads = 5;
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| mpsc::channel::<(DeviceAddr, usize, cuarena::Event)>()).unzip();
    let barrier = Arc::new(Barrier::new(threads));
    let gate = Arc::new(RwLock::new(()));
    let hs: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let tx = txs[(t + 1) % threads].clone();
            let (a, sim, bad, live, barrier, gate) =
                (a.clone(), sim.clone(), bad.clone(), live.clone(), barrier.clone(), gate.clone());
            std::thread::spawn(move || {
                let user = sim.create_stream();
                let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
                let mut x = 0xabcdef ^ (t as u64 * 1_000_003) | 1;
                let mut mine: Vec<(DeviceAddr, usize)> = Vec::new();
                for step in 0..3000 {
                    while let Ok((p, n, ev)) = rx.try_recv() {
                        let s = streams[(rng(&mut x) % 3) as usize];
                        // The sender's work is ordered before the free stream by its event.
                        a.device().stream_wait_event(s, ev).unwrap();
                        a.device().destroy_event(ev);
                        live.remove(p);
                        if rng(&mut x) % 10 == 0 {
                            // An immediate second free: the first is in transit or in the pool.
                            // No thread allocates between the two (`gate`): a block handed out
                            // again cannot be told from a new one (the README's contract).
                            let _no_allocations = gate.write().unwrap();
                            a.deallocate(p, n, s).unwrap();
                            let r = a.deallocate(p, n, streams[(rng(&mut x) % 3) as usize]);
                            assert!(r.is_err(), "double free accepted: {r:?}");
                            bad.fetch_add(1, Ordering::Relaxed);
                        } else {
                            a.deallocate(p, n, s).unwrap();
                        }
                    }
                    let r = rng(&mut x) % 100;
                    if r < 45 || mine.is_empty() {
                        let n = if r % 9 == 0 { 300 << 10 } else { 256 << (rng(&mut x) % 9) };
                        let s = if r % 5 == 0 { user } else { Stream::PER_THREAD };
                        let got = {
                            let _gate = gate.read().unwrap();
                            a.allocate(n, s)
                        };
                        match got {
                            Ok(p) => {
                                live.insert(p, n);
                                sim.hold_and_check(
                                    p.0,
                                    n.min(1024),
                                    t as u32 + 1,
                                    Duration::from_micros(20),
                                    s,
                                )
                                .unwrap();
                                if s == user {
                                    // Hand-offs and cross-stream frees need order: free it here.
                                    live.remove(p);
                                    a.deallocate(p, n, user).unwrap();
                                } else {
                                    mine.push((p, n));
                                }
                            }
                            Err(Error::OutOfMemory { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                    } else if r < 70 {
                        let (p, n) = mine.swap_remove((rng(&mut x) % mine.len() as u64) as usize);
                        live.remove(p);
                        if r % 7 == 0 {
                            // The first free may give the block's superblock back (the return
                            // rule), and another thread's arena may borrow it and hand the block
                            // out before the second free: as above, no allocation in between.
                            let _no_allocations = gate.write().unwrap();
                            a.deallocate_per_thread(p, n).unwrap();
                            let r2 = a.deallocate_per_thread(p, n);
                            bad.fetch_add(1, Ordering::Relaxed);
                            assert!(r2.is_err(), "local double free accepted: {r2:?}");
                        } else {
                            a.deallocate_per_thread(p, n).unwrap();
                        }
                    } else if r < 90 {
                        let (p, n) = mine.swap_remove((rng(&mut x) % mine.len() as u64) as usize);
                        // Hand it on with an event ordering this thread's work before it.
                        let ev = a.device().create_event().unwrap();
                        a.device().record_event(ev, Stream::PER_THREAD).unwrap();
                        tx.send((p, n, ev)).unwrap();
                    } else if r < 93 {
                        a.trim(r == 90).unwrap();
                    } else if r < 94 && step % 5 == 0 {
                        for (p, n) in mine.drain(..) {
                            live.remove(p);
                            a.deallocate_per_thread(p, n).unwrap();
                        }
                        a.release_thread().unwrap();
                    }
                }
                drop(tx);
                barrier.wait();
                for (p, n, ev) in rx {
                    a.device().stream_wait_event(Stream::LEGACY, ev).unwrap();
                    a.device().destroy_event(ev);
                    live.remove(p);
                    a.deallocate(p, n, Stream::LEGACY).unwrap();
                }
                for (p, n) in mine {
                    live.remove(p);
                    a.deallocate_per_thread(p, n).unwrap();
                }
                a.release_thread().unwrap();
                sim.destroy_stream(user).unwrap();
            })
        })
        .collect();
    drop(txs);
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    let _ = a.take_deferred_error();
    assert_all_returned(&a, Some(&sim), bad.load(Ordering::Relaxed));
}

/// The owner frees its block on its per-thread stream, then again on the legacy stream. The
/// owner can read its own tags, so the second free can be refused at once; accepted, it
/// travels to the owner's inbox and, if the block was handed out again meanwhile, frees the
/// new live block ("a double free is caught while the block has not been handed out again").
#[test]
fn the_owners_cross_stream_double_free_is_refused_at_once() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().batch_blocks(64).build().unwrap()).unwrap();
    let mut failures = Vec::new();
    let mut bad = 0;
    for size in [4096usize, 48 << 10] {
        let p = a.allocate_per_thread(size).unwrap();
        a.deallocate_per_thread(p, size).unwrap();
        let second = a.deallocate(p, size, Stream::LEGACY);
        bad += 1;
        if second.is_ok() {
            failures.push(format!("{size}: second free on legacy accepted"));
        }
        // The block is handed out again before the second free is drained.
        let q = a.allocate_per_thread(size).unwrap();
        a.flush().unwrap(); // sends and drains the second free
        std::thread::sleep(Duration::from_millis(5));
        a.flush().unwrap(); // its fence is done: applied
        let r = a.allocate_per_thread(size).unwrap();
        if q == p && r == q {
            failures.push(format!("{size}: live block {q:?} handed out twice"));
        }
        a.deallocate_per_thread(r, size).unwrap();
        if r != q {
            a.deallocate_per_thread(q, size).unwrap();
        }
    }
    let _ = a.take_deferred_error();
    assert!(failures.is_empty(), "{failures:?}");
    assert_all_returned(&a, Some(&sim), bad);
}

/// A block left live by an exited thread is freed (the pool takes it, its superblock being
/// dissolved), the pool lends the whole range to another thread's arena, and the block is
/// freed again before that arena hands anything out at its address: the second free is
/// refused at once, on every stream, whichever way the first free reached the pool (a user
/// stream's free straight to the pool, a batched free on the per-thread or legacy stream, or
/// a free on its way to the exited owner that the pool took in).
#[test]
fn a_double_free_after_the_pool_lent_the_range_again_is_refused_at_once() {
    const SB: u64 = 256 << 10;
    for first in 0..4 {
        for second in 0..3 {
            let sim = host(0);
            let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
            let user = sim.create_stream();
            let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
            // The owner takes two blocks and frees the first: `p` starts 16 granules in.
            let owner = Worker::new(&a);
            let p = owner.run(|a| {
                let q = a.allocate_per_thread(4096).unwrap();
                let p = a.allocate_per_thread(4096).unwrap();
                a.deallocate_per_thread(q, 4096).unwrap();
                p
            });
            if first == 3 {
                // On its way to the owner when the owner exits: the pool takes it in.
                a.deallocate(p, 4096, user).unwrap();
                owner.exit();
                a.flush().unwrap();
                a.trim(true).unwrap(); // delivers the parked free (a device synchronise)
            } else {
                owner.exit();
                a.deallocate(p, 4096, streams[first]).unwrap();
                a.flush().unwrap();
            }
            a.device().synchronize().unwrap();
            // Another thread's arena borrows the range: its first block is carved at the
            // superblock's start, below `p`.
            let lender = Worker::new(&a);
            let b = lender.run(|a| a.allocate_per_thread(256).unwrap());
            assert_eq!(b.0 & !(SB - 1), p.0 & !(SB - 1), "the range was lent again ({first}, {second})");
            assert_ne!(b, p);
            let r = a.deallocate(p, 4096, streams[second]);
            assert!(is_double(&r), "first free on {first}, second on {second}: {r:?}");
            lender.run(move |a| a.deallocate_per_thread(b, 256).unwrap());
            lender.exit();
            a.flush().unwrap();
            a.trim(true).unwrap();
            assert!(a.take_deferred_error().is_none());
            assert_all_returned(&a, Some(&sim), 1);
            sim.destroy_stream(user).unwrap();
        }
    }
}
