//! A property test against a reference model.
//!
//! Random sequences of operations run on three worker threads over the simulated device (small
//! random delays). The workers are driven one command at a time through channels, so the
//! generated order is the executed order and the model is deterministic. The operations:
//! allocate (any size: small, large from an arena's large superblocks, or from the pool; on
//! the per-thread, legacy or a user stream), free (correctly, with the
//! wrong size, a second time, at an interior pointer, or a foreign pointer), by the owner or by
//! another thread (a hand-off), flush a thread, release a thread's arena, and synchronise.
//!
//! The model tracks the live blocks and predicts each result: `Ok`, or an `InvalidFree` with a
//! reason from a small allowed set. A bad free of a block another arena owns may be accepted and
//! refused later by the owner; the model then expects it in `stats().invalid_frees` and in
//! `take_deferred_error()` at the next synchronisation (every thread flushed, the device idle,
//! every thread flushed again), where it also checks `live_bytes`. After every allocation: 256
//! alignment and no overlap with any live block. At the end: every block frees once, the race
//! checker saw no unordered reuse, no tag was overwritten, and all memory comes back.
//!
//! Every free is ordered after the block's last use like a correct program's: the thread that
//! used it records an event on its stream and the freeing stream waits on it. So any race the
//! checker reports is the allocator's (a block reused on another stream without a fence).

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use cuarena::size_class::block_bytes;
use cuarena::{Allocator, Config, Device, DeviceAddr, Error, Event, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, host_allocator};
use proptest::prelude::*;

const SMALL_MAX: usize = 64 << 10;
/// Requests up to this on the per-thread and legacy streams are served by the arenas, from
/// large superblocks above `SMALL_MAX`; above it (sizes go up to 600 KiB), by the pool.
const LARGE_MAX: usize = 512 << 10;
const THREADS: usize = 3;
/// Bytes of each block written with its tag (and checked before its free).
const TAGGED: usize = 1024;

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

    /// Ends the thread (its exit gives its arena back) and waits for it.
    fn join(&mut self) {
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            h.join().expect("worker panicked");
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
// Operations.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum S {
    Ptds,
    Legacy,
    User,
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
        size: usize,
        s: S,
    },
    /// Frees live block `pick % live.len()` on thread `t`, stream `s`.
    Free {
        t: usize,
        pick: usize,
        s: S,
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
}

fn stream_strategy() -> impl Strategy<Value = S> {
    prop_oneof![3 => Just(S::Ptds), 1 => Just(S::Legacy), 1 => Just(S::User)]
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..=2048,
        4 => 2049usize..=SMALL_MAX,
        2 => (SMALL_MAX + 1)..=(600 << 10),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let t = 0..THREADS;
    prop_oneof![
        12 => (t.clone(), size_strategy(), stream_strategy()).prop_map(|(t, size, s)| Op::Alloc { t, size, s }),
        9 => (t.clone(), any::<usize>(), stream_strategy()).prop_map(|(t, pick, s)| Op::Free { t, pick, s }),
        2 => (t.clone(), any::<usize>(), stream_strategy(), prop_oneof![
                any::<usize>().prop_map(Bad::WrongSize),
                any::<usize>().prop_map(Bad::Interior),
            ])
            .prop_map(|(t, pick, s, bad)| Op::BadFree { t, pick, s, bad }),
        2 => (t.clone(), any::<usize>(), stream_strategy()).prop_map(|(t, pick, s)| Op::DoubleFree { t, pick, s }),
        1 => (t.clone(), any::<usize>(), size_strategy(), stream_strategy())
            .prop_map(|(t, which, size, s)| Op::Foreign { t, which, size, s }),
        1 => t.clone().prop_map(|t| Op::Flush { t }),
        1 => t.prop_map(|t| Op::Release { t }),
        1 => Just(Op::Sync),
    ]
}

// ---------------------------------------------------------------------------------------------
// The system under test and the model.

#[derive(Clone, Copy, Debug)]
struct Block {
    ptr: u64,
    size: usize,
    /// The thread that allocated it and uses it, and the stream it uses it on.
    owner: usize,
    s: S,
    tag: u32,
}

