//! Twenty-fifth session's attacks (helper b): `CUARENA_CONF` parsing (`Config::parse`, and the
//! environment path the process-wide allocators take: `Config::from_env_over` under
//! `global::global`), and the C ABI (`capi/src/lib.rs`, compiled in with `#[path]` as
//! `tests/ffi.rs` does).
//!
//! Configuration: every key at and just past each bound, duplicates, empty items, Unicode
//! look-alikes, sizes that overflow only once multiplied by their unit, negative numbers,
//! percentages of 0 and over 100, bare fractions, odd whitespace. Each string must give either
//! exactly the configuration its documentation says, or an error that names the key (and
//! `CUARENA_CONF`), never a panic.
//!
//! The environment path: a child process (this test binary re-run on one test) sets
//! `CUARENA_CONF` to each bad string in turn and calls `cuarena_malloc`: with no CUDA driver
//! here, a valid string fails with "no CUDA driver" and a bad one with its own error naming the
//! key, and a `trace=` path is never created or truncated by an allocator that was not made.
//!
//! The C ABI: what runs with no driver (the statistics peek, the per-thread last error), and
//! what the entry points do with a live allocator on the simulated device (`malloc_with`,
//! `free_with`, `record_with`): a free from another thread after the allocating thread exited,
//! size 0 and `usize::MAX`, foreign pointers.

use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuarena::config::Limit;
use cuarena::{Allocator, Config, Error, Stream};
use cuarena_testkit::{HostConfig, HostDevice};

/// The C ABI, compiled into this test to be called as Rust.
#[allow(dead_code)] // this test calls a subset of it
#[path = "../capi/src/lib.rs"]
mod cuarena_c;
use cuarena_c::*;

/// The process-wide allocators and the defaults are shared by the tests.
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

fn gpu_present() -> bool {
    cuarena::CudaDevice::new(0).is_ok()
}

