//! `cargo run --release`: a short multi-threaded benchmark of cuarena against the baselines,
//! on the GPU if there is one, otherwise on the host-simulated device.
//!
//! Usage: cuarena [--quick] [--json] [--secs S] [--threads 1,2,4] [--workloads churn,handoff]
//!                [--allocators cuarena,cuMemAllocAsync] [--streams ptds,legacy,own]
//!                [--baseline-threads 1,16] [--no-touch] [--touch-only]
//! (`--help` describes each option and its default.)

use std::io::Write;

use cuarena::bench::{Bench, Point, StreamMode, Workload};

struct Args {
    quick: bool,
    json: bool,
    secs: Option<f64>,
    threads: Option<Vec<usize>>,
    workloads: Option<Vec<Workload>>,
    allocators: Option<Vec<String>>,
    streams: Vec<StreamMode>,
    touch: Vec<bool>,
    /// Thread counts at which `cuMemAlloc` runs (default: 1 and the most); never with touch.
    baseline_threads: Option<Vec<usize>>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        json: false,
        secs: None,
        threads: None,
        workloads: None,
        allocators: None,
        streams: StreamMode::ALL.to_vec(),
        touch: vec![false, true],
        baseline_threads: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--json" => a.json = true,
            "--no-touch" => a.touch = vec![false],
            "--touch-only" => a.touch = vec![true],
            "--secs" => a.secs = Some(parse_secs(&val("--secs")?)?),
            "--threads" => a.threads = Some(parse_list("--threads", &val("--threads")?)?),
            "--workloads" => {
                let v = val("--workloads")?;
                a.workloads = Some(
                    v.split(',')
                        .map(|w| Workload::parse(w).ok_or(format!("unknown workload {w}")))
                        .collect::<Result<_, _>>()?,
                );
            }
            "--streams" => a.streams = parse_streams(&val("--streams")?)?,
            "--allocators" => {
                a.allocators = Some(val("--allocators")?.split(',').map(str::to_string).collect())
            }
            "--baseline-threads" => {
                a.baseline_threads = Some(parse_list("--baseline-threads", &val("--baseline-threads")?)?)
            }
            "-h" | "--help" => {
                print!("{}", help());
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// The `--help` text.
fn help() -> String {
    let workloads: Vec<&str> = Workload::ALL.iter().map(|w| w.name()).collect();
    let modes: String =
        StreamMode::ALL.iter().map(|m| format!("    {:<7} {}\n", m.name(), m.describe())).collect();
    format!(
        "cuarena benchmark: alloc+free pairs per second of cuarena against the baselines, on the GPU if\n\
         there is one, otherwise on the host-simulated device.\n\n\
         Options:\n  \
         --quick                  short run: threads 1,4,16 (capped at the cores), 0.15 s a point\n  \
         --json                   one JSON object per point on stdout instead of the table\n  \
         --secs S                 seconds each point is timed (default 0.5; 0.15 with --quick)\n  \
         --threads 1,2,4          thread counts (default 1,2,4,8,16 capped at the cores)\n  \
         --workloads W,...        default all: {}\n  \
         --allocators A,...       default every allocator this device runs\n  \
         --streams M,...          stream modes (default all: ptds,legacy,own):\n{}  \
         --baseline-threads 1,16  thread counts at which cuMemAlloc runs (default 1 and the most)\n  \
         --no-touch               only the variants without a memset per allocation\n  \
         --touch-only             only the variants with a 4 KiB memset per allocation\n",
        workloads.join(","),
        modes
    )
}

/// Parses a comma-separated list of stream modes (repeats are dropped).
fn parse_streams(v: &str) -> Result<Vec<StreamMode>, String> {
    let mut out = Vec::new();
    for m in v.split(',') {
        let mode = StreamMode::parse(m.trim()).ok_or_else(|| {
            let valid: Vec<&str> = StreamMode::ALL.iter().map(|m| m.name()).collect();
            format!("--streams: unknown stream mode `{m}` (valid: {})", valid.join(", "))
        })?;
        if !out.contains(&mode) {
            out.push(mode);
        }
    }
    Ok(out)
}

/// Parses a comma-separated list of thread counts, each at least 1.
fn parse_list(flag: &str, v: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .map(|t| match t.trim().parse::<usize>() {
            Ok(0) => Err(format!("{flag}: thread counts must be at least 1, got 0")),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("{flag}: `{t}` is not a thread count ({e})")),
        })
        .collect()
}

/// Parses the seconds each point runs: a finite number above zero.
fn parse_secs(v: &str) -> Result<f64, String> {
    let s: f64 = v.trim().parse().map_err(|e| format!("--secs: `{v}` is not a number ({e})"))?;
    if s.is_finite() && s > 0.0 {
        Ok(s)
    } else {
        Err(format!("--secs must be a finite number of seconds above 0, got {v}"))
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

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let bench = Bench::detect();
    eprintln!("cuarena benchmark on {}", bench.description);
    if let Some(requested) = &args.allocators
        && let Err(e) = check_allocators(requested, &bench.allocator_names())
    {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads: Vec<usize> = args.threads.clone().unwrap_or_else(|| {
        let all = if args.quick { vec![1, 4, 16] } else { vec![1, 2, 4, 8, 16] };
        let mut v: Vec<usize> = all.into_iter().map(|t| t.min(cores)).collect();
        v.dedup();
        v
    });
    let workloads = args.workloads.clone().unwrap_or_else(|| Workload::ALL.to_vec());
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
        for &touch in &args.touch {
            for &mode in &args.streams {
                let ts: Vec<usize> = if w == Workload::RandomAllocations { vec![1] } else { threads.clone() };
                for &t in &ts {
                    for a in &allocators {
                        // cuMemAlloc synchronises the device on every free: a short run says enough.
                        let s = if a == "cuMemAlloc" { secs.min(0.2) } else { secs };
                        if a == "cuMemAlloc" && (touch || !baseline_threads.contains(&t)) {
                            continue;
                        }
                        plan.push((w, touch, mode, t, a.clone(), s));
                    }
                }
            }
        }
    }
    let mut points: Vec<Point> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    let n = plan.len();
    if n == 0 {
        eprintln!("error: nothing to measure: every requested workload was skipped on this device");
        std::process::exit(1);
    }
    for (i, (w, touch, mode, t, a, s)) in plan.into_iter().enumerate() {
        eprint!(
            "\r[{:>3}/{n}] {:<24} {:<6} {:>2} threads {:<16}",
            i + 1,
            format!("{}{}", w.name(), if touch { "+touch" } else { "" }),
            mode.name(),
            t,
            a
        );
        let _ = std::io::stderr().flush();
        match bench.run(&a, w, touch, mode, t, s) {
            Ok(p) => {
                if args.json {
                    println!("{}", p.json());
                }
                points.push(p);
            }
            Err(e) => {
                let what = format!(
                    "{a} {}{} streams={} {t} threads failed: {e}",
                    w.name(),
                    if touch { "+touch" } else { "" },
                    mode.name()
                );
                eprintln!("\n{what}");
                failures.push(what);
            }
        }
    }
    eprintln!();
    if !args.json {
        print_table(&bench, &points);
    }
    if !failures.is_empty() {
        eprintln!("error: {} of {n} measurements failed:", failures.len());
        for f in &failures {
            eprintln!("  {f}");
        }
        std::process::exit(1);
    }
}

fn print_table(bench: &Bench, points: &[Point]) {
    println!("device: {}", bench.description);
    println!(
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
        println!(
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
    if points.iter().any(|p| p.local_frees.is_some()) {
        println!(
            "local: share of the timed pairs whose block the allocating thread freed itself (a full \
             handoff queue, a ring of one thread, prodcons' last even thread); '-' where every free is \
             local by design. Blocks still queued at the end are freed after the window, not counted."
        );
    }
    if points.iter().any(|p| p.arena_allocations.is_some()) {
        println!(
            "arena: share of cuarena's timed allocations served by a thread's arena (the rest by the pool)"
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_must_be_at_least_one() {
        assert_eq!(parse_list("--threads", "1,4,16"), Ok(vec![1, 4, 16]));
        let e = parse_list("--threads", "0").unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
        assert!(parse_list("--threads", "4,0").is_err());
        assert!(parse_list("--threads", "-1").is_err());
        assert!(parse_list("--threads", "").is_err());
        assert!(parse_list("--baseline-threads", "x").unwrap_err().starts_with("--baseline-threads"));
    }

    #[test]
    fn secs_must_be_finite_and_positive() {
        assert_eq!(parse_secs("0.5"), Ok(0.5));
        for bad in ["-1", "0", "-0", "NaN", "inf", "-inf", "", "soon"] {
            assert!(parse_secs(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn stream_modes_parse_and_unknown_ones_are_refused() {
        assert_eq!(parse_streams("ptds,legacy,own"), Ok(StreamMode::ALL.to_vec()));
        assert_eq!(parse_streams("own"), Ok(vec![StreamMode::Own]));
        assert_eq!(parse_streams("legacy, ptds,legacy"), Ok(vec![StreamMode::Legacy, StreamMode::PerThread]));
        let e = parse_streams("ptds,null").unwrap_err();
        assert!(e.contains("`null`") && e.contains("ptds, legacy, own"), "{e}");
        assert!(parse_streams("").is_err());
        assert!(parse_streams("ptds,").is_err());
        assert!(parse_streams("PTDS").is_err());
    }

    #[test]
    fn help_lists_every_stream_mode_and_workload() {
        let h = help();
        for m in StreamMode::ALL {
            assert!(h.contains(m.name()) && h.contains(m.describe()), "{h}");
        }
        for w in Workload::ALL {
            assert!(h.contains(w.name()), "{h}");
        }
        assert!(h.contains("default all: ptds,legacy,own"), "{h}");
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
