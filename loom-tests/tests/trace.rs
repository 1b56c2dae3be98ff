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
