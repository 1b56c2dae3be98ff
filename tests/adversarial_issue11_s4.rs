//! Session 4 of the adversarial pass on issue 11 (after commit aa56c07: an allocation asks
//! whether a trace runs after it ran; `allocations` is the size histogram's sum).
//!
//! Traces: a free made in a thread's late destructors (its trace buffer gone) must be stamped
//! before it runs, like every other free; start/stop racing threads that allocate on the
//! per-thread, legacy and user streams, free remotely, take large and pool blocks, fail
//! allocations, and run OOM hooks that allocate and free; pass-through mode.
//! Statistics: resets racing pool allocations (`arena_allocations + pool_allocations ==
//! allocations` at quiescence); a remote free refused after a reset; `stats=exact` racing
//! `reset_peak`. Every allocator test ends with `assert_all_returned`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cuarena::trace::{Action, LATE_THREAD, Record};
use cuarena::{Allocator, Device, DeviceAddr, Error, Stream};
use cuarena_testkit::{HookedDevice, Hooks, HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

const MIB: usize = 1 << 20;

fn trace_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cuarena-adv11s4-{}-{name}.bin", std::process::id()))
}

/// Checks the trace property: per address, in time order, alloc and free alternate (a free may
/// come first: its block was allocated before the start; a trailing alloc may have no free).
/// Returns the number of alloc and free records.
fn assert_alternates(recs: &[Record], what: &str) -> usize {
    let mut sorted: Vec<&Record> = recs.iter().collect();
    sorted.sort_by_key(|r| r.time_ns);
    let history = |ptr: u64| -> Vec<String> {
        sorted.iter().filter(|r| r.ptr == ptr).map(|r| format!("{r:?}")).collect()
    };
    let mut live: HashMap<u64, bool> = HashMap::new();
    let mut n = 0;
    for &r in &sorted {
        match r.action {
            Action::Alloc => {
                n += 1;
                assert!(
                    !live.insert(r.ptr, true).unwrap_or(false),
                    "{what}: {r:?} allocated while live: {:#?}",
                    history(r.ptr)
                )
            }
            Action::Free => {
                n += 1;
                assert!(
                    live.insert(r.ptr, false).unwrap_or(true),
                    "{what}: {r:?} freed while free: {:#?}",
                    history(r.ptr)
                )
            }
            Action::FailedAlloc => assert_eq!(r.ptr, 0, "{what}: {r:?}"),
            Action::RefusedFree => {}
        }
    }
    n
}

// ---- A free in a thread's late destructors ----

/// Where a thread's next `stream_key` calls stop until the test lets them go.
static PAUSES: Mutex<Option<mpsc::Sender<mpsc::Sender<()>>>> = Mutex::new(None);

thread_local! {
    /// Set on the thread whose `stream_key` calls pause (const: readable in late destructors).
    static PAUSE_KEYS: Cell<bool> = const { Cell::new(false) };
}

/// A simulated device whose `stream_key` pauses on an armed thread until the test answers:
/// the test acts while the thread stands between two steps of a call.
fn pausing_device(sim: &HostDevice) -> Arc<HookedDevice> {
    let key: cuarena_testkit::hooked::KeyHook = Box::new(|sim, stream| {
        let r = sim.stream_key(stream);
        if PAUSE_KEYS.with(|p| p.get()) {
            let tx = PAUSES.lock().unwrap().clone();
            if let Some(tx) = tx {
                let (done_tx, done_rx) = mpsc::channel();
                if tx.send(done_tx).is_ok() {
                    let _ = done_rx.recv();
                }
            }
        }
        r
    });
    HookedDevice::new(sim.clone(), Hooks { stream_key: Some(key), ..Hooks::default() })
}

/// A block a thread frees in its thread-local destructor.
struct FreeAtExit(Option<(Allocator, DeviceAddr, usize, Stream)>);

impl Drop for FreeAtExit {
    fn drop(&mut self) {
        if let Some((a, p, size, stream)) = self.0.take() {
            PAUSE_KEYS.with(|k| k.set(true));
            a.deallocate(p, size, stream).unwrap();
            PAUSE_KEYS.with(|k| k.set(false));
            FREED_AT_EXIT.store(true, Ordering::SeqCst);
        }
    }
}

/// Set once [`FreeAtExit`]'s free has returned: every pause it made was answered. (Not
/// `JoinHandle::is_finished`, which is true before a thread's thread-local destructors run.)
static FREED_AT_EXIT: AtomicBool = AtomicBool::new(false);

thread_local! {
    static AT_EXIT: RefCell<FreeAtExit> = const { RefCell::new(FreeAtExit(None)) };
}

