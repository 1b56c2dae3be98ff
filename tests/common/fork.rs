// The fork harness of `adversarial_s29_fork.rs` and `adversarial_s29b_fork.rs`, brought into
// each with `include!` (its items stay the test's own). The includer provides the imports:
// `std::io::Write`, `std::path::PathBuf`, `std::sync::atomic::{AtomicBool, AtomicI32,
// Ordering}`, `std::sync::{Mutex, MutexGuard}`, `std::time::{Duration, Instant}`,
// `cuarena::{Allocator, Device}`, `cuarena_testkit::{HostDevice, Interpose}`.
//
// A test forks from its own (harness) thread with [`in_child`] (the child runs a closure and ends
// with `_exit` or `exit`) or [`fork_continue`] (both processes go on from inside a call); the
// parent polls `waitpid` with a time limit, and reports a child still running then as hung (its
// `/proc` state; with CUARENA_FORK_GDB=1 its stack too), then kills it.

unsafe extern "C" {
    fn fork() -> i32;
    fn _exit(code: i32) -> !;
    fn waitpid(pid: i32, status: *mut i32, options: i32) -> i32;
    fn kill(pid: i32, sig: i32) -> i32;
}

const WNOHANG: i32 = 1;
const SIGKILL: i32 = 9;

/// One forking test at a time: a child must not inherit another test's stalled thread.
fn serial() -> MutexGuard<'static, ()> {
    static S: Mutex<()> = Mutex::new(());
    S.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a child ends once its work is done.
#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    /// `_exit`: no destructor, no `atexit` handler.
    Raw,
    /// `std::process::exit` (glibc `exit`): TLS destructors, then `atexit` handlers.
    Normal,
}

#[derive(Debug)]
enum Outcome {
    Exited {
        code: i32,
        after: Duration,
    },
    #[allow(dead_code)] // shown through Debug
    Signaled {
        signal: i32,
        after: Duration,
    },
    #[allow(dead_code)] // shown through Debug
    Hung {
        state: String,
    },
}

#[allow(dead_code)]
impl Outcome {
    fn ok_quick(&self) -> bool {
        matches!(self, Outcome::Exited { code: 0, after } if *after < Duration::from_secs(3))
    }
    fn hung(&self) -> bool {
        matches!(self, Outcome::Hung { .. })
    }
}

/// A file a child writes notes to, for the parent to read.
struct Notes(PathBuf);

impl Notes {
    fn new(name: &str) -> Notes {
        let p = std::env::temp_dir().join(format!("cuarena-fork-{}-{name}.notes", std::process::id()));
        let _ = std::fs::remove_file(&p);
        Notes(p)
    }
    fn note(&self, s: &str) {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&self.0) {
            let _ = writeln!(f, "{s}");
        }
    }
    fn read(&self) -> String {
        std::fs::read_to_string(&self.0).unwrap_or_default()
    }
}

impl Drop for Notes {
    fn drop(&mut self) {
        if !IN_CHILD.load(Ordering::SeqCst) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

#[allow(dead_code)]
fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cuarena-fork-{}-{name}", std::process::id()))
}

/// The state of process `pid` from `/proc` (R running, S sleeping; wchan names the kernel wait).
fn proc_state(pid: i32) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next()).unwrap_or("?").to_string();
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.count()).unwrap_or(0);
    format!("state {state}, wchan {wchan:?}, {threads} thread(s)")
}

