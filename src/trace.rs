//! Allocation traces: every allocate and free an allocator serves, recorded to a file.
//!
//! Started by `trace=PATH` in `CUARENA_CONF` (or [`ConfigBuilder::trace`](crate::ConfigBuilder::trace)),
//! or by [`Allocator::start_trace`](crate::Allocator::start_trace); ended by
//! [`Allocator::stop_trace`](crate::Allocator::stop_trace), by the allocator's drop, or at process
//! exit (an `atexit` hook ends every trace still running, so a process-wide allocator's trace is
//! complete too).
//!
//! ## Format (version 1, all little-endian)
//! A 16-byte header: the magic `CUATRACE` (8 bytes), the version (`u32`, 1), the record size
//! (`u32`, 40). Then records of [`RECORD_SIZE`] bytes each:
//!
//! | offset | type | field |
//! | --- | --- | --- |
//! | 0 | `u64` | time: nanoseconds since the trace started (one monotonic clock for all threads) |
//! | 8 | `u64` | pointer (the block's device address; 0 for a failed allocation) |
//! | 16 | `u64` | size: the bytes asked for (as given to allocate or free) |
//! | 24 | `u64` | stream identity: the stream's [`StreamKey`] (`cuStreamGetId`), never its handle; for the per-thread stream `0x2`, the calling thread's own per-thread stream's key; 0 if it could not be told (a destroyed stream, a stream being captured, the legacy stream while a blocking stream is captured or, until its identity is known, while a capture is announced; any failed lookup) |
//! | 32 | `u32` | thread: a small index per allocator, in order of each thread's first record ([`LATE_THREAD`] for a record made in a thread's late destructors) |
//! | 36 | `u8` | action: [`Action`] (0 alloc, 1 free, 2 failed alloc, 3 refused free) |
//! | 37 | `u8` | path: [`TracePath`] (0 none, 1 arena, 2 large block in an arena, 3 global pool, 4 pass-through) |
//! | 38 | `u8` | stream kind: [`StreamKind`] (0 legacy, 1 per-thread, 2 user stream) |
//! | 39 | `u8` | reserved, 0 |
//!
//! Records are written in blocks, one thread's at a time, so the file is in time order within
//! each thread only; sort by time for a global order. An allocation is stamped when it has
//! returned and a free when it is called, so the records of one address alternate alloc, free
//! in time order across all threads. For that the allocator asks whether a trace runs *after*
//! an allocation (and before a free): an allocation that began before the start can return a
//! block whose free the trace recorded (before this rule, such an allocation went unrecorded
//! and the trace held two frees in a row). Whatever made that block reach the allocating thread
//! orders the free's load of `on` before the allocation's, so the allocation sees this trace's
//! `on` or a later store. `cuarena trace-csv IN OUT` writes a trace as CSV.
//!
//! ## Recording without serialising the threads
//! Each thread appends to its own buffer (`ThreadLog`) with no lock; a full buffer
//! ([`BUFFER_RECORDS`]) is written out by its owner in a cold function under the file's lock
//! (one lock per buffer, not per record). Thread exit writes the thread's rest. When tracing is
//! off, the allocator's only cost is one `Relaxed` load of `Shared::on`.
//!
//! `stop` must collect the buffers of threads that are alive and may be recording this very
//! moment, without their help. This is Dekker's protocol, as in `claim.rs`, but with full fences
//! on both sides (recording is not the allocator's no-read-modify-write fast path):
//! - **owner** (`enter`): store `active = true`; `fence(SeqCst)`; load `on` (`Acquire`). If off,
//!   store `active = false` and record nothing. Otherwise the buffer is the owner's until `leave`
//!   stores `active = false` (`Release`).
//! - **collector** (`stop`, one at a time): store `on = false`; `fence(SeqCst)`; then for every
//!   registered thread, wait until its `active` is false (`Acquire`), and take its buffer.
//!
//! The fences order each side's store before its load, so an owner either sees `on` false or is
//! seen active by the collector, which then waits for it. A thread registers before its first
//! `enter`, so a thread the collector did not see registered enters after the collector's fence
//! and sees `on` false. `loom-tests/tests/trace.rs` checks that no recorded record is lost or
//! written twice, and that the owner and the collector never touch a buffer at once; the
//! mutations `trace_no_owner_fence` and `trace_no_wait` must fail it.

use std::cell::RefCell;
use std::io::Write;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::stream::{Stream, StreamKey};
use crate::sync::{
    AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering, UnsafeCell, fence, lock, thread_local, yield_now,
};

