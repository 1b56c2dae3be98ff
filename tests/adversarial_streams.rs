//! Adversarial tests of the legacy-stream work: arenas for the legacy stream (a79fbf2), pending
//! remote frees taken back behind one stream wait (2dd4d60), lazy legacy fences (d037828) and
//! pool-block frees accepted at once and applied under one fence per outbox batch (6a84b45).
//!
//! Every test ends by checking: no race-checker violation, no tag error, the pool's invariants,
//! statistics that add up, and every byte back (all freed, every thread released, a blocking
//! trim leaves nothing reserved, nothing handed out and nothing held by arenas).
//!
//! Streams in the simulated device follow CUDA's implicit synchronisation: work on the legacy
//! stream waits for earlier work on every per-thread stream, and per-thread work waits for
//! earlier legacy work. Allocation has `cudaMallocAsync`'s contract (README, "The contract"): a
//! block allocated on the legacy stream may be used by any work CUDA orders after the legacy
//! stream at that point, which includes every per-thread stream's later work.

#![allow(clippy::type_complexity, clippy::manual_is_multiple_of)]

use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cuarena::{Allocator, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

const HOLD: Duration = Duration::from_millis(150);

/// Blocks over `small_max` (64 KiB in `small()`) are pool blocks in this file: large
/// superblocks are off (`large_max = small_max`), so each test takes the path its name says.
/// `tests/large.rs` runs the large-superblock paths.
fn alloc_with(sim: &HostDevice, cfg: cuarena::ConfigBuilder) -> Allocator {
    host_allocator(sim.clone(), cfg.large_max(64 << 10).build().unwrap()).unwrap()
}

/// The reference for the two findings below, on the simulated device alone. A block used on
/// thread A's per-thread stream and then used on thread B's per-thread stream is ordered if an
/// operation was queued on the legacy stream in between (what `cudaFreeAsync` on the legacy
/// stream is, and what a fence recorded at the free was before the lazy fences): the legacy
/// operation waits for A's work, and B's per-thread work waits for it. Without such an
/// operation the two uses race, and the checker says so.
#[test]
fn reference_a_legacy_operation_between_two_ptds_uses_orders_them() {
    for with_legacy_op in [true, false] {
        let sim = host(0);
        let size = 1 << 20;
        let p = sim.reserve(size).unwrap().unwrap();
        let s1 = sim.clone();
        // A's work stays in flight until B's is submitted (HOLD alone made that only likely).
        let gate = std::thread::spawn(move || {
            let gate = s1.gate(Stream::PER_THREAD).unwrap();
            s1.hold_and_check(p, size, 0xa, HOLD, Stream::PER_THREAD).unwrap();
            gate
        })
        .join()
        .unwrap();
        if with_legacy_op {
            let e = sim.create_event().unwrap();
            sim.record_event(e, Stream::LEGACY).unwrap(); // the free's operation on legacy
        }
        let s2 = sim.clone();
        std::thread::spawn(move || s2.write_tag(p, size, 0xb, Stream::PER_THREAD).unwrap()).join().unwrap();
        gate.open();
        sim.synchronize();
        assert_eq!(sim.violations().is_empty(), with_legacy_op, "{:?}", sim.violations());
        // SAFETY: synchronised above; the region came from `reserve`.
        unsafe { sim.release(p, size).unwrap() };
    }
}

/// FINDING (lazy legacy fences, d037828), fixed (the lazy fence is recorded at every reuse). A pool block used on thread A's per-thread stream
/// and freed on the legacy stream (legal: later legacy work waits for A's work) records no
/// event. Thread B allocates it on the legacy stream (nothing needed, says the lazy fence) and
/// uses it on its own per-thread stream, which CUDA orders after the legacy stream. Nothing was
/// queued on the legacy stream between A's work and B's, so B's work is not ordered after A's:
/// a race, which `cudaFreeAsync` on the legacy stream, or the event recorded at the flush before
/// d037828, would not have (see the reference test).
#[test]
fn lazy_legacy_pool_block_reused_on_legacy_then_used_on_another_ptds() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(1));
    let size = 512 << 10; // a pool block
    let p = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let p = a.allocate(size, Stream::PER_THREAD).unwrap();
            sim.hold_and_check(p.0, size, 0xa, HOLD, Stream::PER_THREAD).unwrap();
            a.deallocate(p, size, Stream::LEGACY).unwrap();
            p
        }
    });
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let q = a.allocate(size, Stream::LEGACY).unwrap();
            assert_eq!(q, p, "the freed block is reused");
            // Legal under cudaMallocAsync's contract: per-thread work follows the legacy stream.
            sim.write_tag(q.0, size, 0xb, Stream::PER_THREAD).unwrap();
            a.deallocate(q, size, Stream::PER_THREAD).unwrap();
        }
    });
    assert_all_returned(&a, Some(&sim), 0);
}

