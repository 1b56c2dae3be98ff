//! GPU integration tests: the same properties as `tests/host.rs` and `tests/torture.rs`, with
//! real streams and kernels.
//!
//! Every test here is ignored by default, so a machine without a GPU shows them as ignored,
//! never as passed. Run them with `cargo test --test gpu -- --include-ignored` (the GPU bundle's
//! `run.sh` does). When they run without a usable GPU they print "skipped: no CUDA driver" and
//! return, unless `CUARENA_REQUIRE_GPU=1` makes that a failure. The multi-GPU tests also need
//! two devices: with fewer they print "skipped: needs 2 GPUs", unless `CUARENA_REQUIRE_GPUS=2`
//! makes that a failure.

use std::sync::Arc;
use std::time::Duration;

use cuarena::{Allocator, Config, CudaDevice, Device, Error, Stream};
use cuarena_testkit::{
    GpuOps, StreamMode, StressParams, Target, TortureParams, TortureReport, assert_all_returned, gpu_or_skip,
    gpus_or_skip, stress, torture,
};

fn gpu() -> Option<Arc<CudaDevice>> {
    gpu_or_skip(0)
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_stress_keeps_tags_and_layout() {
    let Some(dev) = gpu() else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&dev)).unwrap());
    let a = Allocator::new(dev, Config::default()).unwrap();
    let p = StressParams {
        threads: 8,
        steps: 4000,
        max_size: 8 << 20,
        tag_bytes: 64 << 10,
        hold: Duration::from_micros(20),
        ..Default::default()
    };
    let r = stress(ops, &a, &p).unwrap();
    assert!(r.layout_errors.is_empty(), "{:?}", &r.layout_errors[..r.layout_errors.len().min(5)]);
    assert_eq!(r.tag_errors, 0, "a block was reused before its fence");
    let s = a.stats();
    eprintln!("gpu stress: {r:?}\n{s:?}");
    assert!(s.cross_thread_frees > 1000 && s.cross_stream_frees > 100, "{s:?}");
    // Only where parked user-stream arenas (two per thread, given up at its exit) pass 64 MiB.
    assert!(s.host_syncs <= 2 * p.threads as u64, "{s:?}");
    assert_all_returned(&a, None, 0);
}

// The test of the test on the GPU (fencing off must be caught) is the fence torture's:
// `gpu_torture_{ptds,legacy,own_streams}_unfenced_is_caught` below, in every stream mode. (A
// stress-based one here relied on user-stream blocks going to the pool, where fencing off
// reuses them at once; user streams have arenas now, and it caught nothing on the H200.)

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_stream_identity_and_reused_handles() {
    let Some(dev) = gpu() else { return };
    let k0 = dev.stream_key(Stream::PER_THREAD).unwrap();
    let legacy = dev.stream_key(Stream::LEGACY).unwrap();
    assert_eq!(legacy, dev.stream_key(Stream::NULL).unwrap());
    let d2 = Arc::clone(&dev);
    let (k1, l1) = std::thread::spawn(move || {
        (d2.stream_key(Stream::PER_THREAD).unwrap(), d2.stream_key(Stream::NULL).unwrap())
    })
    .join()
    .unwrap();
    assert_ne!(k0, k1, "0x2 is a different stream in every thread");
    assert_eq!(legacy, l1, "the legacy stream is one stream");

    let ops = GpuOps::new(Arc::clone(&dev)).unwrap();
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let mut reused = 0;
    let mut last = None;
    for round in 0..50u32 {
        let s = ops.kernels.create_stream().unwrap();
        if last == Some(s) {
            reused += 1;
        }
        let p = a.allocate(4 << 20, s).unwrap();
        ops.kernels.tag_hold_check(p.0, 1 << 20, round + 1, 200_000, s).unwrap();
        a.deallocate(p, 4 << 20, s).unwrap();
        ops.kernels.destroy_stream(s).unwrap();
        last = Some(s);
    }
    let (errors, _) = ops.kernels.take_counters().unwrap();
    eprintln!("handles reused {reused} times");
    assert_eq!(errors, 0);
    assert_all_returned(&a, None, 0);
}

