//! Twenty-sixth session's attacks on the return rule on the recent peak `û` (`arena.rs`,
//! "Superblock return rule" and "The recent peak"): an arena without large superblocks gives
//! its emptiest superblock back while `û + K·S < a` and `û < (1 - f)·a`, where `û` is the live
//! granules' running maximum decaying by 2^-10 per call of the rule, and 0 once nothing is live.
//!
//! Attacked with: arenas emptied by their owner on every kind of stream (the per-thread stream,
//! user streams, lean user arenas, the legacy stream whose own frees are kept back, and an
//! owner's free on another stream); out of memory under a cap while idle threads keep
//! superblocks for their recent peak (fragmented and not), and the owner's own requests; the
//! stated bound after every own free across extreme configurations (64 KiB superblocks,
//! `small_max` of one granule, `keep_empty` 0 and 1024, `sparse` near 0 and near 1); the
//! decay rate the module states; the large-superblock path handing over to the normal one;
//! `release_thread` and thread exit; and a multi-thread run under the race checker.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cuarena::{Allocator, Config, DeviceAddr, Stream};

mod common;
use common::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// `small()`'s superblock.
const S: usize = 256 * KIB;

fn held(a: &Allocator) -> usize {
    a.stats().arena_held_bytes as usize
}

/// The return rule's bound on what an arena holds for `u` live bytes: `max(u + K·S, u/(1-f))`.
fn rule_bound(u: usize, k: usize, s: usize, f: f64) -> f64 {
    ((u + k * s) as f64).max(u as f64 / (1.0 - f))
}

/// A size in 1 ..= `max` bytes, most of them small.
fn size_upto(x: &mut u64, max: usize) -> usize {
    let r = rng(x);
    let cap = match r % 4 {
        0 => max,
        1 => max.min(16 * KIB),
        _ => max.min(2 * KIB),
    };
    1 + (rng(x) as usize) % cap
}

/// A working set on `s` that swings four times between `hi` and `lo` blocks (random sizes up to
/// `max`, freed in random order), left at `lo`: the arena's recent peak is then high above its
/// live bytes.
fn swing(
    a: &Allocator,
    s: Stream,
    x: &mut u64,
    hi: usize,
    lo: usize,
    max: usize,
) -> Vec<(DeviceAddr, usize)> {
    let mut set = Vec::new();
    for _ in 0..4 {
        while set.len() < hi {
            let n = size_upto(x, max);
            set.push((a.allocate(n, s).unwrap(), n));
        }
        while set.len() > lo {
            let i = rng(x) as usize % set.len();
            let (p, n) = set.swap_remove(i);
            a.deallocate(p, n, s).unwrap();
        }
    }
    set
}

// ---------------------------------------------------------------------------------------------
// 1. An arena its owner empties: at most `K` superblocks at that free, on every stream.

/// On the per-thread stream and on a user stream, for `keep_empty` 0, 1 and 2: a working set
/// that swings fivefold (within the eightfold a swing may be; deeper is a drain) leaves the
/// arena holding far more than `K·S` for its recent peak (the point of the change), and the
/// free that empties it gives back all but `K` superblocks at once.
#[test]
fn an_arena_its_owner_empties_keeps_at_most_k_superblocks() {
    for k in [0usize, 1, 2] {
        for user in [false, true] {
            let sim = zero_delay(1 << 30);
            let a = alloc_with(&sim, small().keep_empty(k));
            let s = if user { sim.create_stream() } else { Stream::PER_THREAD };
            let mut x = 0x9e37_79b9_7f4a_7c15 ^ (k as u64 * 31 + user as u64);
            let set = swing(&a, s, &mut x, 400, 80, 64 * KIB);
            let low = held(&a);
            assert!(low > (k + 2) * S, "k {k} user {user}: the swing's superblocks were kept: {low}");
            for (p, n) in set {
                a.deallocate(p, n, s).unwrap();
            }
            let h = held(&a);
            assert!(h <= k * S, "k {k} user {user}: emptied by its owner, the arena holds {h} B > K·S");
            all_back(&a, &sim);
        }
    }
}

