//! Adversarial tests of `Arena::may_hold_empty` (commit 1377a39; helper-22): a lean user arena's return
//! rule fires only while that flag is set, so every path by which a superblock it holds becomes
//! empty (`SbLocal::live == 0`) must set it, or the empty superblock is stranded past the
//! arena's next own free ("a lean arena strands no empty superblock after its next own free",
//! `arena.rs`, "Lean arenas").
//!
//! Each test first clears the flag (churn over superblocks that are all in use, with a
//! superblock's worth of free space spread over them: the rule fires, `shrink` finds no empty
//! superblock), then empties a superblock by one path, then makes an own free on the arena's
//! stream that empties nothing, and checks that the empty superblock went back within it.
//!
//! Every test ends with `assert_all_returned` (no live byte, no race, no tag error, no stale
//! handle, every byte back after a blocking trim).

mod common;

use std::collections::BTreeMap;

use common::{Worker, alloc_with, host, lent, no_violations, on_thread, small, superblock_of};
use cuarena::{Allocator, DeviceAddr, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned};

/// 64 KiB: the largest small class of `small()`, four to a 256 KiB superblock, never cached.
const BIG_SMALL: usize = 64 << 10;
/// 8 KiB: a cached class, 32 to a superblock.
const CACHED: usize = 8 << 10;
/// A normal superblock of `small()`.
const SB: u64 = 256 << 10;

/// Makes the calling thread's user arenas lean: one small block allocated and freed on each
/// of `streams` (more than four of them).
fn touch_all(a: &Allocator, streams: &[Stream]) {
    for &s in streams {
        let p = a.allocate(512, s).unwrap();
        a.deallocate(p, 512, s).unwrap();
    }
}

/// `n` blocks of `size` on `s`, grouped by the normal superblock they lie in.
fn fill(a: &Allocator, s: Stream, size: usize, n: usize) -> BTreeMap<u64, Vec<DeviceAddr>> {
    let mut by_sb: BTreeMap<u64, Vec<DeviceAddr>> = BTreeMap::new();
    for _ in 0..n {
        let p = a.allocate(size, s).unwrap();
        by_sb.entry(p.0 / SB).or_default().push(p);
    }
    by_sb
}

/// Clears the lean arena's flag: frees `per_sb` blocks of each of the (full) superblocks in `by_sb`
/// on `s`, so that a superblock's worth or more is free, spread over superblocks all in use:
/// the rule fires and finds no empty superblock. Then allocates the holes again (no superblock
/// borrowed). Checks that nothing went back meanwhile.
fn clear_flag(
    a: &Allocator,
    s: Stream,
    size: usize,
    per_sb: usize,
    by_sb: &mut BTreeMap<u64, Vec<DeviceAddr>>,
) {
    let before = a.stats();
    let mut holes = 0u64;
    for v in by_sb.values_mut() {
        for _ in 0..per_sb {
            let p = v.pop().unwrap();
            a.deallocate(p, size, s).unwrap();
            holes += 1;
        }
    }
    assert!(holes * size as u64 >= SB, "a superblock's worth free: {holes} holes");
    let freed = a.stats();
    // One capture query per free, and one identity lookup where the rule fired (the last free):
    // `shrink` ran, found no empty superblock and cleared the flag.
    assert_eq!(freed.driver_calls - before.driver_calls, holes + 1, "the rule fired once: {freed:?}");
    for _ in 0..holes {
        let p = a.allocate(size, s).unwrap();
        by_sb.get_mut(&(p.0 / SB)).expect("a hole refilled").push(p);
    }
    let after = a.stats();
    assert_eq!(after.superblocks_returned, before.superblocks_returned, "{after:?}");
    assert_eq!(after.superblocks_taken, before.superblocks_taken, "{after:?}");
}

fn free_all(a: &Allocator, s: Stream, size: usize, by_sb: BTreeMap<u64, Vec<DeviceAddr>>) {
    for p in by_sb.into_values().flatten() {
        a.deallocate(p, size, s).unwrap();
    }
}

/// A thread with six user arenas (lean), `blocks` blocks of `size` on its last stream, the
/// flag cleared (`clear_flag`, `per_sb` holes per superblock). Returns the streams and the
/// blocks by superblock.
fn lean_setup(
    a: &Allocator,
    sim: &HostDevice,
    size: usize,
    blocks: usize,
    per_sb: usize,
) -> (Vec<Stream>, BTreeMap<u64, Vec<DeviceAddr>>) {
    let ss: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
    touch_all(a, &ss);
    let s = ss[5];
    let mut by_sb = fill(a, s, size, blocks);
    let per = SB as usize / size;
    assert!(by_sb.values().all(|v| v.len() == per), "full superblocks: {by_sb:?}");
    clear_flag(a, s, size, per_sb, &mut by_sb);
    (ss, by_sb)
}

