//! Adversarial tests of held frees (`Allocator::deallocate_or_hold`, C `cuarena_free_or_hold`),
//! thirty-third session (helper-54): double and invalid frees during a capture, second frees of held blocks from many
//! threads and streams, retries racing new holds, holds of exiting threads, pass-through mode,
//! a running trace, the OOM hook, graph pools and destroyed declared streams.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use cuarena::{Allocator, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

/// The C ABI, compiled in to be called as Rust.
#[allow(dead_code)]
#[path = "../capi/src/lib.rs"]
mod cuarena_c;
use cuarena_c::*;

mod common;
use common::{host, parse};

const CONF: &str = "superblock=256KiB,small_max=64KiB,chunk=1MiB,large_max=1MiB";

fn allocator(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), parse(CONF)).unwrap()
}

/// Small, arena large and pool blocks.
const SIZES: [usize; 3] = [4096, 300 << 10, 3 << 20];

fn block(size: usize) -> u64 {
    cuarena::size_class::block_bytes(size, 64 << 10).unwrap() as u64
}

fn is_double_free<T: std::fmt::Debug>(r: &cuarena::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
}

/// A double free made with `deallocate_or_hold` on a user stream while that stream is being
/// captured must be refused (as it is outside a capture), or at least must never free the
/// block again once the block has been handed out to a new owner. Here the block is freed
/// (taken), the stream's capture begins, the block is freed again with `deallocate_or_hold`,
/// the capture ends, the block is handed out again on the stream, and then a `flush` retries
/// the held free. The new owner's block must stay live, and its own free must be accepted.
///
/// WAS A DEFECT (arena blocks, small and large, on a user stream; fixed: `deallocate_or_hold`
/// validates a free refused for a capture before holding it, `Slot::check_hold`): the user-stream fast path
/// (`free_fast`, the `None` arm of `arena_index`) asks `refuse_capturing(stream)` *before* the
/// arena validates the free (`Arena::free_local` → `accept_own_free`), and returns the
/// capture's refusal as the free's answer (`refused`), which `deallocate_rest` returns without
/// validating. So an already freed block's second free comes back as `StreamCapturing`, and
/// `deallocate_or_hold` holds it (`Ok(false)`) instead of refusing it as a double free. The
/// hold then outlives the block: after the capture, the block is handed out again on the
/// stream (the held list does not stop allocations), and the retry (`flush`, `trim`,
/// `graph_capture_end`, `release_thread`, C `cuarena_empty_cache`) finds a live block of the
/// right size and frees it under its new owner, who may still be writing it: a use after
/// free, and the new owner's own free is then refused as a double free. (Pool blocks are
/// validated first, `check_free`, and are refused as they should be.) Suggested fix: validate
/// before holding: in `deallocate_or_hold`, on `StreamCapturing` from a plain free, check the
/// block is live with this size (`Arena::check_live` / `pool.check_free` / the graph pools'
/// `check_free`, as `Slot::free` does) before pushing the entry, and refuse it otherwise; or
/// make `free_fast` leave the capture query until the arena has validated the free (the
/// slow path's `free_arena_block` already orders `check_live` first for declared frees).
#[test]
fn a_double_free_during_a_capture_never_frees_the_blocks_next_owner() {
    let sim = host(0);
    let a = allocator(&sim);
    let u = sim.create_stream();
    let mut failures = Vec::new();
    let mut bad = 0;
    for size in SIZES {
        let p = a.allocate(size, u).unwrap();
        a.deallocate(p, size, u).unwrap();
        sim.begin_capture(u).unwrap();
        let r = a.deallocate_or_hold(p, size, u, &[]);
        sim.end_capture(u).unwrap();
        if r.is_err() {
            bad += 1;
        }
        // The block comes back to a new owner on its stream.
        let mut got = Vec::new();
        while got.len() < 16 && got.last() != Some(&p) {
            got.push(a.allocate(size, u).unwrap());
        }
        assert_eq!(got.last(), Some(&p), "size {size}: the block never came back: the test checks nothing");
        let live = a.stats().live_bytes;
        a.flush().unwrap(); // retries whatever was held
        let _ = a.take_deferred_error(); // a refused retry is counted in invalid_frees
        let after = a.stats().live_bytes;
        let frees: Vec<_> = got.iter().map(|&b| a.deallocate(b, size, u)).collect();
        if !matches!(r, Err(Error::InvalidFree { .. })) || after != live || frees.iter().any(|f| f.is_err()) {
            failures.push(format!(
                "size {size}: second free during the capture -> {r:?}; live {live} -> {after} at the retry; \
                 the new owner's frees: {frees:?}"
            ));
            bad += frees.iter().filter(|f| f.is_err()).count() as u64;
        }
    }
    sim.destroy_stream(u).unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
    assert_all_returned(&a, Some(&sim), bad);
}

