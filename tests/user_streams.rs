//! Arenas for user streams: the fast path, identity by `cuStreamGetId` (never the handle), the
//! replacement of the least recently used arena (one that holds nothing first; the pool past
//! the parked bound), and arenas whose stream was destroyed while
//! they held memory freed on it (parked until a device synchronise).

mod common;

use std::time::Duration;

use common::{Live, host, on_thread, small};
use cuarena::{Allocator, Device, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

fn alloc_on(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), small().build().unwrap()).unwrap()
}

/// Same-stream churn on a user stream is served by the thread's arena with no event and no
/// wait: one identity lookup per allocation and one capture query per free are the only
/// driver calls (frees on the arena's handle ask no identity: `allocator.rs`, "A user arena's
/// own frees").
#[test]
fn user_stream_churn_is_arena_served_without_events() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let s = sim.create_stream();
    let live = Live::default();
    let (warm, steady) = (200, 5_000);
    let before = std::cell::Cell::new(cuarena::Stats::default());
    for i in 0..warm + steady {
        if i == warm {
            before.set(a.stats());
        }
        let size = 256 + (i * 7919) % (32 << 10);
        let p = a.allocate(size, s).unwrap();
        live.insert(p, size);
        sim.write_tag(p.0, size.min(64), i as u32 | 1, s).unwrap();
        live.remove(p);
        a.deallocate(p, size, s).unwrap();
    }
    let (b, e) = (before.get(), a.stats());
    let ops = 2 * steady as u64;
    assert_eq!(e.pool_allocations - b.pool_allocations, 0, "{e:?}");
    assert_eq!(e.fences_recorded - b.fences_recorded, 0, "no event on the same stream: {e:?}");
    assert_eq!(e.fence_waits - b.fence_waits, 0, "{e:?}");
    assert_eq!(e.fence_polls - b.fence_polls, 0, "{e:?}");
    assert_eq!(
        e.driver_calls - b.driver_calls,
        ops,
        "one identity lookup per allocation, one capture query per free, nothing else: {e:?}"
    );
    live.assert_clean();
    a.release_thread().unwrap();
    sim.destroy_stream(s).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A block freed on a user stream whose work is still running, then the stream destroyed and
/// its handle given to a new stream: the new stream gets its own arena (another identity), so
/// the block is not handed to it unfenced; the old arena is parked until a device
/// synchronise, then everything comes back.
#[test]
fn destroyed_stream_handle_reused_by_a_new_stream() {
    let sim = host(50);
    let a = alloc_on(&sim);
    let live = Live::default();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for round in 0..20u32 {
                let s = sim.create_stream();
                let mut blocks = Vec::new();
                for k in 0..8u32 {
                    let size = 512 * (1 + k as usize);
                    let p = a.allocate(size, s).unwrap();
                    live.insert(p, size);
                    // Long-running work on the block, still queued when the stream goes.
                    let tag = (round << 8) | k | 1;
                    sim.write_tag(p.0, size, tag, s).unwrap();
                    sim.hold_and_check(p.0, size, tag, Duration::from_micros(300), s).unwrap();
                    blocks.push((p, size));
                }
                for (p, size) in blocks {
                    live.remove(p);
                    a.deallocate(p, size, s).unwrap();
                }
                sim.destroy_stream(s).unwrap(); // the next create_stream reuses the handle
            }
            a.release_thread().unwrap();
        });
    });
    live.assert_clean();
    // The first four streams' arenas stay in the thread's table until its release parks them;
    // from the fifth on the thread's user arenas are lean, and each gives its emptied
    // superblock back inside its stream's last free, under an event there.
    assert!(a.parked_bytes() > 0, "arenas of destroyed streams are parked, not synchronised at once");
    assert!(a.stats().superblocks_returned >= 16, "lean arenas gave back: {:?}", a.stats());
    assert_eq!(a.stats().host_syncs, 0, "{:?}", a.stats());
    assert_all_returned(&a, Some(&sim), 0); // trim(true) synchronises once and gives them back
    assert_eq!(a.parked_bytes(), 0);
}

