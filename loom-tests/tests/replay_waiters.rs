//! The replay's waits (`benches/src/waiters.rs`): a player waiting for another player's
//! allocation registers and then checks its slot; the allocating player stores the slot and
//! then checks for waiters. The file is included here as it is, over loom's primitives, with a
//! park that never times out: a lost wake-up leaves the waiter parked for good, which loom
//! reports as a deadlock. The mutation `waiters_load_parked_first` (the storer checks for
//! waiters before it stores) must make `a_wait_racing_the_store_sees_the_value` fail.
#![cfg(loom)]

use std::sync::Arc;

use loom::sync::atomic::AtomicU64;
use loom::thread;
use loom_tests::common::model;

/// Loom's primitives in the place of `std`'s (`crate::waiter_sync` in `benches/src/lib.rs`).
mod waiter_sync {
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
    pub(crate) use loom::sync::{Mutex, MutexGuard};
    pub(crate) use loom::thread::{Thread, current, park, yield_now};

    /// One yield before the park: the spin only shortens waits, and each yield multiplies the
    /// schedules loom explores.
    pub(crate) const SPINS: usize = 1;
}

#[path = "../../benches/src/waiters.rs"]
#[allow(dead_code)] // `abandoned` is the replay's
mod waiters;
use waiters::{PENDING, Waiters};

fn slots(n: usize) -> Arc<Vec<AtomicU64>> {
    Arc::new((0..n).map(|_| AtomicU64::new(PENDING)).collect())
}

#[test]
fn a_wait_racing_the_store_sees_the_value() {
    model(|| {
        let (w, s) = (Arc::new(Waiters::default()), slots(1));
        let (w2, s2) = (w.clone(), s.clone());
        let storer = thread::spawn(move || w2.store(&s2, 0, 7));
        assert_eq!(w.wait(&s[0], 0), 7);
        storer.join().unwrap();
    });
}

#[test]
fn two_waiters_on_two_slots_both_wake() {
    // The count of parked waiters is shared: a storer that sees another slot's waiter must
    // still wake its own, or its own must see the value.
    model(|| {
        let (w, s) = (Arc::new(Waiters::default()), slots(2));
        let (w2, s2) = (w.clone(), s.clone());
        let other = thread::spawn(move || w2.wait(&s2[1], 1));
        w.store(&s, 1, 9);
        w.store(&s, 0, 5);
        assert_eq!(w.wait(&s[0], 0), 5);
        assert_eq!(other.join().unwrap(), 9);
    });
}

#[test]
fn an_abandon_racing_a_wait_ends_it() {
    model(|| {
        let (w, s) = (Arc::new(Waiters::default()), slots(1));
        let w2 = w.clone();
        let quitter = thread::spawn(move || w2.abandon());
        // Nobody stores the slot: only the abandon can end the wait.
        assert_eq!(w.wait(&s[0], 0), PENDING);
        quitter.join().unwrap();
    });
}
