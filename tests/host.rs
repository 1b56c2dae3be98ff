//! Integration tests on the simulated device. Each checks a real property: no overlap, alignment,
//! tags intact (no reuse before the fence), every byte back in the pool, errors that lose nothing.

use std::sync::Arc;
use std::time::Duration;

use cuarena::{Allocator, Config, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, StressParams, assert_all_returned, host_allocator, stress};

mod common;

fn device(max_delay_us: u64) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity: 2 << 30,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(max_delay_us),
        ..HostConfig::default()
    })
}

/// Small superblocks and chunks, so that lending, return and dissolution happen often.
fn small_config() -> cuarena::ConfigBuilder {
    Config::builder().superblock(256 << 10).small_max(64 << 10).chunk(1 << 20).batch_blocks(8)
}

#[test]
fn random_threads_with_cross_thread_and_cross_stream_frees() {
    let dev = device(200);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    let p = StressParams {
        threads: 6,
        steps: 1500,
        max_size: 512 << 10,
        hold: Duration::from_micros(150),
        ..Default::default()
    };
    let r = stress(Arc::new(dev.clone()), &a, &p).unwrap();
    assert!(r.layout_errors.is_empty(), "{:?}", &r.layout_errors[..r.layout_errors.len().min(5)]);
    assert!(r.violations.is_empty(), "{:?}", &r.violations[..r.violations.len().min(5)]);
    assert_eq!(r.tag_errors, 0);
    assert!(r.handoffs > 500, "{r:?}");
    let s = a.stats();
    assert!(s.cross_thread_frees > 100 && s.cross_stream_frees > 10 && s.fences_recorded > 0, "{s:?}");
    assert!(s.superblocks_taken > 6 && s.superblocks_returned + s.superblocks_dissolved > 0, "{s:?}");
    assert_eq!(s.invalid_frees, 0);
    // Host syncs only where parked user-stream arenas (each thread's two user streams, given
    // up at its exit) pass 64 MiB: at most one per such arena.
    assert!(s.host_syncs <= 2 * p.threads as u64, "{s:?}");
    assert_all_returned(&a, Some(&dev), 0);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn default_config_stress_returns_everything() {
    let dev = device(50);
    let a = host_allocator(dev.clone(), Config::default()).unwrap();
    let p = StressParams {
        threads: 4,
        steps: 800,
        hold: Duration::from_micros(50),
        seed: 7,
        ..Default::default()
    };
    let r = stress(Arc::new(dev.clone()), &a, &p).unwrap();
    assert!(r.layout_errors.is_empty() && r.violations.is_empty() && r.tag_errors == 0, "{r:?}");
    assert_all_returned(&a, Some(&dev), 0);
}

/// The test of the tests: with fencing switched off, the same kind of run must be caught. The
/// checker sees a race only when a reuse meets work still running, which timing decides: up to
/// five runs (one is almost always enough) must catch at least one.
#[test]
fn skipping_fences_is_caught_by_the_checker() {
    let mut reports = Vec::new();
    for seed in 1..=5 {
        let dev = device(300);
        // Superblocks of 64 KiB: the owners run out often and take remotely freed blocks back.
        let cfg = small_config().superblock(64 << 10).skip_fences_for_testing().build().unwrap();
        let a = host_allocator(dev.clone(), cfg).unwrap();
        let p = StressParams {
            threads: 4,
            steps: 600,
            slots: 8,
            max_size: 16 << 10,
            handoff_pct: 90,
            cross_stream_pct: 60,
            hold: Duration::from_millis(2),
            seed,
            ..Default::default()
        };
        let r = stress(Arc::new(dev.clone()), &a, &p).unwrap();
        if !r.violations.is_empty() {
            return;
        }
        reports.push(r);
    }
    panic!("unfenced reuse went unnoticed in five runs: {reports:?}");
}

#[test]
fn blocks_are_aligned_disjoint_and_writable() {
    let dev = device(0);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    let mut blocks = Vec::new();
    for (i, size) in
        [1usize, 255, 256, 257, 2047, 2049, 4000, 65536, 65537, 300_000].iter().cycle().take(200).enumerate()
    {
        let p = a.allocate_per_thread(*size).unwrap();
        assert_eq!(p.0 % 256, 0);
        dev.fill(p.0, *size, i as u8, Stream::PER_THREAD).unwrap();
        blocks.push((p, *size, i as u8));
    }
    let mut sorted: Vec<_> = blocks.iter().map(|&(p, s, _)| (p.0, p.0 + s as u64)).collect();
    sorted.sort();
    assert!(sorted.windows(2).all(|w| w[0].1 <= w[1].0), "overlap");
    dev.synchronize();
    for &(p, s, v) in &blocks {
        // SAFETY: the block is live host memory of the simulated device and all work is done.
        let bytes = unsafe { std::slice::from_raw_parts(p.0 as *const u8, s) };
        assert!(bytes.iter().all(|&b| b == v), "block {p:?} was overwritten");
    }
    for (p, s, _) in blocks {
        a.deallocate_per_thread(p, s).unwrap();
    }
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

#[test]
fn invalid_frees_are_refused_and_lose_nothing() {
    let dev = device(0);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    let small = a.allocate_per_thread(1000).unwrap();
    let large = a.allocate(200 << 10, Stream::LEGACY).unwrap();
    let reason = |r: cuarena::Result<()>| match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        other => panic!("expected an invalid free, got {other:?}"),
    };
    // Wrong size, interior pointer, foreign pointer, null with a size.
    assert!(matches!(reason(a.deallocate_per_thread(small, 5000)), InvalidFree::SizeMismatch { .. }));
    assert_eq!(reason(a.deallocate_per_thread(DeviceAddr(small.0 + 256), 256)), InvalidFree::UnknownPointer);
    assert!(matches!(
        reason(a.deallocate(large, 100 << 10, Stream::LEGACY)),
        InvalidFree::SizeMismatch { .. }
    ));
    assert_eq!(
        reason(a.deallocate(DeviceAddr(large.0 + 4096), 4096 * 64, Stream::LEGACY)),
        InvalidFree::UnknownPointer
    );
    assert_eq!(
        reason(a.deallocate(DeviceAddr(0xdead_0000), 4 << 20, Stream::LEGACY)),
        InvalidFree::UnknownPointer
    );
    assert_eq!(reason(a.deallocate(DeviceAddr::NULL, 8, Stream::LEGACY)), InvalidFree::UnknownPointer);
    a.deallocate(DeviceAddr::NULL, 0, Stream::LEGACY).unwrap();
    // The refused frees lost nothing: both blocks are still live and free once.
    a.deallocate_per_thread(small, 1000).unwrap();
    a.deallocate(large, 200 << 10, Stream::LEGACY).unwrap();
    // Double frees.
    assert!(matches!(
        reason(a.deallocate_per_thread(small, 1000)),
        InvalidFree::DoubleFree | InvalidFree::UnknownPointer
    ));
    assert_eq!(reason(a.deallocate(large, 200 << 10, Stream::LEGACY)), InvalidFree::DoubleFree);
    assert_eq!(a.stats().invalid_frees, 8, "every refusal is counted");
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 8);
}

