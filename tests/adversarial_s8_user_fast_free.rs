//! Attacks on the user-stream free fast path: `free_fast` takes the owner's free of its user
//! arena's block on the arena's stream's handle without asking the stream's identity
//! (`allocator.rs`, "A user arena's own frees"), and sends everything else to the slow path (a
//! free on another stream, an invalid free, a retired arena's block). A free on that handle
//! after the stream was destroyed, or after CUDA gave the handle to a new stream, is taken by
//! the old arena, and its block must stay out of use until a device synchronise. Every test
//! is timing-independent: work that must stay in flight is held behind a
//! [`cuarena_testkit::StreamGate`].

mod common;

use common::{host, on_thread, small};
use cuarena::{Allocator, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, StreamGate, assert_all_returned, host_allocator};

/// Small blocks up to 64 KiB, large ones (from large superblocks) up to 128 KiB.
fn alloc_on(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), small().large_max(128 << 10).build().unwrap()).unwrap()
}

/// A small block and a large one (over `small_max`, up to `large_max`); whole classes or
/// granules, so `live_bytes` counts them exactly.
const SIZES: [usize; 2] = [4 << 10, 96 << 10];

/// Makes later work on `to` wait for the work queued on `from` so far.
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    let ev = sim.create_event().unwrap();
    sim.record_event(ev, from).unwrap();
    sim.stream_wait_event(to, ev).unwrap();
}

/// The end of a test with work held behind `gate`: opens it, frees `blocks` (of `size` bytes)
/// on their streams, gives the thread's arenas back and destroys the user stream `s`.
fn finish(
    a: &Allocator,
    sim: &HostDevice,
    gate: StreamGate,
    blocks: &[(DeviceAddr, Stream)],
    size: usize,
    s: Stream,
) {
    gate.open();
    for &(q, on) in blocks {
        a.deallocate(q, size, on).unwrap();
    }
    a.release_thread().unwrap();
    sim.destroy_stream(s).unwrap();
}

fn refused(r: cuarena::Result<()>) -> InvalidFree {
    match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        r => panic!("not refused as an invalid free: {r:?}"),
    }
}

