//! Configuration: a builder, and the `CUARENA_CONF` string form.
//!
//! ## Defaults and why
//! - `superblock = 2 MiB`: the GPU's large-page size, and the granularity at which the driver
//!   hands out big allocations. Superblocks are aligned to their size, so lending one never
//!   splits a large page between two arenas and the owner of any small block is found from its
//!   address with one mask and a table load. The driver's chunks come 2 MiB-aligned in
//!   practice (not promised); a larger `superblock` may find a new chunk off its alignment, and
//!   the pool then reserves another chunk of one superblock more (`GlobalPool::lend`), so under
//!   a cap of a few superblocks such a configuration may hold fewer superblocks than the cap
//!   suggests.
//! - `small_max = 1 MiB`: half a superblock. A superblock then always holds at least two of the
//!   largest small blocks, so the tail a thread cannot use is bounded, while requests above it
//!   are large enough (and rare enough in the workloads of `BENCHMARKS.md`) that the
//!   global pool's lock is not hot.
//! - `large_max = 64 MiB`: requests in `small_max < size <= large_max` on a stream with an arena
//!   are served by that arena too, from *large superblocks* it borrows from the pool (see
//!   `arena.rs`; a lean user arena borrows none, and the pool serves it). 64 MiB is the
//!   largest size the arena's size classes reach ([`MAX_CLASSED_GRANULES`]); above it, the global pool serves. `large_max=off`
//!   ([`ConfigBuilder::no_large`]) turns large superblocks off: every request over `small_max`
//!   goes to the pool (a lock and an event a free, and no memory kept per thread for large
//!   blocks). The Python glue for PyTorch and CuPy gives it as a default: its large superblocks
//!   (4 times the request or more, kept while the thread may reuse them) cost a training run a
//!   third more reserved memory, for a speed frameworks, at thousands of allocations a second,
//!   do not need (`python/cuarena/__init__.py`, `FRAMEWORK_CONF`; `BENCHMARKS.md`).
//! - `chunk = 32 MiB`: the pool grows by at least this much per driver call (less only where
//!   the cap leaves less, and by just the request when the device is full), enough to serve 16
//!   superblocks and keep driver calls rare, small next to a GPU shared with other processes.
//! - `max = 100%`: the cap is the device's memory; nothing is reserved up front.
//! - `keep_empty = 2`, `sparse = 0.6`: the superblock return rule (see `arena.rs`): an arena
//!   holds at most `max(û + 2·S, û / 0.4)` for `û` the recent peak of the bytes live in it
//!   (more while it holds large superblocks: `arena.rs`). Hoard's `f = 1/4` suits
//!   its one-size superblocks; with blocks of every size up to half a superblock, fragmentation
//!   alone often leaves a quarter of a thread's superblocks free, and `f = 1/4` then gives back
//!   and takes again a superblock every few frees: on the churn workload 1.2 M pairs/s, 4·10^4
//!   driver calls per 10^6 operations and a worse memory ratio (2.3), against 6-8 M pairs/s,
//!   under 20 calls per 10^6 and 1.5 at `f = 0.6` (host device, 1 thread, 2026-11-30).
//! - `batch = 64` blocks or `batch_bytes = 16 MiB`: remote frees are sent in batches of this
//!   size, one CUDA event per batch. The batch is memory the freeing thread holds and nobody can
//!   use until it is sent (16 MiB a thread at most, plus as much in its user-stream batches:
//!   `outbox.rs`; out of memory in another thread cannot send it, so under a tight cap with many
//!   idle threads set it lower), so it is kept small next to the GPU's memory, but big enough
//!   that 64 blocks of the handoff workloads' sizes (256 B–1 MiB, 130 KiB on average) fill it by
//!   count: at 4 MiB a batch was sent every 35 remote frees, at 16 MiB every 64, and handoff on
//!   16 threads ran 11–17% faster, for reserved ÷ peak live a tenth higher on `handoff_msg`
//!   (H200, 2026-12-02, `BENCHMARKS.md`).
//! - `legacy_batch = 256` blocks or `legacy_batch_bytes = 64 MiB`: a thread's own frees on the
//!   legacy stream are kept back until this many, then made reusable by a *legacy action*
//!   (`arena.rs`): the thread's own, or, for the first half of them, published under a
//!   ticket, another thread's issued since (`legacy_kept.rs`). Each action is queued on the one legacy stream that all threads share, and
//!   with 16 threads the actions serialise in the driver: at the remote-batch size of the time (64 blocks,
//!   4 MiB), legacy churn made 14,800 actions per 10^6 operations and reached 29–30 M pairs/s
//!   on 16 threads, and large blocks (1–64 MiB, each free a batch) 1.2 M; at 256 blocks and
//!   64 MiB, 2,950 and 96,000 actions per 10^6 operations, 52–59 M and 4.6 M pairs/s (H200,
//!   2026-12-01, `BENCHMARKS.md`). Kept-back memory is not stranded: the owner's slow path
//!   releases it before borrowing more, and a reclaim takes it from an idle thread. It does
//!   raise the memory a thread holds: reserved ÷ peak live on legacy churn went from 1.67 to
//!   1.85 at 16 threads. The Python glue for PyTorch and CuPy, whose frees on the legacy stream
//!   are of megabytes, gives 16 MiB as a default under the user's `CUARENA_CONF` instead
//!   (`python/cuarena/__init__.py`, `FRAMEWORK_CONF`, through `global::set_defaults`; measured
//!   in `BENCHMARKS.md`).
//! - `stats=sampled` (the default) or `stats=exact`: with `exact`, one shared live-byte counter
//!   is updated with `fetch_add` on every allocation and free so that the peak of live bytes is
//!   exact; by default the fast path makes no atomic read-modify-write and the peak is bounded
//!   from both sides (see `stats.rs`).
//! - `passthrough` (off): a debug mode. Every request goes straight to the driver
//!   (`cuMemAllocAsync`/`cuMemFreeAsync`), so tools such as compute-sanitizer see each
//!   allocation at its exact size. Frees are still checked (see `passthrough.rs`).
//!
//! ## Ranges (checked by [`ConfigBuilder::build`])
//! `superblock`: a power of two, 64 KiB ..= 64 MiB; `small_max`: 1 ..= superblock; `large_max`:
//! small_max ..= 64 MiB, or `off` (`large_max = small_max` sends every request over `small_max`
//! to the global pool, as before large superblocks; `off` does so whatever `small_max` is);
//! `chunk`: a
//! positive multiple of the superblock; `max`: at least one superblock, or a fraction in (0, 1];
//! `keep_empty`: 0 ..= [`MAX_KEEP_EMPTY`]; `sparse`: in (0, 1); `batch`: 1 ..= [`MAX_BATCH`];
//! `batch_bytes`: at least 1; `legacy_batch`: 1 ..= [`MAX_BATCH`]; `legacy_batch_bytes`: at least 1.
//!
//! ## The `CUARENA_CONF` string ([`Config::parse`])
//! Items `key=value` or, as in `PYTORCH_CUDA_ALLOC_CONF`, `key:value`, separated by commas
//! (`max:80%,small_max:1MiB`); spaces around items, keys and values are ignored and a later
//! item overrides an earlier one. Keys are exact and lowercase: `small_max`, `large_max`,
//! `superblock`, `chunk`, `max`, `keep_empty`, `sparse`, `batch`, `batch_bytes`, `legacy_batch`,
//! `legacy_batch_bytes`, `passthrough`, `stats`, `trace` (a file path, taken as written: it
//! cannot hold `,` `=` `:` or `;`); the builder's names are aliases with the same meaning:
//! `max_bytes` for `max`, `sparse_fraction` for `sparse`, `batch_blocks` for `batch`,
//! `legacy_batch_blocks` for `legacy_batch`. Every error names `CUARENA_CONF` and lists the keys.
//!
//! Sizes (`small_max`, `large_max`, `superblock`, `chunk`, `max`, `batch_bytes`,
//! `legacy_batch_bytes`) follow one rule:
//! - a number and a unit, in any case, with or without a space between: `B`; `K`, `Ki`, `KiB`,
//!   `M`, `Mi`, `MiB`, `G`, `Gi`, `GiB`, `T`, `Ti`, `TiB` (powers of 1024); `KB`, `MB`, `GB`,
//!   `TB` (powers of 1000). So `4096B`, `64 KiB`, `2M`, `1g`, `512mb` (512·10^6) and `2MiB`;
//! - with a unit other than `B`, the number may have a decimal fraction, and the size is
//!   rounded down to a whole byte: `1.5GiB` is 1.5·2^30 = 1,610,612,736 B;
//! - a bare number (no unit) is a whole number of bytes of at least 1 KiB ([`MIN_BARE_BYTES`]):
//!   `small_max=1` or `chunk=32` is far likelier a forgotten unit than a size in bytes, so it is
//!   refused; write `512B` for 512 bytes;
//! - negative, empty, non-numeric (`NaN`, `inf`, `1e9`) and sizes over `usize::MAX` bytes are
//!   refused.
//!
//! `max` is a size or a percentage of the device's memory (`80%`, `12.5%`). A bare `max` that is
//! surely a percentage without its `%` is refused with the value it probably meant: a fraction
//! in (0, 1] (`max=0.8`: "did you mean max=80%?") or a whole number in 1 ..= 100 (`max=80`,
//! which would be 80 bytes). Other bare numbers follow the size rule, and any byte cap below
//! one superblock is refused by the range check (nothing could ever be reserved under it).

