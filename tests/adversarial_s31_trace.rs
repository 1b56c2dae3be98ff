//! Thirty-first session, helper-49: adversarial tests of two changes (6a0bc87, 3982242).
//!
//! 1. The trace's stream identities are asked through `Allocator::trace_key` (`with_slot` and
//!    `Counted` on the calling thread's counters, so counted in `driver_calls`; the legacy
//!    stream's from the pool's cache, never asked while a capture is announced; a 0 for the
//!    per-thread or legacy stream not kept).
//! 2. Pass-through mode's `deallocate_used_on` refuses a bad free before any driver call, counts
//!    every driver call it makes (a failed one too) and frees nothing on a failure.
//!
//! Every test runs on the simulated device. `Spy` (the test kit's, `testkit/src/spy.rs`) counts
//! every device call (and can fail the n-th, watch the legacy stream, or run a hook after the
//! legacy stream's identity is asked).

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex, mpsc};

use cuarena::trace::{self, Action, LATE_THREAD, Record, StreamKind};
use cuarena::{Allocator, Config, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, Interpose, Interposed, Spy, assert_all_returned};

type CuResult<T> = cuarena::Result<T>;

const PASSTHROUGH: &str = "passthrough,small_max=64KiB,superblock=256KiB,chunk=1MiB";

fn path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cuarena-s31t-{}-{name}.bin", std::process::id()))
}

/// Reads a trace file and removes it.
fn take(p: &std::path::Path) -> Vec<Record> {
    let r = trace::read(p).unwrap();
    std::fs::remove_file(p).unwrap();
    r
}

fn key(d: &dyn Device, s: Stream) -> u64 {
    d.stream_key(s).unwrap().0
}

/// A thread that begins and ends captures of its own per-thread stream (a blocking stream) on
/// command: the capture an announcement says may begin at any moment.
struct Capturer {
    tx: mpsc::Sender<bool>,
    rx: mpsc::Receiver<CuResult<()>>,
}

impl Capturer {
    fn new(sim: &HostDevice) -> Arc<Mutex<Capturer>> {
        let (tx, crx) = mpsc::channel::<bool>();
        let (rtx, rx) = mpsc::channel();
        let sim = sim.clone();
        std::thread::spawn(move || {
            while let Ok(begin) = crx.recv() {
                let r = if begin {
                    sim.begin_capture(Stream::PER_THREAD)
                } else {
                    sim.end_capture(Stream::PER_THREAD)
                };
                let _ = rtx.send(r);
            }
        });
        Arc::new(Mutex::new(Capturer { tx, rx }))
    }
    fn call(&self, begin: bool) -> CuResult<()> {
        self.tx.send(begin).unwrap();
        self.rx.recv().unwrap()
    }
}

