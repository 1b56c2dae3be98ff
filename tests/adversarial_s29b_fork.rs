//! Adversarial session 29, second pass: `fork()` against the mend of `src/shutdown.rs` ("Fork").
//!
//! `tests/adversarial_s29_fork.rs` forks from a quiet harness thread. These tests fork from
//! *inside* cuarena calls (an OOM hook, a `Device` method of an interposed device: `reserve`,
//! `synchronize`, `stream_key`), storm the parent with forks while other threads announce
//! captures, trace and allocate, fork grandchildren, make allocators in children (on a clone of
//! the parent's simulated device, tracing to their own file), drop `DeviceBuffer`s in children,
//! and call every C entry point in a child.
//!
//! A fork inside a call: the child is a copy of the forking thread *in the middle of that call*;
//! it either ends there (`_exit` or `std::process::exit`, which runs the thread's TLS destructors
//! and then the `atexit` handlers) or returns from the hook/device method and so finishes the
//! call on the allocator made before the fork (`fork_continue`, with `IN_CHILD` set). The parent
//! polls `waitpid(WNOHANG)` with a time limit, reports a child still running then as hung, and
//! kills it.
//!
//! Seven of these tests failed against the first fork mend; each says so in its comment (WAS A
//! DEFECT) with the root cause, and each passes since its mend.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, Result, Stream, StreamKey};
use cuarena_testkit::{HostConfig, HostDevice, Interpose, Interposed, Stall, assert_all_returned};

include!("common/fork.rs");

// ---------------------------------------------------------------------------------------------
// A device that forks inside one of its calls.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    Reserve,
    Synchronize,
    StreamKey,
}

type Hook = Box<dyn FnOnce() + Send>;

/// A simulated device that runs a test's hook (which forks) in the next call of one kind made
/// by the armed thread, and whose `reserve` can stall the thread armed on `stall` (inside the
/// global pool's lock). No lock of its own is taken by any thread but the armed one.
struct ForkDevice {
    sim: HostDevice,
    /// A token of the armed thread (0: none).
    armed_for: AtomicU64,
    hook: Mutex<Option<(At, Hook)>>,
    stall: Arc<Stall>,
    /// `device_id` answered, if not the simulator's.
    id: Option<u64>,
}

fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static T: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    T.with(|t| *t)
}

impl ForkDevice {
    fn new(sim: HostDevice, id: Option<u64>) -> ForkDevice {
        ForkDevice { sim, armed_for: AtomicU64::new(0), hook: Mutex::new(None), stall: Stall::new(), id }
    }

    /// The calling thread runs `hook` in its next call `at`.
    fn arm(&self, at: At, hook: impl FnOnce() + Send + 'static) {
        *self.hook.lock().unwrap() = Some((at, Box::new(hook)));
        self.armed_for.store(thread_token(), Ordering::SeqCst);
    }

    fn fire(&self, at: At) {
        if self.armed_for.load(Ordering::SeqCst) != thread_token() {
            return;
        }
        let hook = {
            let mut g = self.hook.lock().unwrap();
            match g.as_ref() {
                Some((a, _)) if *a == at => {
                    self.armed_for.store(0, Ordering::SeqCst);
                    g.take().map(|(_, h)| h)
                }
                _ => None,
            }
        };
        if let Some(h) = hook {
            h();
        }
    }
}

impl Interpose for ForkDevice {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn device_id(&self) -> u64 {
        self.id.unwrap_or_else(|| self.sim.device_id())
    }
    fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.stall.here(true);
        self.fire(At::Reserve);
        self.sim.reserve(bytes)
    }
    fn synchronize(&self) -> Result<()> {
        self.fire(At::Synchronize);
        if IN_CHILD.load(Ordering::SeqCst) {
            return Ok(()); // the simulator's workers are the parent's
        }
        Device::synchronize(&self.sim)
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        self.fire(At::StreamKey);
        self.sim.stream_key(stream)
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        self.sim.record_event(event, stream)
    }
}

struct Rig {
    sim: HostDevice,
    dev: Arc<Interposed<ForkDevice>>,
    a: Allocator,
}

fn sim() -> HostDevice {
    HostDevice::new(HostConfig {
        capacity: 2 << 30,
        max_delay: Duration::from_micros(5),
        ..HostConfig::default()
    })
}

fn rig_with(config: Config) -> Rig {
    let sim = sim();
    let dev = Arc::new(Interposed(ForkDevice::new(sim.clone(), None)));
    let a = Allocator::new(dev.clone(), config).unwrap();
    Rig { sim, dev, a }
}

fn rig() -> Rig {
    rig_with(Config::default())
}

/// Some use of `a` on this thread: a slot with arenas, blocks freed again.
fn churn(a: &Allocator, n: usize) {
    for i in 0..n {
        let size = 256 + (i * 977) % 20000;
        let s = if i % 3 == 0 { Stream::LEGACY } else { Stream::PER_THREAD };
        let p = a.allocate(size, s).unwrap();
        a.deallocate(p, size, s).unwrap();
    }
}

/// A new allocator on a fresh device works (child side): allocations, frees, trim, nothing live.
fn new_allocator_works(notes: &Notes) -> bool {
    let b = match Allocator::new(Arc::new(HostDevice::default()), Config::default()) {
        Ok(b) => b,
        Err(e) => {
            notes.note(&format!("new allocator: {e}"));
            return false;
        }
    };
    let ps: Vec<_> = (0..50)
        .map(|i| (b.allocate(1000 + i * 3000, Stream::PER_THREAD).unwrap(), 1000 + i * 3000))
        .collect();
    for (p, s) in ps {
        b.deallocate(p, s, Stream::PER_THREAD).unwrap();
    }
    b.flush().unwrap();
    b.trim(true).unwrap();
    let live = b.stats().live_bytes;
    notes.note(&format!("new allocator: live {live}"));
    live == 0
}