/// The owner frees its user arena's block on another user stream `C` (legal: the block's work
/// on `A` was ordered before `C`, and `C` uses it behind a closed gate). That free is not the
/// arena's own: the block must not come back on `A` before a fence after `C`'s work. With the
/// identity comparison skipped, the arena would take it locally, and the next allocation on
/// `A` would hand it out (LIFO cache) while `C`'s work on it is still in flight: the race
/// checker catches the write on `A`. The thread has an arena for `C` too.
#[test]
fn owner_free_on_another_user_stream_is_not_reused_before_its_fence() {
    for size in SIZES {
        let sim = host(0);
        let a = alloc_on(&sim);
        let (sa, sc) = (sim.create_stream(), sim.create_stream());
        // An arena for C as well, so that a lookup by the freeing stream finds one.
        let other = a.allocate(size, sc).unwrap();
        let p = a.allocate(size, sa).unwrap();
        let keep = a.allocate(size, sa).unwrap(); // no return rule on the free below
        sim.write_tag(p.0, 256, 1, sa).unwrap();
        order(&sim, sa, sc);
        let gate = sim.gate(sc).unwrap();
        sim.write_tag(p.0, 256, 2, sc).unwrap(); // in flight until the gate opens
        let s0 = a.stats();
        a.deallocate(p, size, sc).unwrap();
        let s1 = a.stats();
        let q = a.allocate(size, sa).unwrap();
        sim.write_tag(q.0, 256, 3, sa).unwrap();
        let v = sim.violations();
        assert!(v.is_empty(), "{size}: {} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
        assert_ne!(q, p, "{size}: the block came back on A at once, unfenced");
        assert_eq!(
            s1.cross_stream_frees,
            s0.cross_stream_frees + 1,
            "{size}: not the arena's own stream: {s1:?}"
        );
        assert_eq!(s1.live_bytes, s0.live_bytes - size as u64, "{size}: {s1:?}");
        // A second free of the block, on either stream, is refused.
        assert_eq!(refused(a.deallocate(p, size, sa)), InvalidFree::DoubleFree, "{size}");
        assert_eq!(refused(a.deallocate(p, size, sc)), InvalidFree::DoubleFree, "{size}");
        gate.open();
        for (b, s) in [(q, sa), (keep, sa), (other, sc)] {
            a.deallocate(b, size, s).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 2);
    }
}

/// Stream `A` destroyed while work on its blocks is still in flight (behind a gate), and its
/// handle given to a new stream `B`. The owner's frees of `A`'s blocks on that handle are taken
/// by `A`'s arena without asking the identity (a free before the reuse, on the destroyed
/// handle, is refused by the capture query's driver error and changes nothing). The second
/// empties the arena (`keep_empty = 0`), so the return rule asks for the superblock back (for
/// the small size; an arena with a large superblock keeps 128 MiB more). It must ask the
/// handle's identity first and keep the superblock: a give-back under a fence on the handle
/// (now `B`'s, with no work) would let `B`'s new arena borrow the range while `A`'s work on it
/// still runs. Under the mutation `give_back_unasked` (the handle trusted) this test fails: the
/// give-back records its event on the handle. After the gate opens, `trim(true)` gives everything back.
#[test]
fn frees_on_a_reused_handle_stay_out_of_use_until_a_synchronise() {
    for size in SIZES {
        let sim = host(0);
        let a =
            host_allocator(sim.clone(), small().large_max(128 << 10).keep_empty(0).build().unwrap()).unwrap();
        on_thread(&a, {
            let sim = sim.clone();
            move |a| {
                let sa = sim.create_stream();
                let p = a.allocate(size, sa).unwrap();
                let keep = a.allocate(size, sa).unwrap();
                let gate = sim.gate(sa).unwrap();
                sim.write_tag(p.0, size, 1, sa).unwrap(); // in flight until the gate opens
                sim.write_tag(keep.0, size, 1, sa).unwrap();
                sim.destroy_stream(sa).unwrap(); // queued work still completes
                let s0 = a.stats();
                let r = a.deallocate(p, size, sa);
                assert!(matches!(r, Err(Error::Driver { .. })), "{size}: free on a destroyed handle: {r:?}");
                assert_eq!(sim.take_stale_handle_calls(), 1, "{size}: the caller's stale handle, once");
                let s1 = a.stats();
                assert_eq!(
                    (s1.live_bytes, s1.deallocations, s1.invalid_frees),
                    (s0.live_bytes, s0.deallocations, 0)
                );
                let sb = sim.create_stream();
                assert_eq!(sb, sa, "the simulator gives the handle to the next stream");
                // Each free: the capture query; for the small size the first also the return
                // rule's identity lookup (it fires at each, `keep_empty = 0`, but once it has
                // found another stream there the arena asks no more).
                a.deallocate(p, size, sb).unwrap();
                let s2 = a.stats();
                let rule = if size == SIZES[0] { 1 } else { 0 };
                assert_eq!(s2.driver_calls - s1.driver_calls, 1 + rule, "{size}: {s2:?}");
                assert_eq!(
                    s2.cross_stream_frees, s1.cross_stream_frees,
                    "{size}: taken by A's arena: {s2:?}"
                );
                a.deallocate(keep, size, sb).unwrap();
                let s3 = a.stats();
                assert_eq!(s3.driver_calls - s2.driver_calls, 1, "{size}: {s3:?}");
                assert_eq!(sim.stale_handle_calls(), 0, "{size}");
                // Second frees are refused (merged with its neighbour, a block's address may be
                // inside a free range: an unknown pointer then).
                for b in [keep, p] {
                    let r = refused(a.deallocate(b, size, sb));
                    assert!(
                        matches!(r, InvalidFree::DoubleFree | InvalidFree::UnknownPointer),
                        "{size}: {r:?}"
                    );
                }
                // B's arena, and per-thread allocations, never reach A's blocks unfenced.
                let mut qs = Vec::new();
                for _ in 0..8 {
                    for s in [sb, Stream::PER_THREAD] {
                        let q = a.allocate(size, s).unwrap();
                        sim.write_tag(q.0, size, 2, s).unwrap();
                        qs.push((q, s));
                    }
                }
                let v = sim.violations();
                assert!(v.is_empty(), "{size}: {} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
                assert!(qs.iter().all(|&(q, _)| q != p && q != keep), "{size}: A's block handed out again");
                assert_eq!(s3.superblocks_returned, s0.superblocks_returned, "{size}: kept: {s3:?}");
                finish(a, &sim, gate, &qs, size, sb);
            }
        });
        assert_all_returned(&a, Some(&sim), 2);
        assert!(sim.violations().is_empty(), "{size}");
    }
}

/// The same with legal frees only (found by helper-1): stream `X`'s superblock full, the last
/// eight blocks freed on `X` while their work runs behind a gate (no return rule yet), `X`
/// destroyed and its handle given to `Y`, and the other blocks, whose work `Y` waits for, freed
/// on `Y`. Those frees empty the superblock below the rule's threshold (`keep_empty = 0`): the
/// rule must ask the handle's identity, find `Y`, and keep the superblock, since the gated
/// work of `X` still runs on it. It asks once (the arena then knows its stream is gone). Under
/// the mutation `give_back_unasked` the superblock goes to the pool under a fence on `Y`, and
/// the allocations below write over the gated work: the race checker sees it.
#[test]
fn a_give_back_after_the_handle_is_reused_is_refused_for_legal_frees() {
    let size = SIZES[0];
    let sim = host(0);
    let a = host_allocator(sim.clone(), small().large_max(128 << 10).keep_empty(0).build().unwrap()).unwrap();
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let sx = sim.create_stream();
            let (n, early) = (64, 56); // 64 blocks of 4 KiB fill a 256 KiB superblock
            let xs: Vec<DeviceAddr> = (0..n).map(|_| a.allocate(size, sx).unwrap()).collect();
            for &p in &xs[..early] {
                sim.write_tag(p.0, size, 1, sx).unwrap();
            }
            let done = sim.create_event().unwrap();
            sim.record_event(done, sx).unwrap();
            let gate = sim.gate(sx).unwrap();
            for &p in &xs[early..] {
                sim.write_tag(p.0, size, 1, sx).unwrap(); // in flight until the gate opens
                a.deallocate(p, size, sx).unwrap();
            }
            let s0 = a.stats();
            assert_eq!(s0.superblocks_returned + s0.superblocks_dissolved, 0, "no rule yet: {s0:?}");
            sim.destroy_stream(sx).unwrap();
            let sy = sim.create_stream();
            assert_eq!(sy, sx, "the simulator gives the handle to the next stream");
            sim.stream_wait_event(sy, done).unwrap();
            for &p in &xs[..early] {
                a.deallocate(p, size, sy).unwrap();
            }
            let s1 = a.stats();
            let mut got = Vec::new();
            for _ in 0..80 {
                for s in [sy, Stream::PER_THREAD, Stream::LEGACY] {
                    let q = a.allocate(size, s).unwrap();
                    sim.write_tag(q.0, size, 2, s).unwrap();
                    got.push((q, s));
                }
            }
            let v = sim.violations();
            assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
            let frees = early as u64;
            assert_eq!(s1.driver_calls - s0.driver_calls, frees + 1, "capture queries, one identity: {s1:?}");
            let s2 = a.stats();
            assert_eq!(s2.superblocks_returned + s2.superblocks_dissolved, 0, "X's superblock kept: {s2:?}");
            finish(a, &sim, gate, &got, size, sy);
        }
    });
    assert_all_returned(&a, Some(&sim), 0);
    assert!(sim.violations().is_empty());
}

