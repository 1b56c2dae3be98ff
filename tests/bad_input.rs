//! The bad-input table, one test per row, on the simulated device.
//!
//! Each row checks that a bad request gets a clear error of the right kind, that nothing
//! panics, and that the allocator is consistent afterwards: its invariants hold, `live_bytes`
//! is exactly the bytes of the blocks still live, every live block frees once, and then every
//! byte comes back (live 0, pool in use 0, arenas holding 0, reserved 0 after `trim(true)`).

use std::sync::mpsc;
use std::time::Duration;

use cuarena::size_class::block_bytes;
use cuarena::{Allocator, Config, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, host_allocator};

const SMALL_MAX: usize = 64 << 10;

fn device(capacity: usize) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(20),
        ..HostConfig::default()
    })
}

/// Small superblocks and chunks, so lending and returning happen in small tests.
fn config() -> cuarena::ConfigBuilder {
    Config::builder().superblock(256 << 10).small_max(SMALL_MAX).chunk(1 << 20).batch_blocks(8)
}

fn setup() -> (HostDevice, Allocator) {
    let dev = device(256 << 20);
    let a = host_allocator(dev.clone(), config().build().unwrap()).unwrap();
    (dev, a)
}

/// A live block: pointer, size asked for, the stream it is used on.
type Block = (DeviceAddr, usize, Stream);

fn reason(r: cuarena::Result<()>) -> InvalidFree {
    match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        other => panic!("expected Error::InvalidFree, got {other:?}"),
    }
}

/// The allocator is consistent with `live` being exactly the live blocks; then they are all
/// freed and every byte must come back.
fn settle(a: &Allocator, dev: &HostDevice, live: Vec<Block>) {
    a.check_invariants();
    let s = a.stats();
    let expected: u64 = live.iter().map(|&(_, size, _)| block_bytes(size, SMALL_MAX).unwrap() as u64).sum();
    assert_eq!(s.live_bytes, expected, "live bytes do not add up: {s:?}");
    assert!(s.pool_in_use_bytes <= s.reserved_bytes, "{s:?}");
    for (p, size, stream) in live {
        a.deallocate(p, size, stream).unwrap_or_else(|e| panic!("freeing live block {p:?} ({size} B): {e}"));
    }
    a.flush().unwrap();
    dev.synchronize();
    a.flush().unwrap();
    assert_eq!(a.take_deferred_error(), None);
    a.release_thread().unwrap();
    a.check_invariants();
    let s = a.stats();
    assert_eq!(s.live_bytes, 0, "{s:?}");
    // A user-stream arena given up holding memory waits, parked, for `trim(true)` below.
    let (parked, frees) = (a.parked_bytes(), a.parked_free_bytes());
    let used = a.pool_in_use();
    assert!(parked <= used && used <= parked + frees, "still handed out: {:?} {s:?}", a.pool_used_ranges());
    assert_eq!((s.arena_held_bytes, s.arenas), (parked as u64, 0), "{s:?}");
    a.trim(true).unwrap();
    assert_eq!((a.stats().reserved_bytes, a.parked_bytes()), (0, 0));
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    assert_eq!(dev.tag_errors(), 0);
}

/// Two live blocks to keep while a row runs: a small one in this thread's arena and a large one
/// from the pool.
fn two_blocks(a: &Allocator) -> Vec<Block> {
    vec![
        (a.allocate_per_thread(1000).unwrap(), 1000, Stream::PER_THREAD),
        (a.allocate(200 << 10, Stream::LEGACY).unwrap(), 200 << 10, Stream::LEGACY),
    ]
}

#[test]
fn size_zero_gives_null_and_null_frees_with_size_zero() {
    let (dev, a) = setup();
    let user = dev.create_stream();
    for s in [Stream::PER_THREAD, Stream::LEGACY, Stream::NULL, user] {
        assert_eq!(a.allocate(0, s).unwrap(), DeviceAddr::NULL);
        a.deallocate(DeviceAddr::NULL, 0, s).unwrap();
    }
    assert!(a.buffer(0, Stream::LEGACY).unwrap().is_empty());
    let s = a.stats();
    assert_eq!((s.allocations, s.deallocations, s.reserved_bytes), (0, 0, 0), "{s:?}");
    settle(&a, &dev, two_blocks(&a));
}