/// The file's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"CUATRACE";
/// The format version this crate writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header: magic, version, record size.
pub const HEADER_SIZE: usize = 16;
/// Bytes of one record.
pub const RECORD_SIZE: usize = 40;
/// Records a thread gathers before it writes them out.
pub const BUFFER_RECORDS: usize = 4096;
/// The thread index of records made where the thread's own buffer is gone (its late
/// destructors): written straight to the file.
pub const LATE_THREAD: u32 = u32::MAX;
/// The header line of [`write_csv`].
pub const CSV_HEADER: &str = "thread,time_ns,action,ptr,size,stream_kind,stream,path";

/// What a record says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Action {
    /// An allocation that succeeded.
    Alloc = 0,
    /// A free that was accepted.
    Free = 1,
    /// An allocation that failed (out of memory, a driver error); the pointer is 0.
    FailedAlloc = 2,
    /// A free that was refused (an invalid free).
    RefusedFree = 3,
}

/// Where the block lives, as the allocator saw it at that moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TracePath {
    /// None (a failed allocation, a refused free of an unknown address).
    None = 0,
    /// A small block of a thread's arena.
    Arena = 1,
    /// A large block (over `small_max`) of a thread's arena, from a large superblock.
    LargeArena = 2,
    /// A block of the global pool.
    Pool = 3,
    /// Pass-through mode: straight from the driver.
    Passthrough = 4,
}

/// Which kind of stream the request named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum StreamKind {
    /// The legacy default stream (NULL or `0x1`).
    Legacy = 0,
    /// The calling thread's per-thread default stream (`0x2`).
    PerThread = 1,
    /// A stream the program created.
    User = 2,
}

/// One allocate or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Record {
    /// Nanoseconds since the trace started.
    pub time_ns: u64,
    /// The block's address (0 for a failed allocation).
    pub ptr: u64,
    /// The size given to allocate or free.
    pub size: u64,
    /// The stream's identity (0 if it could not be told: see the format's table).
    pub stream: StreamKey,
    /// The thread's index in this trace's allocator.
    pub thread: u32,
    pub action: Action,
    pub path: TracePath,
    pub stream_kind: StreamKind,
}

impl Action {
    fn from_u8(v: u8) -> Option<Action> {
        [Action::Alloc, Action::Free, Action::FailedAlloc, Action::RefusedFree].get(v as usize).copied()
    }
    /// Its name in CSV.
    pub fn name(self) -> &'static str {
        ["alloc", "free", "failed_alloc", "refused_free"][self as usize]
    }
    /// The action named `s` in CSV.
    pub fn parse(s: &str) -> Option<Action> {
        (0..4).map(|i| Action::from_u8(i).expect("0..4")).find(|a| a.name() == s)
    }
}

impl TracePath {
    fn from_u8(v: u8) -> Option<TracePath> {
        use TracePath::*;
        [None, Arena, LargeArena, Pool, Passthrough].get(v as usize).copied()
    }
    /// Its name in CSV.
    pub fn name(self) -> &'static str {
        ["none", "arena", "large_arena", "pool", "passthrough"][self as usize]
    }
    /// The path named `s` in CSV.
    pub fn parse(s: &str) -> Option<TracePath> {
        (0..5).map(|i| TracePath::from_u8(i).expect("0..5")).find(|p| p.name() == s)
    }
}

impl StreamKind {
    fn from_u8(v: u8) -> Option<StreamKind> {
        [StreamKind::Legacy, StreamKind::PerThread, StreamKind::User].get(v as usize).copied()
    }
    /// Its name in CSV.
    pub fn name(self) -> &'static str {
        ["legacy", "per_thread", "user"][self as usize]
    }
    /// The kind named `s` in CSV.
    pub fn parse(s: &str) -> Option<StreamKind> {
        (0..3).map(|i| StreamKind::from_u8(i).expect("0..3")).find(|k| k.name() == s)
    }
    /// The kind of `stream`.
    pub fn of(stream: Stream) -> StreamKind {
        if stream.is_per_thread() {
            StreamKind::PerThread
        } else if stream.is_legacy() {
            StreamKind::Legacy
        } else {
            StreamKind::User
        }
    }
}

impl Record {
    /// The record's [`RECORD_SIZE`] bytes.
    pub fn encode(&self) -> [u8; RECORD_SIZE] {
        let mut b = [0u8; RECORD_SIZE];
        b[0..8].copy_from_slice(&self.time_ns.to_le_bytes());
        b[8..16].copy_from_slice(&self.ptr.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.stream.0.to_le_bytes());
        b[32..36].copy_from_slice(&self.thread.to_le_bytes());
        b[36] = self.action as u8;
        b[37] = self.path as u8;
        b[38] = self.stream_kind as u8;
        b
    }

