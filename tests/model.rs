//! A property test against a reference model, over the whole configuration space.
//!
//! Random sequences of operations run on three worker threads over the simulated device (small
//! random delays). The workers are driven one command at a time through channels, so the
//! generated order is the executed order and the model is deterministic. The operations:
//! allocate (any size: small, large from an arena's large superblocks, or from the pool; on
//! the per-thread, legacy or a user stream), free (correctly, with the wrong size, a second
//! time, at an interior pointer, or a foreign pointer), by the owner or by another thread (a
//! hand-off), flush a thread, release a thread's arena, and synchronise. The model tracks the
//! live blocks and predicts each result: `Ok`, or an `InvalidFree` with a reason from a small
//! allowed set. A bad free of a block another arena owns may be accepted and refused later by
//! the owner; the model then expects it in `stats().invalid_frees` and in
//! `take_deferred_error()` at the next synchronisation.
//!
//! Two tests: `random_operations_match_the_model` with one fixed configuration (256 KiB
//! superblocks, `small_max` 64 KiB, `large_max` 512 KiB, batches of 4), and
//! `random_operations_over_random_configurations_match_the_model`, where each case also draws
//! its configuration, written as a `CUARENA_CONF` string (the way users give one) and parsed,
//! from every key's valid range with its edges: superblocks of 64 KiB to 64 MiB, `small_max`
//! from 1 B to the superblock (`small_max == superblock`, one byte over half of it, one byte
//! under it), `large_max` off, equal to `small_max`, one byte over it or up to 64 MiB, `chunk`
//! from one superblock up, a cap `max` from one superblock (small enough that out of memory is
//! common) or a percentage of a small device, `keep_empty` 0 to 1024, `sparse` from 10^-6 to
//! 1 - 10^-6, `batch` and `legacy_batch` from 1 to 65536, `batch_bytes` and
//! `legacy_batch_bytes` from 1 B to `usize::MAX`, `stats=exact`, `passthrough`; and the
//! simulated device's size and chunk alignment (below the superblock the pool must find
//! aligned runs itself). The configuration fuzzing is helper-28's (twenty-fifth session).
//!
//! Operations beyond those: several user streams; destroying a user stream and
//! creating one in its place (the simulated device, like CUDA, gives the new stream the
//! destroyed one's handle when it is created after the destroy); `trim(false)`, `trim(true)`;
//! `set_limit_bytes` (to 0, under a superblock, under or over what is reserved, back, or
//! unlimited); `release_thread`; and a worker thread that exits and is replaced.
//!
//! What is checked, beside the model's results for every free:
//! - every block is 256-byte aligned (README, "The contract") and overlaps no live block;
//! - out of memory is an `Err(Error::OutOfMemory)` naming the size asked for and the cap now
//!   in force (never a panic, never another error); with nothing live, after every thread is
//!   flushed, the device synchronised and `trim(true)` run, a request the cap and the device
//!   leave room for must then succeed (no memory was lost);
//! - reserved memory never exceeds the cap (or what was reserved when a lower cap was set);
//! - at each synchronisation the live bytes, the invalid frees, the allocation and
//!   out-of-memory counts and the cap match the model, and the invariants hold;
//! - at the end every byte comes back (`assert_all_returned`), the race checker saw no unordered
//!   reuse, no tag was overwritten and no destroyed stream's handle reached the device.
//!
//! A free is ordered after the block's last use the way a correct program orders it: the
//! stream that used it records an event, and the freeing stream waits on it; a free on another
//! stream (or thread) then uses the block on the freeing stream first, so a block the allocator
//! hands out again without a fence after such a free races with that use.
//!
//! 96 cases of each by default (`PROPTEST_CASES=N` runs N of each); each prints nothing unless
//! it fails.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use cuarena::size_class::block_bytes;
use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, assert_all_returned, host_allocator};
use proptest::prelude::*;

const THREADS: usize = 3;
/// User streams alive at any time (each may be destroyed and replaced).
const USER_SLOTS: usize = 4;
/// User streams a [`Op::Spray`] allocates on: more than a thread keeps arenas for.
const SPRAY: usize = cuarena::MAX_USER_ARENAS + 3;
/// Bytes of each block written with its tag (and checked before its free).
const TAGGED: usize = 1024;
const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Workers: one command at a time, in order.

type Job = Box<dyn FnOnce() + Send>;

struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    fn spawn() -> Worker {
        let (tx, rx) = mpsc::channel::<Job>();
        let handle = std::thread::spawn(move || rx.into_iter().for_each(|job| job()));
        Worker { tx: Some(tx), handle: Some(handle) }
    }

    /// Runs `f` on the worker and waits for its result.
    fn run<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (rtx, rrx) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = rtx.send(f());
        });
        self.tx.as_ref().expect("running").send(job).expect("worker alive");
        rrx.recv().expect("the worker panicked")
    }

    /// Ends the thread (its exit gives its arenas back) and waits for it.
    fn join(&mut self) -> std::thread::Result<()> {
        drop(self.tx.take());
        match self.handle.take() {
            Some(h) => h.join(),
            None => Ok(()),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The configuration.

/// One case's configuration and simulated device.
#[derive(Clone, Debug)]
struct Setup {
    /// The `CUARENA_CONF` string.
    conf: String,
    /// The device's memory.
    capacity: usize,
    /// The alignment of the device's reservations (chunks).
    alignment: usize,
    max_delay_us: u64,
    seed: u64,
}

fn pick<T: Copy>(xs: &[T], i: usize) -> T {
    xs[i % xs.len()]
}

const ANY_BYTES: [&str; 6] = ["1B", "256B", "4KiB", "1MiB", "16MiB", "18446744073709551615"];

#[allow(clippy::type_complexity)]
fn setup_strategy() -> impl Strategy<Value = Setup> {
    (
        (0usize..11, 0usize..11, any::<u64>()),
        (0usize..8, any::<u64>(), 0usize..6),
        (0usize..8, any::<u64>()),
        (0usize..6, 0usize..8, any::<u64>()),
        (0usize..6, 0usize..6, 0usize..6, 0usize..6, 0usize..8),
        (0usize..5, 0usize..5, 0u64..40, any::<u64>()),
    )
        .prop_map(|(sbs, lms, maxs, ks, bs, dev)| {
            let sb = pick(
                &[64 * KIB, 64 * KIB, 128 * KIB, 256 * KIB, 256 * KIB, 512 * KIB, MIB, 4 * MIB, 8 * MIB, 16 * MIB, 64 * MIB],
                sbs.0,
            );
            let r = sbs.2;
            let small = match sbs.1 {
                0 => 1,
                1 => 256,
                2 => 257,
                3 => 2048,
                4 => sb / 2,
                5 => sb / 2 + 1,
                6 => sb - 1,
                7 => sb,
                8 => 1 + (r as usize) % sb,
                9 => (64 * KIB).min(sb),
                _ => 3000,
            };
            let r = lms.1 as usize;
            let large_limit = 64 * MIB;
            let large = match lms.0 {
                0 => None, // off
                1 => Some(small),
                2 => Some(small + 1),
                3 => Some(small + r % (4 * MIB)),
                4 => Some(large_limit),
                5 => Some((2 * small).max(512 * KIB)),
                6 => Some(small + 256),
                _ => Some(small + r % (large_limit - small + 1)),
            }
            .map(|l| l.clamp(small, large_limit));
            let chunk = sb * pick(&[1, 1, 2, 3, 8, 5], lms.2);
            let capacity = pick(&[1 << 30, 1 << 30, 1 << 30, 64 * MIB, 8 * sb + chunk], dev.0);
            let r = maxs.1 as usize;
            let max = match maxs.0 {
                0 | 1 => None,
                2 => Some(format!("{sb}B")),
                3 => Some(format!("{}B", sb * (2 + r % 10))),
                4 => Some(format!("{}B", sb + r % sb)),
                5 => Some(format!("{}%", 1 + r % 30)),
                6 => Some(format!("{}B", sb * (12 + r % 40))),
                _ => Some(format!("{}B", chunk + r % (4 * sb))),
            };
            let keep = pick(&[0, 1, 2, 3, 1024, 5], ks.0);
            let sparse = match ks.1 {
                0 => "0.000001".to_string(),
                1 => "0.01".to_string(),
                2 => "0.5".to_string(),
                3 => "0.6".to_string(),
                4 => "0.99".to_string(),
                5 => "0.999999".to_string(),
                _ => format!("0.{:03}", 1 + ks.2 % 999),
            };
            let mut conf = format!("superblock={sb}B,small_max={small}B,chunk={chunk}B");
            match large {
                None => conf.push_str(",large_max=off"),
                Some(l) => conf.push_str(&format!(",large_max={l}B")),
            }
            if let Some(m) = max {
                conf.push_str(&format!(",max={m}"));
            }
            conf.push_str(&format!(
                ",keep_empty={keep},sparse={sparse},batch={},batch_bytes={},legacy_batch={},legacy_batch_bytes={}",
                pick(&[1, 2, 4, 64, 65536, 3], bs.0),
                pick(&ANY_BYTES, bs.1),
                pick(&[1, 2, 3, 256, 65536, 7], bs.2),
                pick(&ANY_BYTES, bs.3),
            ));
            match bs.4 {
                0..=2 => conf.push_str(",stats=exact"),
                3 => conf.push_str(",passthrough"),
                _ => {}
            }
            Setup {
                conf,
                capacity,
                alignment: pick(&[2 * MIB, 2 * MIB, 256, 64 * KIB, 4 * MIB], dev.1),
                // Mostly short delays; now and then long ones, so more work is in flight at a reuse.
                max_delay_us: if dev.2 < 34 { dev.2 } else { (dev.2 - 33) * 60 },
                seed: dev.3,
            }
        })
}

// ---------------------------------------------------------------------------------------------
// Operations.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum S {
    Ptds,
    Legacy,
    /// The user stream now in slot `k`.
    User(usize),
}

/// A request size, resolved against the case's configuration.
#[derive(Clone, Copy, Debug)]
enum Sz {
    /// 1 ..= 2048 B.
    Tiny(usize),
    /// 1 ..= `small_max`.
    Small(usize),
    /// Over `small_max`, up to `large_max` (at most 4 MiB over `small_max`).
    Large(usize),
    /// Over `large_max` (the pool), by up to 2 MiB.
    Pool(usize),
    /// `small_max`, `small_max + 1`, `large_max`, `large_max + 1`, 1, 256 or 257.
    Edge(usize),
}

#[derive(Clone, Copy, Debug)]
enum Bad {
    /// A size that rounds to another block size.
    WrongSize(usize),
    /// A pointer inside the block (`n` picks the offset).
    Interior(usize),
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        t: usize,
        size: Sz,
        s: S,
    },
    /// Frees live block `pick % live.len()` on thread `t`, stream `s`; with `own`, on its
    /// owner thread and stream instead (the fast paths).
    Free {
        t: usize,
        pick: usize,
        s: S,
        own: bool,
    },
    /// A bad free of a live block; it must be refused and the block stay live.
    BadFree {
        t: usize,
        pick: usize,
        s: S,
        bad: Bad,
    },
    /// Frees freed block `pick % freed.len()` again.
    DoubleFree {
        t: usize,
        pick: usize,
        s: S,
    },
    /// Frees an address no allocator handed out (`which` picks it).
    Foreign {
        t: usize,
        which: usize,
        size: usize,
        s: S,
    },
    Flush {
        t: usize,
    },
    Release {
        t: usize,
    },
    Sync,
    /// `trim(blocking)` on thread `t` (`THREADS`: the test's main thread, which has no arena).
    Trim {
        t: usize,
        blocking: bool,
    },
    /// `set_limit_bytes` (`how` picks the value, `x` a random part of it), or
    /// `set_memory_fraction` with a valid or an invalid fraction.
    SetLimit {
        how: usize,
        x: usize,
    },
    /// Destroys the user stream of slot `slot` and puts a new one there: created after the
    /// destroy (`reuse`: it gets the destroyed stream's handle), or before it.
    Recreate {
        slot: usize,
        reuse: bool,
    },
    /// Worker `t` exits and a new thread takes its place.
    Exit {
        t: usize,
    },
    /// Thread `t` frees another thread's block on, and allocates one block (`size`, at most
    /// `small_max`) on, each of [`SPRAY`] new user streams, which are then destroyed (with `keep`, the first `keep` blocks are freed
    /// first, on their stream, by `t`).
    Spray {
        t: usize,
        size: usize,
        keep: usize,
    },
    /// Announces a capture (`graph_capture_begin`) and begins capturing a stream of its own on
    /// the simulator, or, if one is underway, ends both: the capture must end intact (no device
    /// synchronise ran meanwhile). While one is announced, an allocation may be refused with
    /// `StreamCapturing` of the legacy stream (README, "Captures of blocking streams"). A
    /// synchronisation of the model ([`Harness::sync`]) ends it first.
    Announce,
    /// Frees every live block, synchronises, then asks thread `t` for as much on `s` as the cap
    /// and the device leave room for: it must succeed (nothing was lost), and is freed again.
    Drain {
        t: usize,
        s: S,
    },
}

