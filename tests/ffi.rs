//! The C ABI, called as C would. Without a driver every call fails cleanly (NULL / -1 / no-op
//! and a message); with one (the `#[ignore]`d tests; CUARENA_REQUIRE_GPU=1 makes the GPU
//! required) the calls work end to end and every bad input is refused without a trace in the
//! statistics.

use std::ffi::{CStr, c_void};
use std::sync::Mutex;

use cuarena_c::*;

/// The C ABI (`capi/`, built as libcuarena.so), compiled into this test to be called as Rust.
#[path = "../capi/src/lib.rs"]
mod cuarena_c;

/// The process-wide allocators and the record_stream table are shared by every test here.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// This thread's last error, read through the C entry point (and checked against the Rust
/// helper the other tests use).
fn err() -> String {
    let p = cuarena_last_error();
    // SAFETY: a non-null result is a NUL-terminated string valid until the next failing call.
    let c = (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    assert_eq!(c, last_error_message(), "cuarena_last_error and last_error_message disagree");
    c.unwrap_or_else(|| "<no error set>".into())
}

fn gpu_present() -> bool {
    let present = cuarena::CudaDevice::new(0).is_ok();
    if !present && std::env::var("CUARENA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("CUARENA_REQUIRE_GPU=1 but no GPU is usable");
    }
    present
}

/// For a GPU test: the serial lock, or `None` (the test is skipped, and says so) without a
/// usable GPU; `CUARENA_REQUIRE_GPU=1` makes that a failure (`gpu_present`).
fn serial_on_a_gpu() -> Option<std::sync::MutexGuard<'static, ()>> {
    let g = serial();
    if gpu_present() {
        return Some(g);
    }
    eprintln!("skipped: no CUDA driver");
    None
}

fn stats(device: i32) -> cuarena::Stats {
    let mut s = cuarena_stats::default();
    // SAFETY: `s` is a valid cuarena_stats whose `size` is its own.
    assert_eq!(unsafe { cuarena_get_stats(device, &mut s) }, 0, "{}", err());
    assert_eq!(s.size, size_of::<cuarena_stats>() as u64, "the whole struct is filled");
    s.stats
}

const NULL: *mut c_void = std::ptr::null_mut();

fn ptr(addr: usize) -> *mut c_void {
    addr as *mut c_void
}

#[test]
fn without_a_driver_every_call_fails_cleanly() {
    let _g = serial();
    if gpu_present() {
        return;
    }
    // Calls after a failed init keep failing the same clean way: the failure is not cached
    // into something worse, and nothing panics.
    for _ in 0..3 {
        assert!(cuarena_malloc(4096, 0, NULL).is_null());
        assert!(err().contains("no CUDA driver"), "{}", err());
        let mut s = cuarena_stats::default();
        // SAFETY: `s` is a valid cuarena_stats.
        assert_eq!(unsafe { cuarena_get_stats(0, &mut s) }, -1);
        assert!(err().contains("no CUDA driver"), "{}", err());
    }
    cuarena_free(ptr(0x1000), 4096, 0, NULL);
    assert!(err().contains("no CUDA driver"), "{}", err());
    assert_eq!(cuarena_free_checked(ptr(0x1000), 4096, 0, NULL), -1);
    assert!(err().contains("no CUDA driver"), "{}", err());
    assert_eq!(cuarena_free_checked(NULL, 0, 0, NULL), 0, "(NULL, 0) is a no-op");
    cuarena_set_memory_fraction(0.5, 0);
    assert!(err().contains("no CUDA driver"), "{}", err());
    cuarena_empty_cache(); // no allocator exists: nothing to do
    // SAFETY: NULL is allowed and refused.
    assert_eq!(unsafe { cuarena_get_stats(0, std::ptr::null_mut()) }, -1);
    assert!(err().contains("out is NULL"), "{}", err());
}

/// A `size` below the first struct's is refused with its own code before anything else (even
/// without a driver), and nothing is written.
#[test]
fn get_stats_refuses_a_too_small_size_and_writes_nothing() {
    let _g = serial();
    for size in [0u64, 1, 8, 192, CUARENA_STATS_SIZE_V1 as u64 - 1] {
        let mut buf = [0x5a5a_5a5a_5a5a_5a5au64; 32];
        buf[0] = size;
        let before = buf;
        // SAFETY: `buf` is 256 writable, aligned bytes, more than any size tried here.
        let r = unsafe { cuarena_get_stats(0, buf.as_mut_ptr().cast()) };
        assert_eq!(r, CUARENA_ERR_STATS_SIZE, "size {size}");
        assert_eq!(buf, before, "size {size}: something was written");
        let e = err();
        assert!(e.contains(&format!("out->size is {size}")) && e.contains("sizeof(cuarena_stats)"), "{e}");
    }
    assert_eq!(cuarena_stats::default().size, size_of::<cuarena_stats>() as u64);
    assert!(size_of::<cuarena_stats>() >= CUARENA_STATS_SIZE_V1);
}

