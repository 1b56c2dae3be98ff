//! A stress workload shared by the host tests, the GPU tests and the demo.
//!
//! Threads allocate blocks of random sizes on their per-thread stream or on user streams, tag
//! every block with stream work that **holds** it for a while (writes a tag, waits, re-reads),
//! and free blocks either themselves or by handing them to the next thread, which makes its own
//! stream wait on the sender's event, holds the block again, and frees it on its own stream.
//! A block reused before its fence overwrites a tag under a hold: the tag check counts it, and
//! on the simulated device the race checker reports it too.
//!
//! While running, a shared map of live blocks checks that no two live blocks overlap and that
//! every block is 256-byte aligned.
//!
//! Also here: [`torture`], the fence torture (many threads, every kind of free, three stream
//! modes, one or more devices); [`LightDevice`], a device for runs with very many threads;
//! [`gpu_or_skip`] and [`gpus_or_skip`], which decide whether a GPU test runs; and
//! [`assert_all_returned`].

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cuarena::{
    Allocator, CudaDevice, Device, DeviceAddr, DeviceKind, Error, Event, Result, Stream, StreamKey,
};

use crate::cuda_kernels::CudaKernels;
use crate::host::HostDevice;

/// Stream work the workload needs from a device.
pub trait TagOps: Send + Sync {
    /// The device, for events.
    fn device(&self) -> &dyn Device;
    /// Writes `tag` over `[ptr, ptr+len)`, holds it for `hold`, then counts words that changed.
    fn hold_check(&self, ptr: u64, len: usize, tag: u32, hold: Duration, stream: Stream) -> Result<()>;
    /// A new user stream.
    fn create_stream(&self) -> Result<Stream>;
    /// Destroys a user stream.
    fn destroy_stream(&self, s: Stream) -> Result<()>;
    /// Waits for all work and returns the tag mismatches counted so far.
    fn finish(&self) -> Result<u64>;
    /// Race-checker findings (the simulated device only).
    fn violations(&self) -> Vec<String>;
}

impl TagOps for HostDevice {
    fn device(&self) -> &dyn Device {
        self
    }
    fn hold_check(&self, ptr: u64, len: usize, tag: u32, hold: Duration, stream: Stream) -> Result<()> {
        self.hold_and_check(ptr, len, tag, hold, stream)
    }
    fn create_stream(&self) -> Result<Stream> {
        Ok(HostDevice::create_stream(self))
    }
    fn destroy_stream(&self, s: Stream) -> Result<()> {
        HostDevice::destroy_stream(self, s)
    }
    fn finish(&self) -> Result<u64> {
        self.synchronize();
        Ok(self.tag_errors())
    }
    fn violations(&self) -> Vec<String> {
        HostDevice::violations(self)
    }
}

/// [`TagOps`] on a GPU.
pub struct GpuOps {
    pub kernels: CudaKernels,
    dev: Arc<CudaDevice>,
    errors: Mutex<u64>,
}

impl GpuOps {
    pub fn new(dev: Arc<CudaDevice>) -> Result<GpuOps> {
        Ok(GpuOps { kernels: CudaKernels::load(Arc::clone(&dev))?, dev, errors: Mutex::new(0) })
    }
}

impl TagOps for GpuOps {
    fn device(&self) -> &dyn Device {
        &*self.dev
    }
    fn hold_check(&self, ptr: u64, len: usize, tag: u32, hold: Duration, stream: Stream) -> Result<()> {
        self.kernels.tag_hold_check(ptr, len, tag, hold.as_nanos() as u64, stream)
    }
    fn create_stream(&self) -> Result<Stream> {
        self.kernels.create_stream()
    }
    fn destroy_stream(&self, s: Stream) -> Result<()> {
        self.kernels.destroy_stream(s)
    }
    fn finish(&self) -> Result<u64> {
        let (e, _) = self.kernels.take_counters()?;
        let mut total = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *total += e;
        Ok(*total)
    }
    fn violations(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Parameters of a run.
#[derive(Clone, Debug)]
pub struct StressParams {
    pub threads: usize,
    pub steps: usize,
    pub slots: usize,
    pub min_size: usize,
    pub max_size: usize,
    /// Percent of allocations made on a user stream instead of the per-thread stream.
    pub user_stream_pct: u32,
    /// Percent of frees handed to the next thread.
    pub handoff_pct: u32,
    /// Percent of a thread's own frees of per-thread-stream blocks made on a user stream
    /// (after making that stream wait for the per-thread stream).
    pub cross_stream_pct: u32,
    /// Bytes of each block the stream work tags (from its start).
    pub tag_bytes: usize,
    pub hold: Duration,
    pub seed: u64,
}

impl Default for StressParams {
    fn default() -> Self {
        StressParams {
            threads: 4,
            steps: 1000,
            slots: 32,
            min_size: 1,
            max_size: 4 << 20,
            user_stream_pct: 20,
            handoff_pct: 40,
            cross_stream_pct: 20,
            tag_bytes: 16 << 10,
            hold: Duration::from_micros(100),
            seed: 1,
        }
    }
}

/// What a run found.
#[derive(Debug, Default)]
pub struct StressReport {
    /// Tag words found overwritten (reuse before fence).
    pub tag_errors: u64,
    /// Race-checker findings.
    pub violations: Vec<String>,
    /// Overlapping live blocks or misaligned blocks seen.
    pub layout_errors: Vec<String>,
    /// Blocks allocated.
    pub allocations: u64,
    /// Blocks handed to another thread and freed there.
    pub handoffs: u64,
}

struct Block {
    ptr: DeviceAddr,
    size: usize,
    tag: u32,
    stream: Stream,
}

struct Live(Mutex<BTreeMap<u64, u64>>);

impl Live {
    fn insert(&self, ptr: u64, size: usize, errors: &Mutex<Vec<String>>) {
        let end = ptr + size as u64;
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut bad = Vec::new();
        if !ptr.is_multiple_of(256) {
            bad.push(format!("block {ptr:#x} is not 256-byte aligned"));
        }
        if let Some((&s, &e)) = m.range(..end).next_back()
            && e > ptr
        {
            bad.push(format!("block [{ptr:#x}, {end:#x}) overlaps live [{s:#x}, {e:#x})"));
        }
        m.insert(ptr, end);
        drop(m);
        if !bad.is_empty() {
            errors.lock().unwrap_or_else(|p| p.into_inner()).extend(bad);
        }
    }

    fn remove(&self, ptr: u64) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&ptr);
    }
}

fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs the workload. Worker threads exit at the end, so their arenas go back to the pool.
pub fn stress(ops: Arc<dyn TagOps>, alloc: &Allocator, p: &StressParams) -> Result<StressReport> {
    let live = Arc::new(Live(Mutex::new(BTreeMap::new())));
    let layout = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(Barrier::new(p.threads));
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..p.threads).map(|_| mpsc::channel::<(Block, Event)>()).unzip();
    let mut handles = Vec::new();
    for (t, rx) in rxs.into_iter().enumerate() {
        let tx = txs[(t + 1) % p.threads].clone();
        let (ops, alloc, p, live, layout, barrier) = (
            Arc::clone(&ops),
            alloc.clone(),
            p.clone(),
            Arc::clone(&live),
            Arc::clone(&layout),
            Arc::clone(&barrier),
        );
        handles.push(std::thread::spawn(move || -> Result<(u64, u64)> {
            let dev = ops.device();
            let mut x = p.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(t as u64 * 7919) | 1;
            let streams = [ops.create_stream()?, ops.create_stream()?];
            let mut slots: Vec<Option<Block>> = (0..p.slots).map(|_| None).collect();
            let (mut allocs, mut handoffs) = (0u64, 0u64);
            let tag_len = |b: &Block| b.size.min(p.tag_bytes) & !3;
            let receive = |blk: Block, ev: Event| -> Result<()> {
                dev.stream_wait_event(Stream::PER_THREAD, ev)?;
                dev.destroy_event(ev);
                ops.hold_check(blk.ptr.0, tag_len(&blk), blk.tag, p.hold, Stream::PER_THREAD)?;
                live.remove(blk.ptr.0);
                alloc.deallocate(blk.ptr, blk.size, Stream::PER_THREAD)
            };
            let (lo, hi) = ((p.min_size as f64).ln(), (p.max_size as f64).ln());
            for step in 0..p.steps {
                while let Ok((blk, ev)) = rx.try_recv() {
                    receive(blk, ev)?;
                    handoffs += 1;
                }
                let i = (rng(&mut x) % p.slots as u64) as usize;
                match slots[i].take() {
                    Some(blk) if (rng(&mut x) % 100) < p.handoff_pct as u64 => {
                        let ev = dev.create_event()?;
                        dev.record_event(ev, blk.stream)?;
                        tx.send((blk, ev)).expect("receiver lives until the barrier");
                    }
                    Some(blk) => {
                        ops.hold_check(blk.ptr.0, tag_len(&blk), blk.tag, p.hold, blk.stream)?;
                        let mut on = blk.stream;
                        if blk.stream.is_per_thread() && (rng(&mut x) % 100) < p.cross_stream_pct as u64 {
                            // Free on a user stream: order the block's work before it first.
                            on = streams[step % 2];
                            let ev = dev.create_event()?;
                            dev.record_event(ev, blk.stream)?;
                            dev.stream_wait_event(on, ev)?;
                            dev.destroy_event(ev);
                        }
                        live.remove(blk.ptr.0);
                        alloc.deallocate(blk.ptr, blk.size, on)?;
                    }
                    None => {
                        let u = (rng(&mut x) % 1_000_000) as f64 / 1_000_000.0;
                        let size = (lo + u * (hi - lo)).exp() as usize;
                        let stream = if (rng(&mut x) % 100) < p.user_stream_pct as u64 {
                            streams[step % 2]
                        } else {
                            Stream::PER_THREAD
                        };
                        let ptr = alloc.allocate(size, stream)?;
                        live.insert(ptr.0, size, &layout);
                        let blk = Block { ptr, size, tag: rng(&mut x) as u32 | 1, stream };
                        ops.hold_check(ptr.0, tag_len(&blk), blk.tag, p.hold, stream)?;
                        slots[i] = Some(blk);
                        allocs += 1;
                    }
                }
            }
            drop(tx);
            barrier.wait();
            while let Ok((blk, ev)) = rx.recv() {
                receive(blk, ev)?;
                handoffs += 1;
            }
            for blk in slots.into_iter().flatten() {
                ops.hold_check(blk.ptr.0, tag_len(&blk), blk.tag, p.hold, blk.stream)?;
                live.remove(blk.ptr.0);
                alloc.deallocate(blk.ptr, blk.size, blk.stream)?;
            }
            // Blocks freed on user streams are fenced there; the streams may go now (CUDA keeps
            // queued work), and their handles may be reused by the next run.
            for s in streams {
                ops.destroy_stream(s)?;
            }
            Ok((allocs, handoffs))
        }));
    }
    drop(txs);
    let mut report = StressReport::default();
    for h in handles {
        let (a, ho) = h.join().expect("stress thread panicked")?;
        report.allocations += a;
        report.handoffs += ho;
    }
    report.tag_errors = ops.finish()?;
    report.violations = ops.violations();
    report.layout_errors = std::mem::take(&mut *layout.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(report)
}

