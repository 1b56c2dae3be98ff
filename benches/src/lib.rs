//! The benchmark suite behind `cargo run --release` and `cargo bench`.
//!
//! Workloads run in a rayon pool, each thread on the stream its [`StreamMode`] gives it:
//! `ptds` (its per-thread default stream), `legacy` (stream 0, shared by every thread) or `own`
//! (one non-blocking stream it creates before the timed window and destroys after it).
//! - `churn`: 256 slots per thread; each step frees a random slot's block and allocates a new
//!   one there (log-uniform 256 B .. 1 MiB).
//! - `handoff`: thread i allocates and hands each block to thread i+1 through a lock-free queue
//!   of 256; thread i+1 frees up to two blocks per step. When the next queue is full the block
//!   is freed by the thread that allocated it: such frees are counted as `local_frees`.
//! - `handoff_msg`: a pipeline of thread-pool stages: each block goes to thread i+1 as one
//!   message through a `Mutex<VecDeque>` + `Condvar` mailbox; thread i+1 waits for it and frees
//!   it as soon as it arrives. Mailboxes are unbounded but stay short (each step sends one
//!   message and waits for one; each thread sends 8 ahead before the window), so no block is
//!   ever freed locally at 2 threads or more. p50/p99 include the wait for the message.
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
//! Cross-thread frees honour the `cudaFreeAsync` contract (every use of the block is ordered
//! before the free's stream). With `touch` in the `ptds` and `own` modes the producer records
//! its event after the memset and the receiving thread makes its stream wait on it before the
//! free (one event per producer, re-recorded per block: a wait takes the latest record, which
//! comes after the block's memset). In `legacy` mode every thread is on the same stream, so
//! nothing is needed. Without `touch` no stream carries any work, so there is nothing to order.
//!
//! In the handoff workloads (`handoff`, `handoff_msg`, `prodcons`) frees the allocating thread
//! makes itself (a fallback, or a ring of one thread) are counted apart as `local_frees`, and
//! blocks still queued when the window closes are freed afterwards and counted as
//! `drain_frees` (not in `pairs`).
//!
//! Measures: pairs (alloc + free) per second over a timed steady state (after each thread's
//! slots are filled), p50/p99 ns per pair (every 8th pair timed), peak live bytes (sampled every
//! millisecond from per-thread single-writer counters) and the sum of each thread's own peak
//! (`thread_peaks_ratio`: that sum over the peak, the memory ratio of keeping each thread's
//! peak), peak reserved bytes, driver calls per million operations in steady state, and
//! host-blocking synchronisations.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use cudarc::driver::sys;

use cuarena::address_tree::AddressTree;
use cuarena::device::cuda::{CudaDevice, check};
use cuarena::{Allocator, Config, Device, DeviceAddr, DeviceKind, Error, Event, Result, Stream};
use cuarena_testkit::cuda_kernels::CudaKernels;
use cuarena_testkit::{HostConfig, HostDevice};

pub mod replay;
mod waiters;

/// The primitives of `waiters.rs`, `std`'s: the loom model `loom-tests/tests/replay_waiters.rs`
/// includes that file with loom's in their place (one file, two sets of primitives, without a
/// dependency of the benchmark on loom). A park times out after 100 ms here, a backstop;
/// the model parks without one.
mod waiter_sync {
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
    pub(crate) use std::sync::{Mutex, MutexGuard};
    pub(crate) use std::thread::{Thread, current, yield_now};

    /// Yields before a waiter parks.
    pub(crate) const SPINS: usize = 64;

    pub(crate) fn park() {
        std::thread::park_timeout(std::time::Duration::from_millis(100));
    }
}

/// Cumulative figures an allocator reports about itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub peak_reserved: u64,
    pub driver_calls: u64,
    pub host_syncs: u64,
    /// Allocations served by a thread's arena and by the pool (allocators that report them).
    pub by_path: Option<(u64, u64)>,
    /// Events recorded as fences, streams made to wait on one, and fence polls
    /// (`cuEventQuery`), for allocators that report them.
    pub fences: Option<Fences>,
    /// Superblocks the arenas gave back to the pool (allocators that report them).
    pub superblocks_returned: Option<u64>,
}

/// Fence operations an allocator made (see [`Counts::fences`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fences {
    pub recorded: u64,
    pub waits: u64,
    pub polls: u64,
}

impl Fences {
    fn since(self, start: Fences) -> Fences {
        Fences {
            recorded: self.recorded - start.recorded,
            waits: self.waits - start.waits,
            polls: self.polls - start.polls,
        }
    }
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
        self.0.deallocate(DeviceAddr(ptr), size, stream)
    }
    fn counts(&self) -> Counts {
        let s = self.0.stats();
        Counts {
            peak_reserved: s.peak_reserved_bytes,
            driver_calls: s.driver_calls,
            host_syncs: s.host_syncs,
            by_path: Some((s.arena_allocations, s.pool_allocations)),
            fences: Some(Fences { recorded: s.fences_recorded, waits: s.fence_waits, polls: s.fence_polls }),
            superblocks_returned: Some(s.superblocks_returned),
        }
    }
    fn thread_end(&self) {
        let _ = self.0.release_thread();
    }
}

/// cuarena with a trace recording (`cuarena+trace`): the trace's overhead, measured in the same
/// run as plain `cuarena`. The trace goes to a file in the temporary folder, removed at drop.
struct CuarenaTraced {
    inner: Cuarena,
    path: std::path::PathBuf,
}

