//! The one place that chooses between `std` and `loom` primitives.
//!
//! Every protocol of the crate takes its atomics, cells, locks and thread-locals from here, so
//! the models in `loom-tests/` (built with `RUSTFLAGS="--cfg loom"`) drive the real code.
//!
//! Not chosen here, by design:
//! - `Arc` is always `std::sync::Arc`. Reference counts are not one of our protocols, and
//!   `Arc<dyn Device>` needs std's unsized coercion.
//! - Process-wide id counters ([`next_id`]) use a std atomic: a unique number, nothing ordered
//!   by it, and loom atomics cannot live in statics. The process-wide table of announced
//!   captures ([`announce_captures`]) is a facade lock and condition variable in a static: a
//!   `loom::lazy_static!` under loom (made afresh in each execution of a model), a plain
//!   static otherwise.
//! - The simulated device (`testkit/src/host.rs`) is a test fixture with real std threads; it is not
//!   run under loom (the models use `loom-tests/src/model.rs`).

#[cfg(loom)]
pub(crate) use loom::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering, fence},
    sync::{Condvar, Mutex, MutexGuard},
    thread::yield_now,
    thread_local,
};

#[cfg(not(loom))]
pub(crate) use std::{
    sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering, fence},
    sync::{Condvar, Mutex, MutexGuard},
    thread::yield_now,
    thread_local,
};

/// The cheap half of an asymmetric barrier pair (`claim.rs`): orders the calling thread's
/// earlier stores before its later loads, given that the other side calls [`heavy_barrier`].
/// A compiler fence where `membarrier` works, else a full fence. Under loom, `fence(SeqCst)`
/// (the mutation `claim_no_light_barrier` drops it, and the loom model must then fail).
#[inline(always)]
pub(crate) fn light_barrier() {
    #[cfg(loom)]
    {
        #[cfg(not(cuarena_mutant = "claim_no_light_barrier"))]
        loom::sync::atomic::fence(Ordering::SeqCst);
    }
    #[cfg(not(loom))]
    {
        if membarrier::available() {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            std::sync::atomic::fence(Ordering::SeqCst);
        }
    }
}

/// Decides now, off any fast path, how the barriers are made (registering `membarrier` can
/// take milliseconds). Called when an allocator is made.
pub(crate) fn prepare_barriers() {
    #[cfg(not(loom))]
    membarrier::available();
}

/// The expensive half: after it returns, every thread that called [`light_barrier`] has either
/// made its earlier stores visible to us or will see our earlier stores in its later loads.
/// False if it could not be done (then the caller must not rely on it).
pub(crate) fn heavy_barrier() -> bool {
    #[cfg(loom)]
    {
        loom::sync::atomic::fence(Ordering::SeqCst);
        true
    }
    #[cfg(not(loom))]
    {
        std::sync::atomic::fence(Ordering::SeqCst);
        !membarrier::available() || membarrier::all_threads()
    }
}

#[cfg(not(loom))]
mod membarrier {
    //! `membarrier(2)`, registered once per process. If registration fails, [`available`] is
    //! false for good and both barrier halves are full fences. The answer is fixed the first
    //! time either half asks, before it acts on it, so the two halves always agree.

    use std::sync::OnceLock;

    static AVAILABLE: OnceLock<bool> = OnceLock::new();

    #[inline(always)]
    pub(super) fn available() -> bool {
        *AVAILABLE.get_or_init(register)
    }

    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    mod sys {
        #[cfg(target_arch = "x86_64")]
        pub(super) const NR_MEMBARRIER: i64 = 324;
        #[cfg(target_arch = "aarch64")]
        pub(super) const NR_MEMBARRIER: i64 = 283;
        pub(super) const CMD_PRIVATE_EXPEDITED: i32 = 1 << 3;
        pub(super) const CMD_REGISTER_PRIVATE_EXPEDITED: i32 = 1 << 4;
        unsafe extern "C" {
            pub(super) fn syscall(num: i64, ...) -> i64;
        }
    }

    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    fn register() -> bool {
        // SAFETY: membarrier takes (cmd, flags, cpu_id) integers and touches no memory of ours.
        unsafe { sys::syscall(sys::NR_MEMBARRIER, sys::CMD_REGISTER_PRIVATE_EXPEDITED, 0i32, 0i32) == 0 }
    }

    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    fn register() -> bool {
        false
    }