use crate::error::{Error, Result};
use crate::size_class::{GRANULE, MAX_CLASSED_GRANULES};

/// The largest `keep_empty`: more empty superblocks per thread than this is never sane (1024
/// superblocks of 2 MiB is 2 GiB per thread), and it keeps the return rule's arithmetic far from
/// overflow.
pub const MAX_KEEP_EMPTY: usize = 1024;

/// The largest `batch` (remote frees per batch).
pub const MAX_BATCH: usize = 1 << 16;

/// The keys of a `CUARENA_CONF` string, for error messages.
const KEYS: &str = "small_max, large_max, superblock, chunk, max, keep_empty, sparse, batch, batch_bytes, legacy_batch, legacy_batch_bytes, passthrough, stats, trace; \
                    aliases: max_bytes = max, sparse_fraction = sparse, batch_blocks = batch, legacy_batch_blocks = legacy_batch; \
                    items are key=value or key:value, separated by commas";

/// A configuration error that says where configuration comes from and what the keys are. The
/// user's text in `msg` is echoed through [`Echo`], so clipped to [`MAX_ECHO`] characters.
fn config_error(msg: impl std::fmt::Display) -> Error {
    Error::Config(format!("{msg} (set in CUARENA_CONF or Config::builder(); valid keys: {KEYS})"))
}

/// The most characters of one piece of the user's text (an item, a key, a value, a line) that
/// an error echoes: a configuration string or a trace line can be megabytes long, and a
/// message that repeats it whole is no help. The reason around it is kept whole.
pub const MAX_ECHO: usize = 200;

/// User text as an error message echoes it: its first [`MAX_ECHO`] characters (never cut
/// inside one), with `…` where it was cut. Cut only when formatted, so making one costs
/// nothing on a path that does not fail.
#[derive(Clone, Copy, Debug)]
pub struct Echo<'a>(pub &'a str);

impl std::fmt::Display for Echo<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.char_indices().nth(MAX_ECHO) {
            Some((at, _)) => write!(f, "{}…", &self.0[..at]),
            None => f.write_str(self.0),
        }
    }
}

/// The cap on reserved memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// At most this many bytes.
    Bytes(usize),
    /// At most this fraction (0, 1] of the device's total memory.
    Fraction(f64),
}