/// A free with the wrong size made with `deallocate_or_hold` during a capture must be refused
/// (it changes nothing outside a capture), and must not make the block's valid free a "double
/// free": the valid free, on a stream not being captured, is taken, and all memory returns.
///
/// WAS A DEFECT (same root cause and fix as
/// `a_double_free_during_a_capture_never_frees_the_blocks_next_owner`):
/// the user-stream fast path answers the capture query before the arena checks the size, so
/// the invalid free is held; the held-list check then refuses the owner's valid free as a
/// double free (counted in `invalid_frees`), and the retry, now validated, is refused as a
/// wrong size and dropped from the list (deferred): neither free is made, and a caller that
/// cannot free again (PyTorch's deleter, a dropped `DeviceBuffer`, whose drop defers the
/// refusal) leaks the block for the allocator's life; the valid free also counts as an invalid
/// one. Fix as there: validate before holding.
#[test]
fn a_wrong_size_free_during_a_capture_does_not_block_the_valid_free() {
    let sim = host(0);
    let a = allocator(&sim);
    let u = sim.create_stream();
    let mut failures = Vec::new();
    for (size, wrong) in [(4096usize, 40 << 10), (300 << 10, 600 << 10), (3 << 20, 5 << 20)] {
        let p = a.allocate(size, u).unwrap();
        sim.begin_capture(u).unwrap();
        let r = a.deallocate_or_hold(p, wrong, u, &[]);
        // The valid free, on a stream not captured.
        let valid = a.deallocate(p, size, Stream::PER_THREAD);
        sim.end_capture(u).unwrap();
        a.flush().unwrap();
        let _ = a.take_deferred_error();
        if !matches!(r, Err(Error::InvalidFree { .. })) || valid.is_err() {
            failures.push(format!("size {size}: wrong-size free -> {r:?}; the valid free -> {valid:?}"));
            if valid.is_err() {
                // Free it for the end check, if the allocator lets anyone.
                let again = a.deallocate(p, size, u);
                failures.push(format!("size {size}: freed again after the retry -> {again:?}"));
            }
        }
    }
    sim.destroy_stream(u).unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
    assert_all_returned(&a, Some(&sim), 3);
}

