//! Checkpoints of CUDA graph pools (`src/graph_pool.rs`, "A checkpoint restores a pool's live
//! blocks"; PyTorch's `getCheckpointState` and `setCheckpointPoolState`, which CUDA graph trees
//! use) on the simulated device: a restore frees every live block and makes exactly the
//! checkpoint's blocks live again at their addresses; memory it makes live again is never used
//! under another stream's pending work; later allocations never overlap the restored blocks;
//! and bad input is refused and changes nothing.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{host, rng, small};
use cuarena::{Allocator, DeviceAddr, Error, GraphCheckpoint, GraphPoolId, InvalidFree, Stream};
use cuarena_testkit::{assert_all_returned, host_allocator};

/// The checkpoint's blocks as (address, bytes).
fn blocks_of(c: &GraphCheckpoint) -> Vec<(u64, usize)> {
    c.blocks().map(|(a, l)| (a.0, l)).collect()
}

/// The pool's live blocks, by address.
fn live(a: &Allocator, pool: GraphPoolId) -> Vec<u64> {
    a.graph_pool_live(pool).unwrap().into_iter().map(|p| p.0).collect()
}

/// What a graph tree does: record A (one output kept), checkpoint; record B after A (A's
/// output freed inside B's capture, B's output kept), checkpoint; then go back to A's state to
/// record C after A. The restore frees B's output, makes A's output live again at its address,
/// and C's capture neither overlaps it nor misses the memory B's output freed.
#[test]
fn a_restore_frees_the_live_blocks_and_makes_the_checkpoints_blocks_live_again() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(40, 1);
    a.graph_pool_retain(pool);

    dev.begin_capture(s).unwrap();
    let tmp = a.graph_allocate(pool, 100_000, s).unwrap();
    let out_a = a.graph_allocate(pool, 5000, s).unwrap();
    a.deallocate(tmp, 100_000, s).unwrap();
    dev.end_capture(s).unwrap();
    let after_a = a.graph_pool_checkpoint(pool).unwrap();
    assert_eq!(after_a.pool(), pool);
    assert_eq!(blocks_of(&after_a), vec![(out_a.0, 5120)]);

    dev.begin_capture(s).unwrap();
    let out_b = a.graph_allocate(pool, 70_000, s).unwrap();
    a.deallocate(out_a, 5000, s).unwrap();
    dev.end_capture(s).unwrap();
    let after_b = a.graph_pool_checkpoint(pool).unwrap();
    assert_eq!(blocks_of(&after_b), vec![(out_b.0, 70_144)]);

    let before = a.stats();
    let freed = a.graph_pool_restore(&after_a).unwrap();
    assert_eq!(freed, vec![(out_b, 70_144)], "every block live at the restore is freed");
    assert_eq!(live(&a, pool), vec![out_a.0], "exactly the checkpoint's blocks are live");
    let after = a.stats();
    assert_eq!(after.deallocations - before.deallocations, 1);
    assert_eq!(after.allocations - before.allocations, 1);
    assert_eq!(after.live_bytes, before.live_bytes - 70_144 + 5120);
    a.check_invariants();

    // C, recorded after A: its blocks stay clear of A's output, and B's freed output serves.
    dev.begin_capture(s).unwrap();
    let c1 = a.graph_allocate(pool, 70_000, s).unwrap();
    let c2 = a.graph_allocate(pool, 5000, s).unwrap();
    for c in [(c1.0, 70_144u64), (c2.0, 5120)] {
        assert!(c.0 + c.1 <= out_a.0 || out_a.0 + 5120 <= c.0, "{c:?} overlaps the restored block");
    }
    assert_eq!(c1, out_b, "the memory the restore freed is reused");
    a.deallocate(c1, 70_000, s).unwrap();
    a.deallocate(c2, 5000, s).unwrap();
    dev.end_capture(s).unwrap();

    // Restoring twice is the same state; the restored block is freed as any block.
    assert_eq!(a.graph_pool_restore(&after_a).unwrap(), vec![(out_a, 5120)]);
    assert_eq!(live(&a, pool), vec![out_a.0]);
    assert!(matches!(
        a.deallocate(out_a, 9000, s),
        Err(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. })
    ));
    a.deallocate(out_a, 5000, s).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 1);
}

