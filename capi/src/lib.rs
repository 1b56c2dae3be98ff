//! The C ABI (`include/cuarena.h`): PyTorch's `CUDAPluggableAllocator` hooks (CuPy's glue in
//! `python/cuarena` uses the same stream-ordered pair), statistics and the last error.
//!
//! Every entry point catches panics: none crosses the boundary. A failure returns NULL or -1
//! and sets this thread's [`cuarena_last_error`]. Once process exit has begun, frees are no-ops
//! and allocations fail with [`Error::ShutDown`]'s message, so no CUDA call is made into a
//! driver that is being torn down.

use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::LazyLock;

use cuarena::global::{created, global, set_defaults};
use cuarena::shutdown::process_exiting;
use cuarena::{Allocator, DeviceAddr, Error, Stats, Stream, StreamUse};

thread_local! {
    static LAST_ERROR: std::cell::RefCell<Option<CString>> = const { std::cell::RefCell::new(None) };
}

/// Streams declared by `cuarena_record_stream`, per block (`recorded.rs`).
mod recorded;
pub(crate) use recorded::Recorded;
#[allow(unused_imports)] // the C ABI's constants; unused where a test compiles this file in with #[path]
pub use recorded::{MAX_RECORDED_BLOCKS, MAX_RECORDED_STREAMS};

static RECORDED: LazyLock<Recorded> = LazyLock::new(|| Recorded::new(MAX_RECORDED_BLOCKS));

/// Blocks that carry `record_stream` declarations and have not been freed. For tests.
#[doc(hidden)]
pub fn recorded_blocks() -> usize {
    RECORDED.live()
}

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

/// A string argument `p` (named `what` in errors): refused if NULL or not UTF-8.
///
/// # Safety
/// `p` must be NULL or a NUL-terminated string that outlives the returned reference.
unsafe fn utf8_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, String> {
    if p.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: not NULL, and the caller guarantees a NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    s.to_str().map_err(|_| format!("{what} is not UTF-8"))
}

fn stream(s: *mut c_void) -> Stream {
    Stream::from_raw(s as usize)
}

/// Allocates `size` bytes on `device`, ready on `stream`. NULL on failure; NULL without an
/// error for `size == 0` (on any device, even with no driver), like `cudaMallocAsync`.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_malloc(size: usize, device: c_int, stream_: *mut c_void) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    guard(std::ptr::null_mut(), || {
        if process_exiting() {
            return Err(Error::ShutDown.to_string());
        }
        let a = global(device).map_err(|e| e.to_string())?;
        malloc_with(a, &RECORDED, size, stream(stream_)).map(|p| p as *mut c_void).map_err(|e| e.to_string())
    })
}

/// The allocation of `cuarena_malloc` on allocator `a`, with the `record_stream` declarations
/// of `recorded` (the process-wide table; a test's own otherwise).
pub(crate) fn malloc_with(
    a: &Allocator,
    recorded: &Recorded,
    size: usize,
    s: Stream,
) -> cuarena::Result<u64> {
    let p = a.allocate(size, s)?.0;
    // A declaration at this address was made while no live block started here (on a block
    // since freed, or an interior pointer: `cuarena_record_stream` cannot tell them from a live
    // block's start from any thread). It belongs to no block, and must neither fence nor fail
    // the free of this one (its stream may be gone by then).
    recorded.forget(p);
    Ok(p)
}

/// Frees a block from `cuarena_malloc`; see the header for the contract. `(NULL, 0)` is a
/// no-op on any device, even with no driver.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_free(ptr: *mut c_void, size: usize, device: c_int, stream_: *mut c_void) {
    free(ptr, size, device, stream_, false);
}

/// [`cuarena_free`] that says whether the free was accepted: 0 if it was (or was a no-op), -1
/// if it was refused (the reason is in [`cuarena_last_error`]). A free of another thread's
/// block that its owner later finds invalid still returns 0 (see `invalid_frees`).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_free_checked(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream_: *mut c_void,
) -> c_int {
    free(ptr, size, device, stream_, false)
}

/// [`cuarena_free`] for a caller whose streams outlive the free and which cannot free again,
/// as PyTorch's deleter (the shim's `cuarena_torch_free`): a free refused because its stream,
/// or a stream declared with [`cuarena_record_stream`], is being captured into a CUDA graph is
/// held and made again at the next `cuarena_graph_capture_end` (PyTorch's
/// `endAllocateToPool`) or `cuarena_empty_cache`, on the same stream handles
/// (`Allocator::deallocate_or_hold`), until no capture refuses it. 0 if the free was taken (or
/// was a no-op), 1 if it was held (the block stays live until then; a capture that ended
/// meanwhile may have had it made already), -1 if it was refused otherwise (the reason is in
/// [`cuarena_last_error`]; nothing changed: a bad free is refused, not held, except a wrong size
/// of another thread's block, which that thread finds when the retry reaches it). While it is
/// held, another free of the block is refused (-1) as a double free; one made while the held
/// free is being retried waits for it, then is judged afresh. A free racing the hold itself
/// may be accepted too, as two racing frees may be.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_free_or_hold(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream_: *mut c_void,
) -> c_int {
    free(ptr, size, device, stream_, true)
}