    /// Reads a record from [`RECORD_SIZE`] bytes; an error names the bad field.
    pub fn decode(b: &[u8; RECORD_SIZE]) -> Result<Record, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Record {
            time_ns: u64_at(0),
            ptr: u64_at(8),
            size: u64_at(16),
            stream: StreamKey(u64_at(24)),
            thread: u32::from_le_bytes(b[32..36].try_into().expect("4 bytes")),
            action: Action::from_u8(b[36]).ok_or(format!("unknown action {}", b[36]))?,
            path: TracePath::from_u8(b[37]).ok_or(format!("unknown path {}", b[37]))?,
            stream_kind: StreamKind::from_u8(b[38]).ok_or(format!("unknown stream kind {}", b[38]))?,
        })
    }

    /// The record as one CSV line (no newline), in [`CSV_HEADER`]'s columns.
    pub fn csv(&self) -> String {
        format!(
            "{},{},{},{:#x},{},{},{},{}",
            self.thread,
            self.time_ns,
            self.action.name(),
            self.ptr,
            self.size,
            self.stream_kind.name(),
            self.stream.0,
            self.path.name()
        )
    }
}

/// The header of a version-1 trace.
pub fn header() -> [u8; HEADER_SIZE] {
    let mut h = [0u8; HEADER_SIZE];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(RECORD_SIZE as u32).to_le_bytes());
    h
}

/// Reads a trace from its bytes. Refuses a wrong magic, another version or record size, and a
/// truncated record, saying which.
pub fn parse(bytes: &[u8]) -> Result<Vec<Record>> {
    read_from(bytes)
}

/// Checks a trace's header.
fn check_header(h: &[u8]) -> Result<()> {
    let bad = |m: String| Error::Trace(m);
    if h.len() < HEADER_SIZE || h[..8] != MAGIC {
        return Err(bad("not a cuarena trace: no CUATRACE header".into()));
    }
    let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    let size = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")) as usize;
    if version != VERSION || size != RECORD_SIZE {
        return Err(bad(format!(
            "trace version {version} with {size}-byte records; this build reads version {VERSION} with {RECORD_SIZE}-byte records"
        )));
    }
    Ok(())
}

/// Reads `buf.len()` bytes or up to the end of `input`; how many it read.
fn fill(input: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Reads a trace from `input` a record at a time: the header is checked before anything else
/// is read, so an input that is not a trace (a device that never ends, a huge file of another
/// kind) is refused at once, and memory grows only with the records read.
fn read_from(mut input: impl std::io::Read) -> Result<Vec<Record>> {
    let io = |e: std::io::Error| Error::Trace(format!("reading the trace: {e}"));
    let mut h = [0u8; HEADER_SIZE];
    let n = fill(&mut input, &mut h).map_err(io)?;
    check_header(&h[..n])?;
    let mut out = Vec::new();
    let mut r = [0u8; RECORD_SIZE];
    loop {
        match fill(&mut input, &mut r).map_err(io)? {
            0 => return Ok(out),
            RECORD_SIZE => {
                let i = out.len();
                out.push(Record::decode(&r).map_err(|e| Error::Trace(format!("record {i}: {e}")))?);
            }
            k => {
                return Err(Error::Trace(format!(
                    "truncated trace: {} bytes after the header is not a whole number of {RECORD_SIZE}-byte records",
                    out.len() * RECORD_SIZE + k
                )));
            }
        }
    }
}

/// Reads the trace file at `path`.
pub fn read(path: impl AsRef<std::path::Path>) -> Result<Vec<Record>> {
    let path = path.as_ref();
    let at = |m: String| Error::Trace(format!("reading {}: {m}", path.display()));
    let f = std::fs::File::open(path).map_err(|e| at(e.to_string()))?;
    if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(at("is a directory".into()));
    }
    read_from(std::io::BufReader::with_capacity(1 << 20, f)).map_err(|e| match e {
        Error::Trace(m) => Error::Trace(format!("{}: {m}", path.display())),
        e => e,
    })
}

/// Writes `records` as CSV: [`CSV_HEADER`], then one line per record, in the order given.
pub fn write_csv(records: &[Record], mut out: impl Write) -> std::io::Result<()> {
    writeln!(out, "{CSV_HEADER}")?;
    for r in records {
        writeln!(out, "{}", r.csv())?;
    }
    out.flush()
}

/// What a finished trace holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceSummary {
    /// Records written.
    pub records: u64,
    /// Threads that wrote records.
    pub threads: u64,
    /// Bytes of the file (header included).
    pub bytes: u64,
}

/// The process's clock origin: times are differences of nanoseconds since it.
fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// One thread's buffer (see the module comment for who may touch `buf` when).
pub(crate) struct ThreadLog {
    active: AtomicBool,
    index: u32,
    buf: UnsafeCell<Vec<Record>>,
}

// SAFETY: `buf` is touched by its owner only between `enter` and `leave`, and by the collector
// only after it saw `active` false with `on` false (the protocol of the module comment), so
// never by two threads at once; `Record` is plain data.
unsafe impl Sync for ThreadLog {}
// SAFETY: as above; the log is shared through `Arc` between its owner and the collector.
unsafe impl Send for ThreadLog {}