/// FINDING (legacy arenas, a79fbf2), fixed: the same hole on the arena path, with no pool and
/// no other thread's free: thread A allocates a small block on the legacy stream (its legacy
/// arena), uses it on its per-thread stream, frees it on the legacy stream and allocates it
/// again on the legacy stream. It hands the block to thread B, which uses it on B's per-thread
/// stream: that must be ordered after A's still running work. (Legacy frees were on the fast
/// path, with no legacy-stream operation queued; now they go out in batches under a legacy
/// event.)
#[test]
fn legacy_arena_local_free_then_use_on_another_ptds() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let size = 16 << 10;
    let p = a.allocate(size, Stream::LEGACY).unwrap();
    sim.hold_and_check(p.0, size, 0xa, HOLD, Stream::PER_THREAD).unwrap();
    a.deallocate(p, size, Stream::LEGACY).unwrap();
    // A free on the legacy stream goes the batched way, with a legacy-stream event per batch
    // (the fix): once sent, the block comes back at once, ordered by that event.
    a.flush().unwrap();
    let q = a.allocate(size, Stream::LEGACY).unwrap();
    assert_eq!(q, p, "the freed block is handed out again");
    let s2 = sim.clone();
    std::thread::spawn(move || s2.write_tag(q.0, size, 0xb, Stream::PER_THREAD).unwrap()).join().unwrap();
    a.deallocate(q, size, Stream::LEGACY).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: another thread's free of a legacy-arena block on the legacy stream goes through an
/// outbox whose flush records an event on the legacy stream (an operation there, which waits
/// for the freer's per-thread work). The owner takes it back without waiting (its own stream),
/// reuses it at once on the legacy stream, and even a use on the owner's per-thread stream is
/// ordered after the freer's work.
#[test]
fn legacy_arena_block_freed_by_another_thread_on_legacy_reused_at_once() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(1));
    let size = 32 << 10;
    let owner = Worker::new(&a);
    // Fill the owner's legacy arena so that the next allocation needs the freed block.
    let n = (256 << 10) / size;
    let blocks: Vec<DeviceAddr> =
        owner.run(move |a| (0..n).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect());
    let victim = blocks[0];
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            sim.hold_and_check(victim.0, size, 0xa, HOLD, Stream::PER_THREAD).unwrap();
            a.deallocate(victim, size, Stream::LEGACY).unwrap(); // batch of one: sent now
        }
    });
    let before = a.stats();
    let (q, sim2) = (victim, sim.clone());
    let got = owner.run(move |a| {
        let r = a.allocate(size, Stream::LEGACY).unwrap();
        sim2.write_tag(r.0, size, 0xb, Stream::LEGACY).unwrap();
        sim2.write_tag(r.0, size, 0xc, Stream::PER_THREAD).unwrap();
        r
    });
    assert_eq!(got, q, "the owner reuses the block freed on its own stream");
    let after = a.stats();
    assert_eq!(after.fence_waits, before.fence_waits, "no wait for a fence on the arena's own stream");
    assert_eq!(after.superblocks_taken, before.superblocks_taken, "no new superblock");
    owner.run(move |a| {
        for b in blocks {
            a.deallocate(b, size, Stream::LEGACY).unwrap();
        }
    });
    drop(owner);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: a block used on a user stream, ordered into the legacy stream by the user's own event