/// `cuarena_peek_stats` never creates an allocator: for a device cuarena has not used it gives
/// 1 and zeros (here no driver: no device is ever created); bad arguments as `get_stats`. On a
/// GPU, a device in use gives 0 and the same figures as `cuarena_get_stats`, and an unused
/// ordinal still makes no allocator.
#[test]
fn peek_stats_never_creates_an_allocator() {
    let _g = serial();
    let before: Vec<i32> = cuarena::global::created().map(|(d, _)| d).collect();
    for device in [0, 1, 7, 63, 64, -1, i32::MIN, i32::MAX] {
        if before.contains(&device) {
            continue;
        }
        let mut s = cuarena_stats::default();
        s.stats.live_bytes = 77;
        // SAFETY: `s` is a valid cuarena_stats whose `size` is its own.
        assert_eq!(unsafe { cuarena_peek_stats(device, &mut s) }, 1, "device {device}");
        assert_eq!(s, cuarena_stats::default(), "device {device}: not all zero");
    }
    let after: Vec<i32> = cuarena::global::created().map(|(d, _)| d).collect();
    assert_eq!(after, before, "peek created an allocator");
    // SAFETY: NULL is refused before anything is read.
    assert_eq!(unsafe { cuarena_peek_stats(0, std::ptr::null_mut()) }, -1);
    assert!(err().contains("out is NULL"), "{}", err());
    let mut small = [0x5a5a_5a5a_5a5a_5a5au64; 32];
    small[0] = 8;
    let copy = small;
    // SAFETY: 256 writable bytes, more than the size given.
    assert_eq!(unsafe { cuarena_peek_stats(0, small.as_mut_ptr().cast()) }, CUARENA_ERR_STATS_SIZE);
    assert_eq!(small, copy, "written on a refusal");
    if gpu_present() {
        let p = cuarena_malloc(4096, 0, NULL);
        assert!(!p.is_null(), "{}", err());
        let mut s = cuarena_stats::default();
        // SAFETY: as above.
        assert_eq!(unsafe { cuarena_peek_stats(0, &mut s) }, 0, "{}", err());
        assert_eq!(s.stats.live_bytes, stats(0).live_bytes);
        assert!(s.stats.live_bytes >= 4096);
        cuarena_free(p, 4096, 0, NULL);
    }
}

#[test]
fn the_version_functions_give_cargos_version() {
    let s = cuarena_version_string();
    // SAFETY: a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(s) }.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    let part = |v: &str| v.parse::<i32>().unwrap();
    let want = part(env!("CARGO_PKG_VERSION_MAJOR")) * 1_000_000
        + part(env!("CARGO_PKG_VERSION_MINOR")) * 1000
        + part(env!("CARGO_PKG_VERSION_PATCH"));
    assert_eq!(cuarena_version(), want);
}

#[test]
fn without_a_driver_bad_devices_name_the_real_reason() {
    let _g = serial();
    if gpu_present() {
        return;
    }
    for dev in [1, -1, 63, 64, 1000, i32::MIN, i32::MAX] {
        assert!(cuarena_malloc(16, dev, NULL).is_null());
        let e = err();
        assert!(e.contains("no CUDA driver"), "device {dev}: {e}");
        assert!(!e.contains("device(s)"), "device {dev}: a count is claimed with no driver: {e}");
    }
}

#[test]
fn free_of_null_with_size_zero_is_silent_even_without_a_driver() {
    let _g = serial();
    // On a fresh thread no error is set; both calls must leave it so, on any device.
    std::thread::spawn(|| {
        for dev in [0, 1, -1, 1000] {
            cuarena_free(NULL, 0, dev, NULL);
            cuarena_free(NULL, 0, dev, ptr(0x2));
            assert!(cuarena_malloc(0, dev, NULL).is_null());
        }
        assert_eq!(last_error_message(), None);
    })
    .join()
    .unwrap();
    // And it does not overwrite an earlier error.
    cuarena_record_stream(ptr(0x1000), ptr(0x2));
    let before = err();
    cuarena_free(NULL, 0, 0, NULL);
    assert_eq!(err(), before);
}

#[test]
fn record_stream_refuses_foreign_pointers_and_keeps_nothing() {
    let _g = serial();
    let _ = gpu_present();
    let before = recorded_blocks();
    // The case: garbage declarations used to grow the table without bound.
    for i in 0..200_000usize {
        cuarena_record_stream(ptr(0x1000 + i * 256), ptr(0x2 + (i & 1)));
    }
    cuarena_record_stream(ptr(usize::MAX), ptr(0x2));
    let e = err();
    assert!(e.contains("not inside memory reserved by cuarena"), "{e}");
    assert_eq!(recorded_blocks(), before, "refused declarations must leave nothing behind");
    cuarena_record_stream(NULL, ptr(0x2)); // NULL (an empty tensor): a no-op
    assert_eq!(recorded_blocks(), before);
    // The checked form tells a foreign pointer (1: nothing of cuarena's to fence) from a
    // declaration kept (0) or lost (-1, `on_a_gpu_a_record_stream_past_the_caps_is_answered_minus_one`).
    cuarena_record_stream(NULL, ptr(0x2)); // clears nothing: the error below must be the checked call's
    assert_eq!(cuarena_record_stream_checked(ptr(0x7000), ptr(0x2)), 1);
    assert!(err().contains("0x7000 is not inside memory reserved by cuarena"), "{}", err());
    assert_eq!(cuarena_record_stream_checked(NULL, ptr(0x2)), 0);
    assert_eq!(recorded_blocks(), before);
}

