//! helper-25's attacks (after the twenty-third session) on captures of blocking streams
//! (`Counted::not_capturing`, `Inner::may_synchronize`, `Outbox::refused`, `Inner::park_arena`,
//! the global pool's retry `fit_avoiding_legacy`) and on the full table of user arenas and lean
//! arenas (twenty-second session), with bad input, thread exits, caps, trims, many threads and
//! reused stream handles during a capture of a per-thread (blocking) stream.
//!
//! Every test captures a per-thread stream of one thread (the simulator then refuses any use
//! of the legacy stream and any device synchronise: a violation that also fails
//! `end_capture`); the other threads never name the legacy stream during the capture (that
//! would be the application's own use of it). The properties checked: no block handed out
//! twice (`Live`), no violation, every byte back once the capture has ended and the threads
//! are gone (`all_back`/`assert_all_returned`), refusals clear (`OutOfMemory`,
//! `StreamCapturing`, `InvalidFree`) and changing nothing.

mod common;

use std::sync::{Arc, Barrier, Mutex};

use common::{Live, Worker, all_back, alloc_with, host, is_double, is_invalid, no_violations, rng, small};
use cuarena::{Allocator, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned};

const MIB: usize = 1 << 20;

fn capturing(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { .. })
}

fn legacy_refusal(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { stream } if Stream::from_raw(*stream).is_legacy())
}

/// A clear outcome of work during a capture: done, out of memory, or a capture refusal.
fn clear<T: std::fmt::Debug>(r: &cuarena::Result<T>) -> bool {
    match r {
        Ok(_) | Err(Error::OutOfMemory { .. }) => true,
        Err(e) => capturing(e),
    }
}

/// Captures this thread's per-thread stream around `work` (which must not touch this thread's
/// per-thread stream, nor the legacy stream), then checks that the capture ended intact and
/// that the simulator saw no violation.
fn captured<R>(dev: &HostDevice, work: impl FnOnce() -> R) -> R {
    dev.begin_capture(Stream::PER_THREAD).unwrap();
    let r = work();
    let v = dev.violations();
    let ended = dev.end_capture(Stream::PER_THREAD);
    assert!(v.is_empty(), "violations during the capture: {v:?}");
    ended.expect("the capture was invalidated");
    r
}

/// The end of a test with `bad` bad frees found by owners (deferred): no violation, a
/// blocking trim, everything returned.
fn all_back_with(a: &Allocator, dev: &HostDevice, bad: u64) {
    no_violations(dev);
    a.trim(true).unwrap();
    if bad == 0 {
        let _ = a.take_deferred_error();
    }
    assert_all_returned(a, Some(dev), bad);
}

// ---------------------------------------------------------------------------------------------
// 1. The pool's retry under a cap: a refusal while the caller's own arena holds empty memory.

/// Under a cap that leaves no room, the only free extent of the pool holds a lazy legacy fence
/// (a pool block freed on the legacy stream), and the allocating thread's own per-thread arena
/// holds four empty superblocks (a whole chunk). During another thread's per-thread capture,
/// that thread asks 1 MiB on a user stream. The out-of-memory reclaim would give its own
/// superblocks back behind an event on its own per-thread stream (allowed during the capture)
/// and the request would fit there; README: "refused with `Error::StreamCapturing` of the
/// legacy stream only when no other memory is left under the cap".
#[test]
fn a_legacy_refusal_under_a_cap_comes_only_after_the_callers_own_reclaim() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10).keep_empty(8));
    let w = Worker::new(&a);
    w.run(|a| {
        let ps: Vec<_> = (0..16).map(|_| a.allocate_per_thread(64 << 10).unwrap()).collect();
        ps.into_iter().for_each(|p| a.deallocate_per_thread(p, 64 << 10).unwrap());
    });
    assert!(a.stats().arena_held_bytes >= MIB as u64, "{:?}", a.stats());
    // A pool block freed on the legacy stream: a lazy legacy fence on its extent.
    let p = a.allocate(MIB, Stream::LEGACY).unwrap();
    dev.write_tag(p.0, 4096, 0x11, Stream::LEGACY).unwrap();
    a.deallocate(p, MIB, Stream::LEGACY).unwrap();
    a.flush().unwrap();
    let u = dev.create_stream();
    a.set_limit_bytes(a.stats().reserved_bytes as usize);
    let d2 = dev.clone();
    let (first, after_trim) = captured(&dev, || {
        w.run(move |a| {
            let first = a.allocate(MIB, u);
            if let Ok(q) = first {
                d2.write_tag(q.0, 4096, 0x22, u).unwrap();
                a.deallocate(q, MIB, u).unwrap();
                return (first, None);
            }
            // What the caller can do itself: give its own empty superblocks back, and ask again.
            let _ = a.trim(false);
            let again = a.allocate(MIB, u);
            if let Ok(q) = again {
                a.deallocate(q, MIB, u).unwrap();
            }
            (first, Some(again))
        })
    });
    a.set_limit_bytes(usize::MAX);
    w.exit();
    dev.destroy_stream(u).unwrap();
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
    assert!(
        first.is_ok(),
        "refused although the caller's own empty superblocks could serve it after a reclaim: {first:?}; \
         after the caller's own trim(false): {after_trim:?}"
    );
}