/// and stream wait, freed on the legacy stream (lazily), reused by another thread on its
/// per-thread stream, on a user stream, and on the legacy stream followed by per-thread use.
#[test]
fn user_stream_use_ordered_into_legacy_then_reused_everywhere() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(1));
    let size = 512 << 10;
    for reuse in ["ptds", "user", "legacy+ptds-after-legacy-op"] {
        let p = on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let u = sim.create_stream();
                let p = a.allocate(size, u).unwrap();
                sim.hold_and_check(p.0, size, 0xa, HOLD, u).unwrap();
                let e = sim.create_event().unwrap();
                sim.record_event(e, u).unwrap();
                sim.stream_wait_event(Stream::LEGACY, e).unwrap();
                a.deallocate(p, size, Stream::LEGACY).unwrap();
                sim.destroy_stream(u).unwrap();
                p
            }
        });
        on_thread(&a, {
            let sim = sim.clone();
            move |a| match reuse {
                "ptds" => {
                    let q = a.allocate(size, Stream::PER_THREAD).unwrap();
                    assert_eq!(q, p);
                    sim.write_tag(q.0, size, 0xb, Stream::PER_THREAD).unwrap();
                    a.deallocate(q, size, Stream::PER_THREAD).unwrap();
                }
                "user" => {
                    let v = sim.create_stream();
                    let q = a.allocate(size, v).unwrap();
                    assert_eq!(q, p);
                    sim.write_tag(q.0, size, 0xb, v).unwrap();
                    a.deallocate(q, size, v).unwrap();
                    sim.destroy_stream(v).unwrap();
                }
                _ => {
                    let q = a.allocate(size, Stream::LEGACY).unwrap();
                    assert_eq!(q, p);
                    // The user's stream wait above is a legacy operation after the use.
                    sim.write_tag(q.0, size, 0xb, Stream::PER_THREAD).unwrap();
                    sim.write_tag(q.0, size, 0xc, Stream::LEGACY).unwrap();
                    a.deallocate(q, size, Stream::LEGACY).unwrap();
                }
            }
        });
        sim.synchronize();
        assert!(sim.violations().is_empty(), "{reuse}: {:?}", sim.violations());
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: a pool block used on A's per-thread stream, freed on the legacy stream, reused by B
/// on its per-thread stream (large request: the pool records the lazy fence and waits), on a
/// user stream, and on the legacy stream with legacy work only.
#[test]
fn lazy_legacy_pool_block_reused_on_ptds_user_and_legacy() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let size = 256 << 10;
    for reuse in ["ptds", "user", "legacy"] {
        let ps: Vec<DeviceAddr> = on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let ps: Vec<DeviceAddr> =
                    (0..3).map(|_| a.allocate(size, Stream::PER_THREAD).unwrap()).collect();
                for p in &ps {
                    sim.hold_and_check(p.0, size, 0xa, HOLD, Stream::PER_THREAD).unwrap();
                }
                for p in &ps {
                    a.deallocate(*p, size, Stream::LEGACY).unwrap(); // waits in the outbox
                }
                ps // sent at thread exit
            }
        });
        on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let s = match reuse {
                    "ptds" => Stream::PER_THREAD,
                    "user" => sim.create_stream(),
                    _ => Stream::LEGACY,
                };
                let qs: Vec<DeviceAddr> = (0..3).map(|_| a.allocate(size, s).unwrap()).collect();
                let mut sorted = qs.clone();
                sorted.sort();
                let mut want = ps.clone();
                want.sort();
                assert_eq!(sorted, want, "{reuse}: the freed blocks are reused");
                for q in &qs {
                    sim.write_tag(q.0, size, 0xb, s).unwrap();
                }
                for q in qs {
                    a.deallocate(q, size, s).unwrap();
                }
                if reuse == "user" {
                    sim.destroy_stream(s).unwrap();
                }
            }
        });
        sim.synchronize();
        assert!(sim.violations().is_empty(), "{reuse}: {:?}", sim.violations());
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: one thread's blocks of both its arenas and of the pool, freed alternately on its
/// per-thread and the legacy stream (each change of stream flushes the outbox), with work in
/// flight on both, reused by the same thread on both streams.
#[test]
fn mixed_ptds_and_legacy_frees_of_one_threads_blocks() {
    let sim = host(200);
    let a = alloc_with(&sim, small().batch_blocks(3));
    let streams = [Stream::PER_THREAD, Stream::LEGACY];
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut live: Vec<(DeviceAddr, usize, Stream, u32)> = Vec::new();
    for round in 0..600u32 {
        let r = rng(&mut seed);
        if live.len() < 40 && r % 3 != 0 {
            let size = match r % 7 {
                0 => 128 << 10, // pool
                1 => 64 << 10,
                _ => 256 * (1 + (r >> 8) as usize % 64),
            };
            let s = streams[(r >> 20) as usize % 2];
            let p = a.allocate(size, s).unwrap();
            let tag = round;
            sim.write_tag(p.0, size, tag, s).unwrap();
            live.push((p, size, s, tag));
        } else if !live.is_empty() {
            let i = (r >> 4) as usize % live.len();
            let (p, size, s, tag) = live.swap_remove(i);
            sim.check_tag(p.0, size, tag, s).unwrap();
            // Free on either stream: the other one is ordered after `s` implicitly.
            let fs = streams[(r >> 30) as usize % 2];
            a.deallocate(p, size, fs).unwrap();
        }
    }
    for (p, size, s, tag) in live {
        sim.check_tag(p.0, size, tag, s).unwrap();
        a.deallocate(p, size, Stream::LEGACY).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: many threads on the legacy stream only, with long checked work in flight, freeing
/// each other's small and large blocks on the legacy stream; everything is used on the legacy
/// stream, so the lazy fences and legacy arenas need no event.
#[test]
fn many_threads_on_the_legacy_stream_hand_blocks_around() {
    let sim = host(300);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let threads = 6;
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..threads).map(|_| mpsc::channel::<(DeviceAddr, usize, u32)>()).unzip();
    let txs = Arc::new(txs);
    let barrier = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let (a, sim, txs, barrier) = (a.clone(), sim.clone(), Arc::clone(&txs), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ ((t as u64 + 1) * 0x1000_0001);
                for i in 0..150u32 {
                    let r = rng(&mut seed);
                    let size = if r % 9 == 0 { 200 << 10 } else { 512 * (1 + (r >> 8) as usize % 60) };
                    let p = a.allocate(size, Stream::LEGACY).unwrap();
                    let tag = (t as u32) << 16 | i;
                    let hold = Duration::from_micros(if r % 5 == 0 { 2000 } else { 50 });
                    sim.hold_and_check(p.0, size, tag, hold, Stream::LEGACY).unwrap();
                    let dest = (t + 1 + (r >> 40) as usize % (threads - 1)) % threads;
                    txs[dest].send((p, size, tag)).unwrap();
                    while let Ok((q, qs, qt)) = rx.try_recv() {
                        sim.check_tag(q.0, qs, qt, Stream::LEGACY).unwrap();
                        a.deallocate(q, qs, Stream::LEGACY).unwrap();
                    }
                }
                barrier.wait();
                while let Ok((q, qs, qt)) = rx.try_recv() {
                    sim.check_tag(q.0, qs, qt, Stream::LEGACY).unwrap();
                    a.deallocate(q, qs, Stream::LEGACY).unwrap();
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: the same with every thread using each block on its own per-thread stream first and
/// freeing on the legacy stream, and the receiver reusing memory on its per-thread stream
/// (small: its arena; large: the pool with the lazy fence recorded at reuse).
#[test]
fn many_threads_ptds_work_freed_on_legacy_reused_on_ptds() {
    let sim = host(300);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let threads = 6;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..threads).map(|_| mpsc::channel::<(DeviceAddr, usize)>()).unzip();
    let txs = Arc::new(txs);
    let barrier = Arc::new(Barrier::new(threads));
    let hs: Vec<_> = rxs
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let (a, sim, txs, barrier) = (a.clone(), sim.clone(), Arc::clone(&txs), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let mut seed = 0x2545_f491_4f6c_dd1du64 ^ ((t as u64 + 1) * 0x3000_0001);
                for i in 0..150u32 {
                    let r = rng(&mut seed);
                    let size = if r % 7 == 0 { 160 << 10 } else { 512 * (1 + (r >> 8) as usize % 60) };
                    let p = a.allocate(size, Stream::PER_THREAD).unwrap();
                    let hold = Duration::from_micros(if r % 5 == 0 { 3000 } else { 50 });
                    sim.hold_and_check(p.0, size, (t as u32) << 16 | i, hold, Stream::PER_THREAD).unwrap();
                    let dest = (t + 1 + (r >> 40) as usize % (threads - 1)) % threads;
                    // The receiver frees it on the legacy stream, which follows this work.
                    txs[dest].send((p, size)).unwrap();
                    while let Ok((q, qs)) = rx.try_recv() {
                        a.deallocate(q, qs, Stream::LEGACY).unwrap();
                    }
                }
                barrier.wait();
                while let Ok((q, qs)) = rx.try_recv() {
                    a.deallocate(q, qs, Stream::LEGACY).unwrap();
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: trim(false) and trim(true) while lazy legacy fences guard whole chunks whose last use
/// is still running on a per-thread stream: non-blocking trim must not release them (the
/// device reports a release under running work as a violation), blocking trim waits.
#[test]
fn trim_with_lazy_fences_pending() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(1));
    let size = 1 << 20; // a whole chunk
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let p = a.allocate(size, Stream::PER_THREAD).unwrap();
            sim.hold_and_check(p.0, size, 0xa, Duration::from_millis(300), Stream::PER_THREAD).unwrap();
            a.deallocate(p, size, Stream::LEGACY).unwrap();
        }
    });
    assert_eq!(a.stats().pool_in_use_bytes, 0);
    let released = a.trim(false).unwrap();
    assert_eq!(released, 0, "a chunk under running work was released by a non-blocking trim");
    assert!(a.stats().reserved_bytes > 0);
    let released = a.trim(true).unwrap();
    assert!(released >= size, "a blocking trim releases the chunk: {released}");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: out of memory under a small cap while every free chunk is guarded by lazy legacy
/// fences whose work is still running: growth's trim materialises them without releasing the
/// chunks under work; the allocation on a per-thread stream then reuses the memory behind a
/// wait, or fails cleanly with out-of-memory, never with a race.
#[test]
fn out_of_memory_with_lazy_fences() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(1).max_bytes(2 << 20));
    let size = 1 << 20;
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let ps: Vec<DeviceAddr> = (0..2).map(|_| a.allocate(size, Stream::PER_THREAD).unwrap()).collect();
            for p in &ps {
                sim.hold_and_check(p.0, size, 0xa, Duration::from_millis(200), Stream::PER_THREAD).unwrap();
                a.deallocate(*p, size, Stream::LEGACY).unwrap();
            }
        }
    });
    // A request that cannot be met at all (it needs a fresh 2 MiB chunk) is refused...
    match a.allocate(2 << 20, Stream::PER_THREAD) {
        Err(Error::OutOfMemory { .. }) => {}
        Ok(p) => {
            // (or served from the two adjacent freed chunks, if the device placed them so)
            sim.write_tag(p.0, 2 << 20, 1, Stream::PER_THREAD).unwrap();
            a.deallocate(p, 2 << 20, Stream::PER_THREAD).unwrap();
        }
        Err(e) => panic!("{e}"),
    }
    // ...and the freed blocks come back on every kind of stream, ordered after the old work.
    let user = sim.create_stream();
    for s in [Stream::PER_THREAD, user, Stream::LEGACY] {
        let p = a.allocate(size, s).unwrap();
        sim.write_tag(p.0, size, 2, s).unwrap();
        a.deallocate(p, size, s).unwrap();
        a.flush().unwrap();
    }
    // Small requests under the cap: the arenas take superblocks out of lazily fenced memory.
    let smalls: Vec<DeviceAddr> =
        (0..32).map(|_| a.allocate(32 << 10, Stream::PER_THREAD).unwrap()).collect();
    for p in &smalls {
        sim.write_tag(p.0, 32 << 10, 3, Stream::PER_THREAD).unwrap();
    }
    for p in smalls {
        a.deallocate(p, 32 << 10, Stream::LEGACY).unwrap();
    }
    sim.destroy_stream(user).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: dropping the allocator while lazy legacy fences guard memory still under per-thread