/// A lean user arena (the thread's sixth user stream) keeps no empty superblock after its own
/// free, whatever its recent peak: with five other lean arenas holding one small block each,
/// the arena's swing and emptying leave exactly their five superblocks held.
#[test]
fn a_lean_arena_emptied_by_its_owner_keeps_nothing() {
    let sim = zero_delay(1 << 30);
    let a = alloc_with(&sim, small().keep_empty(2));
    let streams: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
    let ones: Vec<_> = streams[..5].iter().map(|&s| (a.allocate(4 * KIB, s).unwrap(), s)).collect();
    assert_eq!(held(&a), 5 * S);
    let s = streams[5];
    let mut x = 0x1234_5678_9abc_def1;
    let set = swing(&a, s, &mut x, 300, 5, 64 * KIB);
    for (p, n) in set {
        a.deallocate(p, n, s).unwrap();
    }
    assert_eq!(held(&a), 5 * S, "a lean arena emptied by its owner kept superblocks");
    for (p, s) in ones {
        a.deallocate(p, 4 * KIB, s).unwrap();
    }
    assert_eq!(held(&a), 0, "lean arenas emptied by their owner kept superblocks");
    all_back(&a, &sim);
}

/// The legacy stream: the owner's frees there are kept back (counted live) until a legacy
/// action, issued once `legacy_batch` (8 here) are kept. The owner frees every block it has on
/// the legacy stream; three frees stay kept back (259 = 32·8 + 3). The rule on the live
/// granules bounded the arena by `max(kept + K·S, kept/(1-f))` (one superblock here) at that
/// free, and the module says this memory "is not stranded", the changelog that "an arena
/// emptied by its owner still gives back all but `keep_empty` superblocks at once". On `û`,
/// the three kept-back frees keep `û` at the arena's peak: it keeps every superblock, and with
/// its thread idle, until a `trim` or out of memory.
#[test]
fn a_legacy_arena_its_owner_empties_gives_back_at_that_free() {
    let sim = zero_delay(1 << 30);
    let k = 1;
    let a = alloc_with(&sim, small().keep_empty(k).legacy_batch_blocks(8));
    let s = Stream::LEGACY;
    let n = 16 * KIB;
    let blocks: Vec<_> = (0..259).map(|_| a.allocate(n, s).unwrap()).collect();
    let peak = held(&a);
    assert!(peak >= 259 * n);
    for p in blocks {
        a.deallocate(p, n, s).unwrap();
    }
    let kept = 3 * n;
    let h = held(&a);
    assert!(
        h as f64 <= rule_bound(kept, k, S, 0.6),
        "held {h} B (peak {peak} B) after its owner freed every block on the legacy stream, {kept} B kept back"
    );
    all_back(&a, &sim);
}

/// The same on the per-thread stream when one of the owner's frees went another way: a free of
/// its own block on the legacy stream (a cross-stream free, sent through its outbox and counted
/// live until its batch completes) or one block freed by another thread. The rule on the live
/// granules gave back all but `max(u + K·S, u/(1-f))` with `u` that one block (one superblock
/// here); on `û` that one block keeps the arena's whole peak.
#[test]
fn an_arena_emptied_with_one_free_in_flight_gives_back_at_the_owners_last_free() {
    let mut over = Vec::new();
    for remote in [false, true] {
        let sim = zero_delay(1 << 30);
        let k = 1;
        let a = alloc_with(&sim, small().keep_empty(k));
        let s = Stream::PER_THREAD;
        let n = 16 * KIB;
        let mut blocks: Vec<_> = (0..256).map(|_| a.allocate(n, s).unwrap()).collect();
        let peak = held(&a);
        let first = blocks.remove(0);
        let w = Worker::new(&a);
        if remote {
            w.run(move |a| a.deallocate(first, n, Stream::PER_THREAD).unwrap());
        } else {
            a.deallocate(first, n, Stream::LEGACY).unwrap();
        }
        for p in blocks {
            a.deallocate(p, n, s).unwrap();
        }
        let h = held(&a);
        w.exit();
        if h as f64 > rule_bound(n, k, S, 0.6) {
            over.push(format!("remote {remote}: held {h} B (peak {peak} B) after the owner's last free"));
        }
        all_back(&a, &sim);
    }
    assert!(over.is_empty(), "one {} B free in flight: {over:?}", 16 * KIB);
}

// ---------------------------------------------------------------------------------------------
// 2. Out of memory under a cap while arenas keep superblocks for their recent peak.

