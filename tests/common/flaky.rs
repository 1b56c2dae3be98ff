// The driver-fault device and workload of `adversarial_s27c.rs` and `adversarial_s27d.rs`,
// brought into each with `include!` (not a module: its items stay the test's own, private and
// unprefixed). The includer provides the imports: `std::sync::atomic::{AtomicBool, AtomicU64,
// Ordering}`, `std::sync::{Arc, Mutex}`, `cuarena::{Allocator, Config, Device, DeviceAddr,
// Error, Event, Result, Stream, StreamKey}`, `cuarena_testkit::{HostConfig, HostDevice,
// Interpose, Interposed, assert_all_returned}`, and `common::*`.

const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// A device whose calls fail, at random or on demand.

/// The device calls [`Flaky`] can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    Reserve,
    Release,
    CreateEvent,
    Record,
    Query,
    SyncEvent,
    Synchronize,
    Wait,
    Key,
    Capturing,
}

const CALLS: [Call; 10] = [
    Call::Reserve,
    Call::Release,
    Call::CreateEvent,
    Call::Record,
    Call::Query,
    Call::SyncEvent,
    Call::Synchronize,
    Call::Wait,
    Call::Key,
    Call::Capturing,
];

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Reserve => "reserve (injected)",
            Call::Release => "release (injected)",
            Call::CreateEvent => "create_event (injected)",
            Call::Record => "record_event (injected)",
            Call::Query => "query_event (injected)",
            Call::SyncEvent => "sync_event (injected)",
            Call::Synchronize => "synchronize (injected)",
            Call::Wait => "stream_wait_event (injected)",
            Call::Key => "stream_key (injected)",
            Call::Capturing => "stream_capturing (injected)",
        }
    }
}

/// A [`HostDevice`] whose calls of the kinds in `ppm` fail, while `on`, with that chance (per
/// million) each, before doing anything, with `Error::Driver { code: 999 }`. The draws come
/// from a seeded counter (which thread draws which number depends on the schedule).
struct Flaky {
    sim: HostDevice,
    on: AtomicBool,
    ppm: [u64; CALLS.len()],
    seed: u64,
    draws: AtomicU64,
    calls: [AtomicU64; CALLS.len()],
    injected: [AtomicU64; CALLS.len()],
    /// Armed single failures: a call of this kind fails once this many more have passed.
    armed: Mutex<Vec<(Call, u64)>>,
}

/// [`Flaky`] as a device.
type FlakyDevice = Interposed<Flaky>;

fn mix(mut v: u64) -> u64 {
    v ^= v >> 31;
    v = v.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    v ^= v >> 29;
    v = v.wrapping_mul(0x94d0_49bb_1331_11eb);
    v ^ (v >> 32)
}

impl Flaky {
    fn new(sim: &HostDevice, seed: u64, fails: &[(Call, u64)]) -> Arc<FlakyDevice> {
        let mut ppm = [0; CALLS.len()];
        for &(c, p) in fails {
            ppm[c as usize] = p;
        }
        Arc::new(Interposed(Flaky {
            sim: sim.clone(),
            on: AtomicBool::new(true),
            ppm,
            seed,
            draws: AtomicU64::new(0),
            calls: Default::default(),
            injected: Default::default(),
            armed: Mutex::new(Vec::new()),
        }))
    }

    fn gate(&self, c: Call) -> Result<()> {
        self.calls[c as usize].fetch_add(1, Ordering::Relaxed);
        {
            let mut armed = self.armed.lock().unwrap();
            if let Some(i) = armed.iter().position(|&(k, _)| k == c) {
                if armed[i].1 == 0 {
                    armed.swap_remove(i);
                    self.injected[c as usize].fetch_add(1, Ordering::Relaxed);
                    return Err(Error::Driver { call: c.name(), code: 999 });
                }
                armed[i].1 -= 1;
            }
        }
        let p = self.ppm[c as usize];
        if p == 0 || !self.on.load(Ordering::Acquire) {
            return Ok(());
        }
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        if mix(self.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n.wrapping_add(0x632b_e59b_d9b4_e019))
            % 1_000_000
            < p
        {
            self.injected[c as usize].fetch_add(1, Ordering::Relaxed);
            return Err(Error::Driver { call: c.name(), code: 999 });
        }
        Ok(())
    }

