//! Remote frees on user streams go in batches, one event per batch recorded inside a later
//! call on the same stream (`outbox.rs`, "Frees on user streams"): the owner never reuses a
//! block before its batch's event (the host device's race checker would see it; with fencing
//! off it does), a partial batch is sent after enough allocations on its stream, a batch whose
//! stream is gone is parked and comes back after a device synchronise, a free on a stream past
//! the batched ones is sent alone under its own event, and a free on a stream being captured
//! is refused.

use std::time::Duration;

use cuarena::{Allocator, Device, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned};

mod common;
use common::*;

const SIZE: usize = 8 << 10;

/// The owner allocates `n` blocks on its per-thread stream and tags them there; returns them
/// with an event after the tags, which the user orders its stream after (the blocks are ready
/// on the owner's stream).
fn owned_blocks(owner: &Worker, sim: &HostDevice, n: usize, tag: u32) -> (Vec<DeviceAddr>, cuarena::Event) {
    let sim = sim.clone();
    owner.run(move |a| {
        let v: Vec<DeviceAddr> = (0..n)
            .map(|_| {
                let p = a.allocate(SIZE, Stream::PER_THREAD).unwrap();
                sim.write_tag(p.0, SIZE, tag, Stream::PER_THREAD).unwrap();
                p
            })
            .collect();
        let e = sim.create_event().unwrap();
        sim.record_event(e, Stream::PER_THREAD).unwrap();
        (v, e)
    })
}

/// The owner takes back what was freed to it and reuses it: allocates `n` blocks and
/// overwrites them on its per-thread stream (a reuse before a block's fence is a race the
/// checker reports).
fn owner_reuses(owner: &Worker, sim: &HostDevice, n: usize) {
    let sim = sim.clone();
    owner.run(move |a| {
        a.flush().unwrap();
        let v: Vec<DeviceAddr> = (0..n).map(|_| a.allocate(SIZE, Stream::PER_THREAD).unwrap()).collect();
        for p in &v {
            sim.write_tag(p.0, SIZE, 0xdead, Stream::PER_THREAD).unwrap();
        }
        for p in v {
            a.deallocate(p, SIZE, Stream::PER_THREAD).unwrap();
        }
    });
}

/// 640 blocks of one thread used (held 2 ms each) and freed by another on its own stream:
/// returns the events that thread recorded and the race checker's findings after the owner
/// reused them.
fn handoff(skip_fences: bool) -> (u64, Vec<String>) {
    let sim = host(0);
    let cfg = if skip_fences { small().skip_fences_for_testing() } else { small() };
    let a = alloc_with(&sim, cfg);
    let owner = Worker::new(&a);
    let (blocks, ready) = owned_blocks(&owner, &sim, 640, 7);
    let u = sim.create_stream();
    sim.stream_wait_event(u, ready).unwrap();
    let before = a.stats().fences_recorded;
    for p in &blocks {
        sim.hold_and_check(p.0, SIZE, 7, Duration::from_micros(2000), u).unwrap();
        a.deallocate(*p, SIZE, u).unwrap();
    }
    let events = a.stats().fences_recorded - before;
    owner_reuses(&owner, &sim, 640);
    drop(owner);
    sim.synchronize();
    let v = sim.violations();
    if !skip_fences {
        sim.destroy_stream(u).unwrap();
        assert_all_returned(&a, Some(&sim), 0);
    }
    (events, v)
}

#[test]
fn remote_frees_on_a_user_stream_go_in_batches_of_one_event_and_are_fenced() {
    let (events, v) = handoff(false);
    // 640 frees, batches of 64: ten events (one per remote free before batching).
    assert!(events <= 11, "{events} events for 640 remote frees");
    assert!(v.is_empty(), "{v:?}");
}

#[test]
fn without_fences_the_checker_catches_reuse_of_user_stream_frees() {
    let (_, v) = handoff(true);
    assert!(!v.is_empty(), "unfenced reuse went unnoticed");
}