/// `record_with` says why it kept nothing: a pointer outside the reserved memory is
/// `Foreign` (PyTorch's shim skips it, as PyTorch's own allocator does), a declaration past
/// the table's caps is `Refused` (the shim raises); neither leaves anything in the table.
#[test]
fn record_with_tells_foreign_pointers_from_refusals_at_the_caps() {
    use cuarena::{Config, Stream};
    use cuarena_testkit::{HostConfig, HostDevice, host_allocator};

    let sim = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let a = host_allocator(sim.clone(), Config::default()).unwrap();
    let rec = Recorded::new(2);
    let user = sim.create_stream();
    let blocks: Vec<u64> = (0..3).map(|_| a.allocate(4096, user).unwrap().0).collect();
    let one = std::iter::once(&a);
    assert!(matches!(record_with(one.clone(), &rec, 0x1000, user), Err(NotKept::Foreign(_))));
    assert!(matches!(record_with(std::iter::empty(), &rec, blocks[0], user), Err(NotKept::Foreign(_))));
    record_with(one.clone(), &rec, blocks[0], user).unwrap();
    record_with(one.clone(), &rec, blocks[1], Stream::LEGACY).unwrap();
    match record_with(one.clone(), &rec, blocks[2], user) {
        Err(NotKept::Refused(why)) => assert!(why.contains("the limit"), "{why}"),
        other => panic!("a third block past a cap of 2: {other:?}"),
    }
    assert_eq!(rec.live(), 2, "the refused declaration was kept");
    // A block's stream cap: MAX_RECORDED_STREAMS distinct handles, then refused.
    for h in 0..MAX_RECORDED_STREAMS - 1 {
        record_with(one.clone(), &rec, blocks[0], Stream::from_raw(0x7700_0000 + h)).unwrap();
    }
    assert!(matches!(
        record_with(one.clone(), &rec, blocks[0], Stream::from_raw(0x9999_9999)),
        Err(NotKept::Refused(_))
    ));
    // A stream already declared is not a new one.
    record_with(one.clone(), &rec, blocks[0], user).unwrap();
    // A pointer into a block off a 256-byte boundary (a DLPack view, say): no block can start
    // there, so no free would read it; it is not kept, as PyTorch's own allocator skips it.
    let entries = rec.entries();
    assert!(matches!(record_with(one, &rec, blocks[1] + 4, user), Err(NotKept::Foreign(_))));
    assert_eq!(rec.entries(), entries);

    // Pass-through mode: blocks come from the driver, outside any chunk, and are cuarena's
    // all the same; a declaration on one is kept and its free waits for the stream.
    let pt = host_allocator(sim.clone(), Config::parse("passthrough").unwrap()).unwrap();
    let rec = Recorded::new(16);
    let p = pt.allocate(4096, user).unwrap().0;
    record_with(std::iter::once(&pt), &rec, p, Stream::LEGACY).unwrap();
    assert_eq!(rec.live(), 1);
    free_with(&pt, &rec, p, 4096, user).unwrap();
    assert_eq!(rec.live(), 0, "the free read the declaration and marked it freed");
    assert!(
        matches!(record_with(std::iter::once(&pt), &rec, p, user), Err(NotKept::Foreign(_))),
        "freed: the driver's again"
    );
}

/// Re-runs this test binary with `CUARENA_CONF` invalid, so the process-wide allocator's
/// creation fails for a reason other than the driver, and checks every call in the child.
#[test]
fn calls_after_a_failed_init_fail_cleanly_and_repeatably() {
    if std::env::var_os("CUARENA_FFI_CHILD").is_some() {
        return after_a_failed_init_child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "calls_after_a_failed_init_fail_cleanly_and_repeatably", "--nocapture"])
        .env("CUARENA_FFI_CHILD", "1")
        .env("CUARENA_CONF", "max=banana")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(text.contains("child: all calls refused cleanly"), "{text}");
}

fn after_a_failed_init_child() {
    for _ in 0..3 {
        assert!(cuarena_malloc(4096, 0, NULL).is_null());
        assert!(err().contains("invalid cuarena configuration"), "{}", err());
        let mut s = cuarena_stats::default();
        // SAFETY: `s` is a valid cuarena_stats.
        assert_eq!(unsafe { cuarena_get_stats(0, &mut s) }, -1);
        cuarena_free(ptr(0x1000), 4096, 0, NULL);
        assert!(err().contains("invalid cuarena configuration"), "{}", err());
        cuarena_set_memory_fraction(0.5, 0);
        cuarena_record_stream(ptr(0x1000), ptr(0x2));
        assert!(err().contains("not inside memory reserved"), "{}", err());
        cuarena_empty_cache();
        cuarena_free(NULL, 0, 0, NULL);
        assert!(cuarena_malloc(0, 0, NULL).is_null());
    }
    assert_eq!(recorded_blocks(), 0);
    println!("child: all calls refused cleanly");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn on_a_gpu_the_abi_allocates_fences_and_refuses_bad_frees() {
    let Some(_g) = serial_on_a_gpu() else { return };
    let start = stats(0);
    let streams = [NULL, ptr(0x1), ptr(0x2)];
    let mut blocks = Vec::new();
    for (i, &s) in streams.iter().cycle().take(300).enumerate() {
        let size = 1 + (i * 7919) % (3 << 20);
        let p = cuarena_malloc(size, 0, s);
        assert!(!p.is_null(), "{}", err());
        assert_eq!(p as usize % 256, 0);
        blocks.push((p, size, s));
    }
    let (p0, s0, st0) = blocks[0];
    cuarena_record_stream(p0, ptr(0x2));
    for (i, &(p, size, s)) in blocks.iter().enumerate() {
        if i % 2 == 0 {
            cuarena_free(p, size, 0, s);
        } else {
            assert_eq!(cuarena_free_checked(p, size, 0, s), 0, "{}", err());
        }
    }
    let before = stats(0).invalid_frees;
    cuarena_free(p0, s0, 0, st0); // double free (or, if reused, a size mismatch): refused
    cuarena_free(ptr(0x1234_0000), 100, 0, NULL);
    assert!(err().contains("invalid free"), "{}", err());
    assert_eq!(cuarena_free_checked(ptr(0x1234_0000), 100, 0, NULL), -1);
    assert!(err().contains("invalid free"), "{}", err());
    assert!(stats(0).invalid_frees > before);
    cuarena_set_memory_fraction(0.5, 0);
    cuarena_set_memory_fraction(1.0, 0);
    cuarena_empty_cache();
    assert_eq!(stats(0).live_bytes, start.live_bytes);
}

/// A declaration past the caps is lost, and `cuarena_record_stream_checked` says so with -1
/// (the PyTorch shim raises on it), where a kept one gives 0 and a foreign pointer 1. One block
/// is declared on the legacy stream and on 1,023 more real streams; the next stream is refused.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn on_a_gpu_a_record_stream_past_the_caps_is_answered_minus_one() {
    let Some(_g) = serial_on_a_gpu() else { return };
    let size = 4096;
    let p = cuarena_malloc(size, 0, NULL);
    assert!(!p.is_null(), "{}", err());
    assert_eq!(cuarena_record_stream_checked(ptr(0x10), NULL), 1);
    assert_eq!(cuarena_record_stream_checked(p, NULL), 0, "{}", err());
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let streams: Vec<_> = (0..MAX_RECORDED_STREAMS).map(|_| ctx.new_stream().unwrap()).collect();
    let (kept, last) = streams.split_at(MAX_RECORDED_STREAMS - 1);
    for s in kept {
        assert_eq!(cuarena_record_stream_checked(p, s.cu_stream().cast()), 0, "{}", err());
    }
    assert_eq!(cuarena_record_stream_checked(p, last[0].cu_stream().cast()), -1);
    assert!(err().contains("the limit"), "{}", err());
    // The block's free is fenced after all 1,024 declared streams, and is accepted.
    assert_eq!(cuarena_free_checked(p, size, 0, NULL), 0, "{}", err());
    drop(streams); // destroyed after the free, which recorded its fences on them
}