/// A free made in a thread's late destructors (after its trace buffer was written at its exit)
/// is recorded straight to the file, with the thread `LATE_THREAD`. Every free is stamped when
/// it is called, so that an allocation of the same block by another thread, which can only
/// follow the free, sorts after it. The late free was stamped when its record was written,
/// after the free had run: another thread that took the block in between had its allocation
/// sorted before the free, and the trace said the block was allocated twice, then freed.
#[test]
fn a_free_in_late_destructors_is_stamped_before_it_runs() {
    let sim = host(0);
    let dev = pausing_device(&sim);
    // Blocks of 1 MiB come from the global pool (over large_max); the cap keeps the pool small,
    // so that filling it finds the freed block.
    let cfg = small().large_max(64 << 10).max_bytes(8 * MIB).build().unwrap();
    let a = Allocator::new(dev, cfg).unwrap();
    let a2 = a.clone();
    let sim2 = sim.clone();
    let path = trace_path("late-free");
    let path2 = path.clone();
    let (got, recs) = within(60, move || {
        let (a, sim) = (a2, sim2);
        let s = sim.create_stream(); // one stream: the freed block is reusable on it at once
        let (ptx, prx) = mpsc::channel();
        *PAUSES.lock().unwrap() = Some(ptx);
        a.start_trace(&path2).unwrap();
        let (xtx, xrx) = mpsc::channel();
        let t = {
            let a = a.clone();
            std::thread::spawn(move || {
                AT_EXIT.with(|_| {}); // registered first: destroyed after the trace's buffer
                let p = a.allocate(MIB, s).unwrap();
                AT_EXIT.with(|c| c.borrow_mut().0 = Some((a.clone(), p, MIB, s)));
                xtx.send(p).unwrap();
            })
        };
        let x = xrx.recv().unwrap();
        // The exiting thread's free calls `stream_key` (before and after it frees): at each
        // pause, fill the pool on the same stream; once the free has run, the block is found.
        let mut got = false;
        let t0 = Instant::now();
        loop {
            let done = match prx.recv_timeout(Duration::from_millis(5)) {
                Ok(done) => done,
                Err(_) if FREED_AT_EXIT.load(Ordering::SeqCst) => break,
                Err(_) => {
                    assert!(t0.elapsed() < Duration::from_secs(30), "the exiting thread is stuck");
                    continue;
                }
            };
            if !got {
                let mut taken = Vec::new();
                loop {
                    match a.allocate(MIB, s) {
                        Ok(p) => taken.push(p),
                        Err(Error::OutOfMemory { .. }) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                for p in taken {
                    if p == x {
                        got = true; // kept until the thread is gone
                    } else {
                        a.deallocate(p, MIB, s).unwrap();
                    }
                }
            }
            let _ = done.send(());
        }
        *PAUSES.lock().unwrap() = None;
        t.join().unwrap();
        if got {
            a.deallocate(x, MIB, s).unwrap();
        }
        a.stop_trace().unwrap();
        let recs = cuarena::trace::read(&path2).unwrap();
        sim.synchronize();
        sim.destroy_stream(s).unwrap();
        a.trim(true).unwrap();
        assert_all_returned(&a, Some(&sim), 0);
        let recs: Vec<Record> = recs.into_iter().filter(|r| r.ptr == x.0).collect();
        (got, recs)
    });
    let _ = std::fs::remove_file(&path);
    assert!(got, "the test took the block the exiting thread freed: {recs:#?}");
    assert!(recs.iter().any(|r| r.thread == LATE_THREAD && r.action == Action::Free), "{recs:#?}");
    assert_alternates(&recs, "late free");
}

// ---- Statistics resets ----

/// A remote free is counted in `deallocations` by its sender when handed off; if its owner
/// later finds it invalid, the owner takes that count back (`Env::refuse_remote`, −1 on the
/// owner's counter). With a `reset_counters` between the two, the −1 falls after the reset and
/// the +1 before it: `deallocations` since the reset was −1, wrapped to `u64::MAX`, at a
/// quiescent point.
#[test]
fn a_remote_free_refused_after_a_reset_does_not_wrap_deallocations() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().build().unwrap()).unwrap();
    let o = Worker::new(&a);
    let p = o.run(|a| a.allocate_per_thread(8192).unwrap());
    // An interior pointer freed remotely: accepted now, checked by the owner's drain later.
    let mut bad = 0;
    let mut deferred = 0;
    for (ptr, size) in [(p.0 + 512, 7680), (p.0 + 256, 256)] {
        bad += 1;
        if a.deallocate_per_thread(DeviceAddr(ptr), size).is_ok() {
            deferred += 1;
        }
    }
    a.flush().unwrap(); // sent
    assert!(deferred > 0, "no remote free was deferred: nothing to test");
    a.reset_counters();
    let s = a.stats();
    assert_eq!((s.deallocations, s.invalid_frees), (0, 0), "{s:?}");
    o.run(|a| a.flush().unwrap()); // the owner drains: refused now
    let s = a.stats();
    assert_eq!(s.invalid_frees, deferred, "{s:?}");
    assert!(s.deallocations < 1 << 50, "deallocations wrapped: {s:?}");
    assert!(a.take_deferred_error().is_some());
    o.run(move |a| a.deallocate_per_thread(p, 8192)).unwrap();
    o.exit();
    let s = a.stats();
    assert!(s.deallocations < 1 << 50, "deallocations wrapped: {s:?}");
    assert_all_returned(&a, Some(&sim), bad);
}

