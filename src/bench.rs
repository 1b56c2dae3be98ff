//! The benchmark suite behind `cargo run --release` and `cargo bench`.
//!
//! Workloads run in a rayon pool, each thread on its per-thread stream unless noted:
//! - `churn`: 256 slots per thread; each step frees a random slot's block and allocates a new
//!   one there (log-uniform 256 B .. 1 MiB).
//! - `handoff`: thread i allocates and hands each block to thread i+1, which frees it.
//! - `prodcons`: half the threads only allocate, the other half only free.
//! - `large`: like churn with 8 slots, 1 .. 64 MiB.
//! - `mixed`: like churn, 1% of requests 1 .. 64 MiB.
//! - `random_allocations` (RMM's): one thread, up to 10^5 live blocks, random alloc or free.
//! - `multi_stream` (RMM's, GPU only): each thread allocates on its own stream and runs a
//!   spinning kernel there; reports how many kernels overlapped.
//!
//! `touch` variants memset the first 4 KiB of every block on its stream after allocation, so
//! fences are often still pending when the block is freed.
//!
//! Measures: pairs (alloc + free) per second over a timed steady state (after each thread's
//! slots are filled), p50/p99 ns per pair (every 8th pair timed), peak live bytes (sampled every
//! millisecond from per-thread single-writer counters), peak reserved bytes, driver calls per
//! million operations in steady state, and host-blocking synchronisations.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use cudarc::driver::sys;

use crate::address_tree::AddressTree;
use crate::allocator::{Allocator, DevicePtr};
use crate::config::Config;
use crate::device::cuda::{CudaDevice, check};
use crate::device::cuda_kernels::CudaKernels;
use crate::device::host::{HostConfig, HostDevice};
use crate::device::{Device, DeviceKind};
use crate::error::{Error, Result};
use crate::stream::Stream;

/// Cumulative figures an allocator reports about itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub peak_reserved: u64,
    pub driver_calls: u64,
    pub host_syncs: u64,
}

/// An allocator under test.
pub trait BenchAlloc: Send + Sync {
    fn name(&self) -> &'static str;
    fn alloc(&self, size: usize, stream: Stream) -> Result<u64>;
    fn free(&self, ptr: u64, size: usize, stream: Stream) -> Result<()>;
    fn counts(&self) -> Counts;
    /// Called by each worker thread when it is done.
    fn thread_end(&self) {}
}

struct Cuarena(Allocator);

impl BenchAlloc for Cuarena {
    fn name(&self) -> &'static str {
        "cuarena"
    }
    #[inline]
    fn alloc(&self, size: usize, stream: Stream) -> Result<u64> {
        self.0.allocate(size, stream).map(|p| p.0)
    }
    #[inline]
    fn free(&self, ptr: u64, size: usize, stream: Stream) -> Result<()> {
        self.0.deallocate(DevicePtr(ptr), size, stream)
    }
    fn counts(&self) -> Counts {
        let s = self.0.stats();
        Counts {
            peak_reserved: s.peak_reserved_bytes,
            driver_calls: s.driver_calls,
            host_syncs: s.host_syncs,
        }
    }
    fn thread_end(&self) {
        let _ = self.0.release_thread();
    }
}

/// Tracks live bytes and their peak for baselines that do not report their own.
#[derive(Default)]
struct Tally {
    live: AtomicI64,
    peak: AtomicU64,
    calls: AtomicU64,
    syncs: AtomicU64,
}

impl Tally {
    fn add(&self, d: i64, calls: u64, syncs: u64) {
        let now = self.live.fetch_add(d, Ordering::Relaxed) + d;
        self.peak.fetch_max(now.max(0) as u64, Ordering::Relaxed);
        self.calls.fetch_add(calls, Ordering::Relaxed);
        self.syncs.fetch_add(syncs, Ordering::Relaxed);
    }
}

/// `cuMemAlloc`/`cuMemFree` (the free synchronises the device: counted as a host sync).
struct CuMemAlloc {
    dev: Arc<CudaDevice>,
    tally: Tally,
}