/// The bad-input table through the C ABI on the process-wide allocator: each bad call gives
/// NULL or a no-op plus a clear error, never a panic, and the statistics add up afterwards.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn on_a_gpu_every_bad_input_is_refused_and_the_stats_add_up() {
    let Some(_g) = serial_on_a_gpu() else { return };
    let count = cuarena::device::cuda::device_count().unwrap();
    let legacy = ptr(0x1);
    let start = stats(0);
    let recorded0 = recorded_blocks();
    let mut refused = 0u64; // refusals that reach the allocator (counted in invalid_frees)

    // Sizes.
    assert!(cuarena_malloc(0, 0, legacy).is_null());
    for size in [usize::MAX, usize::MAX - 255, usize::MAX / 2, 1 << 62] {
        assert!(cuarena_malloc(size, 0, legacy).is_null(), "size {size}");
        assert!(err().contains("out of device memory"), "size {size}: {}", err());
    }

    let size = 3 << 20; // a large block: its size is checked to the 256-byte granule
    let p = cuarena_malloc(size, 0, legacy);
    assert!(!p.is_null(), "{}", err());
    let live = stats(0).live_bytes;
    assert!(live > start.live_bytes);

    // Pointers the allocator never handed out.
    for (q, n) in
        [(NULL, 100), (ptr(0x1234_0000), 100), (ptr(usize::MAX), 4096), (ptr(p as usize + 256), size)]
    {
        cuarena_free(q, n, 0, legacy);
        assert!(err().contains("invalid free"), "{q:?}: {}", err());
        refused += 1;
    }
    // Wrong size.
    cuarena_free(p, 3 * size, 0, legacy);
    assert!(err().contains("does not match"), "{}", err());
    refused += 1;
    // Wrong devices. One that exists refuses the pointer (counted on that device); one that
    // does not is refused before reaching any allocator, naming the driver's real count.
    for dev in [1, -1, 1000] {
        cuarena_free(p, size, dev, legacy);
        let e = err();
        if dev >= 0 && dev < count {
            assert!(e.contains("invalid free"), "device {dev}: {e}");
        } else {
            assert!(e.contains(&format!("the driver reports {count} device(s)")), "device {dev}: {e}");
            assert!(cuarena_malloc(16, dev, legacy).is_null());
            assert!(err().contains(&format!("no CUDA device {dev}")), "device {dev}: {}", err());
        }
    }
    assert_eq!(stats(0).live_bytes, live, "refused frees changed nothing");

    // A refused free keeps the record_stream declaration for the corrected retry.
    cuarena_record_stream(p, ptr(0x2));
    assert_eq!(recorded_blocks(), recorded0 + 1);
    cuarena_free(p, size + 4096, 0, legacy);
    assert!(err().contains("does not match"), "{}", err());
    refused += 1;
    assert_eq!(recorded_blocks(), recorded0 + 1, "a refused free must not drop the declaration");
    cuarena_free(p, size, 0, legacy);
    assert_eq!(recorded_blocks(), recorded0, "a successful free clears the declaration");

    // Double free.
    cuarena_free(p, size, 0, legacy);
    assert!(err().contains("invalid free"), "{}", err());
    refused += 1;

    // A pointer outside reserved memory is refused by record_stream.
    cuarena_record_stream(ptr(0x10), ptr(0x2));
    assert!(err().contains("not inside memory reserved"), "{}", err());

    let end = stats(0);
    assert_eq!(end.live_bytes, start.live_bytes, "{end:?}");
    assert!(end.invalid_frees >= start.invalid_frees + refused, "{refused} refused: {start:?} -> {end:?}");
    assert_eq!(end.allocations - start.allocations, end.deallocations - start.deallocations);
}

