//! helper-25c's attacks: truly concurrent workloads under edge configurations the other tests
//! rarely use: the smallest superblock (64 KiB) with `small_max` equal to it, `large_max` equal
//! to `small_max` and `no_large()`, `keep_empty(0)`, `sparse` near its bounds, batches of one
//! block or a few bytes, `legacy_batch` 1, `chunk` equal to the superblock, and a cap just above
//! one or two superblocks (so out of memory and the cross-thread reclaim fire all the time),
//! while 4 to 16 threads allocate, free remotely (blocks passed between threads through
//! mailboxes, behind an event), switch between the per-thread, legacy and shared user streams,
//! destroy user streams and make new ones (the simulated device gives the new ones the
//! destroyed handles, as CUDA does), call `trim`, `flush` and `release_thread`, and exit with
//! blocks still held or frees still in their outboxes. Some runs put two allocators on the same
//! simulated device, with a device just large enough for both.
//!
//! The properties: every allocation succeeds or is refused with out of memory naming the size
//! asked; no panic, no hang (`within`); no two live blocks overlap and every block is 256-byte
//! aligned; the race checker reports nothing (every block is tagged on its stream and checked
//! on the stream that frees it, after that stream waits for its last use); and after every
//! thread is joined and every block freed, `assert_all_returned` holds.
//!
//! `S25C_ITERS=N` (default 1) runs every randomised workload N times with other seeds, for
//! hunting in release builds.

#![allow(clippy::type_complexity, clippy::manual_is_multiple_of)]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use common::{rng, within};
use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, Stream};
use cuarena_testkit::{HostConfig, HostDevice, assert_all_returned, host_allocator};

const KIB: usize = 1 << 10;
const SB: usize = 64 * KIB;

/// Iterations of each randomised workload (`S25C_ITERS`).
fn iters() -> u64 {
    std::env::var("S25C_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

/// A simulated device of `capacity` bytes whose reservations are aligned to `align`, with
/// operations taking up to `delay_us`.
fn device(capacity: usize, align: usize, delay_us: u64, seed: u64) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity,
        alignment: align,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(delay_us),
        seed: seed | 1,
    })
}

/// The 64 KiB superblock with `small_max` equal to it and `chunk` equal to it.
fn tiny() -> cuarena::ConfigBuilder {
    Config::builder().superblock(SB).small_max(SB).chunk(SB)
}

/// Live blocks of every thread and every allocator (address → end): an overlap or a
/// misaligned block is an error.
#[derive(Default)]
struct Live {
    map: Mutex<BTreeMap<u64, u64>>,
}

/// What the workers found wrong, reported at the end (a panic in a worker would leave the
/// others waiting).
#[derive(Default)]
struct Faults(Mutex<Vec<String>>);

impl Faults {
    fn push(&self, s: String) {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < 50 {
            v.push(s);
        }
    }
    fn assert_none(&self) {
        let v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        assert!(v.is_empty(), "{} faults, first: {:#?}", v.len(), &v[..v.len().min(8)]);
    }
}

impl Live {
    fn insert(&self, p: DeviceAddr, n: usize, faults: &Faults) {
        if p.0 % 256 != 0 {
            faults.push(format!("block {:#x} ({n} B) is not 256-byte aligned", p.0));
        }
        let (s, e) = (p.0, p.0 + n as u64);
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((&a, &b)) = m.range(..e).next_back()
            && b > s
        {
            faults.push(format!("[{s:#x},{e:#x}) ({n} B) overlaps live [{a:#x},{b:#x})"));
        }
        m.insert(s, e);
    }
    fn remove(&self, p: DeviceAddr) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).remove(&p.0);
    }
    fn is_empty(&self) -> bool {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
    }
}

/// A user stream shared by the workers: used under the read lock, destroyed and replaced
/// (usually by a stream given the same handle) under the write lock. `generation` counts the
/// replacements, so a block knows whether the stream it was last used on still lives.
struct Slot {
    s: Stream,
    generation: u64,
}

