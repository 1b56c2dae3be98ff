//! Fifteenth session's attacks (a helper's): several allocators alive in one thread, edge
//! configurations (minimum superblock, `small_max=1B`, large superblocks off, `keep_empty=0`,
//! batches of one, a cap of a few superblocks), user streams destroyed while the arena holds
//! blocks freed on them and their handles reused by new streams from several threads racing
//! trims and out-of-memory reclaims, thread exits at awkward moments (outbox, kept-back legacy
//! frees and user-stream batches pending while others free the exiting thread's blocks;
//! thread-local destructors that allocate and free), and sizes at every boundary.
//!
//! The oracles: the host device's race checker and tags, a map of live blocks (overlaps),
//! 256-byte alignment, `stats()`, and `assert_all_returned`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use cuarena::size_class::block_bytes;
use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, InvalidFree, Stream};
use cuarena_testkit::{
    HostConfig, HostDevice, allocate_until_back, assert_all_returned, assert_reuse_waits, host_allocator,
};

mod common;
use common::{Live, check, host, is_double, is_invalid, parse, rng, tag, within};

// ---------------------------------------------------------------------------------------------
// Helpers.

fn is_oom<T>(r: &cuarena::Result<T>) -> bool {
    matches!(r, Err(Error::OutOfMemory { .. }))
}

/// Makes later work on `to` wait for the work queued so far on `from` (both resolved for the
/// calling thread).
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    if from == to {
        return;
    }
    let e = sim.create_event().unwrap();
    sim.record_event(e, from).unwrap();
    sim.stream_wait_event(to, e).unwrap();
}

/// An event after the work queued so far on `s` (for another thread to wait on).
fn mark(sim: &HostDevice, s: Stream) -> Event {
    let e = sim.create_event().unwrap();
    sim.record_event(e, s).unwrap();
    e
}

/// A block a churn thread holds.
#[derive(Clone, Copy, Debug)]
struct Blk {
    p: DeviceAddr,
    size: usize,
    s: Stream,
    t: u32,
}

/// Blocks sent to one thread (address, size, and an event after their last use).
type Mailbox = Mutex<Vec<(DeviceAddr, usize, Event)>>;

/// A block handed to another thread: the event follows its last use.
struct Handoff {
    b: Blk,
    ev: Event,
}

/// Sizes around every boundary of `cfg` (and a few random ones), at most `cap` bytes.
fn size_menu(cfg: &Config, cap: usize) -> Vec<usize> {
    let (sm, lm, sb) = (cfg.small_max(), cfg.large_max(), cfg.superblock());
    let mut v = vec![
        1,
        2,
        255,
        256,
        257,
        511,
        2048,
        2049,
        sm.saturating_sub(1).max(1),
        sm,
        sm + 1,
        sm + 256,
        lm.saturating_sub(1).max(1),
        lm,
        lm + 1,
        sb - 1,
        sb,
        sb + 1,
        2 * sb,
        40 << 10,
        (40 << 10) + 1,
    ];
    v.retain(|&s| s >= 1 && s <= cap);
    v.sort();
    v.dedup();
    v
}

/// Parameters of [`churn`].
#[derive(Clone)]
struct Churn {
    threads: usize,
    ops: usize,
    user_streams: usize,
    max_held: usize,
    /// Largest size drawn.
    cap: usize,
    /// One op in this many destroys a user stream and makes a new one (0: never).
    destroy_every: u64,
    /// One op in this many trims (false/true alternately) (0: never).
    trim_every: u64,
    /// One op in this many releases the thread's arenas (0: never).
    release_every: u64,
    seed: u64,
}

/// A multi-threaded churn on `a`: each thread allocates on its per-thread stream, the legacy
/// stream and its user streams, tags each block, frees its own on the stream it used or on
/// another of its streams (ordered by an event), hands blocks to the next thread (which waits
/// on an event, checks the tags and frees them on one of its own streams), destroys and makes
/// user streams while blocks freed on them are still in flight, trims, flushes and releases.
/// Out of memory is expected under a tight cap: the request is dropped. Any other error fails.
/// Returns the number of out-of-memory errors seen.
fn churn(a: &Allocator, sim: &HostDevice, live: &Arc<Live>, p: &Churn) -> u64 {
    let n = p.threads;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<Handoff>()).unzip();
    let mut rxs: Vec<Option<mpsc::Receiver<Handoff>>> = rxs.into_iter().map(Some).collect();
    let ooms = Arc::new(AtomicU64::new(0));
    let menu = size_menu(a.config(), p.cap);
    let mut hs = Vec::new();
    for i in 0..n {
        let (a, sim, live, p, menu, ooms) =
            (a.clone(), sim.clone(), Arc::clone(live), p.clone(), menu.clone(), Arc::clone(&ooms));
        let tx = txs[(i + 1) % n].clone();
        let rx = rxs[i].take().unwrap();
        hs.push(std::thread::spawn(move || {
            let mut x = p.seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut users: Vec<Stream> = (0..p.user_streams).map(|_| sim.create_stream()).collect();
            let mut held: Vec<Blk> = Vec::new();
            let mut tagn = (i as u32) << 24;
            let pick_stream = |x: &mut u64, users: &[Stream]| -> Stream {
                let k = rng(x) % (2 + users.len() as u64);
                match k {
                    0 => Stream::PER_THREAD,
                    1 => Stream::LEGACY,
                    j => users[j as usize - 2],
                }
            };
            let free_blk = |b: Blk, on: Stream, sim: &HostDevice, a: &Allocator, live: &Live| {
                order(sim, b.s, on);
                check(sim, b.p, b.size, b.t, on);
                live.remove(b.p);
                a.deallocate(b.p, b.size, on).unwrap_or_else(|e| panic!("free {b:?} on {on:?}: {e}"));
            };
            let receive =
                |h: Handoff, x: &mut u64, users: &[Stream], sim: &HostDevice, a: &Allocator, live: &Live| {
                    let on = pick_stream(x, users);
                    sim.stream_wait_event(on, h.ev).unwrap();
                    let b = Blk { s: on, ..h.b };
                    free_blk(b, on, sim, a, live);
                };
            let mut trims = 0u64;
            for op in 0..p.ops {
                // Take in what the previous thread sent.
                while let Ok(h) = rx.try_recv() {
                    receive(h, &mut x, &users, &sim, &a, &live);
                }
                let r = rng(&mut x);
                if p.destroy_every > 0 && r % p.destroy_every == 1 && !users.is_empty() {
                    // Destroy a user stream while blocks freed on it are still in flight:
                    // half of the blocks last used on it are freed on it, the rest move to
                    // the per-thread stream behind an event.
                    // The moved blocks go either to the per-thread stream or to the new
                    // stream that takes the old one's place (often with the same handle: then
                    // their frees on it reach the old stream's arena by its handle).
                    let k = (rng(&mut x) as usize) % users.len();
                    let old = users[k];
                    let to_new = rng(&mut x).is_multiple_of(2);
                    let ev = mark(&sim, old);
                    let mut moved = Vec::new();
                    let mut j = 0;
                    while j < held.len() {
                        if held[j].s == old {
                            let b = held.swap_remove(j);
                            if rng(&mut x).is_multiple_of(2) {
                                free_blk(b, old, &sim, &a, &live);
                            } else {
                                moved.push(b);
                            }
                        } else {
                            j += 1;
                        }
                    }
                    let ev2 = mark(&sim, old);
                    let _ = ev;
                    sim.destroy_stream(old).unwrap();
                    let new = sim.create_stream();
                    users[k] = new;
                    let dest = if to_new { new } else { Stream::PER_THREAD };
                    if !moved.is_empty() {
                        sim.stream_wait_event(dest, ev2).unwrap();
                    }
                    for b in moved {
                        held.push(Blk { s: dest, ..b });
                    }
                    continue;
                }
                if p.trim_every > 0 && r % p.trim_every == 2 {
                    trims += 1;
                    a.trim(trims.is_multiple_of(4)).unwrap();
                    continue;
                }
                if p.release_every > 0 && r % p.release_every == 3 {
                    a.release_thread().unwrap();
                    continue;
                }
                if r % 97 == 5 {
                    a.flush().unwrap();
                    continue;
                }
                match (r >> 8) % 8 {
                    0..=3 if held.len() < p.max_held => {
                        let size = menu[(rng(&mut x) as usize) % menu.len()];
                        let s = pick_stream(&mut x, &users);
                        match a.allocate(size, s) {
                            Ok(q) => {
                                assert_eq!(q.0 % 256, 0, "alignment of {size} B on {s:?}");
                                live.insert(q, size);
                                tagn += 1;
                                tag(&sim, q, size, tagn, s);
                                held.push(Blk { p: q, size, s, t: tagn });
                            }
                            Err(Error::OutOfMemory { .. }) => {
                                ooms.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("allocate {size} on {s:?} (op {op}): {e}"),
                        }
                    }
                    4 | 5 if !held.is_empty() => {
                        let j = (rng(&mut x) as usize) % held.len();
                        let b = held.swap_remove(j);
                        let on =
                            if rng(&mut x).is_multiple_of(3) { pick_stream(&mut x, &users) } else { b.s };
                        free_blk(b, on, &sim, &a, &live);
                    }
                    6 | 7 if !held.is_empty() => {
                        let j = (rng(&mut x) as usize) % held.len();
                        let b = held.swap_remove(j);
                        let ev = mark(&sim, b.s);
                        tx.send(Handoff { b, ev }).unwrap();
                    }
                    _ => {}
                }
            }
            drop(tx);
            for b in std::mem::take(&mut held) {
                let on = b.s;
                free_blk(b, on, &sim, &a, &live);
            }
            // Blocks still coming from the previous thread (it ends when it has sent all).
            for h in rx {
                receive(h, &mut x, &users, &sim, &a, &live);
            }
            a.release_thread().unwrap();
            for s in users {
                sim.destroy_stream(s).unwrap();
            }
        }));
    }
    drop(txs);
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    ooms.load(Ordering::Relaxed)
}

fn churn_config(conf: &str, p: Churn) -> u64 {
    let conf = conf.to_string();
    within(120, move || {
        let sim = host(20);
        let a = host_allocator(sim.clone(), parse(&conf)).unwrap();
        let live = Arc::new(Live::default());
        let ooms = churn(&a, &sim, &live, &p);
        eprintln!("{conf}: {ooms} out-of-memory errors; {:?}", a.stats());
        assert_all_returned(&a, Some(&sim), 0);
        ooms
    })
}

