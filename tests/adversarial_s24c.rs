//! helper-27's attacks on the two fixes of commit 8f16ce6: a legacy refusal gets the
//! out-of-memory reclaim and one retry (`Error::is_out_of_room` in `Slot::alloc_slow_in`,
//! `Slot::alloc_pool_keyed` and `Arena::grow`), and a thread's remote frees on its own
//! per-thread stream, flushed while it captures that stream, are no longer dropped: the pool's
//! blocks take a lazy legacy fence and the others are parked until a device synchronise
//! (`Error::is_capture_of` in `Outbox::flush`).
//!
//! Each test captures the per-thread stream of the thread whose frees are refused (or of
//! another one), with the freeing thread's work held in flight by a gate where the order of
//! reuse matters. The properties checked: no block handed out twice (`Live`), no race, no
//! overwritten tag and no violation in the simulator (a device synchronise or a use of the
//! legacy stream during the capture is one), captures intact, refusals clear and changing
//! nothing, no hang (`within`), and every byte back at the end (`all_back`).

#![allow(clippy::type_complexity)]

mod common;

use std::sync::{Arc, Barrier, Mutex};

use common::{
    Live, Worker, all_back, alloc_with, host, is_double, is_invalid, no_violations, rng, small, tag, within,
};
use cuarena::{Allocator, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, StreamGate, assert_all_returned};

const MIB: usize = 1 << 20;

/// Small blocks up to 64 KiB from normal superblocks, large ones up to 256 KiB from large
/// superblocks, the rest the pool's.
fn cfg() -> cuarena::ConfigBuilder {
    small().large_max(256 << 10)
}

fn capturing(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { .. })
}

fn legacy_refusal(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { stream } if Stream::from_raw(*stream).is_legacy())
}

/// A clear outcome during a capture: done, out of memory, or a capture refusal.
fn clear<T: std::fmt::Debug>(r: &cuarena::Result<T>) -> bool {
    match r {
        Ok(_) | Err(Error::OutOfMemory { .. }) => true,
        Err(e) => capturing(e),
    }
}

/// `n` sizes: every sixth over `large_max` (a pool block), every sixth a large arena block,
/// the rest small.
fn sizes(n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| match i % 6 {
            0 => (300 << 10) + i * 4096,
            1 => (96 << 10) + i * 512,
            _ => 256 + (i * 4099) % (60 << 10),
        })
        .collect()
}

/// Starts a capture of `w`'s per-thread stream (on `w`'s thread).
fn begin(dev: &HostDevice, w: &Worker) {
    let d = dev.clone();
    w.run(move |_| d.begin_capture(Stream::PER_THREAD).unwrap());
}

/// Ends the capture of `w`'s per-thread stream: no violation meanwhile, and intact.
fn end(dev: &HostDevice, w: &Worker) {
    let d = dev.clone();
    let (v, ended) = w.run(move |_| {
        let v = d.violations();
        (v, d.end_capture(Stream::PER_THREAD))
    });
    assert!(v.is_empty(), "violations during the capture: {v:?}");
    ended.expect("the capture was invalidated");
}

/// `owner` allocates `sizes` on its per-thread stream (recorded in `live`).
fn owned(owner: &Worker, live: &Arc<Live>, sizes: Vec<usize>) -> Vec<(DeviceAddr, usize)> {
    let l = Arc::clone(live);
    owner.run(move |a| {
        sizes
            .into_iter()
            .map(|n| {
                let p = a.allocate_per_thread(n).unwrap();
                l.insert(p, n);
                (p, n)
            })
            .collect()
    })
}

/// Frees `blocks` on the calling thread's per-thread stream, each out of `live` first.
fn free_per_thread(a: &Allocator, live: &Live, blocks: &[(DeviceAddr, usize)]) {
    for &(p, n) in blocks {
        live.remove(p);
        a.deallocate_per_thread(p, n).unwrap();
    }
}

/// `freer` closes a gate on its per-thread stream, uses every block there behind it (a tag
/// at the head and the tail: in flight until the gate opens), and frees them there: remote
/// frees, waiting in its outbox (fewer than a batch). Returns the gate.
fn used_behind_a_gate_then_freed(
    dev: &HostDevice,
    freer: &Worker,
    live: &Arc<Live>,
    blocks: &[(DeviceAddr, usize)],
    tag0: u32,
) -> StreamGate {
    let (d, l, b) = (dev.clone(), Arc::clone(live), blocks.to_vec());
    freer.run(move |a| {
        let gate = d.gate(Stream::PER_THREAD).unwrap();
        for (i, &(p, n)) in b.iter().enumerate() {
            tag(&d, p, n, tag0 + i as u32, Stream::PER_THREAD);
        }
        free_per_thread(a, &l, &b);
        gate
    })
}

/// A thread's work: allocates each of `sizes` on each of `streams`, tags it there, records it
/// in `live`. Returns (block, size, stream).
fn take_all(
    a: &Allocator,
    dev: &HostDevice,
    live: &Live,
    sizes: &[usize],
    streams: &[Stream],
    tag0: u32,
) -> Vec<(DeviceAddr, usize, Stream)> {
    let mut got = Vec::new();
    for &s in streams {
        for (i, &n) in sizes.iter().enumerate() {
            let p = a.allocate(n, s).unwrap_or_else(|e| panic!("{n} B on {s:?}: {e}"));
            live.insert(p, n);
            tag(dev, p, n, tag0 + i as u32, s);
            got.push((p, n, s));
        }
    }
    got
}

