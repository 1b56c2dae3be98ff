//! Statistics users can trust (issue 11, item 3): live bytes exact at quiescent points, the
//! peak bounded from both sides (exact with `stats=exact`), resets of peaks and counters that
//! are safe while other threads allocate, the size histogram and per-path counts.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use common::{host, small};
use cuarena::size_class::block_bytes;
use cuarena::stats::{SIZE_HISTOGRAM_BUCKETS, size_bucket, size_bucket_limit};
use cuarena::{Allocator, Config, DeviceAddr, Stream};
use cuarena_testkit::host_allocator;

fn alloc(exact: bool) -> Allocator {
    host_allocator(host(0), small().exact_stats(exact).build().unwrap()).unwrap()
}

const SMALL: usize = 64 << 10; // small_max of `small()`

/// Bytes a block of `size` takes (size-class rounding).
fn bytes(size: usize) -> u64 {
    block_bytes(size, SMALL).unwrap() as u64
}

/// T threads each hold K blocks at once (a barrier), then free them, some on another thread:
/// the true peak is known exactly. Live bytes are exact at every quiescent point, the bounds
/// hold, and with every thread's blocks held together the upper bound is exact too.
fn peak_is_bounded(exact: bool) {
    let a = alloc(exact);
    const T: usize = 6;
    const K: usize = 40;
    let sizes = |t: usize| (0..K).map(move |i| 256 + (t * 997 + i * 1231) % (SMALL - 256));
    let truth: u64 = (0..T).flat_map(sizes).map(bytes).sum();
    let held = Barrier::new(T + 1);
    let checked = Barrier::new(T + 1);
    let handed = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..T {
            let (a, held, checked, handed) = (&a, &held, &checked, &handed);
            s.spawn(move || {
                let mine: Vec<(DeviceAddr, usize)> =
                    sizes(t).map(|n| (a.allocate_per_thread(n).unwrap(), n)).collect();
                held.wait();
                checked.wait();
                // Every third block is freed by another thread (a cross-thread free).
                let (theirs, mine): (Vec<_>, Vec<_>) =
                    mine.into_iter().partition(|(p, _)| (p.0 >> 8) % 3 == 0);
                handed.lock().unwrap().extend(theirs);
                for (p, n) in mine {
                    a.deallocate_per_thread(p, n).unwrap();
                }
            });
        }
        held.wait();
        let s = a.stats();
        assert_eq!(s.live_bytes, truth, "live bytes at a quiescent point");
        checked.wait();
    });
    for (p, n) in handed.into_inner().unwrap() {
        a.deallocate_per_thread(p, n).unwrap();
    }
    let s = a.stats();
    assert_eq!(s.live_bytes, 0, "{s:?}");
    assert!(s.peak_live_bytes <= truth, "lower bound {} over the true peak {truth}", s.peak_live_bytes);
    assert!(s.peak_live_bytes >= truth, "the stats() call at the barrier sampled the peak: {s:?}");
    assert_eq!(s.peak_live_bytes_upper, truth, "every thread held its own peak at once: {s:?}");
    assert_eq!(s.peak_exact, exact as u64);
    assert_eq!((s.allocations, s.deallocations), ((T * K) as u64, (T * K) as u64));
}

#[test]
fn the_peak_is_bounded_from_both_sides_by_default() {
    peak_is_bounded(false);
}

#[test]
fn the_peak_is_exact_with_stats_exact() {
    peak_is_bounded(true);
}

/// A peak reached and left between two samples: the sampled peak misses it, the upper bound
/// and the exact peak do not.
#[test]
fn a_peak_between_samples_is_missed_by_the_sample_only() {
    for exact in [false, true] {
        let a = alloc(exact);
        // Warm up: the arena's superblocks are taken, so the peak below is made on fast paths.
        let warm: Vec<_> = (0..64).map(|_| a.allocate_per_thread(4096).unwrap()).collect();
        warm.into_iter().for_each(|p| a.deallocate_per_thread(p, 4096).unwrap());
        let _ = a.stats();
        a.reset_peak();
        let s0 = a.stats();
        assert_eq!((s0.peak_live_bytes, s0.peak_live_bytes_upper), (0, 0), "{s0:?}");
        let ps: Vec<_> = (0..48).map(|_| a.allocate_per_thread(4096).unwrap()).collect();
        ps.into_iter().for_each(|p| a.deallocate_per_thread(p, 4096).unwrap());
        let s = a.stats();
        let truth = 48 * bytes(4096);
        assert_eq!(s.peak_live_bytes_upper, truth, "exact={exact}: {s:?}");
        if exact {
            assert_eq!(s.peak_live_bytes, truth, "{s:?}");
        } else {
            assert!(s.peak_live_bytes < truth, "made on fast paths, between two samples: {s:?}");
        }
    }
}