// =============================================================================================
// 1. Fork inside an OOM hook.
// =============================================================================================

/// WORKS. The OOM hook forks; the child checks the pre-fork allocator is refused, makes and uses
/// a new allocator, and ends with `exit()` from *inside* the hook (its slot and trace log are
/// forgotten; the parent's trace is left whole). The parent's allocation fails as out of memory
/// (the hook says no) and the allocator stays correct.
#[test]
fn oom_hook_that_forks_child_exits_normally_inside_the_hook() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    let path = temp_path("oom-trace.bin");
    r.a.start_trace(&path).unwrap();
    churn(&r.a, 200);
    let keep = r.a.allocate(5000, Stream::PER_THREAD).unwrap();
    quiesce(&r.sim);
    r.a.set_limit_bytes(256 << 20);
    let notes = Arc::new(Notes::new("oom-exit"));
    let (a2, n2) = (r.a.clone(), Arc::clone(&notes));
    let pid = Arc::new(AtomicI32::new(0));
    let pid2 = Arc::clone(&pid);
    let fired = Arc::new(AtomicBool::new(false));
    r.a.set_oom_hook(Some(Arc::new(move |_req, _dev| {
        if fired.swap(true, Ordering::SeqCst) {
            return false;
        }
        if fork_continue() {
            let ok = matches!(a2.allocate(4096, Stream::PER_THREAD), Err(Error::Forked))
                && matches!(a2.allocate(300 << 20, Stream::LEGACY), Err(Error::Forked))
                && a2.forked();
            n2.note(&format!("pre-fork allocator refused: {ok}"));
            let works = new_allocator_works(&n2);
            end_child(End::Normal, if ok && works { 0 } else { 3 });
        }
        pid2.store(CHILD_PID.load(Ordering::SeqCst), Ordering::SeqCst);
        false
    })));
    let r1 = r.a.allocate(300 << 20, Stream::LEGACY);
    assert!(matches!(r1, Err(Error::OutOfMemory { .. })), "{r1:?}");
    let o = wait_child(pid.load(Ordering::SeqCst), Duration::from_secs(5));
    r.a.set_oom_hook(None);
    r.a.deallocate(keep, 5000, Stream::PER_THREAD).unwrap();
    let summary = r.a.stop_trace().unwrap();
    let read = cuarena::trace::read(&path);
    let _ = std::fs::remove_file(&path);
    assert!(o.ok_quick(), "child: {o:?}; notes:\n{}", notes.read());
    let recs = read.expect("the parent's trace reads");
    assert_eq!(recs.len() as u64, summary.records);
    r.a.set_limit_bytes(usize::MAX);
    assert_all_returned(&r.a, Some(&r.sim), 0);
}

/// WAS A DEFECT, mended (hang). The OOM hook forks and, in the child, returns true ("retry"): the
/// hook returned, so `after_oom` retries the allocation on the allocator made before the fork
/// (`allocate_once`, then `alloc_pool` under the global pool's lock) without asking whether it is
/// still usable. Another parent thread was inside the pool's lock (growing it) at the fork: the
/// child waits for that lock for ever, although every call on a forked allocator is promised to be
/// refused with `Error::Forked` before it takes a lock. Root cause: `Allocator::after_oom`
/// (src/allocator.rs) retries with no `self.usable()?` after the hook returns (nor does the `count`
/// before it: `with_slot` makes the child a new slot of the forked allocator).
#[test]
fn oom_hook_that_forks_child_returns_true_and_its_retry_is_refused_not_hung() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    churn(&r.a, 100);
    quiesce(&r.sim);
    r.a.set_limit_bytes(256 << 20);
    let holder: Arc<Mutex<Option<std::thread::JoinHandle<()>>>> = Arc::default();
    let (a2, dev2, h2) = (r.a.clone(), Arc::clone(&r.dev), Arc::clone(&holder));
    let fired = Arc::new(AtomicBool::new(false));
    r.a.set_oom_hook(Some(Arc::new(move |_req, _dev| {
        if fired.swap(true, Ordering::SeqCst) {
            return false;
        }
        // Another parent thread grows the pool: stopped in `reserve`, inside the pool's lock.
        let (a3, stall) = (a2.clone(), Arc::clone(&dev2.stall));
        *h2.lock().unwrap() = Some(std::thread::spawn(move || {
            stall.arm();
            let p = a3.allocate(100 << 20, Stream::LEGACY).unwrap();
            a3.deallocate(p, 100 << 20, Stream::LEGACY).unwrap();
        }));
        dev2.stall.wait_stalled();
        // The child asks for the retry; the parent does not.
        fork_continue()
    })));
    let t0 = Instant::now();
    let r1 = r.a.allocate(300 << 20, Stream::LEGACY);
    if IN_CHILD.load(Ordering::SeqCst) {
        // SAFETY: ends the child at once.
        unsafe { _exit(if matches!(r1, Err(Error::Forked)) { 0 } else { 4 }) };
    }
    let o = wait_child(CHILD_PID.load(Ordering::SeqCst), Duration::from_millis(1500));
    r.dev.stall.release();
    holder.lock().unwrap().take().unwrap().join().unwrap();
    r.a.set_oom_hook(None);
    assert!(matches!(r1, Err(Error::OutOfMemory { .. })), "{r1:?}");
    r.a.set_limit_bytes(usize::MAX);
    assert_all_returned(&r.a, Some(&r.sim), 0);
    assert!(
        o.ok_quick(),
        "the child's retry after its OOM hook returned true (on the allocator made before the fork, with \
         another parent thread inside the pool's lock): {o:?} after {:?}; expected Err(Forked) at once",
        t0.elapsed()
    );
}

