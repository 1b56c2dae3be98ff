//! `cuarena replay`: plays a recorded allocation trace against cuarena and the baselines.
//!
//! Inputs ([`Format`]):
//! - `cuarena`: a binary trace from `CUARENA_CONF=trace=PATH` or `Allocator::start_trace`
//!   (`cuarena::trace`); `cuarena-csv`: the same written by `cuarena trace-csv`.
//! - `rmm-csv`: RMM's `logging_resource_adaptor` log, header `Thread,Time,Action,Pointer,Size,Stream`;
//!   actions `allocate`/`free` (also `deallocate`; `allocate failure` rows are skipped); time in
//!   seconds (`1634567890.234567`) or `H:M:S.f`/`H:M:S:f`; pointer and stream in hex (`0x..`) or
//!   decimal; stream 0 is the legacy stream. A PyTorch memory snapshot becomes this format with
//!   `tools/torch_snapshot_to_csv.py` (run where torch is installed).
//!
//! How a trace is played:
//! - Records are put in time order (file order among equal times); per address an allocation
//!   is matched with the next free. A free with no allocation before it (a block allocated
//!   before the trace began) is skipped and counted (`unmatched_frees`); a block never freed
//!   is freed after the timed play (`never_freed`); failed allocations and refused frees in the
//!   trace are not played.
//! - Each recorded thread becomes a thread, playing its records in order. A free of a block
//!   that another thread allocated waits until that allocation has happened in the replay (the
//!   recorded pointer is mapped to the live replay pointer). Waits point to earlier records
//!   only, so the replay cannot deadlock.
//! - Each recorded user-stream identity becomes one stream created for the replay; per-thread
//!   stream records play on `0x2` (each thread's own), legacy ones on the legacy stream.
//! - Reported per allocator: pairs/s (matched alloc+free pairs over the wall time of the play),
//!   p50/p99 of one call (alloc or free, waits for another thread's allocation excluded),
//!   peak reserved over the trace's peak live bytes, driver calls, and failures (allocations or
//!   frees the allocator refused).

use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cuarena::config::Echo;
use cuarena::trace::{self, Action, StreamKind};
use cuarena::{Error, Result, Stream};

use crate::Bench;
use crate::waiters::{PENDING, Waiters};

/// A trace's file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Cuarena,
    CuarenaCsv,
    RmmCsv,
}

impl Format {
    pub const ALL: [Format; 3] = [Format::Cuarena, Format::CuarenaCsv, Format::RmmCsv];
    pub fn name(self) -> &'static str {
        match self {
            Format::Cuarena => "cuarena",
            Format::CuarenaCsv => "cuarena-csv",
            Format::RmmCsv => "rmm-csv",
        }
    }
    pub fn parse(s: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// A recorded stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StreamId {
    Legacy,
    PerThread,
    /// A user stream, by its recorded identity (or handle, for RMM logs).
    User(u64),
}

/// One recorded allocation or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub thread: u64,
    pub time: u64,
    pub alloc: bool,
    pub ptr: u64,
    pub size: u64,
    pub stream: StreamId,
}

/// A trace read from a file: its operations in file order, and rows skipped on reading.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub ops: Vec<Op>,
    /// Failed allocations and refused frees in the trace (not played).
    pub not_played: u64,
}

fn err(what: impl std::fmt::Display) -> Error {
    Error::Trace(what.to_string())
}

/// Reads the trace at `path` in `format`.
pub fn load(path: &std::path::Path, format: Format) -> Result<Trace> {
    match format {
        Format::Cuarena => Ok(from_records(&trace::read(path)?)),
        Format::CuarenaCsv => Ok(from_records(&read_cuarena_csv(open(path)?).map_err(|e| at(path, e))?)),
        Format::RmmCsv => read_rmm_csv(open(path)?).map_err(|e| at(path, e)),
    }
}

fn open(path: &std::path::Path) -> Result<std::io::BufReader<std::fs::File>> {
    let f = std::fs::File::open(path).map_err(|e| err(format!("reading {}: {e}", path.display())))?;
    Ok(std::io::BufReader::new(f))
}

