//! Thirty-second session, helper-52: adversarial tests of `Allocator::deallocate_used_on` in the
//! normal (non-pass-through) mode, after its change to validate a free before it orders the
//! declared streams (`Slot::free`, `Slot::free_arena_block`, `order_for_free`).
//!
//! Covered: bad frees of every kind, on blocks of every path (small, arena large, pool) owned
//! by this thread's per-thread, legacy and user-stream arenas and by another thread, answer as
//! the same free without declared streams and record no event, make no stream wait (declared
//! streams held by a gate, captured, or destroyed); a failed ordering of a remote free (each
//! call failed in turn) leaves the block to its owner, who frees it; races inside the ordering
//! (a hook in the device runs while the free orders): the owner's exit and a trim, a reclaimer
//! holding the owner's arena, a racing free of the same block; many distinct declared streams;
//! a running trace; a free on the legacy stream while a capture is announced.
//!
//! `Hooky` below (this file's device) forwards to the simulated device, counts calls, the
//! records and waits that succeeded, can fail the call with a chosen index, and runs a hook
//! armed for one (call, stream, thread) once, before the call; the hook can fail that call.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use common::Worker;
use cuarena::{Allocator, Device, DeviceAddr, Error, Event, InvalidFree, Stream, StreamKey};
use cuarena_testkit::{HostDevice, Interpose, Interposed, assert_all_returned};

/// A hook run once before a chosen call; true fails that call.
type Hook = Box<dyn FnOnce() -> bool + Send>;

