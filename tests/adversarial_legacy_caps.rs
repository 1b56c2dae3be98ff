//! Adversarial pass on the legacy keep-back caps (`legacy_batch` = 256 blocks, `legacy_batch_bytes`
//! = 64 MiB by default, were the remote batch's 64 / 4 MiB): a thread's own frees on the legacy
//! stream are kept back in its legacy arena (`Arena::free_legacy`) until one legacy action. With
//! the larger caps much more memory can be kept back, so these tests lean on what must then
//! hold: kept-back memory is never stranded (out of memory on another thread or on the owner's
//! other arena, `trim`, `release_thread`, thread exit, `flush` all take it), its reuse is
//! ordered after its earlier uses on another thread's per-thread stream (the race checker; each
//! fencing test fails with `skip_fences_for_testing`), bad frees of kept-back blocks are refused
//! and change nothing, and `live_bytes` is exact while frees are kept back.

use std::sync::mpsc;

use cuarena::{Allocator, Config, ConfigBuilder, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

const MIB: usize = 1 << 20;

/// The configuration, with fences skipped where `skip` (to show a fencing test can fail).
fn build(b: ConfigBuilder, skip: bool) -> Config {
    if skip { b.skip_fences_for_testing().build().unwrap() } else { b.build().unwrap() }
}

/// Races and tag errors seen by the simulator, after the device is idle.
fn races(sim: &HostDevice) -> (Vec<String>, u64) {
    sim.synchronize();
    (sim.violations(), sim.tag_errors())
}

// ---------------------------------------------------------------------------------------------
// Out of memory with kept-back frees in superblocks that also hold used blocks.

/// A large superblock (8 MiB, for 2 MiB requests) full of the owner's legacy blocks: the first
/// two (4 MiB, adjacent) freed on the legacy stream and kept back, the last two still in use.
/// The owner then idles. Another thread needs 4 MiB under a cap of 8 MiB: only the kept-back
/// frees can give it. Out of memory must take them (the reclaim dissolves superblocks "with
/// free or pending space", and the kept-back blocks are pending), ordered after their uses on
/// a third thread's per-thread stream.
/// With `same_thread`, the owner itself needs the 4 MiB on its per-thread stream (another arena
/// of its own: the legacy arena's slow path, which releases kept-back frees, does not run).
fn oom_takes_kept_back_frees_from_a_full_superblock(
    skip: bool,
    same_thread: bool,
) -> (bool, Vec<String>, u64) {
    let sim = host(0);
    let cfg = build(Config::builder().max_bytes(8 * MIB).chunk(8 * MIB), skip);
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let owner = Worker::new(&a);
    let sim2 = sim.clone();
    let live: Vec<DeviceAddr> = owner.run(move |a| {
        let ps: Vec<_> = (0..4).map(|_| a.allocate(2 * MIB, Stream::LEGACY).unwrap()).collect();
        let mut sorted = ps.clone();
        sorted.sort();
        assert_eq!(sorted[3].0 - sorted[0].0, 6 * MIB as u64, "one 8 MiB superblock: {ps:?}");
        // With fences skipped (the control), the uses last long enough that the reuse below is
        // submitted while they run, even on a loaded machine (an out-of-memory reclaim lies
        // between).
        let hold_ms = if skip { 200 } else { 40 };
        use_on_another_thread(&sim2, &[(sorted[0], 2 * MIB), (sorted[1], 2 * MIB)], 100, hold_ms);
        a.deallocate(sorted[0], 2 * MIB, Stream::LEGACY).unwrap();
        a.deallocate(sorted[1], 2 * MIB, Stream::LEGACY).unwrap();
        sorted[2..].to_vec()
    });
    assert_eq!(a.stats().reserved_bytes as usize, 8 * MIB);
    assert_eq!(a.stats().live_bytes as usize, 4 * MIB, "kept-back frees are not live");
    // The owner is idle, holding 4 MiB kept back (or needs them itself).
    let need = move |a: &Allocator, sim: &HostDevice| {
        let got = a.allocate_per_thread(4 * MIB);
        if let Ok(p) = got {
            sim.fill(p.0, 4 * MIB, 0xee, Stream::PER_THREAD).unwrap();
        }
        let r = races(sim);
        if let Ok(p) = got {
            a.deallocate_per_thread(p, 4 * MIB).unwrap();
        }
        (got.is_ok(), r)
    };
    let (ok, (v, t)) = if same_thread {
        let sim2 = sim.clone();
        owner.run(move |a| need(a, &sim2))
    } else {
        need(&a, &sim)
    };
    owner.run(move |a| {
        for p in live {
            a.deallocate(p, 2 * MIB, Stream::LEGACY).unwrap();
        }
    });
    owner.exit();
    if !skip {
        assert_all_returned(&a, Some(&sim), 0);
    }
    (ok, v, t)
}

#[test]
fn oom_on_another_thread_takes_kept_back_frees_from_a_superblock_with_used_blocks() {
    let (ok, v, t) = oom_takes_kept_back_frees_from_a_full_superblock(false, false);
    assert!(ok, "out of memory while 4 MiB were only kept back by an idle thread");
    assert!(v.is_empty(), "{v:?}");
    assert_eq!(t, 0);
}

#[test]
fn oom_on_the_owners_per_thread_stream_takes_its_own_kept_back_frees_from_a_superblock_with_used_blocks() {
    let (ok, v, t) = oom_takes_kept_back_frees_from_a_full_superblock(false, true);
    assert!(ok, "out of memory while 4 MiB were only kept back in the thread's own legacy arena");
    assert!(v.is_empty(), "{v:?}");
    assert_eq!(t, 0);
}

// ---------------------------------------------------------------------------------------------
// Many threads keep back large frees up to the caps; one thread then needs the whole cap.

/// How the kept-back frees of the idle threads are to come back before the needy thread asks.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Back {
    /// Not at all: the owners idle, and out of memory on the needy thread takes them.
    Oom,
    /// `trim(false)` on the main thread, with the owners idle.
    Trim,
    /// Each owner calls `release_thread` and idles.
    Release,
    /// Each owner exits.
    Exit,
    /// Each owner calls `flush` (one legacy action) and idles: out of memory takes the rest.
    Flush,
}

