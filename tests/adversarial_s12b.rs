//! Twelfth session, second helper: attacks on the latest fast-path changes.
//!
//! 1. 706af18 (`superblock.rs`): a freed flag is reached through raw pointers into the flag
//!    pages (`first_flag`, `page_base`, `page_mask`) rather than by indexing the `Arc`s.
//!    Attacked with bad frees that reach every path calling `flag(g)` (`is_freed`,
//!    `set_freed`, `unfree`, `claim_free`, `mark_arrived`, `refuse_transit`,
//!    `mark_pool_freed`, `freed_flag`/`in_transit` in the owner's carve, `prefetch_flag`):
//!    pointers at the first and last granule of every page (registry slot) of a large
//!    superblock, unaligned and interior pointers, the last granule of a normal superblock and
//!    pointers past its end and a large one's, on the owner's per-thread, legacy and user
//!    streams and from another thread (whose frees take the flag and are refused later by the
//!    owner's drain), sizes on every route (small, large, over `large_max`); a large
//!    superblock dissolved by an out-of-memory reclaim and its range lent again in another
//!    layout, its old block freed through the pool with bad pointers and twice; a bad free
//!    in transit at a later page of a large superblock while the range goes back to the pool
//!    and is lent again as normal superblocks (the new superblock reads the same flag page);
//!    stale flags left at interior granules, then blocks carved there and freed remotely.
//! 2. b283c8d (`free_lists.rs`): the class bitmap as two `u64` words. Holes of classes 62, 63,
//!    64 and 65 in a large superblock: each request takes the smallest fitting list, across
//!    the words' boundary.
//! 3. 4a32240: the fast path's lazy `Env` (made only for a legacy free or the return rule's
//!    give-back): the return rule fired from the fast path on the per-thread, legacy and user
//!    streams, then the memory reused on another thread's stream under the race checker.
//! 4. 1511b94, fecda64 (`arena.rs`): the slow path releases kept-back legacy frees before it
//!    flushes the cache; the return rule runs after every legacy free. Attacked: second frees
//!    of a kept-back large legacy block from everywhere, its superblock given back and reused
//!    by another thread whose stream only a legacy action orders after the block's last use;
//!    large superblocks given back by the return rule at legacy frees (the recent peak
//!    decaying one step per legacy free) and the ranges reused on another thread's stream;
//!    legacy churn under a tight cap with uses on another thread's stream (no out-of-memory,
//!    no race); multi-threaded churn of small and large blocks with remote frees on every
//!    stream, ordered double frees and interior frees sprinkled in.
//!
//! Found (at b283c8d): all pass. No path reaches `flag(g)` with `g` outside the superblock
//! (every caller's `g` comes from `granule_of`, from `validate`'s bounds-checked tag read, or
//! from the arena's own records), and a `g` past the pages would panic on `page_base`'s bounds
//! check, not read out of bounds. One review finding these tests cannot show: `page_base` is
//! built from `NonNull::from(&p[0])`, a reference to one flag, then offset across the page:
//! undefined behaviour under Stacked Borrows (Miri's default); deriving the pointer from the
//! whole slice (`NonNull::from(&**p).cast()`) fixes it; fixed so after this review. The tight-cap legacy churn does not
//! tell 1511b94's order from the one before it (`adversarial_s12.rs` does); the mutations
//! checked: every flag on page 0, the carve ignoring `IN_TRANSIT`, the bitmap's high word
//! never searched, no return rule at legacy frees, none on the fast path: each fails a test.
//!
//! The oracles: immediate refusals asserted per call; every accepted bad free refused later
//! (`invalid_frees` equals the bad frees made); the host device's race checker and tags;
//! overlap maps; `stats()`; `assert_all_returned`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuarena::{Device, DeviceAddr, Error, Event, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned};

mod common;
use common::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// `small()`'s normal superblock: one registry slot, one page of 1024 freed flags.
const S: usize = 256 * KIB;
const SMALL_MAX: usize = 64 * KIB;
/// The default `large_max`.
const LARGE_MAX: usize = 64 * MIB;

/// Makes later work on `to` wait for the work queued on `from` so far (both resolved for the
/// calling thread).
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    if from != to {
        sim.stream_wait_event(to, record(sim, from)).unwrap();
    }
}

/// An event recorded on `s` now.
fn record(sim: &HostDevice, s: Stream) -> Event {
    let e = sim.create_event().unwrap();
    sim.record_event(e, s).unwrap();
    e
}

/// Bad frees made on purpose: refused at once, or accepted (another thread's, checked later
/// by the owner's drain or the pool).
#[derive(Default, Debug, Clone, Copy)]
struct Bad {
    now: u64,
    later: u64,
}