impl BenchAlloc for CuMemAlloc {
    fn name(&self) -> &'static str {
        "cuMemAlloc"
    }
    fn alloc(&self, size: usize, _s: Stream) -> Result<u64> {
        let _g = self.dev.enter()?;
        let mut p = 0;
        // SAFETY: valid out-pointer, context current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, size) })?;
        self.tally.add(size as i64, 1, 0);
        Ok(p)
    }
    fn free(&self, ptr: u64, size: usize, _s: Stream) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: `ptr` came from cuMemAlloc.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })?;
        self.tally.add(-(size as i64), 1, 1);
        Ok(())
    }
    fn counts(&self) -> Counts {
        let t = &self.tally;
        Counts {
            peak_reserved: t.peak.load(Ordering::Relaxed),
            driver_calls: t.calls.load(Ordering::Relaxed),
            host_syncs: t.syncs.load(Ordering::Relaxed),
        }
    }
}

/// `cuMemAllocAsync`/`cuMemFreeAsync` on the device's default pool, release threshold at max.
struct CuMemAllocAsync {
    dev: Arc<CudaDevice>,
    pool: usize,
    tally: Tally,
}

impl CuMemAllocAsync {
    fn new(dev: Arc<CudaDevice>) -> Result<CuMemAllocAsync> {
        let _g = dev.enter()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device ordinal is valid.
        check("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, dev.ordinal())
        })?;
        let mut max = u64::MAX;
        let mut zero = 0u64;
        // SAFETY: both attributes take a cuuint64_t.
        unsafe {
            check(
                "cuMemPoolSetAttribute",
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut max as *mut u64 as *mut c_void,
                ),
            )?;
            check("cuMemPoolTrimTo", sys::cuMemPoolTrimTo(pool, 0))?;
            check(
                "cuMemPoolSetAttribute",
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                    &mut zero as *mut u64 as *mut c_void,
                ),
            )?;
        }
        Ok(CuMemAllocAsync { dev, pool: pool as usize, tally: Tally::default() })
    }
}

impl BenchAlloc for CuMemAllocAsync {
    fn name(&self) -> &'static str {
        "cuMemAllocAsync"
    }
    fn alloc(&self, size: usize, s: Stream) -> Result<u64> {
        let _g = self.dev.enter()?;
        let mut p = 0;
        // SAFETY: valid out-pointer, context current, the stream is the caller's.
        check("cuMemAllocAsync", unsafe { sys::cuMemAllocAsync(&mut p, size, s.as_raw() as sys::CUstream) })?;
        self.tally.add(0, 1, 0);
        Ok(p)
    }
    fn free(&self, ptr: u64, _size: usize, s: Stream) -> Result<()> {
        let _g = self.dev.enter()?;
        // SAFETY: `ptr` came from cuMemAllocAsync.
        check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(ptr, s.as_raw() as sys::CUstream) })?;
        self.tally.add(0, 1, 0);
        Ok(())
    }
    fn counts(&self) -> Counts {
        let mut high = 0u64;
        if let Ok(_g) = self.dev.enter() {
            // SAFETY: the attribute is a cuuint64_t.
            unsafe {
                sys::cuMemPoolGetAttribute(
                    self.pool as sys::CUmemoryPool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                    &mut high as *mut u64 as *mut c_void,
                )
            };
        }
        Counts { peak_reserved: high, driver_calls: self.tally.calls.load(Ordering::Relaxed), host_syncs: 0 }
    }
}

impl Drop for CuMemAllocAsync {
    fn drop(&mut self) {
        if let Ok(_g) = self.dev.enter() {
            // SAFETY: waits for the frees, then trims the pool this baseline filled.
            unsafe {
                sys::cuCtxSynchronize();
                sys::cuMemPoolTrimTo(self.pool as sys::CUmemoryPool, 0);
            }
        }
    }
}

