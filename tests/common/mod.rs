//! What the adversarial test files share: a simulated device, a small configuration, a
//! generator, a map of live blocks that reports overlaps, and worker threads. The end-of-test
//! check is `cuarena_testkit::assert_all_returned`.
#![allow(dead_code)] // each test file uses its own subset

pub mod cli;

use std::collections::BTreeMap;
use std::sync::{Mutex, mpsc};
use std::time::Duration;

use cuarena::{Allocator, Config, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, host_allocator};

pub fn host(max_delay_us: u64) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity: 1 << 30,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(max_delay_us),
        ..HostConfig::default()
    })
}

/// A `CUARENA_CONF` string that the test knows to be valid.
pub fn parse(s: &str) -> Config {
    Config::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

pub fn small() -> cuarena::ConfigBuilder {
    Config::builder().small_max(64 << 10).superblock(256 << 10).chunk(1 << 20)
}

/// An upper bound of the return rule's recent peak `û` (`arena.rs`, "The recent peak"), in
/// bytes, for an arena without large superblocks whose owner alone frees, on the per-thread
/// stream: start it at the live bytes' peak before the first free and call
/// [`RecentPeak::after_free`] after each own free of a block of the arena's superblocks (not
/// of one a dissolved superblock left in the pool: [`in_arena`] before the free tells), each a
/// call of the rule. It decays only by 2^-10 a call; the arena's `û` decays at least as much at
/// each call (it halves below an eighth, and decays again at each call inside a give-back), and
/// this step is monotone, so the arena's `û` is never above this one. `bound` is then the
/// rule's bound on what the arena holds: `max(û + K·S, û / (1 - f))`.
pub struct RecentPeak(pub u64);

impl RecentPeak {
    /// Granules: the rule counts in them.
    const G: u64 = 256;

    pub fn after_free(&mut self, live_bytes: u64) {
        let (u, r) = (live_bytes / Self::G, self.0 / Self::G);
        let r = if u == 0 { 0 } else { u.max(r.saturating_sub((r >> 10).max(1))) };
        self.0 = r * Self::G;
    }

    pub fn bound(&self, keep_empty: usize, superblock: usize, sparse: f64) -> f64 {
        let r = self.0 as f64;
        (r + (keep_empty * superblock) as f64).max(r / (1.0 - sparse))
    }
}

/// True if `p` lies in a superblock lent to an arena (see [`RecentPeak`]).
pub fn in_arena(a: &Allocator, p: DeviceAddr) -> bool {
    lent(a).iter().any(|&(b, l)| (b..b + l as u64).contains(&p.0))
}

/// A simulated device of `capacity` bytes whose work completes at once.
pub fn zero_delay(capacity: usize) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity,
        min_delay: Duration::ZERO,
        max_delay: Duration::ZERO,
        ..HostConfig::default()
    })
}

pub fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Live blocks of every thread: a second hand-out of a live byte is an overlap.
#[derive(Default)]
pub struct Live {
    map: Mutex<BTreeMap<u64, u64>>,
    errors: Mutex<Vec<String>>,
}

impl Live {
    /// A set holding `blocks` (address, length), checked for overlaps as they go in.
    pub fn of(blocks: &[(DeviceAddr, usize)]) -> Live {
        let live = Live::default();
        for &(p, len) in blocks {
            live.insert(p, len);
        }
        live
    }
    pub fn insert(&self, p: DeviceAddr, len: usize) {
        let (s, e) = (p.0, p.0 + len as u64);
        let mut m = self.map.lock().unwrap();
        let below = m.range(..e).next_back().map(|(&a, &b)| (a, b));
        if let Some((a, b)) = below
            && b > s
        {
            self.errors.lock().unwrap().push(format!("[{s:#x},{e:#x}) overlaps live [{a:#x},{b:#x})"));
        }
        m.insert(s, e);
    }
    pub fn remove(&self, p: DeviceAddr) {
        self.map.lock().unwrap().remove(&p.0);
    }
    pub fn assert_clean(&self) {
        let e = self.errors.lock().unwrap();
        assert!(e.is_empty(), "{} overlaps, first: {:?}", e.len(), &e[..e.len().min(5)]);
    }
}