/// The three frees' entry: 0 taken (or a no-op), 1 held (`hold` only), -1 refused.
fn free(ptr: *mut c_void, size: usize, device: c_int, stream_: *mut c_void, hold: bool) -> c_int {
    if ptr.is_null() && size == 0 {
        return 0;
    }
    guard(-1, || {
        if process_exiting() {
            return Ok(0);
        }
        let a = global(device).map_err(|e| e.to_string())?;
        free_by(a, &RECORDED, ptr as u64, size, stream(stream_), hold)
            .map(|taken| if taken { 0 } else { 1 })
            .map_err(|e| e.to_string())
    })
}

/// The free of `cuarena_free` on allocator `a`, with the `record_stream` declarations of
/// `recorded` (the process-wide table; a test's own otherwise). Called by the tests that
/// compile this file in (`#[path]`); the entry points call [`free_by`].
#[allow(dead_code)]
pub(crate) fn free_with(
    a: &Allocator,
    recorded: &Recorded,
    p: u64,
    size: usize,
    s: Stream,
) -> cuarena::Result<()> {
    free_by(a, recorded, p, size, s, false).map(|_| ())
}

/// The free of [`cuarena_free_or_hold`] on allocator `a`, as [`free_with`]: true if taken now,
/// false if held. For the tests, as [`free_with`].
#[allow(dead_code)]
pub(crate) fn free_or_hold_with(
    a: &Allocator,
    recorded: &Recorded,
    p: u64,
    size: usize,
    s: Stream,
) -> cuarena::Result<bool> {
    free_by(a, recorded, p, size, s, true)
}

/// A free with the block's declared streams, held if `hold` and a capture refuses it
/// (`Allocator::deallocate_or_hold`): true if taken now, false if held.
///
/// The declarations are read, not taken: a refused free, or one accepted and later found
/// invalid by the block's owner, leaves them for the corrected free, and a free racing this one
/// sees them too (`recorded.rs`). An accepted free, taken or held, marks the entry freed: a
/// held free carries the streams it read, and its retry, made inside the library, never
/// reaches this table (helper-54 found held entries kept live, against the cap, for good).
fn free_by(
    a: &Allocator,
    recorded: &Recorded,
    p: u64,
    size: usize,
    s: Stream,
    hold: bool,
) -> cuarena::Result<bool> {
    let used = if p == 0 { Vec::new() } else { recorded.uses(p) };
    // Another thread's per-thread stream is fenced through the legacy stream (`StreamUse`).
    let fence = StreamUse::fence_streams(&used, s);
    let taken = if hold {
        a.deallocate_or_hold(DeviceAddr(p), size, s, &fence)?
    } else {
        a.deallocate_used_on(DeviceAddr(p), size, s, &fence).map(|()| true)?
    };
    if !used.is_empty() {
        recorded.freed(p);
    }
    Ok(taken)
}

/// Declares that work on `stream` uses the block at `ptr`: its free is fenced after that work.
/// Refused (with an error) for a pointer outside the memory cuarena has reserved, and beyond
/// [`MAX_RECORDED_BLOCKS`] blocks or [`MAX_RECORDED_STREAMS`] streams per block. A pointer
/// inside reserved memory where no live block starts is accepted (no thread but a block's
/// owner can tell); its declaration is dropped when a block is handed out there
/// ([`malloc_with`]). [`cuarena_record_stream_checked`] says which of these happened.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_record_stream(ptr: *mut c_void, stream_: *mut c_void) {
    guard((), || declare(ptr, stream_).map_err(|n| n.to_string()))
}

/// [`cuarena_record_stream`], answering what came of the declaration: 0 kept (or `ptr` NULL,
/// or the process exiting), 1 no block of cuarena's can start at `ptr`: it is outside the
/// memory cuarena has reserved on every device, or not on a 256-byte boundary (nothing of
/// cuarena's to fence: PyTorch's own allocator skips memory it did not allocate too; the reason
/// is in [`cuarena_last_error`]), -1 refused at the caps or failed: the declaration is lost, so
/// the block's free will **not** wait for `stream`, and the caller must not free it before that
/// stream's work is done (the reason is in [`cuarena_last_error`]). The PyTorch shim raises on -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_record_stream_checked(ptr: *mut c_void, stream_: *mut c_void) -> c_int {
    guard(-1, || match declare(ptr, stream_) {
        Ok(()) => Ok(0),
        Err(NotKept::Foreign(why)) => {
            set_error(why);
            Ok(1)
        }
        Err(n @ NotKept::Refused(_)) => Err(n.to_string()),
    })
}