impl Bad {
    /// A bad free that must be refused at once.
    fn refused(&mut self, r: cuarena::Result<()>, what: &str) {
        assert!(is_invalid(&r), "{what}: not refused at once: {r:?}");
        self.now += 1;
    }
    /// A bad free that may be accepted (to be refused later) or refused at once.
    fn either(&mut self, r: cuarena::Result<()>, what: &str) {
        match r {
            Ok(()) => self.later += 1,
            Err(Error::InvalidFree { .. }) => self.now += 1,
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
    fn total(&self) -> u64 {
        self.now + self.later
    }
    fn add(&mut self, o: Bad) {
        self.now += o.now;
        self.later += o.later;
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Freed flags through raw page pointers.

/// Pointers aimed at every page of a large superblock (the owner holding two 3 MiB blocks at
/// its start): each page's first granule (block heads get wrong sizes only), its last granule,
/// an unaligned one, one past the superblock's end and beyond, one before its start. Sizes on
/// every route. The owner's frees on its three streams are refused at once; another thread's
/// (per-thread, legacy, its user stream) are refused at once or taken and refused by the
/// owner's drain. Then: the blocks are intact and free normally, the stale flags left at
/// interior granules are cleared by the carve that hands a block out there (another thread's
/// free of such a block is taken, its second free refused), and everything comes back.
#[test]
fn bad_frees_aimed_at_every_page_of_a_large_superblock_are_refused_on_every_stream() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let size = 3 * MIB;
    let p = a.allocate_per_thread(size).unwrap();
    let q = a.allocate_per_thread(size).unwrap();
    tag(&sim, p, size, 1, Stream::PER_THREAD);
    tag(&sim, q, size, 2, Stream::PER_THREAD);
    let (base, bytes) = superblock_of(&a, p.0);
    assert_eq!(base, p.0, "the first block starts the large superblock");
    assert!(bytes >= 8 * MIB && bytes / S >= 32, "a large superblock over many slots: {bytes}");
    assert_eq!(superblock_of(&a, q.0), (base, bytes), "both blocks in one large superblock");
    let pages = (bytes / S) as u64;
    let end = base + bytes as u64;
    let any = vec![256, SMALL_MAX + 1, size, LARGE_MAX + 1];
    let wrong = vec![256, SMALL_MAX + 1, size + 256, LARGE_MAX + 1];
    let mut targets: Vec<(u64, Vec<usize>)> = Vec::new();
    for k in 0..pages {
        let first = base + k * S as u64;
        targets.push((first, if first == p.0 || first == q.0 { wrong.clone() } else { any.clone() }));
        targets.push((first + S as u64 - 256, any.clone())); // the page's last granule
        targets.push((first + 256, vec![256, size])); // the page's second granule
        targets.push((first + S as u64 / 2 + 8, vec![size])); // unaligned
    }
    for t in [end, end + 256, end + S as u64, end + 2 * S as u64 - 256, base - 256, p.0 + size as u64 - 256] {
        targets.push((t, any.clone()));
    }
    let u = sim.create_stream();
    let mut bad = Bad::default();
    for (t, sizes) in &targets {
        for &n in sizes {
            for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                bad.refused(a.deallocate(DeviceAddr(*t), n, s), &format!("owner {t:#x} {n} {s:?}"));
            }
        }
    }
    assert_eq!(a.stats().invalid_frees, bad.total());
    // Another thread, on each of its streams.
    let u2 = sim.create_stream();
    let targets = Arc::new(targets);
    let t2 = Arc::clone(&targets);
    let remote = on_thread(&a, move |a| {
        let mut bad = Bad::default();
        for (t, sizes) in t2.iter() {
            for &n in sizes {
                for s in [Stream::PER_THREAD, Stream::LEGACY, u2] {
                    bad.either(a.deallocate(DeviceAddr(*t), n, s), &format!("remote {t:#x} {n} {s:?}"));
                }
            }
        }
        a.flush().unwrap();
        bad
    });
    bad.add(remote);
    assert!(remote.later > 0, "some remote bad frees were taken to be checked by the owner");
    // The user-stream batches go after a device synchronise (trim(true)); the owner drains.
    a.trim(true).unwrap();
    a.flush().unwrap();
    assert_eq!(a.stats().invalid_frees, bad.total(), "{bad:?}");
    assert!(a.take_deferred_error().is_some());
    assert_eq!(superblock_of(&a, p.0), (base, bytes), "the large superblock stays");
    check(&sim, p, size, 1, Stream::PER_THREAD);
    check(&sim, q, size, 2, Stream::PER_THREAD);
    // Blocks carved over the stale flags (the free space from 6 MiB on, where the bad frees
    // left `ARRIVED` at every page's first, second and last granule): every one starts clear.
    let live = Live::of(&[(p, size), (q, size)]);
    let mut tagn = 100;
    let small_blocks: Vec<Held> = (0..64)
        .map(|_| {
            let x = a.allocate_per_thread(SMALL_MAX).unwrap();
            Held::taken(&sim, &live, x, SMALL_MAX, Stream::PER_THREAD, &mut tagn)
        })
        .collect();
    live.assert_clean();
    let on_stale = small_blocks
        .iter()
        .filter(|h| h.p.0 >= base && h.p.0 < end && (h.p.0 - base) % S as u64 == 0)
        .count();
    assert!(on_stale >= 8, "blocks carved at page heads a bad free had flagged: {on_stale}");
    let blocks: Vec<(DeviceAddr, usize)> = small_blocks.iter().map(|h| (h.p, h.size)).collect();
    // Another thread frees them on the legacy stream (ordered after our per-thread stream):
    // each taken (its flag clear), its second free refused at once.
    let second = on_thread(&a, move |a| {
        let mut bad = Bad::default();
        for &(x, n) in &blocks {
            a.deallocate(x, n, Stream::LEGACY).unwrap();
            bad.refused(a.deallocate(x, n, Stream::LEGACY), "second free");
            bad.refused(a.deallocate(x, n, Stream::PER_THREAD), "second free, per-thread");
        }
        bad
    });
    bad.add(second);
    a.flush().unwrap();
    a.deallocate_per_thread(p, size).unwrap();
    a.deallocate_per_thread(q, size).unwrap();
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(u2).unwrap();
    assert_all_returned(&a, Some(&sim), bad.total());
}

/// The last granule of a normal superblock (the last of its one page: `g == page_mask`) and
/// pointers past its end, for a superblock of the per-thread arena and one of the legacy
/// arena, filled by four 64 KiB blocks each: refused at once by the owner on every stream,
/// refused at once or later from another thread. Then the blocks are intact and free.
#[test]
fn the_last_granule_and_past_the_end_of_a_normal_superblock_are_refused_everywhere() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(4));
    let mut sbs = Vec::new();
    let mut all = Vec::new();
    for (i, s) in [Stream::PER_THREAD, Stream::LEGACY].into_iter().enumerate() {
        let ps: Vec<DeviceAddr> = (0..4).map(|_| a.allocate(SMALL_MAX, s).unwrap()).collect();
        let (base, bytes) = superblock_of(&a, ps[0].0);
        assert_eq!(bytes, S);
        assert!(ps.iter().all(|p| superblock_of(&a, p.0) == (base, bytes)), "four fill one superblock");
        for (j, &p) in ps.iter().enumerate() {
            tag(&sim, p, SMALL_MAX, (10 * i + j) as u32, s);
            all.push((p, s, (10 * i + j) as u32));
        }
        sbs.push(base);
    }
    let mut targets = Vec::new();
    for &base in &sbs {
        let end = base + S as u64;
        for t in [end - 256, end - 512, end - SMALL_MAX as u64 + 256, end - 1, end, end + 256, end + S as u64]
        {
            // Past the end may be the other arena's superblock: its block heads get wrong sizes.
            if !all.iter().any(|&(p, ..)| p.0 == t) {
                targets.push(t);
            }
        }
    }
    let sizes = [256, SMALL_MAX - 256, SMALL_MAX + 1, LARGE_MAX + 1];
    let u = sim.create_stream();
    let mut bad = Bad::default();
    for &t in &targets {
        for n in sizes {
            for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                bad.refused(a.deallocate(DeviceAddr(t), n, s), &format!("owner {t:#x} {n} {s:?}"));
            }
        }
    }
    let u2 = sim.create_stream();
    let t2 = targets.clone();
    let remote = on_thread(&a, move |a| {
        let mut bad = Bad::default();
        for &t in &t2 {
            for n in sizes {
                for s in [Stream::PER_THREAD, Stream::LEGACY, u2] {
                    bad.either(a.deallocate(DeviceAddr(t), n, s), &format!("remote {t:#x} {n} {s:?}"));
                }
            }
        }
        bad
    });
    bad.add(remote);
    a.trim(true).unwrap();
    a.flush().unwrap();
    assert_eq!(a.stats().invalid_frees, bad.total(), "{bad:?}");
    for &(p, s, t) in &all {
        check(&sim, p, SMALL_MAX, t, s);
        a.deallocate(p, SMALL_MAX, s).unwrap();
    }
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(u2).unwrap();
    assert_all_returned(&a, Some(&sim), bad.total());
}