/// An own free on `s` that empties no superblock (one block out of a full one): returns the
/// stats before and after it.
fn one_own_free(
    a: &Allocator,
    s: Stream,
    size: usize,
    by_sb: &mut BTreeMap<u64, Vec<DeviceAddr>>,
) -> (cuarena::Stats, cuarena::Stats) {
    let per = SB as usize / size;
    let before = a.stats();
    let v = by_sb.values_mut().find(|v| v.len() == per).expect("a full superblock");
    let q = v.pop().unwrap();
    a.deallocate(q, size, s).unwrap();
    (before, a.stats())
}

fn end_thread(a: &Allocator, ss: Vec<Stream>, sim: &HostDevice) {
    a.release_thread().unwrap();
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// 1. A superblock borrowed in the slow path and left empty: quarantined whole.

/// Was a defect (1377a39, mended in the commit after it): `Arena::grow` lent a lean arena an
/// empty superblock without setting `may_hold_empty`, and when `carve` could not hand out any of
/// it (a bad free on its way holds
/// the freed flag of its first granule, and another one that of the request's place at its end:
/// `carve_around_transit` quarantines the whole superblock and returns `None`), `alloc_slow`
/// borrows another one and keeps the first, empty (`live == 0`: a quarantined range is free,
/// not live), with the flag still clear. The lean rule then never fires for it: it is stranded
/// past every own free that empties no other superblock, also after the bad frees arrived and
/// the range was merged back (`release_quarantine`, which does not set the flag either).
///
/// Set-up: a lean arena whose flag was cleared (churn over four full superblocks); another
/// thread's 3 MiB block in a 16 MiB large superblock; a third thread's two bad frees (aligned
/// interior pointers of that block) at the first granule of its sixth 256 KiB slot and at that
/// slot's last 64 KiB, kept in its outbox; the large superblock goes back whole; the lean arena
/// allocates 64 KiB blocks until the pool lends it slot 6 (slot 5 was lent, quarantined, and
/// kept).
///
/// Expected (the old rule, and the mutant `lean_rule_unflagged`): the next own free on the
/// arena's stream, which leaves two superblocks' worth free, gives slot 5 back: `arena_held_bytes`
/// falls by 256 KiB and `superblocks_returned` rises by one. Seen on 1377a39: `arena_held_bytes`
/// 3,932,160 before and after, no superblock returned, slot 5 still lent; the same after the bad
/// frees arrive, a `flush` and another own free. The mend sets the flag where a range is
/// quarantined or merged back (`carve_around_transit`, `release_quarantine`); `grow` does not,
/// or the control below would pay a scan and an identity query after every borrow.
#[test]
fn a_fresh_superblock_quarantined_whole_is_not_stranded_in_a_lean_arena() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(64));
    let lean = Worker::new(&a);
    let (ss, by_sb) = lean.run({
        let sim = sim.clone();
        move |a| lean_setup(a, &sim, BIG_SMALL, 16, 1)
    });
    let s = ss[5];
    let owner = Worker::new(&a);
    let p = owner.run(|a| a.allocate_per_thread(3 << 20).unwrap());
    let (base, bytes) = superblock_of(&a, p.0);
    assert!(bytes >= 8 << 20, "a large superblock: {bytes}");
    let target = base + 5 * SB;
    let bad = Worker::new(&a);
    bad.run(move |a| {
        a.deallocate_per_thread(DeviceAddr(target), BIG_SMALL).unwrap();
        a.deallocate_per_thread(DeviceAddr(target + SB - BIG_SMALL as u64), BIG_SMALL).unwrap();
    });
    owner.run(move |a| a.deallocate_per_thread(p, 3 << 20).unwrap());
    owner.exit();
    assert!(lent(&a).iter().all(|&(b, _)| b != base), "the large superblock went back whole");
    let mut by_sb = lean.run(move |a| {
        let mut by_sb = by_sb;
        for _ in 0..bytes / BIG_SMALL {
            let p = a.allocate(BIG_SMALL, s).unwrap();
            by_sb.entry(p.0 / SB).or_default().push(p);
            if p.0 >= target + SB && p.0 < base + bytes as u64 {
                break;
            }
        }
        by_sb
    });
    assert!(!by_sb.contains_key(&(target / SB)), "no block handed out in slot 5");
    assert!(lent(&a).contains(&(target, SB as usize)), "slot 5 lent (to the lean arena): {:x?}", lent(&a));
    let (b1, a1, by) = lean.run(move |a| {
        let (b1, a1) = one_own_free(a, s, BIG_SMALL, &mut by_sb);
        (b1, a1, by_sb)
    });
    let still1 = lent(&a).contains(&(target, SB as usize));
    // The bad frees arrive and are refused; the quarantined range is merged back.
    bad.exit();
    let (b2, a2, still2) = lean.run(move |a| {
        let mut by_sb = by;
        a.flush().unwrap();
        let (b2, a2) = one_own_free(a, s, BIG_SMALL, &mut by_sb);
        let still2 = lent(a).contains(&(target, SB as usize));
        free_all(a, s, BIG_SMALL, by_sb);
        (b2, a2, still2)
    });
    lean.run({
        let sim = sim.clone();
        move |a| end_thread(a, ss, &sim)
    });
    drop(lean);
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 2);
    assert!(
        !still1 && b1.arena_held_bytes - a1.arena_held_bytes == SB,
        "the empty slot-5 superblock went back within the next own free: held {} then {}, \
         returned {} then {}",
        b1.arena_held_bytes,
        a1.arena_held_bytes,
        b1.superblocks_returned,
        a1.superblocks_returned
    );
    assert!(
        !still2,
        "slot 5 still held after the bad frees arrived, a flush and another own free: held {} then {}",
        b2.arena_held_bytes, a2.arena_held_bytes
    );
}