fn give_all(a: &Allocator, live: &Live, got: Vec<(DeviceAddr, usize, Stream)>) {
    for (p, n, s) in got {
        live.remove(p);
        a.deallocate(p, n, s).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The parked frees and the lazy legacy fence against work still in flight.

/// The freeing thread's work on the blocks is held in flight by a gate on its per-thread
/// stream; it frees them there (remote frees of another thread's arena blocks, large blocks and
/// pool blocks), captures that stream and flushes: the arena blocks are parked, the pool blocks
/// take a lazy legacy fence. During the capture another thread takes the same sizes on its
/// per-thread stream and on a user stream and trims without blocking; after it (the gate still
/// closed), every thread (the owner too) takes them again on user streams, per-thread streams
/// and the legacy stream, and trims without blocking. The race checker sees any block handed to
/// a stream not ordered after the gated work. Then the gate opens and everything comes back.
#[test]
fn ptds_frees_refused_in_the_freers_own_capture_wait_for_its_gated_work() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg());
        let live = Arc::new(Live::default());
        let (owner, freer, other) = (Worker::new(&a), Worker::new(&a), Worker::new(&a));
        let szs = sizes(36);
        let blocks = owned(&owner, &live, szs.clone());
        let gate = used_behind_a_gate_then_freed(&dev, &freer, &live, &blocks, 0x1000);
        let parked0 = a.parked_free_bytes();
        let u = dev.create_stream();
        begin(&dev, &freer);
        let r = freer.run(|a| a.flush());
        assert!(r.is_ok(), "the flush during the freer's own capture: {r:?}");
        assert!(a.parked_free_bytes() > parked0, "the arena blocks' frees are parked");
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let during = other.run(move |a| {
            let got = take_all(a, &d, &l, &s2, &[Stream::PER_THREAD, u], 0x2000);
            let r = a.trim(false);
            assert!(clear(&r), "{r:?}");
            got
        });
        end(&dev, &freer);
        // After the capture, the gate still closed: every kind of stream, every thread.
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let mut after = other.run(move |a| {
            let got = take_all(a, &d, &l, &s2, &[u, Stream::LEGACY, Stream::PER_THREAD], 0x3000);
            a.trim(false).unwrap();
            got
        });
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        after.extend(owner.run(move |a| take_all(a, &d, &l, &s2, &[Stream::PER_THREAD, u], 0x4000)));
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let mine = freer.run(move |a| take_all(a, &d, &l, &s2, &[u], 0x5000));
        after.extend(take_all(&a, &dev, &live, &szs, &[Stream::LEGACY, u], 0x6000));
        let v = dev.violations();
        assert!(
            v.is_empty(),
            "{} violations with the gate closed, first: {:?}",
            v.len(),
            &v[..v.len().min(3)]
        );
        live.assert_clean();
        gate.open();
        let l = Arc::clone(&live);
        other.run(move |a| give_all(a, &l, during));
        let l = Arc::clone(&live);
        freer.run(move |a| give_all(a, &l, mine));
        give_all(&a, &live, after); // freed by this thread: remote frees for the others
        drop((owner, freer, other));
        dev.destroy_stream(u).unwrap();
        let _ = a.take_deferred_error();
        all_back(&a, &dev);
    });
}

// ---------------------------------------------------------------------------------------------
// 2. Double frees of blocks whose frees were refused by the capture and parked.

/// The statistics a refused free must leave unchanged.
fn counts(a: &Allocator) -> (u64, u64, u64) {
    let s = a.stats();
    (s.deallocations, s.live_bytes, s.allocations)
}

/// Frees every block again from `w` on `stream`: each must be refused as a double free (once
/// the memory may have gone back to the device, `any`: as any invalid free), changing
/// nothing. Returns how many were made.
fn double_free_all(w: &Worker, blocks: &[(DeviceAddr, usize)], stream: Stream, who: &'static str) -> u64 {
    double_free_all_as(w, blocks, stream, who, false)
}

fn double_free_all_as(
    w: &Worker,
    blocks: &[(DeviceAddr, usize)],
    stream: Stream,
    who: &'static str,
    any: bool,
) -> u64 {
    let b = blocks.to_vec();
    w.run(move |a| {
        for &(p, n) in &b {
            let before = counts(a);
            let r = a.deallocate(p, n, stream);
            let refused = if any { is_invalid(&r) } else { is_double(&r) };
            assert!(refused, "{who}: a second free of {p:?} ({n} B) on {stream:?}: {r:?}");
            assert_eq!(counts(a), before, "{who}: a refused free changed the statistics");
        }
        b.len() as u64
    })
}