/// A large superblock holding one live 3 MiB block is dissolved by another thread's
/// out-of-memory reclaim under a 20 MiB cap, and part of its range is lent again to that
/// thread as a superblock of another layout (the registry's entries there replaced). The old
/// block, now a pool block, is then the target: interior pointers at each of its pages, its
/// last granule, the old superblock's last granule and end, wrong sizes at its head, on every
/// stream, from the thread that allocated it; then its correct free, and second frees from
/// both threads before and after the pool applies the first. All refused; nothing lost.
#[test]
fn a_dissolved_large_superblocks_block_freed_through_the_pool_with_bad_pointers_and_twice() {
    let sim = host(0);
    let a = alloc_with(&sim, small().max_bytes(20 * MIB).batch_blocks(4));
    let size = 3 * MIB;
    let p = a.allocate_per_thread(size).unwrap();
    tag(&sim, p, size, 7, Stream::PER_THREAD);
    let (base, bytes) = superblock_of(&a, p.0);
    assert_eq!((base, bytes), (p.0, 16 * MIB));
    let w = Worker::new(&a);
    let big = 8 * MIB;
    let r = w.run(move |a| a.allocate_per_thread(big).unwrap());
    let s = a.stats();
    assert!(s.superblocks_dissolved >= 1, "the idle owner's large superblock was dissolved: {s:?}");
    assert!(
        a.pool_used_ranges().iter().any(|&(b, l, sb)| b == p.0 && l == size && !sb),
        "the live block is a pool block now: {:?}",
        a.pool_used_ranges()
    );
    assert!(
        r.0 > base && r.0 < base + bytes as u64,
        "the worker's block lies in the dissolved range (lent again in another layout): {:#x} {:?}",
        r.0,
        lent(&a)
    );
    let end = base + bytes as u64;
    let mut targets: Vec<(u64, Vec<usize>)> = vec![(p.0, vec![256, size + 256, size - 256, SMALL_MAX + 1])];
    for k in 1..(size / S) as u64 {
        targets.push((p.0 + k * S as u64, vec![256, size - k as usize * S]));
        targets.push((p.0 + k * S as u64 - 256, vec![256]));
    }
    for t in [p.0 + 256, p.0 + 8, p.0 + size as u64 - 256, end - 256, end, end + S as u64] {
        targets.push((t, vec![256, SMALL_MAX + 1, size]));
    }
    // Inside the worker's superblock (not its block's head): taken, refused by the worker.
    for t in [r.0 + 256, r.0 + S as u64, r.0 + big as u64 - 256] {
        targets.push((t, vec![256, SMALL_MAX + 1]));
    }
    let u = sim.create_stream();
    let mut bad = Bad::default();
    for (t, sizes) in &targets {
        for &n in sizes {
            for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                bad.either(a.deallocate(DeviceAddr(*t), n, s), &format!("{t:#x} {n} {s:?}"));
            }
        }
    }
    a.flush().unwrap();
    w.run(|a| a.flush().unwrap()); // the worker drains what reached it
    a.trim(true).unwrap(); // user-stream batches go after a synchronise
    w.run(|a| a.flush().unwrap());
    assert_eq!(a.stats().invalid_frees, bad.total(), "{bad:?}");
    check(&sim, p, size, 7, Stream::PER_THREAD);
    // The correct free, then second frees from everywhere, before and after the pool applies it.
    a.deallocate_per_thread(p, size).unwrap();
    for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
        bad.refused(a.deallocate(p, size, s), "second free, pending");
    }
    let b2 = w.run(move |a| {
        let mut bad = Bad::default();
        for s in [Stream::PER_THREAD, Stream::LEGACY] {
            bad.refused(a.deallocate(p, size, s), "another thread's second free, pending");
        }
        bad
    });
    bad.add(b2);
    a.flush().unwrap();
    a.trim(true).unwrap();
    for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
        bad.refused(a.deallocate(p, size, s), "second free, applied");
    }
    let b3 = w.run(move |a| {
        let mut bad = Bad::default();
        bad.refused(a.deallocate(p, size, Stream::PER_THREAD), "another thread's second free, applied");
        a.deallocate_per_thread(r, big).unwrap();
        bad
    });
    bad.add(b3);
    w.exit();
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), bad.total());
}