/// The declaration behind both `record_stream` entry points.
fn declare(ptr: *mut c_void, stream_: *mut c_void) -> Result<(), NotKept> {
    if ptr.is_null() || process_exiting() {
        return Ok(());
    }
    record_with(created().map(|(_, a)| a), &RECORDED, ptr as u64, stream(stream_))
}

/// Why [`record_with`] kept no declaration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotKept {
    /// No block of the allocators can start at the pointer: it lies in no memory they
    /// reserved, or off a 256-byte boundary. Nothing of theirs to fence.
    Foreign(String),
    /// The table's caps (`recorded.rs`): the declaration is lost.
    Refused(String),
}

impl std::fmt::Display for NotKept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotKept::Foreign(why) | NotKept::Refused(why) => f.write_str(why),
        }
    }
}

/// The declaration of `cuarena_record_stream` against the allocators `allocs` (the process-wide
/// ones; a test's own otherwise) into `recorded`: [`NotKept::Foreign`] for a pointer outside
/// the memory they have reserved, [`NotKept::Refused`] past the table's caps.
pub(crate) fn record_with<'a>(
    mut allocs: impl Iterator<Item = &'a Allocator>,
    recorded: &Recorded,
    p: u64,
    s: Stream,
) -> Result<(), NotKept> {
    if !allocs.any(|a| a.contains_reserved(p)) {
        return Err(NotKept::Foreign(format!(
            "cuarena_record_stream: {p:#x} is not inside memory reserved by cuarena on any device; refused"
        )));
    }
    // Every block starts on a 256-byte granule (pass-through's too: the driver aligns as much),
    // and a free reads the declarations at its block's start only: a declaration elsewhere
    // (a view into a block made outside PyTorch's allocator, as from DLPack) would fence no
    // free and stay in the table for good, since no block can ever start there.
    if !p.is_multiple_of(256) {
        return Err(NotKept::Foreign(format!(
            "cuarena_record_stream: {p:#x} is not on a 256-byte boundary, so no block of cuarena's starts there \
             (a pointer into a block); refused"
        )));
    }
    recorded.record(p, StreamUse::here(s)).map_err(NotKept::Refused)
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
        // Freed declarations at addresses given back to the driver can serve no later free.
        RECORDED.purge(|p| created().any(|(_, a)| a.contains_reserved(p)));
        Ok(())
    })
}

/// Caps `device`'s reserved memory at `fraction` of its total.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_set_memory_fraction(fraction: f64, device: c_int) {
    guard((), || global(device).and_then(|a| a.set_memory_fraction(fraction)).map_err(|e| e.to_string()))
}

/// Statistics of one device's allocator as C sees them (`include/cuarena.h` documents each
/// field): a leading `size`, then [`Stats`]'s fields in order.
///
/// `size` lets the struct grow without breaking the ABI: the caller sets it to the size of the
/// struct it was compiled with, and [`cuarena_get_stats`] fills at most that many bytes and
/// sets it to the bytes it filled. [`Default`] gives a struct whose `size` is this one's.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct cuarena_stats {
    /// In: the bytes the caller's struct has (`sizeof(cuarena_stats)`). Out: the bytes filled.
    pub size: u64,
    /// The statistics.
    pub stats: Stats,
}

impl Default for cuarena_stats {
    fn default() -> Self {
        cuarena_stats { size: size_of::<cuarena_stats>() as u64, stats: Stats::default() }
    }
}

/// The size of the first `cuarena_stats` (`CUARENA_STATS_SIZE_V1`): `size` and 25 counters.
/// A smaller `size` is refused with [`CUARENA_ERR_STATS_SIZE`]; later versions only add fields
/// at the end, so a caller compiled against this one keeps working.
pub const CUARENA_STATS_SIZE_V1: usize = 8 + 25 * 8;

/// What [`cuarena_get_stats`] returns for a `size` below [`CUARENA_STATS_SIZE_V1`].
pub const CUARENA_ERR_STATS_SIZE: c_int = -2;

const _: () = assert!(
    size_of::<cuarena_stats>() >= CUARENA_STATS_SIZE_V1
        && size_of::<cuarena_stats>() == 8 + size_of::<Stats>(),
    "cuarena_stats must match include/cuarena.h"
);

/// Fills `*out` with `device`'s statistics. Returns 0 on success (`out->size` is then the bytes
/// filled: the smaller of the caller's `size` and this library's struct, in whole fields),
/// [`CUARENA_ERR_STATS_SIZE`] if `out->size` is below [`CUARENA_STATS_SIZE_V1`] (nothing is
/// written), and -1 on any other failure (nothing is written). The reason is in
/// [`cuarena_last_error`].
///
/// # Safety
/// `out` must be NULL or point to memory whose first 8 bytes (`size`) are readable and whose
/// first `size` bytes are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_get_stats(device: c_int, out: *mut cuarena_stats) -> c_int {
    // SAFETY: the caller's guarantee about `out`, passed on.
    unsafe {
        fill_stats("cuarena_get_stats", out, || Ok((global(device).map_err(|e| e.to_string())?.stats(), 0)))
    }
}

