//! Adversarial session 29: `fork()`.
//!
//! Real clients fork: PyTorch DataLoader workers (fork start method), pre-forking servers, C
//! programs that fork and return from `main` (glibc's `exit()` runs the calling thread's
//! thread-local destructors, `__call_tls_dtors`, *before* the `atexit` handlers, so cuarena's
//! per-thread slot destructor runs in the child on a copy of the parent's state). After fork only
//! the forking thread exists in the child; a lock another parent thread held stays locked for
//! ever, and every background thread is gone.
//!
//! Each test forks from its own (harness) thread, does the child's work, and ends the child with
//! `_exit` (no destructors) or `std::process::exit` (glibc's `exit`: this thread's thread-local
//! destructors, then the `atexit` handlers: what returning from `main` does). The parent polls
//! `waitpid(WNOHANG)` with a time limit and reports a child still running then as hung (with its
//! `/proc` state), then kills it. Tests are serialised (`serial()`), and the simulated device's
//! stream workers are let go idle before each fork (`quiesce`), so that a hang is cuarena's, not
//! the simulator's (a worker thread does not survive a fork).
//!
//! helper-43 wrote these tests against the code before the mend (`src/shutdown.rs`, "Fork"), and
//! seven of them failed then: children that hung at exit or in a call, and a parent's trace file
//! that a child's exit wrote into. Each asserts what a user needs: the child ends quickly, an
//! allocator made before the fork is refused in the child (`Error::Forked`) and never touched
//! there, one made in the child works, and the parent is untouched.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, Result, Stream};
use cuarena_testkit::{HostConfig, HostDevice, Interpose, Interposed, Stall};

include!("common/fork.rs");

/// A simulated device whose `reserve` (made under the global pool's lock) and `record_event`
/// can stop the one thread armed for it.
struct StallDevice {
    sim: HostDevice,
    reserve: Arc<Stall>,
    record: Arc<Stall>,
    /// Stop in the next `synchronize` (armed thread only).
    sync: Arc<Stall>,
}

impl Interpose for StallDevice {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.reserve.here(true);
        self.sim.reserve(bytes)
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.record.here(true);
        self.sim.record_event(event, stream)
    }
    fn synchronize(&self) -> Result<()> {
        self.sync.here(true);
        Device::synchronize(&self.sim)
    }
}

struct Rig {
    sim: HostDevice,
    dev: Arc<Interposed<StallDevice>>,
    a: Allocator,
}

fn rig() -> Rig {
    let sim = HostDevice::new(HostConfig {
        capacity: 2 << 30,
        max_delay: Duration::from_micros(5),
        ..HostConfig::default()
    });
    let dev = Arc::new(Interposed(StallDevice {
        sim: sim.clone(),
        reserve: Stall::new(),
        record: Stall::new(),
        sync: Stall::new(),
    }));
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    Rig { sim, dev, a }
}

/// The forking thread uses the allocator: its slot holds arenas with superblocks, a few live
/// blocks (returned), and nothing in flight.
fn use_on_this_thread(a: &Allocator) -> Vec<(DeviceAddr, usize)> {
    let mut live = Vec::new();
    for i in 0..64 {
        let size = 512 + i * 1000;
        live.push((a.allocate(size, Stream::PER_THREAD).unwrap(), size));
    }
    // Half freed again: free space in the arena.
    for (p, s) in live.drain(32..) {
        a.deallocate(p, s, Stream::PER_THREAD).unwrap();
    }
    live.push((a.allocate(3 << 20, Stream::LEGACY).unwrap(), 3 << 20));
    live
}

/// Frees the blocks [`use_on_this_thread`] left live, each on its stream.
fn free_live(a: &Allocator, live: Vec<(DeviceAddr, usize)>) {
    for (p, s) in live {
        let stream = if s == 3 << 20 { Stream::LEGACY } else { Stream::PER_THREAD };
        a.deallocate(p, s, stream).unwrap();
    }
}

