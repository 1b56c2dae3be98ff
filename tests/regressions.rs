//! Regression tests for four ways a block was handed out wrongly or stranded (issue 8, bugs A,
//! B and C; D is CuPy's and is checked on the GPU by `examples/cupy_stream_check.py`). Each
//! failed on the code before its fix.

use std::cell::Cell;
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cuarena::{Allocator, Config, Device, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HookedDevice, Hooks, HostConfig, HostDevice, host_allocator};

fn host(max_delay_us: u64) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity: 1 << 30,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(max_delay_us),
        ..HostConfig::default()
    })
}

thread_local! {
    /// Set on a thread whose next event record stalls after the event is queued.
    static STALL_RECORD: Cell<Option<Duration>> = const { Cell::new(None) };
}

/// A simulated device whose `record_event` can stall after queueing the record, as a thread
/// preempted between the record and whatever the allocator does next.
fn stalling_device(sim: &HostDevice) -> Arc<HookedDevice> {
    let record: cuarena_testkit::hooked::EventHook = Box::new(|sim, event, stream| {
        let r = sim.record_event(event, stream);
        if let Some(d) = STALL_RECORD.with(|s| s.take()) {
            std::thread::sleep(d);
        }
        r
    });
    HookedDevice::new(sim.clone(), Hooks { record_event: Some(record), ..Hooks::default() })
}

/// Bug A: two threads free neighbouring pool blocks on the shared legacy stream. X's record is
/// queued first but X is preempted before it numbers its fence; Y's free (behind 400 ms of work)
/// is numbered first. The coalesced extent must keep both fences (their order on the stream is
/// not known), so a later allocation on another stream waits for Y's work.
#[test]
fn a_later_fence_on_a_shared_stream_is_not_dropped() {
    let sim = host(0);
    let dev = stalling_device(&sim);
    // Pool blocks: large superblocks off (`large_max = small_max`).
    let cfg = Config::builder()
        .small_max(64 << 10)
        .large_max(64 << 10)
        .superblock(256 << 10)
        .chunk(1 << 20)
        .build()
        .unwrap();
    let a = Allocator::new(dev, cfg).unwrap();
    let kib128 = 128 << 10;
    let p1 = a.allocate(kib128, Stream::LEGACY).unwrap();
    let p2 = a.allocate(kib128, Stream::LEGACY).unwrap();
    assert_eq!(p2.0, p1.0 + kib128 as u64, "first fit gives neighbours");
    let start = Arc::new(Barrier::new(2));
    let (ax, sx) = (a.clone(), start.clone());
    let x = std::thread::spawn(move || {
        STALL_RECORD.with(|s| s.set(Some(Duration::from_millis(200))));
        sx.wait();
        ax.deallocate(p1, kib128, Stream::LEGACY).unwrap();
    });
    let (ay, simy) = (a.clone(), sim.clone());
    let y = std::thread::spawn(move || {
        start.wait();
        std::thread::sleep(Duration::from_millis(50)); // X has queued its record and stalls
        simy.hold_and_check(p2.0, kib128, 0xabcd, Duration::from_millis(400), Stream::LEGACY).unwrap();
        ay.deallocate(p2, kib128, Stream::LEGACY).unwrap();
    });
    x.join().unwrap();
    y.join().unwrap();
    let user = sim.create_stream();
    let q = a.allocate(2 * kib128, user).unwrap();
    assert_eq!(q, p1, "the coalesced extent is reused");
    sim.write_tag(q.0, 2 * kib128, 0x1234, user).unwrap();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "reused before Y's fence: {:?}", sim.violations());
    assert_eq!(sim.tag_errors(), 0);
    a.deallocate(q, 2 * kib128, user).unwrap();
    a.trim(true).unwrap();
    assert_eq!(a.stats().live_bytes, 0);
}

