//! Twenty-eighth session, helper-38: a multi-threaded chaos fuzz that combines many features at
//! once, where earlier tests combine two or three. Across 4–8 worker slots (each a sequence of
//! thread lifetimes: threads exit and new ones start) with seeded randomness:
//!
//! - allocations of 0 bytes, small blocks (≤ `small_max`), large ones (arena large
//!   superblocks, up to `large_max`) and pool-sized ones (over `large_max`);
//! - on the per-thread stream, the legacy stream, user streams each thread creates, destroys
//!   and recreates (the simulator gives destroyed handles to new streams, as CUDA does), a user
//!   stream shared by all threads, and a long-lived capture stream per slot;
//! - local frees, cross-stream frees, cross-thread frees (blocks passed through mailboxes with
//!   an event after their last use), and blocks parked for the OOM hook to spill;
//! - owning buffers (`DeviceBuffer`) declared used on other streams (`record_stream`) with work
//!   still running there, dropped during and after captures (`free_or_hold`);
//! - `flush`, `trim(false)`, `trim(true)`, `release_thread` and stats reads from a separate
//!   thread at random times, and from the workers;
//! - a reservation cap so out of memory happens, with an OOM hook that frees a spilled block,
//!   trims, or allocates inside itself;
//! - CUDA graph captures into graph pools (`graph_allocate`) on user streams (announced with
//!   `graph_capture_begin`), and, in a mode where no thread names the legacy stream, captures of
//!   per-thread streams (blocking streams).
//!
//! Properties: no panic; no race-checker violation, no tag error, no call on a destroyed
//! stream's handle; every block non-null, aligned (256 bytes, 512 for a graph pool's) and
//! overlapping no live block; every error one the README allows there (out of memory, a capture
//! refusal where a capture is underway), never `InvalidFree` for a valid free; every capture
//! ends intact; reserved never above the cap; at the end, every byte back
//! (`assert_all_returned`).
//!
//! Found, and mended in this session:
//! - **An announced capture invalidated by a device synchronise.** `graph_capture_begin` only
//!   counted the capture; a blocking `trim` or an out-of-memory reclaim asked
//!   `Inner::may_synchronize` once, at the start of `Slot::reclaim`, and then synchronised for
//!   each idle thread's user-stream arena it reclaimed (`Inner::reclaim_others` ->
//!   `Env::reclaim_fence`) without asking again. A capture announced and begun meanwhile was
//!   broken. Now a synchronise checks for announcements under a process-wide lock that an
//!   announcement takes too (`sync::unless_captures_announced`), and a reclaim whose
//!   synchronise is refused keeps the memory. The chaos fuzz met it in every seed
//!   (`chaos_with_user_stream_captures_under_a_cap`); the two `*_racing_an_announced_capture_*`
//!   tests show it deterministically (mutation `synchronise_after_unlock`).
//! - **The legacy stream used during an announced capture of a per-thread stream.** A pool
//!   allocation on another stream, reusing an extent with a lazy legacy fence, checked that no
//!   blocking stream was being captured and then recorded its event on the legacy stream; a
//!   capture announced and begun between the two was broken (906)
//!   (`chaos_without_the_legacy_stream_with_per_thread_captures`, about two runs in three).
//!   Now such a check and its call hold announcements off, and refuse the legacy stream while
//!   any capture is announced on the device (`Counted::checked`; mutation
//!   `legacy_check_unlocked`, which
//!   `a_legacy_record_racing_an_announced_per_thread_capture_never_breaks_it` shows
//!   deterministically).
//!
//! The fuzzes keep a mode that counts the synchronise race's symptoms instead of failing
//! (`Run::sync_race_known`), for reducing a failure; every test runs with it off.
//!
//! Debugging aids: `S28A_OFF=buffers,recreate,spill,hook,xthread,hold,trimmer,record` switches
//! features off, `S28A_SECS` and `S28A_SEED` set a fuzz's time budget and first seed, and
//! `S28A_BT=1` prints where a racing test's thread stops.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cuarena::{Allocator, Config, Device, DeviceAddr, DeviceBuffer, Error, Event, GraphPoolId, Stream};
use cuarena_testkit::{HostConfig, HostDevice, Interpose, Interposed, assert_all_returned};

mod common;
use common::{Held, check, rng, tag};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SMALL_MAX: usize = 128 * KIB;
const LARGE_MAX: usize = 4 * MIB;

/// A debugging aid: `S28A_OFF=buffers,recreate,...` switches features of the fuzz off.
fn off(name: &str) -> bool {
    std::env::var("S28A_OFF").is_ok_and(|v| v.split(',').any(|x| x == name))
}

fn mix(mut v: u64) -> u64 {
    v ^= v >> 31;
    v = v.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    v ^= v >> 29;
    v = v.wrapping_mul(0x94d0_49bb_1331_11eb);
    v ^ (v >> 32)
}

