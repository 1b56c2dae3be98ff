//! The one place that chooses between `std` and `loom` primitives.
//!
//! Every protocol of the crate takes its atomics, cells, locks and thread-locals from here, so
//! the models in `loom-tests/` (built with `RUSTFLAGS="--cfg loom"`) drive the real code.
//!
//! Not chosen here, by design:
//! - `Arc` is always `std::sync::Arc`. Reference counts are not one of our protocols, and
//!   `Arc<dyn Device>` needs std's unsized coercion.
//! - Process-wide id counters ([`next_id`]) use a std atomic: a unique number, nothing ordered
//!   by it, and loom atomics cannot live in statics.
//! - The simulated device (`device/host.rs`) is a test fixture with real std threads; it is not
//!   run under loom (the models use `device/model.rs`).

#[cfg(loom)]
pub(crate) use loom::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering},
    sync::{Mutex, MutexGuard},
    thread_local,
};

#[cfg(not(loom))]
pub(crate) use std::{
    sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering},
    sync::{Mutex, MutexGuard},
    thread_local,
};

/// A process-wide unique, non-zero id.
pub(crate) fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
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
