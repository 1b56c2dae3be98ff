//! Adversarial tests of user-stream arenas: streams destroyed under the allocator's feet,
//! their handles reused, arenas parked, reclaimed, replaced and dropped while other threads
//! free their blocks. Every test ends with every byte back and the race checker clean.

mod common;

use std::time::Duration;

use common::{Live, Worker, alloc_with, host, on_thread, small};
use cuarena::{Allocator, Device, DeviceAddr, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

fn alloc_on(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), small().build().unwrap()).unwrap()
}

/// On a fresh thread: a stream made, `n` blocks of `size` used on it by long work, freed on it
/// (the arena's local fast path: no event), the stream destroyed, the thread gone. The arena
/// is parked.
fn park_one(a: &Allocator, sim: &HostDevice, n: usize, size: usize, hold: Duration) {
    on_thread(a, {
        let sim = sim.clone();
        move |a| {
            let s = sim.create_stream();
            let ps: Vec<DeviceAddr> = (0..n).map(|_| a.allocate(size, s).unwrap()).collect();
            for (i, p) in ps.iter().enumerate() {
                sim.hold_and_check(p.0, size, i as u32 | 1, hold, s).unwrap();
            }
            for p in ps {
                a.deallocate(p, size, s).unwrap();
            }
            sim.destroy_stream(s).unwrap();
        }
    });
}

/// Dropping the allocator while an arena of a destroyed stream is parked, its memory still
/// under work queued on that stream: the drop must wait for that work before it releases the
/// chunks (as it does for memory behind fences: see `adversarial_streams.rs`,
/// `allocator_drop_with_lazy_fences_pending`), with no panic, and every byte goes back.
#[test]
fn drop_with_parked_arena_waits_for_dead_stream_work() {
    let sim = host(0);
    {
        let a = alloc_on(&sim);
        park_one(&a, &sim, 4, 16 << 10, Duration::from_millis(100));
        assert!(a.parked_bytes() > 0, "the arena is parked");
        assert_eq!(a.stats().live_bytes, 0);
        drop(a);
    }
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0);
    assert_eq!(sim.reserved_bytes(), 0, "the allocator's drop released every chunk");
}

/// A small request that runs out of memory while arenas of destroyed streams are parked: the
/// out-of-memory path gives every parked arena back (allocator.rs, `Zombies`: "as do the
/// out-of-memory path"), after one device synchronise, and the parked byte count follows.
#[test]
fn small_request_out_of_memory_buries_parked_arenas() {
    let sim = host(20);
    let a = alloc_with(&sim, small().max_bytes(2 << 20));
    for _ in 0..6 {
        park_one(&a, &sim, 3, 60 << 10, Duration::from_micros(200));
    }
    let parked = a.parked_bytes();
    assert!(parked >= 6 * (256 << 10), "{parked}");
    let syncs = a.stats().host_syncs;
    // Small blocks on the per-thread stream up to nearly the cap: only possible with the
    // parked arenas' memory back.
    let size = 60 << 10;
    let ps: Vec<DeviceAddr> = (0..28).map(|_| a.allocate(size, Stream::PER_THREAD).unwrap()).collect();
    let s = a.stats();
    assert_eq!(a.parked_bytes(), 0, "parked arenas given back, and the count with them: {s:?}");
    assert!(s.host_syncs - syncs <= 2, "one device synchronise for all parked arenas: {s:?}");
    for p in ps {
        a.deallocate(p, size, Stream::PER_THREAD).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A worker thread that used a user stream (blocks freed there under running work) whose
/// stream is then destroyed: its arena holds that memory, the worker lives on, idle.
fn worker_with_arena_of_a_destroyed_stream(a: &Allocator, sim: &HostDevice) -> Worker {
    let w = Worker::new(a);
    let s = sim.create_stream();
    w.run({
        let sim = sim.clone();
        move |a| {
            let ps: Vec<DeviceAddr> = (0..4).map(|_| a.allocate(32 << 10, s).unwrap()).collect();
            for p in &ps {
                sim.hold_and_check(p.0, 32 << 10, 5, Duration::from_micros(300), s).unwrap();
            }
            for p in ps {
                a.deallocate(p, 32 << 10, s).unwrap();
            }
        }
    });
    sim.destroy_stream(s).unwrap();
    w
}

/// `trim(true)` on a thread whose user arena's stream was destroyed (the thread lives on and
/// keeps the arena): trim's contract is that every superblock holding no used block goes back
/// from this thread's arenas and idle threads' ones; blocking, it may synchronise.
#[test]
fn blocking_trim_takes_back_own_arena_of_destroyed_stream() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let w = worker_with_arena_of_a_destroyed_stream(&a, &sim);
    // From the owner itself.
    let held = w.run(|a| {
        a.trim(true).unwrap();
        a.stats().arena_held_bytes
    });
    assert_eq!(held, 0, "the owner's trim(true) left its dead stream's arena holding memory");
    w.exit();
    assert_all_returned(&a, Some(&sim), 0);
}

/// As above, the trimming thread another one, the owner idle.
#[test]
fn blocking_trim_takes_back_idle_threads_arena_of_destroyed_stream() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let w = worker_with_arena_of_a_destroyed_stream(&a, &sim);
    a.trim(true).unwrap();
    let st = a.stats();
    assert_eq!(st.arena_held_bytes, 0, "an idle thread's dead-stream arena kept memory: {st:?}");
    assert_eq!(sim.reserved_bytes(), 0, "trim(true) released nothing of it");
    w.exit();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Makes later work on `to` wait for the work queued on `from` so far.
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    let ev = sim.create_event().unwrap();
    sim.record_event(ev, from).unwrap();
    sim.stream_wait_event(to, ev).unwrap();
}