/// The same bad-input table on a simulated device, so it runs everywhere: the allocator behind
/// the C ABI refuses each input with an error (never a panic) and its statistics add up.
#[test]
fn the_allocator_behind_the_abi_refuses_every_bad_input_on_a_simulated_device() {
    use cuarena::{Config, DeviceAddr, Error, Stream};
    use cuarena_testkit::{HostConfig, HostDevice, host_allocator};
    use std::panic::{AssertUnwindSafe, catch_unwind};

    let dev = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let a = host_allocator(dev.clone(), Config::default()).unwrap();
    let user = dev.create_stream();
    let no_panic = |what: &str, f: &mut dyn FnMut() -> Result<(), Error>| -> Result<(), Error> {
        catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| panic!("{what}: panicked"))
    };
    let refused = |what: &str, r: Result<(), Error>| match r {
        Err(Error::InvalidFree { .. }) => {}
        other => panic!("{what}: expected an invalid-free error, got {other:?}"),
    };
    for stream in [Stream::LEGACY, Stream::PER_THREAD, user] {
        for size in [1usize, 4096, 1 << 20, 3 << 20] {
            let start = a.stats();
            let p = a.allocate(size, stream).unwrap();
            assert!(!p.is_null());
            let live = a.stats().live_bytes;
            let mut n = 0;
            for (q, s, what) in [
                (DeviceAddr::NULL, size, "null"),
                (DeviceAddr(0x1234_0000), size, "foreign"),
                (DeviceAddr(p.0 + 256), size, "interior"),
                (DeviceAddr(u64::MAX - 255), 4096, "u64::MAX - 255"),
                (DeviceAddr(!0xffff), size, "near u64::MAX"),
                (p, size + (4 << 20), "wrong size"),
            ] {
                let r = no_panic(what, &mut || a.deallocate(q, s, stream));
                refused(&format!("{what} (size {size}, {stream:?})"), r);
                n += 1;
            }
            assert_eq!(a.stats().live_bytes, live, "refused frees changed nothing");
            a.deallocate(p, size, stream).unwrap();
            a.flush().unwrap();
            let r = no_panic("double free", &mut || a.deallocate(p, size, stream));
            refused(&format!("double free (size {size}, {stream:?})"), r);
            n += 1;
            for huge in [usize::MAX, usize::MAX - 255, 1 << 62] {
                let r = no_panic("huge", &mut || a.allocate(huge, stream).map(|_| ()));
                assert!(matches!(r, Err(Error::OutOfMemory { .. })), "size {huge}: {r:?}");
            }
            assert!(a.allocate(0, stream).unwrap().is_null());
            a.deallocate(DeviceAddr::NULL, 0, stream).unwrap();
            let end = a.stats();
            assert_eq!(end.live_bytes, start.live_bytes, "{end:?}");
            assert_eq!(end.invalid_frees - start.invalid_frees, n, "{end:?}");
        }
    }
    a.release_thread().unwrap();
    a.check_invariants();
}

/// `ptr = u64::MAX` through the free path: refused, no overflow (it once computed `ptr + 1`).
#[test]
fn a_free_of_u64_max_is_refused_not_a_panic() {
    use cuarena::{Config, DeviceAddr, Error, Stream};
    use cuarena_testkit::{HostConfig, HostDevice, host_allocator};

    let dev = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let a = host_allocator(dev.clone(), Config::default()).unwrap();
    for stream in [Stream::LEGACY, Stream::PER_THREAD, dev.create_stream()] {
        for size in [1usize, 4096, 3 << 20] {
            let free = || a.deallocate(DeviceAddr(u64::MAX), size, stream);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(free));
            assert!(matches!(r, Ok(Err(Error::InvalidFree { .. }))), "size {size}, {stream:?}: {r:?}");
        }
    }
    assert_eq!(a.stats().invalid_frees, 9);
}

/// The check behind `cuarena_record_stream`'s refusal of foreign pointers.
#[test]
fn contains_reserved_covers_exactly_the_reserved_chunks() {
    use cuarena::{Config, Stream};
    use cuarena_testkit::{HostConfig, HostDevice, host_allocator};
    let a = host_allocator(HostDevice::new(HostConfig::default()), Config::default()).unwrap();
    assert!(!a.contains_reserved(0x1000), "nothing reserved yet");
    let p = a.allocate(3 << 20, Stream::LEGACY).unwrap();
    let (base, len) = (p.0, a.stats().reserved_bytes);
    assert_eq!(len, a.config().chunk() as u64, "one chunk");
    assert!(a.contains_reserved(base) && a.contains_reserved(base + 256));
    assert!(a.contains_reserved(base + len - 1));
    assert!(!a.contains_reserved(base + len) && !a.contains_reserved(base - 1));
    assert!(!a.contains_reserved(0) && !a.contains_reserved(u64::MAX));
    a.deallocate(p, 3 << 20, Stream::LEGACY).unwrap();
    a.trim(true).unwrap();
    assert!(!a.contains_reserved(base), "a released chunk is no longer reserved");
}

