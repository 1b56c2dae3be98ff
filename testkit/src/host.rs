//! A simulated device in host memory, with asynchronous streams, events and a race checker.
//!
//! ## Model
//! - **Memory** is real host memory (`std::alloc`), so tests can write and check it.
//! - **Streams** are ordered queues of work. A worker thread per stream runs the queue; every
//!   memory operation takes a random delay in `[min_delay, max_delay]`, so work completes
//!   asynchronously and out of step with the host.
//! - **Events** complete when the work queued before their record has. `stream_wait_event`
//!   makes later work on a stream wait for them, without blocking the host.
//! - A [`StreamGate`] ([`HostDevice::gate`]) holds a stream's later work back until the test
//!   opens it: work queued behind it stays in flight for as long as the test needs, where a
//!   long hold would only make that likely (a loaded machine can outlast any hold).
//! - Stream handles: NULL and `0x1` are one legacy stream; `0x2` is a different stream in every
//!   host thread; handles of destroyed streams are reused, like CUDA does.
//! - Implicit synchronisation, as CUDA's: work on the legacy stream waits for all work queued
//!   before it on every per-thread stream, and work on a per-thread stream waits for all work
//!   queued before it on the legacy stream. User streams are non-blocking (they synchronise
//!   with neither), the case of PyTorch's and CuPy's streams and the strictest for the
//!   allocator.
//!
//! ## The race checker
//! Each stream keeps a vector clock: its own count of submitted operations, joined with the
//! clock of every event it was made to wait on. When a memory operation is submitted on stream
//! `S`, every operation still **in flight** (submitted, not completed) on another stream `T`
//! that touches overlapping bytes must be ordered before it, i.e. `clock_S[T] >= seq`. If not,
//! the two may run at once on a real GPU: the checker records a violation. An allocator that
//! hands a block to another stream before its fence has completed, and without making the new
//! stream wait, is caught here whenever the old work is still running, which long random
//! delays make the common case. Accesses outside reserved memory and releases of memory that
//! work still uses are violations too.
//!
//! ## Stream-ordered allocation
//! [`Device::alloc_async`] is a fresh reservation (256-byte aligned). [`Device::free_async`]
//! submits a release operation on the stream, like `cuMemFreeAsync`: it is checked like a
//! memory operation (unfinished, unordered work on the region on another stream is a race), the
//! region counts as gone for work submitted after it (an access is then "outside reserved
//! memory"), and the memory is returned when the operation runs.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Duration;

use cuarena::{Device, DeviceKind, Error, Event, Result, Stream, StreamKey};

/// Settings of a simulated device.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Bytes the device can reserve in all.
    pub capacity: usize,
    /// Alignment of every reservation.
    pub alignment: usize,
    /// Shortest simulated duration of a memory operation.
    pub min_delay: Duration,
    /// Longest simulated duration of a memory operation.
    pub max_delay: Duration,
    /// Seed of the delay generator.
    pub seed: u64,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            capacity: 8 << 30,
            alignment: 2 << 20,
            min_delay: Duration::ZERO,
            max_delay: Duration::from_micros(50),
            seed: 0x9e37_79b9_7f4a_7c15,
        }
    }
}

/// A handle to a simulated device; clones share it.
#[derive(Clone)]
pub struct HostDevice {
    handle: Arc<Handle>,
}

/// Drops the simulation when the last [`HostDevice`] clone goes.
struct Handle {
    sh: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut st = self.sh.lock();
        st.shutdown = true;
        drop(st);
        self.sh.cv.notify_all();
    }
}

struct Shared {
    id: u64,
    cfg: HostConfig,
    state: Mutex<State>,
    cv: Condvar,
    tag_errors: AtomicU64,
}

#[derive(Clone, Copy)]
enum MemAction {
    Fill(u8),
    Tag(u32),
    Check(u32),
    HoldCheck(u32, Duration),
}

enum OpKind {
    Mem {
        start: u64,
        end: u64,
        action: MemAction,
    },
    /// Implicit synchronisation: waits until each `(stream, op)` has completed.
    After {
        deps: Vec<(usize, u64)>,
    },
    Record {
        event: usize,
        generation: u64,
    },
    Wait {
        event: usize,
        generation: u64,
    },
    /// A stream-ordered release of the region at `start` (from `free_async`).
    Free {
        start: u64,
        end: u64,
    },
    /// Waits until [`StreamGate`] `gate` is opened.
    Gate {
        gate: u64,
    },
}

struct Op {
    seq: u64,
    delay: Duration,
    kind: OpKind,
}

struct SimStream {
    own: usize,
    key: u64,
    /// Vector clock: `clock[j]` is the last op of stream `j` known to be ordered before the
    /// next op submitted here. `clock[self]` is this stream's submitted count.
    clock: Vec<u64>,
    completed: u64,
    queue: VecDeque<Op>,
    worker: bool,
    rng: u64,
    /// A per-thread default stream (synchronises with the legacy stream).
    per_thread: bool,
    /// Being captured into a CUDA graph (`begin_capture` .. `end_capture`): an event recorded
    /// or waited on here would become a graph node, so the race checker reports it.
    capturing: bool,
    /// The capture was invalidated (as CUDA's is by a use of the legacy stream while a blocking
    /// stream is captured, or by a device synchronise): `end_capture` fails.
    broken: bool,
}

/// An event. Each record is a generation; a wait captures one generation and is released only
/// when that record completes (records on different streams may complete out of order).
struct SimEvent {
    recorded: u64,
    completed: std::collections::HashSet<u64>,
    clock: Vec<u64>,
    /// `destroy_event` has been called: any later use is refused and recorded as a violation
    /// (CUDA's handle would be dangling, or another event's).
    destroyed: bool,
}

impl SimEvent {
    fn is_done(&self, generation: u64) -> bool {
        generation == 0 || self.completed.contains(&generation)
    }
}

struct Inflight {
    stream: usize,
    seq: u64,
    start: u64,
    end: u64,
}

