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

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use crate::allocator::{Allocator, DevicePtr};
use crate::device::Device;
use crate::device::cuda::CudaDevice;
use crate::device::cuda_kernels::CudaKernels;
use crate::device::host::HostDevice;
use crate::error::Result;
use crate::stream::Stream;

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
    ptr: DevicePtr,
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
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..p.threads).map(|_| mpsc::channel::<(Block, crate::device::Event)>()).unzip();
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
            let receive = |blk: Block, ev: crate::device::Event| -> Result<()> {
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
