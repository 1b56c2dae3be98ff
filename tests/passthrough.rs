//! Pass-through mode (`Config::passthrough`) on the simulated device: every block its own
//! stream-ordered driver allocation, frees stream-ordered, bad frees refused.

use std::time::Duration;

use cuarena::{Allocator, Config, DeviceAddr, Error, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, assert_all_returned, host_allocator};

fn device(max_delay_us: u64) -> HostDevice {
    HostDevice::new(HostConfig {
        capacity: 256 << 20,
        min_delay: Duration::ZERO,
        max_delay: Duration::from_micros(max_delay_us),
        ..HostConfig::default()
    })
}

fn passthrough(dev: &HostDevice) -> Allocator {
    host_allocator(
        dev.clone(),
        Config::parse("passthrough,small_max=64KiB,superblock=256KiB,chunk=1MiB").unwrap(),
    )
    .unwrap()
}

fn reason(r: cuarena::Result<()>) -> InvalidFree {
    match r {
        Err(Error::InvalidFree { reason, .. }) => reason,
        other => panic!("expected an invalid free, got {other:?}"),
    }
}

/// Many threads, each block its own driver allocation of its exact size, freed on its own
/// stream, on another thread's stream behind an event, or with `deallocate_used_on`.
#[test]
fn concurrent_threads_allocate_and_free_through_the_driver() {
    let dev = device(100);
    let a = passthrough(&dev);
    let (tx, rx) = std::sync::mpsc::channel::<(DeviceAddr, usize, cuarena::Event, u32)>();
    let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
    const THREADS: usize = 4;
    const STEPS: usize = 200;
    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, dev, tx, rx) = (a.clone(), dev.clone(), tx.clone(), rx.clone());
            std::thread::spawn(move || {
                let user = dev.create_stream();
                let mut mine: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                for i in 0..STEPS {
                    let size = 1 + (i * 7919 + t * 104_729) % (300 << 10);
                    let stream = [Stream::PER_THREAD, Stream::LEGACY, user][i % 3];
                    let p = a.allocate(size, stream).unwrap();
                    assert_eq!(p.0 % 256, 0);
                    assert!(
                        mine.iter().all(|&(q, qs, _)| p.0 + size as u64 <= q.0 || q.0 + qs as u64 <= p.0)
                    );
                    let tag = (t * STEPS + i) as u32;
                    dev.write_tag(p.0, size & !3, tag, stream).unwrap();
                    dev.check_tag(p.0, size & !3, tag, stream).unwrap();
                    match i % 4 {
                        0 => a.deallocate(p, size, stream).unwrap(),
                        1 => {
                            let e = a.device().create_event().unwrap();
                            a.device().record_event(e, stream).unwrap();
                            tx.send((p, size, e, tag)).unwrap();
                        }
                        2 => a.deallocate_used_on(p, size, user, &[stream]).unwrap(),
                        _ => mine.push((p, size, stream)),
                    }
                    // Free a block handed over by another thread, after waiting for its work.
                    let handed = rx.lock().unwrap().try_recv();
                    if let Ok((q, qs, e, qtag)) = handed {
                        a.device().stream_wait_event(user, e).unwrap();
                        dev.check_tag(q.0, qs & !3, qtag, user).unwrap();
                        a.deallocate(q, qs, user).unwrap();
                    }
                    if mine.len() > 8 {
                        let (q, qs, qstream) = mine.remove(i % mine.len());
                        a.deallocate(q, qs, qstream).unwrap();
                    }
                }
                // The main thread frees these on the legacy stream: order their work first.
                let e = a.device().create_event().unwrap();
                let ordered = |(q, qs, qstream): (DeviceAddr, usize, Stream)| {
                    a.device().record_event(e, qstream).unwrap();
                    a.device().stream_wait_event(Stream::LEGACY, e).unwrap();
                    (q, qs)
                };
                mine.into_iter().map(ordered).collect::<Vec<_>>()
            })
        })
        .collect();
    drop(tx);
    let mut left: Vec<(DeviceAddr, usize)> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    while let Ok((q, qs, e, _)) = rx.lock().unwrap().try_recv() {
        a.device().stream_wait_event(Stream::LEGACY, e).unwrap();
        left.push((q, qs));
    }
    let s = a.stats();
    assert_eq!(s.allocations, (THREADS * STEPS) as u64);
    assert_eq!(s.live_bytes, left.iter().map(|&(_, s)| s as u64).sum::<u64>(), "{s:?}");
    assert!(s.driver_calls >= s.allocations + s.deallocations, "one driver call per request: {s:?}");
    a.check_invariants();
    for (q, qs) in left {
        a.deallocate(q, qs, Stream::LEGACY).unwrap();
    }
    assert_eq!(a.stats().reserved_bytes, 0, "pass-through reserves nothing");
    assert_all_returned(&a, Some(&dev), 0);
    assert_eq!(a.stats().invalid_frees, 0);
    assert!(dev.violations().is_empty(), "{:?}", &dev.violations()[..dev.violations().len().min(3)]);
    assert_eq!(dev.tag_errors(), 0);
}

