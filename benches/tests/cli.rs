//! The benchmark binary refuses bad arguments with a clear message and exit status 2, and a run
//! in which a measurement failed exits non-zero.

use std::process::{Command, Output};

/// The binary cargo built, or (in the GPU bundle, where that path does not exist) the
/// `cuarena` beside this test binary.
fn binary() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_cuarena"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.with_file_name("cuarena")
}

fn run(args: &[&str]) -> Output {
    Command::new(binary()).args(args).env_remove("CUARENA_CONF").output().expect("running the cuarena binary")
}

/// Windows for [`run_measured`]: a short one first; a longer one only when the short one
/// measured nothing (on a loaded machine a thread may not run at all within 20 ms).
const WINDOWS: [&str; 3] = ["0.02", "0.2", "2"];

/// Runs `args` with `--secs` from [`WINDOWS`] until `measured` says the output holds a
/// measurement (or the longest window ran); returns that output.
fn run_measured(args: &[&str], measured: impl Fn(&Output) -> bool) -> Output {
    let mut out = None;
    for secs in WINDOWS {
        let mut with_secs = args.to_vec();
        with_secs.extend(["--secs", secs]);
        let o = run(&with_secs);
        let done = !o.status.success() || measured(&o);
        out = Some(o);
        if done {
            break;
        }
    }
    out.expect("at least one window")
}

/// The `pairs` of a `--json` row.
fn json_pairs(row: &str) -> u64 {
    row.split("\"pairs\":")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no pairs in {row}"))
}