struct Region {
    len: usize,
    layout: std::alloc::Layout,
    /// A `free_async` of it has been submitted: no new work may use it.
    freeing: bool,
}

struct State {
    shutdown: bool,
    /// Some stream has queued work and no worker: its spawn failed (`State::enqueue`), and
    /// waits try again (`Shared::wait`).
    orphaned: bool,
    regions: BTreeMap<u64, Region>,
    reserved: usize,
    streams: Vec<SimStream>,
    handles: HashMap<usize, usize>,
    free_handles: Vec<usize>,
    /// Calls made with the handle of a destroyed stream not yet reused (see `resolve`).
    stale_handle_calls: u64,
    next_handle: usize,
    ptds: HashMap<ThreadId, usize>,
    events: Vec<SimEvent>,
    inflight: Vec<Inflight>,
    violations: Vec<String>,
    next_key: u64,
    /// Gates made by [`HostDevice::gate`] and not yet opened.
    closed_gates: std::collections::HashSet<u64>,
    next_gate: u64,
}

const LEGACY: usize = 0;
/// Alignment of [`Device::alloc_async`] memory (CUDA's stream-ordered pools give at least 256).
const ASYNC_ALIGNMENT: usize = 256;
static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

impl Default for HostDevice {
    fn default() -> Self {
        HostDevice::new(HostConfig::default())
    }
}

impl HostDevice {
    /// A new simulated device.
    pub fn new(cfg: HostConfig) -> HostDevice {
        let mut st = State {
            shutdown: false,
            orphaned: false,
            regions: BTreeMap::new(),
            reserved: 0,
            streams: Vec::new(),
            handles: HashMap::new(),
            free_handles: Vec::new(),
            stale_handle_calls: 0,
            next_handle: 0x1000,
            ptds: HashMap::new(),
            events: Vec::new(),
            inflight: Vec::new(),
            violations: Vec::new(),
            next_key: 1,
            closed_gates: Default::default(),
            next_gate: 1,
        };
        st.new_stream(cfg.seed);
        let sh = Arc::new(Shared {
            id: NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            state: Mutex::new(st),
            cv: Condvar::new(),
            tag_errors: AtomicU64::new(0),
        });
        HostDevice { handle: Arc::new(Handle { sh }) }
    }

    fn sh(&self) -> &Arc<Shared> {
        &self.handle.sh
    }

    /// Creates a user stream. Its handle may be one a destroyed stream had.
    pub fn create_stream(&self) -> Stream {
        let mut st = self.sh().lock();
        let seed = self.sh().cfg.seed ^ st.next_key.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let idx = st.new_stream(seed);
        let h = match st.free_handles.pop() {
            Some(h) => h,
            None => {
                st.next_handle += 0x10;
                st.next_handle
            }
        };
        st.handles.insert(h, idx);
        Stream::from_raw(h)
    }

    /// Destroys a user stream. Work already queued on it still completes; the handle may be
    /// given to the next stream created.
    pub fn destroy_stream(&self, stream: Stream) -> Result<()> {
        let mut st = self.sh().lock();
        st.handles.remove(&stream.as_raw()).ok_or(Error::Driver { call: "destroy_stream", code: 400 })?;
        st.free_handles.push(stream.as_raw());
        Ok(())
    }

    /// Sets every byte of `[ptr, ptr+len)` to `value`, in order on `stream` (like `cuMemsetD8Async`).
    pub fn fill(&self, ptr: u64, len: usize, value: u8, stream: Stream) -> Result<()> {
        self.submit_mem(ptr, len, MemAction::Fill(value), stream)
    }

    /// Writes `tag` over every 32-bit word of `[ptr, ptr+len)` on `stream`.
    pub fn write_tag(&self, ptr: u64, len: usize, tag: u32, stream: Stream) -> Result<()> {
        self.submit_mem(ptr, len, MemAction::Tag(tag), stream)
    }

    /// Counts the words of `[ptr, ptr+len)` that do not hold `tag` into [`Self::tag_errors`].
    pub fn check_tag(&self, ptr: u64, len: usize, tag: u32, stream: Stream) -> Result<()> {
        self.submit_mem(ptr, len, MemAction::Check(tag), stream)
    }

    /// Writes `tag`, holds the block for `hold`, then counts words that changed.
    pub fn hold_and_check(
        &self,
        ptr: u64,
        len: usize,
        tag: u32,
        hold: Duration,
        stream: Stream,
    ) -> Result<()> {
        self.submit_mem(ptr, len, MemAction::HoldCheck(tag, hold), stream)
    }

    /// Queues a gate on `stream` (resolved for the calling thread, like any call): work queued
    /// on the stream after it waits until the gate is opened ([`StreamGate::open`], or its
    /// drop), and stays in flight until then. Open it before [`Self::synchronize`] (or
    /// anything that synchronises the device), which would wait for it for ever.
    pub fn gate(&self, stream: Stream) -> Result<StreamGate> {
        let sh = self.sh();
        let mut st = sh.lock();
        let idx = st.resolve(stream)?;
        let gate = st.next_gate;
        st.next_gate += 1;
        st.closed_gates.insert(gate);
        st.sync_implicitly(sh, idx);
        let seq = st.streams[idx].bump();
        st.enqueue(sh, idx, Op { seq, delay: Duration::ZERO, kind: OpKind::Gate { gate } });
        Ok(StreamGate { sh: Arc::clone(sh), gate })
    }

    /// Blocks until every stream is idle.
    pub fn synchronize(&self) {
        let sh = self.sh();
        let mut st = sh.lock();
        while st.streams.iter().any(|s| s.completed < s.submitted()) {
            st = sh.wait(st);
        }
    }

    /// Device calls made so far with the handle of a destroyed stream that no new stream had
    /// yet: on CUDA such a call may crash inside the driver. The allocator must make none of
    /// its own accord (only a caller passing a stale handle can cause one).
    pub fn stale_handle_calls(&self) -> u64 {
        self.sh().lock().stale_handle_calls
    }

