//! The arena inbox (`src/inbox.rs`): pushes from several threads, a drain and a close by the
//! owner. No value may be lost or delivered twice, and a taken value is seen whole (the node's
//! value is a tracked cell, so a push published without `Release` is a causality error).
#![cfg(loom)]

use std::sync::Arc;

use cuarena::inbox::Inbox;
use loom::thread;

#[test]
fn concurrent_pushes_and_drains_deliver_each_value_once() {
    loom::model(|| {
        let ib = Arc::new(Inbox::default());
        let ib2 = ib.clone();
        let owner = thread::spawn(move || ib2.take_all());
        ib.push(1u32).expect("open inbox");
        let ib3 = ib.clone();
        let pusher = thread::spawn(move || ib3.push(2u32).expect("open inbox"));
        let mut got = owner.join().unwrap();
        pusher.join().unwrap();
        got.extend(ib.take_all());
        got.sort();
        assert_eq!(got, vec![1, 2]);
    });
}

#[test]
fn a_push_racing_close_is_delivered_or_handed_back() {
    loom::model(|| {
        let ib = Arc::new(Inbox::default());
        let ib2 = ib.clone();
        let owner = thread::spawn(move || {
            let mut got = ib2.take_all();
            got.extend(ib2.close());
            got
        });
        let refused: Vec<u32> = [1u32, 2].into_iter().filter_map(|v| ib.push(v).err()).collect();
        let mut got = owner.join().unwrap();
        assert!(ib.take_all().is_empty() && ib.close().is_empty(), "nothing lands after close");
        got.extend(refused);
        got.sort();
        assert_eq!(got, vec![1, 2]);
    });
}
