//! Large blocks (over `small_max`, up to `large_max`) served by the arenas from large
//! superblocks: no overlap across threads, alignment, every byte back after exit and trim,
//! remote and cross-stream frees fenced (and the checker catches them when fencing is off),
//! bad frees refused, out-of-memory recovered from idle threads, and the path counted.

use std::time::Duration;

use cuarena::{Allocator, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::assert_all_returned;

mod common;
use common::*;

const HOLD: Duration = Duration::from_millis(150);

#[test]
fn large_blocks_from_many_threads_never_overlap_and_all_come_back() {
    let sim = host(20);
    let a = alloc_with(&sim, small());
    let live = std::sync::Arc::new(Live::default());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
            std::thread::spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                let mut held: Vec<(DeviceAddr, usize, Stream, u32)> = Vec::new();
                for i in 0..400u32 {
                    let r = rng(&mut x);
                    if held.len() >= 8 || (r.is_multiple_of(3) && !held.is_empty()) {
                        let (p, size, s, tag) = held.swap_remove((r >> 8) as usize % held.len());
                        sim.check_tag(p.0, 256, tag, s).unwrap();
                        live.remove(p);
                        a.deallocate(p, size, s).unwrap();
                        continue;
                    }
                    // Mostly large (64 KiB .. 4 MiB), some small, on both arena streams.
                    let size = if r.is_multiple_of(5) {
                        1 + (r >> 16) as usize % (64 << 10)
                    } else {
                        (64 << 10) + 1 + (r >> 16) as usize % (4 << 20)
                    };
                    let s = if r.is_multiple_of(4) { Stream::LEGACY } else { Stream::PER_THREAD };
                    let p = a.allocate(size, s).unwrap();
                    assert_eq!(p.0 % 256, 0, "alignment");
                    live.insert(p, size);
                    sim.write_tag(p.0, 256, i, s).unwrap();
                    held.push((p, size, s, i));
                }
                for (p, size, s, _) in held {
                    live.remove(p);
                    a.deallocate(p, size, s).unwrap();
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    threads.into_iter().for_each(|h| h.join().unwrap());
    live.assert_clean();
    let s = a.stats();
    assert!(s.large_allocations > 400, "large blocks were served by the arenas: {s:?}");
    assert_eq!(s.pool_allocations, 0, "nothing went to the pool: {s:?}");
    assert!(s.superblocks_taken < s.large_allocations / 4, "large superblocks are reused: {s:?}");
    assert_all_returned(&a, Some(&sim), 0);
}

/// A large block used on a user stream, freed by another thread (remote) or by its owner on
/// the legacy stream (cross-stream), is not handed out again before that use ends. With
/// fencing switched off the checker sees the reuse: the test can fail.
fn remote_and_cross_stream_reuse(skip_fences: bool) -> Vec<String> {
    let sim = host(0);
    let cfg = small().batch_blocks(1);
    let a = alloc_with(&sim, if skip_fences { cfg.skip_fences_for_testing() } else { cfg });
    let size = 3 << 20;
    let owner = Worker::new(&a);
    let other = Worker::new(&a);
    for remote in [true, false] {
        let sim2 = sim.clone();
        let (p, e, gate) = owner.run(move |a| {
            let u = sim2.create_stream();
            // The user stream's use stays in flight until the reuse below is submitted (a
            // hold alone could end first on a loaded machine, and then nothing races).
            let gate = sim2.gate(u).unwrap();
            let p = a.allocate(size, Stream::PER_THREAD).unwrap();
            // Ready on the per-thread stream: the user stream is ordered after it first.
            let ready = sim2.create_event().unwrap();
            sim2.record_event(ready, Stream::PER_THREAD).unwrap();
            sim2.stream_wait_event(u, ready).unwrap();
            sim2.hold_and_check(p.0, size, 0xa, HOLD, u).unwrap();
            let e = sim2.create_event().unwrap();
            sim2.record_event(e, u).unwrap();
            (p, e, gate)
        });
        let sim2 = sim.clone();
        let free = move |a: &Allocator, s: Stream| {
            sim2.stream_wait_event(s, e).unwrap();
            a.deallocate(p, size, s).unwrap();
            a.flush().unwrap();
        };
        if remote {
            other.run(move |a| free(a, Stream::PER_THREAD));
        } else {
            owner.run(move |a| free(a, Stream::LEGACY));
        }
        let sim2 = sim.clone();
        owner.run(move |a| {
            // Free space is used first; the freed block once nothing else fits.
            let mut qs = Vec::new();
            while !qs.contains(&p) {
                assert!(qs.len() < 8, "the freed block is reused: {p:?} not in {qs:?}");
                let q = a.allocate(size, Stream::PER_THREAD).unwrap();
                sim2.write_tag(q.0, size, 0xb, Stream::PER_THREAD).unwrap();
                qs.push(q);
            }
            for q in qs {
                a.deallocate(q, size, Stream::PER_THREAD).unwrap();
            }
        });
        gate.open();
    }
    owner.exit();
    other.exit();
    sim.synchronize();
    let v = sim.violations();
    if !skip_fences {
        assert_all_returned(&a, Some(&sim), 0);
        assert!(a.stats().fences_recorded <= 4, "one fence per batch: {:?}", a.stats());
    }
    v
}

#[test]
fn remote_and_cross_stream_large_frees_are_fenced() {
    let v = remote_and_cross_stream_reuse(false);
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn without_fences_the_checker_catches_large_reuse() {
    let v = remote_and_cross_stream_reuse(true);
    assert!(!v.is_empty(), "the checker must see an unfenced reuse");
}

#[test]
fn a_large_block_freed_and_reused_on_its_stream_needs_no_event() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let size = 5 << 20;
    let p = a.allocate_per_thread(size).unwrap();
    a.deallocate_per_thread(p, size).unwrap();
    let before = a.stats();
    for _ in 0..1000 {
        let q = a.allocate_per_thread(size).unwrap();
        assert_eq!(q, p);
        a.deallocate_per_thread(q, size).unwrap();
    }
    let after = a.stats();
    assert_eq!(after.driver_calls, before.driver_calls, "no driver call: {after:?}");
    assert_eq!(after.large_allocations - before.large_allocations, 1000);
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn double_free_and_wrong_size_of_a_large_block_are_refused() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let size = (2 << 20) + 1000;
    let p = a.allocate_per_thread(size).unwrap();
    let q = a.allocate_per_thread(size).unwrap();
    // Wrong size, locally: refused at once, the block stays live.
    for wrong in [size + 4096, 2 << 20, 1 << 10] {
        let r = a.deallocate_per_thread(p, wrong);
        assert!(
            matches!(r, Err(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. })),
            "{wrong}: {r:?}"
        );
    }
    // An interior pointer.
    let r = a.deallocate_per_thread(DeviceAddr(p.0 + 4096), size);
    assert!(matches!(r, Err(Error::InvalidFree { .. })), "{r:?}");
    a.deallocate_per_thread(p, size).unwrap();
    // A second free, locally and from another thread, on any stream.
    let r = a.deallocate_per_thread(p, size);
    assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
    let r = a.deallocate(p, size, Stream::LEGACY);
    assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
    // Remote: q freed by another thread, then again by it.
    let r = on_thread(&a, move |a| {
        a.deallocate_per_thread(q, size).unwrap();
        a.deallocate_per_thread(q, size)
    });
    assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{r:?}");
    assert_eq!(a.stats().invalid_frees, 7);
    a.flush().unwrap();
    assert_all_returned(&a, Some(&sim), 7);
}

#[test]
fn out_of_memory_with_large_superblocks_held_by_idle_threads_recovers() {
    let sim = host(0);
    let a = alloc_with(&sim, small().max_bytes(64 << 20));
    let idle = Worker::new(&a);
    // The idle thread fills most of the cap with large blocks, frees them (its arena keeps the
    // large superblocks: the return rule's spare), and stays alive without allocating.
    let held = idle.run(|a| {
        let ps: Vec<DeviceAddr> = (0..5).map(|_| a.allocate_per_thread(8 << 20).unwrap()).collect();
        for p in ps {
            a.deallocate_per_thread(p, 8 << 20).unwrap();
        }
        a.stats().arena_held_bytes
    });
    assert!(held >= 40 << 20, "the idle arena holds its large superblocks: {held}");
    assert!(a.stats().reserved_bytes >= 64 << 20, "the cap is reached: {:?}", a.stats());
    // Another thread needs a large superblock: the idle arena's are reclaimed.
    let p = a.allocate_per_thread(8 << 20).expect("reclaimed from the idle thread");
    sim.write_tag(p.0, 8 << 20, 1, Stream::PER_THREAD).unwrap();
    let q = a.allocate(48 << 20, sim.create_stream());
    assert!(matches!(q, Err(Error::OutOfMemory { .. })), "the cap holds: {q:?}");
    a.deallocate_per_thread(p, 8 << 20).unwrap();
    assert_eq!(a.stats().host_syncs, 0, "the reclaim blocked the host");
    idle.exit();
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn the_statistics_count_each_path() {
    let sim = host(0);
    let a = alloc_with(&sim, small().large_max(1 << 20));
    let user = sim.create_stream();
    let cases: [(usize, Stream); 6] = [
        (4 << 10, Stream::PER_THREAD),       // arena, small
        (512 << 10, Stream::PER_THREAD),     // arena, large
        (1 << 20, Stream::LEGACY),           // arena, large (at large_max)
        ((1 << 20) + 1, Stream::PER_THREAD), // pool: over large_max
        (512 << 10, user),                   // arena, large: the user stream's arena
        ((1 << 20) + 1, user),               // pool: over large_max
    ];
    for (size, s) in cases {
        let p = a.allocate(size, s).unwrap();
        a.deallocate(p, size, s).unwrap();
    }
    let s = a.stats();
    assert_eq!((s.arena_allocations, s.large_allocations, s.pool_allocations), (4, 3, 2), "{s:?}");
    a.flush().unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}
