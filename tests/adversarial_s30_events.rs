//! Thirtieth session, helper: attacks on `Allocator::trim`'s new last step,
//! `EventPool::shrink` (`src/fence.rs`), which destroys every CUDA event idle in the
//! allocator's event pool. The claim under attack: an event in the pool's free list is held by
//! nothing else (no `Fence`, no `LegacyAction`), so destroying it is safe, and no event is used
//! after it is destroyed.
//!
//! Each test runs trims (blocking and not, from one or several threads, in tight loops) against
//! traffic that takes events out of the pool and puts them back: remote frees (a block freed
//! by another thread, batched under one event per batch), cross-stream frees (a per-thread
//! block freed on a user stream), legacy-stream churn (kept-back frees, legacy actions, lazy
//! legacy fences on pool blocks), user-stream churn, thread exits with frees pending, `flush`,
//! `release_thread`, graph captures (announced, and running on the simulator), the allocator's
//! drop from another clone, and out of memory under a cap. The simulated device completes work
//! late, refuses any use of a destroyed event and records it as a violation, and its race
//! checker flags a block reused before its fence.
//!
//! Properties: no violation (no use of a destroyed event, no race, no tag error), no two live
//! blocks overlap, every byte back at the end (`all_back`), every event destroyed once the
//! allocator and every thread that used it are gone, and the trims did destroy events while
//! the traffic ran (otherwise the test tests nothing).
//!
//! Blocks are handed between threads the way the contract asks: the sender records an event of
//! its own (the test's, not the allocator's) after the block's last use, and the receiver's
//! stream waits on it before the receiver checks the block's tags and frees it there.

mod common;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuarena::{Allocator, Device, Error, Event, Stream};
use cuarena_testkit::{HostDevice, Interpose, Interposed};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// The device: the simulator, counting the allocator's event creations and destructions.

struct Counting {
    sim: HostDevice,
    created: AtomicU64,
    destroyed: AtomicU64,
}

impl Interpose for Counting {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn create_event(&self) -> cuarena::Result<Event> {
        self.created.fetch_add(1, Ordering::Relaxed);
        Device::create_event(&self.sim)
    }
    fn destroy_event(&self, e: Event) {
        self.destroyed.fetch_add(1, Ordering::Relaxed);
        Device::destroy_event(&self.sim, e)
    }
}

type Dev = Interposed<Counting>;

fn counted(sim: &HostDevice, b: cuarena::ConfigBuilder) -> (Allocator, Arc<Dev>) {
    let dev = Arc::new(Interposed(Counting {
        sim: sim.clone(),
        created: AtomicU64::new(0),
        destroyed: AtomicU64::new(0),
    }));
    let a = Allocator::new(dev.clone(), b.build().unwrap()).unwrap();
    (a, dev)
}

/// Small batches (many events), large superblocks up to 128 KiB, the pool above.
fn cfg() -> cuarena::ConfigBuilder {
    small().large_max(128 * KIB).batch_blocks(4).legacy_batch_blocks(4)
}

// ---------------------------------------------------------------------------------------------
// The test's own ordering between streams: an event of the test, recorded and waited on, then
// destroyed at once (a wait already queued keeps what it captured).

fn test_event(sim: &HostDevice, on: Stream) -> Event {
    let e = Device::create_event(sim).unwrap();
    Device::record_event(sim, e, on).unwrap();
    e
}

fn test_wait(sim: &HostDevice, e: Event, on: Stream) {
    Device::stream_wait_event(sim, on, e).unwrap();
    Device::destroy_event(sim, e);
}

fn legacy_refusal(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { stream } if Stream::from_raw(*stream).is_legacy())
}

// ---------------------------------------------------------------------------------------------
// The traffic.

#[derive(Clone, Copy, Default)]
struct Mode {
    /// The legacy stream is named (allocations, frees, orderings).
    legacy: bool,
    /// Each thread lifetime makes a user stream of its own, and all share one more.
    user: bool,
    /// Blocks are sent to the next slot's thread to be freed there.
    remote: bool,
    /// Pool-sized blocks (over `large_max`).
    pool: bool,
    /// `release_thread` now and then.
    release: bool,
    /// Out of memory may happen (a cap): the thread frees a block and goes on.
    oom: bool,
    /// Trims also from the churning threads.
    inline_trims: bool,
    /// A capture is announced: an allocation may get the legacy refusal (README, "Captures of
    /// blocking streams"), counted.
    capture: bool,
    /// Blocks are spilled for an OOM hook, which frees one and trims (`World::hook`).
    hook: bool,
}

struct World {
    a: Allocator,
    dev: Arc<Dev>,
    sim: HostDevice,
    live: Live,
    /// A user stream every thread uses (`mode.user`).
    shared: Stream,
    mail: Vec<Mutex<Vec<(Held, Event)>>>,
    /// Blocks any thread's OOM hook may free (`mode.hook`).
    spill: Mutex<Vec<(Held, Event)>>,
    hook_frees: AtomicU64,
    stop: AtomicBool,
    tags: AtomicU32,
    ooms: AtomicU64,
    refusals: AtomicU64,
    allocs: AtomicU64,
    mode: Mode,
    /// Largest reservation seen by the churning threads (for a cap).
    max_reserved: AtomicUsize,
}

impl World {
    fn new(sim: &HostDevice, b: cuarena::ConfigBuilder, slots: usize, mode: Mode) -> Arc<World> {
        let (a, dev) = counted(sim, b);
        Arc::new(World {
            a,
            dev,
            sim: sim.clone(),
            live: Live::default(),
            shared: sim.create_stream(),
            mail: (0..slots).map(|_| Mutex::new(Vec::new())).collect(),
            spill: Mutex::new(Vec::new()),
            hook_frees: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            tags: AtomicU32::new(1),
            ooms: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            allocs: AtomicU64::new(0),
            mode,
            max_reserved: AtomicUsize::new(0),
        })
    }