/// A block a worker holds, or one in a mailbox.
#[derive(Clone, Copy, Debug)]
struct Block {
    /// Which allocator gave it.
    a: usize,
    p: DeviceAddr,
    n: usize,
    /// The stream of its last use (`PER_THREAD` means the holder's own).
    s: Stream,
    /// The user-stream slot and generation of `s`, if a user stream.
    slot: Option<(usize, u64)>,
    t: u32,
    /// An event recorded on `s` after the last use, if one was.
    ev: Option<Event>,
}

/// Parameters of a [`storm`].
#[derive(Clone)]
struct Storm {
    cfgs: Vec<cuarena::ConfigBuilder>,
    threads: usize,
    /// Worker lives in all (more than `threads`: the rest replace workers that exit).
    lives: usize,
    steps: u32,
    slots: usize,
    capacity: usize,
    align: usize,
    delay_us: u64,
    /// Largest request, and percent of requests over `small_max` (up to `huge`).
    huge: usize,
    big_pct: u64,
    /// Blocks a worker tries to hold.
    hold: usize,
    /// Percent of steps that destroy and replace a user stream.
    destroy_pct: u64,
    /// Percent of steps that call `trim`, `flush` or `release_thread`.
    maint_pct: u64,
    /// Of ten allocations, how many on the per-thread stream and how many on the legacy
    /// stream (the rest on user streams).
    ptds_in_10: u64,
    legacy_in_10: u64,
    /// Of three frees, how many are hand-offs to another worker.
    handoff_in_3: u64,
    /// Maintenance may lower and restore the cap (`set_limit_bytes`).
    move_cap: bool,
    /// Sizes at the edges, from (`small_max`, cap).
    edges: Vec<fn(usize, usize) -> usize>,
    seed: u64,
}

impl Storm {
    fn new(cfgs: Vec<cuarena::ConfigBuilder>, cap_total: usize) -> Storm {
        Storm {
            cfgs,
            threads: 8,
            lives: 14,
            steps: 300,
            slots: 4,
            capacity: cap_total,
            align: SB,
            delay_us: 10,
            huge: 3 * SB / 2,
            big_pct: 10,
            hold: 4,
            destroy_pct: 2,
            maint_pct: 3,
            ptds_in_10: 3,
            legacy_in_10: 2,
            handoff_in_3: 1,
            move_cap: false,
            edges: vec![
                |sm, _| sm,
                |sm, _| sm + 1,
                |sm, _| sm - sm.min(255),
                |_, _| SB,
                |_, _| SB + 1,
                |_, _| 2 * SB,
                |_, cap| cap,
                |_, cap| cap + 1,
                |_, cap| cap - 256,
                |_, _| 256,
                |_, _| 257,
                |_, _| 1,
            ],
            seed: 1,
        }
    }
}

struct Shared {
    sim: HostDevice,
    allocs: Vec<Allocator>,
    live: Live,
    faults: Faults,
    slots: Vec<RwLock<Slot>>,
    mail: Vec<Mutex<Vec<Block>>>,
    events: Mutex<Vec<Event>>,
    tags: AtomicU64,
    ooms: AtomicU64,
    oks: AtomicU64,
    handoffs: AtomicU64,
    small_max: Vec<usize>,
    /// Each allocator's cap.
    caps: Vec<usize>,
    /// Whether maintenance moves the caps.
    move_cap: bool,
    stop: AtomicBool,
}

impl Shared {
    fn event(&self) -> Event {
        if let Some(e) = self.events.lock().unwrap().pop() {
            return e;
        }
        self.sim.create_event().unwrap()
    }
    fn recycle(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }
    fn tag(&self) -> u32 {
        self.tags.fetch_add(1, Ordering::Relaxed) as u32
    }

    /// Writes the block's tags on `s` (a hold on the head now and then keeps the work in
    /// flight while the allocator sees the block again).
    fn mark(&self, b: &Block, s: Stream, hold: bool) {
        let head = b.n.min(256);
        let r = if hold {
            self.sim.hold_and_check(b.p.0, head, b.t, Duration::from_micros(20), s)
        } else {
            self.sim.write_tag(b.p.0, head, b.t, s)
        };
        if let Err(e) = r {
            self.faults.push(format!("tag on {s:?}: {e}"));
        }
        if b.n > 512 {
            let _ = self.sim.write_tag(b.p.0 + (b.n as u64 & !255) - 256, 256, b.t ^ 0x5555, s);
        }
    }

