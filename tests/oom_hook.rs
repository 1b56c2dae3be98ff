//! The OOM hook (issue 11, item 4): called after cuarena's own reclaim fails, on the allocating
//! thread, with no cuarena lock held; a retry it asks for is bounded; a hook that frees memory
//! makes the allocation succeed.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::{host, small};
use cuarena::{Allocator, DeviceAddr, Error, MAX_OOM_RETRIES, Stream};
use cuarena_testkit::host_allocator;

const MIB: usize = 1 << 20;

/// An allocator capped at 8 MiB; 1 MiB blocks come from the global pool (no large superblocks).
fn config() -> cuarena::Config {
    small().large_max(64 << 10).max_bytes(8 * MIB).build().unwrap()
}

fn capped() -> Allocator {
    host_allocator(host(0), config()).unwrap()
}

/// Fills the cap with 1 MiB blocks (until out of memory) and returns them.
fn fill(a: &Allocator) -> Vec<DeviceAddr> {
    let mut v = Vec::new();
    loop {
        match a.allocate_per_thread(MIB) {
            Ok(p) => v.push(p),
            Err(Error::OutOfMemory { .. }) => return v,
            Err(e) => panic!("{e}"),
        }
    }
}

/// Runs `f` on another thread and fails if it does not finish in 20 s (a deadlock).
fn within_deadline<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("deadlock: the allocation with an OOM hook did not finish")
}

#[test]
fn a_hook_that_frees_held_blocks_makes_the_allocation_succeed() {
    within_deadline(|| {
        let a = capped();
        let held = Arc::new(Mutex::new(fill(&a)));
        assert!(held.lock().unwrap().len() >= 4);
        let calls = Arc::new(AtomicUsize::new(0));
        let (a2, h2, c2) = (a.clone(), held.clone(), calls.clone());
        a.set_oom_hook(Some(Arc::new(move |requested, device| {
            assert_eq!((requested, device), (MIB, 0));
            c2.fetch_add(1, Ordering::Relaxed);
            // Spill: free what this layer holds, and ask for a retry.
            for p in h2.lock().unwrap().drain(..) {
                a2.deallocate_per_thread(p, MIB).unwrap();
            }
            true
        })));
        a.reset_counters();
        let p = a.allocate_per_thread(MIB).expect("the hook freed enough");
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        let s = a.stats();
        assert_eq!((s.oom_hook_calls, s.ooms), (1, 0), "{s:?}");
        assert!(s.alloc_retries >= 2, "cuarena's own retry, then the hook's: {s:?}");
        a.deallocate_per_thread(p, MIB).unwrap();
    });
}

#[test]
fn a_hook_that_returns_false_gets_out_of_memory() {
    let a = capped();
    let held = fill(&a);
    a.reset_counters();
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    a.set_oom_hook(Some(Arc::new(move |_, _| {
        c2.fetch_add(1, Ordering::Relaxed);
        false
    })));
    let e = a.allocate_per_thread(MIB).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { requested, .. } if requested == MIB), "{e}");
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    let s = a.stats();
    assert_eq!((s.oom_hook_calls, s.ooms), (1, 1), "{s:?}");
    // Removed: no call any more.
    a.set_oom_hook(None);
    assert!(a.allocate_per_thread(MIB).is_err());
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    assert_eq!(a.stats().ooms, 2);
    held.into_iter().for_each(|p| a.deallocate_per_thread(p, MIB).unwrap());
}

#[test]
fn retries_are_bounded() {
    let a = capped();
    let held = fill(&a);
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    a.set_oom_hook(Some(Arc::new(move |_, _| {
        c2.fetch_add(1, Ordering::Relaxed);
        true // frees nothing, always asks again
    })));
    a.reset_counters();
    assert!(matches!(a.allocate_per_thread(MIB), Err(Error::OutOfMemory { .. })));
    assert_eq!(calls.load(Ordering::Relaxed), MAX_OOM_RETRIES as usize);
    let s = a.stats();
    assert_eq!((s.oom_hook_calls, s.ooms), (MAX_OOM_RETRIES as u64, 1), "{s:?}");
    // Each of the 1 + MAX_OOM_RETRIES attempts retried once after cuarena's reclaim, plus the
    // hook's retries.
    assert_eq!(s.alloc_retries, 2 * MAX_OOM_RETRIES as u64 + 1, "{s:?}");
    held.into_iter().for_each(|p| a.deallocate_per_thread(p, MIB).unwrap());
}

