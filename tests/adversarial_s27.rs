//! Twenty-seventh session's attacks (helper-34): the allocator's lifecycle (many allocators
//! made and dropped on long-lived threads, threads that outlive the allocator they used,
//! parked arenas at the drop), thread-per-request traffic, and `release_thread`, `flush`,
//! `trim` and `set_limit_bytes` racing allocation traffic under a tight cap.
//!
//! Host memory is measured with a counting global allocator (this binary's own): the tests
//! that read it hold [`SERIAL`], and so does every other test here, so that nothing else
//! allocates meanwhile. Device-side leaks are seen on the testkit's `LightDevice`, which
//! counts events created and not destroyed, and through the strong count of the device's
//! `Arc`: an allocator dropped with everything it made gone leaves the device with one owner.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use cuarena::{Allocator, Stream};
use std::time::Duration;

use cuarena_testkit::LightDevice;

mod common;
use common::*;

/// Counts the heap bytes the process holds, to see host memory that is never given back.
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

/// Tests that measure the heap run alone.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn heap() -> isize {
    HEAP.load(Ordering::Relaxed)
}

/// A `LightDevice` (no race checker, events that complete `latency_ms` after their record)
/// held by the test, so its owners can be counted.
fn light(latency_ms: u64) -> Arc<LightDevice> {
    Arc::new(LightDevice::new(1 << 30, Duration::from_millis(latency_ms)))
}

/// An allocator over `dev` with `small()`'s configuration.
fn on_light(dev: &Arc<LightDevice>) -> Allocator {
    Allocator::new(Arc::clone(dev) as Arc<dyn cuarena::Device>, small().build().unwrap()).unwrap()
}

/// What an allocator's drop must leave behind once every thread that used it has moved on:
/// the device with no owner but the test, and no event of the allocator's alive.
fn device_let_go(dev: &Arc<LightDevice>, what: &str) {
    assert_eq!(
        (Arc::strong_count(dev), dev.live_events()),
        (1, 0),
        "{what}: (owners of the device, live events) after every allocator was dropped"
    );
}

/// Makes a block of the calling thread's arena for `s` wait in that arena as a fenced remote
/// free: another thread frees it on its per-thread stream and exits (its batch goes out under
/// an event), and this thread's `flush` takes the batch in while the event is still running.
/// Also leaves one block freed by its owner in the arena.
fn fenced_free_in_own_arena(a: &Allocator, s: Stream) {
    let p = a.allocate(1000, s).unwrap();
    let q = a.allocate(1000, s).unwrap();
    let a2 = a.clone();
    std::thread::spawn(move || {
        a2.deallocate_per_thread(p, 1000).unwrap();
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    a.flush().unwrap();
    a.deallocate(q, 1000, s).unwrap();
}

/// Thousands of allocators made and dropped, one after another, on two long-lived threads
/// that never call `release_thread`: each thread's slot for a dropped allocator is forgotten
/// when the thread makes its next one (`with_slot`, "Forget slots of dropped allocators").
/// Host memory must stay flat: what one allocator's lifetime left behind must not pile up.
/// On the code of this session each lifetime left about 15 KB: the dropped slot's arenas
/// (`Box<Arena>` leaked by `OwnedArena::new`) are never freed.
#[test]
fn allocators_dropped_on_long_lived_threads_leave_no_host_memory_behind() {
    let _g = serial();
    let dev = light(0);
    // Each thread: 50 lifetimes to warm up, a barrier where the test reads the heap, 400 more,
    // another barrier.
    let sync = Arc::new(Barrier::new(3));
    let hs: Vec<_> = (0..2)
        .map(|t| {
            let (dev, sync) = (Arc::clone(&dev), Arc::clone(&sync));
            std::thread::spawn(move || {
                let u = Stream::from_raw(0x5000 + t);
                let live = Live::default();
                for n in [50, 400] {
                    for _ in 0..n {
                        lifetime(&dev, u, &live);
                    }
                    sync.wait();
                    sync.wait();
                }
                live.assert_clean();
            })
        })
        .collect();
    sync.wait();
    let before = heap();
    sync.wait();
    sync.wait();
    let grown = heap() - before;
    sync.wait();
    hs.into_iter().for_each(|h| h.join().unwrap());
    device_let_go(&dev, "long-lived threads");
    assert!(
        grown < 800 * 512,
        "800 allocator lifetimes on two long-lived threads left {grown} B of host memory behind ({} B each)",
        grown / 800
    );
}

/// One allocator's life on the calling thread: small, medium and large blocks on the
/// per-thread, legacy and user stream `u`, all freed, the allocator dropped without
/// `release_thread`.
fn lifetime(dev: &Arc<LightDevice>, u: Stream, live: &Live) {
    let a = on_light(dev);
    let mut blocks = Vec::new();
    for s in streams(u) {
        for size in [1000, 40_000, 3 << 20] {
            let p = a.allocate(size, s).unwrap();
            assert_eq!(p.0 % 256, 0);
            live.insert(p, size);
            blocks.push((p, size, s));
        }
    }
    for (p, size, s) in blocks {
        live.remove(p);
        a.deallocate(p, size, s).unwrap();
    }
    assert_eq!(a.stats().live_bytes, 0);
    if std::env::var("RELEASE").is_ok() {
        a.release_thread().unwrap();
    }
}
fn streams(u: Stream) -> Vec<Stream> {
    match std::env::var("STREAMS").as_deref() {
        Ok("fixed") => vec![Stream::PER_THREAD, Stream::LEGACY],
        Ok("user") => vec![u],
        _ => vec![Stream::PER_THREAD, Stream::LEGACY, u],
    }
}