/// The file of a running trace.
struct Session {
    out: Box<dyn Write + Send>,
    records: u64,
    bytes: u64,
    /// Thread indices that wrote, for the summary.
    threads: std::collections::BTreeSet<u32>,
    /// The first write error; the trace goes on being collected and `stop` reports it.
    error: Option<std::io::Error>,
}

impl Session {
    fn write(&mut self, recs: &[Record]) {
        if recs.is_empty() {
            return;
        }
        let mut bytes = Vec::with_capacity(recs.len() * RECORD_SIZE);
        for r in recs {
            bytes.extend_from_slice(&r.encode());
            self.threads.insert(r.thread);
        }
        self.records += recs.len() as u64;
        self.bytes += bytes.len() as u64;
        if self.error.is_none()
            && let Err(e) = self.out.write_all(&bytes)
        {
            self.error = Some(e);
        }
    }
}

/// An allocator's tracer: the flag its fast path reads, and the running trace.
pub(crate) struct Shared {
    /// True while a trace records. The allocator reads it with one `Relaxed` load per call.
    on: AtomicBool,
    /// `now_ns()` at the trace's start (read by owners after they saw `on`).
    start_ns: AtomicU64,
    /// Records per thread buffer before it is written out.
    cap: usize,
    next_thread: AtomicUsize,
    /// Every thread that may record (registered before its first `enter`).
    logs: Mutex<Vec<Arc<ThreadLog>>>,
    session: Mutex<Option<Session>>,
    /// One `start` or `stop` at a time.
    control: Mutex<()>,
    /// The file's identity, if it is one (for the process-wide busy check).
    path: Mutex<Option<FileId>>,
    /// The fork generation it was made in: in a child forked since, its trace is the parent's,
    /// and nothing of it is written or locked there (`shutdown.rs`, "Fork").
    born: crate::shutdown::Born,
}

/// Files of traces running in this process (two traces must not write one file).
static BUSY: std::sync::Mutex<Vec<FileId>> = std::sync::Mutex::new(Vec::new());

/// Whether a trace may be written to a file of this kind: a regular file, or a character device
/// (`/dev/null`).
fn takes_a_trace(m: &std::fs::Metadata) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        m.is_file() || m.file_type().is_char_device()
    }
    #[cfg(not(unix))]
    m.is_file()
}

/// What makes two opened files one: on Unix the device and inode (so `d/../t.bin`, a link and
/// the plain path are one file), elsewhere the canonical path.
#[derive(Clone, Debug, PartialEq, Eq)]
enum FileId {
    #[cfg_attr(not(unix), allow(dead_code))]
    Inode(u64, u64),
    #[cfg_attr(unix, allow(dead_code))]
    Path(std::path::PathBuf),
}

impl FileId {
    fn of(f: &std::fs::File, path: &std::path::Path) -> FileId {
        #[cfg(unix)]
        if let Ok(m) = f.metadata() {
            use std::os::unix::fs::MetadataExt;
            return FileId::Inode(m.dev(), m.ino());
        }
        let _ = f;
        FileId::Path(std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()))
    }
}

/// Tracers with a running trace, for the exit hook; `None` once the hook has run: a trace
/// started after it could never be finished, so none starts (checked and added under this lock,
/// which `start_file` takes after a tracer's `control` and `stop_all_at_exit` releases before
/// it stops one).
static RUNNING: std::sync::Mutex<Option<Vec<Weak<Shared>>>> = std::sync::Mutex::new(Some(Vec::new()));

#[cfg_attr(loom, allow(dead_code))] // the loom build registers no exit hook
extern "C" fn stop_all_at_exit() {
    let running: Vec<Weak<Shared>> =
        RUNNING.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
    for t in running.iter().filter_map(Weak::upgrade) {
        let _ = t.stop();
    }
}

fn install_exit_hook() {
    #[cfg(not(loom))]
    {
        static HOOK: std::sync::Once = std::sync::Once::new();
        unsafe extern "C" {
            fn atexit(cb: extern "C" fn()) -> i32;
        }
        HOOK.call_once(|| {
            // SAFETY: `stop_all_at_exit` only takes locks of this module and writes files; atexit
            // keeps the plain function for the life of the process.
            unsafe { atexit(stop_all_at_exit) };
        });
    }
}

