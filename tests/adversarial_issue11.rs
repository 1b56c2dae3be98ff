//! An adversarial pass on issue 11's statistics, OOM hook and traces, on the simulated device:
//! OOM hooks that allocate, free, trim, set or clear the hook, or panic, on many threads at
//! once and racing `set_oom_hook(None)`; `start_trace`/`stop_trace` racing threads that
//! allocate, exit or call `release_thread`; two starts at once; a stop with no start; trace
//! paths that cannot be written; `reset_peak`/`reset_counters` racing allocations (live exact
//! at quiescence, `peak_live_bytes <= peak_live_bytes_upper`, counters never below the reset
//! baseline); and the C ABI's new entry points given NULL pointers, short sizes, absurd device
//! ordinals and short buffers. Every allocator test ends with `assert_all_returned`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use cuarena::{Allocator, DeviceAddr, Error, OomHook, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

/// The C ABI, compiled in to be called as C would.
#[allow(dead_code, unreachable_pub)]
#[path = "../capi/src/lib.rs"]
mod cuarena_c;

const MIB: usize = 1 << 20;

/// 1 MiB blocks come from the global pool; the cap is 16 MiB.
fn capped(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), small().large_max(64 << 10).max_bytes(16 * MIB).build().unwrap()).unwrap()
}

fn trace_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cuarena-adv11-{}-{name}.bin", std::process::id()))
}

// ---- The OOM hook ----

/// Blocks a spilling layer holds: the hook frees them to make room.
type Spill = Arc<Mutex<Vec<DeviceAddr>>>;

/// A hook that, by turns, frees spilled blocks, allocates (a nested out-of-memory fails at
/// once), trims, reads stats, clears the hook or puts itself back.
fn busy_hook(a: &Allocator, spill: &Spill, calls: &Arc<AtomicUsize>) -> OomHook {
    let (w, spill, calls) = (a.clone(), spill.clone(), calls.clone());
    Arc::new(move |requested, device| {
        assert_eq!(device, 0);
        assert!(requested > 0);
        let n = calls.fetch_add(1, Ordering::Relaxed);
        match n % 6 {
            0 | 1 => {
                let freed: Vec<_> = spill.lock().unwrap().drain(..).collect();
                for p in &freed {
                    w.deallocate_per_thread(*p, MIB).unwrap();
                }
                !freed.is_empty()
            }
            2 => match w.allocate_per_thread(requested) {
                // Nested: an out-of-memory here fails at once (no recursion into this hook).
                Ok(p) => {
                    w.deallocate_per_thread(p, requested).unwrap();
                    true
                }
                Err(Error::OutOfMemory { .. }) => false,
                Err(e) => panic!("nested allocate: {e}"),
            },
            3 => {
                w.trim(false).unwrap();
                let s = w.stats();
                assert!(s.oom_hook_calls >= 1, "{s:?}");
                true
            }
            4 => {
                w.set_oom_hook(None); // the next out-of-memory runs without a hook
                false
            }
            _ => {
                // Puts a fresh hook back (the hook in place now may be any, or none).
                let calls2 = Arc::new(AtomicUsize::new(0));
                w.set_oom_hook(Some(busy_hook_simple(&w, &calls2)));
                true
            }
        }
    })
}

/// A hook that only trims and asks for a retry.
fn busy_hook_simple(a: &Allocator, calls: &Arc<AtomicUsize>) -> OomHook {
    let (w, calls) = (a.clone(), calls.clone());
    Arc::new(move |_, _| {
        calls.fetch_add(1, Ordering::Relaxed);
        w.trim(false).unwrap();
        true
    })
}