/// The same for an arena's growth: the caller's first small request on a user stream needs a
/// superblock (`GlobalPool::lend`), the pool's only free memory holds a lazy legacy fence, the
/// cap leaves no room, and the caller's own per-thread arena holds four empty superblocks.
#[test]
fn a_legacy_refusal_of_an_arenas_growth_comes_only_after_the_callers_own_reclaim() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10).keep_empty(8));
    let w = Worker::new(&a);
    w.run(|a| {
        let ps: Vec<_> = (0..16).map(|_| a.allocate_per_thread(64 << 10).unwrap()).collect();
        ps.into_iter().for_each(|p| a.deallocate_per_thread(p, 64 << 10).unwrap());
    });
    let p = a.allocate(MIB, Stream::LEGACY).unwrap();
    a.deallocate(p, MIB, Stream::LEGACY).unwrap();
    a.flush().unwrap();
    let u = dev.create_stream();
    a.set_limit_bytes(a.stats().reserved_bytes as usize);
    let (first, retries) = captured(&dev, || {
        w.run(move |a| {
            let before = a.stats().alloc_retries;
            let first = a.allocate(4096, u);
            if let Ok(q) = first {
                a.deallocate(q, 4096, u).unwrap();
            }
            (first, a.stats().alloc_retries - before)
        })
    });
    a.set_limit_bytes(usize::MAX);
    w.exit();
    dev.destroy_stream(u).unwrap();
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
    assert!(
        first.is_ok(),
        "an arena's growth refused with no reclaim tried ({retries} retries) although the caller's own \
         empty superblocks could serve it: {first:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Bad input during a capture, on blocks whose legacy-stream frees were refused and parked.

/// Another thread's frees on the legacy stream of an owner's arena blocks and of pool blocks,
/// waiting in its outbox, are flushed during the capture: the arena blocks are parked
/// (`Outbox::refused`), the pool blocks freed behind a lazy legacy fence. Meanwhile a third
/// thread frees them all again (on its per-thread stream and on a user stream): double frees,
/// refused at once, changing nothing; and it makes a wrong-size free of a live pool block, an
/// interior and a foreign pointer's free, and a wrong-size free of a live arena block of the
/// owner (checked by the owner later: one deferred bad free). After the capture everything
/// comes back.
#[test]
fn double_and_bad_frees_of_blocks_whose_legacy_frees_were_parked_during_a_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10));
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    let third = Worker::new(&a);
    let d2 = dev.clone();
    // (arena blocks freed, pool blocks freed, live arena blocks, live pool block)
    type Blocks = Vec<(DeviceAddr, usize)>;
    let (freed, live_arena, live_pool): (Blocks, Blocks, (DeviceAddr, usize)) = owner.run(move |a| {
        let mut freed = Vec::new();
        for i in 0..6usize {
            let n = 512 + i * 3001;
            let p = a.allocate_per_thread(n).unwrap();
            d2.write_tag(p.0, 256, 0x100 + i as u32, Stream::PER_THREAD).unwrap();
            freed.push((p, n));
        }
        for i in 0..3usize {
            let n = MIB + i * 4096;
            let p = a.allocate_per_thread(n).unwrap();
            d2.write_tag(p.0, 256, 0x200 + i as u32, Stream::PER_THREAD).unwrap();
            freed.push((p, n));
        }
        let live_arena =
            (0..3usize).map(|i| (a.allocate_per_thread(2048 + i * 512).unwrap(), 2048 + i * 512)).collect();
        let live_pool = (a.allocate_per_thread(2 * MIB).unwrap(), 2 * MIB);
        (freed, live_arena, live_pool)
    });
    let f2 = freed.clone();
    freer.run(move |a| {
        for (p, n) in f2 {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
    let u = dev.create_stream();
    let (f3, la, lp) = (freed.clone(), live_arena.clone(), live_pool);
    captured(&dev, || {
        let r = freer.run(|a| a.flush());
        assert!(clear(&r), "{r:?}");
        third.run(move |a| {
            let before = a.stats();
            for (i, &(p, n)) in f3.iter().enumerate() {
                let r = if i % 2 == 0 { a.deallocate_per_thread(p, n) } else { a.deallocate(p, n, u) };
                assert!(is_double(&r), "a second free of {p:?} ({n} B): {r:?}");
            }
            // A wrong size of a live pool block, its interior, a foreign pointer.
            let r = a.deallocate(lp.0, lp.1 + 4096, u);
            assert!(is_invalid(&r), "{r:?}");
            let r = a.deallocate_per_thread(lp.0, lp.1 - MIB);
            assert!(is_invalid(&r), "{r:?}");
            let r = a.deallocate_per_thread(DeviceAddr(lp.0.0 + 4096), 4096);
            assert!(is_invalid(&r), "{r:?}");
            let r = a.deallocate(DeviceAddr(0x7000_0000_0000), 4096, u);
            assert!(is_invalid(&r), "{r:?}");
            let after = a.stats();
            assert_eq!(
                (after.deallocations, after.live_bytes),
                (before.deallocations, before.live_bytes),
                "a refused free changed the statistics"
            );
            // A wrong-size free of a live arena block of the owner: taken, checked by the
            // owner when it drains (deferred).
            a.deallocate_per_thread(la[0].0, la[0].1 + 8192).unwrap();
            a.flush().unwrap();
        });
        // The owner drains now, during the capture: the bad free is found.
        let r = owner.run(|a| a.flush());
        assert!(clear(&r), "{r:?}");
    });
    // After the capture the owner's correct frees are taken.
    owner.run(move |a| {
        for (p, n) in live_arena {
            a.deallocate_per_thread(p, n).unwrap();
        }
        a.deallocate_per_thread(live_pool.0, live_pool.1).unwrap();
        a.flush().unwrap();
    });
    freer.run(|a| a.flush()).unwrap();
    drop((owner, freer, third));
    dev.destroy_stream(u).unwrap();
    assert!(a.take_deferred_error().is_some(), "the owner's check of the wrong-size free");
    all_back_with(&a, &dev, 14);
}

// ---------------------------------------------------------------------------------------------
// 3. A legacy arena parked at its thread's exit during a capture, its live blocks freed later.

/// A thread allocates on the legacy stream, frees half its blocks (kept back) and hands the
/// other half out, then exits during the capture: its legacy arena is parked
/// (`Inner::park_arena`). During the capture another thread frees some of its live blocks on
/// its per-thread stream (into the parked arena's inbox), double-frees one, flushes (draining
/// the parked arenas) and trims; and it allocates a lot, each block checked against the live
/// ones. After the capture the rest are freed on the legacy stream, and everything comes back.
#[test]
fn a_parked_legacy_arenas_live_blocks_freed_during_and_after_the_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small());
    let live = Arc::new(Live::default());
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Vec<(DeviceAddr, usize, u32)>>();
    let (a2, d2, l2) = (a.clone(), dev.clone(), Arc::clone(&live));
    let leaver = std::thread::spawn(move || {
        let mut kept = Vec::new();
        for i in 0..24u32 {
            let n = 256 + i as usize * 2111;
            let p = a2.allocate(n, Stream::LEGACY).unwrap();
            d2.write_tag(p.0, 256, 0x300 + i, Stream::LEGACY).unwrap();
            if i % 2 == 0 {
                a2.deallocate(p, n, Stream::LEGACY).unwrap();
            } else {
                l2.insert(p, n);
                kept.push((p, n, 0x300 + i));
            }
        }
        ready_tx.send(kept).unwrap();
        go_rx.recv().unwrap();
    });
    let kept = ready_rx.recv().unwrap();
    let other = Worker::new(&a);
    let (early, late) = kept.split_at(4);
    let (early, late) = (early.to_vec(), late.to_vec());
    let (d3, l3) = (dev.clone(), Arc::clone(&live));
    captured(&dev, || {
        go_tx.send(()).unwrap();
        leaver.join().unwrap();
        assert!(a.parked_bytes() > 0, "the exited thread's legacy arena is parked");
        other.run(move |a| {
            for &(p, n, t) in &early {
                d3.check_tag(p.0, 256, t, Stream::PER_THREAD).unwrap();
                l3.remove(p);
                a.deallocate_per_thread(p, n).unwrap();
            }
            let (p, n, _) = early[0];
            assert!(is_double(&a.deallocate_per_thread(p, n)), "a double free into a parked arena");
            a.flush().unwrap();
            let r = a.trim(false);
            assert!(clear(&r), "{r:?}");
            let mut mine = Vec::new();
            for i in 0..200usize {
                let n = 64 + (i * 7919) % (60 << 10);
                let p = a.allocate_per_thread(n).unwrap();
                l3.insert(p, n);
                d3.write_tag(p.0, 256, 0x400 + i as u32, Stream::PER_THREAD).unwrap();
                mine.push((p, n));
            }
            for (p, n) in mine {
                l3.remove(p);
                a.deallocate_per_thread(p, n).unwrap();
            }
            let r = a.trim(true);
            assert!(clear(&r), "{r:?}");
        });
    });
    live.assert_clean();
    for &(p, n, t) in &late {
        dev.check_tag(p.0, 256, t, Stream::LEGACY).unwrap();
        live.remove(p);
        a.deallocate(p, n, Stream::LEGACY).unwrap();
    }
    a.flush().unwrap();
    other.exit();
    all_back_with(&a, &dev, 1);
}