/// Invalid frees of a user arena's blocks by their owner on the arena's own stream (the fast
/// path finds the arena and the identity, then `free_local` refuses): wrong sizes, interior
/// and foreign pointers, size 0, huge sizes; then double frees on the same stream, another user
/// stream, the per-thread and legacy streams and from another thread. Each is refused and
/// counted once and changes nothing; the valid free makes one driver call, the capture query.
#[test]
fn invalid_frees_on_the_user_stream_fast_path() {
    let sim = host(0);
    let a = alloc_on(&sim);
    let (s, t) = (sim.create_stream(), sim.create_stream());
    let mut bad = 0u64;
    for size in SIZES {
        let p = a.allocate(size, s).unwrap();
        let keep = a.allocate(size, s).unwrap(); // the free below fires no return rule
        let s0 = a.stats();
        let wrong = [
            (p, size + 4096),
            (p, size - 4096),
            (p, 0),
            (p, usize::MAX),
            (p, 1 << 40),
            (DeviceAddr(p.0 + 256), size - 256),
            (DeviceAddr(p.0 + 256), size),
            (DeviceAddr(p.0 + 1), size),
            (DeviceAddr(0x10_0000), size),
        ];
        for (q, n) in wrong {
            assert!(a.deallocate(q, n, s).is_err(), "{size}: free of {q:?} size {n} accepted");
            bad += 1;
        }
        let s1 = a.stats();
        assert_eq!(s1.invalid_frees, bad, "{size}: {s1:?}");
        assert_eq!((s1.live_bytes, s1.deallocations), (s0.live_bytes, s0.deallocations), "{size}");
        a.deallocate(p, size, s).unwrap();
        let s2 = a.stats();
        assert_eq!(s2.driver_calls - s1.driver_calls, 1, "{size}: the capture query only: {s2:?}");
        assert_eq!(s2.cross_stream_frees, s1.cross_stream_frees, "{size}: the arena's own free: {s2:?}");
        assert_eq!(s2.live_bytes, s1.live_bytes - size as u64, "{size}: {s2:?}");
        for st in [s, t, Stream::PER_THREAD, Stream::LEGACY, Stream::NULL] {
            assert_eq!(refused(a.deallocate(p, size, st)), InvalidFree::DoubleFree, "{size} {st:?}");
            bad += 1;
        }
        let r = on_thread(&a, move |a| [a.deallocate(p, size, s), a.deallocate(p, size, Stream::PER_THREAD)]);
        for r in r {
            assert_eq!(refused(r), InvalidFree::DoubleFree, "{size}: another thread");
            bad += 1;
        }
        let s3 = a.stats();
        assert_eq!(s3.invalid_frees, bad, "{size}: {s3:?}");
        assert_eq!((s3.live_bytes, s3.deallocations), (s2.live_bytes, s2.deallocations), "{size}: {s3:?}");
        a.deallocate(keep, size, s).unwrap();
    }
    assert!(a.take_deferred_error().is_none());
    assert_all_returned(&a, Some(&sim), bad);
}