#[test]
fn a_partial_batch_is_sent_after_enough_allocations_on_its_stream() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned_blocks(&owner, &sim, 3, 1);
    let u = sim.create_stream();
    sim.stream_wait_event(u, ready).unwrap();
    for p in &blocks {
        a.deallocate(*p, SIZE, u).unwrap();
    }
    let events = |a: &Allocator| a.stats().fences_recorded;
    let before = events(&a);
    let mut mine = Vec::new();
    for i in 1..=256 {
        mine.push(a.allocate(512, u).unwrap());
        // The 256th allocation on the stream sends the three frees under one event.
        assert_eq!(events(&a) - before, u64::from(i == 256), "after {i} allocations");
    }
    for p in mine {
        a.deallocate(p, 512, u).unwrap();
    }
    owner_reuses(&owner, &sim, 64);
    drop(owner);
    sim.synchronize();
    sim.destroy_stream(u).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn a_batch_whose_stream_is_gone_is_parked_and_comes_back_after_a_synchronise() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned_blocks(&owner, &sim, 5, 2);
    let user = Worker::new(&a);
    let sim2 = sim.clone();
    user.run(move |a| {
        let u = sim2.create_stream();
        sim2.stream_wait_event(u, ready).unwrap();
        for p in &blocks {
            sim2.hold_and_check(p.0, SIZE, 2, Duration::from_millis(20), u).unwrap();
            a.deallocate(*p, SIZE, u).unwrap();
        }
        sim2.destroy_stream(u).unwrap();
        // A new stream, likely with the same handle: the batch is not its own.
        let v = sim2.create_stream();
        for _ in 0..300 {
            let p = a.allocate(512, v).unwrap();
            a.deallocate(p, 512, v).unwrap();
        }
        sim2.destroy_stream(v).unwrap();
    });
    assert_eq!(a.parked_free_bytes(), 0, "the batch waits in the user's outbox");
    user.exit(); // its outbox's batch is parked: no call on its stream can fence it
    assert_eq!(a.parked_free_bytes(), 5 * SIZE);
    // The owner's superblock holds the five blocks until the parked frees arrive, which is
    // after a synchronise: then, taken in, it is empty and goes back.
    owner.run(|a| a.flush().unwrap());
    a.trim(false).unwrap();
    assert!(a.stats().arena_held_bytes > 0, "the owner's blocks came back unfenced");
    a.trim(true).unwrap();
    assert_eq!(a.parked_free_bytes(), 0);
    owner.run(|a| a.flush().unwrap());
    a.trim(false).unwrap();
    assert_eq!(a.stats().arena_held_bytes, 0, "the parked frees arrived after the synchronise");
    owner_reuses(&owner, &sim, 64);
    drop(owner);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Frees on one stream more than a thread batches for: the last stream's free evicts no batch