/// A stream destroyed with its freed blocks still under work, its handle given at once to a
/// new stream that the same thread allocates on: the new stream gets a new arena (another
/// identity), so none of those blocks is handed to it unfenced.
#[test]
fn reused_handle_on_the_same_thread_gets_a_new_arena() {
    let sim = host(0);
    let a = alloc_on(&sim);
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let live = Live::default();
            let mut s = sim.create_stream();
            for round in 0..30u32 {
                let sizes = [256, 4 << 10, 16 << 10, 60 << 10, 1 << 10];
                let ps: Vec<(DeviceAddr, usize)> =
                    sizes.iter().map(|&n| (a.allocate(n, s).unwrap(), n)).collect();
                for &(p, n) in &ps {
                    live.insert(p, n);
                    sim.hold_and_check(p.0, n, round | 1, Duration::from_micros(400), s).unwrap();
                }
                for (p, n) in ps {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                sim.destroy_stream(s).unwrap();
                let t = sim.create_stream();
                assert_eq!(t, s, "the simulator gives the handle to the next stream");
                s = t;
                // Same sizes at once on the new stream: a block of the old arena would race.
                let qs: Vec<(DeviceAddr, usize)> =
                    sizes.iter().map(|&n| (a.allocate(n, s).unwrap(), n)).collect();
                for &(p, n) in &qs {
                    live.insert(p, n);
                    sim.write_tag(p.0, n, 0xdead_0000 | round, s).unwrap();
                }
                for (p, n) in qs {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                let st = a.stats();
                assert!(
                    st.arenas as usize <= cuarena::MAX_USER_ARENAS,
                    "at most MAX_USER_ARENAS user arenas: {st:?}"
                );
            }
            sim.destroy_stream(s).unwrap();
            live.assert_clean();
        }
    });
    assert_all_returned(&a, Some(&sim), 0);
}

