//! A counting global allocator for the tests that look for host memory never given back
//! (`adversarial_s27.rs`, `adversarial_s27b.rs`): every allocation goes to `System`, and
//! [`heap`] is the bytes held now. Included with `#[path]` by a test binary that wants it (a
//! global allocator is the whole binary's, so it is not in `mod.rs`, which every test shares).
//! The tests that read it run one at a time ([`serial`]), so that nothing else allocates
//! meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicIsize, Ordering};

struct Counting;

static HEAP: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is passed on to `System` unchanged; only a counter is kept beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HEAP.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HEAP.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` came from `System` with layout `l` (every allocation goes there).
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The heap bytes the process holds now.
pub fn heap() -> isize {
    HEAP.load(Ordering::Relaxed)
}

static SERIAL: Mutex<()> = Mutex::new(());

/// Held by every test of the binary: the heap is the process's.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}