    /// [`HostDevice::stale_handle_calls`], reset: for a test whose caller passes a stale handle
    /// on purpose.
    pub fn take_stale_handle_calls(&self) -> u64 {
        std::mem::take(&mut self.sh().lock().stale_handle_calls)
    }

    /// Starts capturing `stream` into a graph (like `cuStreamBeginCapture` in the global mode;
    /// the legacy stream cannot be captured). Until [`Self::end_capture`],
    /// [`Device::stream_capturing`] says so, and an event recorded or waited on the stream
    /// (which would become a graph node instead of a fence, and break or corrupt the capture)
    /// is a race-checker violation. CUDA's rules for what other threads may do meanwhile, as
    /// measured on the H200 (`notes/experiments/s23_blocking_capture_probe.py`), are kept too:
    /// while a per-thread stream (a blocking stream) is captured, an event recorded or waited
    /// on the legacy stream, or work queued there, fails with CUDA's code 906 and invalidates
    /// the capture (the legacy stream would wait for the captured one), while
    /// `stream_capturing` of the legacy stream answers true without harm (CUDA's 906 from
    /// `cuStreamIsCapturing`) and `stream_key` refuses it, as `CudaDevice`'s does (which asks
    /// that first, since `cuStreamGetId` of the legacy stream would invalidate the capture too);
    /// a device synchronise through [`Device::synchronize`] during any
    /// capture fails with 900 and invalidates it. Each of these is a violation, and
    /// [`Self::end_capture`] then fails.
    pub fn begin_capture(&self, stream: Stream) -> Result<()> {
        let mut st = self.sh().lock();
        let idx = st.resolve(stream)?;
        if idx == LEGACY || st.streams[idx].capturing {
            return Err(Error::Driver { call: "begin_capture", code: 900 });
        }
        st.streams[idx].capturing = true;
        st.streams[idx].broken = false;
        Ok(())
    }

    /// Ends the capture of `stream` ([`Self::begin_capture`]): fails with CUDA's 901 if it was
    /// invalidated meanwhile.
    pub fn end_capture(&self, stream: Stream) -> Result<()> {
        let mut st = self.sh().lock();
        let idx = st.resolve(stream)?;
        if !std::mem::replace(&mut st.streams[idx].capturing, false) || st.streams[idx].broken {
            return Err(Error::Driver { call: "end_capture", code: 901 });
        }
        Ok(())
    }

    /// Events created and not yet destroyed.
    pub fn live_events(&self) -> usize {
        self.sh().lock().events.iter().filter(|e| !e.destroyed).count()
    }

    /// Race-checker findings so far (empty when every access was ordered).
    pub fn violations(&self) -> Vec<String> {
        self.sh().lock().violations.clone()
    }

    /// Words found changed by [`Self::check_tag`] and [`Self::hold_and_check`].
    pub fn tag_errors(&self) -> u64 {
        self.sh().tag_errors.load(Ordering::Relaxed)
    }

    /// Bytes currently reserved.
    pub fn reserved_bytes(&self) -> usize {
        self.sh().lock().reserved
    }

    fn submit_mem(&self, ptr: u64, len: usize, action: MemAction, stream: Stream) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let sh = self.sh();
        let mut st = sh.lock();
        let idx = st.resolve(stream)?;
        st.use_legacy(idx, "work queued")?;
        let end = ptr + len as u64;
        if !st.covered(ptr, end) {
            st.violations
                .push(format!("stream {idx}: access to [{ptr:#x}, {end:#x}) outside reserved memory"));
            return Ok(());
        }
        let seq = st.submit_checked(sh, idx, ptr, end, "op");
        st.inflight.push(Inflight { stream: idx, seq, start: ptr, end });
        let delay = st.streams[idx].delay(&sh.cfg);
        st.enqueue(sh, idx, Op { seq, delay, kind: OpKind::Mem { start: ptr, end, action } });
        Ok(())
    }
}

/// A gate queued on a stream by [`HostDevice::gate`]: the stream's later work waits until it
/// is opened. Dropping it opens it.
pub struct StreamGate {
    sh: Arc<Shared>,
    gate: u64,
}

impl StreamGate {
    /// Lets the stream's work behind the gate run.
    pub fn open(self) {}
}

impl Drop for StreamGate {
    fn drop(&mut self) {
        self.sh.lock().closed_gates.remove(&self.gate);
        self.sh.cv.notify_all();
    }
}

impl SimStream {
    fn submitted(&self) -> u64 {
        self.clock[self.own]
    }

    fn bump(&mut self) -> u64 {
        let own = self.own;
        self.clock[own] += 1;
        self.clock[own]
    }

    fn delay(&mut self, cfg: &HostConfig) -> Duration {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let span = cfg.max_delay.saturating_sub(cfg.min_delay).as_nanos() as u64;
        let extra = if span == 0 { 0 } else { self.rng % (span + 1) };
        cfg.min_delay + Duration::from_nanos(extra)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a change of the device's state. While a stream is left with queued work and no
    /// worker (its spawn failed: [`State::enqueue`]), one is tried again every 20 ms.
    fn wait<'a>(self: &Arc<Self>, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        if !g.orphaned {
            return self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        let (mut g, _) =
            self.cv.wait_timeout(g, Duration::from_millis(20)).unwrap_or_else(|p| p.into_inner());
        g.orphaned = false;
        for idx in 0..g.streams.len() {
            if g.ensure_worker(self, idx).is_err() {
                g.orphaned = true;
            }
        }
        g
    }
}

impl State {
    fn new_stream(&mut self, seed: u64) -> usize {
        let idx = self.streams.len();
        for s in &mut self.streams {
            s.clock.push(0);
        }
        for e in &mut self.events {
            e.clock.push(0);
        }
        let key = self.next_key;
        self.next_key += 1;
        self.streams.push(SimStream {
            own: idx,
            key,
            clock: vec![0; idx + 1],
            completed: 0,
            queue: VecDeque::new(),
            worker: false,
            rng: seed | 1,
            per_thread: false,
            capturing: false,
            broken: false,
        });
        idx
    }