/// The C OOM hook's adapter: the C function gets the requested size, the device ordinal and
/// its `user` pointer back; its non-zero return retries (bounded), zero fails the allocation.
#[test]
fn a_c_oom_hook_gets_its_arguments_and_its_answer_is_obeyed() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use cuarena::{Error, MAX_OOM_RETRIES};
    use cuarena_testkit::{HostConfig, HostDevice, host_allocator};

    struct Seen {
        calls: AtomicUsize,
        requested: AtomicUsize,
        answer: c_int,
    }
    unsafe extern "C" fn hook(requested: usize, device: c_int, user: *mut c_void) -> c_int {
        // SAFETY: `user` is the `Seen` the test passed; it outlives every allocation below.
        let seen = unsafe { &*user.cast::<Seen>() };
        assert_eq!(device, 0);
        seen.calls.fetch_add(1, Ordering::Relaxed);
        seen.requested.store(requested, Ordering::Relaxed);
        seen.answer
    }
    use std::ffi::c_int;
    let dev = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let cfg = cuarena::Config::builder().max_bytes(32 << 20).build().unwrap();
    let a = host_allocator(dev, cfg).unwrap();
    for (answer, calls) in [(0, 1), (1, MAX_OOM_RETRIES as usize)] {
        let seen = Seen { calls: AtomicUsize::new(0), requested: AtomicUsize::new(0), answer };
        a.set_oom_hook(Some(c_oom_hook(hook, (&raw const seen).cast_mut().cast())));
        let e = a.allocate_per_thread(64 << 20).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
        assert_eq!(seen.calls.load(Ordering::Relaxed), calls, "answer {answer}");
        assert_eq!(seen.requested.load(Ordering::Relaxed), 64 << 20);
        a.set_oom_hook(None);
    }
}

/// Without a driver, setting a device's hook fails cleanly with the reason.
#[test]
fn set_oom_hook_without_a_driver_fails_cleanly() {
    let _g = serial();
    if gpu_present() {
        return;
    }
    assert_eq!(cuarena_set_oom_hook(0, None, std::ptr::null_mut()), -1);
    assert!(err().contains("driver"), "{}", err());
}

// --- Allocation traces (issue 11) ---

#[test]
fn trace_calls_refuse_bad_input_and_fail_cleanly_without_a_driver() {
    let _g = serial();
    // SAFETY: NULL is allowed and refused.
    assert_eq!(unsafe { cuarena_trace_start(0, std::ptr::null()) }, -1);
    assert!(err().contains("path is NULL"), "{}", err());
    if gpu_present() {
        let p = std::env::temp_dir().join(format!("cuarena-ffi-trace-{}.bin", std::process::id()));
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { cuarena_trace_start(0, c.as_ptr()) }, 0, "{}", err());
        // SAFETY: as above.
        assert_eq!(unsafe { cuarena_trace_start(0, c.as_ptr()) }, -1);
        let q = cuarena_malloc(4096, 0, ptr(2));
        assert!(!q.is_null(), "{}", err());
        cuarena_free(q, 4096, 0, ptr(2));
        assert_eq!(cuarena_trace_stop(0), 0, "{}", err());
        let recs = cuarena::trace::read(&p).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(cuarena_trace_stop(0), -1, "nothing runs any more");
        std::fs::remove_file(&p).unwrap();
    } else {
        let c = std::ffi::CString::new("/tmp/never-written.bin").unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { cuarena_trace_start(0, c.as_ptr()) }, -1);
        assert!(err().contains("no CUDA driver"), "{}", err());
        assert_eq!(cuarena_trace_stop(0), -1);
        assert!(err().contains("no CUDA driver"), "{}", err());
    }
}

/// `cuarena_set_defaults`: bad input is refused with a message and changes nothing; good input
/// replaces the defaults and answers how many devices' allocators exist already (they keep
/// their configuration). The defaults' effect on a new allocator is checked by the Python
/// package's tests (`python/tests/test_framework_conf.py`), each in its own process.
#[test]
fn set_defaults_refuses_bad_items_and_counts_the_devices_it_misses() {
    let _s = serial();
    let before = cuarena::global::defaults();
    // SAFETY: NULL is allowed.
    assert_eq!(unsafe { cuarena_set_defaults(std::ptr::null()) }, -1);
    assert!(err().contains("NULL"), "{}", err());
    for bad in [
        &b"bogus=1\0"[..],
        b"legacy_batch_bytes=0B\0",
        b"superblock=4MiB,chunk=6MiB\0",
        b"trace=/tmp/cuarena-default-trace.bin\0",
        b"\xff\0",
    ] {
        // SAFETY: NUL-terminated.
        assert_eq!(unsafe { cuarena_set_defaults(bad.as_ptr().cast()) }, -1, "{bad:?}");
        assert!(err().contains("set_defaults"), "{bad:?}: {}", err());
        assert_eq!(cuarena::global::defaults(), before, "a refused call changed the defaults");
    }
    assert!(err().contains("UTF-8"), "{}", err());
    let made = cuarena::global::created().count() as i32;
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_set_defaults(c"legacy_batch_bytes=16MiB".as_ptr()) }, made);
    assert_eq!(cuarena::global::defaults(), "legacy_batch_bytes=16MiB");
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_set_defaults(c"".as_ptr()) }, made);
    assert_eq!(cuarena::global::defaults(), "");
    // SAFETY: NUL-terminated.
    unsafe { cuarena_set_defaults(std::ffi::CString::new(before).unwrap().as_ptr()) };
}

/// `cuarena_record_stream(p, cudaStreamPerThread)` declares the *declaring* thread's per-thread
/// stream, a different stream in every thread. Found by helper-7's reading: a free of `p` by
/// another thread resolved the declaration there, as its own per-thread stream, so the work on
/// the declaring thread's stream was fenced by nothing and the block was handed out again under
/// it. Now such a free is fenced through the legacy stream (`free_with`). On the simulated device:
/// thread A allocates `p` on a user stream, holds it with work on its per-thread stream and
/// declares that stream; thread B frees `p` on the user stream (batches of one, so its fence is
/// recorded at once, on the user stream); A then allocates on the user stream until it gets `p`
/// back and writes it there. With the mutation `per_thread_anywhere` (the declaration taken
/// as the freeing thread's) the write lands under A's running work.
#[test]
fn a_per_thread_stream_declared_by_one_thread_is_waited_for_when_another_frees() {
    use cuarena::{Config, Stream};
    use cuarena_testkit::{HostConfig, HostDevice, host_allocator};
    use std::time::Duration;

    let sim = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let a = host_allocator(sim.clone(), Config::parse("superblock=64KiB,small_max=32KiB,batch=1").unwrap())
        .unwrap();
    let recorded = Recorded::new(16);
    let user = sim.create_stream();
    let size = 32 << 10;
    let p = a.allocate(size, user).unwrap();
    sim.hold_and_check(p.0, size, 7, Duration::from_millis(300), Stream::PER_THREAD).unwrap();
    recorded.record(p.0, cuarena::StreamUse::here(Stream::PER_THREAD)).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| free_with(&a, &recorded, p.0, size, user).unwrap()).join().unwrap();
    });
    // Allocations on the user stream until `p` comes back (a superblock holds two blocks: the
    // third allocation takes in the remote free).
    cuarena_testkit::assert_reuse_waits(&sim, &a, (size, user, p), 8, "the declaring thread's work");
}