/// work: no panic, the drop waits for that work before releasing (a release under running
/// work is a violation), and every byte goes back to the device.
#[test]
fn allocator_drop_with_lazy_fences_pending() {
    let sim = host(0);
    {
        let a = alloc_with(&sim, small().batch_blocks(64));
        let size = 256 << 10;
        on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                for _ in 0..4 {
                    let p = a.allocate(size, Stream::PER_THREAD).unwrap();
                    sim.hold_and_check(p.0, size, 0xa, Duration::from_millis(200), Stream::PER_THREAD)
                        .unwrap();
                    a.deallocate(p, size, Stream::LEGACY).unwrap();
                }
                // Thread exit sends the batch, lazily fenced.
            }
        });
        assert_eq!(a.stats().live_bytes, 0);
        assert_eq!(a.pool_in_use(), 0);
        assert!(a.stats().reserved_bytes > 0);
        drop(a);
    }
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.tag_errors(), 0);
    assert_eq!(sim.reserved_bytes(), 0, "the allocator's drop released every chunk");
}

/// Held: thread exit with frees of pool blocks still waiting in its outbox, on the per-thread
/// stream and on the legacy stream: they are sent at exit under the right fence and reused by
/// another thread without a race.
#[test]
fn thread_exit_with_pool_frees_in_the_outbox() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(64));
    let size = 128 << 10;
    for free_on in [Stream::PER_THREAD, Stream::LEGACY] {
        let ps: Vec<DeviceAddr> = {
            let (a, sim) = (a.clone(), sim.clone());
            std::thread::spawn(move || {
                let ps: Vec<DeviceAddr> =
                    (0..5).map(|_| a.allocate(size, Stream::PER_THREAD).unwrap()).collect();
                for p in &ps {
                    sim.hold_and_check(p.0, size, 0xa, HOLD, Stream::PER_THREAD).unwrap();
                    a.deallocate(*p, size, free_on).unwrap();
                }
                assert_eq!(a.pool_in_use(), 5 * size, "the frees wait in the outbox");
                ps // no release_thread: the thread-local destructor sends them
            })
            .join()
            .unwrap()
        };
        assert_eq!(a.pool_in_use(), 0, "{free_on:?}: thread exit sent the outbox");
        on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let u = sim.create_stream();
                for s in [Stream::PER_THREAD, u] {
                    let qs: Vec<DeviceAddr> = (0..5).map(|_| a.allocate(size, s).unwrap()).collect();
                    assert!(qs.iter().all(|q| ps.contains(q)), "reused");
                    for q in &qs {
                        sim.write_tag(q.0, size, 0xb, s).unwrap();
                    }
                    for q in qs {
                        a.deallocate(q, size, s).unwrap();
                    }
                    a.flush().unwrap();
                }
                sim.destroy_stream(u).unwrap();
            }
        });
        sim.synchronize();
        assert!(sim.violations().is_empty(), "{free_on:?}: {:?}", sim.violations());
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: a double free of a pool block whose first free waits in an outbox is refused at once,
/// on every stream and from any thread, and counted once each; the first free still applies.
#[test]
fn double_free_of_a_pool_block_waiting_in_an_outbox() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(64));
    let size = 128 << 10;
    let mut bad = 0;
    for first in [Stream::PER_THREAD, Stream::LEGACY] {
        let p = a.allocate(size, Stream::PER_THREAD).unwrap();
        a.deallocate(p, size, first).unwrap();
        assert_eq!(a.pool_in_use(), size, "the first free waits in the outbox");
        let user = sim.create_stream();
        for second in [Stream::PER_THREAD, Stream::LEGACY, Stream::NULL, user] {
            let r = a.deallocate(p, size, second);
            assert!(
                matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })),
                "{first:?} then {second:?}: {r:?}"
            );
            bad += 1;
        }
        // Wrong size, too: still a double free, and refused.
        assert!(a.deallocate(p, size / 2, Stream::LEGACY).is_err());
        bad += 1;
        // From another thread, after the first free (ordered by the join).
        let r = on_thread(&a, move |a| a.deallocate(p, size, Stream::LEGACY));
        assert!(matches!(r, Err(Error::InvalidFree { .. })), "{r:?}");
        bad += 1;
        assert_eq!(a.stats().invalid_frees, bad);
        a.flush().unwrap();
        assert_eq!(a.pool_in_use(), 0, "the first free applied");
        // After the flush the block is free in the pool: still refused.
        assert!(a.deallocate(p, size, Stream::LEGACY).is_err());
        bad += 1;
        sim.destroy_stream(user).unwrap();
    }
    assert_all_returned(&a, Some(&sim), bad);
}