/// Per address, in time order, the actions alternate alloc, free (an address may start with a
/// free: a block allocated before the trace started).
fn assert_alternating(recs: &[Record], what: &str) {
    let mut sorted: Vec<&Record> = recs.iter().collect();
    sorted.sort_by_key(|r| r.time_ns);
    let mut live: HashMap<u64, bool> = HashMap::new();
    for r in sorted {
        match r.action {
            Action::Alloc => {
                assert!(!live.insert(r.ptr, true).unwrap_or(false), "{what}: {r:?}: allocated while live")
            }
            Action::Free => {
                assert!(live.insert(r.ptr, false).unwrap_or(true), "{what}: {r:?}: freed while not live")
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The trace's identity lookups and `driver_calls`.

/// In pass-through mode too, a trace's identity lookups are driver calls that `driver_calls`
/// must count (the statistics say pass-through's `driver_calls` is exact, and 6a0bc87 says the
/// trace's lookups are counted): the same user-stream pairs, traced and not, change
/// `driver_calls` by exactly the calls the device saw.
#[test]
fn passthrough_trace_lookups_are_counted_in_driver_calls() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = Allocator::new(spy.clone(), common::parse(PASSTHROUGH)).unwrap();
    let user = sim.create_stream();
    let ukey = key(&sim, user);
    let p = path("pt-counted");
    let pairs = |a: &Allocator| {
        for i in 0..32usize {
            let n = 4096 + i * 256;
            let q = a.allocate(n, user).unwrap();
            a.deallocate(q, n, user).unwrap();
        }
    };
    pairs(&a);
    let phase = |traced: bool| {
        if traced {
            a.start_trace(&p).unwrap();
        }
        let (c0, d0) = (spy.calls(), a.stats().driver_calls);
        pairs(&a);
        let (c1, d1) = (spy.calls(), a.stats().driver_calls);
        if traced {
            a.stop_trace().unwrap();
        }
        (c1 - c0, d1 - d0)
    };
    let (plain_calls, plain_counted) = phase(false);
    assert_eq!(plain_counted, plain_calls, "untraced: counted {plain_counted}, device saw {plain_calls}");
    let (traced_calls, traced_counted) = phase(true);
    assert!(traced_calls > plain_calls, "the trace asked no identity");
    assert_eq!(
        traced_counted, traced_calls,
        "traced pass-through pairs: driver_calls rose by {traced_counted}, the device saw {traced_calls} \
         calls (untraced: {plain_counted} and {plain_calls})"
    );
    let recs = take(&p);
    assert_eq!(recs.len(), 64);
    assert!(recs.iter().all(|r| r.stream.0 == ukey), "{recs:?}");
    sim.destroy_stream(user).unwrap();
}

/// Normal mode, one thread, a trace running over every kind of stream and path (arena, large
/// block, pool), cross-stream frees, refused frees, out of memory with its reclaim, a flush, a
/// trim, a user stream destroyed and its handle reused: after each step `driver_calls` has
/// risen by exactly the calls the device saw (`stats.rs`: exact; the drop is the only
/// exception). The same steps untraced too.
#[test]
fn traced_steps_on_every_stream_kind_count_exactly_the_device_calls() {
    for traced in [false, true] {
        let sim = common::host(0);
        let spy = Spy::new(&sim);
        let cfg = common::small().large_max(512 << 10).max_bytes(24 << 20).build().unwrap();
        let a = Allocator::new(spy.clone(), cfg).unwrap();
        let p = path(if traced { "exact-traced" } else { "exact-plain" });
        if traced {
            a.start_trace(&p).unwrap();
        }
        let mut bad = Vec::new();
        let mut step = |what: &str, f: &mut dyn FnMut()| {
            let (c0, d0) = (spy.calls(), a.stats().driver_calls);
            f();
            let (c1, d1) = (spy.calls(), a.stats().driver_calls);
            if d1 < d0 || d1 - d0 != c1 - c0 {
                bad.push(format!("{what}: driver_calls {d0} -> {d1}, device calls {c0} -> {c1}"));
            }
        };
        let (u1, u2) = (sim.create_stream(), sim.create_stream());
        let streams = [Stream::PER_THREAD, Stream::LEGACY, u1, u2];
        let sizes = [4096usize, 48 << 10, 200 << 10, 2 << 20];
        let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
        for (i, &s) in streams.iter().enumerate() {
            for &n in &sizes {
                step(&format!("allocate {n} on stream #{i}"), &mut || {
                    held.push((a.allocate(n, s).unwrap(), n, s));
                });
            }
        }
        // Frees on the next stream (cross-stream), then on their own.
        for (j, (q, n, s)) in std::mem::take(&mut held).into_iter().enumerate() {
            let other = streams[(streams.iter().position(|&x| x == s).unwrap() + 1) % 4];
            let on = if j % 2 == 0 { other } else { s };
            step(&format!("free {n} (#{j})"), &mut || a.deallocate(q, n, on).unwrap());
        }
        step("a refused free", &mut || {
            assert!(a.deallocate(DeviceAddr(0x10), 4096, u1).is_err());
        });
        step("flush", &mut || a.flush().unwrap());
        // Out of memory: fill the cap with pool blocks, then ask more.
        let mut big = Vec::new();
        step("fill to the cap", &mut || {
            loop {
                match a.allocate(1 << 20, u1) {
                    Ok(q) => big.push(q),
                    Err(Error::OutOfMemory { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
        });
        step("out of memory on the legacy stream", &mut || {
            assert!(matches!(a.allocate(1 << 20, Stream::LEGACY), Err(Error::OutOfMemory { .. })));
        });
        for q in big.drain(..) {
            step("free a pool block", &mut || a.deallocate(q, 1 << 20, u1).unwrap());
        }
        // A stream destroyed and its handle given to a new one.
        let q = a.allocate(4096, u2).unwrap();
        step("free on u2", &mut || a.deallocate(q, 4096, u2).unwrap());
        sim.synchronize();
        sim.destroy_stream(u2).unwrap();
        let u3 = sim.create_stream();
        assert_eq!(u3, u2, "the simulator reuses the handle");
        step("allocate and free on the reused handle", &mut || {
            let q = a.allocate(8192, u3).unwrap();
            a.deallocate(q, 8192, u3).unwrap();
        });
        step("trim(true)", &mut || {
            a.trim(true).unwrap();
        });
        step("release_thread", &mut || a.release_thread().unwrap());
        if traced {
            a.stop_trace().unwrap();
            let recs = take(&p);
            assert!(recs.len() > 40, "{}", recs.len());
            assert_alternating(&recs, "exact");
        }
        assert!(bad.is_empty(), "traced {traced}: {} steps miscounted:\n{}", bad.len(), bad.join("\n"));
        sim.synchronize();
        sim.destroy_stream(u1).unwrap();
        sim.destroy_stream(u3).unwrap();
        assert_eq!(sim.violations(), Vec::<String>::new());
        assert_all_returned(&a, Some(&sim), 1);
    }
}

/// Identities of user streams in the records: a stream destroyed and its handle given to a new
/// stream gets the new stream's identity, never the old one's; a free on a handle whose stream
/// is gone (no stream has it) is recorded with 0, never a stale identity.
#[test]
fn records_name_the_stream_a_reused_handle_names_now() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = Allocator::new(spy.clone(), common::small().build().unwrap()).unwrap();
    let p = path("reused");
    a.start_trace(&p).unwrap();
    let mut expect: Vec<(u64, Action, u64)> = Vec::new();
    let s = sim.create_stream();
    let mut handle_keys = Vec::new();
    for round in 0..4usize {
        let cur = sim.create_stream();
        assert_eq!(cur, if round == 0 { cur } else { s }, "handle reuse");
        let k = key(&sim, cur);
        handle_keys.push(k);
        let n = 4096 + round * 256;
        let q = a.allocate(n, cur).unwrap();
        a.deallocate(q, n, cur).unwrap();
        expect.push((q.0, Action::Alloc, k));
        expect.push((q.0, Action::Free, k));
        sim.synchronize();
        sim.destroy_stream(cur).unwrap();
        if round == 0 {
            sim.destroy_stream(s).unwrap(); // from now on `cur` handles are `s`'s
        }
    }
    let ks: HashSet<u64> = handle_keys.iter().copied().collect();
    assert_eq!(ks.len(), handle_keys.len(), "every new stream has a new identity");
    // A block of a live stream freed on a dead handle.
    let live = sim.create_stream();
    let q = a.allocate(4096, live).unwrap();
    let dead = sim.create_stream();
    sim.destroy_stream(dead).unwrap();
    let r = a.deallocate(q, 4096, dead);
    a.stop_trace().unwrap();
    let recs = take(&p);
    for (ptr, action, k) in &expect {
        let r: Vec<&Record> = recs.iter().filter(|r| r.ptr == *ptr && r.action == *action).collect();
        assert!(!r.is_empty(), "no {action:?} of {ptr:#x}: {recs:?}");
        assert!(r.iter().any(|r| r.stream.0 == *k), "{action:?} of {ptr:#x}: {r:?}, want stream {k:#x}");
    }
    let on_dead: Vec<&Record> = recs
        .iter()
        .filter(|r| r.ptr == q.0 && matches!(r.action, Action::Free | Action::RefusedFree))
        .collect();
    assert_eq!(on_dead.len(), 1, "{recs:?}");
    assert_eq!(on_dead[0].stream.0, 0, "a free on a dead handle ({r:?}): {:?}", on_dead[0]);
    assert!(!ks.contains(&on_dead[0].stream.0));
    if r.is_err() {
        a.deallocate(q, 4096, live).unwrap();
    }
    sim.synchronize();
    sim.destroy_stream(live).unwrap();
    assert_eq!(sim.violations(), Vec::<String>::new());
    assert!(sim.take_stale_handle_calls() > 0, "the test's free on a dead handle");
    assert_all_returned(&a, Some(&sim), 0);
}

/// While a thread's per-thread stream is being captured its identity cannot be asked (the
/// device refuses it): the record made meanwhile carries 0, and the 0 is not kept, so the
/// records after the capture carry the real identity. The capture is not broken.
#[test]
fn a_per_thread_identity_refused_during_a_capture_is_asked_again_after_it() {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = Allocator::new(spy.clone(), common::small().build().unwrap()).unwrap();
    let p = path("ptds-zero");
    a.start_trace(&p).unwrap();
    let (a2, sim2) = (a.clone(), sim.clone());
    let (during, after, ptds, ended) = std::thread::spawn(move || {
        sim2.begin_capture(Stream::PER_THREAD).unwrap();
        let during = a2.allocate(4096, Stream::PER_THREAD);
        let ended = sim2.end_capture(Stream::PER_THREAD);
        let ptds = key(&sim2, Stream::PER_THREAD);
        let q = a2.allocate(8192, Stream::PER_THREAD).unwrap();
        a2.deallocate(q, 8192, Stream::PER_THREAD).unwrap();
        if let Ok(d) = during {
            a2.deallocate(d, 4096, Stream::PER_THREAD).unwrap();
        }
        a2.release_thread().unwrap();
        (during, q, ptds, ended)
    })
    .join()
    .unwrap();
    a.stop_trace().unwrap();
    let recs = take(&p);
    assert_eq!(ended, Ok(()), "the capture was broken");
    let first = recs.iter().filter(|r| r.size == 4096).min_by_key(|r| r.time_ns).unwrap();
    assert_eq!(first.stream.0, 0, "during the capture ({during:?}): {first:?}");
    for r in recs.iter().filter(|r| r.ptr == after.0) {
        assert_eq!(r.stream.0, ptds, "after the capture the identity is asked again: {r:?}");
    }
    assert_eq!(recs.iter().filter(|r| r.ptr == after.0).count(), 2, "{recs:?}");
    assert_eq!(sim.violations(), Vec::<String>::new());
    assert_all_returned(&a, Some(&sim), 0);
}

/// A block freed from a thread-local destructor that runs after the thread's trace buffer and
/// slots are gone (late destructors; also an allocation there): recorded as `LATE_THREAD`
/// with the stream's real identity, and every device call of the thread's whole life, the late
/// records' lookups too, is counted in `driver_calls`.
#[test]
fn late_destructor_records_name_their_streams_and_their_lookups_are_counted() {
    struct AtExit(Vec<(Allocator, DeviceAddr, usize, Stream)>);
    impl Drop for AtExit {
        fn drop(&mut self) {
            for (a, p, n, s) in self.0.drain(..) {
                a.deallocate(p, n, s).unwrap();
                let q = a.allocate(n + 256, s).unwrap();
                a.deallocate(q, n + 256, s).unwrap();
                LATE_DONE.fetch_add(1, SeqCst);
            }
        }
    }
    thread_local! {
        static AT_EXIT: RefCell<AtExit> = const { RefCell::new(AtExit(Vec::new())) };
    }
    static LATE_DONE: AtomicUsize = AtomicUsize::new(0);

    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = Allocator::new(spy.clone(), common::small().build().unwrap()).unwrap();
    let user = sim.create_stream();
    let (ukey, lkey) = (key(&sim, user), key(&sim, Stream::LEGACY));
    let p = path("late");
    a.start_trace(&p).unwrap();
    let (c0, d0) = (spy.calls(), a.stats().driver_calls);
    let a2 = a.clone();
    let blocks = std::thread::spawn(move || {
        AT_EXIT.with(|_| {}); // registered first: destroyed after the trace's and slots' locals
        let mut blocks = Vec::new();
        for (n, s) in [(4096usize, user), (8192, Stream::LEGACY), (100 << 10, user)] {
            let q = a2.allocate(n, s).unwrap();
            blocks.push((q, s));
            AT_EXIT.with(|c| c.borrow_mut().0.push((a2.clone(), q, n, s)));
        }
        blocks
    })
    .join()
    .unwrap();
    assert_eq!(LATE_DONE.load(SeqCst), 3, "the late destructor ran");
    let (c1, d1) = (spy.calls(), a.stats().driver_calls);
    a.stop_trace().unwrap();
    let recs = take(&p);
    for (q, s) in &blocks {
        let want = if s.is_legacy() { lkey } else { ukey };
        let frees: Vec<&Record> = recs.iter().filter(|r| r.ptr == q.0 && r.action == Action::Free).collect();
        assert!(!frees.is_empty(), "no free of {q:?}: {recs:?}");
        for r in frees {
            assert_eq!(r.stream.0, want, "{r:?}");
        }
    }
    let late: Vec<&Record> = recs.iter().filter(|r| r.thread == LATE_THREAD).collect();
    assert!(late.len() >= 3, "no late records: {recs:?}");
    for r in &late {
        let want = if r.stream_kind == StreamKind::Legacy { lkey } else { ukey };
        assert_eq!(r.stream.0, want, "{r:?}");
    }
    assert_eq!(
        d1 - d0,
        c1 - c0,
        "over the thread's life: driver_calls {d0} -> {d1}, the device saw {c0} -> {c1}"
    );
    sim.synchronize();
    sim.destroy_stream(user).unwrap();
    assert_eq!(sim.violations(), Vec::<String>::new());
    assert_all_returned(&a, Some(&sim), 0);
}

/// Pass-through mode never asks the legacy stream's identity itself, so every lookup of it is
/// the trace's: none may be made while a capture is announced. Workers make traced
/// legacy-stream pairs (and per-thread and user-stream ones) while the test announces captures
/// and ends them over and over, each round on a fresh allocator (nothing cached yet); the
/// legacy records carry 0 or the real identity, and a thread after the last announcement
/// records the real one.
#[test]
fn passthrough_traces_ask_no_legacy_identity_during_repeated_announcements() {
    let sim = common::host(0);
    let lkey = key(&sim, Stream::LEGACY);
    let user = sim.create_stream();
    for round in 0..12u64 {
        let spy = Spy::new(&sim);
        let a = Allocator::new(spy.clone(), common::parse(PASSTHROUGH)).unwrap();
        let p = path(&format!("pt-announced-{round}"));
        a.start_trace(&p).unwrap();
        a.graph_capture_begin();
        spy.watch.store(true, SeqCst);
        let ops = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, ops, stop) = (a.clone(), ops.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(SeqCst) {
                    let s = match (i + t) % 3 {
                        0 => Stream::LEGACY,
                        1 => Stream::PER_THREAD,
                        _ => user,
                    };
                    let n = 4096 + ((i % 7) as usize) * 256;
                    let q = a.allocate(n, s).unwrap();
                    a.deallocate(q, n, s).unwrap();
                    ops.fetch_add(1, SeqCst);
                    i += 1;
                }
            }));
        }
        for k in 0..6u64 {
            // Each window: until the workers made 40 more pairs.
            let until = ops.load(SeqCst) + 40;
            while ops.load(SeqCst) < until {
                std::thread::yield_now();
            }
            if k % 2 == 0 {
                spy.watch.store(false, SeqCst);
                a.graph_capture_end().unwrap();
            } else {
                a.graph_capture_begin();
                spy.watch.store(true, SeqCst);
            }
        }
        stop.store(true, SeqCst);
        for h in hs {
            h.join().unwrap();
        }
        spy.watch.store(false, SeqCst);
        a.graph_capture_end().unwrap();
        let uses: Vec<String> = spy.legacy_uses().into_iter().filter(|u| u == "stream_key").collect();
        assert!(uses.is_empty(), "round {round}: the legacy identity asked while announced: {uses:?}");
        let a2 = a.clone();
        let last = std::thread::spawn(move || {
            let q = a2.allocate(12288, Stream::LEGACY).unwrap();
            a2.deallocate(q, 12288, Stream::LEGACY).unwrap();
            q
        })
        .join()
        .unwrap();
        a.stop_trace().unwrap();
        let recs = take(&p);
        for r in recs.iter().filter(|r| r.stream_kind == StreamKind::Legacy) {
            assert!(r.stream.0 == 0 || r.stream.0 == lkey, "round {round}: {r:?}");
        }
        let l: Vec<&Record> = recs.iter().filter(|r| r.ptr == last.0 && r.size == 12288).collect();
        assert!(!l.is_empty());
        for r in l {
            assert_eq!(r.stream.0, lkey, "round {round}: after the announcements: {r:?}");
        }
        assert_alternating(&recs, "announced");
        assert_eq!(sim.violations(), Vec::<String>::new());
        assert_eq!(a.stats().live_bytes, 0);
    }
    sim.synchronize();
    sim.destroy_stream(user).unwrap();
}

/// Traces started and stopped over and over while threads allocate and free on every kind of
/// stream: every record's identity is the right one for its kind (the legacy stream's, the
/// recording thread's own per-thread stream's, one of the user streams'), none is 0 (nothing
/// is captured or announced), and `driver_calls`, read meanwhile, never goes down.
#[test]
fn traces_started_and_stopped_during_work_on_every_stream_kind_carry_right_identities() {
    const THREADS: usize = 6;
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let cfg = common::small().large_max(256 << 10).build().unwrap();
    let a = Allocator::new(spy.clone(), cfg).unwrap();
    let lkey = key(&sim, Stream::LEGACY);
    let shared = sim.create_stream();
    let mut user_keys: HashSet<u64> = [key(&sim, shared)].into();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(THREADS + 1));
    let mut hs = Vec::new();
    let mut own_streams = Vec::new();
    for t in 0..THREADS {
        let own = sim.create_stream();
        own_streams.push(own);
        user_keys.insert(key(&sim, own));
        let (a, stop, start, sim) = (a.clone(), stop.clone(), start.clone(), sim.clone());
        hs.push(std::thread::spawn(move || {
            let ptds = key(&sim, Stream::PER_THREAD);
            start.wait();
            let mut x = t as u64 * 7919 + 3;
            let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
            while !stop.load(SeqCst) {
                let s = match common::rng(&mut x) % 4 {
                    0 => Stream::LEGACY,
                    1 => Stream::PER_THREAD,
                    2 => shared,
                    _ => own,
                };
                let n = match common::rng(&mut x) % 4 {
                    0 => 200 << 10,
                    1 => 600 << 10,
                    _ => 256 + (common::rng(&mut x) % 16384) as usize,
                };
                held.push((a.allocate(n, s).unwrap(), n, s));
                if held.len() > 8 {
                    let (q, n, s) = held.swap_remove((common::rng(&mut x) % 8) as usize);
                    // Freed on its own stream: no ordering is asked of the test.
                    a.deallocate(q, n, s).unwrap();
                }
            }
            for (q, n, s) in held {
                a.deallocate(q, n, s).unwrap();
            }
            a.release_thread().unwrap();
            ptds
        }));
    }
    let monitor = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut last = 0;
            while !stop.load(SeqCst) {
                let d = a.stats().driver_calls;
                assert!(d >= last, "driver_calls went down: {last} -> {d}");
                last = d;
            }
        })
    };
    start.wait();
    let mut traces = Vec::new();
    for k in 0..8 {
        let p = path(&format!("startstop-{k}"));
        a.start_trace(&p).unwrap();
        // Until some records are made (a few thousand device calls pass).
        let until = spy.calls() + 2000;
        while spy.calls() < until {
            std::thread::yield_now();
        }
        a.stop_trace().unwrap();
        traces.push(p);
    }
    stop.store(true, SeqCst);
    let ptds: HashSet<u64> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    monitor.join().unwrap();
    assert_eq!(ptds.len(), THREADS);
    let mut total = 0;
    for p in traces {
        let recs = take(&p);
        total += recs.len();
        let mut per_thread: BTreeMap<u32, u64> = BTreeMap::new();
        for r in &recs {
            match r.stream_kind {
                StreamKind::Legacy => assert_eq!(r.stream.0, lkey, "{r:?}"),
                StreamKind::PerThread => {
                    assert!(ptds.contains(&r.stream.0), "{r:?}: not a worker's per-thread stream");
                    let k = *per_thread.entry(r.thread).or_insert(r.stream.0);
                    assert_eq!(k, r.stream.0, "{r:?}: one thread, two per-thread identities");
                }
                StreamKind::User => assert!(user_keys.contains(&r.stream.0), "{r:?}"),
            }
        }
        assert_alternating(&recs, "start/stop");
    }
    assert!(total > 0);
    sim.synchronize();
    sim.destroy_stream(shared).unwrap();
    for s in own_streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_eq!(sim.violations(), Vec::<String>::new());
    assert_all_returned(&a, Some(&sim), 0);
}