fn stream_strategy() -> impl Strategy<Value = S> {
    prop_oneof![3 => Just(S::Ptds), 1 => Just(S::Legacy), 3 => (0..USER_SLOTS).prop_map(S::User)]
}

fn size_strategy() -> impl Strategy<Value = Sz> {
    prop_oneof![
        3 => any::<usize>().prop_map(Sz::Tiny),
        4 => any::<usize>().prop_map(Sz::Small),
        2 => any::<usize>().prop_map(Sz::Large),
        1 => any::<usize>().prop_map(Sz::Pool),
        1 => (0usize..7).prop_map(Sz::Edge),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let t = 0..THREADS;
    prop_oneof![
        14 => (t.clone(), size_strategy(), stream_strategy()).prop_map(|(t, size, s)| Op::Alloc { t, size, s }),
        10 => (t.clone(), any::<usize>(), stream_strategy(), any::<bool>())
            .prop_map(|(t, pick, s, own)| Op::Free { t, pick, s, own }),
        2 => (t.clone(), any::<usize>(), stream_strategy(), prop_oneof![
                any::<usize>().prop_map(Bad::WrongSize),
                any::<usize>().prop_map(Bad::Interior),
            ])
            .prop_map(|(t, pick, s, bad)| Op::BadFree { t, pick, s, bad }),
        2 => (t.clone(), any::<usize>(), stream_strategy()).prop_map(|(t, pick, s)| Op::DoubleFree { t, pick, s }),
        1 => (t.clone(), any::<usize>(), 1usize..(1 << 21), stream_strategy())
            .prop_map(|(t, which, size, s)| Op::Foreign { t, which, size, s }),
        1 => t.clone().prop_map(|t| Op::Flush { t }),
        1 => t.clone().prop_map(|t| Op::Release { t }),
        1 => Just(Op::Sync),
        2 => (0..=THREADS, any::<bool>()).prop_map(|(t, blocking)| Op::Trim { t, blocking }),
        1 => (0usize..10, any::<usize>()).prop_map(|(how, x)| Op::SetLimit { how, x }),
        2 => (0..USER_SLOTS, any::<bool>()).prop_map(|(slot, reuse)| Op::Recreate { slot, reuse }),
        1 => t.clone().prop_map(|t| Op::Exit { t }),
        1 => (t.clone(), stream_strategy()).prop_map(|(t, s)| Op::Drain { t, s }),
        1 => (t, any::<usize>(), 0..=SPRAY).prop_map(|(t, size, keep)| Op::Spray { t, size, keep }),
        1 => Just(Op::Announce),
    ]
}

// ---------------------------------------------------------------------------------------------
// The system under test and the model.

#[derive(Clone, Copy, Debug)]
struct Block {
    ptr: u64,
    size: usize,
    /// Its bytes after rounding (`block_bytes`).
    bytes: usize,
    /// The thread that allocated it and uses it, and the stream it uses it on.
    owner: usize,
    s: S,
    tag: u32,
    /// Once its stream was destroyed or its thread exited: an event recorded after its last
    /// use there (a later free waits on it).
    detached: Option<Event>,
}

impl Block {
    fn end(&self) -> u64 {
        self.ptr + self.bytes as u64
    }
}

type Outcome = Result<(), TestCaseError>;

struct Harness {
    dev: HostDevice,
    a: Allocator,
    setup: Setup,
    superblock: usize,
    small_max: usize,
    large_max: usize,
    passthrough: bool,
    /// The cap in force now (`set_limit_bytes` changes it).
    limit: usize,
    /// The most `reserved_bytes` may be: the cap, or what was reserved when a lower cap was set.
    ceiling: usize,
    users: Vec<Stream>,
    workers: Vec<Worker>,
    live: Vec<Block>,
    /// Freed blocks whose bytes no allocation has touched since: a second free must fail.
    freed: Vec<Block>,
    /// Invalid frees so far (refused at once or accepted and to be refused by the owner).
    invalid: u64,
    /// Invalid frees accepted since the last synchronisation, to be refused by the owner.
    deferred: Vec<Deferred>,
    allocations: u64,
    ooms: u64,
    /// The stream being captured under an announcement ([`Op::Announce`]), if one is.
    announced: Option<Stream>,
    next_tag: u32,
    /// Every operation run so far, for failure messages.
    log: Vec<String>,
}

fn raw(s: S, users: &[Stream]) -> Stream {
    match s {
        S::Ptds => Stream::PER_THREAD,
        S::Legacy => Stream::LEGACY,
        S::User(k) => users[k],
    }
}

impl Harness {
    /// The harness for `setup`, or `None` if the allocator refused the configuration with a
    /// clear error (a percentage cap below one superblock of a small device).
    fn new(setup: &Setup) -> Result<Option<Harness>, TestCaseError> {
        let dev = HostDevice::new(HostConfig {
            capacity: setup.capacity,
            alignment: setup.alignment,
            min_delay: Duration::ZERO,
            max_delay: Duration::from_micros(setup.max_delay_us),
            seed: setup.seed | 1,
        });
        let cfg = Config::parse(&setup.conf)
            .map_err(|e| TestCaseError::fail(format!("a valid configuration was refused: {e}")))?;
        let limit = cfg.limit_bytes(setup.capacity);
        let (superblock, small_max, large_max) = (cfg.superblock(), cfg.small_max(), cfg.large_max());
        let passthrough = cfg.passthrough();
        let a = match host_allocator(dev.clone(), cfg) {
            Ok(a) => a,
            Err(Error::Config(_)) if limit < superblock => return Ok(None),
            Err(e) => return Err(TestCaseError::fail(format!("Allocator::new: {e}"))),
        };
        let users = (0..USER_SLOTS).map(|_| dev.create_stream()).collect();
        Ok(Some(Harness {
            dev,
            a,
            setup: setup.clone(),
            superblock,
            small_max,
            large_max,
            passthrough,
            limit,
            ceiling: limit,
            users,
            workers: (0..THREADS).map(|_| Worker::spawn()).collect(),
            live: Vec::new(),
            freed: Vec::new(),
            invalid: 0,
            deferred: Vec::new(),
            allocations: 0,
            ooms: 0,
            announced: None,
            next_tag: 1,
            log: Vec::new(),
        }))
    }

    fn ctx(&self) -> String {
        let tail = &self.log[self.log.len().saturating_sub(120)..];
        format!(
            "config `{}`, device {} B aligned {} B\nafter {} ops; the last (with what they did):\n  {}",
            self.setup.conf,
            self.setup.capacity,
            self.setup.alignment,
            self.log.len(),
            tail.join("\n  ")
        )
    }

    /// Adds what the current operation did to its log line.
    fn note(&mut self, what: String) {
        if let Some(l) = self.log.last_mut() {
            l.push(' ');
            l.push_str(&what);
        }
    }

    /// The bytes a block of `size` occupies (pass-through mode: exactly `size`, each block the
    /// driver's own).
    fn bytes(&self, size: usize) -> usize {
        if self.passthrough {
            return size;
        }
        block_bytes(size, self.small_max).expect("sizes here never overflow")
    }

    fn resolve(&self, sz: Sz) -> usize {
        let (sm, lm) = (self.small_max, self.large_max);
        match sz {
            Sz::Tiny(x) => 1 + x % 2048,
            Sz::Small(x) => 1 + x % sm,
            Sz::Large(x) if lm > sm => sm + 1 + x % (lm.min(sm + 4 * MIB) - sm),
            Sz::Large(x) => 1 + x % sm,
            Sz::Pool(x) => lm + 1 + x % (2 * MIB),
            Sz::Edge(i) => pick(&[sm, sm + 1, lm, lm + 1, 1, 256, 257], i),
        }
    }

    /// Has `b`'s user record an event after its last use (a tag check) and returns it.
    fn last_use(&self, b: &Block) -> Event {
        if let Some(e) = b.detached {
            return e;
        }
        let dev = self.dev.clone();
        let st = raw(b.s, &self.users);
        let b = *b;
        self.workers[b.owner].run(move || {
            dev.check_tag(b.ptr, b.size.min(TAGGED) & !3, b.tag, st).unwrap();
            let e = dev.create_event().unwrap();
            dev.record_event(e, st).unwrap();
            e
        })
    }

    /// Frees `b` correctly on thread `t`, stream `s`, after its last use. On another thread or
    /// stream, the freeing stream uses the block too before the free.
    fn free_ok(&mut self, b: Block, t: usize, s: S) -> Outcome {
        let e = self.last_use(&b);
        let (a, dev) = (self.a.clone(), self.dev.clone());
        let st = raw(s, &self.users);
        let elsewhere = b.detached.is_some() || t != b.owner || s != b.s;
        let r = self.workers[t].run(move || {
            dev.stream_wait_event(st, e).unwrap();
            if elsewhere {
                dev.check_tag(b.ptr, b.size.min(TAGGED) & !3, b.tag, st).unwrap();
            }
            a.deallocate(DeviceAddr(b.ptr), b.size, st)
        });
        self.note(format!("frees {:#x} ({} B, of thread {} on {:?})", b.ptr, b.size, b.owner, b.s));
        prop_assert!(r.is_ok(), "a correct free of {b:?} on thread {t}, {s:?} failed: {r:?}\n{}", self.ctx());
        self.freed.push(b);
        Ok(())
    }

    /// Runs a bad free and checks it is refused with an allowed reason, now or (when `defer`
    /// names the block, one an arena may own) by its owner later.
    fn bad_free(
        &mut self,
        t: usize,
        ptr: u64,
        size: usize,
        s: S,
        allowed: Vec<InvalidFree>,
        defer: Option<(u32, bool)>,
    ) -> Outcome {
        let a = self.a.clone();
        let st = raw(s, &self.users);
        let r = self.workers[t].run(move || a.deallocate(DeviceAddr(ptr), size, st));
        self.note(format!("frees {ptr:#x} ({size} B) -> {r:?}"));
        match r {
            Err(Error::InvalidFree { reason, ptr: p, size: z }) => {
                prop_assert!((p, z) == (ptr, size), "the error names {p:#x}/{z}, not {ptr:#x}/{size}");
                prop_assert!(
                    allowed.iter().any(|x| same_kind(*x, reason)),
                    "free of {ptr:#x} ({size} B): reason {reason:?}, expected one of {allowed:?}\n{}",
                    self.ctx()
                );
            }
            Ok(()) if defer.is_some() => {
                let (tag, was_freed) = defer.expect("checked");
                self.deferred.push(Deferred { allowed, tag, was_freed });
            }
            other => prop_assert!(
                false,
                "free of {ptr:#x} ({size} B) on thread {t}, {s:?}: got {other:?}, expected one of {allowed:?}\n{}",
                self.ctx()
            ),
        }
        self.invalid += 1;
        Ok(())
    }

    /// Gives every live block of thread `t` (or of user slot `slot`) a last use and an event
    /// after it, before its thread exits (or its stream is destroyed).
    fn detach(&mut self, which: impl Fn(&Block) -> bool) {
        let idx: Vec<usize> = (0..self.live.len())
            .filter(|&i| self.live[i].detached.is_none() && which(&self.live[i]))
            .collect();
        for i in idx {
            let e = self.last_use(&self.live[i]);
            self.live[i].detached = Some(e);
        }
    }

    /// Bytes the cap must leave room for (in whole superblocks, and one superblock more where
    /// the device's chunks may be off the superblock alignment) before a request of `size`
    /// must succeed with nothing else live.
    fn need(&self, size: usize) -> usize {
        let sb = self.superblock;
        let mut need = self.bytes(size).next_multiple_of(sb);
        if self.setup.alignment < sb {
            need += sb;
        }
        need
    }

    /// Bytes the cap and the device leave for the pool to reserve, in whole superblocks.
    fn room(&self) -> usize {
        self.limit.min(self.setup.capacity) / self.superblock * self.superblock
    }

    fn alloc(&mut self, t: usize, size: usize, s: S) -> Result<Result<Block, Error>, TestCaseError> {
        let (a, dev) = (self.a.clone(), self.dev.clone());
        let st = raw(s, &self.users);
        let tag = self.next_tag;
        self.next_tag += 1;
        let r = self.workers[t].run(move || {
            let p = a.allocate(size, st)?;
            dev.write_tag(p.0, size.min(TAGGED) & !3, tag, st).unwrap();
            Ok::<_, Error>(p)
        });
        let p = match r {
            Ok(p) => p.0,
            Err(e) => {
                self.note(format!("-> {e}"));
                match e {
                    Error::OutOfMemory { requested, limit, .. } => {
                        prop_assert_eq!(requested, size, "out of memory names another size\n{}", self.ctx());
                        prop_assert_eq!(limit, self.limit, "out of memory names another cap\n{}", self.ctx());
                        self.ooms += 1;
                        return Ok(Err(e));
                    }
                    // While a capture is announced: only memory that needs a call on the legacy
                    // stream would do.
                    Error::StreamCapturing { stream }
                        if self.announced.is_some() && Stream::from_raw(stream).is_legacy() =>
                    {
                        return Ok(Err(e));
                    }
                    e => {
                        return Err(TestCaseError::fail(format!(
                            "allocate({size}, {s:?}) on thread {t}: {e:?}, not a block or out of memory\n{}",
                            self.ctx()
                        )));
                    }
                }
            }
        };
        let b = Block { ptr: p, size, bytes: self.bytes(size), owner: t, s, tag, detached: None };
        self.note(format!("-> {p:#x}"));
        self.allocations += 1;
        prop_assert!(p % 256 == 0, "{p:#x} is not 256-aligned\n{}", self.ctx());
        if let Some(o) = self.live.iter().find(|o| o.ptr < b.end() && b.ptr < o.end()) {
            prop_assert!(false, "new block {b:?} overlaps live block {o:?}\n{}", self.ctx());
        }
        self.freed.retain(|f| !(f.ptr < b.end() && b.ptr < f.end()));
        self.live.push(b);
        Ok(Ok(b))
    }

    fn step(&mut self, op: &Op) -> Outcome {
        self.log.push(format!("{op:?}"));
        match *op {
            Op::Alloc { t, size, s } => {
                let size = self.resolve(size);
                self.note(format!("({size} B)"));
                if self.alloc(t, size, s)?.is_err() {
                    // With nothing live and everything flushed, synchronised and trimmed, a
                    // request the cap and the device leave room for must succeed.
                    let room = self.room();
                    if self.live.is_empty() && self.deferred.is_empty() && self.need(size) <= room {
                        self.sync()?;
                        self.log.push(format!("retry after a sync: Alloc {size} B on {t} {s:?}"));
                        if let Err(e) = self.alloc(t, size, s)? {
                            prop_assert!(
                                false,
                                "out of memory with nothing live, after a full synchronise: {e}\n{:?}\n{}",
                                self.a.stats(),
                                self.ctx()
                            );
                        }
                    }
                }
            }
            Op::Free { t, pick, s, own } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let b = self.live.swap_remove(pick % self.live.len());
                // With `own`, a block whose stream was destroyed is freed by its thread on the
                // stream now in its slot: with `reuse`, on the destroyed stream's handle.
                let (t, s) = if own { (b.owner, b.s) } else { (t, s) };
                self.free_ok(b, t, s)?;
            }
            Op::BadFree { t, pick, s, bad } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let b = self.live[pick % self.live.len()];
                let may_defer = b.size <= self.large_max;
                match bad {
                    Bad::WrongSize(n) => {
                        let size = self.wrong_size(b.size, n);
                        let allowed = vec![SIZE_MISMATCH, InvalidFree::UnknownPointer];
                        let defer = (may_defer && size <= self.large_max).then_some((b.tag, false));
                        self.bad_free(t, b.ptr, size, s, allowed, defer)?;
                        if defer.is_some() {
                            // Known limitation (README): until a deferred bad free is checked,
                            // a correct free of the same block is refused as a double free.
                            self.sync()?;
                        }
                    }
                    Bad::Interior(n) => {
                        let granules = b.bytes / 256;
                        let off = if granules < 2 || n % 3 == 0 {
                            8 + 8 * (n % 31) as u64
                        } else {
                            256 * (1 + n % (granules - 1)) as u64
                        };
                        let aligned = off % 256 == 0;
                        let defer = (may_defer && aligned).then_some((b.tag, false));
                        // An aligned interior pointer may meet a stale freed flag of an earlier
                        // block that began there (`superblock.rs`): refused as a double free.
                        let allowed = if aligned {
                            vec![InvalidFree::UnknownPointer, InvalidFree::DoubleFree]
                        } else {
                            vec![InvalidFree::UnknownPointer]
                        };
                        self.bad_free(t, b.ptr + off, 256, s, allowed, defer)?;
                        if defer.is_some() {
                            self.sync()?; // as above
                        }
                    }
                }
            }
            Op::DoubleFree { t, pick, s } => {
                if self.freed.is_empty() {
                    return Ok(());
                }
                let b = self.freed[pick % self.freed.len()];
                let allowed = vec![InvalidFree::DoubleFree, InvalidFree::UnknownPointer];
                let defer = (b.size <= self.large_max).then_some((b.tag, true));
                self.bad_free(t, b.ptr, b.size, s, allowed, defer)?;
            }
            Op::Foreign { t, which, size, s } => {
                let ptr = match which % 4 {
                    0 => 0xdead_0000,
                    1 => !255,
                    2 => 256 * (1 + (which as u64 >> 2) % 4096),
                    _ => 0,
                };
                self.bad_free(t, ptr, size, s, vec![InvalidFree::UnknownPointer], None)?;
            }
            Op::Flush { t } => {
                let a = self.a.clone();
                let r = self.workers[t].run(move || a.flush());
                prop_assert!(r.is_ok(), "flush: {r:?}\n{}", self.ctx());
            }
            Op::Release { t } => {
                let a = self.a.clone();
                let r = self.workers[t].run(move || a.release_thread());
                prop_assert!(r.is_ok(), "release_thread: {r:?}\n{}", self.ctx());
            }
            Op::Sync => self.sync()?,
            Op::Trim { t, blocking } => {
                let a = self.a.clone();
                let r = if t < THREADS {
                    self.workers[t].run(move || a.trim(blocking))
                } else {
                    a.trim(blocking)
                };
                self.note(format!("-> {r:?}"));
                prop_assert!(r.is_ok(), "trim({blocking}): {r:?}\n{}", self.ctx());
            }
            Op::SetLimit { how, x } => {
                let sb = self.superblock;
                let reserved = self.a.stats().reserved_bytes as usize;
                let bytes = match how {
                    0 => 0,
                    1 => sb - 1,
                    2 => reserved,
                    3 => reserved + sb * (1 + x % 4),
                    4 => reserved / 2,
                    5 => usize::MAX,
                    6 => sb * (1 + x % 16),
                    7 => Config::parse(&self.setup.conf).unwrap().limit_bytes(self.setup.capacity),
                    8 => {
                        let f = pick(&[0.0, 0.001, 0.02, 0.5, 1.0], x);
                        let r = self.a.set_memory_fraction(f);
                        prop_assert!(r.is_ok(), "set_memory_fraction({f}): {r:?}");
                        (self.setup.capacity as f64 * f) as usize
                    }
                    _ => {
                        let f = pick(&[f64::NAN, -0.5, 1.5, f64::INFINITY, -0.0 - 1e-12], x);
                        let r = self.a.set_memory_fraction(f);
                        prop_assert!(matches!(r, Err(Error::Config(_))), "set_memory_fraction({f}): {r:?}");
                        prop_assert_eq!(
                            self.a.stats().limit_bytes,
                            self.limit as u64,
                            "a refused fraction changed the cap"
                        );
                        return Ok(());
                    }
                };
                if how < 8 {
                    self.a.set_limit_bytes(bytes);
                }
                self.note(format!("({bytes} B, {reserved} B reserved)"));
                self.limit = bytes;
                self.ceiling = bytes.max(reserved);
            }
            Op::Recreate { slot, reuse } => {
                let old = self.users[slot];
                self.detach(|b| b.s == S::User(slot));
                let new = if reuse {
                    self.dev.destroy_stream(old).unwrap();
                    self.dev.create_stream()
                } else {
                    let new = self.dev.create_stream();
                    self.dev.destroy_stream(old).unwrap();
                    new
                };
                self.note(format!("{:#x} -> {:#x}", old.as_raw(), new.as_raw()));
                self.users[slot] = new;
            }
            Op::Drain { t, s } => {
                while let Some(b) = self.live.pop() {
                    self.free_ok(b, b.owner, if b.detached.is_some() { S::Legacy } else { b.s })?;
                }
                self.sync()?;
                let room = self.room().min(96 * MIB);
                let slack = if self.setup.alignment < self.superblock { self.superblock } else { 0 };
                if room > slack {
                    let size = room - slack;
                    self.log.push(format!("fill: Alloc {size} B on {t} {s:?}"));
                    match self.alloc(t, size, s)? {
                        Ok(_) => {
                            let b = self.live.pop().expect("just allocated");
                            self.free_ok(b, t, s)?;
                        }
                        Err(e) => prop_assert!(
                            false,
                            "out of memory with nothing live, after a full synchronise: {e}\n{:?}\n{}",
                            self.a.stats(),
                            self.ctx()
                        ),
                    }
                }
            }
            Op::Announce => match self.announced {
                Some(_) => self.end_announcement()?,
                None => {
                    let cs = self.dev.create_stream();
                    self.a.graph_capture_begin();
                    self.dev
                        .begin_capture(cs)
                        .map_err(|e| TestCaseError::fail(format!("begin_capture: {e}")))?;
                    self.announced = Some(cs);
                }
            },
            Op::Spray { t, size, keep } => {
                let size = 1 + size % self.small_max.min(64 * KIB);
                let mut streams = Vec::new();
                for _ in 0..SPRAY {
                    let st = self.dev.create_stream();
                    streams.push(st);
                    // A slot past the table, for this operation only.
                    self.users.push(st);
                    let k = self.users.len() - 1;
                    self.log.push(format!("spray: Alloc {size} B on {t} {st:?}"));
                    // A remote free on each new stream: `t` batches them per user stream, and
                    // past the sixteenth a free is sent alone, under its own event.
                    if let Some(i) = self.live.iter().position(|b| b.owner != t && b.detached.is_none()) {
                        let b = self.live.swap_remove(i);
                        self.free_ok(b, t, S::User(k))?;
                    }
                    let r = self.alloc(t, size, S::User(k))?;
                    if r.is_ok() && streams.len() <= keep {
                        let b = self.live.pop().expect("just allocated");
                        self.free_ok(b, t, S::User(k))?;
                    }
                }
                // The rest stay live: detached, their streams destroyed.
                let first = USER_SLOTS;
                self.detach(|b| matches!(b.s, S::User(k) if k >= first));
                for b in self.live.iter_mut().filter(|b| matches!(b.s, S::User(k) if k >= first)) {
                    b.s = S::Legacy;
                }
                for st in streams {
                    self.dev.destroy_stream(st).unwrap();
                }
                self.users.truncate(USER_SLOTS);
            }
            Op::Exit { t } => {
                self.detach(|b| b.owner == t);
                let r = self.workers[t].join();
                prop_assert!(r.is_ok(), "worker {t} panicked at its exit\n{}", self.ctx());
                self.workers[t] = Worker::spawn();
            }
        }
        let reserved = self.a.stats().reserved_bytes as usize;
        prop_assert!(
            reserved <= self.ceiling,
            "{reserved} B reserved over the cap {} B (ceiling {} B)\n{}",
            self.limit,
            self.ceiling,
            self.ctx()
        );
        Ok(())
    }

    /// Ends the announced capture, if one is underway: it must end intact.
    fn end_announcement(&mut self) -> Outcome {
        if let Some(cs) = self.announced.take() {
            let ended = self.dev.end_capture(cs);
            prop_assert!(ended.is_ok(), "the announced capture was broken: {ended:?}\n{}", self.ctx());
            let r = self.a.graph_capture_end();
            prop_assert!(r.is_ok(), "graph_capture_end: {r:?}\n{}", self.ctx());
            self.dev.destroy_stream(cs).map_err(|e| TestCaseError::fail(format!("destroy_stream: {e}")))?;
        }
        Ok(())
    }

    /// Every thread flushed, the device idle, parked frees given back (`trim(true)`), every
    /// thread flushed again: every remote free has reached its owner and been checked. Then the
    /// counts must match the model.
    ///
    /// A flush parks a thread's user-stream frees only within the parked bound (README); past
    /// it they stay in the thread's outbox, and the next flush, once the trim has given the
    /// parked memory back, parks them for the next synchronise. So the rounds go on while a
    /// flush leaves frees parked (at most three trims: each empties what is parked, and the
    /// outboxes are emptied by the flush after it).
    fn sync(&mut self) -> Outcome {
        self.end_announcement()?;
        let mut trims = 0;
        loop {
            for w in &self.workers {
                let a = self.a.clone();
                w.run(move || a.flush()).map_err(|e| TestCaseError::fail(format!("flush: {e}")))?;
            }
            self.dev.synchronize();
            if trims > 0 && self.a.parked_free_bytes() == 0 {
                break;
            }
            prop_assert!(trims < 3, "frees still parked after {trims} blocking trims\n{}", self.ctx());
            self.a.trim(true).map_err(|e| TestCaseError::fail(format!("trim: {e}")))?;
            trims += 1;
        }
        self.a.check_invariants();
        let s = self.a.stats();
        prop_assert_eq!(s.reserved_bytes, self.dev.reserved_bytes() as u64, "reserved bytes\n{}", self.ctx());
        let live: u64 = self.live.iter().map(|b| b.bytes as u64).sum();
        prop_assert_eq!(s.live_bytes, live, "live bytes\n{}", self.ctx());
        prop_assert_eq!(s.invalid_frees, self.invalid, "invalid frees counted\n{}", self.ctx());
        prop_assert_eq!(s.allocations, self.allocations, "allocations counted\n{}", self.ctx());
        prop_assert_eq!(s.ooms, self.ooms, "out-of-memory errors counted\n{}", self.ctx());
        prop_assert_eq!(s.limit_bytes, self.limit as u64, "the cap\n{}", self.ctx());
        let err = self.a.take_deferred_error();
        if self.deferred.is_empty() {
            prop_assert!(err.is_none(), "unexpected deferred error {err:?}\n{}", self.ctx());
        } else {
            let ok = match err {
                Some(Error::InvalidFree { reason, .. }) => {
                    self.deferred.iter().any(|d| d.allows(reason, self))
                }
                _ => false,
            };
            prop_assert!(ok, "deferred error {err:?}, expected one of {:?}\n{}", self.deferred, self.ctx());
        }
        self.deferred.clear();
        Ok(())
    }

    /// Frees every live block, then checks that all memory comes back and the checker is clean.
    fn finish(mut self) -> Outcome {
        self.log.push("finish".into());
        while let Some(b) = self.live.pop() {
            let (t, s) = (b.owner, b.s);
            self.free_ok(b, t, s)?;
        }
        self.sync()?;
        for (t, w) in self.workers.iter_mut().enumerate() {
            let a = self.a.clone();
            w.run(move || a.release_thread())
                .map_err(|e| TestCaseError::fail(format!("release {t}: {e}")))?;
            prop_assert!(w.join().is_ok(), "worker {t} panicked at its exit");
        }
        if std::env::var_os("MODEL_CONFIGS_VERBOSE").is_some() {
            let st = self.a.stats();
            eprintln!(
                "case: `{}` dev {} B/{} B: {} ops, {} allocations ({} large, {} pool), {} out of memory, {} invalid frees, peak reserved {} B",
                self.setup.conf,
                self.setup.capacity,
                self.setup.alignment,
                self.log.len(),
                self.allocations,
                st.large_allocations,
                st.pool_allocations,
                self.ooms,
                self.invalid,
                st.peak_reserved_bytes
            );
        }
        let (a, dev, invalid) = (self.a.clone(), self.dev.clone(), self.invalid);
        let ctx = self.ctx();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            assert_all_returned(&a, Some(&dev), invalid)
        }));
        if let Err(p) = r {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            prop_assert!(false, "assert_all_returned: {msg}\n{ctx}");
        }
        Ok(())
    }

    /// A size whose block differs from `size`'s.
    fn wrong_size(&self, size: usize, n: usize) -> usize {
        // The normal mode's rounding, in pass-through mode too (`passthrough.rs`).
        let round = |s: usize| block_bytes(s, self.small_max).expect("sizes here never overflow");
        let rounded = round(size);
        let candidates = [size * 2 + 300, size / 3, size + 70_000, rounded + 1 + n % 4096, 1 + n % 200_000];
        let start = n % candidates.len();
        (0..candidates.len())
            .map(|i| candidates[(start + i) % candidates.len()])
            .find(|&c| c > 0 && round(c) != rounded)
            .expect("one candidate differs")
    }
}