/// Blocks of an owner freed by another thread on its per-thread stream and flushed during that
/// thread's own capture (arena blocks parked, pool blocks freed behind a lazy legacy fence) are
/// freed again during the capture by the freer itself (on its captured per-thread stream), by
/// the owner (its local free on its per-thread stream, and on a user stream) and by a third
/// thread; after the capture before any synchronise; and after the synchronise that delivers
/// them. Every one is a double free, refused at once, changing nothing, and the parked frees
/// still arrive once.
#[test]
fn double_frees_of_ptds_frees_parked_by_the_freers_capture_are_refused() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg());
        let live = Arc::new(Live::default());
        let (owner, freer, third) = (Worker::new(&a), Worker::new(&a), Worker::new(&a));
        let blocks = owned(&owner, &live, sizes(30));
        let gate = used_behind_a_gate_then_freed(&dev, &freer, &live, &blocks, 0x100);
        gate.open();
        let u = dev.create_stream();
        let mut bad = 0;
        begin(&dev, &freer);
        freer.run(|a| a.flush()).unwrap();
        let parked = a.parked_free_bytes();
        assert!(parked > 0);
        bad += double_free_all(&freer, &blocks, Stream::PER_THREAD, "the capturing freer");
        // Its outbox holds nothing of them: flushing again parks nothing more.
        freer.run(|a| a.flush()).unwrap();
        assert_eq!(a.parked_free_bytes(), parked, "a refused double free was parked");
        bad += double_free_all(&owner, &blocks, Stream::PER_THREAD, "the owner");
        bad += double_free_all(&owner, &blocks, u, "the owner on a user stream");
        bad += double_free_all(&third, &blocks, Stream::PER_THREAD, "a third thread");
        bad += double_free_all(&third, &blocks, u, "a third thread on a user stream");
        let r = owner.run(|a| a.trim(true));
        assert!(clear(&r), "{r:?}");
        assert_eq!(a.parked_free_bytes(), parked, "delivered during the capture");
        end(&dev, &freer);
        bad += double_free_all(&owner, &blocks, Stream::PER_THREAD, "the owner, after the capture");
        bad += double_free_all(&third, &blocks, Stream::LEGACY, "a third thread on the legacy stream");
        // The synchronise that delivers them.
        third.run(|a| a.trim(true)).unwrap();
        assert_eq!(a.parked_free_bytes(), 0, "the parked frees are delivered");
        owner.run(|a| a.flush()).unwrap();
        // The pool's blocks' memory may have gone back to the device by now (`trim(true)`).
        bad += double_free_all_as(&owner, &blocks, Stream::PER_THREAD, "the owner, after the delivery", true);
        bad += double_free_all_as(&freer, &blocks, Stream::PER_THREAD, "the freer, after the delivery", true);
        bad += double_free_all_as(&third, &blocks, u, "a third thread, after the delivery", true);
        drop((owner, freer, third));
        dev.destroy_stream(u).unwrap();
        no_violations(&dev);
        a.trim(true).unwrap();
        assert_all_returned(&a, Some(&dev), bad);
    });
}

// ---------------------------------------------------------------------------------------------
// 3. The capturing thread releases itself, holding memory, while its frees are refused.

/// A thread holds memory in its per-thread arena (live blocks and empty superblocks), in its
/// legacy arena (kept-back legacy frees) and in a user arena, and has remote frees of another
/// thread's blocks waiting in its outbox on its per-thread stream; it captures its per-thread
/// stream and calls `release_thread` during the capture (what the fix's own test does, there
/// with no arena memory). The fences its arenas' memory would need go on its captured stream
/// or on the legacy stream: none may be recorded, and nothing may be lost. After the capture
/// the thread frees its live blocks (a new slot: remote frees now) and exits; every byte
/// comes back.
#[test]
fn release_thread_during_its_own_capture_holding_arena_memory_loses_nothing() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg());
        let live = Arc::new(Live::default());
        let (owner, t) = (Worker::new(&a), Worker::new(&a));
        let theirs = owned(&owner, &live, sizes(18));
        let u = dev.create_stream();
        let (d, l, th) = (dev.clone(), Arc::clone(&live), theirs.clone());
        let mine: Vec<(DeviceAddr, usize)> = t.run(move |a| {
            let mut keep = Vec::new();
            for (i, n) in sizes(48).into_iter().enumerate() {
                let s = [Stream::PER_THREAD, Stream::LEGACY, u][i % 3];
                let p = a.allocate(n, s).unwrap();
                tag(&d, p, n, 0x700 + i as u32, s);
                if i % 4 == 0 && s.is_per_thread() {
                    l.insert(p, n);
                    keep.push((p, n));
                } else {
                    a.deallocate(p, n, s).unwrap();
                }
            }
            free_per_thread(a, &l, &th);
            keep
        });
        let held = a.stats().arena_held_bytes;
        assert!(held > 0);
        begin(&dev, &t);
        let r = t.run(|a| a.release_thread());
        assert!(clear(&r), "release_thread during its own capture: {r:?}");
        end(&dev, &t);
        eprintln!(
            "release during the capture: {r:?}; parked arenas {} B, parked frees {} B, deferred {:?}",
            a.parked_bytes(),
            a.parked_free_bytes(),
            a.take_deferred_error()
        );
        let l = Arc::clone(&live);
        t.run(move |a| free_per_thread(a, &l, &mine));
        drop((owner, t));
        dev.destroy_stream(u).unwrap();
        let _ = a.take_deferred_error();
        all_back(&a, &dev);
    });
}

// ---------------------------------------------------------------------------------------------
// 4. The owner exits while the frees of its blocks are parked; its shell is taken again.

