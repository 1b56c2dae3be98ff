//! Allocation traces (`src/trace.rs`): every allocate and free recorded, none lost with many
//! threads (exiting before the stop, alive at it, or recording while it happens), the format
//! read back, and bad use refused.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Barrier};

use cuarena::trace::{self, Action, StreamKind, TracePath};
use cuarena::{Allocator, Config, DeviceAddr, Error, Stream};

fn path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cuarena-trace-{}-{name}.bin", std::process::id()))
}

fn alloc_on(dev: Arc<cuarena_testkit::HostDevice>, cfg: Config) -> Allocator {
    Allocator::new(dev, cfg).unwrap()
}

/// Per address, in time order, the actions alternate alloc, free (a free is stamped before it
/// runs and an allocation after it returns). An address may start with a free: a block
/// allocated before the trace started.
fn assert_alternating(recs: &[trace::Record]) {
    let mut sorted: Vec<&trace::Record> = recs.iter().collect();
    sorted.sort_by_key(|r| r.time_ns);
    let mut live: HashMap<u64, bool> = HashMap::new();
    for r in sorted {
        match r.action {
            Action::Alloc => {
                assert!(!live.insert(r.ptr, true).unwrap_or(false), "{r:?}: allocated while live")
            }
            Action::Free => assert!(live.insert(r.ptr, false).unwrap_or(true), "{r:?}: freed while not live"),
            _ => {}
        }
    }
}

