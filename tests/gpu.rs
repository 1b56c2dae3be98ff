//! GPU integration tests: the same properties as `tests/host.rs`, with real streams and kernels.
//!
//! Without a CUDA driver each test prints "skipped: no CUDA driver" and passes; with
//! `CUARENA_REQUIRE_GPU=1` that is a failure instead.

use std::sync::Arc;
use std::time::Duration;

use cuarena::testkit::{GpuOps, StressParams, stress};
use cuarena::{Allocator, Config, CudaDevice, Device, Stream};

fn gpu() -> Option<Arc<CudaDevice>> {
    let required = std::env::var("CUARENA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match CudaDevice::new(0) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) if required => panic!("CUARENA_REQUIRE_GPU=1 but no GPU is usable: {e}"),
        Err(e) => {
            eprintln!("skipped: no CUDA driver ({e})");
            None
        }
    }
}

fn assert_all_returned(a: &Allocator) {
    a.check_invariants();
    let s = a.stats();
    assert_eq!((s.live_bytes, s.arena_held_bytes, s.arenas), (0, 0, 0), "{s:?}");
    assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
    a.trim(true).unwrap();
    assert_eq!(a.stats().reserved_bytes, 0);
}

#[test]
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
    assert_eq!(s.host_syncs, 0);
    assert_all_returned(&a);
}

/// The test of the test on the GPU: with fencing off, reuse before the fence must show up as
/// overwritten tags.
#[test]
fn gpu_unfenced_reuse_is_caught() {
    let Some(dev) = gpu() else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&dev)).unwrap());
    let cfg = Config::builder().skip_fences_for_testing().build().unwrap();
    let a = Allocator::new(dev, cfg).unwrap();
    let p = StressParams {
        threads: 8,
        steps: 2000,
        slots: 8,
        max_size: 64 << 10,
        handoff_pct: 90,
        hold: Duration::from_micros(300),
        ..Default::default()
    };
    let r = stress(ops, &a, &p).unwrap();
    eprintln!("unfenced: {} overwritten words", r.tag_errors);
    assert!(r.tag_errors > 0, "unfenced reuse went unnoticed on the GPU");
}

#[test]
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
    assert_all_returned(&a);
}

#[test]
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
    assert_all_returned(&a);
}

/// cudarc's copies and kernel launches accept cuarena buffers.
#[test]
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
    let module = ctx.load_module(Ptx::from_src(include_str!("../src/device/kernels/kernels.ptx"))).unwrap();
    let f = module.load_function("tag_hold_check").unwrap();
    let errors = stream.alloc_zeros::<u64>(1).unwrap();
    let (words, tag, hold) = (n as u64, 0xC0FFEEu32, 0u64);
    let mut launch = stream.launch_builder(&f);
    launch.arg(&buf).arg(&words).arg(&tag).arg(&hold).arg(&errors);
    // SAFETY: tag_hold_check(u32*, u64, u32, u64, u64*) with a buffer of `n` words.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)).unwrap() };
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), vec![tag; n]);
    assert_eq!(stream.clone_dtoh(&errors).unwrap(), vec![0]);
    drop(buf);
    stream.synchronize().unwrap();
    assert_eq!(a.stats().live_bytes, 0);
}