/// Remote frees of an owner's blocks, made on the freer's per-thread stream with its work on
/// them held by a gate, are parked by the freer's flush during its own capture. The owner
/// exits during the capture (its superblocks with those blocks become the pool's), and a new
/// thread takes its idle shell and allocates a lot there, on its per-thread and a user stream,
/// during the capture and after it (the gate still closed): none of the parked blocks is
/// handed out, nor any block not ordered after the gated work. A second free of one is
/// refused. Then the gate opens, a synchronise delivers the parked frees to the reused shell
/// (not its blocks: the pool's), and everything comes back.
#[test]
fn owner_exits_and_its_shell_is_reused_while_its_blocks_ptds_frees_are_parked() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg());
        let live = Arc::new(Live::default());
        let (owner, freer) = (Worker::new(&a), Worker::new(&a));
        // Arena blocks only: those are the parked ones.
        let szs: Vec<usize> = sizes(40).into_iter().filter(|&n| n <= 256 << 10).collect();
        let blocks = owned(&owner, &live, szs.clone());
        let gate = used_behind_a_gate_then_freed(&dev, &freer, &live, &blocks, 0x900);
        // Until the parked frees arrive, their blocks are handed out: nobody may get them.
        for &(p, n) in &blocks {
            live.insert(p, n);
        }
        let u = dev.create_stream();
        begin(&dev, &freer);
        freer.run(|a| a.flush()).unwrap();
        assert!(a.parked_free_bytes() > 0);
        owner.exit();
        let newcomer = Worker::new(&a);
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let mut got = newcomer.run(move |a| {
            let mut got = Vec::new();
            for round in 0..4u32 {
                got.extend(take_all(a, &d, &l, &s2, &[Stream::PER_THREAD, u], 0xa00 + 64 * round));
            }
            got
        });
        let (p, n) = blocks[2];
        let r = newcomer.run(move |a| a.deallocate_per_thread(p, n));
        assert!(is_double(&r), "a second free of a parked free's block: {r:?}");
        let r = newcomer.run(|a| a.trim(false));
        assert!(clear(&r), "{r:?}");
        end(&dev, &freer);
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        got.extend(newcomer.run(move |a| take_all(a, &d, &l, &s2, &[u, Stream::LEGACY], 0xc00)));
        let v = dev.violations();
        assert!(
            v.is_empty(),
            "{} violations with the gate closed, first: {:?}",
            v.len(),
            &v[..v.len().min(3)]
        );
        live.assert_clean();
        gate.open();
        for &(p, _) in &blocks {
            live.remove(p);
        }
        a.trim(true).unwrap(); // delivers the parked frees
        assert_eq!(a.parked_free_bytes(), 0);
        let l = Arc::clone(&live);
        newcomer.run(move |a| {
            give_all(a, &l, got);
            a.flush().unwrap();
        });
        drop((newcomer, freer));
        dev.destroy_stream(u).unwrap();
        no_violations(&dev);
        a.trim(true).unwrap();
        assert_all_returned(&a, Some(&dev), 1);
    });
}

/// The smallest case of the test above: a thread whose only memory is empty superblocks in its
/// per-thread arena (no remote frees, no other arena) calls `release_thread` during its own
/// capture. The arena's exit fence would go on the captured stream; the memory must not be
/// lost (parked for a synchronise, or kept until the thread's next call).
#[test]
fn release_thread_during_its_own_capture_with_only_per_thread_arena_memory() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg());
        let t = Worker::new(&a);
        let d = dev.clone();
        t.run(move |a| {
            let ps: Vec<_> = (0..8).map(|_| a.allocate_per_thread(40 << 10).unwrap()).collect();
            for &p in &ps {
                d.write_tag(p.0, 256, 7, Stream::PER_THREAD).unwrap();
            }
            ps.into_iter().for_each(|p| a.deallocate_per_thread(p, 40 << 10).unwrap());
        });
        let held = a.stats().arena_held_bytes;
        assert!(held > 0);
        begin(&dev, &t);
        let r = t.run(|a| a.release_thread());
        assert!(clear(&r), "{r:?}");
        end(&dev, &t);
        let s = a.stats();
        eprintln!(
            "held {held} B before; after the release: {} arenas, {} B held, parked {} B, deferred {:?}",
            s.arenas,
            s.arena_held_bytes,
            a.parked_bytes(),
            a.take_deferred_error()
        );
        t.exit();
        all_back(&a, &dev);
    });
}

// ---------------------------------------------------------------------------------------------
// 5. The capturing thread itself gets a legacy refusal: its reclaim runs during its capture.