/// Waits for child `pid` up to `limit`; a child still running then is killed and reported hung.
fn wait_child(pid: i32, limit: Duration) -> Outcome {
    let t0 = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out-pointer.
        let r = unsafe { waitpid(pid, &mut status, WNOHANG) };
        if r == pid {
            let after = t0.elapsed();
            return if status & 0x7f == 0 {
                Outcome::Exited { code: (status >> 8) & 0xff, after }
            } else {
                Outcome::Signaled { signal: status & 0x7f, after }
            };
        }
        assert!(r == 0, "waitpid({pid}) failed");
        if t0.elapsed() > limit {
            let mut state = proc_state(pid);
            // CUARENA_FORK_GDB=1: the hung child's stack, from gdb, for the report.
            if std::env::var_os("CUARENA_FORK_GDB").is_some()
                && let Ok(o) = std::process::Command::new("gdb")
                    .args(["-batch", "-p", &pid.to_string(), "-ex", "bt 40"])
                    .output()
            {
                let bt = String::from_utf8_lossy(&o.stdout);
                let frames: Vec<&str> = bt.lines().filter(|l| l.starts_with('#')).collect();
                state = format!("{state}\n{}", frames.join("\n"));
            }
            // SAFETY: our own child.
            unsafe {
                kill(pid, SIGKILL);
                waitpid(pid, &mut status, 0);
            }
            return Outcome::Hung { state };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn end_child(end: End, code: i32) -> ! {
    match end {
        // SAFETY: ends the child at once.
        End::Raw => unsafe { _exit(code) },
        End::Normal => std::process::exit(code),
    }
}

/// Forks; the child runs `work` (its exit code; 101 if it panicked) and ends as `end` says; the
/// parent waits up to `limit`.
fn in_child(limit: Duration, end: End, work: impl FnOnce() -> i32) -> Outcome {
    // SAFETY: the child runs the closure and exits.
    let pid = unsafe { fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        IN_CHILD.store(true, Ordering::SeqCst);
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or(101);
        end_child(end, code);
    }
    wait_child(pid, limit)
}

/// True in a child made by [`fork_continue`] or [`in_child`].
static IN_CHILD: AtomicBool = AtomicBool::new(false);
/// The last child [`fork_continue`] made (in the parent).
#[allow(dead_code)]
static CHILD_PID: AtomicI32 = AtomicI32::new(0);

/// Forks here, from inside whatever call is on the stack; both processes go on. True in the
/// child (which sets `IN_CHILD`), false in the parent (`CHILD_PID` names the child).
#[allow(dead_code)]
fn fork_continue() -> bool {
    // SAFETY: both sides go on; the child is confined by `ChildGuard`.
    let pid = unsafe { fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        IN_CHILD.store(true, Ordering::SeqCst);
        true
    } else {
        CHILD_PID.store(pid, Ordering::SeqCst);
        false
    }
}

/// Held by a test that forks with [`fork_continue`]: a child that unwinds out of the test (a
/// panic) ends here instead of running the rest of the test harness.
#[allow(dead_code)]
struct ChildGuard;

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if IN_CHILD.load(Ordering::SeqCst) {
            // SAFETY: ends the child at once.
            unsafe { _exit(97) };
        }
    }
}


/// Lets the simulator's stream workers finish and exit (they idle out after 20 ms): a worker
/// thread does not survive a fork, and the child starts its own.
fn quiesce(sim: &HostDevice) {
    sim.synchronize();
    std::thread::sleep(Duration::from_millis(80));
}

/// A fresh simulated device that names itself as another (`id`): a new allocator in the child
/// over it shares the parent's device's entry in the process-wide capture table, as every CUDA
/// allocator of one ordinal does.
struct SameId {
    sim: HostDevice,
    id: u64,
}

impl Interpose for SameId {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn device_id(&self) -> u64 {
        self.id
    }
}

#[allow(dead_code)]
/// Asserts the child exited with 0, quickly.
#[track_caller]
fn assert_quick_success(what: &str, o: &Outcome, notes: &Notes) {
    match o {
        Outcome::Exited { code: 0, after } if *after < Duration::from_secs(2) => {}
        Outcome::Hung { state } => {
            panic!("{what}: child hung ({state}); its notes:\n{}", notes.read())
        }
        o => panic!("{what}: child ended {o:?}; its notes:\n{}", notes.read()),
    }
}


/// A thread allocates on a new user stream, frees there and ends holding its superblock: its
/// arena is parked (until a device synchronise gives it back).
fn park_an_arena(a: &Allocator, sim: &HostDevice) {
    let stream = sim.create_stream();
    let a2 = a.clone();
    std::thread::spawn(move || {
        let p = a2.allocate(4096, stream).unwrap();
        a2.deallocate(p, 4096, stream).unwrap();
    })
    .join()
    .unwrap();
    assert!(a.parked_bytes() > 0, "a parked arena");
}