    /// Checks the block's tags on `s`.
    fn verify(&self, b: &Block, s: Stream) {
        let _ = self.sim.check_tag(b.p.0, b.n.min(256), b.t, s);
        if b.n > 512 {
            let _ = self.sim.check_tag(b.p.0 + (b.n as u64 & !255) - 256, 256, b.t ^ 0x5555, s);
        }
    }

    /// Allocates `n` bytes from allocator `ai` on `s` (`slot`: the user stream's slot and
    /// generation, its read lock held by the caller), checks and tags the block.
    fn take(&self, ai: usize, n: usize, s: Stream, slot: Option<(usize, u64)>, hold: bool) -> Option<Block> {
        match self.allocs[ai].allocate(n, s) {
            Ok(p) => {
                self.oks.fetch_add(1, Ordering::Relaxed);
                if p.0 == 0 {
                    self.faults.push(format!("null for {n} B on {s:?}"));
                    return None;
                }
                self.live.insert(p, n, &self.faults);
                let mut b = Block { a: ai, p, n, s, slot, t: self.tag(), ev: None };
                self.mark(&b, s, hold);
                if slot.is_some() {
                    // The stream may be destroyed before the block is freed: its last use is
                    // marked now, while it lives.
                    let e = self.event();
                    self.sim.record_event(e, s).unwrap();
                    b.ev = Some(e);
                }
                Some(b)
            }
            Err(Error::OutOfMemory { requested, limit, .. }) => {
                self.ooms.fetch_add(1, Ordering::Relaxed);
                if requested != n {
                    self.faults.push(format!("out of memory for {n} B on {s:?} reports {requested} B"));
                }
                // The cap reported is the cap (maintenance may move it: then any of its values).
                if !self.move_cap && limit != self.caps[ai] {
                    self.faults.push(format!("out of memory for {n} B reports a cap of {limit} B"));
                }
                None
            }
            Err(e) => {
                self.faults.push(format!("allocate {n} B on {s:?} (allocator {ai}): {e}"));
                None
            }
        }
    }

    /// Frees `b` on `f` (a stream the caller may use now): waits for its last use first unless
    /// that was on `f` itself, checks its tags there, then frees it.
    fn give(&self, mut b: Block, f: Stream, same: bool) {
        if !same {
            let e = match b.ev.take() {
                Some(e) => e,
                None => {
                    let e = self.event();
                    self.sim.record_event(e, b.s).unwrap();
                    e
                }
            };
            self.sim.stream_wait_event(f, e).unwrap();
            self.recycle(e);
        } else if let Some(e) = b.ev.take() {
            self.recycle(e);
        }
        self.verify(&b, f);
        self.live.remove(b.p);
        if let Err(e) = self.allocs[b.a].deallocate(b.p, b.n, f) {
            self.faults.push(format!("free of {:#x} ({} B) on {f:?}: {e}", b.p.0, b.n));
        }
    }

    /// Makes `b` ready to leave this thread: an event after its last use.
    fn seal(&self, b: &mut Block) {
        if b.ev.is_none() {
            let e = self.event();
            self.sim.record_event(e, b.s).unwrap();
            b.ev = Some(e);
        }
    }

    /// Frees `b` on a stream picked by `r`: its own stream if it still lives (the fast
    /// paths), else per-thread, legacy or a user slot (after a wait).
    fn free_somewhere(&self, b: Block, r: u64, mine: bool) {
        match r % 5 {
            // Its own stream, where it still lives.
            0 | 1 => {
                if let Some((k, g)) = b.slot {
                    let slot = self.slots[k].read().unwrap();
                    if slot.generation == g {
                        return self.give(b, slot.s, true);
                    }
                    drop(slot);
                    return self.give(b, Stream::LEGACY, false);
                }
                if b.s.is_legacy() || mine {
                    let s = b.s;
                    return self.give(b, s, true);
                }
                self.give(b, Stream::LEGACY, false)
            }
            2 => self.give(b, Stream::PER_THREAD, b.s.is_per_thread() && mine),
            3 => self.give(b, Stream::LEGACY, b.s.is_legacy()),
            _ => {
                let k = (r >> 8) as usize % self.slots.len();
                let slot = self.slots[k].read().unwrap();
                let same = b.slot == Some((k, slot.generation));
                self.give(b, slot.s, same)
            }
        }
    }
}