/// The simulated device, with a record of every device synchronise that invalidated a capture
/// (the simulator fails it with 900): where it came from.
/// It can also stop a chosen thread at its `k`-th capture query of the legacy stream (the one
/// `Inner::may_synchronize` and every synchronise make), event record on the legacy stream or
/// device synchronise, until the test lets it go.
struct Spy {
    sim: HostDevice,
    broke: Mutex<Vec<String>>,
    pause: Mutex<Pause>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct Pause {
    armed: Option<(std::thread::ThreadId, u32)>,
    stalled: bool,
    released: bool,
}

impl Spy {
    fn new(sim: &HostDevice) -> Arc<Interposed<Spy>> {
        Arc::new(Interposed(Spy {
            sim: sim.clone(),
            broke: Mutex::new(Vec::new()),
            pause: Mutex::new(Pause::default()),
            cv: std::sync::Condvar::new(),
        }))
    }
    /// The calling thread stops in its `k`-th (from 0) capture query of the legacy stream.
    fn arm(&self, k: u32) {
        self.pause.lock().unwrap().armed = Some((std::thread::current().id(), k));
    }
    fn here(&self) {
        let mut p = self.pause.lock().unwrap();
        match p.armed {
            Some((t, k)) if t == std::thread::current().id() => {
                if k > 0 {
                    p.armed = Some((t, k - 1));
                    return;
                }
                p.armed = None;
                if std::env::var("S28A_BT").is_ok() {
                    eprintln!("{}", std::backtrace::Backtrace::force_capture());
                }
                p.stalled = true;
                self.cv.notify_all();
                while !p.released {
                    p = self.cv.wait(p).unwrap();
                }
            }
            _ => {}
        }
    }
    /// Waits until the armed thread has stopped, or `done` says it will not.
    fn wait_stalled(&self, done: impl Fn() -> bool) -> bool {
        let mut p = self.pause.lock().unwrap();
        while !p.stalled {
            if done() {
                return false;
            }
            p = self.cv.wait_timeout(p, Duration::from_millis(5)).unwrap().0;
        }
        true
    }
    fn resume(&self) {
        self.pause.lock().unwrap().released = true;
        self.cv.notify_all();
    }
}

impl Interpose for Spy {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn record_event(&self, event: Event, stream: Stream) -> cuarena::Result<()> {
        // A stop point too, between a legacy record's check and the record itself.
        if stream.is_legacy() {
            self.here();
        }
        let r = self.sim.record_event(event, stream);
        self.note(&r);
        r
    }
    fn synchronize(&self) -> cuarena::Result<()> {
        // A stop point too: a capture announced while a synchronise runs must begin after it.
        self.here();
        let r = Device::synchronize(&self.sim);
        self.note(&r);
        r
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> cuarena::Result<()> {
        let r = self.sim.stream_wait_event(stream, event);
        self.note(&r);
        r
    }
    fn stream_capturing(&self, stream: Stream) -> cuarena::Result<bool> {
        if stream.is_legacy() {
            self.here();
        }
        self.sim.stream_capturing(stream)
    }
}

impl Spy {
    /// Records where a call that invalidated a capture came from.
    fn note<T>(&self, r: &cuarena::Result<T>) {
        if let Err(Error::Driver { call: "invalidated a capture", code }) = r {
            let bt = std::backtrace::Backtrace::force_capture().to_string();
            let frames: Vec<&str> = bt
                .lines()
                .filter(|l| l.contains("cuarena::") && !l.contains("backtrace"))
                .map(str::trim)
                .collect();
            let mut b = self.broke.lock().unwrap();
            if b.len() < 4 {
                b.push(format!("[{code}] {}", frames.join(" <- ")));
            }
        }
    }
}

/// One run's settings.
#[derive(Clone, Copy, Debug)]
struct Run {
    seed: u64,
    slots: usize,
    lifetimes: usize,
    ops: usize,
    cap: usize,
    /// No thread names the legacy stream; per-thread streams are captured (blocking captures).
    no_legacy: bool,
    /// Graph captures of each slot's capture stream (user) or per-thread stream (`no_legacy`).
    captures: bool,
    /// Blocks a thread holds at most.
    hold_max: usize,
    /// Sets aside the symptoms of the defect
    /// `a_blocking_trim_racing_an_announced_capture_never_synchronises_during_it` shows (a
    /// capture invalidated by a device synchronise begun before it was announced), to look for
    /// others: counted, not failed.
    sync_race_known: bool,
}

/// A block handed to another thread (or to the OOM hook), with an event recorded after its last
/// use on its stream in the sender's thread (none if last used on the legacy stream).
struct Parcel {
    h: Held,
    after: Option<Event>,
}

/// Live blocks with their history: start -> (end, what).
#[derive(Default)]
struct Book {
    map: Mutex<BTreeMap<u64, (u64, String)>>,
}

impl Book {
    fn insert(&self, p: DeviceAddr, len: usize, what: String) -> Option<String> {
        let (s, e) = (p.0, p.0 + len.max(1) as u64);
        let mut m = self.map.lock().unwrap();
        let below = m
            .range(..e)
            .next_back()
            .filter(|(_, (b, _))| *b > s)
            .map(|(a, (b, h))| format!("[{s:#x},{e:#x}) {what} overlaps live [{a:#x},{b:#x}): {h}"));
        if let Some(old) = m.insert(s, (e, what.clone())) {
            return Some(format!("[{s:#x},{e:#x}) {what} starts where live {old:?} starts"));
        }
        below
    }
    fn remove(&self, p: DeviceAddr) -> Option<(u64, String)> {
        self.map.lock().unwrap().remove(&p.0)
    }
    fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

#[derive(Default)]
struct Counts {
    allocs: AtomicU64,
    zero: AtomicU64,
    ooms: AtomicU64,
    pool_allocs: AtomicU64,
    large_allocs: AtomicU64,
    capture_refusals: AtomicU64,
    legacy_refusals: AtomicU64,
    captures: AtomicU64,
    graph_allocs: AtomicU64,
    graph_ooms: AtomicU64,
    hook_calls: AtomicU64,
    hook_spills: AtomicU64,
    held_buffer_drops: AtomicU64,
    buffers: AtomicU64,
    recreated_streams: AtomicU64,
    cross_thread: AtomicU64,
    trims_true: AtomicU64,
    exits: AtomicU64,
    releases: AtomicU64,
}

struct World {
    a: Allocator,
    sim: HostDevice,
    run: Run,
    live: Book,
    boxes: Vec<Mutex<Vec<Parcel>>>,
    /// Blocks the OOM hook may free.
    spill: Mutex<Vec<Parcel>>,
    shared: Stream,
    /// Per slot: a user stream kept for the whole run (captured in the user-capture mode).
    capture_streams: Vec<Stream>,
    /// Captures underway now, and a counter bumped at every begin and end: a call that
    /// overlapped a capture may meet its refusals.
    captures_now: AtomicU64,
    capture_epoch: AtomicU64,
    defects: Mutex<Vec<String>>,
    /// Symptoms of the known synchronise race, when the run sets them aside.
    known: AtomicU64,
    n: Counts,
    stop: AtomicBool,
}

/// What a worker knows of the captures when it starts a call.
#[derive(Clone, Copy)]
struct Span {
    now: u64,
    epoch: u64,
}

impl World {
    fn defect(&self, s: String) {
        let mut d = self.defects.lock().unwrap();
        if d.len() < 40 {
            d.push(format!("seed {}: {s}", self.run.seed));
        }
    }

    /// A symptom of the synchronise race: a defect unless the run sets them aside.
    fn sync_race(&self, s: String) {
        if self.run.sync_race_known {
            self.known.fetch_add(1, Ordering::Relaxed);
        } else {
            self.defect(s);
        }
    }

    fn span(&self) -> Span {
        Span {
            now: self.captures_now.load(Ordering::SeqCst),
            epoch: self.capture_epoch.load(Ordering::SeqCst),
        }
    }

    /// True if a capture may have been underway during a call that began at `s`.
    fn overlapped(&self, s: Span) -> bool {
        s.now > 0
            || self.captures_now.load(Ordering::SeqCst) > 0
            || self.capture_epoch.load(Ordering::SeqCst) != s.epoch
    }

    /// An error of a call other than an allocation or a free made on a stream this thread is
    /// capturing: allowed is the legacy stream's capture refusal (a synchronise or a legacy
    /// use refused) while a capture overlapped the call, nothing else.
    fn tolerate(&self, what: &str, e: Error, s: Span) {
        match e {
            Error::Driver { call: "invalidated a capture", code: 900 } => {
                self.sync_race(format!("{what}: {e:?}"));
            }
            Error::StreamCapturing { stream }
                if Stream::from_raw(stream).is_legacy() && self.overlapped(s) =>
            {
                self.n.legacy_refusals.fetch_add(1, Ordering::Relaxed);
            }
            e => self.defect(format!("{what}: {e:?} (capture overlapped: {})", self.overlapped(s))),
        }
    }

    fn take_deferred(&self) {
        while let Some(e) = self.a.take_deferred_error() {
            match e {
                // Deferred errors are the allocator's, not a call's: a capture refusal is
                // allowed once any capture has run.
                Error::StreamCapturing { .. } if self.capture_epoch.load(Ordering::SeqCst) > 0 => {
                    self.n.capture_refusals.fetch_add(1, Ordering::Relaxed);
                }
                Error::Driver { call: "invalidated a capture", code: 900 } => {
                    self.sync_race(format!("deferred: {e:?}"));
                }
                e => self.defect(format!("deferred: {e:?}")),
            }
        }
    }