    /// Every running thread of the process executes a full memory barrier before this returns.
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub(super) fn all_threads() -> bool {
        // SAFETY: as in `register`; the process registered for this command.
        unsafe { sys::syscall(sys::NR_MEMBARRIER, sys::CMD_PRIVATE_EXPEDITED, 0i32, 0i32) == 0 }
    }

    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    pub(super) fn all_threads() -> bool {
        false
    }
}

/// The capture table's rows: (device, readers, announced).
type CaptureTable = Vec<(u64, usize, u64)>;

/// Captures announced to any allocator of the process (`Allocator::graph_capture_begin`), per
/// device (`Device::device_id`): a device synchronise breaks a capture on its device whichever
/// allocator makes it (helper-40, `tests/adversarial_s28c.rs`). Each entry is (device, readers,
/// announced): `readers` counts the device's synchronises and legacy-stream uses running now
/// ([`holding_off_announcements`]), each of which checks `announced` after it began; none is
/// left with both 0. An announcement of a device waits until its readers are 0, so no capture
/// is announced between such a check and its use (helper-38, `tests/adversarial_s28a.rs`).
/// Readers never wait (a reader inside a reader is safe), and nothing waits for another
/// device's (helper-42, `tests/adversarial_s28e.rs`: with one std `RwLock` for all devices, a
/// synchronise of one device held up, through a waiting announcement, every other device's
/// legacy-stream calls). Held only briefly, never across a device call; held across a fork and
/// emptied in the child ([`install_fork_handlers`]). The loom model
/// `loom-tests/tests/captures.rs` drives it through the allocator.
#[cfg(not(loom))]
static CAPTURES: Mutex<CaptureTable> = Mutex::new(Vec::new());
/// Signalled when a device's readers drop to 0.
#[cfg(not(loom))]
static CAPTURES_FREE: Condvar = Condvar::new();

#[cfg(loom)]
loom::lazy_static! {
    static ref CAPTURES: Mutex<CaptureTable> = Mutex::new(Vec::new());
    static ref CAPTURES_FREE: Condvar = Condvar::new();
}

fn captures() -> MutexGuard<'static, CaptureTable> {
    lock(&CAPTURES)
}

crate::shutdown::hold_across_fork!(
    /// Registers the capture table's fork handlers (`shutdown.rs`, "Fork"): the table is locked
    /// across a fork (a leaf lock, held briefly: the prepare handler waits at most for one
    /// check), and emptied in the child, whose readers and announcing allocators were the
    /// parent's (a reader of the forking thread's own, when a device forks inside a synchronise,
    /// ends on an emptied entry: [`CaptureReader`] saturates).
    fn install_fork_handlers,
    MutexGuard<'static, CaptureTable>,
    prepare: captures(),
    child: |g: Option<MutexGuard<'static, CaptureTable>>| {
        if let Some(mut g) = g {
            g.clear();
        }
    },
);

/// The index of `device`'s entry, made if there is none.
fn capture_entry(c: &mut CaptureTable, device: u64) -> usize {
    c.iter().position(|e| e.0 == device).unwrap_or_else(|| {
        c.push((device, 0, 0));
        c.len() - 1
    })
}

/// Drops entry `i` if it holds nothing.
fn tidy_captures(c: &mut CaptureTable, i: usize) {
    if c[i].1 == 0 && c[i].2 == 0 {
        c.swap_remove(i);
    }
}