/// Second frees of held blocks (small, arena large and pool blocks) from four threads at once,
/// on the per-thread stream, the legacy stream, their own user streams, with a declared stream
/// (`deallocate_used_on`) and through `deallocate_or_hold` on the captured stream, while a
/// fifth thread retries the held frees (`flush`) all along. While the capture runs, every one
/// is refused as a double free; then the capture ends (`graph_capture_end` makes the held
/// frees) and the storm goes on: every second free is refused, at once or by the block's owner
/// later, and counted once; no block is freed twice, and all memory comes back.
#[test]
fn second_frees_of_held_blocks_from_many_threads_and_streams_are_refused_and_counted() {
    let sim = host(30);
    let a = allocator(&sim);
    let u = sim.create_stream();
    let mut blocks = Vec::new();
    for size in SIZES {
        for _ in 0..3 {
            blocks.push((a.allocate(size, u).unwrap(), size));
        }
    }
    let live = a.stats().live_bytes;
    a.graph_capture_begin();
    sim.begin_capture(u).unwrap();
    for &(p, size) in &blocks {
        assert!(!a.deallocate_or_hold(p, size, u, &[]).unwrap(), "size {size}: not held");
    }
    const THREADS: usize = 4;
    let own: Vec<Stream> = (0..THREADS).map(|_| sim.create_stream()).collect();
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let attempts = Arc::new(AtomicU64::new(0));
    let flushes = Arc::new(AtomicU64::new(0));
    let retrier = {
        let (a, stop, flushes) = (a.clone(), stop.clone(), flushes.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                a.flush().unwrap();
                flushes.fetch_add(1, Ordering::Relaxed);
            }
            a.release_thread().unwrap();
        })
    };
    while flushes.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    let workers: Vec<_> = (0..THREADS)
        .map(|k| {
            let (a, barrier, attempts, blocks, w) =
                (a.clone(), barrier.clone(), attempts.clone(), blocks.clone(), own[k]);
            std::thread::spawn(move || {
                let free = |i: usize, p: DeviceAddr, size: usize| match (k + i) % 5 {
                    0 => a.deallocate(p, size, Stream::PER_THREAD).map(|()| true),
                    1 => a.deallocate(p, size, Stream::LEGACY).map(|()| true),
                    2 => a.deallocate(p, size, w).map(|()| true),
                    3 => a.deallocate_used_on(p, size, Stream::PER_THREAD, &[w]).map(|()| true),
                    _ => a.deallocate_or_hold(p, size, u, &[]),
                };
                let mut phase1 = Vec::new();
                for i in 0..20 {
                    for &(p, size) in &blocks {
                        let r = free(i, p, size);
                        attempts.fetch_add(1, Ordering::Relaxed);
                        if !is_double_free(&r) {
                            phase1.push(format!("thread {k} try {i} size {size}: {r:?}"));
                        }
                    }
                }
                barrier.wait(); // the capture ends here
                barrier.wait();
                let mut phase2 = Vec::new();
                for i in 0..20 {
                    for &(p, size) in &blocks {
                        let r = free(i, p, size);
                        attempts.fetch_add(1, Ordering::Relaxed);
                        // Refused now, or (a free towards another thread's arena) accepted and
                        // checked by the owner later: never held.
                        if !matches!(r, Err(Error::InvalidFree { .. }) | Ok(true)) {
                            phase2.push(format!("thread {k} try {i} size {size}: {r:?}"));
                        }
                    }
                }
                a.release_thread().unwrap();
                (phase1, phase2)
            })
        })
        .collect();
    barrier.wait();
    assert_eq!(a.stats().live_bytes, live, "a held block was freed during the capture");
    sim.end_capture(u).unwrap();
    a.graph_capture_end().unwrap();
    assert!(a.take_deferred_error().is_none());
    barrier.wait();
    let mut bad = Vec::new();
    for w in workers {
        let (p1, p2) = w.join().unwrap();
        bad.extend(p1);
        bad.extend(p2);
    }
    stop.store(true, Ordering::Relaxed);
    retrier.join().unwrap();
    assert!(bad.is_empty(), "{} bad answers, first: {:#?}", bad.len(), &bad[..bad.len().min(5)]);
    a.flush().unwrap();
    let _ = a.take_deferred_error();
    assert_eq!(a.stats().live_bytes, live - blocks.iter().map(|&(_, s)| block(s)).sum::<u64>());
    for w in own {
        sim.destroy_stream(w).unwrap();
    }
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), attempts.load(Ordering::Relaxed));
}

