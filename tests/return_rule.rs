//! The superblock return rule's learnt slack (`E`, `arena.rs`): an arena whose working set
//! needs more superblocks than the pigeonhole bound allows (large blocks of sizes 64-fold
//! apart) stops giving one back and borrowing it again; and the slack it learnt is let go
//! soon after that phase ends, so memory held beyond the recent peak stays bounded.

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
