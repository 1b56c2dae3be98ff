//! Thirty-first session, helper-51: adversarial tests of `Allocator::deallocate_used_on` in the
//! normal (non-pass-through) mode.
//!
//! Every test runs on the simulated device. `Spy` (the test kit's) counts every device call
//! (and can fail the call with a chosen index), and counts the records and waits that succeeded.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cuarena::{Allocator, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, Interposed, Spy, assert_all_returned};

/// Makes later work on `to` wait for the work queued so far on `from` (the caller's own
/// ordering of a block's use on a stream other than the one it was allocated on).
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    let e = Device::create_event(sim).unwrap();
    Device::record_event(sim, e, from).unwrap();
    Device::stream_wait_event(sim, to, e).unwrap();
    Device::destroy_event(sim, e);
}

fn reason(r: cuarena::Result<()>) -> InvalidFree {
    match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        other => panic!("expected an invalid free, got {other:?}"),
    }
}

/// Small blocks up to 64 KiB, arena large blocks up to 1 MiB, pool blocks above.
fn normal(spy: &Arc<Interposed<Spy>>) -> Allocator {
    let cfg = common::small().large_max(1 << 20).build().unwrap();
    Allocator::new(spy.clone(), cfg).unwrap()
}

/// (driver_calls, fences_recorded, fence_waits, invalid_frees, live_bytes)
fn st(a: &Allocator) -> (u64, u64, u64, u64, u64) {
    let s = a.stats();
    (s.driver_calls, s.fences_recorded, s.fence_waits, s.invalid_frees, s.live_bytes)
}

// ---------------------------------------------------------------------------------------------
// 1. Bad frees.

/// A bad free declared used on another stream (whose work is held, so an ordering would record
/// and wait) is refused as an invalid free, counted, and orders nothing: no event, no stream
/// made to wait on the declared stream's work (what pass-through mode was fixed to do,
/// `passthrough::a_free_used_on_other_streams_refuses_bad_frees_first_and_counts_every_call`).
/// It makes no more driver calls than the same bad free without declared streams (on a user
/// stream, the identity lookup that tells the block's arena is not that stream's).
#[test]
fn bad_frees_declared_used_on_another_stream_order_nothing() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    for (size, stream) in [(4096, s2), (4096, Stream::PER_THREAD), (300 << 10, Stream::LEGACY), (2 << 20, s2)]
    {
        let p = a.allocate(size, stream).unwrap();
        let keep = a.allocate(size, stream).unwrap();
        let gate = sim.gate(s1).unwrap();
        sim.write_tag(p.0, 256, 7, s1).unwrap();
        let bad: Vec<(DeviceAddr, usize, InvalidFree)> = vec![
            (DeviceAddr(p.0 + 256), size, InvalidFree::UnknownPointer),
            (p, size + (64 << 10), InvalidFree::SizeMismatch { allocated: size, given: size + (64 << 10) }),
            (DeviceAddr(0x10), 64, InvalidFree::UnknownPointer),
            (DeviceAddr(0), 64, InvalidFree::UnknownPointer),
            (p, 0, InvalidFree::ZeroSize),
        ];
        for (q, n, want) in bad {
            // What the same bad free costs without declared streams: on a user stream, the
            // identity lookup that finds the block's arena is not its home.
            let c0 = spy.calls();
            assert_eq!(
                reason(a.deallocate(q, n, stream)),
                want,
                "size {size} stream {stream:?} free ({q:?}, {n})"
            );
            let plain = spy.calls() - c0;
            let (c0, r0, w0) = (spy.calls(), spy.records.load(SeqCst), spy.waits.load(SeqCst));
            let (_, f0, fw0, i0, l0) = st(&a);
            let got = a.deallocate_used_on(q, n, stream, &[s1, Stream::LEGACY]);
            assert_eq!(reason(got), want, "size {size} stream {stream:?} free ({q:?}, {n})");
            let (c1, r1, w1) = (spy.calls(), spy.records.load(SeqCst), spy.waits.load(SeqCst));
            let (_, f1, fw1, i1, l1) = st(&a);
            assert_eq!(i1 - i0, 1, "the refusal of ({q:?}, {n}) was not counted");
            assert_eq!(l1, l0, "a bad free changed the live bytes");
            // At most the fast path's capture query and the slow path's identity lookup.
            assert!(plain <= 2, "a plain bad free made {plain} driver calls");
            assert!(
                c1 - c0 <= plain,
                "a declared bad free made {} driver calls, a plain one {plain}",
                c1 - c0
            );
            assert_eq!(
                (r1 - r0, w1 - w0, f1 - f0, fw1 - fw0),
                (0, 0, 0, 0),
                "size {size} stream {stream:?}: the bad free ({q:?}, {n}) made driver calls beyond \
                 a plain bad free's (records, waits, fences_recorded, fence_waits)"
            );
        }
        a.deallocate_used_on(p, size, stream, &[s1]).unwrap();
        gate.open();
        sim.synchronize();
        let gate = sim.gate(s1).unwrap();
        sim.write_tag(keep.0, 256, 8, s1).unwrap();
        // A double free while the declared stream's work is held: no more calls than a plain
        // double free's.
        let c0 = spy.calls();
        assert_eq!(reason(a.deallocate(p, size, stream)), InvalidFree::DoubleFree);
        let plain = spy.calls() - c0;
        let (c0, r0, w0) = (spy.calls(), spy.records.load(SeqCst), spy.waits.load(SeqCst));
        let (_, _, _, i0, _) = st(&a);
        assert_eq!(reason(a.deallocate_used_on(p, size, stream, &[s1])), InvalidFree::DoubleFree);
        assert_eq!(st(&a).3 - i0, 1);
        assert!(spy.calls() - c0 <= plain, "size {size} stream {stream:?}: a double free made driver calls");
        assert_eq!((spy.records.load(SeqCst) - r0, spy.waits.load(SeqCst) - w0), (0, 0));
        a.deallocate_used_on(keep, size, stream, &[s1]).unwrap();
        gate.open();
    }
    assert_all_returned(&a, Some(&sim), 12 * 4); // each bad free twice: plain, then declared
}