fn default_churn() -> Churn {
    Churn {
        threads: 3,
        ops: 4000,
        user_streams: 2,
        max_held: 24,
        cap: 1 << 20,
        destroy_every: 150,
        trim_every: 300,
        release_every: 500,
        seed: 0x5151,
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Several allocators alive in one thread.

/// Three allocators over one device, used by three threads at once: each thread's slot vector
/// holds one slot per allocator; allocations and frees (own, cross-stream, handed to another
/// thread) interleave across them. No byte is handed out twice across the allocators, and
/// each gets everything back.
#[test]
fn three_allocators_interleaved_on_three_threads_stay_apart_and_all_return() {
    within(120, || {
        let sim = host(20);
        let confs = [
            "superblock=64KiB,small_max=16KiB,chunk=128KiB,max=48MiB",
            "superblock=256KiB,small_max=64KiB,large_max=64KiB,chunk=1MiB,batch=2,legacy_batch=2",
            "superblock=128KiB,small_max=1B,chunk=256KiB,max=256MiB,keep_empty=0",
        ];
        let allocs: Vec<Allocator> =
            confs.iter().map(|c| host_allocator(sim.clone(), parse(c)).unwrap()).collect();
        let live = Arc::new(Live::default());
        let n = 3;
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<(usize, Handoff)>()).unzip();
        let mut rxs: Vec<_> = rxs.into_iter().map(Some).collect();
        let mut hs = Vec::new();
        for i in 0..n {
            let (allocs, sim, live) = (allocs.clone(), sim.clone(), Arc::clone(&live));
            let tx = txs[(i + 1) % n].clone();
            let rx = rxs[i].take().unwrap();
            hs.push(std::thread::spawn(move || {
                let mut x = 0x1234_5678 ^ ((i as u64 + 7) * 0x9e37_79b9) | 1;
                let u = sim.create_stream();
                let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
                let mut held: Vec<(usize, Blk)> = Vec::new();
                let mut tagn = (i as u32) << 24;
                let free = |k: usize, b: Blk, on: Stream, allocs: &[Allocator]| {
                    order(&sim, b.s, on);
                    check(&sim, b.p, b.size, b.t, on);
                    live.remove(b.p);
                    allocs[k].deallocate(b.p, b.size, on).unwrap();
                };
                for _ in 0..1200 {
                    while let Ok((k, h)) = rx.try_recv() {
                        let on = streams[(rng(&mut x) % 3) as usize];
                        sim.stream_wait_event(on, h.ev).unwrap();
                        free(k, Blk { s: on, ..h.b }, on, &allocs);
                    }
                    let r = rng(&mut x);
                    let k = (r % 3) as usize;
                    match (r >> 4) % 6 {
                        0..=2 if held.len() < 30 => {
                            let size =
                                [1usize, 300, 4096, 16 << 10, 70 << 10, 300 << 10][(r >> 12) as usize % 6];
                            let s = streams[(r >> 20) as usize % 3];
                            let q = allocs[k].allocate(size, s).unwrap();
                            assert_eq!(q.0 % 256, 0);
                            live.insert(q, size);
                            tagn += 1;
                            tag(&sim, q, size, tagn, s);
                            held.push((k, Blk { p: q, size, s, t: tagn }));
                        }
                        3 | 4 if !held.is_empty() => {
                            let (k, b) = held.swap_remove((r >> 12) as usize % held.len());
                            let on = streams[(r >> 20) as usize % 3];
                            free(k, b, on, &allocs);
                        }
                        5 if !held.is_empty() => {
                            let (k, b) = held.swap_remove((r >> 12) as usize % held.len());
                            let ev = mark(&sim, b.s);
                            tx.send((k, Handoff { b, ev })).unwrap();
                        }
                        _ => {
                            if r.is_multiple_of(50) {
                                allocs[k].release_thread().unwrap();
                            }
                        }
                    }
                }
                drop(tx);
                for (k, b) in std::mem::take(&mut held) {
                    free(k, b, b.s, &allocs);
                }
                for (k, h) in rx {
                    sim.stream_wait_event(Stream::PER_THREAD, h.ev).unwrap();
                    free(k, Blk { s: Stream::PER_THREAD, ..h.b }, Stream::PER_THREAD, &allocs);
                }
                for a in &allocs {
                    a.release_thread().unwrap();
                }
                sim.destroy_stream(u).unwrap();
            }));
        }
        drop(txs);
        for h in hs {
            h.join().unwrap();
        }
        live.assert_clean();
        let (last, rest) = allocs.split_last().unwrap();
        for a in rest {
            assert_all_returned(a, None, 0);
        }
        assert_all_returned(last, Some(&sim), 0);
    });
}

/// Blocks of allocator A (arena blocks of every stream, a large block, a pool block) freed
/// through allocator B on every stream kind, and from another thread: refused as unknown
/// pointers, B's counters only; A loses nothing and frees them fine afterwards.
#[test]
fn frees_through_the_wrong_allocator_are_refused_on_every_stream_and_lose_nothing() {
    within(60, || {
        let sim = host(0);
        let a = host_allocator(sim.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB")).unwrap();
        let b = host_allocator(sim.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB")).unwrap();
        let u = sim.create_stream();
        let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
        // Warm B up on every stream, so its arenas and pool exist.
        for s in streams {
            let q = b.allocate(4096, s).unwrap();
            b.deallocate(q, 4096, s).unwrap();
        }
        let sizes = [256usize, 4096, 64 << 10, 100 << 10, 80 << 20];
        let mut blocks = Vec::new();
        for s in streams {
            for &size in &sizes {
                blocks.push((a.allocate(size, s).unwrap(), size, s));
            }
        }
        let before = a.stats();
        let mut bad = 0u64;
        for &(p, size, _) in &blocks {
            for s in streams {
                let r = b.deallocate(p, size, s);
                assert!(
                    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::UnknownPointer, .. })),
                    "B took A's block {p:?} ({size} B) on {s:?}: {r:?}"
                );
                bad += 1;
            }
        }
        // From another thread too (B's slot there is fresh).
        let (b2, bl) = (b.clone(), blocks.clone());
        let other = std::thread::spawn(move || {
            let u2 = {
                // A user stream of this thread's own.
                u
            };
            let mut n = 0;
            for (p, size, _) in bl {
                for s in [Stream::PER_THREAD, Stream::LEGACY, u2] {
                    assert!(is_invalid(&b2.deallocate(p, size, s)));
                    n += 1;
                }
            }
            b2.release_thread().unwrap();
            n
        });
        bad += other.join().unwrap();
        let after = a.stats();
        assert_eq!(after.live_bytes, before.live_bytes, "A lost nothing");
        assert_eq!(after.invalid_frees, 0);
        assert!(a.take_deferred_error().is_none());
        for (p, size, s) in blocks {
            a.deallocate(p, size, s).unwrap();
        }
        assert_all_returned(&a, None, 0);
        sim.destroy_stream(u).unwrap();
        assert_all_returned(&b, Some(&sim), bad);
    });
}

/// One allocator dropped (every clone) while other threads, idle, still have slots for it
/// with arenas holding memory; the same threads then keep using the other allocator, and
/// make a third one (its first slot forgets the dead one's). Nothing of the others is
/// touched, the dead one's memory goes back to the device, and no race is recorded.
#[test]
fn dropping_one_allocator_while_other_threads_hold_its_slots_leaves_the_rest_working() {
    within(60, || {
        let sim = host(20);
        let conf = "superblock=256KiB,small_max=64KiB,chunk=1MiB";
        let a = host_allocator(sim.clone(), parse(conf)).unwrap();
        let b = host_allocator(sim.clone(), parse(conf)).unwrap();
        let live = Arc::new(Live::default());
        // Workers with slots for both; they keep B's blocks live across A's drop.
        let (go_tx, go_rx): (Vec<_>, Vec<_>) = (0..2).map(|_| mpsc::channel::<Option<Allocator>>()).unzip();
        let done = Arc::new(Barrier::new(3));
        let mut hs = Vec::new();
        for (i, rx) in go_rx.into_iter().enumerate() {
            let (a, b, sim, live, done) =
                (a.clone(), b.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&done));
            hs.push(std::thread::spawn(move || {
                let u = sim.create_stream();
                let mut mine_b = Vec::new();
                for k in 0..40usize {
                    let size = 512 + 1000 * k;
                    for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                        let p = a.allocate(size, s).unwrap();
                        live.insert(p, size);
                        tag(&sim, p, size, k as u32 + 1, s);
                        let q = b.allocate(size, s).unwrap();
                        live.insert(q, size);
                        tag(&sim, q, size, k as u32 + 100, s);
                        mine_b.push((q, size, s, k as u32 + 100));
                        // A's block freed on its stream (its arena keeps the memory).
                        live.remove(p);
                        a.deallocate(p, size, s).unwrap();
                    }
                }
                // Let A's work finish before A goes (A's drop is not what is tested here).
                sim.synchronize();
                drop(a);
                done.wait(); // main drops A now
                done.wait();
                // A is gone; B keeps working on this thread, and a third allocator comes.
                let c = rx.recv().unwrap().unwrap();
                for (q, size, s, t) in mine_b.drain(..) {
                    check(&sim, q, size, t, s);
                    live.remove(q);
                    b.deallocate(q, size, s).unwrap();
                }
                for k in 0..40usize {
                    let size = 300 + 777 * k;
                    for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                        let q = b.allocate(size, s).unwrap();
                        live.insert(q, size);
                        let r = c.allocate(size, s).unwrap();
                        live.insert(r, size);
                        tag(&sim, q, size, 7, s);
                        tag(&sim, r, size, 8, s);
                        live.remove(q);
                        b.deallocate(q, size, s).unwrap();
                        live.remove(r);
                        c.deallocate(r, size, s).unwrap();
                    }
                }
                b.release_thread().unwrap();
                c.release_thread().unwrap();
                sim.destroy_stream(u).unwrap();
                let _ = i;
            }));
        }
        done.wait();
        let reserved_b = b.stats().reserved_bytes as usize;
        drop(a);
        // A's chunks went back to the device; B's are still there.
        sim.synchronize();
        assert_eq!(sim.reserved_bytes(), reserved_b, "A's drop released its chunks, and only them");
        let c = host_allocator(sim.clone(), parse(conf)).unwrap();
        done.wait();
        for tx in &go_tx {
            tx.send(Some(c.clone())).unwrap();
        }
        for h in hs {
            h.join().unwrap();
        }
        live.assert_clean();
        assert_all_returned(&c, None, 0);
        assert_all_returned(&b, Some(&sim), 0);
    });
}