/// A bad free accepted by a thread that does not own the block; its owner checks it later.
#[derive(Debug)]
struct Deferred {
    allowed: Vec<InvalidFree>,
    /// The block it named, and whether that block was already freed (a double free).
    tag: u32,
    was_freed: bool,
}

impl Deferred {
    /// The owner checks the free when it drains it, not when it was made. If the block named
    /// was freed correctly in between (or, for a double free, its bytes handed out again), the
    /// owner meets a free block or a new one there: any refusal is then right.
    fn allows(&self, reason: InvalidFree, h: &Harness) -> bool {
        let changed = if self.was_freed {
            !h.freed.iter().any(|b| b.tag == self.tag)
        } else {
            !h.live.iter().any(|b| b.tag == self.tag)
        };
        changed || self.allowed.iter().any(|x| same_kind(*x, reason))
    }
}

const SIZE_MISMATCH: InvalidFree = InvalidFree::SizeMismatch { allocated: 0, given: 0 };

fn same_kind(a: InvalidFree, b: InvalidFree) -> bool {
    std::mem::discriminant(&a) == std::mem::discriminant(&b)
}

/// Runs one case; a panic anywhere (in the allocator on a worker thread, or here) fails it.
fn run_case(setup: &Setup, ops: &[Op]) -> Outcome {
    let Some(mut h) = Harness::new(setup)? else { return Ok(()) };
    for op in ops {
        h.step(op)?;
    }
    h.finish()
}

