//! Replay players waiting for another player's allocation (`replay.rs`): a free of a block
//! another recorded thread allocates waits for that allocation's slot. It yields a few times,
//! then parks here until the allocating player stores the slot and wakes it, so that hundreds
//! of waiting players on a few cores leave the cores to the players they wait for (with yields
//! alone, a ring of 1,024 recorded threads on two cores took about a millisecond per
//! hand-over). Waits are not in the measured latencies.
//!
//! ## Protocol
//! A store-then-check on both sides, each side's store and check split by a `SeqCst` fence:
//! - **wait** (the freeing player): register in `by_slot` (under its lock), increment
//!   `parked` (`SeqCst`, a release of the registration), fence, then load the slot (`Acquire`);
//!   park while it is `PENDING`;
//! - **store** (the allocating player): store the slot (`Release`), fence, then load `parked`
//!   (`Acquire`); if it is not 0, unpark the thread registered for the slot, if any.
//!
//! The two fences are ordered in the single total order of `SeqCst` operations. If the
//! waiter's comes first, the storer's load of `parked` sees the increment (and, through it, the
//! registration made before it under the lock) and unparks the waiter; if the storer's comes
//! first, the waiter's load of the slot sees the store. An unpark before the park is kept by
//! the thread's token, and an unpark happens before the park it ends returns, so no wake-up is
//! lost. Fences, not `SeqCst` operations alone (which would do in the language's model): loom
//! models `SeqCst` operations as acquire-release and fences as `SeqCst`, and on the first
//! version, all `SeqCst` operations, its model reported the lost wake-up that model allows. A
//! player that cannot go on (its thread could not be made, or it panicked) gives up and wakes
//! every waiter ([`Waiters::abandon`]): it sets `abandoned` and then takes the lock, so a waiter
//! registered before that is unparked and one registered after it sees the flag.
//!
//! Invariants: `parked` is the number of waiters between their increment and their decrement;
//! `by_slot` holds, for each slot a waiter has registered for and not yet left, that waiter's
//! thread (one waiter per slot: a recorded allocation is freed once). `abandoned` is never
//! cleared.
//!
//! The primitives come from `crate::waiter_sync`: `std`'s in the benchmark, where a park also
//! times out after 100 ms (a backstop that costs nothing while the protocol holds), and loom's
//! in the model `loom-tests/tests/replay_waiters.rs`, which includes this file as it is and
//! parks without a timeout, so that a lost wake-up is a deadlock loom reports. The mutation
//! `waiters_load_parked_first` (the storer loads `parked` before it stores the slot) must fail
//! that model.

use std::collections::HashMap;

use crate::waiter_sync::{
    AtomicBool, AtomicU64, AtomicUsize, Mutex, MutexGuard, Ordering, SPINS, Thread, current, fence, park,
    yield_now,
};

/// A slot not yet stored: the allocation has not happened.
pub(crate) const PENDING: u64 = 0;

/// The waiting players of one replay (see the module comment).
#[derive(Default)]
pub(crate) struct Waiters {
    parked: AtomicUsize,
    by_slot: Mutex<HashMap<usize, Thread>>,
    /// Set by [`Waiters::abandon`].
    abandoned: AtomicBool,
}

impl Waiters {
    /// The slot's value once it is no longer `PENDING`, or `PENDING` once a player gave up.
    pub(crate) fn wait(&self, slot: &AtomicU64, id: usize) -> u64 {
        for _ in 0..SPINS {
            let p = slot.load(Ordering::Acquire);
            if p != PENDING || self.abandoned.load(Ordering::Acquire) {
                return p;
            }
            yield_now();
        }
        lock(&self.by_slot).insert(id, current());
        self.parked.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let p = loop {
            let p = slot.load(Ordering::Acquire);
            if p != PENDING || self.abandoned.load(Ordering::Acquire) {
                break p;
            }
            park();
        };
        self.parked.fetch_sub(1, Ordering::SeqCst);
        lock(&self.by_slot).remove(&id);
        p
    }

    /// Stores `v` in slot `id` and wakes its waiter, if one is parked.
    pub(crate) fn store(&self, slots: &[AtomicU64], id: usize, v: u64) {
        // The mutation `waiters_load_parked_first` loads `parked` before the store: a waiter
        // that registers between the two is never woken (the model must fail).
        let early =
            cfg!(cuarena_mutant = "waiters_load_parked_first").then(|| self.parked.load(Ordering::Acquire));
        slots[id].store(v, Ordering::Release);
        fence(Ordering::SeqCst);
        let parked = early.unwrap_or_else(|| self.parked.load(Ordering::Acquire));
        if parked > 0
            && let Some(t) = lock(&self.by_slot).get(&id)
        {
            t.unpark();
        }
    }

    /// One player cannot go on: every wait ends, at once or when its park is woken.
    pub(crate) fn abandon(&self) {
        self.abandoned.store(true, Ordering::SeqCst);
        for t in lock(&self.by_slot).values() {
            t.unpark();
        }
    }

    /// True once a player gave up.
    pub(crate) fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