/// Bug B: a free parked in another thread's outbox, then the owner exits (its superblock
/// dissolves), then the same thread frees the block again. The second free must be refused, and
/// the block never handed out twice.
#[test]
fn a_double_free_parked_in_an_outbox_is_refused_and_nothing_is_handed_out_twice() {
    let sim = host(0);
    let cfg = Config::builder().small_max(64 << 10).superblock(256 << 10).chunk(1 << 20).batch_blocks(64);
    let a = host_allocator(sim.clone(), cfg.build().unwrap()).unwrap();
    let (to_owner, owner_rx) = mpsc::channel::<()>();
    let (b_tx, b_rx) = mpsc::channel();
    let ao = a.clone();
    let owner = std::thread::spawn(move || {
        let b = ao.allocate_per_thread(4096).unwrap();
        b_tx.send(b).unwrap();
        owner_rx.recv().unwrap(); // stays alive until told to exit
    });
    let b: DeviceAddr = b_rx.recv().unwrap();
    a.deallocate_per_thread(b, 4096).unwrap(); // parked: the batch is not full
    to_owner.send(()).unwrap();
    owner.join().unwrap(); // the owner exits; its superblock dissolves around b
    let second = a.deallocate_per_thread(b, 4096);
    assert!(matches!(second, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })), "{second:?}");
    let c = a.allocate(4096, Stream::LEGACY).unwrap();
    a.flush().unwrap(); // the parked first free arrives now
    let d = a.allocate(4096, Stream::LEGACY).unwrap();
    assert_ne!(c, d, "a live block was handed out again");
    let live: Vec<_> = [c, d].into_iter().filter(|&p| p == b).collect();
    assert!(live.len() <= 1);
    for p in [c, d] {
        a.deallocate(p, 4096, Stream::LEGACY).unwrap();
    }
    assert!(a.take_deferred_error().is_none(), "{:?}", a.take_deferred_error());
    assert_eq!(a.stats().invalid_frees, 1);
    a.release_thread().unwrap();
    a.check_invariants();
    assert_eq!((a.stats().live_bytes, a.pool_in_use()), (0, 0));
}

/// Bug C: an idle (alive) owner filled the cap; another thread freed every block. With no help
/// from the owner, and no host synchronisation, a later allocation of any size succeeds, and
/// `trim` finds the memory too.
#[test]
fn memory_freed_into_an_idle_arena_is_reclaimed_on_oom_and_by_trim() {
    let sim = host(20);
    let cfg = Config::builder().max_bytes(8 << 20).batch_blocks(16).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let (to_owner, owner_rx) = mpsc::channel::<()>();
    let (blocks_tx, blocks_rx) = mpsc::channel();
    let ao = a.clone();
    let owner = std::thread::spawn(move || {
        let mut v = Vec::new();
        while let Ok(p) = ao.allocate_per_thread(32 << 10) {
            v.push(p);
        }
        blocks_tx.send(v).unwrap();
        owner_rx.recv().unwrap(); // idle from here on
        ao.release_thread().unwrap();
    });
    let blocks = blocks_rx.recv().unwrap();
    assert!(blocks.len() >= 200, "the cap was filled: {}", blocks.len());
    let af = a.clone();
    std::thread::spawn(move || {
        for p in blocks {
            af.deallocate_per_thread(p, 32 << 10).unwrap();
        }
        af.flush().unwrap();
    })
    .join()
    .unwrap();
    let s = a.stats();
    assert_eq!(s.live_bytes, 0);
    assert!(s.arena_held_bytes >= 6 << 20, "{s:?}");
    // The owner stays idle: a large and a small allocation succeed all the same.
    let big = a.allocate(4 << 20, Stream::LEGACY).expect("a large allocation after reclaim");
    let small = a.allocate_per_thread(32 << 10).expect("a small allocation after reclaim");
    sim.write_tag(big.0, 4 << 20, 7, Stream::LEGACY).unwrap();
    sim.write_tag(small.0, 32 << 10, 8, Stream::PER_THREAD).unwrap();
    assert_eq!(a.stats().host_syncs, 0, "the reclaim blocked the host");
    a.deallocate(big, 4 << 20, Stream::LEGACY).unwrap();
    a.deallocate_per_thread(small, 32 << 10).unwrap();
    // trim takes the rest back from the idle arena, and the device gets it.
    a.trim(true).unwrap();
    let s = a.stats();
    assert_eq!(s.arena_held_bytes, 0, "the idle arena kept superblocks with no live block: {s:?}");
    to_owner.send(()).unwrap();
    owner.join().unwrap();
    a.release_thread().unwrap();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    a.trim(true).unwrap();
    let s = a.stats();
    assert_eq!((s.live_bytes, s.reserved_bytes, a.pool_in_use()), (0, 0, 0), "{s:?}");
}