fn at(path: &std::path::Path, e: Error) -> Error {
    match e {
        Error::Trace(m) => err(format!("{}: {m}", path.display())),
        e => e,
    }
}

/// The operations of cuarena trace records.
pub fn from_records(recs: &[trace::Record]) -> Trace {
    let mut t = Trace::default();
    for r in recs {
        let alloc = match r.action {
            Action::Alloc => true,
            Action::Free => false,
            _ => {
                t.not_played += 1;
                continue;
            }
        };
        let stream = match r.stream_kind {
            StreamKind::Legacy => StreamId::Legacy,
            StreamKind::PerThread => StreamId::PerThread,
            StreamKind::User => StreamId::User(r.stream.0),
        };
        t.ops.push(Op { thread: r.thread as u64, time: r.time_ns, alloc, ptr: r.ptr, size: r.size, stream });
    }
    t
}

/// Calls `row(fields, bad)` for every non-blank line of `lines` (the header already taken),
/// with its comma-separated fields trimmed, once they are at least `fields` (exactly, with
/// `exact`); `bad(what)` makes the error that names the line.
fn for_each_row(
    lines: impl Iterator<Item = (usize, std::io::Result<String>)>,
    fields: usize,
    exact: bool,
    mut row: impl FnMut(&[&str], &dyn Fn(&str) -> Error) -> Result<()>,
) -> Result<()> {
    for (i, line) in lines {
        let line = line.map_err(err)?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| err(format!("line {}: {what}: `{}`", i + 1, Echo(&line)));
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() < fields || (exact && f.len() != fields) {
            return Err(bad(&format!("expected {fields} fields")));
        }
        row(&f, &bad)?;
    }
    Ok(())
}

/// The longest line a CSV trace may have: a real row is under a hundred bytes, and reading an
/// input with no line ends (a device, a binary file) must end long before host memory does.
pub const MAX_LINE: usize = 1 << 16;

/// `input`'s lines, numbered from 0, each at most [`MAX_LINE`] bytes: a longer one is an error,
/// and nothing is read after an error.
fn bounded_lines(mut input: impl BufRead) -> impl Iterator<Item = (usize, std::io::Result<String>)> {
    let mut i = 0;
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        let mut buf = Vec::new();
        let r = match std::io::Read::take(&mut input, MAX_LINE as u64 + 1).read_until(b'\n', &mut buf) {
            Ok(0) => return None,
            Ok(_) if buf.len() > MAX_LINE && buf.last() != Some(&b'\n') => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("line {} is longer than {MAX_LINE} bytes: not a CSV trace", i + 1),
            )),
            Ok(_) => {
                while matches!(buf.last(), Some(b'\n' | b'\r')) {
                    buf.pop();
                }
                String::from_utf8(buf).map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "stream did not contain valid UTF-8")
                })
            }
            Err(e) => Err(e),
        };
        done = r.is_err();
        i += 1;
        Some((i - 1, r))
    })
}

/// Reads `cuarena trace-csv` output back into records.
pub fn read_cuarena_csv(input: impl BufRead) -> Result<Vec<trace::Record>> {
    let mut lines = bounded_lines(input);
    match lines.next() {
        Some((_, Ok(h))) if h.trim() == trace::CSV_HEADER => {}
        Some((_, Ok(h))) => {
            return Err(err(format!("line 1: header `{}`, expected `{}`", Echo(&h), trace::CSV_HEADER)));
        }
        Some((_, Err(e))) => return Err(err(e)),
        None => return Err(err("empty file: no header")),
    }
    let mut out = Vec::new();
    for_each_row(lines, 8, true, |f, bad| {
        out.push(trace::Record {
            thread: f[0].parse().map_err(|_| bad("bad thread"))?,
            time_ns: f[1].parse().map_err(|_| bad("bad time"))?,
            action: Action::parse(f[2]).ok_or_else(|| bad("unknown action"))?,
            ptr: number(f[3]).ok_or_else(|| bad("bad pointer"))?,
            size: f[4].parse().map_err(|_| bad("bad size"))?,
            stream_kind: StreamKind::parse(f[5]).ok_or_else(|| bad("unknown stream kind"))?,
            stream: cuarena::StreamKey(f[6].parse().map_err(|_| bad("bad stream"))?),
            path: trace::TracePath::parse(f[7]).ok_or_else(|| bad("unknown path"))?,
        });
        Ok(())
    })?;
    Ok(out)
}

