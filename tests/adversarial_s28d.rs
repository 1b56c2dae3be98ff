//! Twenty-eighth session: the mends of helper-41's audit of the docs against the code, where
//! the code, not the docs, was changed.
//!
//! 1. A batch of remote frees on the per-thread or legacy stream whose fence cannot be made
//!    (the driver fails the record, or a capture refuses it) waited in the freeing thread's
//!    outbox (`Outbox::refused`) until that thread's next `flush`, `trim` or exit, out of every
//!    other thread's reach, and as long as the failures lasted it grew without the bound the
//!    outbox's docs state (one batch a thread). Now it is parked at once
//!    (`Inner::park_refused`), where another thread's out-of-memory takes it back after its
//!    device synchronise. Mutation `refused_stay_in_outbox`.
//! 2. A user-stream batch that a `flush` kept (more than 64 MiB parked) was sent by the thread's
//!    next allocation of at most `large_max` on its stream, or its next free of another
//!    arena's block there, but not by its own fast free there, a pool block's free there, or
//!    an allocation over `large_max` there, though the docs said "its next call on its stream".
//!    Now any of these sends it (`Slot::send_due_user`). Mutation
//!    `due_batches_wait_for_small_calls`.

// `common/flaky.rs` brings its fault workload too, which these tests do not run.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, Result, Stream, StreamKey};
use cuarena_testkit::{HostConfig, HostDevice, Interpose, Interposed, assert_all_returned};

mod common;
use common::*;

include!("common/flaky.rs");

// ---------------------------------------------------------------------------------------------
// 1. Frees whose fence failed are reachable by another thread's out-of-memory.

/// An owner allocates 192 blocks of 32 KiB (6 MiB) on its per-thread stream under an 8 MiB cap
/// and goes idle. Another thread frees them all on its own per-thread stream (remote frees),
/// while every event record fails: its three full batches get no fence, each failure
/// reported. That thread then goes idle too, and a third thread asks for 7 MiB. Its
/// out-of-memory reclaim must reach the frees: parked, they go to the owner's inbox after the
/// reclaim's device synchronise, the owner's emptied superblocks go back, and the request
/// fits. (Before, they waited in the idle freeing thread's outbox, and the request failed.)
#[test]
fn frees_whose_fence_failed_are_reachable_by_another_threads_out_of_memory() {
    within(60, || {
        let sim = host(20);
        let (dev, a) = flaky_allocator(&sim, small().max_bytes(8 * MIB));
        let n = 32 << 10;
        let owner = Worker::new(&a);
        let blocks: Vec<DeviceAddr> =
            owner.run(move |a| (0..192).map(|_| a.allocate(n, Stream::PER_THREAD).unwrap()).collect());
        let freer = Worker::new(&a);
        let d = dev.clone();
        freer.run(move |a| {
            d.arm(Call::Record, 0);
            for (i, p) in blocks.into_iter().enumerate() {
                // A free is accepted even when its batch's record fails (the error deferred).
                a.deallocate(p, n, Stream::PER_THREAD).unwrap();
                if i % 64 != 63 {
                    continue;
                }
                // The batch just flushed used up the armed failure: arm the next one.
                assert!(!d.disarm(), "the full batch did not try to record its event");
                d.arm(Call::Record, 0);
            }
            d.disarm();
        });
        assert!(take_injected(&a, true, "the three batches") > 0, "no injected failure was reported");
        let st = a.stats();
        assert_eq!(st.live_bytes, 0, "{st:?}");
        // A third thread, while the owner and the freer are idle.
        let got = on_thread(&a, |a| {
            let p = a.allocate(7 * MIB, Stream::PER_THREAD)?;
            a.deallocate(p, 7 * MIB, Stream::PER_THREAD)?;
            Ok::<_, Error>(())
        });
        got.unwrap_or_else(|e| panic!("7 MiB under an 8 MiB cap with nothing live: {e}; {:?}", a.stats()));
        freer.exit();
        owner.exit();
        take_injected(&a, false, "cleanup");
        all_back(&a, &sim);
    });
}

// ---------------------------------------------------------------------------------------------
// 2. A kept user-stream batch is sent by any call on its stream.

/// `Allocator::flush` says a batch it keeps is sent by the thread's next call on its stream:
/// here each kind of call that `Outbox::tick_user` and `Outbox::push_user` do not see.
fn kept_batch_is_sent_by(next: Next) {
    within(60, move || {
        let reused = kept_batch_reaches_owner_after(next);
        assert!(
            reused > 0,
            "{next:?}: the worker's 32 frees on u did not reach their owner after its next call on u: \
             none of their blocks was reused by the owner's 32 new allocations on u"
        );
    });
}

#[test]
fn a_kept_user_batch_is_sent_by_the_owners_own_free_on_its_stream() {
    kept_batch_is_sent_by(Next::OwnFree);
}

#[test]
fn a_kept_user_batch_is_sent_by_a_pool_blocks_free_on_its_stream() {
    kept_batch_is_sent_by(Next::PoolFree);
}

#[test]
fn a_kept_user_batch_is_sent_by_a_pool_allocation_on_its_stream() {
    kept_batch_is_sent_by(Next::PoolAlloc);
}