/// A block made live again over memory another stream freed outside a capture, with that
/// stream's work still running on it: the restore waits for the work first (its fence), so a
/// write on a third stream after the restore never lands under it. With a capture underway
/// the restore refuses instead of waiting on the host, and changes nothing.
#[test]
fn a_restored_block_waits_for_the_work_of_the_stream_that_freed_it() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(41, 0);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 8192, s1).unwrap(); // outside a capture (a warm-up)
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 8192, 0x7171, Duration::from_millis(2), s1).unwrap();
    a.deallocate(x, 8192, s1).unwrap(); // its fence waits behind the gate

    a.graph_capture_begin();
    match a.graph_pool_restore(&c) {
        Err(Error::Unsupported(m)) => assert!(m.contains("capture is underway"), "{m}"),
        r => panic!("a restore that would wait on the host during a capture: {r:?}"),
    }
    assert!(live(&a, pool).is_empty(), "a refused restore changed the pool");
    a.graph_capture_end().unwrap();

    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        gate.open();
    });
    let waits = a.stats().host_syncs + a.stats().fence_polls;
    assert!(a.graph_pool_restore(&c).unwrap().is_empty());
    opener.join().unwrap();
    assert!(a.stats().host_syncs + a.stats().fence_polls > waits, "the restore asked no fence");
    assert_eq!(live(&a, pool), vec![x.0]);
    dev.write_tag(x.0, 8192, 0x7272, s2).unwrap();
    dev.synchronize();
    assert_eq!(dev.tag_errors(), 0, "the restored block was written under s1's running work");
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.deallocate(x, 8192, s2).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// The same over a capture's free: a block taken outside a capture from s1's free (behind a
/// wait on its fence only), then freed during a capture, keeps s1's fence; a restore that
/// makes the block live again waits for s1's work before a third stream writes it.
#[test]
fn a_restored_block_waits_for_the_fence_a_captures_free_kept() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2, s3) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(41, 1);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 8192, s1).unwrap();
    let fill = a.graph_allocate(pool, (2 << 20) - 8192, s1).unwrap(); // the segment full
    assert_eq!(fill.0, x.0 + 8192);
    let c = a.graph_pool_checkpoint(pool).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 8192, 0x4141, Duration::from_millis(2), s1).unwrap();
    a.deallocate(x, 8192, s1).unwrap(); // its fence waits behind the gate
    let l = a.graph_allocate(pool, 8192, s2).unwrap();
    assert_eq!(l, x, "s2 took s1's free behind a wait");
    dev.begin_capture(s2).unwrap();
    a.deallocate(l, 8192, s2).unwrap(); // a capture's free
    dev.end_capture(s2).unwrap();

    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        gate.open();
    });
    let waits = a.stats().host_syncs + a.stats().fence_polls;
    assert_eq!(a.graph_pool_restore(&c).unwrap(), vec![(fill, (2 << 20) - 8192)]);
    opener.join().unwrap();
    let asked = a.stats().host_syncs + a.stats().fence_polls > waits;
    assert_eq!(live(&a, pool), vec![x.0, fill.0]);
    dev.write_tag(x.0, 8192, 0x4343, s3).unwrap();
    let v = dev.violations();
    dev.synchronize();
    a.deallocate(x, 8192, s3).unwrap();
    a.deallocate(fill, (2 << 20) - 8192, s3).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(asked, "the restore asked no fence");
    assert!(v.is_empty(), "the restored block was written under s1's running work: {v:?}");
    assert_eq!(dev.tag_errors(), 0);
    assert_all_returned(&a, Some(&dev), 0);
}