impl CuarenaTraced {
    fn new(a: Allocator) -> Result<CuarenaTraced> {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("cuarena-bench-{}-{n}.trace", std::process::id()));
        a.start_trace(&path)?;
        Ok(CuarenaTraced { inner: Cuarena(a), path })
    }
}

impl Drop for CuarenaTraced {
    fn drop(&mut self) {
        let _ = self.inner.0.stop_trace();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl BenchAlloc for CuarenaTraced {
    fn name(&self) -> &'static str {
        "cuarena+trace"
    }
    #[inline]
    fn alloc(&self, size: usize, stream: Stream) -> Result<u64> {
        self.inner.alloc(size, stream)
    }
    #[inline]
    fn free(&self, ptr: u64, size: usize, stream: Stream) -> Result<()> {
        self.inner.free(ptr, size, stream)
    }
    fn counts(&self) -> Counts {
        self.inner.counts()
    }
    fn thread_end(&self) {
        self.inner.thread_end()
    }
}

/// No allocator at all (`harness`, on request only): every allocation answers the same
/// address ([`HARNESS_ADDR`]) and every free does nothing. Nothing is dereferenced, so it runs
/// only without `touch`. Its pairs per second are a workload's ceiling with an allocator that
/// cost nothing: the harness's own work (the size draw, the slot choice, the latency samples,
/// `handoff`'s queues and `handoff_msg`'s mailboxes, the call through `dyn BenchAlloc`),
/// measured in the same run as the allocators, so that their own cost per pair can be read off
/// (`1 / a - 1 / harness` seconds a pair).
struct Harness;

/// The one address `Harness` hands out (256-byte aligned, never dereferenced).
pub const HARNESS_ADDR: u64 = 1 << 40;

impl BenchAlloc for Harness {
    fn name(&self) -> &'static str {
        "harness"
    }
    #[inline]
    fn alloc(&self, _size: usize, _stream: Stream) -> Result<u64> {
        Ok(HARNESS_ADDR)
    }
    #[inline]
    fn free(&self, _ptr: u64, _size: usize, _stream: Stream) -> Result<()> {
        Ok(())
    }
    fn counts(&self) -> Counts {
        Counts::default()
    }
}

/// Allocators that run only when asked for by name (`--allocators`), beside the default ones.
pub const ON_REQUEST: &[&str] = &["cuarena+trace", "harness"];

/// Whether allocator `name` can run a `touch` variant: `Harness` hands out no memory.
pub fn runs_touch(name: &str) -> bool {
    name != "harness"
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
            by_path: None,
            fences: None,
            superblocks_returned: None,
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
        Counts {
            peak_reserved: high,
            driver_calls: self.tally.calls.load(Ordering::Relaxed),
            host_syncs: 0,
            by_path: None,
            fences: None,
            superblocks_returned: None,
        }
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
        let too_big =
            || Error::OutOfMemory { requested: size, reserved: 0, in_use: 0, largest_free: 0, limit: 0 };
        let len = size.checked_next_multiple_of(256).ok_or_else(too_big)? as u64;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let a = match st.0.first_fit(len) {
            Some(a) => a,
            None => {
                let chunk = len.max(32 << 20);
                let p = self.dev.reserve(chunk as usize)?.ok_or_else(too_big)?;
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
            by_path: None,
            fences: None,
            superblocks_returned: None,
        }
    }
}

/// One measured point.
#[derive(Clone, Debug, Default)]
pub struct Point {
    pub allocator: String,
    pub device: &'static str,
    pub workload: String,
    /// The stream mode's name (`ptds`, `legacy`, `own`).
    pub streams: &'static str,
    pub threads: usize,
    /// Alloc + free pairs completed in the timed window.
    pub pairs: u64,
    pub secs: f64,
    pub pairs_per_sec: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub peak_live_bytes: u64,
    /// The sum over threads of each thread's own peak of live bytes, sampled with
    /// `peak_live_bytes`. Over `peak_live_bytes` it is the memory ratio of an allocator that
    /// keeps, per thread, exactly that thread's peak and nothing more: a floor for any design
    /// that caches memory per thread (peaks of different threads fall at different times).
    /// `None` for the handoff workloads, where a thread's count of what it allocated less what
    /// it freed is not memory it holds.
    pub thread_peaks_bytes: Option<u64>,
    pub reserved_bytes: u64,
    pub driver_calls: u64,
    pub driver_calls_per_mop: f64,
    pub host_syncs: u64,
    pub kernel_concurrency: Option<u32>,
    /// Seconds to create the allocator and fill every thread's slots.
    pub setup_secs: f64,
    /// Seconds from the end of the measurement to the allocator's drop.
    pub teardown_secs: f64,
    /// Handoff workloads: frees in the timed window made by the thread that allocated the block
    /// (included in `pairs`). `None` where every free is local by design.
    pub local_frees: Option<u64>,
    /// Handoff workloads: blocks still queued when the window closed, freed after it (not in
    /// `pairs`).
    pub drain_frees: Option<u64>,
    /// Allocations in the timed window served by a thread's arena (cuarena only).
    pub arena_allocations: Option<u64>,
    /// Allocations in the timed window served by the pool (cuarena only).
    pub pool_allocations: Option<u64>,
    /// Fence operations in the timed window (cuarena only): with `pairs - local_frees`, the
    /// remote frees, they give the events recorded per remote free of the handoff workloads.
    pub fences: Option<Fences>,
    /// Superblocks the arenas gave back in the timed window (cuarena only).
    pub superblocks_returned: Option<u64>,
}