fn conf_err(s: &str) -> String {
    match std::panic::catch_unwind(|| Config::parse(s)) {
        Err(_) => panic!("`{s}`: Config::parse panicked"),
        Ok(Ok(c)) => panic!("`{s}`: accepted as {c:?}"),
        Ok(Err(Error::Config(m))) => m,
        Ok(Err(e)) => panic!("`{s}`: not a configuration error: {e:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Config::parse: bounds, overflow, odd text.

/// Values at the edge of each range are accepted as exactly what they say.
#[test]
fn every_key_at_its_bound_is_accepted_as_written() {
    let b = Config::builder;
    let cases: Vec<(&str, Config)> = vec![
        ("keep_empty=1024", b().keep_empty(1024).build().unwrap()),
        ("keep_empty=0", b().keep_empty(0).build().unwrap()),
        ("batch=65536", b().batch_blocks(65536).build().unwrap()),
        ("batch_blocks=1", b().batch_blocks(1).build().unwrap()),
        ("legacy_batch=65536", b().legacy_batch_blocks(65536).build().unwrap()),
        ("legacy_batch_blocks=1", b().legacy_batch_blocks(1).build().unwrap()),
        (
            "superblock=64KiB,small_max=64KiB,large_max=64KiB,chunk=64KiB,max=64KiB",
            b().superblock(64 << 10)
                .small_max(64 << 10)
                .large_max(64 << 10)
                .chunk(64 << 10)
                .max_bytes(64 << 10)
                .build()
                .unwrap(),
        ),
        ("superblock=64MiB,chunk=64MiB", b().superblock(64 << 20).chunk(64 << 20).build().unwrap()),
        ("small_max=2MiB", b().small_max(2 << 20).build().unwrap()),
        ("large_max=64MiB", b().large_max(64 << 20).build().unwrap()),
        ("small_max=1B,large_max=1B", b().small_max(1).large_max(1).build().unwrap()),
        ("max=2MiB", b().max_bytes(2 << 20).build().unwrap()),
        ("max=18446744073709551615B", b().max_bytes(usize::MAX).build().unwrap()),
        ("max=100%", b().max_fraction(1.0).build().unwrap()),
        ("max=12.5 %", b().max_fraction(0.125).build().unwrap()),
        ("max_bytes=1e2%", b().max_fraction(1.0).build().unwrap()),
        ("batch_bytes=1B", b().batch_bytes(1).build().unwrap()),
        ("batch_bytes=18446744073709551615B", b().batch_bytes(usize::MAX).build().unwrap()),
        // (2^34 - 1) GiB + floor(0.99999999999 GiB) = 2^64 - 1 exactly: no rounding past it.
        ("batch_bytes=17179869183.99999999999GiB", b().batch_bytes(usize::MAX).build().unwrap()),
        ("legacy_batch_bytes=1B", b().legacy_batch_bytes(1).build().unwrap()),
        ("batch_bytes=512mb", b().batch_bytes(512_000_000).build().unwrap()),
        ("small_max=1.5 mib", b().small_max(3 << 19).build().unwrap()),
        ("small_max=1.99999999999999999999999999999999999999999KiB", b().small_max(2047).build().unwrap()),
        ("sparse=0.999", b().sparse_fraction(0.999).build().unwrap()),
        ("sparse_fraction=1e-300", b().sparse_fraction(1e-300).build().unwrap()),
        ("large_max=OFF", b().no_large().build().unwrap()),
        ("large_max=off,large_max=8MiB", b().large_max(8 << 20).build().unwrap()),
        ("stats=exact,stats=sampled", b().exact_stats(false).build().unwrap()),
        ("passthrough,passthrough=0", b().passthrough(false).build().unwrap()),
        // Duplicates: the last wins, aliases included.
        ("batch=4,batch=8,batch_blocks=2", b().batch_blocks(2).build().unwrap()),
        ("max=50%,max_bytes=4GiB", b().max_bytes(4 << 30).build().unwrap()),
        // Empty items and whitespace of every kind around items, keys and values.
        (" , ,\tbatch = 8 ,\n, ", b().batch_blocks(8).build().unwrap()),
        ("\u{a0}batch\u{a0}:\u{3000}8\u{a0}", b().batch_blocks(8).build().unwrap()),
        ("chunk=64\tMiB", b().chunk(64 << 20).build().unwrap()),
        ("", Config::default()),
        (",,,", Config::default()),
    ];
    for (s, want) in cases {
        match std::panic::catch_unwind(|| Config::parse(s)) {
            Ok(Ok(c)) => assert_eq!(c, want, "`{s}` parsed to another configuration"),
            Ok(Err(e)) => panic!("`{s}` refused: {e}"),
            Err(_) => panic!("`{s}`: panicked"),
        }
    }
}

/// Values just past each bound, overflows once multiplied by a unit, negative numbers,
/// percentages of 0 and over 100, bare fractions, look-alike characters: refused, and the error
/// names the key as written (for a range error, the key's own name) and `CUARENA_CONF`.
#[test]
fn every_key_just_past_its_bound_is_refused_naming_the_key() {
    let cases: &[(&str, &[&str])] = &[
        ("keep_empty=1025", &["keep_empty", "1025"]),
        ("keep_empty=-1", &["keep_empty", "negative"]),
        ("keep_empty=1.5", &["keep_empty"]),
        ("keep_empty=18446744073709551616", &["keep_empty"]),
        ("batch=65537", &["batch", "65537"]),
        ("batch=0", &["batch"]),
        ("batch=1e3", &["batch"]),
        ("batch_blocks=65537", &["batch"]),
        ("legacy_batch=65537", &["legacy_batch"]),
        ("legacy_batch_blocks=0", &["legacy_batch"]),
        ("superblock=32KiB", &["superblock"]),
        ("superblock=65535B", &["superblock"]),
        ("superblock=96KiB", &["superblock", "power of two"]),
        ("superblock=128MiB", &["superblock"]),
        ("small_max=2097153B", &["small_max"]),
        ("small_max=0B", &["small_max"]),
        ("small_max=-1MiB", &["small_max", "negative"]),
        ("small_max=1.5B", &["small_max"]),
        ("small_max=1", &["small_max", "no unit"]),
        ("small_max=1023", &["small_max", "no unit"]),
        ("large_max=67108865B", &["large_max"]),
        ("small_max=1MiB,large_max=1048575B", &["large_max"]),
        ("chunk=3MiB", &["chunk"]),
        ("chunk=0B", &["chunk"]),
        ("max=2097151B", &["max", "superblock"]),
        ("max=100.1%", &["max"]),
        ("max=0%", &["max"]),
        ("max=-0%", &["max"]),
        ("max=-5%", &["max"]),
        ("max=NaN%", &["max"]),
        ("max=inf%", &["max"]),
        ("max=1e400%", &["max"]),
        ("max=%", &["max"]),
        ("max=50%%", &["max"]),
        ("max=0.5", &["max=50%"]),
        ("max=80", &["max=80%"]),
        ("max_bytes=1", &["max_bytes=100%"]),
        ("max:0.125", &["max:12.5%"]),
        ("sparse=0", &["sparse"]),
        ("sparse=1", &["sparse"]),
        ("sparse=NaN", &["sparse"]),
        ("sparse=-0.5", &["sparse"]),
        ("sparse=inf", &["sparse"]),
        ("sparse_fraction=half", &["sparse_fraction"]),
        ("batch_bytes=0B", &["batch_bytes"]),
        ("batch_bytes=16777216TiB", &["batch_bytes", "overflows"]),
        ("batch_bytes=18446744073709551616B", &["batch_bytes", "overflows"]),
        ("legacy_batch_bytes=18446744073709551.616KB", &["legacy_batch_bytes", "overflows"]),
        ("chunk=99999999999999999999999999999999999999999999TiB", &["chunk", "overflows"]),
        ("legacy_batch_bytes=0KiB", &["legacy_batch_bytes"]),
        ("small_max=\u{ff11}MiB", &["small_max"]), // a full-width digit
        ("small_max=1\u{ff2d}iB", &["small_max"]), // a full-width M
        ("\u{ff53}mall_max=1MiB", &["\u{ff53}mall_max"]), // a full-width s
        ("Small_Max=1MiB", &["Small_Max"]),
        ("stats=EXACT", &["stats"]),
        ("passthrough=yes", &["passthrough"]),
        ("trace=/tmp/a:b", &["trace"]),
        ("small_max==1MiB", &["small_max"]),
        ("small_max=1MiB;max=80%", &["small_max"]),
        ("small_max=", &["small_max", "no value"]),
        ("=1MiB", &["no key"]),
        ("small_max 1MiB", &["small_max"]),
        ("large_max=of", &["large_max"]),
    ];
    for &(s, needles) in cases {
        let m = conf_err(s);
        assert!(
            m.contains("CUARENA_CONF"),
            "`{s}`: the error does not say where configuration comes from: {m}"
        );
        for n in needles {
            assert!(m.contains(n), "`{s}`: the error lacks `{n}`: {m}");
        }
    }
}

/// A tiny positive percentage is a documented value (a fraction in (0, 1]), and a cap below one
/// superblock on the device at hand: the allocator is made, every allocation is refused as out
/// of memory with the cap named, and nothing is reserved. Never a panic or a division by zero.
#[test]
fn a_vanishing_percentage_gives_a_clean_out_of_memory() {
    for s in ["max=1e-320%", "max=0.0001%", "max=0.00000000000000000000001%"] {
        let c = Config::parse(s).unwrap_or_else(|e| panic!("`{s}`: {e}"));
        assert!(matches!(c.max(), Limit::Fraction(f) if f > 0.0 && f < 1e-5), "`{s}`: {:?}", c.max());
        let dev = HostDevice::new(HostConfig { capacity: 8 << 30, ..HostConfig::default() });
        let a = Allocator::new(Arc::new(dev), c).unwrap();
        for (size, st) in
            [(256usize, Stream::PER_THREAD), (3 << 20, Stream::LEGACY), (100 << 20, Stream::LEGACY)]
        {
            match a.allocate(size, st) {
                Err(e @ Error::OutOfMemory { .. }) => assert!(e.to_string().contains("cap"), "{e}"),
                other => panic!("`{s}` size {size}: {other:?}"),
            }
        }
        assert_eq!(a.stats().reserved_bytes, 0, "`{s}`");
    }
}

// ---------------------------------------------------------------------------------------------
// The environment path, through the C ABI, with no driver.

/// `CUARENA_CONF` strings the child tries, with what its error must hold (`None`: valid, so
/// the failure is the missing driver).
const ENV_CASES: &[(&str, Option<&str>)] = &[
    ("small_max=1", Some("small_max")),
    ("keep_empty=1025", Some("keep_empty")),
    ("max=0.5", Some("max=50%")),
    ("max=101%", Some("max")),
    ("batch_bytes=16777216TiB", Some("batch_bytes")),
    ("bogus=1", Some("bogus")),
    ("superblock=4MiB,chunk=6MiB", Some("chunk")),
    (" , max:80% , small_max:512KiB , ", None),
    ("", None),
];

/// The child: each string in turn (the variable is read at each call, since a failed creation
/// is not cached), three calls each; the environment is not UTF-8 last (set by the parent).
fn env_child() {
    let trace = std::env::var("S25B_TRACE").unwrap();
    for &(conf, want) in ENV_CASES {
        // SAFETY: this child process runs this one test on its own thread, and no other thread
        // of it reads or writes the environment.
        unsafe { std::env::set_var("CUARENA_CONF", conf) };
        for _ in 0..3 {
            assert!(cuarena_malloc(4096, 0, NULL).is_null(), "`{conf}`");
            let e = err();
            match want {
                Some(n) => assert!(
                    e.contains("invalid cuarena configuration")
                        && e.contains(n)
                        && e.contains("CUARENA_CONF"),
                    "`{conf}`: {e}"
                ),
                None => assert!(e.contains("no CUDA driver"), "`{conf}`: {e}"),
            }
            assert_eq!(cuarena_free_checked(ptr(0x10_0000), 4096, 0, NULL), -1, "`{conf}`");
        }
    }
    // A trace path in a valid string: the allocator is never made, so the file is neither
    // created nor truncated.
    for conf in [format!("trace={trace}"), format!("trace={trace}.new")] {
        // SAFETY: as above.
        unsafe { std::env::set_var("CUARENA_CONF", &conf) };
        assert!(cuarena_malloc(4096, 0, NULL).is_null());
        assert!(err().contains("no CUDA driver"), "`{conf}`: {}", err());
    }
    // Defaults under CUARENA_CONF: a user string valid alone but not over the defaults is
    // refused, naming both.
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_set_defaults(c"superblock=4MiB,chunk=64MiB".as_ptr()) }, 0);
    // SAFETY: as above.
    unsafe { std::env::set_var("CUARENA_CONF", "chunk=6MiB") };
    assert!(cuarena_malloc(4096, 0, NULL).is_null());
    assert!(err().contains("chunk") && err().contains("superblock=4MiB,chunk=64MiB"), "{}", err());
    // SAFETY: NUL-terminated.
    assert_eq!(unsafe { cuarena_set_defaults(c"".as_ptr()) }, 0);
    // Not UTF-8.
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: as above.
    unsafe { std::env::set_var("CUARENA_CONF", std::ffi::OsStr::from_bytes(b"small_max=1MiB\xff")) };
    assert!(cuarena_malloc(4096, 0, NULL).is_null());
    assert!(err().contains("not valid UTF-8"), "{}", err());
    assert_eq!(cuarena::global::created().count(), 0);
    println!("s25b child: every CUARENA_CONF refused cleanly");
}

#[test]
fn cuarena_conf_errors_reach_the_c_abi_naming_the_key() {
    if std::env::var_os("S25B_CHILD").is_some() {
        return env_child();
    }
    if gpu_present() {
        return; // with a driver, valid strings would make allocators
    }
    let dir = std::env::temp_dir().join(format!("cuarena-s25b-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("kept.bin");
    std::fs::write(&trace, b"precious").unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cuarena_conf_errors_reach_the_c_abi_naming_the_key",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("S25B_CHILD", "1")
        .env("S25B_TRACE", &trace)
        .env_remove("CUARENA_CONF")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the child hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("every CUARENA_CONF refused cleanly"), "child:\n{text}");
    assert_eq!(std::fs::read(&trace).unwrap(), b"precious", "the trace file was truncated");
    assert!(!dir.join("kept.bin.new").exists(), "a trace file was created with no allocator");
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------------
// The C ABI with no driver.

/// `cuarena_peek_stats` never makes an allocator: 1 and zeros for any device, at the struct's
/// size, at a caller's size far larger (only this library's struct is written) and unaligned;
/// -2 below the first version's size and -1 for NULL, nothing written.
#[test]
fn peek_stats_answers_every_device_and_size_without_a_driver() {
    let _g = serial();
    let v1 = CUARENA_STATS_SIZE_V1;
    let full = size_of::<cuarena_stats>();
    for dev in [0, 1, -1, 63, 64, i32::MIN, i32::MAX] {
        let mut buf = vec![0xa5u8; full + 64];
        buf[1..9].copy_from_slice(&u64::MAX.to_ne_bytes());
        // SAFETY: `buf[1..]` holds a size of u64::MAX but only `full` bytes are ever written
        // (the library's struct), which `buf[1..]` has room for; unaligned is allowed.
        assert_eq!(unsafe { cuarena_peek_stats(dev, buf[1..].as_mut_ptr().cast()) }, 1, "dev {dev}");
        assert_eq!(u64::from_ne_bytes(buf[1..9].try_into().unwrap()), full as u64);
        assert!(buf[9..1 + full].iter().all(|&b| b == 0), "dev {dev}: not all zero");
        assert!(buf[1 + full..].iter().all(|&b| b == 0xa5), "dev {dev}: written past the struct");
        let mut small = vec![0xa5u8; v1];
        small[..8].copy_from_slice(&((v1 - 1) as u64).to_ne_bytes());
        // SAFETY: `small` has `v1 - 1` writable bytes (and more).
        assert_eq!(unsafe { cuarena_peek_stats(dev, small.as_mut_ptr().cast()) }, CUARENA_ERR_STATS_SIZE);
        assert!(small[8..].iter().all(|&b| b == 0xa5), "written on a refusal");
        assert!(err().contains("sizeof(cuarena_stats)"), "{}", err());
        // SAFETY: NULL is refused.
        assert_eq!(unsafe { cuarena_peek_stats(dev, std::ptr::null_mut()) }, -1);
        assert!(err().contains("out is NULL"), "{}", err());
    }
    assert_eq!(cuarena::global::created().count(), 0);
    assert_eq!(cuarena_graph_pool_use_count(1, 2, 0), 0);
    assert_eq!(cuarena_graph_pool_use_count(u64::MAX, u64::MAX, -7), 0);
}

/// The last error is per thread: a failure on one thread is not seen on another, a new thread
/// has none (NULL), a success does not clear it, and the string stays valid until this
/// thread's next failure.
#[test]
fn the_last_error_is_per_thread_and_stable() {
    let _g = serial();
    if gpu_present() {
        return;
    }
    assert!(cuarena_malloc(4096, 0, NULL).is_null());
    let mine = cuarena_last_error();
    assert!(!mine.is_null());
    std::thread::spawn(|| {
        assert!(cuarena_last_error().is_null(), "a new thread sees another's error");
        assert_eq!(cuarena_free_checked(NULL, 7, 0, NULL), -1);
        assert!(err().contains("driver") || err().contains("NULL") || err().contains("0x0"), "{}", err());
    })
    .join()
    .unwrap();
    assert_eq!(cuarena_version(), VERSION_NUMBER);
    cuarena_free(NULL, 0, 0, NULL); // a no-op success
    assert_eq!(cuarena_last_error(), mine, "a success or another thread changed this thread's error");
    // SAFETY: the string stays valid until this thread's next failing call, and none was made.
    let s = unsafe { std::ffi::CStr::from_ptr(mine) }.to_str().unwrap();
    assert!(s.contains("no CUDA driver"), "{s}");
    // SAFETY: static and NUL-terminated.
    let v = unsafe { std::ffi::CStr::from_ptr(cuarena_version_string()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

// ---------------------------------------------------------------------------------------------
// The C ABI's bodies with a live allocator, on the simulated device.

fn sim_allocator() -> (HostDevice, Allocator) {
    let dev = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let a = Allocator::new(Arc::new(dev.clone()), Config::default()).unwrap();
    (dev, a)
}

/// Blocks allocated through `malloc_with` by threads that have exited, on each kind of stream,
/// with and without `record_stream` declarations: freed through `free_with` by this thread,
/// each once (a second free is refused, also after a flush), every byte comes back, and the
/// declarations go with the frees.
#[test]
fn frees_after_the_allocating_thread_exited() {
    let (dev, a) = sim_allocator();
    let rec = Recorded::new(1 << 10);
    let user = dev.create_stream();
    let side = dev.create_stream();
    let sizes = [1usize, 256, 4097, 1 << 20, 3 << 20, 100 << 20];
    let blocks: Vec<(u64, usize, Stream)> = std::thread::scope(|s| {
        s.spawn(|| {
            let mut v = Vec::new();
            for st in [Stream::LEGACY, Stream::PER_THREAD, user] {
                for &size in &sizes {
                    let p = malloc_with(&a, &rec, size, st).unwrap();
                    if size == 4097 {
                        record_with(std::iter::once(&a), &rec, p, side).unwrap();
                    }
                    v.push((p, size, st));
                }
            }
            a.flush().unwrap();
            v
        })
        .join()
        .unwrap()
    });
    assert_eq!(rec.live(), 3);
    for &(p, size, st) in &blocks {
        // The allocating thread's per-thread stream is gone with it: free on the legacy stream.
        let st = if st == Stream::PER_THREAD { Stream::LEGACY } else { st };
        free_with(&a, &rec, p, size, st).unwrap_or_else(|e| panic!("{p:#x} ({size} B): {e}"));
        let again = free_with(&a, &rec, p, size, st);
        assert!(matches!(again, Err(Error::InvalidFree { .. })), "second free of {p:#x}: {again:?}");
    }
    a.flush().unwrap();
    for &(p, size, _) in &blocks {
        let again = free_with(&a, &rec, p, size, Stream::LEGACY);
        assert!(matches!(again, Err(Error::InvalidFree { .. })), "free after a flush of {p:#x}: {again:?}");
    }
    assert_eq!(rec.live(), 0);
    assert_eq!(a.stats().live_bytes, 0);
    cuarena_testkit::assert_all_returned(&a, Some(&dev), 2 * blocks.len() as u64);
}

/// Size 0 and huge sizes through the bodies of `cuarena_malloc` / `cuarena_free`: a size-0
/// allocation is NULL, a size-0 free of a live block is refused and the block stays live (its
/// correct free succeeds), NULL with a size is refused, and sizes near `usize::MAX` are out of
/// memory with nothing reserved past the cap; foreign and unaligned pointers are refused by
/// `record_with` as foreign, the table unchanged.
#[test]
fn size_zero_huge_sizes_and_foreign_pointers_through_the_abi_bodies() {
    let (dev, a) = sim_allocator();
    let rec = Recorded::new(1 << 10);
    for st in [Stream::LEGACY, Stream::PER_THREAD, dev.create_stream()] {
        assert_eq!(malloc_with(&a, &rec, 0, st).unwrap(), 0);
        free_with(&a, &rec, 0, 0, st).unwrap();
        for size in [300usize, 2 << 20, 70 << 20] {
            let p = malloc_with(&a, &rec, size, st).unwrap();
            let live = a.stats().live_bytes;
            for bad in [0usize, size * 8, usize::MAX] {
                let r = free_with(&a, &rec, p, bad, st);
                assert!(matches!(r, Err(Error::InvalidFree { .. })), "free of {size} B with {bad}: {r:?}");
            }
            let r = free_with(&a, &rec, 0, size, st);
            assert!(matches!(r, Err(Error::InvalidFree { .. })), "NULL with size {size}: {r:?}");
            assert_eq!(a.stats().live_bytes, live, "a refused free changed the live bytes");
            free_with(&a, &rec, p, size, st).unwrap();
        }
        let before = a.stats().reserved_bytes;
        for huge in [usize::MAX, usize::MAX - 255, usize::MAX - (2 << 20), 1 << 63, (1 << 30) + 1] {
            let r = malloc_with(&a, &rec, huge, st);
            assert!(matches!(r, Err(Error::OutOfMemory { .. })), "size {huge}: {r:?}");
        }
        let s = a.stats();
        assert!(s.reserved_bytes <= s.limit_bytes && s.reserved_bytes <= before.max(64 << 20), "{s:?}");
    }
    let p = malloc_with(&a, &rec, 4096, Stream::LEGACY).unwrap();
    for (q, what) in
        [(0x1000u64, "foreign"), (p + 1, "unaligned"), (p + 128, "off a granule"), (u64::MAX, "u64::MAX")]
    {
        match record_with(std::iter::once(&a), &rec, q, Stream::LEGACY) {
            Err(NotKept::Foreign(m)) => assert!(m.contains(&format!("{q:#x}")), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(rec.live(), 0);
    free_with(&a, &rec, p, 4096, Stream::LEGACY).unwrap();
    // 3 streams × 3 sizes × 4 refused frees.
    cuarena_testkit::assert_all_returned(&a, Some(&dev), 36);
}

/// A process-wide allocator cannot be destroyed through the API; the nearest thing is a device
/// with no allocator and the calls that only look one up: each answers "no cuarena allocator"
/// (or 0) and makes none, for every device number.
#[test]
fn lookups_of_devices_without_an_allocator_make_none() {
    let _g = serial();
    for dev in [0, 5, 63, 64, -1, i32::MAX, i32::MIN] {
        assert_eq!(cuarena_graph_pool_release(7, 7, dev), -1);
        assert!(err().contains("no cuarena allocator"), "dev {dev}: {}", err());
        assert_eq!(cuarena_graph_capture_end(dev), -1);
        assert!(err().contains("no cuarena allocator"), "dev {dev}: {}", err());
        assert!(cuarena_graph_pool_checkpoint(7, 7, dev).is_null());
        let mut n = 5usize;
        // SAFETY: `n` is writable; `out` NULL with n = 0 is allowed.
        assert_eq!(unsafe { cuarena_graph_pool_live(7, 7, dev, std::ptr::null_mut(), 0, &mut n) }, -1);
        assert_eq!(n, 5, "written on a refusal");
    }
    assert_eq!(cuarena::global::created().count(), 0);
    // A declaration with no allocator anywhere: refused as foreign (1), never kept.
    assert_eq!(cuarena_record_stream_checked(ptr(0x7f00_0000_0000), ptr(2)), 1);
    assert_eq!(cuarena_record_stream_checked(NULL, ptr(2)), 0);
    assert_eq!(recorded_blocks(), 0);
    let _ = CString::new("unused").unwrap();
}
