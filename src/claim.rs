//! Exclusive access to an arena's owner-only state, for its owner or for another thread.
//!
//! An arena's free lists and boundary tags are touched without locks by the owning thread. To
//! reclaim memory from an arena whose owner is idle (blocked elsewhere, parked in a thread
//! pool), another thread, the *reclaimer*, must take that state for a moment without the
//! owner's help. A lock on the owner's fast path would cost an atomic read-modify-write per
//! operation; instead this is Dekker's protocol with an asymmetric barrier:
//!
//! - **owner** `enter`: store `busy = true`; *light* barrier; load `claimed`. If set, store
//!   `busy = false` and do not touch the arena (the caller takes a path that does not need
//!   it). Otherwise the arena is the owner's until `leave` stores `busy = false` (`Release`).
//! - **reclaimer** `try_claim`: under `reclaimers` (one at a time), store `claimed = true`;
//!   *heavy* barrier; load `busy` (`Acquire`). If set, store `claimed = false` and give up (the
//!   owner is active: it will drain its own arena). Otherwise the arena is the reclaimer's until
//!   the guard stores `claimed = false` (`Release`).
//!
//! The barriers (`sync::light_barrier`, `sync::heavy_barrier`) order each side's store before
//! its load: then at least one side sees the other's flag, so owner and reclaimer are never
//! both inside. The light barrier is a compiler fence; the heavy one is
//! `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`, which makes every running thread of the
//! process execute a full memory barrier before it returns, so either the owner's store has
//! left its store buffer, or the owner's load runs after the barrier and sees `claimed`. The
//! owner's fast path thus costs two plain stores and a load: no read-modify-write, no lock, no
//! hardware fence. Where `membarrier` is unavailable (not Linux, or refused), the light barrier
//! is a full `SeqCst` fence instead. Under loom both barriers are `fence(SeqCst)`, which loom
//! models; `loom-tests/tests/claim.rs` checks the protocol, and its mutation
//! `claim_no_light_barrier` must fail.
//!
//! `Acquire`/`Release` on the flags pass the arena's contents between the two sides: the
//! reclaimer's `Acquire` load of `busy` reads the owner's last `leave`, and the owner's
//! `Acquire` load of `claimed` reads the reclaimer's release of the claim.

use crate::sync::{AtomicBool, Mutex, MutexGuard, Ordering, heavy_barrier, light_barrier, lock, yield_now};

/// The flags of one arena (see the module comment). On a cache line of their own: the owner
/// touches them on every operation, and other threads push into the inbox beside them.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Claim {
    /// Written by the owner only.
    busy: AtomicBool,
    /// Written by a reclaimer only, under `reclaimers`.
    claimed: AtomicBool,
    reclaimers: Mutex<()>,
}

/// A reclaimer's hold on an arena; released on drop.
pub(crate) struct Claimed<'a> {
    claim: &'a Claim,
    _one_at_a_time: MutexGuard<'a, ()>,
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        self.claim.claimed.store(false, Ordering::Release);
    }
}

impl Claim {
    /// The owner starts touching its arena. False if a reclaimer holds it: then the owner must
    /// not touch it (and need not call [`Claim::leave`]).
    #[inline]
    pub(crate) fn enter(&self) -> bool {
        self.busy.store(true, Ordering::Relaxed);
        light_barrier();
        if self.claimed.load(Ordering::Acquire) {
            self.busy.store(false, Ordering::Release);
            return false;
        }
        true
    }

    /// The owner is done touching its arena.
    #[inline]
    pub(crate) fn leave(&self) {
        self.busy.store(false, Ordering::Release);
    }

    /// The owner waits for a reclaimer to finish (thread exit, which must get in).
    #[cold]
    pub(crate) fn enter_waiting(&self) {
        while !self.enter() {
            yield_now();
        }
    }

    /// Takes the arena from an idle owner; `None` if the owner is inside an operation.
    #[cold]
    pub(crate) fn try_claim(&self) -> Option<Claimed<'_>> {
        let guard = lock(&self.reclaimers);
        self.claimed.store(true, Ordering::Relaxed);
        if !heavy_barrier() || self.busy.load(Ordering::Acquire) {
            self.claimed.store(false, Ordering::Release);
            return None;
        }
        Some(Claimed { claim: self, _one_at_a_time: guard })
    }
}
