//! Resets of the statistics (`src/stats.rs`) racing a thread's counting and a read. A thread's
//! counters are written by that thread alone with load + store; a reset only reads them (into
//! baselines, and the peak window's base), and the thread restarts its own peak window when it
//! sees the reset's epoch (a Dekker pair with the asymmetric barrier). Mutations that must fail:
//! `stats_peak_no_barrier` (the thread's barrier dropped: an allocation's live value can be
//! missed by both the window base and the thread's new window) and
//! `stats_reset_stores_counters` (the reset zeroes the threads' counters: the owner's load +
//! store overwrites the zero, a lost reset).
#![cfg(loom)]

use std::sync::Arc;

use cuarena::loom_api::StatsModel;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use loom_tests::common::model;

/// A thread allocates 100 B, frees them, allocates 10 B, while another resets the peak and
/// reads. At the quiescent end the sampled peak (what the read saw since the reset) is at most
/// the upper bound, which covers every live value after the reset.
#[test]
fn a_peak_reset_racing_a_threads_allocations_keeps_the_upper_bound() {
    model(|| {
        let m = StatsModel::new();
        let m2 = m.clone();
        let worker = thread::spawn(move || {
            let t = m2.register();
            t.alloc(100);
            t.free(100);
            t.alloc(10);
            t
        });
        m.reset_peak();
        let (_, _, lower_mid, _) = m.read();
        let t = worker.join().unwrap();
        let (_, live, lower, upper) = m.read();
        assert_eq!(live, 10);
        assert!(lower >= lower_mid);
        assert!(lower <= upper && live <= upper, "sampled peak {lower} over the upper bound {upper}");
        drop(t);
    });
}

/// A thread counts two allocations; the other resets the counters after seeing the first
/// counted. After the join, at most the second is counted: the reset was not lost.
#[test]
fn a_counter_reset_racing_a_threads_bumps_is_not_lost() {
    model(|| {
        let m = StatsModel::new();
        let first = Arc::new(AtomicBool::new(false));
        let (m2, f2) = (m.clone(), first.clone());
        let t = m.register(); // registered before the reset can run
        let worker = thread::spawn(move || {
            t.alloc(256);
            f2.store(true, Ordering::Release);
            t.alloc(256);
            t
        });
        while !first.load(Ordering::Acquire) {
            thread::yield_now();
        }
        m2.reset_counters();
        let (mid, ..) = m2.read();
        assert!(mid <= 1, "{mid}");
        let t = worker.join().unwrap();
        let (allocations, live, ..) = m2.read();
        assert!(allocations <= 1, "{allocations} allocations counted after a reset that followed the first");
        assert_eq!(live, 512, "gauges are not reset");
        drop(t);
    });
}

/// `stats=exact`: a thread allocates 100 B and frees them while another resets the peak. At the
/// quiescent end the exact peak is at most the upper bound. A free that lowered the thread's
/// live counter before the shared one let a reset between the two take the thread's low value
/// as its window's base and the shared counter's high one as the exact peak: 100 over 0 (found
/// by an adversarial pass). Now the shared counter goes first and the thread's store is
/// `Release`, read with `Acquire` by the reset; the mutation `stats_exact_free_local_first`
/// (the old order) must fail this.
#[test]
fn an_exact_peak_reset_racing_a_free_stays_within_the_upper_bound() {
    model(|| {
        let m = StatsModel::exact();
        let m2 = m.clone();
        let worker = thread::spawn(move || {
            let t = m2.register();
            t.alloc(100);
            t.free(100);
            t
        });
        m.reset_peak();
        let t = worker.join().unwrap();
        let (_, live, peak, upper) = m.read();
        assert_eq!(live, 0);
        assert!(peak <= upper, "exact peak {peak} over the upper bound {upper}");
        drop(t);
    });
}