/// Three threads hold frees of their own blocks on their own captured streams, round after
/// round, and leave the retries to whoever comes (their own `flush` or `trim`, the other
/// threads', a retrier's `flush` loop, one thread's `graph_capture_end`), while they allocate
/// again on the same streams and write the new blocks there. A held block is never handed out
/// before its free is made, nor reused before its fence (the race checker), every second
/// free of a held block is a double free, and all memory comes back.
#[test]
fn retries_on_several_threads_race_new_holds_of_other_blocks() {
    let sim = host(30); // work takes up to 30 µs: fences matter
    let a = allocator(&sim);
    let stop = Arc::new(AtomicBool::new(false));
    let seconds = Arc::new(AtomicU64::new(0));
    let retrier = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                a.flush().unwrap();
                std::thread::yield_now();
            }
            a.release_thread().unwrap();
        })
    };
    let workers: Vec<_> = (0..3)
        .map(|k| {
            let (a, sim, seconds) = (a.clone(), sim.clone(), seconds.clone());
            std::thread::spawn(move || {
                let s = sim.create_stream();
                for round in 0..60usize {
                    let mut mine = Vec::new();
                    for j in 0..3 {
                        let size = SIZES[(round + j + k) % SIZES.len()];
                        let p = a.allocate(size, s).unwrap();
                        sim.write_tag(p.0, 256, (k * 1000 + round) as u32, s).unwrap();
                        mine.push((p, size));
                    }
                    // Announced, as PyTorch's captures are: a held free is retried by other
                    // threads' calls, and only an announced capture holds those retries off
                    // (an unannounced one raced them on the GPU machine's 16 cores: an event
                    // recorded into the capture).
                    a.graph_capture_begin();
                    sim.begin_capture(s).unwrap();
                    for &(p, size) in &mine {
                        // Held, not refused: a block handed out while a free of it was still
                        // held would be refused here as a double free.
                        assert!(!a.deallocate_or_hold(p, size, s, &[]).unwrap(), "thread {k}: not held");
                        let r = a.deallocate(p, size, Stream::PER_THREAD);
                        assert!(is_double_free(&r), "thread {k}: a second free of a held block: {r:?}");
                        seconds.fetch_add(1, Ordering::Relaxed);
                    }
                    sim.end_capture(s).unwrap();
                    a.graph_capture_end().unwrap();
                    match round % 3 {
                        0 => a.flush().unwrap(),
                        1 => {
                            a.trim(false).unwrap();
                        }
                        _ => {}
                    }
                }
                a.flush().unwrap();
                a.release_thread().unwrap();
                s
            })
        })
        .collect();
    let streams: Vec<Stream> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    retrier.join().unwrap();
    a.flush().unwrap();
    assert!(a.take_deferred_error().is_none());
    assert!(sim.violations().is_empty(), "{:?}", &sim.violations()[..1]);
    assert_eq!(a.stats().live_bytes, 0, "{:?}", a.stats());
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    assert_all_returned(&a, Some(&sim), seconds.load(Ordering::Relaxed));
}