/// A free is stream-ordered: the memory goes back only after the work queued before it, and
/// a free on another stream is ordered by `deallocate_used_on`. Without that ordering the
/// race checker sees the free (the negative control shows it is watching).
#[test]
fn frees_are_stream_ordered() {
    let dev = device(0);
    let a = passthrough(&dev);
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let p = a.allocate(4096, s1).unwrap();
    // The gate keeps the work in flight until the checks are made (a 30 ms hold alone can end
    // first on a loaded machine).
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(p.0, 4096, 1, Duration::from_millis(30), s1).unwrap();
    a.deallocate(p, 4096, s1).unwrap();
    assert_eq!(dev.reserved_bytes(), 4096, "released only when the queued work is done");
    gate.open();
    assert_eq!(a.stats().live_bytes, 0);
    let q = a.allocate(4096, s1).unwrap();
    dev.hold_and_check(q.0, 4096, 2, Duration::from_millis(30), s1).unwrap();
    a.deallocate_used_on(q, 4096, s2, &[s1]).unwrap();
    dev.synchronize();
    assert_eq!(dev.violations(), Vec::<String>::new());
    assert_eq!(dev.tag_errors(), 0);
    assert_eq!(a.stats().reserved_bytes, 0, "pass-through reserves nothing");
    assert_all_returned(&a, Some(&dev), 0);

    let r = a.allocate(4096, s1).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(r.0, 4096, 3, Duration::from_millis(30), s1).unwrap();
    a.deallocate(r, 4096, s2).unwrap(); // breaks the contract: nothing orders s1 before s2
    gate.open();
    dev.synchronize();
    assert_eq!(dev.violations().len(), 1, "{:?}", dev.violations());
}