impl Point {
    /// Peak reserved over peak live.
    pub fn memory_ratio(&self) -> f64 {
        if self.peak_live_bytes == 0 { 0.0 } else { self.reserved_bytes as f64 / self.peak_live_bytes as f64 }
    }

    /// Sum of per-thread peaks over the peak of the total (see `thread_peaks_bytes`).
    pub fn thread_peaks_ratio(&self) -> Option<f64> {
        let sum = self.thread_peaks_bytes?;
        Some(if self.peak_live_bytes == 0 { 0.0 } else { sum as f64 / self.peak_live_bytes as f64 })
    }

    /// One JSON object (one line): the fields in this order, the times in seconds to 3 decimals,
    /// `pairs_per_sec` whole, `memory_ratio` to 3 decimals, `driver_calls_per_mop` to 1; `null`
    /// for a figure the point does not have.
    pub fn json(&self) -> String {
        let row = JsonRow {
            allocator: &self.allocator,
            device: self.device,
            workload: &self.workload,
            streams: self.streams,
            threads: self.threads,
            pairs: self.pairs,
            local_frees: self.local_frees,
            drain_frees: self.drain_frees,
            secs: round(self.secs, 3),
            pairs_per_sec: self.pairs_per_sec.round() as u64,
            p50_ns: self.p50_ns,
            p99_ns: self.p99_ns,
            peak_live_bytes: self.peak_live_bytes,
            reserved_bytes: self.reserved_bytes,
            memory_ratio: round(self.memory_ratio(), 3),
            thread_peaks_ratio: self.thread_peaks_ratio().map(|r| round(r, 3)),
            driver_calls: self.driver_calls,
            driver_calls_per_mop: round(self.driver_calls_per_mop, 1),
            host_syncs: self.host_syncs,
            kernel_concurrency: self.kernel_concurrency,
            setup_secs: round(self.setup_secs, 3),
            teardown_secs: round(self.teardown_secs, 3),
            arena_allocations: self.arena_allocations,
            pool_allocations: self.pool_allocations,
            fences_recorded: self.fences.map(|f| f.recorded),
            fence_waits: self.fences.map(|f| f.waits),
            fence_polls: self.fences.map(|f| f.polls),
            superblocks_returned: self.superblocks_returned,
        };
        serde_json::to_string(&row).expect("a row of numbers and strings serialises")
    }
}

/// A [`Point`] as `--json` prints it.
#[derive(serde::Serialize)]
struct JsonRow<'a> {
    allocator: &'a str,
    device: &'a str,
    workload: &'a str,
    streams: &'a str,
    threads: usize,
    pairs: u64,
    local_frees: Option<u64>,
    drain_frees: Option<u64>,
    secs: f64,
    pairs_per_sec: u64,
    p50_ns: u64,
    p99_ns: u64,
    peak_live_bytes: u64,
    reserved_bytes: u64,
    memory_ratio: f64,
    thread_peaks_ratio: Option<f64>,
    driver_calls: u64,
    driver_calls_per_mop: f64,
    host_syncs: u64,
    kernel_concurrency: Option<u32>,
    setup_secs: f64,
    teardown_secs: f64,
    arena_allocations: Option<u64>,
    pool_allocations: Option<u64>,
    fences_recorded: Option<u64>,
    fence_waits: Option<u64>,
    fence_polls: Option<u64>,
    superblocks_returned: Option<u64>,
}

/// `x` rounded to `decimals` places.
fn round(x: f64, decimals: i32) -> f64 {
    let m = 10f64.powi(decimals);
    (x * m).round() / m
}

/// Which streams the threads of a point allocate and free on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamMode {
    /// Each thread on its per-thread default stream (`CU_STREAM_PER_THREAD`).
    PerThread,
    /// Every thread on the legacy default stream (one stream for all).
    Legacy,
    /// Each thread on one non-blocking stream it creates for the point.
    Own,
}

impl StreamMode {
    pub const ALL: [StreamMode; 3] = [StreamMode::PerThread, StreamMode::Legacy, StreamMode::Own];

    pub fn name(self) -> &'static str {
        match self {
            StreamMode::PerThread => "ptds",
            StreamMode::Legacy => "legacy",
            StreamMode::Own => "own",
        }
    }

    /// One line for `--help`.
    pub fn describe(self) -> &'static str {
        match self {
            StreamMode::PerThread => "each thread on its per-thread default stream (0x2)",
            StreamMode::Legacy => "every thread on the legacy default stream (stream 0)",
            StreamMode::Own => {
                "each thread on one non-blocking stream it creates before the timed window \
                 and destroys after it"
            }
        }
    }

    pub fn parse(s: &str) -> Option<StreamMode> {
        StreamMode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// The workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    Churn,
    Handoff,
    HandoffMsg,
    ProdCons,
    Large,
    Mixed,
    RandomAllocations,
    MultiStream,
}