/// A thread holds frees (a per-thread stream's small and pool blocks declared used on a
/// captured stream `v`, and a user stream's block on a captured stream `u`), releases itself
/// (`release_thread`: the retry is refused again, its arenas are given up) and exits. Another
/// thread ends the captures while `v`'s work on the blocks is still running; its
/// `graph_capture_end` makes the held frees (the exited thread's per-thread stream fenced
/// through the legacy stream). The blocks are handed out again only behind `v`'s work and
/// the per-thread stream's work (tags), and all memory comes back.
#[test]
fn held_frees_of_an_exited_thread_are_made_by_another_and_fenced() {
    let sim = host(0);
    let a = allocator(&sim);
    let (u, v) = (sim.create_stream(), sim.create_stream());
    a.graph_capture_begin();
    sim.begin_capture(u).unwrap();
    sim.begin_capture(v).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t = {
        let (a, sim) = (a.clone(), sim.clone());
        std::thread::spawn(move || {
            let mut ptrs = Vec::new();
            for size in SIZES {
                let p = a.allocate(size, Stream::PER_THREAD).unwrap();
                // The per-thread stream's own work on the block, held back by a gate.
                let gate = sim.gate(Stream::PER_THREAD).unwrap();
                // (Its second 256 bytes: v's work below takes the first.)
                sim.write_tag(p.0 + 256, 256, 0x77, Stream::PER_THREAD).unwrap();
                tx.send(gate).unwrap();
                assert!(!a.deallocate_or_hold(p, size, Stream::PER_THREAD, &[v]).unwrap());
                ptrs.push((p, size, Stream::PER_THREAD));
            }
            let q = a.allocate_for_test_on(u);
            ptrs.push(q);
            a.release_thread().unwrap(); // retried, refused again, held again
            ptrs
        })
    };
    let ptrs = t.join().unwrap();
    let gates: Vec<_> = rx.iter().collect();
    let live = a.stats().live_bytes;
    assert!(live >= ptrs.iter().map(|&(_, s, _)| s as u64).sum::<u64>(), "freed during the capture");
    sim.end_capture(u).unwrap();
    sim.end_capture(v).unwrap();
    // v's work on the blocks, still running when the held frees are made.
    let vgate = sim.gate(v).unwrap();
    for &(p, _, _) in &ptrs {
        sim.write_tag(p.0, 256, 0x5a, v).unwrap();
    }
    a.graph_capture_end().unwrap();
    assert!(a.take_deferred_error().is_none());
    assert_eq!(a.stats().live_bytes, 0, "the held frees not made: {:?}", a.stats());
    // Handed out again on u (a stream not ordered after the per-thread streams by itself) and
    // the legacy stream: written there at once.
    let mut got = Vec::new();
    let mut back = 0;
    for &(p, size, _) in &ptrs {
        for s in [u, Stream::LEGACY] {
            for _ in 0..4 {
                let b = a.allocate(size, s).unwrap();
                sim.write_tag(b.0, 512, 0x11, s).unwrap();
                got.push((b, size, s));
                if b == p {
                    back += 1;
                    break;
                }
            }
        }
    }
    // The pool block comes back (on u, behind a wait on its fence; the arena blocks went to the
    // exited thread's arenas, given up or parked): without it the tags check nothing.
    assert!(back >= 1, "no held block came back: the test checks nothing");
    drop(gates);
    vgate.open();
    sim.synchronize();
    assert_eq!(sim.tag_errors(), 0, "a held block reused under running work");
    assert!(sim.violations().is_empty(), "{:?}", &sim.violations()[..1]);
    for (b, size, s) in got {
        a.deallocate(b, size, s).unwrap();
    }
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(v).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

trait OnU {
    fn allocate_for_test_on(&self, u: Stream) -> (DeviceAddr, usize, Stream);
}

impl OnU for Allocator {
    /// A small block allocated on `u` while `u` is captured cannot be had: allocate it on the
    /// per-thread stream and free it on `u` (a cross-stream free, refused by the capture).
    fn allocate_for_test_on(&self, u: Stream) -> (DeviceAddr, usize, Stream) {
        let p = self.allocate(8192, Stream::PER_THREAD).unwrap();
        assert!(!self.deallocate_or_hold(p, 8192, u, &[]).unwrap(), "a free on a captured stream not held");
        (p, 8192, u)
    }
}

/// Pass-through mode: a free declared used on a captured stream is held (the ordering refuses
/// it), a second free of the held block is refused as a double free and counted, a double free
/// during the capture (of a block already freed) is refused rather than held, and `flush`
/// after the capture makes the held free once, fenced after the declared stream's work.
#[test]
fn pass_through_mode_holds_declared_frees_and_refuses_second_frees() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), parse(&format!("passthrough,{CONF}"))).unwrap();
    let (w, v) = (sim.create_stream(), sim.create_stream());
    let mut bad = 0;
    for size in SIZES {
        let p = a.allocate(size, w).unwrap();
        let gone = a.allocate(size, w).unwrap();
        a.deallocate(gone, size, w).unwrap();
        sim.begin_capture(v).unwrap();
        assert!(!a.deallocate_or_hold(p, size, w, &[v]).unwrap(), "size {size}: not held");
        assert!(is_double_free(&a.deallocate(p, size, w)), "size {size}");
        assert!(is_double_free(&a.deallocate_used_on(p, size, w, &[v])), "size {size}");
        assert!(is_double_free(&a.deallocate_or_hold(p, size, w, &[v])), "size {size}");
        // A double free during the capture (the ordering would refuse it): refused, not held.
        let r = a.deallocate_or_hold(gone, size, w, &[v]);
        assert!(matches!(r, Err(Error::InvalidFree { .. })), "size {size}: a double free held: {r:?}");
        bad += 4;
        assert_eq!(a.stats().invalid_frees, bad, "size {size}");
        sim.end_capture(v).unwrap();
        let gate = sim.gate(v).unwrap();
        sim.write_tag(p.0, 256, 0x5a, v).unwrap();
        a.flush().unwrap();
        assert!(a.take_deferred_error().is_none());
        assert_eq!(a.stats().live_bytes, 0, "size {size}: the held free not made");
        // The driver hands the memory out again: the write on w must wait for v's.
        let q = a.allocate(size, w).unwrap();
        sim.write_tag(q.0, 256, 0x11, w).unwrap();
        gate.open();
        sim.synchronize();
        assert_eq!(sim.tag_errors(), 0, "size {size}: reused under v's work");
        a.deallocate(q, size, w).unwrap();
        assert!(
            is_double_free(&a.deallocate(p, size, w)) || p == q,
            "size {size}: the held free made twice?"
        );
        if p != q {
            bad += 1;
        }
    }
    sim.destroy_stream(w).unwrap();
    sim.destroy_stream(v).unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(a.stats().invalid_frees, bad);
    let _ = a.take_deferred_error();
    a.trim(true).unwrap();
    sim.synchronize(); // the driver's frees are asynchronous
    assert_eq!((a.stats().live_bytes, sim.reserved_bytes()), (0, 0));
}

