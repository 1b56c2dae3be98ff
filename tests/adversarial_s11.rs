//! Eleventh session's attacks (a helper's): shared legacy actions (sealed halves, tickets)
//! at thread exit, under OOM reclaim and bad frees; the slow path without the return rule
//! (memory an arena fed only by remote frees keeps); and the 16 MiB outbox batch.

#![allow(clippy::type_complexity)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

const K: usize = 64 << 10;

/// `n` blocks of `size` on the legacy stream, each held on another thread's per-thread stream
/// (a long write) so that reuse on a per-thread stream without a legacy action is caught.
fn legacy_blocks_used_elsewhere(
    sim: &HostDevice,
    a: &Allocator,
    n: usize,
    size: usize,
    hold_ms: u64,
) -> Vec<DeviceAddr> {
    let ps: Vec<_> = (0..n).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
    let uses: Vec<_> = ps.iter().map(|&p| (p, size)).collect();
    use_on_another_thread(sim, &uses, 100, hold_ms);
    ps
}

/// Another thread frees a whole legacy batch of its own: one legacy action.
fn other_thread_action(a: &Allocator, batch: usize) {
    on_thread(a, move |a| {
        let qs: Vec<_> = (0..batch).map(|_| a.allocate(4096, Stream::LEGACY).unwrap()).collect();
        for q in qs {
            a.deallocate(q, 4096, Stream::LEGACY).unwrap();
        }
    });
}

/// Takes `n` blocks on the calling thread's per-thread stream and overwrites them at once.
fn take_and_overwrite(sim: &HostDevice, a: &Allocator, n: usize, size: usize) -> Vec<DeviceAddr> {
    let qs: Vec<_> = (0..n).map(|_| a.allocate_per_thread(size).unwrap()).collect();
    for (i, q) in qs.iter().enumerate() {
        sim.write_tag(q.0, size, 5000 + i as u32, Stream::PER_THREAD).unwrap();
    }
    qs
}

/// A thread exits (or releases its arena) holding a sealed half (covered by another thread's
/// action, or not) and open frees: all go to the pool behind a lazy legacy fence, and another
/// thread's per-thread-stream reuse is ordered after the uses.
#[test]
fn exit_with_sealed_and_open_legacy_halves() {
    for covered in [false, true] {
        for release in [false, true] {
            let sim = host(0);
            let cfg = small().legacy_batch_blocks(8).build().unwrap();
            let a = host_allocator(sim.clone(), cfg).unwrap();
            let w = Worker::new(&a);
            let (sim2, a2) = (sim.clone(), a.clone());
            let ps = w.run(move |a| legacy_blocks_used_elsewhere(&sim2, a, 7, K, 30));
            let first = ps[..4].to_vec();
            w.run(move |a| first.iter().for_each(|p| a.deallocate(*p, K, Stream::LEGACY).unwrap()));
            if covered {
                other_thread_action(&a2, 8);
            }
            let rest = ps[4..].to_vec();
            w.run(move |a| {
                rest.iter().for_each(|p| a.deallocate(*p, K, Stream::LEGACY).unwrap());
                if release {
                    a.release_thread().unwrap();
                }
            });
            w.exit();
            let qs = take_and_overwrite(&sim, &a, 12, K);
            sim.synchronize();
            assert!(
                sim.violations().is_empty(),
                "covered {covered} release {release}: {:?}",
                sim.violations()
            );
            assert_eq!(sim.tag_errors(), 0, "covered {covered} release {release}");
            let live = Live::default();
            qs.iter().for_each(|q| live.insert(*q, K));
            live.assert_clean();
            for q in qs {
                a.deallocate_per_thread(q, K).unwrap();
            }
            assert_all_returned(&a, Some(&sim), 0);
        }
    }
}