/// Allocator configuration. Build one with [`Config::builder`] or [`Config::parse`].
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub(crate) small_max: usize,
    pub(crate) large_max: usize,
    pub(crate) superblock: usize,
    pub(crate) chunk: usize,
    pub(crate) max: Limit,
    pub(crate) keep_empty: usize,
    pub(crate) sparse: f64,
    pub(crate) batch_blocks: usize,
    pub(crate) batch_bytes: usize,
    pub(crate) legacy_blocks: usize,
    pub(crate) legacy_bytes: usize,
    pub(crate) skip_fences: bool,
    pub(crate) passthrough: bool,
    pub(crate) exact_stats: bool,
    /// Record an allocation trace into this file from the allocator's creation (`trace.rs`).
    pub(crate) trace: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            small_max: 1 << 20,
            large_max: MAX_CLASSED_GRANULES * GRANULE,
            superblock: 2 << 20,
            chunk: 32 << 20,
            max: Limit::Fraction(1.0),
            keep_empty: 2,
            sparse: 0.6,
            batch_blocks: 64,
            batch_bytes: 16 << 20,
            legacy_blocks: 256,
            legacy_bytes: 64 << 20,
            skip_fences: false,
            passthrough: false,
            exact_stats: false,
            trace: None,
        }
    }
}

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder(Config::default(), false)
    }

    /// The defaults overridden by `CUARENA_CONF`, if set.
    pub fn from_env() -> Result<Config> {
        Config::from_env_over("")
    }

    /// `CUARENA_CONF` parsed over `defaults`, items of the same form that its own items
    /// override (what [`crate::global::set_defaults`] gives the process-wide allocators). A
    /// `CUARENA_CONF` that is not UTF-8 is refused, not taken as unset.
    pub(crate) fn from_env_over(defaults: &str) -> Result<Config> {
        match std::env::var("CUARENA_CONF") {
            Ok(s) => Config::layered(defaults, Some(&s)),
            Err(std::env::VarError::NotPresent) => Config::layered(defaults, None),
            Err(std::env::VarError::NotUnicode(_)) => Err(config_error("CUARENA_CONF is not valid UTF-8")),
        }
    }

    /// `user`'s items over `defaults`' (both `CUARENA_CONF` strings): one string, the defaults
    /// first, so a key `user` sets wins. The two are checked together, as one configuration: a
    /// user string valid alone may be refused over the defaults (a chunk that is not a whole
    /// number of the defaults' superblocks), and one invalid alone accepted (a `small_max` the
    /// defaults' larger superblock admits). Every error over non-empty defaults names them, so
    /// a user reading only `CUARENA_CONF` can find the cause.
    fn layered(defaults: &str, user: Option<&str>) -> Result<Config> {
        let r = match user {
            Some(u) if !defaults.is_empty() => Config::parse(&format!("{defaults},{u}")),
            Some(u) => Config::parse(u),
            None => Config::parse(defaults),
        };
        match r {
            Err(Error::Config(m)) if !defaults.is_empty() => Err(Error::Config(format!(
                "{m} [read over the defaults `{}` that global::set_defaults (C: cuarena_set_defaults) set, \
                 which CUARENA_CONF's items override]",
                Echo(defaults)
            ))),
            r => r,
        }
    }

    /// Parses a `CUARENA_CONF` string over the defaults, e.g. `small_max=1MiB,superblock=2MiB,max=80%`
    /// or, in `PYTORCH_CUDA_ALLOC_CONF`'s form, `max:80%,small_max:1MiB`.
    ///
    /// Items are `key=value` or `key:value`, separated by commas; a later item overrides an
    /// earlier one. Keys (exact, lowercase): `small_max`, `large_max` (a size, or `off`),
    /// `superblock`, `chunk`,
    /// `max` (alias `max_bytes`), `keep_empty`, `sparse` (alias `sparse_fraction`), `batch`
    /// (alias `batch_blocks`), `batch_bytes`, `legacy_batch` (alias `legacy_batch_blocks`),
    /// `legacy_batch_bytes`, `stats` (`exact` or `sampled`), `passthrough` (a bare key, or
    /// `true|false|1|0`) and `trace` (a path: an allocation trace is recorded there; see
    /// `trace.rs`).
    ///
    /// Sizes are a number and a unit in any case: `4096B`, `64 KiB`, `2M`, `1g`, `512mb`,
    /// `1.5GiB` (binary units: `K`/`Ki`/`KiB` … `T`/`Ti`/`TiB`; decimal: `KB` … `TB`). A fraction
    /// needs a unit other than `B` and is rounded down to a whole byte. A bare number is bytes
    /// and must be a whole number of at least 1024, so that a forgotten unit (`small_max=1`)
    /// is refused instead of meaning one byte. `max` is a size or a percentage of device
    /// memory (`80%`); a bare `max` such as `max=0.8` or `max=80` is refused with the
    /// percentage it probably meant. The module comment has the full rules; every error names
    /// `CUARENA_CONF` and lists the keys.
    pub fn parse(s: &str) -> Result<Config> {
        let mut b = Config::builder();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "passthrough" {
                b = b.passthrough(true);
                continue;
            }
            // The user's text, as error messages echo it: an item may be of any length.
            let item_s = Echo(item);
            let Some(at) = item.find(['=', ':']) else {
                return Err(config_error(format!(
                    "`{item_s}` is not key=value or key:value (items are separated by commas)"
                )));
            };
            let (k, sep, v) = (item[..at].trim(), &item[at..at + 1], item[at + 1..].trim());
            let (k_s, v_s) = (Echo(k), Echo(v));
            if k.is_empty() {
                return Err(config_error(format!("`{item_s}` has no key")));
            }
            if v.is_empty() {
                return Err(config_error(format!("`{item_s}` has no value")));
            }
            if v.contains(['=', ':', ';']) {
                return Err(config_error(format!(
                    "`{item_s}` holds more than one item: items are separated by commas"
                )));
            }
            let size = |x: &str| size_of(x).map_err(|e| config_error(format!("{k_s}{sep}{v_s}: {e}")));
            let whole = |x: &str| parse_usize(x).map_err(|e| config_error(format!("{k_s}{sep}{v_s}: {e}")));
            let number = |x: &str| parse_f64(x).map_err(|e| config_error(format!("{k_s}{sep}{v_s}: {e}")));
            b = match k {
                "small_max" => b.small_max(size(v)?),
                "large_max" if v.eq_ignore_ascii_case("off") => b.no_large(),
                "large_max" => b.large_max(size(v)?),
                "superblock" => b.superblock(size(v)?),
                "chunk" => b.chunk(size(v)?),
                "max" | "max_bytes" => match v.strip_suffix('%') {
                    Some(p) => b.max_fraction(number(p.trim())? / 100.0),
                    None => {
                        check_bare_max(k, sep, v)?;
                        b.max_bytes(size(v)?)
                    }
                },
                "keep_empty" => b.keep_empty(whole(v)?),
                "sparse" | "sparse_fraction" => b.sparse_fraction(number(v)?),
                "batch" | "batch_blocks" => b.batch_blocks(whole(v)?),
                "batch_bytes" => b.batch_bytes(size(v)?),
                "legacy_batch" | "legacy_batch_blocks" => b.legacy_batch_blocks(whole(v)?),
                "legacy_batch_bytes" => b.legacy_batch_bytes(size(v)?),
                "stats" => b.exact_stats(match v {
                    "exact" => true,
                    "sampled" => false,
                    _ => return Err(config_error(format!("stats=`{v_s}` is not exact or sampled"))),
                }),
                // The value is taken as it is: a path holding `,` `=` `:` or `;` cannot be given here.
                "trace" => b.trace(v),
                "passthrough" => b.passthrough(match v {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(config_error(format!("passthrough=`{v_s}` is not true, false, 1 or 0"))),
                }),
                _ => return Err(config_error(format!("unknown key `{k_s}`"))),
            };
        }
        b.build()
    }

    /// Largest small request (class-rounded; larger ones up to `large_max` come from large
    /// superblocks).
    pub fn small_max(&self) -> usize {
        self.small_max
    }
    /// Largest request served by the arenas from large superblocks (requests over
    /// `small_max`, up to this, on a stream with an arena).
    pub fn large_max(&self) -> usize {
        self.large_max
    }
    /// Superblock size (and alignment).
    pub fn superblock(&self) -> usize {
        self.superblock
    }
    /// Minimum growth of the pool per driver allocation.
    pub fn chunk(&self) -> usize {
        self.chunk
    }
    /// The cap on reserved memory.
    pub fn max(&self) -> Limit {
        self.max
    }
    /// True in pass-through mode: every request goes straight to the driver.
    pub fn passthrough(&self) -> bool {
        self.passthrough
    }

    /// `stats=exact`: the peak of live bytes is exact (one shared counter; see `stats.rs`).
    pub fn exact_stats(&self) -> bool {
        self.exact_stats
    }

    /// The file an allocation trace is recorded into from the allocator's creation, if any.
    pub fn trace(&self) -> Option<&std::path::Path> {
        self.trace.as_deref()
    }

    /// The cap in bytes for a device of `total` bytes.
    pub fn limit_bytes(&self, total: usize) -> usize {
        match self.max {
            Limit::Bytes(b) => b,
            Limit::Fraction(f) => (total as f64 * f) as usize,
        }
    }
}

fn parse_usize(v: &str) -> Result<usize, String> {
    let vs = Echo(v);
    if v.starts_with('-') {
        return Err("must not be negative".into());
    }
    v.parse().map_err(|_| format!("`{vs}` is not a whole number (or is over {})", usize::MAX))
}

fn parse_f64(v: &str) -> Result<f64, String> {
    let vs = Echo(v);
    v.parse().map_err(|_| format!("`{vs}` is not a number"))
}

