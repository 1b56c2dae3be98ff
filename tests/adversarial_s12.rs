//! Twelfth session's attacks (a helper's) on three changes:
//!
//! 1. Released kept-back legacy frees now go into the per-class block cache (classes up to
//!    32 KiB, 8 deep) where there is room, instead of always being merged, and kept frees are
//!    stored as (superblock, first granule, granules) (`Arena::merge_legacy`,
//!    `legacy_kept.rs`). Attacked: the cache's documented invariant "emptied ... before taking
//!    a new superblock" on the slow path that releases them; thread exit, `trim` and
//!    out-of-memory reclaim of an arena whose cache holds released legacy blocks; the return
//!    rule firing right after a release into the cache; second frees of a released, cached
//!    block from every stream and from another thread; a large block (granule-rounded) whose
//!    size is exactly a cached class; a sealed half covered by another thread's action going
//!    to the cache; multi-threaded legacy churn with accounting and the race checker.
//! 2. Size-class sizes from a compile-time table (`size_class.rs`): every class boundary on
//!    the arena streams, against an independent rounding and the free's size check.
//! 3. The user-stream allocation fast path (`alloc_fast_user`) that hands its identity query
//!    to the slow path through `Slot::asked`, and `tick_user` only when the outbox holds
//!    user batches. Attacked: a stale `asked` crossing calls or streams (a handle reused by a
//!    new stream, an OOM retry whose hook replaces the stream and allocates on another one, a
//!    failed identity query, a trace running, pass-through mode, a capture), a reclaimer
//!    taking the user arena while the owner is paused inside the fast path's identity query,
//!    and remote user-stream frees still sent after 256 allocations on their stream only.
//!
//! Found (at ed819d5): the first two tests fail. `Arena::alloc_slow` flushes the cache, then
//! releases kept-back legacy frees (`release_covered_legacy`, `release_legacy`), which now put
//! up to 8 blocks per class back into the cache; when the request does not fit the merged
//! remainder, the slow path goes on to `grow` with those blocks still cached and unmerged: a
//! new superblock (or, under a cap, an out-of-memory reclaim, a retry and, with a user arena,
//! a device synchronise) for a request the arena's own free memory could serve. Both pass at
//! 8788dea (before the change), and since 1511b94, whose slow path releases the kept-back
//! frees first and flushes the cache after, so every released block is merged before the
//! arena grows (`Arena::alloc_slow`).
//!
//! The oracles: the host device's race checker and tags, overlap maps, `stats()` (live bytes,
//! invalid frees, cross-stream frees, fences, superblocks, retries), identity queries counted
//! through a `HookedDevice`, and `assert_all_returned`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HookedDevice, Hooks, HostDevice, Stall, assert_all_returned};

mod common;
use common::*;

const KIB4: usize = 4 << 10;

/// Counts identity queries (`Device::stream_key`) per raw handle of user streams; can be told
/// to fail the next `fail` user-stream queries.
#[derive(Default)]
struct KeyLog {
    by_handle: Mutex<HashMap<usize, u64>>,
    fail: AtomicU32,
}

impl KeyLog {
    fn count(&self, s: Stream) -> u64 {
        *self.by_handle.lock().unwrap().get(&s.as_raw()).unwrap_or(&0)
    }
    fn total(&self) -> u64 {
        self.by_handle.lock().unwrap().values().sum()
    }
}

/// A hooked device counting (and optionally failing) user-stream identity queries.
fn counted_device(sim: &HostDevice, log: &Arc<KeyLog>) -> Arc<HookedDevice> {
    let log = Arc::clone(log);
    let key = move |sim: &HostDevice, s: Stream| {
        if s.is_user() {
            *log.by_handle.lock().unwrap().entry(s.as_raw()).or_default() += 1;
            if log.fail.load(Ordering::SeqCst) > 0 {
                log.fail.fetch_sub(1, Ordering::SeqCst);
                return Err(Error::Driver { call: "cuStreamGetId (injected)", code: 999 });
            }
        }
        sim.stream_key(s)
    };
    HookedDevice::new(sim.clone(), Hooks { stream_key: Some(Box::new(key)), ..Hooks::default() })
}

// ---------------------------------------------------------------------------------------------
// 1. Released legacy frees in the block cache.

/// 64 blocks of 4 KiB fill one 256 KiB superblock of the legacy arena. Every eighth (by
/// address) is freed first, then the rest: with the default batch (256) all 64 stay kept back
/// (under half a batch); with `covered`, the batch is 128, so the 64 are sealed as one half and
/// another thread's legacy action covers them. A 32 KiB request then reaches the slow path,
/// which releases them (behind one legacy action of its own, or as the covered half): the
/// first eight freed go to the cache (class 4 KiB has room for 8), the rest are merged, so the
/// superblock's free space is eight runs of 28 KiB split by cached blocks. The module doc of
/// `arena.rs` says the cache is emptied "before taking a new superblock"; before the change
/// every released block was merged, and the request fit in the arena's wholly free superblock.
/// With `user`, the thread also holds a wholly free superblock in a user stream's arena.
/// Returns (superblocks taken, alloc retries, device synchronises) for the request.
fn fragmented_legacy_release(
    cap: Option<usize>,
    covered: bool,
    user: bool,
) -> (u64, u64, u64, Allocator, HostDevice) {
    let sim = host(0);
    let mut cfg = small();
    if let Some(c) = cap {
        cfg = cfg.chunk(256 << 10).max_bytes(c);
    }
    if covered {
        cfg = cfg.legacy_batch_blocks(128);
    }
    let a = alloc_with(&sim, cfg);
    let us = sim.create_stream();
    if user {
        let u = a.allocate(KIB4, us).unwrap();
        a.deallocate(u, KIB4, us).unwrap();
    }
    let mut ps: Vec<DeviceAddr> = (0..64).map(|_| a.allocate(KIB4, Stream::LEGACY).unwrap()).collect();
    ps.sort_by_key(|p| p.0);
    assert_eq!(a.stats().superblocks_taken, 1 + u64::from(user), "64 blocks of 4 KiB fill one superblock");
    assert_eq!(ps[63].0 - ps[0].0, 63 * KIB4 as u64, "contiguous");
    let (every8, rest): (Vec<_>, Vec<_>) = ps.iter().enumerate().partition(|(i, _)| i % 8 == 0);
    for (_, p) in every8.into_iter().chain(rest) {
        a.deallocate(*p, KIB4, Stream::LEGACY).unwrap();
    }
    assert_eq!(a.stats().live_bytes, 0);
    if covered {
        // Another thread's own legacy batch (256 B blocks, from its own arena, which the cap
        // leaves room for only without one): its action covers our sealed half.
        if cap.is_none() {
            on_thread(&a, |a| {
                let qs: Vec<_> = (0..128).map(|_| a.allocate(256, Stream::LEGACY).unwrap()).collect();
                qs.into_iter().for_each(|q| a.deallocate(q, 256, Stream::LEGACY).unwrap());
            });
        }
    }
    let s0 = a.stats();
    let q = a.allocate(32 << 10, Stream::LEGACY).unwrap();
    let s = a.stats();
    a.deallocate(q, 32 << 10, Stream::LEGACY).unwrap();
    sim.destroy_stream(us).unwrap();
    let d = (
        s.superblocks_taken - s0.superblocks_taken,
        s.alloc_retries - s0.alloc_retries,
        s.host_syncs - s0.host_syncs,
    );
    (d.0, d.1, d.2, a, sim)
}

