//! helper-26's attacks (twenty-fourth session): threads using more user streams than their
//! table of user arenas holds, streams destroyed while blocks freed on them sit in arenas and
//! their handles given to new streams; out of memory under a tight cap while idle threads hold
//! memory in every kind of arena; reclaim, `trim`, `flush` and `release_thread` racing owners;
//! remote frees in bulk after their owner exited; wrong-size and double frees racing correct
//! ones; two allocators on the same threads and a dropped allocator's blocks; large and huge
//! blocks mixed with small ones across streams. Every test ends with every byte back and the
//! race checker clean.

#![allow(clippy::manual_is_multiple_of, clippy::type_complexity)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::{
    Live, Worker, all_back, host, is_double, is_invalid, no_violations, on_thread, rng, small, within,
};
use cuarena::{Allocator, Device, DeviceAddr, Error, Event, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

/// Small blocks up to 64 KiB, large ones up to 2 MiB from large superblocks, the rest from the
/// pool.
fn cfg() -> cuarena::ConfigBuilder {
    small().large_max(2 << 20)
}

fn alloc_on(sim: &HostDevice, b: cuarena::ConfigBuilder) -> Allocator {
    host_allocator(sim.clone(), b.build().unwrap()).unwrap()
}

/// An event recorded on `from` now.
fn mark(sim: &HostDevice, from: Stream) -> Event {
    let e = sim.create_event().unwrap();
    sim.record_event(e, from).unwrap();
    e
}

/// Makes later work on `to` wait for the work queued on `from` so far.
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    let e = mark(sim, from);
    sim.stream_wait_event(to, e).unwrap();
}

/// A size: small (most), large (over `small_max`, up to `large_max`) or huge (over
/// `large_max`: the pool).
fn mixed_size(x: &mut u64) -> usize {
    match rng(x) % 16 {
        0 => (2 << 20) + 256 * (1 + (rng(x) % 4096) as usize), // huge: the pool
        1 | 2 => (64 << 10) + 256 * (1 + (rng(x) % 7000) as usize), // large
        _ => 1 + (rng(x) % (64 << 10)) as usize,               // small
    }
}

/// Tags the first and last 256 bytes of a block on `s` (with a hold on the head, so the work
/// is still running when the allocator next sees the block).
fn use_block(sim: &HostDevice, p: DeviceAddr, n: usize, t: u32, s: Stream, hold_us: u64) {
    let head = n.min(256);
    sim.hold_and_check(p.0, head, t, Duration::from_micros(hold_us), s).unwrap();
    if n > 512 {
        sim.write_tag(p.0 + (n as u64 & !255) - 256, 256, t ^ 0x5555, s).unwrap();
    }
}

fn aligned(p: DeviceAddr) {
    assert_eq!(p.0 % 256, 0, "{p:?} not 256-byte aligned");
}