/// Runs `f` on a fresh thread that releases its arena at the end.
pub fn on_thread<R: Send + 'static>(a: &Allocator, f: impl FnOnce(&Allocator) -> R + Send + 'static) -> R {
    let a = a.clone();
    std::thread::spawn(move || {
        let r = f(&a);
        a.release_thread().unwrap();
        r
    })
    .join()
    .unwrap()
}

/// A command for a [`Worker`].
type Job = Box<dyn FnOnce(&Allocator) + Send>;

/// A thread that stays alive (idle between commands) until dropped.
pub struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    pub fn new(a: &Allocator) -> Worker {
        let (tx, rx) = mpsc::channel::<Job>();
        let a = a.clone();
        let h = std::thread::spawn(move || {
            while let Ok(f) = rx.recv() {
                f(&a);
            }
            a.release_thread().unwrap();
        });
        Worker { tx: Some(tx), h: Some(h) }
    }
    pub fn run<R: Send + 'static>(&self, f: impl FnOnce(&Allocator) -> R + Send + 'static) -> R {
        let (rtx, rrx) = mpsc::channel();
        let job: Job = Box::new(move |a| rtx.send(f(a)).unwrap());
        self.tx.as_ref().unwrap().send(job).unwrap();
        rrx.recv().expect("the worker panicked")
    }
}

impl Worker {
    /// Ends the thread (it releases its arena) and waits for it.
    pub fn exit(self) {
        drop(self);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.tx.take());
        let r = self.h.take().unwrap().join();
        if !std::thread::panicking() {
            r.expect("the worker panicked");
        }
    }
}

/// Runs `f` on another thread; fails if it does not end within `secs` (a deadlock), and passes
/// on its panic if it panics.
pub fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(r) => r,
        Err(mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("sent nothing and did not panic"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: not done in {secs} s"),
    }
}

/// True if the free was refused as invalid (any reason).
pub fn is_invalid(r: &cuarena::Result<()>) -> bool {
    matches!(r, Err(Error::InvalidFree { .. }))
}

/// True if the free was refused as a double free.
pub fn is_double(r: &cuarena::Result<()>) -> bool {
    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
}

/// A tag at the head and at the tail of a block (the tail catches an overlap from above),
/// written on `s`.
pub fn tag(sim: &HostDevice, p: DeviceAddr, size: usize, t: u32, s: Stream) {
    sim.write_tag(p.0, 256, t, s).unwrap();
    if size > 512 {
        sim.write_tag(p.0 + (size as u64 & !255) - 256, 256, t ^ 0x5555, s).unwrap();
    }
}

/// A block a test thread holds: its size, and the stream and tag it was last written with.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub p: DeviceAddr,
    pub size: usize,
    pub s: Stream,
    pub t: u32,
}

impl Held {
    /// A block just allocated for `s`: recorded in `live` (an overlap is an error there) and
    /// tagged on `s` with the next tag after `tagn`.
    pub fn taken(
        sim: &HostDevice,
        live: &Live,
        p: DeviceAddr,
        size: usize,
        s: Stream,
        tagn: &mut u32,
    ) -> Held {
        live.insert(p, size);
        *tagn += 1;
        tag(sim, p, size, *tagn, s);
        Held { p, size, s, t: *tagn }
    }
}

/// Checks on `s` the tags [`tag`] wrote (mismatches count in the device's `tag_errors`).
pub fn check(sim: &HostDevice, p: DeviceAddr, size: usize, t: u32, s: Stream) {
    sim.check_tag(p.0, 256, t, s).unwrap();
    if size > 512 {
        sim.check_tag(p.0 + (size as u64 & !255) - 256, 256, t ^ 0x5555, s).unwrap();
    }
}

/// A simulated device roomy enough (8 GiB) that no out-of-memory reclaim runs (it would give
/// back superblocks outside the return rule).
pub fn roomy() -> HostDevice {
    HostDevice::new(HostConfig { capacity: 8 << 30, ..HostConfig::default() })
}

