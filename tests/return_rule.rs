//! The superblock return rule's learnt slack (`E`, `arena.rs`): an arena whose working set
//! needs more superblocks than the pigeonhole bound allows (large blocks of sizes 64-fold
//! apart) stops giving one back and borrowing it again; and the slack it learnt is let go
//! once that phase ends, so memory held beyond the recent peak stays bounded.

use cuarena::{Config, DeviceAddr, Stream};
use cuarena_testkit::{HostConfig, HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

/// A simulated device roomy enough that no out-of-memory reclaim runs (it would give back
/// superblocks outside the rule).
fn roomy() -> HostDevice {
    HostDevice::new(HostConfig { capacity: 8 << 30, ..HostConfig::default() })
}

/// A size log-uniform in 1 MiB ..= 64 MiB (the benchmark's `large` workload).
fn large_size(x: &mut u64) -> usize {
    let u = (rng(x) >> 11) as f64 / (1u64 << 53) as f64;
    ((1u64 << 20) as f64 * 64f64.powf(u)) as usize
}

/// Eight live large blocks on the per-thread stream, each pair freeing a random one and
/// allocating a new size in its place; every block checked against the others.
fn large_churn(
    a: &cuarena::Allocator,
    live: &Live,
    slots: &mut [Option<(DeviceAddr, usize)>],
    x: &mut u64,
    pairs: usize,
) {
    let s = Stream::PER_THREAD;
    for _ in 0..pairs {
        let k = rng(x) as usize % slots.len();
        if let Some((p, n)) = slots[k].take() {
            live.remove(p);
            a.deallocate(p, n, s).unwrap();
        }
        let n = large_size(x);
        let p = a.allocate(n, s).unwrap();
        assert_eq!(p.0 % 256, 0, "alignment");
        live.insert(p, n);
        slots[k] = Some((p, n));
    }
}

#[test]
fn a_fragmented_large_working_set_stops_giving_back_and_borrowing_again() {
    let sim = roomy();
    let a = host_allocator(sim.clone(), Config::default()).unwrap();
    let live = Live::default();
    let mut slots = vec![None; 8];
    let mut x = 0x2545_f491_4f6c_dd1d;
    // Warm up: the arena learns what it needs.
    large_churn(&a, &live, &mut slots, &mut x, 5_000);
    let before = a.stats();
    large_churn(&a, &live, &mut slots, &mut x, 20_000);
    let after = a.stats();
    let taken = after.superblocks_taken - before.superblocks_taken;
    let back = (after.superblocks_returned + after.superblocks_dissolved)
        - (before.superblocks_returned + before.superblocks_dissolved);
    let fences = after.fences_recorded - before.fences_recorded;
    // Without the learnt slack this gave a 128 MiB superblock back and borrowed one again
    // about every 200 pairs: some 100 of each here, and an event recorded for each.
    assert!(
        taken <= 5 && back <= 5 && fences <= 5,
        "taken {taken}, given back {back}, fences {fences} in 20,000 pairs"
    );
    assert_eq!(
        after.arena_allocations - before.arena_allocations,
        20_000,
        "every large block from the arena"
    );
    for (p, n) in slots.iter_mut().filter_map(Option::take) {
        live.remove(p);
        a.deallocate(p, n, Stream::PER_THREAD).unwrap();
    }
    live.assert_clean();
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn slack_learnt_in_a_large_phase_is_let_go_once_it_ends() {
    let sim = roomy();
    let a = host_allocator(sim.clone(), Config::default()).unwrap();
    let live = Live::default();
    let mut slots = vec![None; 8];
    let mut x = 0x9e37_79b9_7f4a_7c15;
    large_churn(&a, &live, &mut slots, &mut x, 5_000);
    let in_phase = a.stats().arena_held_bytes;
    for (p, n) in slots.iter_mut().filter_map(Option::take) {
        live.remove(p);
        a.deallocate(p, n, Stream::PER_THREAD).unwrap();
    }
    // The thread goes on with small blocks only: one live, freed and allocated again. The
    // rule runs once per free; the slack decays by a granule a call and halves at each
    // give-back after one that no borrow followed, so within 250,000 frees the large
    // superblocks go back but for the one `L` keeps (128 MiB) and the small ones. (Without
    // the decay all 384 MiB stay; without the halving 256 MiB do.)
    let s = Stream::PER_THREAD;
    let mut p = a.allocate(4096, s).unwrap();
    for _ in 0..250_000 {
        a.deallocate(p, 4096, s).unwrap();
        p = a.allocate(4096, s).unwrap();
    }
    let held = a.stats().arena_held_bytes;
    assert!(in_phase > (256 << 20), "the large phase held {in_phase} bytes: the test no longer learns slack");
    assert!(
        held <= (128 << 20) + (4 << 20),
        "still held {held} bytes of {in_phase} after the large phase ended"
    );
    a.deallocate(p, 4096, s).unwrap();
    live.assert_clean();
    assert_all_returned(&a, Some(&sim), 0);
}