/// Out of memory in another thread takes a live, idle thread's kept-back legacy frees (a
/// sealed half, covered or not, and open ones; some in superblocks that also hold a used
/// block, so dissolved). The owner then goes on: frees its used block on the legacy stream
/// (its superblock is the pool's now), churns legacy frees through seal/settle again; no
/// overlap, no reuse before the fences, all returned.
#[test]
fn oom_takes_an_idle_threads_sealed_half_then_the_owner_goes_on() {
    for covered in [false, true] {
        let sim = host(0);
        // 8 MiB: 32 superblocks of 256 KiB.
        let cfg = small().max_bytes(8 << 20).legacy_batch_blocks(16).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let w = Worker::new(&a);
        let sim2 = sim.clone();
        // 15 blocks of 64 KiB (~4 superblocks) plus 1 kept live.
        let ps = w.run(move |a| legacy_blocks_used_elsewhere(&sim2, a, 16, K, 20));
        let keep = ps[15];
        let freed = ps[..15].to_vec();
        // 8 frees: half of 16 sealed; then (maybe) an action; then 7 open.
        let f1 = freed[..8].to_vec();
        w.run(move |a| f1.iter().for_each(|p| a.deallocate(*p, K, Stream::LEGACY).unwrap()));
        if covered {
            other_thread_action(&a, 16);
        }
        let f2 = freed[8..].to_vec();
        w.run(move |a| f2.iter().for_each(|p| a.deallocate(*p, K, Stream::LEGACY).unwrap()));
        // The main thread needs the whole cap but the one live block's superblock share.
        let live = Arc::new(Live::default());
        live.insert(keep, K);
        let mut qs = Vec::new();
        for i in 0..(8 << 20) / K - 4 {
            match a.allocate_per_thread(K) {
                Ok(q) => {
                    live.insert(q, K);
                    sim.write_tag(q.0, K, 7000 + i as u32, Stream::PER_THREAD).unwrap();
                    qs.push(q);
                }
                Err(e) => panic!("covered {covered}: block {i} of the cap: {e} (stats {:?})", a.stats()),
            }
        }
        // The owner goes on: its live block (maybe now a pool block), then churn.
        let live2 = live.clone();
        let sim3 = sim.clone();
        w.run(move |a| {
            live2.remove(keep);
            a.deallocate(keep, K, Stream::LEGACY).unwrap();
            let mut tg = 0u32;
            for round in 0..20 {
                let mut v = Vec::new();
                for _ in 0..10 {
                    match a.allocate(K, Stream::LEGACY) {
                        Ok(p) => v.push(Held::taken(&sim3, &live2, p, K, Stream::LEGACY, &mut tg)),
                        Err(Error::OutOfMemory { .. }) => break,
                        Err(e) => panic!("round {round}: {e}"),
                    }
                }
                for h in v {
                    check(&sim3, h.p, h.size, h.t, Stream::LEGACY);
                    live2.remove(h.p);
                    a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
                }
            }
        });
        for q in qs {
            live.remove(q);
            a.deallocate_per_thread(q, K).unwrap();
        }
        w.exit();
        live.assert_clean();
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// A block in a sealed half is freed: a second free (owner on legacy, per-thread, a user
/// stream; another thread on legacy) and a wrong-size or interior free are refused and keep
/// nothing; the batch settles, blocks are reused once each, all returned.
#[test]
fn bad_frees_of_a_sealed_block_are_refused() {
    let sim = host(0);
    let cfg = small().legacy_batch_blocks(8).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let us = sim.create_stream();
    let ps: Vec<_> = (0..8).map(|_| a.allocate(1000, Stream::LEGACY).unwrap()).collect();
    for p in &ps[..4] {
        a.deallocate(*p, 1000, Stream::LEGACY).unwrap(); // sealed
    }
    let p = ps[0];
    let mut bad = 0;
    for s in [Stream::LEGACY, Stream::PER_THREAD, us] {
        let r = a.deallocate(p, 1000, s);
        assert!(is_double(&r), "{s:?}: {r:?}");
        bad += 1;
        let r = a.deallocate(p, 4000, s);
        assert!(is_invalid(&r), "wrong size {s:?}: {r:?}");
        bad += 1;
        let r = a.deallocate(DeviceAddr(p.0 + 256), 744, s);
        assert!(is_invalid(&r), "interior {s:?}: {r:?}");
        bad += 1;
    }
    let r = on_thread(&a, move |a| {
        let r = a.deallocate(p, 1000, Stream::LEGACY);
        a.flush().unwrap();
        r
    });
    // A remote double free may be refused later (deferred) rather than at once.
    if r.is_err() {
        assert!(is_double(&r), "{r:?}");
    }
    bad += 1;
    a.flush().unwrap();
    if r.is_ok() {
        let _ = a.take_deferred_error();
    }
    for q in &ps[4..] {
        a.deallocate(*q, 1000, Stream::LEGACY).unwrap(); // whole batch: settle/act
    }
    let live = Live::default();
    let again: Vec<_> = (0..16).map(|_| a.allocate(1000, Stream::LEGACY).unwrap()).collect();
    again.iter().for_each(|q| live.insert(*q, 1000));
    live.assert_clean();
    for q in again {
        a.deallocate(q, 1000, Stream::LEGACY).unwrap();
    }
    let _ = a.take_deferred_error();
    // `assert_all_returned` checks no deferred error is left only when bad_frees == 0.
    assert_all_returned(&a, Some(&sim), bad);
}

/// Mixed streams and threads under a small cap: blocks allocated on the legacy, per-thread and
/// a user stream, freed by their owner or handed to another thread, on any of its streams
/// (after an event wait on the last use's stream); with threads exiting and restarting and
/// reclaimers (trim, OOM). No overlap, no reuse before a fence, all returned.
#[test]
fn mixed_stream_frees_with_legacy_halves_under_a_cap() {
    let sim = host(5);
    let cfg = small().max_bytes(6 << 20).legacy_batch_blocks(8).batch_blocks(8).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicBool::new(false));
    let tags = Arc::new(AtomicU32::new(1));
    let (htx, hrx) = std::sync::mpsc::channel::<(DeviceAddr, usize, Stream, u32)>();
    let hrx = Arc::new(std::sync::Mutex::new(hrx));
    let mut hs = Vec::new();
    for t in 0..5u64 {
        let (a, live, stop, sim, htx, hrx, tags) =
            (a.clone(), live.clone(), stop.clone(), sim.clone(), htx.clone(), hrx.clone(), tags.clone());
        hs.push(std::thread::spawn(move || {
            let us = sim.create_stream();
            let streams = [Stream::LEGACY, Stream::PER_THREAD, us];
            let mut x = 0x9e37_79b9 ^ (t * 0x1234_5678) | 1;
            let mut iter = 0u64;
            let free_on = |p: DeviceAddr, n: usize, used: Stream, tg: u32, on: Stream| {
                if used != on {
                    let ev = sim.create_event().unwrap();
                    sim.record_event(ev, used).unwrap();
                    sim.stream_wait_event(on, ev).unwrap();
                    sim.destroy_event(ev);
                }
                check(&sim, p, n, tg, on);
                live.remove(p);
                a.deallocate(p, n, on).unwrap();
            };
            while !stop.load(Ordering::Relaxed) {
                iter += 1;
                let mut v = Vec::new();
                for _ in 0..12 {
                    let n = [1000, 4096, 24 << 10, 60 << 10, 200 << 10][rng(&mut x) as usize % 5];
                    let s = streams[rng(&mut x) as usize % 3];
                    match a.allocate(n, s) {
                        Ok(p) => {
                            live.insert(p, n);
                            let tg = tags.fetch_add(1, Ordering::Relaxed);
                            tag(&sim, p, n, tg, s);
                            v.push((p, n, s, tg));
                        }
                        Err(Error::OutOfMemory { .. }) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                for (p, n, s, tg) in v {
                    match rng(&mut x) % 4 {
                        0 => {
                            let _ = htx.send((p, n, s, tg));
                        }
                        _ => free_on(p, n, s, tg, streams[rng(&mut x) as usize % 3]),
                    }
                }
                // Others' blocks, freed on one of our streams.
                for _ in 0..6 {
                    let m = hrx.lock().unwrap().try_recv();
                    match m {
                        Ok((p, n, s, tg)) => {
                            let on = streams[rng(&mut x) as usize % 3];
                            // `s` may be another thread's per-thread stream: record there from
                            // here is not possible, so wait on everything instead.
                            if s == Stream::PER_THREAD || s != on {
                                sim.synchronize();
                            }
                            check(&sim, p, n, tg, on);
                            live.remove(p);
                            a.deallocate(p, n, on).unwrap();
                        }
                        Err(_) => break,
                    }
                }
                if iter.is_multiple_of(97) {
                    a.release_thread().unwrap();
                }
                if iter.is_multiple_of(31) {
                    let _ = a.flush();
                }
            }
            a.release_thread().unwrap();
            us
        }));
    }
    for k in 0..2 {
        let (a, stop) = (a.clone(), stop.clone());
        hs.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if k == 0 {
                    let _ = a.trim(false);
                } else if let Ok(p) = a.allocate(5 << 20, Stream::PER_THREAD) {
                    a.deallocate(p, 5 << 20, Stream::PER_THREAD).unwrap();
                }
                std::thread::sleep(Duration::from_micros(300));
            }
            a.release_thread().unwrap();
            Stream::NULL
        }));
    }
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    let streams: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    // Blocks still handed over: freed here on the legacy stream.
    sim.synchronize();
    while let Ok((p, n, _, tg)) = hrx.lock().unwrap().try_recv() {
        check(&sim, p, n, tg, Stream::LEGACY);
        live.remove(p);
        a.deallocate(p, n, Stream::LEGACY).unwrap();
    }
    // Those frees, of blocks whose owners have exited (pool blocks by now), wait in this
    // thread's outbox until a batch fills or the thread flushes (the stranded-memory bound's
    // "one outbox batch per thread"): send them, as every worker did at its exit. Without this
    // the pool still counted them in use whenever blocks were left in the channel at the stop
    // (a CI run on two cores: five of them, 235,520 bytes).
    a.release_thread().unwrap();
    drop(htx);
    live.assert_clean();
    assert!(a.take_deferred_error().is_none());
    assert_all_returned(&a, Some(&sim), 0);
    for s in streams.into_iter().filter(|s| *s != Stream::NULL) {
        sim.destroy_stream(s).unwrap();
    }
}