/// Under a cap at what is reserved, the pool's only free memory holds a lazy legacy fence, the
/// capturing thread's own per-thread arena holds empty superblocks, and its outbox holds remote
/// frees on its per-thread stream (an owner's arena blocks and a pool block). During its own
/// capture it asks on a user stream for a pool block and for a small block (an arena's growth):
/// each is a legacy refusal, so the out-of-memory reclaim runs on the capturing thread. Its
/// arena's fence and its outbox's event would go on its captured stream, the other arenas'
/// on the legacy stream: none may be recorded, no synchronise may run, the retry happens at
/// most once per request, and the refusal changes nothing it reports (allocations, live and
/// reserved bytes). After the capture the same requests are served under the same cap.
#[test]
fn the_capturing_thread_itself_gets_a_legacy_refusal_and_reclaims() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, small().large_max(64 << 10).keep_empty(8));
        let live = Arc::new(Live::default());
        let (owner, t) = (Worker::new(&a), Worker::new(&a));
        t.run(|a| {
            let ps: Vec<_> = (0..16).map(|_| a.allocate_per_thread(64 << 10).unwrap()).collect();
            ps.into_iter().for_each(|p| a.deallocate_per_thread(p, 64 << 10).unwrap());
        });
        let mut theirs = owned(&owner, &live, (0..10).map(|i| 1000 + i * 700).collect());
        theirs.extend(owned(&owner, &live, vec![512 << 10]));
        let (l, th) = (Arc::clone(&live), theirs.clone());
        t.run(move |a| free_per_thread(a, &l, &th));
        // A pool block freed on the legacy stream: a lazy legacy fence on its extent.
        let p = a.allocate(MIB, Stream::LEGACY).unwrap();
        dev.write_tag(p.0, 4096, 0x11, Stream::LEGACY).unwrap();
        a.deallocate(p, MIB, Stream::LEGACY).unwrap();
        a.flush().unwrap();
        a.set_limit_bytes(a.stats().reserved_bytes as usize);
        let u = dev.create_stream();
        let syncs = a.stats().host_syncs;
        begin(&dev, &t);
        let (results, retries, changed) = t.run(move |a| {
            let mut results = Vec::new();
            let mut retries = Vec::new();
            let mut changed = Vec::new();
            for n in [MIB, 4096, 96 << 10, MIB] {
                let before = a.stats();
                let r = a.allocate(n, u);
                let after = a.stats();
                retries.push(after.alloc_retries - before.alloc_retries);
                if let Ok(q) = r {
                    a.deallocate(q, n, u).unwrap();
                } else {
                    changed.push((
                        (before.allocations, before.live_bytes, before.reserved_bytes),
                        (after.allocations, after.live_bytes, after.reserved_bytes),
                    ));
                }
                results.push(r.map(|_| ()));
            }
            (results, retries, changed)
        });
        assert_eq!(a.stats().host_syncs, syncs, "a synchronise during the capture");
        end(&dev, &t);
        eprintln!("during the capture: {results:?}, retries {retries:?}, parked {} B", a.parked_free_bytes());
        for r in &results {
            assert!(clear(r), "{r:?}");
            if let Err(e) = r {
                assert!(legacy_refusal(e), "not the legacy refusal: {e}");
            }
        }
        assert!(retries.iter().all(|&r| r <= 1), "more than one retry for one request: {retries:?}");
        for (b, a) in changed {
            assert_eq!(b, a, "a refusal changed the allocations, live or reserved bytes");
        }
        let after: Vec<_> = t.run(move |a| {
            [MIB, 4096, 96 << 10]
                .into_iter()
                .map(|n| {
                    let r = a.allocate(n, u);
                    if let Ok(q) = r {
                        a.deallocate(q, n, u).unwrap();
                    }
                    r.map(|_| ())
                })
                .collect()
        });
        a.set_limit_bytes(usize::MAX);
        drop((owner, t));
        dev.destroy_stream(u).unwrap();
        let _ = a.take_deferred_error();
        all_back(&a, &dev);
        for r in after {
            r.expect("served after the capture under the same cap");
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 6. Legacy refusals and their reclaims racing on many threads during a capture.

/// What a racing thread holds: (block, size, stream, tag).
type Held = Vec<(DeviceAddr, usize, Stream, u32)>;

/// One racer's steps during the capture: allocations on its per-thread stream (unless it is the
/// capturing one) and its user stream, frees, remote frees of blocks others handed over (on its
/// per-thread stream, or, for the capturing one, on its user stream), flushes and non-blocking
/// trims. Every outcome must be clear.
#[allow(clippy::too_many_arguments)]
fn racer_steps(
    a: &Allocator,
    dev: &HostDevice,
    live: &Live,
    shared: &Mutex<Vec<(DeviceAddr, usize, Stream, u32)>>,
    u: Stream,
    capturing_self: bool,
    held: &mut Held,
    x: &mut u64,
    steps: usize,
) -> (usize, usize) {
    let (mut refusals, mut done) = (0, 0);
    for _ in 0..steps {
        let k = rng(x) % 100;
        if k < 50 || held.is_empty() {
            let s = if capturing_self || rng(x).is_multiple_of(2) { u } else { Stream::PER_THREAD };
            let n = match rng(x) % 8 {
                0 => (300 << 10) + (rng(x) as usize % MIB),
                1 => (64 << 10) + (rng(x) as usize % (192 << 10)),
                _ => 64 + (rng(x) as usize % (60 << 10)),
            };
            let r = a.allocate(n, s);
            assert!(clear(&r), "allocate {n} on {s:?}: {r:?}");
            match r {
                Ok(p) => {
                    live.insert(p, n);
                    let t = (rng(x) & 0xffff) as u32;
                    tag(dev, p, n, t, s);
                    held.push((p, n, s, t));
                    done += 1;
                }
                Err(_) => refusals += 1,
            }
        } else if k < 85 {
            let i = rng(x) as usize % held.len();
            let (p, n, s, t) = held.swap_remove(i);
            common::check(dev, p, n, t, s);
            live.remove(p);
            a.deallocate(p, n, s).unwrap();
        } else if k < 93 {
            // Hand one over; take one (freed on our own stream after it waited for theirs).
            let i = rng(x) as usize % held.len();
            shared.lock().unwrap().push(held.swap_remove(i));
            let got = shared.lock().unwrap().pop();
            if let Some((p, n, s, t)) = got {
                let mine = if capturing_self { u } else { Stream::PER_THREAD };
                if s == mine {
                    held.push((p, n, s, t));
                } else {
                    common::check(dev, p, n, t, s);
                    live.remove(p);
                    let r = a.deallocate_used_on(p, n, mine, &[s]);
                    assert!(r.is_ok(), "{r:?}");
                }
            }
        } else {
            let r = if k < 97 { a.flush().map(|_| 0) } else { a.trim(false) };
            assert!(clear(&r), "flush/trim: {r:?}");
        }
    }
    (refusals, done)
}

/// Four threads, each with empty superblocks in its own per-thread arena and remote frees in
/// its outbox, race under a cap at what is reserved, where most of the pool's free memory holds
/// a lazy legacy fence, while one of them captures its own per-thread stream: legacy refusals
/// and their reclaims (which dissolve the callers' arenas and flush their outboxes) run on all
/// of them at once, the capturing one included. No synchronise, no legacy use, no block twice,
/// no tag overwritten, every outcome clear; after the capture everything comes back.
#[test]
fn legacy_refusals_and_their_reclaims_race_on_many_threads_during_a_capture() {
    within(120, || {
        for seed in 1..=3u64 {
            race_once(seed);
        }
    });
}

fn race_once(seed: u64) {
    const THREADS: usize = 4;
    let dev = host(20);
    let a = alloc_with(&dev, cfg().keep_empty(8).batch_blocks(6));
    let live = Arc::new(Live::default());
    let shared = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<Worker> = (0..THREADS).map(|_| Worker::new(&a)).collect();
    let users: Vec<Stream> = (0..THREADS).map(|_| dev.create_stream()).collect();
    // Empty superblocks in every racer's per-thread arena.
    for w in &workers {
        w.run(|a| {
            let ps: Vec<_> = (0..12).map(|i| a.allocate_per_thread((40 << 10) + i * 256).unwrap()).collect();
            ps.into_iter()
                .enumerate()
                .for_each(|(i, p)| a.deallocate_per_thread(p, (40 << 10) + i * 256).unwrap());
        });
    }
    // Pool memory freed on the legacy stream: lazy legacy fences.
    let ps: Vec<_> = (0..6).map(|_| a.allocate(2 * MIB, Stream::LEGACY).unwrap()).collect();
    ps.into_iter().for_each(|p| a.deallocate(p, 2 * MIB, Stream::LEGACY).unwrap());
    a.flush().unwrap();
    a.release_thread().unwrap();
    a.set_limit_bytes(a.stats().reserved_bytes as usize + MIB);
    let syncs = a.stats().host_syncs;
    let bar = Arc::new(Barrier::new(THREADS));
    let capturer = 0;
    begin(&dev, &workers[capturer]);
    // The four run at once: each `run` waits on its own scoped thread.
    let helds: Vec<Held> = std::thread::scope(|sc| {
        let hs: Vec<_> = workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let (d, l, sh, b, u) =
                    (dev.clone(), Arc::clone(&live), Arc::clone(&shared), Arc::clone(&bar), users[i]);
                sc.spawn(move || {
                    w.run(move |a| {
                        b.wait();
                        let mut held = Vec::new();
                        let mut x = seed * 0x9e37_79b9 + i as u64 * 7919 + 1;
                        let r = racer_steps(a, &d, &l, &sh, u, i == capturer, &mut held, &mut x, 150);
                        eprintln!("seed {seed} racer {i}: {} refusals, {} served", r.0, r.1);
                        held
                    })
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(a.stats().host_syncs, syncs, "a synchronise during the capture");
    end(&dev, &workers[capturer]);
    live.assert_clean();
    a.set_limit_bytes(usize::MAX);
    for (w, held) in workers.iter().zip(helds) {
        let l = Arc::clone(&live);
        w.run(move |a| {
            for (p, n, s, _) in held {
                l.remove(p);
                a.deallocate(p, n, s).unwrap();
            }
        });
    }
    for (p, n, s, _) in std::mem::take(&mut *shared.lock().unwrap()) {
        live.remove(p);
        a.deallocate_used_on(p, n, Stream::LEGACY, &[s]).unwrap();
    }
    drop(workers);
    for u in users {
        dev.destroy_stream(u).unwrap();
    }
    let _ = a.take_deferred_error();
    all_back(&a, &dev);
}

// ---------------------------------------------------------------------------------------------
// 7. Pool blocks only: the lazy legacy fence of a refused per-thread batch, trims and reuse.

/// Whole-chunk pool blocks used behind a gate on the freer's per-thread stream are freed there
/// and flushed during its own capture (every free of the batch a pool block: all take the lazy
/// legacy fence). Non-blocking trims during and after the capture (the gate closed) may not
/// give those chunks back to the device (their work is in flight: releasing them is a
/// violation), and reuse on a user stream, another thread's per-thread stream, the legacy
/// stream and the freer's own per-thread stream must be ordered after the gated work.
#[test]
fn lazy_legacy_pool_blocks_of_a_refused_ptds_batch_are_trimmed_and_reused_in_order() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg());
        let live = Arc::new(Live::default());
        let (owner, freer, other) = (Worker::new(&a), Worker::new(&a), Worker::new(&a));
        let szs = vec![MIB, 2 * MIB, 3 * MIB, MIB + 4096, 700 << 10];
        let blocks = owned(&owner, &live, szs.clone());
        let gate = used_behind_a_gate_then_freed(&dev, &freer, &live, &blocks, 0x4400);
        let u = dev.create_stream();
        begin(&dev, &freer);
        freer.run(|a| a.flush()).unwrap();
        assert_eq!(a.parked_free_bytes(), 0, "pool blocks are never parked");
        for w in [&other, &owner] {
            let r = w.run(|a| a.trim(false));
            assert!(clear(&r), "{r:?}");
        }
        let r = freer.run(|a| a.trim(false));
        assert!(clear(&r), "the capturing thread's own trim: {r:?}");
        end(&dev, &freer);
        let r = other.run(|a| a.trim(false));
        assert!(clear(&r), "{r:?}");
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let mut got = other.run(move |a| take_all(a, &d, &l, &s2, &[u, Stream::PER_THREAD], 0x4500));
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let mine = freer.run(move |a| take_all(a, &d, &l, &s2, &[Stream::PER_THREAD, u], 0x4600));
        got.extend(take_all(&a, &dev, &live, &szs, &[Stream::LEGACY], 0x4700));
        let r = other.run(|a| a.trim(false));
        assert!(clear(&r), "{r:?}");
        let v = dev.violations();
        assert!(
            v.is_empty(),
            "{} violations with the gate closed, first: {:?}",
            v.len(),
            &v[..v.len().min(3)]
        );
        live.assert_clean();
        gate.open();
        let l = Arc::clone(&live);
        freer.run(move |a| give_all(a, &l, mine));
        give_all(&a, &live, got);
        drop((owner, freer, other));
        dev.destroy_stream(u).unwrap();
        let _ = a.take_deferred_error();
        all_back(&a, &dev);
    });
}

// ---------------------------------------------------------------------------------------------
// 8. Full batches refused during the capture: frees made during it, and the first free.

/// With batches of 8, the freer uses an owner's blocks behind a gate on its per-thread stream,
/// frees a few before its capture and the rest during it: every batch that fills during the
/// capture is flushed inside a free and refused (no error, nothing dropped), and its frees are
/// parked at once (until the twenty-eighth session they accumulated in the freer's outbox until
/// its next flush, out of other threads' reach: `adversarial_s28d`). A second thread that never asked
/// its per-thread stream's identity frees on it during its own capture: refused clearly and
/// changing nothing, or taken. Nobody gets those blocks before the gate opens and a
/// synchronise delivers them; then everything comes back.
#[test]
fn full_ptds_batches_refused_during_the_freers_capture_accumulate_and_come_back() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg().batch_blocks(8));
        let live = Arc::new(Live::default());
        let (owner, freer, fresh, other) =
            (Worker::new(&a), Worker::new(&a), Worker::new(&a), Worker::new(&a));
        let szs: Vec<usize> = (0..60).map(|i| 512 + i * 997).collect();
        let blocks = owned(&owner, &live, szs.clone());
        // Used behind a gate, none freed yet.
        let (d, b) = (dev.clone(), blocks.clone());
        let gate = freer.run(move |a| {
            let gate = d.gate(Stream::PER_THREAD).unwrap();
            for (i, &(p, n)) in b.iter().enumerate() {
                tag(&d, p, n, 0x5500 + i as u32, Stream::PER_THREAD);
            }
            // Three frees before the capture (the identity asked, a batch begun).
            for &(p, n) in &b[..3] {
                a.deallocate_per_thread(p, n).unwrap();
            }
            gate
        });
        let _ = a.take_deferred_error();
        let parked0 = a.parked_free_bytes();
        begin(&dev, &freer);
        let b = blocks.clone();
        let (r, deferred) = freer.run(move |a| {
            let r: Vec<_> = b[3..].iter().map(|&(p, n)| a.deallocate_per_thread(p, n)).collect();
            (r, a.take_deferred_error())
        });
        for x in &r {
            assert!(x.is_ok(), "a free during the capture: {x:?}");
        }
        assert!(deferred.is_none(), "a refused batch is no error: {deferred:?}");
        let during = a.parked_free_bytes();
        assert!(during > parked0, "the refused frees are parked at once");
        // The fresh thread: never asked its per-thread stream's identity.
        let fresh_blocks = owned(&owner, &live, vec![3000, 5000, 7000]);
        let d = dev.clone();
        let fb = fresh_blocks.clone();
        let fresh_results = fresh.run(move |a| {
            d.begin_capture(Stream::PER_THREAD).unwrap();
            let r: Vec<_> = fb
                .iter()
                .map(|&(p, n)| {
                    let before = counts(a);
                    let r = a.deallocate_per_thread(p, n);
                    if r.is_err() {
                        assert_eq!(counts(a), before, "a refused free changed the statistics");
                    }
                    r
                })
                .collect();
            let f = a.flush();
            let v = d.violations();
            let ended = d.end_capture(Stream::PER_THREAD);
            assert!(v.is_empty(), "{v:?}");
            ended.expect("the fresh thread's capture was invalidated");
            (r, f)
        });
        eprintln!("the fresh thread's frees during its capture: {fresh_results:?}");
        for (i, r) in fresh_results.0.iter().enumerate() {
            assert!(clear(r), "{r:?}");
            let (p, n) = fresh_blocks[i];
            if r.is_ok() {
                live.remove(p);
            } else {
                // Refused, changing nothing: freed again after the capture.
                live.remove(p);
                fresh.run(move |a| a.deallocate_per_thread(p, n)).unwrap();
            }
        }
        // Nobody may get the freer's blocks while its gate is closed.
        let (d, l) = (dev.clone(), Arc::clone(&live));
        let s2: Vec<usize> = szs.iter().step_by(3).copied().collect();
        let got = other.run(move |a| take_all(a, &d, &l, &s2, &[Stream::PER_THREAD], 0x5600));
        end(&dev, &freer);
        let r = freer.run(|a| a.flush());
        assert!(r.is_ok(), "{r:?}");
        eprintln!(
            "parked: {parked0} B before, {during} B after the frees, {} B after the flush",
            a.parked_free_bytes()
        );
        assert_eq!(a.parked_free_bytes(), during, "the flush after the capture fences its batch");
        let v = dev.violations();
        assert!(
            v.is_empty(),
            "{} violations with the gate closed, first: {:?}",
            v.len(),
            &v[..v.len().min(3)]
        );
        live.assert_clean();
        gate.open();
        let l = Arc::clone(&live);
        other.run(move |a| give_all(a, &l, got));
        drop((owner, freer, fresh, other));
        let _ = a.take_deferred_error();
        all_back(&a, &dev);
    });
}