#[test]
fn a_double_free_from_another_thread_is_refused_at_once() {
    let dev = device(0);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    let p = a.allocate_per_thread(4096).unwrap();
    let a2 = a.clone();
    let second = std::thread::spawn(move || {
        a2.deallocate_per_thread(p, 4096).unwrap();
        a2.deallocate_per_thread(p, 4096) // its first free is still on its way
    })
    .join()
    .unwrap();
    assert!(matches!(second, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{second:?}");
    // The owner's own free of it is a double free too, on any stream.
    assert!(matches!(
        a.deallocate_per_thread(p, 4096),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    a.flush().unwrap();
    dev.synchronize();
    a.flush().unwrap();
    assert!(a.take_deferred_error().is_none(), "nothing was accepted that should not have been");
    assert_eq!(a.stats().invalid_frees, 2);
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 2);
}

#[test]
fn zero_and_huge_sizes() {
    let dev = device(0);
    let a = host_allocator(dev, Config::builder().max_bytes(64 << 20).build().unwrap()).unwrap();
    assert_eq!(a.allocate_per_thread(0).unwrap(), DeviceAddr::NULL);
    assert!(a.buffer(0, Stream::LEGACY).unwrap().is_empty());
    for huge in [usize::MAX, usize::MAX - 255, 1 << 40, (64 << 20) + 1] {
        match a.allocate(huge, Stream::LEGACY) {
            Err(Error::OutOfMemory { requested, limit, .. }) => {
                assert_eq!(requested, huge);
                assert_eq!(limit, 64 << 20);
            }
            other => panic!("{huge}: {other:?}"),
        }
    }
    assert_eq!(a.stats().reserved_bytes, 0, "a refused request reserves nothing");
}

#[test]
fn out_of_memory_reports_figures_and_recovers() {
    let dev = device(0);
    let a = host_allocator(dev.clone(), small_config().max_bytes(8 << 20).build().unwrap()).unwrap();
    let mut held = Vec::new();
    let err = loop {
        match a.allocate(1 << 20, Stream::LEGACY) {
            Ok(p) => held.push(p),
            Err(e) => break e,
        }
    };
    match err {
        Error::OutOfMemory { requested, reserved, in_use, largest_free, limit } => {
            assert_eq!((requested, limit), (1 << 20, 8 << 20));
            assert!(reserved <= limit && in_use <= reserved && largest_free < (1 << 20));
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(held.len(), 8);
    assert!(a.allocate_per_thread(4096).is_err(), "no room for a superblock either");
    a.deallocate(held.pop().unwrap(), 1 << 20, Stream::LEGACY).unwrap();
    let p = a.allocate(1 << 20, Stream::LEGACY).unwrap();
    a.deallocate(p, 1 << 20, Stream::LEGACY).unwrap();
    for p in held {
        a.deallocate(p, 1 << 20, Stream::LEGACY).unwrap();
    }
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

#[test]
fn frees_after_the_owner_thread_exited_go_to_the_pool() {
    let dev = device(100);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    let a2 = a.clone();
    let blocks: Vec<(DeviceAddr, usize)> = std::thread::spawn(move || {
        let v: Vec<_> =
            (0..100).map(|i| (a2.allocate_per_thread(512 * (i + 1)).unwrap(), 512 * (i + 1))).collect();
        for &(p, s) in &v {
            a2.device().record_event(a2.device().create_event().unwrap(), Stream::PER_THREAD).unwrap();
            let _ = (p, s);
        }
        v
    })
    .join()
    .unwrap();
    let s = a.stats();
    assert_eq!(s.arenas, 0, "the owner's arena went back at exit");
    assert!(s.superblocks_dissolved > 0, "{s:?}");
    for (p, size) in blocks {
        a.deallocate_per_thread(p, size).unwrap();
    }
    dev.synchronize();
    assert_all_returned(&a, Some(&dev), 0);
}

#[test]
fn hoard_rule_bounds_stranded_memory() {
    let dev = device(0);
    let sb = 256usize << 10;
    let a = host_allocator(dev.clone(), small_config().keep_empty(1).sparse_fraction(0.25).build().unwrap())
        .unwrap();
    let mut v: Vec<_> = (0..400).map(|_| a.allocate_per_thread(16 << 10).unwrap()).collect();
    let peak_held = a.stats().arena_held_bytes as usize;
    assert!(peak_held >= 400 * (16 << 10));
    // The rule's bound on the recent peak after every own free (`common::RecentPeak`).
    let mut peak = common::RecentPeak(a.stats().live_bytes);
    let mut check = |what: &str, reached: bool| {
        let s = a.stats();
        if reached {
            peak.after_free(s.live_bytes);
        }
        let held = s.arena_held_bytes as f64;
        assert!(
            held <= peak.bound(1, sb, 0.25) + 1.0,
            "{what}: held {held} live {} peak {}",
            s.live_bytes,
            peak.0
        );
    };
    // Free 95%, in an order that leaves every superblock partly used for a while.
    let mut kept = Vec::new();
    for (i, p) in v.drain(..).enumerate() {
        if i % 20 == 0 {
            kept.push(p);
        } else {
            let reached = common::in_arena(&a, p);
            a.deallocate_per_thread(p, 16 << 10).unwrap();
            check("freeing 95%", reached);
        }
    }
    // The recent peak decays by 2^-10 per own free: within 4,000 more (one block allocated and
    // freed each time) it is down to the live bytes, and the superblocks have gone back.
    for _ in 0..4_000 {
        let p = a.allocate_per_thread(16 << 10).unwrap();
        let reached = common::in_arena(&a, p);
        a.deallocate_per_thread(p, 16 << 10).unwrap();
        check("churning at 5%", reached);
    }
    assert!((a.stats().arena_held_bytes as usize) < peak_held / 4);
    for p in kept {
        a.deallocate_per_thread(p, 16 << 10).unwrap();
    }
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

#[test]
fn stream_handles_reused_after_destroy_are_not_confused() {
    let dev = device(500);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    for round in 0..40u32 {
        let s = dev.create_stream();
        let p = a.allocate(100 << 10, s).unwrap();
        dev.hold_and_check(p.0, 4096, round, Duration::from_micros(500), s).unwrap();
        a.deallocate(p, 100 << 10, s).unwrap();
        dev.destroy_stream(s).unwrap(); // the next create_stream gets this handle back
    }
    dev.synchronize();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    assert_eq!(dev.tag_errors(), 0);
    assert_all_returned(&a, Some(&dev), 0);
}

#[test]
fn config_from_env_string() {
    let c = Config::parse("small_max=1MiB,superblock=2MiB,max=80%").unwrap();
    let a = host_allocator(HostDevice::default(), c).unwrap();
    assert_eq!(a.config().small_max(), 1 << 20);
}

#[test]
fn cuda_without_a_driver_is_an_error_not_a_panic() {
    if cuarena::device::cuda::driver_present() {
        return; // a GPU machine: tests/gpu.rs covers it
    }
    assert!(matches!(Allocator::cuda(0, Config::default()), Err(Error::NoDriver)));
    assert!(matches!(cuarena::CudaDevice::new(0), Err(Error::NoDriver)));
}

#[test]
fn a_free_on_a_destroyed_stream_is_refused_and_the_block_stays_live() {
    let dev = device(0);
    let a = host_allocator(dev.clone(), small_config().build().unwrap()).unwrap();
    let p = a.allocate_per_thread(4096).unwrap();
    let q = a.allocate(200 << 10, Stream::LEGACY).unwrap();
    let s = dev.create_stream();
    dev.destroy_stream(s).unwrap();
    assert!(matches!(a.deallocate(p, 4096, s), Err(Error::Driver { .. })));
    assert!(matches!(a.deallocate(q, 200 << 10, s), Err(Error::Driver { .. })));
    // Those stale handles were the caller's own, one per free.
    assert_eq!(dev.take_stale_handle_calls(), 2);
    assert_eq!(a.stats().live_bytes, 4096 + (200 << 10));
    a.deallocate_per_thread(p, 4096).unwrap();
    a.deallocate(q, 200 << 10, Stream::LEGACY).unwrap();
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// The C example's pattern (examples/c/threads.c) on the simulated device: per-thread and user
/// streams, blocks handed to the next thread through a slot that may be overwritten (the
/// overwritten block is freed by its allocator on its user stream), frees after event waits.
#[test]
fn the_c_example_pattern_keeps_memory_consistent() {
    use std::sync::Mutex;
    let dev = device(0);
    let a = host_allocator(dev.clone(), Config::default()).unwrap();
    const T: usize = 8;
    type Handed = Option<(DeviceAddr, usize, cuarena::Event)>;
    let slots: Arc<Vec<Mutex<Handed>>> = Arc::new((0..T).map(|_| Mutex::new(None)).collect());
    let hs: Vec<_> = (0..T)
        .map(|t| {
            let (a, dev, slots) = (a.clone(), dev.clone(), slots.clone());
            std::thread::spawn(move || {
                let s = dev.create_stream();
                for i in 0..1500usize {
                    let size = 256 + (i * 7919 + t * 104_729) % (1 << 20);
                    let st = if i % 2 == 1 { s } else { Stream::PER_THREAD };
                    let p = a.allocate(size, st).unwrap();
                    dev.fill(p.0, size.min(4096), i as u8, st).unwrap();
                    if i % 3 == 0 {
                        let ev = a.device().create_event().unwrap();
                        a.device().record_event(ev, st).unwrap();
                        let old = slots[(t + 1) % T].lock().unwrap().replace((p, size, ev));
                        if let Some((q, qs, qe)) = old {
                            a.device().stream_wait_event(s, qe).unwrap();
                            a.deallocate(q, qs, s).unwrap();
                        }
                    } else {
                        a.deallocate(p, size, st).unwrap();
                    }
                    let mine = slots[t].lock().unwrap().take();
                    if let Some((q, qs, qe)) = mine {
                        a.device().stream_wait_event(s, qe).unwrap();
                        a.deallocate(q, qs, s).unwrap();
                    }
                }
            })
        })
        .collect();
    hs.into_iter().for_each(|h| h.join().unwrap());
    for slot in slots.iter() {
        if let Some((q, qs, _)) = slot.lock().unwrap().take() {
            a.deallocate(q, qs, Stream::LEGACY).unwrap();
        }
    }
    dev.synchronize();
    a.flush().unwrap();
    assert!(dev.violations().is_empty(), "{:?}", &dev.violations()[..dev.violations().len().min(3)]);
    assert_eq!(a.stats().invalid_frees, 0, "{:?}", a.take_deferred_error());
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A block freed remotely and still waiting for its fence when its superblock is given back
/// goes to the pool as a fenced free range: a second free of it is refused, not accepted.
#[test]
fn a_double_free_of_a_pending_block_across_a_dissolved_superblock_is_refused() {
    let dev = device(0);
    let cfg = small_config().keep_empty(0).sparse_fraction(0.5).build().unwrap();
    let a = host_allocator(dev.clone(), cfg).unwrap();
    let blocks: Vec<_> = (0..4).map(|_| a.allocate_per_thread(16 << 10).unwrap()).collect();
    // Hold the per-thread stream of the freeing thread busy, so the fence of its free is pending.
    let (a2, d2, p) = (a.clone(), dev.clone(), blocks[0]);
    std::thread::spawn(move || {
        d2.hold_and_check(p.0, 4096, 7, Duration::from_millis(300), Stream::PER_THREAD).unwrap();
        a2.deallocate_per_thread(p, 16 << 10).unwrap();
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    a.flush().unwrap(); // drains the free: the block is pending behind its fence
    for &q in &blocks[1..] {
        a.deallocate_per_thread(q, 16 << 10).unwrap(); // the return rule gives the superblock back
    }
    assert!(a.stats().superblocks_dissolved + a.stats().superblocks_returned >= 1);
    // A second free of the pending block, from another thread: refused (double free).
    let a3 = a.clone();
    std::thread::spawn(move || {
        a3.deallocate_per_thread(p, 16 << 10).unwrap_err();
    })
    .join()
    .unwrap();
    dev.synchronize();
    a.flush().unwrap();
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&dev), 1);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

/// A block of one device freed into another device's allocator is refused as foreign, on the
/// arena path and the pool path, and stays live where it belongs.
#[test]
fn a_free_on_the_wrong_device_is_refused() {
    let (d0, d1) = (device(0), device(0));
    let a0 = host_allocator(d0.clone(), small_config().build().unwrap()).unwrap();
    let a1 = host_allocator(d1.clone(), small_config().build().unwrap()).unwrap();
    let warm = a1.allocate_per_thread(4096).unwrap(); // a1 has an arena and a pool of its own
    let small = a0.allocate_per_thread(4096).unwrap();
    let large = a0.allocate(300 << 10, Stream::LEGACY).unwrap();
    for (p, s, st) in [(small, 4096, Stream::PER_THREAD), (large, 300 << 10, Stream::LEGACY)] {
        match a1.deallocate(p, s, st) {
            Err(Error::InvalidFree { reason: InvalidFree::UnknownPointer, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(a0.stats().live_bytes, 4096 + (300 << 10));
    a0.deallocate_per_thread(small, 4096).unwrap();
    a0.deallocate(large, 300 << 10, Stream::LEGACY).unwrap();
    a1.deallocate_per_thread(warm, 4096).unwrap();
    // a1 refused the two foreign frees.
    for (a, d, refused) in [(&a0, &d0, 0), (&a1, &d1, 2)] {
        assert_all_returned(a, Some(d), refused);
    }
}