/// The current context of the calling thread, as a number (0: none).
fn current_context() -> usize {
    let mut cur = std::ptr::null_mut();
    // SAFETY: `cur` is a valid out-pointer; the driver is loaded (a device was opened).
    let r = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut cur) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    cur as usize
}

/// Allocates and frees on the user stream `s` from the calling thread, as an arena's churn:
/// each block is reused by the next allocation (the same identity each time), and a kernel
/// writes and checks each block on `s`. Returns the thread's key for `s`.
fn churn_on(a: &Allocator, ops: &GpuOps, s: Stream) -> cuarena::StreamKey {
    let key = a.device().stream_key(s).unwrap();
    assert!(!a.device().stream_capturing(s).unwrap());
    let first = a.allocate(64 << 10, s).unwrap();
    a.deallocate(first, 64 << 10, s).unwrap();
    for round in 0..20u32 {
        let p = a.allocate(64 << 10, s).unwrap();
        assert_eq!(p, first, "the arena's own free on its stream is reused on it");
        ops.kernels.tag_hold_check(p.0, 64 << 10, round + 1, 1_000, s).unwrap();
        a.deallocate(p, 64 << 10, s).unwrap();
    }
    key
}

/// User-stream queries are made without the allocator's context made current first
/// (`CudaDevice::query`): from a thread with no context current they still give the stream's
/// identity (the one another thread sees), its churn stays on its arena, and nothing is lost.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_user_stream_queries_from_a_thread_with_no_context() {
    let Some(dev) = gpu() else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&dev)).unwrap());
    let a = Arc::new(Allocator::new(dev.clone(), Config::default()).unwrap());
    let s = ops.kernels.create_stream().unwrap();
    let key = dev.stream_key(s).unwrap();
    let (a2, ops2) = (Arc::clone(&a), Arc::clone(&ops));
    let (before, seen, after) = std::thread::spawn(move || {
        let before = current_context();
        let k = a2.device().stream_key(s).unwrap();
        let after = current_context();
        assert_eq!(churn_on(&a2, &ops2, s), k);
        a2.release_thread().unwrap();
        (before, k, after)
    })
    .join()
    .unwrap();
    eprintln!("context before {before:#x}, after the query {after:#x}");
    assert_eq!(before, 0, "a new thread has no context current");
    assert_eq!(seen, key, "the identity does not depend on the thread's context");
    ops.kernels.synchronize().unwrap();
    let (errors, _) = ops.kernels.take_counters().unwrap();
    assert_eq!(errors, 0);
    ops.kernels.destroy_stream(s).unwrap();
    a.release_thread().unwrap();
    assert_all_returned(&a, None, 0);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_memset_and_copy_through_buffers() {
    let Some(dev) = gpu() else { return };
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let ctx = dev.context() as usize;
    let hs: Vec<_> = (0..8u8)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                for i in 0..200usize {
                    let size = 1 + (i * 7919 + t as usize * 104_729) % (3 << 20);
                    let b = a.buffer(size, Stream::PER_THREAD).unwrap();
                    let v = t.wrapping_mul(31).wrapping_add(i as u8);
                    let mut host = vec![0u8; size];
                    // SAFETY: the buffer holds `size` bytes; the copy is synchronous after the
                    // memset on the same (per-thread) stream.
                    unsafe {
                        use cudarc::driver::sys;
                        let _ = sys::cuCtxSetCurrent(ctx as sys::CUcontext);
                        assert_eq!(
                            sys::cuMemsetD8Async(
                                b.ptr().0,
                                v,
                                size,
                                Stream::PER_THREAD.as_raw() as sys::CUstream
                            ),
                            sys::CUresult::CUDA_SUCCESS
                        );
                        assert_eq!(
                            sys::cuStreamSynchronize(0x2 as sys::CUstream),
                            sys::CUresult::CUDA_SUCCESS
                        );
                        assert_eq!(
                            sys::cuMemcpyDtoH_v2(host.as_mut_ptr() as *mut _, b.ptr().0, size),
                            sys::CUresult::CUDA_SUCCESS
                        );
                    }
                    assert!(host.iter().all(|&x| x == v), "thread {t} block {i}");
                }
            })
        })
        .collect();
    hs.into_iter().for_each(|h| h.join().unwrap());
    assert_all_returned(&a, None, 0);
}