/// Another thread frees the owner's user-arena block on the owner's stream (a remote free),
/// then the owner frees it on that stream: the fast path must refuse it (the freed flag is
/// taken), not merge the block a second time. Then a block freed by the owner on its stream
/// and freed again by another thread on the same stream is refused there too.
#[test]
fn cross_thread_and_owner_double_frees_on_one_user_stream() {
    for size in SIZES {
        let sim = host(0);
        let a = alloc_on(&sim);
        let s = sim.create_stream();
        let p = a.allocate(size, s).unwrap();
        let q = a.allocate(size, s).unwrap();
        let keep = a.allocate(size, s).unwrap();
        assert!(on_thread(&a, move |a| a.deallocate(p, size, s)).is_ok());
        assert_eq!(refused(a.deallocate(p, size, s)), InvalidFree::DoubleFree, "{size}");
        a.deallocate(q, size, s).unwrap();
        let r = on_thread(&a, move |a| a.deallocate(q, size, s));
        assert_eq!(refused(r), InvalidFree::DoubleFree, "{size}: another thread");
        let st = a.stats();
        assert_eq!((st.live_bytes, st.invalid_frees), (size as u64, 2), "{size}: {st:?}");
        // A new allocation on the stream never gets a block twice.
        let x = a.allocate(size, s).unwrap();
        let y = a.allocate(size, s).unwrap();
        assert!(x != y && x != keep && y != keep, "{size}");
        for b in [x, y, keep] {
            a.deallocate(b, size, s).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 2);
        sim.destroy_stream(s).unwrap();
    }
}