/// Dropping an allocator (the last clone) with memory freed by a thread's own fast path (no
/// event) while the work queued before that free still runs. The drop must not release the
/// chunk under that work (`Device::release`: "no work may still use it"); the simulator
/// records a release under running work as a violation. Before the fix (`GlobalPool::drop`
/// synchronises the device before it releases the chunks; the mutation `drop_without_sync`
/// skips it) all three cases failed: the pool waited only for its own fences.
fn drop_after_local_free(case: u32) {
    let sim = host(0);
    let size = 32 << 10;
    let hold = Duration::from_millis(150);
    {
        let a = host_allocator(sim.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB")).unwrap();
        match case {
            // The dropping thread's own per-thread stream.
            0 => {
                let p = a.allocate(size, Stream::PER_THREAD).unwrap();
                sim.hold_and_check(p.0, size, 1, hold, Stream::PER_THREAD).unwrap();
                a.deallocate(p, size, Stream::PER_THREAD).unwrap();
                drop(a);
            }
            // The dropping thread's own user stream, which outlives the allocator.
            1 => {
                let u = sim.create_stream();
                let p = a.allocate(size, u).unwrap();
                sim.hold_and_check(p.0, size, 1, hold, u).unwrap();
                a.deallocate(p, size, u).unwrap();
                drop(a);
                sim.synchronize();
                sim.destroy_stream(u).unwrap();
            }
            // Another thread, alive at the drop, whose arena holds its freed block.
            _ => {
                let (tx, rx) = mpsc::channel::<()>();
                let (ready_tx, ready_rx) = mpsc::channel::<()>();
                let (a2, sim2) = (a.clone(), sim.clone());
                let h = std::thread::spawn(move || {
                    let p = a2.allocate(size, Stream::PER_THREAD).unwrap();
                    sim2.hold_and_check(p.0, size, 1, hold, Stream::PER_THREAD).unwrap();
                    a2.deallocate(p, size, Stream::PER_THREAD).unwrap();
                    drop(a2);
                    ready_tx.send(()).unwrap();
                    rx.recv().unwrap();
                });
                ready_rx.recv().unwrap();
                drop(a);
                tx.send(()).unwrap();
                h.join().unwrap();
            }
        }
    }
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "case {case}: {v:?}");
    assert_eq!(sim.tag_errors(), 0);
    assert_eq!(sim.reserved_bytes(), 0);
}

#[test]
fn dropping_an_allocator_right_after_an_own_per_thread_free_releases_nothing_under_running_work() {
    within(60, || drop_after_local_free(0));
}

#[test]
fn dropping_an_allocator_right_after_an_own_user_stream_free_releases_nothing_under_running_work() {
    within(60, || drop_after_local_free(1));
}

#[test]
fn dropping_an_allocator_while_another_live_thread_holds_a_fresh_free_releases_nothing_under_running_work() {
    within(60, || drop_after_local_free(2));
}

// ---------------------------------------------------------------------------------------------
// 2. Edge configurations under churn.

/// The minimum superblock and chunk, `small_max=1B` (every request above one byte is large,
/// from large superblocks halved down under the cap), `keep_empty=0`, batches of one, and a
/// cap of eight superblocks: out of memory all the time.
#[test]
fn churn_minimum_superblock_small_max_one_byte_batches_of_one_tight_cap() {
    churn_config(
        "superblock=64KiB,chunk=64KiB,small_max=1B,keep_empty=0,batch=1,legacy_batch=1,max=512KiB",
        Churn { cap: 128 << 10, ..default_churn() },
    );
}

/// Large superblocks off (`large_max=small_max=superblock`), `keep_empty=0` and a tiny
/// `sparse` (every free that leaves room gives back the emptiest superblock, dissolving it
/// with its live blocks), byte batches of one byte, a cap of sixteen superblocks.
#[test]
fn churn_large_off_dissolving_every_free_byte_batches_tight_cap() {
    churn_config(
        "superblock=64KiB,chunk=64KiB,small_max=64KiB,large_max=64KiB,keep_empty=0,sparse=0.001,\
         batch_bytes=1B,legacy_batch_bytes=1B,max=1MiB",
        Churn { cap: 256 << 10, ..default_churn() },
    );
}

/// `small_max=1B` with large superblocks off too (`large_max=1B`): every request above one
/// byte is a pool block, one-byte ones arena blocks; batches of one; a tiny cap.
#[test]
fn churn_everything_in_the_pool_but_one_byte_requests() {
    churn_config(
        "superblock=64KiB,chunk=64KiB,small_max=1B,large_max=1B,batch=1,legacy_batch=1,max=768KiB",
        Churn { cap: 128 << 10, ..default_churn() },
    );
}

/// Large superblocks under a cap of a few of the smallest one (8 MiB): the arena's borrow is
/// halved down to whole normal superblocks; legacy batches of one, remote batches of one.
#[test]
fn churn_large_superblocks_halved_under_a_cap() {
    churn_config(
        "superblock=64KiB,chunk=128KiB,small_max=8KiB,large_max=1MiB,keep_empty=0,batch=1,legacy_batch=1,max=3MiB",
        Churn { cap: 1 << 20, ..default_churn() },
    );
}

/// The largest superblock (64 MiB), `small_max` equal to it, a cap of two chunks.
#[test]
fn churn_largest_superblock_with_small_max_equal_to_it() {
    churn_config(
        "superblock=64MiB,chunk=64MiB,small_max=64MiB,large_max=64MiB,keep_empty=0,max=192MiB",
        Churn { cap: 64 << 20, ops: 1500, max_held: 6, ..default_churn() },
    );
}

/// `sparse` near 1 (the rule never gives back), `keep_empty` at its maximum, a huge batch,
/// against a cap: only out of memory and trims take memory back.
#[test]
fn churn_never_give_back_until_out_of_memory() {
    churn_config(
        "superblock=64KiB,chunk=64KiB,small_max=16KiB,large_max=256KiB,keep_empty=1024,sparse=0.999,\
         batch=65536,legacy_batch=65536,max=2MiB",
        Churn { cap: 256 << 10, ..default_churn() },
    );
}

/// The default configuration with a small cap (32 MiB, one chunk) and eight threads.
#[test]
fn churn_defaults_with_one_chunk_cap_and_eight_threads() {
    churn_config("max=32MiB", Churn { threads: 8, ops: 1500, cap: 3 << 20, max_held: 8, ..default_churn() });
}

// ---------------------------------------------------------------------------------------------
// 3. User streams destroyed and handles reused, racing trims and out-of-memory reclaims.

