//! Adversarial tests of user-stream arenas: streams destroyed under the allocator's feet,
//! their handles reused, arenas parked, reclaimed, replaced and dropped while other threads
//! free their blocks. Every test ends with every byte back and the race checker clean.

mod common;

use std::time::Duration;

use common::{Live, Worker, assert_all_back, host, on_thread, small};
use cuarena::{Allocator, DevicePtr, HostDevice, Stream};

fn alloc_on(sim: &HostDevice) -> Allocator {
    Allocator::host(sim.clone(), small().build().unwrap()).unwrap()
}

fn alloc_with(sim: &HostDevice, b: cuarena::ConfigBuilder) -> Allocator {
    Allocator::host(sim.clone(), b.build().unwrap()).unwrap()
}

/// On a fresh thread: a stream made, `n` blocks of `size` used on it by long work, freed on it
/// (the arena's local fast path: no event), the stream destroyed, the thread gone. The arena
/// is parked.
fn park_one(a: &Allocator, sim: &HostDevice, n: usize, size: usize, hold: Duration) {
    on_thread(a, {
        let sim = sim.clone();
        move |a| {
            let s = sim.create_stream();
            let ps: Vec<DevicePtr> = (0..n).map(|_| a.allocate(size, s).unwrap()).collect();
            for (i, p) in ps.iter().enumerate() {
                sim.hold_and_check(p.0, size, i as u32 | 1, hold, s).unwrap();
            }
            for p in ps {
                a.deallocate(p, size, s).unwrap();
            }
            sim.destroy_stream(s).unwrap();
        }
    });
}

/// Dropping the allocator while an arena of a destroyed stream is parked, its memory still
/// under work queued on that stream: the drop must wait for that work before it releases the
/// chunks (as it does for memory behind fences: see `adversarial_streams.rs`,
/// `allocator_drop_with_lazy_fences_pending`), with no panic, and every byte goes back.
#[test]
fn drop_with_parked_arena_waits_for_dead_stream_work() {
    let sim = host(0);
    {
        let a = alloc_on(&sim);
        park_one(&a, &sim, 4, 16 << 10, Duration::from_millis(100));
        assert!(a.parked_bytes() > 0, "the arena is parked");
        assert_eq!(a.stats().live_bytes, 0);
        drop(a);
    }
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(sim.tag_errors(), 0);
    assert_eq!(sim.reserved_bytes(), 0, "the allocator's drop released every chunk");
}

/// A small request that runs out of memory while arenas of destroyed streams are parked: the
/// out-of-memory path gives every parked arena back (allocator.rs, `Zombies`: "as do the
/// out-of-memory path"), after one device synchronise, and the parked byte count follows.
#[test]
fn small_request_out_of_memory_buries_parked_arenas() {
    let sim = host(20);
    let a = alloc_with(&sim, small().max_bytes(2 << 20));
    for _ in 0..6 {
        park_one(&a, &sim, 3, 60 << 10, Duration::from_micros(200));
    }
    let parked = a.parked_bytes();
    assert!(parked >= 6 * (256 << 10), "{parked}");
    let syncs = a.stats().host_syncs;
    // Small blocks on the per-thread stream up to nearly the cap: only possible with the
    // parked arenas' memory back.
    let size = 60 << 10;
    let ps: Vec<DevicePtr> = (0..28).map(|_| a.allocate(size, Stream::PER_THREAD).unwrap()).collect();
    let s = a.stats();
    assert_eq!(a.parked_bytes(), 0, "parked arenas given back, and the count with them: {s:?}");
    assert!(s.host_syncs - syncs <= 2, "one device synchronise for all parked arenas: {s:?}");
    for p in ps {
        a.deallocate(p, size, Stream::PER_THREAD).unwrap();
    }
    assert_all_back(&a, &sim, 0);
}

/// `trim(true)` on a thread whose user arena's stream was destroyed (the thread lives on and
/// keeps the arena): trim's contract is that every superblock holding no used block goes back
/// from this thread's arenas and idle threads' ones; blocking, it may synchronise.
#[test]
fn blocking_trim_takes_back_own_arena_of_destroyed_stream() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let w = Worker::new(&a);
    let s = sim.create_stream();
    w.run({
        let sim = sim.clone();
        move |a| {
            let ps: Vec<DevicePtr> = (0..4).map(|_| a.allocate(32 << 10, s).unwrap()).collect();
            for p in &ps {
                sim.hold_and_check(p.0, 32 << 10, 5, Duration::from_micros(300), s).unwrap();
            }
            for p in ps {
                a.deallocate(p, 32 << 10, s).unwrap();
            }
        }
    });
    sim.destroy_stream(s).unwrap();
    // From the owner itself.
    let held = w.run(|a| {
        a.trim(true).unwrap();
        a.stats().arena_held_bytes
    });
    assert_eq!(held, 0, "the owner's trim(true) left its dead stream's arena holding memory");
    w.exit();
    assert_all_back(&a, &sim, 0);
}

/// As above, the trimming thread another one, the owner idle.
#[test]
fn blocking_trim_takes_back_idle_threads_arena_of_destroyed_stream() {
    let sim = host(20);
    let a = alloc_on(&sim);
    let w = Worker::new(&a);
    let s = sim.create_stream();
    w.run({
        let sim = sim.clone();
        move |a| {
            let ps: Vec<DevicePtr> = (0..4).map(|_| a.allocate(32 << 10, s).unwrap()).collect();
            for p in &ps {
                sim.hold_and_check(p.0, 32 << 10, 5, Duration::from_micros(300), s).unwrap();
            }
            for p in ps {
                a.deallocate(p, 32 << 10, s).unwrap();
            }
        }
    });
    sim.destroy_stream(s).unwrap();
    a.trim(true).unwrap();
    let st = a.stats();
    assert_eq!(st.arena_held_bytes, 0, "an idle thread's dead-stream arena kept memory: {st:?}");
    assert_eq!(sim.reserved_bytes(), 0, "trim(true) released nothing of it");
    w.exit();
    assert_all_back(&a, &sim, 0);
}