/// One user stream more than a thread keeps arenas for: the first one's arena is retired
/// (least recently used) while it holds a live block, and parked. The owner's free of that
/// block on its (live) stream finds no arena of the thread: it goes the remote way, once; a
/// second free is refused; the other arenas' frees are their own (lean arenas: each gives its
/// emptied superblock back). The next allocation on the first stream adopts its parked arena
/// again (`Slot::new_user_arena`), with no synchronise, and its free there is its own; the old
/// block stays freed. (The small size only: with the large one, the lean arenas' blocks are
/// the pool's, so their arenas hold nothing and one of them is replaced instead: below.)
#[test]
fn frees_after_the_arena_was_retired_by_lru() {
    let n = cuarena::MAX_USER_ARENAS + 1;
    for size in [SIZES[0]] {
        let sim = host(0);
        let a = alloc_on(&sim);
        let streams: Vec<Stream> = (0..n).map(|_| sim.create_stream()).collect();
        let ps: Vec<DeviceAddr> = streams.iter().map(|&s| a.allocate(size, s).unwrap()).collect();
        for (i, (&p, &s)) in ps.iter().zip(&streams).enumerate() {
            sim.write_tag(p.0, 256, i as u32 + 1, s).unwrap();
        }
        let s0 = a.stats();
        assert_eq!(s0.arenas as usize, n - 1, "{size}: at most MAX_USER_ARENAS user arenas: {s0:?}");
        assert!(a.parked_bytes() > 0, "{size}: the first stream's arena is parked");
        a.deallocate(ps[0], size, streams[0]).unwrap();
        let s1 = a.stats();
        assert_eq!(s1.cross_thread_frees + s1.cross_stream_frees, 1, "{size}: the remote way: {s1:?}");
        assert_eq!(refused(a.deallocate(ps[0], size, streams[0])), InvalidFree::DoubleFree, "{size}");
        for i in 1..n {
            let before = a.stats();
            a.deallocate(ps[i], size, streams[i]).unwrap();
            let after = a.stats();
            // The arena's own free (no remote way); the thread has more than
            // `LEAN_AFTER_USER_ARENAS` user arenas, so they are lean: this free, which empties
            // the arena, gives its superblock back under an event (`arena.rs`). A large block
            // of a lean arena's stream is the pool's (no large superblock is borrowed), except
            // the first four streams', borrowed before the thread's arenas turned lean.
            let remote = |s: &cuarena::Stats| s.cross_thread_frees + s.cross_stream_frees;
            assert_eq!(remote(&after), remote(&before), "{size}: its own free: {after:?}");
            if size <= 64 << 10 || i < 4 {
                let returned = after.superblocks_returned - before.superblocks_returned;
                assert_eq!(returned, 1, "{size}: lean: {after:?}");
            }
            assert_eq!(refused(a.deallocate(ps[i], size, streams[i])), InvalidFree::DoubleFree, "{size}");
        }
        // Stream 0 again: its parked arena is adopted (retiring the least recently used one,
        // which is parked in turn), with no synchronise.
        let syncs = a.stats().host_syncs;
        let q = a.allocate(size, streams[0]).unwrap();
        assert_eq!(a.stats().host_syncs, syncs, "{size}: adopted without a synchronise");
        assert_eq!(a.stats().arenas as usize, n - 1, "{size}");
        sim.write_tag(q.0, 256, 9, streams[0]).unwrap();
        let before = a.stats();
        a.deallocate(q, size, streams[0]).unwrap();
        let after = a.stats();
        assert_eq!(after.cross_stream_frees, before.cross_stream_frees, "{size}: its own free: {after:?}");
        assert_eq!(after.live_bytes, 0, "{size}: {after:?}");
        assert_eq!(refused(a.deallocate(ps[0], size, streams[0])), InvalidFree::DoubleFree, "{size}");
        assert_all_returned(&a, Some(&sim), n as u64 + 1);
    }
}