/// A size log-uniform in 1 ..= `max` (most blocks small, a few the largest).
fn log_size(x: &mut u64, max: usize) -> usize {
    let bits = usize::BITS - max.leading_zeros();
    let b = 1 + (rng(x) % bits as u64) as u32;
    let n = 1 + (rng(x) as usize & ((1usize << b) - 1));
    n.min(max)
}

/// One worker's life: `steps` steps, then an exit of kind `exit`.
fn worker(sh: &Shared, me: usize, steps: u32, seed: u64, p: &Storm, exit: u64) {
    let mut x = seed | 1;
    let mut held: Vec<Block> = Vec::new();
    let na = sh.allocs.len();
    for _ in 0..steps {
        if sh.stop.load(Ordering::Relaxed) {
            break;
        }
        let r = rng(&mut x);
        let ai = (r >> 40) as usize % na;
        let sm = sh.small_max[ai];
        // An allocation.
        if held.len() < p.hold || r % 4 == 0 {
            let edge = p.edges[(r >> 60) as usize % p.edges.len()];
            let n = if (r >> 8) % 100 < 3 {
                edge(sm, sh.caps[ai])
            } else if (r >> 8) % 100 < p.big_pct + 3 {
                sm + 1 + (rng(&mut x) as usize % (p.huge - sm).max(1))
            } else {
                log_size(&mut x, sm)
            };
            let hold = (r >> 20) % 8 == 0;
            let k10 = (r >> 12) % 10;
            let got = match k10 {
                k if k < p.ptds_in_10 => sh.take(ai, n, Stream::PER_THREAD, None, hold),
                k if k < p.ptds_in_10 + p.legacy_in_10 => sh.take(ai, n, Stream::LEGACY, None, hold),
                _ => {
                    let k = (r >> 16) as usize % sh.slots.len();
                    let slot = sh.slots[k].read().unwrap();
                    sh.take(ai, n, slot.s, Some((k, slot.generation)), hold)
                }
            };
            held.extend(got);
        }
        // A free or a hand-off.
        if !held.is_empty() && (held.len() > p.hold || (r >> 24) % 3 == 0) {
            let mut b = held.swap_remove((r >> 28) as usize % held.len());
            if (r >> 32) % 3 < p.handoff_in_3 {
                sh.seal(&mut b);
                let to = (r >> 36) as usize % sh.mail.len();
                sh.mail[to].lock().unwrap().push(b);
                sh.handoffs.fetch_add(1, Ordering::Relaxed);
            } else {
                sh.free_somewhere(b, rng(&mut x), true);
            }
        }
        // Blocks handed to this worker.
        if (r >> 44) % 4 == 0 {
            let got: Vec<Block> = {
                let mut m = sh.mail[me].lock().unwrap();
                let k = m.len().min(4);
                let at = m.len() - k;
                m.split_off(at)
            };
            for b in got {
                sh.free_somewhere(b, rng(&mut x), false);
            }
        }
        // Maintenance.
        if (r >> 48) % 100 < p.maint_pct {
            let a = &sh.allocs[ai];
            let res = match (r >> 56) % 6 {
                0 => a.trim(true).map(drop),
                1 => a.trim(false).map(drop),
                2 => a.flush(),
                3 => a.release_thread(),
                // The cap moved under the others' feet (below one superblock too), and back.
                4 if p.move_cap => {
                    let cap = sh.caps[ai];
                    a.set_limit_bytes([0, 1000, SB - 256, SB, cap / 2, cap, 2 * cap][(r >> 8) as usize % 7]);
                    std::thread::yield_now();
                    a.set_limit_bytes(cap);
                    Ok(())
                }
                _ => {
                    let s = a.stats();
                    if s.reserved_bytes as usize > sh.caps[ai].max(s.limit_bytes as usize) && !p.move_cap {
                        sh.faults.push(format!("reserved over the cap: {s:?}"));
                    }
                    Ok(())
                }
            };
            if let Err(e) = res {
                sh.faults.push(format!("maintenance: {e}"));
            }
        }
        // A user stream destroyed and replaced: its handle likely goes to the new one.
        if (r >> 52) % 100 < p.destroy_pct {
            let k = (r >> 4) as usize % sh.slots.len();
            let mut slot = sh.slots[k].write().unwrap();
            sh.sim.destroy_stream(slot.s).unwrap();
            slot.s = sh.sim.create_stream();
            slot.generation += 1;
        }
    }
    // The exit.
    match exit % 4 {
        // Everything held goes to other workers (remote frees after this thread is gone).
        0 => {
            for mut b in held {
                sh.seal(&mut b);
                let to = (rng(&mut x) as usize) % sh.mail.len();
                sh.mail[to].lock().unwrap().push(b);
            }
        }
        // Everything freed here, remote frees left in the outbox at exit.
        1 => {
            for b in held {
                sh.free_somewhere(b, rng(&mut x), true);
            }
            let mine: Vec<Block> = std::mem::take(&mut *sh.mail[me].lock().unwrap());
            for b in mine {
                sh.free_somewhere(b, rng(&mut x), false);
            }
        }
        // Freed, then released.
        2 => {
            for b in held {
                sh.free_somewhere(b, rng(&mut x), true);
            }
            for a in &sh.allocs {
                if let Err(e) = a.release_thread() {
                    sh.faults.push(format!("release_thread: {e}"));
                }
            }
        }
        // Half freed, half handed over, then flushed.
        _ => {
            for (i, mut b) in held.into_iter().enumerate() {
                if i % 2 == 0 {
                    sh.free_somewhere(b, rng(&mut x), true);
                } else {
                    sh.seal(&mut b);
                    let to = (rng(&mut x) as usize) % sh.mail.len();
                    sh.mail[to].lock().unwrap().push(b);
                }
            }
            for a in &sh.allocs {
                if let Err(e) = a.flush() {
                    sh.faults.push(format!("flush: {e}"));
                }
            }
        }
    }
}