proptest! {
    #![proptest_config(ProptestConfig {
        // 96 by default (about 5 s in release, 15 s in debug); PROPTEST_CASES=N runs more.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96),
        max_shrink_iters: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_match_the_model(
        (max_delay_us, seed) in (0u64..40, any::<u64>()),
        ops in prop::collection::vec(op_strategy(), 1..200),
    ) {
        let setup = Setup {
            conf: "superblock=256KiB,small_max=64KiB,large_max=512KiB,chunk=1MiB,batch=4,keep_empty=1".into(),
            capacity: 1 << 30,
            alignment: 2 * MIB,
            max_delay_us,
            seed,
        };
        run_case(&setup, &ops)?;
    }

    #[test]
    fn random_operations_over_random_configurations_match_the_model(
        setup in setup_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..160),
    ) {
        run_case(&setup, &ops)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic regressions.

/// One thread allocates 64 blocks of 16 KiB (16 superblocks of 64 KiB) on its per-thread
/// stream and frees them all there itself, with `keep_empty=0` and `sparse`: the arena's
/// superblock bytes before and after the frees.
fn held_after_own_frees(sparse: &str) -> (u64, u64) {
    let dev = HostDevice::new(HostConfig { capacity: 1 << 30, ..HostConfig::default() });
    let conf =
        format!("superblock=64KiB,small_max=16KiB,chunk=1MiB,large_max=off,keep_empty=0,sparse={sparse}");
    let a = host_allocator(dev.clone(), Config::parse(&conf).unwrap()).unwrap();
    let a2 = a.clone();
    let held = std::thread::spawn(move || {
        let blocks: Vec<_> = (0..64).map(|_| a2.allocate(16 * KIB, Stream::PER_THREAD).unwrap()).collect();
        let before = a2.stats().arena_held_bytes;
        for p in blocks {
            a2.deallocate(p, 16 * KIB, Stream::PER_THREAD).unwrap();
        }
        let after = a2.stats().arena_held_bytes;
        a2.release_thread().unwrap();
        (before, after)
    })
    .join()
    .unwrap();
    assert_all_returned(&a, Some(&dev), 0);
    held
}

/// The return rule (`src/arena.rs`, "Superblock return rule"): after every own free an arena
/// holds at most `max(u + K·S, u / (1 - f))`; with nothing live and `K = 0`, nothing.
#[test]
fn an_arena_emptied_by_its_owner_keeps_no_superblock_at_keep_empty_0() {
    for sparse in ["0.000001", "0.5", "0.6", "0.99", "0.999", "0.9995"] {
        assert_eq!(held_after_own_frees(sparse), (1 << 20, 0), "sparse={sparse}");
    }
}

/// A valid `sparse` near 1 keeps the return rule on (found by this file's configuration
/// fuzzing, helper-28). `Arena::new` kept `1 - sparse` as `round((1 - f) · 1024)`, which is 0 for
/// `f > 1 - 1/2048`, and the rule's test was then never true: an arena whose owner freed
/// everything kept every superblock it borrowed (here 16 of them) until `trim` or out of memory,
/// where the documented bound (`keep_empty=0`, nothing live) is none. Now `1 - f` is kept in
/// units of 2^-20, rounded up, at least 1.
#[test]
fn sparse_near_1_keeps_the_return_rule_on() {
    for sparse in ["0.9996", "0.9999", "0.999999"] {
        assert_eq!(held_after_own_frees(sparse), (1 << 20, 0), "sparse={sparse}");
    }
}

/// Found by the random configurations (twenty-ninth session's successor): a bad free by one
/// thread on a user stream, while parked arenas fill the parked bound, stays in its outbox
/// through the first flush and is parked by the flush after the trim, so one trim was not
/// enough for the model's synchronisation to see it checked.
#[test]
fn a_bad_free_parked_only_after_a_trim_is_checked_by_the_next() {
    let setup = Setup {
        conf: "superblock=16777216B,small_max=1B,chunk=16777216B,large_max=3028B,keep_empty=1,sparse=0.000001,batch=2,batch_bytes=4KiB,legacy_batch=1,legacy_batch_bytes=1B".into(),
        capacity: 1 << 30,
        alignment: 2 << 20,
        max_delay_us: 0,
        seed: 0,
    };
    let ops = [
        Op::Alloc { t: 1, size: Sz::Tiny(1152701139501006803), s: S::User(2) },
        Op::Spray { t: 1, size: 5008343563154086182, keep: 2 },
        Op::BadFree {
            t: 0,
            pick: 18246038400914508669,
            s: S::User(3),
            bad: Bad::WrongSize(6840934635864136403),
        },
        Op::Sync,
    ];
    if let Err(e) = run_case(&setup, &ops) {
        panic!("{e}");
    }
}
