//! Twentieth session's attack on checkpoints of CUDA graph pools (`src/graph_pool.rs`, "A
//! checkpoint restores a pool's live blocks"; `Allocator::graph_pool_checkpoint`,
//! `graph_pool_restore`, `graph_pool_restore_within`), on the simulated device.
//!
//! helper-20 wrote it; the three tests it found failing (a restore forgot the fences a live
//! block was taken behind, twice; pass-through mode did not count a refused free of a graph
//! block) pass since their mends. The oracles: the host device's race checker (unordered overlapping work
//! on two streams, and an event recorded or waited on a capturing stream, are violations), the
//! pool's live blocks and checkpoints, `stats()`, `check_invariants()`, `within` (a deadlock is
//! a failure) and `assert_all_returned`.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use common::{host, rng, small, within};
use cuarena::{Allocator, DeviceAddr, Error, GraphCheckpoint, GraphPoolId, InvalidFree, Stream};
use cuarena_testkit::{HookedDevice, Hooks, HostDevice, Stall, assert_all_returned, host_allocator};

const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Helpers.

/// The checkpoint's blocks as (address, bytes).
fn blocks_of(c: &GraphCheckpoint) -> Vec<(u64, usize)> {
    c.blocks().map(|(a, l)| (a.0, l)).collect()
}

/// The pool's live blocks, by address.
fn live(a: &Allocator, pool: GraphPoolId) -> Vec<u64> {
    a.graph_pool_live(pool).unwrap().into_iter().map(|p| p.0).collect()
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

fn assert_clean(dev: &HostDevice) {
    let v = dev.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(dev.tag_errors(), 0, "tag errors");
}

/// Frees every block live in `pool` now (their sizes from a checkpoint), on `s`.
fn free_live(a: &Allocator, pool: GraphPoolId, s: Stream) {
    let c = a.graph_pool_checkpoint(pool).unwrap();
    for (p, l) in c.blocks() {
        a.deallocate(p, l, s).unwrap();
    }
}

/// Counts an `InvalidFree` refusal; any other error is a failure.
fn tolerate(r: cuarena::Result<()>, bad: &AtomicU64) {
    match r {
        Ok(()) => {}
        Err(Error::InvalidFree { .. }) => {
            bad.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => panic!("a free failed otherwise than as invalid: {e}"),
    }
}

/// A pool with one 2 MiB segment filled by `x` (8 KiB, at its base) and `fill` (the rest), both
/// allocated on `s` outside a capture: no fresh memory is left, so the next 8 KiB request of
/// another stream must take `x`'s memory once `x` is freed.
fn full_segment(a: &Allocator, pool: GraphPoolId, s: Stream) -> (DeviceAddr, DeviceAddr) {
    let before = a.graph_pool_bytes();
    let x = a.graph_allocate(pool, 8192, s).unwrap();
    let fill = a.graph_allocate(pool, 2 * MIB - 8192, s).unwrap();
    assert_eq!(a.graph_pool_bytes() - before, 2 * MIB as u64, "one segment");
    assert_eq!(fill.0, x.0 + 8192);
    (x, fill)
}

// =============================================================================================
// Defects helper-20 found (each failed before its mend; mended by keeping, per live block, the
// fences it was taken behind: `Pool::behind` in src/graph_pool.rs).

// DEFECT (mended): a block allocated outside a capture on stream s2 out of memory that stream s1 freed
// outside a capture is handed out behind an on-device wait only (`Pool::take`'s `ready`:
// `FenceSet::order_before` makes s2 wait on s1's fence); the pool then forgets that fence (a live
// block carries none). A restore frees that block as `Reuse::Fresh` (`Pool::apply_restore`)
// and checks pending fences only on *free* ranges (`Pool::plan_restore`), so s1's running work
// on the memory is ordered before nothing: the freed memory goes, with no wait and no query, to
// the next allocation of any stream, here a capture on s3 (the module's rule: "an allocation
// during a capture only once the fence is known or queried complete"). The caller broke no
// contract: the block the restore freed was never used, so "every earlier use of the blocks it
// frees" is trivially ordered; s1's work belongs to s1's free, which the free's contract covers
// and the allocator must order. Without the restore the same capture does not get the memory
// (checked below first: s2's free of it carries s2's fence, which follows s1's).
#[test]
fn a_restore_keeps_the_fence_a_live_block_was_taken_behind() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2, s3) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
    let (control, pool) = (GraphPoolId(2000, 0), GraphPoolId(2000, 1));
    a.graph_pool_retain(control);
    a.graph_pool_retain(pool);
    let empty = a.graph_pool_checkpoint(pool).unwrap();
    let (cx, cfill) = full_segment(&a, control, s1);
    let (x, fill) = full_segment(&a, pool, s1);
    let gate = dev.gate(s1).unwrap();
    for p in [cx, x] {
        dev.hold_and_check(p.0, 8192, 0x7171, Duration::from_millis(1), s1).unwrap();
        a.deallocate(p, 8192, s1).unwrap();
    }

    // Control, no restore: s2 takes cx behind a wait on s1's fence, frees it (its fence follows
    // s1's), and a capture on s3 does not get cx's memory while s1's work runs.
    let l = a.graph_allocate(control, 8192, s2).unwrap();
    assert_eq!(l, cx, "s2 took s1's free (behind a wait)");
    a.deallocate(l, 8192, s2).unwrap();
    dev.begin_capture(s3).unwrap();
    let c = a.graph_allocate(control, 8192, s3).unwrap();
    assert!(!overlaps((c.0, 8192), (cx.0, 8192)), "control: the capture got memory under s1's work");
    a.deallocate(c, 8192, s3).unwrap();
    dev.end_capture(s3).unwrap();

    // The same with a restore in between: s2 takes x behind a wait, never uses it, and a
    // restore (to the empty checkpoint) frees it with the rest.
    let l = a.graph_allocate(pool, 8192, s2).unwrap();
    assert_eq!(l, x);
    // While a capture is underway the restore would have to wait on the host: refused.
    a.graph_capture_begin();
    assert!(matches!(a.graph_pool_restore(&empty), Err(Error::Unsupported(_))));
    a.graph_capture_end().unwrap();
    // Otherwise it waits for s1's work: the gate opens a little later.
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        gate.open();
    });
    let freed = a.graph_pool_restore(&empty).unwrap();
    opener.join().unwrap();
    assert_eq!(freed, vec![(x, 8192), (fill, 2 * MIB - 8192)]);
    dev.begin_capture(s3).unwrap();
    let y = a.graph_allocate(pool, 8192, s3).unwrap();
    dev.write_tag(y.0, 8192, 0x7373, s3).unwrap(); // the capture's kernel writes its block
    let v = dev.violations();
    a.deallocate(y, 8192, s3).unwrap();
    dev.end_capture(s3).unwrap();
    dev.synchronize();
    a.deallocate(cfill, 2 * MIB - 8192, s1).unwrap();
    a.graph_pool_release(control).unwrap();
    a.graph_pool_release(pool).unwrap();
    // The restore waited for s1's work, so the capture may get x's memory now, race-free.
    assert!(
        v.is_empty(),
        "a capture after the restore got memory under s1's running work: {y:?} vs {x:?}: {v:?}"
    );
    assert_all_returned(&a, Some(&dev), 0);
}