/// A thread that makes, uses and destroys a new stream at every step, some blocks living on
/// into the next step's stream (ordered there by an event, freed there): replacement,
/// parking and burying under load, under a cap well below what the parked arenas would hold
/// if never given back.
#[test]
fn stream_per_step_churn_under_a_cap() {
    let sim = host(30);
    let cap = 8 << 20;
    let a = alloc_with(&sim, small().max_bytes(cap));
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let live = Live::default();
            let mut x = 0x1234_5678_9abc_def1u64;
            let mut carried: Vec<(DeviceAddr, usize)> = Vec::new();
            let mut prev: Option<Stream> = None;
            for step in 0..400u32 {
                let s = sim.create_stream();
                if let Some(p) = prev.take() {
                    order(&sim, p, s); // the carried blocks' earlier use, before `s`
                    sim.destroy_stream(p).unwrap();
                }
                for (p, n) in carried.drain(..) {
                    sim.check_tag(p.0, n.min(256), 0x0c00_0000 | (step - 1), s).unwrap();
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                let mut ps = Vec::new();
                for _ in 0..(3 + common::rng(&mut x) % 6) {
                    let n = 256 * (1 + (common::rng(&mut x) % 240) as usize);
                    let p = a.allocate(n, s).unwrap();
                    live.insert(p, n);
                    sim.hold_and_check(p.0, n.min(4096), step | 1, Duration::from_micros(60), s).unwrap();
                    ps.push((p, n));
                }
                for (i, (p, n)) in ps.into_iter().enumerate() {
                    if i % 3 == 0 {
                        sim.write_tag(p.0, n.min(256), 0x0c00_0000 | step, s).unwrap();
                        carried.push((p, n));
                    } else {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                assert!(sim.reserved_bytes() <= cap, "reserved {} above the cap", sim.reserved_bytes());
                assert!(a.parked_bytes() <= (64 << 20) + (1 << 20), "parked {}", a.parked_bytes());
                let st = a.stats();
                assert!(
                    st.arenas as usize <= 1 + cuarena::MAX_USER_ARENAS,
                    "the per-thread arena and at most MAX_USER_ARENAS user arenas: {st:?}"
                );
                assert!(st.arena_held_bytes <= st.pool_in_use_bytes, "{st:?}");
                prev = Some(s);
            }
            let s = prev.unwrap();
            for (p, n) in carried {
                live.remove(p);
                a.deallocate(p, n, s).unwrap();
            }
            sim.destroy_stream(s).unwrap();
            live.assert_clean();
        }
    });
    let st = a.stats();
    assert!(st.host_syncs > 0, "parked arenas were given back under load, after a synchronise: {st:?}");
    assert_all_returned(&a, Some(&sim), 0);
}

/// Blocks of an arena parked after its stream was destroyed, freed afterwards by another
/// thread on its own user stream, on the legacy stream and on its per-thread stream, with
/// double frees among them; `trim(false)` meanwhile neither blocks nor loses anything.
#[test]
fn frees_into_a_parked_arena_from_other_threads_and_streams() {
    let sim = host(50);
    let a = alloc_on(&sim);
    let n = 24;
    let size = 8 << 10;
    // The owner: blocks used on `s`, half freed locally, half handed over, `s` destroyed (an
    // event recorded on it first, for the receiver to order its work after), thread gone.
    let (handed, ev) = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let s = sim.create_stream();
            let ps: Vec<DeviceAddr> = (0..n).map(|_| a.allocate(size, s).unwrap()).collect();
            for (i, p) in ps.iter().enumerate() {
                sim.hold_and_check(p.0, size, i as u32 | 1, Duration::from_micros(200), s).unwrap();
            }
            let (mine, theirs) = ps.split_at(n / 2);
            for p in mine {
                a.deallocate(*p, size, s).unwrap();
            }
            let ev = sim.create_event().unwrap();
            sim.record_event(ev, s).unwrap();
            sim.destroy_stream(s).unwrap();
            (theirs.to_vec(), ev)
        }
    });
    let parked = a.parked_bytes();
    assert!(parked > 0);
    let syncs = a.stats().host_syncs;
    a.trim(false).unwrap();
    assert_eq!(a.parked_bytes(), parked, "trim(false) gives nothing parked back");
    assert_eq!(a.stats().host_syncs, syncs, "trim(false) does not block");
    let bad = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let t = sim.create_stream();
            sim.stream_wait_event(t, ev).unwrap();
            sim.stream_wait_event(Stream::LEGACY, ev).unwrap();
            sim.stream_wait_event(Stream::PER_THREAD, ev).unwrap();
            let mut bad = 0;
            for (i, p) in handed.iter().enumerate() {
                let on = [t, Stream::LEGACY, Stream::PER_THREAD][i % 3];
                sim.hold_and_check(p.0, size, 0x77, Duration::from_micros(100), on).unwrap();
                a.deallocate(*p, size, on).unwrap();
                // A second free, on any stream, is refused at once (the block's freed flag).
                let again = [Stream::PER_THREAD, t, Stream::LEGACY][i % 3];
                match a.deallocate(*p, size, again) {
                    Err(cuarena::Error::InvalidFree { .. }) => bad += 1,
                    r => panic!("a double free of a parked arena's block: {r:?}"),
                }
            }
            a.flush().unwrap();
            a.release_thread().unwrap();
            sim.destroy_stream(t).unwrap();
            bad
        }
    });
    assert_eq!(bad, handed_len(n));
    assert_eq!(a.stats().live_bytes, 0);
    assert_all_returned(&a, Some(&sim), bad);
}

fn handed_len(n: usize) -> u64 {
    (n - n / 2) as u64
}