/// The host baseline: one address-ordered first-fit pool with coalescing behind one mutex,
/// growing from the simulated device in 32 MiB chunks. No fences: it is what a plain
/// locked pool costs.
struct MutexPool {
    dev: Arc<HostDevice>,
    state: Mutex<(AddressTree<()>, std::collections::HashMap<u64, usize>)>,
    tally: Tally,
    reserved: AtomicU64,
}

impl BenchAlloc for MutexPool {
    fn name(&self) -> &'static str {
        "mutex-first-fit"
    }
    fn alloc(&self, size: usize, _s: Stream) -> Result<u64> {
        let len = size.next_multiple_of(256) as u64;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let a = match st.0.first_fit(len) {
            Some(a) => a,
            None => {
                let chunk = len.max(32 << 20);
                let p = self.dev.reserve(chunk as usize)?.ok_or(Error::OutOfMemory {
                    requested: size,
                    reserved: 0,
                    in_use: 0,
                    largest_free: 0,
                    limit: 0,
                })?;
                self.reserved.fetch_add(chunk, Ordering::Relaxed);
                self.tally.add(0, 1, 0);
                st.0.insert(p, chunk, ());
                p
            }
        };
        let (flen, ()) = st.0.remove(a).expect("present");
        if flen > len {
            st.0.insert(a + len, flen - len, ());
        }
        st.1.insert(a, len as usize);
        Ok(a)
    }
    fn free(&self, ptr: u64, _size: usize, _s: Stream) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let len = st.1.remove(&ptr).expect("a live block") as u64;
        let (mut start, mut n) = (ptr, len);
        if let Some((k, l, ())) = st.0.below(ptr)
            && k + l == ptr
        {
            st.0.remove(k);
            start = k;
            n += l;
        }
        if let Some((l, ())) = st.0.get(ptr + len) {
            st.0.remove(ptr + len);
            n += l;
        }
        st.0.insert(start, n, ());
        Ok(())
    }
    fn counts(&self) -> Counts {
        Counts {
            peak_reserved: self.reserved.load(Ordering::Relaxed),
            driver_calls: self.tally.calls.load(Ordering::Relaxed),
            host_syncs: 0,
        }
    }
}

/// One measured point.
#[derive(Clone, Debug, Default)]
pub struct Point {
    pub allocator: String,
    pub device: &'static str,
    pub workload: String,
    pub threads: usize,
    pub pairs: u64,
    pub secs: f64,
    pub pairs_per_sec: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub peak_live_bytes: u64,
    pub reserved_bytes: u64,
    pub driver_calls: u64,
    pub driver_calls_per_mop: f64,
    pub host_syncs: u64,
    pub kernel_concurrency: Option<u32>,
    /// Seconds to create the allocator and fill every thread's slots.
    pub setup_secs: f64,
    /// Seconds from the end of the measurement to the allocator's drop.
    pub teardown_secs: f64,
}

impl Point {
    /// Peak reserved over peak live.
    pub fn memory_ratio(&self) -> f64 {
        if self.peak_live_bytes == 0 { 0.0 } else { self.reserved_bytes as f64 / self.peak_live_bytes as f64 }
    }

    /// One JSON object.
    pub fn json(&self) -> String {
        format!(
            "{{\"allocator\":\"{}\",\"device\":\"{}\",\"workload\":\"{}\",\"threads\":{},\"pairs\":{},\"secs\":{:.3},\
             \"pairs_per_sec\":{:.0},\"p50_ns\":{},\"p99_ns\":{},\"peak_live_bytes\":{},\"reserved_bytes\":{},\
             \"memory_ratio\":{:.3},\"driver_calls\":{},\"driver_calls_per_mop\":{:.1},\"host_syncs\":{},\"kernel_concurrency\":{},\
             \"setup_secs\":{:.3},\"teardown_secs\":{:.3}}}",
            self.allocator,
            self.device,
            self.workload,
            self.threads,
            self.pairs,
            self.secs,
            self.pairs_per_sec,
            self.p50_ns,
            self.p99_ns,
            self.peak_live_bytes,
            self.reserved_bytes,
            self.memory_ratio(),
            self.driver_calls,
            self.driver_calls_per_mop,
            self.host_syncs,
            self.kernel_concurrency.map_or("null".to_string(), |c| c.to_string()),
            self.setup_secs,
            self.teardown_secs
        )
    }
}