/// [`cuarena_get_stats`] that never creates `device`'s allocator (no driver call, no CUDA
/// context): for a device not used through cuarena yet, or any device number it could not use,
/// it returns 1 and fills every statistic with 0, as such a device has (a framework's
/// statistics call for every device must not make a context on each). Otherwise as
/// [`cuarena_get_stats`]: 0, [`CUARENA_ERR_STATS_SIZE`], or -1 (`out` NULL).
///
/// # Safety
/// As [`cuarena_get_stats`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_peek_stats(device: c_int, out: *mut cuarena_stats) -> c_int {
    // SAFETY: the caller's guarantee about `out`, passed on.
    unsafe {
        fill_stats("cuarena_peek_stats", out, || {
            Ok(match cuarena::global::existing(device) {
                Some(a) => (a.stats(), 0),
                None => (Stats::default(), 1),
            })
        })
    }
}

/// What both statistics calls share: `out` checked (NULL: -1; a `size` below
/// [`CUARENA_STATS_SIZE_V1`]: [`CUARENA_ERR_STATS_SIZE`], nothing written), then `get`'s
/// statistics written and its result returned (its error: -1, nothing written). `name` is the
/// entry point the errors name.
///
/// # Safety
/// `out` is NULL or points to memory whose first 8 bytes are readable and whose first `size`
/// bytes are writable.
unsafe fn fill_stats(
    name: &str,
    out: *mut cuarena_stats,
    get: impl FnOnce() -> Result<(Stats, c_int), String>,
) -> c_int {
    guard(-1, || {
        if out.is_null() {
            return Err(format!("{name}: out is NULL"));
        }
        // SAFETY: the caller guarantees `out`'s first 8 bytes are readable; they may be unaligned.
        let size = unsafe { out.cast::<u64>().read_unaligned() };
        if size < CUARENA_STATS_SIZE_V1 as u64 {
            set_error(stats_size_error(name, size));
            return Ok(CUARENA_ERR_STATS_SIZE);
        }
        let (stats, r) = get()?;
        // SAFETY: the caller guarantees `size` writable bytes at `out`, and `size` was checked.
        unsafe { write_stats(stats, out.cast::<u8>(), size) };
        Ok(r)
    })
}

fn stats_size_error(name: &str, size: u64) -> String {
    format!(
        "{name}: out->size is {size}, below the {CUARENA_STATS_SIZE_V1} bytes of the smallest \
         cuarena_stats; set it to sizeof(cuarena_stats)"
    )
}

/// Writes `stats` as a `cuarena_stats` into the `size` bytes at `out`: at most `size` bytes and
/// at most this library's struct, in whole fields, with `size` set to the bytes written.
///
/// # Safety
/// `size >= CUARENA_STATS_SIZE_V1`, and `out` points to `size` writable bytes.
unsafe fn write_stats(stats: Stats, out: *mut u8, size: u64) {
    debug_assert!(size >= CUARENA_STATS_SIZE_V1 as u64);
    let n = size.min(size_of::<cuarena_stats>() as u64) as usize / 8 * 8;
    let full = cuarena_stats { size: n as u64, stats };
    // SAFETY: `full` is a local of `size_of::<cuarena_stats>() >= n` bytes; the caller
    // guarantees `out` has `size >= n` writable bytes; the two do not overlap.
    unsafe { std::ptr::copy_nonoverlapping((&raw const full).cast::<u8>(), out, n) };
}

// ---- CUDA graph pools (src/graph_pool.rs) ----

/// `device`'s allocator if one exists already (none is made: a device not used through cuarena
/// has no pool and no capture); `what` begins the error otherwise.
fn existing(device: c_int, what: &str) -> Result<&'static Allocator, String> {
    created()
        .find(|(d, _)| *d == device)
        .map(|(_, a)| a)
        .ok_or_else(|| format!("{what}: CUDA device {device} has no cuarena allocator"))
}

fn graph_id(a: u64, b: u64) -> cuarena::GraphPoolId {
    cuarena::GraphPoolId(a, b)
}

/// Retains `device`'s CUDA graph pool `(id_a, id_b)` (PyTorch's `MempoolId_t`), making it if
/// new. 0, or -1 if the device's allocator cannot be had (see [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_pool_retain(id_a: u64, id_b: u64, device: c_int) -> c_int {
    guard(-1, || {
        global(device).map_err(|e| e.to_string())?.graph_pool_retain(graph_id(id_a, id_b));
        Ok(0)
    })
}

/// Releases `device`'s CUDA graph pool `(id_a, id_b)` once. 0, or -1 for a pool not retained
/// (nothing changes) or a device without an allocator (see [`cuarena_last_error`]). Never
/// blocks.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_pool_release(id_a: u64, id_b: u64, device: c_int) -> c_int {
    guard(-1, || {
        if process_exiting() {
            return Ok(0);
        }
        existing(device, &format!("graph pool ({id_a}, {id_b})"))?
            .graph_pool_release(graph_id(id_a, id_b))
            .map(|()| 0)
            .map_err(|e| e.to_string())
    })
}