    /// Reserves `bytes` of host memory aligned to `align` as a device region, or `None` if
    /// that would exceed `capacity` (the device is full) or the host refuses.
    fn reserve(&mut self, bytes: usize, align: usize, capacity: usize) -> Option<u64> {
        if bytes == 0 || self.reserved.saturating_add(bytes) > capacity {
            return None;
        }
        let layout = std::alloc::Layout::from_size_align(bytes, align).ok()?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return None;
        }
        self.reserved += bytes;
        self.regions.insert(p as u64, Region { len: bytes, layout, freeing: false });
        Some(p as u64)
    }

    /// Takes the sequence number of a new op on stream `idx` touching `[ptr, end)`, after
    /// implicit synchronisation, and records a violation for every unfinished op of another
    /// stream on overlapping bytes that is not ordered before it (the race checker's rule).
    fn submit_checked(&mut self, sh: &Arc<Shared>, idx: usize, ptr: u64, end: u64, what: &str) -> u64 {
        self.sync_implicitly(sh, idx);
        let seq = self.streams[idx].bump();
        let clock = &self.streams[idx].clock;
        let races: Vec<String> = self
            .inflight
            .iter()
            .filter(|x| x.stream != idx && x.start < end && ptr < x.end && clock[x.stream] < x.seq)
            .map(|x| {
                format!(
                    "race: stream {idx} {what} {seq} on [{ptr:#x}, {end:#x}) overlaps unfinished op {} of stream {} on [{:#x}, {:#x})",
                    x.seq, x.stream, x.start, x.end
                )
            })
            .collect();
        self.violations.extend(races);
        seq
    }

    /// Orders the next op on stream `idx` after the work CUDA's implicit synchronisation puts
    /// before it (see the module comment): joins the clocks and queues a wait if any of that
    /// work is unfinished.
    fn sync_implicitly(&mut self, sh: &Arc<Shared>, idx: usize) {
        let before: Vec<usize> = if idx == LEGACY {
            (0..self.streams.len()).filter(|&j| self.streams[j].per_thread).collect()
        } else if self.streams[idx].per_thread {
            vec![LEGACY]
        } else {
            return;
        };
        let mut deps = Vec::new();
        for j in before {
            let (submitted, completed) = (self.streams[j].submitted(), self.streams[j].completed);
            let theirs = self.streams[j].clock.clone();
            for (mine, t) in self.streams[idx].clock.iter_mut().zip(theirs) {
                *mine = (*mine).max(t);
            }
            if completed < submitted {
                deps.push((j, submitted));
            }
        }
        if !deps.is_empty() {
            let seq = self.streams[idx].bump();
            self.enqueue(sh, idx, Op { seq, delay: Duration::ZERO, kind: OpKind::After { deps } });
        }
    }

    /// True while a per-thread stream (a blocking stream) is being captured: the legacy stream
    /// may not be used (see [`HostDevice::begin_capture`]).
    fn legacy_implicated(&self) -> bool {
        self.streams.iter().any(|s| s.per_thread && s.capturing)
    }

    /// `what`, made while captures run that it invalidates (`blocking_only`: those of
    /// per-thread streams; otherwise all): a violation, the captures broken, CUDA's `code`.
    fn invalidate_captures(&mut self, what: &str, blocking_only: bool, code: u32) -> Result<()> {
        let mut hit = false;
        for s in self.streams.iter_mut().filter(|s| s.capturing && (s.per_thread || !blocking_only)) {
            s.broken = true;
            hit = true;
        }
        if !hit {
            return Ok(());
        }
        self.violations.push(format!("{what} during a capture it invalidates"));
        Err(Error::Driver { call: "invalidated a capture", code })
    }

    /// The legacy stream used by `what` (a record, a wait, work queued): refused, breaking the
    /// capture, while a per-thread stream is captured.
    fn use_legacy(&mut self, idx: usize, what: &str) -> Result<()> {
        if idx == LEGACY && self.legacy_implicated() {
            return self.invalidate_captures(&format!("the legacy stream used ({what})"), true, 906);
        }
        Ok(())
    }

    /// The stream a handle names for the calling thread.
    fn resolve(&mut self, stream: Stream) -> Result<usize> {
        if stream.is_legacy() {
            return Ok(LEGACY);
        }
        if stream.is_per_thread() {
            let tid = std::thread::current().id();
            if let Some(&i) = self.ptds.get(&tid) {
                return Ok(i);
            }
            let seed = 0x5851_f42d_4c95_7f2d ^ self.next_key.wrapping_mul(0x9e37_79b9);
            let i = self.new_stream(seed);
            self.streams[i].per_thread = true;
            self.ptds.insert(tid, i);
            return Ok(i);
        }
        if let Some(&i) = self.handles.get(&stream.as_raw()) {
            return Ok(i);
        }
        if self.free_handles.contains(&stream.as_raw()) {
            // A destroyed stream's handle, not yet given to a new stream: on CUDA the driver
            // may read freed memory through it (and crash). Counted for the tests.
            self.stale_handle_calls += 1;
        }
        Err(Error::Driver { call: "stream handle", code: 400 })
    }

    fn covered(&self, start: u64, end: u64) -> bool {
        match self.regions.range(..=start).next_back() {
            Some((&base, r)) => !r.freeing && end <= base + r.len as u64,
            None => false,
        }
    }

    fn enqueue(&mut self, sh: &Arc<Shared>, idx: usize, op: Op) {
        self.streams[idx].queue.push_back(op);
        let spawned = self.ensure_worker(sh, idx);
        self.orphaned |= spawned.is_err();
        sh.cv.notify_all();
        if let Err(e) = spawned {
            // The op stays queued, and the stream without a worker: the next enqueue, and every
            // wait for the device (`Shared::wait`), try again, so queued work is never left
            // with none to run it (a replay of 1,024 threads under a memory cap hung in the
            // allocator's final synchronise, helper-31).
            panic!("spawning a simulated stream worker: {e}");
        }
    }

    /// Starts a worker for stream `idx` if it has queued work and none.
    fn ensure_worker(&mut self, sh: &Arc<Shared>, idx: usize) -> std::io::Result<()> {
        let s = &mut self.streams[idx];
        if s.worker || s.queue.is_empty() {
            return Ok(());
        }
        let sh = Arc::clone(sh);
        std::thread::Builder::new()
            .name(format!("cuarena-sim-stream-{idx}"))
            .spawn(move || worker(sh, idx))?;
        s.worker = true;
        Ok(())
    }

    /// The slot of `event` for `call`: an event never created is refused
    /// (`CUDA_ERROR_INVALID_HANDLE`), and so is one destroyed, which is also a violation: the
    /// allocator used an event it had given back.
    fn live_event(&mut self, event: u64, call: &'static str) -> Result<usize> {
        let e = event as usize;
        if e >= self.events.len() {
            return Err(Error::Driver { call, code: 400 });
        }
        if self.events[e].destroyed {
            self.violations.push(format!("{call} of event {e} after it was destroyed"));
            return Err(Error::Driver { call, code: 400 });
        }
        Ok(e)
    }

    fn event_done(&self, e: usize) -> bool {
        let ev = &self.events[e];
        ev.is_done(ev.recorded)
    }
}