impl Block {
    fn bytes(&self) -> usize {
        block_bytes(self.size, SMALL_MAX).unwrap()
    }
    fn end(&self) -> u64 {
        self.ptr + self.bytes() as u64
    }
    /// Served by its thread's arena: a request up to `LARGE_MAX`, on any stream (each stream
    /// has its arena).
    fn arena(&self) -> bool {
        self.size <= LARGE_MAX
    }
}

struct Harness {
    dev: HostDevice,
    a: Allocator,
    user: Stream,
    workers: Vec<Worker>,
    live: Vec<Block>,
    /// Freed blocks whose bytes no allocation has touched since: a second free must fail.
    freed: Vec<Block>,
    /// Invalid frees so far (refused at once or accepted and to be refused by the owner).
    invalid: u64,
    /// Invalid frees accepted since the last synchronisation, to be refused by the owner.
    deferred: Vec<Deferred>,
    next_tag: u32,
    /// Every operation run so far, for failure messages.
    log: Vec<String>,
}

fn raw(s: S, user: Stream) -> Stream {
    match s {
        S::Ptds => Stream::PER_THREAD,
        S::Legacy => Stream::LEGACY,
        S::User => user,
    }
}

type Outcome = Result<(), TestCaseError>;

impl Harness {
    fn new(seed: u64, max_delay_us: u64) -> Harness {
        let dev = HostDevice::new(HostConfig {
            capacity: 1 << 30,
            min_delay: Duration::ZERO,
            max_delay: Duration::from_micros(max_delay_us),
            seed: seed | 1,
            ..HostConfig::default()
        });
        let cfg = Config::builder()
            .superblock(256 << 10)
            .small_max(SMALL_MAX)
            .large_max(LARGE_MAX)
            .chunk(1 << 20)
            .batch_blocks(4)
            .keep_empty(1)
            .build()
            .unwrap();
        let a = host_allocator(dev.clone(), cfg).unwrap();
        let user = dev.create_stream();
        Harness {
            dev,
            a,
            user,
            workers: (0..THREADS).map(|_| Worker::spawn()).collect(),
            live: Vec::new(),
            freed: Vec::new(),
            invalid: 0,
            deferred: Vec::new(),
            next_tag: 1,
            log: Vec::new(),
        }
    }

    fn ctx(&self) -> String {
        let tail = &self.log[self.log.len().saturating_sub(250)..];
        format!("after {} ops; the last (with what they did):\n  {}", self.log.len(), tail.join("\n  "))
    }

    /// Adds what the current operation did to its log line.
    fn note(&mut self, what: String) {
        if let Some(l) = self.log.last_mut() {
            l.push(' ');
            l.push_str(&what);
        }
    }

    /// Has `b`'s user record an event after its last use (a tag check) and returns it.
    fn last_use(&self, b: &Block) -> Event {
        let (dev, user) = (self.dev.clone(), self.user);
        let b = *b;
        self.workers[b.owner].run(move || {
            let st = raw(b.s, user);
            dev.check_tag(b.ptr, b.size.min(TAGGED) & !3, b.tag, st).unwrap();
            let e = dev.create_event().unwrap();
            dev.record_event(e, st).unwrap();
            e
        })
    }

    /// Frees `b` correctly on thread `t`, stream `s`, after its last use.
    fn free_ok(&mut self, b: Block, t: usize, s: S) -> Outcome {
        let e = self.last_use(&b);
        let (a, dev, user) = (self.a.clone(), self.dev.clone(), self.user);
        let r = self.workers[t].run(move || {
            let st = raw(s, user);
            dev.stream_wait_event(st, e).unwrap();
            a.deallocate(DeviceAddr(b.ptr), b.size, st)
        });
        self.note(format!("frees {:#x} ({} B, of thread {} on {:?})", b.ptr, b.size, b.owner, b.s));
        prop_assert!(r.is_ok(), "a correct free of {b:?} on thread {t}, {s:?} failed: {r:?}\n{}", self.ctx());
        self.freed.push(b);
        Ok(())
    }

