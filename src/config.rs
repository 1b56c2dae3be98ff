//! Configuration: a builder, and the `CUARENA_CONF` string form.
//!
//! ## Defaults and why
//! - `superblock = 2 MiB`: the GPU's large-page size, and the granularity at which the driver
//!   hands out big allocations. Superblocks are aligned to their size, so lending one never
//!   splits a large page between two arenas and the owner of any small block is found from its
//!   address with one mask and a table load.
//! - `small_max = 1 MiB`: half a superblock. A superblock then always holds at least two of the
//!   largest small blocks, so the tail a thread cannot use is bounded, while requests above it
//!   are large enough (and rare enough in the workloads of `../shared/anchors.md`) that the
//!   global pool's lock is not hot.
//! - `chunk = 32 MiB`: the pool grows by at least this much per driver call, enough to serve 16
//!   superblocks and keep driver calls rare, small next to a GPU shared with other processes.
//! - `max = 100%`: the cap is the device's memory; nothing is reserved up front.
//! - `keep_empty = 2`, `sparse = 0.6`: the superblock return rule (see `arena.rs`): an arena
//!   holds at most `max(u + 2·S, u / 0.4)` for `u` bytes live in it. Hoard's `f = 1/4` suits
//!   its one-size superblocks; with blocks of every size up to half a superblock, fragmentation
//!   alone often leaves a quarter of a thread's superblocks free, and `f = 1/4` then gives back
//!   and takes again a superblock every few frees: on the churn workload 1.2 M pairs/s, 4·10^4
//!   driver calls per 10^6 operations and a worse memory ratio (2.3), against 6-8 M pairs/s,
//!   under 20 calls per 10^6 and 1.5 at `f = 0.6` (host device, 1 thread, 2026-11-30).
//! - `batch = 64` blocks or `batch_bytes = 4 MiB`: remote frees are sent in batches of this size,
//!   one CUDA event per batch.
//! - `passthrough` (off): a debug mode. Every request goes straight to the driver
//!   (`cuMemAllocAsync`/`cuMemFreeAsync`), so tools such as compute-sanitizer see each
//!   allocation at its exact size. Frees are still checked (see `passthrough.rs`).
//!
//! ## Ranges (checked by [`ConfigBuilder::build`])
//! `superblock`: a power of two, 64 KiB ..= 64 MiB; `small_max`: 1 ..= superblock; `chunk`: a
//! positive multiple of the superblock; `max`: at least one superblock, or a fraction in (0, 1];
//! `keep_empty`: 0 ..= [`MAX_KEEP_EMPTY`]; `sparse`: in (0, 1); `batch`: 1 ..= [`MAX_BATCH`];
//! `batch_bytes`: at least 1.

use crate::error::{Error, Result};
use crate::size_class::{GRANULE, MAX_CLASSED_GRANULES};

/// The largest `keep_empty`: more empty superblocks per thread than this is never sane (1024
/// superblocks of 2 MiB is 2 GiB per thread), and it keeps the return rule's arithmetic far from
/// overflow.
pub const MAX_KEEP_EMPTY: usize = 1024;

/// The largest `batch` (remote frees per batch).
pub const MAX_BATCH: usize = 1 << 16;

/// The keys of a `CUARENA_CONF` string, for error messages.
const KEYS: &str = "small_max, superblock, chunk, max, keep_empty, sparse, batch, batch_bytes, passthrough";