#[test]
fn oom_hooks_that_allocate_free_trim_and_swap_the_hook_on_many_threads() {
    let sim = host(2);
    let a = capped(&sim);
    let (a2, sim2) = (a.clone(), sim.clone());
    let (ooms, calls) = within(120, move || {
        let (a, sim) = (a2, sim2);
        let spill: Spill = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // The workers start once the toggler has set a hook (on 2 cores it may otherwise not
        // run at all before they finish, and no hook is ever called).
        let started = Arc::new(std::sync::Barrier::new(2));
        // A thread that keeps putting the hook back and taking it away.
        let toggler = {
            let (a, spill, calls, stop) = (a.clone(), spill.clone(), calls.clone(), stop.clone());
            let started = started.clone();
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    a.set_oom_hook((!i.is_multiple_of(3)).then(|| busy_hook(&a, &spill, &calls)));
                    if i == 1 {
                        started.wait();
                    }
                    // It yields only with a hook in place: descheduled, it leaves one (on a busy
                    // machine a descheduled toggler that left none could outlast every error).
                    if !i.is_multiple_of(3) {
                        std::thread::yield_now();
                    }
                }
                a.set_oom_hook(None); // the hooks hold the allocator: break the cycle
            })
        };
        const THREADS: usize = 6;
        let ooms = Arc::new(AtomicUsize::new(0));
        started.wait();
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, spill, ooms) = (a.clone(), spill.clone(), ooms.clone());
                std::thread::spawn(move || {
                    let mut x = t as u64 + 11;
                    let mut mine = Vec::new();
                    for _ in 0..400 {
                        match a.allocate_per_thread(MIB) {
                            Ok(p) => {
                                if rng(&mut x).is_multiple_of(2) {
                                    spill.lock().unwrap().push(p); // the hook may free it
                                } else {
                                    mine.push(p);
                                }
                            }
                            Err(Error::OutOfMemory { .. }) => {
                                ooms.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("{e}"),
                        }
                        if mine.len() > 3 || (rng(&mut x).is_multiple_of(4) && !mine.is_empty()) {
                            a.deallocate_per_thread(mine.swap_remove(0), MIB).unwrap();
                        }
                        if rng(&mut x).is_multiple_of(50) {
                            a.release_thread().unwrap();
                        }
                    }
                    for p in mine {
                        a.deallocate_per_thread(p, MIB).unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        toggler.join().unwrap();
        a.set_oom_hook(None);
        for p in spill.lock().unwrap().drain(..) {
            a.deallocate_per_thread(p, MIB).unwrap();
        }
        let s = a.stats();
        assert!(s.oom_hook_calls <= s.alloc_retries + s.ooms + calls.load(Ordering::Relaxed) as u64, "{s:?}");
        // The hooks' own nested allocations may fail too: at least every failure seen here.
        assert!(s.ooms >= ooms.load(Ordering::Relaxed) as u64, "every failed allocation counted: {s:?}");
        assert_all_returned(&a, Some(&sim), 0);
        (ooms.load(Ordering::Relaxed), s.oom_hook_calls)
    });
    // Some hook ran (the toggler's, or one a hook put in place).
    assert!(calls > 0, "the hooks ran ({ooms} out-of-memory errors)");
    a.set_oom_hook(None);
}

#[test]
fn panicking_hooks_on_many_threads_leave_the_allocator_intact() {
    let sim = host(0);
    let a = capped(&sim);
    let a2 = a.clone();
    within(60, move || {
        let a = a2;
        let n = Arc::new(AtomicUsize::new(0));
        let n2 = n.clone();
        a.set_oom_hook(Some(Arc::new(move |_, _| {
            if n2.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) {
                panic!("the hook panics");
            }
            false
        })));
        const THREADS: usize = 6;
        let barrier = Arc::new(Barrier::new(THREADS));
        let hs: Vec<_> = (0..THREADS)
            .map(|_| {
                let (a, barrier) = (a.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    // Fills the cap between them, then each asks for more.
                    // The hook may already panic here: caught like the rest.
                    let once = || {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.allocate_per_thread(MIB)))
                    };
                    while let Ok(Ok(p)) = once() {
                        held.push(p);
                    }
                    barrier.wait();
                    let (mut panics, mut ooms) = (0, 0);
                    for _ in 0..20 {
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            a.allocate_per_thread(MIB)
                        })) {
                            Err(_) => panics += 1,
                            Ok(Err(Error::OutOfMemory { .. })) => ooms += 1,
                            Ok(Ok(p)) => held.push(p), // another thread freed meanwhile
                            Ok(Err(e)) => panic!("{e}"),
                        }
                    }
                    barrier.wait();
                    for p in held {
                        a.deallocate_per_thread(p, MIB).unwrap();
                    }
                    a.release_thread().unwrap();
                    (panics, ooms)
                })
            })
            .collect();
        let (mut panics, mut ooms) = (0, 0);
        for h in hs {
            let (p, o) = h.join().unwrap();
            panics += p;
            ooms += o;
        }
        assert!(panics > 0 && ooms > 0, "{panics} panics, {ooms} ooms");
        a.set_oom_hook(None);
        // After the panics the whole cap can be allocated again.
        let all: Vec<_> = std::iter::from_fn(|| a.allocate_per_thread(MIB).ok()).collect();
        assert!(all.len() >= 12, "{} MiB after the panics", all.len());
        for p in all {
            a.deallocate_per_thread(p, MIB).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// A hook that starts and stops traces on its own allocator, from inside an allocation that a
/// trace is recording.
#[test]
fn a_hook_that_starts_and_stops_the_trace_does_not_deadlock() {
    let sim = host(0);
    let a = capped(&sim);
    let a2 = a.clone();
    let p1 = trace_path("hook");
    let p1b = p1.clone();
    within(60, move || {
        let a = a2;
        let held: Vec<_> = std::iter::from_fn(|| a.allocate_per_thread(MIB).ok()).collect();
        let w = a.clone();
        let path = p1b.clone();
        a.set_oom_hook(Some(Arc::new(move |_, _| {
            match w.stop_trace() {
                Ok(_) => {}
                Err(_) => w.start_trace(&path).unwrap(),
            }
            false
        })));
        a.start_trace(&p1b).unwrap();
        for _ in 0..5 {
            assert!(matches!(a.allocate_per_thread(MIB), Err(Error::OutOfMemory { .. })));
        }
        a.set_oom_hook(None);
        // 5 hook calls: stop, start, stop, start, stop: no trace runs now.
        assert!(a.stop_trace().is_err());
        for p in held {
            a.deallocate_per_thread(p, MIB).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
    let _ = std::fs::remove_file(&p1);
}

// ---- Traces ----

#[test]
fn stop_without_start_and_two_starts_at_once_are_refused_cleanly() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let e = a.stop_trace().unwrap_err();
    assert!(e.to_string().contains("no trace is running"), "{e}");
    for round in 0..20 {
        const N: usize = 4;
        let barrier = Arc::new(Barrier::new(N));
        let paths: Vec<_> = (0..N).map(|i| trace_path(&format!("two-{round}-{i}"))).collect();
        let hs: Vec<_> = paths
            .iter()
            .cloned()
            .map(|p| {
                let (a, barrier) = (a.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let r = a.start_trace(&p);
                    let q = a.allocate_per_thread(1000).unwrap();
                    a.deallocate_per_thread(q, 1000).unwrap();
                    a.release_thread().unwrap();
                    r
                })
            })
            .collect();
        let rs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(rs.iter().filter(|r| r.is_ok()).count(), 1, "{rs:?}");
        for r in rs.iter().filter_map(|r| r.as_ref().err()) {
            assert!(r.to_string().contains("already running"), "{r}");
        }
        let sum = a.stop_trace().unwrap();
        assert_eq!(sum.records % 2, 0, "allocations and frees are both recorded: {sum:?}");
        assert!(a.stop_trace().is_err());
        let winner = rs.iter().position(|r| r.is_ok()).unwrap();
        let recs = cuarena::trace::read(&paths[winner]).unwrap();
        assert_eq!(recs.len() as u64, sum.records);
        for p in &paths {
            let _ = std::fs::remove_file(p);
        }
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// Found open in session 3: an allocation that began before a start (the flag was read at
/// entry) returned a block whose free the trace recorded, unrecorded itself; the block's next
/// free then followed a free. The flag is now read after an allocation.
#[test]
fn start_and_stop_racing_threads_that_allocate_exit_and_release() {
    let sim = host(1);
    let a = host_allocator(sim.clone(), small().large_max(128 << 10).build().unwrap()).unwrap();
    let a2 = a.clone();
    let sim2 = sim.clone();
    within(180, move || {
        let (a, sim) = (a2, sim2);
        let stop = Arc::new(AtomicBool::new(false));
        let allocs = Arc::new(AtomicU64::new(0));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, stop, allocs) = (a.clone(), stop.clone(), allocs.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = t * 31 + 5;
                let mut round = 0;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    // Short-lived threads that exit (their buffers written at exit), or
                    // release their arena, while traces start and stop.
                    let a2 = a.clone();
                    let allocs2 = allocs.clone();
                    let seed = rng(&mut x);
                    std::thread::spawn(move || {
                        let mut x = seed | 1;
                        let mut held = Vec::new();
                        for i in 0..300 {
                            let size = [100, 5000, 100 << 10, 200 << 10][(rng(&mut x) % 4) as usize];
                            let p = a2.allocate_per_thread(size).unwrap();
                            allocs2.fetch_add(1, Ordering::Relaxed);
                            held.push((p, size));
                            if held.len() > 8 {
                                let (p, s) = held.swap_remove((rng(&mut x) % 8) as usize);
                                a2.deallocate_per_thread(p, s).unwrap();
                            }
                            if i % 97 == 0 && round % 2 == 0 {
                                a2.release_thread().unwrap();
                            }
                        }
                        for (p, s) in held {
                            a2.deallocate_per_thread(p, s).unwrap();
                        }
                        if round % 3 == 0 {
                            a2.release_thread().unwrap();
                        }
                    })
                    .join()
                    .unwrap();
                }
            }));
        }
        let mut files = Vec::new();
        let t0 = Instant::now();
        let mut i = 0;
        while t0.elapsed() < Duration::from_secs(3) {
            let p = trace_path(&format!("race-{i}"));
            a.start_trace(&p).unwrap();
            std::thread::sleep(Duration::from_millis(i % 7));
            let sum = a.stop_trace().unwrap();
            files.push((p, sum));
            i += 1;
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        assert!(allocs.load(Ordering::Relaxed) > 0);
        let mut total = 0;
        for (p, sum) in &files {
            let recs = cuarena::trace::read(p).unwrap();
            assert_eq!(recs.len() as u64, sum.records, "{}", p.display());
            total += recs.len();
            // Per address, in time order, alloc and free alternate (a free may come first:
            // its block was allocated before the trace started).
            let mut sorted: Vec<_> = recs.iter().collect();
            sorted.sort_by_key(|r| r.time_ns);
            let mut live = std::collections::HashMap::new();
            let history = |ptr: u64| -> Vec<String> {
                sorted.iter().filter(|r| r.ptr == ptr).map(|r| format!("{r:?}")).collect()
            };
            for &r in &sorted {
                match r.action {
                    cuarena::trace::Action::Alloc => {
                        assert!(
                            !live.insert(r.ptr, true).unwrap_or(false),
                            "{r:?} allocated while live: {:#?}",
                            history(r.ptr)
                        )
                    }
                    cuarena::trace::Action::Free => {
                        assert!(
                            live.insert(r.ptr, false).unwrap_or(true),
                            "{r:?} freed while free: {:#?}",
                            history(r.ptr)
                        )
                    }
                    _ => {}
                }
            }
            std::fs::remove_file(p).unwrap();
        }
        assert!(total > 0, "{} traces recorded nothing", files.len());
        assert_all_returned(&a, Some(&sim), 0);
    });
}