/// A number in hex (`0x..`) or decimal.
fn number(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None if s == "(nil)" || s == "nullptr" => Some(0),
        None => s.parse().ok(),
    }
}

/// RMM's time: seconds (with a fraction) or `H:M:S.f` / `H:M:S:f`; nanoseconds.
fn rmm_time(s: &str) -> Option<u64> {
    let s = s.trim();
    if !s.contains(':') {
        let x: f64 = s.parse().ok()?;
        // Refused past u64 nanoseconds (about 584 years), as the `H:M:S` form is: a cast would
        // saturate, and two such times would tie and replay in the file's order.
        let ns = x * 1e9;
        return (x.is_finite() && x >= 0.0 && ns < u64::MAX as f64).then_some(ns as u64);
    }
    let parts: Vec<&str> = s.split([':', '.']).collect();
    if parts.len() < 3 {
        return None;
    }
    let (h, m, sec): (u64, u64, u64) =
        (parts[0].parse().ok()?, parts[1].parse().ok()?, parts[2].parse().ok()?);
    let frac = match parts.get(3) {
        Some(f) if !f.is_empty() && f.len() <= 9 => f.parse::<u64>().ok()? * 10u64.pow(9 - f.len() as u32),
        Some(_) => return None,
        None => 0,
    };
    h.checked_mul(60)?
        .checked_add(m)?
        .checked_mul(60)?
        .checked_add(sec)?
        .checked_mul(1_000_000_000)?
        .checked_add(frac)
}

/// Reads an RMM logging-adaptor CSV (module comment).
pub fn read_rmm_csv(input: impl BufRead) -> Result<Trace> {
    let mut lines = bounded_lines(input);
    let cols: Vec<String> = match lines.next() {
        Some((_, Ok(h))) => h.split(',').map(|c| c.trim().to_ascii_lowercase()).collect(),
        Some((_, Err(e))) => return Err(err(e)),
        None => return Err(err("empty file: no header")),
    };
    let col = |name: &str| {
        cols.iter().position(|c| c == name).ok_or_else(|| {
            err(format!(
                "line 1: no `{name}` column (RMM's header is Thread,Time,Action,Pointer,Size,Stream)"
            ))
        })
    };
    let (ct, ctime, ca, cp, cs) =
        (col("thread")?, col("time")?, col("action")?, col("pointer")?, col("size")?);
    let cstream = cols.iter().position(|c| c == "stream");
    let mut t = Trace::default();
    let mut threads: HashMap<String, u64> = HashMap::new();
    for_each_row(lines, cols.len(), false, |f, bad| {
        let alloc = match f[ca].to_ascii_lowercase().as_str() {
            "allocate" | "alloc" => true,
            "free" | "deallocate" => false,
            a if a.contains("failure") || a.contains("fail") => {
                t.not_played += 1;
                return Ok(());
            }
            _ => return Err(bad("unknown action (allocate, free, deallocate or allocate failure)")),
        };
        let n = threads.len() as u64;
        let thread = *threads.entry(f[ct].to_string()).or_insert(n);
        let stream = match cstream.map(|c| number(f[c])) {
            None | Some(Some(0)) => StreamId::Legacy,
            Some(Some(1)) => StreamId::Legacy,
            Some(Some(2)) => StreamId::PerThread,
            Some(Some(s)) => StreamId::User(s),
            Some(None) => return Err(bad("bad stream")),
        };
        t.ops.push(Op {
            thread,
            time: rmm_time(f[ctime]).ok_or_else(|| bad("bad time"))?,
            alloc,
            ptr: number(f[cp]).ok_or_else(|| bad("bad pointer"))?,
            size: f[cs].parse().map_err(|_| bad("bad size"))?,
            stream,
        });
        Ok(())
    })?;
    Ok(t)
}