/// The control of the defect above: the same set-up with no bad free, so slot 5 is carved
/// as any other. No superblock of the lean arena is empty then: the own free gives nothing back
/// and asks nothing more of the driver than its capture query.
#[test]
fn control_no_quarantine_no_empty_superblock_and_the_free_costs_one_call() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(64));
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let (ss, mut by_sb) = lean_setup(a, &sim, BIG_SMALL, 16, 1);
            let s = ss[5];
            for _ in 0..9 {
                let p = a.allocate(BIG_SMALL, s).unwrap();
                by_sb.entry(p.0 / SB).or_default().push(p);
            }
            let (b, f) = one_own_free(a, s, BIG_SMALL, &mut by_sb);
            assert_eq!(f.arena_held_bytes, b.arena_held_bytes, "{f:?}");
            assert_eq!(f.driver_calls - b.driver_calls, 1, "{f:?}");
            free_all(a, s, BIG_SMALL, by_sb);
            end_thread(a, ss, &sim);
        }
    });
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// 2. Paths that empty a superblock and set the flag (pinned: these pass).

/// Another thread frees, on the lean arena's own stream, every block of one of its superblocks
/// (remote frees, batched, one event). The owner's `flush` takes them in and completes them
/// (`tidy` -> `poll` -> `complete`, which sets the flag; the rule is not applied there, on no
/// stream): the superblock, empty, must go back within the owner's next own free on its
/// stream, which empties nothing itself.
#[test]
fn remote_frees_that_empty_a_superblock_of_a_lean_arena_go_back_at_its_next_own_free() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let lean = Worker::new(&a);
    let (ss, mut by_sb) = lean.run({
        let sim = sim.clone();
        move |a| lean_setup(a, &sim, BIG_SMALL, 16, 1)
    });
    let s = ss[5];
    let victim = *by_sb.keys().next().unwrap();
    let blocks = by_sb.remove(&victim).unwrap();
    let other = Worker::new(&a);
    other.run(move |a| {
        // The fourth free sends the batch (`batch_blocks(4)`), inside a call on `s`.
        for p in blocks {
            a.deallocate(p, BIG_SMALL, s).unwrap();
        }
    });
    let (flushed, b, f) = lean.run(move |a| {
        a.flush().unwrap();
        let flushed = a.stats();
        let (b, f) = one_own_free(a, s, BIG_SMALL, &mut by_sb);
        free_all(a, s, BIG_SMALL, by_sb);
        (flushed, b, f)
    });
    lean.run({
        let sim = sim.clone();
        move |a| end_thread(a, ss, &sim)
    });
    drop((lean, other));
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
    assert_eq!(b.live_bytes, flushed.live_bytes, "{b:?}");
    assert_eq!(b.arena_held_bytes - f.arena_held_bytes, SB, "the emptied superblock went back: {f:?}");
    assert_eq!(f.superblocks_returned - b.superblocks_returned, 1, "{f:?}");
}