/// Size 0 with a live block's pointer names no block: refused as such (not as an unknown
/// pointer), on every stream, for the caller's own arena block, another thread's, a pool
/// block and a pointer that is no block at all; the blocks stay live.
#[test]
fn a_free_of_a_live_block_with_size_zero_is_refused() {
    let (dev, a) = setup();
    let user = dev.create_stream();
    let mut live = two_blocks(&a);
    let a2 = a.clone();
    live.push(
        std::thread::spawn(move || (a2.allocate_per_thread(3000).unwrap(), 3000, Stream::PER_THREAD))
            .join()
            .unwrap(),
    );
    live.push((a.allocate(5000, user).unwrap(), 5000, user));
    let mut refused = 0;
    for &(p, _, _) in &live {
        for s in [Stream::PER_THREAD, Stream::LEGACY, user] {
            assert_eq!(reason(a.deallocate(p, 0, s)), InvalidFree::ZeroSize);
            refused += 1;
        }
        let e = a.deallocate(p, 0, Stream::LEGACY).unwrap_err();
        assert!(e.to_string().contains("size 0"), "{e}");
        refused += 1;
    }
    assert_eq!(reason(a.deallocate(DeviceAddr(0xdead_0000), 0, Stream::LEGACY)), InvalidFree::ZeroSize);
    assert_eq!(a.stats().invalid_frees, refused + 1);
    settle(&a, &dev, live);
}

#[test]
fn sizes_near_usize_max_are_out_of_memory() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    for huge in [usize::MAX, usize::MAX - 1, usize::MAX - 255, usize::MAX / 2 + 1] {
        for s in [Stream::PER_THREAD, Stream::LEGACY] {
            match a.allocate(huge, s) {
                Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, huge),
                other => panic!("{huge}: {other:?}"),
            }
        }
        // A free with such a size matches no block.
        for &(p, _, s) in &live {
            assert!(matches!(
                reason(a.deallocate(p, huge, s)),
                InvalidFree::UnknownPointer | InvalidFree::SizeMismatch { .. }
            ));
        }
    }
    settle(&a, &dev, live);
}

#[test]
fn more_than_the_device_has_is_out_of_memory() {
    // The cap is the device (64 MiB): refused before any driver call.
    let dev = device(64 << 20);
    let a = host_allocator(dev.clone(), config().build().unwrap()).unwrap();
    let live = two_blocks(&a);
    match a.allocate(65 << 20, Stream::LEGACY) {
        Err(Error::OutOfMemory { requested, reserved, in_use, largest_free, limit }) => {
            assert_eq!((requested, limit), (65 << 20, 64 << 20));
            assert!(in_use <= reserved && reserved <= limit && largest_free < requested);
        }
        other => panic!("{other:?}"),
    }
    settle(&a, &dev, live);

    // The cap is above the device (1 GiB on 64 MiB): the device itself says no.
    let dev = device(64 << 20);
    let a = host_allocator(dev.clone(), config().max_bytes(1 << 30).build().unwrap()).unwrap();
    let live = two_blocks(&a);
    match a.allocate(100 << 20, Stream::LEGACY) {
        Err(Error::OutOfMemory { requested, limit, .. }) => {
            assert_eq!((requested, limit), (100 << 20, 1 << 30))
        }
        other => panic!("{other:?}"),
    }
    assert!(dev.reserved_bytes() <= 64 << 20);
    settle(&a, &dev, live);
}

#[test]
fn a_null_pointer_with_a_size_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    for (size, s) in [(8, Stream::PER_THREAD), (4096, Stream::LEGACY), (1 << 20, Stream::LEGACY)] {
        assert_eq!(reason(a.deallocate(DeviceAddr::NULL, size, s)), InvalidFree::UnknownPointer);
    }
    assert_eq!(a.stats().invalid_frees, 3);
    settle(&a, &dev, live);
}