// =============================================================================================
// 2. Fork inside a `Device` call; the child finishes the call.
// =============================================================================================

/// WAS A DEFECT, mended (hang in a new allocator). The forking thread forks inside a device
/// synchronise (`trim(true)` with a parked arena: `Counted::synchronize` runs it as a *reader* of
/// the process-wide capture table, `sync::holding_off_announcements`). The fork's child handler
/// (`sync::install_fork_handlers`'s child handler) empties the table, the forking thread's own reader entry with it; then the
/// child finishes the call and the reader's drop (`CaptureReader::drop`, src/sync.rs) finds no
/// entry, makes one with 0 readers and subtracts 1: it wraps to `usize::MAX` (release build; a
/// debug build panics in that drop). From then on `graph_capture_begin` of any allocator of that
/// device id in the child (a new one included: every CUDA allocator of ordinal 0 shares it) waits
/// for ever for the readers to drop to 0. Fix: keep the forking thread's own running readers in the
/// child (count them in a thread-local and restore them in the child handler instead of clearing the
/// entry), or at least make the drop saturate.
#[test]
fn fork_inside_a_device_synchronise_then_a_new_allocator_in_the_child_announces_a_capture() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    churn(&r.a, 50);
    // A parked arena, which a blocking trim gives back after a device synchronise.
    park_an_arena(&r.a, &r.sim);
    quiesce(&r.sim);
    let notes = Notes::new("sync-capture");
    r.dev.arm(At::Synchronize, || {
        fork_continue();
    });
    let t = r.a.trim(true);
    if IN_CHILD.load(Ordering::SeqCst) {
        notes.note(&format!("child: trim(true) finished: {t:?}"));
        let id = r.sim.device_id();
        let b = Allocator::new(
            Arc::new(Interposed(SameId { sim: HostDevice::default(), id })),
            Config::default(),
        )
        .unwrap();
        notes.note("child: graph_capture_begin on a new allocator of the same device id");
        b.graph_capture_begin();
        notes.note("child: began");
        let e = b.graph_capture_end();
        // SAFETY: ends the child at once.
        unsafe { _exit(if e.is_ok() { 0 } else { 5 }) };
    }
    t.unwrap();
    let o = wait_child(CHILD_PID.load(Ordering::SeqCst), Duration::from_millis(1500));
    assert_all_returned(&r.a, Some(&r.sim), 0);
    assert!(o.ok_quick(), "child: {o:?}; notes:\n{}", notes.read());
}

/// WAS A DEFECT, mended (wrong result). The forking thread forks inside `Device::reserve` during
/// its first small allocation (the arena's growth: inside `with_slot`, so the thread's `SLOTS` are
/// borrowed and the fork's child handler `forget_slots_in_child` cannot forget them). The child
/// finishes the call and then keeps the forking thread's slot of the pre-fork allocator: its fast
/// paths (`alloc_fast`, `free_fast`, src/allocator.rs), which never check `born.forked()`, serve
/// allocations and frees from the parent's arena copy instead of refusing them as promised
/// (`Error::Forked`). Fix: have the slot lookups skip (and forget) a slot whose allocator is
/// forked, or have `with_slot` forget such slots when the borrow ends (e.g. a thread-local flag the
/// child handler sets when the borrow fails).
#[test]
fn fork_inside_a_call_leaves_the_forked_allocators_fast_paths_serving_in_the_child() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    quiesce(&r.sim);
    let notes = Notes::new("fast-paths");
    r.dev.arm(At::Reserve, || {
        fork_continue();
    });
    let p = r.a.allocate(4096, Stream::PER_THREAD).unwrap();
    if IN_CHILD.load(Ordering::SeqCst) {
        let forked = r.a.forked();
        let q = r.a.allocate(4096, Stream::PER_THREAD);
        let l = r.a.allocate(8192, Stream::LEGACY);
        let f = r.a.deallocate(p, 4096, Stream::PER_THREAD);
        notes.note(&format!("child: forked() {forked}; allocate {q:?}; legacy {l:?}; free {f:?}"));
        let ok = forked
            && matches!(q, Err(Error::Forked))
            && matches!(l, Err(Error::Forked))
            && matches!(f, Err(Error::Forked));
        end_child(End::Normal, if ok { 0 } else { 6 });
    }
    let o = wait_child(CHILD_PID.load(Ordering::SeqCst), Duration::from_secs(3));
    r.a.deallocate(p, 4096, Stream::PER_THREAD).unwrap();
    assert_all_returned(&r.a, Some(&r.sim), 0);
    assert!(o.ok_quick(), "child: {o:?}; notes:\n{}", notes.read());
}

// =============================================================================================
// 3. Fork inside a traced call; the child ends with `exit()`.
// =============================================================================================