/// Allocates `size` bytes for `stream` in `device`'s retained CUDA graph pool `(id_a, id_b)`:
/// for allocations made while `stream` is being captured. NULL on failure (see
/// [`cuarena_last_error`]); NULL without an error for `size == 0`. Freed with
/// [`cuarena_free`].
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_malloc(
    id_a: u64,
    id_b: u64,
    size: usize,
    device: c_int,
    stream_: *mut c_void,
) -> *mut c_void {
    if size == 0 {
        return std::ptr::null_mut();
    }
    guard(std::ptr::null_mut(), || {
        if process_exiting() {
            return Err(Error::ShutDown.to_string());
        }
        let a = global(device).map_err(|e| e.to_string())?;
        let p = a.graph_allocate(graph_id(id_a, id_b), size, stream(stream_)).map_err(|e| e.to_string())?.0;
        RECORDED.forget(p); // as in `malloc_with`
        Ok(p as *mut c_void)
    })
}

/// A CUDA graph capture begins on `device` (the PyTorch shim: a route to a pool opens). Until
/// the matching [`cuarena_graph_capture_end`], cuarena makes no device synchronise there. 0, or
/// -1 if the device's allocator cannot be had (see [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_capture_begin(device: c_int) -> c_int {
    guard(-1, || {
        global(device).map_err(|e| e.to_string())?.graph_capture_begin();
        Ok(0)
    })
}

/// Ends a capture begun with [`cuarena_graph_capture_begin`]. 0, or -1 if none is underway on
/// `device` (nothing changes; see [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_capture_end(device: c_int) -> c_int {
    guard(-1, || {
        if process_exiting() {
            return Ok(0);
        }
        existing(device, "graph capture end")?.graph_capture_end().map(|()| 0).map_err(|e| e.to_string())
    })
}

/// How many times `device`'s CUDA graph pool `(id_a, id_b)` is retained now (0 for a pool not
/// retained, or a device with no allocator yet), or -1 (see [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_pool_use_count(id_a: u64, id_b: u64, device: c_int) -> i64 {
    guard(-1, || {
        Ok(existing(device, "")
            .map_or(0, |a| a.graph_pool_use_count(graph_id(id_a, id_b)).min(i64::MAX as u64) as i64))
    })
}

/// The live blocks of `device`'s retained CUDA graph pool `(id_a, id_b)`: their number goes to
/// `*count`, and the first `min(n, count)` of their addresses, in address order, to `out`.
/// 0, or -1 (nothing written) for a pool not retained, a NULL `count`, or a NULL `out` with
/// `n > 0` (see [`cuarena_last_error`]).
///
/// # Safety
/// `out` must point to `n` writable pointers (or `n` is 0), `count` to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_graph_pool_live(
    id_a: u64,
    id_b: u64,
    device: c_int,
    out: *mut *mut c_void,
    n: usize,
    count: *mut usize,
) -> c_int {
    guard(-1, || {
        if count.is_null() || (out.is_null() && n > 0) {
            return Err("cuarena_graph_pool_live: count is NULL, or out is NULL with n > 0".into());
        }
        // A device with no allocator yet has no pool: none is made to say so.
        let a = existing(device, &format!("graph pool ({id_a}, {id_b}) is not retained"))?;
        let live = a.graph_pool_live(graph_id(id_a, id_b)).map_err(|e| e.to_string())?;
        for (i, p) in live.iter().take(n).enumerate() {
            // SAFETY: `i < n`, and the caller guarantees `out` holds `n` pointers.
            unsafe { *out.add(i) = p.0 as *mut c_void };
        }
        // SAFETY: not NULL (checked), and the caller guarantees it is writable.
        unsafe { *count = live.len() };
        Ok(0)
    })
}

/// A checkpoint of a graph pool, as the C ABI hands it out (`cuarena_graph_checkpoint` in
/// `include/cuarena.h`): opaque to C, owned by the caller until
/// [`cuarena_graph_checkpoint_free`].
pub struct GraphCheckpointHandle {
    device: c_int,
    checkpoint: cuarena::GraphCheckpoint,
}

/// A checkpoint of `device`'s retained CUDA graph pool `(id_a, id_b)`: its live blocks now
/// (PyTorch's `getCheckpointState`), for [`cuarena_graph_pool_restore`]. NULL for a pool not
/// retained or a device with no allocator (see [`cuarena_last_error`]). Free it with
/// [`cuarena_graph_checkpoint_free`].
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_graph_pool_checkpoint(
    id_a: u64,
    id_b: u64,
    device: c_int,
) -> *mut GraphCheckpointHandle {
    guard(std::ptr::null_mut(), || {
        let a = existing(device, &format!("graph pool ({id_a}, {id_b}) is not retained"))?;
        let checkpoint = a.graph_pool_checkpoint(graph_id(id_a, id_b)).map_err(|e| e.to_string())?;
        Ok(Box::into_raw(Box::new(GraphCheckpointHandle { device, checkpoint })))
    })
}