/// cudarc's copies and kernel launches accept cuarena buffers.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_cudarc_copies_and_launches_take_cuarena_buffers() {
    let Some(dev) = gpu() else { return };
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;
    let a = Allocator::new(dev, Config::default()).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let n = 1 << 16;
    let host: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut buf = a.cuda_buffer::<u32>(n, &stream).unwrap();
    stream.memcpy_htod(&host, &mut buf).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), host, "a round trip through a cuarena buffer");
    // A kernel over a cuarena buffer: write a tag with the test kernel, then check it.
    let module = ctx.load_module(Ptx::from_src(include_str!("../testkit/src/kernels/kernels.ptx"))).unwrap();
    let f = module.load_function("tag_hold_check").unwrap();
    let errors = stream.alloc_zeros::<u64>(1).unwrap();
    let (words, tag, hold) = (n as u64, 0xC0FFEEu32, 0u64);
    let mut launch = stream.launch_builder(&f);
    launch.arg(&buf).arg(&words).arg(&tag).arg(&hold).arg(&errors);
    // SAFETY: tag_hold_check(u32*, u64, u32, u64, u64*) with a buffer of `n` words.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)).unwrap() };
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), vec![tag; n]);
    assert_eq!(stream.clone_dtoh(&errors).unwrap(), vec![0]);
    // cudarc views of the buffer, lent as a CudaSlice: a copy through a view of its second
    // half, then the buffer is still cuarena's (freed once, by cuarena).
    let half: Vec<u32> = vec![7; n / 2];
    buf.with_cuda_slice(|s| {
        let mut upper = s.slice_mut(n / 2..);
        stream.memcpy_htod(&half, &mut upper).unwrap();
        assert_eq!(stream.clone_dtoh(&s.slice(n / 2..)).unwrap(), half);
    });
    let back = stream.clone_dtoh(&buf).unwrap();
    assert_eq!(&back[..n / 2], &vec![tag; n / 2][..]);
    assert_eq!(&back[n / 2..], &half[..]);
    assert_eq!(Stream::from(&*stream), Stream::from_raw(stream.cu_stream() as usize));
    drop(buf);
    stream.synchronize().unwrap();
    assert_eq!(a.stats().live_bytes, 0);
    assert_eq!(a.stats().invalid_frees, 0, "the lent slice was not freed by cudarc");
}

// ---------------------------------------------------------------------------------------------
// The fence torture (testkit::torture) at full scale: 16 threads, 10^6 allocations per mode.

/// 16 threads × 62,500 allocations: small (arena path on the PTDS) and 3% large (pool path),
/// a tag kernel in flight on every block at every allocation and free, 20% of frees on the
/// thread's other stream and 30% handed to another thread.
fn gpu_params(mode: StreamMode) -> TortureParams {
    TortureParams {
        threads: 16,
        allocations_per_thread: 62_500,
        slots: 32,
        small_max: 1 << 20,
        large_pct: 3,
        large_max: 16 << 20,
        tag_bytes: 16 << 10,
        // On the legacy stream every thread's kernels run one after another: hold them less.
        hold: Duration::from_micros(if mode == StreamMode::Legacy { 2 } else { 10 }),
        throttle: 0,
        mode,
        seed: 5,
        ..TortureParams::default()
    }
}

/// `syncs_per_thread`: the host waits allowed per thread (see below); `None`: not bounded.
fn check_fenced(label: &str, r: &TortureReport, a: &[&Allocator], syncs_per_thread: Option<u64>) {
    eprintln!("{label}: {}", r.summary());
    for (d, a) in a.iter().enumerate() {
        eprintln!("  device {d}: {:?}", a.stats());
    }
    assert!(r.layout_errors.is_empty(), "{:?}", &r.layout_errors[..r.layout_errors.len().min(5)]);
    assert_eq!(r.tag_errors, 0, "{label}: a block was reused before its fence: {}", r.summary());
    assert!(r.handoffs > 0 && r.cross_stream_frees > 0 && r.local_frees > 0 && r.large_allocations > 0);
    for a in a {
        let s = a.stats();
        assert_eq!(s.invalid_frees, 0, "{s:?}");
        // Own-stream threads destroy their streams before they exit: their arenas are parked,
        // and a parking that passes 64 MiB synchronises once (`allocator.rs`): at most one per
        // thread.
        if let Some(n) = syncs_per_thread {
            assert!(s.host_syncs <= 16 * n, "{s:?}");
        }
        assert_all_returned(a, None, 0);
    }
}