/// Adds `n` announced captures on `device` (`up`: once no synchronise or legacy-stream use of
/// it is running), or takes `n` away.
pub(crate) fn announce_captures(device: u64, n: u64, up: bool) {
    // The mutation `captures_per_allocator` leaves the count to each allocator's own (as before
    // the twenty-eighth session): the test
    // `adversarial_s28c::a_capture_announced_to_one_allocator_is_not_broken_by_another_on_the_same_device`
    // must then fail.
    if cfg!(cuarena_mutant = "captures_per_allocator") || n == 0 {
        return;
    }
    let mut c = captures();
    let mut i = capture_entry(&mut c, device);
    if up {
        while c[i].1 > 0 {
            c = CAPTURES_FREE.wait(c).unwrap_or_else(|p| p.into_inner());
            i = capture_entry(&mut c, device);
        }
    }
    let count = &mut c[i].2;
    *count = if up { count.saturating_add(n) } else { count.saturating_sub(n) };
    tidy_captures(&mut c, i);
}

/// True while a capture is announced on `device`.
pub(crate) fn captures_announced(device: u64) -> bool {
    captures().iter().any(|e| e.0 == device && e.2 > 0)
}

/// A running reader of `device` (see [`CAPTURES`]), ended on drop (a panic in the reader too).
struct CaptureReader(u64);

impl Drop for CaptureReader {
    fn drop(&mut self) {
        let mut c = captures();
        let i = capture_entry(&mut c, self.0);
        // Saturating: in a forked child whose fork was made inside this reader (by a device's
        // synchronise), the table was emptied under it. The mutation `fork_reader_wraps` wraps
        // instead: the test
        // `adversarial_s29b_fork::fork_inside_a_device_synchronise_then_a_new_allocator_in_the_child_announces_a_capture`
        // must then fail (every announcement would wait for ever).
        c[i].1 = if cfg!(cuarena_mutant = "fork_reader_wraps") {
            c[i].1.wrapping_sub(1)
        } else {
            c[i].1.saturating_sub(1)
        };
        let free = c[i].1 == 0;
        tidy_captures(&mut c, i);
        if free {
            CAPTURES_FREE.notify_all();
        }
    }
}

/// Runs `f` as a reader of `device`: a use of the legacy stream outside a call on it, or a
/// device synchronise, with the check that allows it ([`captures_announced`] among it). No
/// capture is announced on `device` until `f` returns, so none begins between the check and
/// the use (helper-38, `tests/adversarial_s28a.rs`).
pub(crate) fn holding_off_announcements<R>(device: u64, f: impl FnOnce() -> R) -> R {
    {
        let mut c = captures();
        let i = capture_entry(&mut c, device);
        c[i].1 += 1;
    }
    let _reader = CaptureReader(device);
    f()
}

/// A process-wide unique, non-zero id.
pub(crate) fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    // Not `const { .. }`: loom's `thread_local!` has no such form.
    #[allow(clippy::missing_const_for_thread_local)]
    static THREAD_ID: u64 = next_id();
}

/// A number naming the calling thread, never reused in the process (unlike OS thread ids). In
/// a thread's late destructors, where its thread-locals are gone, a fresh number: callers use
/// it only to tell threads apart, and naming one thread twice is always safe for them.
pub(crate) fn thread_id() -> u64 {
    THREAD_ID.try_with(|id| *id).unwrap_or_else(|_| next_id())
}

/// `std`'s `UnsafeCell` with loom's `with`/`with_mut` access style.
#[cfg(not(loom))]
#[derive(Debug, Default)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    #[inline(always)]
    #[allow(dead_code)] // loom's interface; the crate reads through `with_mut` today
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Locks a mutex, ignoring poisoning: every critical section in this crate leaves its data
/// consistent before any call that could panic, so a poisoned lock holds valid data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Chooses an ordering, or its deliberately weakened form in a loom mutation build
/// (`--cfg cuarena_mutant="NAME"`); see `loom-tests/README.md`. Normal builds get `strong`.
macro_rules! ordering {
    ($strong:expr, $mutant:literal => $weak:expr) => {{
        #[cfg(cuarena_mutant = $mutant)]
        let o = $weak;
        #[cfg(not(cuarena_mutant = $mutant))]
        let o = $strong;
        o
    }};
}
pub(crate) use ordering;