/// A bad free naming a destroyed stream among its declared streams is still reported as the
/// invalid free it is (a foreign pointer, a double free), counted in `invalid_frees`.
#[test]
fn a_bad_free_declared_on_a_destroyed_stream_is_reported_as_invalid() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let s1 = sim.create_stream();
    sim.destroy_stream(s1).unwrap();
    let i0 = st(&a).3;
    let r = a.deallocate_used_on(DeviceAddr(0x1000), 4096, Stream::PER_THREAD, &[s1]);
    sim.take_stale_handle_calls();
    assert!(matches!(r, Err(Error::InvalidFree { .. })), "a foreign pointer's free answered {r:?}");
    assert_eq!(st(&a).3 - i0, 1, "the refusal went uncounted");
    assert_all_returned(&a, Some(&sim), 1);
}

// ---------------------------------------------------------------------------------------------
// 2. Driver failures.

/// For blocks of every path and the free on every kind of stream, each driver call the free
/// makes is failed in turn: each failure fails the free, frees nothing, `driver_calls` counts
/// every call the device saw, and the block is freed once afterwards; no reuse under the
/// declared streams' work, no event left after a trim beyond a clean run's.
#[test]
fn every_failed_call_of_a_declared_free_frees_nothing() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let (s1, s2, s3) = (sim.create_stream(), sim.create_stream(), sim.create_stream());
    let mut tag = 1u32;
    let mut bad = 0;
    for size in [4096usize, 300 << 10, 2 << 20] {
        for stream in [Stream::PER_THREAD, Stream::LEGACY, s3] {
            for alloc_on in [Stream::PER_THREAD, s3] {
                let p = a.allocate(size, alloc_on).unwrap();
                let gate = sim.gate(s1).unwrap();
                tag += 1;
                order(&sim, alloc_on, s1);
                sim.write_tag(p.0, size, tag, s1).unwrap();
                sim.check_tag(p.0, size, tag, s1).unwrap();
                let used = [s1, Stream::LEGACY, s2, Stream::PER_THREAD, stream, s1];
                let mut n = 0;
                loop {
                    let (c0, (d0, f0, w0, _, l0)) = (spy.calls(), st(&a));
                    let (r0, wt0) = (spy.records.load(SeqCst), spy.waits.load(SeqCst));
                    spy.fail_at.store(c0 + n, SeqCst);
                    let r = a.deallocate_used_on(p, size, stream, &used);
                    spy.fail_at.store(u64::MAX, SeqCst);
                    let (c1, (d1, f1, w1, _, l1)) = (spy.calls(), st(&a));
                    let (r1, wt1) = (spy.records.load(SeqCst), spy.waits.load(SeqCst));
                    let what = format!("size {size} on {alloc_on:?} freed on {stream:?}, call {n} failed");
                    assert_eq!(d1 - d0, c1 - c0, "{what}: driver_calls vs the device's calls");
                    assert_eq!((f1 - f0, w1 - w0), (r1 - r0, wt1 - wt0), "{what}: fence counts");
                    match r {
                        Ok(()) => {
                            assert!(c1 - c0 <= n, "{what}: the chosen call was made, yet Ok");
                            break;
                        }
                        Err(Error::Driver { code: 999, .. }) => {
                            assert_eq!(l1, l0, "{what}: a failed free changed the live bytes");
                        }
                        Err(e) => panic!("{what}: {e:?}"),
                    }
                    n += 1;
                    assert!(n < 200, "{what}: never succeeded");
                }
                assert_eq!(reason(a.deallocate_used_on(p, size, stream, &used)), InvalidFree::DoubleFree);
                bad += 1;
                // Reuse while s1's work is held: every reuse must wait for it.
                for s in [Stream::PER_THREAD, Stream::LEGACY, s2, s3] {
                    let q = a.allocate(size, s).unwrap();
                    sim.write_tag(q.0, size, 0xdead, s).unwrap();
                    a.deallocate(q, size, s).unwrap();
                }
                gate.open();
                sim.synchronize();
                assert_eq!(sim.violations(), Vec::<String>::new(), "size {size} on {stream:?}");
                assert_eq!(sim.tag_errors(), 0, "size {size} on {stream:?}: reused under declared work");
            }
        }
    }
    a.trim(true).unwrap();
    let left = sim.live_events();
    assert_all_returned(&a, Some(&sim), bad);
    drop(a);
    assert_eq!(sim.live_events(), 0, "events left after the allocator's drop ({left} after a trim)");
}

