//! Model of the held frees (`Allocator::deallocate_or_hold`, `src/allocator.rs`): a free refused
//! because a capture forbids what it needs is held, and made again by the next call that
//! retries the list, `graph_capture_end` first. Two atomics beside the list's mutex:
//! `held_count` (the list's length, read without the lock so that a free skips the held-list
//! check while nothing is held) and `capture_ends` (counted by each `graph_capture_end` before
//! its retry; a hold that sees it changed since its refusal retries itself). A retried entry
//! stays listed, marked with the retry's token (`next_id`), so a second free of the block
//! waits for the retry and then meets the block freed: refused as a double free throughout.
//!
//! The refused free here is declared used on the legacy stream (`record_stream`), which an
//! announced capture forbids (`order_for_free`): the model device's capture is announced and
//! reads the legacy stream as capturing.
#![cfg(loom)]

use std::sync::Arc;

use cuarena::{Allocator, DeviceAddr, Error, InvalidFree, Stream};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use loom_tests::common::{SB, assert_all_returned, model, setup_one_superblock, wait_for};
use loom_tests::model::ModelDevice;

/// The size of the blocks held here.
const SIZE: usize = SB / 4;

/// A block of the calling thread's, whose free (declared used on the legacy stream) is held:
/// a capture is announced and a blocking stream's capture begun on the model device. Both stay
/// open for the caller to end.
fn hold_a_free(dev: &ModelDevice, a: &Allocator) -> DeviceAddr {
    let p = a.allocate(SIZE, Stream::PER_THREAD).unwrap();
    a.graph_capture_begin();
    dev.begin_capture();
    assert!(!a.deallocate_or_hold(p, SIZE, Stream::PER_THREAD, &[Stream::LEGACY]).unwrap(), "not held");
    p
}

/// A thread that ends the capture (the model device's, then the allocator's announcement) and
/// says so, then waits for the word to send its remote frees (its release): the caller checks
/// the held list between the two.
struct Ending {
    ended: Arc<AtomicBool>,
    go: Arc<AtomicBool>,
    thread: thread::JoinHandle<()>,
}

impl Ending {
    fn start(dev: &Arc<ModelDevice>, a: &Allocator) -> Ending {
        let (ended, go) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (a2, dev2, ended2, go2) = (a.clone(), dev.clone(), ended.clone(), go.clone());
        let thread = thread::spawn(move || {
            dev2.end_capture();
            a2.graph_capture_end().unwrap();
            ended2.store(true, Ordering::Release);
            // The held list is read before this thread sends its remote frees (its release).
            wait_for(|| go2.load(Ordering::Acquire).then_some(()));
            a2.release_thread().unwrap();
        });
        Ending { ended, go, thread }
    }

    /// Waits until the capture's end (and its retry) has returned.
    fn wait_ended(&self) {
        wait_for(|| self.ended.load(Ordering::Acquire).then_some(()));
    }

    /// Lets the thread send its remote frees, and joins it.
    fn finish(self) {
        self.go.store(true, Ordering::Release);
        self.thread.join().unwrap();
    }
}

/// A declared free refused during an announced capture races the capture's end on another
/// thread: it is taken at once (the end came first), or held and made by the end's retry, or
/// held after the end's retry and made by its own retry (it saw `capture_ends` change). In
/// every order nothing is held when both calls return, with no flush, trim or release; then,
/// once the ending thread has sent its remote frees, every byte is back. The mutations
/// `hold_ignores_capture_end` (no retry by the hold) and `capture_end_skips_on_count` (the
/// end's retry skips the list on a `Relaxed` 0 of `held_count`) must fail this.
#[test]
fn a_free_held_around_a_captures_end_is_made_by_one_of_them() {
    model(|| {
        let (dev, a) = setup_one_superblock();
        let p = a.allocate(SIZE, Stream::PER_THREAD).unwrap();
        a.graph_capture_begin();
        dev.begin_capture();
        let end = Ending::start(&dev, &a);
        let taken = a.deallocate_or_hold(p, SIZE, Stream::PER_THREAD, &[Stream::LEGACY]).unwrap();
        end.wait_ended();
        assert_eq!(a.held_frees(), 0, "the free is still held (taken now: {taken})");
        end.finish();
        assert!(a.take_deferred_error().is_none());
        assert_all_returned(&a);
    });
}

/// A held free retried by another thread's `graph_capture_end` while its block's owner frees
/// it again: the second free is refused as a double free in every order (it finds the entry
/// listed, or being retried, and waits for the retry, then meets the block already freed),
/// and the held free is made exactly once. The mutation `retry_unlists_held` (the
/// entry taken out of the list while retried) must fail this.
#[test]
fn a_second_free_racing_the_retry_of_a_held_free_is_refused() {
    model(|| {
        let (dev, a) = setup_one_superblock();
        hold_a_free(&dev, &a);
        dev.end_capture();
        a.graph_capture_end().unwrap(); // made here
        // Held again by a second announcement, so that the racing retry has it to make.
        let q = hold_a_free(&dev, &a);
        dev.end_capture();
        let a2 = a.clone();
        let retry = thread::spawn(move || {
            a2.graph_capture_end().unwrap();
            a2.release_thread().unwrap();
        });
        let second = a.deallocate(DeviceAddr(q.0), SIZE, Stream::PER_THREAD);
        retry.join().unwrap();
        assert!(
            matches!(second, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })),
            "a second free of a held block: {second:?}"
        );
        assert_eq!(a.stats().invalid_frees, 1);
        assert_eq!(a.stats().live_bytes, 0, "the held free was not made once");
        assert!(matches!(a.take_deferred_error(), None | Some(Error::InvalidFree { .. })));
        a.reset_counters();
        let _ = a.take_deferred_error();
        assert_all_returned(&a);
    });
}

/// A retry (the holding thread's `flush`) races the capture's end on another thread while a
/// free is held: the retry may mark the entry, be refused (the capture is still announced), and
/// unmark it after the end's own retry skipped it as another retry's. In every order nothing is
/// held when both calls return: the retry that saw an end come while it ran goes round again
/// (helper-55). The mutation `retry_ignores_capture_end` must fail this.
#[test]
fn a_retry_racing_the_captures_end_leaves_nothing_held() {
    model(|| {
        let (dev, a) = setup_one_superblock();
        hold_a_free(&dev, &a);
        let end = Ending::start(&dev, &a);
        a.flush().unwrap();
        end.wait_ended();
        assert_eq!(a.held_frees(), 0, "a free is still held with no capture running");
        end.finish();
        assert!(a.take_deferred_error().is_none());
        assert_all_returned(&a);
    });
}