/// WAS A DEFECT, mended (hang at the child's exit). A traced free on a user stream runs inside the
/// thread's trace log (`trace::record`: `LOGS` borrowed, between `enter` and `leave`); its stream's
/// identity is asked there (then `key_of` → `Device::stream_key`; now `Allocator::trace_key` →
/// `Counted::stream_key`), and the device forks in that call.
/// Meanwhile another parent thread is in `stop_trace`, holding the tracer's `control` lock and
/// waiting for this thread's log to leave. The child handler cannot forget the borrowed `LOGS`, so
/// at the child's `exit()` the log's destructor (`Local::drop` → `Shared::exit`, src/trace.rs) runs
/// on the parent's tracer: it sees recording off and waits for `control`, held for ever by the
/// stopping thread the child does not have. Fix: `Shared::exit`/`Local::drop` must do nothing for a
/// tracer of a forked allocator (give `Shared` a `Born`, or have `Local` check one), like
/// `Slot::drop`.
#[test]
fn fork_inside_a_traced_free_child_exit_hangs_when_a_parent_thread_was_stopping_the_trace() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    let path = temp_path("trace-stop.bin");
    r.a.start_trace(&path).unwrap();
    churn(&r.a, 20);
    let stream = r.sim.create_stream();
    let p = r.a.allocate(4096, stream).unwrap();
    quiesce(&r.sim);
    let stopper: Arc<Mutex<Option<std::thread::JoinHandle<Result<cuarena::trace::TraceSummary>>>>> =
        Arc::default();
    let (a2, st2) = (r.a.clone(), Arc::clone(&stopper));
    r.dev.arm(At::StreamKey, move || {
        let a3 = a2.clone();
        *st2.lock().unwrap() = Some(std::thread::spawn(move || a3.stop_trace()));
        // The stopper turns recording off and waits for this thread's log (it is recording).
        std::thread::sleep(Duration::from_millis(100));
        fork_continue();
    });
    let f = r.a.deallocate(p, 4096, stream);
    if IN_CHILD.load(Ordering::SeqCst) {
        end_child(End::Normal, if f.is_ok() { 0 } else { 7 });
    }
    f.unwrap();
    let o = wait_child(CHILD_PID.load(Ordering::SeqCst), Duration::from_millis(1500));
    let summary = stopper.lock().unwrap().take().unwrap().join().unwrap().unwrap();
    let recs = cuarena::trace::read(&path);
    let _ = std::fs::remove_file(&path);
    assert_eq!(recs.map(|r| r.len() as u64).ok(), Some(summary.records));
    assert_all_returned(&r.a, Some(&r.sim), 0);
    assert!(o.ok_quick(), "the child's exit() after a fork inside a traced free: {o:?}");
}

/// WAS A DEFECT, mended (the child writes into the parent's trace file). As above, with no stop
/// running: the child's `exit()` runs the borrowed (not forgotten) trace log's destructor, which
/// writes its buffer (the parent thread's unwritten records) into the parent's tracer's session: a
/// copy of the parent's `BufWriter` over the trace file's descriptor, shared with the parent. The
/// parent has written 6 buffers (983,056 bytes buffered, the writer holds 1 MiB): the child's write
/// overflows the copy, which flushes the parent's buffered header and records through the shared
/// descriptor; the parent writes them again at its stop. The parent's trace no longer reads. Root
/// cause as above (`trace::install_fork_handlers`'s child handler forgets `LOGS` only if it can borrow them; `Local::drop` →
/// `Shared::exit` → `write_out` does not know the tracer is the parent's).
#[test]
fn fork_inside_a_traced_free_child_exit_writes_into_the_parents_trace_file() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    let path = temp_path("trace-dup.bin");
    r.a.start_trace(&path).unwrap();
    // 6 full buffers written (24,576 records), 2,424 more in this thread's buffer.
    for i in 0..13_500 {
        let size = 1000 + (i % 7) * 100;
        let p = r.a.allocate(size, Stream::PER_THREAD).unwrap();
        r.a.deallocate(p, size, Stream::PER_THREAD).unwrap();
    }
    let stream = r.sim.create_stream();
    let p = r.a.allocate(4096, stream).unwrap();
    quiesce(&r.sim);
    r.dev.arm(At::StreamKey, || {
        fork_continue();
    });
    let f = r.a.deallocate(p, 4096, stream);
    if IN_CHILD.load(Ordering::SeqCst) {
        end_child(End::Normal, if f.is_ok() { 0 } else { 7 });
    }
    f.unwrap();
    let o = wait_child(CHILD_PID.load(Ordering::SeqCst), Duration::from_secs(3));
    let summary = r.a.stop_trace().unwrap();
    let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let read = cuarena::trace::read(&path);
    let _ = std::fs::remove_file(&path);
    assert!(o.ok_quick(), "child: {o:?}");
    assert_all_returned(&r.a, Some(&r.sim), 0);
    assert_eq!(summary.records, 27_002);
    assert_eq!(
        (len, read.as_ref().map(|r| r.len() as u64).map_err(|e| e.to_string())),
        (summary.bytes, Ok(summary.records)),
        "the parent's trace file after the child's exit (expected {} bytes, {} records)",
        summary.bytes,
        summary.records
    );
}

// =============================================================================================
// 4. `DeviceBuffer` alive across the fork, dropped in the child.
// =============================================================================================