    fn streams(&self, own: Option<Stream>) -> Vec<Stream> {
        let mut c = vec![Stream::PER_THREAD];
        if self.mode.legacy {
            c.push(Stream::LEGACY);
        }
        if self.mode.user {
            c.push(self.shared);
            c.extend(own);
        }
        c
    }

    fn pick(&self, own: Option<Stream>, x: &mut u64) -> Stream {
        let c = self.streams(own);
        c[rng(x) as usize % c.len()]
    }

    fn size(&self, x: &mut u64) -> usize {
        let r = rng(x);
        match r % 10 {
            0..=4 => 1 + (r >> 8) as usize % 4096,
            5 | 6 => 4096 + (r >> 8) as usize % (60 * KIB),
            7 | 8 => 64 * KIB + 1 + (r >> 8) as usize % (64 * KIB - 1),
            _ if self.mode.pool => 128 * KIB + 1 + (r >> 8) as usize % (384 * KIB),
            _ => 1 + (r >> 8) as usize % 1024,
        }
    }

    /// Allocates a block on a stream of `own`'s choice; `None` on an allowed out of memory.
    fn alloc(&self, own: Option<Stream>, x: &mut u64) -> Option<Held> {
        let s = self.pick(own, x);
        let n = self.size(x);
        match self.a.allocate(n, s) {
            Ok(p) => {
                assert_eq!(p.0 % 256, 0, "alignment");
                self.allocs.fetch_add(1, Ordering::Relaxed);
                self.max_reserved.fetch_max(self.sim.reserved_bytes(), Ordering::Relaxed);
                let mut t = self.tags.fetch_add(1, Ordering::Relaxed);
                Some(Held::taken(&self.sim, &self.live, p, n, s, &mut t))
            }
            Err(Error::OutOfMemory { .. }) if self.mode.oom => {
                self.ooms.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) if self.mode.capture && legacy_refusal(&e) => {
                self.refusals.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) => panic!("allocate({n}, {s:?}): {e}"),
        }
    }

    /// Frees `h` on `to` (a stream this thread may name), ordered after the block's last use.
    fn free_on(&self, h: Held, to: Stream) {
        if to != h.s {
            let e = test_event(&self.sim, h.s);
            test_wait(&self.sim, e, to);
        }
        check(&self.sim, h.p, h.size, h.t, to);
        self.live.remove(h.p);
        self.a.deallocate(h.p, h.size, to).unwrap();
    }

    /// Sends `h` (used last on `h.s`, a stream this thread names) to slot `to`'s thread.
    fn send(&self, h: Held, to: usize) {
        let e = test_event(&self.sim, h.s);
        self.mail[to].lock().unwrap().push((h, e));
    }

    /// Installs an OOM hook that frees one spilled block on the calling thread's per-thread
    /// stream and then trims (blocking every other time): a trim inside an allocation's
    /// out-of-memory path, events destroyed while that allocation is under way.
    fn hook(self: &Arc<World>) {
        let w = Arc::downgrade(self);
        let n = AtomicU64::new(0);
        self.a.set_oom_hook(Some(Arc::new(move |_, _| {
            let Some(w) = w.upgrade() else { return false };
            let got = w.spill.lock().unwrap().pop();
            let Some((h, e)) = got else {
                w.a.trim(false).unwrap();
                return false;
            };
            test_wait(&w.sim, e, Stream::PER_THREAD);
            w.free_on(Held { s: Stream::PER_THREAD, ..h }, Stream::PER_THREAD);
            w.hook_frees.fetch_add(1, Ordering::Relaxed);
            w.a.trim(n.fetch_add(1, Ordering::Relaxed).is_multiple_of(2)).unwrap();
            true
        })));
    }

    /// Frees every block sent to `slot`, each on a stream of this thread's choice.
    fn receive(&self, slot: usize, own: Option<Stream>, x: &mut u64) -> usize {
        let got = std::mem::take(&mut *self.mail[slot].lock().unwrap());
        let n = got.len();
        for (mut h, e) in got {
            let to = self.pick(own, x);
            test_wait(&self.sim, e, to);
            h.s = to; // ordered on `to` now
            self.free_on(h, to);
        }
        n
    }
}