/// While a trace runs (every free takes the traced slow path), held frees are refused as
/// second frees and made once by the retry, and the trace records them.
#[test]
fn held_frees_while_a_trace_runs() {
    let sim = host(0);
    let a = allocator(&sim);
    let u = sim.create_stream();
    let dir = std::env::temp_dir().join(format!("cuarena-s33-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("held.trace");
    a.start_trace(&path).unwrap();
    let mut bad = 0;
    for size in SIZES {
        let ps: Vec<DeviceAddr> = (0..3).map(|_| a.allocate(size, u).unwrap()).collect();
        a.graph_capture_begin();
        sim.begin_capture(u).unwrap();
        for &p in &ps {
            assert!(!a.deallocate_or_hold(p, size, u, &[]).unwrap(), "size {size}");
            assert!(is_double_free(&a.deallocate(p, size, Stream::PER_THREAD)), "size {size}");
            bad += 1;
        }
        sim.end_capture(u).unwrap();
        a.graph_capture_end().unwrap();
        assert!(a.take_deferred_error().is_none());
        for &p in &ps {
            assert!(
                matches!(a.deallocate(p, size, u), Err(Error::InvalidFree { .. })),
                "size {size}: made twice"
            );
            bad += 1;
        }
    }
    let summary = a.stop_trace().unwrap();
    assert!(summary.records > 0);
    std::fs::remove_dir_all(&dir).unwrap();
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

/// An OOM hook that calls `flush` while frees are held: during the capture the retry is
/// refused again (the entry held again, not lost, not made), and the allocation fails; after
/// the capture the hook's flush makes the held free and the retried allocation gets the
/// memory (behind the free's fence).
#[test]
fn an_oom_hook_that_flushes_while_frees_are_held() {
    let sim = host(0);
    let a = allocator(&sim);
    let u = sim.create_stream();
    let size = 8 << 20;
    let p = a.allocate(size, u).unwrap();
    a.set_limit_bytes(a.stats().reserved_bytes as usize);
    let calls = Arc::new(AtomicUsize::new(0));
    {
        let (a2, calls) = (a.clone(), calls.clone());
        a.set_oom_hook(Some(Arc::new(move |_, _| {
            calls.fetch_add(1, Ordering::Relaxed);
            a2.flush().unwrap();
            true
        })));
    }
    sim.begin_capture(u).unwrap();
    assert!(!a.deallocate_or_hold(p, size, u, &[]).unwrap());
    let r = a.allocate(size, Stream::PER_THREAD);
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    assert!(calls.load(Ordering::Relaxed) >= 1, "the hook was not called");
    assert_eq!(a.stats().live_bytes, size as u64, "the held free was made or lost during the capture");
    assert!(is_double_free(&a.deallocate(p, size, Stream::PER_THREAD)), "the held entry was lost");
    sim.end_capture(u).unwrap();
    let before = calls.load(Ordering::Relaxed);
    let q = a.allocate(size, Stream::PER_THREAD).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), before + 1, "the hook's flush should have made room");
    assert_eq!(a.stats().live_bytes, size as u64);
    a.set_oom_hook(None);
    a.deallocate(q, size, Stream::PER_THREAD).unwrap();
    assert!(matches!(a.deallocate(p, size, u), Err(Error::InvalidFree { .. })), "made twice");
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), 2);
}

