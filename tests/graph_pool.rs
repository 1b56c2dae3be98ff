//! CUDA graph pools (`src/graph_pool.rs`) on the simulated device: allocations routed to a
//! pool while its stream is being captured succeed without an event recorded or waited on the
//! capturing stream (the simulator reports any as a violation), never take memory a fence
//! still guards, stay out of eager allocations' way while the pool is retained, are reused by
//! their own stream only, and come back to the device after the pool's last release and a
//! synchronise. Bad input is refused and changes nothing.

mod common;

use common::{Live, host, small};
use cuarena::{DeviceAddr, Error, GraphPoolId, InvalidFree, Stream};
use cuarena_testkit::{assert_all_returned, host_allocator};

fn ranges_overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// A capture allocates and frees its temporaries in a pool; eager work meanwhile and after
/// never gets the pool's memory; a second capture into the same pool reuses the first's
/// frees on the same stream; the last release and a synchronise give everything back.
#[test]
fn a_capture_allocates_in_its_pool_and_eager_work_never_gets_that_memory() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s, other) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(7, 1);
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    // A capture's allocations: small, medium and large; some freed inside the capture.
    let sizes = [1000usize, 4096, 70_000, 1 << 20, 3 << 20, 12 << 20, 300];
    let mut graph: Vec<(u64, u64)> = Vec::new();
    let mut blocks = Vec::new();
    for &n in &sizes {
        let p = a.graph_allocate(pool, n, s).unwrap();
        assert_eq!(p.0 % 512, 0, "512-byte aligned");
        graph.push((p.0, n.next_multiple_of(512) as u64));
        blocks.push((p, n));
    }
    Live::of(&blocks).assert_clean(); // no two graph blocks overlap
    // Freed inside the capture, on the capturing stream: reused by the capture's next request.
    let (p, n) = blocks.remove(1);
    a.deallocate(p, n, s).unwrap();
    let again = a.graph_allocate(pool, n, s).unwrap();
    assert_eq!(again, p, "the capture's own free is reused on its stream");
    blocks.push((again, n));
    // Eager work on other streams during the capture never lands in the pool.
    for i in 0..200usize {
        let n = 256 + (i * 7919) % (2 << 20);
        let e = a.allocate(n, if i % 2 == 0 { other } else { Stream::PER_THREAD }).unwrap();
        for &g in &graph {
            assert!(!ranges_overlap((e.0, n as u64), g), "eager block {e:?} inside graph memory {g:?}");
        }
        a.deallocate(e, n, if i % 2 == 0 { other } else { Stream::PER_THREAD }).unwrap();
    }
    // The capture frees the rest (a graph's temporaries), then ends.
    for (p, n) in blocks.drain(..) {
        a.deallocate(p, n, s).unwrap();
    }
    dev.end_capture(s).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    // After the capture, while the pool is retained (its graph may replay), eager requests on
    // every stream, the capturing one included, stay out of the graph's memory.
    for i in 0..200usize {
        let n = 256 + (i * 104_729) % (4 << 20);
        let st = [s, other, Stream::LEGACY][i % 3];
        let e = a.allocate(n, st).unwrap();
        for &g in &graph {
            assert!(!ranges_overlap((e.0, n as u64), g), "eager block {e:?} inside graph memory {g:?}");
        }
        a.deallocate(e, n, st).unwrap();
    }
    // A second capture into the same pool (a second graph sharing it) reuses the first's memory.
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    let q = a.graph_allocate(pool, 1000, s).unwrap();
    assert!(graph.iter().any(|&g| ranges_overlap((q.0, 1024), g)), "the pool's memory is reused");
    a.deallocate(q, 1000, s).unwrap();
    dev.end_capture(s).unwrap();
    assert!(a.graph_pool_live(pool).unwrap().is_empty());
    let bytes = a.graph_pool_bytes();
    assert_eq!(bytes, (2 + 20) << 20, "a 2 MiB segment and a 20 MiB one (the 12 MiB block fits its rest)");
    // Released by both graphs: the memory waits for a synchronise, which trim(true) makes.
    a.graph_pool_release(pool).unwrap();
    assert_eq!(a.graph_pool_bytes(), bytes, "still retained by one graph");
    a.graph_pool_release(pool).unwrap();
    assert_eq!(a.graph_pool_bytes(), bytes, "parked until a synchronise");
    assert!(matches!(a.graph_pool_release(pool), Err(Error::UnknownGraphPool { id: (7, 1) })));
    a.check_invariants();
    assert_all_returned(&a, Some(&dev), 0);
    assert_eq!(a.graph_pool_bytes(), 0);
}