/// The blocks of checkpoint `c` (those a restore makes live again): their number is returned,
/// and the first `min(n, number)` of their addresses and sizes (multiples of 512), in address
/// order, go to `ptrs` and `sizes`. -1 (nothing written) for a NULL `c`, or a NULL `ptrs` or
/// `sizes` with `n > 0` (see [`cuarena_last_error`]).
///
/// # Safety
/// `c` is NULL or a checkpoint from [`cuarena_graph_pool_checkpoint`] not yet freed; `ptrs`
/// and `sizes` each point to `n` writable elements (or `n` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_graph_checkpoint_blocks(
    c: *const GraphCheckpointHandle,
    ptrs: *mut *mut c_void,
    sizes: *mut usize,
    n: usize,
) -> isize {
    guard(-1, || {
        if c.is_null() || (n > 0 && (ptrs.is_null() || sizes.is_null())) {
            return Err(
                "cuarena_graph_checkpoint_blocks: c is NULL, or ptrs or sizes is NULL with n > 0".into()
            );
        }
        // SAFETY: not NULL (checked), and the caller guarantees a live checkpoint.
        let c = unsafe { &*c };
        for (i, (p, l)) in c.checkpoint.blocks().take(n).enumerate() {
            // SAFETY: `i < n`, and the caller guarantees `n` writable elements in each.
            unsafe {
                *ptrs.add(i) = p.0 as *mut c_void;
                *sizes.add(i) = l;
            }
        }
        Ok(c.checkpoint.blocks().len() as isize)
    })
}

/// Frees a checkpoint from [`cuarena_graph_pool_checkpoint`]. NULL is ignored.
///
/// # Safety
/// `c` is NULL or a checkpoint from [`cuarena_graph_pool_checkpoint`] not yet freed; it is not
/// used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_graph_checkpoint_free(c: *mut GraphCheckpointHandle) {
    if !c.is_null() {
        // SAFETY: the caller guarantees `c` came from `Box::into_raw` in
        // `cuarena_graph_pool_checkpoint` and is freed once.
        drop(unsafe { Box::from_raw(c) });
    }
}

/// Restores checkpoint `c`'s pool to it (PyTorch's `setCheckpointPoolState`; the contract is
/// [`cuarena::Allocator::graph_pool_restore`]'s): every block live in the pool is freed, and
/// exactly the checkpoint's blocks are live again at their addresses (see
/// [`cuarena_graph_checkpoint_blocks`]), to be freed with [`cuarena_free`]. The number of blocks
/// freed goes to `*count`, and their addresses, in address order, to `freed`. 0; 1 if more
/// than `n` blocks are live (nothing changed: `*count` says how many, so try again with room
/// for them); -1 if refused (nothing changed; see [`cuarena_last_error`]).
///
/// # Safety
/// `c` is NULL or a checkpoint from [`cuarena_graph_pool_checkpoint`] not yet freed; `freed`
/// points to `n` writable pointers (or `n` is 0); `count` to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_graph_pool_restore(
    c: *const GraphCheckpointHandle,
    freed: *mut *mut c_void,
    n: usize,
    count: *mut usize,
) -> c_int {
    guard(-1, || {
        if c.is_null() || count.is_null() || (freed.is_null() && n > 0) {
            return Err("cuarena_graph_pool_restore: c or count is NULL, or freed is NULL with n > 0".into());
        }
        // SAFETY: not NULL (checked), and the caller guarantees a live checkpoint.
        let c = unsafe { &*c };
        let id = c.checkpoint.pool();
        let a = existing(c.device, &format!("graph pool ({}, {}) is not retained", id.0, id.1))?;
        let (r, len) = match a.graph_pool_restore_within(&c.checkpoint, n).map_err(|e| e.to_string())? {
            Ok(blocks) => {
                for (i, &(p, _)) in blocks.iter().enumerate() {
                    // SAFETY: `i < blocks.len() <= n`, and the caller guarantees `n` pointers.
                    unsafe { *freed.add(i) = p.0 as *mut c_void };
                    RECORDED.forget(p.0); // the restore's contract orders their uses
                }
                for (p, _) in c.checkpoint.blocks() {
                    RECORDED.forget(p.0); // handed out again (as in `malloc_with`)
                }
                (0, blocks.len())
            }
            Err(live) => (1, live),
        };
        // SAFETY: not NULL (checked), and the caller guarantees it is writable.
        unsafe { *count = len };
        Ok(r)
    })
}

// ---- Statistics resets and the size histogram (issue 11, item 3) ----