/// A device that carves its memory out of another allocator's blocks on the legacy stream.
struct Carved {
    sim: HostDevice,
    backing: Allocator,
    blocks: Mutex<BTreeMap<u64, (DeviceAddr, usize)>>,
    reserves: AtomicU64,
    releases: AtomicU64,
}

const GRAIN: u64 = 2 << 20;

impl Interpose for Carved {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn total_memory(&self) -> CuResult<usize> {
        Ok(64 << 20)
    }
    fn reserve(&self, bytes: usize) -> CuResult<Option<u64>> {
        let n = bytes + GRAIN as usize;
        let p = match self.backing.allocate(n, Stream::LEGACY) {
            Ok(p) => p,
            Err(Error::OutOfMemory { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.reserves.fetch_add(1, SeqCst);
        let base = p.0.next_multiple_of(GRAIN);
        self.blocks.lock().unwrap().insert(base, (p, n));
        Ok(Some(base))
    }
    unsafe fn release(&self, ptr: u64, _bytes: usize) -> CuResult<()> {
        let (p, n) =
            self.blocks.lock().unwrap().remove(&ptr).ok_or(Error::Driver { call: "release", code: 1 })?;
        self.releases.fetch_add(1, SeqCst);
        self.backing.deallocate(p, n, Stream::LEGACY)
    }
}

/// Nested allocators, both traced: A's device carves from B. Each trace holds exactly its own
/// allocator's calls (B's: one allocation per carve, one free per release, on the legacy
/// stream, with its identity), records alternate, and A's `driver_calls` rose by exactly the
/// calls A's device saw.
#[test]
fn nested_allocators_both_traced_record_their_own_calls_and_count_them() {
    let sim = common::host(0);
    let b = Allocator::new(Arc::new(sim.clone()), common::small().build().unwrap()).unwrap();
    let carved = Arc::new(Interposed(Carved {
        sim: sim.clone(),
        backing: b.clone(),
        blocks: Mutex::new(BTreeMap::new()),
        reserves: AtomicU64::new(0),
        releases: AtomicU64::new(0),
    }));
    let spy = Spy::over(carved.clone());
    let a = Allocator::new(spy.clone(), common::small().large_max(256 << 10).build().unwrap()).unwrap();
    let (pa, pb) = (path("nested-a"), path("nested-b"));
    let lkey = key(&sim, Stream::LEGACY);
    let user = sim.create_stream();
    let ukey = key(&sim, user);
    a.start_trace(&pa).unwrap();
    b.start_trace(&pb).unwrap();
    let (c0, d0) = (spy.calls(), a.stats().driver_calls);
    let mut a_ops = 0;
    for round in 0..3usize {
        let mut held = Vec::new();
        for (i, s) in [Stream::PER_THREAD, Stream::LEGACY, user].into_iter().enumerate() {
            for n in [4096usize, 100 << 10, 1 << 20, 3 << 20] {
                let n = n + round * 256 + i;
                held.push((a.allocate(n, s).unwrap(), n, s));
                a_ops += 1;
            }
        }
        for (q, n, s) in held {
            a.deallocate(q, n, s).unwrap();
            a_ops += 1;
        }
        a.trim(true).unwrap();
    }
    let (c1, d1) = (spy.calls(), a.stats().driver_calls);
    b.stop_trace().unwrap();
    a.stop_trace().unwrap();
    let (ra, rb) = (take(&pa), take(&pb));
    assert_eq!(d1 - d0, c1 - c0, "A: driver_calls {d0} -> {d1}, its device saw {c0} -> {c1}");
    assert_eq!(ra.len(), a_ops, "A's trace: {ra:?}");
    assert_alternating(&ra, "A");
    for r in &ra {
        let want = match r.stream_kind {
            StreamKind::Legacy => lkey,
            StreamKind::User => ukey,
            StreamKind::PerThread => key(&sim, Stream::PER_THREAD),
        };
        assert_eq!(r.stream.0, want, "A: {r:?}");
    }
    let (reserves, releases) = (carved.reserves.load(SeqCst), carved.releases.load(SeqCst));
    assert!(reserves > 0 && releases > 0);
    let allocs = rb.iter().filter(|r| r.action == Action::Alloc).count() as u64;
    let frees = rb.iter().filter(|r| r.action == Action::Free).count() as u64;
    assert_eq!((allocs, frees), (reserves, releases), "B's trace: {rb:?}");
    for r in &rb {
        assert_eq!((r.stream_kind, r.stream.0), (StreamKind::Legacy, lkey), "B: {r:?}");
    }
    assert_alternating(&rb, "B");
    drop(a);
    sim.synchronize();
    sim.destroy_stream(user).unwrap();
    assert_eq!(sim.violations(), Vec::<String>::new());
}

// ---------------------------------------------------------------------------------------------
// 2. Pass-through `deallocate_used_on`.

/// A pass-through allocator over a fresh `Spy`.
fn passthrough() -> (HostDevice, Arc<Interposed<Spy>>, Allocator) {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let a = Allocator::new(spy.clone(), common::parse(PASSTHROUGH)).unwrap();
    (sim, spy, a)
}

/// A free declared used on other streams is a free like any other for the trace: recorded as a
/// free (and a refused one as refused), in pass-through mode as in the normal mode.
fn free_used_on_is_traced(cfg: Config, name: &str) {
    let sim = common::host(0);
    let a = Allocator::new(Arc::new(sim.clone()), cfg).unwrap();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let p = path(name);
    a.start_trace(&p).unwrap();
    let q = a.allocate(4096, s1).unwrap();
    a.deallocate_used_on(q, 4096, s2, &[s1]).unwrap();
    let r = a.deallocate_used_on(q, 4096, s2, &[s1]);
    assert!(common::is_double(&r), "{r:?}");
    a.stop_trace().unwrap();
    let mut recs: Vec<Record> = take(&p).into_iter().filter(|r| r.ptr == q.0).collect();
    recs.sort_by_key(|r| r.time_ns);
    let actions: Vec<Action> = recs.iter().map(|r| r.action).collect();
    assert_eq!(
        actions,
        [Action::Alloc, Action::Free, Action::RefusedFree],
        "{name}: a free with used_on and a refused one: {recs:?}"
    );
    sim.synchronize();
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
}

#[test]
fn a_free_used_on_other_streams_is_traced_in_the_normal_mode() {
    free_used_on_is_traced(common::small().build().unwrap(), "used-on-normal");
}

#[test]
fn a_free_used_on_other_streams_is_traced_in_passthrough_mode() {
    free_used_on_is_traced(common::parse(PASSTHROUGH), "used-on-passthrough");
}

/// A failure injected at every driver call `deallocate_used_on` makes (the capture checks and
/// identities of the free's stream and of each declared stream, each fence's record, poll and
/// wait, the free itself), with the declared streams a user stream, the per-thread stream, the free's own
/// stream and the legacy stream: each attempt fails with that error, frees nothing, leaks no
/// event, and `driver_calls` rises by exactly the calls the device saw; the block is then freed
/// whole, once.
#[test]
fn passthrough_free_used_on_fails_cleanly_at_every_call() {
    let (sim, spy, a) = passthrough();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    // s1's work held: its fences stay pending, so the free's stream waits on them (a fence seen
    // complete is not waited on, and whether one is would depend on the device's timing).
    let gate = sim.gate(s1).unwrap();
    let used_on = [s1, Stream::PER_THREAD, s2, Stream::LEGACY];
    let mut failures = 0;
    let mut failed = std::collections::BTreeSet::new();
    let mut k = 0u64;
    loop {
        let q = a.allocate(4096, s1).unwrap();
        let (c0, d0) = (spy.calls(), a.stats().driver_calls);
        let (e0, f0) = (sim.live_events(), spy.frees.load(SeqCst));
        spy.fail_at.store(c0 + k, SeqCst);
        let r = a.deallocate_used_on(q, 4096, s2, &used_on);
        spy.fail_at.store(u64::MAX, SeqCst);
        let (c1, d1) = (spy.calls(), a.stats().driver_calls);
        let what = format!("failing call #{k} ({r:?})");
        assert_eq!(d1 - d0, c1 - c0, "{what}: driver_calls {d0} -> {d1}, device {c0} -> {c1}");
        assert_eq!(sim.live_events(), e0, "{what}: an event leaked");
        match r {
            Err(Error::Driver { code: 999, call }) => {
                failures += 1;
                failed.insert(call);
                assert_eq!(spy.frees.load(SeqCst), f0, "{what}: freed");
                assert_eq!(a.stats().live_bytes, 4096, "{what}: the block left");
                a.deallocate_used_on(q, 4096, s2, &used_on).unwrap();
            }
            // The chosen call was the destroy (which cannot fail), or past the last.
            Ok(()) => assert_eq!(spy.frees.load(SeqCst), f0 + 1, "{what}"),
            Err(e) => panic!("{what}: {e}"),
        }
        let r = a.deallocate_used_on(q, 4096, s2, &used_on);
        assert!(common::is_double(&r), "{what}: then {r:?}");
        assert_eq!(a.stats().live_bytes, 0, "{what}");
        if c1 - c0 <= k {
            break; // the chosen call was past the last: every call has been failed once
        }
        k += 1;
    }
    // Every kind of call the free makes was failed at least once: the capture checks of the
    // free's stream and the declared ones, their identities, the fences' records, polls and
    // waits (s2 is the free's own stream: none for it), the free itself. How many calls an
    // attempt makes depends on the fences earlier attempts left (a stream's latest is reused).
    let kinds = ["stream_capturing", "stream_key", "record_event", "stream_wait_event", "free_async"];
    for kind in kinds {
        assert!(failed.contains(kind), "no {kind} failed: {failed:?} over {failures} failures");
    }
    gate.open();
    sim.synchronize();
    assert_eq!(sim.violations(), Vec::<String>::new());
    let st = a.stats();
    assert_eq!((st.live_bytes, st.deallocations, st.invalid_frees), (0, k + 1, k + 1), "{st:?}");
    assert_eq!(sim.reserved_bytes(), 0);
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
}

/// The event counters of pass-through `deallocate_used_on` stay exact when an ordering fails
/// part-way: `fences_recorded` (events recorded as fences) and `fence_waits` equal the records
/// and waits the device carried out.
#[test]
fn passthrough_fence_counters_match_the_records_and_waits_made() {
    // The wait is found by failing each call in turn, each try on a fresh allocator (the calls
    // before it, capture checks, identities, the event's create and record, then succeed).
    let (sim, spy, a, s1, s2, q) = (0..16u64)
        .find_map(|k| {
            let (sim, spy, a) = passthrough();
            let (s1, s2) = (sim.create_stream(), sim.create_stream());
            let q = a.allocate(4096, s1).unwrap();
            // s1's work held, so its fence is pending and waited on (not seen complete).
            let gate = sim.gate(s1).unwrap();
            spy.fail_at.store(spy.calls() + k, SeqCst);
            let r = a.deallocate_used_on(q, 4096, s2, &[s1]);
            spy.fail_at.store(u64::MAX, SeqCst);
            gate.open();
            matches!(r, Err(Error::Driver { call: "stream_wait_event", .. }))
                .then_some((sim, spy, a, s1, s2, q))
        })
        .expect("no call of the free was its wait");
    a.deallocate_used_on(q, 4096, s2, &[s1]).unwrap();
    let st = a.stats();
    let (records, waits) = (spy.records.load(SeqCst), spy.waits.load(SeqCst));
    assert_eq!(
        (st.fences_recorded, st.fence_waits),
        (records, waits),
        "fences_recorded, fence_waits against the records and waits the device made"
    );
    sim.synchronize();
    assert_eq!(sim.violations(), Vec::<String>::new());
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
}

/// Declared streams that are the free's own (the same handle, or the per-thread stream named
/// both ways) need no event; a destroyed stream, declared or freed on, fails the free, which
/// loses nothing: the block is freed afterwards, once.
#[test]
fn passthrough_free_used_on_same_and_destroyed_streams() {
    let (sim, spy, a) = passthrough();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let dead = sim.create_stream();
    sim.destroy_stream(dead).unwrap();
    let q1 = a.allocate(4096, s1).unwrap();
    let ev = |a: &Allocator| {
        let st = a.stats();
        (st.fences_recorded, st.fence_waits)
    };
    let (e0, w0, r0) = (ev(&a), spy.waits.load(SeqCst), spy.records.load(SeqCst));
    a.deallocate_used_on(q1, 4096, s1, &[s1, s1]).unwrap();
    let q2 = a.allocate(4096, Stream::PER_THREAD).unwrap();
    a.deallocate_used_on(q2, 4096, Stream::PER_THREAD, &[Stream::PER_THREAD]).unwrap();
    assert_eq!(ev(&a), e0, "no event for the free's own stream");
    let q3 = a.allocate(8192, s1).unwrap();
    for (stream, used_on) in
        [(s2, vec![dead]), (s2, vec![s1, dead]), (dead, vec![s1]), (s2, vec![Stream::LEGACY, dead])]
    {
        let (c0, d0, f0) = (spy.calls(), a.stats().driver_calls, spy.frees.load(SeqCst));
        let r = a.deallocate_used_on(q3, 8192, stream, &used_on);
        assert!(matches!(r, Err(Error::Driver { .. })), "{stream:?} {used_on:?}: {r:?}");
        let (c1, d1) = (spy.calls(), a.stats().driver_calls);
        assert_eq!(d1 - d0, c1 - c0, "{stream:?} {used_on:?}: {r:?}");
        assert_eq!(spy.frees.load(SeqCst), f0);
        assert_eq!(a.stats().live_bytes, 8192);
    }
    assert_eq!(sim.live_events(), 0, "an event leaked");
    // The failed frees recorded and waited on nothing: every declared stream's capture check
    // comes before any ordering, and a dead stream fails there, so a refused free changes nothing.
    assert_eq!((spy.records.load(SeqCst), spy.waits.load(SeqCst)), (r0, w0), "a failed free ordered");
    // s1's work held, so its fence is pending and waited on.
    let gate = sim.gate(s1).unwrap();
    a.deallocate_used_on(q3, 8192, s2, &[s1, Stream::PER_THREAD, Stream::LEGACY]).unwrap();
    gate.open();
    // Three fences, one a declared stream, each counted once; a wait for each not already seen
    // complete (`Fence::order_before` polls first): s1's at least; the others' by timing.
    let (r, w) = (spy.records.load(SeqCst) - r0, spy.waits.load(SeqCst) - w0);
    assert_eq!(r, 3);
    assert!((1..=3).contains(&w), "{w} waits for 3 fences, one of them pending");
    assert_eq!(ev(&a), (e0.0 + r, e0.1 + w));
    let r = a.deallocate_used_on(q3, 8192, s2, &[dead]);
    assert!(common::is_double(&r), "a double free refused first: {r:?}");
    // A bad free makes no call, even with a dead stream declared.
    let c = spy.calls();
    let r = a.deallocate_used_on(DeviceAddr(q3.0 + 256), 8192, dead, &[dead]);
    assert_eq!(
        r.err(),
        Some(Error::InvalidFree { ptr: q3.0 + 256, size: 8192, reason: InvalidFree::UnknownPointer })
    );
    assert_eq!(spy.calls(), c);
    sim.synchronize();
    assert_eq!(sim.violations(), Vec::<String>::new());
    let st = a.stats();
    assert_eq!((st.live_bytes, st.deallocations, st.invalid_frees), (0, 3, 2), "{st:?}");
    assert_eq!(sim.reserved_bytes(), 0);
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
}

/// Threads racing to free one block with `deallocate_used_on` (and one with a plain free): the
/// block is freed exactly once on the device, every loser is refused as a double free (counted),
/// and every call made, the losers' orderings too, is counted.
#[test]
fn passthrough_racing_frees_with_used_on_free_the_block_once() {
    const THREADS: usize = 4;
    let (sim, spy, a) = passthrough();
    let streams: Vec<Stream> = (0..THREADS).map(|_| sim.create_stream()).collect();
    for round in 0..200usize {
        let n = 4096 + (round % 5) * 256;
        let q = a.allocate(n, streams[0]).unwrap();
        let before = (spy.calls(), a.stats(), spy.frees.load(SeqCst));
        let go = Arc::new(Barrier::new(THREADS));
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, go, streams) = (a.clone(), go.clone(), streams.clone());
                std::thread::spawn(move || {
                    go.wait();
                    if t == THREADS - 1 {
                        a.deallocate(q, n, streams[t])
                    } else {
                        let others: Vec<Stream> =
                            streams.iter().copied().filter(|&s| s != streams[t]).collect();
                        a.deallocate_used_on(q, n, streams[t], &others)
                    }
                })
            })
            .collect();
        let rs: Vec<CuResult<()>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let ok = rs.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 1, "round {round}: {rs:?}");
        assert!(rs.iter().all(|r| r.is_ok() || common::is_double(r)), "round {round}: {rs:?}");
        let after = (spy.calls(), a.stats(), spy.frees.load(SeqCst));
        assert_eq!(after.2 - before.2, 1, "round {round}: freed {} times", after.2 - before.2);
        assert_eq!(after.1.invalid_frees - before.1.invalid_frees, (THREADS - 1) as u64);
        assert_eq!(
            after.1.driver_calls - before.1.driver_calls,
            after.0 - before.0,
            "round {round}: every call counted"
        );
        assert_eq!(after.1.live_bytes, 0);
    }
    sim.synchronize();
    assert_eq!(sim.violations(), Vec::<String>::new());
    assert_eq!(sim.reserved_bytes(), 0);
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
}

