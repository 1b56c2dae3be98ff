//! Sixteenth session's attacks (a helper's): the C ABI (`capi/src/lib.rs`) and trace files as
//! untrusted input to the `cuarena` binary (`replay`, `trace-csv`).
//!
//! The C ABI part calls the entry points as C would (compiled in with `#[path]`, as
//! `tests/ffi.rs` does). This machine has no driver, so the process-wide allocators never exist:
//! the entry points are driven with every bad argument and must fail cleanly; what the entry
//! points do with a live allocator (`free_with`, the `record_stream` table) is driven on a
//! simulated device, with the same code the entry points run.
//!
//! The CLI part writes bad trace files and runs the `cuarena` binary on them: every one must end
//! with a clear message and a non-zero status, never a panic, an abort, a hang, or an attempt
//! to allocate absurd host memory. The binary is `target/debug/cuarena` when it is newer than
//! every source it is built from, else it is built here into a target directory of its own
//! (`target/adversarial-s16`; the outer cargo holds the default one). `CUARENA_CLI` names
//! another binary.

use std::ffi::{CString, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cuarena::trace::{self, Action, Record, StreamKind, TracePath};
use cuarena::{Config, Device, DeviceAddr, Error, Stream, StreamKey};
use cuarena_testkit::{allocate_until_back, assert_all_returned, host_allocator};

mod common;
use common::cli::{cli, cuarena, cuarena_capped, os, replay_args, run_limited, scratch, write_trace};
use common::{Live, host, parse, rng, within};

/// The C ABI (`capi/`, built as libcuarena.so), compiled into this test to be called as Rust.
#[allow(dead_code)] // this test calls a subset of it
#[path = "../capi/src/lib.rs"]
mod cuarena_c;
use cuarena_c::*;

// ---------------------------------------------------------------------------------------------
// Helpers.

/// The process-wide allocators, `record_stream` table and trace paths are shared by the tests.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const NULL: *mut c_void = std::ptr::null_mut();

fn ptr(addr: usize) -> *mut c_void {
    addr as *mut c_void
}

fn err() -> String {
    last_error_message().unwrap_or_else(|| "<no error set>".into())
}

/// True if a CUDA driver is usable here (then the no-driver tests have nothing to check).
fn gpu_present() -> bool {
    cuarena::CudaDevice::new(0).is_ok()
}

// ---------------------------------------------------------------------------------------------
// Area 1: the C ABI's entry points, with no driver: every bad argument fails cleanly.

/// Every pointer argument NULL, device ordinals negative and huge, sizes 0 and near
/// `usize::MAX`: each call returns its failure value with a message, or is the documented no-op,
/// and nothing panics (a panic would abort at the boundary, ending this test binary).
#[test]
fn every_entry_point_refuses_null_pointers_and_bad_devices_cleanly() {
    let _g = serial();
    if gpu_present() {
        return;
    }
    let devices = [0, 1, -1, 63, 64, 65, 1000, i32::MIN, i32::MAX];
    for dev in devices {
        for size in [1usize, 4096, usize::MAX, usize::MAX - 255, 1 << 63] {
            assert!(cuarena_malloc(size, dev, NULL).is_null(), "dev {dev} size {size}");
            assert!(err().contains("no CUDA driver"), "dev {dev} size {size}: {}", err());
            assert_eq!(cuarena_free_checked(ptr(0x1000), size, dev, ptr(2)), -1);
            assert!(err().contains("no CUDA driver"), "{}", err());
            // A NULL pointer with a size is not the (NULL, 0) no-op: it is refused.
            assert_eq!(cuarena_free_checked(NULL, size, dev, NULL), -1, "NULL with size {size}");
        }
        assert_eq!(cuarena_free_checked(NULL, 0, dev, ptr(usize::MAX)), 0, "(NULL, 0) is a no-op");
        assert!(cuarena_malloc(0, dev, ptr(usize::MAX)).is_null());
        // SAFETY: NULL is allowed and refused.
        assert_eq!(unsafe { cuarena_get_stats(dev, std::ptr::null_mut()) }, -1);
        assert!(err().contains("out is NULL"), "{}", err());
        // A caller's size far above the struct: nothing written on failure.
        let mut buf = [0xa5a5_a5a5_a5a5_a5a5u64; 64];
        buf[0] = u64::MAX;
        // SAFETY: `buf` has 512 writable bytes; with no driver nothing is written.
        assert_eq!(unsafe { cuarena_get_stats(dev, buf.as_mut_ptr().cast()) }, -1);
        assert_eq!(buf[0], u64::MAX);
        assert!(buf[1..].iter().all(|&w| w == 0xa5a5_a5a5_a5a5_a5a5), "written on a failure");
        // SAFETY: NULL with n > 0 is refused before anything is written.
        assert_eq!(unsafe { cuarena_get_size_histogram(dev, std::ptr::null_mut(), 25) }, -1);
        assert!(err().contains("out is NULL"), "{}", err());
        // SAFETY: NULL with n == 0 is allowed.
        assert_eq!(unsafe { cuarena_get_size_histogram(dev, std::ptr::null_mut(), 0) }, -1);
        assert!(err().contains("no CUDA driver"), "{}", err());
        assert_eq!(cuarena_reset_peak(dev), -1);
        assert_eq!(cuarena_reset_counters(dev), -1);
        assert_eq!(cuarena_set_oom_hook(dev, None, NULL), -1);
        for f in [f64::NAN, -1.0, 0.0, f64::INFINITY, 2.0, 0.5] {
            cuarena_set_memory_fraction(f, dev);
            assert!(err().contains("no CUDA driver"), "fraction {f}: {}", err());
        }
        // SAFETY: NULL is allowed and refused.
        assert_eq!(unsafe { cuarena_trace_start(dev, std::ptr::null()) }, -1);
        assert!(err().contains("path is NULL"), "{}", err());
        // SAFETY: NUL-terminated (not UTF-8).
        assert_eq!(unsafe { cuarena_trace_start(dev, c"\xff\xfe".as_ptr()) }, -1);
        assert!(err().contains("not UTF-8"), "{}", err());
        assert_eq!(cuarena_trace_stop(dev), -1);
        cuarena_record_stream(ptr(usize::MAX), ptr(usize::MAX));
        assert!(err().contains("not inside memory reserved"), "{}", err());
    }
    cuarena_empty_cache();
    assert_eq!(recorded_blocks(), 0);
    assert_eq!(cuarena::global::created().count(), 0);
}

/// `cuarena_set_defaults` with a huge string, a string of only separators, and every byte: a
/// clear refusal (a shortened echo of the input) or acceptance, never a panic; NULL refused.
#[test]
fn set_defaults_survives_huge_and_odd_strings() {
    let _g = serial();
    let before = cuarena::global::defaults();
    let huge = CString::new("small_max=".repeat(100_000)).unwrap();
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_set_defaults(huge.as_ptr()) }, -1);
    let e = err();
    assert!(
        e.contains("set_defaults") && e.len() < 2000,
        "the refusal echoes the whole input: {} bytes",
        e.len()
    );
    for s in
        [c",,,,", c"=", c"max", c"max=", c"=1", c"max=-1", c"max=99999999999999999999999TiB", c"max=1e400"]
    {
        // SAFETY: NUL-terminated.
        let r = unsafe { cuarena_set_defaults(s.as_ptr()) };
        assert!(r == -1 || r == 0, "{s:?}: {r}");
        if r == -1 {
            assert!(err().contains("set_defaults"), "{s:?}: {}", err());
        }
    }
    // A multi-byte character cut by the 200-character echo must not panic.
    let long = CString::new(format!("bogus={}", "é".repeat(400))).unwrap();
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_set_defaults(long.as_ptr()) }, -1);
    assert!(err().contains('…'), "{}", err());
    let before = CString::new(before).unwrap();
    // SAFETY: NUL-terminated.
    assert!(unsafe { cuarena_set_defaults(before.as_ptr()) } >= 0, "{}", err());
}