/// What a thread plays.
#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc {
        id: usize,
        size: usize,
        stream: StreamId,
    },
    /// `wait`: the block was allocated by another thread.
    Free {
        id: usize,
        size: usize,
        stream: StreamId,
        wait: bool,
    },
}

/// A trace made ready to play.
#[derive(Debug)]
pub struct Plan {
    threads: Vec<Vec<Step>>,
    /// Blocks never freed in the trace: (id, size, stream, thread index).
    leftover: Vec<(usize, usize, StreamId, usize)>,
    pub allocations: u64,
    pub pairs: u64,
    pub unmatched_frees: u64,
    pub never_freed: u64,
    pub cross_thread_frees: u64,
    pub not_played: u64,
    /// The trace's own peak of live bytes (sizes as requested).
    pub peak_live: u64,
    pub user_streams: Vec<u64>,
}

impl Plan {
    /// Orders and matches the trace (module comment).
    pub fn new(t: &Trace) -> Plan {
        let mut order: Vec<usize> = (0..t.ops.len()).collect();
        order.sort_by_key(|&i| (t.ops[i].time, i));
        let mut tix: BTreeMap<u64, usize> = BTreeMap::new();
        for op in &t.ops {
            let n = tix.len();
            tix.entry(op.thread).or_insert(n);
        }
        let mut threads = vec![Vec::new(); tix.len()];
        let mut live: HashMap<u64, (usize, usize, usize, StreamId)> = HashMap::new(); // ptr -> id, thread, size
        let mut owner_of = Vec::new();
        let (mut unmatched, mut cross, mut pairs) = (0, 0, 0);
        let (mut now, mut peak) = (0u64, 0u64);
        let mut streams = std::collections::BTreeSet::new();
        let mut leftover_dupes = Vec::new();
        for &i in &order {
            let op = &t.ops[i];
            let th = tix[&op.thread];
            if let StreamId::User(s) = op.stream {
                streams.insert(s);
            }
            if op.alloc {
                let id = owner_of.len();
                owner_of.push(th);
                threads[th].push(Step::Alloc { id, size: op.size as usize, stream: op.stream });
                now = now.saturating_add(op.size);
                peak = peak.max(now);
                // An address allocated again while live (a trace missing a free): the older
                // block is kept live to the end.
                if let Some(old) = live.insert(op.ptr, (id, th, op.size as usize, op.stream)) {
                    leftover_dupes.push(old);
                }
            } else {
                let Some((id, ath, size, _)) = live.remove(&op.ptr) else {
                    unmatched += 1;
                    continue;
                };
                now = now.saturating_sub(size as u64);
                let wait = ath != th;
                cross += u64::from(wait);
                pairs += 1;
                threads[th].push(Step::Free { id, size, stream: op.stream, wait });
            }
        }
        let mut leftover: Vec<(usize, usize, StreamId, usize)> =
            live.into_values().chain(leftover_dupes).map(|(id, th, size, s)| (id, size, s, th)).collect();
        leftover.sort_unstable_by_key(|l| l.0);
        Plan {
            threads,
            never_freed: leftover.len() as u64,
            leftover,
            allocations: owner_of.len() as u64,
            pairs,
            unmatched_frees: unmatched,
            cross_thread_frees: cross,
            not_played: t.not_played,
            peak_live: peak,
            user_streams: streams.into_iter().collect(),
        }
    }

    /// Recorded threads.
    pub fn threads(&self) -> usize {
        self.threads.len()
    }
}

/// One allocator's replay.
#[derive(Clone, Debug)]
pub struct ReplayPoint {
    pub allocator: String,
    pub threads: usize,
    pub allocations: u64,
    pub pairs: u64,
    pub secs: f64,
    pub pairs_per_sec: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub peak_live_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub driver_calls: u64,
    pub failed_allocs: u64,
    pub failed_frees: u64,
}