/// Restarts `device`'s peaks (`peak_live_bytes`, `peak_live_bytes_upper`,
/// `peak_reserved_bytes`) at their values now. 0 on success, -1 on failure (see
/// [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_reset_peak(device: c_int) -> c_int {
    guard(-1, || {
        global(device).map_err(|e| e.to_string())?.reset_peak();
        Ok(0)
    })
}

/// Restarts `device`'s accumulated counters (allocations, frees, fences, driver calls, ...,
/// the size histogram) at zero. 0 on success, -1 on failure (see [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_reset_counters(device: c_int) -> c_int {
    guard(-1, || {
        global(device).map_err(|e| e.to_string())?.reset_counters();
        Ok(0)
    })
}

/// Writes up to `n` buckets of `device`'s allocation-size histogram to `out` (see
/// `Allocator::size_histogram`) and returns the number of buckets the library has
/// (`CUARENA_SIZE_HISTOGRAM_BUCKETS`), or -1 on failure (nothing written; see
/// [`cuarena_last_error`]). `out` may be NULL when `n` is 0.
///
/// # Safety
/// `out` must point to `n` writable `uint64_t`s (or `n` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_get_size_histogram(device: c_int, out: *mut u64, n: usize) -> c_int {
    guard(-1, || {
        if out.is_null() && n > 0 {
            return Err("cuarena_get_size_histogram: out is NULL".into());
        }
        let h = global(device).map_err(|e| e.to_string())?.size_histogram();
        let k = n.min(h.len());
        if k > 0 {
            // SAFETY: the caller guarantees `n >= k` writable u64s at `out` (non-NULL here).
            unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), out, k) };
        }
        Ok(h.len() as c_int)
    })
}

// ---- The OOM hook (issue 11, item 4) ----

/// A C OOM hook: `cb(requested, device, user)`, non-zero to retry.
pub type CuarenaOomHook = unsafe extern "C" fn(usize, c_int, *mut c_void) -> c_int;

/// The `user` pointer of a C hook, handed back to it on whichever thread allocates.
#[derive(Clone, Copy)]
struct UserPtr(*mut c_void);
// SAFETY: cuarena never dereferences it; the header makes the caller responsible for `user`
// being usable from every thread that allocates (the hook is called on the allocating thread).
unsafe impl Send for UserPtr {}
// SAFETY: as above.
unsafe impl Sync for UserPtr {}

/// The Rust hook that calls the C hook `cb` with `user`.
pub fn c_oom_hook(cb: CuarenaOomHook, user: *mut c_void) -> cuarena::OomHook {
    let user = UserPtr(user);
    std::sync::Arc::new(move |requested, device| {
        let u = user;
        // SAFETY: `cb` is the caller's function of this signature, valid until it is replaced
        // (the header's contract); C code cannot unwind into us.
        unsafe { cb(requested, device, u.0) != 0 }
    })
}

/// Sets `device`'s OOM hook to `cb` (NULL removes it). When an allocation on `device` is out of
/// memory after cuarena's own reclaim, `cb(requested, device, user)` is called on the
/// allocating thread with no cuarena lock held; non-zero retries the allocation (at most
/// [`cuarena::MAX_OOM_RETRIES`] times). 0 on success, -1 on failure (see [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_set_oom_hook(
    device: c_int,
    cb: Option<CuarenaOomHook>,
    user: *mut c_void,
) -> c_int {
    guard(-1, || {
        let a = global(device).map_err(|e| e.to_string())?;
        a.set_oom_hook(cb.map(|cb| c_oom_hook(cb, user)));
        Ok(0)
    })
}

/// This library's version: `major * 1000000 + minor * 1000 + patch`, as `CUARENA_VERSION` in
/// the header it was built with.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_version() -> c_int {
    VERSION_NUMBER
}

/// This library's version as a string (`"0.1.0"`), static.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_version_string() -> *const c_char {
    VERSION_STRING.as_ptr()
}

/// [`cuarena_version`]'s value, from Cargo's version of this crate.
pub const VERSION_NUMBER: c_int = {
    let (major, minor, patch) = (
        parse_decimal(env!("CARGO_PKG_VERSION_MAJOR")),
        parse_decimal(env!("CARGO_PKG_VERSION_MINOR")),
        parse_decimal(env!("CARGO_PKG_VERSION_PATCH")),
    );
    assert!(minor < 1000 && patch < 1000, "minor and patch must stay below 1000 for CUARENA_VERSION");
    let v = major * 1_000_000 + minor * 1000 + patch;
    assert!(v <= c_int::MAX as u64, "the version does not fit CUARENA_VERSION");
    v as c_int
};

/// [`cuarena_version_string`]'s value.
const VERSION_STRING: &std::ffi::CStr =
    match std::ffi::CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(s) => s,
        Err(_) => panic!("the crate version contains a NUL"),
    };