// ---------------------------------------------------------------------------------------------
// GPU availability for tests.

/// The GPU of `ordinal` for a test, or `None` after printing "skipped: no CUDA driver (...)".
/// With `CUARENA_REQUIRE_GPU=1`, no usable GPU is a panic (a test failure) instead.
pub fn gpu_or_skip(ordinal: i32) -> Option<Arc<CudaDevice>> {
    let required = std::env::var("CUARENA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match CudaDevice::new(ordinal) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) if required => panic!("CUARENA_REQUIRE_GPU=1 but GPU {ordinal} is not usable: {e}"),
        Err(e) => {
            eprintln!("skipped: no CUDA driver ({e})");
            None
        }
    }
}

/// `n` GPUs (ordinals `0..n`) for a test, or `None` after printing why it is skipped.
/// Fewer than `n` devices is a skip ("skipped: needs n GPUs") unless `CUARENA_REQUIRE_GPUS` is
/// set to `n` or more, which makes it a panic; no driver at all is a skip unless that or
/// `CUARENA_REQUIRE_GPU=1` is set.
pub fn gpus_or_skip(n: usize) -> Option<Vec<Arc<CudaDevice>>> {
    let need_gpu = std::env::var("CUARENA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let need_n = std::env::var("CUARENA_REQUIRE_GPUS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|k| k >= n);
    let count = match cuarena::device::cuda::device_count() {
        Ok(c) => c.max(0) as usize,
        Err(e) if need_gpu || need_n => panic!("a GPU is required but none is usable: {e}"),
        Err(e) => {
            eprintln!("skipped: no CUDA driver ({e})");
            return None;
        }
    };
    if count < n {
        if need_n {
            panic!("CUARENA_REQUIRE_GPUS asks for {n} GPUs but this machine has {count}");
        }
        eprintln!("skipped: needs {n} GPUs (found {count})");
        return None;
    }
    Some(
        (0..n as i32)
            .map(|o| Arc::new(CudaDevice::new(o).unwrap_or_else(|e| panic!("GPU {o} of {count}: {e}"))))
            .collect(),
    )
}

/// Allocates `size` bytes on `stream` up to `tries` times, until the block at `p` comes back:
/// for a test that checks what happens when a freed block is handed out again. Returns every
/// block it allocated (the caller frees them), `p` last if it came back, and whether it did.
pub fn allocate_until_back(
    a: &Allocator,
    size: usize,
    stream: Stream,
    p: DeviceAddr,
    tries: usize,
) -> (Vec<DeviceAddr>, bool) {
    let mut got = Vec::new();
    for _ in 0..tries {
        let q = a.allocate(size, stream).unwrap_or_else(|e| panic!("allocate {size} on {stream:?}: {e}"));
        got.push(q);
        if q == p {
            return (got, true);
        }
    }
    (got, false)
}

/// Gets the freed block at `p` back on `stream` ([`allocate_until_back`], at most `tries`
/// allocations of `size`), writes it there, and asserts that the write waited for every
/// earlier use of the block on the simulated device `sim` (no overwritten tag, no race:
/// `what` names the work it must have waited for); then frees what it allocated. Panics if
/// the block never came back: the test would check nothing.
pub fn assert_reuse_waits(
    sim: &HostDevice,
    a: &Allocator,
    (size, stream, p): (usize, Stream, DeviceAddr),
    tries: usize,
    what: &str,
) {
    let (got, reused) = allocate_until_back(a, size, stream, p, tries);
    assert!(reused, "the freed block never came back, so this test checks nothing: {got:?}");
    sim.write_tag(p.0, size, 9, stream).unwrap();
    sim.synchronize();
    assert_eq!(sim.tag_errors(), 0, "the block was overwritten under {what}");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    for q in got {
        a.deallocate(q, size, stream).unwrap();
    }
}