/// The owner's invalid frees of its user-arena blocks, on its stream and others: double
/// frees (also of a block in the arena's cache), wrong sizes, a free on a destroyed stream's
/// handle (an error, the block not lost); and blocks of the per-thread arena freed on the user
/// stream and the other way round.
#[test]
fn owner_bad_frees_of_user_arena_blocks() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let bad = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let mut bad = 0u64;
            let mut refused = |r: cuarena::Result<()>| match r {
                Err(cuarena::Error::InvalidFree { .. }) => bad += 1,
                r => panic!("not refused: {r:?}"),
            };
            let s = sim.create_stream();
            let u = sim.create_stream();
            let size = 4 << 10;
            // Freed on its stream (cached), then again on each stream.
            let p = a.allocate(size, s).unwrap();
            a.deallocate(p, size, s).unwrap();
            refused(a.deallocate(p, size, s));
            refused(a.deallocate(p, size, u));
            refused(a.deallocate(p, size, Stream::LEGACY));
            refused(a.deallocate(p, size, Stream::PER_THREAD));
            // Wrong sizes on every stream, then the right free.
            let q = a.allocate(size, s).unwrap();
            for on in [s, u, Stream::LEGACY, Stream::PER_THREAD] {
                refused(a.deallocate(q, size * 2, on));
                refused(a.deallocate(q, 256, on));
            }
            a.deallocate(q, size, s).unwrap();
            // A user-arena block freed on the per-thread stream and the legacy stream, then
            // again on its own stream.
            let r1 = a.allocate(size, s).unwrap();
            let r2 = a.allocate(size, s).unwrap();
            sim.write_tag(r1.0, size, 1, s).unwrap();
            sim.write_tag(r2.0, size, 2, s).unwrap();
            order(&sim, s, Stream::PER_THREAD);
            order(&sim, s, Stream::LEGACY);
            a.deallocate(r1, size, Stream::PER_THREAD).unwrap();
            a.deallocate(r2, size, Stream::LEGACY).unwrap();
            refused(a.deallocate(r1, size, s));
            refused(a.deallocate(r2, size, s));
            // A per-thread arena block freed on the user stream, then again on its own.
            let t = a.allocate(size, Stream::PER_THREAD).unwrap();
            sim.write_tag(t.0, size, 3, Stream::PER_THREAD).unwrap();
            order(&sim, Stream::PER_THREAD, u);
            a.deallocate(t, size, u).unwrap();
            refused(a.deallocate(t, size, Stream::PER_THREAD));
            // A free on a destroyed stream's handle: refused, nothing lost.
            let d = sim.create_stream();
            let w = a.allocate(size, d).unwrap();
            sim.write_tag(w.0, size, 4, d).unwrap();
            order(&sim, d, u);
            sim.destroy_stream(d).unwrap();
            assert!(a.deallocate(w, size, d).is_err(), "a free on a destroyed stream's handle");
            // That stale handle was the caller's own, passed on by the free: the only one.
            assert_eq!(sim.take_stale_handle_calls(), 1, "the caller's stale handle, once");
            a.deallocate(w, size, u).unwrap();
            // Reuse after all that on each stream: tags clean.
            for (i, on) in [s, u, Stream::PER_THREAD, Stream::LEGACY].into_iter().enumerate() {
                let ps: Vec<DeviceAddr> = (0..8).map(|_| a.allocate(size, on).unwrap()).collect();
                for p in &ps {
                    sim.hold_and_check(p.0, size, 0x50 + i as u32, Duration::from_micros(50), on).unwrap();
                }
                for p in ps {
                    a.deallocate(p, size, on).unwrap();
                }
            }
            sim.destroy_stream(s).unwrap();
            sim.destroy_stream(u).unwrap();
            bad
        }
    });
    assert_all_returned(&a, Some(&sim), bad);
}