/// Refuses a bare number for `max` that is surely a percentage or fraction written without its
/// `%`: in (0, 1] (`max=0.8`), or a whole number in 1 ..= 100 (`max=80`, 80 bytes). Anything
/// else is left to [`parse_bytes`] and the range check.
fn check_bare_max(k: &str, sep: &str, v: &str) -> Result<()> {
    let bare =
        v.starts_with(|c: char| c.is_ascii_digit()) && v.chars().all(|c| c.is_ascii_digit() || c == '.');
    let Some(x) = v.parse::<f64>().ok().filter(|_| bare) else {
        return Ok(());
    };
    let why = if x > 0.0 && x <= 1.0 {
        "a bare fraction is not a size (the share of device memory is written as a percentage)"
    } else if x.fract() == 0.0 && (1.0..=100.0).contains(&x) {
        "a bare number is bytes, and so few bytes are less than one superblock"
    } else {
        return Ok(());
    };
    let vs = Echo(v);
    let pct = if x <= 1.0 { times_100(v) } else { v.to_string() };
    let pct = Echo(&pct);
    Err(config_error(format!(
        "{k}{sep}{vs}: {why}; did you mean {k}{sep}{pct}%? (or a size with a unit, e.g. {k}{sep}8GiB)"
    )))
}

/// `v` (digits with at most one `.`) times 100, written without floating-point rounding:
/// `0.8` → `80`, `0.125` → `12.5`, `1` → `100`.
fn times_100(v: &str) -> String {
    let (int, frac) = v.split_once('.').unwrap_or((v, ""));
    let frac = format!("{frac:0<2}");
    let (moved, rest) = frac.split_at(2);
    let int = format!("{int}{moved}");
    let int = match int.trim_start_matches('0') {
        "" => "0",
        i => i,
    };
    match rest.trim_end_matches('0') {
        "" => int.to_string(),
        r => format!("{int}.{r}"),
    }
}

/// The units of a size (lowercase) and their multipliers.
const UNITS: [(&str, u64); 17] = [
    ("b", 1),
    ("k", 1 << 10),
    ("ki", 1 << 10),
    ("kib", 1 << 10),
    ("m", 1 << 20),
    ("mi", 1 << 20),
    ("mib", 1 << 20),
    ("g", 1 << 30),
    ("gi", 1 << 30),
    ("gib", 1 << 30),
    ("t", 1 << 40),
    ("ti", 1 << 40),
    ("tib", 1 << 40),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
];

/// The smallest size that may be written as a bare number (no unit).
pub const MIN_BARE_BYTES: usize = 1024;

/// Parses a size as `CUARENA_CONF` writes it (see [`Config::parse`]): a number and a unit in
/// any case (`4096B`, `64 KiB`, `2M`, `1g`, `512mb`, `1.5GiB`; `K`, `Ki`, `KiB` … `TiB` are
/// powers of 1024, `KB` … `TB` powers of 1000), a fraction only with a unit other than `B`
/// (rounded down to a whole byte), or a bare whole number of bytes of at least
/// [`MIN_BARE_BYTES`].
pub fn parse_bytes(v: &str) -> Result<usize> {
    size_of(v).map_err(config_error)
}

/// [`parse_bytes`], with an error that says what is wrong but neither the key nor where
/// configuration comes from (the caller adds both).
fn size_of(v: &str) -> Result<usize, String> {
    let v = v.trim();
    let vs = Echo(v);
    if v.is_empty() {
        return Err("no size given".into());
    }
    if v.starts_with('-') {
        return Err(format!("`{vs}` is negative; a size must not be"));
    }
    let int_end = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (int, rest) = v.split_at(int_end);
    let (frac, unit) = match rest.strip_prefix('.') {
        Some(r) => r.split_at(r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len())),
        None => ("", rest),
    };
    if int.is_empty() || (rest.starts_with('.') && frac.is_empty()) {
        return Err(format!("`{vs}` is not a size (a number and a unit, e.g. 512MiB, 1.5GiB, 4096B)"));
    }
    let unit = unit.trim();
    let lower = unit.to_ascii_lowercase();
    let mul = match UNITS.iter().find(|(u, _)| *u == lower) {
        Some(&(_, m)) => m,
        None if unit.is_empty() => 1,
        None => {
            return Err(format!(
                "unknown unit `{}` in `{vs}` (units, any case: B; K, KiB, M, MiB, G, GiB, T, TiB; KB, MB, GB, TB)",
                Echo(unit)
            ));
        }
    };
    if !frac.is_empty() && mul == 1 {
        return Err(if unit.is_empty() {
            format!("`{vs}` has a fraction but no unit (write e.g. {vs}MiB or {vs}GiB)")
        } else {
            format!("`{vs}` is not a whole number of bytes")
        });
    }
    let overflow = || format!("`{vs}` overflows (more than {} bytes)", usize::MAX);
    let int: u128 = int.parse().map_err(|_| overflow())?;
    // floor(0.frac × mul), exactly, by Horner's rule from the last digit: floor((d·mul + y)/10)
    // equals floor((d·mul + floor(y))/10), so every step may round down.
    let frac_bytes = frac.bytes().rev().fold(0u128, |y, d| (u128::from(d - b'0') * u128::from(mul) + y) / 10);
    let bytes = int
        .checked_mul(u128::from(mul))
        .and_then(|b| b.checked_add(frac_bytes))
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(overflow)?;
    if unit.is_empty() && bytes < MIN_BARE_BYTES {
        return Err(format!(
            "`{vs}` has no unit: a bare number is bytes and must be at least {MIN_BARE_BYTES} \
             (a forgotten unit is the likelier mistake); write {vs}B if bytes are meant, or add a unit (KiB, MiB, GiB)"
        ));
    }
    Ok(bytes)
}

/// Builds a validated [`Config`]. The flag: large superblocks are off ([`ConfigBuilder::no_large`]),
/// so `large_max` is `small_max`, whatever `small_max` the build ends with.
#[derive(Clone, Debug)]
pub struct ConfigBuilder(Config, bool);