/// Asserts that everything `a` handed out came back, and, on a simulated device `sim`, that the
/// device saw no race and holds no memory. The one end-of-test check of every test.
///
/// The calling thread's arena is released here (its gathered frees go out), and parked arenas
/// take in what was sent to them; every other thread that used `a` must have released its own.
/// `bad_frees` is the number of invalid frees the test made on purpose: exactly that many must
/// have been refused, and a deferred error is allowed only if it is not zero. Then: no live
/// bytes, as many deallocations as allocations, the pool's invariants hold, nothing is handed
/// out by the pool, and after a blocking trim no arena, no arena-held byte and no reserved byte
/// is left.
pub fn assert_all_returned(a: &Allocator, sim: Option<&HostDevice>, bad_frees: u64) {
    // Released first: the calling thread's user arenas may be parked by it, with their inboxes.
    a.release_thread().expect("release_thread");
    // Parked arenas have no owner to take in the remote frees sent to them; a flush does. Until
    // then a free of a block whose superblock a reclaim took from a parked arena (the block is
    // then the pool's) waits in that arena's inbox, counted nowhere below. The flush gives this
    // thread a new, empty slot: released again.
    a.flush().expect("flush");
    a.release_thread().expect("release_thread");
    if let Some(sim) = sim {
        sim.synchronize();
        let v = sim.violations();
        assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
        assert_eq!(sim.tag_errors(), 0, "tag errors: a block was reused under running work");
        assert_eq!(sim.stale_handle_calls(), 0, "a destroyed stream's handle reached the device");
    }
    a.check_invariants();
    let s = a.stats();
    assert_eq!(s.live_bytes, 0, "{s:?}");
    assert_eq!(s.invalid_frees, bad_frees, "{s:?}");
    assert_eq!(s.allocations, s.deallocations, "{s:?}");
    assert!(bad_frees > 0 || a.take_deferred_error().is_none(), "a deferred error with no bad free");
    // Arenas of destroyed user streams wait, parked, for a device synchronise (`trim(true)`):
    // before it, they are all the pool has handed out and all the arenas hold.
    // Remote frees made on user streams and parked with them (`outbox.rs`) hold blocks that
    // are pool blocks, or lie in parked arenas.
    let (parked, frees) = (a.parked_bytes() as u64, a.parked_free_bytes() as u64);
    assert_eq!((s.arena_held_bytes, s.arenas), (parked, 0), "{s:?}");
    // Graph pools' segments (retired, waiting for the synchronise below) are the pool's too.
    let used = a.pool_in_use() as u64;
    let graph = a.graph_pool_bytes();
    assert!(
        parked <= used && used <= parked + frees + graph,
        "bytes still handed out: {:?} {s:?}",
        a.pool_used_ranges()
    );
    a.trim(true).expect("trim");
    let s = a.stats();
    assert_eq!((s.arena_held_bytes, s.reserved_bytes, s.pool_in_use_bytes, s.arenas), (0, 0, 0, 0), "{s:?}");
    assert_eq!((a.parked_bytes(), a.parked_free_bytes(), a.graph_pool_bytes()), (0, 0, 0));
    if let Some(sim) = sim {
        assert_eq!(sim.reserved_bytes(), 0, "the device still holds memory");
    }
}

// ---------------------------------------------------------------------------------------------
// The fence torture.

/// The streams the torture's threads use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamMode {
    /// Each thread works on its per-thread default stream ([`Stream::PER_THREAD`]); its
    /// cross-stream frees go to a user stream of its own.
    Ptds,
    /// Every thread works on the legacy stream ([`Stream::LEGACY`]); its cross-stream frees go
    /// to a user stream of its own.
    Legacy,
    /// Each thread creates a user stream and works on it throughout; its cross-stream frees go
    /// to a second user stream of its own.
    Own,
    /// Each thread creates [`MANY_STREAMS`] user streams, more than a thread keeps arenas and
    /// remote-free batches for (`cuarena::MAX_USER_ARENAS`), and each of its slots works on one
    /// of them (slot `i` on stream `i % MANY_STREAMS`), so the thread cycles through them;
    /// its cross-stream frees go to one more user stream of its own. Not in [`StreamMode::ALL`].
    Many,
}

/// User streams per thread in [`StreamMode::Many`].
pub const MANY_STREAMS: usize = cuarena::MAX_USER_ARENAS + 4;

impl StreamMode {
    /// The three modes of the benchmark's table and of the fence torture's every run.
    pub const ALL: [StreamMode; 3] = [StreamMode::Ptds, StreamMode::Legacy, StreamMode::Own];

    /// `"ptds"`, `"legacy"`, `"own"` or `"many"`.
    pub fn name(self) -> &'static str {
        match self {
            StreamMode::Ptds => "ptds",
            StreamMode::Legacy => "legacy",
            StreamMode::Own => "own",
            StreamMode::Many => "many",
        }
    }
}