/// A configuration error that says where configuration comes from and what the keys are.
fn config_error(msg: impl std::fmt::Display) -> Error {
    Error::Config(format!("{msg} (set in CUARENA_CONF or Config::builder(); valid keys: {KEYS})"))
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
    pub(crate) superblock: usize,
    pub(crate) chunk: usize,
    pub(crate) max: Limit,
    pub(crate) keep_empty: usize,
    pub(crate) sparse: f64,
    pub(crate) batch_blocks: usize,
    pub(crate) batch_bytes: usize,
    pub(crate) skip_fences: bool,
    pub(crate) passthrough: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            small_max: 1 << 20,
            superblock: 2 << 20,
            chunk: 32 << 20,
            max: Limit::Fraction(1.0),
            keep_empty: 2,
            sparse: 0.6,
            batch_blocks: 64,
            batch_bytes: 4 << 20,
            skip_fences: false,
            passthrough: false,
        }
    }
}

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder(Config::default())
    }

    /// The defaults overridden by `CUARENA_CONF`, if set.
    pub fn from_env() -> Result<Config> {
        match std::env::var("CUARENA_CONF") {
            Ok(s) => Config::parse(&s),
            Err(_) => Ok(Config::default()),
        }
    }

    /// Parses `key=value` pairs separated by commas, over the defaults, e.g.
    /// `small_max=1MiB,superblock=2MiB,max=80%`. Keys: `small_max`, `superblock`, `chunk`,
    /// `max` (bytes or a percentage), `keep_empty`, `sparse` (a fraction), `batch`, `batch_bytes`,
    /// and `passthrough` (a bare key, or `passthrough=true|false|1|0`).
    pub fn parse(s: &str) -> Result<Config> {
        let mut b = Config::builder();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "passthrough" {
                b = b.passthrough(true);
                continue;
            }
            let (k, v) =
                item.split_once('=').ok_or_else(|| config_error(format!("`{item}` is not key=value")))?;
            let (k, v) = (k.trim(), v.trim());
            b = match k {
                "small_max" => b.small_max(parse_bytes(v)?),
                "superblock" => b.superblock(parse_bytes(v)?),
                "chunk" => b.chunk(parse_bytes(v)?),
                "max" => match v.strip_suffix('%') {
                    Some(p) => b.max_fraction(parse_f64(p)? / 100.0),
                    None => b.max_bytes(parse_bytes(v)?),
                },
                "keep_empty" => b.keep_empty(parse_usize(v)?),
                "sparse" => b.sparse_fraction(parse_f64(v)?),
                "batch" => b.batch_blocks(parse_usize(v)?),
                "batch_bytes" => b.batch_bytes(parse_bytes(v)?),
                "passthrough" => b.passthrough(match v {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(config_error(format!("passthrough=`{v}` is not true, false, 1 or 0"))),
                }),
                _ => return Err(config_error(format!("unknown key `{k}`"))),
            };
        }
        b.build()
    }

    /// Largest request served by the per-thread arenas.
    pub fn small_max(&self) -> usize {
        self.small_max
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
    /// The cap in bytes for a device of `total` bytes.
    pub fn limit_bytes(&self, total: usize) -> usize {
        match self.max {
            Limit::Bytes(b) => b,
            Limit::Fraction(f) => (total as f64 * f) as usize,
        }
    }
}

fn parse_usize(v: &str) -> Result<usize> {
    v.parse().map_err(|_| config_error(format!("`{v}` is not a whole number")))
}

fn parse_f64(v: &str) -> Result<f64> {
    v.parse().map_err(|_| config_error(format!("`{v}` is not a number")))
}

/// Parses `4096`, `4KiB`, `2MiB`, `1GiB`, `1TiB` (binary) or `4KB`, `2MB`, `1GB` (decimal).
pub fn parse_bytes(v: &str) -> Result<usize> {
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: usize = num.parse().map_err(|_| config_error(format!("`{v}` is not a byte size")))?;
    let mul: usize = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        u => return Err(config_error(format!("unknown unit `{u}` in `{v}`"))),
    };
    n.checked_mul(mul).ok_or_else(|| config_error(format!("`{v}` overflows")))
}

/// Builds a validated [`Config`].
#[derive(Clone, Debug)]
pub struct ConfigBuilder(Config);

impl ConfigBuilder {
    /// Largest request served by the arenas (at most the superblock size).
    pub fn small_max(mut self, bytes: usize) -> Self {
        self.0.small_max = bytes;
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
    /// Pass-through mode (a debug mode): every allocation and free goes straight to the driver
    /// (`cuMemAllocAsync`/`cuMemFreeAsync`), so compute-sanitizer sees each one. Frees are still
    /// checked against the live blocks.
    pub fn passthrough(mut self, on: bool) -> Self {
        self.0.passthrough = on;
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
        let c = self.0;
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
                return err(format!("max {b} must be at least one superblock ({})", c.superblock));
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
            m.contains("small_max, superblock, chunk, max, keep_empty, sparse, batch, batch_bytes"),
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
        assert_helpful(&message(Config::parse("batch_bytes=0")), "batch_bytes");
        assert_eq!(Config::parse("batch_bytes=1").unwrap().batch_bytes, 1);
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
}