#[test]
fn bad_requests_are_refused_and_lose_nothing() {
    let dev = device(0);
    let a = passthrough(&dev);
    assert_eq!(a.allocate(0, Stream::LEGACY).unwrap(), DeviceAddr::NULL);
    a.deallocate(DeviceAddr::NULL, 0, Stream::LEGACY).unwrap();
    a.set_limit_bytes(1 << 20);
    assert_eq!(a.stats().limit_bytes, 1 << 20, "pass-through's statistics read the cap it obeys");
    for huge in [usize::MAX, (1 << 20) + 1] {
        match a.allocate(huge, Stream::LEGACY) {
            Err(Error::OutOfMemory { requested, limit, reserved, .. }) => {
                assert_eq!((requested, limit, reserved), (huge, 1 << 20, 0));
            }
            other => panic!("{other:?}"),
        }
    }
    let small = a.allocate(1000, Stream::PER_THREAD).unwrap();
    let large = a.allocate(200 << 10, Stream::LEGACY).unwrap();
    match a.allocate(900 << 10, Stream::LEGACY) {
        Err(Error::OutOfMemory { reserved, in_use, .. }) => {
            assert_eq!((reserved, in_use), (1000 + (200 << 10), 1000 + (200 << 10)))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        reason(a.deallocate(small, 5000, Stream::PER_THREAD)),
        InvalidFree::SizeMismatch { allocated: 1024, given: 5000 }
    ));
    // A size of the same rounded class is accepted, as in the normal mode.
    let alias = a.allocate(1000, Stream::PER_THREAD).unwrap();
    a.deallocate(alias, 1001, Stream::PER_THREAD).unwrap();
    assert_eq!(
        reason(a.deallocate(DeviceAddr(small.0 + 256), 256, Stream::PER_THREAD)),
        InvalidFree::UnknownPointer
    );
    assert_eq!(
        reason(a.deallocate(DeviceAddr(0xdead_0000), 4096, Stream::LEGACY)),
        InvalidFree::UnknownPointer
    );
    assert_eq!(reason(a.deallocate(DeviceAddr(u64::MAX), 4096, Stream::LEGACY)), InvalidFree::UnknownPointer);
    assert_eq!(reason(a.deallocate(DeviceAddr::NULL, 8, Stream::LEGACY)), InvalidFree::UnknownPointer);
    assert_eq!(reason(a.deallocate(small, 0, Stream::LEGACY)), InvalidFree::ZeroSize);
    assert_eq!(reason(a.deallocate(large, usize::MAX, Stream::LEGACY)), InvalidFree::UnknownPointer);
    let gone = dev.create_stream();
    dev.destroy_stream(gone).unwrap();
    assert!(matches!(a.deallocate(large, 200 << 10, gone), Err(Error::Driver { .. })));
    assert!(a.allocate(10, gone).is_err());
    // The caller's own stale handle reached the device, once per call above: no other.
    assert!(dev.take_stale_handle_calls() <= 2);
    let s = a.stats();
    assert_eq!(s.live_bytes, 1000 + (200 << 10), "the refused frees lost nothing: {s:?}");
    a.check_invariants();
    a.deallocate(small, 1000, Stream::PER_THREAD).unwrap();
    a.deallocate(large, 200 << 10, Stream::LEGACY).unwrap();
    assert_eq!(reason(a.deallocate(small, 1000, Stream::PER_THREAD)), InvalidFree::DoubleFree);
    assert_eq!(reason(a.deallocate(large, 200 << 10, Stream::LEGACY)), InvalidFree::DoubleFree);
    assert_eq!(a.stats().invalid_frees, 9, "every refusal is counted");
    assert_eq!(a.stats().reserved_bytes, 0, "pass-through reserves nothing");
    assert_all_returned(&a, Some(&dev), 9);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn the_builder_switch_and_the_parse_key_agree() {
    let dev = device(0);
    let a = host_allocator(dev.clone(), Config::builder().passthrough(true).build().unwrap()).unwrap();
    let p = a.allocate_per_thread(100).unwrap();
    assert_eq!(dev.reserved_bytes(), 100, "an exact-size driver allocation, no chunk");
    assert_eq!(a.stats().arenas, 0);
    a.deallocate_per_thread(p, 100).unwrap();
    assert_eq!(a.stats().reserved_bytes, 0, "pass-through reserves nothing");
    assert_all_returned(&a, Some(&dev), 0);
}

/// The simulator, counting the calls `deallocate_used_on` makes (capture checks, identity
/// lookups, the fences' event create where the event pool has none idle, record, poll and wait;
/// the destroy of an idle event at a trim) and failing every event record while asked to.
struct Calls {
    sim: HostDevice,
    calls: std::sync::atomic::AtomicU64,
    fail_records: std::sync::atomic::AtomicBool,
}

impl cuarena_testkit::Interpose for Calls {
    fn base(&self) -> &dyn cuarena::Device {
        &self.sim
    }
    fn create_event(&self) -> cuarena::Result<cuarena::Event> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cuarena::Device::create_event(&self.sim)
    }
    fn destroy_event(&self, e: cuarena::Event) {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cuarena::Device::destroy_event(&self.sim, e)
    }
    fn record_event(&self, e: cuarena::Event, s: Stream) -> cuarena::Result<()> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.fail_records.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Driver { call: "cuEventRecord", code: 700 });
        }
        cuarena::Device::record_event(&self.sim, e, s)
    }
    fn stream_wait_event(&self, s: Stream, e: cuarena::Event) -> cuarena::Result<()> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cuarena::Device::stream_wait_event(&self.sim, s, e)
    }
    fn stream_key(&self, s: Stream) -> cuarena::Result<cuarena::StreamKey> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cuarena::Device::stream_key(&self.sim, s)
    }
    fn stream_capturing(&self, s: Stream) -> cuarena::Result<bool> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cuarena::Device::stream_capturing(&self.sim, s)
    }
    fn query_event(&self, e: cuarena::Event) -> cuarena::Result<bool> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cuarena::Device::query_event(&self.sim, e)
    }
}