// DEFECT (mended; the same root as above, seen through a restored block): the checkpoint holds x; x is
// freed on s1 with work still running and taken by s2 behind an on-device wait; the restore
// frees s2's block and makes x live again at once, with no wait, though the module's rule says
// "a block made live again over memory another stream freed outside a capture waits for that
// free's fences first". A write on s3 to the restored block then races s1's running work.
#[test]
fn a_restored_block_waits_for_a_free_whose_memory_a_live_block_of_another_stream_took() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2, s3) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(2000, 2);
    a.graph_pool_retain(pool);
    let (x, fill) = full_segment(&a, pool, s1);
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 8192, 0x7171, Duration::from_millis(1), s1).unwrap();
    a.deallocate(x, 8192, s1).unwrap();
    let l = a.graph_allocate(pool, 8192, s2).unwrap();
    assert_eq!(l, x, "s2 took s1's free (behind a wait)");
    let polls = a.stats().fence_polls + a.stats().host_syncs;
    // The restore waits on the host for s1's work: the gate opens a little later.
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        gate.open();
    });
    a.graph_pool_restore(&c).unwrap();
    opener.join().unwrap();
    let asked = a.stats().fence_polls + a.stats().host_syncs > polls;
    assert_eq!(live(&a, pool), vec![x.0, fill.0]);
    dev.write_tag(x.0, 8192, 0x7272, s3).unwrap();
    let v = dev.violations();
    dev.synchronize();
    for (p, n) in [(x, 8192), (fill, 2 * MIB - 8192)] {
        a.deallocate(p, n, s3).unwrap();
    }
    a.graph_pool_release(pool).unwrap();
    assert!(asked, "the restore asked no fence");
    assert!(
        v.is_empty(),
        "the restored block was written under s1's running work (fence asked: {asked}): {v:?}"
    );
    assert_all_returned(&a, Some(&dev), 0);
}

/// Waits on the host until the work queued on `stream` so far has run.
fn drain(dev: &HostDevice, stream: Stream) {
    use cuarena::Device;
    let e = dev.create_event().unwrap();
    dev.record_event(e, stream).unwrap();
    dev.sync_event(e).unwrap();
    dev.destroy_event(e);
}

// =============================================================================================
// Properties that hold.