crate::shutdown::hold_across_fork!(
    /// Registers the trace's fork handlers (`shutdown.rs`, "Fork"): the process-wide lists are
    /// locked across a fork (in their order: `RUNNING`, then `BUSY`); in the child the running
    /// traces, all the parent's, are dropped from the exit hook's list (their files are the
    /// parent's: the child writes nothing to them, and they stay busy there), and the forking
    /// thread's logs are forgotten rather than written out at its exit.
    fn install_fork_handlers,
    ForkGuards,
    prepare: (
        RUNNING.lock().unwrap_or_else(|p| p.into_inner()),
        BUSY.lock().unwrap_or_else(|p| p.into_inner()),
    ),
    child: |g: Option<ForkGuards>| {
        if let Some((mut running, _busy)) = g
            && let Some(r) = running.as_mut()
        {
            r.clear();
        }
        let _ = LOGS.try_with(|cell| {
            if let Ok(mut logs) = cell.try_borrow_mut() {
                std::mem::forget(std::mem::take(&mut *logs));
            }
        });
    },
);

/// The file lists' guards (`RUNNING`, then `BUSY`), held across a fork.
#[cfg(not(loom))]
type ForkGuards =
    (std::sync::MutexGuard<'static, Option<Vec<Weak<Shared>>>>, std::sync::MutexGuard<'static, Vec<FileId>>);

impl Shared {
    /// A tracer with buffers of `cap` records, not recording.
    pub(crate) fn new(cap: usize) -> Arc<Shared> {
        Arc::new(Shared {
            on: AtomicBool::new(false),
            start_ns: AtomicU64::new(0),
            cap: cap.max(1),
            next_thread: AtomicUsize::new(0),
            logs: Mutex::new(Vec::new()),
            session: Mutex::new(None),
            control: Mutex::new(()),
            path: Mutex::new(None),
            born: crate::shutdown::Born::now(),
        })
    }