/// (1) A thread's stream `X` is destroyed while its blocks are still in use there; its handle
/// goes to a new stream `Y`, made to wait for `X`'s work; the owner frees `X`'s blocks on that
/// handle (the fast path takes them into `X`'s arena without asking the identity: its handle
/// matches). Meanwhile `X`'s work is held in flight by a gate. The thread then allocates the
/// same sizes on `Z` (another live stream that never waited for `X`), on its per-thread and on
/// the legacy stream, cycles through more streams than its table holds (so `X`'s arena is
/// replaced and parked), and another thread trims without blocking: none of `X`'s memory may
/// reach a stream not ordered after `X`'s work.
#[test]
fn owner_frees_on_a_reused_handle_then_cycles_past_the_table_under_a_gate() {
    let sim = host(0);
    let a = alloc_on(&sim, cfg());
    let live = Arc::new(Live::default());
    let (gate_tx, gate_rx) = std::sync::mpsc::channel();
    let w = Worker::new(&a);
    // Phase 1: blocks used on X behind a closed gate, X destroyed, Y with X's handle.
    let (y, z, blocks) = w.run({
        let (sim, live) = (sim.clone(), live.clone());
        move |a| {
            let x = sim.create_stream();
            let gate = sim.gate(x).unwrap();
            gate_tx.send(gate).unwrap();
            let mut seed = 0x5eed_0001u64;
            let mut blocks = Vec::new();
            for i in 0..48u32 {
                let n = mixed_size(&mut seed);
                let p = a.allocate(n, x).unwrap();
                aligned(p);
                live.insert(p, n);
                use_block(&sim, p, n, 0x100 + i, x, 50);
                blocks.push((p, n));
            }
            let e = mark(&sim, x);
            sim.destroy_stream(x).unwrap();
            let y = sim.create_stream();
            assert_eq!(y, x, "the simulator hands the handle on");
            sim.stream_wait_event(y, e).unwrap();
            let z = sim.create_stream();
            // The owner frees X's blocks on Y's handle: legal (Y waits for X's work).
            for &(p, n) in &blocks {
                live.remove(p);
                a.deallocate(p, n, y).unwrap();
            }
            (y, z, blocks)
        }
    });
    let gate = gate_rx.recv().unwrap();
    // Phase 2: the same sizes, many times, on streams not ordered after X's work.
    let others = w.run({
        let (sim, live) = (sim.clone(), live.clone());
        move |a| {
            let mut held = Vec::new();
            for round in 0..3 {
                for &s in &[z, Stream::PER_THREAD, Stream::LEGACY] {
                    for &(_, n) in &blocks {
                        let p = a.allocate(n, s).unwrap();
                        aligned(p);
                        live.insert(p, n);
                        sim.write_tag(p.0, n.min(256), 0xa000 + round, s).unwrap();
                        held.push((p, n, s));
                    }
                }
                for (p, n, s) in held.drain(..) {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
            }
            // More streams than the table holds: X's arena (least recently used, holding
            // memory) is parked, or given back if it holds none.
            let mut streams = Vec::new();
            for k in 0..(cuarena::MAX_USER_ARENAS + 4) as u32 {
                let s = sim.create_stream();
                for &(_, n) in blocks.iter().take(6) {
                    let p = a.allocate(n, s).unwrap();
                    live.insert(p, n);
                    sim.write_tag(p.0, n.min(256), 0xb000 + k, s).unwrap();
                    held.push((p, n, s));
                }
                streams.push(s);
            }
            // Y too: its own arena, new.
            for &(_, n) in blocks.iter().take(12) {
                let p = a.allocate(n, y).unwrap();
                live.insert(p, n);
                sim.write_tag(p.0, n.min(256), 0xc000, y).unwrap();
                held.push((p, n, y));
            }
            (held, streams)
        }
    });
    // Another thread trims without blocking (it must not take X's memory: no fence can follow
    // a destroyed stream), and allocates on its own stream.
    on_thread(&a, {
        let (sim, live) = (sim.clone(), live.clone());
        move |a| {
            a.trim(false).unwrap();
            let t = sim.create_stream();
            let mut v = Vec::new();
            for i in 0..64u32 {
                let n = 256 << (i % 8);
                let p = a.allocate(n, t).unwrap();
                live.insert(p, n);
                sim.write_tag(p.0, n.min(256), 0xd000 + i, t).unwrap();
                v.push((p, n));
            }
            for (p, n) in v {
                live.remove(p);
                a.deallocate(p, n, t).unwrap();
            }
            sim.destroy_stream(t).unwrap();
        }
    });
    assert!(sim.violations().is_empty(), "{:?}", &sim.violations()[..sim.violations().len().min(3)]);
    gate.open();
    let (held, streams) = others;
    w.run({
        let (sim, live) = (sim.clone(), live.clone());
        move |a| {
            for (p, n, s) in held {
                live.remove(p);
                a.deallocate(p, n, s).unwrap();
            }
            for s in streams {
                sim.destroy_stream(s).unwrap();
            }
            sim.destroy_stream(y).unwrap();
            sim.destroy_stream(z).unwrap();
        }
    });
    drop(w);
    live.assert_clean();
    all_back(&a, &sim);
}

/// (2) An owner allocates on its user stream `X`, its per-thread and the legacy stream, hands
/// every block to three other threads and exits before any of them frees (its user arena is
/// parked with live blocks). `X` is destroyed (its work still held by a gate), its handle goes
/// to `Y`, which waits for `X`; the freeing threads free on `Y`'s handle (remote frees on a
/// user stream: batched per identity, parked at their flush or exit), on their own streams
/// (ordered after `X`), on their per-thread streams and on the legacy stream. Meanwhile a
/// fourth thread allocates on `Y` and on a stream of its own: it must never get one of the
/// blocks before its fence, nor adopt `X`'s parked arena.
#[test]
fn remote_frees_on_a_reused_handle_after_the_owner_exited() {
    let sim = host(0);
    let a = alloc_on(&sim, cfg().batch_blocks(16));
    let live = Arc::new(Live::default());
    let (x, blocks, gate) = {
        let (sim2, live2) = (sim.clone(), live.clone());
        let a2 = a.clone();
        std::thread::spawn(move || {
            let x = sim2.create_stream();
            let gate = sim2.gate(x).unwrap();
            let mut seed = 0xabcd_ef01u64;
            let mut blocks = Vec::new();
            for i in 0..300u32 {
                let s = [x, x, Stream::PER_THREAD, Stream::LEGACY][i as usize % 4];
                let n = mixed_size(&mut seed);
                let p = a2.allocate(n, s).unwrap();
                aligned(p);
                live2.insert(p, n);
                use_block(&sim2, p, n, 0x200 + i, s, 20);
                blocks.push((p, n, s));
            }
            // The per-thread and legacy uses, ordered before X's end (so one event on X
            // covers every use).
            order(&sim2, Stream::PER_THREAD, x);
            order(&sim2, Stream::LEGACY, x);
            (x, blocks, gate)
            // The thread exits here: its arenas go (X's parked, it holds live blocks).
        })
        .join()
        .unwrap()
    };
    assert!(a.parked_bytes() > 0, "the owner's user arena is parked");
    let e = mark(&sim, x);
    sim.destroy_stream(x).unwrap();
    let y = sim.create_stream();
    assert_eq!(y, x);
    sim.stream_wait_event(y, e).unwrap();
    let blocks = Arc::new(Mutex::new(blocks));
    let done = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for t in 0..3u64 {
        let (a, sim, live, blocks) = (a.clone(), sim.clone(), live.clone(), blocks.clone());
        hs.push(std::thread::spawn(move || {
            let own = sim.create_stream();
            for s in [own, Stream::PER_THREAD, Stream::LEGACY] {
                sim.stream_wait_event(s, e).unwrap();
            }
            let mut i = 0usize;
            loop {
                let Some((p, n, _)) = blocks.lock().unwrap().pop() else { break };
                let on = [y, own, Stream::PER_THREAD, Stream::LEGACY][(i + t as usize) % 4];
                live.remove(p);
                a.deallocate(p, n, on).unwrap();
                // An ordered second free is refused at once, on any stream: as a double free,
                // or as an unknown pointer where the memory went on meanwhile into another block
                // (the pool may lend a freed extent to another stream at once, behind a wait on
                // its fence: seen in about one run in forty on two cores).
                let again = [Stream::PER_THREAD, y, own, Stream::LEGACY][i % 4];
                let r2 = a.deallocate(p, n, again);
                let refused = matches!(
                    r2,
                    Err(Error::InvalidFree {
                        reason: InvalidFree::DoubleFree | InvalidFree::UnknownPointer,
                        ..
                    })
                );
                assert!(refused, "a double free accepted: {r2:?} (freed on {on:?}, again on {again:?})");
                i += 1;
            }
            // Half flush (parks their user-stream batches), half just exit.
            if t % 2 == 0 {
                a.flush().unwrap();
            }
            (own, 2 * i)
        }));
    }
    // The fourth thread: churn on Y and on its own stream while the frees go on.
    let churn = {
        let (a, sim, live, done) = (a.clone(), sim.clone(), live.clone(), done.clone());
        std::thread::spawn(move || {
            let mine = sim.create_stream();
            let mut seed = 0x7777u64;
            let mut k = 0u32;
            while !done.load(Ordering::Relaxed) || k < 600 {
                let s = if k % 2 == 0 { y } else { mine };
                let n = mixed_size(&mut seed);
                let p = a.allocate(n, s).unwrap();
                aligned(p);
                live.insert(p, n);
                sim.write_tag(p.0, n.min(256), 0xe000 + k, s).unwrap();
                live.remove(p);
                a.deallocate(p, n, s).unwrap();
                k += 1;
                if k > 20_000 {
                    break;
                }
            }
            a.release_thread().unwrap();
            mine
        })
    };
    let mut bad = 0;
    let mut owns = Vec::new();
    for h in hs {
        let (own, n) = h.join().unwrap();
        bad += n / 2;
        owns.push(own);
    }
    done.store(true, Ordering::Relaxed);
    let mine = churn.join().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", &sim.violations()[..sim.violations().len().min(3)]);
    gate.open();
    for s in owns.into_iter().chain([y, mine]) {
        sim.destroy_stream(s).unwrap();
    }
    live.assert_clean();
    no_violations(&sim);
    assert_all_returned(&a, Some(&sim), bad as u64);
}

/// Fills `w`'s arenas for its per-thread stream, the legacy stream and `streams` with freed
/// memory (own frees: local, kept back on the legacy stream), keeps `keep` blocks live on each
/// and returns them.
fn fill_and_idle(
    w: &Worker,
    sim: &HostDevice,
    live: &Arc<Live>,
    streams: Vec<Stream>,
    seed: u64,
) -> Vec<(DeviceAddr, usize, Stream)> {
    let (sim, live) = (sim.clone(), live.clone());
    w.run(move |a| {
        let mut x = seed;
        let mut kept = Vec::new();
        for s in [Stream::PER_THREAD, Stream::LEGACY].into_iter().chain(streams) {
            let mut v = Vec::new();
            for i in 0..24u32 {
                let n = 1 + (rng(&mut x) % (48 << 10)) as usize;
                match a.allocate(n, s) {
                    Ok(p) => {
                        aligned(p);
                        live.insert(p, n);
                        use_block(&sim, p, n, 0x300 + i, s, 5);
                        v.push((p, n));
                    }
                    Err(Error::OutOfMemory { .. }) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            for (k, (p, n)) in v.into_iter().enumerate() {
                if k % 8 == 0 {
                    kept.push((p, n, s));
                } else {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
            }
        }
        kept
    })
}

/// (3) Out of memory under a tight cap while four idle threads hold freed memory in per-thread,
/// legacy (kept back) and user-stream arenas (two of those streams destroyed, so only a device
/// synchronise frees their memory), with remote frees sent into their inboxes by a fifth.
/// Another thread then allocates until out of memory: the error is clear, and by then almost
/// every byte the idle threads do not use has been taken back. Then the owners wake and
/// allocate while a reclaimer runs out of memory again, one of them exits mid-way, and
/// everything comes back.
#[test]
fn out_of_memory_takes_back_idle_memory_of_every_kind_of_arena() {
    let sim = host(10);
    let cap = 12 << 20;
    let a = alloc_on(&sim, cfg().max_bytes(cap).batch_blocks(8));
    let live = Arc::new(Live::default());
    let ws: Vec<Worker> = (0..4).map(|_| Worker::new(&a)).collect();
    let mut kept = Vec::new();
    let mut dead = Vec::new();
    let mut alive = Vec::new();
    for (i, w) in ws.iter().enumerate() {
        let (s1, s2) = (sim.create_stream(), sim.create_stream());
        kept.push(fill_and_idle(w, &sim, &live, vec![s1, s2], 0x1000 + i as u64));
        if i % 2 == 0 {
            // Their blocks still live are freed on the legacy stream after it waits.
            order(&sim, s1, Stream::LEGACY);
            sim.destroy_stream(s1).unwrap();
            dead.push(s1);
        } else {
            alive.push(s1);
        }
        alive.push(s2);
    }
    for &s in &alive {
        order(&sim, s, Stream::LEGACY);
    }
    // A fifth thread frees half the kept blocks remotely (into the owners' inboxes) and
    // flushes: on the legacy stream (which follows every per-thread stream's earlier work, and
    // every user stream's, ordered above), the legacy blocks on its per-thread stream (which
    // follows earlier legacy work).
    let remote: Vec<_> = kept.iter_mut().flat_map(|k| k.split_off(k.len() / 2)).collect();
    on_thread(&a, {
        let live = live.clone();
        move |a| {
            for (p, n, s) in remote {
                let on = if s.is_legacy() { Stream::PER_THREAD } else { Stream::LEGACY };
                live.remove(p);
                a.deallocate(p, n, on).unwrap();
            }
            a.flush().unwrap();
        }
    });
    let still: usize = kept.iter().flatten().map(|&(_, n, _)| n).sum();
    // The hungry thread: 32 KiB blocks on its per-thread stream until out of memory.
    let (got, err) = on_thread(&a, {
        let live = live.clone();
        move |a| {
            let mut got = Vec::new();
            let err = loop {
                match a.allocate_per_thread(32 << 10) {
                    Ok(p) => {
                        aligned(p);
                        live.insert(p, 32 << 10);
                        got.push(p);
                    }
                    Err(e) => break e,
                }
                assert!(got.len() < 1000, "more than the cap");
            };
            for &p in &got {
                live.remove(p);
                a.deallocate_per_thread(p, 32 << 10).unwrap();
            }
            (got.len(), err)
        }
    });
    match err {
        Error::OutOfMemory { limit, .. } => assert_eq!(limit, cap),
        e => panic!("not a clear out-of-memory error: {e}"),
    }
    let took = got * (32 << 10);
    eprintln!("took {took} of {cap}, idle threads still use {still}");
    // What the idle threads still use sits in superblocks of 256 KiB, one per live block at
    // worst; the rest of the cap must have come back.
    let kept_blocks = kept.iter().flatten().count();
    assert!(
        took + kept_blocks * (256 << 10) + (2 << 20) >= cap,
        "out of memory with {took} B taken: idle memory was not taken back"
    );
    // The owners wake up and churn while another thread runs out of memory again and again.
    let stop = Arc::new(AtomicBool::new(false));
    let hog = {
        let (a, live, stop) = (a.clone(), live.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut ooms = 0u32;
            for round in 0..400 {
                // At least 15 rounds, more while the owners churn.
                if round >= 15 && stop.load(Ordering::Relaxed) {
                    break;
                }
                let mut got = Vec::new();
                loop {
                    match a.allocate(48 << 10, Stream::LEGACY) {
                        Ok(p) => {
                            live.insert(p, 48 << 10);
                            got.push(p);
                        }
                        Err(Error::OutOfMemory { .. }) => {
                            ooms += 1;
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                for p in got {
                    live.remove(p);
                    a.deallocate(p, 48 << 10, Stream::LEGACY).unwrap();
                }
            }
            a.release_thread().unwrap();
            ooms
        })
    };
    let mut ws: Vec<Option<Worker>> = ws.into_iter().map(Some).collect();
    for (i, k) in kept.into_iter().enumerate() {
        let (sim, live, alive) = (sim.clone(), live.clone(), alive.clone());
        ws[i].as_ref().unwrap().run(move |a| {
            let mut x = 0x99 + i as u64;
            for (p, n, s) in k {
                let on = if s.is_user() && !alive.contains(&s) { Stream::LEGACY } else { s };
                live.remove(p);
                a.deallocate(p, n, on).unwrap();
            }
            for round in 0..30u32 {
                let s = if round % 3 == 0 { alive[i % alive.len()] } else { Stream::PER_THREAD };
                let n = 1 + (rng(&mut x) % (64 << 10)) as usize;
                match a.allocate(n, s) {
                    Ok(p) => {
                        live.insert(p, n);
                        sim.write_tag(p.0, n.min(256), 0x400 + round, s).unwrap();
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    Err(Error::OutOfMemory { .. }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
        });
        if i == 1 {
            // One owner exits mid-way, with the hog still reclaiming.
            ws[1].take().unwrap().exit();
        }
    }
    for w in ws.iter().flatten() {
        w.run(|a| a.flush().unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    let ooms = hog.join().unwrap();
    eprintln!("hog ran out of memory {ooms} times");
    drop(ws);
    for s in alive {
        sim.destroy_stream(s).unwrap();
    }
    let _ = dead;
    live.assert_clean();
    all_back(&a, &sim);
}

/// A block handed from one thread to another, with an event that follows its last use.
type Handoff = (DeviceAddr, usize, Event);

/// (4) Four threads churn on their per-thread stream, the legacy stream and six user streams
/// each (destroyed and made anew now and then, their handles reused), with mixed small, large
/// and huge blocks under a cap, and hand blocks to one another for remote frees (ordered by an
/// event); two more threads meanwhile call `trim(true)`, `trim(false)`, `flush` and
/// `release_thread` in a loop, and two churners exit mid-way and are replaced. Refusals are
/// clear out-of-memory errors only; no overlap, no race, no deadlock, and everything comes
/// back.
#[test]
fn trim_flush_and_release_storm_over_churn_on_many_streams() {
    within(120, || {
        let sim = host(15);
        let a = alloc_on(&sim, cfg().max_bytes(20 << 20).batch_blocks(12));
        let live = Arc::new(Live::default());
        let mailbox: Arc<Mutex<Vec<Handoff>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let ooms = Arc::new(AtomicU64::new(0));
        let churner = |t: u64, steps: u32| {
            let (a, sim, live, mailbox, ooms) =
                (a.clone(), sim.clone(), live.clone(), mailbox.clone(), ooms.clone());
            std::thread::spawn(move || {
                let mut x = 0x51_7e00 + t;
                let mut streams: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
                let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                for step in 0..steps {
                    let r = rng(&mut x);
                    let s = match r % 8 {
                        0 => Stream::PER_THREAD,
                        1 => Stream::LEGACY,
                        k => streams[(k as usize) % streams.len()],
                    };
                    let n = mixed_size(&mut x);
                    match a.allocate(n, s) {
                        Ok(p) => {
                            aligned(p);
                            live.insert(p, n);
                            use_block(&sim, p, n, step, s, 10);
                            held.push((p, n, s));
                        }
                        Err(Error::OutOfMemory { .. }) => {
                            ooms.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("{e}"),
                    }
                    // Free one held block: on its stream, on another (ordered), or hand it over.
                    if held.len() > 12 || (r >> 8) % 3 == 0 {
                        let k = (r >> 16) as usize % held.len().max(1);
                        if k < held.len() {
                            let (p, n, on) = held.swap_remove(k);
                            match (r >> 24) % 4 {
                                0 => {
                                    let e = mark(&sim, on);
                                    live.remove(p);
                                    mailbox.lock().unwrap().push((p, n, e));
                                }
                                1 => {
                                    let to = streams[(r >> 28) as usize % streams.len()];
                                    order(&sim, on, to);
                                    live.remove(p);
                                    a.deallocate(p, n, to).unwrap();
                                }
                                _ => {
                                    live.remove(p);
                                    a.deallocate(p, n, on).unwrap();
                                }
                            }
                        }
                    }
                    // Someone else's block.
                    let handed = if step % 3 == 0 { mailbox.lock().unwrap().pop() } else { None };
                    if let Some((p, n, e)) = handed {
                        let on = [Stream::PER_THREAD, Stream::LEGACY, streams[0]][step as usize % 3];
                        sim.stream_wait_event(on, e).unwrap();
                        a.deallocate(p, n, on).unwrap();
                    }
                    // Now and then a stream is destroyed, its blocks freed first on it.
                    if step % 97 == 96 {
                        let j = (r >> 32) as usize % streams.len();
                        let old = streams[j];
                        for (p, n, _) in held.iter().filter(|h| h.2 == old).copied().collect::<Vec<_>>() {
                            live.remove(p);
                            a.deallocate(p, n, old).unwrap();
                        }
                        held.retain(|h| h.2 != old);
                        sim.destroy_stream(old).unwrap();
                        streams[j] = sim.create_stream();
                    }
                }
                for (p, n, s) in held {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                // What others handed over is freed by whoever is left: the last churners.
                streams
            })
        };
        let mut hs: Vec<_> = (0..4).map(|t| churner(t, if t < 2 { 300 } else { 900 })).collect();
        let maint: Vec<_> = (0..2u64)
            .map(|t| {
                let (a, stop) = (a.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) && i < 5000 {
                        match (i + t) % 4 {
                            0 => drop(a.trim(true).unwrap()),
                            1 => drop(a.trim(false).unwrap()),
                            2 => a.flush().unwrap(),
                            _ => a.release_thread().unwrap(),
                        }
                        i += 1;
                        std::thread::yield_now();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        // The two short churners exit mid-way; two more replace them.
        let mut streams = Vec::new();
        for h in hs.drain(..2) {
            streams.extend(h.join().unwrap());
        }
        hs.push(churner(10, 400));
        hs.push(churner(11, 400));
        for h in hs {
            streams.extend(h.join().unwrap());
        }
        stop.store(true, Ordering::Relaxed);
        for h in maint {
            h.join().unwrap();
        }
        // The blocks still in the mailbox.
        on_thread(&a, {
            let sim = sim.clone();
            let mailbox = mailbox.clone();
            move |a| {
                for (p, n, e) in mailbox.lock().unwrap().drain(..) {
                    sim.stream_wait_event(Stream::LEGACY, e).unwrap();
                    a.deallocate(p, n, Stream::LEGACY).unwrap();
                }
            }
        });
        for s in streams {
            sim.destroy_stream(s).unwrap();
        }
        eprintln!("{} out-of-memory refusals; {:?}", ooms.load(Ordering::Relaxed), a.stats());
        live.assert_clean();
        all_back(&a, &sim);
    });
}

/// (5) An owner allocates 3,000 blocks (small, large and huge) on its per-thread stream, the
/// legacy stream and a user stream, and exits before any is freed. Four threads then free
/// them in bulk, each on a mix of streams (their own user streams, their per-thread streams,
/// the legacy stream, the owner's stream while it lives, then its reused handle), churning
/// their own blocks meanwhile; two of them exit without a flush. No block may be lost or
/// handed out twice.
#[test]
fn bulk_remote_frees_arriving_after_their_owner_exited() {
    let sim = host(5);
    let a = alloc_on(&sim, cfg().batch_blocks(32));
    let live = Arc::new(Live::default());
    let (x, e, blocks) = {
        let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
        std::thread::spawn(move || {
            let x = sim.create_stream();
            let mut seed = 0xb01c_u64;
            let mut blocks = Vec::new();
            for i in 0..3000u32 {
                let s = [x, Stream::PER_THREAD, Stream::LEGACY][i as usize % 3];
                let n = mixed_size(&mut seed);
                let p = a.allocate(n, s).unwrap();
                aligned(p);
                live.insert(p, n);
                sim.write_tag(p.0, n.min(256), i, s).unwrap();
                blocks.push((p, n));
            }
            order(&sim, Stream::PER_THREAD, x);
            order(&sim, Stream::LEGACY, x);
            let e = mark(&sim, x);
            (x, e, blocks)
        })
        .join()
        .unwrap()
    };
    let chunks: Vec<Vec<(DeviceAddr, usize)>> = blocks.chunks(750).map(<[_]>::to_vec).collect();
    // Halfway through, the owner's stream is destroyed and its handle given to a new stream
    // (which waits for it): frees after that use the new stream.
    let reborn = Arc::new(Mutex::new(None::<Stream>));
    let half = Arc::new(Barrier::new(4));
    let hs: Vec<_> = chunks
        .into_iter()
        .enumerate()
        .map(|(t, mine)| {
            let (a, sim, live, reborn, half) =
                (a.clone(), sim.clone(), live.clone(), reborn.clone(), half.clone());
            std::thread::spawn(move || {
                let own = sim.create_stream();
                for s in [own, Stream::PER_THREAD, Stream::LEGACY] {
                    sim.stream_wait_event(s, e).unwrap();
                }
                let mut seed = 0xf00d + t as u64;
                let mut churn = Vec::new();
                for (i, (p, n)) in mine.into_iter().enumerate() {
                    if i == 375 && half.wait().is_leader() {
                        sim.destroy_stream(x).unwrap();
                        let y = sim.create_stream();
                        sim.stream_wait_event(y, e).unwrap();
                        *reborn.lock().unwrap() = Some(y);
                    }
                    if i == 375 {
                        // Everyone sees the new stream before going on.
                        half.wait();
                    }
                    let xs = if i < 375 { x } else { reborn.lock().unwrap().unwrap() };
                    let on = [own, Stream::PER_THREAD, Stream::LEGACY, xs][(i + t) % 4];
                    live.remove(p);
                    a.deallocate(p, n, on).unwrap();
                    // Own churn on the same streams.
                    if i % 5 == 0 {
                        let n = mixed_size(&mut seed);
                        let s = [own, Stream::PER_THREAD, Stream::LEGACY][i % 3];
                        let q = a.allocate(n, s).unwrap();
                        aligned(q);
                        live.insert(q, n);
                        sim.write_tag(q.0, n.min(256), 0x5000 + i as u32, s).unwrap();
                        churn.push((q, n, s));
                    }
                    if churn.len() > 20 {
                        let (q, n, s) = churn.remove(0);
                        live.remove(q);
                        a.deallocate(q, n, s).unwrap();
                    }
                }
                for (q, n, s) in churn {
                    live.remove(q);
                    a.deallocate(q, n, s).unwrap();
                }
                if t % 2 == 0 {
                    a.flush().unwrap();
                    a.release_thread().unwrap();
                }
                own
            })
        })
        .collect();
    let owns: Vec<Stream> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let y = reborn.lock().unwrap().unwrap();
    assert_eq!(y, x, "the handle was reused");
    for s in owns.into_iter().chain([y]) {
        sim.destroy_stream(s).unwrap();
    }
    live.assert_clean();
    all_back(&a, &sim);
}

/// (6) Wrong-size frees by another thread race the owner's correct frees of the same blocks
/// (on its per-thread stream and on its user stream). Whatever the interleaving, every result
/// is clear: a refusal at once, or an acceptance refused later by the owner's check (counted
/// in `invalid_frees`, reported by `take_deferred_error`), and once the bad frees have
/// arrived every correct free succeeds. Then, ordered after the owner's correct frees, a
/// second free of each block is refused at once. Exact accounting: every refusal is counted
/// once.
#[test]
fn wrong_size_frees_racing_correct_ones_are_counted_exactly() {
    let sim = host(5);
    let a = alloc_on(&sim, cfg());
    let owner = Arc::new(Worker::new(&a));
    let bad = Worker::new(&a);
    let s = sim.create_stream();
    let rounds = 6;
    let per = 40;
    let mut sync_refused = 0u64;
    let mut bad_accepted = 0u64;
    for round in 0..rounds {
        let on = if round % 2 == 0 { Stream::PER_THREAD } else { s };
        let sizes: Vec<usize> = (0..per).map(|i| [300, 5000, 40 << 10, 200 << 10, 3 << 20][i % 5]).collect();
        let blocks: Vec<(DeviceAddr, usize)> = owner.run({
            let sizes = sizes.clone();
            move |a| sizes.into_iter().map(|n| (a.allocate(n, on).unwrap(), n)).collect()
        });
        let live = Live::of(&blocks);
        live.assert_clean();
        // Both threads start together.
        let go = Arc::new(Barrier::new(2));
        let bad_on = if round % 3 == 0 { Stream::LEGACY } else { on };
        let (own_results, bad_results) = {
            let (go2, b2, owner2) = (go.clone(), blocks.clone(), owner.clone());
            // The owner's correct frees (newest first) on its worker, from a helper thread...
            let oh = std::thread::spawn(move || {
                owner2.run(move |a| {
                    go2.wait();
                    b2.iter().rev().map(|&(p, n)| a.deallocate(p, n, on)).collect::<Vec<_>>()
                })
            });
            // ...while the bad thread frees the same blocks with wrong sizes (oldest first).
            let blocks = blocks.clone();
            let br = bad.run(move |a| {
                go.wait();
                blocks
                    .iter()
                    .map(|&(p, n)| {
                        // Wrong by a class or more, both ways.
                        let wrong = if n > 4096 { n / 2 } else { n + (64 << 10) };
                        a.deallocate(p, wrong, bad_on)
                    })
                    .collect::<Vec<_>>()
            });
            (oh.join().unwrap(), br)
        };
        let mut retry = Vec::new();
        for (k, r) in own_results.iter().enumerate() {
            let (p, n) = blocks[blocks.len() - 1 - k];
            match r {
                Ok(()) => {}
                Err(Error::InvalidFree { .. }) if is_double(r) => {
                    sync_refused += 1;
                    retry.push((p, n));
                }
                Err(e) => panic!("owner's correct free refused unclearly: {e}"),
            }
        }
        for r in &bad_results {
            match r {
                Ok(()) => bad_accepted += 1,
                Err(Error::InvalidFree { .. }) => sync_refused += 1,
                Err(e) => panic!("not a clear refusal: {e}"),
            }
        }
        // The bad frees reach the owner: sent by their thread (parked if on a user stream,
        // delivered after the blocking trim's synchronise), checked at the owner's flush.
        bad.run(|a| a.flush().unwrap());
        a.trim(true).unwrap();
        owner.run(|a| a.flush().unwrap());
        // Every correct free refused meanwhile succeeds now.
        let retry2 = retry.clone();
        let again =
            owner.run(move |a| retry2.iter().map(|&(p, n)| a.deallocate(p, n, on)).collect::<Vec<_>>());
        for (r, (p, _)) in again.iter().zip(&retry) {
            assert!(r.is_ok(), "{p:?}: the correct free is still refused after the bad one arrived: {r:?}");
        }
        // Ordered after the correct frees: a second free of each is refused at once.
        let dbl =
            bad.run(move |a| blocks.iter().map(|&(p, n)| a.deallocate(p, n, bad_on)).collect::<Vec<_>>());
        for r in &dbl {
            assert!(is_invalid(r), "an ordered double free was accepted: {r:?}");
            sync_refused += 1;
        }
    }
    let invalid = a.stats().invalid_frees;
    eprintln!("refused at once {sync_refused}, bad accepted {bad_accepted}, invalid_frees {invalid}");
    assert_eq!(invalid, sync_refused + bad_accepted, "every refusal counted once");
    assert!(bad_accepted == 0 || a.take_deferred_error().is_some());
    drop(bad);
    drop(Arc::try_unwrap(owner).ok().expect("the owner worker is ours alone"));
    sim.destroy_stream(s).unwrap();
    no_violations(&sim);
    a.trim(true).unwrap();
    assert_all_returned(&a, Some(&sim), invalid);
}

/// (7) Two allocators on one device, used by the same threads on the same streams (their
/// per-thread, the legacy and shared user streams). A block of one freed on the other is
/// refused with a clear error and changes nothing, on every stream and through every path.
/// Then the first allocator is dropped (its last clone) with a few of its blocks never freed
/// and threads still holding its slots; its stale blocks freed on the second are refused, the
/// threads go on with the second, and everything of the second comes back.
#[test]
fn two_allocators_on_the_same_threads_and_a_dropped_ones_blocks() {
    let sim = host(5);
    let a = alloc_on(&sim, cfg());
    let b = alloc_on(&sim, cfg().batch_blocks(8));
    let shared: Vec<Stream> = (0..3).map(|_| sim.create_stream()).collect();
    let live = Arc::new(Live::default()); // both allocators' blocks: one device, one memory
    let refused_on_b = Arc::new(AtomicU64::new(0));
    let refused_on_a = Arc::new(AtomicU64::new(0));
    let stale: Arc<Mutex<Vec<(DeviceAddr, usize, Stream)>>> = Arc::default();
    let hs: Vec<_> = (0..3u64)
        .map(|t| {
            let (a, b, sim, live, shared) = (a.clone(), b.clone(), sim.clone(), live.clone(), shared.clone());
            let (rb, ra, stale) = (refused_on_b.clone(), refused_on_a.clone(), stale.clone());
            std::thread::spawn(move || {
                let mut x = 0xd0_0b1e + t;
                let mut mine: Vec<(bool, DeviceAddr, usize, Stream)> = Vec::new();
                for i in 0..400u32 {
                    let s =
                        [Stream::PER_THREAD, Stream::LEGACY, shared[0], shared[1], shared[2]][i as usize % 5];
                    let first = rng(&mut x) % 2 == 0;
                    let al = if first { &a } else { &b };
                    let n = mixed_size(&mut x);
                    let p = al.allocate(n, s).unwrap();
                    aligned(p);
                    live.insert(p, n);
                    sim.write_tag(p.0, n.min(256), i, s).unwrap();
                    mine.push((first, p, n, s));
                    // A free of this block on the other allocator: refused, nothing changes.
                    let other = if first { &b } else { &a };
                    let r = other.deallocate(p, n, s);
                    assert!(is_invalid(&r), "a block of the other allocator accepted: {r:?}");
                    if first { &rb } else { &ra }.fetch_add(1, Ordering::Relaxed);
                    if mine.len() > 16 {
                        let (f, p, n, s) = mine.remove((rng(&mut x) % 16) as usize);
                        live.remove(p);
                        if f { &a } else { &b }.deallocate(p, n, s).unwrap();
                    }
                }
                for (f, p, n, s) in mine {
                    if f && stale.lock().unwrap().len() < 12 {
                        // Never freed: it goes with the first allocator.
                        live.remove(p);
                        stale.lock().unwrap().push((p, n, s));
                        continue;
                    }
                    live.remove(p);
                    if f { &a } else { &b }.deallocate(p, n, s).unwrap();
                }
                // Slots of both stay: the thread does not release.
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    // The first allocator: its blocks still live are the stale ones; everything else came back.
    let st = a.stats();
    let stale_bytes: usize = stale.lock().unwrap().len();
    assert!(stale_bytes > 0);
    assert_eq!(st.invalid_frees, refused_on_a.load(Ordering::Relaxed), "{st:?}");
    // An idle worker keeps the first allocator's slot alive past its drop.
    let w = Worker::new(&b);
    {
        let a2 = a.clone();
        w.run(move |_| {
            let p = a2.allocate(1000, Stream::PER_THREAD).unwrap();
            a2.deallocate(p, 1000, Stream::PER_THREAD).unwrap();
        });
    }
    drop(a);
    // Stale blocks of the dropped allocator, freed on the second: refused at once, on any
    // stream, with no live block of the second at their addresses (the second holds none now).
    assert_eq!(b.stats().live_bytes, 0);
    for (p, n, s) in stale.lock().unwrap().drain(..) {
        for on in [s, Stream::PER_THREAD, Stream::LEGACY] {
            let r = b.deallocate(p, n, on);
            assert!(is_invalid(&r), "a dropped allocator's block accepted by another: {r:?}");
            refused_on_b.fetch_add(1, Ordering::Relaxed);
        }
    }
    // The worker, whose thread holds a slot of the dropped allocator, goes on with the second.
    w.run({
        let (sim, live, s0) = (sim.clone(), live.clone(), shared[0]);
        move |a| {
            let mut v = Vec::new();
            for i in 0..200u32 {
                let s = [Stream::PER_THREAD, Stream::LEGACY, s0][i as usize % 3];
                let n = 256 << (i % 10);
                let p = a.allocate(n, s).unwrap();
                live.insert(p, n);
                sim.write_tag(p.0, n.min(256), i, s).unwrap();
                v.push((p, n, s));
            }
            for (p, n, s) in v {
                live.remove(p);
                a.deallocate(p, n, s).unwrap();
            }
        }
    });
    drop(w);
    for s in shared {
        sim.destroy_stream(s).unwrap();
    }
    live.assert_clean();
    let bad = refused_on_b.load(Ordering::Relaxed);
    no_violations(&sim);
    b.trim(true).unwrap();
    assert_all_returned(&b, Some(&sim), bad);
}

/// (8) Large (up to `large_max`) and huge (over it: the pool) blocks mixed with small ones on
/// many streams under a tight cap, freed across streams (ordered by events) and across
/// threads, streams destroyed with their blocks freed on them just before, handles reused at
/// once. Out of memory is the only refusal, and is clear; no overlap, no race.
#[test]
fn large_and_huge_blocks_across_dying_streams_under_a_tight_cap() {
    let sim = host(20);
    let cap = 40 << 20;
    let a = alloc_on(&sim, cfg().max_bytes(cap));
    let live = Arc::new(Live::default());
    let mailbox: Arc<Mutex<Vec<Handoff>>> = Arc::default();
    let hs: Vec<_> = (0..3u64)
        .map(|t| {
            let (a, sim, live, mailbox) = (a.clone(), sim.clone(), live.clone(), mailbox.clone());
            std::thread::spawn(move || {
                let mut x = 0x1a_26e0 + t;
                let mut streams: Vec<Stream> =
                    (0..(cuarena::MAX_USER_ARENAS + 3)).map(|_| sim.create_stream()).collect();
                let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                let mut ooms = 0u32;
                for step in 0..500u32 {
                    let r = rng(&mut x);
                    let s = streams[r as usize % streams.len()];
                    let n = match (r >> 8) % 4 {
                        0 => 1 + (rng(&mut x) % (64 << 10)) as usize,
                        1 | 2 => (64 << 10) + (rng(&mut x) % ((2 << 20) - (64 << 10))) as usize,
                        _ => (2 << 20) + (rng(&mut x) % (6 << 20)) as usize,
                    };
                    match a.allocate(n, s) {
                        Ok(p) => {
                            aligned(p);
                            live.insert(p, n);
                            use_block(&sim, p, n, step, s, 30);
                            held.push((p, n, s));
                        }
                        Err(Error::OutOfMemory { requested, limit, .. }) => {
                            assert_eq!((requested, limit), (n, cap));
                            ooms += 1;
                        }
                        Err(e) => panic!("{e}"),
                    }
                    while held.len() > 6 || (!held.is_empty() && (r >> 16) % 3 == 0) {
                        let (p, n, on) = held.swap_remove((r >> 20) as usize % held.len());
                        live.remove(p);
                        match (r >> 28) % 3 {
                            0 => {
                                let to = streams[(r >> 32) as usize % streams.len()];
                                order(&sim, on, to);
                                a.deallocate(p, n, to).unwrap();
                            }
                            1 => mailbox.lock().unwrap().push((p, n, mark(&sim, on))),
                            _ => a.deallocate(p, n, on).unwrap(),
                        }
                    }
                    let handed = mailbox.lock().unwrap().pop();
                    if let Some((p, n, e)) = handed {
                        let on = streams[step as usize % streams.len()];
                        sim.stream_wait_event(on, e).unwrap();
                        a.deallocate(p, n, on).unwrap();
                    }
                    if step % 41 == 40 {
                        let j = (r >> 36) as usize % streams.len();
                        let old = streams[j];
                        let mine: Vec<_> = held.iter().filter(|h| h.2 == old).copied().collect();
                        held.retain(|h| h.2 != old);
                        for (p, n, _) in mine {
                            live.remove(p);
                            a.deallocate(p, n, old).unwrap();
                        }
                        sim.destroy_stream(old).unwrap();
                        streams[j] = sim.create_stream(); // often the same handle
                    }
                }
                for (p, n, s) in held {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                a.release_thread().unwrap();
                (streams, ooms)
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in hs {
        let (s, ooms) = h.join().unwrap();
        eprintln!("{ooms} out-of-memory refusals");
        all.extend(s);
    }
    on_thread(&a, {
        let (sim, mailbox) = (sim.clone(), mailbox.clone());
        move |a| {
            for (p, n, e) in mailbox.lock().unwrap().drain(..) {
                sim.stream_wait_event(Stream::LEGACY, e).unwrap();
                a.deallocate(p, n, Stream::LEGACY).unwrap();
            }
        }
    });
    for s in all {
        sim.destroy_stream(s).unwrap();
    }
    live.assert_clean();
    assert!(sim.reserved_bytes() <= cap);
    all_back(&a, &sim);
}

/// (9) A thread frees its blocks on its user stream `X` (local frees: no event) while their
/// work is held in flight by a gate, and `X` is destroyed. With `reuse`, its handle goes at
/// once to a new stream `Y` that does not wait for `X`; without, the handle stays stale. The
/// thread then flushes, trims without blocking, churns on `Y` (the same handle: its table
/// holds two arenas with that handle), on other streams, past its table, and so does another
/// thread: nothing of `X`'s memory may be handed out, and no call may name the stale handle.
fn stale_user_arena_under_flush_trim_and_churn(reuse: bool) {
    let sim = host(0);
    let a = alloc_on(&sim, cfg());
    let live = Arc::new(Live::default());
    let w = Worker::new(&a);
    let gate = w.run({
        let (sim, live) = (sim.clone(), live.clone());
        move |a| {
            let x = sim.create_stream();
            let gate = sim.gate(x).unwrap();
            let mut seed = 0x9a7e_u64;
            let mut v = Vec::new();
            for i in 0..64u32 {
                let n = mixed_size(&mut seed);
                let p = a.allocate(n, x).unwrap();
                live.insert(p, n);
                use_block(&sim, p, n, 0x600 + i, x, 50);
                v.push((p, n));
            }
            for (p, n) in v {
                live.remove(p);
                a.deallocate(p, n, x).unwrap();
            }
            sim.destroy_stream(x).unwrap();
            gate
        }
    });
    let churn = |w: &Worker, tag: u32| {
        let (sim, live) = (sim.clone(), live.clone());
        w.run(move |a| {
            a.flush().unwrap();
            assert!(a.trim(false).is_ok());
            let y = if reuse { Some(sim.create_stream()) } else { None };
            let mut streams: Vec<Stream> =
                (0..cuarena::MAX_USER_ARENAS + 2).map(|_| sim.create_stream()).collect();
            streams.extend(y);
            streams.extend([Stream::PER_THREAD, Stream::LEGACY]);
            let mut seed = 0x1111_u64 + tag as u64;
            for round in 0..6u32 {
                for &s in streams.iter().rev() {
                    let mut v = Vec::new();
                    for i in 0..8u32 {
                        let n = mixed_size(&mut seed);
                        let p = a.allocate(n, s).unwrap();
                        aligned(p);
                        live.insert(p, n);
                        sim.write_tag(p.0, n.min(256), tag + round * 16 + i, s).unwrap();
                        v.push((p, n));
                    }
                    for (p, n) in v {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                a.flush().unwrap();
                a.trim(false).unwrap();
            }
            streams.into_iter().filter(|s| s.is_user()).collect::<Vec<_>>()
        })
    };
    let mut streams = churn(&w, 0x7000);
    let other = Worker::new(&a);
    streams.extend(churn(&other, 0x8000));
    assert_eq!(sim.stale_handle_calls(), 0, "a call named the destroyed stream's handle");
    assert!(sim.violations().is_empty(), "{:?}", &sim.violations()[..sim.violations().len().min(3)]);
    gate.open();
    drop(other);
    drop(w);
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    live.assert_clean();
    all_back(&a, &sim);
}

#[test]
fn a_stale_user_arena_with_its_handle_reused_gives_nothing_early() {
    stale_user_arena_under_flush_trim_and_churn(true);
}

#[test]
fn a_stale_user_arena_with_its_handle_unused_touches_nothing() {
    stale_user_arena_under_flush_trim_and_churn(false);
}

/// (10) A pool of 24 user streams shared by threads that come and go (their arenas parked at
/// exit, adopted by whichever thread next allocates on the stream), streams destroyed and made
/// anew now and then (their handles reused at once), blocks handed between threads (ordered by
/// events) and freed on any stream, under a cap tight enough for out-of-memory reclaims, with a
/// thread calling `trim(true)` and `flush` meanwhile.
#[test]
fn shared_streams_with_turnover_adoption_and_out_of_memory() {
    within(120, || {
        let sim = host(10);
        let cap = 24 << 20;
        let a = alloc_on(&sim, cfg().max_bytes(cap).batch_blocks(16));
        let live = Arc::new(Live::default());
        let pool: Arc<Vec<std::sync::RwLock<Stream>>> =
            Arc::new((0..24).map(|_| std::sync::RwLock::new(sim.create_stream())).collect());
        let mailbox: Arc<Mutex<Vec<Handoff>>> = Arc::default();
        let ooms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let trimmer = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) && i < 2000 {
                    if i % 2 == 0 {
                        a.trim(true).unwrap();
                    } else {
                        a.flush().unwrap();
                    }
                    i += 1;
                    std::thread::sleep(Duration::from_micros(300));
                }
                a.release_thread().unwrap();
            })
        };
        for generation in 0..4u64 {
            let hs: Vec<_> = (0..4u64)
                .map(|t| {
                    let (a, sim, live, pool, mailbox, ooms) =
                        (a.clone(), sim.clone(), live.clone(), pool.clone(), mailbox.clone(), ooms.clone());
                    std::thread::spawn(move || {
                        let mut x = 0x5a_0000 + generation * 16 + t;
                        for step in 0..150u32 {
                            let r = rng(&mut x);
                            let j = r as usize % pool.len();
                            if (r >> 8) % 50 == 0 {
                                // Turnover: the stream destroyed, a new one (often the same
                                // handle) in its place.
                                let mut s = pool[j].write().unwrap();
                                sim.destroy_stream(*s).unwrap();
                                *s = sim.create_stream();
                                continue;
                            }
                            let s = pool[j].read().unwrap();
                            let mut v = Vec::new();
                            for k in 0..(1 + (r >> 12) % 6) {
                                let n = mixed_size(&mut x);
                                match a.allocate(n, *s) {
                                    Ok(p) => {
                                        aligned(p);
                                        live.insert(p, n);
                                        use_block(&sim, p, n, step * 8 + k as u32, *s, 20);
                                        v.push((p, n));
                                    }
                                    Err(Error::OutOfMemory { limit, .. }) => {
                                        assert_eq!(limit, cap);
                                        ooms.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(e) => panic!("{e}"),
                                }
                            }
                            for (k, (p, n)) in v.into_iter().enumerate() {
                                live.remove(p);
                                match (k as u64 + (r >> 20)) % 4 {
                                    0 => mailbox.lock().unwrap().push((p, n, mark(&sim, *s))),
                                    1 => {
                                        order(&sim, *s, Stream::LEGACY);
                                        a.deallocate(p, n, Stream::LEGACY).unwrap();
                                    }
                                    _ => a.deallocate(p, n, *s).unwrap(),
                                }
                            }
                            drop(s);
                            // Someone's handed-over block, freed on a stream of the pool (the
                            // mailbox's lock let go first: no lock order with the pool's).
                            let handed = mailbox.lock().unwrap().pop();
                            if let Some((p, n, e)) = handed {
                                let s = pool[(r >> 40) as usize % pool.len()].read().unwrap();
                                sim.stream_wait_event(*s, e).unwrap();
                                a.deallocate(p, n, *s).unwrap();
                            }
                        }
                        // Half the threads exit without releasing (the slot's drop does it).
                        if t % 2 == 0 {
                            a.release_thread().unwrap();
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
        }
        stop.store(true, Ordering::Relaxed);
        trimmer.join().unwrap();
        on_thread(&a, {
            let (sim, mailbox) = (sim.clone(), mailbox.clone());
            move |a| {
                for (p, n, e) in mailbox.lock().unwrap().drain(..) {
                    sim.stream_wait_event(Stream::LEGACY, e).unwrap();
                    a.deallocate(p, n, Stream::LEGACY).unwrap();
                }
            }
        });
        for s in pool.iter() {
            sim.destroy_stream(*s.read().unwrap()).unwrap();
        }
        eprintln!("{} out-of-memory refusals; {:?}", ooms.load(Ordering::Relaxed), a.stats());
        live.assert_clean();
        all_back(&a, &sim);
    });
}