/// The workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    Churn,
    Handoff,
    ProdCons,
    Large,
    Mixed,
    RandomAllocations,
    MultiStream,
}

impl Workload {
    pub const ALL: [Workload; 7] = [
        Workload::Churn,
        Workload::Handoff,
        Workload::ProdCons,
        Workload::Large,
        Workload::Mixed,
        Workload::RandomAllocations,
        Workload::MultiStream,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Workload::Churn => "churn",
            Workload::Handoff => "handoff",
            Workload::ProdCons => "prodcons",
            Workload::Large => "large",
            Workload::Mixed => "mixed",
            Workload::RandomAllocations => "random_allocations",
            Workload::MultiStream => "multi_stream",
        }
    }

    pub fn parse(s: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name() == s)
    }
}

/// The device the suite runs on, and what it can do there.
pub struct Bench {
    pub device: Arc<dyn Device>,
    cuda: Option<Arc<CudaDevice>>,
    host: Option<Arc<HostDevice>>,
    kernels: Option<CudaKernels>,
    pub description: String,
}

impl Bench {
    /// The GPU if there is one, else the simulated device (with the reason).
    pub fn detect() -> Bench {
        match CudaDevice::new(0) {
            Ok(d) => {
                let d = Arc::new(d);
                let total = d.total_memory().unwrap_or(0);
                let kernels = CudaKernels::load(Arc::clone(&d)).ok();
                Bench {
                    device: d.clone(),
                    cuda: Some(d),
                    host: None,
                    kernels,
                    description: format!("cuda: GPU 0 ({} GiB)", total >> 30),
                }
            }
            Err(e) => {
                let h = Arc::new(HostDevice::new(HostConfig {
                    capacity: 1 << 40,
                    max_delay: Duration::ZERO,
                    ..HostConfig::default()
                }));
                Bench {
                    device: h.clone(),
                    cuda: None,
                    host: Some(h),
                    kernels: None,
                    description: format!("host-simulated device (no GPU: {e})"),
                }
            }
        }
    }

    pub fn kind(&self) -> DeviceKind {
        self.device.kind()
    }

