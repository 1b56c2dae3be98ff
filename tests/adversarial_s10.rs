//! Tenth session's attacks (a helper's): the user-stream fast free racing reclaimers and
//! cross-thread frees, the OOM hook freeing other threads' blocks while threads exit, a
//! failed identity query inside a user arena's return rule, and bad frees on every kind of
//! stream.

#![allow(clippy::type_complexity)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cuarena::{Allocator, Device, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

/// Owners churn on their own user stream (fast frees, no identity asked) while reclaimers
/// (OOM under a small cap, trim(false), trim(true)) take their arenas, and some blocks are
/// handed to another thread to free on that thread's own stream after an event wait.
#[test]
fn user_stream_fast_frees_race_reclaimers_and_cross_thread_frees() {
    let sim = host(5);
    let cfg = small().max_bytes(6 << 20).batch_blocks(8).large_max(128 << 10).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicBool::new(false));
    let (htx, hrx) = std::sync::mpsc::channel::<(DeviceAddr, usize, Stream, u32)>();
    let hrx = Arc::new(std::sync::Mutex::new(hrx));
    let tags = Arc::new(AtomicU64::new(1));
    let mut hs = Vec::new();
    for t in 0..6u64 {
        let (a, live, stop, sim, htx, tags) =
            (a.clone(), live.clone(), stop.clone(), sim.clone(), htx.clone(), tags.clone());
        hs.push(std::thread::spawn(move || {
            let s = sim.create_stream();
            let mut x = 0x1234_5678 ^ (t * 0x9e37) | 1;
            while !stop.load(Ordering::Relaxed) {
                let mut v = Vec::new();
                for _ in 0..10 {
                    let n = match rng(&mut x) % 3 {
                        0 => 24 << 10,
                        1 => 48 << 10,
                        _ => 96 << 10,
                    };
                    match a.allocate(n, s) {
                        Ok(p) => {
                            live.insert(p, n);
                            let tg = tags.fetch_add(1, Ordering::Relaxed) as u32;
                            tag(&sim, p, n, tg, s);
                            v.push((p, n, tg));
                        }
                        Err(Error::OutOfMemory { .. }) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                for (p, n, tg) in v {
                    check(&sim, p, n, tg, s);
                    if rng(&mut x).is_multiple_of(4) {
                        let _ = htx.send((p, n, s, tg));
                    } else {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
            }
            a.release_thread().unwrap();
            s
        }));
    }
    // Cross-thread freers: on their own user stream, after waiting for the owner's stream.
    let mut fs = Vec::new();
    for _ in 0..2 {
        let (a, live, sim, hrx) = (a.clone(), live.clone(), sim.clone(), hrx.clone());
        fs.push(std::thread::spawn(move || {
            let mine = sim.create_stream();
            loop {
                let m = hrx.lock().unwrap().recv_timeout(Duration::from_millis(20));
                match m {
                    Ok((p, n, s, tg)) => {
                        let ev = sim.create_event().unwrap();
                        sim.record_event(ev, s).unwrap();
                        sim.stream_wait_event(mine, ev).unwrap();
                        check(&sim, p, n, tg, mine);
                        live.remove(p);
                        a.deallocate(p, n, mine).unwrap();
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                    Err(_) => {}
                }
            }
            a.release_thread().unwrap();
            mine
        }));
    }
    for k in 0..3 {
        let (a, stop) = (a.clone(), stop.clone());
        hs.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match k {
                    0 => {
                        let _ = a.trim(false);
                    }
                    1 => {
                        let _ = a.trim(true);
                    }
                    _ => {
                        // OOM reclaim: a big pool request that fails and reclaims dissolving.
                        if let Ok(p) = a.allocate(5 << 20, Stream::PER_THREAD) {
                            a.deallocate(p, 5 << 20, Stream::PER_THREAD).unwrap();
                        }
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            a.release_thread().unwrap();
            Stream::NULL
        }));
    }
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    drop(htx);
    let mut streams = Vec::new();
    for h in hs {
        streams.push(h.join().unwrap());
    }
    for h in fs {
        streams.push(h.join().unwrap());
    }
    live.assert_clean();
    let v = sim.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0);
    for s in streams.into_iter().filter(|s| s.is_user()) {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Under a small cap, the OOM hook frees blocks other threads allocated (cross-thread frees on
/// the hook's stream), releases the calling thread's arenas and trims; workers exit and new
/// ones start meanwhile.
#[test]
fn oom_hook_frees_foreign_blocks_releases_and_trims_while_threads_exit() {
    within(60, || {
        let sim = host(3);
        let cfg = small().max_bytes(4 << 20).large_max(128 << 10).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let pool: Arc<std::sync::Mutex<Vec<(DeviceAddr, usize, Stream)>>> = Default::default();
        let live = Arc::new(Live::default());
        {
            let (pool, a2, live) = (pool.clone(), a.clone(), live.clone());
            a.set_oom_hook(Some(Arc::new(move |_req, _dev| {
                let taken: Vec<_> = {
                    let mut p = pool.lock().unwrap();
                    let n = p.len() / 2;
                    p.drain(..n).collect()
                };
                for (p, n, s) in &taken {
                    live.remove(*p);
                    // The holders' streams are the legacy stream: ordered for every thread.
                    a2.deallocate(*p, *n, *s).unwrap();
                }
                let _ = a2.release_thread();
                let _ = a2.trim(true);
                !taken.is_empty()
            })));
        }
        let mut hs = Vec::new();
        for t in 0..6u64 {
            let (a, pool, live) = (a.clone(), pool.clone(), live.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0x9876_5431 ^ (t * 0x9e37) | 1;
                for round in 0..200 {
                    let s = if t % 2 == 0 { Stream::LEGACY } else { Stream::PER_THREAD };
                    let n = [4 << 10, 40 << 10, 100 << 10, 300 << 10][(rng(&mut x) % 4) as usize];
                    match a.allocate(n, s) {
                        Ok(p) => {
                            live.insert(p, n);
                            if s.is_legacy() && rng(&mut x).is_multiple_of(2) {
                                pool.lock().unwrap().push((p, n, s));
                            } else {
                                live.remove(p);
                                a.deallocate(p, n, s).unwrap();
                            }
                        }
                        Err(Error::OutOfMemory { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    if round % 50 == 49 {
                        a.release_thread().unwrap();
                    }
                }
                a.release_thread().unwrap();
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
        eprintln!("hook stats: {:?}", a.stats());
        a.set_oom_hook(None);
        for (p, n, s) in pool.lock().unwrap().drain(..) {
            live.remove(p);
            a.deallocate(p, n, s).unwrap();
        }
        live.assert_clean();
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// One failed identity query inside the return rule (a transient driver error, injected once)
/// must not stop a live user stream's arena from giving memory back for good: the arena keeps
/// the superblock that time, asks again some return-rule frees later (`Arena::home_retry`),
/// and, the stream alive and named by its handle all along, gives back as before. (It once
/// took an error for another stream, `home_gone`, and kept its peak until an out-of-memory
/// reclaim or a blocking trim; the mutation `home_error_latches` does so again.)
#[test]
fn a_failed_identity_query_does_not_stop_the_return_rule() {
    use cuarena_testkit::{HookedDevice, Hooks};
    let sim = host(0);
    let fail_next = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let hooks = Hooks {
        stream_key: Some(Box::new({
            let (fail_next, failed) = (fail_next.clone(), failed.clone());
            move |sim: &HostDevice, s: Stream| {
                if fail_next.swap(false, Ordering::SeqCst) {
                    failed.fetch_add(1, Ordering::SeqCst);
                    return Err(Error::Driver { call: "cuStreamGetId", code: 999 });
                }
                sim.stream_key(s)
            }
        })),
        ..Hooks::default()
    };
    let dev = HookedDevice::new(sim.clone(), hooks);
    let cfg = small().keep_empty(0).build().unwrap();
    let a = Allocator::new(dev, cfg).unwrap();
    let s = sim.create_stream();
    let n = 48 << 10; // not cached: merged at once
    // A round fills several superblocks and frees everything on the stream's handle (the
    // fast path, which asks no identity unless the return rule fires). With `fail`, every
    // identity query of the round fails once asked.
    let round = |fail: bool| -> u64 {
        let v: Vec<_> = (0..20).map(|_| a.allocate(n, s).unwrap()).collect();
        for p in &v {
            fail_next.store(fail, Ordering::SeqCst);
            a.deallocate(*p, n, s).unwrap();
        }
        fail_next.store(false, Ordering::SeqCst);
        a.stats().arena_held_bytes
    };
    let base = round(false);
    let held = round(true);
    assert!(failed.load(Ordering::SeqCst) >= 1, "the return rule asked the identity in the failing round");
    assert!(held > base, "with the identity unknown the arena keeps its superblocks ({held} against {base})");
    // The stream is alive and named by its handle: within a bounded number of rounds (each
    // with several return-rule frees) the arena gives back as before.
    let mut rounds = 0;
    let mut later = round(false);
    while later > base && rounds < 100 {
        later = round(false);
        rounds += 1;
    }
    assert!(later <= base, "after one failed query the arena keeps {later} bytes, against {base} before");
    assert_eq!(failed.load(Ordering::SeqCst), 1, "one failure, one failing call");
    a.release_thread().unwrap();
    sim.destroy_stream(s).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Bad frees of live arena blocks (small, large) and a pool block on every kind of stream:
/// each refused as an invalid free, counted once, and nothing else changes.
#[test]
fn bad_sizes_on_every_stream_kind_are_refused_and_change_nothing() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().large_max(128 << 10).build().unwrap()).unwrap();
    let u = sim.create_stream();
    let other = sim.create_stream();
    let mut bad = 0u64;
    for s in [Stream::PER_THREAD, Stream::LEGACY, Stream::NULL, u] {
        for n in [4096usize, 96 << 10, 1 << 20] {
            let p = a.allocate(n, s).unwrap();
            let s0 = a.stats();
            let bad0 = bad;
            for fs in [s, other, Stream::PER_THREAD, Stream::LEGACY] {
                for (q, m) in [
                    (p, 0usize),
                    (p, usize::MAX),
                    (p, usize::MAX - 255),
                    (p, (128 << 10) + 1),
                    (p, n * 2 + 4096),
                    (DeviceAddr(p.0 + 256), n - 256),
                    (DeviceAddr(p.0 + 1), n),
                    (DeviceAddr::NULL, n),
                    (DeviceAddr(!255), n),
                ] {
                    if q == p && m == n {
                        continue;
                    }
                    let r = a.deallocate(q, m, fs);
                    assert!(is_invalid(&r), "{s:?} {n} freed on {fs:?} as ({:#x}, {m}): {r:?}", q.0);
                    bad += 1;
                }
            }
            let s1 = a.stats();
            assert_eq!(s1.invalid_frees, s0.invalid_frees + (bad - bad0), "{s:?} {n}");
            assert_eq!((s1.live_bytes, s1.deallocations), (s0.live_bytes, s0.deallocations), "{s:?} {n}");
            a.deallocate(p, n, s).unwrap();
        }
    }
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(other).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}
