//! The C ABI (`include/cuarena.h`): PyTorch's `CUDAPluggableAllocator` hooks, CuPy's
//! `CFunctionAllocator` pair, statistics and the last error.
//!
//! Every entry point catches panics: none crosses the boundary. A failure returns NULL or -1
//! and sets this thread's [`cuarena_last_error`]. Once process exit has begun, frees are no-ops
//! and allocations fail, so no CUDA call is made into a driver that is being torn down.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};

use crate::allocator::DevicePtr;
use crate::global::{created, global};
use crate::shutdown::process_exiting;
use crate::stats::Stats;
use crate::stream::Stream;
use crate::sync::thread_local;

thread_local! {
    static LAST_ERROR: std::cell::RefCell<Option<CString>> = const { std::cell::RefCell::new(None) };
}

/// Streams declared by `cuarena_record_stream`, per block; `RECORDED_COUNT` lets frees skip the
/// lock when nobody uses `record_stream`.
static RECORDED: LazyLock<Mutex<HashMap<u64, Vec<Stream>>>> = LazyLock::new(Default::default);
static RECORDED_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Sizes of CuPy allocations (CuPy's free passes none).
static CUPY_SIZES: LazyLock<Mutex<HashMap<u64, usize>>> = LazyLock::new(Default::default);

fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(c));
}

/// Runs `f`, turning errors and panics into `fallback` plus a recorded message.
fn guard<R>(fallback: R, f: impl FnOnce() -> Result<R, String>) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => r,
        Ok(Err(msg)) => {
            set_error(msg);
            fallback
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned());
            set_error(format!("internal error (caught panic): {}", what.unwrap_or_default()));
            fallback
        }
    }
}

fn stream(s: *mut c_void) -> Stream {
    Stream::from_raw(s as usize)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn take_recorded(ptr: u64) -> Vec<Stream> {
    if RECORDED_COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let v = lock(&RECORDED).remove(&ptr).unwrap_or_default();
    if !v.is_empty() {
        RECORDED_COUNT.fetch_sub(1, Ordering::AcqRel);
    }
    v
}

/// Allocates `size` bytes on `device`, ready on `stream`. NULL for `size == 0` or on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_malloc(size: usize, device: c_int, stream_: *mut c_void) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        if process_exiting() {
            return Err("the process is exiting".into());
        }
        let a = global(device).map_err(|e| e.to_string())?;
        a.allocate(size, stream(stream_)).map(|p| p.0 as *mut c_void).map_err(|e| e.to_string())
    })
}

/// Frees a block from `cuarena_malloc`; see the header for the contract.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_free(ptr: *mut c_void, size: usize, device: c_int, stream_: *mut c_void) {
    guard((), || {
        if process_exiting() {
            return Ok(());
        }
        let a = global(device).map_err(|e| e.to_string())?;
        let used = if ptr.is_null() { Vec::new() } else { take_recorded(ptr as u64) };
        a.deallocate_used_on(DevicePtr(ptr as u64), size, stream(stream_), &used).map_err(|e| e.to_string())
    })
}

/// Declares that work on `stream` uses the block at `ptr`: its free is fenced after that work.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_record_stream(ptr: *mut c_void, stream_: *mut c_void) {
    guard((), || {
        if ptr.is_null() {
            return Ok(());
        }
        let mut m = lock(&RECORDED);
        let v = m.entry(ptr as u64).or_default();
        if v.is_empty() {
            RECORDED_COUNT.fetch_add(1, Ordering::AcqRel);
        }
        if !v.contains(&stream(stream_)) {
            v.push(stream(stream_));
        }
        Ok(())
    })
}

/// Sends this thread's pending remote frees and releases every wholly free chunk of every
/// device to the driver (waiting for their fences).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_empty_cache() {
    guard((), || {
        if process_exiting() {
            return Ok(());
        }
        for (_, a) in created() {
            a.flush().map_err(|e| e.to_string())?;
            a.trim(true).map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// Caps `device`'s reserved memory at `fraction` of its total.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_set_memory_fraction(fraction: f64, device: c_int) {
    guard((), || global(device).and_then(|a| a.set_memory_fraction(fraction)).map_err(|e| e.to_string()))
}

/// CuPy's `CFunctionAllocator` malloc: on the legacy default stream.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_cupy_malloc(_param: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        if process_exiting() {
            return Err("the process is exiting".into());
        }
        let a = global(device).map_err(|e| e.to_string())?;
        let p = a.allocate(size, Stream::LEGACY).map_err(|e| e.to_string())?;
        if !p.is_null() {
            lock(&CUPY_SIZES).insert(p.0, size);
        }
        Ok(p.0 as *mut c_void)
    })
}

/// CuPy's `CFunctionAllocator` free.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_cupy_free(_param: *mut c_void, ptr: *mut c_void, device: c_int) {
    guard((), || {
        if ptr.is_null() || process_exiting() {
            return Ok(());
        }
        let size = lock(&CUPY_SIZES)
            .remove(&(ptr as u64))
            .ok_or_else(|| format!("cuarena_cupy_free: {ptr:?} is not a live CuPy allocation"))?;
        let a = global(device).map_err(|e| e.to_string())?;
        a.deallocate(DevicePtr(ptr as u64), size, Stream::LEGACY).map_err(|e| e.to_string())
    })
}

/// Statistics of one device's allocator: [`Stats`], whose layout is C's
/// (`include/cuarena.h` documents each field).
#[allow(non_camel_case_types)]
pub type cuarena_stats = Stats;

const _: () = assert!(size_of::<cuarena_stats>() == 22 * 8, "cuarena_stats must match include/cuarena.h");

/// Fills `*out` with `device`'s statistics. 0 on success, -1 on failure.
///
/// # Safety
/// `out` must be NULL or point to writable memory for one `cuarena_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_get_stats(device: c_int, out: *mut cuarena_stats) -> c_int {
    guard(-1, || {
        if out.is_null() {
            return Err("cuarena_get_stats: out is NULL".into());
        }
        let a = global(device).map_err(|e| e.to_string())?;
        // SAFETY: the caller guarantees `out` points to a writable cuarena_stats.
        unsafe { out.write(a.stats()) };
        Ok(0)
    })
}

/// This thread's last error message, or NULL if no call has failed on this thread. The string
/// stays valid until the next failing call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        .unwrap_or(std::ptr::null())
}