    /// True while a trace records (a hint: the recording path checks again in `enter`).
    #[inline(always)]
    pub(crate) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Starts a trace into the file at `path` (created or truncated). Refused once process exit
    /// has begun (the exit hook that finishes traces may have run already), and for a file
    /// another trace of this process writes, however the two paths name it (`..`, links).
    pub(crate) fn start_file(self: &Arc<Self>, path: &std::path::Path) -> Result<()> {
        let _c = lock(&self.control);
        if crate::shutdown::process_exiting() {
            return Err(Error::ShutDown);
        }
        if lock(&self.session).is_some() {
            return Err(Error::Trace("a trace is already running on this allocator".into()));
        }
        let not_a_file = || {
            Error::Trace(format!(
                "{} is not a regular file (nor a character device such as /dev/null): a trace is not written there",
                path.display()
            ))
        };
        // A FIFO with no reader would block the open (and the allocator's trace control with
        // it), a socket or a directory cannot be written as a file: refused before the open,
        // and again after it, from the opened file, in case the path changed in between.
        if std::fs::metadata(path).is_ok_and(|m| !takes_a_trace(&m)) {
            return Err(not_a_file());
        }
        // Opened without truncation: a file another trace writes must be left as it is.
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(false);
        #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            // O_NONBLOCK: a FIFO swapped in after the check fails (ENXIO) instead of blocking;
            // on a regular file or /dev/null it changes nothing.
            use std::os::unix::fs::OpenOptionsExt;
            o.custom_flags(0o4000);
        }
        let f = o.open(path).map_err(|e| Error::Trace(format!("creating {}: {e}", path.display())))?;
        if !f.metadata().is_ok_and(|m| takes_a_trace(&m)) {
            return Err(not_a_file());
        }
        let id = FileId::of(&f, path);
        {
            let mut busy = BUSY.lock().unwrap_or_else(|p| p.into_inner());
            if busy.contains(&id) {
                return Err(Error::Trace(format!(
                    "{} is already being written by another trace in this process (give each allocator its own path)",
                    path.display()
                )));
            }
            busy.push(id.clone());
        }
        install_exit_hook();
        let mut running = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
        let started = match running.as_ref() {
            None => Err(Error::ShutDown),
            Some(_) => Ok(()),
        }
        .and_then(|()| {
            match f.metadata() {
                // Only a regular file is truncated (a device such as /dev/null cannot be).
                Ok(m) if m.is_file() => f.set_len(0),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            }
            .map_err(|e| Error::Trace(format!("creating {}: {e}", path.display())))
        })
        .and_then(|()| self.start_locked(Box::new(std::io::BufWriter::with_capacity(1 << 20, f))));
        if let Err(e) = started {
            BUSY.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| *p != id);
            return Err(e);
        }
        *lock(&self.path) = Some(id);
        running.as_mut().expect("checked above, under the lock").push(Arc::downgrade(self));
        Ok(())
    }

    /// Starts a trace into `out` (the loom model's in-memory sink).
    #[cfg(loom)]
    pub(crate) fn start_writer(&self, out: Box<dyn Write + Send>) -> Result<()> {
        let _c = lock(&self.control);
        if lock(&self.session).is_some() {
            return Err(Error::Trace("a trace is already running on this allocator".into()));
        }
        self.start_locked(out)
    }

    /// Writes the header and turns recording on. Called under `control` with no session.
    fn start_locked(&self, mut out: Box<dyn Write + Send>) -> Result<()> {
        out.write_all(&header()).map_err(|e| Error::Trace(format!("writing the trace header: {e}")))?;
        *lock(&self.session) = Some(Session {
            out,
            records: 0,
            bytes: HEADER_SIZE as u64,
            threads: Default::default(),
            error: None,
        });
        self.start_ns.store(now_ns(), Ordering::Relaxed);
        // Release: an owner that sees `on` sees `start_ns`, the session, and its buffer emptied
        // by the last `stop`.
        self.on.store(true, Ordering::Release);
        Ok(())
    }

    /// A new thread's buffer, registered so that `stop` collects it. Call before its first
    /// `enter`.
    pub(crate) fn register(&self) -> Arc<ThreadLog> {
        let index = self.next_thread.fetch_add(1, Ordering::Relaxed).min(LATE_THREAD as usize - 1) as u32;
        let log = Arc::new(ThreadLog {
            active: AtomicBool::new(false),
            index,
            buf: UnsafeCell::new(Vec::with_capacity(self.cap.min(BUFFER_RECORDS))),
        });
        lock(&self.logs).push(Arc::clone(&log));
        log
    }

    /// The owner starts recording; false if no trace runs (then it must not touch its buffer
    /// and need not call [`Shared::leave`]).
    #[inline]
    pub(crate) fn enter(&self, log: &ThreadLog) -> bool {
        log.active.store(true, Ordering::Relaxed);
        #[cfg(not(cuarena_mutant = "trace_no_owner_fence"))]
        fence(Ordering::SeqCst);
        if self.on.load(Ordering::Acquire) {
            return true;
        }
        log.active.store(false, Ordering::Release);
        false
    }

    /// Nanoseconds since the trace started. Inside `enter`/`leave` only.
    #[inline]
    pub(crate) fn time(&self) -> u64 {
        now_ns().saturating_sub(self.start_ns.load(Ordering::Relaxed))
    }

    /// Appends a record to the owner's buffer, writing the buffer out when it is full. Inside
    /// `enter`/`leave` only.
    #[inline]
    pub(crate) fn push(&self, log: &ThreadLog, mut r: Record) {
        r.thread = log.index;
        let full = log.buf.with_mut(|b| {
            // SAFETY: between the owner's `enter` and `leave` the buffer is the owner's alone
            // (module comment).
            let b = unsafe { &mut *b };
            b.push(r);
            b.len() >= self.cap
        });
        if full {
            self.write_out(log);
        }
    }

    /// Writes the owner's buffer to the file and empties it. Inside `enter`/`leave` only.
    #[cold]
    #[inline(never)]
    fn write_out(&self, log: &ThreadLog) {
        // In a forked child (a call in flight at the fork), the parent's trace: the records are
        // dropped, and neither its lock nor its file touched (`shutdown.rs`, "Fork").
        let mut s = (!self.born.forked()).then(|| lock(&self.session));
        log.buf.with_mut(|b| {
            // SAFETY: as in `push`: the caller is the owner, between `enter` and `leave`.
            let b = unsafe { &mut *b };
            // The session exists: a collector waits for this owner before it ends it.
            if let Some(s) = s.as_mut().and_then(|s| s.as_mut()) {
                s.write(b);
            }
            b.clear();
        });
    }

    /// The owner is done with its buffer.
    #[inline]
    pub(crate) fn leave(&self, log: &ThreadLog) {
        log.active.store(false, Ordering::Release);
    }

    /// The owner's thread ends: its buffer is written out and the log unregistered.
    ///
    /// If `enter` fails, a `stop` may be collecting this very buffer (it took the log in its
    /// list, which holds it until we unregister): the owner must neither touch the buffer nor
    /// unregister before that `stop` has ended, or records would be lost. So it waits for
    /// `control` (held by `stop` throughout), then tries once more: under `control` no `stop`
    /// runs, and if no trace runs either, the last `stop` collected the buffer.
    pub(crate) fn exit(&self, log: &Arc<ThreadLog>) {
        if self.born.forked() {
            return; // the parent's trace, in a forked child: nothing written, no lock taken
        }
        let mut entered = self.enter(log);
        // The mutation `trace_exit_unregisters_early` does not wait (a running `stop` may then
        // lose the buffer).
        let _no_stop_running = if entered || cfg!(cuarena_mutant = "trace_exit_unregisters_early") {
            None
        } else {
            let c = lock(&self.control);
            entered = self.enter(log);
            Some(c)
        };
        if entered {
            self.write_out(log);
            self.leave(log);
        }
        lock(&self.logs).retain(|l| !Arc::ptr_eq(l, log));
    }

    /// Writes one record straight to the file (a thread whose buffer is gone), stamped at `at`
    /// (a `now_ns()` taken before a free ran), or now.
    #[cold]
    pub(crate) fn record_late(&self, at: Option<u64>, mut r: Record) {
        if self.born.forked() {
            return;
        }
        let mut s = lock(&self.session);
        if let Some(s) = s.as_mut() {
            r.time_ns = at.unwrap_or_else(now_ns).saturating_sub(self.start_ns.load(Ordering::Relaxed));
            r.thread = LATE_THREAD;
            s.write(&[r]);
        }
    }

    /// Ends the trace: turns recording off, collects every thread's buffer (waiting for threads
    /// recording this moment), writes and closes the file.
    pub(crate) fn stop(&self) -> Result<TraceSummary> {
        if self.born.forked() {
            return Err(Error::Forked);
        }
        let _c = lock(&self.control);
        if lock(&self.session).is_none() {
            return Err(Error::Trace("no trace is running on this allocator".into()));
        }
        self.on.store(false, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let logs: Vec<Arc<ThreadLog>> = lock(&self.logs).clone();
        let mut rest = Vec::new();
        for log in &logs {
            #[cfg(not(cuarena_mutant = "trace_no_wait"))]
            while log.active.load(Ordering::Acquire) {
                yield_now();
            }
            log.buf.with_mut(|b| {
                // SAFETY: `on` is false and the owner was seen outside `enter`/`leave` after our
                // fence: it touches the buffer no more until the next trace (module comment).
                let b = unsafe { &mut *b };
                rest.append(b);
            });
        }
        let mut s = lock(&self.session).take().expect("checked above; `control` held");
        s.write(&rest);
        if s.error.is_none()
            && let Err(e) = s.out.flush()
        {
            s.error = Some(e);
        }
        drop(std::mem::replace(&mut s.out, Box::new(std::io::sink())));
        if let Some(p) = lock(&self.path).take() {
            BUSY.lock().unwrap_or_else(|p| p.into_inner()).retain(|b| *b != p);
        }
        if let Some(r) = RUNNING.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            // This tracer's entry too: a start pushes one each time.
            r.retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), self));
        }
        if let Some(e) = s.error {
            return Err(Error::Trace(format!("writing the trace: {e}")));
        }
        Ok(TraceSummary { records: s.records, threads: s.threads.len() as u64, bytes: s.bytes })
    }

    /// True while a trace runs (under its lock; for `Drop`).
    pub(crate) fn running(&self) -> bool {
        lock(&self.session).is_some()
    }
}