#[test]
fn a_foreign_pointer_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    let host_memory = Box::new([0u8; 4096]);
    let foreign = [0xdead_0000u64, 0x1000, &*host_memory as *const _ as u64, 1 << 62];
    for p in foreign {
        for (size, s) in [(4096, Stream::PER_THREAD), (4096, Stream::LEGACY), (300 << 10, Stream::LEGACY)] {
            assert_eq!(reason(a.deallocate(DeviceAddr(p), size, s)), InvalidFree::UnknownPointer, "{p:#x}");
        }
    }
    assert_eq!(a.stats().invalid_frees, 12);
    settle(&a, &dev, live);
}

#[test]
fn an_interior_pointer_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    let (small, large) = (live[0].0, live[1].0);
    for off in [1, 8, 256, 512] {
        let r = a.deallocate(DeviceAddr(small.0 + off), 256, Stream::PER_THREAD);
        assert_eq!(reason(r), InvalidFree::UnknownPointer, "small + {off}");
        let r = a.deallocate(DeviceAddr(large.0 + off * 16), 4096, Stream::LEGACY);
        assert_eq!(reason(r), InvalidFree::UnknownPointer, "large + {}", off * 16);
    }
    settle(&a, &dev, live);
}

/// `u64::MAX` used to overflow `ptr + 1` in the pool's free (a panic in debug builds).
#[test]
fn the_largest_address_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    for p in [u64::MAX, u64::MAX - 255, !255] {
        for (size, s) in [(4096, Stream::PER_THREAD), (4096, Stream::LEGACY), (4 << 20, Stream::LEGACY)] {
            assert_eq!(reason(a.deallocate(DeviceAddr(p), size, s)), InvalidFree::UnknownPointer, "{p:#x}");
        }
    }
    settle(&a, &dev, live);
}

#[test]
fn a_double_free_of_a_cached_small_block_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    // 1000 B rounds to a cached class: its local free parks it in the arena's cache.
    let p = a.allocate_per_thread(1000).unwrap();
    a.deallocate_per_thread(p, 1000).unwrap();
    assert_eq!(reason(a.deallocate_per_thread(p, 1000)), InvalidFree::DoubleFree);
    // The same through another stream, which routes it like a remote free.
    match a.deallocate(p, 1000, Stream::LEGACY) {
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }) => {}
        Ok(()) => {
            a.flush().unwrap();
            dev.synchronize();
            a.flush().unwrap();
            assert!(matches!(
                a.take_deferred_error(),
                Some(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
            ));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.stats().invalid_frees, 2);
    // The cached block is handed out again, once.
    let q = a.allocate_per_thread(1000).unwrap();
    let mut live = live;
    live.push((q, 1000, Stream::PER_THREAD));
    settle(&a, &dev, live);
}

