//! Arenas for user streams: the fast path, identity by `cuStreamGetId` (never the handle), the
//! replacement of the least recently used arena, and arenas whose stream was destroyed while
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
    assert!(a.parked_bytes() > 0, "arenas of destroyed streams are parked, not synchronised at once");
    assert_eq!(a.stats().host_syncs, 0, "{:?}", a.stats());
    assert_all_returned(&a, Some(&sim), 0); // trim(true) synchronises once and gives them back
    assert_eq!(a.parked_bytes(), 0);
    assert_eq!(a.stats().host_syncs, 1, "{:?}", a.stats());
}

/// A thread cycling through more user streams than it keeps arenas for gives up the least
/// recently used one (parked: its stream is not touched outside a call on it); blocks move
/// between the streams only behind fences or a synchronise.
#[test]
fn more_user_streams_than_arenas() {
    let sim = host(50);
    let a = alloc_on(&sim);
    let streams: Vec<Stream> = (0..7).map(|_| sim.create_stream()).collect();
    let live = Live::default();
    on_thread(&a, {
        let (sim, streams) = (sim.clone(), streams.clone());
        move |a| {
            let mut held = Vec::new();
            for i in 0..700usize {
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
                assert!(a.stats().arenas <= 1 + cuarena_max_user_arenas() as u64, "{:?}", a.stats());
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
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// The user arenas a thread keeps at most (`allocator.rs`'s `MAX_USER_ARENAS`).
fn cuarena_max_user_arenas() -> usize {
    4
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