/// Memory freed outside a capture on three streams, each with work held back by a gate, under
/// one restored block: the restore returns only once every one of those streams' work is done
/// (the gates are opened one by one, after the restore starts), and a fourth stream then writes
/// the block with no race; with a capture underway it is refused instead, changing nothing.
/// Memory that only touches the restored block (the blocks just below and just above it, freed
/// on a fifth stream whose work is held back) is not waited for: a restore goes through while
/// a capture is underway.
#[test]
fn a_restore_waits_for_every_stream_that_freed_memory_under_its_blocks_and_only_those() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s: Vec<Stream> = (0..5).map(|_| dev.create_stream()).collect();
    let pool = GraphPoolId(2001, 0);
    a.graph_pool_retain(pool);
    let lo = a.graph_allocate(pool, 64 << 10, s[4]).unwrap();
    let big = a.graph_allocate(pool, 192 << 10, s[4]).unwrap();
    let hi = a.graph_allocate(pool, 64 << 10, s[4]).unwrap();
    assert_eq!((big.0 - lo.0, hi.0 - big.0), (64 << 10, 192 << 10));
    let c_all = a.graph_pool_checkpoint(pool).unwrap();
    // The neighbours: freed on s[4] with work held back.
    let outer_gate = dev.gate(s[4]).unwrap();
    for p in [lo, hi] {
        dev.hold_and_check(p.0, 64 << 10, 0x4444, Duration::from_millis(1), s[4]).unwrap();
        a.deallocate(p, 64 << 10, s[4]).unwrap();
    }
    let c = a.graph_pool_checkpoint(pool).unwrap();
    assert_eq!(blocks_of(&c), vec![(big.0, 192 << 10)]);
    // `big`'s memory as three blocks of s[0] (own-stream reuse of its free).
    let thirds = |a: &Allocator| -> Vec<DeviceAddr> {
        a.deallocate(big, 192 << 10, s[0]).unwrap();
        let mid: Vec<DeviceAddr> = (0..3).map(|_| a.graph_allocate(pool, 64 << 10, s[0]).unwrap()).collect();
        assert_eq!(
            mid.iter().map(|p| p.0).collect::<Vec<_>>(),
            (0..3).map(|i| big.0 + (i << 16)).collect::<Vec<_>>()
        );
        mid
    };
    thirds(&a);
    // The thirds were taken behind s[0]'s own fence (its free of `big`), which the restore
    // must see complete before it frees them: s[0]'s work is drained first. Then only the
    // neighbours are pending, and they are not under the restored block: a restore goes
    // through even with a capture underway.
    drain(&dev, s[0]);
    a.graph_capture_begin();
    let freed = a.graph_pool_restore(&c).unwrap();
    assert_eq!(freed.len(), 3, "the three thirds");
    assert_eq!(live(&a, pool), vec![big.0]);
    a.graph_capture_end().unwrap();

    // The thirds again, freed on s[1], s[2], s[3], each behind its own gate.
    let mid = thirds(&a);
    let gates: Vec<_> = (1..4).map(|i| dev.gate(s[i]).unwrap()).collect();
    for (i, p) in mid.iter().enumerate() {
        dev.hold_and_check(p.0, 64 << 10, 0x5000 + i as u32, Duration::from_millis(1), s[i + 1]).unwrap();
        a.deallocate(*p, 64 << 10, s[i + 1]).unwrap();
    }
    // With a capture underway the restore must refuse (it would wait on the host).
    a.graph_capture_begin();
    let before = a.stats();
    assert!(
        matches!(a.graph_pool_restore(&c), Err(Error::Unsupported(m)) if m.contains("capture is underway"))
    );
    assert!(live(&a, pool).is_empty(), "a refused restore changed the pool");
    let after = a.stats();
    assert_eq!((after.allocations, after.deallocations), (before.allocations, before.deallocations));
    a.graph_capture_end().unwrap();

    let done = Arc::new(AtomicU64::new(0));
    let opener = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            for g in gates {
                std::thread::sleep(Duration::from_millis(20));
                done.fetch_add(1, Ordering::SeqCst);
                g.open();
            }
        })
    };
    let freed = a.graph_pool_restore(&c).unwrap();
    let opened = done.load(Ordering::SeqCst);
    assert!(freed.is_empty());
    assert_eq!(opened, 3, "the restore returned before every freeing stream's work was let run");
    opener.join().unwrap();
    assert_eq!(live(&a, pool), vec![big.0]);
    dev.write_tag(big.0, 192 << 10, 0x6666, s[0]).unwrap();
    assert_clean(&dev);
    // Back to all three: lo and hi wait for s[4] (opened later, from another thread).
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        outer_gate.open();
    });
    // `big`'s use on s[0] is ordered before the pool's next use (the contract): synchronised
    // by the test after s[4]'s gate opens.
    assert_eq!(a.graph_pool_restore(&c_all).unwrap(), vec![(big, 192 << 10)]);
    opener.join().unwrap();
    dev.synchronize();
    for (p, t) in [(lo, 0x6767), (hi, 0x6868)] {
        dev.write_tag(p.0, 64 << 10, t, s[0]).unwrap();
    }
    dev.synchronize();
    assert_clean(&dev);
    for (p, n) in [(lo, 64 << 10), (big, 192 << 10), (hi, 64 << 10)] {
        a.deallocate(p, n, s[0]).unwrap();
    }
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A checkpoint taken in a one-segment pool, restored after the pool grew two more segments
/// (a 20 MiB one and a 16 MiB one): the blocks in the new segments are freed, the segments stay
/// with the pool (nothing leaves a retained pool) and serve later requests; statistics are
/// exact after each restore; all memory comes back once the pool is released.
#[test]
fn a_restore_after_the_pool_grew_frees_the_new_segments_blocks_and_keeps_the_segments() {
    let dev = host(5);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(2002, 0);
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    let first = a.graph_allocate(pool, 100_000, s).unwrap();
    dev.end_capture(s).unwrap();
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let base = a.stats();
    dev.begin_capture(s).unwrap();
    let mid = a.graph_allocate(pool, 5 * MIB, s).unwrap();
    let big = a.graph_allocate(pool, 16 * MIB, s).unwrap();
    dev.end_capture(s).unwrap();
    let bytes = a.graph_pool_bytes();
    assert_eq!(bytes, (2 + 20 + 16) as u64 * MIB as u64);
    let freed = a.graph_pool_restore(&c).unwrap();
    let mut want = vec![(first, 100_352), (mid, 5 * MIB), (big, 16 * MIB)];
    want.sort_unstable();
    assert_eq!(freed, want);
    assert_eq!(live(&a, pool), vec![first.0]);
    assert_eq!(a.graph_pool_bytes(), bytes, "a retained pool keeps its segments");
    let st = a.stats();
    assert_eq!(st.live_bytes, base.live_bytes, "live bytes back to the checkpoint's");
    assert_eq!(st.allocations - st.deallocations, base.allocations - base.deallocations);
    a.check_invariants();
    // The new segments serve again, with no growth; the restored block is never handed out.
    dev.begin_capture(s).unwrap();
    let again = a.graph_allocate(pool, 16 * MIB, s).unwrap();
    let more = a.graph_allocate(pool, 15 * MIB, s).unwrap();
    dev.end_capture(s).unwrap();
    assert_eq!(a.graph_pool_bytes(), bytes, "no growth");
    for p in [(again.0, 16 * MIB as u64), (more.0, 15 * MIB as u64)] {
        assert!(!overlaps(p, (first.0, 100_352)));
    }
    assert!(!overlaps((again.0, 16 << 20), (more.0, 15 << 20)));
    a.graph_pool_restore(&c).unwrap();
    assert_eq!(a.stats().live_bytes, base.live_bytes);
    a.deallocate(first, 100_000, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Incarnations. A pool released while a block lives is kept (not made again): retained once
/// more, it takes its old checkpoint. While released (retained 0, a block live) a checkpoint and
/// a restore are refused and change nothing. A pool that retired and is made again under the
/// same id refuses every checkpoint of the earlier one; so does a pool of the same id in another
/// allocator.
#[test]
fn checkpoints_follow_the_pools_incarnation_through_releases_and_re_retains() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(2003, 0);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 4096, s).unwrap();
    let y = a.graph_allocate(pool, 4096, s).unwrap();
    let cx = a.graph_pool_checkpoint(pool).unwrap();
    a.graph_pool_release(pool).unwrap(); // x and y live: kept
    let before = a.stats();
    assert!(matches!(a.graph_pool_checkpoint(pool), Err(Error::UnknownGraphPool { .. })));
    assert!(matches!(a.graph_pool_restore(&cx), Err(Error::UnknownGraphPool { .. })));
    assert!(matches!(a.graph_pool_restore_within(&cx, 0), Err(Error::UnknownGraphPool { .. })));
    let after = a.stats();
    assert_eq!((after.allocations, after.deallocations), (before.allocations, before.deallocations));
    a.deallocate(y, 4096, s).unwrap(); // the released pool still frees
    a.graph_pool_retain(pool); // revived, the same incarnation
    assert_eq!(a.graph_pool_restore(&cx).unwrap(), vec![(x, 4096)]);
    assert_eq!(live(&a, pool), vec![x.0, y.0], "y made live again at its address");
    a.check_invariants();
    for p in [x, y] {
        a.deallocate(p, 4096, s).unwrap();
    }
    a.graph_pool_release(pool).unwrap(); // retires: nothing live
    assert!(matches!(a.graph_pool_restore(&cx), Err(Error::UnknownGraphPool { .. })));
    a.graph_pool_retain(pool); // made again
    let z = a.graph_allocate(pool, 4096, s).unwrap();
    let cz = a.graph_pool_checkpoint(pool).unwrap();
    assert_ne!(cx, cz);
    assert!(matches!(a.graph_pool_restore(&cx), Err(Error::Unsupported(m)) if m.contains("made again")));
    assert_eq!(live(&a, pool), vec![z.0]);

    // Another allocator on the same device, with a pool of the same id and the same history.
    let b = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    b.graph_pool_retain(pool);
    let w = b.graph_allocate(pool, 4096, s).unwrap();
    assert!(b.graph_pool_restore(&cz).is_err(), "another allocator took this one's checkpoint");
    assert_eq!(b.graph_pool_live(pool).unwrap(), vec![w]);
    b.deallocate(w, 4096, s).unwrap();
    b.graph_pool_release(pool).unwrap();
    assert_all_returned(&b, None, 0);
    drop(b);

    a.deallocate(z, 4096, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Bad frees around a restore, each refused with the right reason, counted, and changing
/// nothing: a block the restore freed (a double free); stale blocks that lay inside a restored
/// block's memory (its base with their size: a wrong size; an interior one: an unknown
/// pointer); a restored block with a wrong size; an interior pointer of a restored block; a
/// restored block freed twice. A restored block's size is its checkpointed size in bytes: any
/// size that rounds up to it frees it.
#[test]
fn bad_frees_of_restored_and_restore_freed_blocks_are_refused_and_counted() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(2004, 0);
    a.graph_pool_retain(pool);
    let keep = a.graph_allocate(pool, 10_000, s).unwrap(); // 10_240 bytes
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let gone = a.graph_allocate(pool, 3000, s).unwrap(); // fresh memory above keep
    a.deallocate(keep, 10_000, s).unwrap();
    let inner: Vec<DeviceAddr> = (0..2).map(|_| a.graph_allocate(pool, 3000, s).unwrap()).collect();
    assert_eq!(inner, vec![keep, DeviceAddr(keep.0 + 3072)], "own-stream reuse of keep's memory");
    let freed = a.graph_pool_restore(&c).unwrap();
    assert_eq!(freed, vec![(inner[0], 3072), (inner[1], 3072), (gone, 3072)]);
    let reason = |r: cuarena::Result<()>| match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        r => panic!("not refused: {r:?}"),
    };
    let st0 = a.stats();
    assert_eq!(reason(a.deallocate(gone, 3000, s)), InvalidFree::DoubleFree);
    assert!(matches!(
        reason(a.deallocate(inner[0], 3000, s)),
        InvalidFree::SizeMismatch { allocated: 10_240, given: 3000 }
    ));
    assert_eq!(reason(a.deallocate(inner[1], 3000, s)), InvalidFree::UnknownPointer);
    assert!(matches!(reason(a.deallocate(keep, 20_000, s)), InvalidFree::SizeMismatch { .. }));
    assert!(matches!(reason(a.deallocate(keep, 9_000, s)), InvalidFree::SizeMismatch { .. }));
    assert_eq!(reason(a.deallocate(DeviceAddr(keep.0 + 512), 512, s)), InvalidFree::UnknownPointer);
    assert_eq!(
        reason(a.deallocate_used_on(DeviceAddr(keep.0 + 4096), 512, s, &[Stream::LEGACY])),
        InvalidFree::UnknownPointer
    );
    let mut bad = 7;
    let st1 = a.stats();
    assert_eq!(st1.invalid_frees - st0.invalid_frees, bad);
    assert_eq!(
        (st1.live_bytes, st1.deallocations),
        (st0.live_bytes, st0.deallocations),
        "a refused free changed the stats"
    );
    assert_eq!(live(&a, pool), vec![keep.0]);
    a.deallocate(keep, 9_729, s).unwrap(); // rounds up to 10_240
    assert_eq!(reason(a.deallocate(keep, 10_000, s)), InvalidFree::DoubleFree);
    bad += 1;
    assert!(live(&a, pool).is_empty());
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), bad);
}