// ---------------------------------------------------------------------------------------------
// 4. A thread exiting during a capture with everything at once.

/// A thread exits during the capture holding: memory in its per-thread and legacy arenas,
/// kept-back legacy frees, three user arenas with over 64 MiB of large superblocks (so that its
/// exit would bury the parked arenas past the bound, with a synchronise), one of them of a
/// stream destroyed before, remote frees waiting in a user stream's batch and in its legacy
/// batch (arena and pool blocks of another thread), and live blocks another thread frees
/// after the capture. No synchronise, no legacy use; after the capture, everything back.
#[test]
fn a_thread_exiting_with_everything_pending_during_a_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small());
    let owner = Worker::new(&a);
    let streams: Vec<Stream> = (0..3).map(|_| dev.create_stream()).collect();
    let u0 = streams[0];
    // The owner's blocks that the exiting thread frees: on `u0` (arena blocks of the owner's
    // `u0` arena) and on the legacy stream (per-thread arena blocks and large blocks).
    let on_u0: Vec<(DeviceAddr, usize)> = owner.run(move |a| {
        (0..5usize).map(|i| (a.allocate(1000 + i * 100, u0).unwrap(), 1000 + i * 100)).collect()
    });
    let on_legacy: Vec<(DeviceAddr, usize)> = owner.run(|a| {
        let mut v: Vec<_> =
            (0..5usize).map(|i| (a.allocate_per_thread(3000 + i).unwrap(), 3000 + i)).collect();
        v.push((a.allocate_per_thread(3 * MIB).unwrap(), 3 * MIB));
        v.push((a.allocate_per_thread(100 * MIB).unwrap(), 100 * MIB)); // a pool block
        v
    });
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Vec<(DeviceAddr, usize)>>();
    let (a2, d2, ss) = (a.clone(), dev.clone(), streams.clone());
    let leaver = std::thread::spawn(move || {
        // Per-thread arena memory.
        let ps: Vec<_> = (0..20).map(|i| a2.allocate_per_thread(4096 + i * 64).unwrap()).collect();
        ps.into_iter().enumerate().for_each(|(i, p)| a2.deallocate_per_thread(p, 4096 + i * 64).unwrap());
        // User arenas with large superblocks (a 9 MiB block: a 64 MiB superblock), then freed.
        for &s in &ss {
            for n in [9 * MIB, 2048, 40 << 10] {
                let p = a2.allocate(n, s).unwrap();
                d2.write_tag(p.0, 256, 0x500, s).unwrap();
                a2.deallocate(p, n, s).unwrap();
            }
        }
        d2.destroy_stream(ss[2]).unwrap();
        // Remote frees in a user stream's batch.
        for (p, n) in on_u0 {
            a2.deallocate(p, n, ss[0]).unwrap();
        }
        // Legacy blocks: some kept back, some live (handed out).
        let mut live = Vec::new();
        for i in 0..10usize {
            let n = 700 + i * 1500;
            let p = a2.allocate(n, Stream::LEGACY).unwrap();
            if i % 3 == 0 { live.push((p, n)) } else { a2.deallocate(p, n, Stream::LEGACY).unwrap() }
        }
        // Last, remote frees on the legacy stream: they wait in its legacy batch.
        for (p, n) in on_legacy {
            a2.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        ready_tx.send(live).unwrap();
        go_rx.recv().unwrap();
    });
    let live = ready_rx.recv().unwrap();
    let syncs = a.stats().host_syncs;
    captured(&dev, || {
        go_tx.send(()).unwrap();
        leaver.join().unwrap();
    });
    assert_eq!(a.stats().host_syncs, syncs, "a synchronise during the capture");
    assert!(
        a.parked_bytes() > 64 * MIB,
        "parked past the bound, kept for after the capture: {}",
        a.parked_bytes()
    );
    for (p, n) in live {
        a.deallocate(p, n, Stream::LEGACY).unwrap();
    }
    owner.run(|a| a.flush()).unwrap();
    owner.exit();
    for &s in &streams[..2] {
        dev.destroy_stream(s).unwrap();
    }
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 5. Many threads racing through a capture.

/// A block a racing thread holds.
#[derive(Clone, Copy, Debug)]
struct H {
    p: DeviceAddr,
    n: usize,
    /// The stream it was allocated and tagged on.
    s: Stream,
    t: u32,
}

/// What a racing thread may do in a phase.
#[derive(Clone, Copy, PartialEq)]
enum Phase {
    /// Before or after the capture: the legacy stream too.
    Open,
    /// During the capture: never the legacy stream.
    Captured,
}

/// One racing thread's `steps` operations in `phase`. Blocks on user streams may be handed to
/// other threads (`shared`), which free them on their stream.
#[allow(clippy::too_many_arguments)]
fn race_steps(
    a: &Allocator,
    dev: &HostDevice,
    live: &Live,
    shared: &Mutex<Vec<H>>,
    users: &[Stream],
    held: &mut Vec<H>,
    x: &mut u64,
    tagn: &mut u32,
    steps: usize,
    phase: Phase,
) {
    fn ok<T: std::fmt::Debug>(phase: Phase, r: &cuarena::Result<T>, what: &str) {
        if phase == Phase::Captured {
            assert!(clear(r), "{what}: {:?}", r.as_ref().err());
        } else {
            assert!(
                r.is_ok() || matches!(r, Err(Error::OutOfMemory { .. })),
                "{what}: {:?}",
                r.as_ref().err()
            );
        }
    }
    for _ in 0..steps {
        let k = rng(x) % 100;
        if k < 45 || held.is_empty() {
            let s = match rng(x) % 4 {
                0 => Stream::PER_THREAD,
                1 if phase == Phase::Open => Stream::LEGACY,
                1 => Stream::PER_THREAD,
                _ => users[rng(x) as usize % users.len()],
            };
            let n = match rng(x) % 10 {
                0 => MIB + (rng(x) as usize % (3 * MIB)), // over large_max: the pool
                1 | 2 => (64 << 10) + (rng(x) as usize % (192 << 10)), // large, from an arena
                _ => 64 + (rng(x) as usize % (60 << 10)),
            };
            let r = a.allocate(n, s);
            ok(phase, &r, "allocate");
            if let Ok(p) = r {
                live.insert(p, n);
                *tagn += 1;
                dev.write_tag(p.0, 256, *tagn, s).unwrap();
                held.push(H { p, n, s, t: *tagn });
            }
        } else if k < 85 {
            let i = rng(x) as usize % held.len();
            let h = held.swap_remove(i);
            // Freed on its stream; a legacy block during the capture on the per-thread stream
            // (which follows legacy work); a user block now and then on the per-thread stream,
            // declared used on its stream.
            let (fs, used_on): (Stream, Option<Stream>) = if h.s.is_legacy() && phase == Phase::Captured {
                (Stream::PER_THREAD, None)
            } else if h.s.is_user() && rng(x).is_multiple_of(4) {
                (Stream::PER_THREAD, Some(h.s))
            } else {
                (h.s, None)
            };
            dev.check_tag(h.p.0, 256, h.t, if used_on.is_some() { h.s } else { fs }).unwrap();
            live.remove(h.p);
            let r = match used_on {
                Some(s) => a.deallocate_used_on(h.p, h.n, fs, &[s]),
                None => a.deallocate(h.p, h.n, fs),
            };
            ok(phase, &r, "deallocate");
            if r.is_err() {
                live.insert(h.p, h.n);
                held.push(h);
            }
        } else if k < 92 {
            // Hand a user-stream block over, or take one.
            if let Some(i) = held.iter().position(|h| h.s.is_user()) {
                shared.lock().unwrap().push(held.swap_remove(i));
            }
            let got = shared.lock().unwrap().pop();
            if let Some(h) = got {
                held.push(h);
            }
        } else {
            let r = match rng(x) % 5 {
                0 => a.flush().map(|_| 0),
                1 => a.trim(false),
                2 => a.trim(true),
                3 => a.release_thread().map(|_| 0),
                _ => a.flush().map(|_| 0),
            };
            ok(phase, &r, "flush/trim/release");
        }
    }
}

/// Four threads allocate and free on their per-thread streams, the legacy stream (outside the
/// capture) and three shared user streams, hand user blocks to each other, free across streams
/// with `deallocate_used_on`, flush, trim both ways and release themselves, before, during
/// and after a capture of the main thread's per-thread stream, under a cap tightened during
/// it. No block handed out twice, no tag overwritten, no violation, everything back.
#[test]
fn threads_race_through_a_capture_under_a_cap() {
    for seed in 1..=4u64 {
        race_once(seed);
    }
}

fn race_once(seed: u64) {
    const THREADS: usize = 4;
    let dev = host(30);
    let a = alloc_with(&dev, small().large_max(256 << 10));
    let live = Arc::new(Live::default());
    let shared = Arc::new(Mutex::new(Vec::<H>::new()));
    let users: Arc<Vec<Stream>> = Arc::new((0..3).map(|_| dev.create_stream()).collect());
    let bar = Arc::new(Barrier::new(THREADS + 1));
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, dev, live, shared, users, bar) = (
                a.clone(),
                dev.clone(),
                Arc::clone(&live),
                Arc::clone(&shared),
                Arc::clone(&users),
                Arc::clone(&bar),
            );
            std::thread::spawn(move || {
                let mut x =
                    0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1 + seed * 16).wrapping_mul(0x2545_f491_4f6c_dd1d);
                let mut tagn = (t as u32) << 24;
                let mut held = Vec::new();
                let go = |held: &mut Vec<H>, x: &mut u64, tagn: &mut u32, phase| {
                    race_steps(&a, &dev, &live, &shared, &users, held, x, tagn, 250, phase)
                };
                go(&mut held, &mut x, &mut tagn, Phase::Open);
                bar.wait(); // the capture begins
                bar.wait();
                go(&mut held, &mut x, &mut tagn, Phase::Captured);
                bar.wait(); // the capture ends
                bar.wait();
                go(&mut held, &mut x, &mut tagn, Phase::Open);
                for h in held {
                    dev.check_tag(h.p.0, 256, h.t, h.s).unwrap();
                    live.remove(h.p);
                    a.deallocate(h.p, h.n, h.s).unwrap();
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    bar.wait();
    dev.begin_capture(Stream::PER_THREAD).unwrap();
    a.set_limit_bytes(a.stats().reserved_bytes as usize + 8 * MIB);
    bar.wait();
    bar.wait();
    a.set_limit_bytes(usize::MAX);
    let v = dev.violations();
    let ended = dev.end_capture(Stream::PER_THREAD);
    bar.wait();
    let joined: Vec<_> = hs.into_iter().map(|h| h.join()).collect();
    assert!(v.is_empty(), "violations during the capture: {:?}", &v[..v.len().min(3)]);
    ended.expect("the capture was invalidated");
    for j in joined {
        j.expect("a racing thread panicked");
    }
    live.assert_clean();
    for h in std::mem::take(&mut *shared.lock().unwrap()) {
        dev.check_tag(h.p.0, 256, h.t, h.s).unwrap();
        a.deallocate(h.p, h.n, h.s).unwrap();
    }
    a.flush().unwrap();
    for &s in users.iter() {
        dev.destroy_stream(s).unwrap();
    }
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 6. A full table of busy user arenas, lean arenas and the pool during a capture.

/// With 2 MiB superblocks, one thread holds a live block on each of 60 user streams (16 in its
/// table, 32 parked, the rest served by the pool) and the pool holds memory freed on the legacy
/// stream (lazy legacy fences). During the capture it cycles over the streams again, small and
/// large requests (lean arenas send large ones to the pool), some frees on the other streams
/// declared used, under a cap; then it exits during the capture (its user arenas parked past
/// the bound, no synchronise). After the capture its live blocks are freed by the main thread
/// on their streams and everything comes back.
#[test]
fn a_full_table_of_busy_arenas_through_a_capture_under_a_cap() {
    let dev = host(10);
    let a = alloc_with(&dev, cuarena::Config::builder().small_max(64 << 10).large_max(4 * MIB));
    // Lazy legacy memory in the pool: blocks over large_max freed on the legacy stream.
    let ps: Vec<_> = (0..4).map(|_| a.allocate(6 * MIB, Stream::LEGACY).unwrap()).collect();
    ps.into_iter().for_each(|p| a.deallocate(p, 6 * MIB, Stream::LEGACY).unwrap());
    a.flush().unwrap();
    let streams: Arc<Vec<Stream>> = Arc::new((0..60).map(|_| dev.create_stream()).collect());
    let live = Arc::new(Live::default());
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (step_tx, step_rx) = std::sync::mpsc::channel::<()>();
    let (a2, d2, ss, l2) = (a.clone(), dev.clone(), Arc::clone(&streams), Arc::clone(&live));
    let worker = std::thread::spawn(move || {
        let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
        for (i, &s) in ss.iter().enumerate() {
            let n = 4096 + i * 64;
            let p = a2.allocate(n, s).unwrap();
            l2.insert(p, n);
            d2.write_tag(p.0, 256, i as u32, s).unwrap();
            held.push((p, n, s));
        }
        step_tx.send(()).unwrap();
        go_rx.recv().unwrap(); // the capture has begun
        let cap = a2.stats().reserved_bytes as usize + 6 * MIB;
        a2.set_limit_bytes(cap);
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut refusals = 0;
        for round in 0..3 {
            for (i, &s) in ss.iter().enumerate() {
                let n = if rng(&mut x).is_multiple_of(3) {
                    (64 << 10) + (rng(&mut x) as usize % (3 * MIB))
                } else {
                    64 + i * 97
                };
                match a2.allocate(n, s) {
                    Ok(p) => {
                        l2.insert(p, n);
                        d2.write_tag(p.0, 256, 0x1000 + i as u32, s).unwrap();
                        // Free half at once: on its stream, or on the next one declared used.
                        if (i + round) % 2 == 0 {
                            l2.remove(p);
                            let r = if i % 4 == 0 {
                                a2.deallocate_used_on(p, n, ss[(i + 1) % ss.len()], &[s])
                            } else {
                                a2.deallocate(p, n, s)
                            };
                            match r {
                                Ok(()) => {}
                                Err(e) if capturing(&e) => {
                                    l2.insert(p, n);
                                    held.push((p, n, s));
                                }
                                Err(e) => panic!("free: {e}"),
                            }
                        } else {
                            held.push((p, n, s));
                        }
                    }
                    Err(e) if capturing(&e) || matches!(e, Error::OutOfMemory { .. }) => refusals += 1,
                    Err(e) => panic!("allocate: {e}"),
                }
            }
        }
        a2.set_limit_bytes(usize::MAX);
        // Hand the live blocks out; exit during the capture.
        (held, refusals)
    });
    step_rx.recv().unwrap();
    let syncs = a.stats().host_syncs;
    let (held, refusals) = captured(&dev, || {
        go_tx.send(()).unwrap();
        worker.join().unwrap()
    });
    eprintln!("refusals during the capture: {refusals}; parked: {} B", a.parked_bytes());
    assert_eq!(a.stats().host_syncs, syncs, "a synchronise during the capture");
    live.assert_clean();
    for (p, n, s) in held {
        live.remove(p);
        a.deallocate(p, n, s).unwrap();
    }
    a.flush().unwrap();
    for &s in streams.iter() {
        dev.destroy_stream(s).unwrap();
    }
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 7. Stream destroyed and its handle reused during a capture.

/// A thread's user stream, its arena holding live and freed blocks, is destroyed during the
/// capture and its handle given to a new stream; the thread allocates on the new stream (a new
/// arena: another identity), frees the old stream's live blocks on the new handle (the known
/// limit: taken by the old arena without an identity lookup, kept until a synchronise), frees a
/// new-stream block twice, and exits, all during the capture. Nothing is handed out twice, no
/// synchronise runs, no call reaches a destroyed handle, and after the capture everything
/// comes back.
#[test]
fn a_stream_destroyed_and_its_handle_reused_during_a_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small());
    let live = Arc::new(Live::default());
    let w = Worker::new(&a);
    let u = dev.create_stream();
    let (d2, l2) = (dev.clone(), Arc::clone(&live));
    let old: Vec<(DeviceAddr, usize)> = w.run(move |a| {
        let mut old = Vec::new();
        for i in 0..30usize {
            let n = 512 + i * 1500;
            let p = a.allocate(n, u).unwrap();
            d2.write_tag(p.0, 256, i as u32, u).unwrap();
            if i % 3 == 0 {
                a.deallocate(p, n, u).unwrap();
            } else {
                l2.insert(p, n);
                old.push((p, n));
            }
        }
        old
    });
    let (d3, l3) = (dev.clone(), Arc::clone(&live));
    let syncs = a.stats().host_syncs;
    let v = captured(&dev, || {
        w.run(move |a| {
            d3.synchronize(); // the old stream's work done (the test's own wait: no device call)
            d3.destroy_stream(u).unwrap();
            let v = d3.create_stream();
            assert_eq!(v, u, "the simulator gives the handle again");
            let mut mine = Vec::new();
            for i in 0..40usize {
                let n = 256 + i * 1200;
                let p = a.allocate(n, v).unwrap();
                l3.insert(p, n);
                d3.write_tag(p.0, 256, 0x100 + i as u32, v).unwrap();
                mine.push((p, n));
            }
            // The old stream's live blocks, freed on the handle that now names `v`.
            for &(p, n) in &old {
                l3.remove(p);
                a.deallocate(p, n, v).unwrap();
            }
            let (p, n) = mine.pop().unwrap();
            l3.remove(p);
            a.deallocate(p, n, v).unwrap();
            assert!(is_invalid(&a.deallocate(p, n, v)), "a second free");
            for (p, n) in mine {
                l3.remove(p);
                a.deallocate(p, n, v).unwrap();
            }
            for i in 0..40usize {
                let n = 256 + i * 1200;
                let p = a.allocate(n, v).unwrap();
                l3.insert(p, n);
                d3.write_tag(p.0, 256, 0x200, v).unwrap();
                l3.remove(p);
                a.deallocate(p, n, v).unwrap();
            }
            let r = a.trim(true);
            assert!(clear(&r), "{r:?}");
            a.release_thread().unwrap();
            v
        })
    });
    assert_eq!(a.stats().host_syncs, syncs, "a synchronise during the capture");
    live.assert_clean();
    w.exit();
    dev.destroy_stream(v).unwrap();
    all_back_with(&a, &dev, 1);
}

// ---------------------------------------------------------------------------------------------
// 8. Captures that overlap, and an announced capture of a non-blocking stream.

/// Two per-thread streams captured with overlapping spans, and an announced capture of a user
/// stream (`graph_capture_begin`) inside them, while other threads run out of memory under a
/// cap with parked memory to give back, trim both ways and exit: the legacy stream stays
/// untouched while either per-thread capture runs, no synchronise while any runs. After the
/// last one ends, a blocking trim gives everything back.
#[test]
fn overlapping_captures_and_an_announced_one_break_nothing() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10));
    // Lazy legacy memory, and an idle thread's legacy arena holding memory.
    let idle = Worker::new(&a);
    idle.run(|a| {
        for n in [MIB, 2 * MIB, 4096, 30 << 10] {
            let p = a.allocate(n, Stream::LEGACY).unwrap();
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        a.flush().unwrap();
    });
    let c2 = Worker::new(&a);
    let c3 = Worker::new(&a);
    let d2 = dev.clone();
    c2.run(move |_| d2.begin_capture(Stream::PER_THREAD).unwrap());
    let us = dev.create_stream();
    let work = |a: &Allocator, dev: &HostDevice, tag: u32| {
        let (a2, d2) = (a.clone(), dev.clone());
        std::thread::spawn(move || {
            let u = d2.create_stream();
            // Parked memory: a user arena given up at release.
            for n in [4096, 50 << 10, 200 << 10] {
                let p = a2.allocate(n, u).unwrap();
                a2.deallocate(p, n, u).unwrap();
            }
            a2.release_thread().unwrap();
            d2.destroy_stream(u).unwrap();
            a2.set_limit_bytes(a2.stats().reserved_bytes as usize);
            for n in [3 * MIB, MIB, 40 << 10] {
                let r = a2.allocate_per_thread(n);
                assert!(clear(&r), "{r:?}");
                if let Ok(p) = r {
                    d2.write_tag(p.0, 256, tag, Stream::PER_THREAD).unwrap();
                    a2.deallocate_per_thread(p, n).unwrap();
                }
            }
            a2.set_limit_bytes(usize::MAX);
            for b in [false, true] {
                let r = a2.trim(b);
                assert!(clear(&r), "{r:?}");
            }
            a2.release_thread().unwrap();
        })
        .join()
        .unwrap();
    };
    // Main's capture overlaps c2's; c3 announces and captures a user stream inside.
    captured(&dev, || {
        work(&a, &dev, 1);
        let (d3, a3) = (dev.clone(), a.clone());
        c3.run(move |_| {
            a3.graph_capture_begin();
            d3.begin_capture(us).unwrap();
        });
        work(&a, &dev, 2);
        let d2 = dev.clone();
        c2.run(move |_| d2.end_capture(Stream::PER_THREAD)).expect("c2's capture was invalidated");
        work(&a, &dev, 3);
    });
    // Only the announced capture runs now.
    work(&a, &dev, 4);
    let (d3, a3) = (dev.clone(), a.clone());
    c3.run(move |_| {
        d3.end_capture(us).expect("the announced capture was invalidated");
        a3.graph_capture_end().unwrap();
    });
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    drop((idle, c2, c3));
    dev.destroy_stream(us).unwrap();
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 9. Kept-back legacy frees during a capture, then reused by another thread's per-thread stream.

/// A thread's own legacy frees (kept back, below a batch) of blocks last used on a third
/// thread's per-thread stream: during the capture it flushes (the legacy action refused) and
/// trims, and another thread trims (its legacy arena's fence refused). After the capture the
/// thread exits (its kept-back frees go to the pool behind a lazy legacy fence) and another
/// thread takes the memory on its per-thread stream: the race checker sees any reuse not
/// ordered after the third thread's work.
#[test]
fn kept_back_legacy_frees_through_a_capture_then_reused_elsewhere() {
    let dev = host(50);
    let a = alloc_with(&dev, small().large_max(64 << 10));
    let k = Worker::new(&a);
    let d2 = dev.clone();
    let blocks: Vec<(DeviceAddr, usize)> = k.run(move |a| {
        let v: Vec<_> = (0..12).map(|_| (a.allocate(60 << 10, Stream::LEGACY).unwrap(), 60 << 10)).collect();
        common::use_on_another_thread(&d2, &v, 0x700, 40);
        for &(p, n) in &v {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        v
    });
    let other = Worker::new(&a);
    captured(&dev, || {
        let r = k.run(|a| a.flush());
        assert!(clear(&r), "{r:?}");
        let r = k.run(|a| a.trim(false));
        assert!(clear(&r), "{r:?}");
        let r = other.run(|a| a.trim(false));
        assert!(clear(&r), "{r:?}");
        let r = other.run(|a| a.trim(true));
        assert!(clear(&r), "{r:?}");
    });
    k.exit();
    // Another thread's per-thread stream takes memory in that range.
    let d3 = dev.clone();
    let got = other.run(move |a| {
        let mut got = Vec::new();
        for i in 0..16u32 {
            let p = a.allocate_per_thread(60 << 10).unwrap();
            d3.write_tag(p.0, 60 << 10, 0x800 + i, Stream::PER_THREAD).unwrap();
            got.push(p);
        }
        let reused = got.iter().filter(|p| blocks.iter().any(|(q, _)| q == *p)).count();
        for p in got {
            a.deallocate_per_thread(p, 60 << 10).unwrap();
        }
        reused
    });
    eprintln!("{got} of the kept-back blocks' addresses taken again");
    other.exit();
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 10. A thread released, reborn and released again during a capture, with pool frees pending.

/// During the capture one thread frees pool blocks and another thread's arena blocks on its
/// per-thread stream, releases itself (its outbox flushed on its per-thread stream), allocates
/// again (a new slot), frees more, and exits without a release; another thread frees the
/// remaining pool blocks twice. The pool's retry for legacy-fenced extents serves the
/// allocations. Everything back after the capture.
#[test]
fn release_and_rebirth_during_a_capture_with_lazy_legacy_memory() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10));
    // Pool memory freed on the legacy stream, never its identity asked (pool blocks allocated
    // on a per-thread stream): the lazy fence's record would have to ask it during the capture.
    let ps: Vec<_> = (0..6).map(|_| a.allocate_per_thread(MIB).unwrap()).collect();
    ps.into_iter().for_each(|p| a.deallocate(p, MIB, Stream::LEGACY).unwrap());
    a.flush().unwrap();
    let owner = Worker::new(&a);
    let theirs: Vec<(DeviceAddr, usize)> = owner.run(|a| {
        (0..10usize).map(|i| (a.allocate_per_thread(800 + i * 50).unwrap(), 800 + i * 50)).collect()
    });
    let live = Arc::new(Live::default());
    let l2 = Arc::clone(&live);
    let (a2, d2) = (a.clone(), dev.clone());
    let pool_left: Vec<(DeviceAddr, usize)> = captured(&dev, || {
        std::thread::spawn(move || {
            let mut left = Vec::new();
            for round in 0..3usize {
                let mut mine = Vec::new();
                for i in 0..4usize {
                    let n = MIB + i * 4096;
                    let p = a2.allocate_per_thread(n).expect("served from memory without a legacy fence");
                    l2.insert(p, n);
                    d2.write_tag(p.0, 256, (round * 8 + i) as u32, Stream::PER_THREAD).unwrap();
                    mine.push((p, n));
                }
                let q = a2.allocate(3 * MIB, Stream::PER_THREAD).unwrap();
                l2.insert(q, 3 * MIB);
                left.push((q, 3 * MIB));
                for (p, n) in mine {
                    l2.remove(p);
                    a2.deallocate_per_thread(p, n).unwrap();
                }
                if round == 0 {
                    for &(p, n) in &theirs {
                        a2.deallocate_per_thread(p, n).unwrap();
                    }
                }
                a2.release_thread().unwrap();
            }
            left
        })
        .join()
        .unwrap()
    });
    live.assert_clean();
    let third = Worker::new(&a);
    let pl = pool_left.clone();
    third.run(move |a| {
        for (p, n) in pl {
            a.deallocate_per_thread(p, n).unwrap();
            assert!(is_double(&a.deallocate_per_thread(p, n)), "a second free");
        }
    });
    owner.run(|a| a.flush()).unwrap();
    drop((owner, third));
    all_back_with(&a, &dev, 3);
}