/// WAS A DEFECT, mended (hang; probabilistic, near-certain within 60 forks here). A `DeviceBuffer`
/// of the pre-fork allocator dropped in the child: its free is refused (`Error::Forked`), and the
/// drop then *defers* the error: `Allocator::free_or_hold` → `defer_error` (src/allocator.rs) takes
/// the forked allocator's `deferred` lock, which a parent thread may hold at the fork (here one
/// calls `take_deferred_error` in a loop; in real use any thread deferring an error). The child
/// hangs in a destructor. Fix: `free_or_hold` (and `CudaBuffer`'s drop) return at once when
/// `self.forked()`; `defer_error` must not lock a forked allocator.
#[test]
fn device_buffer_dropped_in_a_child_never_hangs() {
    let _s = serial();
    let r = rig();
    let bufs: Vec<cuarena::DeviceBuffer> = (0..4)
        .map(|i| r.a.buffer(4096 << i, if i % 2 == 0 { Stream::LEGACY } else { Stream::PER_THREAD }).unwrap())
        .collect();
    quiesce(&r.sim);
    let stop = Arc::new(AtomicBool::new(false));
    let (a2, s2) = (r.a.clone(), Arc::clone(&stop));
    let hammer = std::thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            let _ = a2.take_deferred_error();
        }
    });
    let t0 = Instant::now();
    let mut outcomes = Vec::new();
    for _ in 0..60 {
        let o = in_child(Duration::from_millis(800), End::Raw, || {
            for b in &bufs {
                // SAFETY: the child's copy of the buffer is dropped once (the child `_exit`s
                // without dropping `bufs`); the parent's own is untouched.
                drop(unsafe { std::ptr::read(b) });
            }
            0
        });
        let hung = o.hung();
        outcomes.push(o);
        if hung || t0.elapsed() > Duration::from_secs(6) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    hammer.join().unwrap();
    drop(bufs);
    assert_all_returned(&r.a, Some(&r.sim), 0);
    let bad: Vec<&Outcome> =
        outcomes.iter().filter(|o| !matches!(o, Outcome::Exited { code: 0, .. })).collect();
    assert!(
        bad.is_empty(),
        "{} of {} children did not end cleanly after dropping pre-fork DeviceBuffers (a parent thread was \
         taking the deferred error): {:?}",
        bad.len(),
        outcomes.len(),
        bad.first()
    );
}

// =============================================================================================
// 5. Fork storms.
// =============================================================================================

/// WORKS. Forks from three threads at once, for about 2 s, while other threads allocate and free
/// with tags on the per-thread, legacy and user streams, announce captures and synchronise
/// (`graph_capture_begin`/`end`, `trim(true)`), and start and stop traces on another allocator.
/// Children refuse the pre-fork allocators, half make a new allocator, half end with `exit()`.
/// The parent never hangs (every thread ends within a watchdog), no child hangs, the parent's
/// allocators return everything with no overlap, and every trace the parent wrote reads whole.
#[test]
fn fork_storm_while_other_threads_allocate_capture_synchronise_and_trace() {
    let _s = serial();
    let _g = ChildGuard;
    let r = rig();
    let sim_b = sim();
    let b = Allocator::new(Arc::new(sim_b.clone()), Config::default()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let children = Arc::new(Mutex::new(Vec::<String>::new()));
    let traces = Arc::new(Mutex::new(Vec::<(PathBuf, u64)>::new()));
    let forks = Arc::new(AtomicUsize::new(0));
    let mut threads: Vec<(&str, std::thread::JoinHandle<()>)> = Vec::new();
    for t in 0..2u32 {
        let (a, sim, stop) = (r.a.clone(), r.sim.clone(), Arc::clone(&stop));
        threads.push((
            "allocator",
            std::thread::spawn(move || {
                let user = sim.create_stream();
                let mut live: Vec<(DeviceAddr, usize, Stream, u32)> = Vec::new();
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let s = [Stream::PER_THREAD, Stream::LEGACY, user][(i % 3) as usize];
                    let size = 512 + ((i as usize * 7919) % 300_000);
                    if let Ok(p) = a.allocate(size, s) {
                        let tag = (t << 24) | i;
                        sim.write_tag(p.0, size, tag, s).unwrap();
                        live.push((p, size, s, tag));
                    }
                    if live.len() > 16 || (i.is_multiple_of(5) && !live.is_empty()) {
                        let (p, size, s, tag) = live.swap_remove(i as usize % live.len());
                        sim.check_tag(p.0, size, tag, s).unwrap();
                        a.deallocate(p, size, s).unwrap();
                    }
                }
                for (p, size, s, tag) in live {
                    sim.check_tag(p.0, size, tag, s).unwrap();
                    a.deallocate(p, size, s).unwrap();
                }
                a.release_thread().unwrap();
            }),
        ));
    }
    {
        let (a, stop) = (r.a.clone(), Arc::clone(&stop));
        threads.push((
            "capture/synchronise",
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    a.graph_capture_begin();
                    std::thread::yield_now();
                    a.graph_capture_end().unwrap();
                    if i.is_multiple_of(4) {
                        let _ = a.trim(true);
                    }
                }
            }),
        ));
    }
    {
        let (b, stop, traces) = (b.clone(), Arc::clone(&stop), Arc::clone(&traces));
        threads.push((
            "trace",
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let path = temp_path(&format!("storm-{i}.bin"));
                    b.start_trace(&path).unwrap();
                    for k in 0..50 {
                        let p = b.allocate(1000 + k, Stream::PER_THREAD).unwrap();
                        b.deallocate(p, 1000 + k, Stream::PER_THREAD).unwrap();
                    }
                    let s = b.stop_trace().unwrap();
                    traces.lock().unwrap().push((path, s.records));
                }
            }),
        ));
    }
    for f in 0..3u32 {
        let (a, b, stop, children, forks) =
            (r.a.clone(), b.clone(), Arc::clone(&stop), Arc::clone(&children), Arc::clone(&forks));
        threads.push((
            "forker",
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let end = if i.is_multiple_of(2) { End::Normal } else { End::Raw };
                    let make_new = (i + f).is_multiple_of(2);
                    let o = in_child(Duration::from_secs(3), end, || {
                        let refused = matches!(a.allocate(4096, Stream::PER_THREAD), Err(Error::Forked))
                            && matches!(b.allocate(4096, Stream::LEGACY), Err(Error::Forked))
                            && matches!(a.trim(true), Err(Error::Forked))
                            && a.stats() == cuarena::Stats::default();
                        a.graph_capture_begin();
                        if !refused {
                            return 2;
                        }
                        if make_new {
                            let c =
                                Allocator::new(Arc::new(HostDevice::default()), Config::default()).unwrap();
                            c.graph_capture_begin();
                            let p = c.allocate(10_000, Stream::PER_THREAD).unwrap();
                            c.deallocate(p, 10_000, Stream::PER_THREAD).unwrap();
                            c.graph_capture_end().unwrap();
                            let _ = c.trim(true).unwrap();
                        }
                        0
                    });
                    forks.fetch_add(1, Ordering::Relaxed);
                    if !matches!(o, Outcome::Exited { code: 0, .. }) {
                        children.lock().unwrap().push(format!("forker {f} child {i} ({end:?}): {o:?}"));
                    }
                    std::thread::sleep(Duration::from_millis(3));
                }
            }),
        ));
    }
    std::thread::sleep(Duration::from_millis(2000));
    stop.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut hung = Vec::new();
    for (name, h) in threads {
        while !h.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            h.join().unwrap();
        } else {
            hung.push(name);
        }
    }
    assert!(hung.is_empty(), "parent threads hung: {hung:?}");
    let children = children.lock().unwrap();
    assert!(children.is_empty(), "children that failed or hung:\n{}", children.join("\n"));
    assert!(forks.load(Ordering::Relaxed) >= 10, "only {} forks", forks.load(Ordering::Relaxed));
    for (path, n) in traces.lock().unwrap().iter() {
        let read = cuarena::trace::read(path);
        let _ = std::fs::remove_file(path);
        assert_eq!(read.map(|r| r.len() as u64).ok(), Some(*n), "{}", path.display());
    }
    assert_all_returned(&r.a, Some(&r.sim), 0);
    assert_all_returned(&b, Some(&sim_b), 0);
}

