//! Running the `cuarena` binary in tests that feed it bad input (`adversarial_s16*.rs`): with a
//! time limit, output to files, optionally under an address-space cap, and never a pipe that
//! can fill. The binary is `CUARENA_CLI` when set (the GPU bundle's `run.sh` sets it: there is no
//! cargo there), else `target/debug/cuarena` when it is newer than every source it is built
//! from, else one built here into `target/adversarial-cli` (the outer cargo holds the default
//! target directory's lock).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuarena::trace::{self, Record};

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cuarena-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The newest modification time of the sources the binary is built from.
pub fn newest_source() -> std::time::SystemTime {
    fn walk(d: &Path, newest: &mut std::time::SystemTime) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, newest);
            } else if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                *newest = (*newest).max(m);
            }
        }
    }
    let mut newest = std::time::SystemTime::UNIX_EPOCH;
    for d in ["src", "benches/src", "testkit/src"] {
        walk(&root().join(d), &mut newest);
    }
    for f in ["Cargo.toml", "Cargo.lock", "benches/Cargo.toml", "testkit/Cargo.toml"] {
        if let Ok(m) = std::fs::metadata(root().join(f)).and_then(|m| m.modified()) {
            newest = newest.max(m);
        }
    }
    newest
}

/// The `cuarena` binary (module comment).
pub fn cli() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(b) = std::env::var_os("CUARENA_CLI") {
            return PathBuf::from(b);
        }
        let exe = std::env::current_exe().unwrap();
        let sibling = exe.parent().and_then(Path::parent).map(|d| d.join("cuarena"));
        if let Some(s) = sibling
            && std::fs::metadata(&s).and_then(|m| m.modified()).is_ok_and(|t| t >= newest_source())
        {
            return s;
        }
        let target = root().join("target/adversarial-cli");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let o = Command::new(cargo)
            .args(["build", "-p", "cuarena-bench", "--bin", "cuarena", "--target-dir"])
            .arg(&target)
            .current_dir(root())
            .output()
            .unwrap();
        assert!(o.status.success(), "building the cuarena binary: {}", String::from_utf8_lossy(&o.stderr));
        target.join("debug/cuarena")
    })
}

/// How a run of the binary ended.
pub struct Run {
    /// The exit status; `None` if it was killed for running past the time limit.
    pub status: Option<std::process::ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn code(&self) -> Option<i32> {
        self.status.and_then(|s| s.code())
    }
    pub fn show(&self) -> String {
        let status = match self.status {
            None => "HUNG (killed at the time limit)".to_string(),
            Some(s) => format!("{s}"),
        };
        let tail =
            |s: &str| s.chars().rev().take(1500).collect::<Vec<_>>().into_iter().rev().collect::<String>();
        format!(
            "status: {status}\nstderr (tail): {}\nstdout (tail): {}",
            tail(&self.stderr),
            tail(&self.stdout)
        )
    }
    /// Ended on its own, with status 1 and a clear `error` line, no panic and no abort.
    pub fn assert_refused(&self, what: &str, needle: &str) {
        assert!(
            self.code() == Some(1)
                && self.stderr.contains(needle)
                && !self.stderr.contains("panicked")
                && !self.stderr.contains("memory allocation of"),
            "{what}: expected status 1 and `{needle}` on stderr, no panic\n{}",
            self.show()
        );
    }
    /// Ended on its own (status 0 or 1), no panic, no abort.
    pub fn assert_clean_end(&self, what: &str) {
        assert!(
            matches!(self.code(), Some(0 | 1))
                && !self.stderr.contains("panicked")
                && !self.stderr.contains("memory allocation of"),
            "{what}: expected a clean end (status 0 or 1)\n{}",
            self.show()
        );
    }
}

/// Runs `program args` with a time limit, stdout and stderr to files (no pipe to fill).
pub fn run_limited(program: &Path, args: &[&std::ffi::OsStr], limit: Duration, close_stdout: bool) -> Run {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "cuarena-cli-{}-run{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (o, e) = (dir.join("out"), dir.join("err"));
    let mut cmd = Command::new(program);
    cmd.args(args).env_remove("CUARENA_CONF").env("RUST_BACKTRACE", "0").stdin(Stdio::null());
    cmd.stderr(std::fs::File::create(&e).unwrap());
    if close_stdout {
        // A pipe whose reader is gone before the child starts: every write to stdout fails
        // with EPIPE (a reader dropped after the spawn would race the child's first writes,
        // which the pipe's buffer would take).
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        cmd.stdout(writer);
    } else {
        cmd.stdout(std::fs::File::create(&o).unwrap());
    }
    let mut child = cmd.spawn().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let r = Run {
        status,
        stdout: std::fs::read_to_string(&o).unwrap_or_default(),
        stderr: String::from_utf8_lossy(&std::fs::read(&e).unwrap_or_default()).into_owned(),
    };
    let _ = std::fs::remove_dir_all(dir);
    r
}

/// `cuarena ARGS` with a time limit.
pub fn cuarena(args: &[&std::ffi::OsStr], limit: Duration) -> Run {
    run_limited(cli(), args, limit, false)
}

/// `cuarena ARGS` under a cap of `kib` KiB of address space (`ulimit -v`), with a time limit:
/// an attempt to take absurd host memory fails at once instead of taking the machine.
pub fn cuarena_capped(kib: u64, args: &[&std::ffi::OsStr], limit: Duration) -> Run {
    let script = format!("ulimit -v {kib} && exec \"$0\" \"$@\"");
    let mut all: Vec<&std::ffi::OsStr> = vec![script.as_ref(), cli().as_os_str()];
    all.extend_from_slice(args);
    let mut a: Vec<&std::ffi::OsStr> = vec!["-c".as_ref()];
    a.extend(all);
    run_limited(Path::new("/bin/sh"), &a, limit, false)
}

pub fn os(s: &str) -> &std::ffi::OsStr {
    s.as_ref()
}

/// `replay FILE --format FORMAT EXTRA...`, on the host-simulated device.
pub fn replay_args<'a>(file: &'a Path, format: &'a str, extra: &[&'a str]) -> Vec<&'a std::ffi::OsStr> {
    // `--host`: the host-simulated device (and its baselines) even on a GPU machine.
    let mut v: Vec<&std::ffi::OsStr> =
        vec![os("replay"), os("--host"), file.as_os_str(), os("--format"), os(format)];
    v.extend(extra.iter().map(|s| os(s)));
    v
}

/// A binary trace of `recs`.
pub fn write_trace(path: &Path, recs: &[Record]) {
    let mut b = trace::header().to_vec();
    for r in recs {
        b.extend_from_slice(&r.encode());
    }
    std::fs::write(path, b).unwrap();
}