/// A double free made on another stream of a block that sits in the owner's cache: it goes the
/// remote way (unchecked until the owner drains it). The block is then handed out again at
/// once. When the owner drains the stale free it must refuse it, not free the new block.
#[test]
fn a_double_free_on_another_stream_is_not_applied_to_the_reused_block() {
    let (dev, a) = setup();
    let user = dev.create_stream();
    let mut live = two_blocks(&a);
    for (i, s) in [user, Stream::LEGACY].into_iter().enumerate() {
        let p = a.allocate_per_thread(428).unwrap();
        a.deallocate_per_thread(p, 428).unwrap(); // cached
        let second = a.deallocate(p, 428, s);
        let q = a.allocate_per_thread(491).unwrap(); // the same class: the cached block again
        live.push((q, 491, Stream::PER_THREAD));
        a.flush().unwrap();
        dev.synchronize();
        a.flush().unwrap();
        match second {
            Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }) => {}
            Ok(()) => assert!(
                matches!(
                    a.take_deferred_error(),
                    Some(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
                ),
                "the double free on {s:?} was accepted and not reported"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(a.stats().invalid_frees, i as u64 + 1);
        let expected: u64 =
            live.iter().map(|&(_, size, _)| block_bytes(size, SMALL_MAX).unwrap() as u64).sum();
        assert_eq!(a.stats().live_bytes, expected, "the stale double free freed the reused block {q:?}");
    }
    settle(&a, &dev, live);
}

#[test]
fn a_double_free_of_a_pooled_block_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    let user = dev.create_stream();
    for (size, s) in [(300 << 10, Stream::LEGACY), (4096, Stream::LEGACY), (100 << 10, user)] {
        let p = a.allocate(size, s).unwrap();
        a.deallocate(p, size, s).unwrap();
        assert_eq!(reason(a.deallocate(p, size, s)), InvalidFree::DoubleFree, "{size} B");
        assert_eq!(reason(a.deallocate(p, size, Stream::LEGACY)), InvalidFree::DoubleFree, "{size} B");
    }
    assert_eq!(a.stats().invalid_frees, 6);
    settle(&a, &dev, live);
}

/// Thread B frees the main thread's small block; the free waits in B's outbox. The owner then
/// frees it again. The second free must be caught (at once, or reported after B's batch
/// arrives) and must not free a block handed out in between.
#[test]
fn a_double_free_whose_first_free_waits_in_another_threads_outbox_is_caught() {
    let (dev, a) = setup();
    let mut live = two_blocks(&a);
    let p = a.allocate_per_thread(4096).unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (parked_tx, parked_rx) = mpsc::channel::<()>();
    let b = {
        let a = a.clone();
        std::thread::spawn(move || {
            a.deallocate_per_thread(p, 4096).unwrap(); // batched: parked in this thread's outbox
            parked_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            a.flush().unwrap();
        })
    };
    parked_rx.recv().unwrap();
    let second = a.deallocate_per_thread(p, 4096);
    // Reuse whatever the owner now has free, so a wrongly accepted free would hit a new block.
    let fresh: Vec<DeviceAddr> = (0..4).map(|_| a.allocate_per_thread(4096).unwrap()).collect();
    go_tx.send(()).unwrap();
    b.join().unwrap();
    a.flush().unwrap();
    dev.synchronize();
    a.flush().unwrap();
    match second {
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }) => {}
        Ok(()) => assert!(
            matches!(
                a.take_deferred_error(),
                Some(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
            ),
            "the second free was accepted and never reported"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.stats().invalid_frees, 1);
    live.extend(fresh.into_iter().map(|q| (q, 4096, Stream::PER_THREAD)));
    settle(&a, &dev, live);
}

#[test]
fn the_wrong_size_is_refused() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    let (small, large) = (live[0].0, live[1].0);
    let mismatch = |r| match reason(r) {
        InvalidFree::SizeMismatch { allocated, given } => (allocated, given),
        other => panic!("{other:?}"),
    };
    assert_eq!(mismatch(a.deallocate_per_thread(small, 5000)), (1024, 5000));
    assert_eq!(mismatch(a.deallocate_per_thread(small, 1)), (1024, 1));
    assert_eq!(mismatch(a.deallocate(large, 100 << 10, Stream::LEGACY)), (200 << 10, 100 << 10));
    assert_eq!(
        mismatch(a.deallocate(large, (200 << 10) + 256, Stream::LEGACY)),
        (200 << 10, (200 << 10) + 256)
    );
    assert!(matches!(
        reason(a.deallocate(large, 1 << 20, Stream::LEGACY)),
        InvalidFree::SizeMismatch { .. } | InvalidFree::UnknownPointer
    ));
    // A small block freed with the wrong size by another thread: checked by the owner.
    let q = a.allocate_per_thread(2048).unwrap();
    let a2 = a.clone();
    let r = std::thread::spawn(move || {
        let r = a2.deallocate_per_thread(q, 8192);
        a2.flush().unwrap();
        r
    })
    .join()
    .unwrap();
    let mut live = live;
    match r {
        Err(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. }) => {}
        Ok(()) => {
            a.flush().unwrap();
            dev.synchronize();
            a.flush().unwrap();
            assert!(
                matches!(
                    a.take_deferred_error(),
                    Some(Error::InvalidFree { reason: InvalidFree::SizeMismatch { .. }, .. })
                ),
                "a remote free of the wrong size was accepted"
            );
        }
        other => panic!("{other:?}"),
    }
    live.push((q, 2048, Stream::PER_THREAD));
    assert_eq!(a.stats().invalid_frees, 6);
    settle(&a, &dev, live);
}