/// One thread lifetime of slot `slot`: `steps` random steps, then an exit that leaves frees
/// pending (remote frees just made, not flushed; blocks sent on; maybe its stream destroyed
/// before the thread's arenas are given up).
fn lifetime(w: &World, slot: usize, seed: u64, steps: usize) {
    let slots = w.mail.len();
    let mut x = seed | 1;
    let own = w.mode.user.then(|| w.sim.create_stream());
    let mut mine: Vec<Held> = Vec::new();
    for _ in 0..steps {
        if w.stop.load(Ordering::Relaxed) {
            break;
        }
        let r = rng(&mut x) % 32;
        match r {
            0..=11 => {
                if mine.len() < 48
                    && let Some(h) = w.alloc(own, &mut x)
                {
                    mine.push(h);
                } else if !mine.is_empty() {
                    let h = mine.swap_remove(rng(&mut x) as usize % mine.len());
                    w.free_on(h, h.s);
                }
            }
            12..=18 if !mine.is_empty() => {
                let h = mine.swap_remove(rng(&mut x) as usize % mine.len());
                w.free_on(h, h.s);
            }
            19..=22 if !mine.is_empty() && w.mode.remote => {
                let h = mine.swap_remove(rng(&mut x) as usize % mine.len());
                w.send(h, (slot + 1) % slots);
            }
            23..=25 => {
                w.receive(slot, own, &mut x);
            }
            26 | 27 if !mine.is_empty() => {
                // A cross-stream free: on another stream than the block's.
                let h = mine.swap_remove(rng(&mut x) as usize % mine.len());
                let to = w.pick(own, &mut x);
                w.free_on(h, to);
            }
            28 => w.a.flush().unwrap(),
            29 if w.mode.release => w.a.release_thread().unwrap(),
            29 if w.mode.hook && !mine.is_empty() => {
                let h = mine.swap_remove(rng(&mut x) as usize % mine.len());
                let e = test_event(&w.sim, h.s);
                w.spill.lock().unwrap().push((h, e));
            }
            30 if w.mode.inline_trims => {
                w.a.trim(rng(&mut x).is_multiple_of(4)).unwrap();
            }
            _ => std::thread::yield_now(),
        }
    }
    // The exit: blocks of the own stream freed there or sent on, the rest sent on or freed
    // (remote frees pending in the outbox at the exit), mail received last, no flush.
    for h in std::mem::take(&mut mine) {
        if w.mode.remote && rng(&mut x).is_multiple_of(2) {
            w.send(h, (slot + 1) % slots);
        } else {
            w.free_on(h, h.s);
        }
    }
    w.receive(slot, own, &mut x);
    if let Some(s) = own {
        if rng(&mut x).is_multiple_of(2) {
            // The stream destroyed while this thread's arena for it still lives (given up at
            // the exit, parked: the handle must never reach the device again).
            w.sim.destroy_stream(s).unwrap();
        } else {
            w.a.release_thread().unwrap();
            w.sim.destroy_stream(s).unwrap();
        }
    }
}

/// Trims in a loop until `w.stop`, blocking every `every`th time (0: never); returns how many.
fn trimmer(w: Arc<World>, k: u64, every: u64) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut n = 0u64;
        while !w.stop.load(Ordering::Relaxed) {
            let blocking = every > 0 && (n + k).is_multiple_of(every);
            if let Err(e) = w.a.trim(blocking) {
                panic!("trim({blocking}): {e}");
            }
            n += 1;
            if n.is_multiple_of(16) {
                w.a.flush().unwrap();
            }
            std::thread::yield_now();
        }
        w.a.release_thread().unwrap();
        n
    })
}