impl Workload {
    pub const ALL: [Workload; 8] = [
        Workload::Churn,
        Workload::Handoff,
        Workload::HandoffMsg,
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
            Workload::HandoffMsg => "handoff_msg",
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

    /// Whether blocks are freed by another thread than the one that allocated them.
    pub fn hands_off(self) -> bool {
        matches!(self, Workload::Handoff | Workload::HandoffMsg | Workload::ProdCons)
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
            Err(e) => Bench::host_default(format!("host-simulated device (no GPU: {e})")),
        }
    }

    /// The simulated device the suite runs on without a GPU (1 TiB, completion at once).
    pub fn host_default(description: String) -> Bench {
        Bench::on_host(
            HostConfig { capacity: 1 << 40, max_delay: Duration::ZERO, ..HostConfig::default() },
            description,
        )
    }

    /// The suite on a simulated device with these settings.
    pub fn on_host(cfg: HostConfig, description: String) -> Bench {
        let h = Arc::new(HostDevice::new(cfg));
        Bench { device: h.clone(), cuda: None, host: Some(h), kernels: None, description }
    }

    /// Race-checker findings of the simulated device so far (empty on a GPU).
    pub fn host_violations(&self) -> Vec<String> {
        self.host.as_ref().map(|h| h.violations()).unwrap_or_default()
    }

    /// Creates a non-blocking stream (a `own` mode thread's).
    fn create_stream(&self) -> Result<Stream> {
        if let Some(d) = &self.cuda {
            let _g = d.enter()?;
            let mut s = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: `s` is a valid out-pointer and the context is current.
            check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
            Ok(Stream::from_raw(s as usize))
        } else if let Some(h) = &self.host {
            Ok(h.create_stream())
        } else {
            Err(Error::NoDriver)
        }
    }

    /// Destroys a stream from [`Bench::create_stream`]; work queued on it still completes.
    fn destroy_stream(&self, s: Stream) -> Result<()> {
        if let Some(d) = &self.cuda {
            let _g = d.enter()?;
            // SAFETY: the stream came from `create_stream` and is destroyed once, by its thread.
            check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s.as_raw() as sys::CUstream) })
        } else if let Some(h) = &self.host {
            h.destroy_stream(s)
        } else {
            Err(Error::NoDriver)
        }
    }

    pub fn kind(&self) -> DeviceKind {
        self.device.kind()
    }

    /// The allocators compared on this device.
    pub fn allocator_names(&self) -> Vec<&'static str> {
        match self.kind() {
            DeviceKind::Cuda => vec!["cuarena", "cuMemAllocAsync", "cuMemAlloc"],
            // The host device, and any later kind: the baseline that needs no driver.
            _ => vec!["cuarena", "mutex-first-fit"],
        }
    }

    fn make(&self, name: &str) -> Result<Box<dyn BenchAlloc>> {
        Ok(match name {
            "cuarena" => Box::new(Cuarena(Allocator::new(Arc::clone(&self.device), Config::from_env()?)?)),
            "cuarena+trace" => {
                Box::new(CuarenaTraced::new(Allocator::new(Arc::clone(&self.device), Config::from_env()?)?)?)
            }
            "harness" => Box::new(Harness),
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
        mode: StreamMode,
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
        if touch && !runs_touch(alloc_name) {
            return Err(Error::Config(format!(
                "{alloc_name} hands out no memory: it runs only without touch (--no-touch)"
            )));
        }
        let t_start = Instant::now();
        let alloc: Arc<dyn BenchAlloc> = Arc::from(self.make(alloc_name)?);
        let threads = if w == Workload::RandomAllocations { 1 } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        // Touched blocks handed to a thread on another stream need ordering: one event per
        // producer (see the module comment).
        let events: Vec<Event> = if touch && w.hands_off() && mode != StreamMode::Legacy {
            (0..threads).map(|_| self.device.create_event()).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let shared = Shared::new(threads, events);
        let barrier = Barrier::new(threads + 1);
        let run =
            Run { bench: self, alloc: &*alloc, w, touch, mode, threads, shared: &shared, barrier: &barrier };
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
            shared.wake_all();
            t_stop = Instant::now();
            let end_counts = alloc.counts();
            start_counts.driver_calls = end_counts.driver_calls - start_counts.driver_calls;
            start_counts.host_syncs = end_counts.host_syncs - start_counts.host_syncs;
            start_counts.by_path = match (start_counts.by_path, end_counts.by_path) {
                (Some((a0, p0)), Some((a1, p1))) => Some((a1 - a0, p1 - p0)),
                _ => None,
            };
            start_counts.fences = end_counts.fences.zip(start_counts.fences).map(|(e, s)| e.since(s));
            start_counts.superblocks_returned =
                end_counts.superblocks_returned.zip(start_counts.superblocks_returned).map(|(e, s)| e - s);
            h.join().expect("bench pool panicked")
        });
        for &e in &shared.events {
            self.device.destroy_event(e);
        }
        let (mut pairs, mut local, mut drained) = (0u64, 0u64, 0u64);
        let mut lat: Vec<u32> = Vec::new();
        for r in results {
            let wk = r?;
            pairs += wk.pairs;
            local += wk.local_frees;
            drained += wk.drain_frees;
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
            streams: mode.name(),
            threads,
            pairs,
            local_frees: w.hands_off().then_some(local),
            drain_frees: w.hands_off().then_some(drained),
            secs: elapsed,
            pairs_per_sec: pairs as f64 / elapsed,
            p50_ns: pct(0.5),
            p99_ns: pct(0.99),
            peak_live_bytes: shared.peak.load(Ordering::Relaxed),
            thread_peaks_bytes: (!w.hands_off())
                .then(|| shared.thread_peaks.iter().map(|p| p.load(Ordering::Relaxed)).sum()),
            reserved_bytes: counts.peak_reserved,
            driver_calls: start_counts.driver_calls,
            driver_calls_per_mop: start_counts.driver_calls as f64 * 1e6 / (2 * pairs).max(1) as f64,
            host_syncs: start_counts.host_syncs,
            arena_allocations: start_counts.by_path.map(|b| b.0),
            pool_allocations: start_counts.by_path.map(|b| b.1),
            fences: start_counts.fences,
            superblocks_returned: start_counts.superblocks_returned,
            kernel_concurrency: concurrency,
        })
    }
}

