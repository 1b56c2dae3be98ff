//! What the adversarial test files share: a simulated device, a small configuration, a
//! generator, a map of live blocks that reports overlaps, and the end-of-test check that every
//! byte came back.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::BTreeMap;
use std::sync::{Mutex, mpsc};
use std::time::Duration;

use cuarena::{Allocator, Config, DevicePtr, HostConfig, HostDevice};

pub fn host(max_delay_us: u64) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity: 1 << 30,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(max_delay_us),
        ..HostConfig::default()
    })
}

pub fn small() -> cuarena::ConfigBuilder {
    Config::builder().small_max(64 << 10).superblock(256 << 10).chunk(1 << 20)
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
    pub fn insert(&self, p: DevicePtr, len: usize) {
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
    pub fn remove(&self, p: DevicePtr) {
        self.map.lock().unwrap().remove(&p.0);
    }
    pub fn assert_clean(&self) {
        let e = self.errors.lock().unwrap();
        assert!(e.is_empty(), "{} overlaps, first: {:?}", e.len(), &e[..e.len().min(5)]);
    }
}

/// Checks the device's findings, the statistics and that everything comes back. The calling
/// thread is released; other threads must have released theirs.
pub fn assert_all_back(a: &Allocator, sim: &HostDevice, bad_frees: u64) {
    a.release_thread().unwrap();
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0, "tag errors: a block was reused under running work");
    a.check_invariants();
    let s = a.stats();
    assert_eq!(s.live_bytes, 0, "{s:?}");
    assert_eq!(s.invalid_frees, bad_frees, "{s:?}");
    assert_eq!(s.allocations, s.deallocations, "{s:?}");
    a.trim(true).unwrap();
    let s = a.stats();
    assert_eq!(a.pool_in_use(), 0, "still handed out: {:?}", a.pool_used_ranges());
    assert_eq!((s.arena_held_bytes, s.reserved_bytes, s.pool_in_use_bytes, s.arenas), (0, 0, 0, 0), "{s:?}");
    assert_eq!(sim.reserved_bytes(), 0, "the device still holds memory");
    assert!(a.take_deferred_error().is_none() || bad_frees > 0);
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

type Job = Box<dyn FnOnce(&Allocator) + Send>;

/// A thread that stays alive (idle between commands) until dropped.
pub struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    pub fn new(a: &Allocator) -> Worker {
        let (tx, rx) = mpsc::channel::<Box<dyn FnOnce(&Allocator) + Send>>();
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
        let job: Box<dyn FnOnce(&Allocator) + Send> = Box::new(move |a| rtx.send(f(a)).unwrap());
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
