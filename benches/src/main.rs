//! `cargo run --release`: a short multi-threaded benchmark of cuarena against the baselines,
//! on the GPU if there is one, otherwise on the host-simulated device.
//!
//! `cuarena --help` describes each option and its default. Bad arguments exit with status 2; a
//! run in which any measurement failed, or in which nothing could be measured, with status 1.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use cuarena::DeviceKind;
use cuarena_bench::replay::{Format, Plan, ReplayPoint};
use cuarena_bench::{Bench, ON_REQUEST, Point, StreamMode, Workload, runs_touch};

/// Every allocator the benchmark knows, and where it runs.
const ALLOCATORS: &str = "cuarena (everywhere), cuMemAllocAsync and cuMemAlloc (GPU), mutex-first-fit (host device); \
     on request only: cuarena+trace (cuarena recording a trace, for the trace's overhead), harness (no allocator: one \
     fixed address, frees do nothing; the harness's own ceiling for each workload, without touch only)";

/// The columns of the table, explained under it.
const LEGEND: &[(&str, &str)] = &[
    ("workload", "the workload; `+touch`: a 4 KiB memset on the block's stream after each allocation"),
    ("stream", "the stream mode (`--help` lists them)"),
    ("thr", "threads"),
    ("allocator", "the allocator measured"),
    ("pairs/s", "alloc+free pairs per second, all threads together, in the timed window"),
    ("p50 ns, p99 ns", "median and 99th percentile of one pair's time (every 8th pair timed)"),
    ("peak live", "the most bytes live at once (sampled every millisecond)"),
    ("res/pk", "peak bytes reserved from the device over peak live bytes (1.00 = no overhead)"),
    ("calls/Mop", "driver calls per million operations in the steady state"),
    ("syncs", "host-blocking synchronisations"),
    ("conc", "multi_stream: kernels seen running at once ('-' elsewhere)"),
    ("local", "handoff workloads: share of the pairs whose block the allocating thread freed itself"),
    ("arena", "cuarena: share of its allocations served by a thread's arena (the rest by the pool)"),
];

/// `println!` that ends the process with an error (status 1), not a panic, when standard output
/// is gone: a closed pipe (`cuarena replay t.bin | head -1`) or a full disk.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($t)*) {
            eprintln!("error: writing standard output: {e}");
            std::process::exit(1);
        }
    }};
}

/// The stream modes and the workloads, for `--help`.
fn choices() -> String {
    let modes: String =
        StreamMode::ALL.iter().map(|m| format!("  {:<8} {}\n", m.name(), m.describe())).collect();
    let workloads: Vec<&str> = Workload::ALL.iter().map(|w| w.name()).collect();
    format!(
        "Stream modes (--streams, default all: ptds,legacy,own):\n{modes}\n\
         Workloads (--workloads, default all): {}\n\n\
         Allocators (--allocators, default every one the device runs): {ALLOCATORS}\n\n\
         Exit status: 0 if every measurement ran, 1 if one failed or none could run, 2 for bad arguments.",
        workloads.join(", ")
    )
}

