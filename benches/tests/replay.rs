//! `cuarena replay` and `cuarena trace-csv`: a recorded multi-threaded run replays with the same
//! counts and no failure on cuarena and the host baseline; the CSV export reads back the same
//! records; RMM's CSV and (through tools/torch_snapshot_to_csv.py) a PyTorch snapshot import.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cuarena::trace;
use cuarena::{Allocator, Config, Stream};
use cuarena_bench::Bench;
use cuarena_bench::replay::{self, Format, Plan};
use cuarena_testkit::{HostConfig, HostDevice};

fn host_bench() -> Bench {
    Bench::on_host(
        HostConfig { capacity: 1 << 32, max_delay: Duration::ZERO, ..HostConfig::default() },
        "host".into(),
    )
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cuarena-replay-{}-{name}", std::process::id()))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Records a run of 4 threads: each allocates on its per-thread stream, the legacy stream and a
/// shared user stream, frees most itself and hands every 5th block to the next thread.
fn record(path: &Path) -> (usize, usize) {
    let dev = Arc::new(HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() }));
    let user = dev.create_stream();
    let a = Allocator::new(dev, Config::default()).unwrap();
    a.start_trace(path).unwrap();
    const T: usize = 4;
    const N: usize = 500;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..T).map(|_| std::sync::mpsc::channel::<(u64, usize)>()).unzip();
    std::thread::scope(|s| {
        for (t, rx) in rxs.into_iter().enumerate() {
            let (a, tx) = (a.clone(), txs[(t + 1) % T].clone());
            s.spawn(move || {
                for i in 0..N {
                    let size = 256 + (i * 97 + t * 13) % 300_000;
                    let st = [Stream::PER_THREAD, Stream::LEGACY, user][i % 3];
                    let p = a.allocate(size, st).unwrap();
                    if i % 5 == 0 {
                        tx.send((p.0, size)).unwrap();
                    } else {
                        a.deallocate(p, size, st).unwrap();
                    }
                    while let Ok((q, sz)) = rx.try_recv() {
                        a.deallocate(cuarena::DeviceAddr(q), sz, Stream::LEGACY).unwrap();
                    }
                }
                drop(tx);
                // What is still coming, until the sender is done (it may be far behind: a
                // fixed wait here let this thread exit while the sender still sent to it).
                for (q, sz) in rx {
                    a.deallocate(cuarena::DeviceAddr(q), sz, Stream::LEGACY).unwrap();
                }
            });
        }
        drop(txs);
    });
    let sum = a.stop_trace().unwrap();
    assert_eq!(sum.threads as usize, T);
    (T, T * N)
}