/// Outside a capture: a pool's free is reused at once by its own stream, by another only
/// behind a wait on the fence recorded at the free, and a block declared used on another
/// stream has that stream ordered before its free. During a capture: a free is reused by the
/// capturing handle only, and a declared block is held while the pool lives.
#[test]
fn reuse_inside_a_pool_follows_streams_fences_and_captures() {
    let dev = host(50);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(1, 0);
    a.graph_pool_retain(pool);
    let p = a.graph_allocate(pool, 4096, s1).unwrap();
    dev.write_tag(p.0, 4096, 0x1111, s1).unwrap();
    a.deallocate(p, 4096, s1).unwrap(); // a fence recorded on s1
    let r = a.graph_allocate(pool, 4096, s1).unwrap();
    assert_eq!(p, r, "s1 reuses its own free at once");
    dev.hold_and_check(r.0, 4096, 0x2222, std::time::Duration::from_millis(5), s1).unwrap();
    a.deallocate(r, 4096, s1).unwrap();
    let waits = a.stats().fence_waits;
    let q = a.graph_allocate(pool, 4096, s2).unwrap();
    if q == p {
        assert!(a.stats().fence_waits > waits, "s2 got s1's free without a wait");
    }
    dev.write_tag(q.0, 4096, 0x3333, s2).unwrap();
    // Declared used on s1 and freed on s2 outside a capture: s1's work is ordered first.
    a.deallocate_used_on(q, 4096, s2, &[s1]).unwrap();
    dev.synchronize();
    assert_eq!(dev.tag_errors(), 0);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    // During a capture of s1: its free is reused by s1's capture only; a declared block is held.
    let t = a.graph_allocate(pool, 4096, s1).unwrap();
    let u = a.graph_allocate(pool, 4096, s1).unwrap();
    dev.begin_capture(s1).unwrap();
    a.deallocate(t, 4096, s1).unwrap();
    assert_eq!(a.graph_allocate(pool, 4096, s1).unwrap(), t, "the capture's own free, at once");
    a.deallocate_used_on(u, 4096, s1, &[s2]).unwrap();
    let v = a.graph_allocate(pool, 4096, s1).unwrap();
    assert_ne!(v, u, "a held block is not reused");
    assert!(matches!(
        a.deallocate(u, 4096, s1),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    for x in [t, v] {
        a.deallocate(x, 4096, s1).unwrap();
    }
    dev.end_capture(s1).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 1);
}

/// A stream destroyed with work still running on a block it freed into a pool, and its handle
/// given to a new stream: the new stream does not get the block before that work is done.
#[test]
fn a_reused_handle_does_not_get_a_destroyed_streams_pending_free() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let pool = GraphPoolId(12, 0);
    a.graph_pool_retain(pool);
    let s1 = dev.create_stream();
    let p = a.graph_allocate(pool, 4096, s1).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(p.0, 4096, 0x5151, std::time::Duration::from_millis(1), s1).unwrap();
    a.deallocate(p, 4096, s1).unwrap();
    dev.destroy_stream(s1).unwrap();
    let s2 = dev.create_stream();
    let q = a.graph_allocate(pool, 4096, s2).unwrap();
    dev.write_tag(q.0, 4096, 0x5252, s2).unwrap();
    gate.open();
    dev.synchronize();
    assert_eq!(dev.tag_errors(), 0, "s2 wrote the block under s1's running work (same handle: {})", s1 == s2);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.deallocate(q, 4096, s2).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A block taken outside a capture from another stream's free (behind an on-device wait on
/// its fence only) and freed during a capture keeps that fence: the capture's next allocation
/// on the same handle does not get it while the first stream's work runs (a replay on another
/// stream would not be ordered after the wait), and does once that work is done.
#[test]
fn a_captures_free_keeps_the_fence_its_block_was_taken_behind() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(13, 0);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 8192, s1).unwrap();
    let fill = a.graph_allocate(pool, (2 << 20) - 8192, s1).unwrap();
    assert_eq!(fill.0, x.0 + 8192, "one segment, full");
    let gate = dev.gate(s1).unwrap();
    dev.hold_and_check(x.0, 8192, 0x1313, std::time::Duration::from_millis(1), s1).unwrap();
    a.deallocate(x, 8192, s1).unwrap(); // its fence waits behind the gate
    let l = a.graph_allocate(pool, 8192, s2).unwrap();
    assert_eq!(l, x, "s2 took s1's free behind a wait");
    dev.begin_capture(s2).unwrap();
    a.deallocate(l, 8192, s2).unwrap(); // a capture's free: no fence recorded
    let y = a.graph_allocate(pool, 8192, s2).unwrap();
    assert!(
        !ranges_overlap((y.0, 8192), (x.0, 8192)),
        "a capture got a block under s1's running work: {y:?} over {x:?}"
    );
    a.deallocate(y, 8192, s2).unwrap();
    dev.end_capture(s2).unwrap();
    gate.open();
    dev.synchronize();
    // s1's work is done: the capture's own free is reused by its next capture.
    dev.begin_capture(s2).unwrap();
    let z = a.graph_allocate(pool, 8192, s2).unwrap();
    assert!([x, y].contains(&z), "the capture's own frees are reused: {z:?}");
    a.deallocate(z, 8192, s2).unwrap();
    dev.end_capture(s2).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    assert_eq!(dev.tag_errors(), 0);
    a.deallocate(fill, (2 << 20) - 8192, s1).unwrap();
    a.graph_pool_release(pool).unwrap();
    dev.synchronize();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Memory a fence still guards (freed on a stream whose work has not run) is never given to a