/// A thread cycling through more user streams than it keeps arenas for gives up the least
/// recently used one (parked: its stream is not touched outside a call on it) and adopts a
/// stream's parked arena again at its next allocation there; blocks move between the streams
/// only behind fences or a synchronise, and no synchronise is needed within the bound.
#[test]
fn more_user_streams_than_arenas() {
    let sim = host(50);
    let a = alloc_on(&sim);
    let streams: Vec<Stream> = (0..cuarena::MAX_USER_ARENAS + 3).map(|_| sim.create_stream()).collect();
    let live = Live::default();
    on_thread(&a, {
        let (sim, streams) = (sim.clone(), streams.clone());
        move |a| {
            let mut held = Vec::new();
            for i in 0..2100usize {
                let s = streams[(i / 3) % streams.len()];
                let size = 256 * (1 + (i * 13) % 64);
                let p = a.allocate(size, s).unwrap();
                live.insert(p, size);
                sim.write_tag(p.0, size, i as u32 | 1, s).unwrap();
                sim.hold_and_check(p.0, size, i as u32 | 1, Duration::from_micros(40), s).unwrap();
                held.push((p, size, s));
                if held.len() > 6 {
                    let (p, size, s) = held.remove(0);
                    live.remove(p);
                    a.deallocate(p, size, s).unwrap();
                }
                assert!(a.stats().arenas <= 1 + cuarena::MAX_USER_ARENAS as u64, "{:?}", a.stats());
            }
            for (p, size, s) in held {
                live.remove(p);
                a.deallocate(p, size, s).unwrap();
            }
            live.assert_clean();
        }
    });
    // A replaced arena's stream is not touched outside a call on it (it may be gone), so a
    // replaced arena that held memory is parked until a synchronise, within its bound.
    assert!(a.parked_bytes() <= 64 << 20, "parked within the bound: {}", a.parked_bytes());
    assert_eq!(a.stats().host_syncs, 0, "parked arenas were adopted, not given back: {:?}", a.stats());
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Blocks of one thread's user-stream arena freed by other threads on other user streams, with
/// their work still running, and reused at once by the owner on its stream: each is fenced.
#[test]
fn user_arena_blocks_freed_by_other_threads_on_other_streams() {
    let sim = host(100);
    let a = alloc_on(&sim);
    let mine = sim.create_stream();
    let (tx, rx) = std::sync::mpsc::sync_channel::<(u64, usize, u32)>(64);
    let frees = {
        let (a, sim) = (a.clone(), sim.clone());
        std::thread::spawn(move || {
            let theirs = sim.create_stream();
            for (p, size, tag) in rx {
                // The block's use on `mine` is ordered before this stream, then work here.
                let ev = sim.create_event().unwrap();
                sim.record_event(ev, mine).unwrap();
                sim.stream_wait_event(theirs, ev).unwrap();
                sim.hold_and_check(p, size, tag, Duration::from_micros(80), theirs).unwrap();
                a.deallocate(cuarena::DeviceAddr(p), size, theirs).unwrap();
            }
            a.release_thread().unwrap();
            theirs
        })
    };
    let live = Live::default();
    for i in 0..1500u32 {
        let size = 256 * (1 + (i as usize * 7) % 32);
        let p = a.allocate(size, mine).unwrap();
        live.insert(p, size);
        sim.write_tag(p.0, size, i | 1, mine).unwrap();
        live.remove(p); // owned by the other thread from here
        tx.send((p.0, size, i | 1)).unwrap();
        if i % 100 == 0 {
            a.flush().unwrap();
        }
    }
    drop(tx);
    let theirs = frees.join().unwrap();
    a.release_thread().unwrap();
    live.assert_clean();
    let s = a.stats();
    assert!(s.cross_thread_frees >= 1500, "{s:?}");
    sim.destroy_stream(mine).unwrap();
    sim.destroy_stream(theirs).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Out of memory while arenas of destroyed streams are parked: the out-of-memory path
/// synchronises once, takes them back, and the request succeeds.
#[test]
fn out_of_memory_takes_back_parked_arenas() {
    let sim = host(20);
    let a = host_allocator(sim.clone(), small().max_bytes(4 << 20).build().unwrap()).unwrap();
    for _ in 0..6 {
        on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let s = sim.create_stream();
                let ps: Vec<_> = (0..4).map(|_| a.allocate(60 << 10, s).unwrap()).collect();
                for p in ps {
                    a.deallocate(p, 60 << 10, s).unwrap();
                }
                sim.destroy_stream(s).unwrap();
            }
        });
    }
    assert!(a.parked_bytes() > 0);
    // Nearly the whole cap in one block: only possible once the parked arenas are back.
    let big = a.allocate(3 << 20, Stream::PER_THREAD).unwrap();
    assert_eq!(a.parked_bytes(), 0);
    assert!(a.stats().host_syncs >= 1);
    a.deallocate(big, 3 << 20, Stream::PER_THREAD).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// An allocation on a user stream asks the stream's identity once, whichever path serves it:
/// the slow path alone (the thread's first allocation), the fast path (the thread's arena for
/// the stream has a fit), or the fast path's question handed to the slow path (no arena for
/// the stream yet, or no fit: `Slot::asked` in `allocator.rs`). A stale answer never crosses
/// calls: every allocation asks afresh.
#[test]
fn a_user_stream_allocation_asks_the_identity_once_on_every_path() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use cuarena_testkit::{HookedDevice, Hooks};

    let sim = host(0);
    let asked = Arc::new(AtomicU64::new(0));
    let n = Arc::clone(&asked);
    let key = move |sim: &HostDevice, s: Stream| {
        if s.is_user() {
            n.fetch_add(1, Ordering::Relaxed);
        }
        sim.stream_key(s)
    };
    let dev = HookedDevice::new(sim.clone(), Hooks { stream_key: Some(Box::new(key)), ..Hooks::default() });
    let a = Allocator::new(dev, small().build().unwrap()).unwrap();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let mut held = Vec::new();
    let mut alloc = |s: Stream, size: usize, what: &str| {
        let before = asked.load(Ordering::Relaxed);
        let p = a.allocate(size, s).unwrap();
        assert_eq!(asked.load(Ordering::Relaxed) - before, 1, "{what}: identity queries");
        held.push((p, size, s));
    };
    alloc(s1, 4096, "the thread's first allocation (no slot yet: the slow path)");
    alloc(s1, 4096, "a fit in the stream's arena (the fast path)");
    alloc(s2, 4096, "a second stream (no arena yet: the fast path's question, then the slow path)");
    let before = a.stats().superblocks_taken;
    // Blocks of 64 KiB until the first arena borrows again: each fills from its free space
    // (the fast path) until one finds none (the slow path, with the fast path's question).
    for i in 0..200 {
        alloc(s1, 64 << 10, &format!("block {i} of 64 KiB"));
        if a.stats().superblocks_taken > before {
            break;
        }
    }
    assert!(a.stats().superblocks_taken > before, "the arena borrowed again");
    for (p, size, s) in held {
        a.deallocate(p, size, s).unwrap();
    }
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
    a.trim(true).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A thread's user arena parked at its exit, its stream alive: the next thread to allocate on
