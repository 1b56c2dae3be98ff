//! Model of one legacy action serving every thread's kept-back frees (`fence.rs`, "One action
//! for every thread's kept-back frees"; `legacy_kept.rs`), driving the real allocator: a thread
//! publishes half a batch of its own legacy-stream frees under a ticket, another thread's
//! action may cover it, and a block is handed out again only once some legacy action was
//! issued after the use that preceded its free.
#![cfg(loom)]

use cuarena::Stream;
use loom::thread;
use loom_tests::common::{SB, assert_all_returned, model, setup_legacy, setup_legacy_pool};

/// Thread A fills a superblock with two half blocks, marks a use of them (a kernel on some
/// blocking stream, as far as the model device knows), and frees them on the legacy stream in a
/// batch of two: the first is published under a ticket, the second makes the batch whole, which
/// releases the published half if an action covered it and otherwise costs A's own action. Thread C meanwhile frees one block of its own on the legacy stream (published) and
/// flushes (its action). When A gets one of its blocks back, the model device must have seen a legacy
/// action issued after A's marked use. The mutations `legacy_covered_early` (the cover raised
/// before the action's call) and `legacy_covered_unchecked` (a published half taken as
/// covered) must fail this.
#[test]
fn a_reused_legacy_free_follows_an_action_issued_after_its_use() {
    model(|| {
        let (dev, a) = setup_legacy(2);
        let q = SB / 2;
        let ps: Vec<_> = (0..2).map(|_| a.allocate(q, Stream::LEGACY).unwrap()).collect();
        let a2 = a.clone();
        let c = thread::spawn(move || {
            let p = a2.allocate(q, Stream::LEGACY).unwrap();
            a2.deallocate(p, q, Stream::LEGACY).unwrap();
            a2.flush().unwrap(); // one legacy action for C's kept-back free
            a2.release_thread().unwrap();
        });
        let mark = dev.mark_legacy_use();
        for p in &ps {
            a.deallocate(*p, q, Stream::LEGACY).unwrap();
        }
        let r = a.allocate(q, Stream::LEGACY).unwrap();
        if ps.contains(&r) {
            assert!(
                dev.legacy_covered() >= mark,
                "a legacy free was reused before any legacy action followed its use"
            );
        }
        c.join().unwrap();
        a.deallocate(r, q, Stream::LEGACY).unwrap();
        a.flush().unwrap();
        assert_all_returned(&a);
    });
}

/// The same rule for a block of the global pool (`FenceSet`'s lazy legacy fence): thread A marks
/// a use of its pool block and frees it on the legacy stream (no event: a ticket taken at the
/// outbox's flush), while thread C's own legacy free issues its arena's action, which may or may
/// not cover A's ticket. When A gets the block back on the legacy stream, the model device must
/// have seen a legacy action issued after A's marked use: C's, if it covered the ticket, or A's
/// own at the reuse. The mutation `pool_legacy_no_action` (no action at the reuse) must fail
/// this.
#[test]
fn a_reused_legacy_pool_free_follows_an_action_issued_after_its_use() {
    model(|| {
        let (dev, a) = setup_legacy_pool();
        let p = a.allocate(SB, Stream::LEGACY).unwrap();
        let a2 = a.clone();
        let c = thread::spawn(move || {
            let q = a2.allocate(SB / 4, Stream::LEGACY).unwrap();
            a2.deallocate(q, SB / 4, Stream::LEGACY).unwrap(); // a batch of one: C's action
            a2.release_thread().unwrap();
        });
        let mark = dev.mark_legacy_use();
        a.deallocate(p, SB, Stream::LEGACY).unwrap();
        a.flush().unwrap();
        let r = a.allocate(SB, Stream::LEGACY).unwrap();
        if r == p {
            assert!(
                dev.legacy_covered() >= mark,
                "a legacy pool free was reused before any legacy action followed its use"
            );
        }
        c.join().unwrap();
        a.deallocate(r, SB, Stream::LEGACY).unwrap();
        a.flush().unwrap();
        assert_all_returned(&a);
    });
}
