//! A race between an owner's fast-path free and a reclaimer that dissolves the owner's
//! superblock (commit 59783b9). Kept in its own test binary: when the race hits, the owner
//! thread panics inside the allocator and its thread-local destructor panics again, which
//! aborts the whole process.

#![allow(clippy::manual_is_multiple_of, clippy::type_complexity)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cuarena::{Error, Stream};
use cuarena_testkit::{assert_all_returned, host_allocator};

mod common;
use common::*;

/// Targets the window in `Slot::free` between reading a superblock's owner (outside the
/// owner's claim) and entering the claim for the local free: a reclaimer that dissolves the
/// superblock in between leaves the owner freeing into a superblock it no longer owns. Many
/// owner threads (more than cores, so they are preempted anywhere) free on their fast path
/// while OOM reclaimers dissolve their arenas.
#[test]
fn race_owner_fast_free_against_dissolving_reclaim() {
    let sim = host(5);
    let cfg = small().max_bytes(4 << 20).batch_blocks(8).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let live = Arc::new(Live::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for t in 0..10u64 {
        let (a, live, stop) = (a.clone(), live.clone(), stop.clone());
        hs.push(std::thread::spawn(move || {
            let mut x = 0x1234_5678 ^ (t * 0x9e37) | 1;
            while !stop.load(Ordering::Relaxed) {
                let mut v = Vec::new();
                for _ in 0..12 {
                    // Both cached (<= 32 KiB) and merged classes.
                    let n = if rng(&mut x) % 2 == 0 { 24 << 10 } else { 48 << 10 };
                    match a.allocate_per_thread(n) {
                        Ok(p) => {
                            live.insert(p, n);
                            v.push((p, n));
                        }
                        Err(Error::OutOfMemory { .. }) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                for (p, n) in v {
                    live.remove(p);
                    a.deallocate_per_thread(p, n).unwrap();
                }
            }
            a.release_thread().unwrap();
        }));
    }
    for _ in 0..3 {
        let (a, live, stop) = (a.clone(), live.clone(), stop.clone());
        hs.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut v = Vec::new();
                while let Ok(p) = a.allocate(256 << 10, Stream::LEGACY) {
                    live.insert(p, 256 << 10);
                    v.push(p);
                }
                for p in v {
                    live.remove(p);
                    a.deallocate(p, 256 << 10, Stream::LEGACY).unwrap();
                }
            }
            a.release_thread().unwrap();
        }));
    }
    std::thread::sleep(Duration::from_secs(8));
    stop.store(true, Ordering::Relaxed);
    let panics: Vec<_> = hs.into_iter().filter_map(|h| h.join().err()).collect();
    assert!(panics.is_empty(), "{} threads panicked", panics.len());
    live.assert_clean();
    let s = a.stats();
    eprintln!(
        "dissolved {} returned {} taken {}",
        s.superblocks_dissolved, s.superblocks_returned, s.superblocks_taken
    );
    assert!(a.take_deferred_error().is_none(), "{:?}", a.take_deferred_error());
    assert_all_returned(&a, Some(&sim), 0);
}