/// `deallocate_used_on` declaring the legacy stream, on a user stream, while a capture is
/// announced (`graph_capture_begin`): the legacy stream is not used (README, "CUDA graphs":
/// while a capture is announced, uses of the legacy stream outside calls on it are refused and
/// avoided; `cuStreamGetId` of it would break a capture of a blocking stream begun at any
/// moment). Here the announced capture, of a per-thread stream, begins right after the legacy
/// stream's identity is asked. The free is refused (`StreamCapturing`, nothing changed, freed
/// after the capture) or made without the legacy stream; the capture ends intact.
fn used_on_legacy_during_an_announced_capture(passthrough: bool) {
    let sim = common::host(0);
    let spy = Spy::new(&sim);
    let cfg = if passthrough { common::parse(PASSTHROUGH) } else { common::small().build().unwrap() };
    let a = Allocator::new(spy.clone(), cfg).unwrap();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let q = a.allocate(4096, s1).unwrap();
    let capturer = Capturer::new(&sim);
    let began = Arc::new(AtomicBool::new(false));
    a.graph_capture_begin();
    spy.watch.store(true, SeqCst);
    {
        let (capturer, began) = (capturer.clone(), began.clone());
        *spy.after_legacy_key.lock().unwrap() = Some(Box::new(move || {
            capturer.lock().unwrap().call(true).unwrap();
            began.store(true, SeqCst);
        }));
    }
    let r = a.deallocate_used_on(q, 4096, s2, &[Stream::LEGACY]);
    spy.watch.store(false, SeqCst);
    spy.after_legacy_key.lock().unwrap().take();
    let ended = if began.load(SeqCst) { capturer.lock().unwrap().call(false) } else { Ok(()) };
    a.graph_capture_end().unwrap();
    let uses = spy.legacy_uses();
    let mode = if passthrough { "pass-through" } else { "normal" };
    assert!(
        uses.is_empty() && ended.is_ok() && sim.violations().is_empty(),
        "{mode}: the legacy stream used while a capture was announced: {uses:?}; the free: {r:?}; \
         the capture's end: {ended:?}; violations: {:?}",
        sim.violations()
    );
    match r {
        Ok(()) => assert_eq!(a.stats().live_bytes, 0),
        Err(Error::StreamCapturing { .. }) => {
            a.deallocate_used_on(q, 4096, s2, &[Stream::LEGACY]).unwrap();
        }
        Err(e) => panic!("{mode}: {e}"),
    }
    sim.synchronize();
    sim.destroy_stream(s1).unwrap();
    sim.destroy_stream(s2).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn normal_free_used_on_the_legacy_stream_during_an_announced_capture_spares_it() {
    used_on_legacy_during_an_announced_capture(false);
}

#[test]
fn passthrough_free_used_on_the_legacy_stream_during_an_announced_capture_spares_it() {
    used_on_legacy_during_an_announced_capture(true);
}