/// The graph-pool calls without a driver, and with bad arguments: -1 or NULL and a reason,
/// never a panic; `(size 0)` is NULL with no error.
#[test]
fn graph_pool_calls_fail_cleanly_without_a_driver_or_with_bad_arguments() {
    let _g = serial();
    let mut count = 0usize;
    // SAFETY: NULL count (refused before anything is written).
    assert_eq!(unsafe { cuarena_graph_pool_live(1, 2, 0, NULL.cast(), 4, &mut count) }, -1);
    assert!(err().contains("NULL"), "{}", err());
    // SAFETY: as above, with a NULL count.
    assert_eq!(unsafe { cuarena_graph_pool_live(1, 2, 0, NULL.cast(), 0, std::ptr::null_mut()) }, -1);
    assert!(cuarena_graph_malloc(1, 2, 0, 0, NULL).is_null());
    assert_eq!(cuarena_graph_pool_release(1, 2, 9999), -1);
    assert!(err().contains("no cuarena allocator"), "{}", err());
    // Checkpoints: a device without an allocator, NULL handles and buffers.
    assert!(cuarena_graph_pool_checkpoint(1, 2, 9999).is_null());
    assert!(err().contains("no cuarena allocator"), "{}", err());
    let mut one = NULL;
    let mut len = 0usize;
    // SAFETY: a NULL checkpoint is refused before anything is read or written.
    assert_eq!(unsafe { cuarena_graph_checkpoint_blocks(std::ptr::null(), &mut one, &mut len, 1) }, -1);
    assert!(err().contains("NULL"), "{}", err());
    // SAFETY: as above.
    assert_eq!(unsafe { cuarena_graph_pool_restore(std::ptr::null(), &mut one, 1, &mut count) }, -1);
    assert!(err().contains("NULL"), "{}", err());
    // SAFETY: NULL is ignored.
    unsafe { cuarena_graph_checkpoint_free(std::ptr::null_mut()) };
    if gpu_present() {
        return;
    }
    assert_eq!(cuarena_graph_pool_retain(1, 2, 0), -1);
    assert!(err().contains("driver"), "{}", err());
    assert!(cuarena_graph_malloc(1, 2, 100, 0, NULL).is_null());
    assert!(err().contains("driver"), "{}", err());
    assert_eq!(cuarena_graph_pool_release(1, 2, 0), -1);
}