/// `reset_peak` restarts every peak at the values now, including threads that have not
/// allocated since (their bound is their live bytes at the reset) and threads that exited.
#[test]
fn reset_peak_restarts_every_peak_at_the_live_bytes() {
    for exact in [false, true] {
        let a = alloc(exact);
        let keep = a.allocate_per_thread(4096).unwrap();
        let (a2, go) = (a.clone(), Arc::new(Barrier::new(2)));
        let go2 = go.clone();
        let t = std::thread::spawn(move || {
            let big: Vec<_> = (0..30).map(|_| a2.allocate_per_thread(8192).unwrap()).collect();
            let hold = a2.allocate_per_thread(1024).unwrap();
            big.into_iter().for_each(|p| a2.deallocate_per_thread(p, 8192).unwrap());
            go2.wait(); // holds `hold`, idle, while the main thread resets
            go2.wait();
            a2.deallocate_per_thread(hold, 1024).unwrap();
        });
        go.wait();
        let before = a.stats();
        assert!(before.peak_live_bytes_upper >= 30 * bytes(8192), "{before:?}");
        a.reset_peak();
        let s = a.stats();
        let live = bytes(4096) + bytes(1024);
        assert_eq!(s.live_bytes, live);
        assert_eq!((s.peak_live_bytes, s.peak_live_bytes_upper), (live, live), "exact={exact}: {s:?}");
        assert_eq!(s.peak_reserved_bytes, s.reserved_bytes, "{s:?}");
        go.wait();
        t.join().unwrap();
        let s = a.stats();
        assert_eq!((s.peak_live_bytes, s.peak_live_bytes_upper), (live, live), "after the exit: {s:?}");
        a.reset_peak();
        let s = a.stats();
        let b = bytes(4096);
        assert_eq!((s.live_bytes, s.peak_live_bytes, s.peak_live_bytes_upper), (b, b, b), "{s:?}");
        a.deallocate_per_thread(keep, 4096).unwrap();
    }
}

/// `reset_counters` while threads allocate and free: no bump is lost or torn (a reset that
/// stored into a thread's counters would race its load + store), counts after the last reset
/// are exact, and no count ever reads negative (wrapped).
#[test]
fn reset_counters_racing_many_threads_loses_nothing() {
    for exact in [false, true] {
        let a = alloc(exact);
        const T: usize = 6;
        let stop = AtomicBool::new(false);
        let ops = AtomicU64::new(0);
        let quiet = Barrier::new(T + 1);
        let resume = Barrier::new(T + 1);
        let done = Barrier::new(T + 1);
        std::thread::scope(|s| {
            for t in 0..T {
                let (a, stop, ops, quiet, resume, done) = (&a, &stop, &ops, &quiet, &resume, &done);
                s.spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let size = 256 + (t * 4099 + n as usize * 613) % 20_000;
                        let p = a.allocate_per_thread(size).unwrap();
                        a.deallocate_per_thread(p, size).unwrap();
                        n += 1;
                    }
                    ops.fetch_add(n, Ordering::Relaxed);
                    quiet.wait();
                    resume.wait();
                    for i in 0..100 {
                        let p = a.allocate(300 + i, Stream::PER_THREAD).unwrap();
                        a.deallocate_per_thread(p, 300 + i).unwrap();
                    }
                    done.wait();
                });
            }
            let mut resets = 0;
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
            while std::time::Instant::now() < deadline {
                a.reset_counters();
                resets += 1;
                let s = a.stats();
                let lim = 1 << 40;
                assert!(s.allocations < lim && s.deallocations < lim && s.driver_calls < lim, "{s:?}");
                assert!(a.size_histogram().iter().all(|&c| c < lim));
            }
            stop.store(true, Ordering::Relaxed);
            quiet.wait();
            assert!(resets > 10 && ops.load(Ordering::Relaxed) > 1000);
            a.reset_counters();
            let s = a.stats();
            assert_eq!(
                (s.allocations, s.deallocations, s.pool_allocations, s.driver_calls),
                (0, 0, 0, 0),
                "{s:?}"
            );
            assert_eq!(s.live_bytes, 0, "gauges are not reset: {s:?}");
            assert!(a.size_histogram().iter().all(|&c| c == 0));
            resume.wait();
            done.wait();
        });
        let s = a.stats();
        let n = (T * 100) as u64;
        assert_eq!((s.allocations, s.deallocations), (n, n), "{s:?}");
        assert_eq!(s.cross_stream_frees, 0, "{s:?}");
        assert_eq!(a.size_histogram().iter().sum::<u64>(), n);
        assert_eq!(s.live_bytes, 0);
    }
}

#[test]
fn the_size_histogram_counts_blocks_by_power_of_two() {
    assert_eq!((size_bucket(1), size_bucket(256), size_bucket(257), size_bucket(512)), (0, 0, 1, 1));
    assert_eq!(size_bucket(usize::MAX), SIZE_HISTOGRAM_BUCKETS - 1);
    for k in 0..SIZE_HISTOGRAM_BUCKETS - 1 {
        let lim = size_bucket_limit(k) as usize;
        assert_eq!((size_bucket(lim), size_bucket(lim + 1)), (k, k + 1));
    }
    let a = alloc(false);
    let sizes = [100usize, 256, 3000, 40_000, 3 << 20];
    let ps: Vec<_> = sizes.iter().map(|&n| a.allocate_per_thread(n).unwrap()).collect();
    let h = a.size_histogram();
    let mut want = [0u64; SIZE_HISTOGRAM_BUCKETS];
    for &n in &sizes {
        want[size_bucket(bytes(n) as usize)] += 1;
    }
    assert_eq!(h, want);
    let s = a.stats();
    assert_eq!(s.allocations, 5);
    assert_eq!(s.arena_allocations + s.pool_allocations, 5, "every allocation has one path: {s:?}");
    for (p, n) in ps.into_iter().zip(sizes) {
        a.deallocate_per_thread(p, n).unwrap();
    }
}

#[test]
fn stats_exact_is_a_config_key() {
    assert!(Config::parse("stats=exact").unwrap().exact_stats());
    assert!(!Config::parse("stats:sampled").unwrap().exact_stats());
    assert!(!Config::default().exact_stats());
    let e = Config::parse("stats=precise").unwrap_err().to_string();
    assert!(e.contains("stats") && e.contains("exact"), "{e}");
}