/// The owner frees every block of one superblock of its lean arena on another of its streams
/// (cross-stream own frees: checked at once, sent the remote way to its own inbox). After its
/// `flush` (its outbox sent, its arenas tidied: the batch completed, the flag set), its next own
/// free on the arena's stream gives the empty superblock back.
#[test]
fn own_cross_stream_frees_that_empty_a_superblock_go_back_at_the_next_own_free() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let (b, f) = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let (ss, mut by_sb) = lean_setup(a, &sim, BIG_SMALL, 16, 1);
            let s = ss[5];
            let victim = *by_sb.keys().next().unwrap();
            for p in by_sb.remove(&victim).unwrap() {
                a.deallocate(p, BIG_SMALL, ss[4]).unwrap();
            }
            sim.synchronize(); // the batch's event complete: the flush's poll completes it
            a.flush().unwrap();
            let r = one_own_free(a, s, BIG_SMALL, &mut by_sb);
            free_all(a, s, BIG_SMALL, by_sb);
            end_thread(a, ss, &sim);
            r
        }
    });
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
    assert_eq!(b.arena_held_bytes - f.arena_held_bytes, SB, "the emptied superblock went back: {f:?}");
    assert_eq!(f.superblocks_returned - b.superblocks_returned, 1, "{f:?}");
}

/// Cached blocks (8 KiB, 32 to a superblock; the cache takes eight of a class): the flag is
/// cleared with cached and merged holes, then every block of one superblock is freed on the
/// arena's stream, the first eight into the cache. The free that empties the superblock (its
/// `live` counts cached blocks out) sets the flag, and the superblock goes back within it: none
/// stays after the last of those frees.
#[test]
fn frees_into_the_block_cache_that_empty_a_superblock_give_it_back_at_once() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let (held, returned) = on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let (ss, mut by_sb) = lean_setup(a, &sim, CACHED, 128, 8);
            let s = ss[5];
            let before = a.stats();
            let victim = *by_sb.keys().next_back().unwrap();
            for p in by_sb.remove(&victim).unwrap() {
                a.deallocate(p, CACHED, s).unwrap();
            }
            let after = a.stats();
            free_all(a, s, CACHED, by_sb);
            end_thread(a, ss, &sim);
            (
                (before.arena_held_bytes, after.arena_held_bytes),
                after.superblocks_returned - before.superblocks_returned,
            )
        }
    });
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
    assert_eq!(held.0 - held.1, SB, "held {held:?}");
    assert_eq!(returned, 1);
}

/// A lean arena with its flag cleared is parked at its thread's exit with another thread's
/// frees, which empty one of its superblocks, on their way to its inbox. A new thread with six
/// streams, the parked arena's last, adopts it (`Zombies::adopt`; made lean again by
/// `set_lean`): its first call there (a slow path: the arena has no free block) completes the
/// frees, its free of that block (an own free) leaves the emptied superblock empty again, and
/// it goes back there; in any case, none of the adopter's own frees on the stream leaves it
/// held.
#[test]
fn an_adopted_lean_arena_gives_back_a_superblock_emptied_while_parked() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let first = Worker::new(&a);
    let (ss, mut by_sb) = first.run({
        let sim = sim.clone();
        move |a| lean_setup(a, &sim, BIG_SMALL, 16, 1)
    });
    let s = ss[5];
    first.run(|a| a.release_thread().unwrap()); // parked, with its superblocks
    drop(first);
    let victim = *by_sb.keys().next().unwrap();
    let blocks = by_sb.remove(&victim).unwrap();
    let other = Worker::new(&a);
    other.run(move |a| {
        // The fourth free sends the batch (`batch_blocks(4)`), inside a call on `s`.
        for p in blocks {
            a.deallocate(p, BIG_SMALL, s).unwrap();
        }
    });
    drop(other);
    assert!(lent(&a).contains(&(victim * SB, SB as usize)), "parked with the arena");
    let (b, f) = on_thread(&a, {
        let ss = ss.clone();
        move |a| {
            let b = a.stats();
            touch_all(a, &ss); // adopts the parked arena at its last stream
            let r = one_own_free(a, s, BIG_SMALL, &mut by_sb);
            free_all(a, s, BIG_SMALL, by_sb);
            a.release_thread().unwrap();
            (b, r.1)
        }
    });
    let returned = f.superblocks_returned - b.superblocks_returned;
    let back = !lent(&a).contains(&(victim * SB, SB as usize));
    for s in ss {
        sim.destroy_stream(s).unwrap();
    }
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), 0);
    assert!(back && returned >= 1, "the emptied superblock went back: {f:?}");
}