/// Graph-pool blocks freed with `deallocate_or_hold` during the capture that allocated them
/// (on the captured stream, and declared used on another captured stream) are taken at once
/// by the pool's rules (never held), and a second free is refused.
#[test]
fn graph_pool_blocks_are_taken_not_held() {
    let sim = host(0);
    let a = allocator(&sim);
    let (u, v) = (sim.create_stream(), sim.create_stream());
    let id = cuarena::GraphPoolId(1, 1);
    a.graph_pool_retain(id);
    a.graph_capture_begin();
    sim.begin_capture(u).unwrap();
    sim.begin_capture(v).unwrap();
    let mut bad = 0;
    for size in SIZES {
        let p = a.graph_allocate(id, size, u).unwrap();
        let q = a.graph_allocate(id, size, u).unwrap();
        assert!(a.deallocate_or_hold(p, size, u, &[]).unwrap(), "size {size}");
        assert!(a.deallocate_or_hold(q, size, u, &[v]).unwrap(), "size {size}");
        for b in [p, q] {
            assert!(
                matches!(a.deallocate_or_hold(b, size, u, &[]), Err(Error::InvalidFree { .. })),
                "size {size}"
            );
            bad += 1;
        }
    }
    sim.end_capture(u).unwrap();
    sim.end_capture(v).unwrap();
    a.graph_capture_end().unwrap();
    a.graph_pool_release(id).unwrap();
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(v).unwrap();
    assert_all_returned(&a, Some(&sim), bad);
}

/// A held free whose declared stream is destroyed (its handle not reused) before the retry.
/// `deallocate_or_hold` documents that the streams must outlive a held free (made on the same
/// handles), so the retry does reach the device with the stale handle: the simulator counts
/// one stale-handle call per retry (on CUDA such a call may crash in the driver; were the
/// handle given to a new stream meanwhile, the block's reuse would be ordered after the wrong
/// work). What is checked is what the allocator promises then: the refusal is deferred, the
/// entry goes (no retry loop), the block stays live (no corruption: tags, race checker) and
/// a corrected free returns it.
#[test]
fn a_held_free_whose_declared_stream_is_destroyed_before_the_retry() {
    let sim = host(0);
    let a = allocator(&sim);
    let w = sim.create_stream();
    for size in SIZES {
        let v = sim.create_stream();
        let p = a.allocate(size, w).unwrap();
        sim.write_tag(p.0, 256, 0x5a, v).unwrap();
        sim.begin_capture(v).unwrap();
        assert!(!a.deallocate_or_hold(p, size, w, &[v]).unwrap(), "size {size}");
        sim.end_capture(v).unwrap();
        sim.synchronize(); // v's work is done: a stream is destroyed after its work
        sim.destroy_stream(v).unwrap();
        a.flush().unwrap();
        let err = a.take_deferred_error();
        assert!(matches!(err, Some(Error::Driver { .. })), "size {size}: {err:?}");
        assert_eq!(sim.take_stale_handle_calls(), 1, "size {size}: the retry's stale-handle calls");
        assert_eq!(a.stats().live_bytes, block(size), "size {size}: a refused retry freed the block");
        a.flush().unwrap(); // the entry is gone: no second stale call
        assert_eq!(sim.take_stale_handle_calls(), 0, "size {size}: retried again");
        // The caller's corrected free (the C ABI's caller cannot make one: the block leaks).
        a.deallocate(p, size, w).unwrap();
        let q = a.allocate(size, w).unwrap();
        sim.write_tag(q.0, 256, 0x11, w).unwrap();
        a.deallocate(q, size, w).unwrap();
    }
    sim.destroy_stream(w).unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_all_returned(&a, Some(&sim), 0);
}

