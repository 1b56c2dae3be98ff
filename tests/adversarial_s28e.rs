//! Twenty-eighth session, helper-42: attacks on the session's changes: process-wide capture
//! announcements (`sync.rs`, `CAPTURES`), the out-of-memory last try (`Slot::last_try`),
//! refused frees parked at once and due user-stream batches, and `with_slot`'s temporary slot.
//!
//! Found (failing on the code of 91dc73d), and mended in this session:
//! - `a_synchronise_on_one_device_does_not_stall_legacy_calls_on_another`: one process-wide
//!   `RwLock` whose read side is held across a device synchronise; with std's writer preference
//!   an announcement on another device makes every legacy-stream call of every device wait for
//!   that synchronise (a deadlock where the synchronised work waits on the host).
//! - `statistics_read_during_another_threads_last_try_do_not_wait_for_device_work`: the last
//!   try's blocking trim waits on the host for fences with the pool's lock held, so `stats()`
//!   and every pool call of every thread wait for device work during any out of memory.
//!
//! Mends: the announcement lock is per device and lets readers in while an announcement waits
//! (`sync.rs`, `CAPTURES`: a mutex-held table and a condition variable, not an `RwLock`); a
//! blocking pool trim waits for its fences without the pool's lock, and the last try waits
//! only where releasing the wholly free chunks would make room for the request.

// `common/flaky.rs` brings its fault workload too, which these tests do not run.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, Result, Stream, StreamKey};
use cuarena_testkit::{HostConfig, HostDevice, Interpose, Interposed, assert_all_returned};

mod common;
use common::*;

include!("common/flaky.rs");

const KIB: usize = 1 << 10;