#[repr(align(128))]
#[derive(Default)]
struct PaddedLive(AtomicI64);

/// A block handed to another thread, with the thread that allocated it.
#[derive(Clone, Copy, Debug)]
struct Msg {
    ptr: u64,
    size: usize,
    from: usize,
}

/// `handoff_msg`'s per-thread inbox: a locked queue and a condition variable.
#[repr(align(128))]
#[derive(Default)]
struct Mailbox {
    state: Mutex<MailState>,
    cv: Condvar,
}

#[derive(Default)]
struct MailState {
    msgs: VecDeque<Msg>,
    /// The owner sleeps on `cv`: a sender must notify (otherwise it skips the syscall).
    waiting: bool,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, MailState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, m: Msg) {
        let mut st = self.lock();
        st.msgs.push_back(m);
        let wake = st.waiting;
        drop(st);
        if wake {
            self.cv.notify_one();
        }
    }

    /// The next message, waiting for one; `None` once `stop` is set and none is queued.
    fn recv(&self, stop: &AtomicBool) -> Option<Msg> {
        let mut st = self.lock();
        loop {
            if let Some(m) = st.msgs.pop_front() {
                return Some(m);
            }
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            st.waiting = true;
            // The timeout only bounds a missed stop; senders notify a waiting owner.
            st = self.cv.wait_timeout(st, Duration::from_millis(1)).unwrap_or_else(|p| p.into_inner()).0;
            st.waiting = false;
        }
    }

    fn try_recv(&self) -> Option<Msg> {
        self.lock().msgs.pop_front()
    }
}

struct Shared {
    go: AtomicBool,
    stop: AtomicBool,
    live: Vec<PaddedLive>,
    peak: AtomicU64,
    /// Each thread's own peak of `live`, sampled with `peak`.
    thread_peaks: Vec<AtomicU64>,
    queues: Vec<ArrayQueue<Msg>>,
    mail: Vec<Mailbox>,
    /// Each producer's ordering event (empty when blocks need no ordering).
    events: Vec<Event>,
    /// Workers meet here after they stop producing and before they drain their queues.
    stopped: Barrier,
}

impl Shared {
    fn new(threads: usize, events: Vec<Event>) -> Shared {
        Shared {
            go: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            live: (0..threads).map(|_| PaddedLive::default()).collect(),
            peak: AtomicU64::new(0),
            thread_peaks: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            queues: (0..threads).map(|_| ArrayQueue::new(256)).collect(),
            mail: (0..threads).map(|_| Mailbox::default()).collect(),
            events,
            stopped: Barrier::new(threads),
        }
    }

    fn sample_live(&self) {
        let mut sum = 0;
        for (l, p) in self.live.iter().zip(&self.thread_peaks) {
            let v = l.0.load(Ordering::Relaxed);
            p.fetch_max(v.max(0) as u64, Ordering::Relaxed);
            sum += v;
        }
        self.peak.fetch_max(sum.max(0) as u64, Ordering::Relaxed);
    }

    /// Wakes every thread waiting for a message (after `stop`).
    fn wake_all(&self) {
        for m in &self.mail {
            let _g = m.lock();
            m.cv.notify_all();
        }
    }
}

struct Run<'a> {
    bench: &'a Bench,
    alloc: &'a dyn BenchAlloc,
    w: Workload,
    touch: bool,
    mode: StreamMode,
    threads: usize,
    shared: &'a Shared,
    barrier: &'a Barrier,
}

#[derive(Default)]
struct Worker {
    pairs: u64,
    lat: Vec<u32>,
    local_frees: u64,
    drain_frees: u64,
}

/// Blocks each `handoff_msg` thread sends before the timed window, so that a receiver seldom
/// finds its mailbox empty.
const MSG_PREFILL: usize = 8;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Log-uniform in `[lo, hi)`: `lo · (hi/lo)^u`. For the workloads' ranges (`hi / lo` a
    /// power of two, `2^L`) it is `lo · 2^k · 2^f` with `k + f = u·L`, `2^f` from a polynomial
    /// ([`exp2_frac`], a table): libm's `exp` was a tenth of a one-thread churn pair's time, the
    /// harness's cost, not the allocator's.
    fn log_uniform(&mut self, lo: usize, hi: usize) -> usize {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        if lo.is_power_of_two() && hi.is_power_of_two() && hi > lo {
            let x = u * f64::from(hi.trailing_zeros() - lo.trailing_zeros());
            let k = x as u32; // floor: x >= 0
            return ((lo << k) as f64 * exp2_frac(x - f64::from(k))) as usize;
        }
        (lo as f64 * (u * (hi as f64 / lo as f64).ln()).exp()) as usize
    }
}

