//! Eleventh session's attacks (a helper's) on the shared legacy actions: a thread's own frees
//! on the legacy stream kept back in halves (`legacy_kept.rs`), the first half published under
//! a ticket (`LegacyAction::request`) and released without a driver call once any thread's
//! legacy action issued after that ticket covers it (`LegacyAction::issue`/`covers`).
//!
//! The property every test leans on: a kept-back block is handed out again only after a legacy
//! action queued (in the device's order) after its last use; the simulator's race checker sees
//! a reuse on another per-thread stream that is not. Plus: nothing overlaps, nothing is lost
//! (after exits, trims and out-of-memory reclaims every byte comes back), bad frees of kept or
//! sealed blocks are refused.

#![allow(clippy::type_complexity)]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Stream};
use cuarena_testkit::{HookedDevice, Hooks, HostDevice, Stall, assert_all_returned, host_allocator};

mod common;
use common::*;

const K64: usize = 64 << 10;

/// `use_on_another_thread` for blocks of one length.
fn use_elsewhere(sim: &HostDevice, blocks: &[DeviceAddr], len: usize, tag0: u32, hold_ms: u64) {
    let blocks: Vec<_> = blocks.iter().map(|&p| (p, len)).collect();
    use_on_another_thread(sim, &blocks, tag0, hold_ms);
}

fn assert_no_race(sim: &HostDevice, what: &str) {
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{what}: {} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0, "{what}: a block was overwritten while in use");
}