    /// The allocators compared on this device.
    pub fn allocator_names(&self) -> Vec<&'static str> {
        match self.kind() {
            DeviceKind::Cuda => vec!["cuarena", "cuMemAllocAsync", "cuMemAlloc"],
            DeviceKind::Host => vec!["cuarena", "mutex-first-fit"],
        }
    }

    fn make(&self, name: &str) -> Result<Box<dyn BenchAlloc>> {
        Ok(match name {
            "cuarena" => Box::new(Cuarena(Allocator::new(Arc::clone(&self.device), Config::from_env()?)?)),
            "cuMemAlloc" => Box::new(CuMemAlloc {
                dev: self.cuda.clone().ok_or(Error::NoDriver)?,
                tally: Tally::default(),
            }),
            "cuMemAllocAsync" => Box::new(CuMemAllocAsync::new(self.cuda.clone().ok_or(Error::NoDriver)?)?),
            "mutex-first-fit" => Box::new(MutexPool {
                dev: self
                    .host
                    .clone()
                    .ok_or(Error::Config("mutex-first-fit runs on the host device".into()))?,
                state: Mutex::new((AddressTree::new(1 << 21), Default::default())),
                tally: Tally::default(),
                reserved: AtomicU64::new(0),
            }),
            _ => return Err(Error::Config(format!("unknown allocator {name}"))),
        })
    }

    /// Memsets the first 4 KiB of a block on `stream`.
    fn touch(&self, ptr: u64, size: usize, stream: Stream) {
        let n = size.min(4096);
        if let Some(d) = &self.cuda {
            if let Ok(_g) = d.enter() {
                // SAFETY: the block holds at least `n` bytes; the stream is the caller's.
                unsafe { sys::cuMemsetD8Async(ptr, 0, n, stream.as_raw() as sys::CUstream) };
            }
        } else if let Some(h) = &self.host {
            let _ = h.fill(ptr, n, 0, stream);
        }
    }

    /// Whether `w` runs on this device.
    pub fn supports(&self, w: Workload) -> bool {
        w != Workload::MultiStream || self.kernels.is_some()
    }

    /// Measures one point.
    pub fn run(
        &self,
        alloc_name: &str,
        w: Workload,
        touch: bool,
        threads: usize,
        secs: f64,
    ) -> Result<Point> {
        if threads == 0 {
            return Err(Error::Config("a benchmark point needs at least 1 thread".into()));
        }
        if !(secs.is_finite() && secs > 0.0) {
            return Err(Error::Config(format!(
                "a benchmark point runs for a finite time above 0 s, not {secs}"
            )));
        }
        let t_start = Instant::now();
        let alloc: Arc<dyn BenchAlloc> = Arc::from(self.make(alloc_name)?);
        let threads = if w == Workload::RandomAllocations { 1 } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        let shared = Shared::new(threads);
        let barrier = Barrier::new(threads + 1);
        let run = Run { bench: self, alloc: &*alloc, w, touch, threads, shared: &shared, barrier: &barrier };
        let mut start_counts = Counts::default();
        let mut elapsed = 0.0;
        let mut setup = 0.0;
        let mut t_stop = Instant::now();
        let results: Vec<Result<Worker>> = std::thread::scope(|s| {
            let h = s.spawn(|| pool.broadcast(|ctx| run.worker(ctx.index())));
            barrier.wait(); // every thread has filled its slots
            start_counts = alloc.counts();
            setup = t_start.elapsed().as_secs_f64();
            let t0 = Instant::now();
            shared.go.store(true, Ordering::Release);
            while t0.elapsed().as_secs_f64() < secs {
                std::thread::sleep(Duration::from_millis(1));
                shared.sample_live();
            }
            shared.stop.store(true, Ordering::Release);
            elapsed = t0.elapsed().as_secs_f64();
            t_stop = Instant::now();
            let end_counts = alloc.counts();
            start_counts.driver_calls = end_counts.driver_calls - start_counts.driver_calls;
            start_counts.host_syncs = end_counts.host_syncs - start_counts.host_syncs;
            h.join().expect("bench pool panicked")
        });
        let mut pairs = 0u64;
        let mut lat: Vec<u32> = Vec::new();
        for r in results {
            let wk = r?;
            pairs += wk.pairs;
            lat.extend(wk.lat);
        }
        lat.sort_unstable();
        let pct = |q: f64| {
            lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0)
                as u64
        };
        let counts = alloc.counts();
        let concurrency = if w == Workload::MultiStream {
            self.kernels.as_ref().and_then(|k| k.take_counters().ok()).map(|(_, c)| c)
        } else {
            None
        };
        let name = alloc.name().to_string();
        drop(alloc);
        drop(pool);
        let teardown = t_stop.elapsed().as_secs_f64();
        Ok(Point {
            setup_secs: setup,
            teardown_secs: teardown,
            allocator: name,
            device: self.kind().name(),
            workload: format!("{}{}", w.name(), if touch { "+touch" } else { "" }),
            threads,
            pairs,
            secs: elapsed,
            pairs_per_sec: pairs as f64 / elapsed,
            p50_ns: pct(0.5),
            p99_ns: pct(0.99),
            peak_live_bytes: shared.peak.load(Ordering::Relaxed),
            reserved_bytes: counts.peak_reserved,
            driver_calls: start_counts.driver_calls,
            driver_calls_per_mop: start_counts.driver_calls as f64 * 1e6 / (2 * pairs).max(1) as f64,
            host_syncs: start_counts.host_syncs,
            kernel_concurrency: concurrency,
        })
    }
}

#[repr(align(128))]
#[derive(Default)]
struct PaddedLive(AtomicI64);