/// (an evicted batch could not be fenced outside a call on its stream, and would be parked
/// until a device synchronise); it is sent at once, alone, under one event recorded in its own
/// call. Nothing is parked, no synchronise is made, and the owner's reuse of that block waits
/// for the stream's work on it (the race checker; the mutation `user_free_alone_unfenced`,
/// which sends it unfenced, fails here).
#[test]
fn a_free_on_a_stream_past_the_batched_ones_is_sent_alone_under_its_own_event() {
    let n = cuarena::MAX_USER_BATCHES + 1;
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned_blocks(&owner, &sim, n, 3);
    let streams: Vec<Stream> = (0..n).map(|_| sim.create_stream()).collect();
    let before = a.stats();
    for (i, (p, &s)) in blocks.iter().zip(&streams).enumerate() {
        sim.stream_wait_event(s, ready).unwrap();
        let hold = if i == n - 1 { Duration::from_millis(30) } else { Duration::ZERO };
        sim.hold_and_check(p.0, SIZE, 3, hold, s).unwrap();
        a.deallocate(*p, SIZE, s).unwrap();
    }
    let (after, parked) = (a.stats(), a.parked_free_bytes());
    // The owner takes the last free in and reuses everything it can while that stream's work
    // still runs: the block must not be among what it writes before the work is done.
    owner_reuses(&owner, &sim, 64);
    let v = sim.violations();
    assert!(v.is_empty(), "the owner reused the block under the stream's running work: {v:?}");
    assert_eq!(parked, 0, "nothing parked");
    assert_eq!(after.fences_recorded - before.fences_recorded, 1, "one event, for the last free: {after:?}");
    assert_eq!(after.host_syncs, before.host_syncs, "{after:?}");
    a.trim(true).unwrap();
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    drop(owner);
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn a_remote_free_on_a_capturing_user_stream_is_refused_and_changes_nothing() {
    let sim = host(0);
    let a = alloc_with(&sim, small());
    let owner = Worker::new(&a);
    let (blocks, ready) = owned_blocks(&owner, &sim, 1, 4);
    let u = sim.create_stream();
    sim.stream_wait_event(u, ready).unwrap();
    sim.begin_capture(u).unwrap();
    let r = a.deallocate(blocks[0], SIZE, u);
    assert!(matches!(r, Err(Error::StreamCapturing { .. })), "{r:?}");
    sim.end_capture(u).unwrap();
    // Nothing changed: the block is still live, and its free is accepted now.
    assert_eq!(a.stats().deallocations, 0);
    a.deallocate(blocks[0], SIZE, u).unwrap();
    a.flush().unwrap();
    sim.synchronize();
    sim.destroy_stream(u).unwrap();
    drop(owner);
    assert_all_returned(&a, Some(&sim), 0);
}

/// A parked arena (its thread exited holding a live block X on its user stream) has no owner
/// to take in what is sent to it. An out-of-memory reclaim that reaches it after its burial
/// step (the thread parked meanwhile) dissolves its superblock, so X becomes the pool's
/// (`from_arena`, its freed flag in transit), while another thread's free of X, which read the
/// old owner, is on its way: its batch lands in the parked arena's inbox. X is then handed out
/// by the pool, held by no arena and in no parked batch, until a flush (or a burial) takes the
/// inbox in and sends X to the pool. (The end-of-test check once missed this: a CI failure of
/// `adversarial_s10::user_stream_fast_frees_race_reclaimers_and_cross_thread_frees`.)
#[test]
fn a_free_sent_to_a_parked_arena_after_a_reclaim_took_its_block_waits_for_a_flush() {
    use cuarena_testkit::hooked::{EventHook, Stall};
    use cuarena_testkit::{HookedDevice, Hooks};
    let sim = host(0);
    // The reclaimer stops after its own arena's fence (past the burial of parked arenas), the
    // freer at its batch's fence (after it read X's owner).
    let (reclaimer, freer) = (Stall::new(), Stall::new());
    let (r2, f2) = (reclaimer.clone(), freer.clone());
    let record: EventHook = Box::new(move |sim, e, s| {
        let r = sim.record_event(e, s);
        r2.here(true);
        f2.here(true);
        r
    });
    let dev = HookedDevice::new(sim.clone(), Hooks { record_event: Some(record), ..Hooks::default() });
    // One chunk of 1 MiB; a pool request of 768 KiB finds no room while two superblocks are lent.
    let cfg = small().large_max(128 << 10).max_bytes(1 << 20).batch_blocks(1).build().unwrap();
    let a = Allocator::new(dev, cfg).unwrap();
    let s = sim.create_stream();
    let owner = Worker::new(&a);
    let x = owner.run(move |a| a.allocate(SIZE, s).unwrap());
    let (ar, rr) = (a.clone(), reclaimer.clone());
    let reclaim = std::thread::spawn(move || {
        let p = ar.allocate(SIZE, Stream::PER_THREAD).unwrap();
        ar.deallocate(p, SIZE, Stream::PER_THREAD).unwrap(); // its arena holds a free superblock
        rr.arm();
        if let Ok(p) = ar.allocate(768 << 10, Stream::PER_THREAD) {
            ar.deallocate(p, 768 << 10, Stream::PER_THREAD).unwrap();
        }
        ar.release_thread().unwrap();
    });
    reclaimer.wait_stalled();
    owner.exit(); // parked now, holding X, after the reclaimer's burial step
    assert!(a.parked_bytes() > 0);
    let (af, ff, fs) = (a.clone(), freer.clone(), sim.clone());
    let free = std::thread::spawn(move || {
        let m = fs.create_stream();
        ff.arm();
        af.deallocate(x, SIZE, m).unwrap(); // a batch of one: sent under an event on `m`
        af.release_thread().unwrap();
        m
    });
    freer.wait_stalled();
    reclaimer.release(); // dissolves the parked arena's superblock: X is the pool's now
    reclaim.join().unwrap();
    assert_eq!(a.parked_bytes(), 0, "the reclaim took the parked arena's superblock");
    freer.release(); // X's free lands in the parked arena's inbox
    let m = free.join().unwrap();
    let held = |a: &Allocator| a.pool_used_ranges().iter().any(|&(p, _, sb)| p == x.0 && !sb);
    assert!(held(&a), "X waits in the parked arena's inbox, the pool's block");
    assert_eq!((a.parked_bytes(), a.parked_free_bytes()), (0, 0), "counted nowhere else");
    a.flush().unwrap(); // parked arenas take in what was sent to them
    assert!(!held(&a), "the flush sent X's free to the pool");
    sim.destroy_stream(s).unwrap();
    sim.destroy_stream(m).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}