/// Runs one stream's queue in order. Exits after a short idle spell; `enqueue` starts a new one.
fn worker(sh: Arc<Shared>, idx: usize) {
    let mut st = sh.lock();
    loop {
        let op = match st.streams[idx].queue.pop_front() {
            Some(op) => op,
            None => {
                if st.shutdown {
                    st.streams[idx].worker = false;
                    return;
                }
                let (g, timeout) =
                    sh.cv.wait_timeout(st, Duration::from_millis(20)).unwrap_or_else(|p| p.into_inner());
                st = g;
                if timeout.timed_out() && st.streams[idx].queue.is_empty() {
                    st.streams[idx].worker = false;
                    return;
                }
                continue;
            }
        };
        match op.kind {
            OpKind::Wait { event, generation } => {
                while !st.events[event].is_done(generation) {
                    st = sh.wait(st);
                }
            }
            OpKind::After { deps } => {
                while deps.iter().any(|&(j, seq)| st.streams[j].completed < seq) {
                    st = sh.wait(st);
                }
            }
            OpKind::Record { event, generation } => {
                st.events[event].completed.insert(generation);
            }
            OpKind::Gate { gate } => {
                while st.closed_gates.contains(&gate) {
                    st = sh.wait(st);
                }
            }
            OpKind::Free { start, end } => {
                // Work ordered before the free has completed; unordered work (a race, reported
                // when the free was submitted) is waited for, so the memory outlives it.
                while st.inflight.iter().any(|x| x.start < end && start < x.end) {
                    st = sh.wait(st);
                }
                let r = st.regions.remove(&start).expect("a region being freed stays until its free runs");
                st.reserved -= r.len;
                // SAFETY: the region came from `alloc` with this layout, no in-flight operation
                // overlaps it, and no operation submitted after the free can touch it
                // (`covered` refuses regions being freed).
                unsafe { std::alloc::dealloc(start as *mut u8, r.layout) };
            }
            OpKind::Mem { start, end, action } => {
                drop(st);
                if !op.delay.is_zero() {
                    std::thread::sleep(op.delay);
                }
                // SAFETY: `submit_mem` checked that [start, end) lies in a reserved region, and
                // `release` waits until no in-flight operation overlaps the region it frees, so
                // the memory is live for this whole operation. All accesses are atomic, so
                // even racing operations (which the checker reports) are not undefined
                // behaviour.
                let bad = unsafe { run_mem(start, end, action) };
                if bad > 0 {
                    sh.tag_errors.fetch_add(bad, Ordering::Relaxed);
                }
                st = sh.lock();
                st.inflight.retain(|x| !(x.stream == idx && x.seq == op.seq));
            }
        }
        st.streams[idx].completed = op.seq;
        sh.cv.notify_all();
    }
}

/// Performs a memory operation and returns the number of words found changed.
///
/// # Safety
/// `[start, end)` must be live host memory for the duration of the call, and `start` must be
/// 4-byte aligned.
unsafe fn run_mem(start: u64, end: u64, action: MemAction) -> u64 {
    let len = (end - start) as usize;
    let words = || {
        // SAFETY: the caller guarantees the range is live and aligned; AtomicU32 has the
        // size and alignment of u32.
        unsafe { std::slice::from_raw_parts(start as *const AtomicU32, len / 4) }
    };
    let count_bad = |tag: u32| words().iter().filter(|w| w.load(Ordering::Relaxed) != tag).count() as u64;
    match action {
        MemAction::Fill(v) => {
            // SAFETY: as above; AtomicU8 has the layout of u8.
            let bytes = unsafe { std::slice::from_raw_parts(start as *const AtomicU8, len) };
            bytes.iter().for_each(|b| b.store(v, Ordering::Relaxed));
            0
        }
        MemAction::Tag(tag) => {
            words().iter().for_each(|w| w.store(tag, Ordering::Relaxed));
            0
        }
        MemAction::Check(tag) => count_bad(tag),
        MemAction::HoldCheck(tag, hold) => {
            words().iter().for_each(|w| w.store(tag, Ordering::Relaxed));
            std::thread::sleep(hold);
            count_bad(tag)
        }
    }
}