/// A size log-uniform in 1 MiB ..= 64 MiB (the benchmark's `large` workload).
pub fn large_size(x: &mut u64) -> usize {
    let u = (rng(x) >> 11) as f64 / (1u64 << 53) as f64;
    ((1u64 << 20) as f64 * 64f64.powf(u)) as usize
}

/// Slots of live blocks (address, size) for [`large_churn`].
pub type Slots = Vec<Option<(DeviceAddr, usize)>>;

/// The benchmark's `large` churn on `s`: each pair frees the block of a random slot and
/// allocates a new size in its place, every block checked aligned and against the others.
/// With eight slots this is what teaches an arena the return rule's slack `E`.
pub fn large_churn(a: &Allocator, live: &Live, slots: &mut Slots, x: &mut u64, pairs: usize, s: Stream) {
    for _ in 0..pairs {
        let k = rng(x) as usize % slots.len();
        if let Some((p, n)) = slots[k].take() {
            live.remove(p);
            a.deallocate(p, n, s).unwrap();
        }
        let n = large_size(x);
        let p = a.allocate(n, s).unwrap();
        assert_eq!(p.0 % 256, 0, "alignment");
        live.insert(p, n);
        slots[k] = Some((p, n));
    }
}

/// Frees every block in `slots`.
pub fn free_all(a: &Allocator, live: &Live, slots: &mut Slots, s: Stream) {
    for (p, n) in slots.iter_mut().filter_map(Option::take) {
        live.remove(p);
        a.deallocate(p, n, s).unwrap();
    }
}

/// Uses `blocks` (address, length) on a fresh thread's per-thread stream (a long hold with a
/// tag check, tags from `tag0`) and returns while those uses still run. A later free of them on
/// the legacy stream covers these uses (legacy work waits for all earlier per-thread work); a
/// reuse on yet another per-thread stream is ordered after them only through a legacy-stream
/// action, which the simulator's race checker sees.
pub fn use_on_another_thread(sim: &HostDevice, blocks: &[(DeviceAddr, usize)], tag0: u32, hold_ms: u64) {
    let (sim2, blocks) = (sim.clone(), blocks.to_vec());
    std::thread::spawn(move || {
        for (i, (p, len)) in blocks.iter().enumerate() {
            sim2.hold_and_check(
                p.0,
                *len,
                tag0 + i as u32,
                Duration::from_millis(hold_ms),
                Stream::PER_THREAD,
            )
            .unwrap();
        }
    })
    .join()
    .unwrap();
}

/// An allocator on `sim` with the configuration `b` builds.
pub fn alloc_with(sim: &HostDevice, b: cuarena::ConfigBuilder) -> Allocator {
    host_allocator(sim.clone(), b.build().unwrap()).unwrap()
}

/// Waits for all of `sim`'s work, then checks that it saw no race, no overwritten tag (a block
/// reused under running work) and no call on a destroyed stream's handle.
pub fn no_violations(sim: &HostDevice) {
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0, "a block was reused under running work");
    assert_eq!(sim.stale_handle_calls(), 0);
}

/// After the allocator and every clone of its device are dropped: [`no_violations`], and every
/// CUDA event the allocator created has been destroyed.
pub fn all_events_destroyed(sim: &HostDevice) {
    no_violations(sim);
    assert_eq!(sim.live_events(), 0, "events alive after the allocator's drop");
}

/// The end of a test: [`no_violations`], then a blocking trim, then everything returned
/// (`assert_all_returned`).
pub fn all_back(a: &Allocator, sim: &HostDevice) {
    no_violations(sim);
    a.trim(true).unwrap();
    cuarena_testkit::assert_all_returned(a, Some(sim), 0);
}

/// Superblocks the pool has lent now, as `(base, bytes)`.
pub fn lent(a: &Allocator) -> Vec<(u64, usize)> {
    a.pool_used_ranges().into_iter().filter(|r| r.2).map(|r| (r.0, r.1)).collect()
}

/// The lent superblock holding `p`.
pub fn superblock_of(a: &Allocator, p: u64) -> (u64, usize) {
    lent(a)
        .into_iter()
        .find(|&(b, l)| (b..b + l as u64).contains(&p))
        .unwrap_or_else(|| panic!("{p:#x} lies in no lent superblock: {:?}", lent(a)))
}