/// Runs `f` on a new thread and waits up to `ms` for it: `Some` of its result, or `None` if it
/// had not ended by then (the thread is left running, its result sent nowhere).
fn try_within<R: Send + 'static>(
    ms: u64,
    f: impl FnOnce() -> R + Send + 'static,
) -> (Option<R>, mpsc::Receiver<R>) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_millis(ms)) {
        Ok(r) => (Some(r), rx),
        Err(_) => (None, rx),
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The process-wide announcement lock.

/// Three simulated devices, A, B and C (three physical devices, three `device_id`s). On A a
/// stream waits on the host (the simulator's gate: a kernel that spins on a flag the host
/// sets, or a host callback; on a real GPU simply a kernel that runs for seconds), and an
/// allocator of A is dropped: its pool's drop synchronises A (`GlobalPool`'s drop), which
/// waits for that stream. Meanwhile a thread announces a capture to an allocator of B
/// (`graph_capture_begin`), and then the thread that will open A's gate makes its first
/// legacy-stream allocation on an allocator of C.
///
/// Nothing of B or C depends on A. Yet C's allocation blocks until A's synchronise ends, and
/// since the gate is opened only after it, for ever (a deadlock that did not exist before the
/// twenty-eighth session). Cause: `sync::CAPTURES` (src/sync.rs) is one `std::sync::RwLock`
/// for every device; `unless_captures_announced` holds its read side around the device
/// synchronise itself (src/device/counted.rs `Counted::synchronize`); `announce_captures` for
/// B takes the write side and waits for that synchronise; std's `RwLock` then refuses new
/// readers while a writer waits, so C's `Counted::stream_key(LEGACY)`
/// (`holding_off_announcements`) waits behind B's announcement, behind A's synchronise. Even
/// with no host dependency, every legacy-stream call, capture check and announcement of every
/// device stalls for as long as any device's synchronise runs. Mended: see the module's docs.
#[test]
fn a_synchronise_on_one_device_does_not_stall_legacy_calls_on_another() {
    let sim_a = zero_delay(256 * MIB);
    let sim_b = zero_delay(256 * MIB);
    let sim_c = zero_delay(256 * MIB);
    let a = alloc_with(&sim_a, small());
    let b = alloc_with(&sim_b, small());
    let c = alloc_with(&sim_c, small());
    // A's pool holds a chunk (its drop synchronises only then).
    let p = a.allocate(4096, Stream::PER_THREAD).unwrap();
    a.deallocate(p, 4096, Stream::PER_THREAD).unwrap();
    a.release_thread().unwrap();
    let s = sim_a.create_stream();
    let gate = sim_a.gate(s).unwrap();
    // A's drop: its synchronise waits for the gate.
    let dropper = std::thread::spawn(move || drop(a));
    std::thread::sleep(Duration::from_millis(300));
    // B: a capture is announced (it waits for A's synchronise).
    let b2 = b.clone();
    let announcer = std::thread::spawn(move || b2.graph_capture_begin());
    std::thread::sleep(Duration::from_millis(300));
    // C: the gate's owner allocates on the legacy stream before it opens the gate.
    let c2 = c.clone();
    let (done, rx) = try_within(3000, move || {
        let p = c2.allocate(4096, Stream::LEGACY).unwrap();
        c2.deallocate(p, 4096, Stream::LEGACY).unwrap();
        c2.release_thread().unwrap();
    });
    let stalled = done.is_none();
    drop(gate);
    if stalled {
        rx.recv_timeout(Duration::from_secs(10)).expect("C's allocation ends once A's gate opens");
    }
    dropper.join().unwrap();
    announcer.join().unwrap();
    b.graph_capture_end().unwrap();
    sim_a.destroy_stream(s).unwrap();
    assert!(
        !stalled,
        "a legacy-stream allocation on device C waited (3 s) for a synchronise of device A, behind a \
         capture announced on device B: a deadlock when A's work waits for C's caller"
    );
    all_back(&c, &sim_c);
    all_back(&b, &sim_b);
}

// ---------------------------------------------------------------------------------------------
// 2. The out-of-memory last try.

/// An allocator capped at 8 MiB, blocks over 64 KiB from the pool. A 4 MiB pool block is
/// freed on a user stream behind a gate (the stream's work waits on the host), so its chunk is
/// wholly free behind a pending fence. Thread T asks for 6 MiB: out of memory, reclaim, retry,
/// and the last try, a blocking pool trim that waits on the host for that fence. While T
/// waits, the gate's owner reads the statistics (or makes any pool call) before it opens the
/// gate.
///
/// `stats()` blocks until the gate opens: for ever here. Cause: `Slot::last_try`
/// (src/allocator.rs) calls `GlobalPool::trim(dev, true)`, and `trim_locked`
/// (src/global_pool.rs) waits for each chunk's fences on the host (`fences.wait_host`) with
/// the pool's state lock held, so every other thread's pool call (`stats`, a superblock's
/// borrow, a pool block's allocation or free) waits for that device work too. `trim(true)`
/// did so before, but only when called; now any out-of-memory on any thread does it, for as
/// long as the slowest fence of any wholly free chunk (before the session, out of memory made
/// no host wait unless something was parked). Mended: see the module's docs.
#[test]
fn statistics_read_during_another_threads_last_try_do_not_wait_for_device_work() {
    let sim = zero_delay(256 * MIB);
    let a = alloc_with(&sim, small().large_max(64 * KIB).max_bytes(8 * MIB));
    let s = sim.create_stream();
    let p = a.allocate(4 * MIB, s).unwrap();
    let gate = sim.gate(s).unwrap();
    a.deallocate(p, 4 * MIB, s).unwrap();
    let a2 = a.clone();
    let (t_done, t_rx) = try_within(300, move || {
        let r = a2.allocate(6 * MIB, Stream::PER_THREAD);
        if let Ok(q) = &r {
            a2.deallocate(*q, 6 * MIB, Stream::PER_THREAD).unwrap();
        }
        a2.release_thread().unwrap();
        r.map(|_| ())
    });
    let t_waited = t_done.is_none();
    let a3 = a.clone();
    let (stats, rx) = try_within(2000, move || a3.stats());
    let stalled = stats.is_none();
    drop(gate);
    if stalled {
        rx.recv_timeout(Duration::from_secs(10)).expect("stats ends once the gate opens");
    }
    let r = match t_done {
        Some(r) => r,
        None => t_rx.recv_timeout(Duration::from_secs(10)).expect("T's allocation ends once the gate opens"),
    };
    assert!(t_waited, "the last try did not wait for the gated fence (the scenario did not arise)");
    r.expect("the 6 MiB request fits once the chunk is released");
    assert!(
        !stalled,
        "stats() waited (2 s) for device work on a user stream, behind another thread's last try"
    );
    sim.destroy_stream(s).unwrap();
    all_back(&a, &sim);
}

/// The scenario above, without a reader: the out-of-memory thread's last try waits for the
/// gated fence (a wait on the host, as `trim(true)`'s), and ends as soon as the gate opens,
/// with the request served from the released chunk. The statistics then count one allocation
/// and no out-of-memory, reserved memory stayed within the cap throughout, and everything
/// comes back.
#[test]
fn a_last_try_waiting_on_a_gated_fence_ends_when_the_gate_opens() {
    within(20, || {
        let sim = zero_delay(256 * MIB);
        let a = alloc_with(&sim, small().large_max(64 * KIB).max_bytes(8 * MIB));
        let s = sim.create_stream();
        let p = a.allocate(4 * MIB, s).unwrap();
        let gate = sim.gate(s).unwrap();
        a.deallocate(p, 4 * MIB, s).unwrap();
        a.reset_counters();
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            drop(gate);
        });
        let t0 = Instant::now();
        let q = on_thread(&a, |a| {
            let q = a.allocate(6 * MIB, Stream::PER_THREAD);
            let st = a.stats();
            (q, st)
        });
        let waited = t0.elapsed();
        opener.join().unwrap();
        let (q, st) = q;
        let q = q.expect("served after the gate opened");
        assert!(waited >= Duration::from_millis(300), "did not wait for the fence: {waited:?}");
        assert_eq!(st.ooms, 0, "{st:?}");
        assert!(st.reserved_bytes <= 8 * MIB as u64, "{st:?}");
        assert!(sim.reserved_bytes() <= 8 * MIB);
        a.deallocate(q, 6 * MIB, Stream::PER_THREAD).unwrap();
        sim.destroy_stream(s).unwrap();
        all_back(&a, &sim);
    });
}