/// Checkpoints through the C ABI on the process-wide allocator: a block is checkpointed,
/// freed and made live again by a restore at its address; a restore with too little room for
/// the blocks it would free changes nothing and says how many; bad handles and buffers are
/// refused; the restored block is freed as any.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn on_a_gpu_a_graph_pool_checkpoint_is_restored_through_the_abi() {
    let Some(_g) = serial_on_a_gpu() else { return };
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let st = ctx.new_stream().unwrap();
    let s: *mut c_void = st.cu_stream().cast();
    let (ia, ib) = (0xc0ffee, 7);
    assert!(cuarena_graph_pool_checkpoint(ia, ib, 0).is_null(), "not retained yet");
    assert!(err().contains("not retained"), "{}", err());
    assert_eq!(cuarena_graph_pool_retain(ia, ib, 0), 0, "{}", err());
    let x = cuarena_graph_malloc(ia, ib, 5000, 0, s); // a warm-up: outside a capture
    assert!(!x.is_null(), "{}", err());
    let c = cuarena_graph_pool_checkpoint(ia, ib, 0);
    assert!(!c.is_null(), "{}", err());
    let (mut ptrs, mut sizes) = ([NULL; 2], [0usize; 2]);
    // SAFETY: `c` is live; two elements in each buffer.
    let n = unsafe { cuarena_graph_checkpoint_blocks(c, ptrs.as_mut_ptr(), sizes.as_mut_ptr(), 2) };
    assert_eq!((n, ptrs[0], sizes[0]), (1, x, 5120));
    // SAFETY: `c` is live; with n = 0 nothing is written.
    let n = unsafe { cuarena_graph_checkpoint_blocks(c, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
    assert_eq!(n, 1);
    assert_eq!(cuarena_free_checked(x, 5000, 0, s), 0, "{}", err());
    let y = cuarena_graph_malloc(ia, ib, 70_000, 0, s);
    assert!(!y.is_null(), "{}", err());
    let mut freed = [NULL; 2];
    let mut count = 0usize;
    // SAFETY: `c` is live; room for 0 (nothing written); `count` writable.
    assert_eq!(unsafe { cuarena_graph_pool_restore(c, std::ptr::null_mut(), 0, &mut count) }, 1);
    assert_eq!(count, 1, "one block live: no room to report it, nothing changed");
    // SAFETY: as above, with room for 2.
    assert_eq!(unsafe { cuarena_graph_pool_restore(c, freed.as_mut_ptr(), 2, &mut count) }, 0, "{}", err());
    assert_eq!((count, freed[0]), (1, y), "the live block is freed");
    let mut live = [NULL; 4];
    // SAFETY: `live` holds 4 pointers, `count` is writable.
    assert_eq!(unsafe { cuarena_graph_pool_live(ia, ib, 0, live.as_mut_ptr(), 4, &mut count) }, 0);
    assert_eq!((count, live[0]), (1, x), "the checkpoint's block is live again at its address");
    assert_eq!(cuarena_free_checked(y, 70_000, 0, s), -1, "freed by the restore");
    assert_eq!(cuarena_free_checked(x, 5000, 0, s), 0, "{}", err());
    assert_eq!(cuarena_graph_pool_release(ia, ib, 0), 0, "{}", err());
    // SAFETY: `c` is live; the pool is released now, so the restore is refused.
    assert_eq!(unsafe { cuarena_graph_pool_restore(c, freed.as_mut_ptr(), 2, &mut count) }, -1);
    assert!(err().contains("not retained"), "{}", err());
    // SAFETY: from cuarena_graph_pool_checkpoint, freed once.
    unsafe { cuarena_graph_checkpoint_free(c) };
    st.synchronize().unwrap();
    cuarena_empty_cache();
}

/// Through the C ABI on the process-wide allocator: a global-mode capture allocates in a graph
/// pool, frees a temporary and gets it back, and ends unbroken; the graph runs; the pool's live
/// blocks are listed; bad frees are refused; release and `cuarena_empty_cache` give the memory
/// back; a pool not retained is refused.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn on_a_gpu_a_capture_allocates_through_the_abi_in_a_graph_pool() {
    use cudarc::driver::sys;
    let Some(_g) = serial_on_a_gpu() else { return };
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let st = ctx.new_stream().unwrap();
    let s: *mut c_void = st.cu_stream().cast();
    let (ia, ib) = (0xdead, 0xbeef);
    assert!(cuarena_graph_malloc(ia, ib, 100, 0, s).is_null(), "not retained yet");
    assert!(err().contains("not retained"), "{}", err());
    assert_eq!(cuarena_graph_pool_retain(ia, ib, 0), 0, "{}", err());
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: a live stream of the primary context.
    assert_eq!(unsafe { sys::cuStreamBeginCapture_v2(st.cu_stream(), mode) }, sys::CUresult::CUDA_SUCCESS);
    let out = cuarena_graph_malloc(ia, ib, 1 << 20, 0, s);
    assert!(!out.is_null(), "{}", err());
    let tmp = cuarena_graph_malloc(ia, ib, 3 << 20, 0, s);
    assert!(!tmp.is_null(), "{}", err());
    // SAFETY: `tmp` holds 3 MiB; captured on the stream.
    let r = unsafe { sys::cuMemsetD8Async(tmp as u64, 1, 3 << 20, st.cu_stream()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(cuarena_free_checked(tmp, 3 << 20, 0, s), 0, "{}", err());
    let again = cuarena_graph_malloc(ia, ib, 3 << 20, 0, s);
    assert_eq!(again, tmp, "the capture's free is reused on its stream");
    // SAFETY: `out` holds 1 MiB; captured on the stream.
    let r = unsafe { sys::cuMemsetD8Async(out as u64, 9, 1 << 20, st.cu_stream()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(cuarena_free_checked(again, 3 << 20, 0, s), 0, "{}", err());
    // The ordinary path still refuses the capturing stream.
    assert!(cuarena_malloc(64 << 20, 0, s).is_null());
    assert!(err().contains("captured"), "{}", err());
    let mut graph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; `graph` is a valid out-pointer.
    let r = unsafe { sys::cuStreamEndCapture(st.cu_stream(), &mut graph) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "capture broken");
    let mut exec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph; `exec` a valid out-pointer; then launched on a
    // live stream and waited for.
    unsafe {
        assert_eq!(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuGraphLaunch(exec, st.cu_stream()), sys::CUresult::CUDA_SUCCESS);
    }
    st.synchronize().unwrap();
    let mut host = vec![0u8; 1 << 20];
    // SAFETY: `out` holds 1 MiB, written by the finished graph; `host` as many bytes.
    let r = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), out as u64, 1 << 20) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert!(host.iter().all(|&b| b == 9));
    let mut live = [NULL; 4];
    let mut count = 0usize;
    // SAFETY: `live` holds 4 pointers, `count` is writable.
    let r = unsafe { cuarena_graph_pool_live(ia, ib, 0, live.as_mut_ptr(), 4, &mut count) };
    assert_eq!(r, 0, "{}", err());
    assert_eq!((count, live[0]), (1, out));
    assert_eq!(cuarena_free_checked(out, 2 << 20, 0, s), -1, "a wrong size");
    assert!(err().contains("does not match"), "{}", err());
    assert_eq!(cuarena_free_checked(ptr(out as usize + 512), 512, 0, s), -1, "an interior pointer");
    assert_eq!(cuarena_free_checked(out, 1 << 20, 0, s), 0, "{}", err());
    assert_eq!(cuarena_free_checked(out, 1 << 20, 0, s), -1, "a double free");
    // SAFETY: idle; destroyed once.
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    assert_eq!(cuarena_graph_pool_release(ia, ib, 0), 0, "{}", err());
    assert_eq!(cuarena_graph_pool_release(ia, ib, 0), -1, "released once only");
    cuarena_empty_cache();
    assert_eq!(cuarena::global(0).unwrap().graph_pool_bytes(), 0);
}