struct Hooky {
    base: Arc<dyn Device>,
    calls: AtomicU64,
    fail_at: AtomicU64,
    records: AtomicU64,
    waits: AtomicU64,
    armed: Mutex<Vec<(&'static str, Stream, ThreadId, Hook)>>,
}

impl Hooky {
    fn new(sim: &HostDevice) -> Arc<Interposed<Hooky>> {
        Arc::new(Interposed(Hooky {
            base: Arc::new(sim.clone()),
            calls: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            records: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            armed: Mutex::new(Vec::new()),
        }))
    }
    /// Runs `hook` once, before the next `what` ("record", "wait", "key", "capturing") on
    /// `stream` made by thread `who`.
    fn arm(
        &self,
        what: &'static str,
        stream: Stream,
        who: ThreadId,
        hook: impl FnOnce() -> bool + Send + 'static,
    ) {
        self.armed.lock().unwrap().push((what, stream, who, Box::new(hook)));
    }
    fn fire(&self, what: &'static str, stream: Stream) -> cuarena::Result<()> {
        let me = std::thread::current().id();
        let hook = {
            let mut v = self.armed.lock().unwrap();
            let i = v.iter().position(|(w, s, t, _)| *w == what && *s == stream && *t == me);
            i.map(|i| v.remove(i).3)
        };
        if let Some(h) = hook
            && h()
        {
            return Err(Error::Driver { call: what, code: 999 });
        }
        Ok(())
    }
    fn tick(&self, what: &'static str) -> cuarena::Result<()> {
        let n = self.calls.fetch_add(1, SeqCst);
        if self.fail_at.load(SeqCst) == n {
            return Err(Error::Driver { call: what, code: 999 });
        }
        Ok(())
    }
    fn calls(&self) -> u64 {
        self.calls.load(SeqCst)
    }
    /// (records, waits) that succeeded so far.
    fn rw(&self) -> (u64, u64) {
        (self.records.load(SeqCst), self.waits.load(SeqCst))
    }
}

impl Interpose for Hooky {
    fn base(&self) -> &dyn Device {
        &*self.base
    }
    fn reserve(&self, bytes: usize) -> cuarena::Result<Option<u64>> {
        self.tick("reserve")?;
        self.base.reserve(bytes)
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> cuarena::Result<()> {
        self.tick("release")?;
        // SAFETY: forwarded from the caller.
        unsafe { self.base.release(ptr, bytes) }
    }
    fn alloc_async(&self, bytes: usize, stream: Stream) -> cuarena::Result<Option<u64>> {
        self.tick("alloc_async")?;
        self.base.alloc_async(bytes, stream)
    }
    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> cuarena::Result<()> {
        self.tick("free_async")?;
        // SAFETY: forwarded from the caller.
        unsafe { self.base.free_async(ptr, bytes, stream) }
    }
    fn create_event(&self) -> cuarena::Result<Event> {
        self.tick("create_event")?;
        self.base.create_event()
    }
    fn destroy_event(&self, event: Event) {
        self.calls.fetch_add(1, SeqCst);
        self.base.destroy_event(event)
    }
    fn record_event(&self, event: Event, stream: Stream) -> cuarena::Result<()> {
        self.fire("record", stream)?;
        self.tick("record_event")?;
        let r = self.base.record_event(event, stream);
        if r.is_ok() {
            self.records.fetch_add(1, SeqCst);
        }
        r
    }
    fn query_event(&self, event: Event) -> cuarena::Result<bool> {
        self.tick("query_event")?;
        self.base.query_event(event)
    }
    fn sync_event(&self, event: Event) -> cuarena::Result<()> {
        self.tick("sync_event")?;
        self.base.sync_event(event)
    }
    fn synchronize(&self) -> cuarena::Result<()> {
        self.tick("synchronize")?;
        self.base.synchronize()
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> cuarena::Result<()> {
        self.fire("wait", stream)?;
        self.tick("stream_wait_event")?;
        let r = self.base.stream_wait_event(stream, event);
        if r.is_ok() {
            self.waits.fetch_add(1, SeqCst);
        }
        r
    }
    fn stream_key(&self, stream: Stream) -> cuarena::Result<StreamKey> {
        self.fire("key", stream)?;
        self.tick("stream_key")?;
        self.base.stream_key(stream)
    }
    fn stream_capturing(&self, stream: Stream) -> cuarena::Result<bool> {
        self.fire("capturing", stream)?;
        self.tick("stream_capturing")?;
        self.base.stream_capturing(stream)
    }
}

/// Small blocks up to 64 KiB, arena large blocks up to 1 MiB, pool blocks above.
fn normal(dev: &Arc<Interposed<Hooky>>) -> Allocator {
    Allocator::new(dev.clone(), common::small().large_max(1 << 20).build().unwrap()).unwrap()
}

const SIZES: [usize; 3] = [4096, 300 << 10, 2 << 20];
const PT: Stream = Stream::PER_THREAD;
const LEGACY: Stream = Stream::LEGACY;

fn me() -> ThreadId {
    std::thread::current().id()
}

/// Makes later work on `to` wait for the work queued so far on `from`.
fn order(sim: &HostDevice, from: Stream, to: Stream) {
    let e = Device::create_event(sim).unwrap();
    Device::record_event(sim, e, from).unwrap();
    Device::stream_wait_event(sim, to, e).unwrap();
    Device::destroy_event(sim, e);
}

/// (invalid_frees, live_bytes)
fn il(a: &Allocator) -> (u64, u64) {
    let s = a.stats();
    (s.invalid_frees, s.live_bytes)
}

fn is_invalid(r: &cuarena::Result<()>) -> bool {
    matches!(r, Err(Error::InvalidFree { .. }))
}

fn is_double(r: &cuarena::Result<()>) -> bool {
    matches!(r, Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
}

/// Allocates `size` on `home` on the worker's thread (`Some`) or this one.
fn alloc_on(a: &Allocator, w: Option<&Worker>, size: usize, home: Stream) -> DeviceAddr {
    match w {
        Some(w) => w.run(move |a| a.allocate(size, home).unwrap()),
        None => a.allocate(size, home).unwrap(),
    }
}

/// Reuses blocks of `size` on several streams and threads, tagging them, while the caller's
/// held work still runs: every reuse must wait for it (the tags are checked after).
fn reuse_everywhere(a: &Allocator, sim: &HostDevice, size: usize, streams: &[Stream]) {
    for &s in streams {
        for _ in 0..3 {
            let q = a.allocate(size, s).unwrap();
            sim.write_tag(q.0, size, 0xbad, s).unwrap();
            a.deallocate(q, size, s).unwrap();
        }
    }
    a.flush().unwrap();
    let hs: Vec<_> = (0..2)
        .map(|t| {
            let (a, sim) = (a.clone(), sim.clone());
            std::thread::spawn(move || {
                let s = [PT, LEGACY][t];
                for _ in 0..4 {
                    let q = a.allocate(size, s).unwrap();
                    sim.write_tag(q.0, size, 0xbad1, s).unwrap();
                    a.deallocate(q, size, s).unwrap();
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Bad frees answer as plain ones, and order nothing.

/// Every kind of bad free, of blocks of every path owned by each of this thread's arenas and
/// by another thread, on every kind of stream: declared used on a held stream (an ordering
/// would record and wait), it gets the very error the same free without declared streams
/// gets, is counted once, changes no live byte, records no event and makes no stream wait,
/// and makes no more driver calls than the plain one.
#[test]
fn bad_frees_answer_as_plain_frees_and_order_nothing() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let (u1, u2, d) = (sim.create_stream(), sim.create_stream(), sim.create_stream());
    let w = Worker::new(&a);
    let mut bad_frees = 0u64;
    for size in SIZES {
        for (owner, home) in [("pt", PT), ("legacy", LEGACY), ("user", u1), ("worker", PT)] {
            for stream in [PT, LEGACY, u1, u2] {
                let wk = (owner == "worker").then_some(&w);
                let p = alloc_on(&a, wk, size, home);
                let keep = alloc_on(&a, wk, size, home);
                let gate = sim.gate(d).unwrap();
                sim.write_tag(p.0, 256, 7, d).unwrap();
                // Another thread's arena block: a wrong size or a granule-aligned interior
                // pointer is accepted for its owner to check (README), so left out.
                let remote_arena = wk.is_some() && size <= 1 << 20;
                let mut bad =
                    vec![(DeviceAddr(p.0 + 16), size), (DeviceAddr(0x10), 64), (DeviceAddr(0), 64), (p, 0)];
                if !remote_arena {
                    bad.push((DeviceAddr(p.0 + 256), size));
                    bad.push((p, size + (64 << 10)));
                }
                let what = |q: DeviceAddr, n: usize| {
                    format!("size {size} owner {owner} on {stream:?}: ({q:?}, {n})")
                };
                let used = [d, LEGACY, u2, PT];
                let check = |q: DeviceAddr, n: usize| {
                    let c0 = dev.calls();
                    let plain = a.deallocate(q, n, stream);
                    let plain_calls = dev.calls() - c0;
                    assert!(is_invalid(&plain), "{}: the plain free answered {plain:?}", what(q, n));
                    let (c0, rw0, (i0, l0)) = (dev.calls(), dev.rw(), il(&a));
                    let got = a.deallocate_used_on(q, n, stream, &used);
                    let (c1, rw1, (i1, l1)) = (dev.calls(), dev.rw(), il(&a));
                    assert_eq!(got, plain, "{}: declared vs plain", what(q, n));
                    assert_eq!((i1 - i0, l1), (1, l0), "{}: (counted, live bytes)", what(q, n));
                    assert_eq!(rw1, rw0, "{}: recorded or waited", what(q, n));
                    assert!(c1 - c0 <= plain_calls, "{}: {} calls, plain {plain_calls}", what(q, n), c1 - c0);
                };
                for &(q, n) in &bad {
                    check(q, n);
                }
                a.deallocate_used_on(p, size, stream, &[d]).unwrap();
                // The double free, while the declared work is still held.
                check(p, size);
                bad_frees += 2 * (bad.len() as u64 + 1);
                match wk {
                    Some(w) => w.run(move |a| a.deallocate(keep, size, home).unwrap()),
                    None => a.deallocate(keep, size, home).unwrap(),
                }
                gate.open();
            }
        }
    }
    w.exit();
    assert_all_returned(&a, Some(&sim), bad_frees);
}

/// A bad free declared used on a stream being captured, or on a destroyed stream, is the
/// invalid free it is, as without declared streams: no call reaches the destroyed handle, no
/// event is recorded or waited on the captured stream (its capture ends intact). A good free
/// so declared fails and frees nothing; the block is freed afterwards.
#[test]
fn bad_frees_declared_on_captured_or_destroyed_streams_are_invalid_and_touch_nothing() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let (u1, c, gone) = (sim.create_stream(), sim.create_stream(), sim.create_stream());
    let w = Worker::new(&a);
    sim.destroy_stream(gone).unwrap(); // no stream is created after: the handle stays stale
    sim.begin_capture(c).unwrap();
    let mut bad_frees = 0u64;
    for size in SIZES {
        for (owner, home) in [("pt", PT), ("legacy", LEGACY), ("user", u1), ("worker", PT)] {
            for stream in [PT, LEGACY, u1] {
                let wk = (owner == "worker").then_some(&w);
                let p = alloc_on(&a, wk, size, home);
                let remote_arena = wk.is_some() && size <= 1 << 20;
                for bad_stream in [c, gone] {
                    let used = [LEGACY, bad_stream];
                    let what = format!("size {size} owner {owner} on {stream:?} declared {bad_stream:?}");
                    let mut bad = vec![(DeviceAddr(p.0 + 16), size), (DeviceAddr(0x10), 64), (p, 0)];
                    if !remote_arena {
                        bad.push((DeviceAddr(p.0 + 256), size));
                        bad.push((p, size + (64 << 10)));
                    }
                    for (q, n) in bad {
                        let plain = a.deallocate(q, n, stream);
                        assert!(is_invalid(&plain), "{what}: ({q:?}, {n}) plain {plain:?}");
                        let (rw0, (i0, l0)) = (dev.rw(), il(&a));
                        let got = a.deallocate_used_on(q, n, stream, &used);
                        assert_eq!(got, plain, "{what}: ({q:?}, {n})");
                        assert_eq!((dev.rw(), il(&a)), (rw0, (i0 + 1, l0)), "{what}: ({q:?}, {n})");
                        assert_eq!(
                            sim.stale_handle_calls(),
                            0,
                            "{what}: ({q:?}, {n}) reached the destroyed handle"
                        );
                        bad_frees += 2;
                    }
                    // A good free: refused, nothing freed.
                    let l0 = il(&a).1;
                    let r = a.deallocate_used_on(p, size, stream, &used);
                    sim.take_stale_handle_calls();
                    assert!(r.is_err() && !is_invalid(&r), "{what}: a good free answered {r:?}");
                    if bad_stream == c {
                        assert!(matches!(r, Err(Error::StreamCapturing { .. })), "{what}: {r:?}");
                    }
                    assert_eq!(il(&a).1, l0, "{what}: the refused free changed the live bytes");
                }
                a.deallocate_used_on(p, size, stream, &[LEGACY]).unwrap();
                let plain = a.deallocate(p, size, stream);
                assert!(is_double(&plain), "size {size} owner {owner} on {stream:?}: {plain:?}");
                let got = a.deallocate_used_on(p, size, stream, &[c, gone]);
                assert_eq!(got, plain, "size {size} owner {owner} on {stream:?}: double free");
                assert_eq!(sim.stale_handle_calls(), 0);
                bad_frees += 2;
            }
        }
    }
    sim.end_capture(c).expect("the capture was broken");
    w.exit();
    assert_all_returned(&a, Some(&sim), bad_frees);
}

// ---------------------------------------------------------------------------------------------
// 2. A failed ordering leaves the block live, to its owner.

/// Another thread's block (arena small, arena large, pool; on its per-thread stream or a user
/// stream) freed here on every kind of stream, declared used on a held stream, with each of
/// the free's driver calls failed in turn: each failure changes no live byte and leaves the
/// block to its owner, whose plain free of it then succeeds (a freed flag left set would
/// refuse it as a double free). The free that succeeds is not reused under the held work.
#[test]
fn a_remote_declared_free_failed_at_any_call_leaves_the_block_to_its_owner() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let (d, u, u2) = (sim.create_stream(), sim.create_stream(), sim.create_stream());
    let w = Worker::new(&a);
    let mut bad_frees = 0;
    for size in SIZES {
        for home in [PT, u] {
            for stream in [PT, LEGACY, u2] {
                let mut n = 0;
                loop {
                    let what = format!("size {size} home {home:?} freed on {stream:?}, call {n} failed");
                    let p = alloc_on(&a, Some(&w), size, home);
                    let gate = sim.gate(d).unwrap();
                    sim.write_tag(p.0, size, 0x51, d).unwrap();
                    let l0 = il(&a).1;
                    let c0 = dev.calls();
                    dev.fail_at.store(c0 + n, SeqCst);
                    let r = a.deallocate_used_on(p, size, stream, &[d, LEGACY, stream]);
                    dev.fail_at.store(u64::MAX, SeqCst);
                    match r {
                        Ok(()) => {
                            assert!(dev.calls() - c0 <= n, "{what}: the chosen call was made, yet Ok");
                            let r = w.run(move |a| a.deallocate(p, size, home));
                            assert!(is_double(&r), "{what}: the owner's second free answered {r:?}");
                            bad_frees += 1;
                            reuse_everywhere(&a, &sim, size, &[PT, LEGACY, u2]);
                            gate.open();
                            sim.synchronize();
                            assert_eq!(sim.tag_errors(), 0, "{what}: reused under the declared work");
                            break;
                        }
                        Err(Error::Driver { code: 999, .. }) => {
                            assert_eq!(il(&a).1, l0, "{what}: the failed free changed the live bytes");
                            gate.open();
                            let r = w.run(move |a| a.deallocate(p, size, home));
                            assert_eq!(r, Ok(()), "{what}: the owner's free after the failed one");
                            assert_eq!(
                                il(&a).1,
                                l0 - size as u64,
                                "{what}: live bytes after the owner's free"
                            );
                        }
                        Err(e) => panic!("{what}: {e:?}"),
                    }
                    n += 1;
                    assert!(n < 100, "{what}: never succeeded");
                }
            }
        }
    }
    w.exit();
    assert_all_returned(&a, Some(&sim), bad_frees);
}

// ---------------------------------------------------------------------------------------------
// 3. Races inside the ordering.

/// While a remote declared free orders (a hook before its record on the declared stream), the
/// block's owner exits and a trim runs on a third thread. With the record then failed, the
/// free fails, changes no live byte, and the block is freed afterwards (once: a second free is
/// a double free); with it let through, the block is not reused under the declared work.
#[test]
fn the_owner_exits_and_a_trim_runs_while_a_remote_declared_free_orders() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let (d, u, u2) = (sim.create_stream(), sim.create_stream(), sim.create_stream());
    let mut bad_frees = 0;
    for size in SIZES {
        for home in [PT, u, LEGACY] {
            for stream in [PT, LEGACY, u2] {
                for fail in [true, false] {
                    let what = format!("size {size} home {home:?} on {stream:?} fail {fail}");
                    let w = Worker::new(&a);
                    let p = alloc_on(&a, Some(&w), size, home);
                    let other = alloc_on(&a, Some(&w), size, home); // live through the owner's exit
                    let gate = sim.gate(d).unwrap();
                    sim.hold_and_check(p.0, size, 0x77, Duration::from_micros(200), d).unwrap();
                    let w = Arc::new(Mutex::new(Some(w)));
                    let (w2, a2) = (w.clone(), a.clone());
                    let hook = move || {
                        w2.lock().unwrap().take().unwrap().exit();
                        std::thread::spawn(move || {
                            a2.trim(false).unwrap();
                            a2.release_thread().unwrap();
                        })
                        .join()
                        .unwrap();
                        fail
                    };
                    let l0 = il(&a).1;
                    let (a3, dev3, used) = (a.clone(), dev.clone(), [d, LEGACY]);
                    let r = common::within(20, move || {
                        dev3.arm("record", d, me(), hook);
                        let r = a3.deallocate_used_on(p, size, stream, &used);
                        a3.release_thread().unwrap(); // this thread ends here
                        r
                    });
                    assert!(w.lock().unwrap().is_none(), "{what}: the hook did not run");
                    if fail {
                        assert!(matches!(r, Err(Error::Driver { code: 999, .. })), "{what}: {r:?}");
                        assert_eq!(il(&a).1, l0, "{what}: the failed free changed the live bytes");
                        a.deallocate_used_on(p, size, stream, &[d]).unwrap();
                    } else {
                        assert_eq!(r, Ok(()), "{what}");
                    }
                    let r = a.deallocate(p, size, stream);
                    assert!(is_double(&r), "{what}: second free {r:?}");
                    bad_frees += 1;
                    a.deallocate(other, size, LEGACY).unwrap();
                    reuse_everywhere(&a, &sim, size, &[PT, LEGACY, u2]);
                    a.release_thread().unwrap();
                    gate.open();
                    sim.synchronize();
                    assert_eq!(sim.tag_errors(), 0, "{what}: reused under the declared work");
                    assert_eq!(sim.violations(), Vec::<String>::new(), "{what}");
                }
            }
        }
    }
    assert_all_returned(&a, Some(&sim), bad_frees);
}

/// A reclaimer (a trim on a third thread) holds an idle owner's arena (a hook before its fence
/// on the legacy stream), and the owner then frees its own block declared used on a held
/// stream: the free goes the remote way (checked: `cross_stream_frees`). Once with its
/// ordering failed (the block stays live and is freed again after), once let through (no
/// reuse under the declared work).
#[test]
fn a_declared_free_by_the_owner_while_a_reclaimer_holds_its_arena() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let d = sim.create_stream();
    let mut bad_frees = 0;
    for size in [4096usize, 300 << 10] {
        for stream in [PT, LEGACY] {
            for fail in [true, false] {
                let what = format!("size {size} on {stream:?} fail {fail}");
                let w = Arc::new(Worker::new(&a));
                let wid = w.run(|_| me());
                // Dense superblocks around the block (the return rule would dissolve a sparse
                // one, leaving the block to the pool), then empty ones for the reclaimer.
                let keep: Vec<DeviceAddr> =
                    (0..(8 << 20) / size).map(|_| alloc_on(&a, Some(&w), size, PT)).collect();
                let p = keep[keep.len() / 2];
                let fill: Vec<DeviceAddr> =
                    (0..(16 << 20) / size).map(|_| alloc_on(&a, Some(&w), size, PT)).collect();
                w.run(move |a| {
                    for q in fill.into_iter().rev() {
                        a.deallocate(q, size, PT).unwrap();
                    }
                });
                assert!(common::in_arena(&a, p), "{what}: the block left its arena before the test");
                let gate = sim.gate(d).unwrap();
                sim.hold_and_check(p.0, size, 0x99, Duration::from_micros(200), d).unwrap();
                // No arena of this thread for the reclaimer to hold instead.
                a.release_thread().unwrap();
                let x0 = a.stats().cross_stream_frees;
                let result = Arc::new(Mutex::new(None));
                let ran = Arc::new(AtomicBool::new(false));
                let (a2, w2, dev2, result2, ran2) =
                    (a.clone(), w.clone(), dev.clone(), result.clone(), ran.clone());
                let l0 = il(&a).1;
                common::within(20, move || {
                    std::thread::spawn(move || {
                        let (w3, dev3) = (w2.clone(), dev2.clone());
                        dev2.arm("record", LEGACY, me(), move || {
                            ran2.store(true, SeqCst);
                            if fail {
                                dev3.arm("record", d, wid, || true);
                            }
                            let r = w3.run(move |a| a.deallocate_used_on(p, size, stream, &[d, LEGACY]));
                            *result2.lock().unwrap() = Some(r);
                            false
                        });
                        a2.trim(false).unwrap();
                        a2.release_thread().unwrap();
                    })
                    .join()
                    .unwrap()
                });
                assert!(ran.load(SeqCst), "{what}: no reclaimer recorded on the legacy stream");
                let r = result.lock().unwrap().take().unwrap();
                if fail {
                    assert!(matches!(r, Err(Error::Driver { code: 999, .. })), "{what}: {r:?}");
                    assert_eq!(il(&a).1, l0, "{what}: the failed free changed the live bytes");
                    w.run(move |a| a.deallocate_used_on(p, size, stream, &[d])).unwrap();
                } else {
                    assert_eq!(r, Ok(()), "{what}");
                    // The owner's free went the remote way (its arena was held).
                    w.run(|a| a.flush().unwrap());
                    assert_eq!(a.stats().cross_stream_frees - x0, 1, "{what}: not the remote way");
                }
                let r = w.run(move |a| a.deallocate(p, size, stream));
                assert!(is_double(&r), "{what}: second free {r:?}");
                bad_frees += 1;
                w.run(|a| a.flush().unwrap());
                reuse_everywhere(&a, &sim, size, &[PT, LEGACY]);
                w.run(move |a| {
                    for _ in 0..3 {
                        let q = a.allocate(size, PT).unwrap();
                        a.deallocate(q, size, PT).unwrap();
                    }
                });
                let rest: Vec<DeviceAddr> = keep.into_iter().filter(|&q| q != p).collect();
                w.run(move |a| {
                    for q in rest {
                        a.deallocate(q, size, PT).unwrap();
                    }
                });
                Arc::into_inner(w).unwrap().exit();
                gate.open();
                sim.synchronize();
                assert_eq!(sim.tag_errors(), 0, "{what}: reused under the declared work");
            }
        }
    }
    assert_all_returned(&a, Some(&sim), bad_frees);
}

/// Two frees of one block race: a declared free orders (hook before its record on the
/// declared stream) while a plain free of the same block is made on another thread, and the
/// declared free's ordering then fails or goes on. Whatever the outcome, at most one free is
/// accepted (none only if the declared one failed, the block then still live and freed after),
/// the live bytes drop by the block once, and every refusal is counted.
#[test]
fn a_free_racing_a_declared_free_inside_its_ordering_is_taken_at_most_once() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let (d, u, u2) = (sim.create_stream(), sim.create_stream(), sim.create_stream());
    let mut bad_frees = 0;
    for size in SIZES {
        for home in [PT, u, LEGACY] {
            for stream in [home, PT, u2] {
                for fail in [true, false] {
                    let what = format!("size {size} home {home:?} on {stream:?} fail {fail}");
                    let p = a.allocate(size, home).unwrap();
                    let l0 = il(&a).1;
                    let (a2, racer) = (a.clone(), Arc::new(Mutex::new(None)));
                    let racer2 = racer.clone();
                    dev.arm("record", d, me(), move || {
                        let r = std::thread::spawn(move || {
                            let r = a2.deallocate(p, size, LEGACY);
                            a2.release_thread().unwrap();
                            r
                        })
                        .join()
                        .unwrap();
                        *racer2.lock().unwrap() = Some(r);
                        fail
                    });
                    let r = a.deallocate_used_on(p, size, stream, &[d]);
                    let other = racer.lock().unwrap().take().expect("the hook did not run");
                    let accepted = [&r, &other].iter().filter(|r| r.is_ok()).count();
                    bad_frees += [&r, &other].iter().filter(|r| is_invalid(r)).count() as u64;
                    if fail {
                        assert!(matches!(r, Err(Error::Driver { code: 999, .. })), "{what}: {r:?}");
                    }
                    if accepted == 0 {
                        // Neither taken (the racer refused while the declared free held the
                        // block, the declared free then failed): the block is still live.
                        assert!(fail, "{what}: both refused: {r:?} {other:?}");
                        assert_eq!(il(&a).1, l0, "{what}");
                        a.deallocate(p, size, stream).unwrap();
                    } else {
                        assert_eq!(accepted, 1, "{what}: both accepted: {r:?} {other:?}");
                    }
                    a.flush().unwrap();
                    assert_eq!(il(&a).1, l0 - size as u64, "{what}: live bytes");
                }
            }
        }
    }
    assert_all_returned(&a, Some(&sim), bad_frees);
}

// ---------------------------------------------------------------------------------------------
// 4. Many declared streams; a trace.

/// A block used on 16 distinct held streams (and freed on one of them, or another stream,
/// listed twice) is not reused anywhere before every one of them has finished; the gates are
/// opened in turn, the last one last.
#[test]
fn many_distinct_declared_streams_are_all_ordered() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let held: Vec<Stream> = (0..16).map(|_| sim.create_stream()).collect();
    let u = sim.create_stream();
    let w = Worker::new(&a);
    for size in SIZES {
        for (owner, home) in [("pt", PT), ("legacy", LEGACY), ("user", u), ("worker", PT)] {
            for stream in [PT, LEGACY, u, held[5]] {
                let wk = (owner == "worker").then_some(&w);
                let p = alloc_on(&a, wk, size, home);
                let tag = 0x100 + size as u32;
                sim.write_tag(p.0, 4096, tag, LEGACY).unwrap();
                sim.synchronize();
                let gates: Vec<_> = held.iter().map(|&s| sim.gate(s).unwrap()).collect();
                // Each held stream reads its own slice (reads of one byte by two streams are
                // a race to the simulator's checker).
                for (i, &s) in held.iter().enumerate() {
                    sim.check_tag(p.0 + 256 * i as u64, 256, tag, s).unwrap();
                }
                let mut used: Vec<Stream> = held.iter().rev().copied().collect();
                used.extend([stream, stream, held[0]]);
                a.deallocate_used_on(p, size, stream, &used).unwrap();
                reuse_everywhere(&a, &sim, size, &[PT, LEGACY, u]);
                for g in gates {
                    g.open();
                    std::thread::sleep(Duration::from_micros(50));
                }
                sim.synchronize();
                assert_eq!(sim.tag_errors(), 0, "size {size} owner {owner} on {stream:?}: reused early");
            }
        }
    }
    w.exit();
    assert_all_returned(&a, Some(&sim), 0);
}

/// With a trace running: bad frees declared used on a held stream answer as plain ones and
/// order nothing; a good free declared on a destroyed stream fails and frees nothing, and the
/// block is then freed and not reused under the declared work.
#[test]
fn traced_declared_frees_validate_first_and_roll_back() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let dir = std::env::temp_dir().join(format!("cuarena-s32-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("declared.trace");
    a.start_trace(&path).unwrap();
    let (d, u) = (sim.create_stream(), sim.create_stream());
    let gone = sim.create_stream();
    sim.destroy_stream(gone).unwrap();
    let mut bad_frees = 0;
    for size in SIZES {
        for home in [PT, LEGACY, u] {
            let p = a.allocate(size, home).unwrap();
            let gate = sim.gate(d).unwrap();
            order(&sim, home, d);
            sim.hold_and_check(p.0, size, 0x33, Duration::from_micros(100), d).unwrap();
            for (q, n) in
                [(DeviceAddr(p.0 + 256), size), (p, size + (64 << 10)), (p, 0), (DeviceAddr(0x10), 64)]
            {
                let plain = a.deallocate(q, n, home);
                let (rw0, i0) = (dev.rw(), il(&a).0);
                let got = a.deallocate_used_on(q, n, home, &[d, gone]);
                assert!(is_invalid(&plain), "size {size} on {home:?}: ({q:?}, {n}) {plain:?}");
                assert_eq!(got, plain, "size {size} on {home:?}: ({q:?}, {n})");
                assert_eq!((dev.rw(), il(&a).0), (rw0, i0 + 1), "size {size} on {home:?}: ({q:?}, {n})");
                assert_eq!(sim.stale_handle_calls(), 0);
                bad_frees += 2;
            }
            let l0 = il(&a).1;
            let r = a.deallocate_used_on(p, size, home, &[d, gone]);
            sim.take_stale_handle_calls();
            assert!(r.is_err() && !is_invalid(&r), "size {size} on {home:?}: {r:?}");
            assert_eq!(il(&a).1, l0);
            a.deallocate_used_on(p, size, home, &[d]).unwrap();
            reuse_everywhere(&a, &sim, size, &[PT, LEGACY, u]);
            gate.open();
            sim.synchronize();
            assert_eq!(sim.tag_errors(), 0, "size {size} on {home:?}: reused under the declared work");
        }
    }
    let summary = a.stop_trace().unwrap();
    assert!(summary.records > 0);
    let _ = std::fs::remove_dir_all(&dir);
    assert_all_returned(&a, Some(&sim), bad_frees);
}

// ---------------------------------------------------------------------------------------------
// 5. A free on the legacy stream while a capture is announced.

/// While a capture is announced (`graph_capture_begin`), a free on the legacy stream declared
/// used on a user stream answers the same whichever arena or path the block belongs to (the
/// call is itself a legacy-stream operation, `Counted::on_stream`, as a plain free on the
/// legacy stream is, which is accepted), and a refused one leaves the block live: freed once
/// the announcement has ended, and then only once.
///
/// Failed (helper-52) on the first version of the change: the legacy arena's own blocks
/// (small and arena large) were refused with `StreamCapturing`, every other block accepted.
/// Now every branch orders as `order_for_free` says (its calls are not the caller's own use of
/// the legacy stream), so all are refused alike and freed after the announcement.
#[test]
fn declared_frees_on_the_legacy_stream_during_an_announced_capture_answer_alike() {
    let sim = common::host(0);
    let dev = Hooky::new(&sim);
    let a = normal(&dev);
    let u = sim.create_stream();
    let mut answers = Vec::new();
    let mut bad_frees = 0;
    for size in SIZES {
        for home in [LEGACY, PT, u] {
            let p = a.allocate(size, home).unwrap();
            let q = a.allocate(size, home).unwrap();
            a.graph_capture_begin();
            let plain = a.deallocate(q, size, LEGACY);
            let l0 = il(&a).1;
            let declared = a.deallocate_used_on(p, size, LEGACY, &[u]);
            if declared.is_err() {
                assert_eq!(
                    il(&a).1,
                    l0,
                    "size {size} home {home:?}: the refused free changed the live bytes"
                );
            }
            a.graph_capture_end().unwrap();
            answers.push((size, home, plain.clone(), declared.clone()));
            if plain.is_err() {
                a.deallocate(q, size, LEGACY).unwrap();
            }
            if declared.is_err() {
                a.deallocate_used_on(p, size, LEGACY, &[u]).unwrap();
            }
            assert!(is_double(&a.deallocate(p, size, LEGACY)), "size {size} home {home:?}");
            bad_frees += 1;
        }
    }
    let first = answers[0].3.clone();
    let all: Vec<String> = answers.iter().map(|(n, h, _, d)| format!("{n} on {h:?}: {d:?}")).collect();
    for (size, home, plain, declared) in &answers {
        assert_eq!(plain, &Ok(()), "size {size} home {home:?}: the plain free on the legacy stream");
        assert_eq!(declared, &first, "size {size} home {home:?} answers unlike the others: {all:#?}");
        assert!(declared.is_ok() || matches!(declared, Err(Error::StreamCapturing { .. })), "{declared:?}");
    }
    assert_all_returned(&a, Some(&sim), bad_frees);
}