impl ReplayPoint {
    /// Peak reserved over the trace's peak live bytes.
    pub fn memory_ratio(&self) -> f64 {
        if self.peak_live_bytes == 0 {
            0.0
        } else {
            self.peak_reserved_bytes as f64 / self.peak_live_bytes as f64
        }
    }
    pub fn json(&self) -> String {
        serde_json::json!({
            "allocator": self.allocator,
            "threads": self.threads,
            "allocations": self.allocations,
            "pairs": self.pairs,
            "secs": self.secs,
            "pairs_per_sec": self.pairs_per_sec,
            "p50_ns": self.p50_ns,
            "p99_ns": self.p99_ns,
            "peak_live_bytes": self.peak_live_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "reserved_over_live": self.memory_ratio(),
            "driver_calls": self.driver_calls,
            "failed_allocs": self.failed_allocs,
            "failed_frees": self.failed_frees,
        })
        .to_string()
    }
}

/// The most recorded threads a replay plays (one OS thread each).
pub const MAX_THREADS: usize = 1024;
/// The most recorded user streams a replay plays (one stream each, made before the replay, for
/// every allocator): a few megabytes of trace could otherwise ask for any number, and the
/// simulated device's streams cost memory quadratic in their number (each stream's and
/// event's clock has an entry per stream ever made).
pub const MAX_USER_STREAMS: usize = 1024;

/// A replay slot: not yet allocated ([`PENDING`]), failed, or the live pointer.
const FAILED: u64 = u64::MAX;