fn gpu_torture(mode: StreamMode) {
    let Some(dev) = gpu() else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&dev)).unwrap());
    let a = Allocator::new(dev, Config::default()).unwrap();
    let p = gpu_params(mode);
    let r = torture(&[Target { ops, alloc: a.clone() }], &p).unwrap();
    assert_eq!(r.allocations, 1_000_000);
    check_fenced(&format!("gpu torture {}", mode.name()), &r, &[&a], Some(1));
}

/// The test of the test: fencing off, remote frees sent one by one, small blocks reused at
/// once, long holds, most frees cross-stream or handed off. Reuse before the fence must show as overwritten tags.
///
/// On the legacy stream a handoff stays on one stream, so only cross-stream frees can be
/// caught: there the legacy kernels are short (so the legacy stream has little queued) and the
/// kernels on the other stream long, so a block reused on the legacy stream is overwritten
/// while the other stream still holds it.
fn gpu_torture_unfenced(mode: StreamMode) {
    let Some(dev) = gpu() else { return };
    // Whether an unfenced reuse overlaps a kernel still running is timing: on the H200 one
    // run in about five saw none on own streams. Up to three runs, each a fresh allocator;
    // the test fails if none sees an overwritten tag.
    for run in 1..=3 {
        let tag_errors = gpu_torture_unfenced_once(&dev, mode);
        if tag_errors > 0 {
            return;
        }
        eprintln!("gpu torture {} unfenced: run {run} saw no overwritten tag", mode.name());
    }
    panic!("unfenced reuse went unnoticed on the GPU in 3 runs ({} mode)", mode.name());
}