impl Device for HostDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Host
    }

    fn ordinal(&self) -> i32 {
        0
    }

    /// Each simulated device is a device of its own (its clones share it), apart from every
    /// CUDA ordinal: the top bit is set.
    fn device_id(&self) -> u64 {
        self.sh().id | 1 << 63
    }

    fn total_memory(&self) -> Result<usize> {
        Ok(self.sh().cfg.capacity)
    }

    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        let sh = self.sh();
        let mut st = sh.lock();
        Ok(st.reserve(bytes, sh.cfg.alignment, sh.cfg.capacity))
    }

    fn alloc_async(&self, bytes: usize, stream: Stream) -> Result<Option<u64>> {
        let sh = self.sh();
        let mut st = sh.lock();
        st.resolve(stream)?;
        Ok(st.reserve(bytes, ASYNC_ALIGNMENT, sh.cfg.capacity))
    }

    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> Result<()> {
        let sh = self.sh();
        let mut st = sh.lock();
        let idx = st.resolve(stream)?;
        match st.regions.get(&ptr) {
            Some(r) if r.len == bytes && !r.freeing => {}
            _ => return Err(Error::Driver { call: "free_async", code: 1 }),
        }
        let end = ptr + bytes as u64;
        let seq = st.submit_checked(sh, idx, ptr, end, "free_async");
        st.regions.get_mut(&ptr).expect("checked above").freeing = true;
        st.enqueue(sh, idx, Op { seq, delay: Duration::ZERO, kind: OpKind::Free { start: ptr, end } });
        Ok(())
    }

    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        let sh = self.sh();
        let mut st = sh.lock();
        match st.regions.get(&ptr) {
            Some(r) if r.len == bytes && !r.freeing => {}
            _ => {
                return Err(Error::Driver { call: "release", code: 1 });
            }
        }
        let end = ptr + bytes as u64;
        let busy = |st: &State| st.inflight.iter().any(|x| x.start < end && ptr < x.end);
        if busy(&st) {
            st.violations
                .push(format!("release of [{ptr:#x}, {end:#x}) while work on it is still in flight"));
            while busy(&st) {
                st = sh.wait(st);
            }
        }
        let r = st.regions.remove(&ptr).expect("checked above");
        st.reserved -= bytes;
        // SAFETY: `ptr` came from `alloc` with this layout and no operation touches it now.
        unsafe { std::alloc::dealloc(ptr as *mut u8, r.layout) };
        Ok(())
    }

    fn create_event(&self) -> Result<Event> {
        let mut st = self.sh().lock();
        // Slots are never reused: a destroyed event's last record may still be queued, and a
        // new event must not be completed by it.
        let n = st.streams.len();
        st.events.push(SimEvent {
            recorded: 0,
            completed: Default::default(),
            clock: vec![0; n],
            destroyed: false,
        });
        Ok(Event((st.events.len() - 1) as u64))
    }

    fn destroy_event(&self, event: Event) {
        let mut st = self.sh().lock();
        // The slot stays (never reused, see `create_event`); work already queued that waits on
        // its last record still completes, as CUDA releases a destroyed event's resources once
        // the device is done with it.
        if st.live_event(event.0, "destroy_event").is_err() {
            return; // a violation if destroyed before; never created: nothing to do
        }
        st.events[event.0 as usize].destroyed = true;
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        let sh = self.sh();
        let mut st = sh.lock();
        let idx = st.resolve(stream)?;
        let e = st.live_event(event.0, "record_event")?;
        st.use_legacy(idx, "an event recorded")?;
        if st.streams[idx].capturing {
            st.violations
                .push(format!("event {e} recorded on a capturing stream ({stream:?}): a graph node"));
        }
        st.sync_implicitly(sh, idx);
        let seq = st.streams[idx].bump();
        let clock = st.streams[idx].clock.clone();
        let ev = &mut st.events[e];
        ev.recorded += 1;
        let generation = ev.recorded;
        ev.clock = clock;
        st.enqueue(sh, idx, Op { seq, delay: Duration::ZERO, kind: OpKind::Record { event: e, generation } });
        Ok(())
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        let mut st = self.sh().lock();
        let e = st.live_event(event.0, "query_event")?;
        Ok(st.event_done(e))
    }

    fn sync_event(&self, event: Event) -> Result<()> {
        let sh = self.sh();
        let mut st = sh.lock();
        let e = st.live_event(event.0, "sync_event")?;
        while !st.event_done(e) {
            st = sh.wait(st);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.sh().lock().invalidate_captures("a device synchronise", false, 900)?;
        HostDevice::synchronize(self);
        Ok(())
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        let sh = self.sh();
        let mut st = sh.lock();
        let idx = st.resolve(stream)?;
        let e = st.live_event(event.0, "stream_wait_event")?;
        st.use_legacy(idx, "an event waited on")?;
        if st.streams[idx].capturing {
            st.violations
                .push(format!("a wait on event {e} on a capturing stream ({stream:?}): a graph node"));
        }
        st.sync_implicitly(sh, idx);
        let ev_clock = st.events[e].clock.clone();
        let generation = st.events[e].recorded;
        let s = &mut st.streams[idx];
        for (mine, theirs) in s.clock.iter_mut().zip(ev_clock) {
            *mine = (*mine).max(theirs);
        }
        let seq = s.bump();
        st.enqueue(sh, idx, Op { seq, delay: Duration::ZERO, kind: OpKind::Wait { event: e, generation } });
        Ok(())
    }

    /// Refused on a stream being captured, and on the legacy stream while a per-thread stream
    /// is, as `CudaDevice` refuses them (its `cuStreamGetId` would invalidate the capture, so
    /// it asks `cuStreamIsCapturing` first).
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        let mut st = self.sh().lock();
        let idx = st.resolve(stream)?;
        if st.streams[idx].capturing || (idx == LEGACY && st.legacy_implicated()) {
            return Err(Error::StreamCapturing { stream: stream.as_raw() });
        }
        Ok(StreamKey((self.sh().id << 32) | st.streams[idx].key))
    }

    /// Of the legacy stream: true while it may not be used because a per-thread stream is
    /// captured (CUDA's `cuStreamIsCapturing` fails with 906 then, harmlessly).
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        let mut st = self.sh().lock();
        let idx = st.resolve(stream)?;
        Ok(st.streams[idx].capturing || (idx == LEGACY && st.legacy_implicated()))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for (ptr, r) in std::mem::take(&mut st.regions) {
            // SAFETY: every worker holds an `Arc<Shared>`, so none runs now; the region came
            // from `alloc` with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, r.layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(max_us: u64) -> HostDevice {
        HostDevice::new(HostConfig {
            capacity: 64 << 20,
            min_delay: Duration::from_micros(max_us / 2),
            max_delay: Duration::from_micros(max_us),
            ..HostConfig::default()
        })
    }

    /// The first word of `[p, p+4)`, read as the device's work writes it.
    fn word(p: u64) -> u32 {
        // SAFETY: `p` lies in a reserved region that outlives the call; the device's work
        // writes it atomically.
        unsafe { (*(p as *const AtomicU32)).load(Ordering::Relaxed) }
    }

    #[test]
    fn unordered_overlapping_work_is_a_violation() {
        let d = dev(2000);
        let p = d.reserve(1 << 20).unwrap().unwrap();
        let a = d.create_stream();
        let b = d.create_stream();
        d.write_tag(p, 4096, 0, a).unwrap();
        d.synchronize();
        // A long hold, so that a busy machine (parallel tests on two cores) cannot finish it
        // before the unordered write runs. The write is submitted once `a` has written its tag
        // (a fixed sleep here could pass before `a`'s worker even started).
        d.hold_and_check(p, 4096, 1, Duration::from_millis(200), a).unwrap();
        while word(p) != 1 {
            std::thread::yield_now();
        }
        d.write_tag(p, 4096, 2, b).unwrap();
        d.synchronize();
        assert!(!d.violations().is_empty());
        assert!(d.tag_errors() > 0);
    }

    #[test]
    fn event_wait_orders_work() {
        let d = dev(2000);
        let p = d.reserve(1 << 20).unwrap().unwrap();
        let a = d.create_stream();
        let b = d.create_stream();
        let e = d.create_event().unwrap();
        // The gate keeps the work in flight until the query (a short hold only made it likely).
        let gate = d.gate(a).unwrap();
        d.hold_and_check(p, 4096, 1, Duration::from_millis(5), a).unwrap();
        d.record_event(e, a).unwrap();
        assert!(!d.query_event(e).unwrap());
        gate.open();
        d.stream_wait_event(b, e).unwrap();
        d.write_tag(p, 4096, 2, b).unwrap();
        d.check_tag(p, 4096, 2, b).unwrap();
        d.synchronize();
        assert!(d.query_event(e).unwrap());
        assert_eq!(d.violations(), Vec::<String>::new());
        assert_eq!(d.tag_errors(), 0);
    }

    #[test]
    fn a_wait_is_for_the_record_it_saw_not_a_later_one() {
        let d = dev(0);
        let p = d.reserve(1 << 20).unwrap().unwrap();
        let (slow, fast, waiter) = (d.create_stream(), d.create_stream(), d.create_stream());
        let e = d.create_event().unwrap();
        d.hold_and_check(p, 4096, 1, Duration::from_millis(30), slow).unwrap();
        d.record_event(e, slow).unwrap();
        d.stream_wait_event(waiter, e).unwrap();
        d.record_event(e, fast).unwrap(); // completes at once, long before the first record
        d.write_tag(p, 4096, 2, waiter).unwrap();
        d.synchronize();
        assert_eq!(d.tag_errors(), 0, "the waiter ran before the record it waited for");
        assert!(d.violations().is_empty());
    }

    #[test]
    fn completed_work_needs_no_wait() {
        let d = dev(100);
        let p = d.reserve(1 << 20).unwrap().unwrap();
        let a = d.create_stream();
        let b = d.create_stream();
        let e = d.create_event().unwrap();
        d.write_tag(p, 512, 7, a).unwrap();
        d.record_event(e, a).unwrap();
        d.sync_event(e).unwrap();
        d.write_tag(p, 512, 8, b).unwrap();
        d.synchronize();
        assert!(d.violations().is_empty());
    }

    #[test]
    fn legacy_work_follows_per_thread_work_and_the_reverse() {
        let d = dev(0);
        let p = d.reserve(1 << 20).unwrap().unwrap();
        // Per-thread work, then legacy work on the same bytes: ordered, no wait needed.
        d.hold_and_check(p, 4096, 1, Duration::from_millis(20), Stream::PER_THREAD).unwrap();
        d.write_tag(p, 4096, 2, Stream::LEGACY).unwrap();
        // Legacy work, then another thread's per-thread work: ordered too.
        d.hold_and_check(p + 4096, 4096, 3, Duration::from_millis(20), Stream::LEGACY).unwrap();
        let d2 = d.clone();
        std::thread::spawn(move || d2.write_tag(p + 4096, 4096, 4, Stream::PER_THREAD).unwrap())
            .join()
            .unwrap();
        // A user stream is non-blocking: unordered. The legacy work is held in flight by a gate
        // until the user stream's write is submitted (a sleep made that only likely).
        let u = d.create_stream();
        let gate = d.gate(Stream::LEGACY).unwrap();
        d.hold_and_check(p + 8192, 4096, 5, Duration::from_millis(20), Stream::LEGACY).unwrap();
        d.write_tag(p + 8192, 4096, 6, u).unwrap();
        gate.open();
        d.synchronize();
        let v = d.violations();
        assert_eq!(v.len(), 1, "only the user stream's write races: {v:?}");
        assert!(v[0].contains(&format!("{:#x}", p + 8192)), "{v:?}");
    }

    #[test]
    fn per_thread_streams_differ_and_legacy_is_shared() {
        let d = dev(10);
        let k0 = d.stream_key(Stream::PER_THREAD).unwrap();
        let l0 = d.stream_key(Stream::LEGACY).unwrap();
        assert_eq!(l0, d.stream_key(Stream::NULL).unwrap());
        let d2 = d.clone();
        let (k1, l1) = std::thread::spawn(move || {
            (d2.stream_key(Stream::PER_THREAD).unwrap(), d2.stream_key(Stream::NULL).unwrap())
        })
        .join()
        .unwrap();
        assert_ne!(k0, k1);
        assert_eq!(l0, l1);
        assert_eq!(k0, d.stream_key(Stream::PER_THREAD).unwrap());
    }

    #[test]
    fn destroyed_handles_are_reused_with_new_keys() {
        let d = dev(10);
        let s = d.create_stream();
        let k = d.stream_key(s).unwrap();
        d.destroy_stream(s).unwrap();
        assert!(d.stream_key(s).is_err());
        let t = d.create_stream();
        assert_eq!(s, t, "the handle is reused");
        assert_ne!(k, d.stream_key(t).unwrap(), "but the identity is new");
    }

    #[test]
    fn out_of_bounds_and_busy_release_are_violations() {
        let d = dev(1000);
        let p = d.reserve(1 << 20).unwrap().unwrap();
        d.write_tag(p + (1 << 20) - 256, 512, 1, Stream::LEGACY).unwrap();
        assert_eq!(d.violations().len(), 1);
        // The gate keeps the work in flight until the release has seen it; the release waits
        // for the work, so it runs on another thread while this one opens the gate.
        let gate = d.gate(Stream::LEGACY).unwrap();
        d.hold_and_check(p, 256, 1, Duration::from_millis(5), Stream::LEGACY).unwrap();
        let d2 = d.clone();
        // SAFETY: the region came from reserve; the simulated release waits for the work.
        let release = std::thread::spawn(move || unsafe { d2.release(p, 1 << 20).unwrap() });
        while d.violations().len() < 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
        gate.open();
        release.join().unwrap();
        assert_eq!(d.violations().len(), 2);
        assert_eq!(d.reserve(128 << 20).unwrap(), None, "over capacity");
    }

    #[test]
    fn a_stream_ordered_free_runs_after_the_work_before_it() {
        let d = dev(2000);
        let (a, b) = (d.create_stream(), d.create_stream());
        let p = d.alloc_async(4096, a).unwrap().unwrap();
        assert_eq!(p % 256, 0);
        assert_eq!(d.reserved_bytes(), 4096);
        let gate = d.gate(a).unwrap(); // keeps the work in flight past the check below
        d.hold_and_check(p, 4096, 3, Duration::from_millis(20), a).unwrap();
        let e = d.create_event().unwrap();
        d.record_event(e, a).unwrap();
        d.stream_wait_event(b, e).unwrap();
        // SAFETY: from alloc_async, freed once, its use on `a` ordered before `b` by the wait.
        unsafe { d.free_async(p, 4096, b).unwrap() };
        assert_eq!(d.reserved_bytes(), 4096, "released only when the free runs");
        gate.open();
        d.synchronize();
        assert_eq!(d.reserved_bytes(), 0);
        assert_eq!(d.violations(), Vec::<String>::new());
        assert_eq!(d.tag_errors(), 0);
    }

    #[test]
    fn an_unordered_stream_ordered_free_is_a_violation() {
        let d = dev(0);
        let (a, b) = (d.create_stream(), d.create_stream());
        let p = d.alloc_async(4096, a).unwrap().unwrap();
        let gate = d.gate(a).unwrap(); // keeps the work in flight while the free is queued
        d.hold_and_check(p, 4096, 3, Duration::from_millis(30), a).unwrap();
        // SAFETY: deliberately unordered; the simulated release waits for the work all the same.
        unsafe { d.free_async(p, 4096, b).unwrap() };
        gate.open();
        d.synchronize();
        assert_eq!(d.violations().len(), 1, "{:?}", d.violations());
        assert!(d.violations()[0].contains("free_async"), "{:?}", d.violations());
        assert_eq!(d.tag_errors(), 0, "the memory outlived the work");
        assert_eq!(d.reserved_bytes(), 0);
    }

    #[test]
    fn work_submitted_after_a_stream_ordered_free_is_a_violation() {
        let d = dev(0);
        let a = d.create_stream();
        let p = d.alloc_async(4096, a).unwrap().unwrap();
        // SAFETY: from alloc_async, freed once, unused.
        unsafe { d.free_async(p, 4096, a).unwrap() };
        d.write_tag(p, 256, 1, a).unwrap();
        d.synchronize();
        assert_eq!(d.violations().len(), 1);
        assert!(d.violations()[0].contains("outside reserved memory"), "{:?}", d.violations());
    }

    #[test]
    fn bad_stream_ordered_frees_are_errors_and_free_nothing() {
        let d = dev(0);
        let s = d.create_stream();
        let p = d.alloc_async(1000, Stream::LEGACY).unwrap().unwrap();
        d.destroy_stream(s).unwrap();
        assert!(d.alloc_async(1000, s).is_err(), "a destroyed stream");
        // SAFETY: each call is refused before anything is freed.
        unsafe {
            assert!(d.free_async(p, 1000, s).is_err(), "a destroyed stream");
            assert!(d.free_async(p, 999, Stream::LEGACY).is_err(), "the wrong size");
            assert!(d.free_async(p + 256, 744, Stream::LEGACY).is_err(), "an interior pointer");
        }
        assert_eq!(d.reserved_bytes(), 1000);
        // SAFETY: from alloc_async, freed once.
        unsafe { d.free_async(p, 1000, Stream::PER_THREAD).unwrap() };
        // SAFETY: refused: the region is already being freed.
        assert!(unsafe { d.free_async(p, 1000, Stream::LEGACY) }.is_err(), "a double free");
        d.synchronize();
        assert_eq!(d.reserved_bytes(), 0);
        assert_eq!(d.alloc_async(128 << 20, Stream::LEGACY).unwrap(), None, "over capacity");
        assert!(d.violations().is_empty(), "{:?}", d.violations());
    }
}