/// Held: frees on user streams that are destroyed right after, of pool blocks and of another
/// thread's arena blocks (sent at once with their own fence); the handles are then reused by
/// new streams, which must not be mistaken for the old ones.
#[test]
fn user_streams_destroyed_after_frees() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(8));
    let owner = Worker::new(&a);
    for round in 0..20u32 {
        let sim1 = sim.clone();
        let (small_blocks, ready) = owner.run(move |a| {
            let v: Vec<DeviceAddr> =
                (0..4).map(|_| a.allocate(8 << 10, Stream::PER_THREAD).unwrap()).collect();
            // The blocks are ready on the owner's per-thread stream: the user orders `u` after it.
            let e = sim1.create_event().unwrap();
            sim1.record_event(e, Stream::PER_THREAD).unwrap();
            (v, e)
        });
        let u = sim.create_stream();
        sim.stream_wait_event(u, ready).unwrap();
        let big = a.allocate(128 << 10, u).unwrap();
        sim.hold_and_check(big.0, 128 << 10, round, Duration::from_millis(5), u).unwrap();
        for p in &small_blocks {
            sim.hold_and_check(p.0, 8 << 10, round, Duration::from_millis(5), u).unwrap();
            a.deallocate(*p, 8 << 10, u).unwrap();
        }
        a.deallocate(big, 128 << 10, u).unwrap();
        sim.destroy_stream(u).unwrap();
        // A new stream, likely with the same handle.
        let v = sim.create_stream();
        let q = a.allocate(128 << 10, v).unwrap();
        sim.write_tag(q.0, 128 << 10, 0xb, v).unwrap();
        a.deallocate(q, 128 << 10, v).unwrap();
        sim.destroy_stream(v).unwrap();
        let sim2 = sim.clone();
        owner.run(move |a| {
            for _ in 0..8 {
                let p = a.allocate(8 << 10, Stream::PER_THREAD).unwrap();
                sim2.write_tag(p.0, 8 << 10, 0xc, Stream::PER_THREAD).unwrap();
                a.deallocate(p, 8 << 10, Stream::PER_THREAD).unwrap();
            }
        });
    }
    drop(owner);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Held: pending remote frees taken back behind one stream wait (2dd4d60) on both of a