/// `graph_pool_restore_within` with too little room changes nothing: no block freed or made
/// live, no statistic moved, no fence asked or waited for (even with one pending under a
/// restored block), and it reports how many blocks are live. Room for exactly that many works.
/// Room 0 on a pool with nothing live works too.
#[test]
fn a_restore_with_too_little_room_changes_nothing_at_all() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(2005, 0);
    a.graph_pool_retain(pool);
    let empty = a.graph_pool_checkpoint(pool).unwrap();
    assert_eq!(a.graph_pool_restore_within(&empty, 0).unwrap(), Ok(vec![]));
    let x = a.graph_allocate(pool, 4096, s1).unwrap();
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 4096, 0x1234, Duration::from_millis(1), s1).unwrap();
    a.deallocate(x, 4096, s1).unwrap(); // pending under the checkpoint's block
    let ys: Vec<DeviceAddr> = (0..3).map(|_| a.graph_allocate(pool, 4096, s2).unwrap()).collect();
    let before = a.stats();
    let live0 = live(&a, pool);
    for room in [0, 1, 2] {
        assert_eq!(a.graph_pool_restore_within(&c, room).unwrap(), Err(3));
    }
    let after = a.stats();
    assert_eq!(live(&a, pool), live0);
    assert_eq!(
        (
            after.allocations,
            after.deallocations,
            after.live_bytes,
            after.fence_polls,
            after.host_syncs,
            after.fence_waits
        ),
        (
            before.allocations,
            before.deallocations,
            before.live_bytes,
            before.fence_polls,
            before.host_syncs,
            before.fence_waits
        ),
        "a restore refused for room changed something"
    );
    a.check_invariants();
    gate.open();
    let freed = a.graph_pool_restore_within(&c, 3).unwrap().unwrap();
    assert_eq!(freed.iter().map(|&(p, _)| p).collect::<Vec<_>>(), ys);
    assert_eq!(live(&a, pool), vec![x.0]);
    a.deallocate(x, 4096, s2).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A pool's live blocks as a test knows them: address -> (size asked, bytes, stream index).
type Model = BTreeMap<u64, (usize, u64, usize)>;

