//! The trace buffers' hand-off (`src/trace.rs`): an owner appends records to its own buffer
//! with no lock and writes it out when full, while `stop` turns recording off and collects
//! every buffer without the owner's help. Loom checks that owner and collector never touch a
//! buffer at once (the buffer is a tracked cell), and that every record the owner reports as
//! recorded is in the file exactly once. The mutations `trace_no_owner_fence` (the owner's
//! fence between `active = true` and its load of `on` dropped) and `trace_no_wait` (`stop`
//! does not wait for an active owner) must fail it.
#![cfg(loom)]

use cuarena::loom_api::TraceModel;
use loom::thread;
use loom_tests::common::model;

fn check(recorded: &[u64], file: &[u64]) {
    let mut f = file.to_vec();
    f.sort_unstable();
    assert_eq!(recorded, &f[..], "the file must hold exactly the records the owner made");
}

#[test]
fn a_stop_racing_an_owner_loses_and_duplicates_no_record() {
    model(|| {
        // A buffer of 2: the third record comes after the owner wrote its full buffer out.
        let m = TraceModel::new(2);
        let m2 = m.clone();
        let owner = thread::spawn(move || {
            let log = m2.register();
            let recorded: Vec<u64> = (1..=3).filter(|&v| m2.record(&log, v)).collect();
            (recorded, log)
        });
        let file = m.stop();
        let (recorded, log) = owner.join().unwrap();
        check(&recorded, &file);
        m.exit(log);
    });
}

#[test]
fn a_stop_racing_an_owners_exit_loses_no_record() {
    model(|| {
        let m = TraceModel::new(4);
        let log = m.register();
        let recorded: Vec<u64> = (1..=2).filter(|&v| m.record(&log, v)).collect();
        assert_eq!(recorded, [1, 2]);
        let m2 = m.clone();
        let owner = thread::spawn(move || m2.exit(log));
        let file = m.stop();
        owner.join().unwrap();
        check(&recorded, &file);
    });
}

/// An allocation racing the start: thread X frees block 7 (recorded if the trace runs by then)
/// and hands it over; thread Y's allocation may take it. If the trace holds X's free and Y got
/// the block, it must hold Y's allocation too, or the trace shows two frees in a row (found
/// by an adversarial pass in session 3). The mutation `trace_alloc_flag_first` (the flag read
/// before the allocation, as then) must fail it.
#[test]
fn an_allocation_that_takes_a_recorded_free_is_recorded() {
    use loom::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    model(|| {
        let m = TraceModel::stopped(4);
        let handed = Arc::new(AtomicU64::new(0));
        let (m2, h2) = (m.clone(), handed.clone());
        let x = thread::spawn(move || {
            let log = m2.register();
            let recorded = m2.record(&log, 7);
            h2.store(7, Ordering::Release); // the block reaches other threads after its free
            (recorded, log)
        });
        let (m3, h3) = (m.clone(), handed.clone());
        let y = thread::spawn(move || {
            let log = m3.register();
            let (got, recorded) = m3.allocate(&log, || Some(h3.load(Ordering::Acquire)).filter(|&v| v != 0));
            (got, recorded, log)
        });
        m.start();
        let (freed, xlog) = x.join().unwrap();
        let (got, allocated, ylog) = y.join().unwrap();
        let file = m.stop_records();
        if freed && got == Some(7) {
            assert!(allocated, "the block's free is recorded and its reuse is not: {file:?}");
        }
        let expect = usize::from(freed) + usize::from(allocated);
        assert_eq!(file.len(), expect, "{file:?}");
        m.exit(xlog);
        m.exit(ylog);
    });
}