// ---------------------------------------------------------------------------------------------
// 3. Reuse before the declared streams' work is done.

/// A block declared used on a held stream and freed on another is not handed to any other
/// stream or thread before the held work is done: the owner's reuse on every stream, then
/// (its arena released) other threads' reuse on theirs.
#[test]
fn no_block_of_any_path_is_reused_before_the_declared_work() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let (d, s3) = (sim.create_stream(), sim.create_stream());
    for size in [4096usize, 300 << 10, 2 << 20] {
        for declared in [d, Stream::LEGACY, Stream::PER_THREAD] {
            for stream in [Stream::PER_THREAD, Stream::LEGACY, s3] {
                let p = a.allocate(size, stream).unwrap();
                let gate = sim.gate(declared).unwrap();
                order(&sim, stream, declared);
                sim.hold_and_check(p.0, size, 0x5157, Duration::from_micros(200), declared).unwrap();
                a.deallocate_used_on(p, size, stream, &[declared]).unwrap();
                for s in [Stream::PER_THREAD, Stream::LEGACY, s3, d] {
                    for _ in 0..3 {
                        let q = a.allocate(size, s).unwrap();
                        sim.write_tag(q.0, size, 0xbad, s).unwrap();
                        a.deallocate(q, size, s).unwrap();
                    }
                }
                a.release_thread().unwrap();
                a.flush().unwrap();
                a.release_thread().unwrap();
                let b = Arc::new(Barrier::new(3));
                let hs: Vec<_> = (0..3)
                    .map(|t| {
                        let (a, sim, b) = (a.clone(), sim.clone(), b.clone());
                        std::thread::spawn(move || {
                            // No user stream of their own: its arena, parked at the thread's
                            // exit past 64 MiB, would synchronise under the closed gate.
                            let s = [Stream::PER_THREAD, Stream::LEGACY, Stream::PER_THREAD][t];
                            b.wait();
                            for _ in 0..4 {
                                let q = a.allocate(size, s).unwrap();
                                sim.write_tag(q.0, size, 0xbad0 + t as u32, s).unwrap();
                                a.deallocate(q, size, s).unwrap();
                            }
                            a.release_thread().unwrap();
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().unwrap();
                }
                gate.open();
                sim.synchronize();
                let v = sim.violations();
                let what = format!("size {size} declared {declared:?} freed on {stream:?}");
                assert!(v.is_empty(), "{what}: {:?}", &v[..v.len().min(3)]);
                assert_eq!(sim.tag_errors(), 0, "{what}: reused under the declared stream's work");
            }
        }
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A remote free: the block's owner (on a user stream, or its per-thread stream) has exited;
/// another thread frees it declared used on a held stream; nobody reuses it before.
#[test]
fn a_remote_declared_free_of_an_exited_owners_block_waits_for_the_declared_work() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let (d, u) = (sim.create_stream(), sim.create_stream());
    for size in [4096usize, 300 << 10, 2 << 20] {
        for home in [Stream::PER_THREAD, u, Stream::LEGACY] {
            for stream in [Stream::PER_THREAD, u, Stream::LEGACY] {
                let (a2, s2) = (a.clone(), sim.clone());
                let blocks: Vec<DeviceAddr> = std::thread::spawn(move || {
                    let v: Vec<_> = (0..4).map(|_| a2.allocate(size, home).unwrap()).collect();
                    for &p in &v {
                        s2.write_tag(p.0, size, 1, home).unwrap();
                    }
                    v
                })
                .join()
                .unwrap();
                // The owner's use on its home stream is not declared: done before.
                sim.synchronize();
                let gate = sim.gate(d).unwrap();
                for &p in &blocks {
                    sim.hold_and_check(p.0, size, 0x77, Duration::from_micros(100), d).unwrap();
                    a.deallocate_used_on(p, size, stream, &[d, stream]).unwrap();
                }
                a.flush().unwrap();
                a.release_thread().unwrap();
                let hs: Vec<_> = (0..3)
                    .map(|t| {
                        let (a, sim) = (a.clone(), sim.clone());
                        std::thread::spawn(move || {
                            let s = [Stream::PER_THREAD, Stream::LEGACY, u][t];
                            for _ in 0..8 {
                                let q = a.allocate(size, s).unwrap();
                                sim.write_tag(q.0, size, 0xbad, s).unwrap();
                                a.deallocate(q, size, s).unwrap();
                            }
                            a.flush().unwrap();
                            a.release_thread().unwrap();
                        })
                    })
                    .collect();
                for h in hs {
                    h.join().unwrap();
                }
                gate.open();
                sim.synchronize();
                let v = sim.violations();
                let what = format!("size {size} home {home:?} freed on {stream:?}");
                assert!(v.is_empty(), "{what}: {:?}", &v[..v.len().min(3)]);
                assert_eq!(sim.tag_errors(), 0, "{what}: reused under the declared stream's work");
            }
        }
    }
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// 4. Odd declared lists.

/// The free's own stream, duplicates, the per-thread and legacy streams, a reused handle and a
/// list of 1000 entries: every free succeeds, `driver_calls` equals the device's calls, the
/// fence counters equal the successful records and waits, and a 1000-entry list does not keep
/// 1000 events.
#[test]
fn odd_declared_lists_are_ordered_and_counted_exactly() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let old = sim.create_stream();
    sim.destroy_stream(old).unwrap();
    let reused = sim.create_stream();
    assert_eq!(reused, old, "the simulator gives the destroyed handle to the next stream");
    let long: Vec<Stream> = (0..1000).map(|i| [s1, s2, Stream::LEGACY, Stream::PER_THREAD][i % 4]).collect();
    let lists: Vec<Vec<Stream>> = vec![
        vec![s2],
        vec![s2, s2, s2],
        vec![Stream::PER_THREAD],
        vec![Stream::LEGACY, Stream::LEGACY],
        vec![reused, s1],
        long.clone(),
    ];
    for stream in [s2, Stream::PER_THREAD, Stream::LEGACY] {
        for list in &lists {
            for size in [4096usize, 300 << 10, 2 << 20] {
                let p = a.allocate(size, stream).unwrap();
                let g1 = sim.gate(s1).unwrap();
                let g2 = sim.gate(reused).unwrap();
                order(&sim, stream, s1);
                sim.hold_and_check(p.0, size, 3, Duration::from_micros(50), s1).unwrap();
                let (c0, r0, w0) = (spy.calls(), spy.records.load(SeqCst), spy.waits.load(SeqCst));
                let (d0, f0, fw0, _, _) = st(&a);
                let ev0 = sim.live_events();
                let mut list = list.clone();
                list.push(s1); // the held work's stream
                a.deallocate_used_on(p, size, stream, &list).unwrap();
                let (c1, r1, w1) = (spy.calls(), spy.records.load(SeqCst), spy.waits.load(SeqCst));
                let (d1, f1, fw1, _, _) = st(&a);
                let what = format!("size {size} on {stream:?}, {} declared", list.len());
                assert_eq!(d1 - d0, c1 - c0, "{what}: driver_calls");
                assert_eq!((f1 - f0, fw1 - fw0), (r1 - r0, w1 - w0), "{what}: fence counters");
                assert!(sim.live_events() <= ev0 + 8, "{what}: {} events made", sim.live_events() - ev0);
                for s in [Stream::PER_THREAD, Stream::LEGACY, s2] {
                    let q = a.allocate(size, s).unwrap();
                    sim.write_tag(q.0, size, 9, s).unwrap();
                    a.deallocate(q, size, s).unwrap();
                }
                g1.open();
                g2.open();
                sim.synchronize();
                assert_eq!(sim.violations(), Vec::<String>::new(), "{what}");
                assert_eq!(sim.tag_errors(), 0, "{what}");
            }
        }
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A free whose declared stream was destroyed (its handle not reused) fails and frees nothing;
/// the block is freed afterwards exactly once.
#[test]
fn a_free_declared_on_a_destroyed_stream_fails_and_frees_nothing() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = normal(&spy);
    let s1 = sim.create_stream();
    for size in [4096usize, 300 << 10, 2 << 20] {
        let gone = sim.create_stream();
        sim.destroy_stream(gone).unwrap();
        let p = a.allocate(size, s1).unwrap();
        let l0 = st(&a).4;
        let r = a.deallocate_used_on(p, size, s1, &[Stream::LEGACY, gone]);
        sim.take_stale_handle_calls();
        assert!(r.is_err(), "size {size}: a free declared on a destroyed stream answered Ok");
        assert_eq!(st(&a).4, l0, "size {size}: the failed free changed the live bytes");
        a.deallocate_used_on(p, size, s1, &[Stream::LEGACY]).unwrap();
        assert_eq!(reason(a.deallocate(p, size, s1)), InvalidFree::DoubleFree);
        let _ = sim.create_stream(); // takes the handle back
    }
    assert_all_returned(&a, Some(&sim), 3);
}

// ---------------------------------------------------------------------------------------------
// 5. Races.

/// Threads free their blocks declared used on each other's held streams, racing; other threads
/// allocate and write meanwhile. No reuse under held work, statistics exact at the end.
#[test]
fn racing_declared_frees_never_hand_out_held_blocks() {
    let sim = common::host(20);
    let a =
        Allocator::new(Arc::new(sim.clone()), common::small().large_max(1 << 20).build().unwrap()).unwrap();
    let streams: Vec<Stream> = (0..4).map(|_| sim.create_stream()).collect();
    let gates: Vec<_> = streams.iter().map(|&s| sim.gate(s).unwrap()).collect();
    let (b, done) = (Arc::new(Barrier::new(8)), Arc::new(Barrier::new(9)));
    let hs: Vec<_> = (0..8)
        .map(|t| {
            let (a, sim, b, streams) = (a.clone(), sim.clone(), b.clone(), streams.clone());
            let done = done.clone();
            std::thread::spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                b.wait();
                for i in 0..60 {
                    let size =
                        [256usize, 4096, 60 << 10, 300 << 10, 2 << 20][(common::rng(&mut x) % 5) as usize];
                    let home = [Stream::PER_THREAD, Stream::LEGACY, streams[t % 4]][i % 3];
                    let p = a.allocate(size, home).unwrap();
                    if t < 4 {
                        let d = streams[(t + 1 + i) % 4];
                        order(&sim, home, d);
                        sim.hold_and_check(p.0, size, (t * 1000 + i) as u32, Duration::from_micros(10), d)
                            .unwrap();
                        let free_on = [home, Stream::PER_THREAD, Stream::LEGACY, streams[t]][i % 4];
                        a.deallocate_used_on(p, size, free_on, &[d, free_on, Stream::LEGACY]).unwrap();
                    } else {
                        sim.write_tag(p.0, size, 0xbad, home).unwrap();
                        a.deallocate(p, size, home).unwrap();
                    }
                }
                // Released (and exited) only once the gates are open: a release parking past
                // 64 MiB synchronises the device.
                done.wait();
                a.release_thread().unwrap();
            })
        })
        .collect();
    done.wait();
    drop(gates);
    for h in hs {
        h.join().unwrap();
    }
    sim.synchronize();
    assert_eq!(sim.violations().len(), 0, "{:?}", &sim.violations()[..sim.violations().len().min(3)]);
    assert_eq!(sim.tag_errors(), 0);
    assert_all_returned(&a, Some(&sim), 0);
}