/// Inside the hook every call works: stats (counter and pool locks), trim (the shells lock and
/// other arenas' claims), allocation and free on this thread's arena (its slot and claim), on
/// a user stream and in the pool, and setting the hook. An out-of-memory inside the hook fails
/// at once without calling the hook again. No deadlock, no panic.
#[test]
fn the_hook_runs_with_no_cuarena_lock_held_and_may_reenter() {
    within_deadline(|| {
        let dev = host(0);
        let user = dev.create_stream();
        let a = host_allocator(dev, config()).unwrap();
        let held = Arc::new(Mutex::new(fill(&a)));
        a.reset_counters();
        let calls = Arc::new(AtomicUsize::new(0));
        let nested_oom = Arc::new(AtomicUsize::new(0));
        let (a2, h2, c2, n2) = (a.clone(), held.clone(), calls.clone(), nested_oom.clone());
        a.set_oom_hook(Some(Arc::new(move |requested, _| {
            c2.fetch_add(1, Ordering::Relaxed);
            // 1 MiB of room for the hook's own work.
            let spare = h2.lock().unwrap().pop().unwrap();
            a2.deallocate_per_thread(spare, MIB).unwrap();
            let _ = a2.stats();
            a2.flush().unwrap();
            a2.trim(false).unwrap();
            for (n, s) in [(4096, Stream::PER_THREAD), (4096, user), (300 << 10, Stream::LEGACY)] {
                let p = a2.allocate(n, s).unwrap();
                a2.deallocate(p, n, s).unwrap();
            }
            // Out of memory inside the hook: refused at once, no recursion.
            assert_eq!(requested, MIB);
            match a2.allocate_per_thread(64 * MIB) {
                Err(Error::OutOfMemory { .. }) => n2.fetch_add(1, Ordering::Relaxed),
                r => panic!("{r:?}"),
            };
            let a3 = a2.clone();
            a2.set_oom_hook(Some(Arc::new(move |_, _| {
                let _ = a3.stats();
                false
            })));
            for p in h2.lock().unwrap().drain(..) {
                a2.deallocate_per_thread(p, MIB).unwrap();
            }
            true
        })));
        let p = a.allocate_per_thread(MIB).expect("the hook freed enough");
        assert_eq!(calls.load(Ordering::Relaxed), 1, "the nested out-of-memory did not call the hook");
        assert_eq!(nested_oom.load(Ordering::Relaxed), 1);
        let s = a.stats();
        assert_eq!(s.oom_hook_calls, 1, "{s:?}");
        assert_eq!(s.ooms, 1, "the nested one (refused at once): {s:?}");
        a.deallocate_per_thread(p, MIB).unwrap();
        // The replacement hook is in place and is called on the next out-of-memory.
        assert!(a.allocate_per_thread(64 * MIB).is_err());
        assert_eq!(a.stats().oom_hook_calls, 2);
    });
}

/// A panicking hook: the panic reaches the caller, and the allocator is intact (no lock
/// poisoned, nothing held, the hook called again next time).
#[test]
fn a_panicking_hook_leaves_the_allocator_intact() {
    let a = capped();
    let held = fill(&a);
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = calls.clone();
    a.set_oom_hook(Some(Arc::new(move |_, _| {
        if c2.fetch_add(1, Ordering::Relaxed) == 0 {
            panic!("the hook failed");
        }
        false
    })));
    let a2 = a.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || a2.allocate_per_thread(MIB)));
    assert!(r.is_err(), "the hook's panic reaches the caller");
    assert!(matches!(a.allocate_per_thread(MIB), Err(Error::OutOfMemory { .. })));
    assert_eq!(calls.load(Ordering::Relaxed), 2, "called again: the re-entry guard was cleared");
    held.into_iter().for_each(|p| a.deallocate_per_thread(p, MIB).unwrap());
    let p = a.allocate_per_thread(MIB).unwrap();
    a.deallocate_per_thread(p, MIB).unwrap();
    a.check_invariants();
}