    /// Runs a bad free and checks it is refused with an allowed reason, now or (when `defer`
    /// names the block, a small one another arena may own) by its owner later.
    fn bad_free(
        &mut self,
        t: usize,
        ptr: u64,
        size: usize,
        s: S,
        allowed: Vec<InvalidFree>,
        defer: Option<(u32, bool)>,
    ) -> Outcome {
        let (a, user) = (self.a.clone(), self.user);
        let r = self.workers[t].run(move || a.deallocate(DeviceAddr(ptr), size, raw(s, user)));
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

    fn step(&mut self, op: &Op) -> Outcome {
        self.log.push(format!("{op:?}"));
        match *op {
            Op::Alloc { t, size, s } => {
                let (a, dev, user) = (self.a.clone(), self.dev.clone(), self.user);
                let tag = self.next_tag;
                self.next_tag += 1;
                let r = self.workers[t].run(move || {
                    let st = raw(s, user);
                    let p = a.allocate(size, st)?;
                    dev.write_tag(p.0, size.min(TAGGED) & !3, tag, st).unwrap();
                    Ok::<_, Error>(p)
                });
                let p = match r {
                    Ok(p) => p.0,
                    Err(e) => {
                        return Err(TestCaseError::fail(format!(
                            "allocate({size}, {s:?}): {e}\n{}",
                            self.ctx()
                        )));
                    }
                };
                let b = Block { ptr: p, size, owner: t, s, tag };
                self.note(format!("-> {p:#x}"));
                prop_assert!(p % 256 == 0, "{p:#x} is not 256-aligned");
                if let Some(o) = self.live.iter().find(|o| o.ptr < b.end() && b.ptr < o.end()) {
                    prop_assert!(false, "new block {b:?} overlaps live block {o:?}\n{}", self.ctx());
                }
                self.freed.retain(|f| !(f.ptr < b.end() && b.ptr < f.end()));
                self.live.push(b);
            }
            Op::Free { t, pick, s } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let b = self.live.swap_remove(pick % self.live.len());
                self.free_ok(b, t, s)?;
            }
            Op::BadFree { t, pick, s, bad } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let b = self.live[pick % self.live.len()];
                match bad {
                    Bad::WrongSize(n) => {
                        let size = wrong_size(b.size, n);
                        // A size that the free routes differently (registry or pool).
                        let crosses = (size <= LARGE_MAX) != (b.size <= LARGE_MAX);
                        let allowed = if crosses {
                            vec![SIZE_MISMATCH, InvalidFree::UnknownPointer]
                        } else {
                            vec![SIZE_MISMATCH]
                        };
                        let may_defer = b.arena() && size <= LARGE_MAX;
                        self.bad_free(t, b.ptr, size, s, allowed, may_defer.then_some((b.tag, false)))?;
                        if may_defer {
                            // Known limitation (README): until a deferred bad free is checked,
                            // a correct free of the same block is refused as a double free.
                            self.sync()?;
                        }
                    }
                    Bad::Interior(n) => {
                        let granules = b.bytes() / 256;
                        let off = if granules < 2 || n % 3 == 0 {
                            8 + 8 * (n % 31) as u64
                        } else {
                            256 * (1 + n % (granules - 1)) as u64
                        };
                        let may_defer = b.arena() && off % 256 == 0;
                        let defer = may_defer.then_some((b.tag, false));
                        // An aligned interior pointer of an arena block may meet a stale freed
                        // flag of an earlier block that began there (`superblock.rs`): it is
                        // refused at once, as a double free.
                        let allowed = if may_defer {
                            vec![InvalidFree::UnknownPointer, InvalidFree::DoubleFree]
                        } else {
                            vec![InvalidFree::UnknownPointer]
                        };
                        self.bad_free(t, b.ptr + off, 256, s, allowed, defer)?;
                        if may_defer {
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
                self.bad_free(t, b.ptr, b.size, s, allowed, (b.size <= LARGE_MAX).then_some((b.tag, true)))?;
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
        }
        Ok(())
    }

    /// Every thread flushed, the device idle, parked frees given back (`trim(true)`: remote
    /// frees on user streams that a flush could not fence wait parked for a synchronise, see
    /// `outbox.rs`), every thread flushed again: every remote free has reached its owner and
    /// been checked. Then the counts must match the model.
    fn sync(&mut self) -> Outcome {
        for round in 0..2 {
            for w in &self.workers {
                let a = self.a.clone();
                w.run(move || a.flush()).map_err(|e| TestCaseError::fail(format!("flush: {e}")))?;
            }
            self.dev.synchronize();
            if round == 0 {
                self.a.trim(true).map_err(|e| TestCaseError::fail(format!("trim: {e}")))?;
            }
        }
        self.a.check_invariants();
        let s = self.a.stats();
        let live: u64 = self.live.iter().map(|b| b.bytes() as u64).sum();
        prop_assert_eq!(s.live_bytes, live, "live bytes\n{}", self.ctx());
        prop_assert_eq!(s.invalid_frees, self.invalid, "invalid frees counted\n{}", self.ctx());
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
        for w in &mut self.workers {
            let a = self.a.clone();
            w.run(move || a.release_thread()).map_err(|e| TestCaseError::fail(format!("release: {e}")))?;
            w.join();
        }
        self.a.release_thread().unwrap();
        self.dev.synchronize();
        self.a.check_invariants();
        let s = self.a.stats();
        prop_assert_eq!(s.live_bytes, 0, "{:?}", s);
        // User-stream arenas given up while holding memory wait, parked, for a device
        // synchronise (`trim(true)` below): before it, they are all that is handed out.
        let (parked, frees) = (self.a.parked_bytes(), self.a.parked_free_bytes());
        let used = self.a.pool_in_use();
        prop_assert!(
            parked <= used && used <= parked + frees,
            "still handed out: {:?}",
            self.a.pool_used_ranges()
        );
        prop_assert_eq!((s.arena_held_bytes, s.arenas), (parked as u64, 0), "{:?}", s);
        prop_assert_eq!(self.a.take_deferred_error(), None);
        self.a.trim(true).unwrap();
        let s = self.a.stats();
        prop_assert_eq!(
            (s.reserved_bytes, s.arena_held_bytes, self.a.parked_bytes(), self.a.parked_free_bytes()),
            (0, 0, 0, 0)
        );
        prop_assert_eq!(self.dev.stale_handle_calls(), 0, "a destroyed stream's handle reached the device");
        let v = self.dev.violations();
        prop_assert!(v.is_empty(), "race checker: {:?}\n{}", &v[..v.len().min(3)], self.ctx());
        prop_assert_eq!(self.dev.tag_errors(), 0, "tags overwritten\n{}", self.ctx());
        Ok(())
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
    /// owner meets a free block or a new one there: any refusal is then right. (Accepting it
    /// would be wrong, and shows as a miscount of invalid frees and live bytes.)
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

/// A size whose block differs from `size`'s.
fn wrong_size(size: usize, n: usize) -> usize {
    let rounded = block_bytes(size, SMALL_MAX).unwrap();
    let candidates = [size * 2 + 300, size / 3, size + 70_000, rounded + 1 + n % 4096, 1 + n % 200_000];
    let start = n % candidates.len();
    (0..candidates.len())
        .map(|i| candidates[(start + i) % candidates.len()])
        .find(|&c| c > 0 && block_bytes(c, SMALL_MAX) != Some(rounded))
        .expect("one candidate differs")
}

proptest! {
    #![proptest_config(ProptestConfig {
        // 64 by default (a few seconds); PROPTEST_CASES=N runs more.
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        max_shrink_iters: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_match_the_model(
        ops in prop::collection::vec(op_strategy(), 1..200),
        seed in any::<u64>(),
        max_delay_us in 0u64..40,
    ) {
        let mut h = Harness::new(seed, max_delay_us);
        for op in &ops {
            h.step(op)?;
        }
        h.finish()?;
    }
}