#[test]
fn trace_paths_that_cannot_be_written_give_a_clear_error_and_lose_nothing() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let dir = std::env::temp_dir();
    let p = a.allocate_per_thread(1000).unwrap(); // live across the failures
    // A directory, and a file in a directory that does not exist: refused at start.
    for bad in [dir.clone(), dir.join(format!("cuarena-adv11-missing-{}/t.bin", std::process::id()))] {
        let e = a.start_trace(&bad).unwrap_err();
        assert!(matches!(e, Error::Trace(_)), "{e:?}");
        assert!(e.to_string().contains(&bad.display().to_string()), "names the path: {e}");
        assert!(a.stop_trace().is_err(), "nothing started");
        // The path is not left marked busy, and the allocator is unchanged.
        let e2 = a.start_trace(&bad).unwrap_err();
        assert!(!e2.to_string().contains("already"), "{e2}");
    }
    // A file whose writes fail (no space): the error comes at the stop, whole.
    let full = std::path::Path::new("/dev/full");
    if full.exists() {
        a.start_trace(full).unwrap();
        let q = a.allocate_per_thread(2000).unwrap();
        a.deallocate_per_thread(q, 2000).unwrap();
        let e = a.stop_trace().unwrap_err();
        assert!(e.to_string().contains("writing the trace"), "{e}");
        assert!(a.stop_trace().is_err(), "the failed trace is over");
        // The same path can be started again (not left busy).
        a.start_trace(full).unwrap();
        assert!(a.stop_trace().is_err());
    }
    // A good trace works after all that, and the block live all along is freed normally.
    let good = trace_path("after-bad");
    a.start_trace(&good).unwrap();
    a.deallocate_per_thread(p, 1000).unwrap();
    let sum = a.stop_trace().unwrap();
    assert_eq!(sum.records, 1);
    assert_eq!(cuarena::trace::read(&good).unwrap()[0].ptr, p.0);
    std::fs::remove_file(&good).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn one_path_for_two_allocators_is_refused() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let b = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let p = trace_path("shared");
    a.start_trace(&p).unwrap();
    let e = b.start_trace(&p).unwrap_err();
    assert!(e.to_string().contains("already being written"), "{e}");
    // Through a different spelling of the same path too.
    let alt = p.parent().unwrap().join(".").join(p.file_name().unwrap());
    let e = b.start_trace(&alt).unwrap_err();
    assert!(e.to_string().contains("already being written"), "{e}");
    a.stop_trace().unwrap();
    b.start_trace(&p).unwrap();
    b.stop_trace().unwrap();
    std::fs::remove_file(&p).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
    assert_all_returned(&b, Some(&sim), 0);
}