/// Parameters of a [`torture`] run.
#[derive(Clone, Debug)]
pub struct TortureParams {
    pub threads: usize,
    /// Allocations each thread makes, over all devices (the run makes `threads ×` this).
    pub allocations_per_thread: usize,
    /// Blocks each thread keeps live at once, per device.
    pub slots: usize,
    /// Small requests are log-uniform in `[small_min, small_max]` (at least 4 bytes, so every
    /// block has a tag word; the arena path when
    /// `small_max` is at most the allocator's `small_max` and the stream is the PTDS).
    pub small_min: usize,
    pub small_max: usize,
    /// Percent of requests that are large: log-uniform in `[large_min, large_max]` (pool path).
    pub large_pct: u32,
    pub large_min: usize,
    pub large_max: usize,
    /// Percent of frees made on the thread's other stream, after a legal event wait.
    pub cross_stream_pct: u32,
    /// Percent of frees handed to another thread, with an event recorded after the last use.
    pub handoff_pct: u32,
    /// Bytes tagged at each end of a block (the whole block when it is at most twice this).
    pub tag_bytes: usize,
    /// How long each tag kernel holds its block between writing and re-checking the tag.
    pub hold: Duration,
    /// How long the tag kernels on the thread's other stream (before a cross-stream free) hold
    /// their block; `None`: `hold`.
    pub cross_hold: Option<Duration>,
    /// Every `throttle` steps a thread waits on the host for its streams' work up to
    /// `throttle` steps back, which bounds the work it has queued (0: never). This is the
    /// test's own back-pressure; the allocator never blocks.
    pub throttle: usize,
    pub mode: StreamMode,
    pub seed: u64,
}

impl Default for TortureParams {
    fn default() -> Self {
        TortureParams {
            threads: 16,
            allocations_per_thread: 2000,
            slots: 32,
            small_min: 4,
            small_max: 1 << 20,
            large_pct: 3,
            large_min: (1 << 20) + 1,
            large_max: 8 << 20,
            cross_stream_pct: 20,
            handoff_pct: 30,
            tag_bytes: 16 << 10,
            hold: Duration::from_micros(20),
            cross_hold: None,
            throttle: 0,
            mode: StreamMode::Ptds,
            seed: 1,
        }
    }
}

/// One device of a torture run: its tag work and its allocator.
#[derive(Clone)]
pub struct Target {
    pub ops: Arc<dyn TagOps>,
    pub alloc: Allocator,
}

/// What a torture run did and found.
#[derive(Debug, Default, Clone)]
pub struct TortureReport {
    /// Blocks allocated (all devices).
    pub allocations: u64,
    /// Of which large (above `small_max` of the parameters).
    pub large_allocations: u64,
    /// Frees by the allocating thread on the stream the block was allocated on.
    pub local_frees: u64,
    /// Frees by the allocating thread on its other stream.
    pub cross_stream_frees: u64,
    /// Blocks handed to another thread, which used and freed them on its own stream.
    pub handoffs: u64,
    /// Tag words found overwritten (reuse before the fence), summed over devices.
    pub tag_errors: u64,
    /// Tag words found overwritten, per device.
    pub tag_errors_per_device: Vec<u64>,
    /// Race-checker findings (the simulated device only), prefixed by the device index.
    pub violations: Vec<String>,
    /// Overlapping or misaligned live blocks seen, prefixed by the device index.
    pub layout_errors: Vec<String>,
    /// Wall time of the run.
    pub secs: f64,
}

impl TortureReport {
    /// One line with every count, for the log.
    pub fn summary(&self) -> String {
        format!(
            "allocations {} (large {}), local frees {}, cross-stream frees {}, handoffs {}, tag errors {} {:?}, \
             race violations {}, layout errors {}, {:.1} s",
            self.allocations,
            self.large_allocations,
            self.local_frees,
            self.cross_stream_frees,
            self.handoffs,
            self.tag_errors,
            self.tag_errors_per_device,
            self.violations.len(),
            self.layout_errors.len(),
            self.secs
        )
    }
}

struct TBlock {
    ptr: DeviceAddr,
    size: usize,
    tag: u32,
}

struct Handoff {
    dev: usize,
    blk: TBlock,
    event: Event,
}

#[derive(Default)]
struct TCounts {
    allocations: u64,
    large: u64,
    local: u64,
    cross: u64,
    handoffs: u64,
}

/// Per-thread, per-device state of the torture.
struct Lane {
    /// The thread's stream for handoffs and throttling; `streams[0]`.
    main: Stream,
    /// The streams its slots work on: slot `i` on `streams[i % streams.len()]` (one stream
    /// but in [`StreamMode::Many`]).
    streams: Vec<Stream>,
    alt: Stream,
    slots: Vec<Option<TBlock>>,
    /// The throttle's events of `throttle` steps back, on `main` and `alt`.
    pending: Option<[Event; 2]>,
}

