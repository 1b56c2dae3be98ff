//! The C ABI, called as C would. Without a driver every call fails cleanly (NULL / -1 and a
//! message); with one (CUARENA_REQUIRE_GPU=1 makes it required) the calls work end to end.

use std::ffi::{CStr, c_void};

use cuarena::ffi::*;

fn last_error() -> Option<String> {
    let p = cuarena_last_error();
    // SAFETY: a non-null result is a NUL-terminated string valid until the next failing call.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn gpu_present() -> bool {
    let present = cuarena::CudaDevice::new(0).is_ok();
    if !present && std::env::var("CUARENA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("CUARENA_REQUIRE_GPU=1 but no GPU is usable");
    }
    present
}

#[test]
fn without_a_driver_every_call_fails_cleanly() {
    if gpu_present() {
        return;
    }
    assert!(cuarena_malloc(4096, 0, std::ptr::null_mut()).is_null());
    assert!(last_error().unwrap().contains("no CUDA driver"), "{:?}", last_error());
    cuarena_free(0x1000 as *mut c_void, 4096, 0, std::ptr::null_mut());
    cuarena_record_stream(0x1000 as *mut c_void, 0x2 as *mut c_void);
    cuarena_empty_cache();
    cuarena_set_memory_fraction(0.5, 0);
    assert!(cuarena_cupy_malloc(std::ptr::null_mut(), 64, 0).is_null());
    let mut s = cuarena_stats::default();
    // SAFETY: `s` is a valid cuarena_stats.
    assert_eq!(unsafe { cuarena_get_stats(0, &mut s) }, -1);
    // SAFETY: NULL is allowed and refused.
    assert_eq!(unsafe { cuarena_get_stats(0, std::ptr::null_mut()) }, -1);
    assert!(cuarena_malloc(16, -3, std::ptr::null_mut()).is_null());
}

#[test]
#[allow(clippy::manual_dangling_ptr)] // 0x1 and 0x2 are CUDA's legacy and per-thread stream handles
fn on_a_gpu_the_abi_allocates_fences_and_refuses_bad_frees() {
    if !gpu_present() {
        eprintln!("skipped: no CUDA driver");
        return;
    }
    let streams = [std::ptr::null_mut(), 0x1 as *mut c_void, 0x2 as *mut c_void];
    let mut blocks = Vec::new();
    for (i, &s) in streams.iter().cycle().take(300).enumerate() {
        let size = 1 + (i * 7919) % (3 << 20);
        let p = cuarena_malloc(size, 0, s);
        assert!(!p.is_null(), "{:?}", last_error());
        assert_eq!(p as usize % 256, 0);
        blocks.push((p, size, s));
    }
    assert!(cuarena_malloc(0, 0, std::ptr::null_mut()).is_null(), "size 0 is NULL");
    cuarena_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
    let (p0, s0, st0) = blocks[0];
    cuarena_record_stream(p0, 0x2 as *mut c_void);
    for &(p, size, s) in &blocks {
        cuarena_free(p, size, 0, s);
    }
    let mut st = cuarena_stats::default();
    // SAFETY: `st` is a valid cuarena_stats.
    assert_eq!(unsafe { cuarena_get_stats(0, &mut st) }, 0);
    let before = st.invalid_frees;
    cuarena_free(p0, s0, 0, st0); // double free (or, if reused, a size mismatch): refused
    cuarena_free(0x1234_0000 as *mut c_void, 100, 0, std::ptr::null_mut());
    assert!(last_error().unwrap().contains("invalid free"));
    // SAFETY: as above.
    assert_eq!(unsafe { cuarena_get_stats(0, &mut st) }, 0);
    assert!(st.invalid_frees > before, "{st:?}");
    let c = cuarena_cupy_malloc(std::ptr::null_mut(), 12345, 0);
    assert!(!c.is_null());
    cuarena_cupy_free(std::ptr::null_mut(), c, 0);
    cuarena_set_memory_fraction(0.5, 0);
    cuarena_empty_cache();
}