/// thread's arenas, with the freers' work on user streams still running: the owner reuses the
/// blocks at once on its home streams and its work is ordered after theirs.
#[test]
fn pending_batches_waited_for_on_both_homes() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let owner = Worker::new(&a);
    let size = 32 << 10;
    let n = (256 << 10) / size;
    for home in [Stream::PER_THREAD, Stream::LEGACY] {
        let blocks: Vec<DeviceAddr> =
            owner.run(move |a| (0..n).map(|_| a.allocate(size, home).unwrap()).collect());
        let victims = blocks.clone();
        // The freers' work stays in flight behind a gate until the owner has reused the blocks
        // (a hold alone could end first on a loaded machine, and the reuse need not wait).
        let gate = on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let u = sim.create_stream();
                let gate = sim.gate(u).unwrap();
                for p in &victims {
                    sim.hold_and_check(p.0, size, 0xa, HOLD, u).unwrap();
                    a.deallocate(*p, size, u).unwrap(); // sent at once, fenced on `u`
                }
                sim.destroy_stream(u).unwrap();
                gate
            }
        });
        let before = a.stats();
        let sim2 = sim.clone();
        let again: Vec<DeviceAddr> = owner.run(move |a| {
            (0..n)
                .map(|_| {
                    let p = a.allocate(size, home).unwrap();
                    sim2.write_tag(p.0, size, 0xb, home).unwrap();
                    p
                })
                .collect()
        });
        let after = a.stats();
        assert!(again.iter().all(|p| blocks.contains(p)), "{home:?}: reused behind a wait");
        assert!(after.fence_waits > before.fence_waits, "{home:?}: the reuse waited");
        assert_eq!(after.superblocks_taken, before.superblocks_taken, "{home:?}: no growth");
        gate.open();
        owner.run(move |a| {
            for p in again {
                a.deallocate(p, size, home).unwrap();
            }
        });
        sim.synchronize();
        assert!(sim.violations().is_empty(), "{home:?}: {:?}", sim.violations());
    }
    drop(owner);
    assert_all_returned(&a, Some(&sim), 0);
}
