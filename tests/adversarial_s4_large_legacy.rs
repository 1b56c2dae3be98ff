//! Adversarial pass (session 4) on two changes: large superblocks lent without clearing their
//! tags or freed flags (`SbLocal::init`, `TagStash`, `Arena::give_back` clearing each block's
//! tags), and a thread's legacy-stream frees kept back until one legacy action per batch
//! (`Arena::free_legacy`, `release_legacy`). Superblocks change hands many times over the same
//! address ranges (normal 2 MiB and large 8 to 128 MiB), dissolve on out-of-memory under small
//! caps, are reclaimed by other threads (`trim`, out-of-memory), by thread exit and
//! `release_thread`; blocks cross threads and streams; bad frees come after superblocks were
//! returned and re-lent; a device that fails its waits and records now and then. Every test
//! checks overlaps (a map of live blocks and tags written on the simulator), the race checker,
//! and, where nothing was lost on purpose, that every byte comes back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Stream};
use cuarena_testkit::hooked::EventHook;
use cuarena_testkit::{HookedDevice, Hooks, HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// The default layout (2 MiB superblocks, `small_max` 1 MiB, `large_max` 64 MiB).
fn default_cfg() -> cuarena::ConfigBuilder {
    Config::builder()
}

/// A size: mostly small, some over `small_max` (large superblocks of 8 to 128 MiB).
fn pick_size(r: u64) -> usize {
    match r % 16 {
        0..=7 => 256 + (r >> 8) as usize % (32 * KIB),
        8..=10 => 32 * KIB + (r >> 8) as usize % (MIB - 32 * KIB),
        11..=13 => MIB + 1 + (r >> 8) as usize % (3 * MIB),
        14 => 4 * MIB + (r >> 8) as usize % (12 * MIB),
        _ => 16 * MIB + (r >> 8) as usize % (17 * MIB),
    }
}

/// Blocks sent to a thread: (block, sender, hand it back?).
type Mailbox = Mutex<Vec<(Held, usize, bool)>>;

/// Many threads churn mixed small and large blocks on their per-thread and the legacy stream,
/// under a cap that forces out-of-memory dissolves, with blocks handed to other threads (used
/// there on their per-thread stream and handed back, or freed there), cross-stream frees,
/// `trim` by one thread, `flush` and `release_thread` now and then. No overlap, no race, every
/// byte back.
fn churn(cap: usize, threads: usize, ops: usize, seed: u64, batch: usize) {
    churn_on(cap, threads, ops, seed, batch, 0);
}

/// `fail_ppm`: a device that fails that share (per million) of its waits and records.
fn churn_on(cap: usize, threads: usize, ops: usize, seed: u64, batch: usize, fail_ppm: u64) {
    let sim = host(20);
    let cfg = default_cfg().max_bytes(cap).batch_blocks(batch).build().unwrap();
    let a = if fail_ppm == 0 {
        host_allocator(sim.clone(), cfg).unwrap()
    } else {
        Allocator::new(flaky_device(&sim, fail_ppm, seed), cfg).unwrap()
    };
    let flaky = fail_ppm > 0;
    let ok = move |r: cuarena::Result<()>| {
        if let Err(e) = r {
            assert!(flaky && matches!(e, Error::Driver { .. }), "{e:?}");
        }
    };
    let live = Arc::new(Live::default());
    // Hand-offs: per thread, blocks sent to it by others (to free or to return).
    let boxes: Arc<Vec<Mailbox>> = Arc::new((0..threads).map(|_| Mutex::new(Vec::new())).collect());
    let ooms = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(threads));
    let mut hs = Vec::new();
    for t in 0..threads {
        let (a, sim, live, boxes, ooms, start) =
            (a.clone(), sim.clone(), live.clone(), boxes.clone(), ooms.clone(), start.clone());
        hs.push(std::thread::spawn(move || {
            let mut x = seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(t as u64 + 1));
            let mut held: Vec<Held> = Vec::new();
            let mut tagn = (t as u32) << 24;
            start.wait();
            for i in 0..ops {
                let r = rng(&mut x);
                // Blocks sent to us: (block, sender, return it?).
                let inbox: Vec<_> = std::mem::take(&mut *boxes[t].lock().unwrap());
                for (h, from, back) in inbox {
                    // Legacy work follows every per-thread stream's earlier work.
                    check(&sim, h.p, h.size, h.t, Stream::LEGACY);
                    if back {
                        // Used here on our per-thread stream, then handed back to its owner,
                        // which frees it on the legacy stream.
                        tagn += 1;
                        tag(&sim, h.p, h.size, tagn, Stream::PER_THREAD);
                        let h = Held { s: Stream::PER_THREAD, t: tagn, ..h };
                        boxes[from].lock().unwrap().push((h, usize::MAX, false));
                    } else {
                        let s =
                            if rng(&mut x).is_multiple_of(2) { Stream::LEGACY } else { Stream::PER_THREAD };
                        live.remove(h.p);
                        ok(a.deallocate(h.p, h.size, s));
                    }
                }
                match r % 32 {
                    0..=13 => {
                        let size = pick_size(rng(&mut x));
                        let s = if r & 0x100 == 0 { Stream::LEGACY } else { Stream::PER_THREAD };
                        match a.allocate(size, s) {
                            Ok(p) => held.push(Held::taken(&sim, &live, p, size, s, &mut tagn)),
                            Err(Error::OutOfMemory { .. }) => {
                                ooms.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(Error::Driver { .. }) if flaky => {}
                            Err(e) => panic!("allocate {size}: {e:?}"),
                        }
                    }
                    14..=25 if !held.is_empty() => {
                        let h = held.swap_remove((r >> 8) as usize % held.len());
                        check(&sim, h.p, h.size, h.t, h.s);
                        // Mostly the legacy stream (the kept-back path), sometimes the other.
                        let s = match (r >> 40) % 4 {
                            0 => Stream::PER_THREAD,
                            _ => Stream::LEGACY,
                        };
                        live.remove(h.p);
                        ok(a.deallocate(h.p, h.size, s));
                    }
                    26..=28 if !held.is_empty() && threads > 1 => {
                        let h = held.swap_remove((r >> 8) as usize % held.len());
                        let to = (t + 1 + (r >> 20) as usize % (threads - 1)) % threads;
                        boxes[to].lock().unwrap().push((h, t, (r >> 30).is_multiple_of(2)));
                    }
                    29 => {
                        if i % 7 == 0 {
                            ok(a.trim(false).map(|_| ()));
                        } else {
                            ok(a.flush());
                        }
                    }
                    30 if i % 5 == 0 => {
                        // Our arenas go back (held blocks become pool blocks).
                        ok(a.release_thread());
                    }
                    _ => {}
                }
            }
            // Drain whatever is still sent to us, then free the rest.
            start.wait();
            let inbox: Vec<_> = std::mem::take(&mut *boxes[t].lock().unwrap());
            for (h, _, _) in inbox {
                check(&sim, h.p, h.size, h.t, Stream::LEGACY);
                live.remove(h.p);
                ok(a.deallocate(h.p, h.size, Stream::LEGACY));
            }
            for h in held {
                check(&sim, h.p, h.size, h.t, h.s);
                live.remove(h.p);
                ok(a.deallocate(h.p, h.size, Stream::LEGACY));
            }
            ok(a.release_thread());
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    let st = a.stats();
    eprintln!(
        "cap {cap} seed {seed}: ooms {} dissolved {} returned {} taken {} waits {} allocs {}",
        ooms.load(Ordering::Relaxed),
        st.superblocks_dissolved,
        st.superblocks_returned,
        st.superblocks_taken,
        st.fence_waits,
        st.allocations
    );
    if flaky {
        // Memory may be lost (a batch whose fence failed), never corrupted.
        let _ = a.release_thread();
        sim.synchronize();
        let v = sim.violations();
        assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
        assert_eq!(sim.tag_errors(), 0);
        a.check_invariants();
        return;
    }
    assert_all_returned(&a, Some(&sim), 0);
}

#[test]
fn churn_large_and_legacy_under_a_tight_cap() {
    for (seed, batch) in [(1u64, 64usize), (2, 3), (3, 1)] {
        churn(288 * MIB, 4, 2500, seed, batch);
    }
}

#[test]
fn churn_large_and_legacy_roomy() {
    for (seed, batch) in [(11u64, 64usize), (12, 5)] {
        churn(1 << 30, 4, 2500, seed, batch);
    }
}

#[test]
fn churn_on_a_device_that_fails_waits_and_records() {
    for (seed, batch, ppm) in [(21u64, 64usize, 20_000u64), (22, 4, 50_000), (23, 1, 100_000)] {
        churn_on(1 << 30, 4, 2000, seed, batch, ppm);
    }
}

/// A simulated device that fails a share (`ppm` per million) of its `stream_wait_event` and
/// `record_event` calls, before doing anything.
fn flaky_device(sim: &HostDevice, ppm: u64, seed: u64) -> Arc<HookedDevice> {
    let x = Arc::new(AtomicU64::new(seed | 1));
    let fail = move || {
        let mut v = x.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        v ^= v >> 31;
        v = v.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        v ^= v >> 29;
        v % 1_000_000 < ppm
    };
    let fail2 = fail.clone();
    let record: EventHook = Box::new(move |sim, event, stream| {
        if fail() {
            return Err(Error::Driver { call: "record_event (injected)", code: 999 });
        }
        sim.record_event(event, stream)
    });
    let wait: EventHook = Box::new(move |sim, event, stream| {
        if fail2() {
            return Err(Error::Driver { call: "stream_wait_event (injected)", code: 999 });
        }
        sim.stream_wait_event(stream, event)
    });
    HookedDevice::new(
        sim.clone(),
        Hooks { record_event: Some(record), stream_wait_event: Some(wait), ..Hooks::default() },
    )
}

/// A block kept back in an idle thread's legacy arena; another thread's `trim` gives its
/// superblock back (the kept-back block goes to the pool with a lazy legacy fence and its freed
/// flag left set); the range is lent again, as large superblocks, to another thread, which
/// writes its blocks there on its per-thread stream. Then the first thread frees the kept-back
/// pointer again (legacy and per-thread stream), and a third thread does too, with the right
/// size, a wrong one, and an interior pointer: all refused (at once or by the owner's drain),
/// the new owner's blocks untouched, no race.
#[test]
fn a_kept_back_block_whose_superblock_was_reclaimed_and_relent_as_large_is_refused_again() {
    for round in 0..3u32 {
        let sim = host(30);
        let a = host_allocator(sim.clone(), default_cfg().batch_blocks(64).build().unwrap()).unwrap();
        // Keeps the chunk from being wholly free (so `trim` does not release it).
        let pin = a.allocate(4 * MIB, Stream::PER_THREAD).unwrap();
        let w = Worker::new(&a);
        let (p, q) = w.run(|a| {
            let p = a.allocate(64 * KIB, Stream::LEGACY).unwrap();
            let q = a.allocate(64 * KIB, Stream::LEGACY).unwrap();
            a.deallocate(p, 64 * KIB, Stream::LEGACY).unwrap(); // kept back
            a.deallocate(q, 64 * KIB, Stream::LEGACY).unwrap(); // kept back
            (p, q)
        });
        // W is idle: its superblock holds no used block and goes back.
        a.trim(false).unwrap();
        let sim2 = sim.clone();
        let covering = on_thread(&a, move |a| {
            let mut got = Vec::new();
            let mut hit = None;
            for i in 0..40u32 {
                let size = (3 + (i + round) as usize % 5) * MIB;
                let Ok(b) = a.allocate(size, Stream::PER_THREAD) else { break };
                sim2.write_tag(b.0, 256, 0xb000 + i, Stream::PER_THREAD).unwrap();
                let range = b.0..b.0 + size as u64;
                if hit.is_none() && (range.contains(&p.0) || range.contains(&q.0)) {
                    hit = Some(i);
                }
                got.push((b, size, i));
                if hit.is_some() && got.len() > 4 {
                    break;
                }
            }
            // Keep them live while the bad frees run: hand them out of this thread.
            (got, hit)
        });
        let (got, hit) = covering;
        let mut bad = 0;
        for &x in &[p, q] {
            if got.iter().any(|g| g.0 == x) {
                continue; // handed out again at that very address: a free of it would be valid
            }
            for s in [Stream::LEGACY, Stream::PER_THREAD] {
                let r = w.run(move |a| a.deallocate(x, 64 * KIB, s));
                assert!(is_invalid(&r), "round {round}: the owner's second free on {s:?}: {r:?}");
                bad += 1;
            }
            let r = on_thread(&a, move |a| a.deallocate(x, 64 * KIB, Stream::LEGACY));
            if r.is_ok() {
                a.flush().unwrap();
            }
            bad += 1;
            let r = on_thread(&a, move |a| a.deallocate(x, 32 * KIB, Stream::PER_THREAD));
            let _ = r;
            bad += 1;
        }
        a.flush().unwrap();
        w.run(|a| a.flush().unwrap());
        for (b, _, i) in &got {
            sim.check_tag(b.0, 256, 0xb000 + i, Stream::LEGACY).unwrap();
        }
        for (b, size, _) in got {
            a.deallocate(b, size, Stream::LEGACY).unwrap();
        }
        a.deallocate(pin, 4 * MIB, Stream::PER_THREAD).unwrap();
        w.exit();
        assert!(hit.is_some(), "round {round}: the kept-back blocks' range was not lent again");
        assert_all_returned(&a, Some(&sim), bad);
    }
}

/// Live bytes are exact at quiescence while frees are kept back (small and large blocks on the
/// legacy stream), after a flush releases them, and after the thread releases its arenas.
#[test]
fn live_bytes_are_exact_with_frees_kept_back() {
    let sim = host(0);
    let a =
        host_allocator(sim.clone(), default_cfg().batch_blocks(1000).batch_bytes(1 << 40).build().unwrap())
            .unwrap();
    let sizes = [300, 4 * KIB, 70 * KIB, MIB, MIB + 1, 5 * MIB + 300, 20 * MIB];
    let ps: Vec<_> = sizes.iter().map(|&s| (a.allocate(s, Stream::LEGACY).unwrap(), s)).collect();
    let l0 = a.stats().live_bytes as usize;
    assert!(l0 >= ps.iter().map(|p| p.1).sum::<usize>(), "{l0}");
    let mut live = l0;
    for (i, &(p, s)) in ps.iter().enumerate() {
        if i % 2 == 0 {
            let before = a.stats().live_bytes as usize;
            a.deallocate(p, s, Stream::LEGACY).unwrap();
            let after = a.stats().live_bytes as usize;
            assert!(after < before, "a kept-back free lowers live bytes: {before} -> {after}");
            live -= before - after;
        }
    }
    assert_eq!(a.stats().live_bytes as usize, live);
    a.flush().unwrap();
    assert_eq!(a.stats().live_bytes as usize, live, "releasing kept-back frees changes no live byte");
    a.trim(false).unwrap();
    assert_eq!(a.stats().live_bytes as usize, live);
    let a2 = a.clone();
    let rest: Vec<_> = ps.iter().enumerate().filter(|(i, _)| i % 2 == 1).map(|(_, &x)| x).collect();
    let r2 = rest.clone();
    // Another thread frees the rest on the legacy stream (the outbox path into our legacy arena).
    std::thread::spawn(move || {
        for (p, s) in r2 {
            a2.deallocate(p, s, Stream::LEGACY).unwrap();
        }
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(a.stats().live_bytes, 0);
    assert_all_returned(&a, Some(&sim), 0);
}

/// Large blocks of an idle thread's legacy arena, used on a second thread's per-thread stream
/// (long writes) and then freed by their owner on the legacy stream (kept back, a batch of 64);
/// a third thread under a tight cap runs out of memory, dissolves the idle arena's large
/// superblock (its kept-back blocks go to the pool behind a lazy legacy fence), and writes the
/// memory at once on its per-thread stream, as normal superblocks' small blocks and as large
/// blocks. Its writes must be ordered after the second thread's.
#[test]
fn kept_back_large_blocks_taken_by_out_of_memory_are_ordered_for_the_next_user() {
    for round in 0..3u64 {
        let sim = host(0);
        let cap = 32 * MIB;
        let a = host_allocator(
            sim.clone(),
            default_cfg().max_bytes(cap).chunk(32 * MIB).batch_blocks(64).build().unwrap(),
        )
        .unwrap();
        let owner = Worker::new(&a);
        let user = Worker::new(&a);
        let size = 3 * MIB + 256 * round as usize;
        // A 16 MiB large superblock in the owner's legacy arena, plus a used block so the
        // superblock dissolves (rather than goes back whole) on out-of-memory.
        let (ps, keep) = owner.run(move |a| {
            let ps: Vec<_> = (0..3).map(|_| a.allocate(size, Stream::LEGACY).unwrap()).collect();
            let keep = a.allocate(8 * KIB, Stream::LEGACY).unwrap();
            (ps, keep)
        });
        let sim2 = sim.clone();
        let ps2 = ps.clone();
        user.run(move |_| {
            for (i, p) in ps2.iter().enumerate() {
                sim2.hold_and_check(p.0, size, 40 + i as u32, Duration::from_millis(40), Stream::PER_THREAD)
                    .unwrap();
            }
        });
        let ps3 = ps.clone();
        owner.run(move |a| {
            for p in ps3 {
                a.deallocate(p, size, Stream::LEGACY).unwrap(); // kept back
            }
        });
        // Out of memory: the cap holds the owner's 16 MiB superblock and 16 MiB more.
        let sim3 = sim.clone();
        let ps4 = ps.clone();
        let reused = on_thread(&a, move |a| {
            let mut got = Vec::new();
            loop {
                match a.allocate(if got.len() % 2 == 0 { 5 * MIB } else { 512 * KIB }, Stream::PER_THREAD) {
                    Ok(b) => {
                        let len = if got.len() % 2 == 0 { 5 * MIB } else { 512 * KIB };
                        sim3.fill(b.0, len, 7, Stream::PER_THREAD).unwrap();
                        got.push((b, len));
                    }
                    Err(Error::OutOfMemory { .. }) => break,
                    Err(e) => panic!("{e:?}"),
                }
                if got.len() > 40 {
                    break;
                }
            }
            let reused = got
                .iter()
                .any(|&(b, len)| ps4.iter().any(|p| b.0 < p.0 + size as u64 && p.0 < b.0 + len as u64));
            for (b, len) in got {
                a.deallocate(b, len, Stream::PER_THREAD).unwrap();
            }
            reused
        });
        assert!(reused, "round {round}: the kept-back blocks' memory was not reused");
        owner.run(move |a| a.deallocate(keep, 8 * KIB, Stream::LEGACY).unwrap());
        owner.exit();
        user.exit();
        sim.synchronize();
        let v = sim.violations();
        assert!(v.is_empty(), "round {round}: {} violations, first {:?}", v.len(), &v[..v.len().min(2)]);
        assert_all_returned(&a, Some(&sim), 0);
    }
}

/// Another thread frees an interior pointer `Q` of the owner's live block (a bad free: it takes
/// the freed flag at `Q`, which was clear, and waits in that thread's outbox). The owner then
/// frees the block and hands out a new block starting exactly at `Q`, of the bad free's size.
/// When the bad free arrives it must be refused, not taken as a free of the new block: before
/// the fix, the owner cleared the flag as it handed the block out, the drain found a live block
/// of that size at `Q`, and the next allocation handed it out a second time.
#[test]
fn a_bad_free_on_its_way_is_not_taken_as_a_free_of_a_block_handed_out_there_later() {
    let sim = host(0);
    let a = host_allocator(sim.clone(), default_cfg().batch_blocks(64).build().unwrap()).unwrap();
    let x = a.allocate_per_thread(64 * KIB).unwrap();
    let q = DeviceAddr(x.0 + 4 * KIB as u64);
    let w = Worker::new(&a);
    // The bad free: accepted for now (the owner checks it), parked in the worker's outbox.
    w.run(move |a| a.deallocate(q, 4 * KIB, Stream::PER_THREAD).unwrap());
    a.deallocate_per_thread(x, 64 * KIB).unwrap();
    let first = a.allocate_per_thread(4 * KIB).unwrap();
    let second = a.allocate_per_thread(4 * KIB).unwrap();
    tag(&sim, second, 4 * KIB, 0xabcd, Stream::PER_THREAD);
    // The bad free arrives; the owner drains it.
    w.run(|a| a.flush().unwrap());
    a.flush().unwrap();
    let e = a.take_deferred_error();
    assert!(matches!(e, Some(Error::InvalidFree { .. })), "the bad free is reported: {e:?}");
    // Nothing live is handed out again.
    let more: Vec<_> = (0..64).map(|_| a.allocate_per_thread(4 * KIB).unwrap()).collect();
    assert!(!more.contains(&second) && !more.contains(&first), "a live block handed out twice");
    check(&sim, second, 4 * KIB, 0xabcd, Stream::PER_THREAD);
    sim.synchronize();
    assert_eq!(sim.tag_errors(), 0);
    for p in more.into_iter().chain([first, second]) {
        a.deallocate_per_thread(p, 4 * KIB).unwrap();
    }
    drop(w);
    assert_all_returned(&a, Some(&sim), 1);
}