/// `2^(j/256)` for `j` in `0..=256`, by repeated multiplication (error a few ulps).
const EXP2_TABLE: [f64; 257] = {
    const STEP: f64 = 1.002_711_275_050_202_5; // 2^(1/256)
    let mut t = [1.0; 257];
    let mut j = 1;
    while j < 257 {
        t[j] = t[j - 1] * STEP;
        j += 1;
    }
    t
};

/// `2^f` for `f` in `[0, 1)`: [`EXP2_TABLE`] with linear interpolation between its entries
/// (relative error under 10^-6; a chord lies above the convex curve, and at most at the next
/// entry, so the result stays under 2 and a draw under `hi`). Two loads, a multiply and an add.
#[inline]
fn exp2_frac(f: f64) -> f64 {
    let x = f * 256.0;
    let j = (x as usize).min(255);
    let (a, b) = (EXP2_TABLE[j], EXP2_TABLE[j + 1]);
    a + (b - a) * (x - j as f64)
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

    /// Allocates a block for another thread: after the allocation (and memset), the producer's
    /// event is recorded when blocks need ordering.
    fn produce(&self, t: usize, rng: &mut Rng, stream: Stream) -> Result<Msg> {
        let size = self.size(rng);
        let ptr = self.alloc(t, size, stream)?;
        if let Some(&e) = self.shared.events.get(t) {
            self.bench.device.record_event(e, stream)?;
        }
        Ok(Msg { ptr, size, from: t })
    }

    /// Frees a block another thread may have allocated, on this thread's stream, after making
    /// that stream wait for the producer's work when it needs to. Returns whether the free was
    /// local (made by the thread that allocated the block).
    fn consume(&self, t: usize, m: Msg, stream: Stream) -> Result<bool> {
        let local = m.from == t;
        if !local && let Some(&e) = self.shared.events.get(m.from) {
            self.bench.device.stream_wait_event(stream, e)?;
        }
        self.free(t, m.ptr, m.size, stream)?;
        Ok(local)
    }

    fn worker(&self, t: usize) -> Result<Worker> {
        let (stream, made) = match self.mode {
            StreamMode::PerThread => (Ok(Stream::PER_THREAD), false),
            StreamMode::Legacy => (Ok(Stream::LEGACY), false),
            StreamMode::Own => (self.bench.create_stream(), true),
        };
        let (r, own) = match stream {
            Ok(s) => (self.work(t, s, None), made.then_some(s)),
            // Still meet the others at every barrier; drain on the per-thread stream.
            Err(e) => (self.work(t, Stream::PER_THREAD, Some(e)), None),
        };
        self.alloc.thread_end();
        match own {
            Some(s) => {
                let d = self.bench.destroy_stream(s);
                r.and_then(|w| d.map(|()| w))
            }
            None => r,
        }
    }

    fn work(&self, t: usize, st: Stream, mut failure: Option<Error>) -> Result<Worker> {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
        let nslots = match self.w {
            Workload::Churn | Workload::Mixed => 256,
            Workload::Large => 8,
            _ => 0,
        };
        let mut slots: Vec<(u64, usize)> = Vec::with_capacity(nslots);
        if failure.is_none() {
            for _ in 0..nslots {
                let s = self.size(&mut rng);
                match self.alloc(t, s, st) {
                    Ok(p) => slots.push((p, s)),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        let next = (t + 1) % self.threads;
        if self.w == Workload::HandoffMsg && failure.is_none() {
            for _ in 0..MSG_PREFILL {
                match self.produce(t, &mut rng, st) {
                    Ok(m) => self.shared.mail[next].send(m),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        self.barrier.wait();
        while !self.shared.go.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        let mut wk = Worker { lat: Vec::with_capacity(1 << 16), ..Worker::default() };
        let mut random_live: Vec<(u64, usize)> = Vec::new();
        while failure.is_none() && !self.shared.stop.load(Ordering::Relaxed) {
            let timed = wk.pairs.is_multiple_of(8) && wk.lat.len() < wk.lat.capacity();
            let t0 = if timed { Some(Instant::now()) } else { None };
            let r: Result<u64> = match self.w {
                Workload::Churn | Workload::Mixed | Workload::Large => {
                    let i = (rng.next() % slots.len() as u64) as usize;
                    let (p, s) = slots[i];
                    self.free(t, p, s, st).and_then(|()| {
                        let s = self.size(&mut rng);
                        let p = self.alloc(t, s, st)?;
                        slots[i] = (p, s);
                        Ok(1)
                    })
                }
                Workload::Handoff => self.handoff(t, &mut rng, st, &mut wk.local_frees),
                Workload::HandoffMsg => self.handoff_msg(t, &mut rng, st, &mut wk.local_frees),
                Workload::ProdCons => self.prodcons(t, &mut rng, st, &mut wk.local_frees),
                Workload::RandomAllocations => {
                    if random_live.len() < 100_000 && (random_live.is_empty() || rng.next().is_multiple_of(2))
                    {
                        let s = self.size(&mut rng);
                        self.alloc(t, s, st).map(|p| {
                            random_live.push((p, s));
                            0
                        })
                    } else {
                        let i = (rng.next() % random_live.len() as u64) as usize;
                        let (p, s) = random_live.swap_remove(i);
                        self.free(t, p, s, st).map(|()| 1)
                    }
                }
                Workload::MultiStream => {
                    let k = self.bench.kernels.as_ref().expect("multi_stream runs only with kernels");
                    self.alloc(t, 1 << 20, st).and_then(|p| {
                        k.spin(200_000, st)?;
                        self.free(t, p, 1 << 20, st).map(|()| 1)
                    })
                }
            };
            match r {
                Ok(n) => wk.pairs += n,
                Err(e) => failure = Some(e),
            }
            if let Some(t0) = t0 {
                wk.lat.push(t0.elapsed().as_nanos().min(u32::MAX as u128) as u32);
            }
        }
        // Drain: every block back, after every thread has stopped sending.
        self.shared.stopped.wait();
        let mut drained = Ok(());
        for (p, s) in slots.drain(..).chain(random_live.drain(..)) {
            drained = drained.and_then(|()| self.free(t, p, s, st));
        }
        while let Some(m) = self.shared.queues[t].pop().or_else(|| self.shared.mail[t].try_recv()) {
            wk.drain_frees += 1;
            drained = drained.and_then(|()| self.consume(t, m, st).map(drop));
        }
        if let (Workload::MultiStream, Some(k)) = (self.w, &self.bench.kernels) {
            drained = drained.and_then(|()| k.synchronize());
        }
        match failure {
            Some(e) => Err(e),
            None => drained.map(|()| wk),
        }
    }

    /// Allocates one block for the next thread and frees up to two the previous one sent. When
    /// the next thread's queue is full, the block is freed here: a local free.
    fn handoff(&self, t: usize, rng: &mut Rng, st: Stream, local: &mut u64) -> Result<u64> {
        let m = self.produce(t, rng, st)?;
        let next = (t + 1) % self.threads;
        let mut n = 0;
        if let Err(m) = self.shared.queues[next].push(m) {
            self.consume(t, m, st)?;
            *local += 1;
            n += 1;
        }
        for _ in 0..2 {
            match self.shared.queues[t].pop() {
                Some(m) => {
                    *local += u64::from(self.consume(t, m, st)?);
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }

    /// Sends one block to the next thread as one message, then waits for the previous
    /// thread's message and frees its block at once.
    fn handoff_msg(&self, t: usize, rng: &mut Rng, st: Stream, local: &mut u64) -> Result<u64> {
        let m = self.produce(t, rng, st)?;
        self.shared.mail[(t + 1) % self.threads].send(m);
        match self.shared.mail[t].recv(&self.shared.stop) {
            Some(m) => {
                *local += u64::from(self.consume(t, m, st)?);
                Ok(1)
            }
            None => Ok(0),
        }
    }

    /// Producers (even threads) allocate into their queue; consumers (odd) free from their
    /// producer's queue. A single thread, or the last even one of an odd count, does both
    /// (local frees).
    fn prodcons(&self, t: usize, rng: &mut Rng, st: Stream, local: &mut u64) -> Result<u64> {
        let producer = t.is_multiple_of(2);
        let q = &self.shared.queues[t & !1];
        let mut n = 0;
        if producer && q.len() < q.capacity() {
            let m = self.produce(t, rng, st)?;
            if let Err(m) = q.push(m) {
                self.consume(t, m, st)?;
                *local += 1;
                n += 1;
            }
        }
        if (!producer || self.threads == 1 || t + 1 == self.threads)
            && let Some(m) = q.pop()
        {
            *local += u64::from(self.consume(t, m, st)?);
            n += 1;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_bench(max_delay: Duration) -> Bench {
        Bench::on_host(
            HostConfig { capacity: 1 << 36, min_delay: Duration::ZERO, max_delay, ..HostConfig::default() },
            "test".into(),
        )
    }

    #[test]
    fn exp2_frac_is_two_to_the_f_and_stays_under_two() {
        let mut worst: f64 = 0.0;
        for i in 0..=100_000 {
            let f = f64::from(i) / 100_001.0;
            let (got, want) = (exp2_frac(f), f.exp2());
            assert!((1.0..2.0).contains(&got), "2^{f} = {got}");
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 1e-6, "relative error {worst}");
    }

    #[test]
    fn log_uniform_draws_stay_in_range_and_spread_evenly_over_octaves() {
        for (lo, hi) in [(256usize, 1usize << 20), (1 << 20, 64 << 20), (256, 64 << 10), (1000, 3000)] {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
            let octaves = (hi as f64 / lo as f64).log2();
            let buckets = octaves.ceil() as usize;
            let mut count = vec![0u32; buckets];
            let n = 200_000;
            for _ in 0..n {
                let s = rng.log_uniform(lo, hi);
                assert!((lo..hi).contains(&s), "{s} outside [{lo}, {hi})");
                count[((s as f64 / lo as f64).log2() as usize).min(buckets - 1)] += 1;
            }
            // Each whole octave holds 1/octaves of the draws (within 3%).
            for (b, &c) in count.iter().enumerate().take(octaves.floor() as usize) {
                let share = f64::from(c) / f64::from(n) * octaves;
                assert!((share - 1.0).abs() < 0.03, "[{lo}, {hi}) octave {b}: {share}");
            }
        }
    }

    #[test]
    fn stream_modes_round_trip_their_names() {
        for m in StreamMode::ALL {
            assert_eq!(StreamMode::parse(m.name()), Some(m));
        }
        assert_eq!(StreamMode::parse("null"), None);
        assert_eq!(Workload::parse("handoff_msg"), Some(Workload::HandoffMsg));
    }

    /// Touched blocks freed by another thread, on another stream, are ordered after the
    /// producer's memset: the simulated device's race checker (memsets take up to 300 µs here)
    /// finds nothing, in every stream mode and every handoff workload.
    #[test]
    fn handed_off_touched_blocks_are_ordered_in_every_mode() {
        let b = host_bench(Duration::from_micros(300));
        for w in [Workload::Handoff, Workload::HandoffMsg, Workload::ProdCons] {
            for mode in StreamMode::ALL {
                let p = b.run("cuarena", w, true, mode, 3, 0.05).expect("a point");
                assert!(p.pairs > 0, "{}", p.json());
                assert_eq!(p.streams, mode.name());
                let v = b.host_violations();
                assert!(v.is_empty(), "{} {}: {} races, first: {}", w.name(), mode.name(), v.len(), v[0]);
            }
        }
    }

    /// `handoff_msg` frees every block on another thread than the one that allocated it at 2
    /// threads or more; with one thread every free is local, and says so.
    #[test]
    fn handoff_msg_counts_local_frees_apart() {
        let b = host_bench(Duration::ZERO);
        for mode in StreamMode::ALL {
            let p = b.run("cuarena", Workload::HandoffMsg, false, mode, 2, 0.03).expect("a point");
            assert!(p.pairs > 0, "{}", p.json());
            assert_eq!(p.local_frees, Some(0), "{}", p.json());
            // Each thread sent MSG_PREFILL blocks ahead, so some are still queued at the end.
            let d = p.drain_frees.expect("counted");
            assert!(d <= 2 * (MSG_PREFILL as u64 + 1), "{}", p.json());
            let p = b.run("cuarena", Workload::HandoffMsg, false, mode, 1, 0.02).expect("a point");
            assert_eq!(p.local_frees, Some(p.pairs), "{}", p.json());
        }
        let p = b.run("cuarena", Workload::Churn, false, StreamMode::Own, 1, 0.02).expect("a point");
        assert_eq!((p.local_frees, p.drain_frees), (None, None));
    }

    #[test]
    fn thread_peaks_are_at_least_the_peak_of_the_total_and_absent_for_handoffs() {
        let b = host_bench(Duration::ZERO);
        let p = b.run("cuarena", Workload::Churn, false, StreamMode::PerThread, 2, 0.05).expect("a point");
        // Both come from the same samples, and each sample's total is at most the sum of the
        // threads' peaks so far.
        let sum = p.thread_peaks_bytes.expect("churn has them");
        assert!(p.peak_live_bytes > 0 && sum >= p.peak_live_bytes, "{}", p.json());
        assert!(p.thread_peaks_ratio().expect("churn") >= 1.0, "{}", p.json());
        let p = b.run("cuarena", Workload::Handoff, false, StreamMode::PerThread, 2, 0.02).expect("a point");
        assert_eq!(p.thread_peaks_bytes, None, "{}", p.json());
        assert!(p.json().contains("\"thread_peaks_ratio\":null"), "{}", p.json());
    }

    #[test]
    fn the_harness_runs_every_workload_without_memory_and_refuses_touch() {
        let b = host_bench(Duration::ZERO);
        for w in [Workload::Churn, Workload::Handoff, Workload::HandoffMsg, Workload::Large] {
            let p = b.run("harness", w, false, StreamMode::PerThread, 2, 0.02).expect("a point");
            assert!(p.pairs > 0, "{}", p.json());
            // It holds nothing and calls nothing: its rows are the harness alone.
            assert_eq!((p.reserved_bytes, p.driver_calls, p.host_syncs), (0, 0, 0), "{}", p.json());
            assert_eq!(p.allocator, "harness");
        }
        let e = b.run("harness", Workload::Churn, true, StreamMode::PerThread, 1, 0.02).unwrap_err();
        assert!(e.to_string().contains("--no-touch"), "{e}");
        assert!(runs_touch("cuarena") && !runs_touch("harness"));
    }

    #[test]
    fn json_rows_carry_the_stream_mode_and_the_pairs() {
        let b = host_bench(Duration::ZERO);
        let p =
            b.run("mutex-first-fit", Workload::Handoff, false, StreamMode::Legacy, 2, 0.02).expect("a point");
        let j = p.json();
        let v: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        assert_eq!((v["pairs"].as_u64(), v["threads"].as_u64()), (Some(p.pairs), Some(2)), "{j}");
        assert!(j.contains("\"streams\":\"legacy\""), "{j}");
        assert!(j.contains(&format!("\"pairs\":{},", p.pairs)) && p.pairs > 0, "{j}");
        assert!(j.contains(&format!("\"local_frees\":{},", p.local_frees.expect("handoff"))), "{j}");
        let p = b.run("cuarena", Workload::Churn, false, StreamMode::Own, 1, 0.02).expect("a point");
        assert!(p.json().contains("\"streams\":\"own\"") && p.json().contains("\"local_frees\":null"));
        let by_path = p.arena_allocations.zip(p.pool_allocations).expect("cuarena reports its paths");
        assert!(by_path.0 + by_path.1 > 0, "{}", p.json());
        assert!(j.contains("\"arena_allocations\":null"), "the baseline has no paths: {j}");
    }
}