/// Many threads hammer every entry point at once with no driver: each call fails cleanly on
/// its own thread (errors are per thread), no deadlock, no panic.
#[test]
fn concurrent_calls_without_a_driver_fail_cleanly_and_do_not_deadlock() {
    let _g = serial();
    if gpu_present() {
        return;
    }
    within(60, || {
        std::thread::scope(|s| {
            for t in 0..8 {
                s.spawn(move || {
                    let path = CString::new(format!("/tmp/cuarena-s16-never-{t}.bin")).unwrap();
                    for i in 0..300usize {
                        let dev = [0, 1, -1, 7][i % 4];
                        match (i + t) % 6 {
                            0 => assert!(cuarena_malloc(256 + i, dev, ptr(2)).is_null()),
                            1 => {
                                assert_eq!(cuarena_free_checked(ptr(0x10000 + i * 256), 256, dev, ptr(2)), -1)
                            }
                            // SAFETY: NUL-terminated.
                            2 => assert_eq!(unsafe { cuarena_trace_start(dev, path.as_ptr()) }, -1),
                            3 => assert_eq!(cuarena_trace_stop(dev), -1),
                            4 => cuarena_empty_cache(),
                            _ => {
                                let mut st = cuarena_stats::default();
                                // SAFETY: a valid cuarena_stats.
                                assert_eq!(unsafe { cuarena_get_stats(dev, &mut st) }, -1);
                            }
                        }
                        if (i + t) % 6 != 4 {
                            let e = err();
                            assert!(e.contains("no CUDA driver"), "thread {t} call {i}: {e}");
                        }
                    }
                });
            }
        });
    });
    assert!(
        !Path::new("/tmp/cuarena-s16-never-0.bin").exists(),
        "a trace file was made without an allocator"
    );
}

// ---------------------------------------------------------------------------------------------
// Area 1: what the entry points do with a live allocator, on the simulated device.

/// `free_with` (the body of `cuarena_free`) refuses size mismatches, double frees, foreign and
/// interior pointers, NULL with a size, and a free on the wrong device's allocator. A refused
/// free keeps the block's declaration: the corrected free is still fenced after the declared
/// stream's work (the race checker and the tags see a reuse under it). Every byte comes back.
#[test]
fn free_with_refuses_every_bad_free_and_the_corrected_free_is_still_fenced() {
    let dev0 = host(50);
    let dev1 = host(50);
    let cfg = "superblock=256KiB,small_max=64KiB,chunk=1MiB,batch=1";
    let a = host_allocator(dev0.clone(), parse(cfg)).unwrap();
    let b = host_allocator(dev1.clone(), parse(cfg)).unwrap();
    let rec = Recorded::new(64);
    let user = dev0.create_stream();
    let mut bad = 0u64;
    let mut bad_b = 0u64;
    let mut reused = 0;
    for (i, size) in [1usize, 4096, 64 << 10, (64 << 10) + 1, 3 << 20].into_iter().enumerate() {
        let p = a.allocate(size, user).unwrap();
        let keep = b.allocate(size, Stream::LEGACY).unwrap(); // so `b` has reserved memory
        // Work on the per-thread stream uses `p` for a while (after the allocation's stream);
        // declared as record_stream does.
        let e = dev0.create_event().unwrap();
        dev0.record_event(e, user).unwrap();
        dev0.stream_wait_event(Stream::PER_THREAD, e).unwrap();
        dev0.hold_and_check(
            p.0,
            size.min(4096),
            40 + i as u32,
            Duration::from_millis(150),
            Stream::PER_THREAD,
        )
        .unwrap();
        record_with(std::iter::once(&a), &rec, p.0, Stream::PER_THREAD).unwrap();
        for (q, n, what) in [
            (p.0, size + (8 << 20), "size mismatch"),
            (p.0 + 256, size, "interior pointer"),
            (0x1234_0000, size, "foreign pointer"),
            (u64::MAX, size, "u64::MAX"),
            (u64::MAX - 255, usize::MAX, "near u64::MAX, size usize::MAX"),
            (0, size, "NULL with a size"),
        ] {
            let r = free_with(&a, &rec, q, n, user);
            assert!(matches!(r, Err(Error::InvalidFree { .. })), "{what} (size {size}): {r:?}");
            bad += 1;
        }
        // The wrong device: `b` refuses it (counted there).
        let r = free_with(&b, &rec, p.0, size, user);
        assert!(r.is_err(), "a free on the wrong device was accepted: {r:?}");
        bad_b += u64::from(matches!(r, Err(Error::InvalidFree { .. })));
        free_with(&a, &rec, p.0, size, user).unwrap();
        // The block comes back on the user stream: its first use there must wait for the work
        // on the declared stream.
        let (got, back) = allocate_until_back(&a, size, user, p, 16);
        reused += usize::from(back);
        if back {
            dev0.write_tag(p.0, size.min(4096), 90 + i as u32, user).unwrap();
        }
        for q in got {
            free_with(&a, &rec, q.0, size, user).unwrap();
        }
        a.flush().unwrap();
        let r = free_with(&a, &rec, p.0, size, user);
        assert!(matches!(r, Err(Error::InvalidFree { .. })), "double free (size {size}): {r:?}");
        bad += 1;
        b.deallocate(keep, size, Stream::LEGACY).unwrap();
    }
    dev0.synchronize();
    assert!(reused >= 3, "blocks came back {reused} times of 5: the fence check checks little");
    assert_eq!(dev0.tag_errors(), 0, "a block was reused under the declared stream's work");
    dev0.destroy_stream(user).unwrap();
    assert_all_returned(&a, Some(&dev0), bad);
    assert_all_returned(&b, Some(&dev1), bad_b);
}