/// One unfenced torture run; returns the overwritten tags it saw.
fn gpu_torture_unfenced_once(dev: &Arc<CudaDevice>, mode: StreamMode) -> u64 {
    let ops = Arc::new(GpuOps::new(Arc::clone(dev)).unwrap());
    // Remote frees sent one at a time (not gathered into batches), so a freed block reaches its
    // owner, and is reused, while the freeing side's work may still run.
    let cfg = Config::builder().skip_fences_for_testing().batch_blocks(1).build().unwrap();
    let a = Allocator::new(Arc::clone(dev) as Arc<dyn Device>, cfg).unwrap();
    let legacy = mode == StreamMode::Legacy;
    let p = TortureParams {
        allocations_per_thread: 2000,
        // Many streams: two slots per stream, so every stream is used.
        slots: if mode == StreamMode::Many { 2 * cuarena_testkit::MANY_STREAMS } else { 4 },
        small_max: 64 << 10,
        large_pct: 0,
        handoff_pct: if legacy { 10 } else { 45 },
        cross_stream_pct: if legacy { 80 } else { 45 },
        tag_bytes: 16 << 10,
        hold: Duration::from_micros(if legacy { 2 } else { 300 }),
        cross_hold: Some(Duration::from_micros(if legacy { 1000 } else { 300 })),
        ..gpu_params(mode)
    };
    let r = torture(&[Target { ops, alloc: a }], &p).unwrap();
    eprintln!("gpu torture {} unfenced: {}", mode.name(), r.summary());
    r.tag_errors
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_ptds() {
    gpu_torture(StreamMode::Ptds);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_legacy() {
    gpu_torture(StreamMode::Legacy);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_own_streams() {
    gpu_torture(StreamMode::Own);
}

/// Each thread on 20 user streams (more than it keeps arenas and batches for): lean arenas,
/// replacement, parking, adoption and frees sent alone, with real kernels on every block.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_many_streams() {
    let Some(dev) = gpu() else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&dev)).unwrap());
    let a = Allocator::new(dev, Config::default()).unwrap();
    let p = TortureParams {
        allocations_per_thread: 20_000,
        slots: 2 * cuarena_testkit::MANY_STREAMS,
        ..gpu_params(StreamMode::Many)
    };
    let r = torture(&[Target { ops, alloc: a.clone() }], &p).unwrap();
    assert_eq!(r.allocations, 320_000);
    // Every stream holds live blocks, so a full table makes room by parking an arena with its
    // memory, but only within the parked bound; past it the pool serves the stream, and no
    // replacement synchronises (`Slot::new_user_arena`, "Making room"; before, 1,306
    // synchronises in 320,000 allocations on the H200, 2026-12-04). A thread's exit may still
    // park past the bound: at most one synchronise per thread.
    check_fenced("gpu torture many", &r, &[&a], Some(1));
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_many_streams_unfenced_is_caught() {
    gpu_torture_unfenced(StreamMode::Many);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_ptds_unfenced_is_caught() {
    gpu_torture_unfenced(StreamMode::Ptds);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_legacy_unfenced_is_caught() {
    gpu_torture_unfenced(StreamMode::Legacy);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_torture_own_streams_unfenced_is_caught() {
    gpu_torture_unfenced(StreamMode::Own);
}

// ---------------------------------------------------------------------------------------------
// Two GPUs.

/// A block of device 0 given to device 1's allocator is refused, on the arena path and the pool
/// path, and nothing is lost: it stays live on device 0 and frees there later; the statistics
/// of both allocators add up.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn multi_gpu_a_free_on_the_wrong_device_is_refused() {
    let Some(_devs) = gpus_or_skip(2) else { return };
    let a0 = Allocator::cuda(0, Config::default()).unwrap();
    let a1 = Allocator::cuda(1, Config::default()).unwrap();
    let warm = a1.allocate_per_thread(4096).unwrap(); // a1 has an arena and a pool of its own
    let big = a1.allocate(8 << 20, Stream::LEGACY).unwrap();
    let small = a0.allocate_per_thread(4096).unwrap();
    let large = a0.allocate(64 << 20, Stream::LEGACY).unwrap();
    let (live0, live1) = (a0.stats().live_bytes, a1.stats().live_bytes);
    for (p, s, st) in [(small, 4096, Stream::PER_THREAD), (large, 64 << 20, Stream::LEGACY)] {
        match a1.deallocate(p, s, st) {
            Err(Error::InvalidFree { reason, .. }) => eprintln!("refused as {reason:?}"),
            other => panic!("a free of device 0's block {p:?} on device 1: {other:?}"),
        }
    }
    let (s0, s1) = (a0.stats(), a1.stats());
    assert_eq!(
        (s0.live_bytes, s0.allocations, s0.deallocations, s0.invalid_frees),
        (live0, 2, 0, 0),
        "{s0:?}"
    );
    assert_eq!(
        (s1.live_bytes, s1.allocations, s1.deallocations, s1.invalid_frees),
        (live1, 2, 0, 2),
        "{s1:?}"
    );
    a0.deallocate_per_thread(small, 4096).unwrap();
    a0.deallocate(large, 64 << 20, Stream::LEGACY).unwrap();
    a1.deallocate_per_thread(warm, 4096).unwrap();
    a1.deallocate(big, 8 << 20, Stream::LEGACY).unwrap();
    for a in [&a0, &a1] {
        let s = a.stats();
        assert_eq!((s.allocations, s.deallocations), (2, 2), "{s:?}");
        a.release_thread().unwrap();
        assert_all_returned(a, None, 0);
    }
}

/// A thread with device 1's context current uses device 0's allocator on a device-0 user
/// stream: the queries of the stream (made without device 0's context made current,
/// `CudaDevice::query`) give its identity, the churn stays on its arena, and the thread's
/// context is still device 1's afterwards.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn multi_gpu_user_stream_queries_with_another_devices_context_current() {
    let Some(devs) = gpus_or_skip(2) else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&devs[0])).unwrap());
    let a = Arc::new(Allocator::new(devs[0].clone(), Config::default()).unwrap());
    let s = ops.kernels.create_stream().unwrap();
    let key = devs[0].stream_key(s).unwrap();
    let (a2, ops2, d1) = (Arc::clone(&a), Arc::clone(&ops), Arc::clone(&devs[1]));
    std::thread::spawn(move || {
        drop(d1.enter().unwrap()); // a thread with none current keeps device 1's for good
        let mine = current_context();
        assert_eq!(mine, d1.context() as usize);
        assert_eq!(churn_on(&a2, &ops2, s), key);
        assert_eq!(current_context(), mine, "the thread's context is left as it was");
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    let (errors, _) = ops.kernels.take_counters().unwrap();
    assert_eq!(errors, 0);
    ops.kernels.destroy_stream(s).unwrap();
    a.release_thread().unwrap();
    assert_all_returned(&a, None, 0);
}

/// The fence torture on both GPUs at once, in every stream mode: 16 threads, each alternating
/// between the devices, with the checks per device (about 3.2·10^5 allocations per mode).
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn multi_gpu_torture_on_both_devices_at_once() {
    let Some(devs) = gpus_or_skip(2) else { return };
    for mode in StreamMode::ALL {
        let targets: Vec<Target> = devs
            .iter()
            .enumerate()
            .map(|(o, d)| Target {
                ops: Arc::new(GpuOps::new(Arc::clone(d)).unwrap()),
                alloc: Allocator::cuda(o as i32, Config::default()).unwrap(),
            })
            .collect();
        let p = TortureParams { allocations_per_thread: 20_000, ..gpu_params(mode) };
        let r = torture(&targets, &p).unwrap();
        assert_eq!(r.allocations, 320_000);
        let allocs: Vec<&Allocator> = targets.iter().map(|t| &t.alloc).collect();
        for a in &allocs {
            assert_eq!(a.stats().allocations, 160_000, "each device got half");
        }
        check_fenced(&format!("multi-gpu torture {}", mode.name()), &r, &allocs, Some(1));
        assert_eq!(r.tag_errors_per_device, vec![0, 0]);
    }
}

/// A buffer on a user stream, used by this thread's per-thread stream and declared there
/// (`record_stream(PER_THREAD)`), dropped by another thread: its free is fenced through the
/// legacy stream (`StreamUse::fence_stream`), whose event follows this thread's
/// per-thread-stream work on the GPU too. A 200 ms kernel on this thread's per-thread stream
/// writes tag 7 and checks it stays; the other thread drops the buffer (batches of one: the
/// fence goes out at once); this thread gets the block back on the user stream and writes tag 9
/// there. Written before the first kernel ends, tag 9 would show as changed words.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_a_per_thread_stream_declared_by_one_thread_is_fenced_when_another_drops_the_buffer() {
    let Some(dev) = gpu() else { return };
    let k = cuarena_testkit::cuda_kernels::CudaKernels::load(Arc::clone(&dev)).unwrap();
    let a = Allocator::new(dev, Config::parse("superblock=64KiB,small_max=32KiB,batch=1").unwrap()).unwrap();
    let x = k.create_stream().unwrap();
    let size = 32 << 10;
    let mut buf = a.buffer(size, x).unwrap();
    let p = buf.ptr();
    k.tag_hold_check(p.0, size, 7, 200_000_000, Stream::PER_THREAD).unwrap();
    buf.record_stream(Stream::PER_THREAD);
    std::thread::spawn(move || drop(buf)).join().unwrap();
    assert!(a.take_deferred_error().is_none());
    let (got, reused) = cuarena_testkit::allocate_until_back(&a, size, x, p, 8);
    assert!(reused, "the block never came back, so this test checks nothing: {got:?}");
    k.tag_hold_check(p.0, size, 9, 0, x).unwrap();
    let (errors, _) = k.take_counters().unwrap();
    assert_eq!(errors, 0, "the block was written under the declaring thread's kernel");
    for q in got {
        a.deallocate(q, size, x).unwrap();
    }
    a.trim(true).unwrap();
    k.destroy_stream(x).unwrap();
}