/// Another thread's bad free of an aligned interior pointer at the first granule of page 5 of
/// a large superblock is taken (its flag `IN_TRANSIT`) and kept in that thread's outbox. The
/// owner frees its block and exits: the large superblock goes back to the pool whole. The
/// owner then allocates 64 KiB blocks until the range is lent again as normal superblocks:
/// the one at slot 5 reads the same flag page, and its first granule must not be handed out
/// while the bad free is on its way. Then the bad free arrives and is refused; the range
/// becomes usable again; nothing is lost.
#[test]
fn a_bad_free_in_transit_at_a_later_page_holds_its_flag_across_a_change_of_layout() {
    let sim = host(0);
    let a = alloc_with(&sim, small().batch_blocks(64));
    let p = a.allocate_per_thread(3 * MIB).unwrap();
    let (base, bytes) = superblock_of(&a, p.0);
    assert!(bytes >= 8 * MIB);
    let target = base + 5 * S as u64;
    let w = Worker::new(&a);
    let r = w.run(move |a| a.deallocate_per_thread(DeviceAddr(target), SMALL_MAX));
    assert!(r.is_ok(), "an aligned interior pointer into another thread's superblock is taken: {r:?}");
    a.deallocate_per_thread(p, 3 * MIB).unwrap();
    a.release_thread().unwrap();
    assert!(lent(&a).is_empty(), "the large superblock went back: {:?}", lent(&a));
    let live = Live::default();
    let mut got = Vec::new();
    for _ in 0..bytes / SMALL_MAX {
        let x = a.allocate_per_thread(SMALL_MAX).unwrap();
        assert_ne!(x.0, target, "a block handed out at a flag a bad free on its way holds");
        live.insert(x, SMALL_MAX);
        got.push(x);
    }
    live.assert_clean();
    let in_slot5 = got.iter().filter(|x| (target..target + S as u64).contains(&x.0)).count();
    assert!(in_slot5 >= 1, "slot 5 was lent again as a normal superblock: {:?}", lent(&a));
    assert_eq!(superblock_of(&a, target), (target, S), "a normal superblock at slot 5 now");
    // The bad free arrives.
    w.exit();
    a.flush().unwrap();
    assert_eq!(a.stats().invalid_frees, 1);
    assert!(a.take_deferred_error().is_some());
    // The quarantined range is merged back: the smallest fitting free block is the one at the
    // flag (the 256th block took a new superblock, whose rest is larger).
    let y = a.allocate_per_thread(SMALL_MAX).unwrap();
    assert_eq!(y.0, target, "the quarantined first block of slot 5 is reused once the bad free arrived");
    got.push(y);
    for x in got {
        a.deallocate_per_thread(x, SMALL_MAX).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 1);
}