/// Threads allocate blocks that only the global pool serves while `reset_counters` runs, once
/// per round; at the end of each round (quiescent) every allocation of the round after the
/// reset was a pool allocation, so `arena_allocations` is 0 and `pool_allocations ==
/// allocations`. A pool allocation bumps `pool_allocations`, then its histogram bucket (of
/// which `allocations` is the sum); a reset reads the block's `pool_allocations`, then its
/// histogram, one word at a time. Both orders of straddling are checked.
#[test]
fn resets_racing_pool_allocations_keep_arena_plus_pool_equal_to_allocations() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
    let a2 = a.clone();
    let sim2 = sim.clone();
    within(120, move || {
        let (a, sim) = (a2, sim2);
        const THREADS: usize = 4;
        const OPS: u64 = 400;
        let go = Arc::new(std::sync::Barrier::new(THREADS + 1));
        let done = Arc::new(std::sync::Barrier::new(THREADS + 1));
        let quit = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, go, done, quit, progress) =
                    (a.clone(), go.clone(), done.clone(), quit.clone(), progress.clone());
                std::thread::spawn(move || {
                    let mut x = t as u64 * 7 + 1;
                    loop {
                        go.wait();
                        if quit.load(Ordering::Relaxed) {
                            break;
                        }
                        let mut held = Vec::new();
                        for _ in 0..OPS {
                            let size = [96 << 10, 128 << 10, 200 << 10][(rng(&mut x) % 3) as usize];
                            held.push((a.allocate_per_thread(size).unwrap(), size));
                            if held.len() > 4 {
                                let (p, s) = held.swap_remove(0);
                                a.deallocate_per_thread(p, s).unwrap();
                            }
                            progress.fetch_add(1, Ordering::Relaxed);
                        }
                        for (p, s) in held {
                            a.deallocate_per_thread(p, s).unwrap();
                        }
                        done.wait();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        let t0 = Instant::now();
        let mut rounds = 0u64;
        let mut bad = Vec::new();
        while t0.elapsed() < Duration::from_secs(3) && bad.is_empty() {
            rounds += 1;
            progress.store(0, Ordering::Relaxed);
            let at = (rounds * 97) % (OPS * THREADS as u64);
            go.wait();
            while progress.load(Ordering::Relaxed) < at {
                std::hint::spin_loop();
            }
            a.reset_counters();
            done.wait();
            let s = a.stats();
            if s.arena_allocations != 0
                || s.pool_allocations != s.allocations
                || s.arena_allocations + s.pool_allocations != s.allocations
            {
                bad.push(format!("round {rounds}: {s:?}"));
            }
        }
        quit.store(true, Ordering::Relaxed);
        go.wait();
        for h in hs {
            h.join().unwrap();
        }
        assert!(bad.is_empty(), "after {rounds} rounds: {bad:?}");
        a.reset_counters(); // quiescent: the frees of blocks allocated before the last reset
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---- Traces racing every kind of call ----

/// Traces start and stop while threads allocate on the per-thread, legacy and a user stream,
/// small, large (arena) and pool blocks, free remotely (blocks of other threads, on other
/// streams), fail allocations (over the cap), run an OOM hook that allocates and frees
/// (nested calls, recorded while the outer allocation is still running), release their arena,
/// and exit. Every trace: as many records as its summary, and per address, alloc and free
/// alternate in time order.
fn traces_racing_every_kind_of_call(passthrough: bool, name: &str) {
    let sim = host(0);
    let cfg = small().large_max(128 << 10).max_bytes(24 * MIB).passthrough(passthrough).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let a2 = a.clone();
    let sim2 = sim.clone();
    let name = name.to_string();
    within(120, move || {
        let (a, sim) = (a2, sim2);
        let user = sim.create_stream();
        let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
        type Mail = Arc<Mutex<Vec<(DeviceAddr, usize)>>>;
        let mail: Mail = Arc::new(Mutex::new(Vec::new()));
        let hook_calls = Arc::new(AtomicUsize::new(0));
        {
            let (w, mail, calls) = (a.clone(), mail.clone(), hook_calls.clone());
            a.set_oom_hook(Some(Arc::new(move |requested, _| {
                let n = calls.fetch_add(1, Ordering::Relaxed);
                // Nested: an allocation and a free inside the outer allocation.
                if let Ok(p) = w.allocate_per_thread(4096) {
                    w.deallocate(p, 4096, Stream::LEGACY).unwrap();
                }
                let spilled: Vec<_> = {
                    let mut m = mail.lock().unwrap();
                    let k = m.len().min(4);
                    m.drain(..k).collect()
                };
                for (p, s) in &spilled {
                    w.deallocate_per_thread(*p, *s).unwrap();
                }
                requested > 0 && !spilled.is_empty() && n % 5 != 0
            })));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let one = move |a: &Allocator, x: &mut u64, held: &mut Vec<(DeviceAddr, usize)>, mail: &Mail| {
            let size = [100, 5000, 100 << 10, 300 << 10, 3 * MIB, 64 * MIB][(rng(x) % 6) as usize];
            let s = streams[(rng(x) % 3) as usize];
            match a.allocate(size, s) {
                Ok(p) => {
                    if rng(x).is_multiple_of(3) {
                        mail.lock().unwrap().push((p, size)); // freed by another thread
                    } else {
                        held.push((p, size));
                    }
                }
                Err(Error::OutOfMemory { .. }) => {}
                Err(e) => panic!("{e}"),
            }
            if !held.is_empty() && (held.len() > 6 || rng(x).is_multiple_of(3)) {
                let (p, sz) = held.swap_remove((rng(x) as usize) % held.len());
                a.deallocate(p, sz, streams[(rng(x) % 3) as usize]).unwrap();
            }
            if rng(x).is_multiple_of(2) {
                let m = mail.lock().unwrap().pop();
                if let Some((p, sz)) = m {
                    a.deallocate(p, sz, streams[(rng(x) % 3) as usize]).unwrap();
                }
            }
        };
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (a, stop, ops, mail) = (a.clone(), stop.clone(), ops.clone(), mail.clone());
                std::thread::spawn(move || {
                    let mut x = t * 977 + 13;
                    let mut held = Vec::new();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        one(&a, &mut x, &mut held, &mail);
                        ops.fetch_add(1, Ordering::Relaxed);
                        if n.is_multiple_of(300) {
                            a.release_thread().unwrap();
                        }
                        if n.is_multiple_of(500) {
                            // A short-lived thread: its buffer is written at its exit.
                            let (a2, mail2, seed) = (a.clone(), mail.clone(), rng(&mut x));
                            std::thread::spawn(move || {
                                let (mut x, mut held) = (seed | 1, Vec::new());
                                for _ in 0..50 {
                                    one(&a2, &mut x, &mut held, &mail2);
                                }
                                mail2.lock().unwrap().extend(held);
                            })
                            .join()
                            .unwrap();
                        }
                    }
                    for (p, s) in held {
                        a.deallocate_per_thread(p, s).unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        let mut files = Vec::new();
        let t0 = Instant::now();
        let mut i = 0u64;
        while t0.elapsed() < Duration::from_secs(3) {
            let p = trace_path(&format!("{name}-{i}"));
            a.start_trace(&p).unwrap();
            if !i.is_multiple_of(3) {
                std::thread::sleep(Duration::from_micros(200 * (i % 11)));
            }
            files.push((p, a.stop_trace().unwrap()));
            i += 1;
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        a.set_oom_hook(None);
        for (p, s) in mail.lock().unwrap().drain(..) {
            a.deallocate_per_thread(p, s).unwrap();
        }
        assert!(ops.load(Ordering::Relaxed) > 0);
        let (mut total, mut failed) = (0, 0);
        for (p, sum) in &files {
            let recs = cuarena::trace::read(p).unwrap();
            assert_eq!(recs.len() as u64, sum.records, "{}", p.display());
            failed += recs.iter().filter(|r| r.action == Action::FailedAlloc).count();
            total += assert_alternates(&recs, &p.display().to_string());
            std::fs::remove_file(p).unwrap();
        }
        assert!(total > 0, "{} traces recorded nothing", files.len());
        assert!(failed > 0, "no failed allocation was traced");
        sim.synchronize();
        sim.destroy_stream(user).unwrap();
        assert_all_returned(&a, Some(&sim), 0);
    });
}

#[test]
fn traces_racing_every_kind_of_call_alternate_per_address() {
    traces_racing_every_kind_of_call(false, "every");
}

#[test]
fn traces_racing_every_kind_of_call_alternate_per_address_in_pass_through_mode() {
    traces_racing_every_kind_of_call(true, "every-pt");
}