/// Runs `slots` slots of `lifetimes` thread lifetimes each (a new thread each), with
/// `trimmers` trim loops beside them; then frees what is left in the mail.
fn run(w: &Arc<World>, seed: u64, lifetimes: usize, steps: usize, trimmers: u64, every: u64) -> u64 {
    let trims: Vec<_> = (0..trimmers).map(|k| trimmer(w.clone(), k, every)).collect();
    let slots: Vec<_> = (0..w.mail.len())
        .map(|slot| {
            let w = w.clone();
            std::thread::spawn(move || {
                for l in 0..lifetimes {
                    let w2 = w.clone();
                    let s = seed ^ ((slot as u64) << 32) ^ (l as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    std::thread::spawn(move || lifetime(&w2, slot, s, steps)).join().unwrap();
                }
            })
        })
        .collect();
    for h in slots {
        h.join().unwrap();
    }
    w.stop.store(true, Ordering::Relaxed);
    let n: u64 = trims.into_iter().map(|h| h.join().unwrap()).sum();
    // Mail left over: freed by a thread that then exits.
    let w2 = w.clone();
    std::thread::spawn(move || {
        let mut x = seed;
        for slot in 0..w2.mail.len() {
            w2.receive(slot, None, &mut x);
        }
        w2.a.set_oom_hook(None);
        let spilled = std::mem::take(&mut *w2.spill.lock().unwrap());
        for (h, e) in spilled {
            test_wait(&w2.sim, e, Stream::PER_THREAD);
            w2.free_on(Held { s: Stream::PER_THREAD, ..h }, Stream::PER_THREAD);
        }
        w2.a.flush().unwrap();
    })
    .join()
    .unwrap();
    n
}

/// The end of a test: no violation, no overlap, everything back; then the allocator dropped,
/// and every event it made destroyed.
fn finish(w: Arc<World>, min_trims: u64, trims: u64) {
    // Destroyed by the trims that ran beside the traffic (before `all_back`'s own).
    let during = w.dev.destroyed.load(Ordering::Relaxed);
    w.live.assert_clean();
    all_back(&w.a, &w.sim);
    let (created, destroyed) =
        (w.dev.created.load(Ordering::Relaxed), w.dev.destroyed.load(Ordering::Relaxed));
    eprintln!(
        "trims {trims}, allocations {}, ooms {}, legacy refusals {}, events created {created}, \
         destroyed by the traffic's trims {during}, before the drop {destroyed}, alive {}",
        w.allocs.load(Ordering::Relaxed),
        w.ooms.load(Ordering::Relaxed),
        w.refusals.load(Ordering::Relaxed),
        w.sim.live_events()
    );
    assert!(trims >= min_trims, "only {trims} trims ran: the test does not test");
    assert!(during > 0, "no trim destroyed an event during the traffic: the test does not test");
    // After a blocking trim with everything freed and every thread gone, only the legacy
    // action's event may be held.
    assert!(w.sim.live_events() <= 1, "{} events alive after all_back's trim", w.sim.live_events());
    let sim = w.sim.clone();
    w.sim.destroy_stream(w.shared).unwrap();
    let w = Arc::into_inner(w).expect("the last reference");
    drop(w);
    all_events_destroyed(&sim);
}

// ---------------------------------------------------------------------------------------------
// 1. Trims against remote, cross-stream, legacy and user-stream churn.

/// Two trim loops (one blocking every third trim) against four slots of threads doing every
/// kind of traffic: remote frees, cross-stream frees, the legacy stream, user streams, pool
/// blocks, `flush`, `release_thread`, exits with frees pending.
#[test]
fn trims_race_every_kind_of_churn() {
    within(60, || {
        let sim = host(100);
        let mode =
            Mode { legacy: true, user: true, remote: true, pool: true, release: true, ..Mode::default() };
        let w = World::new(&sim, cfg(), 4, mode);
        let trims = run(&w, 0x5eed_0001, 3, 400, 2, 3);
        finish(w, 5, trims);
    });
}

/// Non-blocking trims only, in a tight loop from three threads, against remote and
/// cross-stream frees on the per-thread streams (no legacy stream): fences recorded and
/// dropped by many threads while idle events are destroyed.
#[test]
fn non_blocking_trims_from_three_threads_race_remote_frees() {
    within(60, || {
        let sim = host(200);
        let mode = Mode { remote: true, user: true, ..Mode::default() };
        let w = World::new(&sim, cfg(), 3, mode);
        let trims = run(&w, 0x5eed_0002, 3, 500, 3, 0);
        finish(w, 30, trims);
    });
}

/// The legacy stream only (with the per-thread streams): kept-back frees and legacy actions,
/// lazy legacy fences on pool blocks materialised by blocking trims and reused on per-thread
/// streams behind an event recorded on the legacy stream, while trims destroy idle events. The
/// legacy action's event must survive every trim.
#[test]
fn trims_race_legacy_stream_churn() {
    within(60, || {
        let sim = host(100);
        let mode = Mode { legacy: true, remote: true, pool: true, ..Mode::default() };
        let w = World::new(&sim, cfg(), 3, mode);
        let trims = run(&w, 0x5eed_0003, 3, 500, 2, 4);
        finish(w, 5, trims);
    });
}

/// Every churning thread trims too (blocking a quarter of the time), beside a trim loop: a
/// trim inside the traffic of its own thread, whose arenas hold pending batches.
#[test]
fn churning_threads_trim_themselves() {
    within(60, || {
        let sim = host(100);
        let mode = Mode {
            legacy: true,
            user: true,
            remote: true,
            pool: true,
            release: true,
            inline_trims: true,
            ..Mode::default()
        };
        let w = World::new(&sim, cfg(), 4, mode);
        let trims = run(&w, 0x5eed_0004, 2, 400, 1, 5);
        finish(w, 5, trims);
    });
}

// ---------------------------------------------------------------------------------------------
// 2. A deterministic interleaving: a trim while a fence is recorded, and while it is waited on.

/// A simulated device that, around chosen calls, hands control to a trimmer thread and waits
/// (a while) until that thread has trimmed: the trim runs while an event is outside the pool
/// between `pool.get` and the fence's construction (`Fence::record`), or while a stream waits
/// on a fence's event (`Fence::order_before`, the legacy action).
struct Stepping {
    sim: HostDevice,
    armed: AtomicBool,
    ask: Mutex<Option<std::sync::mpsc::Sender<std::sync::mpsc::Sender<()>>>>,
    handed: AtomicU64,
    /// The trimmer's thread: its own records and waits hand over nothing.
    trimmer: Mutex<Option<std::thread::ThreadId>>,
}

impl Stepping {
    fn hand_over(&self) {
        if !self.armed.load(Ordering::Relaxed)
            || *self.trimmer.lock().unwrap() == Some(std::thread::current().id())
        {
            return;
        }
        let tx = self.ask.lock().unwrap().clone();
        if let Some(tx) = tx {
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            if tx.send(done_tx).is_ok() {
                // Bounded: the trim may need a lock this call's caller holds.
                let _ = done_rx.recv_timeout(Duration::from_millis(20));
                self.handed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Interpose for Stepping {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn record_event(&self, e: Event, s: Stream) -> cuarena::Result<()> {
        let r = Device::record_event(&self.sim, e, s);
        self.hand_over();
        r
    }
    fn stream_wait_event(&self, s: Stream, e: Event) -> cuarena::Result<()> {
        self.hand_over();
        Device::stream_wait_event(&self.sim, s, e)
    }
}

/// At every event record and stream wait the allocator makes (from the churning threads), a
/// trimmer thread trims, blocking or not, before the call returns: every idle event is
/// destroyed at the worst moment the allocator gives. Remote frees, cross-stream frees and the
/// legacy stream keep records and waits coming.
#[test]
fn a_trim_at_every_record_and_wait_destroys_nothing_in_use() {
    within(60, || {
        let sim = host(50);
        let dev = Arc::new(Interposed(Stepping {
            sim: sim.clone(),
            armed: AtomicBool::new(false),
            ask: Mutex::new(None),
            handed: AtomicU64::new(0),
            trimmer: Mutex::new(None),
        }));
        let a = Allocator::new(dev.clone(), cfg().build().unwrap()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<std::sync::mpsc::Sender<()>>();
        *dev.ask.lock().unwrap() = Some(tx);
        let (b, dev2) = (a.clone(), dev.clone());
        let trimmer = std::thread::spawn(move || {
            *dev2.trimmer.lock().unwrap() = Some(std::thread::current().id());
            drop(dev2);
            let mut n = 0u64;
            while let Ok(done) = rx.recv() {
                b.trim(n.is_multiple_of(3)).unwrap();
                n += 1;
                let _ = done.send(());
            }
            b.release_thread().unwrap();
            n
        });
        dev.armed.store(true, Ordering::Relaxed);
        let live = Arc::new(Live::default());
        // Two threads passing blocks both ways, each freeing the other's on its own per-thread
        // stream, on the legacy stream, or on a user stream of its own.
        let (txs, rxs): (Vec<_>, Vec<_>) =
            (0..2).map(|_| std::sync::mpsc::channel::<Vec<(Held, Event)>>()).unzip();
        let mut rxs: Vec<_> = rxs.into_iter().map(Some).collect();
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let (a, sim, live) = (a.clone(), sim.clone(), live.clone());
                let to = txs[1 - i].clone();
                let from = rxs[i].take().unwrap();
                std::thread::spawn(move || {
                    let own = sim.create_stream();
                    let mut x = 0x1234_5678 + i as u64;
                    let mut tagn = (i as u32) << 28;
                    for round in 0..40 {
                        let mut batch = Vec::new();
                        for k in 0..24 {
                            let s = [Stream::PER_THREAD, Stream::LEGACY, own][k % 3];
                            let n = [4096, 100 * KIB, 200 * KIB][(rng(&mut x) % 3) as usize];
                            let p = a.allocate(n, s).unwrap();
                            let h = Held::taken(&sim, &live, p, n, s, &mut tagn);
                            if k % 2 == 0 {
                                batch.push((h, test_event(&sim, s)));
                            } else {
                                // Cross-stream: freed on the next stream of the three.
                                let t = [Stream::PER_THREAD, Stream::LEGACY, own][(k + 1) % 3];
                                test_wait(&sim, test_event(&sim, s), t);
                                check(&sim, p, n, h.t, t);
                                live.remove(p);
                                a.deallocate(p, n, t).unwrap();
                            }
                        }
                        if to.send(batch).is_err() {
                            break;
                        }
                        if let Ok(theirs) = from.recv_timeout(Duration::from_secs(5)) {
                            for (j, (h, e)) in theirs.into_iter().enumerate() {
                                let t = [Stream::PER_THREAD, Stream::LEGACY, own][j % 3];
                                test_wait(&sim, e, t);
                                check(&sim, h.p, h.size, h.t, t);
                                live.remove(h.p);
                                a.deallocate(h.p, h.size, t).unwrap();
                            }
                        }
                        if round % 8 == 7 {
                            a.flush().unwrap();
                        }
                    }
                    drop(to);
                    // Whatever is still coming.
                    for theirs in from {
                        for (h, e) in theirs {
                            test_wait(&sim, e, Stream::PER_THREAD);
                            check(&sim, h.p, h.size, h.t, Stream::PER_THREAD);
                            live.remove(h.p);
                            a.deallocate(h.p, h.size, Stream::PER_THREAD).unwrap();
                        }
                    }
                    a.release_thread().unwrap();
                    sim.destroy_stream(own).unwrap();
                })
            })
            .collect();
        drop(txs);
        for h in hs {
            h.join().unwrap();
        }
        dev.armed.store(false, Ordering::Relaxed);
        *dev.ask.lock().unwrap() = None;
        let trims = trimmer.join().unwrap();
        live.assert_clean();
        all_back(&a, &sim);
        let handed = dev.handed.load(Ordering::Relaxed);
        eprintln!("trims at a record or a wait: {trims} (handed over {handed})");
        assert!(trims >= 50, "only {trims} trims ran inside records and waits");
        drop(a);
        drop(dev);
        all_events_destroyed(&sim);
    });
}

// ---------------------------------------------------------------------------------------------
// 3. Captures.

/// A capture announced (`graph_capture_begin`) and running on the simulator (a user stream
/// being captured), while trims (blocking ones among them) destroy idle events and the other
/// threads churn: no synchronise may run (it would invalidate the capture), nothing is used
/// after it is destroyed, and the capture ends intact. Then again after the capture.
#[test]
fn trims_during_an_announced_capture_of_a_user_stream() {
    within(60, || {
        let sim = host(100);
        let mode =
            Mode { legacy: true, user: true, remote: true, pool: true, capture: true, ..Mode::default() };
        let w = World::new(&sim, cfg(), 3, mode);
        let cap = sim.create_stream();
        w.a.graph_capture_begin();
        sim.begin_capture(cap).unwrap();
        let before = w.dev.destroyed.load(Ordering::Relaxed);
        let trims = run(&w, 0x5eed_0005, 2, 300, 2, 3);
        let during = w.dev.destroyed.load(Ordering::Relaxed) - before;
        sim.end_capture(cap).expect("the capture was invalidated");
        assert!(during > 0, "no event destroyed during the capture: the test does not test");
        w.a.graph_capture_end().unwrap();
        sim.destroy_stream(cap).unwrap();
        no_violations(&sim);
        // And the traffic again with no capture, the same allocator.
        w.stop.store(false, Ordering::Relaxed);
        let trims = trims + run(&w, 0x5eed_0006, 1, 300, 2, 3);
        finish(w, 10, trims);
    });
}

/// A per-thread stream (a blocking stream) captured on the simulator and announced, while the
/// other threads churn without naming the legacy stream and trims run: the allocator must not
/// use the legacy stream (its legacy action or a lazy legacy fence: 906, the capture broken)
/// nor synchronise; the trims' event destructions go on. The capture ends intact.
#[test]
fn trims_during_an_announced_capture_of_a_per_thread_stream() {
    within(60, || {
        let sim = host(100);
        let mode =
            Mode { user: true, remote: true, pool: true, release: true, capture: true, ..Mode::default() };
        let w = World::new(&sim, cfg(), 3, mode);
        // First some legacy-stream history: kept-back frees, a legacy action's event, pool
        // blocks under lazy legacy fences, all still pending when the capture begins.
        let w2 = w.clone();
        std::thread::spawn(move || {
            let ps: Vec<_> = (0..64)
                .map(|i| {
                    let n = if i % 4 == 0 { 300 * KIB } else { 4096 };
                    (w2.a.allocate(n, Stream::LEGACY).unwrap(), n)
                })
                .collect();
            for &(p, n) in &ps {
                tag(&w2.sim, p, n, 7, Stream::LEGACY);
                w2.a.deallocate(p, n, Stream::LEGACY).unwrap();
            }
            // And once more, so that the legacy action has run and holds its event.
            let qs: Vec<_> = (0..64).map(|_| w2.a.allocate(4096, Stream::LEGACY).unwrap()).collect();
            for q in qs {
                w2.a.deallocate(q, 4096, Stream::LEGACY).unwrap();
            }
        })
        .join()
        .unwrap();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let (a2, sim2) = (w.a.clone(), sim.clone());
        let capturer = std::thread::spawn(move || {
            a2.graph_capture_begin();
            sim2.begin_capture(Stream::PER_THREAD).unwrap();
            ready_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            let r = sim2.end_capture(Stream::PER_THREAD);
            a2.graph_capture_end().unwrap();
            r
        });
        ready_rx.recv().unwrap();
        let before = w.dev.destroyed.load(Ordering::Relaxed);
        let trims = run(&w, 0x5eed_0007, 2, 300, 2, 3);
        let during = w.dev.destroyed.load(Ordering::Relaxed) - before;
        go_tx.send(()).unwrap();
        capturer.join().unwrap().expect("the per-thread capture was invalidated");
        assert!(during > 0, "no event destroyed during the capture: the test does not test");
        no_violations(&sim);
        finish(w, 10, trims);
    });
}

// ---------------------------------------------------------------------------------------------
// 4. The allocator's drop and thread exits.

/// Rounds of: an allocator, a trim loop on one clone, churn with remote and cross-stream frees
/// on two other threads (one of them exits with frees pending), and the clones dropped in a
/// random order, the last drop (the pool's, and its events') possibly on the trimmer's thread
/// right after a trim. Every event made is destroyed once every thread is gone.
#[test]
fn trims_race_the_allocators_drop_and_thread_exits() {
    within(60, || {
        let sim = host(100);
        let mut x = 0x5eed_0008u64;
        let mut total_destroyed = 0;
        for round in 0..12u32 {
            let (a, dev) = counted(&sim, cfg());
            let live = Arc::new(Live::default());
            let stop = Arc::new(AtomicBool::new(false));
            let (tx, rx) = std::sync::mpsc::channel::<Vec<(Held, Event)>>();
            let order = rng(&mut x);
            let trim_clone = a.clone();
            let stop2 = stop.clone();
            let trimmer = std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop2.load(Ordering::Relaxed) || n < 5 {
                    trim_clone.trim(n.is_multiple_of(4)).unwrap();
                    n += 1;
                    std::thread::yield_now();
                }
                // The last clone may be this one: dropped right after a trim.
                drop(trim_clone);
                n
            });
            let (b, sim2, live2) = (a.clone(), sim.clone(), live.clone());
            let producer = std::thread::spawn(move || {
                let own = sim2.create_stream();
                let mut tagn = round << 20;
                for k in 0..300 {
                    let s = if k % 2 == 0 { Stream::PER_THREAD } else { Stream::LEGACY };
                    let n = [256, 8 * KIB, 90 * KIB, 150 * KIB][k % 4];
                    let p = b.allocate(n, s).unwrap();
                    let h = Held::taken(&sim2, &live2, p, n, s, &mut tagn);
                    if k % 3 == 0 {
                        test_wait(&sim2, test_event(&sim2, s), own);
                        check(&sim2, p, n, h.t, own);
                        live2.remove(p);
                        b.deallocate(p, n, own).unwrap();
                    } else if tx.send(vec![(h, test_event(&sim2, s))]).is_err() {
                        unreachable!("the consumer waits for the channel's end");
                    }
                }
                drop(tx);
                sim2.destroy_stream(own).unwrap();
                drop(b); // the thread exits with its arenas (no release_thread)
            });
            let (c, sim3, live3) = (a.clone(), sim.clone(), live.clone());
            let consumer = std::thread::spawn(move || {
                for got in rx {
                    for (h, e) in got {
                        test_wait(&sim3, e, Stream::PER_THREAD);
                        check(&sim3, h.p, h.size, h.t, Stream::PER_THREAD);
                        live3.remove(h.p);
                        c.deallocate(h.p, h.size, Stream::PER_THREAD).unwrap();
                    }
                }
                // Exits with its remote frees unflushed (sent at the thread's exit).
                drop(c);
            });
            let mut a = Some(a);
            if order.is_multiple_of(2) {
                drop(a.take()); // the test's clone goes first
            }
            producer.join().unwrap();
            consumer.join().unwrap();
            if order.is_multiple_of(3) {
                drop(a.take());
            }
            stop.store(true, Ordering::Relaxed);
            let trims = trimmer.join().unwrap();
            drop(a.take());
            live.assert_clean();
            no_violations(&sim);
            assert!(trims >= 5);
            total_destroyed += dev.destroyed.load(Ordering::Relaxed);
            drop(dev);
            assert_eq!(sim.live_events(), 0, "round {round}: events alive after every drop");
            assert_eq!(sim.reserved_bytes(), 0, "round {round}: memory kept after the drop");
        }
        assert!(total_destroyed > 0, "no event destroyed at all: the test does not test");
    });
}

// ---------------------------------------------------------------------------------------------
// 5. Out of memory under a cap.

/// A cap of 6 MiB (1 MiB chunks), pool blocks and large superblocks among the requests, so
/// out-of-memory reclaims (with their own fences, and the last try's host waits on them) run
/// between trims that destroy idle events, from a trim loop and the churning threads.
#[test]
fn out_of_memory_under_a_cap_with_trims_interleaved() {
    within(60, || {
        let sim = host(100);
        let mode = Mode {
            legacy: true,
            user: true,
            remote: true,
            pool: true,
            release: true,
            oom: true,
            inline_trims: true,
            capture: false,
            hook: false,
        };
        let w = World::new(&sim, cfg(), 3, mode);
        let cap = 6 * MIB;
        w.a.set_limit_bytes(cap);
        let trims = run(&w, 0x5eed_0009, 3, 400, 1, 3);
        let (ooms, top) = (w.ooms.load(Ordering::Relaxed), w.max_reserved.load(Ordering::Relaxed));
        eprintln!("out of memory {ooms} times, reserved at most {top} bytes");
        assert!(top <= cap, "reserved {top} bytes over the cap {cap}");
        assert!(ooms > 0, "no out of memory under the cap: the test does not test");
        finish(w, 5, trims);
    });
}

/// The same cap, one thread: each out of memory is followed by a trim (blocking or not) and the
/// request tried again, the blocks of a remote thread's frees pending meanwhile.
#[test]
fn a_trim_after_each_out_of_memory_then_the_retry() {
    within(60, || {
        let sim = host(200);
        let (a, dev) = counted(&sim, cfg());
        a.set_limit_bytes(4 * MIB);
        let live = Arc::new(Live::default());
        let mut x = 0x5eed_000au64;
        let mut held: Vec<Held> = Vec::new();
        let mut tagn = 0u32;
        let (mut ooms, mut retried_ok) = (0, 0);
        let remote = Worker::new(&a);
        for i in 0..1500 {
            let s = [Stream::PER_THREAD, Stream::LEGACY][i % 2];
            let n = [4096, 100 * KIB, 300 * KIB, 700 * KIB][(rng(&mut x) % 4) as usize];
            let r = a.allocate(n, s);
            let p = match r {
                Ok(p) => p,
                Err(Error::OutOfMemory { .. }) => {
                    ooms += 1;
                    // Half the held blocks to the remote thread (pending there), then a trim.
                    let give: Vec<_> = held.drain(..held.len() / 2).collect();
                    let msgs: Vec<_> = give.into_iter().map(|h| (h, test_event(&sim, h.s))).collect();
                    let (sim2, live2, flush) = (sim.clone(), live.clone(), ooms % 3 == 0);
                    remote.run(move |b| {
                        for (h, e) in msgs {
                            test_wait(&sim2, e, Stream::PER_THREAD);
                            check(&sim2, h.p, h.size, h.t, Stream::PER_THREAD);
                            live2.remove(h.p);
                            b.deallocate(h.p, h.size, Stream::PER_THREAD).unwrap();
                        }
                        if flush {
                            b.flush().unwrap();
                        }
                    });
                    a.trim(ooms % 2 == 0).unwrap();
                    match a.allocate(n, s) {
                        Ok(p) => {
                            retried_ok += 1;
                            p
                        }
                        Err(Error::OutOfMemory { .. }) => continue,
                        Err(e) => panic!("{e}"),
                    }
                }
                Err(e) => panic!("{e}"),
            };
            held.push(Held::taken(&sim, &live, p, n, s, &mut tagn));
            if rng(&mut x).is_multiple_of(3) {
                let h = held.swap_remove(rng(&mut x) as usize % held.len());
                check(&sim, h.p, h.size, h.t, h.s);
                live.remove(h.p);
                a.deallocate(h.p, h.size, h.s).unwrap();
            }
        }
        for h in held {
            check(&sim, h.p, h.size, h.t, h.s);
            live.remove(h.p);
            a.deallocate(h.p, h.size, h.s).unwrap();
        }
        remote.exit();
        eprintln!("out of memory {ooms} times, {retried_ok} retries after a trim served");
        assert!(ooms > 10, "only {ooms} out-of-memory errors: the test does not test");
        live.assert_clean();
        all_back(&a, &sim);
        assert!(dev.destroyed.load(Ordering::Relaxed) > 0, "no event destroyed");
        drop(a);
        drop(dev);
        all_events_destroyed(&sim);
    });
}

// ---------------------------------------------------------------------------------------------
// 6. A side finding, outside the events feature (found by the capture tests above).

/// An allocation on the legacy stream is itself a legacy-stream operation (README, "Captures of
/// blocking streams": cuarena asks before each use of the legacy stream "that is not inside an
/// allocation or free on the legacy stream"; while a capture is announced, "its uses of the
/// legacy stream outside calls on it are refused"). A small legacy allocation during an
/// announced capture of a non-blocking stream is served; one the global pool serves (over
/// `large_max`) should be too, with the device nearly empty.
#[test]
fn a_legacy_stream_pool_allocation_is_served_during_an_announced_capture() {
    let sim = host(0);
    let a = alloc_with(&sim, cfg());
    let w = Worker::new(&a);
    // The legacy stream's identity known, the pool grown, the thread's legacy arena made.
    w.run(|a| {
        for n in [4096, 300 * KIB] {
            let p = a.allocate(n, Stream::LEGACY).unwrap();
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
    a.graph_capture_begin();
    let try_legacy = |a: &Allocator, n: usize| {
        let r = a.allocate(n, Stream::LEGACY);
        if let Ok(p) = r {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        r.map(|_| ())
    };
    let small = w.run(move |a| try_legacy(a, 4096));
    let fresh = on_thread(&a, move |a| try_legacy(a, 4096));
    let pool = w.run(move |a| try_legacy(a, 300 * KIB));
    a.graph_capture_end().unwrap();
    w.exit();
    all_back(&a, &sim);
    eprintln!("during the announcement: arena {small:?}, a new thread's arena {fresh:?}, pool {pool:?}");
    assert!(small.is_ok(), "the arena's legacy allocation was refused: {small:?}");
    assert!(fresh.is_ok(), "a new thread's first legacy allocation was refused: {fresh:?}");
    assert!(pool.is_ok(), "the pool's legacy allocation was refused: {pool:?}");
}

// ---------------------------------------------------------------------------------------------
// 7. More: trims inside an OOM hook, and a dead slot's fences.

/// Under a cap, the churning threads spill blocks for an OOM hook, which frees one and trims
/// (blocking every other time) inside the allocation's out-of-memory path, while a trim loop
/// runs too: idle events destroyed while an allocation that ran out is under way, its reclaim
/// having just recorded fences.
#[test]
fn an_oom_hook_that_frees_and_trims_inside_the_allocation() {
    within(60, || {
        let sim = host(100);
        let mode = Mode {
            legacy: true,
            user: true,
            remote: true,
            pool: true,
            oom: true,
            hook: true,
            ..Mode::default()
        };
        let w = World::new(&sim, cfg(), 3, mode);
        let cap = 5 * MIB;
        w.a.set_limit_bytes(cap);
        w.hook();
        let trims = run(&w, 0x5eed_000b, 3, 400, 1, 4);
        let (hooked, top) = (w.hook_frees.load(Ordering::Relaxed), w.max_reserved.load(Ordering::Relaxed));
        eprintln!("the hook freed {hooked} blocks; reserved at most {top} bytes");
        assert!(top <= cap, "reserved {top} bytes over the cap {cap}");
        assert!(hooked > 0, "the hook never freed a block: the test does not test");
        finish(w, 5, trims);
    });
}

/// A thread whose arena holds fenced remote frees when the allocator's last clone is dropped
/// keeps those fences, their events and the device (README, "Dropping the allocator"), until
/// its next call on an allocator it has not used: that call forgets the dead slot, the fences
/// go back to the orphaned event pool, and its drop destroys them, each once, on a device that
/// another allocator is using meanwhile. A trim on the new allocator runs there too.
#[test]
fn a_dead_slots_fences_are_destroyed_once_when_its_thread_moves_on() {
    within(60, || {
        let sim = host(300);
        let (a, dev) = counted(&sim, cfg());
        let (cmd_tx, cmd_rx) = std::sync::mpsc::channel::<u32>();
        let (msg_tx, msg_rx) = std::sync::mpsc::channel::<Vec<(Held, Event)>>();
        let (ack_tx, ack_rx) = std::sync::mpsc::channel::<()>();
        let live = Arc::new(Live::default());
        let (ta, tsim, tlive) = (a.clone(), sim.clone(), live.clone());
        let owner = std::thread::spawn(move || {
            let mut tagn = 0;
            let mut blocks = Vec::new();
            for i in 0..96 {
                let n = [4096, 40 * KIB, 100 * KIB][i % 3];
                let p = ta.allocate(n, Stream::PER_THREAD).unwrap();
                let h = Held::taken(&tsim, &tlive, p, n, Stream::PER_THREAD, &mut tagn);
                blocks.push((h, test_event(&tsim, Stream::PER_THREAD)));
            }
            msg_tx.send(blocks).unwrap();
            // Wait until the frees are fenced in this thread's inbox, then drop the last clone.
            assert_eq!(cmd_rx.recv().unwrap(), 1);
            drop(ta);
            ack_tx.send(()).unwrap();
            assert_eq!(cmd_rx.recv().unwrap(), 2);
            // Another allocator on the same device: this thread's first call on it forgets the
            // dead slot.
            let b = host_alloc(&tsim);
            let mut tagn = 1 << 20;
            for _ in 0..4 {
                let ps: Vec<_> = (0..32)
                    .map(|_| {
                        let p = b.allocate(4096, Stream::PER_THREAD).unwrap();
                        Held::taken(&tsim, &tlive, p, 4096, Stream::PER_THREAD, &mut tagn)
                    })
                    .collect();
                for h in ps {
                    check(&tsim, h.p, h.size, h.t, h.s);
                    tlive.remove(h.p);
                    b.deallocate(h.p, h.size, h.s).unwrap();
                }
                b.trim(true).unwrap();
            }
            all_back(&b, &tsim);
            drop(b);
        });
        // Another thread frees the owner's blocks (remote frees, fenced in batches on its
        // per-thread stream) and flushes them to the owner's inbox.
        let (ra, rsim, rlive) = (a.clone(), sim.clone(), live.clone());
        std::thread::spawn(move || {
            for (h, e) in msg_rx.recv().unwrap() {
                test_wait(&rsim, e, Stream::PER_THREAD);
                check(&rsim, h.p, h.size, h.t, Stream::PER_THREAD);
                rlive.remove(h.p);
                ra.deallocate(h.p, h.size, Stream::PER_THREAD).unwrap();
            }
            ra.flush().unwrap();
            ra.release_thread().unwrap();
        })
        .join()
        .unwrap();
        drop(a);
        cmd_tx.send(1).unwrap();
        ack_rx.recv().unwrap();
        let held = sim.live_events();
        eprintln!("events alive with the allocator gone and its owner thread alive: {held}");
        cmd_tx.send(2).unwrap();
        owner.join().unwrap();
        live.assert_clean();
        no_violations(&sim);
        let (c, d) = (dev.created.load(Ordering::Relaxed), dev.destroyed.load(Ordering::Relaxed));
        assert!(c > 0, "no event made: the test does not test");
        drop(dev);
        assert_eq!(sim.live_events(), 0, "events of the dropped allocator still alive");
        assert_eq!(d, c, "the dropped allocator destroyed {d} of the {c} events it made");
    });
}

fn host_alloc(sim: &HostDevice) -> Allocator {
    alloc_with(sim, cfg())
}