/// Bad input, each refused with a clear error and changing nothing: a checkpoint of a pool not
/// retained; a restore of a released pool; a restore of a checkpoint taken of an earlier
/// incarnation of the pool's id; a restore over memory held for another stream; a restore
/// with too little room to report the blocks it frees.
#[test]
fn bad_checkpoints_and_restores_are_refused_and_change_nothing() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s, other) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(42, 0);
    assert!(matches!(a.graph_pool_checkpoint(pool), Err(Error::UnknownGraphPool { id: (42, 0) })));

    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 4096, s).unwrap();
    let old = a.graph_pool_checkpoint(pool).unwrap();
    a.deallocate(x, 4096, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(matches!(a.graph_pool_restore(&old), Err(Error::UnknownGraphPool { .. })));
    a.graph_pool_retain(pool); // the same id, made again
    let y = a.graph_allocate(pool, 4096, s).unwrap();
    match a.graph_pool_restore(&old) {
        Err(Error::Unsupported(m)) => assert!(m.contains("made again"), "{m}"),
        r => panic!("a checkpoint of an earlier incarnation was restored: {r:?}"),
    }
    assert_eq!(live(&a, pool), vec![y.0]);

    // Held memory: declared used on another stream and freed during a capture.
    let c = a.graph_pool_checkpoint(pool).unwrap();
    dev.begin_capture(s).unwrap();
    a.deallocate_used_on(y, 4096, s, &[other]).unwrap();
    dev.end_capture(s).unwrap();
    let z = a.graph_allocate(pool, 4096, s).unwrap();
    match a.graph_pool_restore(&c) {
        Err(Error::Unsupported(m)) => assert!(m.contains("held"), "{m}"),
        r => panic!("a restore over held memory: {r:?}"),
    }
    assert_eq!(live(&a, pool), vec![z.0]);

    // Too little room: nothing freed, the number needed reported.
    let w = a.graph_allocate(pool, 4096, s).unwrap();
    let cz = a.graph_pool_checkpoint(pool).unwrap();
    assert_eq!(a.graph_pool_restore_within(&cz, 1).unwrap(), Err(2));
    let mut both = live(&a, pool);
    both.sort_unstable();
    let mut want = vec![z.0, w.0];
    want.sort_unstable();
    assert_eq!(both, want);
    assert_eq!(a.graph_pool_restore_within(&cz, 2).unwrap().unwrap().len(), 2);
    a.check_invariants();
    for p in [z, w] {
        a.deallocate(p, 4096, s).unwrap();
    }
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.graph_pool_release(pool).unwrap();
    dev.synchronize();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A pool's live blocks as the test knows them: address → (size asked, bytes).
type Model = BTreeMap<u64, (usize, u64)>;

/// Random graph trees: captures on two streams and warm-ups outside a capture allocate and free
/// in one pool, checkpoints are taken, and restores go back to random earlier checkpoints.
/// After every restore the pool's live blocks are exactly the checkpoint's; live blocks never
/// overlap; every block is 512-byte aligned; and all memory comes back at the end.
#[test]
fn random_graph_trees_restore_exactly_and_never_overlap() {
    for seed in 1..=12u64 {
        let dev = host(5);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let streams = [dev.create_stream(), dev.create_stream()];
        let pool = GraphPoolId(43, seed);
        a.graph_pool_retain(pool);
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut model: Model = BTreeMap::new();
        let mut checkpoints: Vec<(GraphCheckpoint, Model)> = Vec::new();
        for step in 0..400 {
            let s = streams[(rng(&mut x) % 2) as usize];
            let capture = !rng(&mut x).is_multiple_of(3);
            if capture {
                dev.begin_capture(s).unwrap();
            }
            for _ in 0..(rng(&mut x) % 6) {
                if rng(&mut x).is_multiple_of(2) || model.is_empty() {
                    let n = 1 + (rng(&mut x) % (3 << 20)) as usize;
                    let p = a.graph_allocate(pool, n, s).unwrap();
                    let len = n.next_multiple_of(512) as u64;
                    assert_eq!(p.0 % 512, 0);
                    if let Some((&q, &(_, ql))) = model.range(..p.0 + len).next_back() {
                        assert!(q + ql <= p.0, "seed {seed} step {step}: {p:?} overlaps {q:#x}");
                    }
                    model.insert(p.0, (n, len));
                } else {
                    let k = rng(&mut x) as usize % model.len();
                    let (&q, &(n, _)) = model.iter().nth(k).unwrap();
                    a.deallocate(DeviceAddr(q), n, s).unwrap();
                    model.remove(&q);
                }
            }
            if capture {
                dev.end_capture(s).unwrap();
            }
            match rng(&mut x) % 5 {
                0 => checkpoints.push((a.graph_pool_checkpoint(pool).unwrap(), model.clone())),
                1 if !checkpoints.is_empty() => {
                    let (c, m) = &checkpoints[rng(&mut x) as usize % checkpoints.len()];
                    let freed = a.graph_pool_restore(c).unwrap();
                    let was: Vec<(DeviceAddr, usize)> =
                        model.iter().map(|(&q, &(_, l))| (DeviceAddr(q), l as usize)).collect();
                    assert_eq!(freed, was, "seed {seed} step {step}: the freed blocks are the live ones");
                    model = m.clone();
                    assert_eq!(live(&a, pool), model.keys().copied().collect::<Vec<_>>());
                }
                _ => {}
            }
            if step % 50 == 0 {
                a.check_invariants();
            }
        }
        for (&q, &(n, _)) in &model {
            a.deallocate(DeviceAddr(q), n, Stream::LEGACY).unwrap();
        }
        assert!(dev.violations().is_empty(), "seed {seed}: {:?}", dev.violations());
        a.graph_pool_release(pool).unwrap();
        dev.synchronize();
        a.trim(true).unwrap();
        assert_all_returned(&a, Some(&dev), 0);
    }
}