/// Restores of random checkpoints on a pool whose blocks come and go on three streams, inside
/// and outside captures, with `stats=exact`: after each restore the pool's live blocks are the
/// checkpoint's, `live_bytes` is exactly the live blocks' bytes, `allocations - deallocations`
/// their number, the exact peak never drops below the live bytes, and `check_invariants` holds;
/// no write on any stream ever races (every block is written on the stream it was allocated
/// for, and freed there; restored blocks are written on the stream the checkpoint's block had).
#[test]
fn statistics_stay_exact_through_many_restores() {
    let dev = host(10);
    let a = host_allocator(dev.clone(), small().exact_stats(true).build().unwrap()).unwrap();
    let streams = [dev.create_stream(), dev.create_stream(), dev.create_stream()];
    let pool = GraphPoolId(2006, 0);
    a.graph_pool_retain(pool);
    let mut model: Model = BTreeMap::new();
    let mut cps: Vec<(GraphCheckpoint, Model)> = Vec::new();
    let mut x = 0x5eed_1234_u64;
    for step in 0..300 {
        let si = (rng(&mut x) % 3) as usize;
        let s = streams[si];
        let capture = rng(&mut x).is_multiple_of(2);
        if capture {
            dev.begin_capture(s).unwrap();
        }
        for _ in 0..(1 + rng(&mut x) % 5) {
            if rng(&mut x).is_multiple_of(2) || model.is_empty() {
                let n = 1 + (rng(&mut x) % (1 << 18)) as usize;
                let p = a.graph_allocate(pool, n, s).unwrap();
                dev.write_tag(p.0, 256, step, s).unwrap();
                model.insert(p.0, (n, n.next_multiple_of(512) as u64, si));
            } else {
                // Freed on its own stream: any block, in or out of a capture of that stream.
                let k = rng(&mut x) as usize % model.len();
                let (&q, &(n, _, qs)) = model.iter().nth(k).unwrap();
                if qs == si {
                    a.deallocate(DeviceAddr(q), n, s).unwrap();
                    model.remove(&q);
                }
            }
        }
        if capture {
            dev.end_capture(s).unwrap();
        }
        match rng(&mut x) % 4 {
            0 => cps.push((a.graph_pool_checkpoint(pool).unwrap(), model.clone())),
            1 if !cps.is_empty() => {
                let (c, m) = &cps[rng(&mut x) as usize % cps.len()];
                // Every block the restore frees is ordered before the pool's next use: the
                // caller waits for the streams (the contract).
                dev.synchronize();
                let freed = a.graph_pool_restore(c).unwrap();
                assert_eq!(freed.len(), model.len(), "step {step}");
                model = m.clone();
                assert_eq!(live(&a, pool), model.keys().copied().collect::<Vec<_>>(), "step {step}");
                let st = a.stats();
                let bytes: u64 = model.values().map(|v| v.1).sum();
                assert_eq!(st.live_bytes, bytes, "step {step}: {st:?}");
                assert_eq!(st.allocations - st.deallocations, model.len() as u64, "step {step}");
                assert!(
                    st.peak_live_bytes >= st.live_bytes && st.peak_live_bytes_upper >= st.peak_live_bytes
                );
                a.check_invariants();
            }
            _ => {}
        }
    }
    for (&q, &(n, _, qs)) in &model {
        a.deallocate(DeviceAddr(q), n, streams[qs]).unwrap();
    }
    assert_clean(&dev);
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A hundred thousand blocks: a checkpoint of them all, a restore that frees them all and makes
/// them all live again, one that frees them all for an empty checkpoint, and one from empty
/// back to all of them; each well under a second, the pool's invariants holding, every block
/// exactly in place, and all memory back at the end.
#[test]
fn a_hundred_thousand_blocks_restore_quickly_and_exactly() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(2007, 0);
    a.graph_pool_retain(pool);
    let empty = a.graph_pool_checkpoint(pool).unwrap();
    const N: usize = 100_000;
    dev.begin_capture(s).unwrap();
    let mut blocks: Vec<(DeviceAddr, usize)> = (0..N)
        .map(|i| {
            let n = 512 * (1 + i % 3);
            (a.graph_allocate(pool, n, s).unwrap(), n)
        })
        .collect();
    dev.end_capture(s).unwrap();
    blocks.sort_unstable();
    let all = a.graph_pool_checkpoint(pool).unwrap();
    assert_eq!(all.blocks().len(), N);
    assert_eq!(all.blocks().collect::<Vec<_>>(), blocks);
    for (c, n_freed) in [(&all, N), (&empty, N), (&all, 0), (&all, N)] {
        let t = Instant::now();
        let freed = a.graph_pool_restore(c).unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "a restore of {N} blocks took {:?}", t.elapsed());
        assert_eq!(freed.len(), n_freed);
    }
    assert_eq!(a.stats().allocations - a.stats().deallocations, N as u64);
    a.check_invariants();
    dev.begin_capture(s).unwrap();
    for &(p, n) in &blocks {
        a.deallocate(p, n, s).unwrap();
    }
    dev.end_capture(s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Restores of one pool racing, on two other threads, allocations and frees of the same pool
/// (in and out of captures of their own streams) and frees of blocks the restore may just have
/// freed: nothing panics or deadlocks, every restore succeeds, every refused free is an
/// `InvalidFree`, no event is ever recorded or waited on a capturing stream, the invariants hold
/// throughout, and the statistics and memory come out exact.
#[test]
fn restores_racing_allocations_frees_and_captures_of_the_same_pool_stay_consistent() {
    within(60, || {
        let dev = host(20);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let pool = GraphPoolId(2008, 0);
        a.graph_pool_retain(pool);
        let bad = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..2u64)
            .map(|w| {
                let (a, dev, bad, stop) = (a.clone(), dev.clone(), Arc::clone(&bad), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let s = dev.create_stream();
                    let mut x = 0x9e37_79b9 + w;
                    let mut held: Vec<(DeviceAddr, usize)> = Vec::new();
                    let mut rounds = 0;
                    while !stop.load(Ordering::Relaxed) || rounds < 50 {
                        rounds += 1;
                        let capture = rng(&mut x).is_multiple_of(2);
                        if capture {
                            dev.begin_capture(s).unwrap();
                        }
                        for _ in 0..8 {
                            if rng(&mut x).is_multiple_of(2) || held.is_empty() {
                                let n = 1 + (rng(&mut x) % (300 << 10)) as usize;
                                held.push((a.graph_allocate(pool, n, s).unwrap(), n));
                            } else {
                                let k = rng(&mut x) as usize % held.len();
                                let (p, n) = held.swap_remove(k);
                                tolerate(a.deallocate(p, n, s), &bad);
                            }
                        }
                        if capture {
                            dev.end_capture(s).unwrap();
                        }
                    }
                    for (p, n) in held {
                        tolerate(a.deallocate(p, n, s), &bad);
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        let mut cps: Vec<GraphCheckpoint> = Vec::new();
        let mut x = 77u64;
        for i in 0..300 {
            if rng(&mut x).is_multiple_of(2) || cps.is_empty() {
                cps.push(a.graph_pool_checkpoint(pool).unwrap());
            } else {
                let c = &cps[rng(&mut x) as usize % cps.len()];
                a.graph_pool_restore(c).unwrap();
            }
            if i % 25 == 0 {
                a.check_invariants();
            }
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        for h in workers {
            h.join().unwrap();
        }
        // What the restores left live: freed once, by address and checkpointed size.
        free_live(&a, pool, Stream::LEGACY);
        a.graph_pool_release(pool).unwrap();
        let bad = bad.load(Ordering::Relaxed);
        assert_all_returned(&a, Some(&dev), bad);
    });
}

/// Restores of pool P (whose blocks were freed on several streams with work still running)
/// racing threads that work eagerly and in another pool Q, with tags held and checked: the
/// restores never disturb another pool's or the eager path's memory (no race, no tag error),
/// and no restore ever hands out memory under running work.
#[test]
fn restores_of_one_pool_never_disturb_another_pools_or_eager_memory() {
    within(60, || {
        let dev = host(30);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let (p, q) = (GraphPoolId(2009, 0), GraphPoolId(2009, 1));
        a.graph_pool_retain(p);
        a.graph_pool_retain(q);
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..2u32)
            .map(|w| {
                let (a, dev, stop) = (a.clone(), dev.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let s = dev.create_stream();
                    let mut x = 0xabcdef + u64::from(w);
                    let mut rounds = 0u32;
                    while !stop.load(Ordering::Relaxed) || rounds < 30 {
                        rounds += 1;
                        let tag = (w << 24) | rounds;
                        let n = 1 + (rng(&mut x) % (200 << 10)) as usize;
                        let e = a.allocate(n, s).unwrap();
                        let g = a.graph_allocate(q, n, s).unwrap();
                        for b in [e, g] {
                            dev.hold_and_check(b.0, n.min(4096), tag, Duration::from_micros(200), s).unwrap();
                        }
                        a.deallocate(e, n, s).unwrap();
                        a.deallocate(g, n, s).unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        let sp: Vec<Stream> = (0..3).map(|_| dev.create_stream()).collect();
        let mut x = 99u64;
        // One block of P kept live throughout, in every checkpoint.
        let anchor = a.graph_allocate(p, 4096, sp[0]).unwrap();
        for round in 0..60u32 {
            // A few blocks in P, used and freed on random streams with work still running; a
            // restore back to them waits for that work, and a write on another stream after it
            // never races; then they are freed on that stream, and a restore back to before
            // them frees nothing.
            let c = a.graph_pool_checkpoint(p).unwrap();
            let mut mine = Vec::new();
            for i in 0..4 {
                let s = sp[(rng(&mut x) % 3) as usize];
                let n = 4096 * (1 + (rng(&mut x) % 16) as usize);
                let b = a.graph_allocate(p, n, s).unwrap();
                dev.hold_and_check(b.0, n, 0x0100_0000 | (round << 4) | i, Duration::from_micros(300), s)
                    .unwrap();
                mine.push((b, n, s));
            }
            let c2 = a.graph_pool_checkpoint(p).unwrap();
            for &(b, n, s) in &mine {
                a.deallocate(b, n, s).unwrap();
            }
            assert_eq!(a.graph_pool_restore(&c2).unwrap(), vec![(anchor, 4096)]);
            let w = sp[(rng(&mut x) % 3) as usize];
            for &(b, n, _) in &mine {
                dev.write_tag(b.0, n, 0x0200_0000 | round, w).unwrap();
                a.deallocate(b, n, w).unwrap();
            }
            assert_eq!(a.graph_pool_restore(&c).unwrap(), vec![(anchor, 4096)]);
        }
        a.deallocate(anchor, 4096, sp[0]).unwrap();
        stop.store(true, Ordering::Relaxed);
        for h in workers {
            h.join().unwrap();
        }
        assert_clean(&dev);
        for id in [p, q] {
            free_live(&a, id, Stream::LEGACY);
            a.graph_pool_release(id).unwrap();
        }
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// Checkpoints handed from a thread that retains, uses and releases a pool over and over (each
/// cycle a new incarnation) to a thread that restores them: each restore either succeeds (the
/// incarnation still lives) or is refused as a pool not retained or made again; the restored
/// blocks are freed by the restorer (a free the other thread's cycle made a double free is
/// refused and counted). Nothing panics or deadlocks, and everything comes back.
#[test]
fn restores_racing_releases_and_re_retains_of_the_same_pool_are_refused_or_exact() {
    within(60, || {
        let dev = host(5);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let pool = GraphPoolId(2010, 0);
        let bad = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::channel::<GraphCheckpoint>();
        let cycler = {
            let (a, dev, bad) = (a.clone(), dev.clone(), Arc::clone(&bad));
            std::thread::spawn(move || {
                let s = dev.create_stream();
                for i in 0..400 {
                    a.graph_pool_retain(pool);
                    let n = 512 * (1 + i % 7);
                    let x = a.graph_allocate(pool, n, s).unwrap();
                    let y = a.graph_allocate(pool, 4096, s).unwrap();
                    tx.send(a.graph_pool_checkpoint(pool).unwrap()).unwrap();
                    if i % 3 == 0 {
                        std::thread::yield_now();
                    }
                    tolerate(a.deallocate(x, n, s), &bad);
                    tolerate(a.deallocate(y, 4096, s), &bad);
                    a.graph_pool_release(pool).unwrap();
                }
                a.release_thread().unwrap();
            })
        };
        let (mut ok, mut refused) = (0, 0);
        for c in rx {
            match a.graph_pool_restore(&c) {
                Ok(_) => {
                    ok += 1;
                    for (p, l) in c.blocks() {
                        tolerate(a.deallocate(p, l, Stream::LEGACY), &bad);
                    }
                }
                Err(Error::UnknownGraphPool { .. }) => refused += 1,
                Err(Error::Unsupported(m)) if m.contains("made again") => refused += 1,
                Err(e) => panic!("unexpected refusal: {e}"),
            }
            if (ok + refused) % 50 == 0 {
                a.check_invariants();
            }
        }
        cycler.join().unwrap();
        assert_eq!(ok + refused, 400);
        // A pool revived by a restore whose blocks outlived the cycler's release is freed above;
        // nothing may be left retained.
        assert_eq!(a.graph_pool_use_count(pool), 0);
        assert!(a.graph_pool_live(pool).is_err());
        let bad = bad.load(Ordering::Relaxed);
        assert_all_returned(&a, Some(&dev), bad);
    });
}

/// A restore waiting on the host for another stream's work, while another thread frees the
/// pool's blocks and releases it (it retires), then makes a pool of the same id: the waiting
/// restore comes back refused (the pool it planned for is gone), changing nothing in the new
/// pool. A restore whose wait races a free of more memory under its block on yet another stream
/// waits for that too.
#[test]
fn a_restore_waiting_on_the_host_sees_a_release_or_a_new_free_made_meanwhile() {
    within(30, || {
        let dev = host(0);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let (s1, s2, s3) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
        let pool = GraphPoolId(2011, 0);
        a.graph_pool_retain(pool);
        let x = a.graph_allocate(pool, 8192, s1).unwrap();
        let c = a.graph_pool_checkpoint(pool).unwrap();
        let gate = dev.gate(s1).unwrap();
        dev.hold_and_check(x.0, 8192, 0x1, Duration::from_millis(1), s1).unwrap();
        a.deallocate(x, 8192, s1).unwrap();
        let restorer = {
            let a = a.clone();
            let c = c.clone();
            std::thread::spawn(move || {
                let r = a.graph_pool_restore(&c).map(|_| ());
                a.release_thread().unwrap();
                r
            })
        };
        std::thread::sleep(Duration::from_millis(30)); // the restorer waits on s1's fence
        a.graph_pool_release(pool).unwrap(); // retires: nothing live
        a.graph_pool_retain(pool); // made again
        let y = a.graph_allocate(pool, 4096, s2).unwrap();
        gate.open();
        let r = restorer.join().unwrap();
        assert!(
            matches!(&r, Err(Error::Unsupported(m)) if m.contains("made again"))
                || matches!(r, Err(Error::UnknownGraphPool { .. })),
            "{r:?}"
        );
        assert_eq!(live(&a, pool), vec![y.0]);
        a.deallocate(y, 4096, s2).unwrap();

        // Second part: the memory under the restored block freed again, on s3, while the
        // restore waits for s1.
        let x = a.graph_allocate(pool, 8192, s1).unwrap();
        let z = a.graph_allocate(pool, 8192, s1).unwrap();
        let c = a.graph_pool_checkpoint(pool).unwrap(); // x and z
        let g1 = dev.gate(s1).unwrap();
        dev.hold_and_check(x.0, 8192, 0x2, Duration::from_millis(1), s1).unwrap();
        a.deallocate(x, 8192, s1).unwrap();
        // z freed on s3 later, behind its own gate.
        let g3 = dev.gate(s3).unwrap();
        let restorer = {
            let a = a.clone();
            std::thread::spawn(move || {
                let r = a.graph_pool_restore(&c).map(|_| ());
                a.release_thread().unwrap();
                r
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        dev.hold_and_check(z.0, 8192, 0x3, Duration::from_millis(1), s3).unwrap();
        a.deallocate(z, 8192, s3).unwrap();
        g1.open();
        std::thread::sleep(Duration::from_millis(20));
        let s3_done = Arc::new(AtomicBool::new(false));
        let opener = {
            let s3_done = Arc::clone(&s3_done);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                s3_done.store(true, Ordering::SeqCst);
                g3.open();
            })
        };
        restorer.join().unwrap().unwrap();
        assert!(
            s3_done.load(Ordering::SeqCst),
            "the restore returned before s3's work (z's free) was let run"
        );
        dev.write_tag(x.0, 8192, 0x4, s2).unwrap();
        dev.write_tag(z.0, 8192, 0x5, s2).unwrap();
        opener.join().unwrap();
        dev.synchronize();
        assert_clean(&dev);
        free_live(&a, pool, s2);
        a.graph_pool_release(pool).unwrap();
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// A restore whose block's memory another thread keeps taking and freeing on its own stream
/// (with work each time, paced so that its stream keeps up) ends: it waits on the host, never
/// spins, and returns while the other thread still runs.
#[test]
fn a_restore_under_churn_of_its_memory_on_another_stream_ends() {
    within(30, || {
        let dev = host(20);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let s1 = dev.create_stream();
        let pool = GraphPoolId(2012, 0);
        a.graph_pool_retain(pool);
        let (x, fill) = full_segment(&a, pool, s1);
        let c = a.graph_pool_checkpoint(pool).unwrap();
        a.deallocate(x, 8192, s1).unwrap();
        a.deallocate(fill, 2 * MIB - 8192, s1).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let bad = Arc::new(AtomicU64::new(0));
        let churn = {
            let (a, dev, stop, bad) = (a.clone(), dev.clone(), Arc::clone(&stop), Arc::clone(&bad));
            std::thread::spawn(move || {
                let s2 = dev.create_stream();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let p = a.graph_allocate(pool, 8192, s2).unwrap();
                    dev.fill(p.0, 8192, 0x5a, s2).unwrap();
                    tolerate(a.deallocate(p, 8192, s2), &bad);
                    std::thread::sleep(Duration::from_micros(100));
                    n += 1;
                }
                a.release_thread().unwrap();
                n
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let t = Instant::now();
        let asked = a.stats().fence_polls + a.stats().host_syncs;
        for _ in 0..200 {
            a.graph_pool_restore(&c).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        let took = t.elapsed();
        let asked = a.stats().fence_polls + a.stats().host_syncs - asked;
        stop.store(true, Ordering::Relaxed);
        let rounds = churn.join().unwrap();
        assert!(rounds > 0 && asked > 0, "no churn met ({rounds} rounds, {asked} fences asked)");
        assert!(took < Duration::from_secs(10), "200 restores took {took:?} under churn ({rounds} rounds)");
        dev.synchronize();
        free_live(&a, pool, s1);
        a.graph_pool_release(pool).unwrap();
        let bad = bad.load(Ordering::Relaxed);
        assert_all_returned(&a, Some(&dev), bad);
    });
}

/// Held memory (declared used on another stream, freed during a capture) between restored
/// blocks: a checkpoint whose blocks are all clear of it restores; one with a block over it is
/// refused, changing nothing; the held memory is never handed out by a restore or after it.
#[test]
fn restores_work_around_held_memory_and_never_over_it() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s, other) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(2013, 0);
    a.graph_pool_retain(pool);
    let b: Vec<DeviceAddr> = (0..3).map(|_| a.graph_allocate(pool, 4096, s).unwrap()).collect();
    let all = a.graph_pool_checkpoint(pool).unwrap();
    dev.begin_capture(s).unwrap();
    a.deallocate_used_on(b[1], 4096, s, &[other]).unwrap(); // held
    dev.end_capture(s).unwrap();
    let around = a.graph_pool_checkpoint(pool).unwrap(); // b[0], b[2]
    assert!(matches!(a.graph_pool_restore(&all), Err(Error::Unsupported(m)) if m.contains("held")));
    assert_eq!(live(&a, pool), vec![b[0].0, b[2].0]);
    a.deallocate(b[0], 4096, s).unwrap();
    let freed = a.graph_pool_restore(&around).unwrap();
    assert_eq!(freed, vec![(b[2], 4096)]);
    assert_eq!(live(&a, pool), vec![b[0].0, b[2].0]);
    // Everything else of the segment, asked for in pieces: never the held block.
    dev.begin_capture(s).unwrap();
    let mut got = Vec::new();
    while a.graph_pool_bytes() == 2 * MIB as u64 {
        let p = a.graph_allocate(pool, 4096, s).unwrap();
        assert!(!overlaps((p.0, 4096), (b[1].0, 4096)), "held memory handed out");
        got.push(p);
    }
    for p in got {
        a.deallocate(p, 4096, s).unwrap();
    }
    dev.end_capture(s).unwrap();
    for p in [b[0], b[2]] {
        a.deallocate(p, 4096, s).unwrap();
    }
    assert!(matches!(
        a.deallocate(b[1], 4096, s),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 1);
}

/// Pass-through mode: checkpoints and restores work the same (the pool's blocks are the
/// pool's, outside pass-through statistics), and everything comes back.
#[test]
fn pass_through_mode_restores_exactly() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().passthrough(true).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(2014, 0);
    a.graph_pool_retain(pool);
    let e = a.allocate(4096, s).unwrap(); // a pass-through block alongside
    let x = a.graph_allocate(pool, 4096, s).unwrap();
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let y = a.graph_allocate(pool, 4096, s).unwrap();
    let before = a.stats();
    assert_eq!(a.graph_pool_restore(&c).unwrap(), vec![(x, 4096), (y, 4096)]);
    assert_eq!(live(&a, pool), vec![x.0]);
    let after = a.stats();
    assert_eq!(after.live_bytes, before.live_bytes, "pass-through statistics count no graph block");
    a.check_invariants();
    a.deallocate(x, 4096, s).unwrap();
    a.deallocate(e, 4096, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

// DEFECT (mended; minor; graph pools in pass-through mode, met through a restore): a refused free of a
// graph pool's block is counted in the freeing thread's counters (`free_graph`), but in
// pass-through mode `stats()` takes `invalid_frees` from the pass-through state only
// (`Allocator::stats`), so the refusal is counted nowhere the user can see; a double free of a
// block a restore freed (the common slip after a restore) goes unreported, and
// `assert_all_returned(.., 1)` fails. The ordinary mode counts it (test
// `bad_frees_of_restored_and_restore_freed_blocks_are_refused_and_counted`). Mended: the
// counters' `invalid_frees` are added into pass-through statistics, as `alloc_retries`, `ooms`
// and `oom_hook_calls` are.
#[test]
fn pass_through_mode_counts_a_double_free_of_a_restore_freed_block() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().passthrough(true).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(2014, 1);
    a.graph_pool_retain(pool);
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let y = a.graph_allocate(pool, 4096, s).unwrap();
    assert_eq!(a.graph_pool_restore(&c).unwrap(), vec![(y, 4096)]);
    assert!(matches!(
        a.deallocate(y, 4096, s),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    assert_eq!(a.stats().invalid_frees, 1, "the refused free is not counted");
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 1);
}

/// A free of a pool's block stopped in the middle (checked, its fence being recorded) while a
/// restore runs: the restore goes through (it does not wait for the free), and the free then
/// answers as if it came after the restore: refused as a double free when the checkpoint does
/// not hold the block, and freeing the block made live again when it does. Either way the
/// pool's invariants hold and the statistics come out exact.
#[test]
fn a_free_caught_mid_way_by_a_restore_lands_after_it() {
    within(30, || {
        let sim = host(0);
        // The stall of the round (one-shot each).
        let cell = Arc::new(Mutex::new(Stall::new()));
        let hook_cell = Arc::clone(&cell);
        let hooks = Hooks {
            record_event: Some(Box::new(move |sim: &HostDevice, e, s| {
                let stall = Arc::clone(&hook_cell.lock().unwrap());
                stall.here(true);
                cuarena::Device::record_event(sim, e, s)
            })),
            ..Hooks::default()
        };
        let a = Allocator::new(HookedDevice::new(sim.clone(), hooks), small().build().unwrap()).unwrap();
        let (sa, sb) = (sim.create_stream(), sim.create_stream());
        let pool = GraphPoolId(2015, 0);
        a.graph_pool_retain(pool);
        let y = a.graph_allocate(pool, 8192, sa).unwrap();
        let c0 = a.graph_pool_checkpoint(pool).unwrap(); // y
        for remade in [false, true] {
            let stall = Stall::new();
            *cell.lock().unwrap() = Arc::clone(&stall);
            let x = a.graph_allocate(pool, 8192, sa).unwrap();
            let c = if remade { a.graph_pool_checkpoint(pool).unwrap() } else { c0.clone() };
            let freer = {
                let (a, stall) = (a.clone(), Arc::clone(&stall));
                std::thread::spawn(move || {
                    stall.arm();
                    let r = a.deallocate(x, 8192, sb);
                    a.release_thread().unwrap();
                    r
                })
            };
            stall.wait_stalled();
            let freed = a.graph_pool_restore(&c).unwrap();
            assert!(freed.contains(&(x, 8192)), "{freed:?}");
            stall.release();
            let r = freer.join().unwrap();
            if remade {
                r.unwrap();
            } else {
                assert!(
                    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })),
                    "{r:?}"
                );
            }
            assert_eq!(live(&a, pool), vec![y.0]);
            a.check_invariants();
        }
        a.deallocate(y, 8192, sa).unwrap();
        a.graph_pool_release(pool).unwrap();
        assert_all_returned(&a, Some(&sim), 1);
    });
}