// ---------------------------------------------------------------------------------------------
// 9. The capture ends while refused frees still wait in the outbox.

/// A full batch is refused inside a free during the freer's capture and parked at once; the
/// capture ends, and the freer goes on (more remote frees on its per-thread stream, now fenced;
/// a switch to the legacy stream; allocations), while another thread's blocking trim delivers
/// the parked frees after its synchronise, and other threads allocate a lot. Until the
/// twenty-eighth session the refused frees waited in the freer's outbox, where the blocking
/// trim could not reach them, until the freer's flush. Everything comes back.
#[test]
fn the_capture_ends_while_refused_frees_wait_parked() {
    within(60, || {
        let dev = host(20);
        let a = alloc_with(&dev, cfg().batch_blocks(8));
        let live = Arc::new(Live::default());
        let (owner, freer, other) = (Worker::new(&a), Worker::new(&a), Worker::new(&a));
        let szs: Vec<usize> = (0..24).map(|i| 700 + i * 1499).collect();
        let blocks = owned(&owner, &live, szs.clone());
        let (first, rest) = (blocks[..8].to_vec(), blocks[8..].to_vec());
        let f1 = first.clone();
        freer.run(move |a| {
            for &(p, n) in &f1[..7] {
                a.deallocate_per_thread(p, n).unwrap();
            }
        });
        let parked0 = a.parked_free_bytes();
        begin(&dev, &freer);
        let (p, n) = first[7];
        freer.run(move |a| a.deallocate_per_thread(p, n)).unwrap(); // the eighth: refused batch
        end(&dev, &freer);
        let parked = a.parked_free_bytes();
        assert!(parked > parked0, "the refused batch is parked at once");
        // The freer goes on: more frees (fenced now), a switch of stream, allocations.
        let (l, r2, d) = (Arc::clone(&live), rest.clone(), dev.clone());
        let mine = freer.run(move |a| {
            for (i, &(p, n)) in r2.iter().enumerate() {
                l.remove(p);
                let s = if i % 2 == 0 { Stream::PER_THREAD } else { Stream::LEGACY };
                a.deallocate(p, n, s).unwrap();
            }
            take_all(a, &d, &l, &[4096, 50 << 10, 600 << 10], &[Stream::PER_THREAD], 0x6600)
        });
        other.run(|a| a.trim(true)).unwrap();
        assert_eq!(a.parked_free_bytes(), 0, "the blocking trim delivers the parked frees");
        for &(p, _) in &first {
            live.remove(p);
        }
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let got = other.run(move |a| {
            let mut got = Vec::new();
            for round in 0..3 {
                got.extend(take_all(
                    a,
                    &d,
                    &l,
                    &s2,
                    &[Stream::PER_THREAD, Stream::LEGACY],
                    0x6700 + round * 64,
                ));
            }
            got
        });
        owner.run(|a| a.flush()).unwrap();
        let (d, l, s2) = (dev.clone(), Arc::clone(&live), szs.clone());
        let got2 = owner.run(move |a| take_all(a, &d, &l, &s2, &[Stream::PER_THREAD], 0x6800));
        live.assert_clean();
        freer.run(|a| a.flush()).unwrap();
        other.run(|a| a.trim(true)).unwrap();
        assert_eq!(a.parked_free_bytes(), 0);
        let l = Arc::clone(&live);
        other.run(move |a| give_all(a, &l, got));
        let l = Arc::clone(&live);
        owner.run(move |a| give_all(a, &l, got2));
        let l = Arc::clone(&live);
        freer.run(move |a| give_all(a, &l, mine));
        drop((owner, freer, other));
        let _ = a.take_deferred_error();
        all_back(&a, &dev);
    });
}