/// A block of one allocator (over its own device) freed into another: refused, and it stays
/// live where it belongs.
#[test]
fn a_block_of_another_device_is_refused() {
    let (d0, a0) = setup();
    let (d1, a1) = setup();
    let own1 = two_blocks(&a1);
    let own0 = two_blocks(&a0);
    let extra = a0.allocate(64, Stream::LEGACY).unwrap();
    let mut own0 = own0;
    own0.push((extra, 64, Stream::LEGACY));
    for &(p, size, s) in &own0 {
        assert_eq!(reason(a1.deallocate(p, size, s)), InvalidFree::UnknownPointer, "{p:?}");
    }
    assert_eq!(a1.stats().invalid_frees, 3);
    settle(&a0, &d0, own0);
    settle(&a1, &d1, own1);
}

#[test]
fn a_destroyed_stream_is_a_driver_error_and_changes_nothing() {
    let (dev, a) = setup();
    let live = two_blocks(&a);
    let gone = dev.create_stream();
    let on_gone = a.allocate(100 << 10, gone).unwrap();
    dev.destroy_stream(gone).unwrap();
    for (size, what) in [(4096, "small"), (300 << 10, "large")] {
        assert!(matches!(a.allocate(size, gone), Err(Error::Driver { .. })), "{what} allocation");
    }
    for &(p, size, _) in &live {
        assert!(matches!(a.deallocate(p, size, gone), Err(Error::Driver { .. })), "{p:?}");
    }
    assert!(matches!(a.deallocate(on_gone, 100 << 10, gone), Err(Error::Driver { .. })));
    assert!(matches!(
        a.deallocate_used_on(live[1].0, 200 << 10, Stream::LEGACY, &[gone]),
        Err(Error::Driver { .. })
    ));
    let mut live = live;
    live.push((on_gone, 100 << 10, Stream::LEGACY));
    settle(&a, &dev, live);
}

#[test]
fn no_driver_is_an_error_not_a_panic() {
    if cuarena::device::cuda::driver_present() {
        // A GPU machine: bad ordinals are errors all the same.
        assert!(matches!(Allocator::cuda(-1, Config::default()), Err(Error::NoDevice { ordinal: -1, .. })));
        assert!(matches!(Allocator::cuda(1 << 20, Config::default()), Err(Error::NoDevice { .. })));
        return;
    }
    assert_eq!(Allocator::cuda(0, Config::default()).err(), Some(Error::NoDriver));
    assert_eq!(Allocator::cuda(3, config().build().unwrap()).err(), Some(Error::NoDriver));
    assert_eq!(cuarena::CudaDevice::new(0).err(), Some(Error::NoDriver));
    assert!(matches!(cuarena::device::cuda::device_count(), Err(Error::NoDriver)));
    assert!(Error::NoDriver.to_string().contains("no CUDA driver"));
}