fn refused(args: &[&str], needle: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: a bad argument exits with 2; stderr: {err}");
    assert!(err.contains(needle), "{args:?}: stderr lacks `{needle}`: {err}");
    assert!(out.stdout.is_empty(), "{args:?} printed a table: {}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn zero_threads_is_refused() {
    refused(&["--threads", "0"], "at least 1");
    refused(&["--threads", "2,0"], "at least 1");
    refused(&["--baseline-threads", "0"], "at least 1");
}

#[test]
fn an_unknown_allocator_is_refused_and_the_valid_ones_listed() {
    refused(&["--allocators", "foo", "--secs", "0.01"], "unknown allocator `foo`");
    refused(&["--allocators", "foo", "--secs", "0.01"], "cuarena");
}

#[test]
fn bad_secs_are_refused() {
    refused(&["--secs", "-1"], "--secs");
    refused(&["--secs", "0"], "--secs");
    refused(&["--secs", "nan"], "--secs");
}

#[test]
fn a_run_with_nothing_to_measure_fails() {
    // multi_stream needs the GPU's kernels: on the simulated device every point is skipped.
    let out = run(&["--workloads", "multi_stream", "--secs", "0.01", "--threads", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("host-simulated device") {
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("nothing to measure"), "{err}");
    }
}

#[test]
fn a_short_valid_run_succeeds() {
    let out = run(&[
        "--workloads",
        "churn",
        "--threads",
        "1",
        "--secs",
        "0.02",
        "--no-touch",
        "--allocators",
        "cuarena",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("cuarena"), "{err}");
}

#[test]
fn a_run_in_which_a_measurement_failed_prints_what_it_could_and_fails() {
    // A bad CUARENA_CONF makes every cuarena point fail; the baseline's points still run.
    let out = Command::new(binary())
        .args(["--workloads", "churn", "--threads", "1", "--secs", "0.02", "--no-touch"])
        .env("CUARENA_CONF", "no_such_key=1")
        .output()
        .expect("running the cuarena binary");
    let (err, table) = (String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    assert!(!out.status.success(), "exited with success: {err}");
    assert!(err.contains("measurements failed") && err.contains("no_such_key"), "{err}");
    let baseline = if err.contains("host-simulated device") { "mutex-first-fit" } else { "cuMemAllocAsync" };
    assert!(table.contains(baseline), "the points that ran are printed: {table}\n{err}");
}

#[test]
fn a_run_in_which_every_measurement_failed_fails() {
    let out = Command::new(binary())
        .args([
            "--workloads",
            "churn",
            "--threads",
            "1",
            "--secs",
            "0.02",
            "--allocators",
            "cuarena",
            "--json",
        ])
        .env("CUARENA_CONF", "no_such_key=1")
        .output()
        .expect("running the cuarena binary");
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout.is_empty());
}

#[test]
fn an_unknown_stream_mode_is_refused_with_exit_2_and_the_valid_ones_listed() {
    for bad in ["foo", "ptds,foo", "", "ptds,", "PTDS", "null"] {
        let out = run(&["--streams", bad, "--secs", "0.01"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--streams {bad:?}: {err}");
        assert!(err.contains("unknown stream mode") && err.contains("ptds, legacy, own"), "{bad:?}: {err}");
        assert!(out.stdout.is_empty(), "--streams {bad:?} printed: {}", String::from_utf8_lossy(&out.stdout));
    }
    refused(&["--streams"], "a value is required for '--streams");
}

#[test]
fn help_lists_the_stream_modes_and_their_default() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["--streams", "ptds", "legacy", "own", "default all: ptds,legacy,own", "handoff_msg"] {
        assert!(help.contains(needle), "--help lacks `{needle}`: {help}");
    }
}

#[test]
fn every_json_row_names_its_stream_mode_and_counts_its_pairs() {
    let out = run_measured(
        &[
            "--workloads",
            "churn,handoff_msg",
            "--threads",
            "2",
            "--no-touch",
            "--allocators",
            "cuarena",
            "--json",
        ],
        |o| String::from_utf8_lossy(&o.stdout).lines().all(|r| json_pairs(r) > 0),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let rows: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(rows.len(), 6, "2 workloads x 3 stream modes by default: {rows:?}");
    for mode in ["ptds", "legacy", "own"] {
        let n = rows.iter().filter(|r| r.contains(&format!("\"streams\":\"{mode}\""))).count();
        assert_eq!(n, 2, "{mode}: {rows:?}");
    }
    for r in &rows {
        assert!(json_pairs(r) > 0, "{r}");
        if r.contains("handoff_msg") {
            assert!(r.contains("\"local_frees\":0,"), "2 threads hand every block off: {r}");
        } else {
            assert!(r.contains("\"local_frees\":null"), "{r}");
        }
    }
}

#[test]
fn the_table_shows_the_stream_mode() {
    // Nothing measured: the row's pairs/s (its fifth column) is "0" when the window closed
    // before a pair, and its arena share "-" when the only pair's allocation came after the
    // window's counts were read (the last pair in flight at the close is counted by its thread).
    let measured = |o: &Output| {
        let table = String::from_utf8_lossy(&o.stdout).into_owned();
        let Some(row) = table.lines().find(|l| l.starts_with("handoff")) else { return true };
        let cols: Vec<&str> = row.split_whitespace().collect();
        cols.get(4) != Some(&"0") && cols.last() != Some(&"-")
    };
    let out = run_measured(
        &[
            "--workloads",
            "handoff",
            "--threads",
            "1",
            "--no-touch",
            "--allocators",
            "cuarena",
            "--streams",
            "legacy",
        ],
        measured,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("stream") && table.contains("local"), "{table}");
    let row = table.lines().find(|l| l.starts_with("handoff")).unwrap_or_else(|| panic!("{table}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert!(row.contains("legacy"), "{row}");
    assert_eq!(cols[cols.len() - 2], "100.0%", "a ring of one thread frees locally: {row}");
    assert!(cols[cols.len() - 1].ends_with('%'), "cuarena reports its arena share: {row}");
    assert!(!table.contains("ptds") && !table.contains(" own "), "only the requested mode: {table}");
}

#[test]
fn the_table_has_a_legend_and_says_when_the_figures_are_not_gpu_figures() {
    let out = run(&[
        "--workloads",
        "churn",
        "--threads",
        "1",
        "--secs",
        "0.02",
        "--no-touch",
        "--allocators",
        "cuarena",
        "--streams",
        "ptds",
    ]);
    let (err, table) = (String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "{err}");
    for column in ["columns:", "pairs/s", "res/pk", "calls/Mop", "syncs", "conc", "local", "arena"] {
        assert!(table.lines().any(|l| l.trim_start().starts_with(column)), "no legend for {column}: {table}");
    }
    let on_host = err.contains("host-simulated device");
    assert_eq!(table.contains("they are not GPU figures"), on_host, "{table}\n{err}");
    assert!(!err.contains('\r'), "a progress line although stderr is not a terminal: {err:?}");
}

#[test]
fn help_lists_workloads_allocators_stream_modes_and_defaults() {
    let out = run(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for needle in
        ["churn", "random_allocations", "cuMemAllocAsync", "mutex-first-fit", "default: 0.5", "Exit status"]
    {
        assert!(help.contains(needle), "--help lacks `{needle}`: {help}");
    }
}