#[test]
fn a_recorded_threaded_run_replays_with_the_same_counts_and_no_failure() {
    let p = tmp("rec.bin");
    let (threads, allocs) = record(&p);
    let t = replay::load(&p, Format::Cuarena).unwrap();
    let plan = Plan::new(&t);
    assert_eq!(plan.threads(), threads);
    assert_eq!(plan.allocations as usize, allocs);
    assert_eq!((plan.unmatched_frees, plan.not_played), (0, 0));
    assert!(plan.cross_thread_frees > 0, "the run handed blocks between threads");
    assert_eq!(plan.user_streams.len(), 1);
    let bench = host_bench();
    for name in ["cuarena", "mutex-first-fit"] {
        let r = bench.replay(name, &plan).unwrap();
        assert_eq!((r.allocations, r.pairs), (plan.allocations, plan.pairs), "{name}");
        assert_eq!((r.failed_allocs, r.failed_frees), (0, 0), "{name}");
        assert!(r.peak_reserved_bytes >= r.peak_live_bytes / 2 && r.pairs_per_sec > 0.0, "{name}: {r:?}");
    }
    assert!(bench.host_violations().is_empty(), "{:?}", bench.host_violations());
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn the_csv_export_reads_back_the_same_records_and_replays_alike() {
    let p = tmp("csv.bin");
    record(&p);
    let recs = trace::read(&p).unwrap();
    let out = tmp("out.csv");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_cuarena"))
        .args(["trace-csv", p.to_str().unwrap(), out.to_str().unwrap()])
        .env_remove("CUARENA_CONF")
        .status()
        .unwrap();
    assert!(st.success());
    let back = replay::read_cuarena_csv(std::io::BufReader::new(std::fs::File::open(&out).unwrap())).unwrap();
    assert_eq!(back, recs);
    let a = Plan::new(&replay::load(&p, Format::Cuarena).unwrap());
    let b = Plan::new(&replay::load(&out, Format::CuarenaCsv).unwrap());
    assert_eq!(
        (a.allocations, a.pairs, a.cross_thread_frees),
        (b.allocations, b.pairs, b.cross_thread_frees)
    );
    // A damaged file is refused with the reason, not half-read.
    let mut bytes = std::fs::read(&p).unwrap();
    bytes.truncate(bytes.len() - 3);
    std::fs::write(&p, &bytes).unwrap();
    let e = replay::load(&p, Format::Cuarena).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    let e = replay::load(&out, Format::RmmCsv).unwrap_err().to_string();
    assert!(e.contains("no `time` column"), "{e}");
    std::fs::remove_file(&p).unwrap();
    std::fs::remove_file(&out).unwrap();
}

#[test]
fn an_rmm_log_imports_and_replays() {
    let t = replay::load(&fixture("rmm_sample.csv"), Format::RmmCsv).unwrap();
    let plan = Plan::new(&t);
    assert_eq!(plan.threads(), 2);
    assert_eq!((plan.allocations, plan.pairs, plan.never_freed), (4, 3, 1));
    assert_eq!((plan.unmatched_frees, plan.not_played, plan.cross_thread_frees), (1, 1, 2));
    assert_eq!(plan.user_streams, [0x7f8a38001020]);
    assert_eq!(plan.peak_live, 300_000);
    let r = host_bench().replay("cuarena", &plan).unwrap();
    assert_eq!((r.pairs, r.failed_allocs, r.failed_frees), (3, 0, 0));
    assert!(t.ops.iter().any(|o| !o.alloc));
}

#[test]
fn a_torch_snapshot_converts_and_replays() {
    let dir = tmp("torch");
    std::fs::create_dir_all(&dir).unwrap();
    let snap = dir.join("snap.pickle");
    let csv = dir.join("snap.csv");
    // A synthetic snapshot in torch's shape: device 1 has the events; segment events and
    // free_completed are skipped; one event lacks time_us in device 0 (not chosen).
    let make = format!(
        r#"
import pickle
ev = lambda a, addr, size, t, s=0: {{'action': a, 'addr': addr, 'size': size, 'stream': s, 'time_us': t, 'frames': [{{'filename': 'x.py', 'line': 1, 'name': 'f'}}]}}
d1 = [ev('segment_alloc', 0x7f0000000000, 2 << 20, 1),
      ev('alloc', 0x7f0000000000, 512, 2), ev('alloc', 0x7f0000000200, 4096, 3, 0x55aa00),
      ev('free_requested', 0x7f0000000000, 512, 4), ev('free_completed', 0x7f0000000000, 512, 5),
      ev('alloc', 0x7f0000000000, 256, 6),
      ev('free_requested', 0x7f0000000200, 4096, 7, 0x55aa00), ev('free_completed', 0x7f0000000200, 4096, 8, 0x55aa00)]
snap = {{'segments': [], 'device_traces': [[{{'action': 'alloc', 'addr': 1, 'size': 1, 'stream': 0}}], d1]}}
pickle.dump(snap, open(r'{}', 'wb'), protocol=pickle.HIGHEST_PROTOCOL)
"#,
        snap.display()
    );
    let py = |args: &[&str]| {
        std::process::Command::new("python3").args(args).output().expect("python3 is needed for this test")
    };
    let o = py(&["-c", &make]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/torch_snapshot_to_csv.py");
    let o = py(&[script.to_str().unwrap(), snap.to_str().unwrap(), csv.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("device 1: 5 events written, 3 skipped"));
    let plan = Plan::new(&replay::load(&csv, Format::RmmCsv).unwrap());
    assert_eq!((plan.threads(), plan.allocations, plan.pairs, plan.never_freed), (1, 3, 2, 1));
    assert_eq!(plan.user_streams, [0x55aa00]);
    let r = host_bench().replay("cuarena", &plan).unwrap();
    assert_eq!((r.failed_allocs, r.failed_frees), (0, 0));
    // Not a snapshot: a clear error.
    std::fs::write(&snap, b"not a pickle").unwrap();
    let o = py(&[script.to_str().unwrap(), snap.to_str().unwrap(), csv.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("error:"));
    std::fs::remove_dir_all(&dir).unwrap();
}