#[test]
fn many_threads_lose_no_record_whether_they_exit_before_the_stop_or_not() {
    let dev = Arc::new(common::host(0));
    // large_max 128 KiB: 100 KiB blocks come from large superblocks, 200 KiB ones from the pool.
    let a = alloc_on(dev.clone(), common::small().large_max(128 << 10).build().unwrap());
    let p = path("many");
    a.start_trace(&p).unwrap();
    const THREADS: usize = 12;
    const PAIRS: usize = 3000; // x2 records: more than one buffer per thread
    let done = Arc::new(Barrier::new(THREADS + 1));
    let stopped = Arc::new(Barrier::new(THREADS / 2 + 1));
    let user = dev.create_stream();
    let mut hs = Vec::new();
    for t in 0..THREADS {
        let (a, done, stopped) = (a.clone(), done.clone(), stopped.clone());
        hs.push(std::thread::spawn(move || {
            let mut x = t as u64 * 7919 + 1;
            let mut held = Vec::new();
            for i in 0..PAIRS {
                // Small and large ones come from the thread's arenas, the largest from the pool.
                let size = match common::rng(&mut x) % 8 {
                    0 => 200 << 10,
                    1 => 100 << 10,
                    _ => 64 + (x % 4000) as usize,
                };
                let stream = [Stream::PER_THREAD, Stream::LEGACY, user][i % 3];
                let p = a.allocate(size, stream).unwrap();
                held.push((p, size, stream));
                if held.len() > 8 {
                    let (p, size, stream) = held.remove((x % 8) as usize);
                    a.deallocate(p, size, stream).unwrap();
                }
            }
            for (p, size, stream) in held {
                a.deallocate(p, size, stream).unwrap();
            }
            // One refused free per thread.
            assert!(a.deallocate(DeviceAddr(0x10), 256, Stream::PER_THREAD).is_err());
            done.wait();
            if t % 2 == 0 {
                stopped.wait(); // alive at the stop: its last buffer is collected without it
            }
        }));
    }
    done.wait();
    // Half the threads exit first (their buffers written at exit), half stay alive.
    for (t, h) in hs.iter().enumerate() {
        if t % 2 == 1 {
            while !h.is_finished() {
                std::thread::yield_now();
            }
        }
    }
    let sum = a.stop_trace().unwrap();
    stopped.wait();
    for h in hs {
        h.join().unwrap();
    }
    let recs = trace::read(&p).unwrap();
    let want = THREADS * (2 * PAIRS + 1);
    assert_eq!(recs.len(), want, "records lost or duplicated");
    assert_eq!(sum.records as usize, want);
    assert_eq!(sum.threads as usize, THREADS);
    assert_eq!(sum.bytes, std::fs::metadata(&p).unwrap().len());
    let mut per_thread: BTreeMap<u32, Vec<&trace::Record>> = BTreeMap::new();
    for r in &recs {
        per_thread.entry(r.thread).or_default().push(r);
    }
    assert_eq!(per_thread.len(), THREADS);
    for (t, rs) in &per_thread {
        assert_eq!(rs.len(), 2 * PAIRS + 1, "thread {t}");
        assert!(rs.windows(2).all(|w| w[0].time_ns <= w[1].time_ns), "thread {t}: out of time order");
        assert_eq!(rs.iter().filter(|r| r.action == Action::RefusedFree).count(), 1);
        assert_eq!(rs.iter().filter(|r| r.action == Action::Alloc).count(), PAIRS);
        // Per-thread stream keys differ between threads; legacy is one key for all.
        let keys: std::collections::HashSet<u64> =
            rs.iter().filter(|r| r.stream_kind == StreamKind::PerThread).map(|r| r.stream.0).collect();
        assert_eq!(keys.len(), 1, "thread {t}: one per-thread stream");
    }
    let ptds: std::collections::HashSet<u64> =
        recs.iter().filter(|r| r.stream_kind == StreamKind::PerThread).map(|r| r.stream.0).collect();
    assert_eq!(ptds.len(), THREADS, "each thread's 0x2 is its own stream");
    let legacy: std::collections::HashSet<u64> =
        recs.iter().filter(|r| r.stream_kind == StreamKind::Legacy).map(|r| r.stream.0).collect();
    assert_eq!(legacy.len(), 1);
    for want in [TracePath::Arena, TracePath::LargeArena, TracePath::Pool] {
        assert!(recs.iter().any(|r| r.path == want), "no {want:?} record");
    }
    assert_alternating(&recs);
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn a_stop_while_threads_record_keeps_the_file_whole_and_a_second_trace_starts_clean() {
    let dev = Arc::new(common::host(0));
    let a = alloc_on(dev, common::small().build().unwrap());
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    const THREADS: usize = 6;
    let stop = Arc::new(AtomicBool::new(false));
    // Pairs each thread has made: the window below lasts until some were made inside it (on a
    // loaded machine a fixed sleep can pass with every thread descheduled: no record at all).
    let pairs: Arc<Vec<AtomicU64>> = Arc::new((0..THREADS).map(|_| AtomicU64::new(0)).collect());
    let total = |pairs: &[AtomicU64]| pairs.iter().map(|n| n.load(SeqCst)).sum::<u64>();
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, stop, pairs) = (a.clone(), stop.clone(), pairs.clone());
            std::thread::spawn(move || {
                while !stop.load(SeqCst) {
                    let p = a.allocate(256 + t * 64, Stream::PER_THREAD).unwrap();
                    a.deallocate(p, 256 + t * 64, Stream::PER_THREAD).unwrap();
                    pairs[t].fetch_add(1, SeqCst);
                }
                pairs[t].load(SeqCst)
            })
        })
        .collect();
    // Every thread records from the first window on.
    while pairs.iter().any(|n| n.load(SeqCst) == 0) {
        std::thread::yield_now();
    }
    for round in 0..3 {
        let p = path(&format!("busy{round}"));
        a.start_trace(&p).unwrap();
        // At least 30 ms, and until some thread has made two pairs after the start (the
        // second begun after it): the trace must hold records.
        let at_start = total(&pairs);
        std::thread::sleep(std::time::Duration::from_millis(30));
        while total(&pairs) < at_start + THREADS as u64 + 1 {
            std::thread::yield_now();
        }
        let sum = a.stop_trace().unwrap();
        let recs = trace::read(&p).unwrap();
        assert_eq!(recs.len() as u64, sum.records);
        assert!(sum.records > 0);
        // Every thread's records form whole pairs except at the two ends of the window.
        let mut per: BTreeMap<u32, Vec<&trace::Record>> = BTreeMap::new();
        for r in &recs {
            per.entry(r.thread).or_default().push(r);
        }
        for rs in per.values() {
            for w in rs.windows(2) {
                assert!(w[0].time_ns <= w[1].time_ns);
                assert_ne!(w[0].action, w[1].action, "two allocs or two frees in a row: a record lost");
            }
        }
        assert_alternating(&recs);
        std::fs::remove_file(&p).unwrap();
    }
    stop.store(true, SeqCst);
    for h in hs {
        assert!(h.join().unwrap() > 0);
    }
}

