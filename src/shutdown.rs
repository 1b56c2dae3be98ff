//! The process's life: exit and fork.
//!
//! Exit: once it has begun, cuarena makes no CUDA call. The CUDA driver tears itself down during
//! `exit`, so calls from late destructors (thread-local arenas, statics) can crash.
//! `mark_exiting` is registered with `atexit` the first time a CUDA allocator is created; from
//! then on the release paths skip driver calls and leave the memory to the process teardown.
//!
//! Fork: see "Fork" below.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static EXITING: AtomicBool = AtomicBool::new(false);
static HOOK: Once = Once::new();

unsafe extern "C" {
    fn atexit(cb: extern "C" fn()) -> i32;
}

extern "C" fn mark_exiting() {
    EXITING.store(true, Ordering::SeqCst);
}

/// True once process exit has begun.
pub fn process_exiting() -> bool {
    EXITING.load(Ordering::Acquire)
}

/// Registers the exit hook (once).
pub fn install_exit_hook() {
    HOOK.call_once(|| {
        // SAFETY: `mark_exiting` is a plain function that only stores to an atomic; atexit
        // accepts it for the life of the process.
        unsafe { atexit(mark_exiting) };
    });
}

// ---------------------------------------------------------------------------------------------
// Fork.
//
// After `fork()` the child has one thread, the one that forked. Locks other threads of the parent
// held at that moment stay held, their thread-local state is a copy no thread owns, and the CUDA
// driver is unusable in the child if the parent had initialised it (CUDA: "Cannot re-initialize
// CUDA in forked subprocess", as PyTorch puts it). So an allocator made before a fork is not
// used in the child at all: every call on it returns `Error::Forked` before it takes a lock
// (`Allocator::usable`), its thread-local slots and trace buffers are forgotten in the child
// rather than given back at the thread's exit, its last handle's drop leaks it, and the exit
// hooks pass it by. An allocator made in the child works as in any process. The few process-wide
// locks a new allocator in the child needs are held across the fork by `pthread_atfork` prepare
// handlers (leaf locks, held briefly: `sync.rs`'s capture table, `trace.rs`'s file lists), or
// checked in the child (`global.rs`'s creation lock, which a creation holds across `cuInit`).

/// Forks since the process began, counted by the first child handler.
static FORKS: AtomicU64 = AtomicU64::new(0);
#[cfg_attr(any(loom, not(unix), cuarena_mutant = "fork_ignored"), allow(dead_code))]
static FORK_HOOK: Once = Once::new();

#[cfg(all(unix, not(loom)))]
unsafe extern "C" {
    #[cfg_attr(cuarena_mutant = "fork_ignored", allow(dead_code))]
    fn pthread_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
    ) -> i32;
}

#[cfg_attr(any(loom, not(unix), cuarena_mutant = "fork_ignored"), allow(dead_code))]
extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// Registers fork handlers: `prepare` runs in the forking thread before the fork (handlers in
/// the reverse order of their registration), `parent` and `child` after it in each process (in
/// the order of registration). A no-op where there is no `fork`. The generation's own child
/// handler is registered first (so it runs first in the child), by the first call.
pub(crate) fn at_fork(
    prepare: Option<extern "C" fn()>,
    parent: Option<extern "C" fn()>,
    child: Option<extern "C" fn()>,
) {
    // The mutation `fork_ignored` registers nothing and never reports a fork: the tests of
    // `tests/adversarial_s29_fork.rs` must then fail (children that hang, a trace written twice).
    #[cfg(all(unix, not(loom), not(cuarena_mutant = "fork_ignored")))]
    {
        FORK_HOOK.call_once(|| {
            // SAFETY: a plain function that only bumps an atomic, kept for the process's life.
            unsafe { pthread_atfork(None, None, Some(count_fork_in_child)) };
        });
        // SAFETY: the caller's handlers are plain functions, kept for the process's life; each
        // is safe to run in its place (prepare: may take locks; child: the only thread).
        unsafe { pthread_atfork(prepare, parent, child) };
    }
    #[cfg(not(all(unix, not(loom), not(cuarena_mutant = "fork_ignored"))))]
    {
        let _ = (prepare, parent, child, &FORK_HOOK);
    }
}

/// Defines `pub(crate) fn $install()`, which registers `pthread_atfork` handlers ([`at_fork`])
/// that hold a guard across a fork: the prepare handler takes it (`$prepare`, an expression
/// of type `$ty`) on the forking thread, the parent's handler drops it, and the child's hands
/// it (`None` if the forking thread's thread-locals were gone) to `$child`, a closure that
/// cleans up the child's copy. The guard lives in a thread-local of the forking thread between
/// the handlers. Nothing is registered under loom, which has no fork.
macro_rules! hold_across_fork {
    ($(#[$doc:meta])* fn $install:ident, $ty:ty, prepare: $prepare:expr, child: $child:expr $(,)?) => {
        $(#[$doc])*
        pub(crate) fn $install() {
            #[cfg(not(loom))]
            {
                std::thread_local! {
                    /// The guard, held by the forking thread from `prepare` to the fork's end.
                    static HELD_ACROSS_FORK: std::cell::RefCell<Option<$ty>> =
                        const { std::cell::RefCell::new(None) };
                }
                extern "C" fn prepare() {
                    let g: $ty = $prepare;
                    let _ = HELD_ACROSS_FORK.try_with(move |h| *h.borrow_mut() = Some(g));
                }
                extern "C" fn parent() {
                    let _ = HELD_ACROSS_FORK.try_with(|h| drop(h.borrow_mut().take()));
                }
                extern "C" fn child() {
                    let g: Option<$ty> = HELD_ACROSS_FORK.try_with(|h| h.borrow_mut().take()).ok().flatten();
                    ($child)(g);
                }
                crate::shutdown::at_fork(Some(prepare), Some(parent), Some(child));
            }
        }
    };
}
pub(crate) use hold_across_fork;

/// The fork generation an object was made in: it is of a forked child's parent (unusable
/// there) once the process has forked since.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Born(u64);

impl Born {
    pub(crate) fn now() -> Born {
        Born(FORKS.load(Ordering::Acquire))
    }

    /// True in a child forked after this was made.
    #[inline]
    pub(crate) fn forked(self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.0
    }
}