/// One user stream more than a thread keeps arenas for, with a large block live on each: the
/// first four streams' arenas hold large superblocks (borrowed before the thread's arenas
/// turned lean), the others' blocks are the pool's and their arenas hold nothing. The 17th
/// stream's arena replaces the least recently used arena that holds nothing (the fifth
/// stream's), not the least recently used one: nothing is parked, and the first stream's
/// block is still its arena's own free (`Slot::new_user_arena`, "Making room").
#[test]
fn an_empty_arena_is_replaced_before_a_busy_one() {
    let n = cuarena::MAX_USER_ARENAS + 1;
    let size = SIZES[1];
    let sim = host(0);
    let a = alloc_on(&sim);
    let streams: Vec<Stream> = (0..n).map(|_| sim.create_stream()).collect();
    let ps: Vec<DeviceAddr> = streams.iter().map(|&s| a.allocate(size, s).unwrap()).collect();
    for (i, (&p, &s)) in ps.iter().zip(&streams).enumerate() {
        sim.write_tag(p.0, 256, i as u32 + 1, s).unwrap();
    }
    let st = a.stats();
    assert_eq!(st.arenas as usize, n - 1, "{st:?}");
    assert_eq!(a.parked_bytes(), 0, "an arena holding nothing was replaced: {st:?}");
    assert_eq!(st.host_syncs, 0, "{st:?}");
    let remote = |s: &cuarena::Stats| s.cross_thread_frees + s.cross_stream_frees;
    for (i, (&p, &s)) in ps.iter().zip(&streams).enumerate() {
        let before = a.stats();
        a.deallocate(p, size, s).unwrap();
        assert_eq!(remote(&a.stats()), remote(&before), "stream {i}: its own or the pool's free");
        assert_eq!(refused(a.deallocate(p, size, s)), InvalidFree::DoubleFree, "stream {i}");
    }
    assert_all_returned(&a, Some(&sim), n as u64);
}