#[test]
fn the_config_key_records_from_creation_and_the_drop_ends_the_file() {
    let p = path("conf");
    let cfg = Config::parse(&format!("small_max=64KiB,superblock=256KiB,chunk=1MiB,trace={}", p.display()))
        .unwrap();
    assert_eq!(cfg.trace(), Some(p.as_path()));
    let a = alloc_on(Arc::new(common::host(0)), cfg);
    let q = a.allocate(1000, Stream::PER_THREAD).unwrap();
    a.deallocate(q, 1000, Stream::PER_THREAD).unwrap();
    let _ = a.allocate(1 << 40, Stream::PER_THREAD).unwrap_err(); // a failed allocation
    drop(a);
    let recs = trace::read(&p).unwrap();
    let acts: Vec<Action> = recs.iter().map(|r| r.action).collect();
    assert_eq!(acts, [Action::Alloc, Action::Free, Action::FailedAlloc]);
    assert_eq!((recs[0].ptr, recs[0].size, recs[0].path), (q.0, 1000, TracePath::Arena));
    assert_eq!(recs[1].ptr, q.0);
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn bad_use_is_refused_clearly() {
    let dev = Arc::new(common::host(0));
    let a = alloc_on(dev.clone(), common::small().build().unwrap());
    let b = alloc_on(dev, common::small().build().unwrap());
    let msg = |e: Error| e.to_string();
    assert!(msg(a.stop_trace().unwrap_err()).contains("no trace is running"));
    let p = path("bad");
    a.start_trace(&p).unwrap();
    assert!(msg(a.start_trace(path("bad2")).unwrap_err()).contains("already running"));
    assert!(msg(b.start_trace(&p).unwrap_err()).contains("already being written"));
    assert!(msg(b.start_trace("/nonexistent-dir/x.bin").unwrap_err()).contains("/nonexistent-dir/x.bin"));
    // b can still trace elsewhere; a's trace is untouched by b's refusals.
    let q = a.allocate(512, Stream::LEGACY).unwrap();
    a.deallocate(q, 512, Stream::LEGACY).unwrap();
    assert_eq!(a.stop_trace().unwrap().records, 2);
    assert!(Config::parse("trace=").is_err());
    std::fs::remove_file(&p).unwrap();
}

/// The simulator, counting identity lookups: all of them, and the legacy stream's while a flag
/// is up.
struct KeyCounting {
    sim: cuarena_testkit::HostDevice,
    watching: std::sync::atomic::AtomicBool,
    legacy_keys: std::sync::atomic::AtomicU64,
    keys: std::sync::atomic::AtomicU64,
}

impl cuarena_testkit::Interpose for KeyCounting {
    fn base(&self) -> &dyn cuarena::Device {
        &self.sim
    }
    fn stream_key(&self, s: Stream) -> cuarena::Result<cuarena::StreamKey> {
        use std::sync::atomic::Ordering::SeqCst;
        self.keys.fetch_add(1, SeqCst);
        if s.is_legacy() && self.watching.load(SeqCst) {
            self.legacy_keys.fetch_add(1, SeqCst);
        }
        cuarena::Device::stream_key(&self.sim, s)
    }
}

fn key_counting() -> Arc<cuarena_testkit::Interposed<KeyCounting>> {
    Arc::new(cuarena_testkit::Interposed(KeyCounting {
        sim: common::host(0),
        watching: Default::default(),
        legacy_keys: Default::default(),
        keys: Default::default(),
    }))
}

/// While a capture is announced, a trace never asks the legacy stream's identity
/// (`cuStreamGetId` of it could break a capture of a blocking stream begun at any moment): a
/// thread's legacy-stream allocation and free ask it exactly as often traced as untraced (the
/// allocation itself may, inside its own legacy-stream call), the records carry the identity the
/// allocator knows or 0, and once the announcement ends the next thread's records carry the real
/// one. Before the thirty-first session the trace asked the raw device, announcement or not.
#[test]
fn a_trace_asks_no_legacy_identity_while_a_capture_is_announced() {
    use std::sync::atomic::Ordering::SeqCst;
    let on_new_thread = |a: &Allocator, size: usize| {
        let a = a.clone();
        std::thread::spawn(move || {
            let q = a.allocate(size, Stream::LEGACY).unwrap();
            a.deallocate(q, size, Stream::LEGACY).unwrap();
            q
        })
        .join()
        .unwrap()
    };
    let run = |traced: bool| {
        let dev = key_counting();
        let a = Allocator::new(dev.clone(), common::small().build().unwrap()).unwrap();
        let p = path(if traced { "announced" } else { "announced-untraced" });
        if traced {
            a.start_trace(&p).unwrap();
        }
        a.graph_capture_begin();
        dev.0.watching.store(true, SeqCst);
        let during = on_new_thread(&a, 4096);
        dev.0.watching.store(false, SeqCst);
        a.graph_capture_end().unwrap();
        let after = on_new_thread(&a, 8192);
        let recs = if traced {
            a.stop_trace().unwrap();
            let r = trace::read(&p).unwrap();
            std::fs::remove_file(&p).unwrap();
            r
        } else {
            Vec::new()
        };
        let legacy = cuarena::Device::stream_key(&dev.0.sim, Stream::LEGACY).unwrap();
        (dev.0.legacy_keys.load(SeqCst), recs, during, after, legacy)
    };
    let (untraced, ..) = run(false);
    let (asked, recs, during, after, legacy) = run(true);
    assert_eq!(
        asked, untraced,
        "the legacy stream's identity asked {asked} times traced, {untraced} untraced"
    );
    let of = |q: DeviceAddr, size: u64| -> Vec<&trace::Record> {
        recs.iter().filter(|r| r.ptr == q.0 && r.size == size).collect()
    };
    let (d, l) = (of(during, 4096), of(after, 8192));
    assert_eq!((d.len(), l.len()), (2, 2), "{recs:?}");
    for r in d.iter().chain(&l) {
        assert_eq!(r.stream_kind, StreamKind::Legacy, "{r:?}");
        assert!(r.stream.0 == 0 || r.stream == legacy, "{r:?}: neither unknown nor the legacy stream");
    }
    for r in &l {
        assert_eq!(r.stream, legacy, "{r:?}: after the announcement the identity is known");
    }
}

/// The trace's identity lookups are driver calls like the allocator's own (on CUDA a lookup is
/// `cuStreamIsCapturing` and `cuStreamGetId`) and `driver_calls` counts them: the same pairs on
/// a user stream, traced and not, differ in `driver_calls` by exactly the lookups the device saw.
/// Before the thirty-first session the trace asked the raw device, uncounted.
#[test]
fn a_traces_identity_lookups_are_counted_in_driver_calls() {
    use std::sync::atomic::Ordering::SeqCst;
    let dev = key_counting();
    let a = Allocator::new(dev.clone(), common::small().build().unwrap()).unwrap();
    let user = dev.0.sim.create_stream();
    let p = path("counted");
    let pairs = |a: &Allocator| {
        for i in 0..64usize {
            let n = 4096 + (i % 4) * 256;
            let q = a.allocate(n, user).unwrap();
            a.deallocate(q, n, user).unwrap();
        }
    };
    pairs(&a); // warm: the arena's superblock taken
    let phase = |traced: bool| {
        if traced {
            a.start_trace(&p).unwrap();
        }
        let (k0, c0) = (dev.0.keys.load(SeqCst), a.stats().driver_calls);
        pairs(&a);
        let (k1, c1) = (dev.0.keys.load(SeqCst), a.stats().driver_calls);
        if traced {
            a.stop_trace().unwrap();
        }
        (k1 - k0, c1 - c0)
    };
    let (plain_keys, plain_calls) = phase(false);
    let (traced_keys, traced_calls) = phase(true);
    assert!(traced_keys > plain_keys, "the trace asked no identity: {traced_keys} vs {plain_keys}");
    assert_eq!(
        traced_calls - plain_calls,
        traced_keys - plain_keys,
        "driver calls {plain_calls} -> {traced_calls}, identity lookups {plain_keys} -> {traced_keys}"
    );
    assert_eq!(trace::read(&p).unwrap().len(), 128);
    std::fs::remove_file(&p).unwrap();
    dev.0.sim.destroy_stream(user).unwrap();
}