const THREADS: usize = 8;
/// Each owner's blocks: three of 4 MiB on the legacy stream, in one 16 MiB large superblock.
const EACH: usize = 3;
const BLOCK: usize = 4 * MIB;
const LARGE_SB: usize = 16 * MIB;

/// The odd cap settings: the defaults, everything kept back (blocks and bytes past anything
/// the test frees), and a batch of one block or one byte (every free is its own action).
fn cap_settings() -> Vec<(&'static str, ConfigBuilder)> {
    vec![
        ("defaults", Config::builder()),
        ("keep everything", Config::builder().legacy_batch_blocks(65536).legacy_batch_bytes(usize::MAX)),
        ("legacy_batch=1", Config::builder().legacy_batch_blocks(1)),
        ("legacy_batch_bytes=1B", Config::builder().legacy_batch_bytes(1)),
    ]
}

/// `THREADS` owners each allocate `EACH` large blocks on the legacy stream (one large
/// superblock each, filling the cap between them), have them used on another thread's
/// per-thread stream, and free them on the legacy stream (kept back under the default caps);
/// then `back`; then the main thread allocates the whole cap as 16 MiB blocks on its per-thread
/// stream and overwrites them at once. Returns the allocations that failed, the races and the
/// tag errors.
fn many_keep_back_then_one_needs_the_cap(
    cfg: ConfigBuilder,
    back: Back,
    skip: bool,
) -> (usize, Vec<String>, u64) {
    let sim = host(0);
    // One chunk: the owners' superblocks, and one normal superblock of the main thread's that
    // a small block pins, so that the chunk never becomes wholly free. (A wholly free chunk
    // would be trimmed on the way, and the trim records its lazy legacy fence, which orders
    // the reuse even with fences skipped: the test could not fail.)
    let cap = THREADS * LARGE_SB + 2 * MIB;
    let a = host_allocator(sim.clone(), build(cfg.max_bytes(cap).chunk(cap), skip)).unwrap();
    let pin = a.allocate_per_thread(4096).unwrap();
    let (done_tx, done) = mpsc::channel::<()>();
    let mut go = Vec::new();
    // All allocate before any gives memory back, so that the owners fill the cap.
    let allocated = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
    let owners: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a2, sim2, done_tx, allocated) = (a.clone(), sim.clone(), done_tx.clone(), allocated.clone());
            let (go_tx, go_rx) = mpsc::channel::<()>();
            go.push(go_tx);
            std::thread::spawn(move || {
                let ps: Vec<_> = (0..EACH).map(|_| a2.allocate(BLOCK, Stream::LEGACY).unwrap()).collect();
                allocated.wait();
                // The head of each block (the reuse below writes every MiB's head).
                let uses: Vec<_> = ps.iter().map(|&p| (p, 64 << 10)).collect();
                // With fences skipped (the control) the uses last longer, so that the main
                // thread's writes still meet them on a loaded machine: at 15 ms, CI on two
                // cores once saw no race after the owners' exit.
                use_on_another_thread(&sim2, &uses, (t * EACH) as u32, if skip { 200 } else { 15 });
                for p in ps {
                    a2.deallocate(p, BLOCK, Stream::LEGACY).unwrap();
                }
                match back {
                    Back::Release => a2.release_thread().unwrap(),
                    Back::Flush => a2.flush().unwrap(),
                    _ => {}
                }
                done_tx.send(()).unwrap();
                go_rx.recv().unwrap(); // idle, alive
                if back != Back::Exit {
                    a2.release_thread().unwrap();
                } // else thread exit gives the arenas back
            })
        })
        .collect();
    for _ in 0..THREADS {
        done.recv().unwrap();
    }
    let s = a.stats();
    assert_eq!(s.peak_reserved_bytes as usize, cap, "{back:?}: the owners fill the cap: {s:?}");
    assert_eq!(s.live_bytes, 4096, "{back:?}: kept-back frees are not live: {s:?}");
    let mut owners = Some(owners);
    let finish = |owners: Vec<std::thread::JoinHandle<()>>, go: &mut Vec<mpsc::Sender<()>>| {
        go.drain(..).for_each(|g| g.send(()).unwrap());
        owners.into_iter().for_each(|h| h.join().unwrap());
    };
    match back {
        Back::Exit => finish(owners.take().unwrap(), &mut go),
        Back::Trim => {
            a.trim(false).unwrap();
        }
        _ => {}
    }
    let mut got = Vec::new();
    let mut failed = 0;
    for i in 0..THREADS * LARGE_SB / LARGE_SB {
        match a.allocate_per_thread(LARGE_SB) {
            Ok(p) => {
                for off in (0..LARGE_SB).step_by(MIB) {
                    sim.write_tag(p.0 + off as u64, 64 << 10, 5000 + i as u32, Stream::PER_THREAD).unwrap();
                }
                got.push(p);
            }
            Err(Error::OutOfMemory { .. }) => failed += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    let (v, t) = races(&sim);
    for p in got {
        a.deallocate_per_thread(p, LARGE_SB).unwrap();
    }
    a.deallocate_per_thread(pin, 4096).unwrap();
    if let Some(o) = owners.take() {
        finish(o, &mut go);
    }
    if !skip {
        assert_all_returned(&a, Some(&sim), 0);
    }
    (failed, v, t)
}

#[test]
fn eight_threads_keep_back_large_frees_and_one_thread_then_takes_the_whole_cap() {
    for (name, cfg) in cap_settings() {
        for back in [Back::Oom, Back::Trim, Back::Release, Back::Exit, Back::Flush] {
            let (failed, v, t) = many_keep_back_then_one_needs_the_cap(cfg.clone(), back, false);
            assert_eq!(failed, 0, "{name}, {back:?}: out of memory while the memory was only kept back");
            assert!(v.is_empty(), "{name}, {back:?}: reuse not ordered after the earlier uses: {v:?}");
            assert_eq!(t, 0, "{name}, {back:?}: a block was overwritten under its earlier use");
        }
    }
}

/// The two fencing tests above can fail: with fences skipped, the reuse overlaps the earlier
/// uses on another thread's per-thread stream.
#[test]
fn with_fences_skipped_the_fencing_tests_above_see_races() {
    for same_thread in [false, true] {
        let (ok, v, _) = oom_takes_kept_back_frees_from_a_full_superblock(true, same_thread);
        assert!(ok && !v.is_empty(), "same thread {same_thread}: no race seen with fences skipped");
    }
    for back in [Back::Oom, Back::Exit] {
        let (failed, v, _) = many_keep_back_then_one_needs_the_cap(Config::builder(), back, true);
        assert!(failed == 0 && !v.is_empty(), "{back:?}: no race seen with fences skipped");
    }
}

// ---------------------------------------------------------------------------------------------
// Bad frees of kept-back blocks, and `live_bytes` while frees are kept back.

/// Every bad free of a kept-back block (small and large), by its owner and by another thread,
/// on the legacy, the per-thread and a user stream: a second free, a wrong size, an interior
/// pointer, size 0. Refused (at once, or, for another thread's interior pointer, which only
/// the owner can check, when it arrives), and nothing changes: `live_bytes` stays exact, the
/// kept-back blocks are reused once each after their batch, no overlap, all memory back.
#[test]
fn bad_frees_of_kept_back_blocks_are_refused_and_change_nothing() {
    for (name, cfg) in cap_settings() {
        let sim = host(0);
        let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
        let user = sim.create_stream();
        let sizes = [3000usize, 200 << 10, 3 * MIB, 24 * MIB];
        let owner = Worker::new(&a);
        let sizes2 = sizes;
        // The owner: one kept-back block of each size, and one live block of each.
        let (kept, live): (Vec<DeviceAddr>, Vec<DeviceAddr>) = owner.run(move |a| {
            let kept: Vec<_> = sizes2.iter().map(|&n| a.allocate(n, Stream::LEGACY).unwrap()).collect();
            let live: Vec<_> = sizes2.iter().map(|&n| a.allocate(n, Stream::LEGACY).unwrap()).collect();
            for (p, n) in kept.iter().zip(sizes2) {
                a.deallocate(*p, n, Stream::LEGACY).unwrap();
            }
            (kept, live)
        });
        let live_bytes = a.stats().live_bytes;
        let streams = [Stream::LEGACY, Stream::PER_THREAD, user];
        // Bad frees refused at once: (pointer, size), on every stream, by both threads.
        let mut bad: Vec<(DeviceAddr, usize)> = Vec::new();
        for (p, n) in kept.iter().zip(sizes) {
            bad.push((*p, n)); // a second free
            bad.push((*p, n + 4096)); // a second free, wrong size
            bad.push((*p, 0));
            bad.push((*p, usize::MAX));
        }
        let mut refused = 0u64;
        let (bad2, kept2) = (bad.clone(), kept.clone());
        refused += owner.run(move |a| {
            let mut n = 0;
            for &(p, size) in &bad2 {
                for s in streams {
                    assert!(is_invalid(&a.deallocate(p, size, s)), "owner {p:?} {size} on {s:?}");
                    n += 1;
                }
            }
            // The owner's interior pointers are checked at once too.
            for (p, size) in kept2.iter().zip(sizes) {
                for s in streams {
                    let r = a.deallocate(DeviceAddr(p.0 + 512), size - 512, s);
                    assert!(is_invalid(&r), "owner interior {p:?} on {s:?}: {r:?}");
                    n += 1;
                }
            }
            n
        });
        refused += on_thread(&a, move |a| {
            let mut n = 0;
            for &(p, size) in &bad {
                for s in streams {
                    assert!(is_invalid(&a.deallocate(p, size, s)), "other {p:?} {size} on {s:?}");
                    n += 1;
                }
            }
            n
        });
        let s = a.stats();
        assert_eq!(s.live_bytes, live_bytes, "{name}: bad frees changed live bytes: {s:?}");
        assert_eq!(s.invalid_frees, refused, "{name}: {s:?}");
        // Another thread's interior pointer of a kept-back block: only the owner can check it.
        let interior = DeviceAddr(kept[3].0 + (1 << 20));
        let r = on_thread(&a, move |a| a.deallocate(interior, 4096, Stream::LEGACY));
        let late = u64::from(r.is_ok());
        assert!(r.is_ok() || is_invalid(&r), "{r:?}");
        // The owner flushes (the bad free arrives and is refused), reuses the kept-back blocks
        // once each (no overlap with its live blocks), and frees everything.
        let live2 = live.clone();
        owner.run(move |a| {
            a.flush().unwrap();
            let map = Live::default();
            for (p, n) in live2.iter().zip(sizes) {
                map.insert(*p, n);
            }
            let again: Vec<_> = sizes.iter().map(|&n| a.allocate(n, Stream::LEGACY).unwrap()).collect();
            for (p, n) in again.iter().zip(sizes) {
                map.insert(*p, n);
            }
            map.assert_clean();
            for (p, n) in again.iter().chain(&live2).zip(sizes.iter().chain(&sizes)) {
                a.deallocate(*p, *n, Stream::LEGACY).unwrap();
            }
            a.flush().unwrap();
        });
        owner.exit();
        let s = a.stats();
        assert_eq!(s.invalid_frees, refused + late, "{name}: the interior free refused on arrival: {s:?}");
        assert_eq!(s.live_bytes, 0, "{name}: {s:?}");
        sim.destroy_stream(user).unwrap();
        assert_all_returned(&a, Some(&sim), refused + late);
    }
}

/// `live_bytes` is exact at quiescent points while frees are kept back, for many threads under
/// each cap setting, and after they are released by a flush, `release_thread` and exit.
#[test]
fn live_bytes_are_exact_while_frees_are_kept_back() {
    for (name, cfg) in cap_settings() {
        let sim = host(0);
        let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
        let workers: Vec<Worker> = (0..THREADS).map(|_| Worker::new(&a)).collect();
        let mut expect = 0u64;
        let mut held = Vec::new();
        for (t, w) in workers.iter().enumerate() {
            // Sizes over both caps' ranges: many small blocks and a few large ones.
            let sizes: Vec<usize> = (0..300)
                .map(|i| if i % 50 == 7 { MIB + 1 + i * 4096 * (t + 1) } else { 256 + i * 64 })
                .collect();
            let (kept_live, h) = w.run(move |a| {
                let ps: Vec<_> = sizes.iter().map(|&n| (a.allocate(n, Stream::LEGACY).unwrap(), n)).collect();
                let (free, keep): (Vec<_>, Vec<_>) =
                    ps.into_iter().enumerate().partition(|(i, _)| i % 3 != 0);
                for (_, (p, n)) in free {
                    a.deallocate(p, n, Stream::LEGACY).unwrap();
                }
                let keep: Vec<_> = keep.into_iter().map(|(_, x)| x).collect();
                let bytes: u64 = keep.iter().map(|&(_, n)| cuarena_block(n)).sum();
                (bytes, keep)
            });
            expect += kept_live;
            held.push(h);
            assert_eq!(a.stats().live_bytes, expect, "{name}: after thread {t}");
        }
        // Flush on half the threads, release on a quarter, the rest exit after freeing all.
        for (t, (w, h)) in workers.into_iter().zip(held).enumerate() {
            let freed: u64 = h.iter().map(|&(_, n)| cuarena_block(n)).sum();
            w.run(move |a| {
                for (p, n) in h {
                    a.deallocate(p, n, Stream::LEGACY).unwrap();
                }
                match t % 4 {
                    0 | 1 => a.flush().unwrap(),
                    2 => a.release_thread().unwrap(),
                    _ => {}
                }
            });
            expect -= freed;
            assert_eq!(a.stats().live_bytes, expect, "{name}: after thread {t} freed all");
            w.exit();
            assert_eq!(a.stats().live_bytes, expect, "{name}: after thread {t} exited");
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// The bytes a block of `n` bytes takes, as `live_bytes` counts it (default `small_max`).
fn cuarena_block(n: usize) -> u64 {
    cuarena::size_class::block_bytes(n, 1 << 20).unwrap() as u64
}