/// Four threads each: make a stream, allocate on it, run work, free on it (the arena keeps the
/// memory, unfenced), hand some blocks to the next thread (freed on that thread's stream,
/// another batch), destroy the stream, make a new one at once (the simulator hands out the
/// most recently freed handle: often another thread's), allocate again. A fifth thread loops
/// `trim(true)` / `trim(false)` and a tight cap forces out-of-memory reclaims. No race, no
/// stale handle reaches the device, no overlap, all memory back.
#[test]
fn destroyed_streams_with_reused_handles_on_four_threads_racing_trims_and_oom() {
    within(120, || {
        let sim = host(30);
        let a = host_allocator(
            sim.clone(),
            parse("superblock=64KiB,chunk=128KiB,small_max=16KiB,large_max=256KiB,max=3MiB,batch=4"),
        )
        .unwrap();
        let live = Arc::new(Live::default());
        let stop = Arc::new(AtomicBool::new(false));
        let trimmer = {
            let (a, stop) = (a.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    k += 1;
                    a.trim(k.is_multiple_of(3)).unwrap();
                    std::thread::yield_now();
                }
                a.release_thread().unwrap();
                k
            })
        };
        let n = 4;
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<Handoff>()).unzip();
        let mut rxs: Vec<_> = rxs.into_iter().map(Some).collect();
        let ooms = Arc::new(AtomicU64::new(0));
        let mut hs = Vec::new();
        for i in 0..n {
            let (a, sim, live, ooms) = (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&ooms));
            let tx = txs[(i + 1) % n].clone();
            let rx = rxs[i].take().unwrap();
            hs.push(std::thread::spawn(move || {
                let mut x = 0xabcd ^ ((i as u64 + 1) * 0x2545_f491) | 1;
                let mut t = (i as u32) << 24;
                let take_in = |rx: &mpsc::Receiver<Handoff>, s: Stream, blocking: bool| {
                    let mut got = Vec::new();
                    if blocking {
                        got.extend(rx.iter());
                    } else {
                        got.extend(rx.try_iter());
                    }
                    for h in got {
                        sim.stream_wait_event(s, h.ev).unwrap();
                        // Only the head was tagged (by `hold_and_check`).
                        sim.check_tag(h.b.p.0, 256, h.b.t, s).unwrap();
                        live.remove(h.b.p);
                        a.deallocate(h.b.p, h.b.size, s).unwrap();
                    }
                };
                for round in 0..60 {
                    let s = sim.create_stream();
                    take_in(&rx, s, false);
                    let mut mine = Vec::new();
                    for _ in 0..12 {
                        let size = [256usize, 3000, 16 << 10, (16 << 10) + 1, 100 << 10, 256 << 10]
                            [(rng(&mut x) % 6) as usize];
                        match a.allocate(size, s) {
                            Ok(p) => {
                                assert_eq!(p.0 % 256, 0);
                                live.insert(p, size);
                                t += 1;
                                sim.hold_and_check(p.0, 256, t, Duration::from_micros(200), s).unwrap();
                                mine.push(Blk { p, size, s, t });
                            }
                            Err(Error::OutOfMemory { .. }) => {
                                ooms.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    for b in mine {
                        if rng(&mut x).is_multiple_of(3) {
                            let ev = mark(&sim, s);
                            tx.send(Handoff { b, ev }).unwrap();
                        } else {
                            live.remove(b.p);
                            a.deallocate(b.p, b.size, s).unwrap();
                        }
                    }
                    take_in(&rx, s, false);
                    if round % 7 == 3 {
                        a.flush().unwrap();
                    }
                    sim.destroy_stream(s).unwrap();
                }
                drop(tx);
                let s = sim.create_stream();
                take_in(&rx, s, true);
                a.release_thread().unwrap();
                sim.destroy_stream(s).unwrap();
            }));
        }
        drop(txs);
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let trims = trimmer.join().unwrap();
        eprintln!("{trims} trims, {} out-of-memory errors", ooms.load(Ordering::Relaxed));
        live.assert_clean();
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// A handle destroyed on one thread and given by the simulator to a stream another thread makes
/// at once, while the first thread's user arena (keyed by the old stream) still holds blocks
/// freed on it (and live ones) and its outbox holds remote frees batched on it. Under a cap of
/// four superblocks, the second thread's allocations on the new stream run out of memory and
/// reclaim the first thread's idle arena of the destroyed stream, whose handle now names a live
/// stream again. Then the first thread frees its old blocks on the new handle and allocates
/// there. No block is reused unfenced, no overlap, everything back.
#[test]
fn a_handle_destroyed_on_one_thread_and_reused_on_another_mid_batch() {
    within(60, || {
        let sim = host(0);
        let a = host_allocator(
            sim.clone(),
            parse("superblock=64KiB,chunk=64KiB,small_max=16KiB,large_max=16KiB,batch=64,max=256KiB"),
        )
        .unwrap();
        let live = Arc::new(Live::default());
        let size = 8 << 10;
        let (b_tx, b_rx) = mpsc::channel::<(Vec<DeviceAddr>, Event)>();
        let (h_tx, h_rx) = mpsc::channel::<usize>();
        let (back_tx, back_rx) = mpsc::channel::<(Stream, Event)>();
        let (fin_tx, fin_rx) = mpsc::channel::<()>();
        let (a1, sim1, live1) = (a.clone(), sim.clone(), Arc::clone(&live));
        let t_a = std::thread::spawn(move || {
            let s = sim1.create_stream();
            let own: Vec<DeviceAddr> = (0..8).map(|_| a1.allocate(size, s).unwrap()).collect();
            for (i, p) in own.iter().enumerate() {
                live1.insert(*p, size);
                sim1.hold_and_check(p.0, size, 0x100 + i as u32, Duration::from_millis(30), s).unwrap();
            }
            let (theirs, ev) = b_rx.recv().unwrap();
            sim1.stream_wait_event(s, ev).unwrap();
            for p in &theirs {
                sim1.hold_and_check(p.0, 256, 0x200, Duration::from_millis(20), s).unwrap();
                live1.remove(*p);
                a1.deallocate(*p, size, s).unwrap(); // batched on s in this thread's outbox
            }
            // Own frees on s: kept in this thread's arena for s, unfenced.
            for p in &own[..4] {
                live1.remove(*p);
                a1.deallocate(*p, size, s).unwrap();
            }
            sim1.destroy_stream(s).unwrap();
            h_tx.send(s.as_raw()).unwrap();
            let (s2, ready) = back_rx.recv().unwrap();
            assert_eq!(s2, s, "the simulator reuses the handle");
            sim1.stream_wait_event(s2, ready).unwrap();
            for p in &own[4..] {
                live1.remove(*p);
                a1.deallocate(*p, size, s2).unwrap();
            }
            let mut fresh = Vec::new();
            for _ in 0..16 {
                match a1.allocate(size, s2) {
                    Ok(p) => {
                        live1.insert(p, size);
                        sim1.fill(p.0, size, 0x55, s2).unwrap();
                        fresh.push(p);
                    }
                    Err(Error::OutOfMemory { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            for p in fresh {
                live1.remove(p);
                a1.deallocate(p, size, s2).unwrap();
            }
            fin_rx.recv().unwrap();
            a1.release_thread().unwrap();
        });
        let (a2, sim2, live2) = (a.clone(), sim.clone(), Arc::clone(&live));
        let t_b = std::thread::spawn(move || {
            let blocks: Vec<DeviceAddr> =
                (0..8).map(|_| a2.allocate(size, Stream::PER_THREAD).unwrap()).collect();
            for p in &blocks {
                live2.insert(*p, size);
                sim2.write_tag(p.0, size, 0x300, Stream::PER_THREAD).unwrap();
            }
            let ev = mark(&sim2, Stream::PER_THREAD);
            b_tx.send((blocks, ev)).unwrap();
            let h = h_rx.recv().unwrap();
            // The old stream's work is still running.
            let s2 = sim2.create_stream();
            assert_eq!(s2.as_raw(), h);
            let mut got = Vec::new();
            let mut ooms = 0;
            for _ in 0..24 {
                match a2.allocate(size, s2) {
                    Ok(p) => {
                        live2.insert(p, size);
                        // Overwritten at once: a block of the old stream handed out here
                        // unfenced races its running work.
                        sim2.fill(p.0, size, 0x77, s2).unwrap();
                        got.push(p);
                    }
                    Err(Error::OutOfMemory { .. }) => ooms += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            a2.trim(false).unwrap();
            let ready = mark(&sim2, s2);
            // The test's own ordering of the first thread's remaining old blocks' work (on the
            // destroyed stream) before their free on s2.
            sim2.synchronize();
            back_tx.send((s2, ready)).unwrap();
            for p in got {
                live2.remove(p);
                a2.deallocate(p, size, s2).unwrap();
            }
            fin_tx.send(()).unwrap();
            a2.release_thread().unwrap();
            (s2, ooms)
        });
        t_a.join().unwrap();
        let (s2, ooms) = t_b.join().unwrap();
        eprintln!("{ooms} out-of-memory errors on the new stream");
        sim.destroy_stream(s2).unwrap();
        live.assert_clean();
        assert_all_returned(&a, Some(&sim), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// 4. Thread exit at awkward moments.

/// A thread exits with frees waiting everywhere: remote frees in its outbox (per-thread and
/// legacy, pool blocks too), its own legacy frees kept back, remote frees in user-stream
/// batches, its own user-arena frees; while two other threads free its live blocks on their
/// streams at the same moment (released together by a barrier). Then another thread reuses
/// everything at once on its per-thread stream: no race, nothing lost.
#[test]
fn thread_exit_with_everything_pending_while_others_free_its_blocks() {
    within(60, || {
        for round in 0..6u64 {
            let sim = host(30);
            let a = host_allocator(
                sim.clone(),
                parse("superblock=64KiB,chunk=256KiB,small_max=16KiB,large_max=128KiB,batch=64,legacy_batch=256"),
            )
            .unwrap();
            let live = Arc::new(Live::default());
            // Blocks owned by helper threads, freed by the exiting thread (outbox, batches).
            let foreign: Vec<(DeviceAddr, usize)> = std::thread::spawn({
                let (a, sim, live) = (a.clone(), sim.clone(), Arc::clone(&live));
                move || {
                    let v: Vec<(DeviceAddr, usize)> = [1000usize, 16 << 10, 100 << 10, 300 << 10]
                        .iter()
                        .cycle()
                        .take(24)
                        .map(|&n| {
                            let p = a.allocate(n, Stream::PER_THREAD).unwrap();
                            live.insert(p, n);
                            sim.write_tag(p.0, 256, 0xf00, Stream::PER_THREAD).unwrap();
                            (p, n)
                        })
                        .collect();
                    a.release_thread().unwrap(); // its superblocks dissolve: some are pool blocks now
                    v
                }
            })
            .join()
            .unwrap();
            let go = Arc::new(Barrier::new(3));
            let (own_tx, own_rx) = mpsc::channel::<Vec<(DeviceAddr, usize, Event)>>();
            let (own_tx2, own_rx2) = mpsc::channel::<Vec<(DeviceAddr, usize, Event)>>();
            let exiting = {
                let (a, sim, live, go) = (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&go));
                std::thread::spawn(move || {
                    let u = sim.create_stream();
                    let ev0 = mark(&sim, Stream::LEGACY);
                    // Foreign blocks freed here on every stream kind: outbox and user batches.
                    for (k, &(p, n)) in foreign.iter().enumerate() {
                        let s = [Stream::PER_THREAD, Stream::LEGACY, u][k % 3];
                        sim.stream_wait_event(s, ev0).unwrap();
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    // Own blocks: some kept back on the legacy stream, some freed on the user
                    // stream, some handed to the two others.
                    let mut give = [Vec::new(), Vec::new()];
                    for k in 0..48usize {
                        let n = [512usize, 4096, 20 << 10, 64 << 10][k % 4];
                        let s = [Stream::LEGACY, u, Stream::PER_THREAD][k % 3];
                        let p = a.allocate(n, s).unwrap();
                        live.insert(p, n);
                        sim.hold_and_check(p.0, 256, 0x1000 + k as u32, Duration::from_micros(300), s)
                            .unwrap();
                        if k % 2 == 0 {
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        } else {
                            let ev = mark(&sim, s);
                            give[k / 2 % 2].push((p, n, ev));
                        }
                    }
                    let [g0, g1] = give;
                    own_tx.send(g0).unwrap();
                    own_tx2.send(g1).unwrap();
                    go.wait();
                    // Exit now, while the others free this thread's blocks.
                    u
                })
            };
            let freer = |rx: mpsc::Receiver<Vec<(DeviceAddr, usize, Event)>>, which: u64| {
                let (a, sim, live, go) = (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&go));
                std::thread::spawn(move || {
                    let u = sim.create_stream();
                    let v = rx.recv().unwrap();
                    go.wait();
                    for (k, (p, n, ev)) in v.into_iter().enumerate() {
                        let s =
                            [Stream::PER_THREAD, Stream::LEGACY, u][(k as u64 + which + round) as usize % 3];
                        sim.stream_wait_event(s, ev).unwrap();
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    if which == 0 {
                        a.flush().unwrap();
                    }
                    a.release_thread().unwrap();
                    u
                })
            };
            let f0 = freer(own_rx, 0);
            let f1 = freer(own_rx2, 1);
            let u = exiting.join().unwrap();
            let u0 = f0.join().unwrap();
            let u1 = f1.join().unwrap();
            // Reuse everything at once on a new thread's per-thread stream, under a trim.
            std::thread::spawn({
                let (a, sim, live) = (a.clone(), sim.clone(), Arc::clone(&live));
                move || {
                    a.trim(false).unwrap();
                    let mut v = Vec::new();
                    for _ in 0..64 {
                        let n = 16 << 10;
                        let p = a.allocate(n, Stream::PER_THREAD).unwrap();
                        live.insert(p, n);
                        sim.fill(p.0, n, 3, Stream::PER_THREAD).unwrap();
                        v.push((p, n));
                    }
                    for (p, n) in v {
                        live.remove(p);
                        a.deallocate(p, n, Stream::PER_THREAD).unwrap();
                    }
                    a.release_thread().unwrap();
                }
            })
            .join()
            .unwrap();
            for s in [u, u0, u1] {
                sim.destroy_stream(s).unwrap();
            }
            live.assert_clean();
            assert_all_returned(&a, Some(&sim), 0);
        }
    });
}

// Late destructors: thread-locals whose destructors allocate and free. Which runs before or
// after the allocator's own (`SLOTS`) depends on registration order (reverse, on Linux): one
// registered before the thread's first allocator call runs after the slots are gone, one
// registered after runs before.
struct LateUse {
    a: Option<Allocator>,
    sim: Option<HostDevice>,
    live: Vec<(DeviceAddr, usize, Stream)>,
    u: Option<Stream>,
    done: Option<mpsc::Sender<Vec<String>>>,
}

impl Drop for LateUse {
    fn drop(&mut self) {
        let (Some(a), Some(sim)) = (self.a.take(), self.sim.take()) else { return };
        let mut errs = Vec::new();
        // Free what the thread left live, on the stream it used.
        for (p, n, s) in self.live.drain(..) {
            if let Err(e) = a.deallocate(p, n, s) {
                errs.push(format!("free {p:?} {n} on {s:?}: {e}"));
            }
        }
        // Allocate and free again on every stream kind, with a second free refused.
        let mut streams = vec![Stream::PER_THREAD, Stream::LEGACY];
        streams.extend(self.u);
        for s in streams {
            for n in [1usize, 4096, 20 << 10, 200 << 10, 3 << 20] {
                match a.allocate(n, s) {
                    Ok(p) => {
                        if p.0 % 256 != 0 {
                            errs.push(format!("unaligned {p:?}"));
                        }
                        let _ = sim.fill(p.0, n.max(256), 9, s);
                        if let Err(e) = a.deallocate(p, n, s) {
                            errs.push(format!("late free {n} on {s:?}: {e}"));
                        }
                        let r = a.deallocate(p, n, s);
                        if !is_invalid(&r) {
                            errs.push(format!("late second free {n} on {s:?} not refused: {r:?}"));
                        }
                    }
                    Err(e) => errs.push(format!("late alloc {n} on {s:?}: {e}")),
                }
            }
        }
        if let Some(d) = self.done.take() {
            let _ = d.send(errs);
        }
    }
}

thread_local! {
    static EARLY_REGISTERED: std::cell::RefCell<LateUse> = const {
        std::cell::RefCell::new(LateUse { a: None, sim: None, live: Vec::new(), u: None, done: None })
    };
    static LATE_REGISTERED: std::cell::RefCell<LateUse> = const {
        std::cell::RefCell::new(LateUse { a: None, sim: None, live: Vec::new(), u: None, done: None })
    };
}

/// Thread-local destructors that free blocks the thread left live (on the per-thread, legacy
/// and a user stream) and allocate and free again on every stream kind, one running after the
/// allocator's thread state is gone and one before it. Each call succeeds (a refused second
/// free excepted), no race, and all memory comes back.
#[test]
fn thread_local_destructors_allocate_and_free_before_and_after_the_slots_go() {
    within(60, || {
        for which in 0..3 {
            let sim = host(20);
            let a = host_allocator(
                sim.clone(),
                parse("superblock=64KiB,chunk=256KiB,small_max=16KiB,large_max=1MiB"),
            )
            .unwrap();
            let u = sim.create_stream();
            let (done_tx, done_rx) = mpsc::channel::<Vec<String>>();
            let (a2, sim2) = (a.clone(), sim.clone());
            let h = std::thread::spawn(move || {
                // Registered before the allocator's thread-local: its destructor runs after.
                if which != 1 {
                    EARLY_REGISTERED.with(|l| {
                        let mut l = l.borrow_mut();
                        l.a = Some(a2.clone());
                        l.sim = Some(sim2.clone());
                        l.u = Some(u);
                        l.done = Some(done_tx.clone());
                    });
                }
                let mut left = Vec::new();
                for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                    for n in [300usize, 8 << 10, 100 << 10, 2 << 20] {
                        let p = a2.allocate(n, s).unwrap();
                        sim2.hold_and_check(p.0, 256, 5, Duration::from_micros(500), s).unwrap();
                        left.push((p, n, s));
                    }
                    // And some freed (kept back on legacy, in the arena on the others).
                    for n in [512usize, 4096] {
                        let p = a2.allocate(n, s).unwrap();
                        a2.deallocate(p, n, s).unwrap();
                    }
                }
                // Registered after: its destructor runs before the allocator's.
                if which != 0 {
                    LATE_REGISTERED.with(|l| {
                        let mut l = l.borrow_mut();
                        l.a = Some(a2.clone());
                        l.sim = Some(sim2.clone());
                        l.u = Some(u);
                        l.done = Some(done_tx.clone());
                    });
                }
                let (early, late) = left.split_at(left.len() / 2);
                if which == 1 {
                    // Only the late-registered one: it frees everything.
                    LATE_REGISTERED.with(|l| l.borrow_mut().live.extend_from_slice(&left));
                } else if which == 0 {
                    EARLY_REGISTERED.with(|l| l.borrow_mut().live.extend_from_slice(&left));
                } else {
                    EARLY_REGISTERED.with(|l| l.borrow_mut().live.extend_from_slice(early));
                    LATE_REGISTERED.with(|l| l.borrow_mut().live.extend_from_slice(late));
                }
                drop(done_tx);
            });
            h.join().unwrap();
            let mut reports = 0;
            for errs in done_rx.iter() {
                reports += 1;
                assert!(errs.is_empty(), "case {which}: {errs:?}");
            }
            assert_eq!(reports, if which == 2 { 2 } else { 1 }, "case {which}: every destructor ran");
            sim.synchronize();
            sim.destroy_stream(u).unwrap();
            let n_bad = 3 * 5 * reports as u64;
            assert_all_returned(&a, Some(&sim), n_bad);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 5. Sizes at boundaries, bad frees.

/// Under edge configurations, every boundary size on every stream kind: allocated, aligned,
/// not overlapping; each freed first with a wrong size (one granule off, where that changes
/// the block's rounding), an interior pointer, the pointer one granule past the block's
/// rounded end and one granule before it: each refused, changing nothing; then freed right; a
/// second free from another thread, ordered after, refused. Nothing lost.
#[test]
fn boundary_sizes_and_bad_frees_on_every_stream_under_edge_configs() {
    within(120, || {
        for conf in [
            "superblock=64KiB,chunk=64KiB,small_max=1B",
            "superblock=64KiB,chunk=128KiB,small_max=64KiB,large_max=64KiB,keep_empty=0",
            "superblock=64KiB,chunk=64KiB,small_max=32KiB,large_max=1MiB,keep_empty=0,batch=1,legacy_batch=1",
            "superblock=128KiB,chunk=256KiB,small_max=1B,large_max=1B",
        ] {
            let sim = host(0);
            let a = host_allocator(sim.clone(), parse(conf)).unwrap();
            let cfg = a.config().clone();
            let u = sim.create_stream();
            let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
            let menu = size_menu(&cfg, 4 << 20);
            let mut bad = 0u64;
            let live = Live::default();
            let mut blocks = Vec::new();
            for &s in &streams {
                for &n in &menu {
                    let p = a.allocate(n, s).unwrap_or_else(|e| panic!("{conf}: {n} on {s:?}: {e}"));
                    assert_eq!(p.0 % 256, 0, "{conf}: {n} on {s:?}");
                    live.insert(p, n);
                    blocks.push((p, n, s));
                }
            }
            live.assert_clean();
            let sm = cfg.small_max();
            for &(p, n, s) in &blocks {
                let before = a.stats();
                let bytes = block_bytes(n, sm).unwrap();
                let mut tries: Vec<(DeviceAddr, usize)> = Vec::new();
                for m in [n + 256, n.saturating_sub(256), bytes + 1, bytes - 255] {
                    if m > 0 && block_bytes(m, sm) != Some(bytes) {
                        tries.push((p, m));
                    }
                }
                tries.push((DeviceAddr(p.0 + 256), n.max(1)));
                tries.push((DeviceAddr(p.0 + bytes as u64), n));
                tries.push((DeviceAddr(p.0 - 256), n));
                tries.push((DeviceAddr(p.0 + 1), n));
                for (q, m) in tries {
                    // One past the end may be the start of a neighbour of the same size: a
                    // valid free of that block. Skip addresses of live blocks of that size.
                    if blocks.iter().any(|&(o, on, _)| o == q && block_bytes(on, sm) == block_bytes(m, sm)) {
                        continue;
                    }
                    for &fs in &streams {
                        let r = a.deallocate(q, m, fs);
                        assert!(
                            is_invalid(&r),
                            "{conf}: bad free {q:?} {m} B on {fs:?} of {p:?} {n} B ({s:?}): {r:?}"
                        );
                        bad += 1;
                    }
                }
                let after = a.stats();
                assert_eq!(after.live_bytes, before.live_bytes, "{conf}: a refused free changed live bytes");
            }
            // Free right, on the block's own stream or another (ordered), then a second free
            // by another thread, ordered after the first by the join.
            for (k, &(p, n, s)) in blocks.iter().enumerate() {
                let on = streams[(k + 1) % 3];
                order(&sim, s, on);
                live.remove(p);
                a.deallocate(p, n, on).unwrap();
                if k % 4 == 0 {
                    let r = a.deallocate(p, n, streams[k % 3]);
                    assert!(is_invalid(&r), "{conf}: owner's second free {p:?} {n}: {r:?}");
                    bad += 1;
                }
            }
            let b2 = blocks.clone();
            let a2 = a.clone();
            let other = std::thread::spawn(move || {
                let mut n_bad = 0u64;
                let mut deferred = 0u64;
                for (k, &(p, n, _)) in b2.iter().enumerate() {
                    let on = [Stream::PER_THREAD, Stream::LEGACY, u][k % 3];
                    let r = a2.deallocate(p, n, on);
                    match r {
                        Err(Error::InvalidFree { .. }) => n_bad += 1,
                        // A second free the owner checks later (documented limit: the first may
                        // have arrived and been merged; it is then refused by the owner's drain).
                        Ok(()) => deferred += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                a2.release_thread().unwrap();
                (n_bad, deferred)
            });
            let (n_bad, deferred) = other.join().unwrap();
            assert_eq!(deferred, 0, "{conf}: ordered second frees from another thread accepted");
            bad += n_bad;
            sim.destroy_stream(u).unwrap();
            eprintln!("{conf}: {} blocks, {bad} bad frees refused", blocks.len());
            assert!(bad > 10 * blocks.len() as u64);
            assert_all_returned(&a, Some(&sim), bad);
        }
    });
}

/// Absurd sizes on every stream kind, in the arena mode and pass-through mode, under
/// configurations whose `large_max` and cap sit at edges: a clear error (out of memory for an
/// allocation, an invalid free for a free), never a panic, and nothing changes.
#[test]
fn absurd_sizes_give_clear_errors_on_every_stream_and_mode() {
    within(60, || {
        for conf in [
            "superblock=64KiB,chunk=64KiB,small_max=1B,max=64KiB",
            "superblock=64KiB,chunk=64KiB,small_max=64KiB,large_max=64KiB,max=128KiB",
            "max=4MiB",
            "passthrough,max=4MiB",
            "small_max=1B,large_max=64MiB,superblock=64KiB,chunk=64KiB,max=64MiB",
        ] {
            let sim = host(0);
            let a = host_allocator(sim.clone(), parse(conf)).unwrap();
            let u = sim.create_stream();
            let lim = 1usize << 20;
            let p = a.allocate(256, Stream::PER_THREAD).unwrap();
            let mut bad = 0;
            for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                for n in [
                    usize::MAX,
                    usize::MAX - 1,
                    usize::MAX - 255,
                    usize::MAX - 256,
                    isize::MAX as usize,
                    (isize::MAX as usize) + 1,
                    1 << 48,
                    lim * 1024,
                    (64 << 20) + 1,
                    (128 << 20) + 1,
                ] {
                    let r = a.allocate(n, s);
                    assert!(is_oom(&r), "{conf}: allocate({n:#x}) on {s:?}: {r:?}");
                    let r = a.deallocate(p, n, s);
                    assert!(is_invalid(&r), "{conf}: free of {p:?} with {n:#x} on {s:?}: {r:?}");
                    bad += 1;
                    let r = a.deallocate(DeviceAddr(u64::MAX - 255), n, s);
                    assert!(is_invalid(&r), "{conf}: free of the top address with {n:#x}: {r:?}");
                    bad += 1;
                }
                for q in [1u64, 255, 256, u64::MAX, u64::MAX - 255, 1 << 63] {
                    let r = a.deallocate(DeviceAddr(q), 256, s);
                    assert!(is_invalid(&r), "{conf}: free of {q:#x}: {r:?}");
                    bad += 1;
                }
            }
            assert_eq!(a.stats().live_bytes as usize, 256, "{conf}: only the live block");
            a.deallocate(p, 256, Stream::PER_THREAD).unwrap();
            sim.destroy_stream(u).unwrap();
            if conf.starts_with("passthrough") {
                let s = a.stats();
                assert_eq!((s.live_bytes, s.invalid_frees), (0, bad), "{conf}");
                a.release_thread().unwrap();
                sim.synchronize();
                assert!(sim.violations().is_empty());
            } else {
                assert_all_returned(&a, Some(&sim), bad);
            }
        }
    });
}

/// Ordered double frees from two threads on every stream kind, with the first free in every
/// state (just made on the owner's fast path, kept back on the legacy stream, waiting in a
/// remote outbox, waiting in a user-stream batch, parked, arrived and merged), under batches
/// of one and of many: the second is refused at once, and counted once.
#[test]
fn ordered_double_frees_from_two_threads_in_every_state_of_the_first() {
    within(60, || {
        for conf in [
            "superblock=64KiB,chunk=256KiB,small_max=16KiB,large_max=256KiB,batch=1,legacy_batch=1",
            "superblock=64KiB,chunk=256KiB,small_max=16KiB,large_max=256KiB,batch=64,legacy_batch=256",
        ] {
            let sim = host(10);
            let a = host_allocator(sim.clone(), parse(conf)).unwrap();
            let mut bad = 0u64;
            let owner_u = sim.create_stream();
            let other_u = sim.create_stream();
            for n in [256usize, 16 << 10, (16 << 10) + 1, 200 << 10] {
                for first_by_owner in [true, false] {
                    for (fi, first_on) in
                        [Stream::PER_THREAD, Stream::LEGACY, owner_u].into_iter().enumerate()
                    {
                        for second_on in [Stream::PER_THREAD, Stream::LEGACY, other_u] {
                            // The owner allocates on `first_on`'s kind (its own user stream).
                            let p = a.allocate(n, first_on).unwrap();
                            let ev = mark(&sim, first_on);
                            let fs = if first_by_owner {
                                a.deallocate(p, n, first_on).unwrap();
                                None
                            } else {
                                // Freed first by a helper thread (its outbox or user batch).
                                let (a2, sim2) = (a.clone(), sim.clone());
                                let su = if fi == 2 { other_u } else { first_on };
                                std::thread::spawn(move || {
                                    sim2.stream_wait_event(su, ev).unwrap();
                                    a2.deallocate(p, n, su).unwrap();
                                    // Exits with the free in its outbox / batch (sent or parked).
                                })
                                .join()
                                .unwrap();
                                Some(su)
                            };
                            let _ = fs;
                            let (a3, sim3) = (a.clone(), sim.clone());
                            let r = std::thread::spawn(move || {
                                sim3.stream_wait_event(second_on, ev).unwrap();
                                let r = a3.deallocate(p, n, second_on);
                                a3.release_thread().unwrap();
                                r
                            })
                            .join()
                            .unwrap();
                            assert!(
                                is_double(&r),
                                "{conf}: {n} B, first free on {first_on:?} by {}, second on {second_on:?}: {r:?}",
                                if first_by_owner { "owner" } else { "helper" }
                            );
                            bad += 1;
                        }
                    }
                }
            }
            a.release_thread().unwrap();
            sim.synchronize();
            sim.destroy_stream(owner_u).unwrap();
            sim.destroy_stream(other_u).unwrap();
            assert_all_returned(&a, Some(&sim), bad);
        }
    });
}

/// Edge configurations parse, and values just past each edge are refused with a configuration
/// error (never a panic).
#[test]
fn edge_configurations_parse_and_values_past_the_edges_are_refused() {
    for ok in [
        "superblock=64KiB,chunk=64KiB,small_max=1B,max=64KiB",
        "superblock=64KiB,small_max=64KiB,large_max=64KiB",
        "superblock=64MiB,chunk=64MiB,small_max=64MiB,large_max=64MiB",
        "keep_empty=0,batch=1,legacy_batch=1,batch_bytes=1B,legacy_batch_bytes=1B",
        "keep_empty=1024,batch=65536,legacy_batch=65536,sparse=0.999",
        "small_max=1B,large_max=1B",
    ] {
        parse(ok);
    }
    for bad in [
        "superblock=32KiB",
        "superblock=64KiB,small_max=65537B",
        "superblock=64KiB,chunk=96KiB",
        "superblock=64KiB,max=65535B",
        "small_max=1MiB,large_max=1048575B",
        "large_max=67108865B",
        "keep_empty=1025",
        "batch=65537",
        "legacy_batch=0",
        "batch_bytes=0B",
        "legacy_batch_bytes=0B",
        "small_max=0B",
        "sparse=0",
        "max=0B",
        "superblock=128MiB",
        "chunk=0B",
    ] {
        assert!(
            matches!(Config::parse(bad), Err(Error::Config(_))),
            "{bad} accepted: {:?}",
            Config::parse(bad)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// More: the cap moved under the churn, mutual exits, the last clone in a late destructor, OOM
// hooks across allocators.

/// The churn while another thread moves the cap (`set_limit_bytes`) between nothing (below one
/// superblock: every growth refused), a few superblocks and plenty, and trims: out of memory
/// comes and goes; nothing is lost, no race.
#[test]
fn churn_while_the_cap_moves_between_nothing_and_plenty() {
    within(120, || {
        let sim = host(20);
        let a = host_allocator(
            sim.clone(),
            parse("superblock=64KiB,chunk=128KiB,small_max=8KiB,large_max=512KiB,keep_empty=0,batch=2,legacy_batch=2"),
        )
        .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mover = {
            let (a, stop) = (a.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let caps = [0usize, 1, 64 << 10, 256 << 10, 1 << 20, 64 << 20, 4 << 20, 100];
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    a.set_limit_bytes(caps[k % caps.len()]);
                    // Memory reserved under a higher cap still serves under a lower one (as
                    // PyTorch's fraction does): a full trim at the cap of nothing makes it bite.
                    let nothing = k % caps.len() == 0;
                    if k % 5 == 0 || nothing {
                        a.trim(k % 10 == 0 || nothing).unwrap();
                    }
                    k += 1;
                    // The cap of nothing is held longest, so the churn needs to grow under it.
                    std::thread::sleep(Duration::from_micros(if nothing { 3000 } else { 300 }));
                }
                a.set_limit_bytes(usize::MAX);
                a.release_thread().unwrap();
            })
        };
        let live = Arc::new(Live::default());
        // Whether a growth meets the cap of nothing is a matter of timing (on a loaded machine
        // one round of churn can slip between two such windows), so the churn runs again, with
        // a new seed, until the cap has bitten: at most eight rounds.
        let mut ooms = 0;
        for round in 0..8u64 {
            ooms +=
                churn(&a, &sim, &live, &Churn { cap: 600 << 10, seed: 0x5151 + round, ..default_churn() });
            if ooms > 0 {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        mover.join().unwrap();
        eprintln!("{ooms} out-of-memory errors");
        assert!(ooms > 0, "the cap never bit in eight rounds of churn");
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// Four threads each hold blocks of the others, freed on every stream kind (so each thread's
/// outbox, user-stream batches and kept-back legacy frees hold frees towards the others), and
/// all four exit at once, released by a barrier: their exits push batches into inboxes that
/// are closing. Then a new thread reuses everything at once. Several rounds.
#[test]
fn four_threads_exit_at_once_with_frees_towards_each_other_pending() {
    within(120, || {
        let sim = host(30);
        let a = host_allocator(
            sim.clone(),
            parse("superblock=64KiB,chunk=256KiB,small_max=16KiB,large_max=256KiB,batch=64,legacy_batch=256,max=512MiB"),
        )
        .unwrap();
        let live = Arc::new(Live::default());
        for round in 0..8u64 {
            let n = 4;
            let exit = Arc::new(Barrier::new(n));
            let swap = Arc::new(Barrier::new(n));
            let boxes: Arc<Vec<Mailbox>> = Arc::new((0..n).map(|_| Mutex::new(Vec::new())).collect());
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    let (a, sim, live, exit, swap, boxes) = (
                        a.clone(),
                        sim.clone(),
                        Arc::clone(&live),
                        Arc::clone(&exit),
                        Arc::clone(&swap),
                        Arc::clone(&boxes),
                    );
                    std::thread::spawn(move || {
                        let u = sim.create_stream();
                        let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
                        let mut x = ((round + 1) * 0x9e37_79b9) ^ ((i as u64 + 1) * 0x2545) | 1;
                        for k in 0..30usize {
                            let size = [256usize, 5000, 16 << 10, 40 << 10, 200 << 10, 400 << 10][k % 6];
                            let s = streams[(rng(&mut x) % 3) as usize];
                            let p = a.allocate(size, s).unwrap();
                            live.insert(p, size);
                            sim.hold_and_check(p.0, 256, (i * 100 + k) as u32, Duration::from_micros(400), s)
                                .unwrap();
                            let ev = mark(&sim, s);
                            if k % 5 == 0 {
                                // Own free, same stream (kept back on legacy; local elsewhere).
                                live.remove(p);
                                a.deallocate(p, size, s).unwrap();
                            } else {
                                boxes[(i + 1 + k % 3) % n].lock().unwrap().push((p, size, ev));
                            }
                        }
                        swap.wait();
                        let mine = std::mem::take(&mut *boxes[i].lock().unwrap());
                        for (p, size, ev) in mine {
                            let s = streams[(rng(&mut x) % 3) as usize];
                            sim.stream_wait_event(s, ev).unwrap();
                            live.remove(p);
                            a.deallocate(p, size, s).unwrap();
                        }
                        exit.wait();
                        // All four exit now (no release_thread: the thread-local destructor).
                        u
                    })
                })
                .collect();
            let us: Vec<Stream> = hs.into_iter().map(|h| h.join().unwrap()).collect();
            std::thread::spawn({
                let (a, sim, live) = (a.clone(), sim.clone(), Arc::clone(&live));
                move || {
                    a.flush().unwrap();
                    let mut v = Vec::new();
                    for k in 0..200usize {
                        let n = [4096usize, 16 << 10, 100 << 10][k % 3];
                        match a.allocate(n, Stream::PER_THREAD) {
                            Ok(p) => {
                                live.insert(p, n);
                                sim.fill(p.0, n, 1, Stream::PER_THREAD).unwrap();
                                v.push((p, n));
                            }
                            Err(Error::OutOfMemory { .. }) => break,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    for (p, n) in v {
                        live.remove(p);
                        a.deallocate(p, n, Stream::PER_THREAD).unwrap();
                    }
                    a.release_thread().unwrap();
                }
            })
            .join()
            .unwrap();
            for u in us {
                sim.destroy_stream(u).unwrap();
            }
            live.assert_clean();
        }
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// What the late destructor reports: the bytes still reserved on the device after the drop,
/// and the errors of its calls.
type Report = mpsc::Sender<(usize, Vec<String>)>;

struct HoldsAllocator(Option<(Allocator, HostDevice, Report)>);

impl Drop for HoldsAllocator {
    fn drop(&mut self) {
        if let Some((a, sim, done)) = self.0.take() {
            // A late call first (temporary slot), then the last clone goes here.
            let mut errs = Vec::new();
            match a.allocate(4096, Stream::PER_THREAD) {
                Ok(p) => {
                    if let Err(e) = a.deallocate(p, 4096, Stream::PER_THREAD) {
                        errs.push(format!("{e}"));
                    }
                }
                Err(e) => errs.push(format!("{e}")),
            }
            drop(a);
            let _ = done.send((sim.reserved_bytes(), errs));
        }
    }
}

thread_local! {
    static HOLDER: std::cell::RefCell<HoldsAllocator> = const { std::cell::RefCell::new(HoldsAllocator(None)) };
}

/// The only clone of an allocator lives in a thread-local registered before the allocator's
/// own thread state, so it is dropped in a late destructor, after the thread's slots went: the
/// allocator is dropped there (its drop releases every chunk), after a late call. The thread
/// freed everything before exiting, on every stream kind, with work still running. No race
/// and nothing left on the device.
#[test]
fn the_last_clone_dropped_in_a_late_thread_local_destructor() {
    within(60, || {
        let sim = host(0);
        let (tx, rx) = mpsc::channel();
        let sim2 = sim.clone();
        std::thread::spawn(move || {
            let a = host_allocator(
                sim2.clone(),
                parse("superblock=64KiB,chunk=256KiB,small_max=16KiB,large_max=1MiB"),
            )
            .unwrap();
            HOLDER.with(|h| h.borrow_mut().0 = Some((a.clone(), sim2.clone(), tx)));
            let u = sim2.create_stream();
            for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                for n in [256usize, 8 << 10, 100 << 10, 2 << 20] {
                    let p = a.allocate(n, s).unwrap();
                    sim2.hold_and_check(p.0, 256, 3, Duration::from_millis(20), s).unwrap();
                    a.deallocate(p, n, s).unwrap();
                }
            }
            // A remote free waiting in this thread's outbox at exit, too.
            let q = std::thread::spawn({
                let a = a.clone();
                move || a.allocate(3000, Stream::PER_THREAD).unwrap()
            })
            .join()
            .unwrap();
            a.deallocate(q, 3000, Stream::LEGACY).unwrap();
            drop(a);
            // `u` outlives the allocator (destroyed by the test after).
            u
        })
        .join()
        .unwrap();
        let (reserved, errs) = rx.recv_timeout(Duration::from_secs(20)).expect("the holder's destructor ran");
        assert!(errs.is_empty(), "{errs:?}");
        // Measured inside the destructor right after the drop: nothing may be left.
        assert_eq!(reserved, 0, "the allocator's drop released every chunk");
        sim.synchronize();
        let v = sim.violations();
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(sim.tag_errors(), 0);
        assert_eq!(sim.reserved_bytes(), 0);
    });
}

/// OOM hooks across two allocators on one device: A's hook frees A's spare blocks and
/// allocates from B (which is out of memory too, so B's hook runs and allocates from A, which
/// is out of memory inside its own hook: no recursion). From two threads at once. No
/// deadlock, no panic, each allocator's accounting intact.
#[test]
fn oom_hooks_that_call_into_each_others_allocator() {
    within(60, || {
        let sim = host(0);
        let conf = "superblock=64KiB,chunk=64KiB,small_max=16KiB,large_max=64KiB,max=256KiB";
        let a = host_allocator(sim.clone(), parse(conf)).unwrap();
        let b = host_allocator(sim.clone(), parse(conf)).unwrap();
        let spare_a: Arc<Mutex<Vec<DeviceAddr>>> = Arc::default();
        let took: Arc<Mutex<Vec<(u8, DeviceAddr, usize)>>> = Arc::default();
        {
            let (spare, b2, took) = (Arc::clone(&spare_a), b.clone(), Arc::clone(&took));
            let a_weak = a.clone();
            a.set_oom_hook(Some(Arc::new(move |n, _| {
                // From B (probably out of memory: B's hook runs, and calls A).
                if let Ok(p) = b2.allocate(n.min(32 << 10), Stream::LEGACY) {
                    took.lock().unwrap().push((1, p, n.min(32 << 10)));
                }
                let freed = spare.lock().unwrap().pop();
                match freed {
                    Some(p) => {
                        a_weak.deallocate(p, 16 << 10, Stream::LEGACY).unwrap();
                        true
                    }
                    None => false,
                }
            })));
        }
        {
            let (a2, took) = (a.clone(), Arc::clone(&took));
            b.set_oom_hook(Some(Arc::new(move |n, _| {
                if let Ok(p) = a2.allocate(n.min(32 << 10), Stream::LEGACY) {
                    took.lock().unwrap().push((0, p, n.min(32 << 10)));
                }
                false
            })));
        }
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let (a, b, spare, took) = (a.clone(), b.clone(), Arc::clone(&spare_a), Arc::clone(&took));
                std::thread::spawn(move || {
                    for _ in 0..6 {
                        if let Ok(p) = a.allocate(16 << 10, Stream::LEGACY) {
                            spare.lock().unwrap().push(p);
                        }
                    }
                    for k in 0..60usize {
                        let n = [16usize << 10, 48 << 10, 60 << 10][(k + i) % 3];
                        for (w, al) in [(0u8, &a), (1u8, &b)] {
                            match al.allocate(n, Stream::LEGACY) {
                                Ok(p) => took.lock().unwrap().push((w, p, n)),
                                Err(Error::OutOfMemory { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                        }
                        if k % 4 == 3 {
                            let v: Vec<_> = std::mem::take(&mut *took.lock().unwrap());
                            for (w, p, n) in v {
                                let al = if w == 0 { &a } else { &b };
                                al.deallocate(p, n, Stream::LEGACY).unwrap();
                            }
                        }
                    }
                    a.release_thread().unwrap();
                    b.release_thread().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        a.set_oom_hook(None);
        b.set_oom_hook(None);
        let (ha, hb) = (a.stats().oom_hook_calls, b.stats().oom_hook_calls);
        eprintln!("hook calls: A {ha}, B {hb}");
        assert!(ha > 0 && hb > 0, "both hooks ran: A {ha}, B {hb}");
        for (w, p, n) in std::mem::take(&mut *took.lock().unwrap()) {
            let al = if w == 0 { &a } else { &b };
            al.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        for p in std::mem::take(&mut *spare_a.lock().unwrap()) {
            a.deallocate(p, 16 << 10, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, None, 0);
        assert_all_returned(&b, Some(&sim), 0);
    });
}

/// A cap of exactly one superblock (64 KiB), the chunk at its default (clipped to the cap),
/// `small_max` equal to the superblock: three threads fight over one superblock.
#[test]
fn churn_with_a_cap_of_exactly_one_superblock() {
    churn_config(
        "superblock=64KiB,small_max=64KiB,max=64KiB,keep_empty=0",
        Churn { cap: 64 << 10, ops: 3000, ..default_churn() },
    );
}

/// Two allocators on a small device (8 MiB) that hands out chunks aligned to 4 KiB only (not
/// to the superblock: lending takes a chunk one superblock larger), each with no cap of its
/// own: the device fills up (`reserve` refused, not the cap), churned at once.
#[test]
fn two_allocators_churn_on_a_small_device_with_unaligned_chunks() {
    within(120, || {
        let sim = HostDevice::new(HostConfig {
            capacity: 8 << 20,
            alignment: 4096,
            min_delay: Duration::ZERO,
            max_delay: Duration::from_micros(20),
            ..HostConfig::default()
        });
        let a =
            host_allocator(sim.clone(), parse("superblock=64KiB,chunk=64KiB,small_max=16KiB,large_max=1MiB"))
                .unwrap();
        let b = host_allocator(
            sim.clone(),
            parse("superblock=256KiB,chunk=512KiB,small_max=256KiB,large_max=2MiB,keep_empty=0"),
        )
        .unwrap();
        let live = Arc::new(Live::default());
        let hs: Vec<_> = [(a.clone(), 1u64), (b.clone(), 2u64)]
            .into_iter()
            .map(|(al, seed)| {
                let (sim, live) = (sim.clone(), Arc::clone(&live));
                std::thread::spawn(move || {
                    churn(&al, &sim, &live, &Churn { cap: 1 << 20, seed, threads: 2, ..default_churn() })
                })
            })
            .collect();
        for h in hs {
            let ooms = h.join().unwrap();
            eprintln!("{ooms} out-of-memory errors");
        }
        assert_all_returned(&a, None, 0);
        assert_all_returned(&b, Some(&sim), 0);
    });
}

/// Allocator A uses a range, gives it all back to the device (`trim(true)`), and allocator B
/// then reserves memory (often at the very addresses A had: A's registry still has entries
/// and freed flags there). B's blocks freed through A, on every stream kind and from another
/// thread, are refused and B loses nothing; A's own later use is unaffected.
#[test]
fn blocks_of_another_allocator_at_addresses_this_one_released_are_refused() {
    within(60, || {
        let sim = host(0);
        let conf = "superblock=64KiB,chunk=1MiB,small_max=16KiB,large_max=256KiB";
        let a = host_allocator(sim.clone(), parse(conf)).unwrap();
        let b = host_allocator(sim.clone(), parse(conf)).unwrap();
        let u = sim.create_stream();
        let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
        let sizes = [256usize, 4096, 16 << 10, 100 << 10, 300 << 10];
        let mut a_addrs = std::collections::BTreeSet::new();
        for s in streams {
            let v: Vec<_> = sizes.iter().map(|&n| (a.allocate(n, s).unwrap(), n)).collect();
            for &(p, n) in &v {
                a_addrs.insert(p.0);
                a.deallocate(p, n, s).unwrap();
            }
        }
        // One block of A's stays live across the trim (its superblock dissolved at the
        // release: a pool block of A's, freed at the end).
        let keep = a.allocate(8 << 10, Stream::PER_THREAD).unwrap();
        a.release_thread().unwrap();
        a.flush().unwrap();
        a.release_thread().unwrap();
        assert!(a.trim(true).unwrap() > 0);
        let _ = keep; // now a pool block of A's: freed below
        let mut blocks = Vec::new();
        for s in streams {
            for &n in &sizes {
                blocks.push((b.allocate(n, s).unwrap(), n, s));
            }
        }
        let reused = blocks.iter().filter(|(p, ..)| a_addrs.contains(&p.0)).count();
        eprintln!("{reused} of B's blocks start where A's did");
        let mut bad = 0u64;
        for &(p, n, _) in &blocks {
            for s in streams {
                let r = a.deallocate(p, n, s);
                assert!(is_invalid(&r), "A took B's block {p:?} ({n} B) on {s:?}: {r:?}");
                bad += 1;
            }
        }
        let (a2, bl) = (a.clone(), blocks.clone());
        bad += std::thread::spawn(move || {
            let mut k = 0;
            for (p, n, _) in bl {
                for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                    assert!(is_invalid(&a2.deallocate(p, n, s)));
                    k += 1;
                }
            }
            a2.release_thread().unwrap();
            k
        })
        .join()
        .unwrap();
        for (p, n, s) in blocks {
            sim.fill(p.0, n, 1, s).unwrap();
            b.deallocate(p, n, s).unwrap();
        }
        a.deallocate(keep, 8 << 10, Stream::PER_THREAD).unwrap();
        sim.destroy_stream(u).unwrap();
        assert_all_returned(&b, None, 0);
        assert_all_returned(&a, Some(&sim), bad);
    });
}

// ---------------------------------------------------------------------------------------------
// Found by helper-7's reading of every place memory goes back to the driver.

/// A `trim` whose identity query of the legacy stream fails (needed to record the lazy legacy
/// fence of a pool extent freed on the legacy stream) returns that error and loses nothing: the
/// extent stays in the pool, and the next `trim` releases its chunk. Before the fix the extent
/// was taken out of the free map before the query and dropped by its `?`: the chunk was never
/// wholly free again, and stayed reserved until the allocator's drop.
#[test]
fn a_trim_whose_legacy_identity_query_fails_keeps_the_extent() {
    within(60, || {
        let sim = host(0);
        let fail = Arc::new(AtomicBool::new(false));
        let fail_h = Arc::clone(&fail);
        let key: cuarena_testkit::hooked::KeyHook = Box::new(move |sim, s| {
            if s.is_legacy() && fail_h.load(Ordering::SeqCst) {
                return Err(Error::Driver { call: "cuStreamGetId (injected)", code: 999 });
            }
            sim.stream_key(s)
        });
        let dev = cuarena_testkit::HookedDevice::new(
            sim.clone(),
            cuarena_testkit::Hooks { stream_key: Some(key), ..Default::default() },
        );
        // Every request over 64 KiB is the pool's: a 1 MiB block freed on the legacy stream
        // leaves its chunk wholly free behind a lazy legacy fence, and nothing has asked the
        // legacy stream's identity for the pool yet (the block is allocated on the per-thread
        // stream: since the twenty-fifth session a pool allocation on the legacy stream asks
        // it, once per allocator, `Slot::key_of`).
        let a = Allocator::new(dev, parse("superblock=64KiB,small_max=64KiB,large_max=64KiB,chunk=2MiB"))
            .unwrap();
        let p = a.allocate(1 << 20, Stream::PER_THREAD).unwrap();
        a.deallocate(p, 1 << 20, Stream::LEGACY).unwrap();
        let reserved = a.stats().reserved_bytes;
        assert!(reserved >= 1 << 20);
        fail.store(true, Ordering::SeqCst);
        let r = a.trim(false);
        assert!(matches!(r, Err(Error::Driver { code: 999, .. })), "the query's error, not {r:?}");
        assert_eq!(a.stats().reserved_bytes, reserved, "nothing released under the failed trim");
        fail.store(false, Ordering::SeqCst);
        a.trim(true).unwrap();
        assert_eq!(a.stats().reserved_bytes, 0, "the extent stayed in the pool: its chunk goes back");
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// A `DeviceBuffer` declared on the per-thread stream (`record_stream(PER_THREAD)`) by one
/// thread and dropped on another: the declaration names the first thread's per-thread stream,
/// which the dropping thread cannot name (its `0x2` is its own), so the drop fences it through
/// the legacy stream. Found by helper-7's reading: the drop fenced the dropping thread's per-thread
/// stream instead, and the block was handed out again under the first thread's running work.
/// Thread A makes the buffer on a user stream, holds it with work on its per-thread stream and
/// declares that stream; thread B drops it (batches of one: the free's fence is recorded at
/// once, on the user stream); A allocates on the user stream until it gets the block back and
/// writes it there. With the mutation `per_thread_anywhere` the write lands under A's
/// work.
#[test]
fn a_buffer_used_on_one_threads_per_thread_stream_and_dropped_on_another_waits_for_it() {
    within(60, || {
        let sim = host(0);
        let a = host_allocator(sim.clone(), parse("superblock=64KiB,small_max=32KiB,batch=1")).unwrap();
        let user = sim.create_stream();
        let size = 32 << 10;
        let mut buf = a.buffer(size, user).unwrap();
        let p = buf.ptr();
        sim.hold_and_check(p.0, size, 7, Duration::from_millis(300), Stream::PER_THREAD).unwrap();
        buf.record_stream(Stream::PER_THREAD);
        std::thread::spawn(move || drop(buf)).join().unwrap();
        assert!(a.take_deferred_error().is_none());
        assert_reuse_waits(&sim, &a, (size, user, p), 8, "the declaring thread's work");
        sim.destroy_stream(user).unwrap();
        assert_all_returned(&a, Some(&sim), 0);
    });
}

/// The same buffer dropped by the thread that declared its per-thread stream: no host block
/// (the work on that stream waits behind a closed gate here, which a synchronise would wait
/// for until the test times out), and the declared stream is fenced as any stream, so the
/// block comes back only after that work.
#[test]
fn a_buffer_dropped_by_the_thread_that_declared_its_per_thread_stream_is_fenced_without_blocking() {
    within(60, || {
        let sim = host(0);
        let a = host_allocator(sim.clone(), parse("superblock=64KiB,small_max=32KiB,batch=1")).unwrap();
        let user = sim.create_stream();
        let size = 32 << 10;
        let mut buf = a.buffer(size, user).unwrap();
        let p = buf.ptr();
        let gate = sim.gate(Stream::PER_THREAD).unwrap();
        sim.hold_and_check(p.0, size, 7, Duration::from_millis(50), Stream::PER_THREAD).unwrap();
        buf.record_stream(Stream::PER_THREAD);
        drop(buf);
        assert!(a.take_deferred_error().is_none());
        let (got, reused) = allocate_until_back(&a, size, user, p, 8);
        if reused {
            sim.write_tag(p.0, size, 9, user).unwrap();
        }
        gate.open();
        sim.synchronize();
        assert_eq!(sim.tag_errors(), 0);
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        for q in got {
            a.deallocate(q, size, user).unwrap();
        }
        sim.destroy_stream(user).unwrap();
        assert_all_returned(&a, Some(&sim), 0);
    });
}