// ---------------------------------------------------------------------------------------------
// 2. The free lists' two-word bitmap.

/// Holes of exactly classes 64 (288 KiB), 63 (256 KiB), 62 (240 KiB) and 65 (320 KiB) in one
/// large superblock, separated by live blocks: each request takes the smallest list that fits,
/// in the low word, at the boundary, and across it, with no new superblock.
#[test]
fn holes_around_the_bitmaps_word_boundary_are_each_taken_by_the_smallest_fitting_request() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let sep = 80 * KIB;
    let sizes = [288 * KIB, 256 * KIB, 240 * KIB, 320 * KIB];
    let mut holes = Vec::new();
    let mut seps = Vec::new();
    let mut next = None;
    for n in sizes {
        let h = a.allocate_per_thread(n).unwrap();
        let s = a.allocate_per_thread(sep).unwrap();
        if let Some(e) = next {
            assert_eq!(h.0, e, "carved in order");
        }
        assert_eq!(s.0, h.0 + n as u64);
        next = Some(s.0 + sep as u64);
        holes.push(h);
        seps.push(s);
    }
    let tail = next.unwrap();
    let taken = a.stats().superblocks_taken;
    assert_eq!(taken, 1);
    for (h, n) in holes.iter().zip(sizes) {
        a.deallocate_per_thread(*h, n).unwrap();
    }
    let want = |n: usize, at: u64, what: &str| {
        let x = a.allocate_per_thread(n).unwrap();
        assert_eq!(x.0, at, "{what}: a request of {n} B took {:#x}", x.0);
        x
    };
    let x1 = want(256 * KIB + 1, holes[0].0, "class 64 (high word, bit 0) takes the 288 KiB hole");
    let x2 = want(250 * KIB, holes[1].0, "class 63 (low word, bit 63) takes the 256 KiB hole");
    let x3 = want(240 * KIB, holes[2].0, "class 62 takes the 240 KiB hole");
    let x4 = want(241 * KIB, holes[3].0, "class 63, lists 63 and 64 empty: across the words to 65");
    let x5 = want(241 * KIB, tail, "then the superblock's remainder (the last list)");
    assert_eq!(a.stats().superblocks_taken, taken, "no new superblock");
    for (x, n) in [(x1, 256 * KIB + 1), (x2, 250 * KIB), (x3, 240 * KIB), (x4, 241 * KIB), (x5, 241 * KIB)] {
        a.deallocate_per_thread(x, n).unwrap();
    }
    for s in seps {
        a.deallocate_per_thread(s, sep).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// 3. The fast path's lazy Env.

/// 64 blocks of 64 KiB (16 superblocks) allocated and freed on one stream: the frees run the
/// return rule on the fast path (its give-back makes the `Env` there), which gives back all but
/// the kept ones. On a user stream the give-back asks the handle's identity first. Then
/// another thread reuses the memory on its per-thread stream: ordered after our uses by the
/// give-back's fence (race checker).
#[test]
fn the_return_rule_on_the_fast_path_gives_back_on_every_stream() {
    let sim = host(50);
    let a = alloc_with(&sim, small());
    let u = sim.create_stream();
    for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
        let s0 = a.stats();
        let ps: Vec<DeviceAddr> = (0..64).map(|_| a.allocate(SMALL_MAX, s).unwrap()).collect();
        for (i, &p) in ps.iter().enumerate() {
            sim.hold_and_check(p.0, 256, i as u32, Duration::from_micros(200), s).unwrap();
        }
        for &p in &ps {
            a.deallocate(p, SMALL_MAX, s).unwrap();
        }
        if s.is_legacy() {
            a.flush().unwrap(); // the kept-back frees released, the rule applied
        }
        let s1 = a.stats();
        assert!(
            s1.superblocks_returned - s0.superblocks_returned >= 12,
            "{s:?}: the return rule gave back on the fast path: {s1:?}"
        );
        let ranges: Vec<(DeviceAddr, usize)> = ps.iter().map(|&p| (p, SMALL_MAX)).collect();
        let reused = on_thread(&a, move |a| {
            let qs: Vec<DeviceAddr> = (0..64).map(|_| a.allocate_per_thread(SMALL_MAX).unwrap()).collect();
            let reused = qs.iter().filter(|q| ranges.iter().any(|r| r.0 == **q)).count();
            for q in qs {
                a.deallocate_per_thread(q, SMALL_MAX).unwrap();
            }
            reused
        });
        assert!(reused >= 32, "{s:?}: another thread reused the given-back memory: {reused}");
        let v = sim.violations();
        assert!(v.is_empty(), "{s:?}: {v:?}");
    }
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

// ---------------------------------------------------------------------------------------------
// 4. Legacy frees: the reordered slow path and the return rule after every legacy free.

/// A large legacy block, used on another thread's per-thread stream, is freed on the legacy
/// stream (kept back). Its second frees from everywhere are refused at once; an aligned
/// interior pointer at a later page of it from another thread is taken and refused later.
/// Its superblock is then given back (trim) with the kept-back free's lazy legacy fence, and
/// another thread reuses the range on its per-thread stream: ordered after the use only by a
/// legacy action (race checker). Second frees after the give-back are refused too.
#[test]
fn a_kept_back_large_legacy_free_is_refused_twice_and_its_range_reused_in_order() {
    let sim = host(0);
    let a = alloc_with(&sim, small().legacy_batch_blocks(64));
    let size = 2 * MIB + 1000;
    let ps: Vec<DeviceAddr> = (0..3).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
    let (base, bytes) = superblock_of(&a, ps[0].0);
    assert!(ps.iter().all(|p| superblock_of(&a, p.0) == (base, bytes)));
    let p = ps[0];
    use_on_another_thread(&sim, &[(p, 4096), (DeviceAddr(p.0 + 2 * MIB as u64), 4096)], 500, 30);
    a.deallocate(p, size, Stream::LEGACY).unwrap(); // kept back
    let u = sim.create_stream();
    let mut bad = Bad::default();
    for s in [Stream::LEGACY, Stream::PER_THREAD, u] {
        bad.refused(a.deallocate(p, size, s), "owner's second free");
        bad.refused(a.deallocate(DeviceAddr(p.0 + 256), size - 256, s), "interior of a kept block");
        bad.refused(a.deallocate(DeviceAddr(p.0 + 8 * S as u64), size, s), "later page of a kept block");
    }
    let u2 = sim.create_stream();
    let remote = on_thread(&a, move |a| {
        let mut bad = Bad::default();
        for s in [Stream::PER_THREAD, Stream::LEGACY, u2] {
            let r = a.deallocate(p, size, s);
            assert!(is_double(&r), "another thread's second free of a kept-back block: {r:?}");
            bad.now += 1;
        }
        bad.either(a.deallocate(DeviceAddr(p.0 + 4 * S as u64), 4096, Stream::PER_THREAD), "interior");
        bad
    });
    bad.add(remote);
    for &q in &ps[1..] {
        a.deallocate(q, size, Stream::LEGACY).unwrap();
    }
    a.flush().unwrap();
    a.trim(false).unwrap();
    assert!(
        !lent(&a).iter().any(|&(b, _)| b == base),
        "the empty large superblock went back: {:?}",
        lent(&a)
    );
    assert!(a.stats().superblocks_returned >= 1);
    assert_eq!(a.stats().invalid_frees, bad.total(), "{bad:?}");
    for s in [Stream::LEGACY, Stream::PER_THREAD, u] {
        bad.refused(a.deallocate(p, size, s), "second free after the give-back");
    }
    // Another thread reuses the range on its per-thread stream, writing where the other
    // thread's uses were: ordered after them only through the kept-back free's legacy action.
    let sim2 = sim.clone();
    let hits = std::thread::spawn({
        let a = a.clone();
        move || {
            let qs: Vec<DeviceAddr> = (0..3).map(|_| a.allocate_per_thread(size).unwrap()).collect();
            for (i, &q) in qs.iter().enumerate() {
                sim2.write_tag(q.0, 4096, 900 + i as u32, Stream::PER_THREAD).unwrap();
                sim2.write_tag(q.0 + 2 * MIB as u64, 4096, 950 + i as u32, Stream::PER_THREAD).unwrap();
            }
            let hits = qs.iter().filter(|q| q.0 == p.0).count();
            for q in qs {
                a.deallocate_per_thread(q, size).unwrap();
            }
            a.release_thread().unwrap();
            hits
        }
    })
    .join()
    .unwrap();
    assert_eq!(hits, 1, "the given-back range was reused by another thread at the block's address");
    sim.destroy_stream(u).unwrap();
    sim.destroy_stream(u2).unwrap();
    assert_all_returned(&a, Some(&sim), bad.total());
}

/// 24 blocks of 8 MiB on the legacy stream (six large superblocks of 32 MiB, more than the
/// rule's spare `L` of 128 MiB), their heads used on another thread's per-thread stream, are
/// freed on the legacy stream in batches of 4; then small legacy churn. The return rule, now
/// run after every legacy free, gives the empty large superblocks back as its recent peak
/// decays, down to its bound. Second frees of the old blocks are refused at once; another
/// thread then reuses the ranges on its per-thread stream, ordered after the uses by a legacy
/// action (race checker).
#[test]
fn the_return_rule_at_legacy_frees_gives_back_large_superblocks_and_their_reuse_is_ordered() {
    let sim = roomy();
    let a = alloc_with(&sim, small().legacy_batch_blocks(4));
    let size = 8 * MIB;
    let ps: Vec<DeviceAddr> = (0..24).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
    let held0 = a.stats().arena_held_bytes;
    assert!(held0 >= 192 * MIB as u64, "{held0}");
    let heads: Vec<(DeviceAddr, usize)> = ps.iter().map(|&p| (p, 4096)).collect();
    use_on_another_thread(&sim, &heads, 2000, 5);
    for &p in &ps {
        a.deallocate(p, size, Stream::LEGACY).unwrap();
    }
    for _ in 0..3000 {
        let x = a.allocate(4096, Stream::LEGACY).unwrap();
        a.deallocate(x, 4096, Stream::LEGACY).unwrap();
    }
    let s = a.stats();
    assert!(s.superblocks_returned >= 1, "large superblocks given back at legacy frees: {s:?}");
    assert!(
        s.arena_held_bytes <= (128 + 32) as u64 * MIB as u64 + 2 * S as u64,
        "held {} MiB after the peak decayed (L = 128 MiB): {s:?}",
        s.arena_held_bytes >> 20
    );
    let mut bad = Bad::default();
    let u = sim.create_stream();
    for &p in &ps {
        for s in [Stream::LEGACY, Stream::PER_THREAD, u] {
            bad.refused(a.deallocate(p, size, s), "second free of a given-back block");
        }
    }
    let b = on_thread(&a, move |a| {
        let mut bad = Bad::default();
        for &p in &ps {
            bad.refused(a.deallocate(p, size, Stream::PER_THREAD), "another thread's second free");
        }
        bad
    });
    bad.add(b);
    let (sim2, a2) = (sim.clone(), a.clone());
    let reused = std::thread::spawn(move || {
        let qs: Vec<DeviceAddr> = (0..20).map(|_| a2.allocate_per_thread(size).unwrap()).collect();
        for (i, &q) in qs.iter().enumerate() {
            sim2.write_tag(q.0, 4096, 5000 + i as u32, Stream::PER_THREAD).unwrap();
        }
        let n = qs.iter().filter(|q| heads.iter().any(|h| h.0 == **q)).count();
        for q in qs {
            a2.deallocate_per_thread(q, size).unwrap();
        }
        a2.release_thread().unwrap();
        n
    })
    .join()
    .unwrap();
    assert!(reused > 0, "the ranges were reused at the old blocks' addresses");
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), bad.total());
}