struct Shared {
    go: AtomicBool,
    stop: AtomicBool,
    live: Vec<PaddedLive>,
    peak: AtomicU64,
    queues: Vec<ArrayQueue<(u64, usize)>>,
    /// Workers meet here after they stop producing and before they drain their queues.
    stopped: Barrier,
}

impl Shared {
    fn new(threads: usize) -> Shared {
        Shared {
            go: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            live: (0..threads).map(|_| PaddedLive::default()).collect(),
            peak: AtomicU64::new(0),
            queues: (0..threads).map(|_| ArrayQueue::new(256)).collect(),
            stopped: Barrier::new(threads),
        }
    }

    fn sample_live(&self) {
        let sum: i64 = self.live.iter().map(|l| l.0.load(Ordering::Relaxed)).sum();
        self.peak.fetch_max(sum.max(0) as u64, Ordering::Relaxed);
    }
}

struct Run<'a> {
    bench: &'a Bench,
    alloc: &'a dyn BenchAlloc,
    w: Workload,
    touch: bool,
    threads: usize,
    shared: &'a Shared,
    barrier: &'a Barrier,
}

struct Worker {
    pairs: u64,
    lat: Vec<u32>,
}

struct Rng(u64);

const LN_4096: f64 = 8.317_766_166_719_343;
const LN_64: f64 = 4.158_883_083_359_672;
const LN_256: f64 = 5.545_177_444_479_562;

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Log-uniform in `[lo, hi)`: `lo · (hi/lo)^u`, one `exp` per draw.
    fn log_uniform(&mut self, lo: usize, hi: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let ratio_ln = match (lo, hi) {
            (256, 0x10_0000) => LN_4096,
            (0x10_0000, 0x400_0000) => LN_64,
            (256, 0x1_0000) => LN_256,
            _ => (hi as f64 / lo as f64).ln(),
        };
        (lo as f64 * (u * ratio_ln).exp()) as usize
    }
}

