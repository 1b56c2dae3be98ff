//! A loom model of `LegacyAction::issue`'s read-before-call rule
//! (`fence.rs`, "One action for every thread's kept-back frees") that needs only two
//! preemptions. The issuer C runs on the model's main thread and the publisher A is spawned,
//! so "C's call, then A's marked use and its published half, then C raising `covered`" is
//! reached by preempting C after its call and A after its first free. (`legacy.rs`'s model has
//! C spawned and A on the main thread: the same interleaving needs three preemptions there, so
//! a mutation reading `requests` after the call passes it at `LOOM_MAX_PREEMPTIONS=2`.)
#![cfg(loom)]

use cuarena::Stream;
use loom::thread;
use loom_tests::common::{SB, assert_all_returned, model, setup_legacy};

/// A's block, used (marked) and freed on the legacy stream in a batch of two, is handed out
/// again only once the model device has seen a legacy action issued after the use. C (main)
/// publishes one free of its own and flushes: its action. The mutation
/// `legacy_read_after_call` (`issue` reads `requests` after its call) must fail this.
#[test]
fn an_action_queued_before_a_use_never_covers_its_ticket() {
    model(|| {
        let (dev, a) = setup_legacy(2);
        let q = SB / 2;
        let cq = a.allocate(q, Stream::LEGACY).unwrap();
        let (a2, dev2) = (a.clone(), dev.clone());
        let h = thread::spawn(move || {
            let ps: Vec<_> = (0..2).map(|_| a2.allocate(q, Stream::LEGACY).unwrap()).collect();
            let mark = dev2.mark_legacy_use();
            for p in &ps {
                a2.deallocate(*p, q, Stream::LEGACY).unwrap();
            }
            let r = a2.allocate(q, Stream::LEGACY).unwrap();
            if ps.contains(&r) {
                assert!(
                    dev2.legacy_covered() >= mark,
                    "a legacy free was reused before any action followed its use"
                );
            }
            a2.deallocate(r, q, Stream::LEGACY).unwrap();
            a2.flush().unwrap();
            a2.release_thread().unwrap();
        });
        a.deallocate(cq, q, Stream::LEGACY).unwrap(); // half of 2: published
        a.flush().unwrap(); // C's action
        h.join().unwrap();
        assert_all_returned(&a);
    });
}