// ---- Statistics resets ----

/// Found open in session 3: a reset read a block's `allocations` and its histogram one word at
/// a time, so allocations racing it fell between the two baselines and the histogram summed
/// below `allocations` until the next reset. `allocations` is now the histogram's sum.
#[test]
fn resets_racing_allocations_keep_the_stats_within_their_bounds() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().large_max(128 << 10).build().unwrap()).unwrap();
    let a2 = a.clone();
    let sim2 = sim.clone();
    within(120, move || {
        let (a, sim) = (a2, sim2);
        let stop = Arc::new(AtomicBool::new(false));
        const THREADS: usize = 5;
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, stop) = (a.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut x = t as u64 * 13 + 3;
                    let mut held = Vec::new();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let size = [64, 4000, 60 << 10, 100 << 10, 300 << 10][(rng(&mut x) % 5) as usize];
                        held.push((a.allocate_per_thread(size).unwrap(), size));
                        n += 1;
                        if held.len() > 16 || rng(&mut x).is_multiple_of(3) {
                            let (p, s) = held.swap_remove((rng(&mut x) as usize) % held.len());
                            a.deallocate_per_thread(p, s).unwrap();
                        }
                        if n.is_multiple_of(501) {
                            a.release_thread().unwrap(); // its counters retire mid-race
                        }
                    }
                    for (p, s) in held {
                        a.deallocate_per_thread(p, s).unwrap();
                    }
                    a.release_thread().unwrap();
                    n
                })
            })
            .collect();
        let sane = |v: u64, what: &str, s: &cuarena::Stats| assert!(v < 1 << 50, "{what} wrapped: {s:?}");
        let t0 = Instant::now();
        let mut rounds = 0;
        while t0.elapsed() < Duration::from_secs(3) {
            rounds += 1;
            if rounds % 2 == 0 {
                a.reset_counters();
            } else {
                a.reset_peak();
            }
            let s1 = a.stats();
            let h1 = a.size_histogram();
            let s2 = a.stats();
            for s in [&s1, &s2] {
                sane(s.allocations, "allocations", s);
                sane(s.deallocations, "deallocations", s);
                sane(s.pool_allocations, "pool_allocations", s);
                sane(s.arena_allocations, "arena_allocations", s);
                sane(s.driver_calls, "driver_calls", s);
            }
            // Since the last reset nothing goes backwards.
            assert!(s2.allocations >= s1.allocations, "{s1:?} then {s2:?}");
            assert!(s2.deallocations >= s1.deallocations, "{s1:?} then {s2:?}");
            assert!(s2.pool_allocations >= s1.pool_allocations, "{s1:?} then {s2:?}");
            let hsum: u64 = h1.iter().sum();
            // The same monotone counters read three times in order: exact, no slack.
            assert!(s1.allocations <= hsum && hsum <= s2.allocations, "{s1:?} {h1:?} {s2:?}");
        }
        stop.store(true, Ordering::Relaxed);
        let total: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        assert!(total > 0);
        // Quiescent: live exact, the peak between its bounds, and a fresh reset counts exactly.
        let s = a.stats();
        assert_eq!(s.live_bytes, 0, "{s:?}");
        assert!(s.peak_live_bytes <= s.peak_live_bytes_upper, "{s:?}");
        a.reset_counters();
        a.reset_peak();
        let s = a.stats();
        assert_eq!((s.allocations, s.deallocations), (0, 0), "{s:?}");
        assert_eq!((s.peak_live_bytes, s.peak_live_bytes_upper), (0, 0), "{s:?}");
        let ps: Vec<_> = (0..10).map(|_| a.allocate_per_thread(5000).unwrap()).collect();
        let s = a.stats();
        assert_eq!(s.allocations, 10, "{s:?}");
        assert_eq!(a.size_histogram().iter().sum::<u64>(), 10);
        assert!(s.peak_live_bytes <= s.peak_live_bytes_upper, "{s:?}");
        assert!(s.peak_live_bytes_upper >= s.live_bytes && s.live_bytes >= 50_000, "{s:?}");
        for p in ps {
            a.deallocate_per_thread(p, 5000).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// A `stats()` call samples the live sum under the list lock, then raises the sampled peak
/// after letting the lock go. A `reset_peak` that runs in between is undone by the stale
/// sample: the peak of before the reset comes back, above the upper bound, at quiescence.
#[test]
fn a_stats_read_racing_reset_peak_does_not_bring_back_the_old_peak() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let a2 = a.clone();
    let sim2 = sim.clone();
    within(120, move || {
        let (a, sim) = (a2, sim2);
        const READERS: usize = 6;
        let pause = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicUsize::new(0));
        let reads = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let hs: Vec<_> = (0..READERS)
            .map(|_| {
                let (a, pause, paused, reads, stop) =
                    (a.clone(), pause.clone(), paused.clone(), reads.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if pause.load(Ordering::Acquire) {
                            paused.fetch_add(1, Ordering::AcqRel);
                            while pause.load(Ordering::Acquire) {
                                std::thread::yield_now();
                            }
                            paused.fetch_sub(1, Ordering::AcqRel);
                        }
                        let _ = a.stats();
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let big = 8 * MIB;
        let t0 = Instant::now();
        let mut rounds = 0;
        let mut bad = None;
        while t0.elapsed() < Duration::from_secs(4) && bad.is_none() {
            rounds += 1;
            let p = a.allocate_per_thread(big).unwrap();
            let r0 = reads.load(Ordering::Relaxed);
            while reads.load(Ordering::Relaxed) < r0 + READERS as u64 {
                std::hint::spin_loop();
            }
            a.deallocate_per_thread(p, big).unwrap();
            a.reset_peak();
            // Quiescent: every reader outside `stats()`.
            pause.store(true, Ordering::Release);
            while paused.load(Ordering::Acquire) < READERS {
                std::thread::yield_now();
            }
            let s = a.stats();
            if s.peak_live_bytes > s.peak_live_bytes_upper || s.peak_live_bytes >= big as u64 {
                bad = Some(s);
            }
            pause.store(false, Ordering::Release);
            while paused.load(Ordering::Acquire) > 0 {
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        if let Some(s) = bad {
            panic!(
                "round {rounds}: after reset_peak with nothing live, peak_live_bytes {} > upper {}: {s:?}",
                s.peak_live_bytes, s.peak_live_bytes_upper
            );
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---- The C ABI (no driver on this machine: every call fails cleanly) ----

fn last_error() -> String {
    let p = cuarena_c::cuarena_last_error();
    assert!(!p.is_null(), "a failing call sets the last error");
    // SAFETY: a non-null result is a NUL-terminated string valid until the next failing call.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn gpu_present() -> bool {
    cuarena::CudaDevice::new(0).is_ok()
}

#[test]
fn the_c_entry_points_refuse_null_short_and_absurd_input_without_panicking() {
    use cuarena_c::*;
    use std::ffi::c_void;
    if gpu_present() {
        return; // this pass is about the driver-less failures
    }
    let absurd = [-1, i32::MIN, 64, 65, 1 << 20, i32::MAX, 0];
    for &d in &absurd {
        assert_eq!(cuarena_reset_peak(d), -1);
        assert!(!last_error().is_empty());
        assert_eq!(cuarena_reset_counters(d), -1);
        assert!(!last_error().is_empty());
        assert_eq!(cuarena_trace_stop(d), -1);
        assert!(!last_error().is_empty());
        assert_eq!(cuarena_set_oom_hook(d, None, std::ptr::null_mut()), -1);
        assert!(!last_error().is_empty());
        let mut h = [7u64; 3];
        // SAFETY: `h` has 3 writable u64s.
        assert_eq!(unsafe { cuarena_get_size_histogram(d, h.as_mut_ptr(), h.len()) }, -1);
        assert_eq!(h, [7; 3], "nothing written on failure");
        // SAFETY: n is 0: out is not touched.
        assert_eq!(unsafe { cuarena_get_size_histogram(d, std::ptr::null_mut(), 0) }, -1);
        let mut s = cuarena_stats { size: size_of::<cuarena_stats>() as u64, ..Default::default() };
        s.stats.allocations = 99;
        // SAFETY: `s` is a whole cuarena_stats.
        assert_eq!(unsafe { cuarena_get_stats(d, &mut s) }, -1);
        assert_eq!(s.stats.allocations, 99, "nothing written on failure");
        assert!(!last_error().is_empty());
        let c = std::ffi::CString::new("/tmp/cuarena-adv11-never.bin").unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { cuarena_trace_start(d, c.as_ptr()) }, -1);
        assert!(!last_error().is_empty());
    }
    // NULL and short buffers, whatever the device.
    // SAFETY: NULL with n > 0 is refused before any write.
    assert_eq!(unsafe { cuarena_get_size_histogram(0, std::ptr::null_mut(), 5) }, -1);
    assert!(last_error().contains("NULL"), "{}", last_error());
    // SAFETY: NULL is refused.
    assert_eq!(unsafe { cuarena_get_stats(0, std::ptr::null_mut()) }, -1);
    assert!(last_error().contains("NULL"), "{}", last_error());
    for size in [0u64, 1, 7, 8, CUARENA_STATS_SIZE_V1 as u64 - 8, CUARENA_STATS_SIZE_V1 as u64 - 1] {
        let mut buf = [0xabu8; 64];
        buf[..8].copy_from_slice(&size.to_ne_bytes());
        // SAFETY: the first 8 bytes hold `size` (< the minimum: nothing more is touched).
        let r = unsafe { cuarena_get_stats(0, buf.as_mut_ptr().cast()) };
        assert_eq!(r, CUARENA_ERR_STATS_SIZE, "size {size}");
        assert!(last_error().contains("sizeof(cuarena_stats)"), "{}", last_error());
        assert!(buf[8..].iter().all(|&b| b == 0xab), "nothing written for size {size}");
    }
    // An unaligned stats pointer is read unaligned, not a fault.
    let mut buf = [0u8; 24];
    buf[1..9].copy_from_slice(&3u64.to_ne_bytes());
    // SAFETY: 8 readable bytes at offset 1; size 3 is refused before any write.
    assert_eq!(unsafe { cuarena_get_stats(0, buf.as_mut_ptr().add(1).cast()) }, CUARENA_ERR_STATS_SIZE);
    // A path that is not UTF-8.
    let bad = [0xffu8, 0xfe, b'x', 0];
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_trace_start(0, bad.as_ptr().cast()) }, -1);
    assert!(last_error().contains("UTF-8"), "{}", last_error());
    assert!(cuarena_version() > 0);
    let _: *mut c_void = std::ptr::null_mut();
}

#[test]
fn the_c_entry_points_fail_cleanly_from_many_threads_at_once() {
    use cuarena_c::*;
    if gpu_present() {
        return;
    }
    let hs: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                for i in 0..200 {
                    let d = [(t + i) % 3 - 1, 0, 70][i as usize % 3];
                    assert_eq!(cuarena_reset_peak(d), -1);
                    assert_eq!(cuarena_reset_counters(d), -1);
                    let mut h = [0u64; 30];
                    // SAFETY: 30 writable u64s.
                    assert_eq!(unsafe { cuarena_get_size_histogram(d, h.as_mut_ptr(), 30) }, -1);
                    assert_eq!(cuarena_trace_stop(d), -1);
                    assert!(!last_error().is_empty());
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("no panic escapes the C ABI");
    }
}

/// A C hook on a simulated allocator, racing its own removal on another thread.
#[test]
fn a_c_hook_racing_its_removal_is_called_safely() {
    use std::ffi::{c_int, c_void};
    unsafe extern "C" fn hook(_requested: usize, device: c_int, user: *mut c_void) -> c_int {
        // SAFETY: `user` is the test's counter, alive until after every allocation.
        let n = unsafe { &*user.cast::<AtomicUsize>() };
        n.fetch_add(1, Ordering::Relaxed);
        (device == 0) as c_int
    }
    let sim = host(0);
    let a = capped(&sim);
    let held: Vec<_> = std::iter::from_fn(|| a.allocate_per_thread(MIB).ok()).collect();
    let calls = Box::new(AtomicUsize::new(0));
    let user = (&raw const *calls).cast_mut().cast::<c_void>() as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let toggler = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                a.set_oom_hook((i % 2 == 0).then(|| cuarena_c::c_oom_hook(hook, user as *mut c_void)));
            }
            a.set_oom_hook(None);
        })
    };
    let hs: Vec<_> = (0..4)
        .map(|_| {
            let a = a.clone();
            std::thread::spawn(move || {
                for _ in 0..300 {
                    assert!(matches!(a.allocate_per_thread(MIB), Err(Error::OutOfMemory { .. })));
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    toggler.join().unwrap();
    let s = a.stats();
    assert_eq!(s.ooms, 1200 + 1, "the fill's last allocation, then every one here: {s:?}");
    assert_eq!(s.oom_hook_calls, calls.load(Ordering::Relaxed) as u64, "{s:?}");
    for p in held {
        a.deallocate_per_thread(p, MIB).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
    drop(calls);
    let _ = Stream::PER_THREAD;
}