impl Run<'_> {
    fn size(&self, rng: &mut Rng) -> usize {
        match self.w {
            Workload::Large => rng.log_uniform(1 << 20, 64 << 20),
            Workload::Mixed if rng.next().is_multiple_of(100) => rng.log_uniform(1 << 20, 64 << 20),
            Workload::RandomAllocations => rng.log_uniform(256, 64 << 10),
            Workload::MultiStream => 1 << 20,
            _ => rng.log_uniform(256, 1 << 20),
        }
    }

    fn live(&self, t: usize, d: i64) {
        let l = &self.shared.live[t].0;
        l.store(l.load(Ordering::Relaxed) + d, Ordering::Relaxed);
    }

    fn alloc(&self, t: usize, size: usize, stream: Stream) -> Result<u64> {
        let p = self.alloc.alloc(size, stream)?;
        self.live(t, size as i64);
        if self.touch {
            self.bench.touch(p, size, stream);
        }
        Ok(p)
    }

    fn free(&self, t: usize, p: u64, size: usize, stream: Stream) -> Result<()> {
        self.alloc.free(p, size, stream)?;
        self.live(t, -(size as i64));
        Ok(())
    }

    fn worker(&self, t: usize) -> Result<Worker> {
        let r = self.work(t);
        self.alloc.thread_end();
        r
    }

    fn work(&self, t: usize) -> Result<Worker> {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
        let ps = Stream::PER_THREAD;
        let nslots = match self.w {
            Workload::Churn | Workload::Mixed => 256,
            Workload::Large => 8,
            _ => 0,
        };
        let mut slots: Vec<(u64, usize)> = Vec::with_capacity(nslots);
        let mut failure = None;
        for _ in 0..nslots {
            let s = self.size(&mut rng);
            match self.alloc(t, s, ps) {
                Ok(p) => slots.push((p, s)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let own_stream = match (self.w, &self.bench.kernels) {
            (Workload::MultiStream, Some(k)) => Some(k.create_stream()?),
            _ => None,
        };
        self.barrier.wait();
        while !self.shared.go.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        let mut lat = Vec::with_capacity(1 << 16);
        let mut pairs = 0u64;
        let mut random_live: Vec<(u64, usize)> = Vec::new();
        while failure.is_none() && !self.shared.stop.load(Ordering::Relaxed) {
            let timed = pairs.is_multiple_of(8) && lat.len() < lat.capacity();
            let t0 = if timed { Some(Instant::now()) } else { None };
            let r: Result<u64> = match self.w {
                Workload::Churn | Workload::Mixed | Workload::Large => {
                    let i = (rng.next() % slots.len() as u64) as usize;
                    let (p, s) = slots[i];
                    self.free(t, p, s, ps).and_then(|()| {
                        let s = self.size(&mut rng);
                        let p = self.alloc(t, s, ps)?;
                        slots[i] = (p, s);
                        Ok(1)
                    })
                }
                Workload::Handoff => self.handoff(t, &mut rng),
                Workload::ProdCons => self.prodcons(t, &mut rng),
                Workload::RandomAllocations => {
                    if random_live.len() < 100_000 && (random_live.is_empty() || rng.next().is_multiple_of(2))
                    {
                        let s = self.size(&mut rng);
                        self.alloc(t, s, ps).map(|p| {
                            random_live.push((p, s));
                            0
                        })
                    } else {
                        let i = (rng.next() % random_live.len() as u64) as usize;
                        let (p, s) = random_live.swap_remove(i);
                        self.free(t, p, s, ps).map(|()| 1)
                    }
                }
                Workload::MultiStream => {
                    let s = own_stream.expect("multi_stream needs kernels");
                    let k = self.bench.kernels.as_ref().expect("checked");
                    self.alloc(t, 1 << 20, s).and_then(|p| {
                        k.spin(200_000, s)?;
                        self.free(t, p, 1 << 20, s).map(|()| 1)
                    })
                }
            };
            match r {
                Ok(n) => pairs += n,
                Err(e) => failure = Some(e),
            }
            if let Some(t0) = t0 {
                lat.push(t0.elapsed().as_nanos().min(u32::MAX as u128) as u32);
            }
        }
        // Drain: every block back, after every thread has stopped pushing.
        self.shared.stopped.wait();
        for (p, s) in slots.drain(..).chain(random_live.drain(..)) {
            self.free(t, p, s, ps)?;
        }
        while let Some((p, s)) = self.shared.queues[t].pop() {
            self.free(t, p, s, ps)?;
        }
        if let (Some(s), Some(k)) = (own_stream, &self.bench.kernels) {
            k.synchronize()?;
            k.destroy_stream(s)?;
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(Worker { pairs, lat }),
        }
    }

    /// Allocates one block for the next thread and frees what the previous one sent.
    fn handoff(&self, t: usize, rng: &mut Rng) -> Result<u64> {
        let s = self.size(rng);
        let p = self.alloc(t, s, Stream::PER_THREAD)?;
        let next = (t + 1) % self.threads;
        let mut n = 0;
        if let Err((p, s)) = self.shared.queues[next].push((p, s)) {
            self.free(t, p, s, Stream::PER_THREAD)?;
            n += 1;
        }
        for _ in 0..2 {
            match self.shared.queues[t].pop() {
                Some((p, s)) => {
                    self.free(t, p, s, Stream::PER_THREAD)?;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }

    /// Producers (even threads) allocate into their queue; consumers (odd) free from their
    /// producer's queue. A single thread does both.
    fn prodcons(&self, t: usize, rng: &mut Rng) -> Result<u64> {
        let producer = t.is_multiple_of(2);
        let q = &self.shared.queues[t & !1];
        let mut n = 0;
        if producer && q.len() < q.capacity() {
            let s = self.size(rng);
            let p = self.alloc(t, s, Stream::PER_THREAD)?;
            if let Err((p, s)) = q.push((p, s)) {
                self.free(t, p, s, Stream::PER_THREAD)?;
                n += 1;
            }
        }
        if (!producer || self.threads == 1 || t + 1 == self.threads)
            && let Some((p, s)) = q.pop()
        {
            self.free(t, p, s, Stream::PER_THREAD)?;
            n += 1;
        }
        Ok(n)
    }
}
