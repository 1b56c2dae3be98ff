//! The C ABI's frees refused for a CUDA graph capture (thirty-second session).
//!
//! `cuarena_free` answers nothing, and PyTorch's deleter, which calls it, cannot free a block
//! again: a free refused because its stream (or a declared one) is being captured is held and
//! made after the capture (`Allocator::deallocate_or_hold`), by `graph_capture_end` (PyTorch's
//! route to a pool closing), a flush, a trim or the thread's release. Before, the refusal only
//! set `cuarena_last_error`, and the block stayed live for the process's life.
//! `cuarena_free_checked` still answers -1 and leaves the block live, for its caller to free
//! again.
//!
//! The C ABI is compiled in with `#[path]` (as `tests/adversarial_s16b.rs` does) and driven on
//! a simulated device with the code its entry points run (`free_or_hold_with` is
//! `cuarena_free`'s, `free_with` is `cuarena_free_checked`'s).

use cuarena::{Allocator, Error};
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

/// A free on a stream being captured, through `cuarena_free`'s path: no error, the block stays
/// live (not handed out during the capture), and `graph_capture_end` makes the free, so the
/// memory comes back with no flush or trim. `cuarena_free_checked`'s path refuses the same free
/// and leaves the block live, and a later free of it succeeds.
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
        free_or_hold_with(&a, &rec, p, size, u).expect("cuarena_free's path answers no error");
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