/// that stream adopts it (`Slot::new_user_arena`), with no synchronise, and may get the
/// blocks freed there at once (the same stream orders them); memory of the parked arena
/// reaches no other stream early. A stream whose handle is a destroyed stream's is another
/// stream (another identity): it adopts nothing, and the parked arena waits for a
/// synchronise. The mutation `adopt_any_parked` (adopt whatever is parked) fails here.
#[test]
fn a_parked_arena_is_adopted_by_its_own_stream_only() {
    let sim = host(0);
    let a = alloc_on(&sim);
    let (s, t) = (sim.create_stream(), sim.create_stream());
    let sizes = [512usize, 4096, 20_000, 60_000];
    // Thread 1: blocks on `t` with long work, freed there, `t` destroyed: a parked arena that
    // only a synchronise may give back.
    let dead: Vec<(u64, usize)> = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let v: Vec<(u64, usize)> = sizes.iter().map(|&n| (a.allocate(n, t).unwrap().0, n)).collect();
            for &(p, n) in &v {
                sim.hold_and_check(p, n, 0x7171, Duration::from_millis(40), t).unwrap();
                a.deallocate(cuarena::DeviceAddr(p), n, t).unwrap();
            }
            sim.destroy_stream(t).unwrap();
            v
        }
    });
    // Thread 2: blocks on `s` with long work, freed there; `s` stays alive.
    let freed: Vec<(u64, usize)> = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let v: Vec<(u64, usize)> = sizes.iter().map(|&n| (a.allocate(n, s).unwrap().0, n)).collect();
            for &(p, n) in &v {
                sim.hold_and_check(p, n, 0x7272, Duration::from_millis(40), s).unwrap();
                a.deallocate(cuarena::DeviceAddr(p), n, s).unwrap();
            }
            v
        }
    });
    let parked = a.parked_bytes();
    assert!(parked > 0, "both arenas parked");
    // Thread 3: a new stream that gets the destroyed stream's handle adopts nothing, and its
    // blocks are written at once; then `s`'s arena is adopted.
    let u = sim.create_stream();
    assert_eq!(u, t, "the simulator gives the destroyed stream's handle to the next stream");
    let got = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let on_u: Vec<(u64, usize)> = sizes.iter().map(|&n| (a.allocate(n, u).unwrap().0, n)).collect();
            for &(p, n) in &on_u {
                sim.write_tag(p, n, 0x7373, u).unwrap();
            }
            let still = a.parked_bytes();
            let on_s: Vec<(u64, usize)> = sizes.iter().map(|&n| (a.allocate(n, s).unwrap().0, n)).collect();
            for &(p, n) in &on_s {
                sim.write_tag(p, n, 0x7474, s).unwrap(); // after thread 2's work on `s`: ordered
            }
            let after = a.parked_bytes();
            for &(p, n) in on_u.iter() {
                a.deallocate(cuarena::DeviceAddr(p), n, u).unwrap();
            }
            for &(p, n) in on_s.iter() {
                a.deallocate(cuarena::DeviceAddr(p), n, s).unwrap();
            }
            (on_u, on_s, still, after)
        }
    });
    let (on_u, on_s, still, after) = got;
    let overlaps = |x: &[(u64, usize)], y: &[(u64, usize)]| {
        x.iter().any(|&(p, n)| y.iter().any(|&(q, m)| p < q + m as u64 && q < p + n as u64))
    };
    let v = sim.violations();
    assert!(v.is_empty(), "a parked arena's memory reached another stream early: {v:?}");
    assert!(!overlaps(&on_u, &dead), "the new stream on a reused handle got the destroyed stream's blocks");
    assert_eq!(still, parked, "the new stream adopted nothing");
    assert!(after < still, "`s`'s arena was adopted: parked {after} of {still}");
    assert!(overlaps(&on_s, &freed), "the adopted arena served `s` from its own frees");
    assert_eq!(a.stats().host_syncs, 0, "{:?}", a.stats());
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(s).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Threads that take their stream for each request from a shared pool of streams (PyTorch's
/// `torch.cuda.Stream()` hands out a pool of 32 in turn), more streams than a thread keeps
/// arenas for: each thread's user arenas turn lean (`arena.rs`, "Lean arenas"), so a request's
/// last free gives its superblock back under an event on its stream, and the memory reserved
/// stays near what is live instead of a superblock or more per thread and stream. No device
/// synchronise, and no reuse before a fence. The mutation `user_arenas_never_lean` fails the
/// memory bound.
#[test]
fn threads_sharing_a_pool_of_streams_hold_little_and_never_synchronise() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let streams: Vec<Stream> = (0..cuarena::MAX_USER_ARENAS + 4).map(|_| sim.create_stream()).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let live = Live::default();
    std::thread::scope(|sc| {
        for t in 0..4u32 {
            let (a, sim, streams, next, live) = (&a, &sim, &streams, &next, &live);
            sc.spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(t);
                for req in 0..150u32 {
                    let s = streams[next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % streams.len()];
                    let blocks: Vec<(cuarena::DeviceAddr, usize)> = (0..6)
                        .map(|_| {
                            let n = 256 * (1 + (common::rng(&mut x) % 120) as usize);
                            let p = a.allocate(n, s).unwrap();
                            live.insert(p, n);
                            let tag = (t << 24) | (req << 4) | 1;
                            sim.hold_and_check(p.0, n.min(1024), tag, Duration::from_micros(20), s).unwrap();
                            (p, n)
                        })
                        .collect();
                    for (p, n) in blocks {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                a.release_thread().unwrap();
            });
        }
    });
    live.assert_clean();
    let st = a.stats();
    eprintln!("{st:?}");
    assert_eq!(st.host_syncs, 0, "{st:?}");
    // 4 threads × 20 streams: two empty 256 KiB superblocks kept per arena would be 40 MiB.
    assert!(st.peak_reserved_bytes <= 8 << 20, "reserved {} MiB: {st:?}", st.peak_reserved_bytes >> 20);
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Threads with a live block on more user streams than they keep arenas for (a request's
/// buffer on each request's stream, living as long as the request): every arena of a full
/// table holds memory, so another stream's arena can only be made by parking one with its
/// memory. Parking stops at the parked bound (64 MiB; 2 MiB superblocks here, so 4 threads ×
/// 12 streams past the table would park 96 MiB): past it the pool serves those streams, and
/// nothing synchronises the device (`Slot::new_user_arena`, "Making room"). The mutation
/// `replacement_parks_past_the_bound` (park whatever the arena holds and bury past the bound,
/// as the code before it did) fails it.
#[test]
fn a_full_table_of_busy_arenas_overflows_to_the_pool_without_a_synchronise() {
    let sim = host(5);
    let a = host_allocator(sim.clone(), cuarena::Config::default()).unwrap();
    let per_thread = cuarena::MAX_USER_ARENAS + 12;
    let live = Live::default();
    let threads = 4;
    let barrier = std::sync::Barrier::new(threads);
    let at_barrier = std::sync::Mutex::new(None);
    std::thread::scope(|sc| {
        for t in 0..threads as u32 {
            let (a, sim, live, barrier, at_barrier) = (&a, &sim, &live, &barrier, &at_barrier);
            sc.spawn(move || {
                let streams: Vec<Stream> = (0..per_thread).map(|_| sim.create_stream()).collect();
                let held: Vec<(cuarena::DeviceAddr, Stream)> = streams
                    .iter()
                    .map(|&s| {
                        let p = a.allocate(4096, s).unwrap();
                        live.insert(p, 4096);
                        (p, s)
                    })
                    .collect();
                for round in 0..4u32 {
                    for (i, &s) in streams.iter().enumerate() {
                        let n = 256 << (i % 9);
                        let p = a.allocate(n, s).unwrap();
                        live.insert(p, n);
                        let tag = (t << 24) | (round << 16) | ((i as u32) << 4) | 1;
                        sim.hold_and_check(p.0, n.min(1024), tag, Duration::from_micros(5), s).unwrap();
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                barrier.wait();
                if t == 0 {
                    *at_barrier.lock().unwrap() = Some((a.stats(), a.parked_bytes()));
                }
                barrier.wait();
                for (p, s) in held {
                    live.remove(p);
                    a.deallocate(p, 4096, s).unwrap();
                }
                a.release_thread().unwrap();
                for s in streams {
                    sim.destroy_stream(s).unwrap();
                }
            });
        }
    });
    live.assert_clean();
    let (st, parked) = at_barrier.into_inner().unwrap().unwrap();
    assert_eq!(st.host_syncs, 0, "a device synchronise: {st:?}");
    assert!(st.pool_allocations > 0, "the pool served the streams past the room: {st:?}");
    assert!(parked <= (64 << 20) + threads * (2 << 20), "parked {parked}");
    assert!(st.arenas as usize <= threads * (1 + cuarena::MAX_USER_ARENAS), "{st:?}");
    assert_all_returned(&a, Some(&sim), 0);
}