#[test]
fn a_bad_cuarena_conf_is_a_config_error() {
    for bad in [
        "small_max",
        "small_max=",
        "=1MiB",
        "small_max=1XB",
        "small_max=-1",
        "small_max=1.5",
        "small_max=1.5B",
        "small_max=1",
        "small_max=-1MiB",
        "small_max=NaN",
        "chunk=32",
        "max=80",
        "max=0.8",
        "max:0.8",
        "max_bytes=1MiB",
        "batch_blocks=0",
        "sparse_fraction=1",
        "max_fraction=0.8",
        "max=80%;small_max=1MiB",
        "superblock=3MiB",
        "superblock=1TiB",
        "chunk=3MiB",
        "max=0",
        "max=150%",
        "max=abc%",
        "max=99999999999999999999",
        "keep_empty=18446744073709551615",
        "keep_empty=1025",
        "keep_empty=-1",
        "sparse=1.5",
        "sparse=NaN",
        "batch=0",
        "batch=1000000000",
        "batch_bytes=0",
        "passthrough=maybe",
        "small_max=1MiB;superblock=2MiB",
        "bogus=1",
        "SMALL_MAX=1MiB",
    ] {
        match Config::parse(bad) {
            Err(Error::Config(m)) => {
                assert!(m.contains("CUARENA_CONF") && m.contains("keep_empty"), "{bad}: {m}");
                assert!(m.contains("batch_blocks") && m.contains("key:value"), "{bad}: {m}");
                let full = Error::Config(m).to_string();
                assert!(full.starts_with("invalid cuarena configuration"), "{full}");
            }
            other => panic!("`{bad}` gave {other:?}"),
        }
    }
    // The same settings in every accepted spelling give one configuration.
    let want = config().max_bytes(3 << 29).batch_bytes(512).build().unwrap();
    for good in [
        "superblock=256KiB,small_max=64KiB,chunk=1MiB,batch=8,max=1.5GiB,batch_bytes=512B",
        "superblock:256kib, small_max:64 KiB, chunk:1m, batch_blocks:8, max_bytes:1.5gib, batch_bytes:512b",
        "superblock=262144,small_max=65536,chunk=1048576,batch=8,max=1610612736,batch_bytes=512B",
    ] {
        assert_eq!(Config::parse(good).unwrap(), want, "{good}");
    }
}

/// `keep_empty` at its largest accepted value works (the multiply that overflowed at
/// `usize::MAX` stays far from overflow), and beyond it the builder refuses.
#[test]
fn keep_empty_at_its_limit_works_and_beyond_it_is_refused() {
    assert!(matches!(config().keep_empty(usize::MAX).build(), Err(Error::Config(_))));
    let dev = device(256 << 20);
    let max = cuarena::config::MAX_KEEP_EMPTY;
    let a = host_allocator(dev.clone(), config().keep_empty(max).build().unwrap()).unwrap();
    let blocks: Vec<DeviceAddr> = (0..64).map(|_| a.allocate_per_thread(48 << 10).unwrap()).collect();
    for p in blocks {
        a.deallocate_per_thread(p, 48 << 10).unwrap();
    }
    settle(&a, &dev, Vec::new());
}