/// A decimal number at compile time.
const fn parse_decimal(s: &str) -> u64 {
    let b = s.as_bytes();
    assert!(!b.is_empty(), "empty version part");
    let mut v = 0u64;
    let mut i = 0;
    while i < b.len() {
        assert!(b[i].is_ascii_digit(), "a version part is not a number");
        v = v * 10 + (b[i] - b'0') as u64;
        i += 1;
    }
    v
}

/// This thread's last error message, or NULL if no call has failed on this thread. The string
/// stays valid until the next failing call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        .unwrap_or(std::ptr::null())
}

/// [`cuarena_last_error`] as a Rust string, for tests that call the C ABI as Rust.
#[doc(hidden)]
pub fn last_error_message() -> Option<String> {
    LAST_ERROR.try_with(|e| e.borrow().as_ref().map(|c| c.to_string_lossy().into_owned())).ok().flatten()
}

/// Sets defaults under `CUARENA_CONF` for the allocators of devices first used after this call:
/// `items` in `CUARENA_CONF`'s form (`"legacy_batch_bytes=16MiB"`), which `CUARENA_CONF`'s own
/// items override; `""` clears them. No environment variable is changed. Returns how many
/// devices' allocators exist already (they keep their configuration; 0: the defaults apply to
/// every device), or -1 if `items` is NULL, not UTF-8, not a valid configuration or holds
/// `trace=` (nothing changes; the reason is in [`cuarena_last_error`]). The Python glue for
/// PyTorch and CuPy calls it before installing itself.
///
/// # Safety
/// `items` must be NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_set_defaults(items: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: the caller guarantees NULL or a NUL-terminated string.
        let s = unsafe { utf8_arg(items, "cuarena_set_defaults: items") }?;
        let made = set_defaults(s).map_err(|e| e.to_string())?;
        Ok(c_int::try_from(made).unwrap_or(c_int::MAX))
    })
}

// --- Allocation traces (issue 11; `cuarena::trace` documents the format) ---

/// Starts recording every allocation and free of `device`'s allocator into the file at `path`
/// (created or truncated). 0 on success; -1 if `path` is NULL or not UTF-8, the file cannot be
/// created, or a trace runs already (the reason is in [`cuarena_last_error`]).
///
/// # Safety
/// `path` must be NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuarena_trace_start(device: c_int, path: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: the caller guarantees NULL or a NUL-terminated string.
        let p = unsafe { utf8_arg(path, "cuarena_trace_start: path") }?;
        let a = global(device).map_err(|e| e.to_string())?;
        a.start_trace(p).map(|()| 0).map_err(|e| e.to_string())
    })
}

/// Ends `device`'s trace: every thread's records are written and the file closed. 0 on
/// success; -1 if no trace runs or writing failed (the reason is in [`cuarena_last_error`]).
#[unsafe(no_mangle)]
pub extern "C" fn cuarena_trace_stop(device: c_int) -> c_int {
    guard(-1, || {
        let a = global(device).map_err(|e| e.to_string())?;
        a.stop_trace().map(|_| 0).map_err(|e| e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_stats_fills_whole_fields_within_the_callers_size_only() {
        let mut stats = Stats::default();
        (stats.live_bytes, stats.invalid_frees, stats.pool_allocations) = (11, 17, 24);
        let word = |b: &[u8], i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        for size in [CUARENA_STATS_SIZE_V1, 211, 215, 216, 256, 4096] {
            let mut buf = vec![0xa5u8; size + 64];
            buf[..8].copy_from_slice(&(size as u64).to_ne_bytes());
            // SAFETY: `buf` has `size` (and more) writable bytes and `size >= CUARENA_STATS_SIZE_V1`.
            unsafe { write_stats(stats, buf.as_mut_ptr(), size as u64) };
            let n = size.min(size_of::<cuarena_stats>()) / 8 * 8;
            assert_eq!(word(&buf, 0), n as u64, "size {size}: the bytes filled");
            assert_eq!((word(&buf, 1), word(&buf, 17), word(&buf, 24)), (11, 17, 24), "size {size}");
            assert!(buf[n..].iter().all(|&b| b == 0xa5), "size {size}: a byte past the struct was written");
        }
        // An unaligned buffer is fine too.
        let mut buf = vec![0u8; CUARENA_STATS_SIZE_V1 + 1];
        // SAFETY: `buf[1..]` has CUARENA_STATS_SIZE_V1 writable bytes.
        unsafe { write_stats(stats, buf[1..].as_mut_ptr(), CUARENA_STATS_SIZE_V1 as u64) };
        assert_eq!(word(&buf[1..], 24), 24);
    }

    #[test]
    fn version_number_is_cargos_version() {
        let v: Vec<i32> =
            env!("CARGO_PKG_VERSION").split(['.', '-', '+']).take(3).map(|p| p.parse().unwrap()).collect();
        assert_eq!(VERSION_NUMBER, v[0] * 1_000_000 + v[1] * 1000 + v[2]);
        assert_eq!(VERSION_STRING.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert_eq!(parse_decimal("0"), 0);
        assert_eq!(parse_decimal("907"), 907);
    }
}