    fn check_cap(&self, where_: &str) {
        let s = self.a.stats();
        if s.reserved_bytes as usize > self.run.cap {
            self.defect(format!("{where_}: reserved {} above the cap {}", s.reserved_bytes, self.run.cap));
        }
        let d = self.sim.reserved_bytes();
        if d > self.run.cap {
            self.defect(format!("{where_}: the device holds {d} B, above the cap {}", self.run.cap));
        }
    }
}

/// Orders `from`'s work so far before later work on `to` with the simulator's own event, unless
/// CUDA's implicit synchronisation already does.
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

fn pick_size(r: u64) -> usize {
    let v = (r >> 12) as usize;
    match r % 20 {
        0 => 0,
        1..=10 => 1 + v % SMALL_MAX,
        11..=15 => SMALL_MAX + 1 + v % (LARGE_MAX - SMALL_MAX),
        _ => LARGE_MAX + 1 + v % (5 * MIB),
    }
}

/// The thread's state within one lifetime.
struct Me {
    slot: usize,
    x: u64,
    tagn: u32,
    held: Vec<Held>,
    /// Owning buffers with their tag (0: used on another declared stream, whose hold checks the
    /// tag: a check on the buffer's own stream would race that use, unordered on purpose).
    bufs: Vec<(DeviceBuffer, u32)>,
    /// User streams this thread made and will destroy.
    eph: Vec<Stream>,
    /// Graph pools retained by this lifetime and not released.
    pools: Vec<GraphPoolId>,
    next_pool: u64,
    /// Addresses of graph pools' blocks this thread got (never pruned: a test step skips them).
    graph_addrs: std::collections::HashSet<u64>,
}

impl Me {
    fn r(&mut self) -> u64 {
        rng(&mut self.x)
    }
    fn pick_stream(&mut self, w: &World) -> Stream {
        let r = self.r();
        match r % 20 {
            0..=5 => Stream::PER_THREAD,
            6..=9 if !w.run.no_legacy => Stream::LEGACY,
            6..=13 => self.eph[(r >> 8) as usize % self.eph.len()],
            14..=16 => w.shared,
            _ => w.capture_streams[self.slot],
        }
    }
    /// A stream for a free of a block received from another thread (never the sender's).
    fn home_stream(&mut self, w: &World) -> Stream {
        let r = self.r();
        match r % 5 {
            0 if !w.run.no_legacy => Stream::LEGACY,
            0 | 1 => Stream::PER_THREAD,
            2 => w.shared,
            3 => w.capture_streams[self.slot],
            _ => self.eph[(r >> 8) as usize % self.eph.len()],
        }
    }
}

/// Allocates `size` on `s`: checks the result and records the block.
fn alloc(w: &World, me: &mut Me, size: usize, s: Stream) {
    let span = w.span();
    match w.a.allocate(size, s) {
        Ok(p) if size == 0 => {
            w.n.zero.fetch_add(1, Ordering::Relaxed);
            if !p.is_null() {
                w.defect(format!("allocate(0, {s:?}) gave {:#x}", p.0));
            }
            if let Err(e) = w.a.deallocate(p, 0, s) {
                w.defect(format!("deallocate(null, 0) refused: {e:?}"));
            }
        }
        Ok(p) => {
            if p.is_null() || p.0 % 256 != 0 {
                w.defect(format!("allocate({size}, {s:?}) gave {:#x}", p.0));
                return;
            }
            w.n.allocs.fetch_add(1, Ordering::Relaxed);
            if size > LARGE_MAX {
                w.n.pool_allocs.fetch_add(1, Ordering::Relaxed);
            } else if size > SMALL_MAX {
                w.n.large_allocs.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(c) = w.live.insert(p, size, format!("{size} B on {s:?} by slot {}", me.slot)) {
                w.defect(c);
            }
            me.tagn += 1;
            tag(&w.sim, p, size, me.tagn, s);
            me.held.push(Held { p, size, s, t: me.tagn });
        }
        Err(Error::OutOfMemory { requested, limit, reserved, .. }) => {
            w.n.ooms.fetch_add(1, Ordering::Relaxed);
            if requested != size {
                w.defect(format!("OutOfMemory for {size} reports {requested}"));
            }
            if limit != w.run.cap || reserved > w.run.cap {
                w.defect(format!("OutOfMemory: reserved {reserved} limit {limit}, cap {}", w.run.cap));
            }
        }
        Err(e) => w.tolerate(&format!("allocate({size}, {s:?})"), e, span),
    }
}

/// Frees `h` on `to` after ordering its last use before it and checking its tags there. A
/// refused free (allowed only as a capture refusal) gives the block back.
fn free_on(w: &World, h: Held, to: Stream) -> Option<Held> {
    order(&w.sim, h.s, to);
    check(&w.sim, h.p, h.size, h.t, to);
    let h = Held { s: to, ..h };
    let Some((_, history)) = w.live.remove(h.p) else {
        w.defect(format!("{:#x} not in the book", h.p.0));
        return None;
    };
    let span = w.span();
    match w.a.deallocate(h.p, h.size, to) {
        Ok(()) => None,
        Err(e) => {
            if let Some(c) = w.live.insert(h.p, h.size, format!("{history}; free on {to:?} refused: {e}")) {
                w.defect(format!("a block whose free was refused was handed out again: {c}"));
            }
            w.tolerate(&format!("deallocate({:#x}, {}, {to:?}) [{history}]", h.p.0, h.size), e, span);
            Some(h)
        }
    }
}

fn parcel(w: &World, h: Held) -> Parcel {
    let after = (!h.s.is_legacy()).then(|| {
        let e = w.sim.create_event().unwrap();
        w.sim.record_event(e, h.s).unwrap();
        e
    });
    Parcel { h, after }
}

fn receive(w: &World, p: Parcel, on: Stream) -> Held {
    match p.after {
        Some(e) => {
            w.sim.stream_wait_event(on, e).unwrap();
            Held { s: on, ..p.h }
        }
        None => p.h,
    }
}

/// The OOM hook: frees a spilled block (or trims, or allocates inside itself) and asks for a
/// retry.
fn hook(w: &Weak<World>, requested: usize) -> bool {
    let Some(w) = w.upgrade() else { return false };
    w.n.hook_calls.fetch_add(1, Ordering::Relaxed);
    w.check_cap("OOM hook");
    let k = mix(requested as u64 ^ w.n.hook_calls.load(Ordering::Relaxed));
    let p = w.spill.lock().unwrap().pop();
    if let Some(p) = p {
        // The spill goes on this thread's per-thread stream (never the legacy stream in the
        // no-legacy mode; this thread captures nothing while it allocates eagerly).
        let h = receive(&w, p, Stream::PER_THREAD);
        w.n.hook_spills.fetch_add(1, Ordering::Relaxed);
        let mut h = h;
        loop {
            match free_on(&w, h, Stream::PER_THREAD) {
                None => break,
                Some(back) => h = back,
            }
            std::thread::yield_now();
        }
        return true;
    }
    let span = w.span();
    match k % 4 {
        0 => {
            if let Err(e) = w.a.trim(true) {
                w.tolerate("trim(true) in the hook", e, span);
            }
            true
        }
        1 => {
            if let Err(e) = w.a.trim(false) {
                w.tolerate("trim(false) in the hook", e, span);
            }
            false
        }
        2 => {
            // An allocation inside the hook: out of memory there fails at once.
            match w.a.allocate(requested, Stream::PER_THREAD) {
                Ok(q) => {
                    if let Some(c) = w.live.insert(q, requested, "in the hook".into()) {
                        w.defect(c);
                    }
                    w.live.remove(q);
                    if let Err(e) = w.a.deallocate(q, requested, Stream::PER_THREAD) {
                        w.defect(format!("free in the hook: {e:?}"));
                    }
                }
                Err(Error::OutOfMemory { .. }) => {}
                Err(e) => w.tolerate("allocate in the hook", e, span),
            }
            true
        }
        _ => false,
    }
}

/// A graph capture by this thread: of its slot's capture stream (a user stream), or, in the
/// no-legacy mode, of its per-thread stream. Announced with `graph_capture_begin`.
fn capture(w: &World, me: &mut Me) {
    let s = if w.run.no_legacy { Stream::PER_THREAD } else { w.capture_streams[me.slot] };
    // Blocks last used on the captured stream wait until after the capture.
    let pool = GraphPoolId(1 + me.slot as u64, me.next_pool);
    me.next_pool += 1;
    w.a.graph_pool_retain(pool);
    me.pools.push(pool);
    w.captures_now.fetch_add(1, Ordering::SeqCst);
    w.capture_epoch.fetch_add(1, Ordering::SeqCst);
    w.a.graph_capture_begin();
    if let Err(e) = w.sim.begin_capture(s) {
        w.defect(format!("begin_capture: {e:?}"));
    }
    w.n.captures.fetch_add(1, Ordering::Relaxed);
    let mut graph: Vec<Held> = Vec::new();
    let steps = 4 + me.r() % 12;
    for _ in 0..steps {
        let r = me.r();
        match r % 8 {
            0..=3 => {
                let size = pick_size(me.r()).max(1);
                match w.a.graph_allocate(pool, size, s) {
                    Ok(p) => {
                        if p.is_null() || p.0 % 512 != 0 {
                            w.defect(format!("graph_allocate({size}) gave {:#x}", p.0));
                            continue;
                        }
                        w.n.graph_allocs.fetch_add(1, Ordering::Relaxed);
                        if let Some(c) = w.live.insert(p, size, format!("graph {size} B by slot {}", me.slot))
                        {
                            w.defect(c);
                        }
                        me.tagn += 1;
                        tag(&w.sim, p, size, me.tagn, s);
                        graph.push(Held { p, size, s, t: me.tagn });
                        me.graph_addrs.insert(p.0);
                    }
                    Err(Error::OutOfMemory { .. }) => {
                        w.n.graph_ooms.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => w.defect(format!("graph_allocate({size}) during a capture: {e:?}")),
                }
            }
            4 if !graph.is_empty() => {
                // A capture's own free, on its stream.
                let h = graph.swap_remove((r >> 8) as usize % graph.len());
                check(&w.sim, h.p, h.size, h.t, s);
                w.live.remove(h.p);
                if let Err(e) = w.a.deallocate(h.p, h.size, s) {
                    w.defect(format!("a graph block's free during its capture: {e:?}"));
                    w.live.insert(h.p, h.size, "graph block whose free failed".into());
                    graph.push(h);
                }
            }
            5 if s.is_user() => {
                // An eager allocation on the capturing user stream: refused.
                let size = 1 + (r >> 8) as usize % (2 * LARGE_MAX);
                match w.a.allocate(size, s) {
                    Err(Error::StreamCapturing { stream }) if stream == s.as_raw() => {
                        w.n.capture_refusals.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(p) => {
                        w.defect(format!("allocate({size}) on a capturing user stream gave {:#x}", p.0));
                        if let Some(c) = w.live.insert(p, size, "eager during capture".into()) {
                            w.defect(c);
                        }
                        me.tagn += 1;
                        tag(&w.sim, p, size, me.tagn, s);
                        graph.push(Held { p, size, s, t: me.tagn });
                    }
                    Err(e) => w.defect(format!("allocate({size}) on a capturing user stream: {e:?}")),
                }
            }
            6 if s.is_user() => {
                // A free of an eager block last used on the capturing stream: refused, nothing
                // changed.
                if let Some(i) = me.held.iter().position(|h| h.s == s && !me.graph_addrs.contains(&h.p.0)) {
                    let h = me.held[i];
                    match w.a.deallocate(h.p, h.size, s) {
                        Err(Error::StreamCapturing { .. }) => {
                            w.n.capture_refusals.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(()) => {
                            // The README: every free on a capturing user stream is refused.
                            w.defect(format!(
                                "a free of {:#x} on a capturing user stream was accepted",
                                h.p.0
                            ));
                            me.held.swap_remove(i);
                            w.live.remove(h.p);
                        }
                        Err(e) => w.defect(format!("a free on a capturing user stream: {e:?}")),
                    }
                }
            }
            7 => {
                // A buffer dropped during the capture of its stream: its free is held, made
                // again after the capture.
                if let Some(i) = me.bufs.iter().position(|(b, _)| b.stream() == s) {
                    let (b, t) = me.bufs.swap_remove(i);
                    if t != 0 {
                        check(&w.sim, b.ptr(), b.len(), t, s);
                    }
                    w.live.remove(b.ptr());
                    drop(b);
                    w.n.held_buffer_drops.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ => {}
        }
    }
    match w.sim.end_capture(s) {
        Ok(()) => {}
        Err(e) => w.sync_race(format!("the capture of {s:?} by slot {} was invalidated: {e:?}", me.slot)),
    }
    if let Err(e) = w.a.graph_capture_end() {
        w.defect(format!("graph_capture_end: {e:?}"));
    }
    w.captures_now.fetch_sub(1, Ordering::SeqCst);
    w.capture_epoch.fetch_add(1, Ordering::SeqCst);
    // The capture's blocks outlive it: ordinary blocks now, freed anywhere later.
    me.held.extend(graph);
    // Graphs destroyed now and then (the pool's blocks may outlive its release).
    if me.r().is_multiple_of(3) {
        let pool = me.pools.pop().unwrap();
        if let Err(e) = w.a.graph_pool_release(pool) {
            w.defect(format!("graph_pool_release: {e:?}"));
        }
    }
}

/// Destroys one of this thread's user streams and makes a new one (often given the same handle
/// by the simulator): blocks and buffers last used on it move to the per-thread stream first.
fn recreate(w: &World, me: &mut Me) {
    let i = me.r() as usize % me.eph.len();
    let old = me.eph[i];
    if me.held.iter().any(|h| h.s == old) {
        order(&w.sim, old, Stream::PER_THREAD);
        for h in me.held.iter_mut().filter(|h| h.s == old) {
            h.s = Stream::PER_THREAD;
        }
    }
    w.sim.destroy_stream(old).unwrap();
    me.eph[i] = w.sim.create_stream();
    w.n.recreated_streams.fetch_add(1, Ordering::Relaxed);
}

/// One thread lifetime of a slot.
fn lifetime(w: &World, slot: usize, life: usize) {
    let run = w.run;
    let mut me = Me {
        slot,
        x: mix(run.seed ^ ((slot as u64) << 32) ^ (life as u64) << 8) | 1,
        tagn: ((slot as u32) << 26) | ((life as u32 & 0x3ff) << 16),
        held: Vec::new(),
        bufs: Vec::new(),
        eph: (0..3).map(|_| w.sim.create_stream()).collect(),
        pools: Vec::new(),
        next_pool: (life as u64) << 20,
        graph_addrs: Default::default(),
    };
    let others = run.slots - 1;
    for i in 0..run.ops {
        if w.stop.load(Ordering::Relaxed) {
            break;
        }
        // Blocks sent to us: freed on a stream of ours.
        let parcels: Vec<Parcel> = std::mem::take(&mut *w.boxes[slot].lock().unwrap());
        for p in parcels {
            let to = me.home_stream(w);
            let h = receive(w, p, to);
            if let Some(h) = free_on(w, h, to) {
                me.held.push(h);
            }
        }
        let r = me.r();
        match r % 100 {
            0..=34 if me.held.len() < run.hold_max => {
                let size = pick_size(me.r());
                let s = me.pick_stream(w);
                alloc(w, &mut me, size, s);
                // Some blocks are held under long work on their stream.
                if me.r().is_multiple_of(8)
                    && !off("hold")
                    && let Some(h) = me.held.last()
                {
                    w.sim
                        .hold_and_check(h.p.0, 256, h.t, Duration::from_micros(300 + me.x % 700), h.s)
                        .unwrap();
                }
            }
            0..=52 if !me.held.is_empty() => {
                let k = (r >> 8) as usize % me.held.len();
                let h = me.held.swap_remove(k);
                let to = if (r >> 20).is_multiple_of(2) { h.s } else { me.pick_stream(w) };
                if let Some(h) = free_on(w, h, to) {
                    me.held.push(h);
                }
            }
            53..=62 if !me.held.is_empty() && others > 0 && !off("xthread") => {
                let h = me.held.swap_remove((r >> 8) as usize % me.held.len());
                let to = (slot + 1 + (r >> 20) as usize % others) % run.slots;
                w.boxes[to].lock().unwrap().push(parcel(w, h));
                w.n.cross_thread.fetch_add(1, Ordering::Relaxed);
            }
            63..=66 if !me.held.is_empty() && !off("spill") => {
                // Parked for the OOM hook.
                let h = me.held.swap_remove((r >> 8) as usize % me.held.len());
                w.spill.lock().unwrap().push(parcel(w, h));
            }
            67..=72 if me.bufs.len() < 6 && !off("buffers") => {
                // A buffer, used on another stream too and declared there.
                let size = pick_size(me.r());
                let s = match me.r() % 4 {
                    _ if off("bufptds") => Stream::PER_THREAD,
                    _ if off("bufshared") => w.shared,
                    _ if off("buflegacy") => Stream::LEGACY,
                    0 if !run.no_legacy => Stream::LEGACY,
                    0 | 1 => Stream::PER_THREAD,
                    2 => w.shared,
                    _ => w.capture_streams[slot],
                };
                let span = w.span();
                match w.a.buffer(size, s) {
                    Ok(mut b) => {
                        if size == 0 {
                            if !b.ptr().is_null() {
                                w.defect(format!("an empty buffer at {:#x}", b.ptr().0));
                            }
                            continue;
                        }
                        if b.ptr().0 % 256 != 0 {
                            w.defect(format!("buffer at {:#x}", b.ptr().0));
                            continue;
                        }
                        if let Some(c) = w.live.insert(b.ptr(), size, format!("buffer {size} B on {s:?}")) {
                            w.defect(c);
                        }
                        me.tagn += 1;
                        tag(&w.sim, b.ptr(), size, me.tagn, s);
                        let other =
                            [Stream::PER_THREAD, w.shared, w.capture_streams[slot]][me.r() as usize % 3];
                        let mut t = me.tagn;
                        if other != s && !off("record") {
                            order(&w.sim, s, other);
                            w.sim
                                .hold_and_check(
                                    b.ptr().0,
                                    256,
                                    me.tagn,
                                    Duration::from_micros(200 + me.x % 800),
                                    other,
                                )
                                .unwrap();
                            b.record_stream(other);
                            t = 0;
                        }
                        w.n.buffers.fetch_add(1, Ordering::Relaxed);
                        me.bufs.push((b, t));
                    }
                    Err(Error::OutOfMemory { .. }) => {
                        w.n.ooms.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => w.tolerate("buffer", e, span),
                }
            }
            73..=76 if !me.bufs.is_empty() => {
                let (b, t) = me.bufs.swap_remove((r >> 8) as usize % me.bufs.len());
                if t != 0 {
                    check(&w.sim, b.ptr(), b.len(), t, b.stream());
                }
                w.live.remove(b.ptr());
                drop(b); // freed on its stream, fenced after the declared one
            }
            77..=80 if !off("recreate") => recreate(w, &mut me),
            81..=83 if run.captures => capture(w, &mut me),
            84..=86 => {
                let span = w.span();
                if let Err(e) = w.a.flush() {
                    w.tolerate("flush", e, span);
                }
            }
            87 => {
                let span = w.span();
                if let Err(e) = w.a.trim(false) {
                    w.tolerate("trim(false)", e, span);
                }
            }
            88 if i % 3 == 0 => {
                let span = w.span();
                if let Err(e) = w.a.trim(true) {
                    w.tolerate("trim(true)", e, span);
                }
            }
            89..=90 => {
                let span = w.span();
                if let Err(e) = w.a.release_thread() {
                    w.tolerate("release_thread", e, span);
                }
            }
            _ => {}
        }
        if i % 32 == 0 {
            w.take_deferred();
        }
    }
    // The end of the lifetime: buffers dropped, graph pools released, held blocks sent to other
    // slots (or spilled), streams destroyed, then a release or a bare exit.
    for (b, t) in me.bufs.drain(..) {
        if t != 0 {
            check(&w.sim, b.ptr(), b.len(), t, b.stream());
        }
        w.live.remove(b.ptr());
        drop(b);
    }
    for pool in me.pools.drain(..) {
        if let Err(e) = w.a.graph_pool_release(pool) {
            w.defect(format!("graph_pool_release at exit: {e:?}"));
        }
    }
    for h in std::mem::take(&mut me.held) {
        let p = parcel(w, h);
        if others > 0 && !me.r().is_multiple_of(4) {
            let to = (slot + 1 + me.r() as usize % others) % run.slots;
            w.boxes[to].lock().unwrap().push(p);
        } else {
            w.spill.lock().unwrap().push(p);
        }
    }
    for s in me.eph.drain(..) {
        w.sim.destroy_stream(s).unwrap();
    }
    if me.r().is_multiple_of(2) {
        let span = w.span();
        w.n.releases.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = w.a.release_thread() {
            w.tolerate("release_thread at the end", e, span);
        }
    } else {
        w.n.exits.fetch_add(1, Ordering::Relaxed);
    }
}

/// The separate thread: flushes, trims (blocking or not), releases, reads stats and checks the
/// cap, at random times.
fn trimmer(w: &World) {
    let mut x = mix(w.run.seed ^ 0x7777) | 1;
    while !w.stop.load(Ordering::Relaxed) && !off("trimmer") {
        std::thread::sleep(Duration::from_micros(rng(&mut x) % 3000));
        let span = w.span();
        let r = match rng(&mut x) % 6 {
            0 => w.a.flush(),
            1 => w.a.trim(false).map(drop),
            2 => {
                w.n.trims_true.fetch_add(1, Ordering::Relaxed);
                w.a.trim(true).map(drop)
            }
            3 => w.a.release_thread(),
            _ => {
                w.check_cap("trimmer");
                Ok(())
            }
        };
        if let Err(e) = r {
            w.tolerate("trimmer", e, span);
        }
    }
    let _ = w.a.release_thread();
}

fn fuzz(run: Run) {
    let sim = HostDevice::new(HostConfig {
        capacity: 1 << 30,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(40),
        seed: run.seed,
        ..HostConfig::default()
    });
    let cfg = Config::builder()
        .small_max(SMALL_MAX)
        .large_max(LARGE_MAX)
        .max_bytes(run.cap)
        .batch_blocks(16)
        .build()
        .unwrap();
    let spy = Spy::new(&sim);
    let a = Allocator::new(spy.clone(), cfg).unwrap();
    let w = Arc::new(World {
        a: a.clone(),
        sim: sim.clone(),
        run,
        live: Book::default(),
        boxes: (0..run.slots).map(|_| Mutex::new(Vec::new())).collect(),
        spill: Mutex::new(Vec::new()),
        shared: sim.create_stream(),
        capture_streams: (0..run.slots).map(|_| sim.create_stream()).collect(),
        captures_now: AtomicU64::new(0),
        capture_epoch: AtomicU64::new(0),
        defects: Mutex::new(Vec::new()),
        known: AtomicU64::new(0),
        n: Counts::default(),
        stop: AtomicBool::new(false),
    });
    let weak = Arc::downgrade(&w);
    if !off("hook") {
        a.set_oom_hook(Some(Arc::new(move |req, _| hook(&weak, req))));
    }
    let t = {
        let w = w.clone();
        std::thread::spawn(move || trimmer(&w))
    };
    let hs: Vec<_> = (0..run.slots)
        .map(|slot| {
            let w = w.clone();
            std::thread::spawn(move || {
                for life in 0..run.lifetimes {
                    let w2 = w.clone();
                    if let Err(p) = std::thread::spawn(move || lifetime(&w2, slot, life)).join() {
                        std::panic::resume_unwind(p);
                    }
                }
            })
        })
        .collect();
    let mut panics = Vec::new();
    for (i, h) in hs.into_iter().enumerate() {
        if let Err(p) = h.join() {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panics.push(format!("slot {i}: {msg}"));
        }
    }
    w.stop.store(true, Ordering::Relaxed);
    t.join().expect("the trimmer panicked");
    assert!(panics.is_empty(), "seed {}: panics: {panics:?}", run.seed);
    // Everything still sent somewhere or spilled is freed here.
    let home = if run.no_legacy { Stream::PER_THREAD } else { Stream::LEGACY };
    let mut left: Vec<Parcel> = std::mem::take(&mut *w.spill.lock().unwrap());
    for b in &w.boxes {
        left.extend(std::mem::take(&mut *b.lock().unwrap()));
    }
    for p in left {
        let h = receive(&w, p, home);
        if free_on(&w, h, home).is_some() {
            w.defect("a free after the run was refused".into());
        }
    }
    let span = w.span();
    if let Err(e) = a.flush() {
        w.tolerate("final flush", e, span);
    }
    w.take_deferred();
    a.set_oom_hook(None);
    let st = a.stats();
    let n = &w.n;
    eprintln!(
        "seed {} ({} slots, cap {} MiB, no_legacy {}): allocs {} (zero {}, large {}, pool {}), ooms {}, hook {} \
         (spills {}), captures {} (graph allocs {}, graph ooms {}, refusals {}, legacy refusals {}), buffers {} \
         (held drops {}), streams recreated {}, cross-thread {}, trims(true) {}, exits {}, releases {}; \
         stats: ooms {} retries {} hook calls {} host_syncs {} peak reserved {} MiB",
        run.seed,
        run.slots,
        run.cap / MIB,
        run.no_legacy,
        n.allocs.load(Ordering::Relaxed),
        n.zero.load(Ordering::Relaxed),
        n.large_allocs.load(Ordering::Relaxed),
        n.pool_allocs.load(Ordering::Relaxed),
        n.ooms.load(Ordering::Relaxed),
        n.hook_calls.load(Ordering::Relaxed),
        n.hook_spills.load(Ordering::Relaxed),
        n.captures.load(Ordering::Relaxed),
        n.graph_allocs.load(Ordering::Relaxed),
        n.graph_ooms.load(Ordering::Relaxed),
        n.capture_refusals.load(Ordering::Relaxed),
        n.legacy_refusals.load(Ordering::Relaxed),
        n.buffers.load(Ordering::Relaxed),
        n.held_buffer_drops.load(Ordering::Relaxed),
        n.recreated_streams.load(Ordering::Relaxed),
        n.cross_thread.load(Ordering::Relaxed),
        n.trims_true.load(Ordering::Relaxed),
        n.exits.load(Ordering::Relaxed),
        n.releases.load(Ordering::Relaxed),
        st.ooms,
        st.alloc_retries,
        st.oom_hook_calls,
        st.host_syncs,
        st.peak_reserved_bytes as usize / MIB,
    );
    if st.peak_reserved_bytes as usize > run.cap {
        w.defect(format!("peak reserved {} above the cap {}", st.peak_reserved_bytes, run.cap));
    }
    if w.live.len() != 0 {
        w.defect(format!("{} blocks still in the book", w.live.len()));
    }
    let mut d = w.defects.lock().unwrap().clone();
    for b in spy.broke.lock().unwrap().iter().filter(|b| b.starts_with("[906]")) {
        d.push(format!("the legacy stream used during a blocking capture, from: {b}"));
    }
    if !run.sync_race_known {
        for b in spy.broke.lock().unwrap().iter() {
            d.insert(0, format!("a device synchronise during a capture, from: {b}"));
        }
    } else if w.known.load(Ordering::Relaxed) > 0 {
        eprintln!(
            "seed {}: {} symptoms of the known synchronise race set aside",
            run.seed,
            w.known.load(Ordering::Relaxed)
        );
        // A broken capture is allowed only where a synchronise broke one.
        if spy.broke.lock().unwrap().is_empty() {
            d.push("a capture was invalidated with no synchronise during one".into());
        }
    }
    assert!(d.is_empty(), "{} defects, first: {:#?}", d.len(), &d[..d.len().min(8)]);
    // The run's races, before anything else waits.
    sim.synchronize();
    let v: Vec<String> = sim
        .violations()
        .into_iter()
        .filter(|v| !(run.sync_race_known && v.starts_with("a device synchronise during a capture")))
        .collect();
    assert!(v.is_empty(), "seed {}: {} violations, first: {:?}", run.seed, v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0, "seed {}: a block was reused under running work", run.seed);
    assert_eq!(sim.stale_handle_calls(), 0, "seed {}", run.seed);
    // Held frees of buffers were made by the flush above; the streams can go now.
    let streams: Vec<Stream> = w.capture_streams.iter().copied().chain([w.shared]).collect();
    drop(w);
    if run.sync_race_known {
        // `assert_all_returned` asks the race checker again: the set-aside violations would
        // fail it. The same checks, without that one.
        a.release_thread().unwrap();
        a.flush().unwrap();
        a.release_thread().unwrap();
        sim.synchronize();
        a.check_invariants();
        let s = a.stats();
        assert_eq!(s.live_bytes, 0, "{s:?}");
        assert_eq!(s.invalid_frees, 0, "{s:?}");
        assert_eq!(s.allocations, s.deallocations, "{s:?}");
        a.trim(true).unwrap();
        let s = a.stats();
        assert_eq!(
            (s.arena_held_bytes, s.reserved_bytes, s.pool_in_use_bytes, s.arenas),
            (0, 0, 0, 0),
            "{s:?}"
        );
        assert_eq!((a.parked_bytes(), a.parked_free_bytes(), a.graph_pool_bytes()), (0, 0, 0));
    } else {
        assert_all_returned(&a, Some(&sim), 0);
    }
    for s in streams {
        sim.destroy_stream(s).unwrap();
    }
    a.trim(true).unwrap();
    assert_eq!(sim.reserved_bytes(), 0);
}

/// Runs seeds of `base` until `budget` is spent (at least one).
fn seeds(base: Run, first: u64, budget: Duration) {
    // `S28A_SECS` (a debugging aid) runs longer.
    let budget =
        std::env::var("S28A_SECS").ok().and_then(|v| v.parse().ok()).map_or(budget, Duration::from_secs);
    let first = std::env::var("S28A_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(first);
    let t0 = Instant::now();
    let mut seed = first;
    loop {
        fuzz(Run { seed, ..base });
        seed += 1;
        if t0.elapsed() > budget {
            break;
        }
    }
    eprintln!("{} seeds in {:?}", seed - first, t0.elapsed());
}

/// Every feature at once, with the legacy stream, graph captures of user streams (announced
/// with `graph_capture_begin`) and a cap. Failed in every seed before the mend of the
/// synchronise race (see the module's docs): announced captures were invalidated by a device
/// synchronise from another thread's blocking `trim` or out-of-memory reclaim that began before
/// the announcement.
#[test]
fn chaos_with_user_stream_captures_under_a_cap() {
    let base = Run {
        seed: 0,
        slots: 6,
        lifetimes: 3,
        ops: 250,
        cap: 160 * MIB,
        no_legacy: false,
        captures: true,
        hold_max: 14,
        sync_race_known: false,
    };
    seeds(base, 1, Duration::from_secs(12));
}

/// The same from another hundred seeds.
#[test]
fn chaos_with_user_stream_captures_more_seeds() {
    let base = Run {
        seed: 0,
        slots: 6,
        lifetimes: 3,
        ops: 250,
        cap: 160 * MIB,
        no_legacy: false,
        captures: true,
        hold_max: 14,
        sync_race_known: false,
    };
    seeds(base, 100, Duration::from_secs(15));
}

/// Every feature but captures, eight slots, a tighter cap.
#[test]
fn chaos_without_captures_eight_slots_tight_cap() {
    let base = Run {
        seed: 0,
        slots: 8,
        lifetimes: 3,
        ops: 200,
        cap: 128 * MIB,
        no_legacy: false,
        captures: false,
        hold_max: 12,
        sync_race_known: false,
    };
    seeds(base, 200, Duration::from_secs(15));
}

/// No thread names the legacy stream; threads capture their per-thread streams (blocking
/// captures, announced) into graph pools while others churn, trim and run out of memory.
/// Failed in about two runs of three before the mend (see the module's docs): a pool allocation
/// on another stream reused an extent with a lazy legacy fence and recorded its event on the
/// legacy stream (`GlobalPool::alloc_from` -> `FenceSet::order_before` -> `Fence::record`) with a
/// capture announced and begun between its check and its record.
#[test]
fn chaos_without_the_legacy_stream_with_per_thread_captures() {
    let base = Run {
        seed: 0,
        slots: 5,
        lifetimes: 3,
        ops: 250,
        cap: 160 * MIB,
        no_legacy: true,
        captures: true,
        hold_max: 14,
        sync_race_known: false,
    };
    seeds(base, 300, Duration::from_secs(15));
}

/// Announced captures (`graph_capture_begin`) are to be spared every device synchronise
/// (README, "CUDA graphs": "while any is underway, cuarena makes no device synchronise").
/// Failed before the mend (the module's docs). A blocking `trim(true)` decided once, at its start (`Slot::reclaim`, allocator.rs:1251,
/// `Inner::may_synchronize`), that it may synchronise, and then synchronises for each idle
/// thread's user-stream arena it reclaims (`Inner::reclaim_others` -> `Env::reclaim_fence` ->
/// `Env::home_fence_or_sync`, env.rs:118), without asking again whether a capture was announced
/// meanwhile (`Counted::synchronize` re-checks only blocking captures, through the legacy
/// stream). So a capture announced and begun on another thread while the trim runs is
/// invalidated by the trim's synchronise (on CUDA a `cuCtxSynchronize` during a global-mode
/// capture breaks it, as the README measured). PyTorch's allocator cannot do this: its
/// `beginAllocateToPool` and `emptyCache` take one mutex.
///
/// Here a thread idles with a user-stream arena holding freed memory; another thread runs
/// `trim(true)` and is stopped at its `k`-th capture query of the legacy stream or device
/// synchronise (the first is `may_synchronize`'s query, after the announced-capture check; a
/// stop inside a synchronise is what the mutation `synchronise_after_unlock` fails); meanwhile a third thread
/// announces a capture (`graph_capture_begin`) and begins capturing a user stream; then the trim
/// goes on. For every `k` the trim reaches, the capture must end intact and the simulator must
/// see no synchronise during it. (If `graph_capture_begin` waits for the trim, as a lock would
/// make it, the test lets the trim go on first, and the capture begins after it.)
#[test]
fn a_blocking_trim_racing_an_announced_capture_never_synchronises_during_it() {
    race_an_announced_capture(false);
}

/// The same race through the out-of-memory path: an allocation under a full cap reclaims with
/// `may_block` decided at its start (`Slot::alloc_pool_keyed` -> `Slot::reclaim`), and
/// synchronises for the idle thread's user arena after a capture was announced and begun.
#[test]
fn an_out_of_memory_reclaim_racing_an_announced_capture_never_synchronises_during_it() {
    race_an_announced_capture(true);
}

/// See `a_blocking_trim_racing_an_announced_capture_never_synchronises_during_it`; with `oom`,
/// the racing call is an allocation that runs out of memory instead of `trim(true)`.
fn race_an_announced_capture(oom: bool) {
    let mut broken = Vec::new();
    for k in 0..10u32 {
        let sim = common::host(20);
        let spy = Spy::new(&sim);
        // Blocks over 64 KiB from the pool; 1 MiB chunks.
        let a = Allocator::new(spy.clone(), common::small().large_max(64 * KIB).build().unwrap()).unwrap();
        let (v, u) = (sim.create_stream(), sim.create_stream());
        // An idle thread whose user arena holds memory its owner freed.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let a2 = a.clone();
        let idle = std::thread::spawn(move || {
            let ps: Vec<_> = (0..8).map(|_| a2.allocate(32 * KIB, v).unwrap()).collect();
            for p in ps {
                a2.deallocate(p, 32 * KIB, v).unwrap();
            }
            ready_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            a2.release_thread().unwrap();
        });
        ready_rx.recv().unwrap();
        // With `oom`: the cap is what is reserved, and a pool block fills the rest of it.
        let filler = oom.then(|| {
            let reserved = a.stats().reserved_bytes as usize;
            a.set_limit_bytes(reserved);
            let rest = reserved - a.pool_in_use();
            (a.allocate(rest, Stream::LEGACY).unwrap(), rest)
        });
        // The trimmer, stopped in its k-th legacy capture query.
        let (a2, spy2) = (a.clone(), spy.clone());
        let trim_done = Arc::new(AtomicBool::new(false));
        let td = trim_done.clone();
        let trimmer = std::thread::spawn(move || {
            spy2.arm(k);
            let r = if oom {
                // A new arena needs a superblock: out of memory, reclaim, retry.
                match a2.allocate(4096, Stream::PER_THREAD) {
                    Ok(p) => a2.deallocate(p, 4096, Stream::PER_THREAD).map(|()| 0),
                    Err(Error::OutOfMemory { .. }) => Ok(0),
                    Err(e) => Err(e),
                }
            } else {
                a2.trim(true)
            };
            td.store(true, Ordering::SeqCst);
            a2.release_thread().unwrap();
            r
        });
        let stalled = spy.wait_stalled(|| trim_done.load(Ordering::SeqCst));
        // The capture: announced, then begun on a user stream nothing else touches.
        let (a2, sim2) = (a.clone(), sim.clone());
        let (began_tx, began_rx) = std::sync::mpsc::channel::<()>();
        let capturer = std::thread::spawn(move || {
            a2.graph_capture_begin();
            sim2.begin_capture(u).unwrap();
            began_tx.send(()).unwrap();
        });
        // Gives it the chance to begin while the trim is stopped (it may wait for the trim).
        let _ = began_rx.recv_timeout(Duration::from_millis(300));
        spy.resume();
        let r = trimmer.join().unwrap();
        capturer.join().unwrap();
        let ended = sim.end_capture(u);
        a.graph_capture_end().unwrap();
        if ended.is_err() || r.is_err() || !spy.broke.lock().unwrap().is_empty() {
            broken.push(format!(
                "k = {k}: capture {ended:?}, trim {r:?}, synchronised from: {:?}",
                spy.broke.lock().unwrap()
            ));
        }
        done_tx.send(()).unwrap();
        idle.join().unwrap();
        if let Some((p, n)) = filler {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        sim.synchronize();
        if broken.is_empty() {
            common::all_back(&a, &sim);
        }
        if !stalled {
            break; // the trim made no k-th query: every stop point was tried
        }
    }
    assert!(broken.is_empty(), "{} stop points broke the capture:\n{}", broken.len(), broken.join("\n"));
}

/// The legacy-stream half, deterministically: a pool allocation on a user stream reuses an
/// extent freed on the legacy stream, whose lazy legacy fence it records on the legacy stream
/// (outside any call on the legacy stream, so after a check that no blocking stream is being
/// captured: `Counted::checked`). The allocating thread is stopped at its `k`-th capture query
/// of the legacy stream or legacy record (or synchronise); meanwhile another thread announces a capture
/// (`graph_capture_begin`) and begins capturing its per-thread stream, a blocking stream; then
/// the allocation goes on. For every `k`, the capture must end intact, with no legacy-stream use
/// during it: the announcement waits for a check and its record, and a record after the
/// announcement is refused (the allocation served from other memory). The mutation
/// `legacy_check_unlocked` (the check alone, as before) breaks it.
#[test]
fn a_legacy_record_racing_an_announced_per_thread_capture_never_breaks_it() {
    let mut broken = Vec::new();
    for k in 0..10u32 {
        let sim = common::host(20);
        let spy = Spy::new(&sim);
        // Blocks over 64 KiB from the pool; 1 MiB chunks.
        let a = Allocator::new(spy.clone(), common::small().large_max(64 * KIB).build().unwrap()).unwrap();
        let n = 256 * KIB;
        // An extent with a lazy legacy fence: a pool block freed on the legacy stream.
        let p = a.allocate(n, Stream::LEGACY).unwrap();
        a.deallocate(p, n, Stream::LEGACY).unwrap();
        a.flush().unwrap();
        let u = sim.create_stream();
        let (a2, spy2) = (a.clone(), spy.clone());
        let done = Arc::new(AtomicBool::new(false));
        let d2 = done.clone();
        let allocating = std::thread::spawn(move || {
            spy2.arm(k);
            let r = a2.allocate(n, u);
            d2.store(true, Ordering::SeqCst);
            if let Ok(q) = r {
                a2.deallocate(q, n, u).unwrap();
            }
            a2.release_thread().unwrap();
            r.map(|_| ())
        });
        let stalled = spy.wait_stalled(|| done.load(Ordering::SeqCst));
        // The capture of a per-thread stream: announced, then begun; ended when told.
        let (a2, sim2) = (a.clone(), sim.clone());
        let (began_tx, began_rx) = std::sync::mpsc::channel::<()>();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let capturer = std::thread::spawn(move || {
            a2.graph_capture_begin();
            sim2.begin_capture(Stream::PER_THREAD).unwrap();
            began_tx.send(()).unwrap();
            end_rx.recv().unwrap();
            let ended = sim2.end_capture(Stream::PER_THREAD);
            a2.graph_capture_end().unwrap();
            ended
        });
        // Gives it the chance to begin while the allocation is stopped (it may wait for it).
        let _ = began_rx.recv_timeout(Duration::from_millis(300));
        spy.resume();
        let r = allocating.join().unwrap();
        end_tx.send(()).unwrap();
        let ended = capturer.join().unwrap();
        let allowed = match &r {
            Ok(()) | Err(Error::OutOfMemory { .. }) => true,
            Err(e) => matches!(e, Error::StreamCapturing { stream } if Stream::from_raw(*stream).is_legacy()),
        };
        let v = sim.violations();
        if ended.is_err() || !allowed || !v.is_empty() || !spy.broke.lock().unwrap().is_empty() {
            broken.push(format!(
                "k = {k}: capture {ended:?}, allocation {r:?}, violations {v:?}, from: {:?}",
                spy.broke.lock().unwrap()
            ));
        }
        let _ = a.take_deferred_error();
        sim.synchronize();
        if broken.is_empty() {
            common::all_back(&a, &sim);
        }
        sim.destroy_stream(u).unwrap();
        if !stalled {
            break; // the allocation made no k-th query: every stop point was tried
        }
    }
    assert!(broken.is_empty(), "{} stop points broke the capture:\n{}", broken.len(), broken.join("\n"));
}