/// `deallocate_used_on` in pass-through mode refuses a bad free before any driver call (a
/// foreign pointer, a size mismatch, a double free: each an invalid free, no event made), and
/// counts in `driver_calls` every call it makes, those of a failed ordering too; that failure
/// frees nothing, and the block is freed whole afterwards. Before the thirty-first session it
/// made its events first, and a failure lost their count.
#[test]
fn a_free_used_on_other_streams_refuses_bad_frees_first_and_counts_every_call() {
    use std::sync::atomic::Ordering::SeqCst;
    let sim = device(0);
    let dev = std::sync::Arc::new(cuarena_testkit::Interposed(Calls {
        sim: sim.clone(),
        calls: Default::default(),
        fail_records: Default::default(),
    }));
    let a = Allocator::new(
        dev.clone(),
        Config::parse("passthrough,small_max=64KiB,superblock=256KiB,chunk=1MiB").unwrap(),
    )
    .unwrap();
    let (s1, s2) = (sim.create_stream(), sim.create_stream());
    let p = a.allocate(4096, s1).unwrap();
    let seen = || (dev.0.calls.load(SeqCst), a.stats().driver_calls, a.stats().invalid_frees);
    let (c0, d0, i0) = seen();
    let bad = [
        (DeviceAddr(p.0 + 256), 4096, InvalidFree::UnknownPointer),
        (p, 1 << 20, InvalidFree::SizeMismatch { allocated: 4096, given: 1 << 20 }),
    ];
    for (q, n, want) in bad {
        assert_eq!(reason(a.deallocate_used_on(q, n, s2, &[s1])), want);
    }
    let (c1, d1, i1) = seen();
    assert_eq!((c1 - c0, d1 - d0, i1 - i0), (0, 0, 2), "a bad free made driver calls or went uncounted");

    dev.0.fail_records.store(true, SeqCst);
    let r = a.deallocate_used_on(p, 4096, s2, &[s1]);
    assert!(matches!(r, Err(Error::Driver { .. })), "{r:?}");
    let (c2, d2, _) = seen();
    assert!(c2 > c1, "no driver call made");
    assert_eq!(d2 - d1, c2 - c1, "the failed ordering's calls were not all counted");
    assert_eq!(a.stats().live_bytes, 4096, "a failed ordering freed the block");

    dev.0.fail_records.store(false, SeqCst);
    // s1's work held, so its fence is pending and waited on (a fence seen complete is not).
    let gate = sim.gate(s1).unwrap();
    a.deallocate_used_on(p, 4096, s2, &[s1]).unwrap();
    gate.open();
    let (c3, d3, _) = seen();
    // The free itself is one more call the device's `free_async` makes (not counted above).
    assert_eq!(d3 - d2, c3 - c2 + 1, "calls {c2} -> {c3}, driver_calls {d2} -> {d3}");
    assert_eq!(reason(a.deallocate_used_on(p, 4096, s2, &[s1])), InvalidFree::DoubleFree);
    assert_eq!(seen().0, c3, "a double free made driver calls");
    sim.synchronize();
    assert_eq!(sim.violations(), Vec::<String>::new());
    let st = a.stats();
    assert_eq!((st.live_bytes, st.deallocations, st.invalid_frees), (0, 1, 3), "{st:?}");
    assert_eq!((st.fences_recorded, st.fence_waits), (1, 1), "only the ordering that ran: {st:?}");
    assert_eq!(sim.reserved_bytes(), 0, "the block went back to the device");
}
