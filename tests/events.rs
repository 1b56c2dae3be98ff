//! The allocator's CUDA events: `trim` destroys the idle ones (`EventPool::shrink`), and none
//! is used after it is destroyed.
//!
//! The simulator refuses any use of a destroyed event and records it as a violation
//! (`HostDevice::destroy_event`), and counts the events alive (`HostDevice::live_events`).

use std::sync::mpsc;

use cuarena::{Allocator, DeviceAddr, Stream};
use cuarena_testkit::HostDevice;

mod common;
use common::*;

const BLOCK: usize = 4096;

/// `threads` threads each allocate `per_thread` blocks on their per-thread streams, half freed
/// by another thread (remote frees, batched under one event per batch) and half by the owner
/// on a user stream of its own (cross-stream frees, one event per batch too), while the
/// simulated device completes work late. Every block is tagged on its stream and checked by
/// the next user.
fn burst(a: &Allocator, sim: &HostDevice, threads: usize, per_thread: usize, tag0: u32) {
    let (tx, rx) = mpsc::channel::<Vec<(DeviceAddr, u32)>>();
    let live = std::sync::Arc::new(Live::default());
    std::thread::scope(|s| {
        for t in 0..threads {
            let (a, sim, tx, live) = (a.clone(), sim.clone(), tx.clone(), live.clone());
            s.spawn(move || {
                let own = sim.create_stream();
                let mut mine = Vec::new();
                let mut theirs = Vec::new();
                for i in 0..per_thread {
                    let p = a.allocate(BLOCK, Stream::PER_THREAD).unwrap();
                    live.insert(p, BLOCK);
                    let t = tag0 + (t * per_thread + i) as u32;
                    tag(&sim, p, BLOCK, t, Stream::PER_THREAD);
                    if i % 2 == 0 { mine.push((p, t)) } else { theirs.push((p, t)) }
                }
                // The user stream's work is ordered after the tags by a host synchronise (the
                // free's promise), then its frees are fenced on it.
                sim.synchronize();
                for (p, t) in mine {
                    check(&sim, p, BLOCK, t, own);
                    live.remove(p);
                    a.deallocate(p, BLOCK, own).unwrap();
                }
                tx.send(theirs).unwrap();
                a.flush().unwrap();
                sim.synchronize();
                a.release_thread().unwrap();
                sim.destroy_stream(own).unwrap();
            });
        }
        drop(tx);
        // This thread frees the others' blocks on its per-thread stream.
        for blocks in rx {
            for (p, t) in blocks {
                check(sim, p, BLOCK, t, Stream::PER_THREAD);
                live.remove(p);
                a.deallocate(p, BLOCK, Stream::PER_THREAD).unwrap();
            }
        }
        a.flush().unwrap();
    });
    live.assert_clean();
}

/// A burst of fences leaves its events idle in the pool; a trim destroys them, and the
/// allocator goes on (a second burst, the same checks) using none of them. The mutation
/// `shrink_leaks_events` (taken out of the pool, not destroyed) must fail this.
#[test]
fn trim_destroys_the_events_a_burst_of_fences_left_idle() {
    let sim = host(300);
    let a = alloc_with(&sim, small());
    burst(&a, &sim, 8, 512, 1);
    sim.synchronize();
    let before = sim.live_events();
    // 8 threads × 256 frees each way, at most 64 blocks a batch: at least 64 batches, so many
    // events were in flight at once behind a late device.
    assert!(before >= 16, "the burst made only {before} events: the test does not test");
    a.trim(true).unwrap();
    let after = sim.live_events();
    eprintln!("events alive: {before} before the trim, {after} after");
    // What may stay: an event the legacy action holds (none here) and fences still held by
    // memory that is not free (none: every block was freed and the chunks are released).
    assert!(after <= 1, "{after} of {before} events alive after a blocking trim");

    burst(&a, &sim, 8, 512, 1 << 20);
    all_back(&a, &sim);
    let s = a.stats();
    assert!(s.fences_recorded > 0);
    drop(a);
    all_events_destroyed(&sim);
}

/// A trim while fences are in flight and the legacy stream's action holds its event: only
/// idle events are destroyed. Memory freed remotely and on the legacy stream is reused after
/// the trim (a wait or a poll on its fence, the legacy action again); the simulator flags any
/// use of a destroyed event. The mutation `legacy_event_lent` (the legacy action's event also
/// put back in the pool as idle) must fail this.
#[test]
fn a_trim_destroys_no_event_a_fence_or_the_legacy_action_still_holds() {
    let sim = host(1000);
    let a = alloc_with(&sim, small());
    for round in 0..6u32 {
        // Legacy-stream churn: kept-back frees, made reusable by a legacy action.
        let qs: Vec<_> = (0..300).map(|_| a.allocate(BLOCK, Stream::LEGACY).unwrap()).collect();
        for &q in &qs {
            a.deallocate(q, BLOCK, Stream::LEGACY).unwrap();
        }
        // Remote frees in flight: another thread's blocks, freed here while the device is
        // still running their tagged work, then reused by their owner after the trim.
        let (tx, rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (b, sim2) = (a.clone(), sim.clone());
        let owner = std::thread::spawn(move || {
            let ps: Vec<_> = (0..200)
                .map(|i| {
                    let p = b.allocate(BLOCK, Stream::PER_THREAD).unwrap();
                    tag(&sim2, p, BLOCK, round * 1000 + i, Stream::PER_THREAD);
                    p
                })
                .collect();
            tx.send(ps).unwrap();
            go_rx.recv().unwrap();
            // Reuse, behind the remote frees' fences.
            let qs: Vec<_> = (0..400)
                .map(|i| {
                    let p = b.allocate(BLOCK, Stream::PER_THREAD).unwrap();
                    tag(&sim2, p, BLOCK, 1 << 30 | (round * 1000 + i), Stream::PER_THREAD);
                    p
                })
                .collect();
            for q in qs {
                b.deallocate(q, BLOCK, Stream::PER_THREAD).unwrap();
            }
            b.release_thread().unwrap();
        });
        let user = sim.create_stream();
        for p in rx.recv().unwrap() {
            a.deallocate(p, BLOCK, user).unwrap();
        }
        a.flush().unwrap();
        a.trim(false).unwrap();
        go_tx.send(()).unwrap();
        owner.join().unwrap();
        // And the legacy stream again, after the trim: its action's event must be alive.
        let qs: Vec<_> = (0..300).map(|_| a.allocate(BLOCK, Stream::LEGACY).unwrap()).collect();
        for &q in &qs {
            a.deallocate(q, BLOCK, Stream::LEGACY).unwrap();
        }
        a.trim(false).unwrap();
        sim.synchronize();
        sim.destroy_stream(user).unwrap();
    }
    all_back(&a, &sim);
    drop(a);
    all_events_destroyed(&sim);
}
