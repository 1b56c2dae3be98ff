//! Model of the announced-capture table (`src/sync.rs`, `CAPTURES`), driving the real allocator:
//! a capture announced with `Allocator::graph_capture_begin` (as PyTorch announces one before
//! it begins) must not be broken by a device synchronise or a use of the legacy stream that
//! checked for captures just before the announcement. Each such check and its use run as a
//! reader of the device's entry, and an announcement waits for the readers to leave.
//!
//! The capture is of a blocking stream: while it is open, the model device reads the legacy
//! stream as capturing and panics at a synchronise or a legacy-stream action
//! (`ModelDevice::begin_capture`).
#![cfg(loom)]

use cuarena::{Allocator, Stream};
use loom::thread;
use loom_tests::common::{
    SB, assert_all_returned, model, park_an_arena, setup_legacy_pool, setup_one_superblock,
};
use loom_tests::model::ModelDevice;
use std::sync::Arc;

/// The capturing thread: announce, begin the capture on the device, end it, end the
/// announcement.
fn capture(a: Allocator, dev: Arc<ModelDevice>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        a.graph_capture_begin();
        dev.begin_capture();
        dev.end_capture();
        a.graph_capture_end().unwrap();
        a.release_thread().unwrap();
    })
}

/// A blocking trim (`Inner::bury_zombies`, whose device synchronise gives back an arena of a
/// destroyed stream) races an announced capture: the synchronise runs wholly before the
/// announcement or not at all (the arena then stays parked, without an error). The mutation
/// `synchronise_after_unlock` (the check and the synchronise outside the reader) must fail this.
#[test]
fn a_synchronise_never_runs_inside_an_announced_capture() {
    model(|| {
        let (dev, a) = setup_one_superblock();
        let s = Stream::from_raw(0x100);
        // An arena of a user stream, destroyed with the memory freed on it: parked until a
        // device synchronise.
        park_an_arena(&a, &dev, s);
        assert_eq!(a.parked_bytes(), SB);
        let c = capture(a.clone(), dev.clone());
        a.trim(true).unwrap();
        c.join().unwrap();
        // No capture now: the trim synchronises and the arena comes back.
        a.trim(true).unwrap();
        assert!(dev.syncs() > 0);
        assert_eq!(a.parked_bytes(), 0);
        assert_all_returned(&a);
    });
}

/// A pool block freed on the legacy stream (a lazy legacy fence: no event until reuse) is
/// taken by an allocation on a user stream, which records on the legacy stream outside any
/// call on it (`Counted::checked`), racing an announced capture: the record runs wholly before
/// the announcement, or the block is not taken. The mutation `legacy_check_unlocked` (the
/// capture check and the record outside the reader) must fail this.
#[test]
fn a_legacy_record_never_runs_inside_an_announced_capture() {
    model(|| {
        let (dev, a) = setup_legacy_pool();
        let s = Stream::from_raw(0x100);
        let p = a.allocate(SB, Stream::LEGACY).unwrap();
        a.deallocate(p, SB, Stream::LEGACY).unwrap();
        a.flush().unwrap();
        let c = capture(a.clone(), dev.clone());
        let q = a.allocate(SB, s).unwrap();
        c.join().unwrap();
        a.deallocate(q, SB, s).unwrap();
        a.flush().unwrap();
        assert_all_returned(&a);
    });
}
