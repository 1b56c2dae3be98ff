//! The superblock return rule on the recent peak of live bytes, and its learnt slack (`E`,
//! `arena.rs`): a working set that swings keeps its superblocks through the swings, and gives
//! them back once its live bytes stay low; an arena whose working set needs more superblocks
//! than the pigeonhole bound allows (large blocks of sizes 64-fold apart) stops giving one
//! back and borrowing it again; and the slack it learnt is let go soon after that phase ends,
//! so memory held beyond the recent peak stays bounded.

use cuarena::{Allocator, Config, Stats, Stream};
use cuarena_testkit::{assert_all_returned, host_allocator};

mod common;
use common::*;

/// 5,000 pairs of the large churn on the per-thread stream (the arena learns what it needs),
/// then 20,000 more: the statistics before and after those, and the blocks still live.
fn learn(a: &Allocator, live: &Live) -> (Stats, Stats, Slots) {
    let s = Stream::PER_THREAD;
    let mut slots = vec![None; 8];
    let mut x = 0x2545_f491_4f6c_dd1d;
    large_churn(a, live, &mut slots, &mut x, 5_000, s);
    let before = a.stats();
    large_churn(a, live, &mut slots, &mut x, 20_000, s);
    (before, a.stats(), slots)
}

#[test]
fn a_fragmented_large_working_set_stops_giving_back_and_borrowing_again() {
    let sim = roomy();
    let a = host_allocator(sim.clone(), Config::default()).unwrap();
    let (live, s) = (Live::default(), Stream::PER_THREAD);
    let (before, after, mut slots) = learn(&a, &live);
    let taken = after.superblocks_taken - before.superblocks_taken;
    let back = (after.superblocks_returned + after.superblocks_dissolved)
        - (before.superblocks_returned + before.superblocks_dissolved);
    let fences = after.fences_recorded - before.fences_recorded;
    // Without the learnt slack this gave a 128 MiB superblock back and borrowed one again
    // about every 200 pairs: 114 of each here, and an event recorded for each.
    assert!(
        taken <= 5 && back <= 5 && fences <= 5,
        "taken {taken}, given back {back}, fences {fences} in 20,000 pairs"
    );
    assert_eq!(
        after.arena_allocations - before.arena_allocations,
        20_000,
        "every large block from the arena"
    );
    free_all(&a, &live, &mut slots, s);
    live.assert_clean();
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn slack_learnt_in_a_large_phase_is_let_go_soon_after_it_ends() {
    let sim = roomy();
    let a = host_allocator(sim.clone(), Config::default()).unwrap();
    let (live, s) = (Live::default(), Stream::PER_THREAD);
    let (before, after, mut slots) = learn(&a, &live);
    // The slack is learnt (without it, 114 superblocks taken here: the test above).
    let taken = after.superblocks_taken - before.superblocks_taken;
    assert!(taken <= 5, "taken {taken} in 20,000 pairs: no slack learnt");
    let in_phase = after.arena_held_bytes;
    free_all(&a, &live, &mut slots, s);
    // The thread goes on with small blocks only: one live, freed and allocated again (the
    // rule runs once per free). The large superblocks must go back but for the one `L`
    // keeps (128 MiB), and the normal one: each give-back that no borrow follows within
    // 8,192 frees halves the slack. It takes about 18,000 frees here; without the halving
    // about 1,000,000.
    let mut p = a.allocate(4096, s).unwrap();
    let mut frees = 0;
    while a.stats().arena_held_bytes > (128 << 20) + (4 << 20) && frees < 2_000_000 {
        for _ in 0..1000 {
            a.deallocate(p, 4096, s).unwrap();
            p = a.allocate(4096, s).unwrap();
        }
        frees += 1000;
    }
    let held = a.stats().arena_held_bytes;
    assert!(frees <= 50_000, "held {held} of {in_phase} after {frees} frees of the small phase");
    a.deallocate(p, 4096, s).unwrap();
    live.assert_clean();
    assert_all_returned(&a, Some(&sim), 0);
}

/// An arena whose blocks come back only as other threads' frees, 64 at a time (one remote
/// batch), on the legacy stream: the batch completes at the owner's next slow path with no
/// wait (freed on its own stream), and the owner allocates from it. The return rule is not
/// applied there, where the arena needs the memory: applied after the completion, it gave the
/// superblocks back and borrowed them again for the next allocations, an event and the pool's
/// lock each time (about 3 per round here). Memory stays the working set's.
#[test]
fn remote_batches_completing_at_a_slow_path_are_reused_not_given_back() {
    let sim = roomy();
    let a = host_allocator(sim.clone(), Config::default()).unwrap();
    let s = Stream::LEGACY;
    let (tx, rx) = std::sync::mpsc::channel::<Vec<cuarena::DeviceAddr>>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let a2 = a.clone();
    let freer = std::thread::spawn(move || {
        for blocks in rx {
            for p in blocks {
                a2.deallocate(p, 128 << 10, s).unwrap();
            }
            done_tx.send(()).unwrap();
        }
        a2.release_thread().unwrap();
    });
    let round = |a: &Allocator| {
        let blocks: Vec<_> = (0..64).map(|_| a.allocate(128 << 10, s).unwrap()).collect();
        tx.send(blocks).unwrap();
        done_rx.recv().unwrap();
    };
    for _ in 0..5 {
        round(&a); // the working set: 64 blocks of 128 KiB, 8 MiB
    }
    let before = a.stats();
    for _ in 0..50 {
        round(&a);
    }
    let after = a.stats();
    let taken = after.superblocks_taken - before.superblocks_taken;
    let back = (after.superblocks_returned + after.superblocks_dissolved)
        - (before.superblocks_returned + before.superblocks_dissolved);
    assert_eq!(after.cross_thread_frees - before.cross_thread_frees, 50 * 64, "{after:?}");
    assert!(taken <= 1 && back <= 1, "taken {taken}, given back {back} in 50 rounds");
    assert!(
        after.arena_held_bytes <= 16 << 20,
        "the arena holds {} bytes for an 8 MiB working set",
        after.arena_held_bytes
    );
    drop(tx);
    freer.join().unwrap();
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// The legacy arena's slow path releases the owner's kept-back legacy frees to serve the
/// request at hand, and gives nothing back there (the return rule runs after the owner's next
/// free, as after a batch of remote frees completed at a slow path: applied there, it gave
/// back superblocks the next allocations borrowed again). Four superblocks of 64 KiB blocks,
/// all but one block freed and kept back, then one more block: it comes from the released
/// memory with no superblock given back or taken.
#[test]
fn a_slow_path_release_of_kept_back_legacy_frees_gives_nothing_back() {
    let sim = host(0);
    let cfg = small().keep_empty(0).legacy_batch_blocks(1_000).legacy_batch_bytes(1 << 30);
    let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
    let s = Stream::LEGACY;
    let blocks: Vec<_> = (0..16).map(|_| a.allocate(64 << 10, s).unwrap()).collect();
    let held = a.stats().arena_held_bytes;
    assert_eq!(held, 1 << 20, "four superblocks of 256 KiB");
    for &p in &blocks[1..] {
        a.deallocate(p, 64 << 10, s).unwrap(); // kept back: the batch is far from full
    }
    let before = a.stats();
    let p = a.allocate(64 << 10, s).unwrap();
    let after = a.stats();
    let given = |s: &Stats| s.superblocks_returned + s.superblocks_dissolved;
    assert!(after.fence_waits > before.fence_waits, "the kept-back frees went behind a legacy action");
    assert_eq!(given(&after), given(&before), "nothing given back in the slow path");
    assert_eq!(after.superblocks_taken, before.superblocks_taken, "nothing borrowed");
    assert_eq!(after.arena_held_bytes, held);
    a.deallocate(p, 64 << 10, s).unwrap();
    // The rule runs at the next own free, on the recent peak of live bytes (`arena.rs`, "The
    // recent peak": 16 blocks, barely decayed), which still covers the four superblocks.
    let later = a.stats();
    assert_eq!((given(&later), later.arena_held_bytes), (given(&after), held));
    a.deallocate(blocks[0], 64 << 10, s).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A working set that swings fourfold (64 blocks of 16 KiB in four superblocks of 256 KiB, then
/// 16, then 64 again, twenty times) keeps its superblocks through the swings: the rule, on the
/// recent peak of live bytes, gives nothing back at the lows and nothing is borrowed on the way
/// up, and what the arena holds stays within the rule's bound on that peak. On the live bytes
/// themselves (the mutation `rule_on_live`) it gave superblocks back at every low and borrowed
/// them again at every high. Then the live bytes stay at the low: within 4,000 own frees the
/// superblocks go back (the peak has decayed to them), and the free that empties the arena
/// gives back everything (`keep_empty` 0).
#[test]
fn a_swinging_working_set_keeps_its_superblocks() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().keep_empty(0).build().unwrap()).unwrap();
    let s = Stream::PER_THREAD;
    const B: usize = 16 << 10;
    let mut set: Vec<_> = (0..64).map(|_| a.allocate(B, s).unwrap()).collect();
    let start = a.stats();
    assert_eq!(start.arena_held_bytes, 1 << 20, "four superblocks");
    let mut peak = RecentPeak(start.live_bytes);
    let free = |p, peak: &mut RecentPeak| {
        let reached = in_arena(&a, p);
        a.deallocate(p, B, s).unwrap();
        let st = a.stats();
        if reached {
            peak.after_free(st.live_bytes);
        }
        assert!(st.arena_held_bytes as f64 <= peak.bound(0, 256 << 10, 0.6), "{st:?}");
    };
    for _ in 0..20 {
        while set.len() > 16 {
            free(set.pop().unwrap(), &mut peak);
        }
        while set.len() < 64 {
            set.push(a.allocate(B, s).unwrap());
        }
    }
    let swung = a.stats();
    let moved = |st: &Stats| st.superblocks_taken + st.superblocks_returned + st.superblocks_dissolved;
    assert_eq!(moved(&swung), moved(&start), "superblocks went back and came again: {swung:?}");
    assert_eq!(swung.driver_calls, start.driver_calls, "{swung:?}");
    while set.len() > 16 {
        free(set.pop().unwrap(), &mut peak);
    }
    for _ in 0..4_000 {
        set.push(a.allocate(B, s).unwrap());
        free(set.pop().unwrap(), &mut peak);
    }
    let low = a.stats();
    assert!(low.arena_held_bytes <= 3 * (256 << 10) && moved(&low) > moved(&swung), "{low:?}");
    for p in set {
        free(p, &mut peak);
    }
    assert_eq!(a.stats().arena_held_bytes, 0);
    assert_all_returned(&a, Some(&sim), 0);
}