// =============================================================================================
// 6. Grandchildren; allocators made in a child.
// =============================================================================================

/// WORKS. The parent's allocator A; a child makes allocator B (tracing to its own file) and forks
/// a grandchild, which finds A and B refused, makes C (tracing to a third file) and ends with
/// `exit()`; the child goes on with B, stops its trace (whole: the grandchild wrote nothing into
/// it) and ends with `exit()`; C's trace was finished by the grandchild's exit hook.
#[test]
fn grandchildren_refuse_both_generations_and_their_own_allocators_work() {
    let _s = serial();
    let r = rig();
    churn(&r.a, 300);
    quiesce(&r.sim);
    let notes = Notes::new("grand");
    let (path_b, path_c) = (temp_path("grand-b.bin"), temp_path("grand-c.bin"));
    let o = in_child(Duration::from_secs(10), End::Normal, || {
        let b = Allocator::new(Arc::new(HostDevice::default()), Config::default()).unwrap();
        b.start_trace(&path_b).unwrap();
        churn(&b, 300);
        let keep = b.allocate(7000, Stream::PER_THREAD).unwrap();
        let g = in_child(Duration::from_secs(5), End::Normal, || {
            let refused = r.a.forked()
                && b.forked()
                && matches!(r.a.allocate(100, Stream::PER_THREAD), Err(Error::Forked))
                && matches!(b.allocate(100, Stream::PER_THREAD), Err(Error::Forked))
                && matches!(b.deallocate(keep, 7000, Stream::PER_THREAD), Err(Error::Forked))
                && matches!(b.stop_trace(), Err(Error::Forked));
            let c = Allocator::new(Arc::new(HostDevice::default()), Config::default()).unwrap();
            if c.start_trace(&path_c).is_err() {
                return 3;
            }
            churn(&c, 100);
            if refused { 0 } else { 2 }
        });
        notes.note(&format!("grandchild: {g:?}"));
        churn(&b, 100);
        b.deallocate(keep, 7000, Stream::PER_THREAD).unwrap();
        let s = b.stop_trace().unwrap();
        let recs = cuarena::trace::read(&path_b).map(|r| r.len() as u64);
        notes.note(&format!("child: B's trace {recs:?}, summary {}", s.records));
        let live = b.stats().live_bytes;
        if g.ok_quick() && recs.ok() == Some(s.records) && s.records == 802 && live == 0 { 0 } else { 2 }
    });
    let c = cuarena::trace::read(&path_c).map(|r| r.len());
    let _ = std::fs::remove_file(&path_b);
    let _ = std::fs::remove_file(&path_c);
    assert!(o.ok_quick(), "child: {o:?}; notes:\n{}", notes.read());
    assert_eq!(c.ok(), Some(200), "the grandchild's own trace, finished at its exit");
    assert_all_returned(&r.a, Some(&r.sim), 0);
}