// ---------------------------------------------------------------------------------------------
// 11. Out of memory during a capture with only legacy-fenced memory, then after it.

/// Under a cap at what is reserved, all of the pool's free memory freed on the legacy stream:
/// during the capture a request on another thread's per-thread stream and one on a user stream
/// are refused clearly (`StreamCapturing` of the legacy stream), changing nothing (no block,
/// no statistics, reserved bytes unchanged); the OOM hook may be called. After the capture the
/// same requests succeed under the same cap.
#[test]
fn only_legacy_fenced_memory_under_a_cap_is_refused_then_served_after_the_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10));
    let ps: Vec<_> = (0..4).map(|_| a.allocate(MIB, Stream::LEGACY).unwrap()).collect();
    ps.into_iter().for_each(|p| a.deallocate(p, MIB, Stream::LEGACY).unwrap());
    a.flush().unwrap();
    a.release_thread().unwrap();
    let cap = a.stats().reserved_bytes as usize;
    a.set_limit_bytes(cap);
    let hook_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let hc = Arc::clone(&hook_calls);
    a.set_oom_hook(Some(Arc::new(move |_, _| {
        hc.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        false
    })));
    let u = dev.create_stream();
    let w = Worker::new(&a);
    let results = captured(&dev, || {
        w.run(move |a| {
            let before = a.stats();
            let r1 = a.allocate_per_thread(MIB);
            let r2 = a.allocate(MIB, u);
            let r3 = a.allocate_per_thread(4096); // an arena's growth: a superblock
            let after = a.stats();
            assert_eq!(
                (after.allocations, after.live_bytes, after.reserved_bytes),
                (before.allocations, before.live_bytes, before.reserved_bytes),
                "a refusal changed something"
            );
            (r1, r2, r3)
        })
    });
    for r in [&results.0, &results.1, &results.2] {
        match r {
            Err(e) => {
                assert!(legacy_refusal(e), "not the legacy refusal: {e}");
                assert!(e.to_string().contains("blocking stream"), "{e}");
            }
            Ok(p) => panic!("{p:?} handed out from legacy-fenced memory during the capture"),
        }
    }
    // After the capture, under the same cap, all served.
    w.run(move |a| {
        let p = a.allocate_per_thread(MIB).unwrap();
        let q = a.allocate(MIB, u).unwrap();
        let r = a.allocate_per_thread(4096).unwrap();
        a.deallocate_per_thread(p, MIB).unwrap();
        a.deallocate(q, MIB, u).unwrap();
        a.deallocate_per_thread(r, 4096).unwrap();
    });
    a.set_limit_bytes(usize::MAX);
    a.set_oom_hook(None);
    w.exit();
    dev.destroy_stream(u).unwrap();
    eprintln!("OOM hook calls: {}", hook_calls.load(std::sync::atomic::Ordering::Relaxed));
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 12. Parked legacy frees towards an owner that exits during the capture, its shell reused.