/// The tag work over a block: its head and tail (or all of it), each held for `hold`.
fn hold_block(ops: &dyn TagOps, p: &TortureParams, b: &TBlock, stream: Stream, hold: Duration) -> Result<()> {
    let len = b.size & !3;
    if len <= 2 * p.tag_bytes {
        return ops.hold_check(b.ptr.0, len, b.tag, hold, stream);
    }
    let n = p.tag_bytes & !3;
    ops.hold_check(b.ptr.0, n, b.tag, hold, stream)?;
    let tail = (b.ptr.0 + b.size as u64 - n as u64) & !3;
    ops.hold_check(tail, n, b.tag, hold, stream)
}

/// Runs the fence torture over `targets` (one or more devices, each with its allocator).
///
/// `p.threads` threads each make `p.allocations_per_thread` allocations, alternating between
/// the targets, on the streams of `p.mode`. Every block has tag kernels in flight on it (written,
/// held, re-checked) when it is allocated and when it is freed. A full slot is freed in one of
/// three ways: locally (same thread, same stream), on the thread's other stream (after making
/// that stream wait on an event recorded after the block's last use, and using it there), or
/// handed to a random other thread (event recorded after the last use; the receiver makes its
/// stream wait on it, uses the block and frees it on its own stream). A shared map per device
/// checks that live blocks never overlap and are 256-byte aligned. At the end every block has
/// been freed and every worker thread has exited (so their arenas went back).
pub fn torture(targets: &[Target], p: &TortureParams) -> Result<TortureReport> {
    assert!(p.threads >= 1 && !targets.is_empty() && p.slots >= 1);
    let t0 = Instant::now();
    let lives: Arc<Vec<Live>> = Arc::new(targets.iter().map(|_| Live(Mutex::new(BTreeMap::new()))).collect());
    let layout = Arc::new(Mutex::new(Vec::new()));
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..p.threads).map(|_| mpsc::channel::<Handoff>()).unzip();
    let mut handles = Vec::new();
    for (t, rx) in rxs.into_iter().enumerate() {
        let (txs, targets, p, lives, layout) =
            (txs.clone(), targets.to_vec(), p.clone(), Arc::clone(&lives), Arc::clone(&layout));
        let h = std::thread::Builder::new()
            .name(format!("torture-{t}"))
            .spawn(move || -> Result<TCounts> { torture_thread(t, rx, txs, &targets, &p, &lives, &layout) });
        handles.push(h.expect("spawning a torture thread"));
    }
    drop(txs);
    let mut report = TortureReport::default();
    let mut first_err = None;
    for h in handles {
        match h.join().expect("torture thread panicked") {
            Ok(c) => {
                report.allocations += c.allocations;
                report.large_allocations += c.large;
                report.local_frees += c.local;
                report.cross_stream_frees += c.cross;
                report.handoffs += c.handoffs;
            }
            Err(e) => first_err = first_err.or(Some(e)),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for (d, tg) in targets.iter().enumerate() {
        let e = tg.ops.finish()?;
        report.tag_errors += e;
        report.tag_errors_per_device.push(e);
        report.violations.extend(tg.ops.violations().into_iter().map(|v| format!("device {d}: {v}")));
    }
    report.layout_errors = std::mem::take(&mut *layout.lock().unwrap_or_else(|p| p.into_inner()));
    report.secs = t0.elapsed().as_secs_f64();
    Ok(report)
}

fn torture_thread(
    t: usize,
    rx: mpsc::Receiver<Handoff>,
    txs: Vec<mpsc::Sender<Handoff>>,
    targets: &[Target],
    p: &TortureParams,
    lives: &[Live],
    layout: &Mutex<Vec<String>>,
) -> Result<TCounts> {
    let mut x = p.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add((t as u64 + 1) * 0x2545_f491) | 1;
    let mut lanes = Vec::with_capacity(targets.len());
    for tg in targets {
        let streams = match p.mode {
            StreamMode::Ptds => vec![Stream::PER_THREAD],
            StreamMode::Legacy => vec![Stream::LEGACY],
            StreamMode::Own => vec![tg.ops.create_stream()?],
            StreamMode::Many => (0..MANY_STREAMS).map(|_| tg.ops.create_stream()).collect::<Result<_>>()?,
        };
        let alt = tg.ops.create_stream()?;
        let main = streams[0];
        lanes.push(Lane { main, streams, alt, slots: (0..p.slots).map(|_| None).collect(), pending: None });
    }
    let mut c = TCounts::default();
    let small_min = p.small_min.max(4);
    let (slo, shi) = ((small_min as f64).ln(), (p.small_max.max(small_min) as f64).ln());
    let (llo, lhi) = ((p.large_min.max(1) as f64).ln(), (p.large_max.max(p.large_min.max(1)) as f64).ln());
    // The receiving side of a handoff: wait on the sender's event, use the block, free it here.
    let receive = |h: Handoff, lanes: &[Lane]| -> Result<()> {
        let (tg, lane) = (&targets[h.dev], &lanes[h.dev]);
        let dev = tg.ops.device();
        dev.stream_wait_event(lane.main, h.event)?;
        dev.destroy_event(h.event);
        hold_block(&*tg.ops, p, &h.blk, lane.main, p.hold)?;
        lives[h.dev].remove(h.blk.ptr.0);
        tg.alloc.deallocate(h.blk.ptr, h.blk.size, lane.main)
    };
    for step in 0..p.allocations_per_thread {
        while let Ok(h) = rx.try_recv() {
            receive(h, &lanes)?;
            c.handoffs += 1;
        }
        let d = step % targets.len();
        let (tg, dev) = (&targets[d], targets[d].ops.device());
        if p.throttle > 0 && step % (p.throttle * targets.len()) < targets.len() {
            let lane = &mut lanes[d];
            if let Some(evs) = lane.pending.take() {
                for ev in evs {
                    dev.sync_event(ev)?;
                    dev.destroy_event(ev);
                }
            }
            let evs = [dev.create_event()?, dev.create_event()?];
            dev.record_event(evs[0], lane.main)?;
            dev.record_event(evs[1], lane.alt)?;
            lane.pending = Some(evs);
        }
        let lane = &mut lanes[d];
        let i = (rng(&mut x) % p.slots as u64) as usize;
        let home = lane.streams[i % lane.streams.len()];
        if let Some(blk) = lane.slots[i].take() {
            // The block's last use on its stream, in flight as it is freed or handed on.
            hold_block(&*tg.ops, p, &blk, home, p.hold)?;
            let r = rng(&mut x) % 100;
            if p.threads > 1 && r < p.handoff_pct as u64 {
                let ev = dev.create_event()?;
                dev.record_event(ev, home)?;
                let to = (t + 1 + (rng(&mut x) % (p.threads as u64 - 1)) as usize) % p.threads;
                if let Err(mpsc::SendError(h)) = txs[to].send(Handoff { dev: d, blk, event: ev }) {
                    // The receiver failed and returned early; its error is the one reported.
                    dev.destroy_event(h.event);
                    return Err(Error::Config(format!("torture thread {to} ended early")));
                }
            } else if r < (p.handoff_pct + p.cross_stream_pct) as u64 {
                let ev = dev.create_event()?;
                dev.record_event(ev, home)?;
                dev.stream_wait_event(lane.alt, ev)?;
                dev.destroy_event(ev);
                hold_block(&*tg.ops, p, &blk, lane.alt, p.cross_hold.unwrap_or(p.hold))?;
                lives[d].remove(blk.ptr.0);
                tg.alloc.deallocate(blk.ptr, blk.size, lane.alt)?;
                c.cross += 1;
            } else {
                lives[d].remove(blk.ptr.0);
                tg.alloc.deallocate(blk.ptr, blk.size, home)?;
                c.local += 1;
            }
        }
        let large = (rng(&mut x) % 100) < p.large_pct as u64;
        let u = (rng(&mut x) % 1_000_000) as f64 / 1_000_000.0;
        let size = if large { (llo + u * (lhi - llo)).exp() } else { (slo + u * (shi - slo)).exp() } as usize;
        let size = size.max(small_min);
        let ptr = tg.alloc.allocate(size, home)?;
        lives[d].insert(ptr.0, size, layout);
        let blk = TBlock { ptr, size, tag: rng(&mut x) as u32 | 1 };
        hold_block(&*tg.ops, p, &blk, home, p.hold)?;
        lane.slots[i] = Some(blk);
        c.allocations += 1;
        c.large += u64::from(size > p.small_max);
    }
    // Every sender goes, then what others still send arrives until they are all done.
    drop(txs);
    while let Ok(h) = rx.recv() {
        receive(h, &lanes)?;
        c.handoffs += 1;
    }
    for (d, lane) in lanes.iter_mut().enumerate() {
        let tg = &targets[d];
        let n = lane.streams.len();
        for (i, slot) in lane.slots.iter_mut().enumerate() {
            let Some(blk) = slot.take() else { continue };
            let home = lane.streams[i % n];
            hold_block(&*tg.ops, p, &blk, home, p.hold)?;
            lives[d].remove(blk.ptr.0);
            tg.alloc.deallocate(blk.ptr, blk.size, home)?;
            c.local += 1;
        }
        if let Some(evs) = lane.pending.take() {
            for ev in evs {
                tg.ops.device().destroy_event(ev);
            }
        }
        // Blocks freed on these streams are fenced there; CUDA keeps queued work of a
        // destroyed stream, and the allocator knows streams by key, not by handle.
        if matches!(p.mode, StreamMode::Own | StreamMode::Many) {
            for &s in &lane.streams {
                tg.ops.destroy_stream(s)?;
            }
        }
        tg.ops.destroy_stream(lane.alt)?;
    }
    Ok(c)
}

// ---------------------------------------------------------------------------------------------
// A light device for runs with very many threads.

/// A device for runs with many short-lived threads, where [`HostDevice`] (a stream and a
/// vector-clock entry per thread, kept for ever) would grow without bound. Memory is address
/// space only (nothing is ever mapped: the allocator never touches device memory); stream work
/// is not simulated, but every event completes `latency` after it is recorded, so fences are
/// pending for a while as on a GPU. Stream keys are unique per thread for the PTDS, one for the
/// legacy stream, and derived from the handle for user streams.
pub struct LightDevice {
    capacity: usize,
    latency: Duration,
    state: Mutex<LightState>,
}

#[derive(Default)]
struct LightState {
    next_addr: u64,
    regions: BTreeMap<u64, usize>,
    reserved: usize,
    next_event: u64,
    /// When each live event completes (`None`: never recorded).
    events: HashMap<u64, Option<Instant>>,
}

static LIGHT_NEXT_PTDS_KEY: AtomicU64 = AtomicU64::new(1 << 32);
thread_local! {
    static LIGHT_PTDS_KEY: Cell<u64> = const { Cell::new(0) };
}

impl LightDevice {
    /// Reservations are 2 MiB-aligned, `capacity` bytes in all; events complete `latency`
    /// after their record.
    pub fn new(capacity: usize, latency: Duration) -> LightDevice {
        LightDevice {
            capacity,
            latency,
            state: Mutex::new(LightState { next_addr: 1 << 40, next_event: 1, ..LightState::default() }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LightState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes reserved now.
    pub fn reserved_bytes(&self) -> usize {
        self.lock().reserved
    }

    /// Events created and not yet destroyed.
    pub fn live_events(&self) -> usize {
        self.lock().events.len()
    }
}

const LIGHT_ALIGN: u64 = 2 << 20;

impl Device for LightDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Host
    }
    fn ordinal(&self) -> i32 {
        0
    }
    fn total_memory(&self) -> Result<usize> {
        Ok(self.capacity)
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        let mut st = self.lock();
        if bytes == 0 || st.reserved.saturating_add(bytes) > self.capacity {
            return Ok(None);
        }
        let p = st.next_addr;
        st.next_addr = (p + bytes as u64).next_multiple_of(LIGHT_ALIGN);
        st.regions.insert(p, bytes);
        st.reserved += bytes;
        Ok(Some(p))
    }
    fn alloc_async(&self, bytes: usize, _stream: Stream) -> Result<Option<u64>> {
        self.reserve(bytes)
    }
    unsafe fn free_async(&self, ptr: u64, bytes: usize, _stream: Stream) -> Result<()> {
        // Address space only: nothing runs on it, so a stream-ordered release is a release.
        // SAFETY: forwarded from the caller (the same contract as `release`).
        unsafe { self.release(ptr, bytes) }
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        let mut st = self.lock();
        match st.regions.get(&ptr) {
            Some(&b) if b == bytes => {
                st.regions.remove(&ptr);
                st.reserved -= bytes;
                Ok(())
            }
            _ => Err(Error::Driver { call: "release", code: 1 }),
        }
    }
    fn create_event(&self) -> Result<Event> {
        let mut st = self.lock();
        let e = st.next_event;
        st.next_event += 1;
        st.events.insert(e, None);
        Ok(Event(e))
    }
    fn destroy_event(&self, event: Event) {
        self.lock().events.remove(&event.0);
    }
    fn record_event(&self, event: Event, _stream: Stream) -> Result<()> {
        let mut st = self.lock();
        let done = Instant::now() + self.latency;
        match st.events.get_mut(&event.0) {
            Some(e) => {
                *e = Some(done);
                Ok(())
            }
            None => Err(Error::Driver { call: "record_event", code: 400 }),
        }
    }
    fn query_event(&self, event: Event) -> Result<bool> {
        match self.lock().events.get(&event.0) {
            Some(e) => Ok(e.is_none_or(|t| Instant::now() >= t)),
            None => Err(Error::Driver { call: "query_event", code: 400 }),
        }
    }
    fn sync_event(&self, event: Event) -> Result<()> {
        let done = match self.lock().events.get(&event.0) {
            Some(e) => *e,
            None => return Err(Error::Driver { call: "sync_event", code: 400 }),
        };
        if let Some(t) = done {
            std::thread::sleep(t.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }
    /// Waits until the latest-completing recorded event is done: all "work" has then completed.
    fn synchronize(&self) -> Result<()> {
        let last = self.lock().events.values().flatten().max().copied();
        if let Some(t) = last {
            std::thread::sleep(t.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }
    fn stream_wait_event(&self, _stream: Stream, event: Event) -> Result<()> {
        if self.lock().events.contains_key(&event.0) {
            Ok(())
        } else {
            Err(Error::Driver { call: "stream_wait_event", code: 400 })
        }
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        if stream.is_legacy() {
            return Ok(StreamKey(1));
        }
        if stream.is_per_thread() {
            let k = LIGHT_PTDS_KEY.with(|k| {
                if k.get() == 0 {
                    k.set(LIGHT_NEXT_PTDS_KEY.fetch_add(1, Ordering::Relaxed));
                }
                k.get()
            });
            return Ok(StreamKey(k));
        }
        Ok(StreamKey((1 << 62) | stream.as_raw() as u64))
    }
}