/// A thread's log for one tracer, and what it knows of its streams.
struct Local {
    shared: Weak<Shared>,
    log: Arc<ThreadLog>,
    /// This thread's per-thread stream's identity, and the legacy stream's, asked once.
    ptds: Option<u64>,
    legacy: Option<u64>,
}

impl Drop for Local {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.exit(&self.log);
        }
    }
}

thread_local! {
    // Not `const { .. }`: loom's `thread_local!` has no such form.
    #[allow(clippy::missing_const_for_thread_local)]
    static LOGS: RefCell<Vec<Local>> = RefCell::new(Vec::new());
}

/// An allocation with the trace's rule for it: `alloc` runs, *then* the flag is read, and
/// `record` runs on its result if a trace runs (module comment: an allocation that began before
/// a start may return a block whose free the trace recorded). The mutation
/// `trace_alloc_flag_first` reads the flag first, as before, and must fail
/// `loom-tests/tests/trace.rs`.
#[inline(always)]
pub(crate) fn allocation<R>(shared: &Shared, alloc: impl FnOnce() -> R, record: impl FnOnce(R) -> R) -> R {
    #[cfg(cuarena_mutant = "trace_alloc_flag_first")]
    let on = shared.on();
    let r = alloc();
    #[cfg(not(cuarena_mutant = "trace_alloc_flag_first"))]
    let on = shared.on();
    if on { record(r) } else { r }
}

/// What the allocator tells the tracer about one call, beside the stream.
pub(crate) struct Event {
    pub(crate) action: Action,
    pub(crate) ptr: u64,
    pub(crate) size: usize,
    pub(crate) path: TracePath,
}