/// A thread frees a whole batch of its own on the legacy stream (its own action).
fn other_threads_action(a: &Allocator, n: usize) {
    on_thread(a, move |a| {
        let qs: Vec<_> = (0..n).map(|_| a.allocate(4096, Stream::LEGACY).unwrap()).collect();
        for q in qs {
            a.deallocate(q, 4096, Stream::LEGACY).unwrap();
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 1. The read-before-call rule of `LegacyAction::issue`.

/// Thread C's legacy action is queued (its driver call made) and C then stalls before raising
/// `covered`. Meanwhile B uses A's blocks on B's per-thread stream, *after* C's action in the
/// device's order, and A frees them on the legacy stream, publishing half a batch. C's action
/// must not cover A's ticket: when A's batch is whole it costs A's own action, and A's reuse on
/// its per-thread stream is ordered after B's use. (An `issue` that read `requests` after its
/// call, or raised `covered` to the current count, would let A reuse the blocks unordered: the
/// mutation `legacy_read_after_call` must fail this.)
#[test]
fn an_action_queued_before_a_ticket_does_not_cover_it_even_if_raised_after() {
    within(60, || {
        let sim = host(0);
        let stall = Stall::new();
        let hooks = Hooks {
            stream_wait_event: Some(Box::new({
                let stall = stall.clone();
                move |sim: &HostDevice, e, s: Stream| {
                    let r = sim.stream_wait_event(s, e); // the action is queued ...
                    stall.here(s.is_legacy()); // ... and C stalls before `covered` is raised
                    r
                }
            })),
            ..Hooks::default()
        };
        let a = Allocator::new(
            HookedDevice::new(sim.clone(), hooks),
            Config::builder().legacy_batch_blocks(4).build().unwrap(),
        )
        .unwrap();
        let ps: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        let (a2, st2) = (a.clone(), stall.clone());
        let c = std::thread::spawn(move || {
            let q = a2.allocate(4096, Stream::LEGACY).unwrap();
            a2.deallocate(q, 4096, Stream::LEGACY).unwrap();
            st2.arm();
            a2.flush().unwrap(); // C's action: stalls after its call
            a2.release_thread().unwrap();
        });
        stall.wait_stalled();
        // B's use comes after C's action on the device.
        use_elsewhere(&sim, &ps, K64, 7, 40);
        a.deallocate(ps[0], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[1], K64, Stream::LEGACY).unwrap(); // half of 4: published
        stall.release();
        c.join().unwrap();
        let w1 = a.stats().fence_waits;
        a.deallocate(ps[2], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[3], K64, Stream::LEGACY).unwrap(); // whole: settled
        let w2 = a.stats().fence_waits;
        assert_eq!(w2 - w1, 1, "C's action came before A's ticket: A's whole batch costs A's own action");
        let again: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        assert!(again.contains(&ps[0]), "{again:?} {ps:?}");
        for q in &again {
            sim.fill(q.0, K64, 1, Stream::PER_THREAD).unwrap();
        }
        assert_no_race(&sim, "reuse after an action queued before the ticket");
        for q in again {
            a.deallocate(q, K64, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// Thread C reads the ticket count after A published half a batch (so its action will cover
/// it) and stalls before its driver call. A's batch then becomes whole while C's action is not
/// yet queued: A must not take the half as covered (the mutation `legacy_covered_early`, which
/// raises `covered` before the call, lets A reuse the blocks before any action follows B's use).
#[test]
fn a_ticket_is_covered_only_once_the_action_is_queued() {
    within(60, || {
        let sim = host(0);
        let stall = Stall::new();
        let hooks = Hooks {
            stream_wait_event: Some(Box::new({
                let stall = stall.clone();
                move |sim: &HostDevice, e, s: Stream| {
                    stall.here(s.is_legacy()); // C stalls before its call
                    sim.stream_wait_event(s, e)
                }
            })),
            ..Hooks::default()
        };
        let a = Allocator::new(
            HookedDevice::new(sim.clone(), hooks),
            Config::builder().legacy_batch_blocks(4).build().unwrap(),
        )
        .unwrap();
        // A first action records the event every later one waits on: C's is then one wait
        // (were it C's first, its record would already order B's use).
        other_threads_action(&a, 4);
        let ps: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        use_elsewhere(&sim, &ps, K64, 7, 60);
        a.deallocate(ps[0], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[1], K64, Stream::LEGACY).unwrap(); // published
        let (a2, st2) = (a.clone(), stall.clone());
        let c = std::thread::spawn(move || {
            let q = a2.allocate(4096, Stream::LEGACY).unwrap();
            a2.deallocate(q, 4096, Stream::LEGACY).unwrap();
            st2.arm();
            a2.flush().unwrap(); // reads the count (A's ticket included), stalls before the call
            a2.release_thread().unwrap();
        });
        stall.wait_stalled();
        a.deallocate(ps[2], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[3], K64, Stream::LEGACY).unwrap(); // whole: settled
        let again: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        for q in &again {
            sim.fill(q.0, K64, 1, Stream::PER_THREAD).unwrap();
        }
        stall.release();
        c.join().unwrap();
        assert_no_race(&sim, "reuse while the covering action was not yet queued");
        for q in again {
            a.deallocate(q, K64, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 2. Failed actions.

/// A legacy action that fails (the wait refused) covers nothing: neither another thread's
/// published half nor the issuer's own frees, which stay kept back (never handed out) until an
/// action succeeds; then everything comes back.
#[test]
fn a_failed_action_covers_nothing_and_keeps_its_frees_back() {
    within(60, || {
        let sim = host(0);
        let fail = Arc::new(AtomicBool::new(false));
        let hooks = Hooks {
            stream_wait_event: Some(Box::new({
                let fail = fail.clone();
                move |sim: &HostDevice, e, s: Stream| {
                    if s.is_legacy() && fail.load(Ordering::SeqCst) {
                        return Err(Error::Driver { call: "cuStreamWaitEvent", code: 999 });
                    }
                    sim.stream_wait_event(s, e)
                }
            })),
            ..Hooks::default()
        };
        let a = Allocator::new(
            HookedDevice::new(sim.clone(), hooks),
            Config::builder().legacy_batch_blocks(4).build().unwrap(),
        )
        .unwrap();
        // (a) C's action fails after A published a half: A's batch costs A's own action.
        let ps: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        use_elsewhere(&sim, &ps, K64, 7, 40);
        a.deallocate(ps[0], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[1], K64, Stream::LEGACY).unwrap();
        let c = Worker::new(&a);
        let cq: Vec<DeviceAddr> =
            c.run(|a| (0..4).map(|_| a.allocate(4096, Stream::LEGACY).unwrap()).collect());
        fail.store(true, Ordering::SeqCst);
        {
            let cq = cq.clone();
            c.run(move |a| {
                for q in cq {
                    a.deallocate(q, 4096, Stream::LEGACY).unwrap(); // C's action fails
                }
            });
        }
        fail.store(false, Ordering::SeqCst);
        assert!(a.take_deferred_error().is_some(), "C's failed action is reported");
        let w0 = a.stats().fence_waits;
        a.deallocate(ps[2], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[3], K64, Stream::LEGACY).unwrap();
        assert_eq!(a.stats().fence_waits - w0, 1, "a failed action covered A's half");
        let again: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        for q in &again {
            sim.fill(q.0, K64, 1, Stream::PER_THREAD).unwrap();
        }
        assert_no_race(&sim, "after another thread's failed action");
        // C's kept-back frees go with C's next successful action.
        c.run(move |a| {
            let got: Vec<_> = (0..4).map(|_| a.allocate(4096, Stream::LEGACY).unwrap()).collect();
            for q in got {
                a.deallocate(q, 4096, Stream::LEGACY).unwrap();
            }
            a.flush().unwrap();
        });
        c.exit();
        // (b) A's own action fails: the whole batch stays kept back, and A's allocations of the
        // same size get other memory until an action succeeds.
        let b: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        use_elsewhere(&sim, &b, K64, 20, 40);
        fail.store(true, Ordering::SeqCst);
        for p in &b {
            a.deallocate(*p, K64, Stream::LEGACY).unwrap();
        }
        let during: Vec<_> = (0..8).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        for q in &during {
            assert!(!b.contains(q), "a kept-back block handed out while its action failed: {q:?}");
            sim.fill(q.0, K64, 2, Stream::PER_THREAD).unwrap();
        }
        fail.store(false, Ordering::SeqCst);
        assert!(a.take_deferred_error().is_some(), "A's failed action is reported");
        for q in during {
            a.deallocate(q, K64, Stream::LEGACY).unwrap();
        }
        a.flush().unwrap();
        let after: Vec<_> = (0..12).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        for q in &after {
            sim.fill(q.0, K64, 3, Stream::PER_THREAD).unwrap();
        }
        assert_no_race(&sim, "after A's own failed action");
        for q in after.into_iter().chain(again) {
            a.deallocate(q, K64, Stream::LEGACY).unwrap();
        }
        let _ = a.take_deferred_error();
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 3. Many threads sharing actions.

/// Four owners each free their legacy blocks on the legacy stream right after a helper thread
/// used them on the helper's per-thread stream (a hold still running), and write every block
/// they get back on their own per-thread stream at once. Batches of 8 with four owners: most
/// sealed halves are released by another owner's action. Every reuse must be ordered after the
/// helper's use (the race checker), nothing may overlap, and everything comes back.
#[test]
fn owners_sharing_actions_never_reuse_a_block_before_an_action_after_its_use() {
    within(120, || {
        let sim = host(20);
        let cfg = small().legacy_batch_blocks(8).large_max(256 << 10).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let live = Arc::new(Live::default());
        let tags = Arc::new(AtomicU32::new(1));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, sim, live, tags) = (a.clone(), sim.clone(), live.clone(), tags.clone());
            hs.push(std::thread::spawn(move || {
                let helper = Worker::new(&a);
                let ev = sim.create_event().unwrap();
                let mut x = 0xdead_beef ^ (t * 0x9e37_79b9) | 1;
                for _round in 0..60 {
                    let n = 1 + (rng(&mut x) % 6) as usize;
                    let mut mine = Vec::new();
                    for _ in 0..n {
                        let sz = [4096, 16 << 10, K64, 200 << 10][(rng(&mut x) % 4) as usize];
                        let p = a.allocate(sz, Stream::LEGACY).unwrap();
                        live.insert(p, sz);
                        // The owner's first write, on its own per-thread stream: a race with
                        // the previous life's helper use unless a legacy action came between.
                        sim.write_tag(p.0, 256, 1, Stream::PER_THREAD).unwrap();
                        mine.push((p, sz));
                    }
                    // Hand them to the helper's per-thread stream behind an event.
                    sim.record_event(ev, Stream::PER_THREAD).unwrap();
                    let hold = Duration::from_micros(200 + rng(&mut x) % 800);
                    let (sim2, m2, tg) =
                        (sim.clone(), mine.clone(), tags.fetch_add(n as u32, Ordering::Relaxed));
                    helper.run(move |_| {
                        sim2.stream_wait_event(Stream::PER_THREAD, ev).unwrap();
                        for (i, (p, _)) in m2.iter().enumerate() {
                            sim2.hold_and_check(p.0, 256, tg + i as u32, hold, Stream::PER_THREAD).unwrap();
                        }
                    });
                    // Freed on the legacy stream while the helper's uses run.
                    for (p, sz) in mine {
                        live.remove(p);
                        a.deallocate(p, sz, Stream::LEGACY).unwrap();
                    }
                }
                helper.exit();
                a.release_thread().unwrap();
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
        live.assert_clean();
        let s = a.stats();
        eprintln!(
            "shared actions: fence_waits {} fences_recorded {} deallocations {}",
            s.fence_waits, s.fences_recorded, s.deallocations
        );
        assert_no_race(&sim, "owners sharing actions");
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 4. Threads exiting with sealed halves.

/// A thread exits (or releases its arenas) with a sealed half and an open rest kept back, the
/// sealed half covered by another thread's action or not. Both go to the pool behind a lazy
/// legacy fence: another thread that takes that memory on its per-thread stream is ordered
/// after the blocks' last use, and every byte comes back.
#[test]
fn a_thread_exiting_with_a_sealed_half_gives_it_back_fenced() {
    for (release, covered) in [(true, false), (false, false), (true, true), (false, true)] {
        let what = format!("release {release} covered {covered}");
        let sim = host(0);
        let cfg = small().legacy_batch_blocks(8).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (sealed_tx, sealed_rx) = std::sync::mpsc::channel::<()>();
        let (a2, sim2) = (a.clone(), sim.clone());
        let h = std::thread::spawn(move || {
            let ps: Vec<_> = (0..6).map(|_| a2.allocate(K64, Stream::LEGACY).unwrap()).collect();
            use_elsewhere(&sim2, &ps, K64, 100, 40);
            for p in &ps {
                a2.deallocate(*p, K64, Stream::LEGACY).unwrap(); // 4 sealed, 2 open
            }
            sealed_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            if release {
                a2.release_thread().unwrap();
            }
        });
        sealed_rx.recv().unwrap();
        if covered {
            other_threads_action(&a, 8);
        }
        go_tx.send(()).unwrap();
        h.join().unwrap();
        // Take everything the pool has, on this thread's per-thread stream, and write it.
        let qs: Vec<_> = (0..16).map(|_| a.allocate_per_thread(K64).unwrap()).collect();
        for q in &qs {
            sim.fill(q.0, K64, 9, Stream::PER_THREAD).unwrap();
        }
        let ls: Vec<_> = (0..16).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        for q in &ls {
            sim.fill(q.0, K64, 9, Stream::PER_THREAD).unwrap();
        }
        assert_no_race(&sim, &what);
        for q in qs {
            a.deallocate_per_thread(q, K64).unwrap();
        }
        for q in ls {
            a.deallocate(q, K64, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Reclaim of a live, idle owner's sealed half.

/// The owner (alive, idle) keeps a sealed half spread over two superblocks and an open rest.
/// `trim(false)` by another thread takes the superblock with no used block (part of the sealed
/// half goes with it, behind a lazy legacy fence), leaving the sealed half partly emptied under
/// its ticket; another thread's action then covers that ticket and the owner goes on: its next
/// allocations take the rest of the sealed half back, its frees of blocks taken away are
/// refused, and every reuse, by the trimming thread or the owner, is ordered after the use.
#[test]
fn a_trim_takes_part_of_an_idle_owners_sealed_half_and_the_owner_goes_on() {
    within(60, || {
        let sim = host(0);
        let cfg = small().legacy_batch_blocks(6).keep_empty(0).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let owner = Worker::new(&a);
        let ps: Vec<DeviceAddr> =
            owner.run(|a| (0..8).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect());
        let mut by_sb: std::collections::BTreeMap<u64, Vec<DeviceAddr>> = Default::default();
        for p in &ps {
            by_sb.entry(p.0 >> 18).or_default().push(*p);
        }
        let sbs: Vec<Vec<DeviceAddr>> = by_sb.into_values().collect();
        assert_eq!(sbs.len(), 2, "two superblocks of four: {ps:?}");
        let (s1, s2) = (sbs[0].clone(), sbs[1].clone());
        use_elsewhere(&sim, &ps, K64, 50, 60);
        // Sealed: s1[0], s1[1], s2[0] (half of 6); open: s1[2], s1[3].
        let order = vec![s1[0], s1[1], s2[0], s1[2], s1[3]];
        {
            let order = order.clone();
            owner.run(move |a| {
                for p in order {
                    a.deallocate(p, K64, Stream::LEGACY).unwrap();
                }
            });
        }
        // Another thread trims: s1 holds no used block.
        let held0 = a.stats().arena_held_bytes;
        on_thread(&a, |a| a.trim(false).unwrap());
        let held1 = a.stats().arena_held_bytes;
        assert_eq!(held0 - held1, 256 << 10, "the superblock of kept-back blocks goes back");
        // A block the trim took (a free range of the pool now, not yet lent again): a second
        // free of it is refused.
        let refused = {
            let p = s1[0];
            owner.run(move |a| is_invalid(&a.deallocate(p, K64, Stream::LEGACY)))
        };
        assert!(refused, "a free of a block the trim took is refused");
        // The trimming memory reused on yet another per-thread stream.
        let sim2 = sim.clone();
        let qs: Vec<DeviceAddr> = on_thread(&a, move |a| {
            let qs: Vec<_> = (0..8).map(|_| a.allocate_per_thread(K64).unwrap()).collect();
            for q in &qs {
                sim2.fill(q.0, K64, 4, Stream::PER_THREAD).unwrap();
            }
            qs
        });
        // A third thread's action covers the (partly emptied) sealed half's ticket.
        other_threads_action(&a, 6);
        let sim3 = sim.clone();
        let again: Vec<DeviceAddr> = owner.run(move |a| {
            let again: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
            for q in &again {
                sim3.fill(q.0, K64, 5, Stream::PER_THREAD).unwrap();
            }
            again
        });
        let live = Live::default();
        for q in qs.iter().chain(&again).chain(&s2[1..]) {
            live.insert(*q, K64);
        }
        live.assert_clean();
        assert_no_race(&sim, "after a trim took part of a sealed half");
        let s2b = s2.clone();
        owner.run(move |a| {
            for q in again.into_iter().chain(s2b[1..].iter().copied()) {
                a.deallocate(q, K64, Stream::LEGACY).unwrap();
            }
        });
        owner.exit();
        on_thread(&a, move |a| {
            for q in qs {
                a.deallocate_per_thread(q, K64).unwrap();
            }
        });
        let _ = a.take_deferred_error();
        assert_all_returned(&a, Some(&sim), 1);
    });
}

/// Out of memory on another thread dissolves a live, idle owner's superblocks that hold its
/// sealed half and used blocks. The owner then frees its used blocks (now the pool's) on the
/// legacy stream, frees and allocates more: nothing overlaps, no reuse is unordered, and all
/// memory comes back.
#[test]
fn out_of_memory_dissolves_an_idle_owners_sealed_half_and_the_owner_goes_on() {
    within(60, || {
        let sim = host(0);
        let cfg = small().legacy_batch_blocks(8).max_bytes(2 << 20).build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let owner = Worker::new(&a);
        let ps: Vec<DeviceAddr> =
            owner.run(|a| (0..32).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect());
        use_elsewhere(&sim, &ps, K64, 200, 60);
        // Every other block freed: 4 sealed, 2 open, in superblocks that keep used blocks.
        let freed: Vec<_> = ps.iter().copied().step_by(5).take(6).collect();
        {
            let f = freed.clone();
            owner.run(move |a| {
                for p in f {
                    a.deallocate(p, K64, Stream::LEGACY).unwrap();
                }
            });
        }
        // The cap is taken by the owner's superblocks: another thread needs 6 of the kept-back
        // 64 KiB blocks' room, which only a dissolving reclaim gives.
        let sim2 = sim.clone();
        let qs: Vec<DeviceAddr> = on_thread(&a, move |a| {
            let mut qs = Vec::new();
            for _ in 0..6 {
                match a.allocate_per_thread(K64) {
                    Ok(q) => {
                        sim2.fill(q.0, K64, 4, Stream::PER_THREAD).unwrap();
                        qs.push(q);
                    }
                    Err(Error::OutOfMemory { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            qs
        });
        assert!(!qs.is_empty(), "out of memory took kept-back frees back");
        let live = Live::default();
        for q in &qs {
            live.insert(*q, K64);
        }
        let rest: Vec<_> = ps.iter().copied().filter(|p| !freed.contains(p)).collect();
        for p in &rest {
            live.insert(*p, K64);
        }
        live.assert_clean();
        let sim3 = sim.clone();
        owner.run(move |a| {
            // The owner's used blocks (maybe the pool's now) freed on the legacy stream, some
            // fresh blocks freed and allocated again.
            for p in rest {
                a.deallocate(p, K64, Stream::LEGACY).unwrap();
            }
            let again: Vec<_> = (0..12).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
            for q in &again {
                sim3.fill(q.0, K64, 6, Stream::PER_THREAD).unwrap();
            }
            for q in again {
                a.deallocate(q, K64, Stream::LEGACY).unwrap();
            }
        });
        owner.exit();
        on_thread(&a, move |a| {
            for q in qs {
                a.deallocate_per_thread(q, K64).unwrap();
            }
        });
        assert_no_race(&sim, "after out of memory dissolved a sealed half");
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 6. Bad frees of sealed blocks.

/// Sealed (published, not yet covered) and open kept-back blocks freed again, on every kind of
/// stream, by the owner and by another thread, or with a wrong size: each refused, nothing
/// changes, and after the half is covered and merged they are refused again (free blocks).
#[test]
fn frees_of_sealed_and_open_kept_back_blocks_again_are_refused() {
    within(60, || {
        let sim = host(0);
        let a =
            host_allocator(sim.clone(), Config::builder().legacy_batch_blocks(8).build().unwrap()).unwrap();
        let user = sim.create_stream();
        let ps: Vec<_> = (0..6).map(|_| a.allocate(1000, Stream::LEGACY).unwrap()).collect();
        for p in &ps[..5] {
            a.deallocate(*p, 1000, Stream::LEGACY).unwrap(); // 4 sealed, 1 open
        }
        let mut bad = 0u64;
        let attack = |a: &Allocator, bad: &mut u64| {
            for &p in &[ps[0], ps[3], ps[4]] {
                for (size, s) in [
                    (1000, Stream::LEGACY),
                    (1000, Stream::PER_THREAD),
                    (1000, user),
                    (2000, Stream::LEGACY),
                    (300, Stream::LEGACY),
                    (4096, Stream::PER_THREAD),
                ] {
                    let r = a.deallocate(p, size, s);
                    assert!(is_invalid(&r), "{p:?} {size} {s:?}: {r:?}");
                    *bad += 1;
                }
                let r = on_thread(a, move |a| {
                    [a.deallocate(p, 1000, Stream::LEGACY), a.deallocate(p, 1000, Stream::PER_THREAD)]
                        .iter()
                        .all(is_invalid)
                });
                assert!(r, "another thread's second free of {p:?} refused");
                *bad += 2;
            }
        };
        attack(&a, &mut bad);
        // Cover the sealed half, settle it (a whole batch: 4 sealed + 4 open).
        other_threads_action(&a, 8);
        a.deallocate(ps[5], 1000, Stream::LEGACY).unwrap();
        let more: Vec<_> = (0..3).map(|_| a.allocate(1000, Stream::LEGACY).unwrap()).collect();
        for q in &more {
            a.deallocate(*q, 1000, Stream::LEGACY).unwrap();
        }
        attack(&a, &mut bad);
        a.flush().unwrap();
        attack(&a, &mut bad);
        sim.synchronize();
        let _ = a.take_deferred_error();
        assert_all_returned(&a, Some(&sim), bad);
        sim.destroy_stream(user).unwrap();
    });
}

// ---------------------------------------------------------------------------------------------
// 7. Fences skipped.

/// With fences skipped for tests no ticket is ever covered and no action issued: halves still
/// seal and settle, nothing is handed out twice, and everything comes back, after threads
/// that exit with sealed halves and trims racing them.
#[test]
fn with_fences_skipped_halves_lose_nothing_and_overlap_nothing() {
    within(60, || {
        let sim = host(0);
        let cfg =
            small().legacy_batch_blocks(8).max_bytes(8 << 20).skip_fences_for_testing().build().unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let live = Arc::new(Live::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, live) = (a.clone(), live.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0x1357_9bdf ^ (t * 0x9e37) | 1;
                for round in 0..400 {
                    let mut v = Vec::new();
                    for _ in 0..(1 + rng(&mut x) % 7) {
                        let sz = [512, 4096, 40 << 10][(rng(&mut x) % 3) as usize];
                        match a.allocate(sz, Stream::LEGACY) {
                            Ok(p) => {
                                live.insert(p, sz);
                                v.push((p, sz));
                            }
                            Err(Error::OutOfMemory { .. }) => break,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    for (p, sz) in v {
                        live.remove(p);
                        a.deallocate(p, sz, Stream::LEGACY).unwrap();
                    }
                    if round % 97 == 96 {
                        a.release_thread().unwrap();
                    }
                }
                a.release_thread().unwrap();
            }));
        }
        {
            let (a, stop) = (a.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _ = a.trim(false);
                    std::thread::sleep(Duration::from_micros(300));
                }
                a.release_thread().unwrap();
            }));
        }
        let n = hs.len();
        for (i, h) in hs.into_iter().enumerate() {
            if i == n - 1 {
                stop.store(true, Ordering::Relaxed);
            }
            h.join().unwrap();
        }
        live.assert_clean();
        assert_all_returned(&a, None, 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 8. Legacy frees mixed with per-thread and user-stream frees, cross-thread frees, reclaimers
// and exits.

#[derive(Clone, Copy)]
struct Blk {
    p: DeviceAddr,
    sz: usize,
    /// The stream of its last use (a tag), and the tag.
    s: Stream,
    t: u32,
}

/// Workers allocate on the legacy or their per-thread stream, use the blocks there, and free
/// them on the legacy stream, their per-thread stream or a user stream (after an event wait),
/// or hand them to another worker, which frees them on the legacy stream (or its per-thread
/// stream for a block last used on the legacy stream). Meanwhile a reclaimer trims and forces
/// out-of-memory reclaims under a cap, and workers release their arenas now and then.
#[test]
fn legacy_halves_mixed_with_other_frees_reclaimers_and_exits() {
    within(120, || {
        let sim = host(10);
        let cfg = small()
            .legacy_batch_blocks(8)
            .batch_blocks(8)
            .large_max(256 << 10)
            .max_bytes(10 << 20)
            .build()
            .unwrap();
        let a = host_allocator(sim.clone(), cfg).unwrap();
        let live = Arc::new(Live::default());
        let handed: Arc<Mutex<Vec<Blk>>> = Default::default();
        let stop = Arc::new(AtomicBool::new(false));
        let tags = Arc::new(AtomicU32::new(1));
        let ooms = Arc::new(AtomicU64::new(0));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, sim, live, handed, tags, ooms) =
                (a.clone(), sim.clone(), live.clone(), handed.clone(), tags.clone(), ooms.clone());
            hs.push(std::thread::spawn(move || {
                let user = sim.create_stream();
                let ev = sim.create_event().unwrap();
                let mut x = 0xfeed_f00d ^ (t * 0x9e37_79b9) | 1;
                for round in 0..150 {
                    let mut v: Vec<Blk> = Vec::new();
                    for _ in 0..(1 + rng(&mut x) % 8) {
                        let s =
                            if rng(&mut x).is_multiple_of(3) { Stream::PER_THREAD } else { Stream::LEGACY };
                        let sz = [2048, 16 << 10, K64, 160 << 10][(rng(&mut x) % 4) as usize];
                        match a.allocate(sz, s) {
                            Ok(p) => {
                                live.insert(p, sz);
                                let tg = tags.fetch_add(1, Ordering::Relaxed);
                                tag(&sim, p, sz, tg, s);
                                v.push(Blk { p, sz, s, t: tg });
                            }
                            Err(Error::OutOfMemory { .. }) => {
                                ooms.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    // Some blocks handed over by other workers: freed here.
                    let theirs: Vec<Blk> = {
                        let mut h = handed.lock().unwrap();
                        let n = h.len().min(4);
                        h.drain(..n).collect()
                    };
                    for b in theirs {
                        live.remove(b.p);
                        let s = if b.s.is_legacy() && rng(&mut x).is_multiple_of(2) {
                            Stream::PER_THREAD
                        } else {
                            Stream::LEGACY
                        };
                        a.deallocate(b.p, b.sz, s).unwrap();
                    }
                    for b in v {
                        check(&sim, b.p, b.sz, b.t, b.s);
                        match rng(&mut x) % 5 {
                            0 => handed.lock().unwrap().push(b),
                            1 if b.s.is_legacy() => {
                                live.remove(b.p);
                                a.deallocate(b.p, b.sz, Stream::PER_THREAD).unwrap();
                            }
                            2 => {
                                // On a user stream made to wait for the use's stream.
                                sim.record_event(ev, b.s).unwrap();
                                sim.stream_wait_event(user, ev).unwrap();
                                live.remove(b.p);
                                a.deallocate(b.p, b.sz, user).unwrap();
                            }
                            3 if !b.s.is_legacy() => {
                                live.remove(b.p);
                                a.deallocate(b.p, b.sz, Stream::LEGACY).unwrap();
                            }
                            _ => {
                                live.remove(b.p);
                                a.deallocate(b.p, b.sz, b.s).unwrap();
                            }
                        }
                    }
                    if round % 40 == 39 {
                        a.release_thread().unwrap();
                    }
                }
                a.release_thread().unwrap();
                user
            }));
        }
        let rec = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match k % 3 {
                        0 => {
                            let _ = a.trim(false);
                        }
                        1 => {
                            let _ = a.trim(true);
                        }
                        _ => {
                            if let Ok(p) = a.allocate(6 << 20, Stream::PER_THREAD) {
                                a.deallocate(p, 6 << 20, Stream::PER_THREAD).unwrap();
                            }
                        }
                    }
                    k += 1;
                    std::thread::sleep(Duration::from_micros(500));
                }
                a.release_thread().unwrap();
            })
        };
        let mut users = Vec::new();
        for h in hs {
            users.push(h.join().unwrap());
        }
        stop.store(true, Ordering::Relaxed);
        rec.join().unwrap();
        on_thread(&a, {
            let (handed, live) = (handed.clone(), live.clone());
            move |a| {
                for b in handed.lock().unwrap().drain(..) {
                    live.remove(b.p);
                    a.deallocate(b.p, b.sz, Stream::LEGACY).unwrap();
                }
            }
        });
        eprintln!("mixed: ooms {} stats {:?}", ooms.load(Ordering::Relaxed), a.stats());
        live.assert_clean();
        assert_no_race(&sim, "mixed frees");
        for u in users {
            sim.destroy_stream(u).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 9. An action by a thread of another allocator on the same device.

/// Two allocators over one device: an action of the second's threads is a legacy action too,
/// but it is the first's tickets it must not be trusted to cover unless it is the first's own
/// `LegacyAction`; either way the first's reuse must be ordered after the use (tickets of one
/// allocator compared with another's counter would be wrong).
/// (A sanity check, weak: the second allocator's threads also record a legacy event when they
/// release their arenas, which orders the use by itself; it fails under no mutation tried.)
#[test]
fn another_allocators_actions_do_not_confuse_the_tickets() {
    within(60, || {
        let sim = host(0);
        let cfg = || Config::builder().legacy_batch_blocks(4).build().unwrap();
        let a = host_allocator(sim.clone(), cfg()).unwrap();
        let b = host_allocator(sim.clone(), cfg()).unwrap();
        // B hands out many tickets and actions first, so its counters run far ahead of A's.
        for _ in 0..20 {
            other_threads_action(&b, 4);
        }
        let ps: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        use_elsewhere(&sim, &ps, K64, 7, 40);
        a.deallocate(ps[0], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[1], K64, Stream::LEGACY).unwrap();
        // B's action after A's ticket (in time) is a legacy action as well, but not A's.
        other_threads_action(&b, 4);
        a.deallocate(ps[2], K64, Stream::LEGACY).unwrap();
        a.deallocate(ps[3], K64, Stream::LEGACY).unwrap();
        let again: Vec<_> = (0..4).map(|_| a.allocate(K64, Stream::LEGACY).unwrap()).collect();
        for q in &again {
            sim.fill(q.0, K64, 1, Stream::PER_THREAD).unwrap();
        }
        assert_no_race(&sim, "two allocators");
        for q in again {
            a.deallocate(q, K64, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, None, 0);
        assert_all_returned(&b, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 10. The return rule when kept-back frees are merged (informational: churn of superblocks).

/// A steady working set (16 live blocks of 64 KiB, oldest freed, one allocated) on the legacy
/// stream against the per-thread stream: superblocks given back and borrowed again per 4096
/// frees. On the per-thread stream, none. Kept-back legacy frees are merged a batch at a time
/// (in a free or at the slow path, where the arena needs memory); the return rule applied there
/// gives back the superblocks that the next allocations borrow again.
#[test]
fn a_steady_legacy_working_set_does_not_churn_superblocks() {
    let run = |s: Stream| {
        let sim = host(0);
        let a = host_allocator(sim.clone(), Config::default()).unwrap();
        let mut ring: std::collections::VecDeque<DeviceAddr> =
            (0..16).map(|_| a.allocate(K64, s).unwrap()).collect();
        let s0 = a.stats();
        for _ in 0..4096 {
            let p = ring.pop_front().unwrap();
            a.deallocate(p, K64, s).unwrap();
            ring.push_back(a.allocate(K64, s).unwrap());
        }
        let s1 = a.stats();
        for p in ring {
            a.deallocate(p, K64, s).unwrap();
        }
        assert_all_returned(&a, Some(&sim), 0);
        (
            s1.superblocks_returned - s0.superblocks_returned + s1.superblocks_dissolved
                - s0.superblocks_dissolved,
            s1.superblocks_taken - s0.superblocks_taken,
            s1.fences_recorded - s0.fences_recorded,
        )
    };
    let ptds = run(Stream::PER_THREAD);
    let legacy = run(Stream::LEGACY);
    eprintln!("(given back, taken, events) ptds {ptds:?} legacy {legacy:?}");
    assert!(legacy.0 <= 4 * (ptds.0 + 1), "legacy churns superblocks: ptds {ptds:?} legacy {legacy:?}");
}