impl ConfigBuilder {
    /// Largest small request (class-rounded; at most the superblock size). Larger ones up to
    /// `large_max` come from large superblocks.
    pub fn small_max(mut self, bytes: usize) -> Self {
        self.0.small_max = bytes;
        self
    }
    /// Largest request the arenas serve from large superblocks: in `small_max ..= 64 MiB`
    /// (`small_max` itself turns large superblocks off). Undoes an earlier [`Self::no_large`].
    pub fn large_max(mut self, bytes: usize) -> Self {
        self.0.large_max = bytes;
        self.1 = false;
        self
    }
    /// No large superblocks: every request over `small_max` goes to the global pool, as
    /// `large_max = small_max` does, for whatever `small_max` the configuration ends with
    /// (`large_max=off` in `CUARENA_CONF`). Undone by a later [`Self::large_max`].
    pub fn no_large(mut self) -> Self {
        self.1 = true;
        self
    }
    /// Superblock size: a power of two from 64 KiB to 64 MiB.
    pub fn superblock(mut self, bytes: usize) -> Self {
        self.0.superblock = bytes;
        self
    }
    /// Minimum pool growth per driver allocation (a multiple of the superblock size).
    pub fn chunk(mut self, bytes: usize) -> Self {
        self.0.chunk = bytes;
        self
    }
    /// Cap on reserved bytes.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.0.max = Limit::Bytes(bytes);
        self
    }
    /// Cap as a fraction of the device's memory.
    pub fn max_fraction(mut self, f: f64) -> Self {
        self.0.max = Limit::Fraction(f);
        self
    }
    /// Empty superblocks an arena may keep (K in the return rule).
    pub fn keep_empty(mut self, k: usize) -> Self {
        self.0.keep_empty = k;
        self
    }
    /// Emptiness fraction f of the return rule, in (0, 1).
    pub fn sparse_fraction(mut self, f: f64) -> Self {
        self.0.sparse = f;
        self
    }
    /// Remote frees per batch (one event per batch).
    pub fn batch_blocks(mut self, n: usize) -> Self {
        self.0.batch_blocks = n;
        self
    }
    /// Bytes per remote-free batch.
    pub fn batch_bytes(mut self, n: usize) -> Self {
        self.0.batch_bytes = n;
        self
    }
    /// A thread's own frees on the legacy stream kept back before one legacy action makes them
    /// reusable (`legacy_batch`).
    pub fn legacy_batch_blocks(mut self, n: usize) -> Self {
        self.0.legacy_blocks = n;
        self
    }
    /// Bytes of a thread's own legacy-stream frees kept back before one legacy action
    /// (`legacy_batch_bytes`).
    pub fn legacy_batch_bytes(mut self, n: usize) -> Self {
        self.0.legacy_bytes = n;
        self
    }
    /// Pass-through mode (a debug mode): every allocation and free goes straight to the driver
    /// (`cuMemAllocAsync`/`cuMemFreeAsync`), so compute-sanitizer sees each one. Frees are still
    /// checked against the live blocks.
    pub fn passthrough(mut self, on: bool) -> Self {
        self.0.passthrough = on;
        self
    }
    /// `stats=exact`: keeps one shared live-byte counter, updated with an atomic
    /// read-modify-write (`fetch_add`) on every allocation and free, so that
    /// `Stats::peak_live_bytes` is exact. Off by default: the fast path then makes no atomic
    /// read-modify-write, and the peak is bounded from both sides (`peak_live_bytes` and
    /// `peak_live_bytes_upper`). It costs a contended cache line under many threads; the
    /// benchmark measures it (`BENCHMARKS.md`).
    pub fn exact_stats(mut self, on: bool) -> Self {
        self.0.exact_stats = on;
        self
    }

    /// Records an allocation trace into the file at `path` (created or truncated) from the
    /// allocator's creation until [`Allocator::stop_trace`](crate::Allocator::stop_trace), its
    /// drop or process exit (`trace.rs` documents the format). `CUARENA_CONF`: `trace=PATH`.
    pub fn trace(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.0.trace = Some(path.into());
        self
    }

    /// **Breaks the allocator on purpose.** Hands freed blocks to other streams with no fence.
    /// It exists only so that tests can show the race checkers catch missing fences.
    #[doc(hidden)]
    pub fn skip_fences_for_testing(mut self) -> Self {
        self.0.skip_fences = true;
        self
    }

    /// Validates and returns the configuration. Every field is range-checked (see the module
    /// comment); an error names the field, its value and the valid range.
    pub fn build(self) -> Result<Config> {
        let mut c = self.0;
        if self.1 {
            c.large_max = c.small_max;
        }
        let err = |m: String| Err(config_error(m));
        if !c.superblock.is_power_of_two() || c.superblock < (64 << 10) {
            return err(format!("superblock {} must be a power of two of at least 64 KiB", c.superblock));
        }
        if c.superblock / GRANULE > MAX_CLASSED_GRANULES {
            return err(format!("superblock {} is over the 64 MiB maximum", c.superblock));
        }
        if c.small_max == 0 || c.small_max > c.superblock {
            return err(format!("small_max {} must be in 1 ..= superblock ({})", c.small_max, c.superblock));
        }
        if c.large_max < c.small_max || c.large_max > MAX_CLASSED_GRANULES * GRANULE {
            return err(format!(
                "large_max {} must be in small_max ({}) ..= 64 MiB (the largest size class)",
                c.large_max, c.small_max
            ));
        }
        if c.chunk == 0 || !c.chunk.is_multiple_of(c.superblock) {
            return err(format!(
                "chunk {} must be a positive multiple of the superblock ({})",
                c.chunk, c.superblock
            ));
        }
        match c.max {
            Limit::Fraction(f) if !(f > 0.0 && f <= 1.0) => {
                return err(format!("max fraction {f} must be in (0, 1] (a percentage in (0%, 100%])"));
            }
            Limit::Bytes(b) if b < c.superblock => {
                return err(format!(
                    "max {b} B is less than one superblock ({} B), so nothing could be reserved; \
                     give a size with a unit (e.g. max=8GiB) or a percentage of device memory (max=80%)",
                    c.superblock
                ));
            }
            _ => {}
        }
        if c.keep_empty > MAX_KEEP_EMPTY {
            return err(format!("keep_empty {} must be in 0 ..= {MAX_KEEP_EMPTY}", c.keep_empty));
        }
        if !(c.sparse > 0.0 && c.sparse < 1.0) {
            return err(format!("sparse {} must be in (0, 1)", c.sparse));
        }
        if c.batch_blocks == 0 || c.batch_blocks > MAX_BATCH {
            return err(format!("batch {} must be in 1 ..= {MAX_BATCH}", c.batch_blocks));
        }
        if c.batch_bytes == 0 {
            return err("batch_bytes must be positive".into());
        }
        if c.legacy_blocks == 0 || c.legacy_blocks > MAX_BATCH {
            return err(format!("legacy_batch {} must be in 1 ..= {MAX_BATCH}", c.legacy_blocks));
        }
        if c.legacy_bytes == 0 {
            return err("legacy_batch_bytes must be positive".into());
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let c = Config::parse("small_max=1MiB,superblock=2MiB,max=80%").unwrap();
        assert_eq!(c.small_max, 1 << 20);
        assert_eq!(c.superblock, 2 << 20);
        assert_eq!(c.max, Limit::Fraction(0.8));
        assert_eq!(c.limit_bytes(1000), 800);
    }

    #[test]
    fn parses_every_key() {
        let c = Config::parse(
            " small_max=64KiB, superblock=128KiB,chunk=1MiB,max=3GB,keep_empty=2,sparse=0.5,batch=8,batch_bytes=1M",
        )
        .unwrap();
        assert_eq!(c.small_max, 64 << 10);
        assert_eq!(c.superblock, 128 << 10);
        assert_eq!(c.chunk, 1 << 20);
        assert_eq!(c.max, Limit::Bytes(3_000_000_000));
        assert_eq!((c.keep_empty, c.sparse, c.batch_blocks, c.batch_bytes), (2, 0.5, 8, 1 << 20));
    }

    #[test]
    fn rejects_bad_values() {
        for bad in [
            "superblock=3MiB",
            "superblock=128MiB",
            "small_max=4MiB",
            "small_max=0",
            "chunk=3MiB",
            "max=0%",
            "max=120%",
            "sparse=1",
            "batch=0",
            "bogus=1",
            "small_max",
            "small_max=1XB",
            "max=99999999999999999999TiB",
        ] {
            assert!(matches!(Config::parse(bad), Err(Error::Config(_))), "{bad} was accepted");
        }
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    fn message(r: Result<Config>) -> String {
        match r {
            Err(Error::Config(m)) => m,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    /// Every configuration error says where configuration comes from and lists the keys.
    fn assert_helpful(m: &str, field: &str) {
        assert!(m.contains(field), "{m}");
        assert!(m.contains("CUARENA_CONF"), "{m}");
        assert!(
            m.contains(
                "small_max, large_max, superblock, chunk, max, keep_empty, sparse, batch, batch_bytes"
            ),
            "{m}"
        );
    }

    #[test]
    fn keep_empty_is_range_checked() {
        // usize::MAX used to be accepted and overflowed a multiply on the first local free.
        assert_helpful(&message(Config::builder().keep_empty(usize::MAX).build()), "keep_empty");
        assert_helpful(&message(Config::parse(&format!("keep_empty={}", usize::MAX))), "keep_empty");
        assert_helpful(&message(Config::builder().keep_empty(MAX_KEEP_EMPTY + 1).build()), "keep_empty");
        assert_eq!(Config::builder().keep_empty(MAX_KEEP_EMPTY).build().unwrap().keep_empty, MAX_KEEP_EMPTY);
        assert_eq!(Config::parse("keep_empty=0").unwrap().keep_empty, 0);
    }

    #[test]
    fn batch_is_range_checked() {
        assert_helpful(&message(Config::parse("batch=0")), "batch");
        assert_helpful(&message(Config::builder().batch_blocks(MAX_BATCH + 1).build()), "batch");
        assert_helpful(&message(Config::builder().batch_blocks(usize::MAX).build()), "batch");
        assert_eq!(Config::parse("batch=1").unwrap().batch_blocks, 1);
        assert_eq!(Config::builder().batch_blocks(MAX_BATCH).build().unwrap().batch_blocks, MAX_BATCH);
    }

    #[test]
    fn batch_bytes_must_be_positive() {
        assert_helpful(&message(Config::parse("batch_bytes=0B")), "batch_bytes");
        assert_helpful(&message(Config::parse("batch_bytes=0")), "batch_bytes");
        assert_eq!(Config::parse("batch_bytes=1B").unwrap().batch_bytes, 1);
    }

    #[test]
    fn legacy_batch_is_its_own_key_and_range_checked() {
        let d = Config::default();
        assert_eq!((d.legacy_blocks, d.legacy_bytes), (256, 64 << 20));
        let c = Config::parse("legacy_batch=8,legacy_batch_bytes=1MiB").unwrap();
        assert_eq!((c.legacy_blocks, c.legacy_bytes), (8, 1 << 20));
        assert_eq!(
            (c.batch_blocks, c.batch_bytes),
            (d.batch_blocks, d.batch_bytes),
            "remote batches unchanged"
        );
        let b = Config::builder().legacy_batch_blocks(8).legacy_batch_bytes(1 << 20).build().unwrap();
        assert_eq!(b, c);
        assert_eq!(Config::parse("legacy_batch_blocks=9").unwrap().legacy_blocks, 9);
        assert_helpful(&message(Config::parse("legacy_batch=0")), "legacy_batch");
        assert_helpful(
            &message(Config::builder().legacy_batch_blocks(MAX_BATCH + 1).build()),
            "legacy_batch",
        );
        assert_helpful(&message(Config::parse("legacy_batch_bytes=0B")), "legacy_batch_bytes");
    }

    /// Defaults under `CUARENA_CONF` (`global::set_defaults`, as the Python glue's
    /// `legacy_batch_bytes=16MiB`): the user's items win whatever separator they use, the
    /// defaults hold where the user says nothing, and an invalid user string gives the error it
    /// gives alone, naming the defaults too.
    #[test]
    fn defaults_lie_under_the_users_items() {
        let d = "legacy_batch_bytes=16MiB";
        assert_eq!(Config::layered(d, None).unwrap().legacy_bytes, 16 << 20);
        assert_eq!(Config::layered("", None).unwrap(), Config::default());
        assert_eq!(Config::layered("", Some("max=50%")).unwrap(), Config::parse("max=50%").unwrap());
        let c = Config::layered(d, Some("legacy_batch_bytes:64MiB,max=50%")).unwrap();
        assert_eq!((c.legacy_bytes, c.max), (64 << 20, Limit::Fraction(0.5)));
        for user in ["", " ", ",", " , max=50% ,", "passthrough", "legacy_batch=8"] {
            let c = Config::layered(d, Some(user)).unwrap();
            assert_eq!(c.legacy_bytes, 16 << 20, "{user:?}");
            let mut alone = Config::parse(user).unwrap();
            alone.legacy_bytes = 16 << 20;
            assert_eq!(c, alone, "{user:?}");
        }
        // An error over defaults is the user's string's own, naming the defaults too.
        for user in
            ["bogus=1", "max=0.8", "small_max", "legacy_batch_bytes=0B", "max=50%;chunk=4MiB", "\u{1f}"]
        {
            let (over, alone) = (message(Config::layered(d, Some(user))), message(Config::parse(user)));
            assert!(over.starts_with(&alone) && over.contains(d), "{user:?}: {over}");
            assert_eq!(message(Config::layered("", Some(user))), alone, "{user:?}");
        }
        // Checked together: each valid alone, refused together, and the error names the defaults.
        let m = message(Config::layered("chunk=6MiB", Some("superblock=4MiB")));
        assert!(m.contains("chunk") && m.contains("defaults `chunk=6MiB`"), "{m}");
    }

    #[test]
    fn max_must_hold_a_superblock() {
        assert_helpful(&message(Config::parse("max=0")), "max");
        assert_helpful(&message(Config::parse("max=1000")), "max");
        assert_helpful(&message(Config::parse("superblock=4MiB,small_max=1MiB,chunk=32MiB,max=2MiB")), "max");
        assert_eq!(Config::parse("max=2MiB").unwrap().max, Limit::Bytes(2 << 20));
    }

    #[test]
    fn max_fraction_is_range_checked() {
        for bad in ["max=0%", "max=-5%", "max=100.5%", "max=NaN%", "max=inf%"] {
            assert_helpful(&message(Config::parse(bad)), "max");
        }
        assert_helpful(&message(Config::builder().max_fraction(f64::NAN).build()), "max");
        assert_eq!(Config::parse("max=100%").unwrap().max, Limit::Fraction(1.0));
    }

    #[test]
    fn sparse_is_range_checked() {
        for bad in ["sparse=0", "sparse=1", "sparse=-0.5", "sparse=NaN", "sparse=x"] {
            assert!(matches!(Config::parse(bad), Err(Error::Config(_))), "{bad} was accepted");
        }
        assert_helpful(&message(Config::builder().sparse_fraction(f64::NAN).build()), "sparse");
        assert_eq!(Config::parse("sparse=0.25").unwrap().sparse, 0.25);
    }

    #[test]
    fn superblock_small_max_and_chunk_are_range_checked() {
        assert_helpful(&message(Config::parse("superblock=3MiB")), "superblock");
        assert_helpful(&message(Config::parse("superblock=32KiB")), "superblock");
        assert_helpful(&message(Config::parse("superblock=128MiB")), "superblock");
        assert_helpful(&message(Config::parse("small_max=0")), "small_max");
        assert_helpful(&message(Config::parse("small_max=3MiB")), "small_max");
        assert_helpful(&message(Config::parse("chunk=0")), "chunk");
        assert_helpful(&message(Config::parse("chunk=3MiB")), "chunk");
    }

    #[test]
    fn parse_errors_name_the_keys() {
        assert_helpful(&message(Config::parse("bogus=1")), "bogus");
        assert_helpful(&message(Config::parse("small_max")), "small_max");
        assert_helpful(&message(Config::parse("keep_empty=two")), "two");
        assert_helpful(&message(Config::parse("chunk=1XB")), "XB");
        assert_helpful(&message(Config::parse("chunk=99999999TiB")), "overflows");
    }

    fn size(v: &str) -> usize {
        parse_bytes(v).unwrap_or_else(|e| panic!("`{v}` refused: {e}"))
    }

    #[test]
    fn sizes_take_every_usual_form_in_any_case() {
        for (v, want) in [
            ("4096", 4096),
            ("1024", 1024),
            ("4096B", 4096),
            ("4096 b", 4096),
            ("512B", 512),
            ("1b", 1),
            ("2M", 2 << 20),
            ("2m", 2 << 20),
            ("2Mi", 2 << 20),
            ("2MiB", 2 << 20),
            ("2mib", 2 << 20),
            ("2MIB", 2 << 20),
            ("64 KiB", 64 << 10),
            ("64k", 64 << 10),
            ("1g", 1 << 30),
            ("1GiB", 1 << 30),
            ("1T", 1 << 40),
            ("1tib", 1 << 40),
            ("512mb", 512_000_000),
            ("512MB", 512_000_000),
            ("3GB", 3_000_000_000),
            ("4kb", 4_000),
            ("2TB", 2_000_000_000_000),
            (" 007MiB ", 7 << 20),
        ] {
            assert_eq!(size(v), want, "{v}");
        }
    }

    #[test]
    fn fractions_with_a_unit_round_down_to_a_byte() {
        assert_eq!(size("1.5GiB"), 3 << 29);
        assert_eq!(size("1.5 gib"), 3 << 29);
        assert_eq!(size("0.5M"), 1 << 19);
        assert_eq!(size("1.5KB"), 1500);
        // 0.1 KiB = 102.4 B, 0.999 KiB = 1022.976 B, 1.0009765625 KiB = 1025 B exactly.
        assert_eq!(size("0.1KiB"), 102);
        assert_eq!(size("0.999KiB"), 1022);
        assert_eq!(size("1.0009765625KiB"), 1025);
        // Below a byte: rounded down to zero (the range check then refuses a zero size).
        assert_eq!(size("0.0000001KiB"), 0);
        // Many digits stay exact: 0.(40 nines) TiB is one byte short of a TiB.
        assert_eq!(size(&format!("0.{}TiB", "9".repeat(40))), (1 << 40) - 1);
        assert_eq!(size("1.25GB"), 1_250_000_000);
        assert_eq!(Config::parse("small_max=1.5MiB,superblock=2MiB").unwrap().small_max, 3 << 19);
    }

    #[test]
    fn bad_sizes_are_refused_with_the_reason() {
        for (v, why) in [
            ("", "no size"),
            ("-1MiB", "negative"),
            ("-4096", "negative"),
            ("NaN", "not a size"),
            ("nanMiB", "not a size"),
            ("inf", "not a size"),
            ("+4096", "not a size"),
            (".5GiB", "not a size"),
            ("1.GiB", "not a size"),
            ("1e9", "unknown unit `e9`"),
            ("1XB", "unknown unit `XB`"),
            ("1.5", "fraction but no unit"),
            ("1.5B", "not a whole number of bytes"),
            ("99999999999999999999TiB", "overflows"),
            ("99999999999999999999999999999999999999999", "overflows"),
            ("16777216TiB", "overflows"),
            ("18446744073709551616", "overflows"),
            ("1", "must be at least 1024"),
            ("1023", "must be at least 1024"),
            ("0", "must be at least 1024"),
        ] {
            match parse_bytes(v) {
                Err(Error::Config(m)) => {
                    assert!(m.contains(why), "`{v}`: {m}");
                    assert!(m.contains("CUARENA_CONF") && m.contains("small_max"), "`{v}`: {m}");
                }
                other => panic!("`{v}` gave {other:?}"),
            }
        }
        assert_eq!(size("18446744073709551615"), usize::MAX);
    }

    #[test]
    fn a_bare_size_below_a_kib_is_refused_for_every_size_key() {
        for k in ["small_max", "superblock", "chunk", "batch_bytes", "max"] {
            for v in ["0", "1", "1000", "1023"] {
                let m = message(Config::parse(&format!("{k}={v}")));
                assert_helpful(&m, &format!("{k}={v}"));
                if v != "1" {
                    assert!(m.contains(&format!("write {v}B")), "{m}");
                }
            }
        }
        // With an explicit unit, or at 1 KiB and above, the range check alone decides.
        assert_eq!(Config::parse("small_max=512B").unwrap().small_max, 512);
        assert_eq!(Config::parse("small_max=1024").unwrap().small_max, 1024);
        assert_eq!(Config::parse("batch_bytes=1024").unwrap().batch_bytes, 1024);
        assert_eq!(Config::parse("max=4194304").unwrap().max, Limit::Bytes(4 << 20));
        assert_eq!(Config::parse("chunk=67108864").unwrap().chunk, 64 << 20);
    }

    #[test]
    fn a_bare_max_that_is_surely_a_percentage_is_refused_with_a_suggestion() {
        for (v, meant) in [
            ("0.8", "max=80%?"),
            ("0.125", "max=12.5%?"),
            ("0.05", "max=5%?"),
            ("1", "max=100%?"),
            ("1.0", "max=100%?"),
            ("80", "max=80%?"),
            ("100", "max=100%?"),
            ("5", "max=5%?"),
        ] {
            let m = message(Config::parse(&format!("max={v}")));
            assert_helpful(&m, &format!("did you mean {meant}"));
        }
        // The alias is named as written.
        assert_helpful(&message(Config::parse("max_bytes=0.8")), "did you mean max_bytes=80%?");
        assert_helpful(&message(Config::parse("max:0.8")), "did you mean max:80%?");
        // Not a percentage in disguise: the size rule's message.
        for v in ["101", "1.5", "0", "0.0"] {
            let m = message(Config::parse(&format!("max={v}")));
            assert!(!m.contains("did you mean"), "{v}: {m}");
            assert_helpful(&m, &format!("max={v}"));
        }
        assert_eq!(Config::parse("max=80%").unwrap().max, Limit::Fraction(0.8));
        assert_eq!(Config::parse("max=12.5 %").unwrap().max, Limit::Fraction(0.125));
    }

    #[test]
    fn a_max_below_one_superblock_says_so() {
        let m = message(Config::parse("max=1MiB"));
        assert_helpful(&m, "less than one superblock (2097152 B)");
        assert!(m.contains("max=80%"), "{m}");
        let m = message(Config::parse("max=2047KiB,superblock=2MiB"));
        assert_helpful(&m, "less than one superblock");
        let m = message(Config::builder().max_bytes(80).build());
        assert_helpful(&m, "max 80 B is less than one superblock");
        assert_eq!(
            Config::parse("max=64KiB,superblock=64KiB,small_max=64KiB,chunk=64KiB").unwrap().max,
            Limit::Bytes(64 << 10)
        );
    }

    #[test]
    fn pytorch_key_colon_value_form_is_accepted() {
        let c = Config::parse("max:80%,small_max:1MiB").unwrap();
        assert_eq!((c.max, c.small_max), (Limit::Fraction(0.8), 1 << 20));
        let c = Config::parse(" superblock : 4MiB , chunk:64MiB,small_max=2MiB, batch:16, passthrough:true")
            .unwrap();
        assert_eq!((c.superblock, c.chunk, c.small_max, c.batch_blocks), (4 << 20, 64 << 20, 2 << 20, 16));
        assert!(c.passthrough);
        assert_eq!(
            Config::parse("max:80%,small_max:1MiB").unwrap(),
            Config::parse("max=80%,small_max=1MiB").unwrap()
        );
    }

    #[test]
    fn builder_names_are_aliases() {
        let c = Config::parse("batch_blocks=8,max_bytes=4GiB,sparse_fraction=0.5").unwrap();
        assert_eq!((c.batch_blocks, c.max, c.sparse), (8, Limit::Bytes(4 << 30), 0.5));
        let built =
            Config::builder().batch_blocks(8).max_bytes(4 << 30).sparse_fraction(0.5).build().unwrap();
        assert_eq!(c, built);
        assert_eq!(Config::parse("max_bytes=50%").unwrap().max, Limit::Fraction(0.5));
        // An alias and its key are one setting: the later wins.
        assert_eq!(Config::parse("batch=4,batch_blocks=8").unwrap().batch_blocks, 8);
        assert_eq!(Config::parse("batch_blocks=8,batch=4").unwrap().batch_blocks, 4);
        // Aliases are range-checked like their keys.
        assert_helpful(&message(Config::parse("batch_blocks=0")), "batch");
        assert_helpful(&message(Config::parse("max_bytes=1MiB")), "superblock");
        assert_helpful(&message(Config::parse("sparse_fraction=1")), "sparse");
    }

    #[test]
    fn malformed_items_are_refused_with_every_key_listed() {
        for (bad, what) in [
            ("small_max", "not key=value or key:value"),
            ("=1MiB", "has no key"),
            (":1MiB", "has no key"),
            ("small_max=", "has no value"),
            ("small_max:", "has no value"),
            ("small_max=1MiB;superblock=2MiB", "separated by commas"),
            ("small_max=1MiB superblock=2MiB", "separated by commas"),
            ("max:80%:1", "separated by commas"),
            ("SMALL_MAX=1MiB", "unknown key `SMALL_MAX`"),
            ("max_fraction=0.8", "unknown key"),
            ("keep_empty=-1", "negative"),
            ("batch=1.5", "not a whole number"),
            ("sparse=half", "not a number"),
            ("max=abc%", "not a number"),
        ] {
            let m = message(Config::parse(bad));
            assert_helpful(&m, what);
            for alias in ["max_bytes", "sparse_fraction", "batch_blocks", "passthrough", "key:value"] {
                assert!(m.contains(alias), "{bad}: {m}");
            }
        }
    }

    #[test]
    fn every_error_names_cuarena_conf_and_the_keys() {
        // One of each error path of `parse` and `build`.
        for bad in [
            "x",
            "bogus=1",
            "small_max=1",
            "small_max=1.5",
            "small_max=-1",
            "small_max=1ZiB",
            "small_max=99999999999999999999TiB",
            "max=0.8",
            "max=1MiB",
            "max=0%",
            "superblock=3MiB",
            "superblock=128MiB",
            "small_max=4MiB",
            "chunk=3MiB",
            "keep_empty=2000",
            "sparse=2",
            "batch=0",
            "batch_bytes=0B",
            "passthrough=maybe",
        ] {
            let m = message(Config::parse(bad));
            assert_helpful(&m, "");
            assert!(m.contains("batch_blocks") && m.contains("passthrough"), "{bad}: {m}");
        }
    }

    #[test]
    fn passthrough_is_a_bare_key_or_a_boolean() {
        assert!(!Config::default().passthrough());
        assert!(Config::parse("passthrough").unwrap().passthrough());
        assert!(Config::parse(" small_max=64KiB , passthrough ").unwrap().passthrough());
        assert!(Config::parse("passthrough=true").unwrap().passthrough());
        assert!(Config::parse("passthrough=1").unwrap().passthrough());
        assert!(!Config::parse("passthrough=0").unwrap().passthrough());
        assert!(!Config::parse("passthrough,passthrough=false").unwrap().passthrough());
        assert!(Config::builder().passthrough(true).build().unwrap().passthrough());
        assert_helpful(&message(Config::parse("passthrough=yes")), "passthrough");
    }

    #[test]
    fn large_max_defaults_to_the_largest_class_and_is_range_checked() {
        assert_eq!(Config::default().large_max(), 64 << 20);
        assert_eq!(Config::parse("large_max=8MiB").unwrap().large_max(), 8 << 20);
        // `small_max` itself is allowed: large superblocks off.
        assert_eq!(Config::parse("small_max=1MiB,large_max=1MiB").unwrap().large_max(), 1 << 20);
        assert_helpful(&message(Config::parse("small_max=1MiB,large_max=512KiB")), "large_max");
        assert_helpful(&message(Config::parse("large_max=65MiB")), "large_max");
        assert_helpful(&message(Config::builder().large_max(128 << 20).build()), "64 MiB");
    }

    #[test]
    fn large_max_off_follows_small_max_and_the_later_item_wins() {
        let off = |s: &str| Config::parse(s).unwrap();
        assert_eq!(off("large_max=off").large_max(), off("large_max=off").small_max());
        assert_eq!(off("large_max=OFF").large_max(), 1 << 20);
        // Whatever small_max the configuration ends with, before or after the item.
        assert_eq!(off("large_max=off,superblock=4MiB,small_max=2MiB").large_max(), 2 << 20);
        assert_eq!(off("superblock=4MiB,small_max=2MiB,large_max=off").large_max(), 2 << 20);
        assert_eq!(off("small_max=64KiB,large_max=off").large_max(), 64 << 10);
        // A later size turns large superblocks back on, and a later `off` off again.
        assert_eq!(off("large_max=off,large_max=8MiB").large_max(), 8 << 20);
        assert_eq!(off("large_max=8MiB,large_max=off").large_max(), 1 << 20);
        // Under the glue's defaults, a user's larger small_max is not refused.
        let c =
            Config::layered("legacy_batch_bytes=16MiB,large_max=off", Some("superblock=8MiB,small_max=4MiB"));
        assert_eq!(c.unwrap().large_max(), 4 << 20);
        assert_helpful(&message(Config::parse("large_max=of")), "large_max");
    }
}