/// A thread's legacy-stream frees of an owner's blocks are refused at its flush during the
/// capture and parked; the owner then exits during the capture (the blocks, freed but parked,
/// stay handed out as pool blocks), and a new thread takes its idle shell and allocates a lot
/// during the capture: none of the parked blocks is handed out, and a second free of one is
/// refused. After the capture the parked frees reach the reused shell's new owner (not its
/// blocks: sent to the pool) and everything comes back.
#[test]
fn parked_legacy_frees_towards_an_owner_that_exits_during_the_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small());
    let live = Arc::new(Live::default());
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    let blocks: Vec<(DeviceAddr, usize)> = owner.run(|a| {
        (0..12usize).map(|i| (a.allocate_per_thread(1024 + i * 2000).unwrap(), 1024 + i * 2000)).collect()
    });
    for &(p, n) in &blocks {
        live.insert(p, n); // handed out until the parked frees arrive
    }
    let b2 = blocks.clone();
    freer.run(move |a| {
        for (p, n) in b2 {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
    let newcomer = std::cell::RefCell::new(None);
    let (l2, d2, b3) = (Arc::clone(&live), dev.clone(), blocks.clone());
    captured(&dev, || {
        let r = freer.run(|a| a.flush());
        assert!(clear(&r), "{r:?}");
        assert!(a.parked_free_bytes() > 0, "the refused legacy frees are parked");
        owner.exit();
        let n = Worker::new(&a);
        n.run(move |a| {
            let mut mine = Vec::new();
            for i in 0..300usize {
                let n = 64 + (i * 4099) % (60 << 10);
                let p = a.allocate_per_thread(n).unwrap();
                l2.insert(p, n);
                d2.write_tag(p.0, 256, i as u32, Stream::PER_THREAD).unwrap();
                mine.push((p, n));
            }
            let (p, n) = b3[3];
            assert!(is_double(&a.deallocate_per_thread(p, n)), "a second free of a parked free's block");
            for (p, n) in mine {
                l2.remove(p);
                a.deallocate_per_thread(p, n).unwrap();
            }
        });
        *newcomer.borrow_mut() = Some(n);
    });
    live.assert_clean();
    let n = newcomer.into_inner().unwrap();
    a.trim(true).unwrap(); // the parked frees delivered
    n.run(|a| a.flush()).unwrap();
    drop((n, freer));
    all_back_with(&a, &dev, 1);
}

// ---------------------------------------------------------------------------------------------
// 13. `record_stream` naming the legacy stream during a capture.

/// During the capture another thread frees an owner's blocks (arena and pool blocks) declaring
/// them used on the legacy stream (`deallocate_used_on`): the legacy stream may not be used, so
/// each such free is refused clearly and changes nothing, or taken without a legacy use. A
/// refused one is made again after the capture. Nothing handed out twice, everything back.
#[test]
fn record_stream_naming_the_legacy_stream_during_a_capture() {
    let dev = host(20);
    let a = alloc_with(&dev, small().large_max(64 << 10));
    let owner = Worker::new(&a);
    let blocks: Vec<(DeviceAddr, usize)> = owner.run(|a| {
        let mut v: Vec<_> =
            (0..6usize).map(|i| (a.allocate_per_thread(700 + i * 300).unwrap(), 700 + i * 300)).collect();
        v.push((a.allocate_per_thread(2 * MIB).unwrap(), 2 * MIB));
        v
    });
    let other = Worker::new(&a);
    let u = dev.create_stream();
    let b2 = blocks.clone();
    let refused: Vec<(DeviceAddr, usize)> = captured(&dev, || {
        other.run(move |a| {
            let mut refused = Vec::new();
            for (i, (p, n)) in b2.into_iter().enumerate() {
                let before = a.stats();
                let fs = if i % 2 == 0 { Stream::PER_THREAD } else { u };
                match a.deallocate_used_on(p, n, fs, &[Stream::LEGACY]) {
                    Ok(()) => {}
                    Err(e) if capturing(&e) => {
                        let after = a.stats();
                        assert_eq!(
                            (after.deallocations, after.live_bytes),
                            (before.deallocations, before.live_bytes)
                        );
                        refused.push((p, n));
                    }
                    Err(e) => panic!("unclear: {e}"),
                }
            }
            a.flush().unwrap();
            refused
        })
    });
    eprintln!("{} of {} refused during the capture", refused.len(), blocks.len());
    other.run(move |a| {
        for (p, n) in refused {
            a.deallocate_used_on(p, n, Stream::PER_THREAD, &[Stream::LEGACY]).unwrap();
        }
        a.flush().unwrap();
    });
    owner.run(|a| a.flush()).unwrap();
    drop((owner, other));
    dev.destroy_stream(u).unwrap();
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}