/// Six threads run out of memory at once, each needing a chunk that lies wholly free behind a
/// fence of a slow stream (4 MiB blocks freed on user streams with 50 ms of work queued
/// first): their last tries wait concurrently (each gathers its fences under the pool's lock
/// and waits without it: `GlobalPool::trim`). Each
/// request either fits or fails cleanly with out of memory; no block is handed out twice, none
/// is reused under running work, the statistics count each failure once, and everything comes
/// back.
#[test]
fn concurrent_last_tries_hand_out_nothing_twice() {
    within(20, || {
        let sim = zero_delay(512 * MIB);
        let a = alloc_with(&sim, small().large_max(64 * KIB).max_bytes(24 * MIB));
        let live = Arc::new(Live::default());
        for _round in 0..3 {
            // Six chunks of 4 MiB, wholly free behind slow fences (the last round's given back).
            a.trim(true).unwrap();
            let streams: Vec<Stream> = (0..6).map(|_| sim.create_stream()).collect();
            let ps: Vec<DeviceAddr> = streams.iter().map(|&s| a.allocate(4 * MIB, s).unwrap()).collect();
            for (&s, &p) in streams.iter().zip(&ps) {
                sim.hold_and_check(p.0, 4096, 7, Duration::from_millis(50), s).unwrap();
                a.deallocate(p, 4 * MIB, s).unwrap();
            }
            a.reset_counters();
            let fails = Arc::new(AtomicU64::new(0));
            let hs: Vec<_> = (0..6)
                .map(|i| {
                    let (a, live, fails, sim) = (a.clone(), live.clone(), fails.clone(), sim.clone());
                    std::thread::spawn(move || {
                        let n = 5 * MIB + i * 64 * KIB;
                        match a.allocate(n, Stream::PER_THREAD) {
                            Ok(p) => {
                                live.insert(p, n);
                                sim.fill(p.0, n, i as u8, Stream::PER_THREAD).unwrap();
                                std::thread::sleep(Duration::from_millis(20));
                                live.remove(p);
                                a.deallocate(p, n, Stream::PER_THREAD).unwrap();
                            }
                            Err(Error::OutOfMemory { .. }) => {
                                fails.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(e) => panic!("{e}"),
                        }
                        a.release_thread().unwrap();
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            live.assert_clean();
            assert_eq!(a.stats().ooms, fails.load(Ordering::SeqCst));
            assert!(a.stats().peak_reserved_bytes <= 24 * MIB as u64);
            sim.synchronize();
            for s in streams {
                sim.destroy_stream(s).unwrap();
            }
        }
        all_back(&a, &sim);
    });
}

// ---------------------------------------------------------------------------------------------
// 3. Announcements: drops, imbalance, long-lived regions.

/// A thread of `a` exits holding memory in a user-stream arena whose stream is then destroyed:
/// the arena is parked until a device synchronise. Returns its bytes.
fn park_an_arena(a: &Allocator, sim: &HostDevice) -> usize {
    let u = sim.create_stream();
    let before = a.parked_bytes();
    on_thread(a, move |a| {
        let p = a.allocate(100_000, u).unwrap();
        a.deallocate(p, 100_000, u).unwrap();
    });
    sim.destroy_stream(u).unwrap();
    let parked = a.parked_bytes() - before;
    assert!(parked > 0, "the arena was parked");
    parked
}

/// Allocator A announces two captures and is dropped without ending them; B, over the same
/// device, holds a parked arena. A's drop returns at once (its own announcements do not hold
/// off its pool's synchronise), and B's `trim(true)` then synchronises and takes the parked
/// arena back. While A's announcements stood, B's `trim(true)` kept it parked. An unbalanced
/// `graph_capture_end` on B (none begun there) is refused and does not end A's.
#[test]
fn an_allocator_dropped_mid_announcement_stops_holding_off_the_device() {
    within(20, || {
        let sim = host(0);
        let a = alloc_with(&sim, small());
        let b = alloc_with(&sim, small());
        let p = a.allocate(4096, Stream::PER_THREAD).unwrap();
        a.deallocate(p, 4096, Stream::PER_THREAD).unwrap();
        a.release_thread().unwrap();
        park_an_arena(&b, &sim);
        a.graph_capture_begin();
        a.graph_capture_begin();
        assert!(matches!(b.graph_capture_end(), Err(Error::Unsupported(_))));
        b.trim(true).unwrap();
        assert!(b.parked_bytes() > 0, "B synchronised while A's captures were announced");
        let t0 = Instant::now();
        drop(a);
        assert!(t0.elapsed() < Duration::from_secs(2), "A's drop waited {:?}", t0.elapsed());
        b.trim(true).unwrap();
        assert_eq!(b.parked_bytes(), 0, "B's trim(true) did not synchronise after A's drop");
        all_back(&b, &sim);
    });
}

/// B is dropped while A, over the same device, has a capture announced; A's capture ends
/// 500 ms later. B's drop waits for it, then synchronises and releases its chunks: it returns
/// soon after the end, and the device holds only A's memory.
#[test]
fn an_allocator_dropped_during_anothers_announcement_releases_its_memory_when_it_ends() {
    within(20, || {
        let sim = host(0);
        let a = alloc_with(&sim, small());
        let b = alloc_with(&sim, small());
        let pa = a.allocate(100_000, Stream::PER_THREAD).unwrap();
        on_thread(&b, |b| {
            let p = b.allocate(3 * MIB, Stream::PER_THREAD).unwrap();
            b.deallocate(p, 3 * MIB, Stream::PER_THREAD).unwrap();
        });
        assert!(b.stats().reserved_bytes > 0);
        a.graph_capture_begin();
        let a2 = a.clone();
        let ender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            a2.graph_capture_end().unwrap();
        });
        let t0 = Instant::now();
        drop(b);
        let took = t0.elapsed();
        ender.join().unwrap();
        assert!(took >= Duration::from_millis(400), "B's drop did not wait for A's capture: {took:?}");
        assert!(took < Duration::from_secs(3), "B's drop waited {took:?}");
        assert_eq!(sim.reserved_bytes() as u64, a.stats().reserved_bytes, "B's chunks were released");
        a.deallocate(pa, 100_000, Stream::PER_THREAD).unwrap();
        all_back(&a, &sim);
    });
}

fn is_legacy_refusal(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { stream } if Stream::from_raw(*stream).is_legacy())
}

/// A long-lived announcement (PyTorch's `use_mem_pool` region) on allocator A while its
/// threads do everything: allocate and free on every stream, free each other's blocks on the
/// legacy and per-thread streams and on a user stream, flush, trim both ways, run out of memory
/// under a cap, and exit. No call fails but an allocation, with out of memory or the legacy
/// stream's refusal the README describes (memory behind a lazy legacy fence, during an
/// announcement); no device synchronise runs
/// (the simulator would report one as breaking a capture of `cap`, a stream captured for the
/// whole region); nothing races. Once the announcement ends, everything comes back.
#[test]
fn a_long_lived_announcement_loses_nothing_and_fails_nothing() {
    within(20, || {
        let sim = host(20);
        let a = alloc_with(&sim, small().max_bytes(24 * MIB));
        let cap = sim.create_stream();
        let u = sim.create_stream();
        a.graph_capture_begin();
        sim.begin_capture(cap).unwrap();
        let handoff: Arc<Mutex<Vec<(DeviceAddr, usize)>>> = Arc::default();
        let live = Arc::new(Live::default());
        let hs: Vec<_> = (0..3u64)
            .map(|t| {
                let (a, handoff, live) = (a.clone(), handoff.clone(), live.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
                    let mut mine: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                    for i in 0..600 {
                        let s = streams[(rng(&mut x) % 3) as usize];
                        let n = [512, 4096, 40_000, 300_000, 3 << 20][(rng(&mut x) % 5) as usize];
                        match a.allocate(n, s) {
                            Ok(p) => {
                                live.insert(p, n);
                                mine.push((p, n, s));
                            }
                            Err(Error::OutOfMemory { .. }) => {}
                            // README, "Captures of blocking streams": while a capture is
                            // announced, memory behind a lazy legacy fence cannot go to another
                            // stream, and a request with no other memory under the cap is
                            // refused so (it succeeds after the capture).
                            Err(e) if is_legacy_refusal(&e) => {}
                            Err(e) => panic!("thread {t} allocate {n} on {s:?}: {e}"),
                        }
                        if mine.len() > 12 {
                            let (p, n, s) = mine.swap_remove((rng(&mut x) % mine.len() as u64) as usize);
                            if rng(&mut x).is_multiple_of(2) {
                                handoff.lock().unwrap().push((p, n));
                            } else {
                                live.remove(p);
                                a.deallocate(p, n, s).unwrap();
                            }
                        }
                        // Others' blocks, freed on a random stream.
                        let theirs = handoff.lock().unwrap().pop();
                        if let Some((p, n)) = theirs {
                            live.remove(p);
                            let s = streams[(rng(&mut x) % 3) as usize];
                            a.deallocate(p, n, s).unwrap_or_else(|e| panic!("thread {t} free on {s:?}: {e}"));
                        }
                        match i % 97 {
                            13 => a.flush().unwrap_or_else(|e| panic!("flush: {e}")),
                            41 => drop(a.trim(false).unwrap_or_else(|e| panic!("trim(false): {e}"))),
                            77 => drop(a.trim(true).unwrap_or_else(|e| panic!("trim(true): {e}"))),
                            96 => a.release_thread().unwrap_or_else(|e| panic!("release_thread: {e}")),
                            _ => {}
                        }
                    }
                    for (p, n, s) in mine {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    a.release_thread().unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        live.assert_clean();
        for (p, n) in std::mem::take(&mut *handoff.lock().unwrap()) {
            a.deallocate(p, n, Stream::PER_THREAD).unwrap();
        }
        a.release_thread().unwrap();
        sim.end_capture(cap).expect("the capture survived the region");
        a.graph_capture_end().unwrap();
        // Uses of the legacy stream refused during the announcement are kept as deferred
        // errors (an arena's give-back, a kept-back legacy batch's action): nothing else.
        while let Some(e) = a.take_deferred_error() {
            assert!(is_legacy_refusal(&e), "deferred during the region: {e:?}");
        }
        sim.destroy_stream(cap).unwrap();
        sim.destroy_stream(u).unwrap();
        all_back(&a, &sim);
    });
}

// ---------------------------------------------------------------------------------------------
// 4. Temporary slots.

/// A device whose `reserve` takes a 4 KiB bookkeeping block from another allocator
/// (`backing`, over the same simulated device) on the per-thread stream and whose `release`
/// frees it on the legacy stream: each is a call inside A's call on the same thread, served by
/// a temporary slot of `backing` (an arena made and given back per call). Each `reserve` also
/// tries `backing.release_thread()`, which must be refused there.
struct Layered {
    sim: HostDevice,
    backing: Allocator,
    notes: Mutex<std::collections::BTreeMap<u64, DeviceAddr>>,
    refused: AtomicU64,
}

impl Interpose for Layered {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        match self.backing.release_thread() {
            Err(Error::Unsupported(_)) => {
                self.refused.fetch_add(1, Ordering::SeqCst);
            }
            r => panic!("release_thread inside another allocator's call: {r:?}"),
        }
        let note = self.backing.allocate(4096, Stream::PER_THREAD)?;
        let p = self.sim.reserve(bytes)?;
        if let Some(p) = p {
            self.notes.lock().unwrap().insert(p, note);
        } else {
            self.backing.deallocate(note, 4096, Stream::PER_THREAD)?;
        }
        Ok(p)
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        let note = self.notes.lock().unwrap().remove(&ptr).expect("reserved here");
        self.backing.deallocate(note, 4096, Stream::LEGACY)?;
        // SAFETY: forwarded.
        unsafe { self.sim.release(ptr, bytes) }
    }
}

/// Allocator A over [`Layered`] grows and trims its pool over and over on two threads, under a
/// cap (so out of memory and its last try run too), while `backing` serves its own blocks on
/// the same threads. Every `release_thread` inside is refused; no block of either allocator is
/// handed out twice; the bookkeeping blocks the temporary slots handed out are all freed; and
/// after A's drop `backing` has everything back (nothing stranded in temporary slots' arenas).
#[test]
fn temporary_slots_strand_nothing_and_refuse_release_thread() {
    within(20, || {
        let sim = host(10);
        let backing = alloc_with(&sim, small());
        let dev = Arc::new(Interposed(Layered {
            sim: sim.clone(),
            backing: backing.clone(),
            notes: Mutex::default(),
            refused: AtomicU64::new(0),
        }));
        let a = Allocator::new(dev.clone(), small().max_bytes(6 * MIB).build().unwrap()).unwrap();
        let live = Arc::new(Live::default());
        let hs: Vec<_> = (0..2u64)
            .map(|t| {
                let (a, b, live) = (a.clone(), backing.clone(), live.clone());
                std::thread::spawn(move || {
                    let mut x = 77 + t;
                    for round in 0..30 {
                        let mut held = Vec::new();
                        for _ in 0..12 {
                            let n = [3000usize, 50_000, 700_000][(rng(&mut x) % 3) as usize];
                            let s = if rng(&mut x).is_multiple_of(2) {
                                Stream::PER_THREAD
                            } else {
                                Stream::LEGACY
                            };
                            match a.allocate(n, s) {
                                Ok(p) => {
                                    live.insert(p, n);
                                    held.push((&a, p, n, s));
                                }
                                Err(Error::OutOfMemory { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                            let q = b.allocate(n, s).unwrap();
                            live.insert(q, n);
                            held.push((&b, q, n, s));
                        }
                        for (al, p, n, s) in held {
                            live.remove(p);
                            al.deallocate(p, n, s).unwrap();
                        }
                        if round % 5 == 4 {
                            a.trim(round % 10 == 9).unwrap();
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
        live.assert_clean();
        assert!(dev.refused.load(Ordering::SeqCst) > 0, "A's pool never grew");
        no_violations(&sim);
        a.trim(true).unwrap();
        assert_all_returned(&a, None, 0);
        drop(a);
        assert!(dev.notes.lock().unwrap().is_empty(), "every chunk's note was freed");
        drop(dev);
        all_back(&backing, &sim);
    });
}