/// Smaller defects of issue 8: an arena-path out-of-memory error reports the request (not the
/// superblock size), and a bad pool-path free is refused before any event is recorded.
#[test]
fn arena_oom_reports_the_request_and_a_bad_pool_free_records_no_event() {
    let sim = host(0);
    let cfg = Config::builder().superblock(256 << 10).small_max(64 << 10).chunk(256 << 10);
    let a = host_allocator(sim.clone(), cfg.max_bytes(512 << 10).build().unwrap()).unwrap();
    let big = a.allocate(512 << 10, Stream::LEGACY).unwrap(); // the whole cap, from the pool
    match a.allocate_per_thread(32 << 10) {
        Err(Error::OutOfMemory { requested, .. }) => {
            assert_eq!(requested, 32 << 10, "the request, not a superblock")
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    let before = a.stats();
    for (ptr, size) in [(big.0 + 4096, 4096), (big.0, 4096), (0xdead_0000, 1 << 20)] {
        let user = sim.create_stream();
        assert!(a.deallocate(DeviceAddr(ptr), size, user).is_err());
    }
    let after = a.stats();
    assert_eq!(after.fences_recorded, before.fences_recorded, "a refused free recorded an event");
    assert_eq!(after.invalid_frees, before.invalid_frees + 3);
    a.deallocate(big, 512 << 10, Stream::LEGACY).unwrap();
    a.release_thread().unwrap();
    a.trim(true).unwrap();
    assert_eq!((a.stats().live_bytes, a.stats().reserved_bytes), (0, 0));
}

/// Lazy legacy fences (`src/fence.rs`): a pool block used on one thread's per-thread stream and
/// freed on the legacy stream gets no event at its free. Reused on another thread's per-thread
/// stream or on a user stream, one legacy event is recorded at reuse (a legacy operation after
/// the free) and that stream waits on it; reused on the legacy stream, a legacy action issued
/// after the free's ticket orders it (a wait on the legacy stream).
#[test]
fn a_block_freed_on_the_legacy_stream_is_fenced_when_reused_elsewhere() {
    let sim = host(0);
    // large_max = small_max: this test is about pool blocks.
    let cfg = Config::builder().small_max(64 << 10).large_max(64 << 10).superblock(256 << 10).chunk(1 << 20);
    let a = host_allocator(sim.clone(), cfg.batch_blocks(1).build().unwrap()).unwrap();
    let size = 512 << 10; // a pool block
    for reuse in ["other thread's per-thread stream", "user stream", "legacy stream"] {
        let (a1, s1) = (a.clone(), sim.clone());
        let p = std::thread::spawn(move || {
            let p = a1.allocate(size, Stream::LEGACY).unwrap();
            s1.hold_and_check(p.0, size, 0xfeed, Duration::from_millis(150), Stream::PER_THREAD).unwrap();
            // The caller's own ordering: its per-thread work precedes later legacy work.
            a1.deallocate(p, size, Stream::LEGACY).unwrap();
            a1.release_thread().unwrap();
            p
        })
        .join()
        .unwrap();
        let before = a.stats();
        let (a2, s2) = (a.clone(), sim.clone());
        let reuse_on = move |stream: Stream| {
            let q = a2.allocate(size, stream).unwrap();
            assert_eq!(q, p, "the freed block is reused");
            s2.write_tag(q.0, size, 0x1, stream).unwrap();
            a2.deallocate(q, size, stream).unwrap();
            a2.flush().unwrap();
        };
        match reuse {
            "user stream" => reuse_on(sim.create_stream()),
            "legacy stream" => reuse_on(Stream::LEGACY),
            _ => std::thread::spawn(move || reuse_on(Stream::PER_THREAD)).join().unwrap(),
        }
        sim.synchronize();
        assert!(sim.violations().is_empty(), "{reuse}: {:?}", sim.violations());
        assert_eq!(sim.tag_errors(), 0, "{reuse}");
        let after = a.stats();
        if reuse == "legacy stream" {
            // A legacy action issued after the free's ticket (a wait on the legacy stream).
            assert!(after.fence_waits > before.fence_waits, "{reuse}: a legacy action ordered the reuse");
        } else {
            assert!(
                after.fences_recorded > before.fences_recorded,
                "{reuse}: the lazy fence was recorded at reuse"
            );
        }
    }
    a.release_thread().unwrap();
    a.trim(true).unwrap();
    assert_eq!((a.stats().live_bytes, a.stats().reserved_bytes), (0, 0));
}

/// `Allocator` is `Debug` (issue 10): it names its device and configuration.
#[test]
fn an_allocator_prints_its_device_and_configuration() {
    let a = host_allocator(host(0), Config::default()).unwrap();
    let s = format!("{a:?}");
    assert!(s.starts_with("Allocator") && s.contains("\"host\"") && s.contains("small_max"), "{s}");
}

/// The reliability suite's OOM row: several owners fill the cap, other threads free everything,
/// some owners stay idle (blocked) and some exit. The next allocations, large and small,
/// succeed without a host synchronisation, and all memory comes back.
#[test]
fn oom_recovers_with_several_idle_owners_and_remote_frees() {
    let sim = host(20);
    // large_max = small_max: the 8 MiB request below is a pool block, as this test means
    // (under a 16 MiB cap a large superblock for it may not find 8 MiB in one piece while
    // racing owners still give theirs back: see the note on tight caps in `arena.rs`).
    let cfg = Config::builder().max_bytes(16 << 20).large_max(1 << 20).batch_blocks(8).build().unwrap();
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let (blocks_tx, blocks_rx) = mpsc::channel::<Vec<DeviceAddr>>();
    let mut gates = Vec::new();
    let mut owners = Vec::new();
    for t in 0..4 {
        let (go, wait) = mpsc::channel::<()>();
        gates.push(go);
        let (ao, tx) = (a.clone(), blocks_tx.clone());
        owners.push(std::thread::spawn(move || {
            let mut v = Vec::new();
            while let Ok(p) = ao.allocate_per_thread(16 << 10) {
                v.push(p);
                if v.len() >= 300 {
                    break;
                }
            }
            tx.send(v).unwrap();
            if t % 2 == 0 {
                wait.recv().unwrap(); // idle, alive
            }
            ao.release_thread().unwrap();
        }));
    }
    drop(blocks_tx);
    let all: Vec<DeviceAddr> = (0..4).flat_map(|_| blocks_rx.recv().unwrap()).collect();
    // Filled up to what out-of-memory reclaims, racing the owners, left in pieces (each
    // dissolves idle owners' part-used superblocks); the next check is what the test needs.
    assert!(all.len() * (16 << 10) >= 8 << 20, "the cap was filled: {} blocks", all.len());
    assert!(
        matches!(a.allocate(8 << 20, Stream::LEGACY), Err(Error::OutOfMemory { .. })),
        "out of memory before the frees"
    );
    let halves: Vec<Vec<DeviceAddr>> = all.chunks(all.len() / 2 + 1).map(|c| c.to_vec()).collect();
    let freers: Vec<_> = halves
        .into_iter()
        .map(|h| {
            let af = a.clone();
            std::thread::spawn(move || {
                for p in h {
                    af.deallocate_per_thread(p, 16 << 10).unwrap();
                }
                af.flush().unwrap();
                af.release_thread().unwrap();
            })
        })
        .collect();
    freers.into_iter().for_each(|h| h.join().unwrap());
    assert_eq!(a.stats().live_bytes, 0);
    // The owners that do not wait have released their arenas (joined: one still inside its
    // release is an owner inside a call, whose memory the reclaim rightly leaves alone).
    let (idle, exited): (Vec<_>, Vec<_>) = owners.into_iter().enumerate().partition(|(t, _)| t % 2 == 0);
    exited.into_iter().for_each(|(_, h)| h.join().unwrap());
    // Two owners are still alive and idle, holding their arenas.
    let big = a.allocate(8 << 20, Stream::LEGACY).expect("a large allocation after reclaim");
    let small = a.allocate_per_thread(16 << 10).expect("a small allocation after reclaim");
    assert_eq!(a.stats().host_syncs, 0, "the reclaim blocked the host");
    a.deallocate(big, 8 << 20, Stream::LEGACY).unwrap();
    a.deallocate_per_thread(small, 16 << 10).unwrap();
    for g in gates {
        let _ = g.send(());
    }
    idle.into_iter().for_each(|(_, h)| h.join().unwrap());
    a.release_thread().unwrap();
    sim.synchronize();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    a.check_invariants();
    a.trim(true).unwrap();
    let s = a.stats();
    assert_eq!((s.live_bytes, s.reserved_bytes, s.arena_held_bytes, a.pool_in_use()), (0, 0, 0, 0), "{s:?}");
}