/// Runs `f`, a call on `stream`, and records the event it returns. A free (`stamp_before`) runs
/// inside this thread's `enter`/`leave` and is stamped with the time before it; an allocation
/// runs first (it may take long, or call back into user code) and is stamped after it. So the
/// records of one address alternate alloc, free in time order. With no trace running `f` runs
/// all the same; with this thread's buffer busy (a nested call) or gone (late destructors), the
/// record goes straight to the file, a free's still stamped before it ran.
///
/// `key` gives a stream's identity, 0 where it cannot say; the allocator asks it as it asks
/// every identity (counted in `driver_calls`, and never of the legacy stream while a capture is
/// announced: `Allocator::trace_key`). A 0 for the per-thread or the legacy stream is not kept,
/// so a later record asks again.
pub(crate) fn record<R>(
    shared: &Arc<Shared>,
    key: &dyn Fn(Stream) -> u64,
    stream: Stream,
    stamp_before: bool,
    f: impl FnOnce() -> (R, Event),
) -> R {
    let mut f = Some(f);
    let mut result = None;
    let mut event = None;
    if !stamp_before {
        let (r, ev) = (f.take().expect("once"))();
        result = Some(r);
        event = Some(ev);
    }
    let kind = StreamKind::of(stream);
    let done = LOGS.try_with(|cell| {
        let Ok(mut locals) = cell.try_borrow_mut() else { return false };
        let at = match locals.iter().position(|l| std::ptr::eq(l.shared.as_ptr(), Arc::as_ptr(shared))) {
            Some(i) => i,
            None => {
                locals.retain(|l| l.shared.strong_count() > 0);
                locals.push(Local {
                    shared: Arc::downgrade(shared),
                    log: shared.register(),
                    ptds: None,
                    legacy: None,
                });
                locals.len() - 1
            }
        };
        let local = &mut locals[at];
        if !shared.enter(&local.log) {
            return true; // no trace now: nothing to record (`f`, if not run, runs below)
        }
        let time_ns = shared.time();
        let ev = match event.take() {
            Some(ev) => ev,
            None => {
                let (r, ev) = (f.take().expect("once"))();
                result = Some(r);
                ev
            }
        };
        let key = match kind {
            StreamKind::PerThread => asked_once(&mut local.ptds, || key(stream)),
            StreamKind::Legacy => asked_once(&mut local.legacy, || key(stream)),
            StreamKind::User => key(stream),
        };
        let rec = Record {
            time_ns,
            ptr: ev.ptr,
            size: ev.size as u64,
            stream: StreamKey(key),
            thread: 0,
            action: ev.action,
            path: ev.path,
            stream_kind: kind,
        };
        shared.push(&local.log, rec);
        shared.leave(&local.log);
        true
    });
    let late = !matches!(done, Ok(true));
    // A free made here is stamped before it runs, as in the buffer (an allocation, already
    // run, is stamped when written): another thread may take the block as soon as it is freed.
    let mut at = None;
    if let Some(f) = f.take() {
        at = Some(now_ns());
        let (r, ev) = f();
        result = Some(r);
        if late {
            event = Some(ev);
        }
    }
    if late && let Some(ev) = event {
        shared.record_late(
            at,
            Record {
                time_ns: 0,
                ptr: ev.ptr,
                size: ev.size as u64,
                stream: StreamKey(key(stream)),
                thread: LATE_THREAD,
                action: ev.action,
                path: ev.path,
                stream_kind: kind,
            },
        );
    }
    result.expect("`f` ran")
}

/// `*known`, or `ask()` kept there unless it is 0 (the identity could not be told this time).
fn asked_once(known: &mut Option<u64>, ask: impl FnOnce() -> u64) -> u64 {
    if let Some(k) = *known {
        return k;
    }
    let k = ask();
    if k != 0 {
        *known = Some(k);
    }
    k
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn rec(i: u64) -> Record {
        Record {
            time_ns: i * 10,
            ptr: 0x7f00_0000_0000 + i * 256,
            size: 100 + i,
            stream: StreamKey(i + 7),
            thread: i as u32,
            action: Action::from_u8((i % 4) as u8).unwrap(),
            path: TracePath::from_u8((i % 5) as u8).unwrap(),
            stream_kind: StreamKind::from_u8((i % 3) as u8).unwrap(),
        }
    }

    #[test]
    fn records_round_trip_through_bytes_and_names() {
        let mut bytes = header().to_vec();
        let recs: Vec<Record> = (0..20).map(rec).collect();
        for r in &recs {
            bytes.extend_from_slice(&r.encode());
        }
        assert_eq!(parse(&bytes).unwrap(), recs);
        for r in &recs {
            assert_eq!(Action::parse(r.action.name()), Some(r.action));
            assert_eq!(TracePath::parse(r.path.name()), Some(r.path));
            assert_eq!(StreamKind::parse(r.stream_kind.name()), Some(r.stream_kind));
        }
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let msg = |b: &[u8]| parse(b).unwrap_err().to_string();
        assert!(msg(b"garbage").contains("no CUATRACE header"));
        let mut h = header().to_vec();
        h[8] = 2;
        assert!(msg(&h).contains("version 2"));
        let mut h = header().to_vec();
        h.extend_from_slice(&[0; RECORD_SIZE - 1]);
        assert!(msg(&h).contains("truncated"));
        let mut h = header().to_vec();
        let mut r = rec(1).encode();
        r[36] = 9;
        h.extend_from_slice(&r);
        assert!(msg(&h).contains("record 0: unknown action 9"));
    }
}
