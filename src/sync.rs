//! The one place that chooses between `std` and `loom` primitives.
//!
//! Every module of the crate takes its atomics, cells, locks and thread-locals from here, so
//! the models in `loom-tests/` (built with `RUSTFLAGS="--cfg loom"`) drive the real code.

#[cfg(loom)]
pub(crate) use loom::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering},
    sync::{Arc, Mutex, MutexGuard},
    thread_local,
};

#[cfg(not(loom))]
pub(crate) use std::{
    sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering},
    sync::{Arc, Mutex, MutexGuard, Weak},
    thread_local,
};

/// loom's `Arc` has no weak form. Under loom a thread slot holds its allocator strongly,
/// which only delays the allocator's drop until the model's threads are gone.
#[cfg(loom)]
pub(crate) struct Weak<T>(Arc<T>);

#[cfg(loom)]
impl<T> Weak<T> {
    pub(crate) fn upgrade(&self) -> Option<Arc<T>> {
        Some(Arc::clone(&self.0))
    }
    pub(crate) fn strong_count(&self) -> usize {
        1
    }
}

/// A weak reference to `a`.
#[cfg(loom)]
pub(crate) fn downgrade<T>(a: &Arc<T>) -> Weak<T> {
    Weak(Arc::clone(a))
}

/// A weak reference to `a`.
#[cfg(not(loom))]
pub(crate) fn downgrade<T>(a: &Arc<T>) -> Weak<T> {
    Arc::downgrade(a)
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
    #[allow(dead_code)] // part of loom's interface; the crate uses `with_mut` today
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