/// Legacy churn under a tight cap (six superblocks), with a working set under two of them:
/// small blocks of cached and uncached classes, some used on another thread's per-thread stream
/// before their legacy free, a second thread making legacy frees that cover sealed halves.
/// No allocation fails, no byte is handed out twice, no reuse races a use, and the arena never
/// needs the out-of-memory reclaim for memory it holds free (the slow path releases kept-back
/// frees before it would grow).
#[test]
fn legacy_churn_under_a_tight_cap_releases_kept_frees_before_growing() {
    let sim = host(2);
    let cap = 6 * S;
    let a = alloc_with(&sim, small().chunk(S).max_bytes(cap).legacy_batch_blocks(16));
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicU64::new(0));
    // The covering thread: its own tiny legacy churn, a legacy action every 8 frees.
    let cover = {
        let (a, stop) = (a.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut n = 0u64;
            while stop.load(Ordering::Relaxed) == 0 {
                let x = a.allocate(256, Stream::LEGACY).unwrap();
                a.deallocate(x, 256, Stream::LEGACY).unwrap();
                n += 1;
                if n.is_multiple_of(8) {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            a.release_thread().unwrap();
            n
        })
    };
    let mut x = 0x1234_5678_9abc_def1u64;
    let mut held: Vec<Held> = Vec::new();
    let mut tagn = 0;
    let mut bytes = 0usize;
    let s0 = a.stats();
    for step in 0..3000 {
        let r = rng(&mut x);
        if bytes < 2 * S - SMALL_MAX && (!r.is_multiple_of(5) || held.is_empty()) {
            let size = match r % 6 {
                0 => 256,
                1 => 4 * KIB,
                2 => 32 * KIB,
                3 => 40 * KIB,
                4 => SMALL_MAX,
                _ => 3000,
            };
            let p = a.allocate(size, Stream::LEGACY).unwrap_or_else(|e| {
                panic!("step {step}: {size} B with {bytes} B live under a {cap} B cap: {e}")
            });
            bytes += size;
            held.push(Held::taken(&sim, &live, p, size, Stream::LEGACY, &mut tagn));
        } else {
            let k = rng(&mut x) as usize % held.len();
            let h = held.swap_remove(k);
            if step % 97 == 0 {
                use_on_another_thread(&sim, &[(h.p, h.size.min(4096))], 10_000 + step, 2);
            } else {
                check(&sim, h.p, h.size, h.t, Stream::LEGACY);
            }
            live.remove(h.p);
            bytes -= h.size;
            a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
        }
    }
    stop.store(1, Ordering::Relaxed);
    let covered = cover.join().unwrap();
    live.assert_clean();
    let s = a.stats();
    assert!(covered > 0);
    assert_eq!(s.ooms - s0.ooms, 0, "{s:?}");
    assert_eq!(
        s.alloc_retries - s0.alloc_retries,
        0,
        "out-of-memory reclaims for a working set under a third of the cap: {s:?}"
    );
    for h in held {
        a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
    }
    assert_all_returned(&a, Some(&sim), 0);
}

