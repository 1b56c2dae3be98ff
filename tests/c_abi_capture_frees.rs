//! The C ABI's `cuarena_free_or_hold`, PyTorch's free through the shim (thirty-third session;
//! first written in the thirty-second for `cuarena_free`, whose hold was taken out because a C
//! caller such as CuPy's glue may destroy a stream before the held free is made).
//!
//! PyTorch's deleter cannot free a block again, and its streams are pooled: a free refused
//! because its stream (or a declared one) is being captured is held and made after the capture
//! (`Allocator::deallocate_or_hold`), by `graph_capture_end` (PyTorch's route to a pool closing)
//! or `cuarena_empty_cache`. Before, the refusal only set `cuarena_last_error`, and the block
//! stayed live for the process's life. `cuarena_free` and `cuarena_free_checked` still refuse
//! and leave the block live, for their caller to free again.
//!
//! The C ABI is compiled in with `#[path]` (as `tests/adversarial_s16b.rs` does) and driven on
//! a simulated device with the code its entry points run (`free_or_hold_with` is
//! `cuarena_free_or_hold`'s, `free_with` is `cuarena_free`'s and `cuarena_free_checked`'s).

use cuarena::{Allocator, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

/// The C ABI (`capi/`, built as libcuarena.so), compiled into this test to be called as Rust.
#[allow(dead_code)] // this test calls a subset of it
#[path = "../capi/src/lib.rs"]
mod cuarena_c;
use cuarena_c::*;

mod common;
use common::{host, parse};

fn allocator(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,large_max=1MiB")).unwrap()
}

/// Small, arena large and pool blocks.
const SIZES: [usize; 3] = [4096, 300 << 10, 3 << 20];

fn is_double_free<T: std::fmt::Debug>(r: &cuarena::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
}

/// A free on a stream being captured, through `cuarena_free_or_hold`'s path: held (false), the
/// block stays live (not handed out during the capture), and `graph_capture_end` makes the
/// free, so the memory comes back with no flush or trim. `cuarena_free_checked`'s path refuses
/// the same free and leaves the block live, and a later free of it succeeds.
#[test]
fn a_free_on_a_capturing_stream_is_held_and_made_when_the_capture_ends() {
    let sim = host(0);
    let a = allocator(&sim);
    let rec = Recorded::new(64);
    let u = sim.create_stream();
    for size in SIZES {
        let p = malloc_with(&a, &rec, size, u).unwrap();
        let q = malloc_with(&a, &rec, size, u).unwrap();
        a.graph_capture_begin();
        sim.begin_capture(u).unwrap();
        let live = a.stats().live_bytes;
        assert!(!free_or_hold_with(&a, &rec, p, size, u).unwrap(), "size {size}: not held");
        let checked = free_with(&a, &rec, q, size, u);
        assert!(matches!(checked, Err(Error::StreamCapturing { .. })), "size {size}: {checked:?}");
        assert_eq!(a.stats().live_bytes, live, "size {size}: a free was taken during the capture");
        a.flush().unwrap(); // still capturing: held again
        assert_eq!(a.stats().live_bytes, live, "size {size}: a held free was made during the capture");
        sim.end_capture(u).unwrap();
        a.graph_capture_end().unwrap();
        assert_eq!(
            a.stats().live_bytes,
            live - block(size) as u64,
            "size {size}: the held free was not made when the capture ended"
        );
        // The held free was made once: a second free of p is a double free (or, if p was
        // handed out since, not this block's).
        assert!(free_with(&a, &rec, p, size, u).is_err(), "size {size}: the held free was not made");
        free_with(&a, &rec, q, size, u).unwrap();
    }
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), SIZES.len() as u64);
}

/// A second free of a held block, on any stream and by any path (a plain free, a declared
/// one, another hold), is refused as a double free and counted, whether the capture still
/// runs or not: were it taken, the held free would later free the block again, by then perhaps
/// another caller's. The held free is then made once, at the capture's end. Meanwhile other
/// blocks' frees (which skip the fast path while anything is held) are taken as usual.
#[test]
fn a_second_free_of_a_held_block_is_a_double_free() {
    let sim = host(0);
    let a = allocator(&sim);
    let rec = Recorded::new(64);
    let u = sim.create_stream();
    for size in SIZES {
        let p = malloc_with(&a, &rec, size, u).unwrap();
        let others: Vec<u64> =
            (0..4).map(|_| malloc_with(&a, &rec, size, Stream::PER_THREAD).unwrap()).collect();
        a.graph_capture_begin();
        sim.begin_capture(u).unwrap();
        assert!(!free_or_hold_with(&a, &rec, p, size, u).unwrap());
        let invalid = a.stats().invalid_frees;
        // During the capture, on a stream not captured, so that nothing else refuses them.
        assert!(is_double_free(&free_with(&a, &rec, p, size, Stream::PER_THREAD)), "size {size}");
        assert!(is_double_free(&a.deallocate(cuarena::DeviceAddr(p), size, Stream::LEGACY)), "size {size}");
        assert!(
            is_double_free(&a.deallocate_used_on(
                cuarena::DeviceAddr(p),
                size,
                Stream::PER_THREAD,
                &[Stream::LEGACY]
            )),
            "size {size}"
        );
        assert!(is_double_free(&free_or_hold_with(&a, &rec, p, size, u)), "size {size}");
        assert_eq!(a.stats().invalid_frees, invalid + 4, "size {size}: double frees not counted");
        // Other blocks' frees are taken while p is held.
        let live = a.stats().live_bytes;
        for &o in &others {
            free_with(&a, &rec, o, size, Stream::PER_THREAD).unwrap();
        }
        assert_eq!(a.stats().live_bytes, live - 4 * block(size) as u64, "size {size}");
        sim.end_capture(u).unwrap();
        // After the stream's capture, still held until the announcement ends: still refused.
        assert!(is_double_free(&free_with(&a, &rec, p, size, u)), "size {size}");
        a.graph_capture_end().unwrap();
        assert!(a.take_deferred_error().is_none());
        assert_eq!(
            a.stats().live_bytes,
            live - 5 * block(size) as u64,
            "size {size}: the held free not made once"
        );
    }
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), 5 * SIZES.len() as u64);
}