/// Frees made with `deallocate_or_hold` on the legacy stream while another thread captures its
/// per-thread stream (a blocking stream: any legacy-stream event or wait would break that
/// capture): pool blocks, the legacy arena's blocks and another thread's blocks. Each is taken
/// (parked, no legacy event) or held; a second free of each, during the capture, is refused
/// as invalid; retries during the capture (several `flush`es) touch nothing; the capture ends
/// cleanly; after it one `flush` makes whatever was held, and all memory comes back.
#[test]
fn legacy_holds_during_a_blocking_capture_do_not_break_it() {
    let sim = host(0);
    let a = allocator(&sim);
    let mut blocks: Vec<(DeviceAddr, usize)> =
        SIZES.iter().map(|&s| (a.allocate(s, Stream::LEGACY).unwrap(), s)).collect();
    let other = {
        let a = a.clone();
        std::thread::spawn(move || {
            let v: Vec<_> = SIZES.iter().map(|&s| (a.allocate(s, Stream::PER_THREAD).unwrap(), s)).collect();
            a.release_thread().unwrap();
            v
        })
        .join()
        .unwrap()
    };
    blocks.extend(other);
    let (go, ended) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let capturer = {
        let (sim, go, ended) = (sim.clone(), go.clone(), ended.clone());
        std::thread::spawn(move || {
            sim.begin_capture(Stream::PER_THREAD).unwrap();
            go.wait();
            ended.wait();
            sim.end_capture(Stream::PER_THREAD)
        })
    };
    go.wait();
    let mut bad = 0;
    let mut held = 0;
    for &(p, size) in &blocks {
        if !a.deallocate_or_hold(p, size, Stream::LEGACY, &[]).unwrap() {
            held += 1;
        }
        let r = a.deallocate(p, size, Stream::LEGACY);
        assert!(matches!(r, Err(Error::InvalidFree { .. })), "size {size}: a second free: {r:?}");
        bad += 1;
    }
    for _ in 0..3 {
        a.flush().unwrap();
    }
    ended.wait();
    let r = capturer.join().unwrap();
    assert!(r.is_ok(), "the blocking capture was broken: {r:?}; {:?}", sim.violations());
    a.flush().unwrap();
    assert!(a.take_deferred_error().is_none(), "held {held}");
    assert_all_returned(&a, Some(&sim), bad);
}

/// Through the C ABI (`cuarena_free_or_hold`'s path), a held free of a block declared with
/// `cuarena_record_stream` must, once it is made, leave the declaration table as an accepted
/// free does: no *live* entry (`recorded_blocks`), which the table's cap counts.
///
/// WAS A DEFECT (fixed: the C ABI marks the entry freed when it holds the free too; that is now
/// in `free_by`, the body the three C frees share):
/// `free_or_hold_with` called `recorded.freed(p)` only when the free was taken at once;
/// a held free's later retry (`Allocator::retry_held`, inside the library) cannot reach the C
/// ABI's table, so the entry stays *live* for good: only a block handed out again at that
/// very address (`forget` in `cuarena_malloc`/`cuarena_graph_malloc`) removes it, and
/// neither eviction nor `cuarena_empty_cache`'s purge touches live entries. So
/// `cuarena_recorded_blocks` over-counts, and a program whose declared frees are held
/// (PyTorch's `record_stream` tensors freed during graph captures) whose memory is then
/// trimmed or served at other addresses creeps towards `MAX_RECORDED_BLOCKS`, past which
/// every `cuarena_record_stream` of a new block is refused. Here a table capped at 4 refuses
/// a declaration after four held frees were made. Suggested fix: mark the entry freed when the
/// free is held too (`recorded.freed(p)` on `Ok(false)`): a held block cannot be freed again
/// (double free), and a freed entry is still read by `uses`, so a corrected free after a
/// refused retry keeps its declarations until eviction.
#[test]
fn c_abi_held_frees_release_their_record_stream_declarations() {
    let sim = host(0);
    let a = allocator(&sim);
    let rec = Recorded::new(4);
    let (w, v) = (sim.create_stream(), sim.create_stream());
    let size = 3 << 20;
    let ps: Vec<u64> = (0..5).map(|_| malloc_with(&a, &rec, size, w).unwrap()).collect();
    for &p in &ps[..4] {
        record_with(std::iter::once(&a), &rec, p, v).unwrap();
    }
    a.graph_capture_begin();
    sim.begin_capture(v).unwrap();
    for &p in &ps[..4] {
        assert!(!free_or_hold_with(&a, &rec, p, size, w).unwrap(), "not held");
    }
    sim.end_capture(v).unwrap();
    a.graph_capture_end().unwrap();
    assert!(a.take_deferred_error().is_none());
    assert_eq!(a.stats().live_bytes, block(size), "the held frees were not made");
    let live_entries = rec.live();
    let fifth = record_with(std::iter::once(&a), &rec, ps[4], v);
    free_with(&a, &rec, ps[4], size, w).unwrap();
    sim.destroy_stream(w).unwrap();
    sim.destroy_stream(v).unwrap();
    assert_eq!(live_entries, 0, "declarations of frees made still count as live blocks");
    assert!(
        fifth.is_ok(),
        "a declaration refused by the cap: {}",
        fifth.err().map(|e| e.to_string()).unwrap_or_default()
    );
    assert_all_returned(&a, Some(&sim), 0);
}