/// The return rule on a user stream's fast-path free: with `keep_empty = 0` the free that
/// empties the arena gives its superblock back under a fence on the arena's stream, recorded
/// inside this very call. Work on the block still runs behind a gate; the range then lent to
/// the per-thread stream must wait for that fence. (A small block: an arena holding a large
/// superblock keeps up to 128 MiB more by the rule.)
#[test]
fn return_rule_on_the_user_stream_fast_path_fences_the_give_back() {
    {
        let size = SIZES[0];
        let sim = host(0);
        let cfg = small().large_max(128 << 10).keep_empty(0);
        let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
        let s = sim.create_stream();
        let p = a.allocate(size, s).unwrap();
        let gate = sim.gate(s).unwrap();
        sim.write_tag(p.0, 256, 1, s).unwrap();
        let s0 = a.stats();
        a.deallocate(p, size, s).unwrap();
        let s1 = a.stats();
        assert!(s1.superblocks_returned > s0.superblocks_returned, "{size}: the return rule fired: {s1:?}");
        assert!(s1.fences_recorded > s0.fences_recorded, "{size}: under a fence: {s1:?}");
        // Per-thread allocations over the range just given back.
        let qs: Vec<DeviceAddr> = (0..8).map(|_| a.allocate(size, Stream::PER_THREAD).unwrap()).collect();
        for &q in &qs {
            sim.write_tag(q.0, 256, 2, Stream::PER_THREAD).unwrap();
        }
        let v = sim.violations();
        assert!(v.is_empty(), "{size}: {} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
        gate.open();
        for q in qs {
            a.deallocate(q, size, Stream::PER_THREAD).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
        sim.destroy_stream(s).unwrap();
    }
}

/// A reclaimer (another thread's `trim(true)`) holds the owner's user arena: it found an empty
/// superblock there and, the arena's stream being a user stream it cannot vouch for, waits in
/// a device synchronise, which a closed gate on another stream holds back (deterministically:
/// the test sees the synchronise counted before it acts). Meanwhile the owner's free on its
/// own stream cannot take the fast path (the claim is taken): it goes the remote way, once; a
/// second free is refused; an allocation on the stream is served by the pool. Once the
/// reclaimer is done, everything comes back and the race checker is clean.
#[test]
fn owner_frees_on_its_user_stream_while_a_reclaimer_holds_the_arena() {
    let sim = host(0);
    let a = alloc_on(&sim);
    let sb_bytes = 256u64 << 10;
    on_thread(&a, {
        let sim = sim.clone();
        move |a| {
            let s = sim.create_stream();
            let size = 60 << 10;
            let ps: Vec<DeviceAddr> = (0..8).map(|_| a.allocate(size, s).unwrap()).collect();
            let home = ps[0].0 & !(sb_bytes - 1);
            let (mine, rest): (Vec<DeviceAddr>, Vec<DeviceAddr>) =
                ps.iter().partition(|p| p.0 & !(sb_bytes - 1) == home);
            assert!(mine.len() >= 2 && !rest.is_empty(), "two superblocks at least");
            for &p in &ps {
                sim.write_tag(p.0, 256, 7, s).unwrap();
            }
            for &p in &rest {
                a.deallocate(p, size, s).unwrap(); // an empty superblock, kept by the rule
            }
            let (p, keep) = (mine[0], mine[1]);
            let g = sim.create_stream();
            let gate = sim.gate(g).unwrap();
            let syncs = a.stats().host_syncs;
            let r = std::thread::spawn({
                let a = a.clone();
                move || {
                    let r = a.trim(true);
                    a.release_thread().unwrap();
                    r
                }
            });
            let t0 = std::time::Instant::now();
            while a.stats().host_syncs == syncs {
                assert!(
                    t0.elapsed() < std::time::Duration::from_secs(20),
                    "the reclaimer never synchronised"
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            // The reclaimer holds the arena's claim until the gate opens.
            let s0 = a.stats();
            a.deallocate(p, size, s).unwrap();
            let s1 = a.stats();
            assert_eq!(s1.cross_stream_frees, s0.cross_stream_frees + 1, "the remote way: {s1:?}");
            assert_eq!(s1.live_bytes, s0.live_bytes - size as u64, "{s1:?}");
            assert_eq!(refused(a.deallocate(p, size, s)), InvalidFree::DoubleFree);
            let q = a.allocate(size, s).unwrap();
            assert_ne!(q, p);
            assert_eq!(a.stats().pool_allocations, s0.pool_allocations + 1, "the arena is held");
            sim.write_tag(q.0, 256, 8, s).unwrap();
            gate.open();
            r.join().unwrap().unwrap();
            for b in [q, keep].into_iter().chain(mine[2..].iter().copied()) {
                a.deallocate(b, size, s).unwrap();
            }
            assert_eq!(refused(a.deallocate(p, size, s)), InvalidFree::DoubleFree);
            let st = a.stats();
            assert_eq!((st.live_bytes, st.invalid_frees), (0, 2), "{st:?}");
            a.release_thread().unwrap();
            sim.destroy_stream(s).unwrap();
            sim.destroy_stream(g).unwrap();
        }
    });
    assert_all_returned(&a, Some(&sim), 2);
}

/// A free of a user arena's block on its destroyed stream's handle (which the contract does not
/// allow) passes that stale handle to the driver once, in the fast path's capture query (on
/// CUDA such a call may crash the driver): its error is the free's answer, and the slow path
/// does not ask again. An invalid free on the arena's own stream costs the fast path's capture
/// query and the slow path's identity lookup, which reports it.
#[test]
fn a_free_on_a_stale_handle_reaches_the_driver_once() {
    for size in SIZES {
        let sim = host(0);
        let a = alloc_on(&sim);
        let s = sim.create_stream();
        let p = a.allocate(size, s).unwrap();
        let keep = a.allocate(size, s).unwrap();
        let s0 = a.stats();
        assert!(a.deallocate(p, size + 4096, s).is_err());
        assert_eq!(a.stats().driver_calls - s0.driver_calls, 2, "{size}: an invalid free: capture, identity");
        sim.synchronize();
        sim.destroy_stream(s).unwrap();
        assert!(matches!(a.deallocate(p, size, s), Err(Error::Driver { .. })), "{size}");
        assert_eq!(sim.take_stale_handle_calls(), 1, "{size}: the caller's stale handle, once");
        for b in [p, keep] {
            a.deallocate(b, size, Stream::PER_THREAD).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 1);
    }
}