/// Fills `blocks` of `n` bytes on this thread's per-thread stream, then frees all but those
/// `keep` says, on that stream: the arena keeps its superblocks for its recent peak. Returns
/// the blocks kept.
fn fill_and_keep(a: &Allocator, blocks: usize, n: usize, keep: impl Fn(usize) -> bool) -> Vec<DeviceAddr> {
    let s = Stream::PER_THREAD;
    let all: Vec<_> = (0..blocks).map(|_| a.allocate(n, s).unwrap()).collect();
    let mut kept = Vec::new();
    for (i, p) in all.into_iter().enumerate() {
        if keep(i) {
            kept.push(p);
        } else {
            a.deallocate(p, n, s).unwrap();
        }
    }
    kept
}

/// Two idle threads each keep 3 MiB of superblocks for their recent peak with one 16 KiB block
/// left in each superblock (only a dissolving reclaim can take them; `trim` cannot), and a third
/// idle thread keeps its legacy arena's superblocks with frees kept back. Under an 8 MiB cap,
/// the main thread's 16 KiB blocks up to 7 MiB must all be served: the out-of-memory reclaim
/// takes the idle threads' memory.
#[test]
fn idle_threads_keeping_their_peak_do_not_make_another_thread_run_out() {
    let sim = zero_delay(1 << 30);
    let a = alloc_with(&sim, small().max_bytes(8 * MIB).chunk(8 * MIB));
    let n = 16 * KIB;
    let workers: Vec<Worker> = (0..2).map(|_| Worker::new(&a)).collect();
    let mut kept = Vec::new();
    for w in &workers {
        let k = w.run(move |a| fill_and_keep(a, 192, n, |i| i % 16 == 0));
        kept.push(k);
    }
    let legacy = Worker::new(&a);
    let lk = legacy.run(move |a| {
        let v: Vec<_> = (0..40).map(|_| a.allocate(n, Stream::LEGACY).unwrap()).collect();
        let (keep, free) = v.split_at(1);
        for &p in free {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        keep.to_vec()
    });
    let before = a.stats();
    assert!(before.arena_held_bytes as usize >= 6 * MIB, "the idle arenas kept their peak: {before:?}");
    let mut mine = Vec::new();
    let live = Live::default();
    for i in 0..(7 * MIB / n) {
        match a.allocate(n, Stream::PER_THREAD) {
            Ok(p) => {
                live.insert(p, n);
                mine.push(p);
            }
            Err(e) => {
                panic!("block {i} of 7 MiB under an 8 MiB cap with idle memory: {e:?}; {:?}", a.stats())
            }
        }
    }
    live.assert_clean();
    for p in mine {
        a.deallocate(p, n, Stream::PER_THREAD).unwrap();
    }
    for (w, k) in workers.iter().zip(kept) {
        w.run(move |a| {
            for p in k {
                a.deallocate(p, n, Stream::PER_THREAD).unwrap();
            }
        });
    }
    legacy.run(move |a| a.deallocate(lk[0], n, Stream::LEGACY).unwrap());
    drop(workers);
    legacy.exit();
    all_back(&a, &sim);
}

/// An idle thread keeps 11 empty superblocks for its recent peak beside one full one, as does
/// the allocating thread itself; under an 8 MiB cap (one chunk), a 4 MiB block (a large
/// superblock of at least 4 MiB, in one piece) must be served, on the per-thread stream, on a
/// user stream, and from the pool (over `large_max`): the reclaim takes the empty superblocks
/// of both arenas.
#[test]
fn a_large_request_under_a_cap_takes_the_superblocks_kept_for_the_peak() {
    for how in 0..3 {
        let sim = zero_delay(1 << 30);
        let b = small().max_bytes(8 * MIB).chunk(8 * MIB);
        let b = if how == 2 { b.large_max(64 * KIB) } else { b };
        let a = alloc_with(&sim, b);
        let n = 16 * KIB;
        let w = Worker::new(&a);
        let theirs = w.run(move |a| fill_and_keep(a, 192, n, |i| i < 16));
        let mine = fill_and_keep(&a, 192, n, |i| i < 16);
        assert_eq!(held(&a), 6 * MIB, "how {how}: both arenas kept their peak");
        let s = if how == 1 { sim.create_stream() } else { Stream::PER_THREAD };
        let big = 4 * MIB;
        let p = a.allocate(big, s).unwrap_or_else(|e| panic!("how {how}: {e:?}; {:?}", a.stats()));
        let live = Live::default();
        for &q in mine.iter().chain(&theirs) {
            live.insert(q, n);
        }
        live.insert(p, big);
        live.assert_clean();
        a.deallocate(p, big, s).unwrap();
        for q in mine {
            a.deallocate(q, n, Stream::PER_THREAD).unwrap();
        }
        w.run(move |a| {
            for q in theirs {
                a.deallocate(q, n, Stream::PER_THREAD).unwrap();
            }
        });
        w.exit();
        all_back(&a, &sim);
    }
}

/// `trim(false)` from another thread takes an idle owner's superblocks kept for its peak that
/// hold no used block, on the per-thread stream and on the legacy stream (whose kept-back frees
/// count as free there); what stays is the two superblocks with the live blocks (a fivefold
/// fall: within a swing, so the rule itself keeps the rest).
#[test]
fn trim_takes_what_an_idle_owner_keeps_for_its_peak() {
    let sim = zero_delay(1 << 30);
    let a = alloc_with(&sim, small().keep_empty(0).legacy_batch_blocks(8));
    let n = 16 * KIB;
    for s in [Stream::PER_THREAD, Stream::LEGACY] {
        let w = Worker::new(&a);
        let keep = w.run(move |a| {
            let mut v: Vec<_> = (0..160).map(|_| a.allocate(n, s).unwrap()).collect();
            for &p in &v[32..] {
                a.deallocate(p, n, s).unwrap();
            }
            v.truncate(32);
            v
        });
        assert!(held(&a) >= 8 * S, "{s:?}: kept for the peak: {}", held(&a));
        a.trim(false).unwrap();
        assert_eq!(held(&a), 2 * S, "{s:?}: trim left superblocks with no used block");
        w.run(move |a| {
            for p in keep {
                a.deallocate(p, n, s).unwrap();
            }
        });
        w.exit();
        assert_eq!(held(&a), 0, "{s:?}: the thread's exit gave back everything");
    }
    all_back(&a, &sim);
}

// ---------------------------------------------------------------------------------------------
// 3. The stated bound, across configurations.

/// Extreme configurations: (superblock, small_max, keep_empty, sparse).
const EXTREMES: [(usize, usize, usize, f64); 7] = [
    (64 * KIB, 16 * KIB, 0, 0.6),
    (64 * KIB, 256, 1, 0.25),
    (256 * KIB, 64 * KIB, 1, 1e-9),
    (256 * KIB, 64 * KIB, 2, 1.0 - 1e-9),
    (256 * KIB, 256 * KIB, 0, 0.999),
    (2 * MIB, MIB, 1024, 0.6),
    (64 * KIB, 64 * KIB, 0, 0.5),
];

/// Random swings on one thread's per-thread stream for `EXTREMES[ci]`: after every own free,
/// held <= max(û + K·S, û/(1-f)) with `RecentPeak` the model of `û`, and held <= K·S when the
/// free empties the arena. Requests up to `small_max` only (no large superblock). The model
/// decays only at frees that reach the arena (the block lies in a superblock the pool has
/// lent): a block of a superblock the rule dissolved is a pool block, and its free, though the
/// owner's, calls no rule (`common::RecentPeak`).
fn swings_within_the_bound(ci: usize) {
    let (sb, small_max, k, f) = EXTREMES[ci];
    let sim = zero_delay(1 << 30);
    let b = Config::builder().superblock(sb).small_max(small_max).large_max(small_max).chunk(sb * 16);
    let a = alloc_with(&sim, b.keep_empty(k).sparse_fraction(f));
    let s = Stream::PER_THREAD;
    let mut x = 0xdead_beef_0000_0001 ^ ci as u64;
    let mut set: Vec<(DeviceAddr, usize)> = Vec::new();
    let mut peak = RecentPeak(0);
    let mut frees = 0;
    let max = small_max.min(sb / 4).max(1);
    for round in 0..24 {
        let hi = 20 + (rng(&mut x) % 300) as usize;
        let lo = if round % 5 == 4 { 0 } else { (rng(&mut x) % hi as u64) as usize };
        while set.len() < hi {
            let n = size_upto(&mut x, max);
            set.push((a.allocate(n, s).unwrap(), n));
        }
        peak.0 = peak.0.max(a.stats().live_bytes);
        while set.len() > lo {
            let i = rng(&mut x) as usize % set.len();
            let (p, n) = set.swap_remove(i);
            let in_arena = in_arena(&a, p);
            a.deallocate(p, n, s).unwrap();
            frees += 1;
            let st = a.stats();
            if in_arena {
                peak.after_free(st.live_bytes);
            }
            let h = st.arena_held_bytes as f64;
            assert!(
                h <= peak.bound(k, sb, f) + 1.0,
                "config {ci} free {frees}: held {h} > bound {} (û model {}, live {})",
                peak.bound(k, sb, f),
                peak.0,
                st.live_bytes
            );
            if set.is_empty() {
                assert!(st.arena_held_bytes as usize <= k * sb, "config {ci}: emptied, held {h}");
            }
        }
    }
    for (p, n) in set {
        a.deallocate(p, n, s).unwrap();
    }
    assert!(held(&a) <= k * sb, "config {ci}");
    all_back(&a, &sim);
}

/// The bound, for every extreme configuration, with the model decaying at the arena's frees.
#[test]
fn the_bound_on_the_recent_peak_holds_after_every_own_free() {
    for ci in 0..EXTREMES.len() {
        swings_within_the_bound(ci);
    }
}

/// A request of at most `small_max` bytes is small: "`grow`: a normal [superblock] for a small
/// request, a large one for a request over `small_max`". But `grow` compares the request
/// rounded up to its class with `small_max`: with a `small_max` that is not a class size (100
/// KiB; 1 B), a request of `small_max` bytes (class 104 KiB; 256 B) borrows a large superblock
/// of 8 MiB, four or 128 times the normal one, and the arena's rule then runs on the large
/// path (128 MiB more kept, `L`). Not from this session's change, found by its sweep.
#[test]
fn a_request_of_small_max_bytes_borrows_a_normal_superblock() {
    for (small_max, sb) in [(100 * KIB, 2 * MIB), (1, 64 * KIB)] {
        let sim = zero_delay(1 << 30);
        let a = alloc_with(&sim, Config::builder().small_max(small_max).superblock(sb).chunk(32 * MIB));
        let p = a.allocate(small_max, Stream::PER_THREAD).unwrap();
        let h = held(&a);
        a.deallocate(p, small_max, Stream::PER_THREAD).unwrap();
        assert_eq!(h, sb, "small_max {small_max}: a request of {small_max} B borrowed {h} B");
        all_back(&a, &sim);
    }
}

/// The stated decay: "in one whose live bytes fall to `u` and stay there `û` halves every 710
/// calls until it meets `u`: the arena is back within the bound on its live bytes after about
/// `710·log2(û/u)` own frees" (for a fall of at most eightfold; deeper, `û` halves at every
/// call). 256 blocks of 16 KiB (16 superblocks) fall to the 64 of the first four superblocks
/// (`û/u` = 4: 2 halvings, 1,420 frees); churning one block there, the arena is within the
/// bound on its live bytes (plus the churned block) 3,000 own frees later, and not after 700
/// (when `û` has only halved).
#[test]
fn the_recent_peak_decays_at_the_stated_rate() {
    let sim = zero_delay(1 << 30);
    let a = alloc_with(&sim, small().keep_empty(0));
    let s = Stream::PER_THREAD;
    let n = 16 * KIB;
    let kept = fill_and_keep(&a, 256, n, |i| i < 64);
    assert_eq!(held(&a), 16 * S, "kept for the peak");
    let u = 65 * n;
    let mut frees = 192;
    while frees < 192 + 3_000 {
        let p = a.allocate(n, s).unwrap();
        a.deallocate(p, n, s).unwrap();
        frees += 1;
        if frees == 192 + 700 {
            assert!(held(&a) as f64 > rule_bound(u, 0, S, 0.6), "given back too soon: {}", held(&a));
        }
    }
    let h = held(&a);
    assert!(h as f64 <= rule_bound(u, 0, S, 0.6), "after {frees} own frees at {u} B live: held {h}");
    for p in kept {
        a.deallocate(p, n, s).unwrap();
    }
    assert_eq!(held(&a), 0);
    all_back(&a, &sim);
}

/// The large-superblock path handing over to the normal one: 136 MiB of 512 KiB blocks, then
/// two 64 MiB blocks (one large superblock of 128 MiB), the large blocks freed, then the small
/// ones in random order, churning between. Whenever the arena holds no large superblock, the normal rule's
/// bound on the recent peak must hold (`RecentPeak` from the peak: the large path's `û` decays
/// faster); when it is emptied with no large superblock left, at most `K·S`. Then the
/// superblocks still held go back at `trim(true)`.
#[test]
fn the_bound_holds_once_large_superblocks_are_gone() {
    let sim = roomy();
    let a = alloc_with(&sim, Config::builder());
    let s = Stream::PER_THREAD;
    let (k, sb, f) = (2, 2 * MIB, 0.6);
    let mut set: Vec<(DeviceAddr, usize)> =
        (0..272).map(|_| (a.allocate(512 * KIB, s).unwrap(), 512 * KIB)).collect();
    let bigs = [a.allocate(64 * MIB, s).unwrap(), a.allocate(64 * MIB, s).unwrap()];
    let large_held = |a: &Allocator| lent(a).iter().any(|&(_, l)| l > sb);
    assert_eq!(lent(&a).iter().filter(|&&(_, l)| l > sb).count(), 1, "one large superblock");
    let mut peak = RecentPeak(a.stats().live_bytes);
    for p in bigs {
        a.deallocate(p, 64 * MIB, s).unwrap();
        peak.after_free(a.stats().live_bytes);
    }
    let mut x = 0x5151_7777_2222_0001;
    let mut normal_only = 0;
    while !set.is_empty() {
        let i = rng(&mut x) as usize % set.len();
        let (p, n) = set.swap_remove(i);
        a.deallocate(p, n, s).unwrap();
        let st = a.stats();
        peak.after_free(st.live_bytes);
        let h = st.arena_held_bytes as usize;
        if !large_held(&a) {
            normal_only += 1;
            assert!(h as f64 <= peak.bound(k, sb, f) + 1.0, "held {h} > {} ({st:?})", peak.bound(k, sb, f));
            if set.is_empty() {
                assert!(h <= k * sb, "emptied with no large superblock: held {h}");
            }
        }
        // Churn at the current level to let the peak decay (own frees).
        for _ in 0..4 {
            let q = a.allocate(512 * KIB, s).unwrap();
            a.deallocate(q, 512 * KIB, s).unwrap();
            let st = a.stats();
            peak.after_free(st.live_bytes);
            let h = st.arena_held_bytes as usize;
            if !large_held(&a) {
                assert!(h as f64 <= peak.bound(k, sb, f) + 1.0, "churn: held {h} > {}", peak.bound(k, sb, f));
            }
        }
    }
    assert!(normal_only > 0, "the large superblock never went back by the rule: {:?}", a.stats());
    all_back(&a, &sim);
}

// ---------------------------------------------------------------------------------------------
// 4. Release, exit, and a race-checked run.

/// `release_thread` and thread exit give back everything an arena keeps for its recent peak
/// (per-thread, legacy and user arenas), and a new arena after `release_thread` starts from
/// nothing: its first emptying keeps at most `K·S`.
#[test]
fn release_and_exit_give_back_what_the_peak_kept() {
    let sim = zero_delay(1 << 30);
    let k = 1;
    let a = alloc_with(&sim, small().keep_empty(k));
    let user = sim.create_stream();
    let mut x = 77;
    let mut all = Vec::new();
    for s in [Stream::PER_THREAD, Stream::LEGACY, user] {
        all.push((s, swing(&a, s, &mut x, 300, 3, 64 * KIB)));
    }
    assert!(held(&a) > 6 * S);
    let mine = held(&a);
    let w = Worker::new(&a);
    let user2 = sim.create_stream();
    w.run(move |a| {
        let mut x = 78;
        for s in [Stream::PER_THREAD, Stream::LEGACY, user2] {
            for (p, n) in swing(a, s, &mut x, 300, 2, 64 * KIB) {
                a.deallocate(p, n, s).unwrap();
            }
        }
    });
    w.exit();
    assert_eq!(held(&a) - a.parked_bytes(), mine, "the exited thread's arenas kept superblocks");
    // Blocks stay live across the release: the per-thread and legacy arenas give everything
    // back (dissolving), the user arena, holding live blocks, is parked.
    a.release_thread().unwrap();
    assert_eq!(held(&a), a.parked_bytes(), "released with {mine} B held before");
    let s = Stream::PER_THREAD;
    let v: Vec<_> = (0..3).map(|_| a.allocate(16 * KIB, s).unwrap()).collect();
    for p in v {
        a.deallocate(p, 16 * KIB, s).unwrap();
    }
    assert!(held(&a) <= k * S + a.parked_bytes());
    for (s, set) in all {
        for (p, n) in set {
            a.deallocate(p, n, s).unwrap();
        }
    }
    all_back(&a, &sim);
}

/// Three threads under a tight cap, each swinging on its per-thread stream, the legacy stream
/// and a user stream of its own, handing a fifth of its legacy and user-stream blocks to the
/// next thread to free on the same stream (remote frees, counted live in the owner until their
/// batch completes), with tags on every block: no overlap, no reuse before a fence, everything
/// back. Out of memory is allowed (arenas whose owner is inside a call keep what the rule
/// allows them), but not while the thread's own arenas and every idle one could give it room:
/// each thread must get at least half its requests.
#[test]
fn swings_on_every_stream_under_a_cap_stay_race_free() {
    within(50, || {
        let sim = host(15);
        let cap = 24 * MIB;
        let a = alloc_with(&sim, small().max_bytes(cap).chunk(4 * MIB).legacy_batch_blocks(16));
        let live = Arc::new(Live::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..3).map(|_| std::sync::mpsc::channel::<Held>()).unzip();
        let mut hs = Vec::new();
        for (t, rx) in rxs.into_iter().enumerate() {
            let (a, sim, live, stop) = (a.clone(), sim.clone(), live.clone(), stop.clone());
            let next = txs[(t + 1) % 3].clone();
            let user = sim.create_stream();
            hs.push(std::thread::spawn(move || {
                let mut x = 0xabcd_0000 + t as u64;
                let mut tagn = (t as u32) << 24;
                let mut mine: Vec<Held> = Vec::new();
                let (mut asked, mut ooms) = (0u32, 0u32);
                let take = |h: Held| {
                    check(&sim, h.p, h.size, h.t, h.s);
                    live.remove(h.p);
                    a.deallocate(h.p, h.size, h.s).unwrap();
                };
                for round in 0..30 {
                    let s = [Stream::PER_THREAD, Stream::LEGACY, user][round % 3];
                    let hi = 100 + (rng(&mut x) % 200) as usize;
                    while mine.len() < hi {
                        let n = size_upto(&mut x, 64 * KIB);
                        asked += 1;
                        match a.allocate(n, s) {
                            Ok(p) => mine.push(Held::taken(&sim, &live, p, n, s, &mut tagn)),
                            Err(cuarena::Error::OutOfMemory { .. }) => {
                                ooms += 1;
                                break;
                            }
                            Err(e) => panic!("{e:?}"),
                        }
                    }
                    while let Ok(h) = rx.try_recv() {
                        take(h);
                    }
                    let lo = if round % 7 == 6 { 0 } else { (rng(&mut x) % 40) as usize };
                    while mine.len() > lo {
                        let i = rng(&mut x) as usize % mine.len();
                        let h = mine.swap_remove(i);
                        if h.s != Stream::PER_THREAD
                            && rng(&mut x).is_multiple_of(5)
                            && !stop.load(Ordering::Relaxed)
                        {
                            next.send(h).unwrap();
                            continue;
                        }
                        take(h);
                    }
                }
                stop.store(true, Ordering::Relaxed);
                for h in mine {
                    take(h);
                }
                drop(next);
                // What the previous thread handed on, until it is done.
                for h in rx {
                    take(h);
                }
                a.release_thread().unwrap();
                assert!(ooms * 2 < asked, "thread {t}: {ooms} of {asked} requests out of memory");
            }));
        }
        drop(txs);
        for h in hs {
            h.join().unwrap();
        }
        live.assert_clean();
        all_back(&a, &sim);
    });
}