/// A block handed from one thread to another: the allocating stream, its tag, and an event
/// recorded after its uses there.
#[derive(Clone, Copy)]
struct Handed {
    h: Held,
    after: Event,
}

/// Three threads churn small and large blocks on their per-thread, legacy and user streams,
/// hand a third to the next thread (freed there on a random stream, ordered after the uses by
/// an event), free their own on random streams (cross-stream frees ordered by an event), make
/// an ordered second free of their own freed blocks (refused at once), and aligned interior
/// frees of blocks handed to them (taken or refused, refused later by the owner). `trim` now
/// and then. No overlap, no race, the bad frees all refused, everything returned.
#[test]
fn three_threads_churn_small_and_large_blocks_with_remote_frees_and_bad_frees() {
    let sim = host(5);
    let a = alloc_with(&sim, small().batch_blocks(8).legacy_batch_blocks(8));
    let live = Arc::new(Live::default());
    let bad_total = Arc::new(Mutex::new(Bad::default()));
    let n = 3;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| std::sync::mpsc::channel::<Handed>()).unzip();
    let mut rxs: Vec<Option<std::sync::mpsc::Receiver<Handed>>> = rxs.into_iter().map(Some).collect();
    let mut hs = Vec::new();
    for id in 0..n {
        let tx = txs[(id + 1) % n].clone();
        let rx = rxs[id].take().unwrap();
        let (a, sim, live, bad_total) = (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&bad_total));
        hs.push(std::thread::spawn(move || {
            let mut x = 0x2545_f491_4f6c_dd1du64 ^ ((id as u64 + 1) * 0x9e37);
            let mut tagn = id as u32 * 1_000_000;
            let u = sim.create_stream();
            let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
            let mut held: Vec<Held> = Vec::new();
            let mut bad = Bad::default();
            let free_on = |h: &Held, s: Stream| {
                live.remove(h.p);
                a.deallocate(h.p, h.size, s).unwrap();
            };
            for step in 0..1200 {
                for hd in rx.try_iter() {
                    let h = hd.h;
                    let s = streams[rng(&mut x) as usize % 3];
                    sim.stream_wait_event(s, hd.after).unwrap();
                    check(&sim, h.p, h.size, h.t, s);
                    if h.size > 1024 && rng(&mut x).is_multiple_of(4) {
                        let off = 256 * (1 + rng(&mut x) % (h.size as u64 / 256 - 1).max(1));
                        if off < h.size as u64 {
                            bad.either(a.deallocate(DeviceAddr(h.p.0 + off), 256, s), "interior");
                        }
                    }
                    free_on(&h, s);
                }
                let r = rng(&mut x);
                if !r.is_multiple_of(3) || held.is_empty() {
                    let size = match r % 9 {
                        0 => 256,
                        1 => 3000,
                        2 => 4 * KIB,
                        3 => 32 * KIB,
                        4 => SMALL_MAX,
                        5 => SMALL_MAX + 1,
                        6 => 300 * KIB,
                        7 => MIB + 4096,
                        _ => 3 * MIB,
                    };
                    let s = streams[(r >> 8) as usize % 3];
                    let p = a.allocate(size, s).unwrap();
                    held.push(Held::taken(&sim, &live, p, size, s, &mut tagn));
                } else {
                    let k = rng(&mut x) as usize % held.len();
                    let h = held.swap_remove(k);
                    if rng(&mut x).is_multiple_of(3) {
                        let after = record(&sim, h.s);
                        tx.send(Handed { h, after }).unwrap();
                    } else {
                        let s = streams[rng(&mut x) as usize % 3];
                        order(&sim, h.s, s);
                        check(&sim, h.p, h.size, h.t, s);
                        free_on(&h, s);
                        // An ordered second free on another stream: refused at once.
                        let s2 = streams[rng(&mut x) as usize % 3];
                        bad.refused(a.deallocate(h.p, h.size, s2), "second free");
                    }
                }
                if held.len() > 40 {
                    for h in held.drain(..20) {
                        order(&sim, h.s, Stream::LEGACY);
                        free_on(&h, Stream::LEGACY);
                    }
                }
                if step % 400 == 399 {
                    a.flush().unwrap();
                    a.trim(false).unwrap();
                }
            }
            for h in held {
                order(&sim, h.s, Stream::LEGACY);
                free_on(&h, Stream::LEGACY);
            }
            drop(tx);
            for hd in rx.iter() {
                sim.stream_wait_event(Stream::LEGACY, hd.after).unwrap();
                free_on(&hd.h, Stream::LEGACY);
            }
            a.flush().unwrap();
            bad_total.lock().unwrap().add(bad);
            a.release_thread().unwrap();
            u
        }));
    }
    drop(txs);
    let mut us = Vec::new();
    for h in hs {
        us.push(h.join().unwrap());
    }
    live.assert_clean();
    // The threads have exited (their arenas released at thread exit); user-stream batches go
    // after the synchronise of trim(true).
    a.trim(true).unwrap();
    a.flush().unwrap();
    for u in us {
        sim.destroy_stream(u).unwrap();
    }
    let bad = *bad_total.lock().unwrap();
    assert!(bad.now > 100 && bad.later > 0, "{bad:?}");
    assert_all_returned(&a, Some(&sim), bad.total());
}