    /// The call of kind `c` after `skip` more of them fails, once.
    fn arm(&self, c: Call, skip: u64) {
        self.armed.lock().unwrap().push((c, skip));
    }

    /// True if an armed failure has not fired yet (and forgets it).
    fn disarm(&self) -> bool {
        let mut armed = self.armed.lock().unwrap();
        let left = !armed.is_empty();
        armed.clear();
        left
    }

    fn stop(&self) {
        self.on.store(false, Ordering::Release);
    }

    fn injected(&self, c: Call) -> u64 {
        self.injected[c as usize].load(Ordering::Relaxed)
    }

    fn summary(&self) -> String {
        CALLS
            .iter()
            .filter(|&&c| self.calls[c as usize].load(Ordering::Relaxed) > 0)
            .map(|&c| {
                format!("{:?} {}/{}", c, self.injected(c), self.calls[c as usize].load(Ordering::Relaxed))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The gated calls fail as [`Flaky::gate`] says; the others, and each gated call that passes,
/// go to the simulator.
impl Interpose for Flaky {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.gate(Call::Reserve)?;
        self.sim.reserve(bytes)
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.gate(Call::Release)?;
        // SAFETY: forwarded from the caller, who gives the same guarantees.
        unsafe { self.sim.release(ptr, bytes) }
    }
    fn create_event(&self) -> Result<Event> {
        self.gate(Call::CreateEvent)?;
        self.sim.create_event()
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.gate(Call::Record)?;
        self.sim.record_event(event, stream)
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        self.gate(Call::Query)?;
        self.sim.query_event(event)
    }
    fn sync_event(&self, event: Event) -> Result<()> {
        self.gate(Call::SyncEvent)?;
        self.sim.sync_event(event)
    }
    fn synchronize(&self) -> Result<()> {
        self.gate(Call::Synchronize)?;
        Device::synchronize(&self.sim)
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.gate(Call::Wait)?;
        self.sim.stream_wait_event(stream, event)
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        self.gate(Call::Key)?;
        self.sim.stream_key(stream)
    }
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        self.gate(Call::Capturing)?;
        self.sim.stream_capturing(stream)
    }
}

// ---------------------------------------------------------------------------------------------
// The workload.

/// Every call kind.
#[allow(dead_code)] // not used by every file that includes this one
const ALL: &[Call] = &CALLS;
/// Call kinds whose failure the README does not allow to lose memory: everything but
/// recording an event, making the event to record, and the capture check that precedes every
/// record (which lost memory before the mend: see
/// `a_failed_capture_check_in_release_thread_loses_no_memory`).
#[allow(dead_code)]
const NO_RECORD_OR_CAPTURE: &[Call] =
    &[Call::Reserve, Call::Release, Call::Query, Call::SyncEvent, Call::Synchronize, Call::Wait, Call::Key];

/// One fuzz run's settings.
#[derive(Clone, Copy)]
struct Run {
    seed: u64,
    /// Worker slots (each a sequence of thread lifetimes).
    slots: usize,
    /// Thread lifetimes per slot.
    lifetimes: usize,
    /// Operations per lifetime.
    ops: usize,
    /// Chance per million that a chosen call fails.
    ppm: u64,
    cap: usize,
}

/// A block handed to another thread, with an event the sender recorded after its last use
/// (on the block's stream, in the sender's thread), if the receiver needs one.
struct Parcel {
    h: Held,
    after: Option<Event>,
}

/// Live blocks with their history (for the report of an overlap): start -> (end, history).
#[derive(Default)]
struct Book {
    map: Mutex<std::collections::BTreeMap<u64, (u64, String)>>,
}

impl Book {
    /// Inserts a new block; an overlap with a live one is returned with that one's history.
    fn insert(&self, p: DeviceAddr, len: usize, what: String) -> Option<String> {
        let (s, e) = (p.0, p.0 + len as u64);
        let mut m = self.map.lock().unwrap();
        let clash = m
            .range(..e)
            .next_back()
            .filter(|(_, (b, _))| *b > s)
            .map(|(a, (b, h))| format!("[{s:#x},{e:#x}) {what} overlaps live [{a:#x},{b:#x}): {h}"));
        m.insert(s, (e, what));
        clash
    }
    fn remove(&self, p: DeviceAddr) -> Option<(u64, String)> {
        self.map.lock().unwrap().remove(&p.0)
    }
}

/// What the workers share.
struct World {
    a: Allocator,
    sim: HostDevice,
    dev: Arc<FlakyDevice>,
    live: Book,
    /// Per slot: blocks sent to it.
    boxes: Vec<Mutex<Vec<Parcel>>>,
    /// Per slot: its user streams.
    users: Vec<[Stream; 2]>,
    shared: Stream,
    /// Defects found (with the seed in the message).
    defects: Mutex<Vec<String>>,
    /// Driver errors returned to a caller of `flush`, `release_thread`, `trim` or a free, and
    /// deferred ones taken.
    driver_errors: AtomicU64,
    deferred_driver: AtomicU64,
    ooms: AtomicU64,
    capture_refusals: AtomicU64,
    seed: u64,
}

impl World {
    fn defect(&self, s: String) {
        let mut d = self.defects.lock().unwrap();
        if d.len() < 20 {
            d.push(format!("seed {}: {s}", self.seed));
        }
    }

    /// An error from a call while injection may be on: a driver error (counted) or a capture
    /// refusal (a failed capture check of the legacy stream is taken as a capture); anything
    /// else is a defect.
    fn tolerate(&self, what: &str, e: Error) {
        let injecting = self.dev.on.load(Ordering::Acquire);
        match e {
            Error::Driver { code: 999, .. } if injecting => {
                self.driver_errors.fetch_add(1, Ordering::Relaxed);
            }
            Error::StreamCapturing { .. } if injecting => {
                self.capture_refusals.fetch_add(1, Ordering::Relaxed);
            }
            e => self.defect(format!("{what}: {e:?} (injecting: {injecting})")),
        }
    }

    fn take_deferred(&self) {
        while let Some(e) = self.a.take_deferred_error() {
            match e {
                Error::Driver { code: 999, .. } => {
                    self.deferred_driver.fetch_add(1, Ordering::Relaxed);
                }
                Error::StreamCapturing { .. } => {
                    self.capture_refusals.fetch_add(1, Ordering::Relaxed);
                }
                e => self.defect(format!("deferred: {e:?}")),
            }
        }
    }
}

/// Orders `from`'s work so far (as the calling thread names it) before later work on `to`,
/// with the simulator's own event (never failing), unless CUDA's rules already do: the same
/// stream, or the per-thread stream and the legacy stream either way round (implicit
/// synchronisation). Returns nothing; the event is the test's.
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    if from == to || implicit(from, to) {
        return;
    }
    let e = sim.create_event().unwrap();
    sim.record_event(e, from).unwrap();
    sim.stream_wait_event(to, e).unwrap();
}

fn implicit(from: Stream, to: Stream) -> bool {
    (from.is_per_thread() && to.is_legacy()) || (from.is_legacy() && (to.is_per_thread() || to.is_legacy()))
}

/// A size: mostly small, some large (arena large superblocks: over `small_max` 1 MiB, up to
/// `large_max` 4 MiB), some over `large_max` (the pool).
fn pick_size(r: u64) -> usize {
    let v = (r >> 12) as usize;
    match r % 16 {
        0..=6 => 1 + v % (16 << 10),
        7..=9 => (16 << 10) + v % (MIB - (16 << 10)),
        10..=12 => MIB + 1 + v % (3 * MIB),
        _ => 4 * MIB + 1 + v % (6 * MIB),
    }
}

/// A slot's stream for a new block.
fn pick_stream(w: &World, slot: usize, r: u64) -> Stream {
    match r % 20 {
        0..=6 => Stream::PER_THREAD,
        7..=12 => Stream::LEGACY,
        13..=17 => w.users[slot][(r >> 8) as usize % 2],
        _ => w.shared,
    }
}

/// Frees `h` on `to` after ordering its last use before it and checking its tags there. On a
/// tolerated error the block stays the caller's (returned, its last use now on `to`).
fn free_on(w: &World, h: Held, to: Stream) -> Option<Held> {
    order(&w.sim, h.s, to);
    check(&w.sim, h.p, h.size, h.t, to);
    let h = Held { s: to, ..h };
    // Out of the book before the free: once it is accepted, another thread may get the block.
    let (_, history) = w.live.remove(h.p).expect("a held block is in the book");
    match w.a.deallocate(h.p, h.size, to) {
        Ok(()) => None,
        Err(Error::InvalidFree { reason, .. }) => {
            // The workload makes no bad free: a free that failed before must have changed
            // nothing.
            w.defect(format!("free of {:#x} ({} B) on {to:?} refused: {reason:?}; {history}", h.p.0, h.size));
            None
        }
        Err(e) => {
            // Nothing changed: the block is still ours, and nobody else can have it.
            let history = format!("{history}; free on {to:?} failed: {e}");
            if let Some(clash) = w.live.insert(h.p, h.size, history) {
                w.defect(format!("a block whose free failed was handed out again: {clash}"));
            }
            w.tolerate("deallocate", e);
            Some(h)
        }
    }
}

/// Sends `h` to slot `to`, with an event after its last use where the receiver needs one.
fn send(w: &World, h: Held, to: usize) {
    // The receiver frees on a stream of its own choosing: an event unless the block was last
    // used on the legacy stream (every stream the receiver may pick follows it, or gets the
    // receiver's own event from the legacy stream).
    let after = (!h.s.is_legacy()).then(|| {
        let e = w.sim.create_event().unwrap();
        w.sim.record_event(e, h.s).unwrap();
        e
    });
    w.boxes[to].lock().unwrap().push(Parcel { h, after });
}

/// Takes a parcel in: after the sender's event (if any) its block's last use is on `on`.
fn receive(w: &World, p: Parcel, on: Stream) -> Held {
    if let Some(e) = p.after {
        w.sim.stream_wait_event(on, e).unwrap();
        Held { s: on, ..p.h }
    } else {
        p.h
    }
}

/// One thread lifetime of slot `slot`.
fn lifetime(w: &World, slot: usize, life: usize, run: Run) {
    let mut x = mix(run.seed ^ ((slot as u64) << 32) ^ life as u64) | 1;
    let mut held: Vec<Held> = Vec::new();
    let mut tagn = ((slot as u32) << 26) | ((life as u32) << 16);
    let others = run.slots - 1;
    for i in 0..run.ops {
        let r = rng(&mut x);
        // Blocks sent to us: freed here, on a stream of ours or the block's user stream.
        let parcels: Vec<Parcel> = std::mem::take(&mut *w.boxes[slot].lock().unwrap());
        for p in parcels {
            let k = rng(&mut x);
            let to = match k % 4 {
                0 => Stream::PER_THREAD,
                1 => Stream::LEGACY,
                2 if p.h.s.is_user() => p.h.s,
                _ => w.users[slot][(k >> 8) as usize % 2],
            };
            let h = receive(w, p, to);
            if let Some(h) = free_on(w, h, to) {
                held.push(h); // a failed free: made again later
            }
        }
        match r % 100 {
            0..=39 => {
                let size = pick_size(rng(&mut x));
                let s = pick_stream(w, slot, rng(&mut x));
                match w.a.allocate(size, s) {
                    Ok(p) if p.0 == 0 || p.0 % 256 != 0 => {
                        w.defect(format!("allocate({size}, {s:?}) gave {:#x}", p.0));
                    }
                    Ok(p) => {
                        if let Some(clash) =
                            w.live.insert(p, size, format!("allocated on {s:?} by slot {slot}"))
                        {
                            w.defect(clash);
                        }
                        tagn += 1;
                        tag(&w.sim, p, size, tagn, s);
                        held.push(Held { p, size, s, t: tagn });
                    }
                    Err(Error::OutOfMemory { .. }) => {
                        w.ooms.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => w.tolerate("allocate", e),
                }
            }
            40..=66 if !held.is_empty() => {
                let h = held.swap_remove((r >> 8) as usize % held.len());
                // Half on its own stream, half on another of ours.
                let to = if (r >> 20).is_multiple_of(2) { h.s } else { pick_stream(w, slot, r >> 24) };
                if let Some(h) = free_on(w, h, to) {
                    held.push(h);
                }
            }
            67..=76 if !held.is_empty() && others > 0 => {
                let h = held.swap_remove((r >> 8) as usize % held.len());
                let to = (slot + 1 + (r >> 20) as usize % others) % run.slots;
                send(w, h, to);
            }
            77..=82 => {
                if let Err(e) = w.a.flush() {
                    w.tolerate("flush", e);
                }
            }
            83..=85 => {
                if let Err(e) = w.a.trim(false) {
                    w.tolerate("trim(false)", e);
                }
            }
            86 if i % 4 == 0 => {
                if let Err(e) = w.a.trim(true) {
                    w.tolerate("trim(true)", e);
                }
            }
            87..=88 => {
                if let Err(e) = w.a.release_thread() {
                    w.tolerate("release_thread", e);
                }
            }
            _ => {}
        }
        if i % 64 == 0 {
            w.take_deferred();
        }
    }
    // The end of the lifetime: what is still held goes to other slots (or is freed here if
    // there are none), then the thread releases its arenas or just exits.
    for h in held {
        if others > 0 {
            let to = (slot + 1 + rng(&mut x) as usize % others) % run.slots;
            send(w, h, to);
        } else {
            let mut h = h;
            while let Some(back) = free_on(w, h, Stream::LEGACY) {
                h = back;
            }
        }
    }
    if rng(&mut x).is_multiple_of(2)
        && let Err(e) = w.a.release_thread()
    {
        w.tolerate("release_thread at the end", e);
    }
}

/// What a run found, for the tests' own checks.
struct Outcome {
    world: Arc<World>,
}

/// Runs the workload on an allocator over a [`Flaky`] device failing `fails`, stops the
/// injection, frees everything left (no error allowed any more), and checks the run's
/// properties; returns the world for the memory checks.
fn fuzz(run: Run, fails: &[Call]) -> Outcome {
    let sim = HostDevice::new(HostConfig {
        capacity: 1 << 30,
        min_delay: std::time::Duration::ZERO,
        max_delay: std::time::Duration::from_micros(30),
        seed: run.seed,
        ..HostConfig::default()
    });
    let dev = Flaky::new(&sim, run.seed, &fails.iter().map(|&c| (c, run.ppm)).collect::<Vec<_>>());
    let cfg = Config::builder().large_max(4 * MIB).max_bytes(run.cap).batch_blocks(16).build().unwrap();
    // The allocator's own start makes device calls too: they may fail, and that is an error.
    let a = loop {
        match Allocator::new(dev.clone(), cfg.clone()) {
            Ok(a) => break a,
            Err(Error::Driver { code: 999, .. }) => {}
            Err(e) => panic!("seed {}: Allocator::new: {e:?}", run.seed),
        }
    };
    let users = (0..run.slots).map(|_| [sim.create_stream(), sim.create_stream()]).collect();
    let w = Arc::new(World {
        a,
        sim: sim.clone(),
        dev: dev.clone(),
        live: Book::default(),
        boxes: (0..run.slots).map(|_| Mutex::new(Vec::new())).collect(),
        users,
        shared: sim.create_stream(),
        defects: Mutex::new(Vec::new()),
        driver_errors: AtomicU64::new(0),
        deferred_driver: AtomicU64::new(0),
        ooms: AtomicU64::new(0),
        capture_refusals: AtomicU64::new(0),
        seed: run.seed,
    });
    let hs: Vec<_> = (0..run.slots)
        .map(|slot| {
            let w = w.clone();
            std::thread::spawn(move || {
                for life in 0..run.lifetimes {
                    let w2 = w.clone();
                    let r = std::thread::spawn(move || lifetime(&w2, slot, life, run)).join();
                    if let Err(p) = r {
                        std::panic::resume_unwind(p);
                    }
                }
            })
        })
        .collect();
    for (i, h) in hs.into_iter().enumerate() {
        if let Err(p) = h.join() {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("seed {}: worker slot {i} panicked: {msg}", run.seed);
        }
    }
    // The races of the run itself, before anything else waits.
    no_violations(&sim);
    w.take_deferred();
    dev.stop();
    // Quiesce: every block still sent somewhere is freed here, on the legacy stream; no
    // error is allowed any more.
    for b in &w.boxes {
        let parcels: Vec<Parcel> = std::mem::take(&mut *b.lock().unwrap());
        for p in parcels {
            let h = receive(&w, p, Stream::LEGACY);
            if let Some(h) = free_on(&w, h, Stream::LEGACY) {
                w.defect(format!("after the injection stopped, a free of {:#x} still failed", h.p.0));
            }
        }
    }
    if let Err(e) = w.a.flush() {
        w.defect(format!("flush after the injection: {e:?}"));
    }
    w.take_deferred();
    let st = w.a.stats();
    eprintln!(
        "seed {} ppm {}: injected [{}]; errors to callers {}, deferred {}, ooms {}, capture refusals {}; \
         allocations {}, live {}, reserved {}",
        run.seed,
        run.ppm,
        dev.summary(),
        w.driver_errors.load(Ordering::Relaxed),
        w.deferred_driver.load(Ordering::Relaxed),
        w.ooms.load(Ordering::Relaxed),
        w.capture_refusals.load(Ordering::Relaxed),
        st.allocations,
        st.live_bytes,
        st.reserved_bytes,
    );
    let d = w.defects.lock().unwrap().clone();
    assert!(d.is_empty(), "{} defects, first: {:#?}", d.len(), &d[..d.len().min(5)]);
    Outcome { world: w }
}

/// The end of a run where memory may have been lost to failed records: no live byte, no
/// invalid free, no race; after `trim(true)` what stays reserved is what failed records
/// dropped (none if none failed), and a request the cap leaves room for beside it succeeds.
#[allow(dead_code)]
fn quiesce_allowing_record_losses(o: &Outcome, run: Run) {
    let w = &o.world;
    let a = &w.a;
    a.release_thread().unwrap();
    a.flush().unwrap();
    a.release_thread().unwrap();
    a.trim(true).unwrap();
    no_violations(&w.sim);
    a.check_invariants();
    let s = a.stats();
    assert_eq!(s.live_bytes, 0, "seed {}: {s:?}", run.seed);
    assert_eq!(s.allocations, s.deallocations, "seed {}: {s:?}", run.seed);
    assert_eq!(s.invalid_frees, 0, "seed {}: {s:?}", run.seed);
    let lost = s.reserved_bytes as usize;
    let records = w.dev.injected(Call::Record) + w.dev.injected(Call::CreateEvent);
    if lost > 0 {
        assert!(records > 0, "seed {}: {lost} B kept with no record failed: {s:?}", run.seed);
        // Dropped silently? Each loss comes from an error a caller saw or a deferred one.
        assert!(
            w.driver_errors.load(Ordering::Relaxed) + w.deferred_driver.load(Ordering::Relaxed) > 0,
            "seed {}: {lost} B lost and no error reported",
            run.seed
        );
    }
    let room = (run.cap - lost) / (2 * MIB) * (2 * MIB);
    if room > 4 * MIB {
        let p = a.allocate(room, Stream::LEGACY).unwrap_or_else(|e| {
            panic!("seed {}: {room} B with {lost} B lost under a {} B cap: {e:?}", run.seed, run.cap)
        });
        a.deallocate(p, room, Stream::LEGACY).unwrap();
    }
    eprintln!("seed {}: {lost} B lost to {records} failed records", run.seed);
}

/// The end of a run where no memory may be lost: `assert_all_returned` (no live byte, no
/// invalid free, nothing held by an arena or the pool beyond what waits for the synchronise of
/// the final `trim(true)`, and nothing reserved after it).
fn every_byte_back(o: &Outcome) {
    let w = &o.world;
    w.a.release_thread().unwrap();
    let s = w.a.stats();
    eprintln!(
        "seed {}: before the final trim: arena_held {} parked {} pool_in_use {} reserved {}",
        w.seed,
        s.arena_held_bytes,
        w.a.parked_bytes(),
        s.pool_in_use_bytes,
        s.reserved_bytes
    );
    assert_all_returned(&w.a, Some(&w.sim), 0);
}

/// Parks a user arena of 80 MiB (past the 64 MiB bound): a thread allocates 20 blocks of 4 MiB
/// on a user stream, frees them there and releases itself with its burial's synchronise
/// failing, so that the arena stays parked (the failure is the deferred error, taken here);
/// the stream is then destroyed.
fn park_past_the_bound(a: &Allocator, sim: &HostDevice, dev: &Arc<FlakyDevice>) {
    let u = sim.create_stream();
    let (a2, d) = (a.clone(), dev.clone());
    std::thread::spawn(move || {
        let blocks: Vec<DeviceAddr> = (0..20).map(|_| a2.allocate(4 * MIB, u).unwrap()).collect();
        for p in blocks {
            a2.deallocate(p, 4 * MIB, u).unwrap();
        }
        d.arm(Call::Synchronize, 0);
        a2.release_thread().unwrap();
        assert!(!d.disarm(), "the release tried to synchronise");
    })
    .join()
    .unwrap();
    assert!(matches!(a.take_deferred_error(), Some(Error::Driver { code: 999, .. })));
    sim.destroy_stream(u).unwrap();
    assert!(a.parked_bytes() > 64 * MIB, "parked: {}", a.parked_bytes());
}

// ---------------------------------------------------------------------------------------------
// Shared by the files that test parking past the bound (`adversarial_s27d`, `adversarial_s28d`).

/// The allocator over a [`Flaky`] device that fails nothing until armed.
#[allow(dead_code)] // not used by every file that includes this one
fn flaky_allocator(sim: &HostDevice, cfg: cuarena::ConfigBuilder) -> (Arc<FlakyDevice>, Allocator) {
    let dev = Flaky::new(sim, 0, &[]);
    let a = Allocator::new(dev.clone(), cfg.build().unwrap()).unwrap();
    (dev, a)
}

/// Takes every deferred error, each a driver error the test injected (`injected` says whether
/// one may be there); returns how many.
#[allow(dead_code)]
fn take_injected(a: &Allocator, injected: bool, what: &str) -> usize {
    let mut n = 0;
    while let Some(e) = a.take_deferred_error() {
        assert!(injected && matches!(e, Error::Driver { code: 999, .. }), "{what}: deferred {e:?}");
        n += 1;
    }
    n
}

/// What a worker does on user stream `u` after a `flush` kept its batch there
/// ([`kept_batch_reaches_owner_after`]).
#[allow(dead_code)]
#[derive(Clone, Copy, Debug)]
enum Next {
    /// This many allocations of 4 KiB on `u`, each freed there at once.
    Calls(usize),
    /// The thread's own fast free of its `u` arena's block on `u`.
    OwnFree,
    /// A free on `u` of a block over `large_max` (the pool's).
    PoolFree,
    /// An allocation over `large_max` on `u` (the pool's), and its free.
    PoolAlloc,
}

/// `Allocator::flush` says that user-stream frees it cannot park (more than 64 MiB parked)
/// "stay with this thread until its next call on their stream sends them under an event".
/// Here a worker frees on user stream `u` 32 blocks of 64 KiB of an owner's `u` arena (one
/// batch, under `batch_blocks` and `batch_bytes`), flushes past the bound (the batch is kept),
/// then does `next` on `u`. The owner then takes in its frees (`flush`) and allocates the same
/// blocks again on `u`: returns how many of them lie where a block of the first round was (none
/// unless the worker's frees reached it: until then those blocks are still claimed). What
/// `next` frees was allocated before the flush, so that `next` makes no allocation of at most
/// `large_max` on `u`, which would send the batch itself.
#[allow(dead_code)]
fn kept_batch_reaches_owner_after(next: Next) -> usize {
    let large_max = 4 * MIB;
    let sim = host(0);
    let (dev, a) = flaky_allocator(&sim, Config::builder().large_max(large_max));
    park_past_the_bound(&a, &sim, &dev);
    let u = sim.create_stream();
    let owner = Worker::new(&a);
    let n = 64 << 10;
    let round = move |a: &Allocator| -> Vec<DeviceAddr> {
        a.flush().unwrap();
        (0..32).map(|_| a.allocate(n, u).unwrap()).collect()
    };
    let first = owner.run(round);
    let first_set: std::collections::HashSet<u64> = first.iter().map(|p| p.0).collect();
    let worker = Worker::new(&a);
    let big = 2 * large_max;
    let (own, pool) = match next {
        Next::Calls(_) => (None, None),
        _ => worker.run(move |a| (Some(a.allocate(4096, u).unwrap()), Some(a.allocate(big, u).unwrap()))),
    };
    let parked_frees = a.parked_free_bytes();
    worker.run(move |a| {
        for p in first {
            a.deallocate(p, n, u).unwrap();
        }
        a.flush().unwrap();
    });
    assert_eq!(a.parked_free_bytes(), parked_frees, "the flush kept the batch (past the bound)");
    // The worker's next calls on `u`.
    worker.run(move |a| match next {
        Next::Calls(calls) => {
            for _ in 0..calls {
                let p = a.allocate(4096, u).unwrap();
                a.deallocate(p, 4096, u).unwrap();
            }
        }
        Next::OwnFree => a.deallocate(own.unwrap(), 4096, u).unwrap(),
        Next::PoolFree => a.deallocate(pool.unwrap(), big, u).unwrap(),
        Next::PoolAlloc => {
            let p = a.allocate(big, u).unwrap();
            a.deallocate(p, big, u).unwrap();
        }
    });
    sim.synchronize(); // the worker's event on `u`, if any, has completed
    let second = owner.run(round);
    let reused = second.iter().filter(|p| first_set.contains(&p.0)).count();
    owner.run(move |a| {
        for p in second {
            a.deallocate(p, n, u).unwrap();
        }
    });
    worker.run(move |a| {
        if let Some(p) = own.filter(|_| !matches!(next, Next::OwnFree)) {
            a.deallocate(p, 4096, u).unwrap();
        }
        if let Some(p) = pool.filter(|_| !matches!(next, Next::PoolFree)) {
            a.deallocate(p, big, u).unwrap();
        }
    });
    worker.exit();
    owner.exit();
    sim.destroy_stream(u).unwrap();
    take_injected(&a, false, "cleanup");
    all_back(&a, &sim);
    reused
}
