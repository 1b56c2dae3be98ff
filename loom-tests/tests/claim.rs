//! The claim protocol (`src/claim.rs`): an owner that touches its arena with two plain stores
//! and a load, and a reclaimer that takes the arena from an idle owner. Loom checks that they
//! are never inside at once (the state is a tracked cell) and that each side sees the other's
//! writes. The mutation `claim_no_light_barrier` drops the owner's barrier: this model must
//! then fail.
#![cfg(loom)]

use cuarena::loom_api::ClaimModel;
use loom::thread;
use loom_tests::common::model;

#[test]
fn an_owner_and_a_reclaimer_are_never_inside_at_once() {
    model(|| {
        let m = ClaimModel::new();
        let m2 = m.clone();
        let reclaimer = thread::spawn(move || m2.reclaim_op());
        let mut owner_ops = 0;
        for _ in 0..2 {
            owner_ops += u64::from(m.owner_op());
        }
        let reclaimed = reclaimer.join().unwrap();
        m.owner_exit();
        assert_eq!(m.state(), owner_ops + 1 + if reclaimed { 100 } else { 0 });
    });
}

#[test]
fn an_exiting_owner_waits_out_a_reclaimer() {
    model(|| {
        let m = ClaimModel::new();
        let m2 = m.clone();
        let reclaimer = thread::spawn(move || m2.reclaim_op());
        m.owner_exit();
        let reclaimed = reclaimer.join().unwrap();
        assert_eq!(m.state(), 1 + if reclaimed { 100 } else { 0 });
    });
}