/// Threads that park arenas (stream destroyed, thread released) while another thread keeps
/// reclaiming (`trim(false)`): a thread's exit that finds its arena held by the reclaimer at
/// that moment must still park it (or give it back fenced), never strand its memory.
#[test]
fn thread_exit_racing_a_reclaimer_strands_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let sim = host(5);
    let a = alloc_on(&sim);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let reclaimer = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                a.trim(false).unwrap();
                n += 1;
            }
            a.release_thread().unwrap();
            n
        })
    };
    for i in 0..800u32 {
        on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let s = sim.create_stream();
                let ps: Vec<DeviceAddr> = (0..3).map(|_| a.allocate(2 << 10, s).unwrap()).collect();
                for p in &ps {
                    sim.write_tag(p.0, 2 << 10, i | 1, s).unwrap();
                }
                for p in ps {
                    a.deallocate(p, 2 << 10, s).unwrap();
                }
                sim.destroy_stream(s).unwrap();
            }
        });
    }
    stop.store(true, Ordering::Relaxed);
    let trims = reclaimer.join().unwrap();
    assert!(trims > 0);
    assert_eq!(a.stats().arenas, 0, "{:?}", a.stats());
    assert_all_returned(&a, Some(&sim), 0);
}

/// Threads racing into out-of-memory under a tight cap while others park arenas of
/// destroyed streams: every request either succeeds or fails cleanly with out-of-memory, no
/// block is handed out twice or under running work, and everything comes back.
#[test]
fn out_of_memory_races_with_parking() {
    let sim = host(20);
    let cap = 3 << 20;
    let a = alloc_with(&sim, small().max_bytes(cap));
    let live = std::sync::Arc::new(Live::default());
    let ooms: u64 = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
                sc.spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    let mut ooms = 0;
                    for round in 0..40u32 {
                        let s = sim.create_stream();
                        let mut ps = Vec::new();
                        for k in 0..12 {
                            let n = 1024 * (1 + (common::rng(&mut x) % 63) as usize);
                            let on = if k % 4 == 3 { Stream::PER_THREAD } else { s };
                            match a.allocate(n, on) {
                                Ok(p) => {
                                    live.insert(p, n);
                                    let tag = ((t as u32) << 24) | (round << 8) | k;
                                    sim.hold_and_check(p.0, n.min(8192), tag, Duration::from_micros(80), on)
                                        .unwrap();
                                    ps.push((p, n, on));
                                }
                                Err(cuarena::Error::OutOfMemory { .. }) => ooms += 1,
                                Err(e) => panic!("{e}"),
                            }
                        }
                        for (p, n, on) in ps {
                            live.remove(p);
                            a.deallocate(p, n, on).unwrap();
                        }
                        sim.destroy_stream(s).unwrap();
                        if round % 3 == t as u32 % 3 {
                            a.release_thread().unwrap(); // parks the dead stream's arena
                        }
                        assert!(sim.reserved_bytes() <= cap);
                    }
                    a.release_thread().unwrap();
                    ooms
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    live.assert_clean();
    eprintln!("out-of-memory errors: {ooms}; {:?}", a.stats());
    assert_all_returned(&a, Some(&sim), 0);
}

/// While a thread's user arenas come and go (replaced, parked, buried), its per-thread
/// stream's fast path stays what it was: no driver call, no event, no pool request.
#[test]
fn per_thread_fast_path_unaffected_by_user_arenas() {
    let sim = host(10);
    let a = alloc_on(&sim);
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let churn = |a: &Allocator| {
                for i in 0..2000usize {
                    let n = 256 + (i * 7919) % (32 << 10);
                    let p = a.allocate(n, Stream::PER_THREAD).unwrap();
                    a.deallocate(p, n, Stream::PER_THREAD).unwrap();
                }
            };
            churn(a); // warm
            for round in 0..12u32 {
                let s = sim.create_stream();
                let ps: Vec<DeviceAddr> = (0..5).map(|_| a.allocate(8 << 10, s).unwrap()).collect();
                for p in &ps {
                    sim.hold_and_check(p.0, 8 << 10, round | 1, Duration::from_micros(50), s).unwrap();
                }
                for p in ps {
                    a.deallocate(p, 8 << 10, s).unwrap();
                }
                sim.destroy_stream(s).unwrap();
                let before = a.stats();
                churn(a);
                let after = a.stats();
                assert_eq!(after.driver_calls, before.driver_calls, "{after:?}");
                assert_eq!(after.fences_recorded, before.fences_recorded, "{after:?}");
                assert_eq!(after.pool_allocations, before.pool_allocations, "{after:?}");
            }
            let st = a.stats();
            assert!(
                st.arenas as usize <= 1 + cuarena::MAX_USER_ARENAS,
                "the per-thread arena and at most MAX_USER_ARENAS user arenas: {st:?}"
            );
        }
    });
    assert!(a.parked_bytes() > 0, "the dead streams' arenas were parked");
    assert_all_returned(&a, Some(&sim), 0);
}
