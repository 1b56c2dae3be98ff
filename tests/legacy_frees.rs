//! A thread's frees of its own blocks on the legacy stream: kept back in its legacy arena until
//! one legacy action per batch (`Arena::free_legacy`, `fence.rs`'s `LegacyAction`), instead of
//! an event per batch through the outbox. These tests check what the action is for (a block
//! reused after a legacy free is ordered after its earlier use on another thread's per-thread
//! stream), that kept-back frees are bounded, refused twice, and returned at exit and by
//! reclaim, and that the action, not an event, is what the batch costs.

use std::time::Duration;

use cuarena::{Allocator, Config, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::host;

/// Kept-back legacy frees are released `batch` at a time (`legacy_batch`).
fn allocator(sim: &HostDevice, batch: usize) -> Allocator {
    host_allocator(sim.clone(), Config::builder().legacy_batch_blocks(batch).build().unwrap()).unwrap()
}

/// The block is used on thread B's per-thread stream (a long write), freed by its owner A on
/// the legacy stream (the free's contract covers B's use: legacy work waits for it), reused by
/// A on the legacy stream and written on A's per-thread stream. That write must be ordered
/// after B's: only a legacy-stream action between the free and the reuse does it (A's
/// per-thread stream waits for earlier legacy actions, which wait for B's per-thread stream).
/// The mutation `legacy_no_action` (the action skipped) must fail this.
#[test]
fn a_legacy_free_reused_on_a_per_thread_stream_follows_its_use_on_another() {
    for batch in [1, 3] {
        let sim = host(0);
        let a = allocator(&sim, batch);
        let p = a.allocate(64 << 10, Stream::LEGACY).unwrap();
        // Blocks to fill the batch with (freed on the legacy stream after `p`).
        let fill: Vec<_> = (1..batch).map(|_| a.allocate(64 << 10, Stream::LEGACY).unwrap()).collect();
        use_on_b(&a, &sim, p, 64 << 10);
        a.deallocate(p, 64 << 10, Stream::LEGACY).unwrap();
        for q in &fill {
            a.deallocate(*q, 64 << 10, Stream::LEGACY).unwrap();
        }
        // The batch is full: its action is queued and the blocks are reusable, newest first.
        let mut again = Vec::new();
        for _ in 0..batch {
            again.push(a.allocate(64 << 10, Stream::LEGACY).unwrap());
        }
        assert!(again.contains(&p), "the kept-back block is reused after its batch: {again:?} {p:?}");
        write_after_b(&sim, p, &format!("batch {batch}"));
        for q in again {
            a.deallocate(q, 64 << 10, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Released kept-back frees of a class the block cache holds (4 KiB) go to the cache, not the
/// free lists (`Arena::merge_legacy`): the reuse is still ordered after the block's use on
/// another thread's per-thread stream, a second free of a released block is refused while it
/// waits in the cache, and every byte comes back.
#[test]
fn released_legacy_frees_of_a_cached_class_are_reused_in_order_and_refused_twice() {
    const S: usize = 4 << 10;
    for batch in [1, 3] {
        let sim = host(0);
        let a = allocator(&sim, batch);
        let p = a.allocate(S, Stream::LEGACY).unwrap();
        let fill: Vec<_> = (1..batch).map(|_| a.allocate(S, Stream::LEGACY).unwrap()).collect();
        use_on_b(&a, &sim, p, S);
        a.deallocate(p, S, Stream::LEGACY).unwrap();
        for q in &fill {
            a.deallocate(*q, S, Stream::LEGACY).unwrap();
        }
        // The batch is full: released behind its action, into the cache.
        let live = a.stats().live_bytes;
        for q in std::iter::once(&p).chain(&fill) {
            let r = a.deallocate(*q, S, Stream::LEGACY);
            assert!(
                matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })),
                "batch {batch}: a second free of a released block: {r:?}"
            );
        }
        assert_eq!(a.stats().live_bytes, live, "refused frees change nothing");
        let again: Vec<_> = (0..batch).map(|_| a.allocate(S, Stream::LEGACY).unwrap()).collect();
        assert!(again.contains(&p), "batch {batch}: the released block is reused: {again:?} {p:?}");
        write_len_after_b(&sim, p, S, &format!("cached, batch {batch}"));
        for q in again {
            a.deallocate(q, S, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), batch as u64);
    }
}

/// Thread B's use of `p` (`len` bytes): a long write of tag 7 on its per-thread stream, checked
/// at its end; B then releases its arenas and ends.
fn use_on_b(a: &Allocator, sim: &HostDevice, p: cuarena::DeviceAddr, len: usize) {
    let (a2, sim2) = (a.clone(), sim.clone());
    std::thread::spawn(move || {
        sim2.hold_and_check(p.0, len, 7, Duration::from_millis(30), Stream::PER_THREAD).unwrap();
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
}

/// Writes the reused block `p` on the calling thread's per-thread stream and checks that the
/// write was ordered after B's (no race seen, B's tag intact).
fn write_after_b(sim: &HostDevice, p: cuarena::DeviceAddr, what: &str) {
    write_len_after_b(sim, p, 64 << 10, what)
}

/// [`write_after_b`] of a block of `len` bytes.
fn write_len_after_b(sim: &HostDevice, p: cuarena::DeviceAddr, len: usize, what: &str) {
    sim.fill(p.0, len, 1, Stream::PER_THREAD).unwrap();
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{what}: reused without ordering: {v:?}");
    assert_eq!(sim.tag_errors(), 0, "{what}: B's block was overwritten while in use");
}

/// A block used on thread B's per-thread stream is freed by its owner A on the legacy stream
/// and kept back. Returns the allocator, the block and three more of A's, all 64 KiB, after
/// B's use (a long write of tag 7) and before A's free.
fn used_on_another_per_thread_stream(
    sim: &HostDevice,
    batch: usize,
) -> (Allocator, Vec<cuarena::DeviceAddr>) {
    let a = allocator(sim, batch);
    let ps: Vec<_> = (0..4).map(|_| a.allocate(64 << 10, Stream::LEGACY).unwrap()).collect();
    use_on_b(&a, sim, ps[0], 64 << 10);
    (a, ps)
}

/// Reuses A's first two blocks (the sealed half, merged back) and writes the first on A's
/// per-thread stream: ordered after B's write only if a legacy action was issued after A's
/// free. Then everything goes back.
fn reuse_and_check(sim: &HostDevice, a: &Allocator, ps: &[cuarena::DeviceAddr]) {
    let again: Vec<_> = (0..2).map(|_| a.allocate(64 << 10, Stream::LEGACY).unwrap()).collect();
    assert!(again.contains(&ps[0]), "the released half is reused: {again:?} {ps:?}");
    write_after_b(sim, ps[0], "a released half");
    for q in again {
        a.deallocate(q, 64 << 10, Stream::LEGACY).unwrap();
    }
    a.flush().unwrap();
}

/// Another thread's legacy action, issued after A published the first half of its batch,
/// covers that half: when A's batch is whole, the half is merged back with no driver call
/// (the rest published in its place), and its reuse on A's per-thread stream is ordered after
/// B's use through that action (`legacy_kept.rs`; `fence.rs`, "One action for every thread's
/// kept-back frees").
#[test]
fn another_threads_action_releases_a_published_half_without_a_call() {
    let sim = host(0);
    let (a, ps) = used_on_another_per_thread_stream(&sim, 4);
    for p in &ps[..2] {
        a.deallocate(*p, 64 << 10, Stream::LEGACY).unwrap(); // half of 4: published
    }
    // Thread C frees a whole batch of its own on the legacy stream: its action.
    let a2 = a.clone();
    let waits = std::thread::spawn(move || {
        let w0 = a2.stats().fence_waits;
        let qs: Vec<_> = (0..4).map(|_| a2.allocate(4096, Stream::LEGACY).unwrap()).collect();
        for q in qs {
            a2.deallocate(q, 4096, Stream::LEGACY).unwrap();
        }
        let w = a2.stats().fence_waits - w0;
        a2.release_thread().unwrap();
        w
    })
    .join()
    .unwrap();
    assert_eq!(waits, 1, "C's batch made one action");
    let s0 = a.stats();
    for p in &ps[2..] {
        a.deallocate(*p, 64 << 10, Stream::LEGACY).unwrap(); // a whole batch: settled
    }
    let s1 = a.stats();
    assert_eq!(s1.driver_calls, s0.driver_calls, "the half C's action covered needs no call: {s1:?}");
    reuse_and_check(&sim, &a, &ps);
    assert_all_returned(&a, Some(&sim), 0);
}

/// A published half whose ticket no action has covered (none issued since, or one issued
/// before it was published) is not reused without one: A's whole batch then costs A's own
/// action, and the reuse is ordered. The mutation `legacy_covered_unchecked` (a published half
/// taken as covered) must fail this.
#[test]
fn a_published_half_waits_for_an_action_issued_after_it() {
    for action_before in [false, true] {
        let sim = host(0);
        let (a, ps) = used_on_another_per_thread_stream(&sim, 4);
        if action_before {
            // C's action comes before A publishes: it covers nothing of A's.
            let a2 = a.clone();
            std::thread::spawn(move || {
                let qs: Vec<_> = (0..4).map(|_| a2.allocate(4096, Stream::LEGACY).unwrap()).collect();
                for q in qs {
                    a2.deallocate(q, 4096, Stream::LEGACY).unwrap();
                }
                a2.release_thread().unwrap();
            })
            .join()
            .unwrap();
        }
        for p in &ps[..2] {
            a.deallocate(*p, 64 << 10, Stream::LEGACY).unwrap();
        }
        let w0 = a.stats().fence_waits;
        for p in &ps[2..] {
            a.deallocate(*p, 64 << 10, Stream::LEGACY).unwrap();
        }
        assert_eq!(a.stats().fence_waits, w0 + 1, "action before: {action_before}: A's own action");
        reuse_and_check(&sim, &a, &ps);
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Kept-back frees are not reusable before their batch's action: with a batch of 64, frees
/// then allocations of the same size get other memory until the slow path releases the batch
/// (one action), and the whole run costs one wait per batch and no event.
#[test]
fn kept_back_frees_cost_one_wait_per_batch_and_no_event() {
    let sim = host(0);
    let a = allocator(&sim, 64);
    let ps: Vec<_> = (0..64 * 8).map(|_| a.allocate(4096, Stream::LEGACY).unwrap()).collect();
    let s0 = a.stats();
    for p in &ps {
        a.deallocate(*p, 4096, Stream::LEGACY).unwrap();
    }
    let s1 = a.stats();
    // The action's own event is recorded once per allocator, at its first action.
    assert!(s1.fences_recorded - s0.fences_recorded <= 1, "no event per batch: {s1:?}");
    assert_eq!(s1.fence_waits - s0.fence_waits, 8, "one wait per batch of 64: {s1:?}");
    assert_eq!(s1.fence_polls, s0.fence_polls, "no polls: {s1:?}");
    // A partial batch: kept back until the slow path needs it (or a flush).
    let q: Vec<_> = (0..10).map(|_| a.allocate(4096, Stream::LEGACY).unwrap()).collect();
    for p in &q {
        a.deallocate(*p, 4096, Stream::LEGACY).unwrap();
    }
    let s2 = a.stats();
    assert_eq!(s2.fence_waits, s1.fence_waits, "10 frees are under a batch");
    a.flush().unwrap();
    assert_eq!(a.stats().fence_waits, s2.fence_waits + 1, "a flush releases them with one action");
    assert_all_returned(&a, Some(&sim), 0);
}

/// The legacy keep-back has its own caps, apart from the remote-free batch: by default 256
/// blocks or 64 MiB; `legacy_batch_bytes` releases a batch once that many bytes are kept back.
#[test]
fn the_legacy_batch_is_capped_by_its_own_blocks_and_bytes() {
    let waits_for = |cfg: Config, n: usize, size: usize| {
        let sim = host(0);
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let ps: Vec<_> = (0..n).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
        let s0 = a.stats();
        for p in &ps {
            a.deallocate(*p, size, Stream::LEGACY).unwrap();
        }
        let waits = a.stats().fence_waits - s0.fence_waits;
        assert_all_returned(&a, Some(&sim), 0);
        waits
    };
    // Defaults: 1024 frees of 4 KiB (4 MiB) are 4 batches of 256 blocks, not 16 of the remote
    // batch's 64.
    assert_eq!(waits_for(Config::default(), 1024, 4096), 4);
    // 64 frees of 1 MiB: one batch at 64 MiB.
    assert_eq!(waits_for(Config::default(), 64, 1 << 20), 1);
    // A byte cap of 256 KiB: every 64 blocks of 4 KiB.
    let cfg = Config::builder().legacy_batch_bytes(256 << 10).build().unwrap();
    assert_eq!(waits_for(cfg, 1024, 4096), 16);
    // The remote batch does not change it.
    let cfg = Config::builder().batch_blocks(1).batch_bytes(4096).build().unwrap();
    assert_eq!(waits_for(cfg, 1024, 4096), 4);
}

/// A kept-back block is freed: a second free of it, by its owner on any stream or by another
/// thread, is refused and changes nothing.
#[test]
fn a_kept_back_block_freed_again_is_refused() {
    let sim = host(0);
    let a = allocator(&sim, 64);
    let p = a.allocate(1000, Stream::LEGACY).unwrap();
    a.deallocate(p, 1000, Stream::LEGACY).unwrap();
    for s in [Stream::LEGACY, Stream::PER_THREAD] {
        let e = a.deallocate(p, 1000, s).unwrap_err();
        assert!(matches!(e, Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }), "{s:?}: {e:?}");
    }
    let a2 = a.clone();
    let e = std::thread::spawn(move || {
        let r = a2.deallocate(p, 1000, Stream::LEGACY);
        a2.release_thread().unwrap();
        r
    })
    .join()
    .unwrap()
    .unwrap_err();
    assert!(matches!(e, Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }), "{e:?}");
    // A wrong size or an interior pointer of a live legacy block is refused and keeps nothing.
    let q = a.allocate(1000, Stream::LEGACY).unwrap();
    assert!(a.deallocate(q, 2000, Stream::LEGACY).is_err());
    assert!(a.deallocate(cuarena::DeviceAddr(q.0 + 256), 744, Stream::LEGACY).is_err());
    a.deallocate(q, 1000, Stream::LEGACY).unwrap();
    assert!(a.take_deferred_error().is_none());
    assert_all_returned(&a, Some(&sim), 5);
}

/// A thread that exits, or releases its arena, with frees kept back gives them back with the
/// rest (to the pool, behind a lazy legacy fence); another thread that takes that memory on its
/// per-thread stream is ordered after the block's last use.
#[test]
fn kept_back_frees_go_back_at_thread_exit_and_are_fenced_for_the_next_user() {
    for release in [true, false] {
        let sim = host(50);
        let a = allocator(&sim, 64);
        let (a2, sim2) = (a.clone(), sim.clone());
        std::thread::spawn(move || {
            let ps: Vec<_> = (0..20).map(|_| a2.allocate(256 << 10, Stream::LEGACY).unwrap()).collect();
            for (i, p) in ps.iter().enumerate() {
                sim2.hold_and_check(p.0, 256 << 10, i as u32, Duration::from_millis(2), Stream::LEGACY)
                    .unwrap();
                a2.deallocate(*p, 256 << 10, Stream::LEGACY).unwrap();
            }
            if release {
                a2.release_thread().unwrap();
            } // else thread exit gives them back
        })
        .join()
        .unwrap();
        // Another thread's memory, on its per-thread stream, overwritten at once.
        let qs: Vec<_> = (0..20).map(|_| a.allocate_per_thread(256 << 10).unwrap()).collect();
        for q in &qs {
            sim.fill(q.0, 256 << 10, 9, Stream::PER_THREAD).unwrap();
        }
        sim.synchronize();
        assert!(sim.violations().is_empty(), "release {release}: {:?}", sim.violations());
        assert_eq!(sim.tag_errors(), 0, "release {release}");
        for q in qs {
            a.deallocate_per_thread(q, 256 << 10).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Out of memory takes kept-back frees of an idle thread back (its superblocks have no used
/// block), without that thread's help.
#[test]
fn out_of_memory_takes_an_idle_threads_kept_back_frees() {
    let sim = host(0);
    let cfg = Config::builder().max_bytes(8 << 20).batch_blocks(64).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let (done, freed) = std::sync::mpsc::channel::<()>();
    let a2 = a.clone();
    let idle = std::thread::spawn(move || {
        let ps: Vec<_> = (0..12).map(|_| a2.allocate(512 << 10, Stream::LEGACY).unwrap()).collect();
        for p in ps {
            a2.deallocate(p, 512 << 10, Stream::LEGACY).unwrap(); // 12 blocks, 6 MiB: all kept back
        }
        done.send(()).unwrap();
        wait.recv().unwrap(); // idle, alive, holding them
        a2.release_thread().unwrap();
    });
    freed.recv().unwrap();
    let ps: Vec<_> = (0..12).map(|_| a.allocate_per_thread(512 << 10).unwrap()).collect();
    go.send(()).unwrap();
    idle.join().unwrap();
    for p in ps {
        a.deallocate_per_thread(p, 512 << 10).unwrap();
    }
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_all_returned(&a, Some(&sim), 0);
}

/// With the default caps (256 blocks, 64 MiB) each thread may keep back much of what it holds.
/// Four idle threads keep back everything they had, filling the cap between them; another
/// thread then needs the whole cap: out of memory takes every idle thread's kept-back frees,
/// ordered for the per-thread stream that reuses them (with fences skipped, this fails: the
/// reuse overlaps the earlier uses).
#[test]
fn out_of_memory_takes_the_kept_back_frees_of_many_idle_threads_under_the_default_caps() {
    const THREADS: usize = 4;
    const EACH: usize = 8; // 8 × 512 KiB: two whole superblocks per thread
    let sim = host(0);
    let cap = THREADS * EACH * (512 << 10);
    let cfg = Config::builder().max_bytes(cap).chunk(2 << 20).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let mut go = Vec::new();
    let (done, freed) = std::sync::mpsc::channel::<()>();
    let idle: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a2, done, sim2) = (a.clone(), done.clone(), sim.clone());
            let (tx, wait) = std::sync::mpsc::channel::<()>();
            go.push(tx);
            std::thread::spawn(move || {
                let ps: Vec<_> = (0..EACH).map(|_| a2.allocate(512 << 10, Stream::LEGACY).unwrap()).collect();
                // Uses still running on another thread's per-thread stream when the blocks are
                // freed on the legacy stream (which the free's contract covers: later legacy
                // work waits for them; another per-thread stream does not, unless a legacy
                // action comes between).
                let (ps2, sim3) = (ps.clone(), sim2.clone());
                std::thread::spawn(move || {
                    for (i, p) in ps2.iter().enumerate() {
                        let tag = (t * EACH + i) as u32;
                        sim3.hold_and_check(
                            p.0,
                            512 << 10,
                            tag,
                            Duration::from_millis(20),
                            Stream::PER_THREAD,
                        )
                        .unwrap();
                    }
                })
                .join()
                .unwrap();
                for p in ps {
                    a2.deallocate(p, 512 << 10, Stream::LEGACY).unwrap();
                }
                done.send(()).unwrap();
                wait.recv().unwrap(); // idle, alive, holding them kept back
                a2.release_thread().unwrap();
            })
        })
        .collect();
    for _ in 0..THREADS {
        freed.recv().unwrap();
    }
    assert_eq!(a.stats().reserved_bytes as usize, cap, "the cap is reached");
    let ps: Vec<_> = (0..THREADS * EACH)
        .map(|_| a.allocate_per_thread(512 << 10).expect("kept-back frees of idle threads are taken back"))
        .collect();
    for (i, p) in ps.iter().enumerate() {
        sim.write_tag(p.0, 512 << 10, 1000 + i as u32, Stream::PER_THREAD).unwrap();
    }
    go.into_iter().for_each(|g| g.send(()).unwrap());
    idle.into_iter().for_each(|h| h.join().unwrap());
    sim.synchronize();
    assert!(sim.violations().is_empty(), "reused before the legacy uses ended: {:?}", sim.violations());
    assert_eq!(sim.tag_errors(), 0);
    for p in ps {
        a.deallocate_per_thread(p, 512 << 10).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// The pool's blocks on the legacy stream (requests over `large_max`) ask the legacy stream's
/// identity once per allocator, as everything else does: it never changes. Before, every pool
/// allocation on the legacy stream asked it (on CUDA a `cuStreamIsCapturing` and a
/// `cuStreamGetId`: two of a pool pair's three driver calls). What must stay: a capture of a
/// blocking stream still refuses such an allocation, with nothing changed, and it succeeds
/// after the capture.
#[test]
fn pool_blocks_on_the_legacy_stream_ask_its_identity_once() {
    use cuarena_testkit::{HookedDevice, Hooks};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let sim = host(0);
    let asked = Arc::new(AtomicU64::new(0));
    let n = Arc::clone(&asked);
    let key = move |sim: &HostDevice, s: Stream| {
        if s.is_legacy() {
            n.fetch_add(1, Ordering::Relaxed);
        }
        cuarena::Device::stream_key(sim, s)
    };
    let dev = HookedDevice::new(sim.clone(), Hooks { stream_key: Some(Box::new(key)), ..Hooks::default() });
    let a = Allocator::new(dev, Config::builder().no_large().build().unwrap()).unwrap();
    const PAIRS: usize = 50;
    for i in 0..PAIRS {
        let size = (2 << 20) + i * 4096;
        let p = a.allocate(size, Stream::LEGACY).unwrap();
        sim.write_tag(p.0, size, i as u32 + 1, Stream::LEGACY).unwrap();
        a.deallocate(p, size, Stream::LEGACY).unwrap();
    }
    assert!(a.stats().pool_allocations >= PAIRS as u64, "served by the pool");
    assert_eq!(asked.load(Ordering::Relaxed), 1, "the legacy stream's identity asked once");
    // A blocking stream's capture (this thread's per-thread stream) refuses the legacy stream's
    // pool allocation, changing nothing, and is not invalidated.
    sim.begin_capture(Stream::PER_THREAD).unwrap();
    let before = a.stats();
    let e = a.allocate(2 << 20, Stream::LEGACY).unwrap_err();
    assert!(matches!(e, Error::StreamCapturing { .. }), "{e:?}");
    let after = a.stats();
    assert_eq!((after.live_bytes, after.pool_in_use_bytes), (before.live_bytes, before.pool_in_use_bytes));
    sim.end_capture(Stream::PER_THREAD).expect("the capture was not invalidated");
    let p = a.allocate(2 << 20, Stream::LEGACY).unwrap();
    a.deallocate(p, 2 << 20, Stream::LEGACY).unwrap();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_all_returned(&a, Some(&sim), 0);
}

/// A pool block of 2 MiB used on thread B's per-thread stream (a long write of tag 7), then
/// freed by A on the legacy stream and sent to the pool (`flush`).
fn pool_block_used_by_b_then_freed_on_legacy(a: &Allocator, sim: &HostDevice) -> cuarena::DeviceAddr {
    const S: usize = 2 << 20;
    let p = a.allocate(S, Stream::LEGACY).unwrap();
    use_on_b(a, sim, p, S);
    a.deallocate(p, S, Stream::LEGACY).unwrap();
    a.flush().unwrap(); // the outbox's legacy batch goes to the pool now
    p
}

/// A pool block (over `large_max`) used on thread B's per-thread stream, freed by A on the
/// legacy stream (no event: a lazy legacy fence under a ticket), reused by A on the legacy stream
/// and written on A's per-thread stream: the write must follow B's use, which only a legacy
/// action issued after the free orders (A's per-thread stream waits for earlier legacy
/// operations, which wait for B's). The reuse issues one action, and records no event: before,
/// it recorded an event on the legacy stream at every such reuse. The mutation
/// `pool_legacy_no_action` (no action) must fail this.
#[test]
fn a_pool_block_freed_on_the_legacy_stream_is_reused_there_behind_an_action() {
    const S: usize = 2 << 20;
    let sim = host(0);
    let a = host_allocator(sim.clone(), Config::builder().no_large().legacy_batch_blocks(1).build().unwrap())
        .unwrap();
    // A legacy action now (an arena's batch of one), so that the action's event, recorded by
    // the first action, exists before the reuse below.
    let r = a.allocate(4096, Stream::LEGACY).unwrap();
    a.deallocate(r, 4096, Stream::LEGACY).unwrap();
    let p = pool_block_used_by_b_then_freed_on_legacy(&a, &sim);
    let before = a.stats();
    let q = a.allocate(S, Stream::LEGACY).unwrap();
    assert_eq!(q, p, "the pool's first fit hands the block out again");
    let after = a.stats();
    write_len_after_b(&sim, q, S, "a pool block reused on the legacy stream");
    assert_eq!(
        after.fences_recorded, before.fences_recorded,
        "no event recorded for a reuse on the legacy stream"
    );
    assert_eq!(after.driver_calls - before.driver_calls, 2, "one capture check and one legacy action");
    assert_eq!(after.fence_waits - before.fence_waits, 1, "the action: a wait on the legacy stream");
    a.deallocate(q, S, Stream::LEGACY).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Another thread's legacy action issued after a pool block's free on the legacy stream covers
/// its ticket: the block's reuse on the legacy stream then makes no legacy action of its own,
/// and stays ordered after the use before the free (as
/// `a_pool_block_freed_on_the_legacy_stream_is_reused_there_behind_an_action`). A reuse on
/// another stream still records an event on the legacy stream and waits on it (a non-blocking
/// stream orders itself after no legacy action).
#[test]
fn a_pool_blocks_legacy_ticket_covered_by_another_threads_action_costs_no_call() {
    const S: usize = 2 << 20;
    let sim = host(0);
    let a = host_allocator(sim.clone(), Config::builder().no_large().legacy_batch_blocks(1).build().unwrap())
        .unwrap();
    let p = pool_block_used_by_b_then_freed_on_legacy(&a, &sim);
    // Thread C's own legacy free (a batch of one) issues its arena's legacy action now.
    let a3 = a.clone();
    std::thread::spawn(move || {
        let r = a3.allocate(4096, Stream::LEGACY).unwrap();
        a3.deallocate(r, 4096, Stream::LEGACY).unwrap();
        a3.release_thread().unwrap();
    })
    .join()
    .unwrap();
    let before = a.stats();
    let q = a.allocate(S, Stream::LEGACY).unwrap();
    assert_eq!(q, p);
    let after = a.stats();
    assert_eq!(
        after.driver_calls - before.driver_calls,
        1,
        "the capture check only: C's action covered the ticket"
    );
    write_len_after_b(&sim, q, S, "a pool block reused behind another thread's action");
    a.deallocate(q, S, Stream::LEGACY).unwrap();
    a.flush().unwrap();
    // On a non-blocking user stream: an event on the legacy stream, and a wait on it.
    let user = sim.create_stream();
    let before = a.stats();
    let u = a.allocate(S, user).unwrap();
    assert_eq!(u, p);
    let after = a.stats();
    assert_eq!(after.fences_recorded - before.fences_recorded, 1, "an event on the legacy stream");
    assert_eq!(after.fence_waits - before.fence_waits, 1, "the user stream waits on it");
    a.deallocate(u, S, user).unwrap();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_all_returned(&a, Some(&sim), 0);
    sim.destroy_stream(user).unwrap();
}