#[test]
fn released_legacy_frees_are_merged_before_the_arena_borrows_another_superblock() {
    for covered in [true, false] {
        let (taken, _, _, a, sim) = fragmented_legacy_release(None, covered, false);
        assert_eq!(
            taken, 0,
            "covered {covered}: a 32 KiB request took a new superblock while the arena's only \
             superblock was wholly free (released legacy frees left in the cache, unmerged, \
             when the slow path grew)"
        );
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// The same under a cap the thread's superblocks fill (one legacy superblock; with a user
/// stream's arena holding a free superblock, two): the request should be served from the free
/// legacy superblock; with released blocks stranded in the cache it needs the out-of-memory
/// reclaim (which flushes the cache, gives the superblock back and lends it again) and a
/// retry, and, with the user arena, a device synchronise (the user arena's memory can leave
/// it outside a call on its stream only after one).
#[test]
fn released_legacy_frees_fit_under_a_tight_cap_without_an_oom_reclaim() {
    for user in [true, false] {
        let cap = if user { 512 << 10 } else { 256 << 10 };
        let (_, retries, syncs, a, sim) = fragmented_legacy_release(Some(cap), false, user);
        assert_eq!(
            (retries, syncs),
            (0, 0),
            "user arena {user}: out-of-memory reclaims and device synchronises for memory the \
             legacy arena held free"
        );
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// A thread's legacy blocks, used on another thread's per-thread stream (long holds), are
/// freed on the legacy stream in batches of 4 (released into the cache: 12 of 4 KiB, 8 fit,
/// and 3 of 1 KiB), some reused from the cache; then the thread ends, with or without
/// `release_thread`. Another thread then reuses the memory on its per-thread stream: ordered
/// after the holds, no overlap, everything returned.
#[test]
fn thread_exit_with_released_legacy_blocks_in_the_cache() {
    for explicit in [true, false] {
        let sim = host(0);
        let a = alloc_with(&sim, small().legacy_batch_blocks(4));
        let (a2, sim2) = (a.clone(), sim.clone());
        let kept = std::thread::spawn(move || {
            let mut ps: Vec<(DeviceAddr, usize)> =
                (0..12).map(|_| (a2.allocate(KIB4, Stream::LEGACY).unwrap(), KIB4)).collect();
            ps.extend((0..3).map(|_| (a2.allocate(1024, Stream::LEGACY).unwrap(), 1024)));
            use_on_another_thread(&sim2, &ps, 300, 20);
            for &(p, n) in &ps {
                a2.deallocate(p, n, Stream::LEGACY).unwrap();
            }
            // 15 frees, batches of 4: 12 released (cache: 8 of 4 KiB), 3 kept back.
            let again: Vec<_> = (0..3).map(|_| a2.allocate(KIB4, Stream::LEGACY).unwrap()).collect();
            assert!(again.iter().all(|q| ps.iter().any(|(p, _)| p == q)), "reused from the cache");
            if explicit {
                a2.release_thread().unwrap();
            }
            again // still live: freed by the main thread below
        })
        .join()
        .unwrap();
        let live = Live::default();
        kept.iter().for_each(|q| live.insert(*q, KIB4));
        let mut qs = Vec::new();
        for i in 0..64 {
            let q = a.allocate_per_thread(KIB4).unwrap();
            live.insert(q, KIB4);
            sim.write_tag(q.0, KIB4, 9000 + i, Stream::PER_THREAD).unwrap();
            qs.push(q);
        }
        live.assert_clean();
        sim.synchronize();
        assert!(sim.violations().is_empty(), "explicit {explicit}: {:?}", sim.violations());
        for q in qs {
            a.deallocate_per_thread(q, KIB4).unwrap();
        }
        for q in kept {
            a.deallocate(q, KIB4, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// An idle thread's legacy arena holds only released blocks, in its cache (8 of 4 KiB, two
/// batches of 4) and merged (1 KiB ones). `trim(false)` from another thread takes the arena
/// without its owner: every superblock holds no used block, so all go back. Then the owner
/// allocates again (its cache must be empty now, or it would hand out memory it gave back),
/// and another thread's per-thread reuse of the given-back memory is ordered after the uses.
#[test]
fn trim_takes_an_idle_arena_whose_cache_holds_released_legacy_blocks() {
    let sim = host(0);
    let a = alloc_with(&sim, small().legacy_batch_blocks(4));
    let w = Worker::new(&a);
    let sim2 = sim.clone();
    let ps = w.run(move |a| {
        let mut ps: Vec<(DeviceAddr, usize)> =
            (0..8).map(|_| (a.allocate(KIB4, Stream::LEGACY).unwrap(), KIB4)).collect();
        ps.extend((0..4).map(|_| (a.allocate(1024, Stream::LEGACY).unwrap(), 1024)));
        use_on_another_thread(&sim2, &ps, 500, 20);
        for &(p, n) in &ps {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        ps
    });
    let s0 = a.stats();
    assert_eq!(s0.live_bytes, 0);
    assert!(s0.arena_held_bytes > 0);
    a.trim(false).unwrap();
    let s1 = a.stats();
    assert_eq!(s1.arena_held_bytes, 0, "trim gave back every superblock of the idle arena: {s1:?}");
    // The main thread takes the memory on its per-thread stream and overwrites it.
    let live = Arc::new(Live::default());
    let mut qs = Vec::new();
    for i in 0..64 {
        let q = a.allocate_per_thread(KIB4).unwrap();
        live.insert(q, KIB4);
        sim.write_tag(q.0, KIB4, 7000 + i, Stream::PER_THREAD).unwrap();
        qs.push(q);
    }
    // The owner allocates again: nothing from its (emptied) cache may overlap the above.
    let live2 = Arc::clone(&live);
    let again = w.run(move |a| {
        let v: Vec<_> = (0..16).map(|_| a.allocate(KIB4, Stream::LEGACY).unwrap()).collect();
        v.iter().for_each(|q| live2.insert(*q, KIB4));
        v
    });
    live.assert_clean();
    let _ = ps;
    w.run(move |a| again.into_iter().for_each(|q| a.deallocate(q, KIB4, Stream::LEGACY).unwrap()));
    w.exit();
    for q in qs {
        a.deallocate_per_thread(q, KIB4).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// The same idle arena with released blocks in its cache, taken by an out-of-memory reclaim:
/// under a 1 MiB cap (4 superblocks) the idle thread holds 2 superblocks of released legacy
/// blocks (one live block pins one of them), and the main thread needs 3 superblocks' worth on
/// its per-thread stream. It gets them (the reclaim flushes the idle cache and dissolves), the
/// reuse is ordered after the uses on a third thread's per-thread stream, the idle owner goes
/// on (frees its live block, allocates again), no overlap, all returned.
#[test]
fn oom_reclaim_takes_an_idle_arena_whose_cache_holds_released_legacy_blocks() {
    let sim = host(0);
    let a = alloc_with(&sim, small().chunk(256 << 10).max_bytes(1 << 20).legacy_batch_blocks(4));
    let w = Worker::new(&a);
    let sim2 = sim.clone();
    // 2 superblocks of 64 blocks of 4 KiB, all used elsewhere; one kept live, the rest freed on
    // the legacy stream in batches of 4 (31 released, mostly merged, 8 cached; 3 kept back).
    let (pin, ps) = w.run(move |a| {
        let ps: Vec<(DeviceAddr, usize)> =
            (0..128).map(|_| (a.allocate(KIB4, Stream::LEGACY).unwrap(), KIB4)).collect();
        use_on_another_thread(&sim2, &ps, 100, 1);
        let pin = ps[5].0;
        for &(p, n) in ps.iter().filter(|(p, _)| *p != pin) {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        (pin, ps)
    });
    assert_eq!(a.stats().superblocks_taken, 2);
    let live = Arc::new(Live::default());
    live.insert(pin, KIB4);
    let mut qs = Vec::new();
    // 3 superblocks' worth minus a little (the pinned superblock is dissolved: its free ranges
    // go to the pool, which serves a request that still finds no superblock by first fit).
    for i in 0..(3 * 64 - 2) {
        match a.allocate_per_thread(KIB4) {
            Ok(q) => {
                live.insert(q, KIB4);
                sim.write_tag(q.0, KIB4, 20_000 + i, Stream::PER_THREAD).unwrap();
                qs.push(q);
            }
            Err(e) => panic!("block {i}: {e}; {:?}", a.stats()),
        }
    }
    assert!(a.stats().alloc_retries > 0, "the cap was reached and memory reclaimed");
    let live2 = Arc::clone(&live);
    w.run(move |a| {
        live2.remove(pin);
        a.deallocate(pin, KIB4, Stream::LEGACY).unwrap();
        // Whatever the owner still gets must not overlap the main thread's blocks.
        let mut v = Vec::new();
        for _ in 0..8 {
            match a.allocate(KIB4, Stream::LEGACY) {
                Ok(q) => {
                    live2.insert(q, KIB4);
                    v.push(q);
                }
                Err(Error::OutOfMemory { .. }) => break,
                Err(e) => panic!("{e}"),
            }
        }
        for q in v {
            live2.remove(q);
            a.deallocate(q, KIB4, Stream::LEGACY).unwrap();
        }
    });
    live.assert_clean();
    let _ = ps;
    w.exit();
    for q in qs {
        a.deallocate_per_thread(q, KIB4).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A released legacy free waiting in the cache is freed again: by its owner on the legacy,
/// per-thread and a user stream, with its size, a wrong size and an interior pointer, and by
/// another thread on the legacy and per-thread streams. Every one is refused at once (the
/// freed flag and the `PENDING` head), counted, and changes nothing; the block comes back from
/// the cache once, and everything is returned.
#[test]
fn second_frees_of_a_released_cached_block_are_refused_everywhere() {
    let sim = host(0);
    let a = alloc_with(&sim, small().legacy_batch_blocks(1));
    let us = sim.create_stream();
    let other = a.allocate(KIB4, Stream::LEGACY).unwrap(); // a neighbour, still live
    let p = a.allocate(KIB4, Stream::LEGACY).unwrap();
    a.deallocate(p, KIB4, Stream::LEGACY).unwrap(); // a batch of 1: released, into the cache
    let live = a.stats().live_bytes;
    assert_eq!(live, KIB4 as u64);
    let mut bad = 0;
    for s in [Stream::LEGACY, Stream::PER_THREAD, us] {
        let r = a.deallocate(p, KIB4, s);
        assert!(is_double(&r), "{s:?}: {r:?}");
        let r = a.deallocate(p, 8 << 10, s);
        assert!(is_invalid(&r), "wrong size on {s:?}: {r:?}");
        let r = a.deallocate(DeviceAddr(p.0 + 256), KIB4 - 256, s);
        assert!(is_invalid(&r), "interior on {s:?}: {r:?}");
        bad += 3;
    }
    for s in [Stream::LEGACY, Stream::PER_THREAD] {
        let r = on_thread(&a, move |a| a.deallocate(p, KIB4, s));
        assert!(is_double(&r), "another thread on {s:?}: refused at once: {r:?}");
        bad += 1;
    }
    let st = a.stats();
    assert_eq!(st.live_bytes, live, "refused frees change nothing");
    assert_eq!(st.invalid_frees, bad);
    assert!(a.take_deferred_error().is_none(), "every refusal was at once");
    let q = a.allocate(KIB4, Stream::LEGACY).unwrap();
    assert_eq!(q, p, "the cached block comes back");
    let q2 = a.allocate(KIB4, Stream::LEGACY).unwrap();
    assert_ne!(q2, p, "and only once");
    for x in [q, q2, other] {
        a.deallocate(x, KIB4, Stream::LEGACY).unwrap();
    }
    sim.destroy_stream(us).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

/// With `small_max = 1 KiB`, a 5 KiB request is large (granule-rounded, 20 granules), and 20
/// granules is exactly a class the cache holds. Freed on the legacy stream and released into
/// the cache, it must go only to a request of exactly 20 granules (a 19-granule request rounds
/// to the same class), and its frees must be checked against its own size.
#[test]
fn a_large_released_block_of_a_cached_class_goes_only_to_its_exact_size() {
    let sim = host(0);
    let a = alloc_with(&sim, small().small_max(1024).legacy_batch_blocks(1));
    let (n20, n19) = (20 * 256, 19 * 256);
    let p = a.allocate(n20, Stream::LEGACY).unwrap();
    a.deallocate(p, n20, Stream::LEGACY).unwrap(); // released into the cache
    let q = a.allocate(n19, Stream::LEGACY).unwrap();
    // Had it been handed the cached 20-granule block, its free as 19 granules would be
    // refused as a size mismatch, and one as 20 granules taken.
    let live = Live::of(&[(q, n19)]);
    let mut bad = 0;
    let r = a.deallocate(q, n20, Stream::LEGACY);
    assert!(matches!(r, Err(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. })), "{r:?}");
    bad += 1;
    let r2 = a.allocate(n20 - 10, Stream::LEGACY).unwrap();
    if q != p {
        assert_eq!(r2, p, "the cached block goes to a request of exactly its granules");
    }
    live.insert(r2, n20);
    live.assert_clean();
    let r = a.deallocate(r2, n19, Stream::LEGACY);
    assert!(is_invalid(&r), "{r:?}");
    bad += 1;
    a.deallocate(r2, n20 - 10, Stream::LEGACY).unwrap();
    a.deallocate(q, n19, Stream::LEGACY).unwrap();
    let r = a.deallocate(r2, n20 - 10, Stream::LEGACY);
    assert!(is_invalid(&r), "a second free: {r:?}");
    bad += 1;
    assert_eq!(a.stats().live_bytes, 0);
    assert_all_returned(&a, Some(&sim), bad);
}

/// A sealed half covered by another thread's legacy action is released into the cache at the
/// next whole batch (`settle_legacy`, no driver call): its blocks, used on a third thread's
/// per-thread stream before their frees, are reused from the cache and written on the owner's
/// per-thread stream: ordered after those uses by the other thread's action.
#[test]
fn a_covered_sealed_half_released_into_the_cache_is_reused_in_order() {
    for round in 0..3 {
        let sim = host(0);
        let a = alloc_with(&sim, small().legacy_batch_blocks(4));
        let ps: Vec<DeviceAddr> = (0..4).map(|_| a.allocate(KIB4, Stream::LEGACY).unwrap()).collect();
        let uses: Vec<_> = ps.iter().map(|&p| (p, KIB4)).collect();
        use_on_another_thread(&sim, &uses, 40, 25);
        a.deallocate(ps[0], KIB4, Stream::LEGACY).unwrap();
        a.deallocate(ps[1], KIB4, Stream::LEGACY).unwrap(); // half of 4: sealed
        on_thread(&a, |a| {
            // A whole batch of this thread's own: one legacy action, which covers the seal.
            let qs: Vec<_> = (0..4).map(|_| a.allocate(1024, Stream::LEGACY).unwrap()).collect();
            qs.into_iter().for_each(|q| a.deallocate(q, 1024, Stream::LEGACY).unwrap());
        });
        a.deallocate(ps[2], KIB4, Stream::LEGACY).unwrap();
        a.deallocate(ps[3], KIB4, Stream::LEGACY).unwrap(); // whole batch: settle, covered
        let again: Vec<_> = (0..2).map(|_| a.allocate(KIB4, Stream::LEGACY).unwrap()).collect();
        let mut got = again.clone();
        got.sort_by_key(|p| p.0);
        let mut want = vec![ps[0], ps[1]];
        want.sort_by_key(|p| p.0);
        assert_eq!(got, want, "round {round}: the covered half comes from the cache");
        for q in &again {
            sim.fill(q.0, KIB4, 1, Stream::PER_THREAD).unwrap();
        }
        sim.synchronize();
        let v = sim.violations();
        assert!(v.is_empty(), "round {round}: reused without ordering: {v:?}");
        assert_eq!(sim.tag_errors(), 0, "round {round}");
        for q in again {
            a.deallocate(q, KIB4, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Three superblocks of 4 KiB legacy blocks freed as one batch of 192: the release puts eight
/// in the cache and merges the rest, then the return rule fires inside the release
/// (`merge_legacy` -> `shrink`) with cached blocks present. With `keep_empty = 0` every
/// superblock goes back; the debug assertions of `give_back` ("a pending block without its
/// batch") and the race checker watch that no cached block leaves with its superblock
/// unflushed; a later reuse is clean.
#[test]
fn the_return_rule_inside_a_release_into_the_cache_gives_back_cleanly() {
    for keep in [0, 2] {
        let sim = host(0);
        let a = alloc_with(&sim, small().keep_empty(keep).legacy_batch_blocks(192));
        let ps: Vec<(DeviceAddr, usize)> =
            (0..192).map(|_| (a.allocate(KIB4, Stream::LEGACY).unwrap(), KIB4)).collect();
        assert_eq!(a.stats().superblocks_taken, 3);
        use_on_another_thread(&sim, &ps, 1, 1);
        let returned = a.stats().superblocks_returned;
        for &(p, n) in &ps {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        let s = a.stats();
        let back = s.superblocks_returned - returned;
        if keep == 0 {
            assert_eq!((back, s.arena_held_bytes), (3, 0), "keep_empty 0: {s:?}");
        } else {
            assert_eq!(back, 1, "keep_empty 2: one of three goes back: {s:?}");
        }
        // Reuse on another thread's per-thread stream, then ours.
        let live = Arc::new(Live::default());
        let qs: Vec<_> = (0..192).map(|_| a.allocate(KIB4, Stream::LEGACY).unwrap()).collect();
        qs.iter().for_each(|q| live.insert(*q, KIB4));
        let l2 = Arc::clone(&live);
        let other = on_thread(&a, move |a| {
            let v: Vec<_> = (0..64).map(|_| a.allocate_per_thread(KIB4).unwrap()).collect();
            v.iter().for_each(|q| l2.insert(*q, KIB4));
            v
        });
        live.assert_clean();
        for q in &qs {
            sim.write_tag(q.0, 256, 3, Stream::PER_THREAD).unwrap();
        }
        for q in qs {
            a.deallocate(q, KIB4, Stream::LEGACY).unwrap();
        }
        for q in other {
            a.deallocate(q, KIB4, Stream::LEGACY).unwrap(); // another thread's: remote
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Two threads churn legacy blocks of cached and uncached sizes (batches of 8, so releases
/// into the cache all the time), hand a third of them to each other (remote frees on the
/// legacy or per-thread stream), `flush` and `trim` now and then, under a 4 MiB cap. Every
/// block is tagged and checked; no overlap, no race, live bytes exact at the end.
#[test]
fn two_threads_churn_legacy_blocks_through_the_cache_under_a_cap() {
    let sim = host(3);
    let a =
        alloc_with(&sim, small().chunk(256 << 10).max_bytes(4 << 20).legacy_batch_blocks(8).batch_blocks(8));
    let live = Arc::new(Live::default());
    // Bounded: a thread that runs ahead of the other (one core) cannot pile its sent blocks up
    // under the cap; when the channel is full it frees the block itself.
    let (tx0, rx0) = std::sync::mpsc::sync_channel::<Held>(16);
    let (tx1, rx1) = std::sync::mpsc::sync_channel::<Held>(16);
    let ooms = Arc::new(AtomicU64::new(0));
    let run = |id: u32, tx: std::sync::mpsc::SyncSender<Held>, rx: std::sync::mpsc::Receiver<Held>| {
        let (a, sim, live, ooms) = (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&ooms));
        std::thread::spawn(move || {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(id);
            let mut tagn = id * 1_000_000;
            let mut held: Vec<Held> = Vec::new();
            for step in 0..1500 {
                for h in rx.try_iter() {
                    // A block from the other thread: freed here, on the legacy or our stream.
                    check(&sim, h.p, h.size, h.t, h.s);
                    live.remove(h.p);
                    // Its uses were on the legacy stream, which a per-thread stream follows.
                    let s = if rng(&mut x).is_multiple_of(2) { Stream::LEGACY } else { Stream::PER_THREAD };
                    a.deallocate(h.p, h.size, s).unwrap();
                }
                let r = rng(&mut x);
                if !r.is_multiple_of(3) || held.is_empty() {
                    let size = match r % 7 {
                        0 => 300,
                        1 => 1024,
                        2 => KIB4,
                        3 => 32 << 10,
                        4 => 40 << 10,
                        5 => 2048,
                        _ => 6000,
                    };
                    match a.allocate(size, Stream::LEGACY) {
                        Ok(p) => held.push(Held::taken(&sim, &live, p, size, Stream::LEGACY, &mut tagn)),
                        Err(Error::OutOfMemory { .. }) => {
                            ooms.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("{e}"),
                    }
                } else {
                    let k = (rng(&mut x) as usize) % held.len();
                    let h = held.swap_remove(k);
                    let mine = if rng(&mut x).is_multiple_of(3) {
                        match tx.try_send(h) {
                            Ok(()) => None,
                            Err(std::sync::mpsc::TrySendError::Full(h)) => Some(h),
                            Err(e) => panic!("{e}"),
                        }
                    } else {
                        Some(h)
                    };
                    if let Some(h) = mine {
                        check(&sim, h.p, h.size, h.t, Stream::LEGACY);
                        live.remove(h.p);
                        a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
                    }
                }
                if held.len() > 48 {
                    for h in held.drain(..24) {
                        live.remove(h.p);
                        a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
                    }
                }
                if step % 300 == 299 {
                    a.flush().unwrap();
                    a.trim(false).unwrap();
                }
            }
            for h in held {
                check(&sim, h.p, h.size, h.t, Stream::LEGACY);
                live.remove(h.p);
                a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
            }
            drop(tx);
            // What the other thread still sends.
            for h in rx.iter() {
                live.remove(h.p);
                a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
            }
            a.release_thread().unwrap();
        })
    };
    let t0 = run(0, tx1, rx0);
    let t1 = run(1, tx0, rx1);
    t0.join().unwrap();
    t1.join().unwrap();
    live.assert_clean();
    assert!(ooms.load(Ordering::Relaxed) < 100, "{} out-of-memory errors", ooms.load(Ordering::Relaxed));
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// 2. Size classes from the table.

/// The bytes a block of `size` occupies, computed here without the allocator's table: small
/// requests rounded to their class (every granule up to 8, then 8 classes per power of two),
/// large ones to the granule.
fn expected_block(size: usize, small_max: usize) -> usize {
    let g = size.div_ceil(256);
    if size > small_max || g <= 8 {
        return g * 256;
    }
    let k = (usize::BITS - 1 - g.leading_zeros()) - 3;
    g.next_multiple_of(1 << k) * 256
}

/// Around every class boundary up to 64 MiB (the class size, one byte more, one less) on the
/// per-thread, legacy and a user stream: live bytes are exactly the independently rounded
/// size, the block is aligned, a free with a size of another class is refused as a mismatch,
/// and the free with its own size passes.
#[test]
fn class_boundaries_round_as_the_arithmetic_on_every_arena_stream() {
    let sim = roomy();
    let small_max = 64 << 10;
    let a = alloc_with(&sim, Config::builder().small_max(small_max).superblock(256 << 10).chunk(32 << 20));
    let us = sim.create_stream();
    let mut classes = Vec::new();
    let mut g = 1usize;
    while g <= 1 << 18 {
        classes.push(g);
        let k = if g < 8 { 0 } else { (usize::BITS - 1 - g.leading_zeros()) - 3 };
        g += 1 << k;
    }
    assert_eq!(classes.len(), 128, "128 classes up to 64 MiB");
    let mut bad = 0;
    for (i, &cg) in classes.iter().enumerate() {
        let bytes = cg * 256;
        let sizes: Vec<usize> =
            [bytes - 1, bytes, bytes + 1].into_iter().filter(|&s| s <= 64 << 20).collect();
        // Big ones on one stream only (time and memory), small ones on all three.
        let streams: &[Stream] =
            if bytes > (4 << 20) { &[Stream::LEGACY] } else { &[Stream::PER_THREAD, Stream::LEGACY, us] };
        for &s in streams {
            for &size in &sizes {
                let before = a.stats().live_bytes;
                let p = a.allocate(size, s).unwrap();
                assert_eq!(p.0 % 256, 0);
                let got = a.stats().live_bytes - before;
                assert_eq!(got as usize, expected_block(size, small_max), "class {i}, size {size} on {s:?}");
                // A size of the next class (or granule) is refused and changes nothing.
                let other = expected_block(size, small_max) + 1;
                if other <= 64 << 20 && expected_block(other, small_max) != expected_block(size, small_max) {
                    let r = a.deallocate(p, other, s);
                    assert!(is_invalid(&r), "class {i}, size {size} freed as {other}: {r:?}");
                    bad += 1;
                }
                a.deallocate(p, size, s).unwrap();
            }
        }
    }
    a.flush().unwrap();
    sim.destroy_stream(us).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

// ---------------------------------------------------------------------------------------------
// 3. The user-stream allocation fast path and `Slot::asked`.

/// A block of stream 1's arena is used on stream 1 (a long hold) and freed there (into the
/// cache). Stream 1 is destroyed and the next stream gets its handle. An allocation on that
/// handle finds no arena for the new identity (the fast path's miss, its question handed to
/// the slow path) and must not get stream 1's block, whose use is still running; the free of
/// the new block on its stream is not a cross-stream free (it is in the new stream's arena).
/// Done twice: once with the fast path's identity query failing (the slow path must ask
/// again, not use an answer left from stream 1's last allocation on the same handle), once
/// without.
#[test]
fn a_handle_reused_by_a_new_stream_gets_a_new_arena_after_the_fast_paths_miss() {
    let sim = host(0);
    let log = Arc::new(KeyLog::default());
    let a = Allocator::new(counted_device(&sim, &log), small().build().unwrap()).unwrap();
    let s1 = sim.create_stream();
    let warm = a.allocate(KIB4, s1).unwrap(); // the slot and s1's arena
    let p = a.allocate(KIB4, s1).unwrap(); // the fast path
    let gate = sim.gate(s1).unwrap();
    sim.write_tag(p.0, KIB4, 77, s1).unwrap(); // stays in flight behind the gate
    a.deallocate(p, KIB4, s1).unwrap(); // own free on s1: into s1's cache, no event
    a.deallocate(warm, KIB4, s1).unwrap();
    sim.destroy_stream(s1).unwrap();
    let s2 = sim.create_stream();
    assert_eq!(s2.as_raw(), s1.as_raw(), "the simulator reuses the handle");
    let cross = a.stats().cross_stream_frees;
    let n = log.count(s2);
    log.fail.store(1, Ordering::SeqCst); // the fast path's query fails
    let q = a.allocate(KIB4, s2).unwrap();
    assert_eq!(log.count(s2) - n, 2, "the failed query, then the slow path's own");
    assert_ne!(q, p, "stream 1's block, still in use on stream 1, went to stream 2");
    assert_ne!(q, warm);
    sim.write_tag(q.0, KIB4, 78, s2).unwrap();
    let n = log.count(s2);
    let q2 = a.allocate(KIB4, s2).unwrap(); // now the fast path of s2's arena
    assert_eq!(log.count(s2) - n, 1, "one identity query");
    assert!(q2 != p && q2 != warm);
    a.deallocate(q, KIB4, s2).unwrap();
    a.deallocate(q2, KIB4, s2).unwrap();
    assert_eq!(a.stats().cross_stream_frees, cross, "the blocks were in stream 2's arena");
    gate.open();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    sim.destroy_stream(s2).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// An allocation on a user stream runs out of memory (a 2 MiB request under a 1 MiB cap: the
/// fast path asked the identity and handed it to the slow path). The OOM hook, first call:
/// destroys the stream and creates a new one with the same handle, and asks for a retry,
/// which must ask the handle's identity again (the stream it names changed; nothing in between
/// asked anything). Second call: allocates on another user stream (its fast and slow paths)
/// and asks for a retry, which asks again. Third call: gives up. An allocation after the call,
/// on the reused handle, asks once and lands in the new stream's arena.
#[test]
fn an_oom_retry_asks_afresh_after_a_hook_that_replaces_the_stream() {
    let sim = host(0);
    let log = Arc::new(KeyLog::default());
    let cfg = small().chunk(256 << 10).max_bytes(1 << 20).build().unwrap();
    let a = Allocator::new(counted_device(&sim, &log), cfg).unwrap();
    let s1 = sim.create_stream();
    let s_other = sim.create_stream();
    let warm = a.allocate(KIB4, s1).unwrap();
    a.deallocate(warm, KIB4, s1).unwrap();
    let replaced = Arc::new(Mutex::new(None::<Stream>));
    let hook_queries = Arc::new(AtomicU64::new(u64::MAX));
    let calls = Arc::new(AtomicU32::new(0));
    {
        let (a2, sim2, log2) = (a.clone(), sim.clone(), Arc::clone(&log));
        let (replaced, hook_queries, calls) =
            (Arc::clone(&replaced), Arc::clone(&hook_queries), Arc::clone(&calls));
        a.set_oom_hook(Some(Arc::new(move |_, _| match calls.fetch_add(1, Ordering::SeqCst) {
            0 => {
                sim2.destroy_stream(s1).unwrap();
                let s3 = sim2.create_stream();
                *replaced.lock().unwrap() = Some(s3);
                true
            }
            1 => {
                let n = log2.count(s_other);
                let x = a2.allocate(KIB4, s_other).unwrap(); // slow: a new arena
                let y = a2.allocate(KIB4, s_other).unwrap(); // fast
                hook_queries.store(log2.count(s_other) - n, Ordering::SeqCst);
                a2.deallocate(x, KIB4, s_other).unwrap();
                a2.deallocate(y, KIB4, s_other).unwrap();
                true
            }
            _ => false,
        })));
    }
    let n = log.count(s1);
    let r = a.allocate(2 << 20, s1);
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 3, "the hook ran three times");
    assert_eq!(hook_queries.load(Ordering::SeqCst), 2, "one query per allocation in the hook");
    let s3 = replaced.lock().unwrap().unwrap();
    assert_eq!(s3.as_raw(), s1.as_raw());
    assert_eq!(
        log.count(s1) - n,
        3,
        "the first try asks once, each of the two retries once more (the stream may have changed)"
    );
    a.set_oom_hook(None);
    let n = log.count(s3);
    let cross = a.stats().cross_stream_frees;
    let q = a.allocate(KIB4, s3).unwrap();
    assert_eq!(log.count(s3) - n, 1);
    a.deallocate(q, KIB4, s3).unwrap();
    assert_eq!(a.stats().cross_stream_frees, cross, "the block came from the new stream's arena");
    sim.destroy_stream(s3).unwrap();
    sim.destroy_stream(s_other).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Identity queries that fail: one failure on the fast path is asked again by the slow path
/// and the allocation succeeds; two failures return the error. The next allocation, on another
/// stream, is served by that stream's arena (nothing stale from the failed call), and so is the
/// next on the first stream.
#[test]
fn a_failed_identity_query_leaves_nothing_for_the_next_call() {
    let sim = host(0);
    let log = Arc::new(KeyLog::default());
    let a = Allocator::new(counted_device(&sim, &log), small().build().unwrap()).unwrap();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let mut held = vec![(a.allocate(KIB4, s1).unwrap(), s1), (a.allocate(KIB4, s2).unwrap(), s2)];
    // One failure: the fast path's; the slow path asks again.
    log.fail.store(1, Ordering::SeqCst);
    let n = log.count(s1);
    held.push((a.allocate(KIB4, s1).unwrap(), s1));
    assert_eq!(log.count(s1) - n, 2);
    // Served by the fast path (its answer for s1 must not outlive the call), then two
    // failures: the error is the call's.
    held.push((a.allocate(KIB4, s1).unwrap(), s1));
    log.fail.store(2, Ordering::SeqCst);
    let r = a.allocate(KIB4, s1);
    assert!(matches!(r, Err(Error::Driver { code: 999, .. })), "{r:?}");
    assert_eq!(log.fail.load(Ordering::SeqCst), 0);
    // A miss (64 KiB blocks until s1's arena grows) after which s2 is asked.
    for _ in 0..8 {
        held.push((a.allocate(64 << 10, s1).unwrap(), s1));
    }
    let cross = a.stats().cross_stream_frees;
    for s in [s2, s1, s2] {
        let n = log.count(s);
        held.push((a.allocate(KIB4, s).unwrap(), s));
        assert_eq!(log.count(s) - n, 1, "{s:?}");
    }
    for (p, s) in held {
        let size = if a.deallocate(p, KIB4, s).is_ok() { continue } else { 64 << 10 };
        a.deallocate(p, size, s).unwrap();
    }
    // The wrong-size tries above were refused (64 KiB blocks freed as 4 KiB first).
    let bad = a.stats().invalid_frees;
    assert_eq!(bad, 8);
    assert_eq!(a.stats().cross_stream_frees, cross, "every block was in its stream's arena");
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

/// With a trace running, allocations alternate between two user streams through the fast
/// path (fits), its misses (new arena, growth) and a reused handle. Each block is in its
/// stream's arena (no cross-stream free when freed there), and the trace records the identity
/// the handle had at each allocation (the reused handle's records carry the new identity).
#[test]
fn with_a_trace_running_user_allocations_land_in_their_streams_arena() {
    let sim = host(0);
    let dir = std::env::temp_dir().join(format!("cuarena-s12-trace-{}", std::process::id()));
    let a = alloc_with(&sim, small());
    a.start_trace(&dir).unwrap();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let (k1, k2) = (sim.stream_key(s1).unwrap(), sim.stream_key(s2).unwrap());
    let mut held = Vec::new();
    for i in 0..40 {
        let s = if i % 3 == 0 { s2 } else { s1 };
        let size = if i % 5 == 0 { 64 << 10 } else { KIB4 };
        held.push((a.allocate(size, s).unwrap(), size, s));
    }
    let cross = a.stats().cross_stream_frees;
    for (p, size, s) in held.drain(..) {
        a.deallocate(p, size, s).unwrap();
    }
    sim.destroy_stream(s1).unwrap();
    let s3 = sim.create_stream();
    assert_eq!(s3.as_raw(), s1.as_raw());
    let k3 = sim.stream_key(s3).unwrap();
    for _ in 0..10 {
        held.push((a.allocate(KIB4, s3).unwrap(), KIB4, s3));
    }
    for (p, size, s) in held.drain(..) {
        a.deallocate(p, size, s).unwrap();
    }
    assert_eq!(a.stats().cross_stream_frees, cross, "every block was in its stream's arena");
    a.stop_trace().unwrap();
    let recs = cuarena::trace::read(&dir).unwrap();
    let _ = std::fs::remove_file(&dir);
    let allocs: Vec<_> = recs.iter().filter(|r| r.action == cuarena::trace::Action::Alloc).collect();
    assert_eq!(allocs.len(), 50);
    let keys: Vec<u64> = allocs.iter().map(|r| r.stream.0).collect();
    for (i, k) in keys.iter().enumerate().take(40) {
        let want = if i % 3 == 0 { k2 } else { k1 };
        assert_eq!(*k, want.0, "record {i}");
    }
    assert!(keys[40..].iter().all(|k| *k == k3.0), "the reused handle's records carry its new identity");
    sim.destroy_stream(s2).unwrap();
    sim.destroy_stream(s3).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Pass-through mode: user-stream allocations never reach the arena paths (no fast path, no
/// `asked`): each goes to the driver on its stream; a reused handle is just another stream;
/// frees on the right stream pass, accounting is exact, the race checker is clean.
#[test]
fn passthrough_user_stream_allocations_bypass_the_fast_path() {
    let sim = host(0);
    let log = Arc::new(KeyLog::default());
    let a = Allocator::new(counted_device(&sim, &log), small().passthrough(true).build().unwrap()).unwrap();
    let s1 = sim.create_stream();
    let p = a.allocate(KIB4, s1).unwrap();
    sim.write_tag(p.0, KIB4, 5, s1).unwrap();
    a.deallocate(p, KIB4, s1).unwrap();
    sim.destroy_stream(s1).unwrap();
    let s2 = sim.create_stream();
    assert_eq!(s2.as_raw(), s1.as_raw());
    let mut v = Vec::new();
    for i in 0..20 {
        let size = 1000 + 777 * i;
        let q = a.allocate(size, s2).unwrap();
        sim.write_tag(q.0, 256, i as u32, s2).unwrap();
        v.push((q, size));
    }
    let want: u64 = v.iter().map(|&(_, n)| n as u64).sum();
    assert_eq!(a.stats().live_bytes, want, "pass-through counts the sizes asked for");
    for (q, n) in v {
        a.deallocate(q, n, s2).unwrap();
    }
    assert_eq!(a.stats().live_bytes, 0);
    assert_eq!(log.total(), 0, "pass-through allocations asked no identity");
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.stale_handle_calls(), 0);
    sim.destroy_stream(s2).unwrap();
}

/// A capture begun on a user stream: the fast path's identity query is refused, the slow path
/// asks again and returns `StreamCapturing`; nothing is kept for the next call, which (after
/// the capture) is served normally; no event ever touched the capturing stream.
#[test]
fn a_capturing_user_stream_is_refused_on_the_fast_path_and_nothing_is_kept() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let s = sim.create_stream();
    let p = a.allocate(KIB4, s).unwrap(); // the arena exists: the fast path would serve
    sim.begin_capture(s).unwrap();
    for _ in 0..3 {
        let r = a.allocate(KIB4, s);
        assert!(matches!(r, Err(Error::StreamCapturing { .. })), "{r:?}");
    }
    let other = sim.create_stream();
    let q = a.allocate(KIB4, other).unwrap(); // another stream meanwhile
    sim.end_capture(s).unwrap();
    let r = a.allocate(KIB4, s).unwrap();
    let cross = a.stats().cross_stream_frees;
    a.deallocate(r, KIB4, s).unwrap();
    a.deallocate(p, KIB4, s).unwrap();
    a.deallocate(q, KIB4, other).unwrap();
    assert_eq!(a.stats().cross_stream_frees, cross);
    sim.destroy_stream(s).unwrap();
    sim.destroy_stream(other).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// The owner is paused inside the fast path's identity query (its user arena not claimed), and
/// another thread runs `trim(true)`, which takes that arena (after a device synchronise) and
/// gives back its wholly free superblock, flushing its cache. The owner goes on: its
/// allocation must come from what the arena still holds or from a new superblock, never from a
/// cached block given back; no overlap with what the trimming thread takes meanwhile, no race.
#[test]
fn a_trim_while_the_owner_is_paused_in_the_fast_paths_identity_query() {
    let sim = host(0);
    let stall = Stall::new();
    let st2 = Arc::clone(&stall);
    let hook = move |sim: &HostDevice, s: Stream| {
        st2.here(s.is_user());
        sim.stream_key(s)
    };
    let dev = HookedDevice::new(sim.clone(), Hooks { stream_key: Some(Box::new(hook)), ..Hooks::default() });
    let a = Allocator::new(dev, small().build().unwrap()).unwrap();
    let s = sim.create_stream();
    let (a2, sim2, st3) = (a.clone(), sim.clone(), Arc::clone(&stall));
    let live = Arc::new(Live::default());
    let l2 = Arc::clone(&live);
    let owner = std::thread::spawn(move || {
        // Two superblocks: 64 KiB blocks (4 a superblock); one pinned, the rest freed on s
        // (cache and lists), all used on s first.
        let ps: Vec<_> = (0..8).map(|_| a2.allocate(64 << 10, s).unwrap()).collect();
        for (i, p) in ps.iter().enumerate() {
            sim2.hold_and_check(p.0, 64 << 10, 600 + i as u32, Duration::from_millis(2), s).unwrap();
        }
        let pin = ps[0];
        l2.insert(pin, 64 << 10);
        for p in &ps[1..] {
            a2.deallocate(*p, 64 << 10, s).unwrap();
        }
        for _ in 0..4 {
            let q = a2.allocate(KIB4, s).unwrap();
            a2.deallocate(q, KIB4, s).unwrap(); // into the cache
        }
        st3.arm();
        let q = a2.allocate(KIB4, s).unwrap(); // stops in the identity query
        l2.insert(q, KIB4);
        sim2.write_tag(q.0, KIB4, 1, s).unwrap();
        let more: Vec<_> = (0..6).map(|_| a2.allocate(64 << 10, s).unwrap()).collect();
        more.iter().for_each(|m| l2.insert(*m, 64 << 10));
        (pin, q, more)
    });
    stall.wait_stalled();
    let held0 = a.stats().arena_held_bytes;
    a.trim(true).unwrap();
    assert!(a.stats().arena_held_bytes < held0, "the trim took the paused owner's free superblock");
    // The trimming thread takes memory now, on its per-thread stream.
    let mine: Vec<_> = (0..8).map(|_| a.allocate_per_thread(64 << 10).unwrap()).collect();
    mine.iter().for_each(|m| live.insert(*m, 64 << 10));
    for m in &mine {
        sim.write_tag(m.0, 64 << 10, 2, Stream::PER_THREAD).unwrap();
    }
    stall.release();
    let (pin, q, more) = owner.join().unwrap();
    live.assert_clean();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.tag_errors(), 0);
    for m in mine {
        a.deallocate_per_thread(m, 64 << 10).unwrap();
    }
    // The owner's blocks, freed by this thread on s: remote frees on a user stream.
    a.deallocate(pin, 64 << 10, s).unwrap();
    a.deallocate(q, KIB4, s).unwrap();
    for m in more {
        a.deallocate(m, 64 << 10, s).unwrap();
    }
    a.flush().unwrap();
    sim.destroy_stream(s).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// Remote frees on user stream `u` wait in this thread's outbox. The thread also has arenas
/// with room for `u` and `v` (the fast path would serve both). Allocations on `v` do not count
/// towards `u`'s batch; the 256th allocation on `u` sends it under one event, and only it: a
/// batch on `v` begun meanwhile goes at its own 256th. The owner reuses the blocks after the
/// events, with no race.
#[test]
fn remote_user_batches_go_after_256_allocations_on_their_own_stream_only() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let sim2 = sim.clone();
    let (blocks, ready) = owner.run(move |a| {
        let v: Vec<_> = (0..6)
            .map(|_| {
                let p = a.allocate(8 << 10, Stream::PER_THREAD).unwrap();
                sim2.write_tag(p.0, 8 << 10, 3, Stream::PER_THREAD).unwrap();
                p
            })
            .collect();
        let e = sim2.create_event().unwrap();
        sim2.record_event(e, Stream::PER_THREAD).unwrap();
        (v, e)
    });
    let (u, v) = (sim.create_stream(), sim.create_stream());
    // This thread's arenas for u and v, with room.
    for s in [u, v] {
        let w = a.allocate(512, s).unwrap();
        a.deallocate(w, 512, s).unwrap();
    }
    sim.stream_wait_event(u, ready).unwrap();
    sim.stream_wait_event(v, ready).unwrap();
    for p in &blocks[..3] {
        sim.hold_and_check(p.0, 8 << 10, 3, Duration::from_millis(1), u).unwrap();
        a.deallocate(*p, 8 << 10, u).unwrap();
    }
    let fences = |a: &Allocator| a.stats().fences_recorded;
    let f0 = fences(&a);
    let mut mine = Vec::new();
    for _ in 0..300 {
        mine.push((a.allocate(512, v).unwrap(), v));
    }
    assert_eq!(fences(&a), f0, "allocations on v do not send u's batch");
    for p in &blocks[3..] {
        a.deallocate(*p, 8 << 10, v).unwrap(); // v's batch begins
    }
    for i in 1..=256 {
        mine.push((a.allocate(512, u).unwrap(), u));
        assert_eq!(fences(&a) - f0, u64::from(i == 256), "after {i} allocations on u");
    }
    for i in 1..=256 {
        mine.push((a.allocate(512, v).unwrap(), v));
        assert_eq!(fences(&a) - f0, 1 + u64::from(i == 256), "after {i} allocations on v");
    }
    // Nothing left in the outbox: the fast path again, and no more events.
    for _ in 0..300 {
        mine.push((a.allocate(512, u).unwrap(), u));
    }
    assert_eq!(fences(&a) - f0, 2);
    assert_eq!(a.parked_free_bytes(), 0);
    let sim3 = sim.clone();
    owner.run(move |a| {
        a.flush().unwrap();
        let v: Vec<_> = (0..6).map(|_| a.allocate(8 << 10, Stream::PER_THREAD).unwrap()).collect();
        for p in &v {
            sim3.write_tag(p.0, 8 << 10, 0xbeef, Stream::PER_THREAD).unwrap();
        }
        for p in v {
            a.deallocate(p, 8 << 10, Stream::PER_THREAD).unwrap();
        }
    });
    drop(owner);
    for (p, s) in mine {
        a.deallocate(p, 512, s).unwrap();
    }
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(v).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}
