//! Attacks on the fast paths of commit b66e424: allocations served by `allocate_fast`, frees
//! on the legacy stream through `Arena::free_legacy`, and frees of large blocks (over
//! `small_max`, up to `large_max`) through the fast path on both default streams.

use cuarena::{Allocator, Config, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::host;

/// `small_max` below the largest cached class (class 39, 128..136 granules = 32..34 KiB):
/// large blocks then have sizes that fall in cached classes.
fn low_small_max(sim: &HostDevice) -> Allocator {
    let cfg = Config::builder().small_max(16 << 10).large_max(1 << 20).superblock(256 << 10).chunk(1 << 20);
    host_allocator(sim.clone(), cfg.build().unwrap()).unwrap()
}

/// A large block that is not a whole size class (65 granules; its class floor is 64 granules)
/// freed on the per-thread stream must not be cached as a 64-granule block: a small request
/// of 64 granules would get it, and its own valid free would be refused.
#[test]
fn a_freed_large_block_is_not_handed_out_as_a_smaller_class() {
    let sim = host(0);
    let a = low_small_max(&sim);
    let large = (16 << 10) + 256; // 65 granules: large
    let small = 16 << 10; // 64 granules: small, class 31
    let p = a.allocate(large, Stream::PER_THREAD).unwrap();
    a.deallocate(p, large, Stream::PER_THREAD).unwrap();
    let q = a.allocate(small, Stream::PER_THREAD).unwrap();
    let s = a.stats();
    assert_eq!(s.live_bytes, small as u64, "{s:?}");
    a.deallocate(q, small, Stream::PER_THREAD).expect("a valid free of a small block");
    assert_all_returned(&a, Some(&sim), 0);
}

/// With `small_max` not a whole class (65 granules), the largest small request is rounded up
/// to 72 granules; a large request of 66 granules has the same class ceiling and must not be
/// handed the cached 72-granule block (its valid free would be refused as a size mismatch,
/// and 6 granules would be lost to the statistics).
#[test]
fn a_large_request_is_not_served_a_cached_small_block_of_another_size() {
    let sim = host(0);
    let small_max = (16 << 10) + 256; // 65 granules; small blocks of it occupy 72
    let cfg = Config::builder().small_max(small_max).large_max(1 << 20).superblock(256 << 10).chunk(1 << 20);
    let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
    for stream in [Stream::PER_THREAD, Stream::LEGACY] {
        let p = a.allocate(small_max, stream).unwrap();
        a.deallocate(p, small_max, stream).unwrap();
        let large = small_max + 256; // 66 granules: large
        let q = a.allocate(large, stream).unwrap();
        let s = a.stats();
        assert_eq!(s.live_bytes, large as u64, "{stream:?}: {s:?}");
        a.deallocate(q, large, stream).expect("a valid free of a large block");
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// The small configuration of the other adversarial tests with large blocks up to 128 KiB:
/// 4 KiB is small, 96 KiB large (from an arena), 200 KiB over `large_max` (from the pool).
fn three_paths(sim: &HostDevice, legacy_batch: usize) -> Allocator {
    let cfg = common::small().large_max(128 << 10).legacy_batch_blocks(legacy_batch);
    host_allocator(sim.clone(), cfg.build().unwrap()).unwrap()
}

const SIZES: [usize; 3] = [4 << 10, 96 << 10, 200 << 10];
const STREAMS: [Stream; 3] = [Stream::PER_THREAD, Stream::LEGACY, Stream::NULL];

fn refused(r: cuarena::Result<()>) -> InvalidFree {
    match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        r => panic!("not refused as an invalid free: {r:?}"),
    }
}

/// Invalid frees on the fast paths (per-thread and legacy stream, small, large and pool
/// blocks): wrong sizes, interior pointers, size 0, huge sizes and double frees on the same
/// stream, on the other default stream and from another thread are refused, counted once each
/// and change nothing; the block's own free then succeeds and the statistics stay exact.
#[test]
fn invalid_frees_on_the_fast_paths_are_refused_and_change_nothing() {
    let sim = host(0);
    let a = three_paths(&sim, 64); // legacy frees stay kept back throughout
    let mut bad = 0u64;
    for &size in &SIZES {
        for &stream in &STREAMS {
            let other = if stream.is_per_thread() { Stream::LEGACY } else { Stream::PER_THREAD };
            let p = a.allocate(size, stream).unwrap();
            let s0 = a.stats();
            assert_eq!(s0.live_bytes, size as u64, "all three sizes are whole classes or granules");
            let wrong = [
                (p, size + 4096),
                (p, size.saturating_sub(4096).max(1)),
                (p, 0),
                (p, usize::MAX),
                (p, 1 << 40),
                (cuarena::DeviceAddr(p.0 + 256), size - 256),
                (cuarena::DeviceAddr(p.0 + 256), size),
                (cuarena::DeviceAddr(p.0 + 1), size),
                (cuarena::DeviceAddr(0x10_0000), size),
            ];
            for (q, n) in wrong {
                for s in [stream, other] {
                    if s == other && q == p && n != size {
                        continue; // another stream's wrong size may be checked later (remote)
                    }
                    let r = a.deallocate(q, n, s);
                    if r.is_ok() {
                        panic!("{size} {stream:?}: free of {q:?} size {n} on {s:?} accepted");
                    }
                    bad += 1;
                }
            }
            let s1 = a.stats();
            assert_eq!(s1.invalid_frees, bad, "{size} {stream:?}: {s1:?}");
            assert_eq!(
                (s1.live_bytes, s1.deallocations),
                (s0.live_bytes, s0.deallocations),
                "{size} {stream:?}"
            );
            a.deallocate(p, size, stream).unwrap();
            // Double frees: same stream, the other default stream, another thread on each.
            assert_eq!(refused(a.deallocate(p, size, stream)), InvalidFree::DoubleFree, "{size} {stream:?}");
            assert_eq!(refused(a.deallocate(p, size, other)), InvalidFree::DoubleFree, "{size} {stream:?}");
            let a2 = a.clone();
            let r = std::thread::spawn(move || {
                let r = [a2.deallocate(p, size, stream), a2.deallocate(p, size, other)];
                a2.release_thread().unwrap();
                r
            })
            .join()
            .unwrap();
            for r in r {
                assert_eq!(refused(r), InvalidFree::DoubleFree, "{size} {stream:?}: another thread");
            }
            bad += 4;
            let s2 = a.stats();
            assert_eq!(s2.invalid_frees, bad, "{size} {stream:?}: {s2:?}");
            assert_eq!(s2.live_bytes, 0, "{size} {stream:?}: {s2:?}");
            assert_eq!(s2.deallocations, s0.deallocations + 1, "{size} {stream:?}: {s2:?}");
        }
    }
    assert!(a.take_deferred_error().is_none());
    assert_all_returned(&a, Some(&sim), bad);
}

fn trace_file(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cuarena-s8-{}-{name}.bin", std::process::id()))
}

/// While a trace runs, every allocation (served by the fast path or by the slow path: a cache
/// hit, an arena that must grow, a large block, a pool block, the OOM hook's retry) and every
/// free (fast per-thread, fast legacy kept back, slow, refused) is recorded exactly once, in
/// the order made, with its path; a size 0 request and a NULL free record nothing.
#[test]
fn a_trace_records_fast_and_slow_calls_exactly_once() {
    use cuarena::trace::{self, Action, TracePath};
    let sim = host(0);
    let cfg = common::small().large_max(128 << 10).legacy_batch_blocks(3).max_bytes(4 << 20);
    let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
    // A block from before the trace: its free is the trace's first record.
    let before = a.allocate(4096, Stream::PER_THREAD).unwrap();
    let file = trace_file("exact");
    a.start_trace(&file).unwrap();
    let mut want: Vec<(Action, u64, usize, TracePath)> = Vec::new();
    a.deallocate(before, 4096, Stream::PER_THREAD).unwrap();
    want.push((Action::Free, before.0, 4096, TracePath::Arena));
    let user = sim.create_stream();
    let mut held = Vec::new();
    for round in 0..4 {
        for &stream in &[Stream::PER_THREAD, Stream::LEGACY, Stream::NULL, user] {
            for &size in &SIZES {
                let p = a.allocate(size, stream).unwrap();
                let path = match size {
                    s if s <= 64 << 10 => TracePath::Arena,
                    s if s <= 128 << 10 => TracePath::LargeArena,
                    _ => TracePath::Pool,
                };
                want.push((Action::Alloc, p.0, size, path));
                held.push((p, size, stream, path));
            }
            assert_eq!(a.allocate(0, stream).unwrap(), cuarena::DeviceAddr::NULL);
            a.deallocate(cuarena::DeviceAddr::NULL, 0, stream).unwrap();
        }
        // Free half now (the rest next round, so the cache and kept-back frees are reused).
        let keep = held.split_off(held.len() / 2);
        for (p, size, stream, path) in held {
            a.deallocate(p, size, stream).unwrap();
            want.push((Action::Free, p.0, size, path));
            let r = a.deallocate(p, size, stream);
            assert!(r.is_err(), "round {round}: double free accepted");
            want.push((Action::RefusedFree, p.0, size, TracePath::None));
        }
        held = keep;
    }
    // The OOM hook: the limit is reached, the hook frees the held blocks, the retry succeeds.
    let hold = std::sync::Arc::new(std::sync::Mutex::new(held));
    let mut filler = Vec::new();
    loop {
        match a.allocate(64 << 10, Stream::PER_THREAD) {
            Ok(p) => {
                want.push((Action::Alloc, p.0, 64 << 10, TracePath::Arena));
                filler.push(p);
            }
            Err(Error::OutOfMemory { .. }) => {
                want.push((Action::FailedAlloc, 0, 64 << 10, TracePath::None));
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let (a2, hold2) = (a.clone(), hold.clone());
    let freed_by_hook = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let f2 = freed_by_hook.clone();
    a.set_oom_hook(Some(std::sync::Arc::new(move |_, _| {
        let mut h = hold2.lock().unwrap();
        let mut f = f2.lock().unwrap();
        for (p, size, stream, path) in h.drain(..) {
            a2.deallocate(p, size, stream).unwrap();
            f.push((Action::Free, p.0, size, path));
        }
        true
    })));
    for p in filler.drain(..) {
        a.deallocate(p, 64 << 10, Stream::PER_THREAD).unwrap();
        want.push((Action::Free, p.0, 64 << 10, TracePath::Arena));
    }
    // Memory is back in this thread's arena: this allocation takes the fast path, no hook.
    let p = a.allocate(64 << 10, Stream::PER_THREAD).unwrap();
    want.push((Action::Alloc, p.0, 64 << 10, TracePath::Arena));
    // Over the limit at once: the hook runs, frees what is held (recorded inside), the retry
    // fails or succeeds; either way one record for the allocation, after the hook's frees.
    let big = 8 << 20;
    let r = a.allocate(big, Stream::PER_THREAD);
    want.extend(freed_by_hook.lock().unwrap().drain(..));
    assert!(r.is_err(), "8 MiB over a 4 MiB limit");
    want.push((Action::FailedAlloc, 0, big, TracePath::None));
    a.deallocate(p, 64 << 10, Stream::PER_THREAD).unwrap();
    want.push((Action::Free, p.0, 64 << 10, TracePath::Arena));
    a.set_oom_hook(None);
    a.stop_trace().unwrap();
    let recs = trace::read(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    let got: Vec<(Action, u64, usize, TracePath)> =
        recs.iter().map(|r| (r.action, r.ptr, r.size as usize, r.path)).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        // A live block's superblock may have been dissolved (given back with its live blocks
        // by the return rule): its free is then the pool's. Near the limit an arena that cannot
        // grow is served by the pool.
        let pool = g.3 == TracePath::Pool && w.3 != TracePath::None && (g.0, g.1, g.2) == (w.0, w.1, w.2);
        assert!(g == w || pool, "record {i}: {g:?}, want {w:?}");
    }
    assert_eq!(got.len(), want.len(), "records lost or doubled");
    let s = a.stats();
    // The hook asks for a retry each time: called as often as retries are allowed.
    assert_eq!(s.oom_hook_calls, cuarena::MAX_OOM_RETRIES as u64, "{s:?}");
    let refused = want.iter().filter(|w| w.0 == Action::RefusedFree).count() as u64;
    sim.destroy_stream(user).unwrap();
    assert_all_returned(&a, Some(&sim), refused);
}

/// A large block (over `small_max`) used on thread B's per-thread stream (a write held back by
/// a gate), then freed by its owner on the legacy stream, which is now the fast path: it must
/// be kept back until a legacy action, so that its reuse on the owner's per-thread stream is
/// ordered after B's write. Taking it back at once (`free_local` on the legacy stream) lets
/// the race checker see the reuse overlap B's write.
#[test]
fn a_large_block_freed_on_the_legacy_stream_is_reused_only_after_its_use_elsewhere() {
    for (size, batch) in [(96 << 10, 1), (96 << 10, 2), (4 << 10, 1)] {
        let sim = host(0);
        let a = three_paths(&sim, batch);
        let p = a.allocate(size, Stream::LEGACY).unwrap();
        let fill: Vec<_> = (1..batch).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
        let (gate_tx, gate_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let (a2, sim2) = (a.clone(), sim.clone());
        let b = std::thread::spawn(move || {
            let gate = sim2.gate(Stream::PER_THREAD).unwrap();
            sim2.fill(p.0, size, 7, Stream::PER_THREAD).unwrap(); // waits behind the gate
            gate_tx.send(gate).unwrap();
            done_rx.recv().unwrap();
            a2.release_thread().unwrap();
        });
        let gate = gate_rx.recv().unwrap();
        let s0 = a.stats();
        a.deallocate(p, size, Stream::LEGACY).unwrap();
        for q in &fill {
            a.deallocate(*q, size, Stream::LEGACY).unwrap();
        }
        let s1 = a.stats();
        assert_eq!(s1.live_bytes, 0, "{s1:?}");
        assert_eq!(s1.deallocations - s0.deallocations, batch as u64);
        let again: Vec<_> = (0..batch).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
        assert!(again.contains(&p), "{size} batch {batch}: the block is reused after its batch");
        for q in &again {
            sim.fill(q.0, size, 1, Stream::PER_THREAD).unwrap();
        }
        gate.open();
        sim.synchronize();
        let v = sim.violations();
        assert!(v.is_empty(), "{size} batch {batch}: reused before its use elsewhere ended: {v:?}");
        done_tx.send(()).unwrap();
        b.join().unwrap();
        for q in again {
            a.deallocate(q, size, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Kept-back legacy frees of small and large blocks at thread exit, and across a `trim` from
/// another thread: all memory comes back, and a second free of a kept-back block, from the
/// owner before its exit or from another thread after it, is refused.
#[test]
fn kept_back_legacy_frees_survive_trim_and_exit_and_refuse_a_second_free() {
    let sim = host(0);
    let a = three_paths(&sim, 64);
    let (a2, sim2) = (a.clone(), sim.clone());
    let freed = std::thread::spawn(move || {
        let mut freed = Vec::new();
        for round in 0..3 {
            for &size in &SIZES {
                let p = a2.allocate(size, Stream::LEGACY).unwrap();
                sim2.fill(p.0, size, round as u8, Stream::LEGACY).unwrap();
                a2.deallocate(p, size, Stream::LEGACY).unwrap();
                assert_eq!(refused(a2.deallocate(p, size, Stream::LEGACY)), InvalidFree::DoubleFree);
                assert_eq!(refused(a2.deallocate(p, size, Stream::PER_THREAD)), InvalidFree::DoubleFree);
                freed.push((p, size));
            }
            // Another thread reclaims (this one is between calls: its arena is idle).
            let a3 = a2.clone();
            std::thread::spawn(move || {
                a3.trim(false).unwrap();
                a3.release_thread().unwrap();
            })
            .join()
            .unwrap();
        }
        freed // the thread exits with its kept-back frees
    })
    .join()
    .unwrap();
    let mut bad = 3 * 3 * 2;
    for (p, size) in freed {
        for s in [Stream::LEGACY, Stream::PER_THREAD] {
            assert!(a.deallocate(p, size, s).is_err(), "a second free of {p:?} after the exit accepted");
            bad += 1;
        }
    }
    let s = a.stats();
    assert_eq!((s.live_bytes, s.invalid_frees), (0, bad), "{s:?}");
    assert_all_returned(&a, Some(&sim), bad);
}