/// `set_memory_fraction` takes [0, 1] as PyTorch does. At 0 nothing more is reserved (what is
/// reserved still serves, in the arenas and in the pool, and an allocation past it is out of
/// memory naming the limit 0); NaN,
/// negative and above-1 fractions are refused and leave the cap as it was.
#[test]
fn a_memory_fraction_of_zero_stops_growth_and_bad_fractions_change_nothing() {
    let (dev, a) = setup(); // 256 MiB device
    let live = two_blocks(&a);
    let reserved = a.stats().reserved_bytes;
    assert!(reserved > 0);
    a.set_memory_fraction(0.0).unwrap();
    let limit_of = |r: cuarena::Result<DeviceAddr>| match r {
        Err(Error::OutOfMemory { limit, .. }) => limit,
        other => panic!("expected out of memory, got {other:?}"),
    };
    assert_eq!(limit_of(a.allocate(8 << 20, Stream::LEGACY)), 0);
    // The statistics read the cap back (PyTorch's get_per_process_memory_fraction does).
    assert_eq!((a.stats().limit_bytes, a.stats().device_total_bytes), (0, 256 << 20));
    // A small block from what this thread's arena already holds is still served.
    let small = a.allocate_per_thread(1000).unwrap();
    a.deallocate_per_thread(small, 1000).unwrap();
    a.set_memory_fraction(0.25).unwrap(); // from a cap a bad fraction's cast would change
    for bad in [f64::NAN, -0.0001, -1.0, 1.0001, f64::INFINITY, f64::NEG_INFINITY] {
        match a.set_memory_fraction(bad) {
            Err(Error::Config(m)) => assert!(m.contains("must be in [0, 1]"), "{m}"),
            other => panic!("fraction {bad}: {other:?}"),
        }
        assert_eq!(
            limit_of(a.allocate(80 << 20, Stream::LEGACY)),
            64 << 20,
            "fraction {bad} changed the cap"
        );
    }
    assert_eq!(a.stats().limit_bytes, 64 << 20, "bad fractions changed the cap the statistics read");
    let big = a.allocate(8 << 20, Stream::LEGACY).unwrap();
    assert_eq!(limit_of(a.allocate(80 << 20, Stream::LEGACY)), 64 << 20);
    settle(&a, &dev, [live, vec![(big, 8 << 20, Stream::LEGACY)]].concat());

    // The global pool's path (no large superblocks, as the framework glue sets): a block freed
    // into the pool serves again at fraction 0, larger than the cap as it is; growth does not.
    let dev = device(256 << 20);
    let a = host_allocator(dev.clone(), config().no_large().build().unwrap()).unwrap();
    let p = a.allocate(8 << 20, Stream::LEGACY).unwrap();
    a.deallocate(p, 8 << 20, Stream::LEGACY).unwrap();
    a.set_memory_fraction(0.0).unwrap();
    let again = a.allocate(8 << 20, Stream::LEGACY).unwrap();
    assert_eq!(again, p, "the pool's free block at the same address");
    assert_eq!(limit_of(a.allocate(8 << 20, Stream::LEGACY)), 0);
    assert_eq!(limit_of(a.allocate(257 << 20, Stream::LEGACY)), 0, "more than the device");
    settle(&a, &dev, vec![(again, 8 << 20, Stream::LEGACY)]);
}

/// Out of memory names the size the caller asked for, on every path: an arena's request is
/// rounded to its class (small) or to the granule (large) before it reaches the pool, whose
/// error carried that rounding (helper-26's test saw 1,886,976 for 1,886,966 on the CI host).
#[test]
fn out_of_memory_reports_the_size_asked_on_every_path() {
    let dev = device(1 << 30);
    let cap = 4 << 20;
    let a = host_allocator(dev.clone(), config().max_bytes(cap).build().unwrap()).unwrap();
    let user = dev.create_stream();
    // Over the cap, not granule or class multiples: small (class-rounded), large (arena, from
    // large superblocks) and over `large_max` (the pool), on every kind of stream.
    for size in [SMALL_MAX - 10, (5 << 20) - 10, (5 << 20) + 3, (70 << 20) + 1] {
        for s in [Stream::PER_THREAD, Stream::LEGACY, user] {
            if size <= SMALL_MAX {
                // Fill the cap first so that a small request runs out too.
                let mut held = Vec::new();
                let r = loop {
                    match a.allocate(size, s) {
                        Ok(p) => held.push(p),
                        Err(e) => break e,
                    }
                };
                for p in held {
                    a.deallocate(p, size, s).unwrap();
                }
                match r {
                    Error::OutOfMemory { requested, limit, .. } => {
                        assert_eq!((requested, limit), (size, cap))
                    }
                    e => panic!("{size} on {s:?}: {e}"),
                }
            } else {
                match a.allocate(size, s) {
                    Err(Error::OutOfMemory { requested, limit, .. }) => {
                        assert_eq!((requested, limit), (size, cap), "on {s:?}")
                    }
                    r => panic!("{size} on {s:?}: {r:?}"),
                }
            }
        }
    }
    a.release_thread().unwrap();
    dev.destroy_stream(user).unwrap();
    a.trim(true).unwrap();
    cuarena_testkit::assert_all_returned(&a, Some(&dev), 0);
}