/// cuarena benchmark: alloc+free pairs per second of cuarena against the baselines, on the GPU
/// if there is one, otherwise on the host-simulated device.
#[derive(Parser, Debug)]
#[command(name = "cuarena", version, after_help = choices())]
struct Args {
    /// Short run: threads 1,4,16 (capped at the cores), 0.15 s a point.
    #[arg(long)]
    quick: bool,
    /// One JSON object per point on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Seconds each point is timed [default: 0.5; 0.15 with --quick].
    #[arg(long, value_name = "S", value_parser = parse_secs, allow_hyphen_values = true)]
    secs: Option<f64>,
    /// Thread counts [default: 1,2,4,8,16 capped at the cores; 1,4,16 with --quick].
    #[arg(long, value_name = "N,...", value_delimiter = ',', value_parser = parse_threads, allow_hyphen_values = true)]
    threads: Option<Vec<usize>>,
    /// Workloads [default: all; listed below].
    #[arg(long, value_name = "W,...", value_delimiter = ',', value_parser = parse_workload)]
    workloads: Option<Vec<Workload>>,
    /// Allocators [default: every one this device runs; listed below].
    #[arg(long, value_name = "A,...", value_delimiter = ',')]
    allocators: Option<Vec<String>>,
    /// Stream modes [default all: ptds,legacy,own; listed below].
    #[arg(long, value_name = "M,...", value_delimiter = ',', value_parser = parse_stream)]
    streams: Option<Vec<StreamMode>>,
    /// Thread counts at which cuMemAlloc runs [default: 1 and the most threads].
    #[arg(long, value_name = "N,...", value_delimiter = ',', value_parser = parse_threads, allow_hyphen_values = true)]
    baseline_threads: Option<Vec<usize>>,
    /// Only the variants without a memset per allocation.
    #[arg(long, conflicts_with = "touch_only")]
    no_touch: bool,
    /// Only the variants with a 4 KiB memset per allocation.
    #[arg(long)]
    touch_only: bool,
    /// Run on the host-simulated device even where a GPU is present (its race checker, and
    /// its baseline `mutex-first-fit`; a replay's memory there does not depend on GPU timing).
    #[arg(long, global = true)]
    host: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Plays a recorded trace against cuarena and the baselines (threads, streams and
    /// cross-thread frees as recorded; see benches/src/replay.rs).
    Replay {
        /// The trace file.
        file: std::path::PathBuf,
        /// Its format: cuarena (binary, CUARENA_CONF=trace=PATH), cuarena-csv (`trace-csv`'s
        /// output), rmm-csv (RMM's logging adaptor; also tools/torch_snapshot_to_csv.py's output).
        #[arg(long, default_value = "cuarena", value_parser = parse_format)]
        format: Format,
        /// Allocators [default: every one this device runs].
        #[arg(long, value_name = "A,...", value_delimiter = ',')]
        allocators: Option<Vec<String>>,
        /// One JSON object per allocator instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Writes a binary cuarena trace as CSV (thread,time_ns,action,ptr,size,stream_kind,stream,path).
    TraceCsv {
        /// The binary trace.
        input: std::path::PathBuf,
        /// The CSV file to write (`-` for standard output).
        output: std::path::PathBuf,
    },
}

fn parse_format(f: &str) -> Result<Format, String> {
    Format::parse(f.trim()).ok_or_else(|| {
        let valid: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
        format!("unknown trace format `{f}` (valid: {})", valid.join(", "))
    })
}

fn parse_stream(m: &str) -> Result<StreamMode, String> {
    StreamMode::parse(m.trim()).ok_or_else(|| {
        let valid: Vec<&str> = StreamMode::ALL.iter().map(|m| m.name()).collect();
        format!("unknown stream mode `{m}` (valid: {})", valid.join(", "))
    })
}

fn parse_workload(w: &str) -> Result<Workload, String> {
    Workload::parse(w.trim()).ok_or_else(|| {
        let valid: Vec<&str> = Workload::ALL.iter().map(|w| w.name()).collect();
        format!("unknown workload `{w}` (valid: {})", valid.join(", "))
    })
}

/// A thread count: at least 1.
fn parse_threads(t: &str) -> Result<usize, String> {
    match t.trim().parse::<usize>() {
        Ok(0) => Err("thread counts must be at least 1, got 0".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("`{t}` is not a thread count ({e})")),
    }
}

/// The seconds each point runs: a finite number above zero.
fn parse_secs(v: &str) -> Result<f64, String> {
    let s: f64 = v.trim().parse().map_err(|e| format!("`{v}` is not a number ({e})"))?;
    if s.is_finite() && s > 0.0 {
        Ok(s)
    } else {
        Err(format!("must be a finite number of seconds above 0, got {v}"))
    }
}

/// Checks every requested allocator against those this device runs.
fn check_allocators(requested: &[String], valid: &[&str]) -> Result<(), String> {
    let unknown: Vec<&str> = requested.iter().map(String::as_str).filter(|a| !valid.contains(a)).collect();
    if unknown.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "unknown allocator{} {} (this device runs: {})",
            if unknown.len() > 1 { "s" } else { "" },
            unknown.iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", "),
            valid.join(", ")
        ))
    }
}

fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2} G", x / 1e9),
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.1} k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// A bad argument found after parsing: reported like clap's own, with status 2.
fn usage_error(msg: String) -> ExitCode {
    let _ = Args::command().error(clap::error::ErrorKind::InvalidValue, msg).print();
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args = Args::parse(); // on a bad argument: a message and exit status 2
    if let Some(Command::TraceCsv { input, output }) = &args.command {
        return trace_csv(input, output);
    }
    let bench = if args.host {
        Bench::host_default("host-simulated device (--host)".into())
    } else {
        Bench::detect()
    };
    eprintln!("cuarena benchmark on {}", bench.description);
    let known: Vec<&str> = bench.allocator_names().into_iter().chain(ON_REQUEST.iter().copied()).collect();
    if let Some(Command::Replay { file, format, allocators, json }) = &args.command {
        if let Some(requested) = allocators
            && let Err(e) = check_allocators(requested, &known)
        {
            return usage_error(e);
        }
        return replay(&bench, file, *format, allocators.clone(), *json);
    }
    if let Some(requested) = &args.allocators
        && let Err(e) = check_allocators(requested, &known)
    {
        return usage_error(e);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<usize> = args.threads.clone().unwrap_or_else(|| {
        let all = if args.quick { vec![1, 4, 16] } else { vec![1, 2, 4, 8, 16] };
        let mut v: Vec<usize> = all.into_iter().map(|t| t.min(cores)).collect();
        v.dedup();
        v
    });
    let workloads = args.workloads.clone().unwrap_or_else(|| Workload::ALL.to_vec());
    let mut streams: Vec<StreamMode> = Vec::new();
    for m in args.streams.clone().unwrap_or_else(|| StreamMode::ALL.to_vec()) {
        if !streams.contains(&m) {
            streams.push(m);
        }
    }
    let touch: Vec<bool> = match (args.no_touch, args.touch_only) {
        (true, _) => vec![false],
        (_, true) => vec![true],
        _ => vec![false, true],
    };
    let allocators: Vec<String> = args
        .allocators
        .clone()
        .unwrap_or_else(|| bench.allocator_names().iter().map(|s| s.to_string()).collect());
    let secs = args.secs.unwrap_or(if args.quick { 0.15 } else { 0.5 });
    // cuMemAlloc synchronises the device on every free: by default it runs only at 1 thread and
    // the most threads, and without touch variants, so a default run stays short on a GPU.
    let baseline_threads =
        args.baseline_threads.clone().unwrap_or_else(|| vec![1, threads.iter().copied().max().unwrap_or(1)]);
    let mut plan = Vec::new();
    for &w in &workloads {
        if !bench.supports(w) {
            eprintln!("skipping {}: needs the GPU's kernels", w.name());
            continue;
        }
        for &touch in &touch {
            for &mode in &streams {
                let ts: Vec<usize> = if w == Workload::RandomAllocations { vec![1] } else { threads.clone() };
                for &t in &ts {
                    for a in &allocators {
                        // cuMemAlloc synchronises the device on every free: a short run says enough.
                        let s = if a == "cuMemAlloc" { secs.min(0.2) } else { secs };
                        if a == "cuMemAlloc" && (touch || !baseline_threads.contains(&t)) {
                            continue;
                        }
                        if touch && !runs_touch(a) {
                            continue; // `harness` hands out no memory to touch
                        }
                        plan.push((w, touch, mode, t, a.clone(), s));
                    }
                }
            }
        }
    }
    let n = plan.len();
    if n == 0 {
        eprintln!("error: nothing to measure: every requested workload was skipped on this device");
        return ExitCode::FAILURE;
    }
    // The progress line rewrites itself with `\r`: only on a terminal, never into a log.
    let progress = std::io::stderr().is_terminal();
    let mut points: Vec<Point> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for (i, (w, touch, mode, t, a, s)) in plan.into_iter().enumerate() {
        let what = format!("{}{}", w.name(), if touch { "+touch" } else { "" });
        if progress {
            eprint!("\r[{:>3}/{n}] {what:<24} {:<6} {t:>2} threads {a:<16}", i + 1, mode.name());
            let _ = std::io::stderr().flush();
        }
        match bench.run(&a, w, touch, mode, t, s) {
            Ok(p) => {
                if args.json {
                    out!("{}", p.json());
                }
                points.push(p);
            }
            Err(e) => {
                let failed = format!("{a} {what} streams={} {t} threads failed: {e}", mode.name());
                if progress {
                    eprintln!();
                }
                eprintln!("{failed}");
                failures.push(failed);
            }
        }
    }
    if progress {
        eprintln!();
    }
    if !args.json {
        print_table(&bench, &points);
    }
    if !failures.is_empty() {
        eprintln!("error: {} of {n} measurements failed:", failures.len());
        for f in &failures {
            eprintln!("  {f}");
        }
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn print_table(bench: &Bench, points: &[Point]) {
    out!("device: {}", bench.description);
    if bench.kind() == DeviceKind::Host {
        out!(
            "note: these figures time cuarena and the baseline over a simulated device in host memory; \
             they are not GPU figures."
        );
    }
    out!(
        "{:<24} {:<6} {:>3} {:<16} {:>10} {:>8} {:>8} {:>10} {:>6} {:>10} {:>6} {:>5} {:>6} {:>6}",
        "workload",
        "stream",
        "thr",
        "allocator",
        "pairs/s",
        "p50 ns",
        "p99 ns",
        "peak live",
        "res/pk",
        "calls/Mop",
        "syncs",
        "conc",
        "local",
        "arena"
    );
    for p in points {
        out!(
            "{:<24} {:<6} {:>3} {:<16} {:>10} {:>8} {:>8} {:>10} {:>6.2} {:>10.1} {:>6} {:>5} {:>6} {:>6}",
            p.workload,
            p.streams,
            p.threads,
            p.allocator,
            human(p.pairs_per_sec),
            p.p50_ns,
            p.p99_ns,
            human(p.peak_live_bytes as f64) + "B",
            p.memory_ratio(),
            p.driver_calls_per_mop,
            p.host_syncs,
            p.kernel_concurrency.map_or("-".into(), |c| c.to_string()),
            local_share(p),
            arena_share(p)
        );
    }
    out!("");
    out!("{}", legend().trim_end_matches('\n'));
}

/// The table's legend: one line per column.
fn legend() -> String {
    let mut s = String::from("columns:\n");
    for (col, what) in LEGEND {
        s += &format!("  {col:<15} {what}\n");
    }
    s += "  In `local`, '-' means every free is local by design; blocks still queued when the window \
          closed are freed after it and not counted.\n";
    s
}

/// The arena's share of the timed allocations, or `-` for an allocator without paths.
fn arena_share(p: &Point) -> String {
    match (p.arena_allocations, p.pool_allocations) {
        (Some(a), Some(b)) if a + b > 0 => format!("{:.0}%", 100.0 * a as f64 / (a + b) as f64),
        _ => "-".into(),
    }
}

/// `local_frees` as a share of the point's pairs, or `-`.
fn local_share(p: &Point) -> String {
    match p.local_frees {
        None => "-".into(),
        Some(0) => "0".into(),
        Some(l) => format!("{:.1}%", 100.0 * l as f64 / p.pairs.max(1) as f64),
    }
}

/// `cuarena trace-csv IN OUT`.
fn trace_csv(input: &std::path::Path, output: &std::path::Path) -> ExitCode {
    if output.as_os_str() != "-" && same_file(input, output) {
        return usage_error(format!(
            "the output {} is the input trace: writing it would replace the trace with its CSV",
            output.display()
        ));
    }
    let recs = match cuarena::trace::read(input) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = if output.as_os_str() == "-" {
        cuarena::trace::write_csv(&recs, std::io::BufWriter::new(std::io::stdout().lock()))
    } else {
        std::fs::File::create(output)
            .and_then(|f| cuarena::trace::write_csv(&recs, std::io::BufWriter::new(f)))
    };
    match r {
        Ok(()) => {
            eprintln!("{} records written", recs.len());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: writing {}: {e}", output.display());
            ExitCode::FAILURE
        }
    }
}

/// True if `a` and `b` name one existing file (through links or other spellings of the path).
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => false,
    }
}

/// `cuarena replay FILE`.
fn replay(
    bench: &Bench,
    file: &std::path::Path,
    format: Format,
    allocators: Option<Vec<String>>,
    json: bool,
) -> ExitCode {
    let trace = match cuarena_bench::replay::load(file, format) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let plan = Plan::new(&trace);
    eprintln!(
        "{}: {} threads, {} allocations, {} pairs ({} freed by another thread), {} user streams; \
         not played: {} unmatched frees, {} failed or refused in the trace; {} never freed (freed after the play)",
        file.display(),
        plan.threads(),
        plan.allocations,
        plan.pairs,
        plan.cross_thread_frees,
        plan.user_streams.len(),
        plan.unmatched_frees,
        plan.not_played,
        plan.never_freed
    );
    if plan.allocations == 0 {
        eprintln!("error: nothing to replay: the trace has no allocation");
        return ExitCode::FAILURE;
    }
    let names = allocators.unwrap_or_else(|| bench.allocator_names().iter().map(|s| s.to_string()).collect());
    let mut points: Vec<ReplayPoint> = Vec::new();
    let mut failed = false;
    for a in &names {
        match bench.replay(a, &plan) {
            Ok(p) => {
                if json {
                    out!("{}", p.json());
                }
                failed |= p.failed_allocs + p.failed_frees > 0;
                points.push(p);
            }
            Err(e) => {
                eprintln!("{a} failed: {e}");
                failed = true;
            }
        }
    }
    if !json {
        out!("device: {}", bench.description);
        out!(
            "{:<16} {:>4} {:>10} {:>10} {:>8} {:>8} {:>10} {:>7} {:>8} {:>8}",
            "allocator",
            "thr",
            "pairs",
            "pairs/s",
            "p50 ns",
            "p99 ns",
            "peak live",
            "res/pk",
            "drv calls",
            "failures"
        );
        for p in &points {
            out!(
                "{:<16} {:>4} {:>10} {:>10} {:>8} {:>8} {:>10} {:>7.2} {:>8} {:>8}",
                p.allocator,
                p.threads,
                p.pairs,
                human(p.pairs_per_sec),
                p.p50_ns,
                p.p99_ns,
                human(p.peak_live_bytes as f64) + "B",
                p.memory_ratio(),
                p.driver_calls,
                p.failed_allocs + p.failed_frees
            );
        }
        out!(
            "\ncolumns: pairs/s: matched alloc+free pairs over the play's wall time; p50/p99: one call \
             (alloc or free); peak live: the trace's own peak; res/pk: peak reserved over it; failures: \
             allocations or frees the allocator refused"
        );
    }
    if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("cuarena").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn thread_counts_must_be_at_least_one() {
        assert_eq!(parse(&["--threads", "1,4,16"]).unwrap().threads, Some(vec![1, 4, 16]));
        let e = parse(&["--threads", "0"]).unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
        assert_eq!(e.exit_code(), 2);
        assert!(parse(&["--threads", "4,0"]).is_err());
        assert!(parse(&["--threads", "-1"]).is_err());
        assert!(parse(&["--threads", ""]).is_err());
        let e = parse(&["--baseline-threads", "x"]).unwrap_err().to_string();
        assert!(e.contains("--baseline-threads") && e.contains("`x` is not a thread count"), "{e}");
    }

    #[test]
    fn secs_must_be_finite_and_positive() {
        assert_eq!(parse(&["--secs", "0.5"]).unwrap().secs, Some(0.5));
        for bad in ["-1", "0", "-0", "NaN", "inf", "-inf", "", "soon"] {
            let e = parse(&["--secs", bad]).expect_err(bad).to_string();
            assert!(e.contains("--secs"), "{bad}: {e}");
        }
    }

    #[test]
    fn stream_modes_parse_and_unknown_ones_are_refused() {
        assert_eq!(parse(&["--streams", "ptds,legacy,own"]).unwrap().streams, Some(StreamMode::ALL.to_vec()));
        assert_eq!(parse(&["--streams", "own"]).unwrap().streams, Some(vec![StreamMode::Own]));
        let e = parse(&["--streams", "ptds,null"]).unwrap_err().to_string();
        assert!(e.contains("`null`") && e.contains("ptds, legacy, own"), "{e}");
        for bad in ["", "ptds,", "PTDS"] {
            assert!(parse(&["--streams", bad]).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn unknown_workloads_are_refused_with_the_valid_ones() {
        assert_eq!(parse(&["--workloads", "churn"]).unwrap().workloads, Some(vec![Workload::Churn]));
        let e = parse(&["--workloads", "churn,spin"]).unwrap_err().to_string();
        assert!(e.contains("`spin`") && e.contains("handoff_msg"), "{e}");
    }

    #[test]
    fn help_lists_the_stream_modes_workloads_allocators_and_defaults() {
        let h = Args::command().render_help().to_string();
        for m in StreamMode::ALL {
            assert!(h.contains(m.name()) && h.contains(m.describe()), "{h}");
        }
        for w in Workload::ALL {
            assert!(h.contains(w.name()), "{h}");
        }
        for a in ["cuarena", "cuMemAllocAsync", "cuMemAlloc", "mutex-first-fit", "cuarena+trace", "harness"] {
            assert!(h.contains(a), "{h}");
        }
        for d in ["default all: ptds,legacy,own", "default: 0.5", "default: 1,2,4,8,16"] {
            assert!(h.contains(d), "{d}: {h}");
        }
    }

    #[test]
    fn the_legend_explains_every_column_of_the_table() {
        let l = legend();
        for col in ["workload", "stream", "thr", "allocator", "pairs/s", "p50 ns", "p99 ns", "peak live"] {
            assert!(l.contains(col), "{col}: {l}");
        }
        for col in ["res/pk", "calls/Mop", "syncs", "conc", "local", "arena"] {
            assert!(l.contains(&format!("\n  {col}")), "{col}: {l}");
        }
    }

    #[test]
    fn unknown_allocators_are_listed_against_the_valid_ones() {
        let valid = ["cuarena", "mutex-first-fit"];
        assert!(check_allocators(&["cuarena".into()], &valid).is_ok());
        let e = check_allocators(&["foo".into(), "cuarena".into(), "bar".into()], &valid).unwrap_err();
        assert!(e.contains("`foo`") && e.contains("`bar`") && !e.contains("`cuarena`"), "{e}");
        assert!(e.contains("cuarena, mutex-first-fit"), "{e}");
        assert!(check_allocators(&["".into()], &valid).is_err());
    }
}