/// Runs the storm `p` and checks everything at the end. Returns (successful allocations, out
/// of memory refusals).
fn storm(p: Storm) -> (u64, u64) {
    let sim = device(p.capacity, p.align, p.delay_us, p.seed);
    let allocs: Vec<Allocator> =
        p.cfgs.iter().map(|b| host_allocator(sim.clone(), b.clone().build().unwrap()).unwrap()).collect();
    let small_max = allocs.iter().map(|a| a.config().small_max()).collect();
    let caps = allocs.iter().map(|a| a.config().limit_bytes(p.capacity)).collect();
    let sh = Arc::new(Shared {
        slots: (0..p.slots).map(|_| RwLock::new(Slot { s: sim.create_stream(), generation: 0 })).collect(),
        sim: sim.clone(),
        allocs,
        live: Live::default(),
        faults: Faults::default(),
        mail: (0..p.threads).map(|_| Mutex::new(Vec::new())).collect(),
        events: Mutex::new(Vec::new()),
        tags: AtomicU64::new(1),
        ooms: AtomicU64::new(0),
        oks: AtomicU64::new(0),
        handoffs: AtomicU64::new(0),
        small_max,
        caps,
        move_cap: p.move_cap,
        stop: AtomicBool::new(false),
    });
    let next_life = Arc::new(AtomicUsize::new(0));
    let mut hs = Vec::new();
    for me in 0..p.threads {
        let (sh, p, next_life) = (Arc::clone(&sh), p.clone(), Arc::clone(&next_life));
        hs.push(std::thread::spawn(move || {
            // Each worker index runs lives one after another on fresh threads until the lives
            // run out: a life that ends is a thread that exits mid-flight.
            loop {
                let life = next_life.fetch_add(1, Ordering::Relaxed);
                if life >= p.lives {
                    break;
                }
                let seed = p.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((life as u64 + 1) * 0x2545_f491);
                let steps =
                    if life < p.threads { p.steps / 2 + (seed % (p.steps as u64)) as u32 } else { p.steps };
                let sh2 = Arc::clone(&sh);
                let p2 = p.clone();
                let r = std::thread::spawn(move || worker(&sh2, me, steps, seed, &p2, seed >> 7)).join();
                if r.is_err() {
                    sh.faults.push(format!("worker {me} (life {life}) panicked"));
                    sh.stop.store(true, Ordering::Relaxed);
                }
            }
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    // What is left in the mailboxes is freed here, on the legacy stream.
    for m in &sh.mail {
        for b in std::mem::take(&mut *m.lock().unwrap()) {
            sh.give(b, Stream::LEGACY, false);
        }
    }
    sh.faults.assert_none();
    assert!(sh.live.is_empty(), "blocks left live by the test");
    let n = sh.allocs.len();
    for (i, a) in sh.allocs.iter().enumerate() {
        // The device check (nothing reserved) only once every allocator has given back.
        assert_all_returned(a, (i + 1 == n).then_some(&sim), 0);
    }
    for slot in &sh.slots {
        sim.destroy_stream(slot.read().unwrap().s).unwrap();
    }
    (sh.oks.load(Ordering::Relaxed), sh.ooms.load(Ordering::Relaxed))
}

/// Runs `make(seed)` for `iters()` seeds, each within `secs`.
fn hunt(name: &str, secs: u64, make: impl Fn(u64) -> Storm + Send + Sync + 'static) {
    let make = Arc::new(make);
    for i in 0..iters() {
        let seed = 0x5eed_0000 + i * 7919;
        let m = Arc::clone(&make);
        let (ok, oom) = within(secs, move || storm(m(seed)));
        if i == 0 || std::env::var("S25C_VERBOSE").is_ok() {
            eprintln!("{name} seed {seed:#x}: {ok} allocations, {oom} out of memory");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The smallest superblock under a cap of two superblocks.

/// Eight threads, a cap of two 64 KiB superblocks (`small_max` = superblock, chunk =
/// superblock), `keep_empty(0)`, batches of one block: every other allocation runs out of
/// memory and reclaims from the others, while blocks travel between threads and streams die.
#[test]
fn two_superblock_cap_with_eight_threads_and_one_block_batches() {
    hunt("two-superblock cap", 50, |seed| Storm {
        seed,
        ..Storm::new(
            vec![tiny().max_bytes(2 * SB).keep_empty(0).batch_blocks(1).legacy_batch_blocks(1)],
            1 << 30,
        )
    });
}

/// A cap just above one superblock (one superblock and a half, so only one can be reserved),
/// `large_max` = `small_max` (every request over it goes to the pool), 16 threads, four shared
/// user streams destroyed and made anew often, `sparse` near 1.
#[test]
fn cap_of_one_superblock_and_a_half_with_sixteen_threads() {
    hunt("one-and-a-half superblock cap", 50, |seed| Storm {
        seed,
        threads: 16,
        lives: 24,
        steps: 150,
        destroy_pct: 5,
        huge: SB,
        ..Storm::new(
            vec![
                Config::builder()
                    .superblock(SB)
                    .small_max(16 * KIB)
                    .large_max(16 * KIB)
                    .chunk(SB)
                    .max_bytes(SB + SB / 2)
                    .keep_empty(0)
                    .sparse_fraction(0.999)
                    .batch_bytes(1)
                    .legacy_batch_bytes(1),
            ],
            1 << 30,
        )
    });
}

/// Large superblocks under a cap too small for any of them (8 MiB at least, a cap of 4 MiB):
/// every large request falls through to the pool after the reclaim; sparse near 0 (the rule
/// gives back only when nearly empty).
#[test]
fn large_requests_under_a_cap_below_the_smallest_large_superblock() {
    hunt("large under a small cap", 50, |seed| Storm {
        seed,
        big_pct: 30,
        huge: 3 * SB,
        hold: 6,
        ..Storm::new(
            vec![
                Config::builder()
                    .superblock(SB)
                    .small_max(SB / 2)
                    .large_max(2 * SB)
                    .chunk(SB)
                    .max_bytes(4 * SB)
                    .keep_empty(0)
                    .sparse_fraction(0.001)
                    .batch_blocks(2)
                    .legacy_batch_blocks(1),
            ],
            1 << 30,
        )
    });
}

/// Two allocators on one device just large enough for both caps (so the device, not only the
/// cap, refuses growth): one with the tiny superblock and `no_large`, the other with 128 KiB
/// superblocks and large ones, threads using both.
#[test]
fn two_allocators_share_a_device_barely_large_enough() {
    hunt("two allocators", 50, |seed| Storm {
        seed,
        align: 4 * KIB,
        ..Storm::new(
            vec![
                tiny().max_bytes(3 * SB).no_large().keep_empty(0).batch_blocks(1).legacy_batch_blocks(1),
                Config::builder()
                    .superblock(2 * SB)
                    .small_max(SB)
                    .large_max(3 * SB)
                    .chunk(2 * SB)
                    .max_bytes(6 * SB)
                    .batch_bytes(300)
                    .legacy_batch_blocks(2),
            ],
            6 * SB,
        )
    });
}

/// A device whose reservations are aligned only to 4 KiB (so a chunk of one superblock is
/// rarely aligned to it), `chunk` = superblock and a cap of three superblocks.
#[test]
fn unaligned_device_chunks_under_a_cap_of_three_superblocks() {
    hunt("unaligned chunks", 50, |seed| Storm {
        seed,
        align: 4 * KIB,
        ..Storm::new(vec![tiny().max_bytes(3 * SB).keep_empty(0).batch_blocks(1)], 1 << 30)
    });
}

/// `keep_empty(0)` and `sparse` near 0: the return rule gives back (dissolving it) the
/// emptiest superblock after nearly every free, so blocks keep moving from arenas to the pool
/// while other threads' frees of them are on their way; two of three frees are hand-offs.
#[test]
fn constant_dissolution_under_remote_frees() {
    hunt("constant dissolution", 50, |seed| Storm {
        seed,
        hold: 8,
        handoff_in_3: 2,
        big_pct: 5,
        ..Storm::new(
            vec![
                tiny()
                    .small_max(SB / 4)
                    .max_bytes(16 * SB)
                    .keep_empty(0)
                    .sparse_fraction(1e-4)
                    .batch_blocks(3),
            ],
            1 << 30,
        )
    });
}

/// Mostly the legacy stream, with batches of one block and one byte (every own legacy free
/// makes a whole batch, every remote free its own batch), under a cap of four superblocks.
#[test]
fn legacy_stream_with_one_block_batches_under_a_cap() {
    hunt("legacy one-block batches", 50, |seed| Storm {
        seed,
        ptds_in_10: 2,
        legacy_in_10: 7,
        handoff_in_3: 2,
        ..Storm::new(
            vec![
                tiny()
                    .max_bytes(4 * SB)
                    .keep_empty(0)
                    .batch_blocks(1)
                    .batch_bytes(1)
                    .legacy_batch_blocks(1)
                    .legacy_batch_bytes(1),
            ],
            1 << 30,
        )
    });
}

/// Twenty shared user streams (more than a thread keeps arenas for), destroyed and made anew
/// often, nearly every allocation on one of them, four threads, a cap of eight superblocks:
/// lean arenas, parked arenas adopted by other threads, the pool serving the overflow.
#[test]
fn more_user_streams_than_the_table_under_a_cap() {
    hunt("many user streams", 50, |seed| Storm {
        seed,
        threads: 4,
        lives: 8,
        steps: 600,
        slots: 20,
        ptds_in_10: 1,
        legacy_in_10: 0,
        destroy_pct: 6,
        hold: 10,
        ..Storm::new(vec![tiny().small_max(SB / 2).large_max(SB).max_bytes(8 * SB).batch_blocks(4)], 1 << 30)
    });
}

/// The cap lowered (to nothing, below a superblock, to half) and restored by maintenance
/// threads while eight others allocate under it, with sizes at every edge (`small_max`,
/// `small_max + 1`, a superblock, the cap, one byte over it).
#[test]
fn the_cap_moves_while_threads_allocate_at_the_edges() {
    hunt("moving cap", 50, |seed| Storm {
        seed,
        move_cap: true,
        maint_pct: 8,
        ..Storm::new(
            vec![tiny().small_max(SB / 2).large_max(SB).max_bytes(4 * SB).keep_empty(0).batch_blocks(2)],
            1 << 30,
        )
    });
}

// ---------------------------------------------------------------------------------------------
// 2. A cap of exactly one superblock, passed around.

/// A cap of exactly one 64 KiB superblock and blocks of 64 KiB (`small_max` = superblock): the
/// whole cap is one block. Four persistent threads take turns: each takes the block on a
/// stream of its own choosing (its per-thread stream, the legacy stream, a user stream of its
/// own, a user stream shared by all), uses it, and frees it itself (on its stream, or on
/// another after a wait) or hands it to the next thread, which frees it remotely and flushes.
/// Whoever's turn it is, everyone else is idle and no block is live, so every allocation must
/// succeed: the out-of-memory reclaim has to take the one superblock from wherever it sits
/// (an idle arena of any kind, an inbox, kept-back legacy frees, a parked batch).
#[test]
fn one_superblock_cap_passed_around_idle_threads_always_serves() {
    for i in 0..iters() {
        within(50, move || passed_around(0x25c1 + i * 7919));
    }
}

fn passed_around(seed: u64) {
    {
        let sim = device(1 << 30, SB, 20, 7);
        let a = host_allocator(sim.clone(), tiny().max_bytes(SB).batch_blocks(1).build().unwrap()).unwrap();
        let shared = sim.create_stream();
        let ws: Vec<common::Worker> = (0..4).map(|_| common::Worker::new(&a)).collect();
        let own: Vec<Stream> = (0..4).map(|_| sim.create_stream()).collect();
        let mut x = seed;
        // A block handed on: (address, stream of its last use, event after it).
        let mut handed: Option<(DeviceAddr, Event)> = None;
        for turn in 0..200u32 {
            let i = turn as usize % 4;
            let r = rng(&mut x);
            let s = match r % 4 {
                0 => Stream::PER_THREAD,
                1 => Stream::LEGACY,
                2 => own[i],
                _ => shared,
            };
            let other = [Stream::PER_THREAD, Stream::LEGACY, own[i], shared][(r >> 8) as usize % 4];
            let how = (r >> 16) % 3;
            if std::env::var("S25C_VERBOSE").is_ok() {
                eprintln!("turn {turn}: worker {i} on {s:?}, how {how}, other {other:?}");
            }
            let sim2 = sim.clone();
            let prev = handed.take();
            handed = ws[i].run(move |a| {
                // The previous holder's block, freed here remotely, then sent.
                if let Some((p, e)) = prev {
                    sim2.stream_wait_event(Stream::PER_THREAD, e).unwrap();
                    sim2.check_tag(p.0, 256, 0xb10c, Stream::PER_THREAD).unwrap();
                    a.deallocate_per_thread(p, SB).unwrap();
                    a.flush().unwrap();
                }
                let p = a.allocate(SB, s).unwrap_or_else(|e| panic!("turn {turn} on {s:?}: {e}"));
                assert_eq!(p.0 % 256, 0);
                sim2.hold_and_check(p.0, 256, 0xb10c, Duration::from_micros(50), s).unwrap();
                match how {
                    0 => {
                        a.deallocate(p, SB, s).unwrap();
                        None
                    }
                    1 => {
                        let e = sim2.create_event().unwrap();
                        sim2.record_event(e, s).unwrap();
                        sim2.stream_wait_event(other, e).unwrap();
                        a.deallocate(p, SB, other).unwrap();
                        None
                    }
                    _ => {
                        let e = sim2.create_event().unwrap();
                        sim2.record_event(e, s).unwrap();
                        Some((p, e))
                    }
                }
            });
        }
        if let Some((p, e)) = handed {
            sim.stream_wait_event(Stream::LEGACY, e).unwrap();
            a.deallocate(p, SB, Stream::LEGACY).unwrap();
        }
        drop(ws);
        common::no_violations(&sim);
        assert_all_returned(&a, Some(&sim), 0);
        for s in own.into_iter().chain([shared]) {
            sim.destroy_stream(s).unwrap();
        }
    }
}
