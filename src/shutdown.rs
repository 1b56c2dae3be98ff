//! Process-exit detection: once exit has begun, cuarena makes no CUDA call.
//!
//! The CUDA driver tears itself down during `exit`, so calls from late destructors
//! (thread-local arenas, statics) can crash. `mark_exiting` is registered with `atexit` the
//! first time a CUDA allocator is created; from then on the release paths skip driver calls and
//! leave the memory to the process teardown.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

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