/// WORKS. A child makes a new allocator on a *clone* of the parent's simulated device (its
/// state is the child's copy), traces it to its own file, works it hard from four threads with
/// tags, and ends with `exit()` without stopping the trace (the exit hook finishes it). The
/// parent's allocator and trace are untouched.
#[test]
fn child_allocator_on_a_clone_of_the_parents_device_works_and_traces_to_its_own_file() {
    let _s = serial();
    let r = rig();
    let parent_trace = temp_path("clone-parent.bin");
    r.a.start_trace(&parent_trace).unwrap();
    churn(&r.a, 500);
    let keep = r.a.allocate(70 << 20, Stream::LEGACY).unwrap();
    quiesce(&r.sim);
    let notes = Notes::new("clone");
    let path = temp_path("clone-child.bin");
    let o = in_child(Duration::from_secs(15), End::Normal, || {
        let c = Allocator::new(Arc::new(r.sim.clone()), Config::default()).unwrap();
        if c.start_trace(&parent_trace).is_ok() {
            notes.note("the parent's trace file was not busy in the child");
            return 2;
        }
        c.start_trace(&path).unwrap();
        let ops = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..4u32)
            .map(|t| {
                let (c, sim, ops) = (c.clone(), r.sim.clone(), Arc::clone(&ops));
                std::thread::spawn(move || {
                    let user = sim.create_stream();
                    let mut live = Vec::new();
                    for i in 0..3000u32 {
                        let s = [Stream::PER_THREAD, Stream::LEGACY, user][(i % 3) as usize];
                        let size = 256 + (i as usize * 4099 + t as usize * 77) % 200_000;
                        let p = c.allocate(size, s).unwrap();
                        sim.write_tag(p.0, size, i ^ (t << 20), s).unwrap();
                        live.push((p, size, s, i ^ (t << 20)));
                        if live.len() > 8 {
                            let (p, size, s, tag) = live.remove(0);
                            sim.check_tag(p.0, size, tag, s).unwrap();
                            c.deallocate(p, size, s).unwrap();
                            ops.fetch_add(2, Ordering::Relaxed);
                        }
                    }
                    for (p, size, s, tag) in live {
                        sim.check_tag(p.0, size, tag, s).unwrap();
                        c.deallocate(p, size, s).unwrap();
                        ops.fetch_add(2, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let big = c.allocate(500 << 20, Stream::LEGACY).unwrap();
        c.deallocate(big, 500 << 20, Stream::LEGACY).unwrap();
        ops.fetch_add(2, Ordering::Relaxed);
        c.flush().unwrap();
        c.trim(true).unwrap();
        r.sim.synchronize();
        let s = c.stats();
        let (tags, violations) = (r.sim.tag_errors(), r.sim.violations().len());
        notes.note(&format!(
            "ops {}; live {}; tag errors {tags}; violations {violations}",
            ops.load(Ordering::Relaxed),
            s.live_bytes
        ));
        if s.live_bytes != 0 || tags != 0 || violations != 0 {
            return 3;
        }
        0
    });
    let note = notes.read();
    let ops: Option<u64> = note
        .lines()
        .find_map(|l| l.strip_prefix("ops "))
        .and_then(|l| l.split(';').next())
        .and_then(|n| n.parse().ok());
    let child_trace = cuarena::trace::read(&path).map(|r| r.len() as u64);
    let _ = std::fs::remove_file(&path);
    r.a.deallocate(keep, 70 << 20, Stream::LEGACY).unwrap();
    let summary = r.a.stop_trace().unwrap();
    let parent = cuarena::trace::read(&parent_trace).map(|r| r.len() as u64);
    let _ = std::fs::remove_file(&parent_trace);
    assert!(o.ok_quick() || matches!(o, Outcome::Exited { code: 0, .. }), "child: {o:?}; notes:\n{note}");
    assert!(ops.is_some(), "notes: {note}");
    assert_eq!(child_trace.ok(), ops, "the child's trace, finished by its exit hook");
    assert_eq!(parent.ok(), Some(summary.records));
    assert_all_returned(&r.a, Some(&r.sim), 0);
}

// =============================================================================================
// 7. The C ABI in a child (no driver on this machine).
// =============================================================================================

#[allow(dead_code)]
#[path = "../capi/src/lib.rs"]
mod cuarena_c;

/// WORKS. Every C entry point, called in a child while parent threads hammer the creation path
/// (`cuarena_malloc`) and the defaults (`cuarena_set_defaults`), fails cleanly (NULL / -1 / 1
/// with a message, or does nothing) and the child ends quickly, both ways.
#[test]
fn c_abi_every_entry_point_in_a_child_fails_cleanly_and_quickly() {
    use std::ffi::c_void;
    let _s = serial();
    if std::env::var_os("CUARENA_REQUIRE_GPU").is_some() {
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let hammers: Vec<_> = (0..2)
        .map(|k| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if k == 0 {
                        let _ = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
                    } else {
                        // SAFETY: a NUL-terminated string.
                        let _ = unsafe { cuarena_c::cuarena_set_defaults(c"".as_ptr()) };
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(20));
    let mut bad = Vec::new();
    for i in 0..12 {
        let end = if i % 2 == 0 { End::Raw } else { End::Normal };
        let notes = Notes::new(&format!("capi-{i}"));
        let o = in_child(Duration::from_secs(3), end, || {
            use cuarena_c::*;
            let null = std::ptr::null_mut::<c_void>();
            let mut fails = Vec::new();
            let mut check = |name: &str, ok: bool| {
                if !ok {
                    fails.push(name.to_string());
                }
            };
            check("malloc", cuarena_malloc(4096, 0, null).is_null());
            check("free_checked", cuarena_free_checked(0x7000_0000 as *mut c_void, 4096, 0, null) == -1);
            cuarena_free(0x7000_0000 as *mut c_void, 4096, 0, null);
            check(
                "record_stream_checked",
                cuarena_record_stream_checked(0x7000_0000 as *mut c_void, null) == 1,
            );
            cuarena_record_stream(0x7000_0000 as *mut c_void, null);
            cuarena_empty_cache();
            cuarena_set_memory_fraction(0.5, 0);
            let mut st = cuarena_stats::default();
            // SAFETY: a valid struct.
            check("get_stats", unsafe { cuarena_get_stats(0, &mut st) } == -1);
            // SAFETY: as above.
            check("peek_stats", unsafe { cuarena_peek_stats(0, &mut st) } == 1);
            check("graph_pool_retain", cuarena_graph_pool_retain(1, 2, 0) == -1);
            check("graph_pool_release", cuarena_graph_pool_release(1, 2, 0) == -1);
            check("graph_malloc", cuarena_graph_malloc(1, 2, 4096, 0, null).is_null());
            check("graph_capture_begin", cuarena_graph_capture_begin(0) == -1);
            check("graph_capture_end", cuarena_graph_capture_end(0) == -1);
            check("graph_pool_use_count", cuarena_graph_pool_use_count(1, 2, 0) == 0);
            let mut out = [std::ptr::null_mut::<c_void>(); 4];
            let mut count = 0usize;
            // SAFETY: valid out-pointers.
            check(
                "graph_pool_live",
                unsafe { cuarena_graph_pool_live(1, 2, 0, out.as_mut_ptr(), 4, &mut count) } == -1,
            );
            let c = cuarena_graph_pool_checkpoint(1, 2, 0);
            check("graph_pool_checkpoint", c.is_null());
            // SAFETY: NULL handle.
            unsafe { cuarena_graph_checkpoint_free(c) };
            check("reset_peak", cuarena_reset_peak(0) == -1);
            check("reset_counters", cuarena_reset_counters(0) == -1);
            let mut h = [0u64; 40];
            // SAFETY: 40 writable words.
            check("get_size_histogram", unsafe { cuarena_get_size_histogram(0, h.as_mut_ptr(), 40) } == -1);
            check("set_oom_hook", cuarena_set_oom_hook(0, None, null) == -1);
            check("version", cuarena_version() > 0 && !cuarena_version_string().is_null());
            let path = std::ffi::CString::new(temp_path("capi-child.bin").to_str().unwrap()).unwrap();
            // SAFETY: NUL-terminated strings.
            check("trace_start", unsafe { cuarena_trace_start(0, path.as_ptr()) } == -1);
            check("trace_stop", cuarena_trace_stop(0) == -1);
            // SAFETY: as above.
            let d = unsafe { cuarena_set_defaults(c"legacy_batch_bytes=16MiB".as_ptr()) };
            check("set_defaults", d == 0 || d == -1);
            check("last_error", !cuarena_last_error().is_null());
            notes.note(&format!("failed checks: {fails:?}; last error: {:?}", last_error_message()));
            if fails.is_empty() { 0 } else { 2 }
        });
        if !o.ok_quick() {
            bad.push(format!("child {i} ({end:?}): {o:?}; notes: {}", notes.read()));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in hammers {
        h.join().unwrap();
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// WAS A DEFECT, mended (hang; narrow: needs a process that has not yet called
/// `global`/`set_defaults`). `global.rs` registers its fork child handler (`check_locks_in_child`)
/// lazily, in the first `global()` or `set_defaults()` (`not_locked_by_the_parent`); `defaults()`,
/// public, takes `DEFAULTS` without registering it. A parent thread reading `defaults()` at the
/// fork leaves `DEFAULTS` locked in the child, no handler noticed it, and the child's first C call
/// (`cuarena_malloc` → `global` → `Config::from_env_over(&lock(&DEFAULTS))`) waits for ever, though
/// the README promises the process-wide allocator works in a child "unless a parent thread was
/// creating it at the fork". Fix: register the handler in `defaults()` too (better: once, from a
/// static constructor or `install_fork_handlers`, before either lock can be taken). Runs in a fresh
/// process (this binary again), where no cuarena call has registered it.
#[test]
fn c_abi_child_does_not_hang_when_a_parent_thread_was_reading_the_defaults() {
    const NAME: &str = "c_abi_child_does_not_hang_when_a_parent_thread_was_reading_the_defaults";
    if std::env::var_os("CUARENA_REQUIRE_GPU").is_some() {
        return;
    }
    if std::env::var_os("CUARENA_S29B_FRESH").is_none() {
        let _s = serial();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
            .env("CUARENA_S29B_FRESH", "1")
            .output()
            .unwrap();
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "fresh process:\n{text}");
        return;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = Arc::clone(&stop);
    let reader = std::thread::spawn(move || {
        let mut n = 0u64;
        while !s2.load(Ordering::Relaxed) {
            n += cuarena::global::defaults().len() as u64 + 1;
        }
        n
    });
    std::thread::sleep(Duration::from_millis(10));
    let mut outcomes = Vec::new();
    let t0 = Instant::now();
    for _ in 0..40 {
        let o = in_child(Duration::from_millis(800), End::Raw, || {
            let p = cuarena_c::cuarena_malloc(4096, 0, std::ptr::null_mut());
            if p.is_null() { 0 } else { 2 }
        });
        let hung = o.hung();
        outcomes.push(o);
        if hung || t0.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    let hung = outcomes.iter().filter(|o| o.hung()).count();
    assert_eq!(
        hung,
        0,
        "{hung} of {} children hung in their first cuarena_malloc (a parent thread was reading \
         cuarena::global::defaults() at the fork): {:?}",
        outcomes.len(),
        outcomes.iter().find(|o| o.hung())
    );
}