impl Bench {
    /// Plays `plan` against the allocator `name`.
    pub fn replay(&self, name: &str, plan: &Plan) -> Result<ReplayPoint> {
        if plan.threads() > MAX_THREADS {
            return Err(err(format!(
                "the trace has {} threads; the replay plays each on a thread of its own, and refuses more than {MAX_THREADS}",
                plan.threads()
            )));
        }
        if plan.user_streams.len() > MAX_USER_STREAMS {
            return Err(err(format!(
                "the trace has {} user streams; the replay makes a stream for each, and refuses more than {MAX_USER_STREAMS}",
                plan.user_streams.len()
            )));
        }
        let alloc: Arc<dyn crate::BenchAlloc> = Arc::from(self.make(name)?);
        let mut streams: HashMap<u64, Stream> = HashMap::new();
        for &s in &plan.user_streams {
            streams.insert(s, self.create_stream()?);
        }
        let stream_of = |s: StreamId| match s {
            StreamId::Legacy => Stream::LEGACY,
            StreamId::PerThread => Stream::PER_THREAD,
            StreamId::User(k) => streams[&k],
        };
        let slots: Vec<AtomicU64> = (0..plan.allocations).map(|_| AtomicU64::new(PENDING)).collect();
        let waiters = Waiters::default();
        let t0 = Instant::now();
        let results: Vec<Option<(Vec<u64>, u64, u64)>> = std::thread::scope(|sc| {
            let mut hs = Vec::new();
            for steps in &plan.threads {
                let (alloc, slots, stream_of, waiters) = (&alloc, &slots, &stream_of, &waiters);
                let play = move || {
                    // If the player panics (an allocator's bug), the others must not wait for it.
                    struct Abandon<'a>(&'a Waiters);
                    impl Drop for Abandon<'_> {
                        fn drop(&mut self) {
                            if std::thread::panicking() {
                                self.0.abandon();
                            }
                        }
                    }
                    let _abandon = Abandon(waiters);
                    let mut lat = Vec::with_capacity(steps.len());
                    let (mut fa, mut ff) = (0u64, 0u64);
                    for &step in steps {
                        match step {
                            Step::Alloc { id, size, stream } => {
                                let t = Instant::now();
                                let r = alloc.alloc(size, stream_of(stream));
                                lat.push(t.elapsed().as_nanos() as u64);
                                let v = match r {
                                    Ok(p) if p != PENDING && p != FAILED => p,
                                    _ => {
                                        fa += 1;
                                        FAILED
                                    }
                                };
                                waiters.store(slots, id, v);
                            }
                            Step::Free { id, size, stream, wait } => {
                                let p = if wait {
                                    waiters.wait(&slots[id], id)
                                } else {
                                    slots[id].load(Ordering::Acquire)
                                };
                                if p == FAILED || p == PENDING {
                                    continue;
                                }
                                let t = Instant::now();
                                let r = alloc.free(p, size, stream_of(stream));
                                lat.push(t.elapsed().as_nanos() as u64);
                                ff += u64::from(r.is_err());
                            }
                        }
                    }
                    alloc.thread_end();
                    (lat, fa, ff)
                };
                match std::thread::Builder::new().spawn_scoped(sc, play) {
                    Ok(h) => hs.push(h),
                    Err(e) => {
                        waiters.abandon();
                        eprintln!("replay: cannot start a thread for recorded thread {}: {e}", hs.len());
                        break;
                    }
                }
            }
            let started = hs.len();
            let mut r: Vec<_> = hs.into_iter().map(|h| h.join().ok()).collect();
            r.resize(plan.threads().max(started), None);
            r
        });
        if waiters.abandoned() || results.iter().any(Option::is_none) {
            return Err(err(
                "the replay did not finish: a thread could not be started, or a player panicked (see above)",
            ));
        }
        let results: Vec<(Vec<u64>, u64, u64)> = results.into_iter().flatten().collect();
        let secs = t0.elapsed().as_secs_f64();
        let counts = alloc.counts();
        // Blocks the trace never freed: freed now, outside the timing.
        for &(id, size, s, _) in &plan.leftover {
            let p = slots[id].load(Ordering::Acquire);
            if p != FAILED && p != PENDING {
                let _ = alloc.free(p, size, stream_of(s));
            }
        }
        alloc.thread_end();
        drop(alloc);
        for s in streams.into_values() {
            self.destroy_stream(s)?;
        }
        let mut lat: Vec<u64> = results.iter().flat_map(|r| r.0.iter().copied()).collect();
        lat.sort_unstable();
        let pct = |q: f64| if lat.is_empty() { 0 } else { lat[((lat.len() - 1) as f64 * q) as usize] };
        Ok(ReplayPoint {
            allocator: name.to_string(),
            threads: plan.threads(),
            allocations: plan.allocations,
            pairs: plan.pairs,
            secs,
            pairs_per_sec: if secs > 0.0 { plan.pairs as f64 / secs } else { 0.0 },
            p50_ns: pct(0.5),
            p99_ns: pct(0.99),
            peak_live_bytes: plan.peak_live,
            peak_reserved_bytes: counts.peak_reserved,
            driver_calls: counts.driver_calls,
            failed_allocs: results.iter().map(|r| r.1).sum(),
            failed_frees: results.iter().map(|r| r.2).sum(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmm_times_and_numbers_parse() {
        assert_eq!(rmm_time("1634567890.5"), Some(1_634_567_890_500_000_000));
        assert_eq!(rmm_time("01:02:03.000004"), Some(3_723_000_004_000));
        assert_eq!(rmm_time("01:02:03:5"), Some(3_723_500_000_000));
        assert_eq!(rmm_time("x"), None);
        assert_eq!(number("0x7f00"), Some(0x7f00));
        assert_eq!(number("42"), Some(42));
        assert_eq!(number("zz"), None);
    }

    #[test]
    fn a_plan_matches_frees_waits_across_threads_and_counts_the_rest() {
        let op = |thread, time, alloc, ptr, size| Op {
            thread,
            time,
            alloc,
            ptr,
            size,
            stream: StreamId::PerThread,
        };
        let t = Trace {
            ops: vec![
                op(0, 5, false, 0x900, 10), // freed before the trace: unmatched
                op(0, 10, true, 0x100, 256),
                op(1, 20, false, 0x100, 256), // another thread's block: waits
                op(1, 30, true, 0x100, 512),  // the address again
                op(1, 40, true, 0x200, 1024), // never freed
                op(1, 50, false, 0x100, 512),
            ],
            not_played: 2,
        };
        let p = Plan::new(&t);
        assert_eq!((p.allocations, p.pairs, p.unmatched_frees, p.never_freed), (3, 2, 1, 1));
        assert_eq!((p.cross_thread_frees, p.not_played, p.peak_live), (1, 2, 1536));
        assert!(matches!(p.threads[1][0], Step::Free { id: 0, wait: true, .. }));
        assert!(matches!(p.threads[1][3], Step::Free { id: 1, wait: false, .. }));
    }
}