/// Another parent thread stopped inside the global pool's growth, i.e. holding the pool's lock
/// (`GlobalPool::alloc_from` calls `Device::reserve` under `state`). Returns its handle.
fn hold_pool_lock(r: &Rig) -> std::thread::JoinHandle<()> {
    let a = r.a.clone();
    let stall = Arc::clone(&r.dev.reserve);
    let h = std::thread::spawn(move || {
        stall.arm();
        // Over `large_max` (64 MiB): the pool's first fit, which grows the pool.
        let p = a.allocate(200 << 20, Stream::LEGACY).unwrap();
        a.deallocate(p, 200 << 20, Stream::LEGACY).unwrap();
    });
    r.dev.reserve.wait_stalled();
    h
}

// ---------------------------------------------------------------------------------------------
// 1. The child ends (normally, or with `_exit`) after the parent used the allocator.
// ---------------------------------------------------------------------------------------------

/// Baseline: nothing else in flight in the parent. The child's `exit` runs the forking thread's
/// slot destructor (thread exit: exit fences, superblocks back to the pool) on its copy.
#[test]
fn child_exits_quickly_after_the_parent_used_the_allocator_on_the_forking_thread() {
    let _s = serial();
    let r = rig();
    let live = use_on_this_thread(&r.a);
    quiesce(&r.sim);
    let before = r.a.stats();
    for end in [End::Raw, End::Normal] {
        let notes = Notes::new(&format!("baseline-{end:?}"));
        let o = in_child(Duration::from_secs(10), end, || {
            notes.note("child: exiting");
            0
        });
        assert_quick_success(&format!("child end {end:?}"), &o, &notes);
    }
    // The parent's allocator is as it was, and goes on working.
    let after = r.a.stats();
    assert_eq!((before.live_bytes, before.reserved_bytes), (after.live_bytes, after.reserved_bytes));
    free_live(&r.a, live);
    assert_eq!(r.a.stats().live_bytes, 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
}

/// WAS A DEFECT (mended, `src/shutdown.rs`, "Fork"). Another parent thread holds the global pool's
/// lock at the fork (it is growing the pool: a `cuMemAlloc` under the lock, which on a GPU takes
/// milliseconds). The child does nothing at all and returns (`exit`): the forking thread's slot
/// destructor gives its arenas back to the pool and blocks for ever on the lock that no thread of
/// the child will release.
#[test]
fn child_exit_is_quick_when_another_parent_thread_holds_the_pool_lock() {
    let _s = serial();
    let r = rig();
    let _live = use_on_this_thread(&r.a);
    quiesce(&r.sim);
    let holder = hold_pool_lock(&r);
    let notes = Notes::new("exit-pool-lock");
    let raw = in_child(Duration::from_secs(5), End::Raw, || 0);
    let normal = in_child(Duration::from_secs(3), End::Normal, || {
        notes.note("child: returning, exit() runs the TLS destructors");
        0
    });
    r.dev.reserve.release();
    holder.join().unwrap();
    // `_exit` is fine (no destructor runs).
    assert_quick_success("_exit", &raw, &notes);
    // exit() must be too.
    assert_quick_success("exit() with a parent thread inside the pool's lock", &normal, &notes);
}

/// WAS A DEFECT (mended, `src/shutdown.rs`, "Fork"). Another parent thread is a reclaimer (`trim`,
/// or any thread's out-of-memory path) holding the forking thread's arena's claim at the fork (here
/// stopped in the legacy-stream fence record that a reclaim makes while it holds the claim). In the
/// child the claim is never released: the slot destructor's `Claim::enter_waiting` spins (yield
/// loop, 100% CPU) for ever.
#[test]
fn child_exit_is_quick_when_a_parent_reclaimer_held_the_forking_threads_arena() {
    let _s = serial();
    let r = rig();
    // Superblocks held, all blocks freed: a reclaimer has something to take.
    let ps: Vec<_> = (0..200).map(|_| r.a.allocate(8192, Stream::PER_THREAD).unwrap()).collect();
    for p in ps {
        r.a.deallocate(p, 8192, Stream::PER_THREAD).unwrap();
    }
    quiesce(&r.sim);
    assert!(r.a.stats().arena_held_bytes > 0, "the arena keeps superblocks");
    let a = r.a.clone();
    let stall = Arc::clone(&r.dev.record);
    let reclaimer = std::thread::spawn(move || {
        stall.arm();
        a.trim(false).unwrap();
    });
    r.dev.record.wait_stalled();
    let notes = Notes::new("exit-claim");
    let normal = in_child(Duration::from_secs(3), End::Normal, || 0);
    r.dev.record.release();
    reclaimer.join().unwrap();
    assert_quick_success("exit() with a parent reclaimer holding this thread's arena", &normal, &notes);
}

// ---------------------------------------------------------------------------------------------
// 2. The child calls the allocator made before the fork.
// ---------------------------------------------------------------------------------------------

/// With nothing in flight in the parent, every call on the allocator made before the fork is
/// refused in the child as `Error::Forked` (the fast paths too: the child forgot the forking
/// thread's slots), the calls that cannot fail do nothing or answer zeros, and the parent's
/// allocator is untouched and not forked. Both ends of the child.
#[test]
fn child_calls_on_a_pre_fork_allocator_are_refused_as_forked() {
    let _s = serial();
    let r = rig();
    let live = use_on_this_thread(&r.a);
    quiesce(&r.sim);
    let before = r.a.stats();
    for end in [End::Raw, End::Normal] {
        let notes = Notes::new(&format!("calls-quiet-{end:?}"));
        let a = r.a.clone();
        let live = live.clone();
        let notes_ref = &notes;
        let o = in_child(Duration::from_secs(10), end, move || {
            let notes = notes_ref;
            let forked = |what: &str, r: cuarena::Result<()>| {
                notes.note(what);
                if !matches!(r, Err(Error::Forked)) {
                    notes.note(&format!("{what}: {r:?}, not Forked"));
                    // SAFETY: ends the child at once.
                    unsafe { _exit(3) };
                }
            };
            forked("forked()", if a.forked() { Err(Error::Forked) } else { Ok(()) });
            forked("allocate small (fast path)", a.allocate(4096, Stream::PER_THREAD).map(drop));
            forked("allocate 200 MiB (pool)", a.allocate(200 << 20, Stream::LEGACY).map(drop));
            forked("allocate on a user stream", a.allocate(1000, Stream::from_raw(0x77)).map(drop));
            let (lp, ls) = live[0];
            forked("free a parent block", a.deallocate(lp, ls, Stream::PER_THREAD));
            forked("free used on", a.deallocate_used_on(lp, ls, Stream::PER_THREAD, &[Stream::LEGACY]));
            forked("flush", a.flush());
            forked("trim(true)", a.trim(true).map(drop));
            forked("release_thread", a.release_thread());
            forked("set_memory_fraction", a.set_memory_fraction(0.5));
            forked("graph_capture_end", a.graph_capture_end());
            forked("start_trace", a.start_trace("/dev/null"));
            forked("stop_trace", a.stop_trace().map(drop));
            notes.note("the calls that cannot fail");
            a.set_limit_bytes(1 << 20);
            a.reset_peak();
            a.reset_counters();
            a.graph_capture_begin();
            let s = a.stats();
            let zeros = s == cuarena::Stats::default() && a.size_histogram().iter().all(|&n| n == 0);
            notes.note("dropping a handle");
            drop(a);
            notes.note("done");
            if zeros { 0 } else { 4 }
        });
        match (&o, end) {
            (Outcome::Exited { code: 0, .. }, _) => {}
            _ => panic!("child end {end:?}: {o:?}; notes:\n{}", notes.read()),
        }
    }
    assert!(!r.a.forked(), "the parent's allocator is not forked");
    let after = r.a.stats();
    assert_eq!((before.live_bytes, before.reserved_bytes), (after.live_bytes, after.reserved_bytes));
    free_live(&r.a, live);
    assert_eq!(r.a.stats().live_bytes, 0);
    assert!(r.sim.violations().is_empty(), "{:?}", r.sim.violations());
}

/// WAS A DEFECT (mended, `src/shutdown.rs`, "Fork"). With another parent thread inside the pool's
/// lock at the fork, the child's calls on the pre-fork allocator that reach the pool hang for ever,
/// `stats()` among them (it reads the pool under its lock). Each call in its own child; the child
/// ends with `_exit`.
#[test]
fn child_calls_are_refused_without_hanging_when_another_parent_thread_holds_the_pool_lock() {
    let _s = serial();
    let r = rig();
    let _live = use_on_this_thread(&r.a);
    quiesce(&r.sim);
    let holder = hold_pool_lock(&r);
    type Op = Box<dyn Fn(&Allocator) -> bool + Send>;
    let forked = |r: cuarena::Result<()>| matches!(r, Err(Error::Forked));
    let ops: Vec<(&str, Op)> = vec![
        (
            "allocate 4 KiB on the per-thread stream (arena fast path)",
            Box::new(move |a: &Allocator| forked(a.allocate(4096, Stream::PER_THREAD).map(drop))),
        ),
        ("stats()", Box::new(|a: &Allocator| a.stats() == cuarena::Stats::default())),
        (
            "allocate 100 MiB (pool)",
            Box::new(move |a: &Allocator| forked(a.allocate(100 << 20, Stream::LEGACY).map(drop))),
        ),
        ("trim(false)", Box::new(move |a: &Allocator| forked(a.trim(false).map(drop)))),
        ("release_thread()", Box::new(move |a: &Allocator| forked(a.release_thread()))),
    ];
    let mut results = Vec::new();
    for (what, op) in &ops {
        let notes = Notes::new("calls-pool-lock");
        let a = r.a.clone();
        let o = in_child(Duration::from_millis(1500), End::Raw, || if op(&a) { 0 } else { 5 });
        let _ = notes;
        results.push((format!("{what}: {o:?}"), matches!(o, Outcome::Exited { code: 0, .. })));
    }
    r.dev.reserve.release();
    holder.join().unwrap();
    assert!(
        results.iter().all(|(_, ok)| *ok),
        "child calls that hung or were not refused as Forked (another parent thread held the pool lock):\n{}",
        results.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>().join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// 3. The child makes a new allocator on a fresh simulated device.
// ---------------------------------------------------------------------------------------------

/// A new allocator shares no lock with the old one: it works in the child, even with another
/// parent thread inside the old pool's lock, as long as the child ends with `_exit`.
#[test]
fn a_new_allocator_in_the_child_works_and_exits_raw() {
    let _s = serial();
    let r = rig();
    let _live = use_on_this_thread(&r.a);
    quiesce(&r.sim);
    let holder = hold_pool_lock(&r);
    let notes = Notes::new("new-raw");
    let o = in_child(Duration::from_secs(10), End::Raw, || {
        let b = Allocator::new(Arc::new(HostDevice::default()), Config::default()).unwrap();
        let ps: Vec<_> = (0..100)
            .map(|i| (b.allocate(1000 + i * 4096, Stream::PER_THREAD).unwrap(), 1000 + i * 4096))
            .collect();
        let big = b.allocate(100 << 20, Stream::LEGACY).unwrap();
        // Another thread in the child frees one block: the fence machinery runs.
        let b2 = b.clone();
        let (p0, s0) = ps[0];
        std::thread::spawn(move || b2.deallocate(p0, s0, Stream::PER_THREAD).unwrap()).join().unwrap();
        for &(p, s) in &ps[1..] {
            b.deallocate(p, s, Stream::PER_THREAD).unwrap();
        }
        b.deallocate(big, 100 << 20, Stream::LEGACY).unwrap();
        b.flush().unwrap();
        b.trim(true).unwrap();
        let s = b.stats();
        b.release_thread().unwrap();
        notes.note(&format!("child: live {} reserved {}", s.live_bytes, s.reserved_bytes));
        drop(b);
        if s.live_bytes == 0 { 0 } else { 2 }
    });
    r.dev.reserve.release();
    holder.join().unwrap();
    assert_quick_success("a new allocator in the child", &o, &notes);
}

/// WAS A DEFECT (a consequence of the first; mended: the child forgets the forking thread's slots):
/// the child uses only a NEW allocator, and returns normally; but the forking thread's slot of the
/// OLD allocator is still in its thread-local list, and its destructor hangs on the old pool's lock
/// held by a parent thread.
#[test]
fn a_child_using_only_a_new_allocator_exits_quickly_past_the_old_allocators_slot() {
    let _s = serial();
    let r = rig();
    let _live = use_on_this_thread(&r.a);
    quiesce(&r.sim);
    let holder = hold_pool_lock(&r);
    let notes = Notes::new("new-normal");
    let o = in_child(Duration::from_secs(3), End::Normal, || {
        let b = Allocator::new(Arc::new(HostDevice::default()), Config::default()).unwrap();
        let p = b.allocate(4096, Stream::PER_THREAD).unwrap();
        b.deallocate(p, 4096, Stream::PER_THREAD).unwrap();
        notes.note("child: new allocator worked; returning");
        0
    });
    r.dev.reserve.release();
    holder.join().unwrap();
    assert_quick_success("exit() of a child that used only a new allocator", &o, &notes);
}

// ---------------------------------------------------------------------------------------------
// Trace files: shared with the child through the fork.
// ---------------------------------------------------------------------------------------------

/// WAS A DEFECT (mended, `src/shutdown.rs`, "Fork"). The parent traces into a file. The child
/// returns normally (`exit`): the forking thread's trace log (a TLS destructor) and cuarena's
/// `atexit` hook (`stop_all_at_exit`) finish the CHILD's copy of the trace: its copy of the
/// buffered header and records, plus records of every parent thread's buffer copied by the fork,
/// are written through the file descriptor the child shares with the parent. The parent's own stop
/// later writes the same bytes again: the parent's trace file is corrupt (a second header in the
/// middle, records written twice).
#[test]
fn a_child_that_exits_normally_leaves_the_parents_trace_file_whole() {
    let _s = serial();
    let r = rig();
    let path = std::env::temp_dir().join(format!("cuarena-s29-{}-trace.bin", std::process::id()));
    r.a.start_trace(&path).unwrap();
    for i in 0..10 {
        let p = r.a.allocate(1000 + i, Stream::PER_THREAD).unwrap();
        r.a.deallocate(p, 1000 + i, Stream::PER_THREAD).unwrap();
    }
    quiesce(&r.sim);
    let notes = Notes::new("trace");
    let o = in_child(Duration::from_secs(10), End::Normal, || 0);
    assert_quick_success("child exit", &o, &notes);
    let summary = r.a.stop_trace().unwrap();
    let read = cuarena::trace::read(&path);
    let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&path);
    assert_eq!(summary.records, 20);
    match read {
        Ok(recs) => assert_eq!(
            recs.len() as u64,
            summary.records,
            "the parent's trace holds {} records where it wrote {} ({} bytes, expected {}): the child's exit wrote into it",
            recs.len(),
            summary.records,
            len,
            summary.bytes
        ),
        Err(e) => panic!(
            "the parent's trace no longer reads ({len} bytes where it wrote {}): {e}: the child's exit wrote into it",
            summary.bytes
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Process-wide state: announced captures.
// ---------------------------------------------------------------------------------------------

/// WAS A DEFECT (narrow; mended: the capture table is locked across a fork and emptied in the
/// child). A parent thread is inside a device synchronise (`trim(true)` with parked memory, or out
/// of memory) at the fork: the process-wide table of announced captures counts it as a running
/// reader of the device. In the child that count never drops, so `graph_capture_begin` on the same
/// device (the same allocator, or any allocator of the same device id: every CUDA allocator of
/// ordinal 0) waits for ever.
#[test]
fn a_new_allocator_in_the_child_announces_captures_though_a_parent_thread_was_synchronising() {
    let _s = serial();
    let r = rig();
    let _live = use_on_this_thread(&r.a);
    // A parked arena, which a blocking trim gives back after a device synchronise.
    park_an_arena(&r.a, &r.sim);
    quiesce(&r.sim);
    let a = r.a.clone();
    let stall = Arc::clone(&r.dev.sync);
    let syncer = std::thread::spawn(move || {
        stall.arm();
        a.trim(true).unwrap();
    });
    r.dev.sync.wait_stalled();
    fork_and_begin_capture(&r, syncer);
}

fn fork_and_begin_capture(r: &Rig, syncer: std::thread::JoinHandle<()>) {
    let notes = Notes::new("capture");
    let a = r.a.clone();
    let id = r.sim.device_id();
    let o = in_child(Duration::from_millis(1500), End::Raw, || {
        notes.note("the pre-fork allocator's capture calls");
        a.graph_capture_begin(); // nothing, in the child
        if !matches!(a.graph_capture_end(), Err(Error::Forked)) {
            return 6;
        }
        notes.note("a new allocator on the same device: graph_capture_begin");
        let dev = Arc::new(Interposed(SameId { sim: HostDevice::default(), id }));
        let b = Allocator::new(dev, Config::default()).unwrap();
        b.graph_capture_begin();
        notes.note("began");
        b.graph_capture_end().unwrap();
        0
    });
    r.dev.sync.release();
    syncer.join().unwrap();
    assert_quick_success("graph_capture_begin in the child", &o, &notes);
}

// ---------------------------------------------------------------------------------------------
// 4. The C ABI (compiled in, as tests/ffi.rs does). No driver on this machine: the process-wide
//    allocators cannot be made, so what can be tried is the creation path.
// ---------------------------------------------------------------------------------------------

/// The C ABI, compiled into this test.
#[allow(dead_code)]
#[path = "../capi/src/lib.rs"]
mod cuarena_c;

fn last_error() -> String {
    let e = cuarena_c::cuarena_last_error();
    if e.is_null() {
        return String::new();
    }
    // SAFETY: NUL-terminated, valid until the next failing call on this thread.
    unsafe { std::ffi::CStr::from_ptr(e) }.to_string_lossy().into_owned()
}

/// Without a driver, a child's C calls fail at once with the driver's error, and exit is quick.
#[test]
fn c_abi_calls_in_a_child_fail_cleanly_without_a_driver() {
    let _s = serial();
    if std::env::var_os("CUARENA_REQUIRE_GPU").is_some() {
        return; // on a GPU machine the process-wide allocator exists: not this test's case
    }
    let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
    assert!(p.is_null());
    let parent_err = last_error();
    for end in [End::Raw, End::Normal] {
        let notes = Notes::new(&format!("c-{end:?}"));
        let o = in_child(Duration::from_secs(10), end, || {
            let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
            let e = last_error();
            notes.note(&format!("malloc {p:?}: {e}"));
            cuarena_c::cuarena_empty_cache();
            if p.is_null() && !e.is_empty() { 0 } else { 2 }
        });
        assert_quick_success(&format!("C calls, end {end:?} (parent saw: {parent_err})"), &o, &notes);
    }
}

/// WAS A DEFECT (mended, `src/shutdown.rs`, "Fork"). A parent thread is inside the creation of the
/// process-wide allocator at the fork (`global()` holds `CREATING` across driver load, `cuInit` and
/// context creation: hundreds of milliseconds on a GPU; here, on a machine without a driver, every
/// call retries the creation under the lock). The child's first C call waits for `CREATING` for
/// ever. Forks repeatedly while another thread makes C calls; any child that does not finish its
/// one `cuarena_malloc` within 1.5 s is reported.
#[test]
fn c_abi_child_does_not_hang_when_a_parent_thread_was_creating_the_process_wide_allocator() {
    let _s = serial();
    if std::env::var_os("CUARENA_REQUIRE_GPU").is_some() {
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = Arc::clone(&stop);
    let hammer = std::thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            let _ = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
        }
    });
    std::thread::sleep(Duration::from_millis(20));
    let mut outcomes = Vec::new();
    let mut hung = 0;
    let t0 = Instant::now();
    for _ in 0..40 {
        let o = in_child(Duration::from_millis(1500), End::Raw, || {
            let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
            if p.is_null() { 0 } else { 2 }
        });
        if matches!(o, Outcome::Hung { .. }) {
            hung += 1;
        }
        outcomes.push(o);
        if hung >= 1 || t0.elapsed() > Duration::from_secs(8) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    hammer.join().unwrap();
    assert_eq!(
        hung,
        0,
        "{hung} of {} children hung in their first cuarena_malloc (a parent thread was inside global()'s creation at the fork): {:?}",
        outcomes.len(),
        outcomes.iter().find(|o| matches!(o, Outcome::Hung { .. }))
    );
}

// ---------------------------------------------------------------------------------------------
// On a GPU (ignored here; `cargo test --test adversarial_s29_fork -- --ignored --nocapture` on a
// GPU machine). The CUDA driver is unusable in a forked child: what does cuarena do there?
// ---------------------------------------------------------------------------------------------

/// Runs each operation in its own child of a process whose forking thread used a CUDA allocator,
/// and reports what each returned (or that it hung). Asserts only that no child hung.
#[test]
#[ignore = "needs a GPU: what a CUDA allocator does in a forked child"]
fn gpu_a_cuda_allocator_in_a_forked_child() {
    let _s = serial();
    let a = match Allocator::cuda(0, Config::default()) {
        Ok(a) => a,
        Err(e) => return eprintln!("no GPU: {e}"),
    };
    let mut live = use_on_this_thread(&a);
    let big = live.remove(0); // freed by a child on the per-thread stream of its (copied) thread
    a.flush().unwrap();
    a.trim(true).unwrap();
    type Op = Box<dyn Fn(&Allocator, &Notes) + Send>;
    let ops: Vec<(&str, End, Op)> = vec![
        ("nothing, _exit", End::Raw, Box::new(|_: &Allocator, _: &Notes| {})),
        (
            "nothing, exit() (the slot's destructor makes CUDA calls)",
            End::Normal,
            Box::new(|_: &Allocator, _: &Notes| {}),
        ),
        (
            "allocate 4 KiB per-thread (arena fast path)",
            End::Raw,
            Box::new(|a: &Allocator, n: &Notes| {
                n.note(&format!("{:?}", a.allocate(4096, Stream::PER_THREAD)))
            }),
        ),
        (
            "allocate 200 MiB legacy (pool growth: cuMemAlloc)",
            End::Raw,
            Box::new(|a: &Allocator, n: &Notes| {
                n.note(&format!("{:?}", a.allocate(200 << 20, Stream::LEGACY)))
            }),
        ),
        (
            "free a parent block on the legacy stream, then flush",
            End::Raw,
            Box::new(move |a: &Allocator, n: &Notes| {
                n.note(&format!("free: {:?}", a.deallocate(big.0, big.1, Stream::PER_THREAD)));
                n.note(&format!("flush: {:?}", a.flush()));
            }),
        ),
        (
            "stats",
            End::Raw,
            Box::new(|a: &Allocator, n: &Notes| n.note(&format!("live {}", a.stats().live_bytes))),
        ),
        ("trim(true)", End::Raw, Box::new(|a: &Allocator, n: &Notes| n.note(&format!("{:?}", a.trim(true))))),
        (
            "release_thread",
            End::Raw,
            Box::new(|a: &Allocator, n: &Notes| n.note(&format!("{:?}", a.release_thread()))),
        ),
        (
            "a new CUDA allocator",
            End::Raw,
            Box::new(|_: &Allocator, n: &Notes| {
                let b = Allocator::cuda(0, Config::default());
                n.note(&format!("new: {:?}", b.as_ref().map(|_| ())));
                if let Ok(b) = b {
                    n.note(&format!("alloc: {:?}", b.allocate(4096, Stream::LEGACY)));
                }
            }),
        ),
        (
            "drop the allocator (pool drop: synchronise, release)",
            End::Raw,
            Box::new(|a: &Allocator, n: &Notes| {
                let b = a.clone();
                n.note("dropping a clone only; the last is the parent's copy");
                drop(b);
            }),
        ),
    ];
    let mut report = Vec::new();
    for (i, (what, end, op)) in ops.iter().enumerate() {
        let notes = Notes::new(&format!("gpu-{i}"));
        let a2 = a.clone();
        let o = in_child(Duration::from_secs(8), *end, || {
            op(&a2, &notes);
            0
        });
        report.push(format!("{what} [{end:?}]: {o:?}; child said: {}", notes.read().trim()));
    }
    eprintln!("GPU fork report:\n{}", report.join("\n"));
    free_live(&a, live);
    a.deallocate(big.0, big.1, Stream::PER_THREAD).unwrap();
    assert!(report.iter().all(|r| !r.contains("Hung")), "{}", report.join("\n"));
}

/// The C ABI on a GPU: the parent used it on the forking thread; the child calls it.
#[test]
#[ignore = "needs a GPU: the C ABI in a forked child"]
fn gpu_c_abi_in_a_forked_child() {
    let _s = serial();
    let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
    if p.is_null() {
        return eprintln!("no GPU: {}", last_error());
    }
    let q = cuarena_c::cuarena_malloc(8 << 20, 0, std::ptr::null_mut());
    cuarena_c::cuarena_free(q, 8 << 20, 0, std::ptr::null_mut());
    let mut report = Vec::new();
    for (i, end) in [End::Raw, End::Normal].into_iter().enumerate() {
        let notes = Notes::new(&format!("gpu-c-{i}"));
        let o = in_child(Duration::from_secs(8), end, || {
            let small = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
            notes.note(&format!(
                "malloc 4 KiB: {small:?} {}",
                if small.is_null() { last_error() } else { String::new() }
            ));
            let big = cuarena_c::cuarena_malloc(300 << 20, 0, std::ptr::null_mut());
            notes.note(&format!(
                "malloc 300 MiB: {big:?} {}",
                if big.is_null() { last_error() } else { String::new() }
            ));
            let r = cuarena_c::cuarena_free_checked(p, 4096, 0, std::ptr::null_mut());
            notes.note(&format!(
                "free parent block: {r} {}",
                if r != 0 { last_error() } else { String::new() }
            ));
            cuarena_c::cuarena_empty_cache();
            notes.note(&format!("empty_cache done; last error: {}", last_error()));
            0
        });
        report.push(format!("[{end:?}] {o:?}; child said:\n{}", notes.read()));
    }
    eprintln!("GPU C ABI fork report:\n{}", report.join("\n"));
    cuarena_c::cuarena_free(p, 4096, 0, std::ptr::null_mut());
    assert!(report.iter().all(|r| !r.contains("Hung")), "{}", report.join("\n"));
}

/// WAS A DEFECT on a GPU (expected, not run; mended: `global` refuses in a child whose parent held
/// its creation lock): a thread makes the first C call (the process-wide allocator is created under
/// `CREATING`: driver load, `cuInit`, context) while another thread forks; the child's first C call
/// waits on `CREATING` for ever. Runs in a fresh process (the test binary again), where no
/// allocator exists yet.
#[test]
#[ignore = "needs a GPU: fork during the process-wide allocator's creation"]
fn gpu_c_abi_child_does_not_hang_when_the_parent_was_initialising_cuda() {
    if std::env::var_os("CUARENA_S29_FRESH").is_none() {
        let _s = serial();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "gpu_c_abi_child_does_not_hang_when_the_parent_was_initialising_cuda",
                "--include-ignored",
                "--nocapture",
            ])
            .env("CUARENA_S29_FRESH", "1")
            .output()
            .unwrap();
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        eprintln!("fresh process:\n{text}");
        assert!(out.status.success(), "{text}");
        return;
    }
    let t0 = Instant::now();
    let init = std::thread::spawn(move || {
        let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
        (p as usize, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(5));
    let notes = Notes::new("gpu-init");
    let o = in_child(Duration::from_secs(8), End::Raw, || {
        let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
        notes
            .note(&format!("child malloc: {p:?} {}", if p.is_null() { last_error() } else { String::new() }));
        0
    });
    let (p, took) = init.join().unwrap();
    eprintln!("parent's first malloc: {p:#x} after {took:?}; child: {o:?}; child said: {}", notes.read());
    if p == 0 {
        return eprintln!("no GPU");
    }
    assert!(!matches!(o, Outcome::Hung { .. }), "the child hung in its first C call: {o:?}");
}