/// Threads retrying held frees (`flush` on two threads at once, while the capture goes on and
/// after it) while the blocks' owner frees them again and again: every held free is made
/// exactly once, every second free is refused (as a double free, held or made) and counted
/// once, and all memory comes back. An entry stays listed while it is retried, so no second
/// free slips in between a retry's refusal and its hold again.
#[test]
fn concurrent_retries_and_second_frees_make_each_held_free_once() {
    let sim = host(0);
    let a = allocator(&sim);
    let rec = Recorded::new(64);
    let u = sim.create_stream();
    let rounds = 12;
    for round in 0..rounds {
        let size = SIZES[round % SIZES.len()];
        let ps: Vec<u64> = (0..8).map(|_| malloc_with(&a, &rec, size, u).unwrap()).collect();
        let live = a.stats().live_bytes;
        a.graph_capture_begin();
        sim.begin_capture(u).unwrap();
        for &p in &ps {
            assert!(!free_or_hold_with(&a, &rec, p, size, u).unwrap());
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let retriers: Vec<_> = (0..2)
            .map(|_| {
                let (a, stop) = (a.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        a.flush().unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        for i in 0..50 {
            if i == 25 {
                sim.end_capture(u).unwrap();
                a.graph_capture_end().unwrap();
            }
            for &p in &ps {
                let r = free_with(&a, &rec, p, size, if i % 2 == 0 { u } else { Stream::PER_THREAD });
                assert!(matches!(r, Err(Error::InvalidFree { .. })), "round {round}: a second free: {r:?}");
            }
            std::thread::yield_now();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in retriers {
            r.join().unwrap();
        }
        a.flush().unwrap();
        assert!(sim.violations().is_empty(), "round {round}: {:?}", sim.violations());
        assert_eq!(
            a.stats().live_bytes,
            live - 8 * block(size) as u64,
            "round {round}: not every held free made once"
        );
    }
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), (rounds * 8 * 50) as u64);
}

/// A free whose declared stream (`cuarena_record_stream`) is being captured is held too, and
/// made after the capture fenced after that stream's work: the block, freed on its own user
/// stream's arena or pool (where it is reused at once on that stream), is handed out again on
/// that stream only behind the declared work. The block must come back, or the test checks
/// nothing.
#[test]
fn a_held_free_with_a_declared_stream_is_fenced_after_its_work() {
    let sim = host(0);
    let a = allocator(&sim);
    let rec = Recorded::new(64);
    let (w, v) = (sim.create_stream(), sim.create_stream());
    for size in SIZES {
        let p = malloc_with(&a, &rec, size, w).unwrap();
        record_with(std::iter::once(&a), &rec, p, v).unwrap();
        a.graph_capture_begin();
        sim.begin_capture(v).unwrap();
        free_or_hold_with(&a, &rec, p, size, w).unwrap();
        assert!(a.stats().live_bytes >= size as u64, "size {size}: freed during the capture");
        sim.end_capture(v).unwrap();
        // The declared stream's work, still running when the held free is made.
        let gate = sim.gate(v).unwrap();
        sim.write_tag(p, 256, 0x5a, v).unwrap();
        a.graph_capture_end().unwrap();
        let mut got = Vec::new();
        while got.len() < 16 && got.last() != Some(&p) {
            let b = malloc_with(&a, &rec, size, w).unwrap();
            // Overwrites p's first bytes under v's work if the free was not fenced after it.
            sim.write_tag(b, 256, 0x11, w).unwrap();
            got.push(b);
        }
        assert_eq!(got.last(), Some(&p), "size {size}: the block never came back: the test checks nothing");
        gate.open();
        sim.synchronize();
        assert_eq!(
            sim.tag_errors(),
            0,
            "size {size}: the held free's block was reused before its declared work"
        );
        assert!(sim.violations().is_empty(), "size {size}: {:?}", sim.violations());
        for b in got {
            free_with(&a, &rec, b, size, w).unwrap();
        }
    }
    sim.destroy_stream(w).unwrap();
    sim.destroy_stream(v).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

fn block(size: usize) -> usize {
    cuarena::size_class::block_bytes(size, 64 << 10).unwrap()
}