/// pool: a capturing stream would have to wait on it. The simulator reports such a wait.
#[test]
fn a_pool_never_grows_into_memory_under_a_pending_fence() {
    let dev = host(0);
    // Pool blocks over 64 KiB: the 1 MiB block below is the global pool's.
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
    let (s, busy) = (dev.create_stream(), dev.create_stream());
    let gate = dev.gate(busy).unwrap();
    let big = a.allocate(4 << 20, busy).unwrap();
    dev.write_tag(big.0, 4 << 20, 0xfeed, busy).unwrap();
    a.deallocate(big, 4 << 20, busy).unwrap(); // its fence waits behind the gate
    let pool = GraphPoolId(2, 0);
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    let p = a.graph_allocate(pool, 1 << 20, s).unwrap();
    assert!(!ranges_overlap((p.0, 1 << 20), (big.0, 4 << 20)), "the pool took fenced memory");
    a.deallocate(p, 1 << 20, s).unwrap();
    dev.end_capture(s).unwrap();
    gate.open();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Bad input: a pool not retained, sizes 0 and huge, a wrong size, a double free, an interior
/// pointer, a foreign pointer. Each is refused, counted where it is a free, and changes nothing.
#[test]
fn bad_input_to_graph_pools_is_refused_and_changes_nothing() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(3, 3);
    assert!(matches!(a.graph_allocate(pool, 100, s), Err(Error::UnknownGraphPool { id: (3, 3) })));
    assert!(matches!(a.graph_pool_live(pool), Err(Error::UnknownGraphPool { .. })));
    assert!(matches!(a.graph_pool_release(pool), Err(Error::UnknownGraphPool { .. })));
    a.graph_pool_retain(pool);
    assert_eq!(a.graph_allocate(pool, 0, s).unwrap(), DeviceAddr::NULL);
    assert!(matches!(
        a.graph_allocate(pool, usize::MAX, s),
        Err(Error::OutOfMemory { requested: usize::MAX, .. })
    ));
    assert!(matches!(a.graph_allocate(pool, 1 << 40, s), Err(Error::OutOfMemory { .. })));
    let p = a.graph_allocate(pool, 5000, s).unwrap();
    let before = a.stats();
    for (ptr, n, why) in
        [(p, 6000usize, "size"), (p, 0, "zero size"), (DeviceAddr(p.0 + 512), 512, "interior")]
    {
        let e = a.deallocate(ptr, n, s).unwrap_err();
        assert!(matches!(e, Error::InvalidFree { .. }), "{why}: {e}");
    }
    let after = a.stats();
    assert_eq!(after.invalid_frees, before.invalid_frees + 3);
    assert_eq!(after.live_bytes, before.live_bytes, "nothing freed");
    assert_eq!(a.graph_pool_live(pool).unwrap(), vec![p]);
    a.deallocate(p, 5000, s).unwrap();
    assert!(matches!(
        a.deallocate(p, 5000, s),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    assert!(matches!(
        a.deallocate(DeviceAddr(0x10), 5000, s),
        Err(Error::InvalidFree { reason: InvalidFree::UnknownPointer, .. })
    ));
    a.graph_pool_release(pool).unwrap();
    assert!(matches!(a.graph_allocate(pool, 100, s), Err(Error::UnknownGraphPool { .. })));
    assert_all_returned(&a, Some(&dev), 5);
}

/// A pool whose last release comes while blocks live (a graph's output tensors outlive it)
/// keeps them valid; their frees, on any thread, return them, and the last one parks the pool.
#[test]
fn blocks_outliving_their_pools_release_are_freed_later_from_other_threads() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(9, 0);
    a.graph_pool_retain(pool);
    let outs: Vec<DeviceAddr> = (0..8).map(|i| a.graph_allocate(pool, 1000 * (i + 1), s).unwrap()).collect();
    a.graph_pool_release(pool).unwrap();
    assert!(a.graph_pool_bytes() > 0);
    let a2 = a.clone();
    std::thread::spawn(move || {
        for (i, p) in outs.into_iter().enumerate() {
            a2.deallocate(p, 1000 * (i + 1), s).unwrap();
        }
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    a.check_invariants();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Many threads, each capturing into its own pool while others churn eagerly: no block
/// overlaps another (graph or eager), the invariants hold, and everything comes back.
#[test]
fn threads_capturing_into_their_own_pools_alongside_eager_churn_never_overlap() {
    let dev = host(5);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let live = std::sync::Arc::new(Live::default());
    let mut hs = Vec::new();
    for t in 0..6u64 {
        let (a, dev, live) = (a.clone(), dev.clone(), live.clone());
        hs.push(std::thread::spawn(move || {
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
            let s = dev.create_stream();
            let pool = GraphPoolId(100 + t, 0);
            for round in 0..20 {
                let capture = t % 2 == 0;
                // Announced, as the shim announces PyTorch's: a capture of a non-blocking stream
                // cannot be seen otherwise, and another thread's out of memory would
                // synchronise, which invalidates it (the simulator fails `end_capture` then).
                if capture {
                    a.graph_pool_retain(pool);
                    a.graph_capture_begin();
                    dev.begin_capture(s).unwrap();
                }
                let mut mine = Vec::new();
                for _ in 0..40 {
                    let n = 256 + (common::rng(&mut x) % (3 << 20)) as usize;
                    let p = if capture {
                        a.graph_allocate(pool, n, s).unwrap()
                    } else {
                        a.allocate(n, s).unwrap()
                    };
                    live.insert(p, n);
                    mine.push((p, n));
                    if common::rng(&mut x).is_multiple_of(3) {
                        let (p, n) = mine.swap_remove((common::rng(&mut x) as usize) % mine.len());
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                for (p, n) in mine {
                    live.remove(p);
                    a.deallocate(p, n, s).unwrap();
                }
                if capture {
                    dev.end_capture(s).unwrap();
                    a.graph_capture_end().unwrap();
                    if round % 5 == 4 {
                        // Destroyed graphs: the pool's memory parks until a synchronise.
                        for _ in 0..5 {
                            a.graph_pool_release(pool).unwrap();
                        }
                    }
                }
            }
            a.release_thread().unwrap();
        }));
    }
    for h in hs {
        h.join().unwrap();
    }
    live.assert_clean();
    a.check_invariants();
    assert_all_returned(&a, Some(&dev), 0);
}

/// A trace records neither a graph pool's allocations nor their frees (a replay would meet a
/// free of an address it never allocated), and the eager traffic around them as usual.
#[test]
fn traces_leave_graph_pool_blocks_out() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(11, 0);
    a.graph_pool_retain(pool);
    let dir = std::env::temp_dir().join(format!("cuarena-graph-trace-{}", std::process::id()));
    a.start_trace(&dir).unwrap();
    let g = a.graph_allocate(pool, 4096, s).unwrap();
    let e = a.allocate(4096, s).unwrap();
    a.deallocate(g, 4096, s).unwrap();
    a.deallocate(e, 4096, s).unwrap();
    let summary = a.stop_trace().unwrap();
    let records = cuarena::trace::read(&dir).unwrap();
    std::fs::remove_file(&dir).unwrap();
    assert_eq!(summary.records, 2, "{records:?}");
    assert!(records.iter().all(|r| r.ptr == e.0), "{records:?}");
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Graphs made and destroyed over and over (re-captures): each retired pool's memory waits for a
/// synchronise. Outside a capture, a pool's out of memory runs the ordinary reclaim (which
/// synchronises and takes them back) before it fails, so the device never fills with retired
/// pools; during a capture it fails at once, with no synchronise and no event on the stream.
/// (On the H200's 16 cores, `adversarial_s19`'s racing releases ran out of memory this way.)
#[test]
fn retired_pools_memory_is_taken_back_before_a_pool_runs_out_outside_a_capture() {
    let dev = host(0); // 1 GiB
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    for round in 0..80u64 {
        let pool = GraphPoolId(500 + round, 0);
        a.graph_pool_retain(pool);
        let blocks: Vec<DeviceAddr> = (0..2).map(|_| a.graph_allocate(pool, 3 << 20, s).unwrap()).collect();
        for p in blocks {
            a.deallocate(p, 3 << 20, s).unwrap();
        }
        a.graph_pool_release(pool).unwrap(); // 40 MiB parked: 3.2 GiB in all without a reclaim
    }
    assert!(a.stats().alloc_retries > 0, "the reclaim ran");
    // 600 MiB parked again, then 600 MiB asked during a capture: out of memory at once (a
    // reclaim would have synchronised and found room).
    a.trim(true).unwrap();
    let gone = GraphPoolId(900, 0);
    a.graph_pool_retain(gone);
    let p = a.graph_allocate(gone, 600 << 20, s).unwrap();
    a.deallocate(p, 600 << 20, s).unwrap();
    a.graph_pool_release(gone).unwrap();
    let pool = GraphPoolId(1, 1);
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    let e = a.graph_allocate(pool, 600 << 20, s).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { requested, .. } if requested == 600 << 20), "{e}");
    assert_eq!(a.graph_pool_bytes(), 600 << 20, "still parked: no synchronise during the capture");
    dev.end_capture(s).unwrap();
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// While a capture is underway (`graph_capture_begin` .. `graph_capture_end`, which the PyTorch
/// shim calls as routes open and close), no device synchronise is made: out of memory and
/// `trim(true)` leave a retired pool's memory parked; once the capture ends they take it back.
#[test]
fn no_device_synchronise_while_a_capture_is_underway() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().max_bytes(32 << 20).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let gone = GraphPoolId(77, 0);
    a.graph_pool_retain(gone);
    let p = a.graph_allocate(gone, 3 << 20, s).unwrap(); // a 20 MiB segment
    a.deallocate(p, 3 << 20, s).unwrap();
    a.graph_pool_release(gone).unwrap();
    assert!(a.graph_capture_end().is_err(), "none begun");
    a.graph_capture_begin();
    a.trim(true).unwrap();
    assert_eq!(a.graph_pool_bytes(), 20 << 20, "trim(true) synchronised during a capture");
    let mem_pool = GraphPoolId(78, 0);
    a.graph_pool_retain(mem_pool);
    assert!(matches!(a.graph_allocate(mem_pool, 3 << 20, s), Err(Error::OutOfMemory { .. })));
    assert!(matches!(a.allocate(16 << 20, s), Err(Error::OutOfMemory { .. })));
    assert_eq!(a.graph_pool_bytes(), 20 << 20, "an out-of-memory path synchronised during a capture");
    a.graph_capture_end().unwrap();
    let q = a.graph_allocate(mem_pool, 3 << 20, s).unwrap(); // the reclaim takes the parked 20 MiB
    a.deallocate(q, 3 << 20, s).unwrap();
    a.graph_pool_release(mem_pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Pass-through mode: one cap over the driver's blocks and graph segments, and an out of memory
/// there takes back a retired pool's parked memory before it fails.
#[test]
fn pass_through_mode_shares_its_cap_with_graph_pools_and_takes_retired_pools_back() {
    let dev = host(0);
    let a =
        host_allocator(dev.clone(), small().passthrough(true).max_bytes(32 << 20).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(79, 0);
    a.graph_pool_retain(pool);
    let g = a.graph_allocate(pool, 3 << 20, s).unwrap(); // 20 MiB
    assert!(matches!(a.allocate(16 << 20, s), Err(Error::OutOfMemory { .. })), "20 + 16 > 32 MiB");
    let small_block = a.allocate(8 << 20, s).unwrap();
    a.deallocate(g, 3 << 20, s).unwrap();
    a.graph_pool_release(pool).unwrap(); // parked
    let big = a.allocate(20 << 20, s).unwrap(); // fits once the parked 20 MiB is taken back
    assert!(dev.reserved_bytes() <= 32 << 20);
    for (p, n) in [(small_block, 8 << 20), (big, 20 << 20)] {
        a.deallocate(p, n, s).unwrap();
    }
    assert_eq!(a.graph_pool_bytes(), 0);
}