/// `cuarena_record_stream` on a block already freed, and on an interior pointer: no thread but a
/// block's owner can tell these from a live block's start, so they may be accepted. Before the
/// fix such a declaration stayed in the table, and once its stream was destroyed the next
/// valid free of a block handed out at that address looked the dead stream up: refused, the
/// declaration put back, refused again on every retry, so the block could never be freed (on
/// CUDA, `cuStreamGetId` on a dangling handle). Now the hand-out at that address
/// (`malloc_with`, `cuarena_malloc`'s path) drops it.
#[test]
fn a_declaration_on_a_freed_block_cannot_poison_the_next_free() {
    let dev = host(50);
    let a =
        host_allocator(dev.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,batch=1")).unwrap();
    let rec = Recorded::new(64);
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let size = 4096;
    let p = malloc_with(&a, &rec, size, s1).unwrap();
    free_with(&a, &rec, p, size, s1).unwrap();
    // record_stream on the freed block, and on an interior pointer.
    let stale = record_with(std::iter::once(&a), &rec, p, s2);
    let interior = record_with(std::iter::once(&a), &rec, p + 256, s2);
    assert!(stale.is_ok() && interior.is_ok(), "inside reserved memory: {stale:?} {interior:?}");
    dev.destroy_stream(s2).unwrap();
    // The address is handed out again (through the C ABI's path), and its valid free must be
    // accepted, with no lookup of the destroyed stream.
    let mut got = Vec::new();
    while got.len() < 16 && got.last() != Some(&p) {
        got.push(malloc_with(&a, &rec, size, s1).unwrap());
    }
    assert_eq!(got.last(), Some(&p), "the freed block never came back, so this test checks nothing");
    let mut refused = Vec::new();
    for q in got {
        // Twice: a refusal is not a one-off.
        for _ in 0..2 {
            match free_with(&a, &rec, q, size, s1) {
                Ok(()) => break,
                Err(e) => refused.push(format!("{q:#x}: {e}")),
            }
        }
    }
    let stale_calls = dev.take_stale_handle_calls();
    assert!(
        refused.is_empty() && stale_calls == 0,
        "valid frees refused after a declaration on a freed block: {refused:?}; destroyed-stream lookups: {stale_calls}"
    );
    // The interior declaration is dropped in the same way once a block starts there.
    let mut small = Vec::new();
    while small.len() < 4096 && small.last() != Some(&(p + 256)) {
        small.push(malloc_with(&a, &rec, 256, s1).unwrap());
    }
    assert_eq!(small.last(), Some(&(p + 256)), "no block came back at the interior address");
    for q in small {
        free_with(&a, &rec, q, 256, s1).unwrap_or_else(|e| panic!("{q:#x}: {e}"));
    }
    assert_eq!(dev.take_stale_handle_calls(), 0);
    dev.destroy_stream(s1).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

// ---------------------------------------------------------------------------------------------
// Area 1: traces as `cuarena_trace_start` / `cuarena_trace_stop` drive them (`start_trace`,
// `stop_trace` of the device's allocator).

/// Start twice, stop without a start, paths that cannot be written (a directory, a missing
/// directory, an empty path, a full device): each refused with the reason, and a later trace
/// to a good path works (nothing is left marked busy).
#[test]
fn trace_start_and_stop_refuse_misuse_and_recover() {
    let dev = host(50);
    let a = host_allocator(dev.clone(), Config::default()).unwrap();
    let dir = scratch("trace-misuse");
    let good = dir.join("t.bin");
    assert!(a.stop_trace().is_err(), "stop without a start");
    for bad in [dir.clone(), dir.join("missing/t.bin"), PathBuf::from("")] {
        let r = a.start_trace(&bad);
        assert!(matches!(&r, Err(Error::Trace(m)) if !m.is_empty()), "{}: {r:?}", bad.display());
        assert!(a.stop_trace().is_err(), "a refused start left a trace running");
    }
    // A device that takes the file but not the writes: the error comes at the stop.
    if Path::new("/dev/full").exists() {
        a.start_trace("/dev/full").unwrap();
        let p = a.allocate(4096, Stream::LEGACY).unwrap();
        a.deallocate(p, 4096, Stream::LEGACY).unwrap();
        let r = a.stop_trace();
        assert!(matches!(&r, Err(Error::Trace(m)) if m.contains("writing")), "{r:?}");
    }
    a.start_trace(&good).unwrap();
    let r = a.start_trace(&good);
    assert!(matches!(&r, Err(Error::Trace(m)) if m.contains("already running")), "{r:?}");
    let r = a.start_trace(dir.join("other.bin"));
    assert!(r.is_err(), "a second trace on one allocator: {r:?}");
    let p = a.allocate(4096, Stream::LEGACY).unwrap();
    a.deallocate(p, 4096, Stream::LEGACY).unwrap();
    let sum = a.stop_trace().unwrap();
    assert_eq!(sum.records, 2);
    assert_eq!(trace::read(&good).unwrap().len(), 2);
    assert!(a.stop_trace().is_err(), "a second stop");
    // The path is free again, for this allocator and for another.
    let b = host_allocator(dev.clone(), Config::default()).unwrap();
    b.start_trace(&good).unwrap();
    b.stop_trace().unwrap();
    assert_all_returned(&a, Some(&dev), 0);
    let _ = std::fs::remove_dir_all(dir);
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: Two traces must not write one file: `start_file`
/// refuses a path already being written in this process, but it compares
/// `std::path::absolute` forms, which keep `..` and do not follow symbolic links. So the same
/// file named `d/sub/../t.bin` or through a link is taken by a second allocator's trace, and
/// the two writers overwrite each other's header and records: the file no longer reads back
/// as what either recorded.
#[test]
fn one_file_cannot_be_traced_twice_under_another_name() {
    let dev = host(50);
    let dir = scratch("trace-alias");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let path = dir.join("t.bin");
    let link = dir.join("link.bin");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let a = host_allocator(dev.clone(), Config::default()).unwrap();
    a.start_trace(&path).unwrap();
    let mut accepted = Vec::new();
    for alias in [dir.join("sub/../t.bin"), link.clone()] {
        let b = host_allocator(dev.clone(), Config::default()).unwrap();
        if b.start_trace(&alias).is_ok() {
            accepted.push(alias.display().to_string());
            for i in 0..5000 {
                let q = b.allocate(256 + i, Stream::LEGACY).unwrap();
                b.deallocate(q, 256 + i, Stream::LEGACY).unwrap();
            }
            b.stop_trace().unwrap();
        }
    }
    for i in 0..100 {
        let q = a.allocate(256 + i, Stream::LEGACY).unwrap();
        a.deallocate(q, 256 + i, Stream::LEGACY).unwrap();
    }
    let sum = a.stop_trace().unwrap();
    let back = trace::read(&path).map(|r| r.len());
    assert!(
        accepted.is_empty(),
        "the file being traced was taken by a second trace under {accepted:?}; the first trace \
         wrote {} records, the file now reads back as {back:?}",
        sum.records
    );
    assert_eq!(back.unwrap(), sum.records as usize);
    assert_all_returned(&a, Some(&dev), 0);
    let _ = std::fs::remove_dir_all(dir);
}

/// Many threads allocate and free through the C ABI's free path (`free_with`, with
/// `record_stream` declarations) while one thread trims, reads statistics and starts and stops
/// traces, and others start and stop traces at the same time: no block handed out twice, no
/// race, every trace file reads back with alloc and free alternating per address, every byte
/// comes back.
#[test]
fn abi_churn_with_concurrent_trim_stats_and_trace_start_stop() {
    let dev = host(50);
    let a =
        host_allocator(dev.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,batch=4")).unwrap();
    let rec = Recorded::new(1 << 12);
    let live = Live::default();
    let stop = AtomicU64::new(0); // churn threads done
    let dir = scratch("trace-churn");
    let traces = Mutex::new(Vec::<PathBuf>::new());
    let seq = AtomicU64::new(0);
    let user = dev.create_stream();
    {
        {
            std::thread::scope(|s| {
                for t in 0..4u64 {
                    let (a, rec, live, dev, stop) = (&a, &rec, &live, &dev, &stop);
                    s.spawn(move || {
                        let mut x = 0x9e37_79b9_7f4a_7c15 ^ (t + 1);
                        let mut held: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                        for i in 0..3000 {
                            let r = rng(&mut x);
                            let size = [1usize, 256, 4000, 64 << 10, 100_000, 3 << 20][r as usize % 6]
                                + (r >> 32) as usize % 300;
                            let st = [Stream::LEGACY, Stream::PER_THREAD, user][(r >> 8) as usize % 3];
                            if held.len() < 24 && !(r >> 16).is_multiple_of(3) {
                                let p = a.allocate(size, st).unwrap_or_else(|e| panic!("{e}"));
                                live.insert(p, size);
                                if i % 7 == 0 {
                                    dev.write_tag(p.0, 256, i, st).unwrap();
                                    record_with(std::iter::once(a), rec, p.0, Stream::PER_THREAD).unwrap();
                                }
                                held.push((p, size, st));
                            } else if let Some((p, size, st)) = held.pop() {
                                live.remove(p);
                                free_with(a, rec, p.0, size, st).unwrap_or_else(|e| panic!("{e}"));
                            }
                        }
                        for (p, size, st) in held {
                            live.remove(p);
                            free_with(a, rec, p.0, size, st).unwrap();
                        }
                        a.release_thread().unwrap();
                        stop.fetch_add(1, Ordering::Relaxed);
                    });
                }
                for c in 0..3 {
                    let (a, stop, dir, traces, seq) = (&a, &stop, &dir, &traces, &seq);
                    s.spawn(move || {
                        while stop.load(Ordering::Relaxed) < 4 || seq.load(Ordering::Relaxed) < 30 {
                            if c == 0 {
                                a.trim(seq.load(Ordering::Relaxed) % 2 == 0).unwrap();
                                let st = a.stats();
                                assert!(st.pool_in_use_bytes <= st.reserved_bytes, "{st:?}");
                            }
                            let n = seq.fetch_add(1, Ordering::Relaxed);
                            let p = dir.join(format!("t{n}.bin"));
                            if a.start_trace(&p).is_ok() {
                                traces.lock().unwrap().push(p);
                            }
                            std::thread::sleep(Duration::from_millis(2));
                            let _ = a.stop_trace(); // may be another thread's trace: fine
                        }
                    });
                }
            });
        }
    }
    live.assert_clean();
    let _ = a.stop_trace();
    let traces = traces.into_inner().unwrap();
    assert!(traces.len() >= 5, "only {} traces ran", traces.len());
    for p in &traces {
        let recs = trace::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let mut sorted = recs.clone();
        sorted.sort_by_key(|r| r.time_ns);
        let mut state: std::collections::HashMap<u64, bool> = Default::default();
        for r in sorted {
            let alloc = match r.action {
                Action::Alloc => true,
                Action::Free => false,
                other => panic!("{}: unexpected {other:?}", p.display()),
            };
            if let Some(&was) = state.get(&r.ptr) {
                assert_ne!(was, alloc, "{}: two {:?} in a row at {:#x}", p.display(), r.action, r.ptr);
            }
            state.insert(r.ptr, alloc);
        }
    }
    dev.destroy_stream(user).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Area 1: calls during process exit.

unsafe extern "C" {
    fn atexit(cb: extern "C" fn()) -> c_int;
    fn _exit(code: c_int) -> !;
}

/// Runs during exit, after cuarena's hook marked the process as exiting: every entry point
/// that would make a device's allocator (CUDA calls into a driver being torn down) or start a
/// trace that nothing will end must refuse with the shut-down error. Prints what each said.
extern "C" fn calls_during_exit() {
    let shut = Error::ShutDown.to_string();
    let mut wrong = Vec::new();
    let mut check = |what: &str, failed: bool| {
        let e = err();
        if !failed || e != shut {
            wrong.push(format!("{what}: failed={failed}, error `{e}`"));
        }
    };
    check("malloc", cuarena_malloc(4096, 3, NULL).is_null());
    let mut st = cuarena_stats::default();
    // SAFETY: a valid cuarena_stats.
    check("get_stats", unsafe { cuarena_get_stats(3, &mut st) } == -1);
    check("reset_peak", cuarena_reset_peak(3) == -1);
    check("reset_counters", cuarena_reset_counters(3) == -1);
    // SAFETY: n is 0.
    check("get_size_histogram", unsafe { cuarena_get_size_histogram(3, std::ptr::null_mut(), 0) } == -1);
    check("set_oom_hook", cuarena_set_oom_hook(3, None, NULL) == -1);
    let path = CString::new(std::env::var("CUARENA_S16_EXIT_TRACE").unwrap()).unwrap();
    // SAFETY: NUL-terminated.
    check("trace_start", unsafe { cuarena_trace_start(3, path.as_ptr()) } == -1);
    cuarena_set_memory_fraction(0.5, 3);
    check("set_memory_fraction", true);
    for w in &wrong {
        eprintln!("child: {w}");
    }
    eprintln!("child: {} calls made no shut-down refusal", wrong.len());
    // SAFETY: `_exit` ends the process at once.
    unsafe { _exit(if wrong.is_empty() { 0 } else { 3 }) }
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: The header: "Once process exit has begun, cuarena
/// makes no CUDA call". Only `malloc`, `free`, `record_stream` and `empty_cache` check for it;
/// `get_stats`, `reset_peak`, `reset_counters`, `get_size_histogram`, `set_oom_hook`,
/// `set_memory_fraction` and `trace_start` call `global(device)`, which creates a device's
/// allocator (driver load, `cuInit`, a context) from an `atexit` handler or a late destructor;
/// `trace_start` then starts a trace after the exit hook that ends traces has run (its file is
/// never completed). Without a driver the tell is the error: "no CUDA driver" (the driver was
/// looked for) instead of the shut-down error.
#[test]
fn entry_points_during_process_exit_refuse_with_the_shut_down_error() {
    if std::env::var_os("CUARENA_S16_EXIT_CHILD").is_some() {
        // Registered first, so it runs after cuarena's hook, registered just below.
        // SAFETY: a plain function that lives for the whole process.
        assert_eq!(unsafe { atexit(calls_during_exit) }, 0);
        cuarena::shutdown::install_exit_hook();
        return;
    }
    let dir = scratch("exit");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "entry_points_during_process_exit_refuse_with_the_shut_down_error", "--nocapture"])
        .env("CUARENA_S16_EXIT_CHILD", "1")
        .env("CUARENA_S16_EXIT_TRACE", dir.join("t.bin"))
        .env_remove("CUARENA_CONF")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("calls made no shut-down refusal"),
        "the child did not reach its exit handler:\n{text}"
    );
    assert_eq!(out.status.code(), Some(0), "child:\n{text}");
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------------
// Area 2: trace files as untrusted input to `cuarena replay` and `cuarena trace-csv`.

const LIMIT: Duration = Duration::from_secs(60);

/// A record for a binary trace.
fn rec(thread: u32, time_ns: u64, action: Action, ptr: u64, size: u64) -> Record {
    Record {
        time_ns,
        ptr,
        size,
        stream: StreamKey(0),
        thread,
        action,
        path: TracePath::None,
        stream_kind: StreamKind::Legacy,
    }
}

/// Truncated files, a wrong magic, another version or record size, unknown enum values, an
/// empty file: `replay` and `trace-csv` each refuse with the reason and status 1, and
/// `trace-csv` writes no output.
#[test]
fn cli_refuses_malformed_binary_traces() {
    let dir = scratch("cli-binary");
    let good = {
        let mut b = trace::header().to_vec();
        b.extend_from_slice(&rec(0, 1, Action::Alloc, 0x1000, 256).encode());
        b
    };
    let with = |at: usize, v: &[u8]| {
        let mut b = good.clone();
        b[at..at + v.len()].copy_from_slice(v);
        b
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "no CUATRACE header"),
        ("short header", good[..10].to_vec(), "no CUATRACE header"),
        ("header only, 15 bytes", good[..15].to_vec(), "no CUATRACE header"),
        ("wrong magic", with(0, b"CUATRACX"), "no CUATRACE header"),
        ("version 2", with(8, &2u32.to_le_bytes()), "version 2"),
        ("version u32::MAX", with(8, &u32::MAX.to_le_bytes()), "version 4294967295"),
        ("record size 41", with(12, &41u32.to_le_bytes()), "41-byte records"),
        ("record size 0", with(12, &0u32.to_le_bytes()), "0-byte records"),
        ("truncated record", good[..good.len() - 1].to_vec(), "truncated"),
        ("unknown action", with(16 + 36, &[9]), "unknown action 9"),
        ("unknown path", with(16 + 37, &[200]), "unknown path 200"),
        ("unknown stream kind", with(16 + 38, &[3]), "unknown stream kind 3"),
    ];
    for (what, bytes, needle) in cases {
        let f = dir.join(what.replace(' ', "_"));
        std::fs::write(&f, &bytes).unwrap();
        cuarena(&replay_args(&f, "cuarena", &[]), LIMIT).assert_refused(&format!("replay: {what}"), needle);
        let out = dir.join("out.csv");
        cuarena(&[os("trace-csv"), f.as_os_str(), out.as_os_str()], LIMIT)
            .assert_refused(&format!("trace-csv: {what}"), needle);
        assert!(!out.exists(), "trace-csv: {what}: an output was written");
    }
    // A header and no record: nothing to replay (status 1), and an empty CSV (status 0).
    let f = dir.join("header-only");
    write_trace(&f, &[]);
    cuarena(&replay_args(&f, "cuarena", &[]), LIMIT)
        .assert_refused("replay: no records", "nothing to replay");
    let out = dir.join("out.csv");
    let r = cuarena(&[os("trace-csv"), f.as_os_str(), out.as_os_str()], LIMIT);
    assert_eq!(r.code(), Some(0), "{}", r.show());
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), trace::CSV_HEADER);
    let _ = std::fs::remove_dir_all(dir);
}

/// A directory, a missing file and an unreadable special file as input, in every format; a
/// directory, a missing directory and a full device as `trace-csv`'s output.
#[test]
fn cli_refuses_directories_missing_files_and_unwritable_outputs() {
    let dir = scratch("cli-paths");
    let missing = dir.join("missing.bin");
    for input in [dir.as_path(), missing.as_path()] {
        for format in ["cuarena", "cuarena-csv", "rmm-csv"] {
            cuarena(&replay_args(input, format, &[]), LIMIT).assert_refused(
                &format!("replay {} --format {format}", input.display()),
                &input.display().to_string(),
            );
        }
        let out = dir.join("o.csv");
        cuarena(&[os("trace-csv"), input.as_os_str(), out.as_os_str()], LIMIT)
            .assert_refused(&format!("trace-csv {}", input.display()), &input.display().to_string());
    }
    let f = dir.join("t.bin");
    write_trace(&f, &[rec(0, 1, Action::Alloc, 0x1000, 256), rec(0, 2, Action::Free, 0x1000, 256)]);
    let unwritable = [dir.clone(), dir.join("missing/o.csv"), PathBuf::from("/dev/full")];
    for out in unwritable.iter().filter(|o| !o.starts_with("/dev") || o.exists()) {
        cuarena(&[os("trace-csv"), f.as_os_str(), out.as_os_str()], LIMIT)
            .assert_refused(&format!("trace-csv to {}", out.display()), "error: writing");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Bad CSV rows in both CSV formats: negative, non-numeric and overflowing numbers, missing and
/// extra fields, unknown names, a bad header, no header, bytes that are not UTF-8: status 1 and
/// an error naming the line (the header's problems name line 1).
#[test]
fn cli_refuses_bad_csv_rows_with_the_line() {
    let dir = scratch("cli-csv");
    let h = trace::CSV_HEADER;
    let ok = "0,10,alloc,0x1000,256,legacy,0,arena";
    let cuarena_rows: Vec<(&str, String, &str)> = vec![
        ("negative size", format!("{h}\n{ok}\n0,20,free,0x1000,-256,legacy,0,arena\n"), "line 3: bad size"),
        (
            "size 2^64",
            format!("{h}\n0,10,alloc,0x1000,18446744073709551616,legacy,0,arena\n"),
            "line 2: bad size",
        ),
        ("non-numeric time", format!("{h}\n0,ten,alloc,0x1000,256,legacy,0,arena\n"), "line 2: bad time"),
        ("negative time", format!("{h}\n0,-10,alloc,0x1000,256,legacy,0,arena\n"), "line 2: bad time"),
        (
            "thread 2^32",
            format!("{h}\n4294967296,10,alloc,0x1000,256,legacy,0,arena\n"),
            "line 2: bad thread",
        ),
        ("bad pointer", format!("{h}\n0,10,alloc,0xZZ,256,legacy,0,arena\n"), "line 2: bad pointer"),
        (
            "pointer 2^64",
            format!("{h}\n0,10,alloc,0x10000000000000000,256,legacy,0,arena\n"),
            "line 2: bad pointer",
        ),
        ("unknown action", format!("{h}\n0,10,malloc,0x1000,256,legacy,0,arena\n"), "line 2: unknown action"),
        (
            "unknown kind",
            format!("{h}\n0,10,alloc,0x1000,256,green,0,arena\n"),
            "line 2: unknown stream kind",
        ),
        ("unknown path", format!("{h}\n0,10,alloc,0x1000,256,legacy,0,heap\n"), "line 2: unknown path"),
        ("7 fields", format!("{h}\n0,10,alloc,0x1000,256,legacy,0\n"), "line 2: expected 8 fields"),
        ("9 fields", format!("{h}\n{ok},x\n"), "line 2: expected 8 fields"),
        ("bad header", format!("thread,time\n{ok}\n"), "line 1: header"),
        ("empty", String::new(), "empty file"),
    ];
    for (what, text, needle) in cuarena_rows {
        let f = dir.join(format!("c-{}", what.replace(' ', "_")));
        std::fs::write(&f, text).unwrap();
        cuarena(&replay_args(&f, "cuarena-csv", &[]), LIMIT)
            .assert_refused(&format!("cuarena-csv: {what}"), needle);
    }
    let rh = "Thread,Time,Action,Pointer,Size,Stream";
    let rmm_rows: Vec<(&str, String, &str)> = vec![
        ("negative size", format!("{rh}\n1,1.0,allocate,0x1000,-5,0x0\n"), "line 2: bad size"),
        ("size 2^64", format!("{rh}\n1,1.0,allocate,0x1000,18446744073709551616,0x0\n"), "line 2: bad size"),
        ("negative time", format!("{rh}\n1,-1.0,allocate,0x1000,256,0x0\n"), "line 2: bad time"),
        ("time inf", format!("{rh}\n1,inf,allocate,0x1000,256,0x0\n"), "line 2: bad time"),
        ("time NaN", format!("{rh}\n1,NaN,allocate,0x1000,256,0x0\n"), "line 2: bad time"),
        (
            "time with a 10-digit fraction",
            format!("{rh}\n1,01:02:03.1234567890,allocate,0x1000,256,0x0\n"),
            "line 2: bad time",
        ),
        ("bad pointer", format!("{rh}\n1,1.0,allocate,pointer,256,0x0\n"), "line 2: bad pointer"),
        ("bad stream", format!("{rh}\n1,1.0,allocate,0x1000,256,stream\n"), "line 2: bad stream"),
        ("unknown action", format!("{rh}\n1,1.0,realloc,0x1000,256,0x0\n"), "line 2: unknown action"),
        ("missing field", format!("{rh}\n1,1.0,allocate,0x1000,256\n"), "line 2: expected 6 fields"),
        (
            "no size column",
            "Thread,Time,Action,Pointer\n1,1.0,allocate,0x1000\n".to_string(),
            "no `size` column",
        ),
        ("empty", String::new(), "empty file"),
    ];
    for (what, text, needle) in rmm_rows {
        let f = dir.join(format!("r-{}", what.replace(' ', "_")));
        std::fs::write(&f, text).unwrap();
        cuarena(&replay_args(&f, "rmm-csv", &[]), LIMIT).assert_refused(&format!("rmm-csv: {what}"), needle);
    }
    // Not UTF-8, in both formats: refused with the file named.
    for format in ["cuarena-csv", "rmm-csv"] {
        let f = dir.join(format!("latin1-{format}"));
        let mut b = if format == "rmm-csv" { rh.as_bytes().to_vec() } else { h.as_bytes().to_vec() };
        b.extend_from_slice(b"\n0,10,alloc\xe9,0x1000,256,legacy,0,arena\n");
        std::fs::write(&f, b).unwrap();
        cuarena(&replay_args(&f, format, &[]), LIMIT)
            .assert_refused(&format!("{format}: not UTF-8"), "UTF-8");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: An RMM time of
/// `H:M:S` whose hours overflow nanoseconds: `rmm_time` computes `((h * 60 + m) * 60 + sec) *
/// 1e9` unchecked: a panic (attempt to multiply with overflow) in a debug build, a silently
/// wrapped time (a wrong replay order) in a release build. Expected: "line 2: bad time".
#[test]
fn cli_refuses_an_rmm_time_that_overflows() {
    let dir = scratch("cli-rmm-time");
    for t in ["999999999999999999:00:00", "5124096:00:00", "0:0:18446744074", "0:307445734561825861:0"] {
        let f = dir.join("t.csv");
        std::fs::write(
            &f,
            format!("Thread,Time,Action,Pointer,Size,Stream\n1,{t},allocate,0x1000,256,0x0\n"),
        )
        .unwrap();
        cuarena(&replay_args(&f, "rmm-csv", &[]), LIMIT)
            .assert_refused(&format!("time {t}"), "line 2: bad time");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Frees of addresses never allocated, double frees, an address allocated twice without a
/// free, failed allocations and refused frees inside the trace: the replay skips and counts
/// them, and no allocator sees an invalid free (no failure, status 0).
#[test]
fn cli_replays_a_trace_with_unmatched_and_double_frees_without_failures() {
    let dir = scratch("cli-unmatched");
    let f = dir.join("t.bin");
    let mut recs = vec![
        rec(0, 1, Action::Free, 0xdead_0000, 256),         // never allocated
        rec(0, 2, Action::Alloc, 0x1000, 256),             //
        rec(0, 3, Action::Free, 0x1000, 256),              //
        rec(0, 4, Action::Free, 0x1000, 256),              // double free
        rec(1, 5, Action::Free, 0x1000, 256),              // and again, on another thread
        rec(1, 6, Action::Alloc, 0x2000, 512),             //
        rec(1, 7, Action::Alloc, 0x2000, 1024),            // again while live
        rec(0, 8, Action::Free, 0x2000, 1024),             // another thread's block
        rec(0, 9, Action::FailedAlloc, 0, 1 << 40),        // not played
        rec(0, 10, Action::RefusedFree, 0xbeef_0000, 256), // not played
        rec(1, 11, Action::Free, 0, 0),                    // a free of NULL
    ];
    for i in 0..200u64 {
        recs.push(rec((i % 3) as u32, 100 + i, Action::Free, 0x9000_0000 + i * 256, 256));
    }
    write_trace(&f, &recs);
    let r = cuarena(&replay_args(&f, "cuarena", &["--json"]), LIMIT);
    assert_eq!(r.code(), Some(0), "{}", r.show());
    // 200 + the never-allocated one + two double frees + the free of NULL.
    assert!(r.stderr.contains("204 unmatched frees"), "{}", r.show());
    assert!(r.stderr.contains("2 failed or refused in the trace"), "{}", r.show());
    let rows: Vec<&str> = r.stdout.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(rows.len(), 2, "one row per allocator: {}", r.show());
    for row in rows {
        assert!(row.contains("\"failed_allocs\":0") && row.contains("\"failed_frees\":0"), "{row}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Absurd sizes in the trace (2^63, `u64::MAX`, two 2^63 blocks live at once): each allocator
/// refuses them as out of memory and the replay ends with status 1 and its table, no panic.
/// A defect this attack found, now fixed (the test failed before the fix). Before it: two 2^63 blocks
/// live at once overflow `Plan::new`'s running total of live bytes (`now += op.size`,
/// benches/src/replay.rs): a panic in debug, a wrapped peak in release; and `u64::MAX` makes
/// the host baseline's `size.next_multiple_of(256)` overflow (benches/src/lib.rs, `MutexPool`).
#[test]
fn cli_survives_absurd_sizes() {
    let dir = scratch("cli-sizes");
    let cases: Vec<(&str, Vec<Record>)> = vec![
        ("2^63", vec![rec(0, 1, Action::Alloc, 0x1000, 1 << 63), rec(0, 2, Action::Free, 0x1000, 1 << 63)]),
        (
            "u64::MAX",
            vec![rec(0, 1, Action::Alloc, 0x1000, u64::MAX), rec(0, 2, Action::Free, 0x1000, u64::MAX)],
        ),
        (
            "two 2^63 live",
            vec![
                rec(0, 1, Action::Alloc, 0x1000, 1 << 63),
                rec(0, 2, Action::Alloc, 0x2000, 1 << 63),
                rec(0, 3, Action::Free, 0x1000, 1 << 63),
                rec(0, 4, Action::Free, 0x2000, 1 << 63),
            ],
        ),
    ];
    let mut bad = Vec::new();
    for (what, recs) in cases {
        let f = dir.join("t.bin");
        write_trace(&f, &recs);
        for alloc in ["cuarena", "mutex-first-fit"] {
            let r = cuarena_capped(8 << 20, &replay_args(&f, "cuarena", &["--allocators", alloc]), LIMIT);
            let clean = r.code() == Some(1)
                && !r.stderr.contains("panicked")
                && !r.stderr.contains("memory allocation of")
                && r.stdout.contains(alloc);
            if !clean {
                bad.push(format!("{what} on {alloc}: {}", r.show()));
            }
        }
    }
    assert!(bad.is_empty(), "{} of 6 runs did not end cleanly:\n{}", bad.len(), bad.join("\n---\n"));
    let _ = std::fs::remove_dir_all(dir);
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: A block the trace allocates on
/// one thread and frees on another: the freeing thread waits until the allocation has happened
/// in the replay. When the allocating replay thread panics (here the host baseline's
/// `next_multiple_of` overflow on a `u64::MAX` size), the slot is never filled, the waiter spins
/// forever and `std::thread::scope` never returns: the replay hangs (killed here after 60 s).
/// Expected: a clean failure (the allocation counted as failed, or the error reported).
#[test]
fn cli_does_not_hang_when_a_replay_thread_dies() {
    let dir = scratch("cli-hang");
    let f = dir.join("t.bin");
    write_trace(&f, &[rec(0, 1, Action::Alloc, 0x1000, u64::MAX), rec(1, 2, Action::Free, 0x1000, u64::MAX)]);
    let r =
        cuarena(&replay_args(&f, "cuarena", &["--allocators", "mutex-first-fit"]), Duration::from_secs(30));
    r.assert_clean_end("a cross-thread free of a block whose allocation panicked");
    let _ = std::fs::remove_dir_all(dir);
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: An endless input (`/dev/zero`): `trace::read` reads
/// the whole file before it looks at the magic (`std::fs::read`), and the CSV readers read the
/// first line before they look at it (`BufRead::lines`), so each keeps allocating until the
/// host's memory is gone; under a 2 GiB address-space cap here, an abort ("memory allocation of
/// N bytes failed"). Expected: the magic / header refused after its first bytes.
#[test]
fn cli_refuses_an_endless_input_without_taking_all_memory() {
    let zero = Path::new("/dev/zero");
    if !zero.exists() {
        return;
    }
    // The control: a valid trace replays fine under the same cap.
    let dir = scratch("cli-zero");
    let f = dir.join("t.bin");
    write_trace(&f, &[rec(0, 1, Action::Alloc, 0x1000, 256), rec(0, 2, Action::Free, 0x1000, 256)]);
    let r = cuarena_capped(2 << 20, &replay_args(&f, "cuarena", &[]), LIMIT);
    assert_eq!(r.code(), Some(0), "the control run failed: the cap alone breaks the replay\n{}", r.show());
    let _ = std::fs::remove_dir_all(dir);
    let mut bad = Vec::new();
    for (format, needle) in
        [("cuarena", "no CUATRACE header"), ("cuarena-csv", "line 1"), ("rmm-csv", "line 1")]
    {
        let r = cuarena_capped(2 << 20, &replay_args(zero, format, &[]), Duration::from_secs(60));
        let ok =
            r.code() == Some(1) && r.stderr.contains(needle) && !r.stderr.contains("memory allocation of");
        if !ok {
            bad.push(format!("--format {format}: {}", r.show()));
        }
    }
    let out = std::env::temp_dir().join(format!("cuarena-s16-{}-zero.csv", std::process::id()));
    let r = cuarena_capped(
        2 << 20,
        &[os("trace-csv"), zero.as_os_str(), out.as_os_str()],
        Duration::from_secs(60),
    );
    if !(r.code() == Some(1) && r.stderr.contains("no CUATRACE header")) {
        bad.push(format!("trace-csv: {}", r.show()));
    }
    let _ = std::fs::remove_file(out);
    assert!(bad.is_empty(), "{} of 4 runs did not refuse /dev/zero:\n{}", bad.len(), bad.join("\n---\n"));
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: Every recorded thread becomes an OS thread, all alive
/// at once (`Bench::replay` spawns them in one `std::thread::scope` with `Scope::spawn`, which
/// panics when the OS refuses a thread). A trace of 3000 one-record threads (120 KB) under a
/// 1.5 GiB address-space cap (2 MiB stacks) stands for a bigger trace on a bigger machine (this
/// one's pid_max is 32768): a panic ("failed to spawn thread"). Expected: a clean error or a
/// cap on the replay's threads.
#[test]
fn cli_survives_a_trace_with_thousands_of_threads() {
    let dir = scratch("cli-threads");
    let f = dir.join("t.bin");
    let trace_of = |n: u32| -> Vec<Record> {
        (0..n).map(|t| rec(t, t as u64, Action::Alloc, 0x1000 + t as u64 * 256, 256)).collect()
    };
    // The control: 50 threads replay fine under the same cap.
    write_trace(&f, &trace_of(50));
    let r = cuarena_capped(1536 << 10, &replay_args(&f, "cuarena", &["--allocators", "harness"]), LIMIT);
    assert_eq!(r.code(), Some(0), "the control run failed: the cap alone breaks the replay\n{}", r.show());
    write_trace(&f, &trace_of(3000));
    let r = cuarena_capped(1536 << 10, &replay_args(&f, "cuarena", &["--allocators", "harness"]), LIMIT);
    r.assert_clean_end("3000 recorded threads");
    let _ = std::fs::remove_dir_all(dir);
}

/// A defect this attack found, now fixed (the test failed before the fix). Before it: `cuarena replay ... | head -0`: the table is printed
/// with `println!`, which panics when stdout is a closed pipe (Rust ignores SIGPIPE). Expected:
/// an exit without a panic (`trace-csv` already handles it: `write_csv` returns the error).
#[test]
fn cli_replay_to_a_closed_pipe_does_not_panic() {
    let dir = scratch("cli-pipe");
    let f = dir.join("t.bin");
    write_trace(&f, &[rec(0, 1, Action::Alloc, 0x1000, 256), rec(0, 2, Action::Free, 0x1000, 256)]);
    let r = run_limited(cli(), &replay_args(&f, "cuarena", &[]), LIMIT, true);
    assert!(r.status.is_some() && !r.stderr.contains("panicked"), "replay into a closed pipe:\n{}", r.show());
    let r = run_limited(cli(), &[os("trace-csv"), f.as_os_str(), os("-")], LIMIT, true);
    assert!(
        r.code() == Some(1) && r.stderr.contains("error: writing"),
        "trace-csv into a closed pipe:\n{}",
        r.show()
    );
    let _ = std::fs::remove_dir_all(dir);
}