/// An arena whose blocks come back only as remote frees keeps what it borrowed (no return
/// rule at the slow path). Its owner then goes idle, or only allocates another size class:
/// out of memory in another thread must still get that memory, and so must `trim(false)`.
#[test]
fn remote_fed_arena_memory_is_reclaimed_when_the_owner_idles_or_changes_class() {
    for (mode, s) in
        [(0, Stream::LEGACY), (1, Stream::LEGACY), (0, Stream::PER_THREAD), (2, Stream::PER_THREAD)]
    {
        let sim = host(0);
        let cap = 32 << 20;
        let cfg = Config::builder().max_bytes(cap).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let owner = Worker::new(&a);
        let freer = Worker::new(&a);
        // Rounds: the owner allocates 64 blocks of 256 KiB (16 MiB), the freer frees them on
        // its own stream of the same kind and flushes.
        for _ in 0..5 {
            let ps =
                owner.run(move |a| (0..64).map(|_| a.allocate(256 << 10, s).unwrap()).collect::<Vec<_>>());
            freer.run(move |a| {
                ps.iter().for_each(|p| a.deallocate(*p, 256 << 10, s).unwrap());
                a.flush().unwrap();
            });
        }
        // The owner changes class: many 4 KiB blocks, live, through its slow path.
        let small_live = owner.run(move |a| {
            let v: Vec<_> = (0..200).map(|_| a.allocate(4096, s).unwrap()).collect();
            (v, a.stats().arena_held_bytes)
        });
        let (small_live, held) = small_live;
        assert!(held <= 24 << 20, "mode {mode} {s:?}: the owner holds {held} bytes for a 16 MiB working set");
        let got = match mode {
            1 => {
                // trim(false) from another thread: superblocks with no used block go back.
                let t = a.trim(false).unwrap();
                let after = a.stats().arena_held_bytes;
                assert!(after <= 4 << 20, "mode {mode} {s:?}: trim(false) released {t}, arenas hold {after}");
                None
            }
            _ => {
                // OOM in another thread: needs the whole cap but what the 4 KiB blocks take.
                let n = (cap - (2 << 20)) / (1 << 20);
                let r: Vec<_> = (0..n).map(|_| a.allocate_per_thread(1 << 20)).collect();
                let bad = r.iter().filter(|r| r.is_err()).count();
                let oks: Vec<_> = r.into_iter().filter_map(|r| r.ok()).collect();
                assert_eq!(bad, 0, "mode {mode} {s:?}: {bad} of {n} MiB failed, stats {:?}", a.stats());
                Some(oks)
            }
        };
        if mode == 2 {
            // The owner keeps allocating the new class meanwhile.
            owner.run(move |a| {
                for _ in 0..100 {
                    let p = a.allocate(8192, s).unwrap();
                    a.deallocate(p, 8192, s).unwrap();
                }
            });
        }
        for p in got.into_iter().flatten() {
            a.deallocate_per_thread(p, 1 << 20).unwrap();
        }
        owner.run(move |a| small_live.iter().for_each(|p| a.deallocate(*p, 4096, s).unwrap()));
        owner.exit();
        freer.exit();
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// The 16 MiB outbox: remote frees (under 64 blocks, under 16 MiB) wait in an idle thread's
/// outbox. Out of memory elsewhere cannot reach them (the stranded bound of `arena.rs`
/// counts one batch per other thread; `config.rs` says to set `batch_bytes` lower under a
/// tight cap): the 20 MiB request is refused, and nothing is lost; thread exit, `flush` and
/// `release_thread` send them, after which 20 MiB fit.
#[test]
fn remote_frees_waiting_in_an_idle_outbox() {
    for how in ["flush", "exit", "owner_exits_first"] {
        let sim = host(0);
        let cap = 24 << 20;
        let cfg = Config::builder().max_bytes(cap).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let owner = Worker::new(&a);
        let freer = Worker::new(&a);
        // 15 blocks of 1 MiB (< 16 MiB, < 64 blocks): the batch is not sent.
        let ps = owner
            .run(|a| (0..15).map(|_| a.allocate(1 << 20, Stream::PER_THREAD).unwrap()).collect::<Vec<_>>());
        freer.run(move |a| ps.iter().for_each(|p| a.deallocate(*p, 1 << 20, Stream::PER_THREAD).unwrap()));
        // Out of memory on the main thread: 20 MiB wanted; 15 of the 24 are in the freer's
        // outbox.
        match a.allocate_per_thread(20 << 20) {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("{how}: 20 MiB with 15 MiB in an idle outbox: {other:?}"),
        }
        match how {
            "flush" => freer.run(|a| a.flush().unwrap()),
            "exit" => {}
            _ => owner.run(|a| a.release_thread().unwrap()),
        }
        if how != "flush" {
            freer.exit();
        }
        let _ = a.trim(true);
        let p = a.allocate_per_thread(20 << 20).expect("after the outbox was sent, 20 MiB fit");
        a.deallocate_per_thread(p, 20 << 20).unwrap();
        owner.exit();
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// The owner's kept-back legacy frees and a live sibling thread: OOM in a third thread while
/// the owner is busy on another stream (not idle, not inside a call for long): retried until
/// it fits, with the owner never reusing its kept blocks early.
#[test]
fn oom_while_the_legacy_owner_is_busy_elsewhere() {
    let sim = host(2);
    let cfg = small().max_bytes(8 << 20).legacy_batch_blocks(64).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let live = Arc::new(Live::default());
    let (a2, stop2, live2, sim2) = (a.clone(), stop.clone(), live.clone(), sim.clone());
    let busy = std::thread::spawn(move || {
        let mut tg = 0;
        let mut rounds = 0;
        while !stop2.load(Ordering::Relaxed) {
            rounds += 1;
            // 20 blocks of 64 KiB freed on legacy: kept back (batch 64).
            let mut v = Vec::new();
            for _ in 0..20 {
                match a2.allocate(K, Stream::LEGACY) {
                    Ok(p) => v.push(Held::taken(&sim2, &live2, p, K, Stream::LEGACY, &mut tg)),
                    Err(Error::OutOfMemory { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            for h in v {
                check(&sim2, h.p, h.size, h.t, Stream::LEGACY);
                live2.remove(h.p);
                a2.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
            }
            // Busy on the per-thread stream meanwhile.
            for _ in 0..5 {
                if let Ok(p) = a2.allocate(4096, Stream::PER_THREAD) {
                    a2.deallocate(p, 4096, Stream::PER_THREAD).unwrap();
                }
            }
        }
        a2.release_thread().unwrap();
        rounds
    });
    let mut fails = 0;
    for i in 0..200 {
        let mut v = Vec::new();
        for _ in 0..((6 << 20) / K) {
            match a.allocate_per_thread(K) {
                Ok(q) => {
                    live.insert(q, K);
                    sim.write_tag(q.0, K, 90_000 + i, Stream::PER_THREAD).unwrap();
                    v.push(q);
                }
                Err(_) => {
                    fails += 1;
                    break;
                }
            }
        }
        for q in v {
            sim.check_tag(q.0, K, 90_000 + i, Stream::PER_THREAD).unwrap();
            live.remove(q);
            a.deallocate_per_thread(q, K).unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = busy.join().unwrap();
    eprintln!("busy owner rounds {rounds}, main OOM rounds {fails} of 200");
    live.assert_clean();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Remote-only frees with a pin (a live 4 KiB block) kept by the owner each round: the owner
/// never frees locally, so the return rule never runs. Reports held ÷ live against the rule's
/// bound `max(u + 2·S, u / 0.4)`, then checks OOM elsewhere gets the memory.
#[test]
fn remote_fed_arena_with_pins_held_against_the_rule_bound() {
    let sim = host(0);
    let cfg = small().build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    let s = Stream::LEGACY;
    let mut pins = Vec::new();
    let mut x = 77u64;
    for r in 0..300 {
        let sz = [40 << 10, 60 << 10, 24 << 10][r % 3];
        let n = 8 + (rng(&mut x) % 8) as usize;
        let (pin, ps) = owner.run(move |a| {
            let ps: Vec<_> = (0..n).map(|_| a.allocate(sz, s).unwrap()).collect();
            (a.allocate(4096, s).unwrap(), ps)
        });
        pins.push(pin);
        freer.run(move |a| {
            ps.iter().for_each(|p| a.deallocate(*p, sz, s).unwrap());
            a.flush().unwrap();
        });
    }
    let held = a.stats().arena_held_bytes as usize;
    let u = pins.len() * 4096;
    let bound = (u + 2 * (256 << 10)).max((u as f64 / 0.4) as usize);
    eprintln!("pins: held {held} live {u} rule bound {bound} ratio {:.1}", held as f64 / u as f64);
    // trim(false): superblocks with no used block only.
    let t = a.trim(false).unwrap();
    let after = a.stats().arena_held_bytes as usize;
    eprintln!("pins: trim(false) released {t}, arenas hold {after}");
    // OOM elsewhere: cap at what is reserved now, then ask for most of it.
    let reserved = a.stats().reserved_bytes as usize;
    a.set_limit_bytes(reserved);
    let want = reserved - u - (1 << 20);
    let r = a.allocate_per_thread(want);
    eprintln!("pins: OOM request of {want} of {reserved}: {:?}", r.as_ref().map(|_| ()));
    if let Ok(p) = r {
        a.deallocate_per_thread(p, want).unwrap();
    }
    owner.run(move |a| pins.iter().for_each(|p| a.deallocate(*p, 4096, s).unwrap()));
    owner.exit();
    freer.exit();
    assert!(held <= bound * 2, "held {held} live {u} bound {bound}");
    assert_all_returned(&a, Some(&sim), 0);
}

/// What `mixed_stream_frees_with_legacy_halves_under_a_cap` met once in CI: a free, on the
/// legacy stream, of a block whose owner has exited (a pool block by then) waits in the freeing
/// thread's outbox, counted in use by the pool, until that thread sends its batch.
#[test]
fn a_pool_block_freed_on_the_legacy_stream_waits_in_the_freeing_threads_outbox() {
    let sim = host(2);
    let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let a2 = a.clone();
    let p = std::thread::spawn(move || {
        let p = a2.allocate(4096, Stream::LEGACY).unwrap();
        a2.release_thread().unwrap();
        p
    })
    .join()
    .unwrap();
    assert!(a.pool_in_use() >= 4096, "the exited owner's block is a pool block in use");
    a.deallocate(p, 4096, Stream::LEGACY).unwrap();
    assert!(a.pool_in_use() >= 4096, "sent with this thread's next batch, not at once");
    a.release_thread().unwrap();
    assert_eq!(a.pool_in_use(), 0, "sent at this thread's release");
    assert_all_returned(&a, Some(&sim), 0);
}
