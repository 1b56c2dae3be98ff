//! Session 19b: an attack on the *mends* of helper-18's graph-pool findings (commits `3dc3550`
//! and `099f58c`): fenced reuse of a free made outside a capture (`FreeAs::Stream`,
//! `Pool::take`, `graph_allocate`'s `ready`), no event on a capturing stream, the out-of-memory
//! retry outside a capture (`Slot::reclaim` + `trim(false)`), pass-through mode's shared cap and
//! trim, and the address-span hint (`GraphPools::may_hold`). On the simulated device.
//!
//! Tests marked `// WAS A DEFECT:` failed at `6787a61` (the mends under review) and say why;
//! each passes since `c652d04`, which landed during this review. The oracles: the race checker
//! (unordered overlapping work, and an event recorded or waited on a capturing stream, are
//! violations), tag checks (`hold_and_check` under a closed gate keeps the freeing stream's
//! work in flight for as long as the test needs), `stats()`, `check_invariants()`, a device
//! wrapper that counts device synchronises made while a capture is underway, and
//! `assert_all_returned`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use cuarena::{Allocator, Device, DeviceAddr, Error, Event, GraphPoolId, InvalidFree, Stream};
use cuarena_testkit::{HostDevice, Interpose, Interposed, StreamGate, assert_all_returned, host_allocator};

mod common;
use common::{Worker, host, rng, small, within};

const MIB: usize = 1 << 20;
const HOLD: Duration = Duration::from_millis(2);

fn assert_clean(dev: &HostDevice, what: &str) {
    let v = dev.violations();
    assert!(v.is_empty(), "{what}: {} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(dev.tag_errors(), 0, "{what}: tag errors");
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Which thread a step runs on: the test's, or a second one (its own per-thread stream).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Main,
    Other,
}

fn on<R: Send + 'static>(
    who: Who,
    a: &Allocator,
    w: &Worker,
    f: impl FnOnce(&Allocator) -> R + Send + 'static,
) -> R {
    match who {
        Who::Main => f(a),
        Who::Other => w.run(f),
    }
}

/// A simulated device that counts device synchronises made while a capture is underway (on any
/// stream, any thread): on CUDA, `cuCtxSynchronize` then fails and invalidates a capture begun
/// in the global mode (PyTorch's default), which is why PyTorch's allocator frees cached blocks
/// only when no capture is underway.
/// It can also run a step once, inside the next event query (to stop a thread there), and hand
/// out reservations `skew` bytes past the simulator's (2 MiB-aligned) ones.
struct Spy {
    sim: HostDevice,
    skew: u64,
    captures: AtomicUsize,
    syncs_in_capture: AtomicU64,
    on_query: Mutex<Option<Step>>,
}

type Step = Box<dyn FnOnce() + Send>;

impl Spy {
    fn new(sim: HostDevice) -> Arc<Interposed<Spy>> {
        Spy::skewed(sim, 0)
    }
    fn skewed(sim: HostDevice, skew: u64) -> Arc<Interposed<Spy>> {
        Arc::new(Interposed(Spy {
            sim,
            skew,
            captures: AtomicUsize::new(0),
            syncs_in_capture: AtomicU64::new(0),
            on_query: Mutex::new(None),
        }))
    }
    fn begin_capture(&self, s: Stream) {
        self.sim.begin_capture(s).unwrap();
        self.captures.fetch_add(1, Ordering::SeqCst);
    }
    fn end_capture(&self, s: Stream) {
        self.captures.fetch_sub(1, Ordering::SeqCst);
        self.sim.end_capture(s).unwrap();
    }
}

impl Interpose for Spy {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn reserve(&self, bytes: usize) -> cuarena::Result<Option<u64>> {
        Ok(self.sim.reserve(bytes + self.skew as usize)?.map(|p| p + self.skew))
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> cuarena::Result<()> {
        // SAFETY: the caller's `ptr` and `bytes` came from one `reserve` above, which reserved
        // `skew` bytes more from the simulator, starting `skew` bytes before; no work uses it.
        unsafe { self.sim.release(ptr - self.skew, bytes + self.skew as usize) }
    }
    fn query_event(&self, event: Event) -> cuarena::Result<bool> {
        let step = self.on_query.lock().unwrap().take();
        if let Some(step) = step {
            step();
        }
        self.sim.query_event(event)
    }
    fn synchronize(&self) -> cuarena::Result<()> {
        if self.captures.load(Ordering::SeqCst) > 0 {
            self.syncs_in_capture.fetch_add(1, Ordering::SeqCst);
        }
        Device::synchronize(&self.sim)
    }
}

// =============================================================================================
// Defects found at `6787a61` (each mended by `c652d04` meanwhile).

// WAS A DEFECT (mended by `c652d04`: `graph_capture_begin/end`, and no device synchronise while
// a capture is underway): `graph_allocate`'s out-of-memory retry outside a capture (`099f58c`)
// synchronised the device while *another* stream was being captured. The README justified the
// retry with "as PyTorch frees its cached blocks only when no capture is underway", but the
// test was only `key.is_some()` (this stream not captured): `Slot::reclaim(.., may_block)` ran
// `bury_zombies`, whose `cuCtxSynchronize` (with a retired pool parked) invalidates a capture on
// any other thread. Checked on the H200 (a PyTorch global-mode capture on one thread,
// relaxed-mode driver calls on another): `cuCtxSynchronize` fails (900) and the capture is
// invalidated; `cuMemAlloc`, `cuMemFree`, `cuEventQuery` and `cuEventSynchronize` of another
// stream's event leave it intact. So a `MemPool` used eagerly on one thread broke another's
// capture; the ordinary `allocate` out-of-memory path did the same. The capture is announced
// here as the PyTorch shim now does (`graph_capture_begin` as a route opens).
#[test]
fn a_pools_out_of_memory_retry_does_not_synchronise_while_another_stream_is_captured() {
    let spy = Spy::new(host(0));
    let a = Allocator::new(spy.clone(), small().max_bytes(32 * MIB).build().unwrap()).unwrap();
    let s = spy.sim.create_stream();
    // A retired pool's 20 MiB segment, parked for a synchronise.
    let gone = GraphPoolId(0x19b, 2);
    a.graph_pool_retain(gone);
    let p = a.graph_allocate(gone, 3 * MIB, s).unwrap();
    a.deallocate(p, 3 * MIB, s).unwrap();
    a.graph_pool_release(gone).unwrap();
    assert_eq!(a.graph_pool_bytes(), 20 << 20);
    // Another thread captures a stream of its own meanwhile.
    let c = spy.sim.create_stream();
    let (began_tx, began_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let spy2 = spy.clone();
    let a2 = a.clone();
    let capturer = std::thread::spawn(move || {
        a2.graph_capture_begin();
        spy2.begin_capture(c);
        began_tx.send(()).unwrap();
        done_rx.recv().unwrap();
        spy2.end_capture(c);
        a2.graph_capture_end().unwrap();
        a2.release_thread().unwrap();
    });
    began_rx.recv().unwrap();
    // A MemPool used eagerly on `s` (not captured): a 20 MiB segment does not fit the cap
    // beside the parked one, so the retry runs.
    let mem_pool = GraphPoolId(0x19b, 3);
    a.graph_pool_retain(mem_pool);
    let q = a.graph_allocate(mem_pool, 3 * MIB, s);
    let eager = a.allocate(24 * MIB, s); // the ordinary out-of-memory path
    done_tx.send(()).unwrap();
    capturer.join().unwrap();
    let syncs = spy.syncs_in_capture.load(Ordering::SeqCst);
    for (r, n) in [(&q, 3 * MIB), (&eager, 24 * MIB)] {
        if let Ok(p) = r {
            a.deallocate(*p, n, s).unwrap();
        }
    }
    assert_eq!(syncs, 0, "a device synchronise during another stream's capture ({q:?}, {eager:?})");
    assert!(q.is_err() && eager.is_err(), "the parked memory needs a synchronise");
    assert_eq!(a.graph_pool_bytes(), 20 << 20, "still parked");
    // The capture over, the same request's retry takes the parked memory.
    let q = a.graph_allocate(mem_pool, 3 * MIB, s).unwrap();
    a.deallocate(q, 3 * MIB, s).unwrap();
    a.graph_pool_release(mem_pool).unwrap();
    assert_all_returned(&a, Some(&spy.sim), 0);
}

// WAS A DEFECT (mended by `c652d04`: `Allocator::passthrough_allocate` takes retired pools'
// memory back and trims before one retry): in pass-through mode a pass-through allocation's out
// of memory never took back a retired graph pool's parked segments (nor trimmed the global
// pool's free chunks), though they count against the one cap since `3dc3550`. The normal mode's
// out-of-memory reclaim takes them (checked first, below), and the README promises a retired
// pool's memory back at "the next device synchronise that happens anyway (... out of memory
// ...)". A 31 MiB pass-through request under a 32 MiB cap failed while the only other memory
// was a retired pool's 2 MiB.
#[test]
fn pass_through_out_of_memory_takes_back_a_retired_pools_parked_memory() {
    for passthrough in [false, true] {
        let dev = host(0);
        let cfg = small().large_max(64 << 10).passthrough(passthrough).max_bytes(32 * MIB);
        let a = host_allocator(dev.clone(), cfg.build().unwrap()).unwrap();
        let s = dev.create_stream();
        let pool = GraphPoolId(0x19b, 4);
        a.graph_pool_retain(pool);
        let p = a.graph_allocate(pool, 1000, s).unwrap(); // a 2 MiB segment
        a.deallocate(p, 1000, s).unwrap();
        a.graph_pool_release(pool).unwrap();
        assert_eq!(a.graph_pool_bytes(), 2 << 20, "parked");
        let r = a.allocate(31 * MIB, s);
        let mode = if passthrough { "pass-through" } else { "normal" };
        assert!(r.is_ok(), "{mode} mode: {r:?} with only a retired pool's 2 MiB beside it under the cap");
        a.deallocate(r.unwrap(), 31 * MIB, s).unwrap();
        assert_all_returned(&a, Some(&dev), 0);
    }
}

// WAS A DEFECT (mended by `c652d04`: `Passthrough::allocate` reads the pool's reserved bytes
// under its lock, and a pool's growth runs inside `Passthrough::with_held`): pass-through
// mode's one cap (`3dc3550`) was checked by each side against a figure read earlier, with no
// lock held across the check and the reservation: `graph_allocate` read the pass-through bytes
// (`outside`) before it took the graph pools' lock, and `allocate_once` read `pool.reserved()`
// before `Passthrough::allocate` took its own. A pass-through allocation made while a capture's
// `graph_allocate` was between its read and its growth (here stopped in the query of another
// stream's fence, which a capture makes before it grows) was granted, and so was the growth:
// 33 MiB reserved under a 32 MiB cap. (Unforced, a 20 MiB pass-through block raced against a
// 20 MiB segment both won about once in 2000 tries on 2 cores.)
#[test]
fn pass_through_and_a_pools_growth_racing_both_fit_under_the_one_cap() {
    let spy = Spy::new(host(0));
    let a =
        Allocator::new(spy.clone(), small().passthrough(true).max_bytes(32 * MIB).build().unwrap()).unwrap();
    let (sa, c, sp) = (spy.sim.create_stream(), spy.sim.create_stream(), spy.sim.create_stream());
    let pool = GraphPoolId(0x19b, 5);
    a.graph_pool_retain(pool);
    // A full 2 MiB segment whose half `x` is freed on `sa` while `sa`'s work on it is held.
    let x = a.graph_allocate(pool, MIB, sa).unwrap();
    let y = a.graph_allocate(pool, MIB, sa).unwrap();
    let gate = spy.sim.gate(sa).unwrap();
    spy.sim.hold_and_check(x.0, 4096, 1, HOLD, sa).unwrap();
    a.deallocate(x, MIB, sa).unwrap();
    // Inside the capture's query of `x`'s fence: a 29 MiB pass-through allocation on another
    // thread (30 MiB left under the cap: it fits alone).
    let (tx, rx) = mpsc::channel();
    let a2 = a.clone();
    *spy.on_query.lock().unwrap() = Some(Box::new(move || {
        let r = std::thread::spawn(move || {
            let r = a2.allocate(29 * MIB, sp);
            a2.release_thread().unwrap();
            r
        })
        .join()
        .unwrap();
        tx.send(r).unwrap();
    }));
    spy.begin_capture(c);
    let q = a.graph_allocate(pool, MIB, c); // `x` not complete: grows by 2 MiB
    spy.end_capture(c);
    // (Had the capture made no query, the pass-through allocation runs now, after it.)
    let unrun = spy.on_query.lock().unwrap().take();
    if let Some(step) = unrun {
        step();
    }
    let pt = rx.recv().unwrap();
    let reserved = spy.sim.reserved_bytes();
    gate.open();
    spy.sim.synchronize();
    let granted = (q.is_ok(), pt.is_ok());
    if let Ok(q) = q {
        a.deallocate(q, MIB, c).unwrap();
    }
    if let Ok(p) = pt {
        a.deallocate(p, 29 * MIB, sp).unwrap();
    }
    a.deallocate(y, MIB, sa).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(
        reserved <= 32 * MIB,
        "{} MiB reserved under a 32 MiB cap (growth, pass-through granted: {granted:?})",
        reserved / MIB
    );
    assert_all_returned(&a, Some(&spy.sim), 0);
}

// =============================================================================================
// What holds.

/// `graph_allocate` on a stream that is not captured, out of memory while the calling thread's
/// per-thread stream *is* being captured: the retry's reclaim (`099f58c`) dissolves this
/// thread's per-thread arena, whose fence would be an event on that stream; `Counted`'s refusal
/// of a capturing stream stops it (no violation). It leaves a `StreamCapturing` error for
/// `take_deferred_error` that no call of the user caused (a NIT: `Arena::reclaim` could ask
/// `stream_capturing(home)` and skip the arena quietly).
#[test]
fn a_pools_out_of_memory_reclaim_records_no_event_on_the_threads_captured_per_thread_stream() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().max_bytes(8 * MIB).build().unwrap()).unwrap();
    // An arena on this thread's per-thread stream with one live block and free room: the
    // reclaim (dissolve = true) takes its superblock back behind a fence on its home stream.
    let e = a.allocate(1000, Stream::PER_THREAD).unwrap();
    dev.write_tag(e.0, 1000 & !3, 5, Stream::PER_THREAD).unwrap();
    dev.synchronize();
    let s = dev.create_stream();
    let pool = GraphPoolId(0x19b, 1);
    a.graph_pool_retain(pool);
    dev.begin_capture(Stream::PER_THREAD).unwrap();
    // Not a capture of `s`: the retry path. 20 MiB segment, 8 MiB cap: out of memory anyway.
    let r = a.graph_allocate(pool, 3 * MIB, s);
    dev.end_capture(Stream::PER_THREAD).unwrap();
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    assert_clean(&dev, "the reclaim and the captured per-thread stream");
    let deferred = a.take_deferred_error();
    assert!(matches!(deferred, None | Some(Error::StreamCapturing { .. })), "{deferred:?}");
    a.deallocate(e, 1000, Stream::PER_THREAD).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Two 1 MiB blocks `x` and `y` fill a new 2 MiB segment of `pool`, allocated on `fs` by `fw`;
/// then `x` is freed there with work on it (tagged `tag`) held in flight by the returned closed
/// gate: `x` is the pool's only free range, and its fence is pending until the gate opens.
fn free_one_behind_a_gate(
    a: &Allocator,
    w: &Worker,
    dev: &HostDevice,
    fw: Who,
    fs: Stream,
    pool: GraphPoolId,
    tag: u32,
) -> (DeviceAddr, DeviceAddr, StreamGate) {
    let (x, y) = on(fw, a, w, move |a| {
        (a.graph_allocate(pool, MIB, fs).unwrap(), a.graph_allocate(pool, MIB, fs).unwrap())
    });
    let d = dev.clone();
    let gate = on(fw, a, w, move |a| {
        let g = d.gate(fs).unwrap();
        d.hold_and_check(x.0, 4096, tag, HOLD, fs).unwrap();
        a.deallocate(x, MIB, fs).unwrap();
        g
    });
    (x, y, gate)
}

/// A block freed outside a capture on stream A while A's work on it is held in flight by a
/// closed gate is handed to stream B (the pool's only free range) only behind a wait on A's
/// fence: user, per-thread (two threads) and legacy streams, frees and allocations on either
/// thread.
#[test]
fn fenced_reuse_outside_a_capture_waits_for_the_freeing_streams_work() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let w = Worker::new(&a);
    let (s1, s2) = (dev.create_stream(), dev.create_stream());
    let pt = Stream::PER_THREAD;
    let cases = [
        ("user -> user", Who::Main, s1, Who::Main, s2),
        ("per-thread -> other thread's per-thread", Who::Main, pt, Who::Other, pt),
        ("other thread's per-thread -> per-thread", Who::Other, pt, Who::Main, pt),
        ("legacy -> user", Who::Main, Stream::LEGACY, Who::Main, s2),
        ("user -> legacy on another thread", Who::Main, s1, Who::Other, Stream::LEGACY),
        ("other thread's per-thread -> user", Who::Other, pt, Who::Main, s2),
        ("user -> other thread's per-thread", Who::Main, s1, Who::Other, pt),
        ("per-thread -> legacy on another thread", Who::Main, pt, Who::Other, Stream::LEGACY),
    ];
    for (i, &(name, fw, fs, uw, us)) in cases.iter().enumerate() {
        let pool = GraphPoolId(0x19b, 100 + i as u64);
        a.graph_pool_retain(pool);
        let (x, y, gate) = free_one_behind_a_gate(&a, &w, &dev, fw, fs, pool, 0x100 + i as u32);
        let d = dev.clone();
        let (q, waits) = on(uw, &a, &w, move |a| {
            let before = a.stats().fence_waits;
            let q = a.graph_allocate(pool, MIB, us).unwrap();
            d.write_tag(q.0, 4096, 0x200 + i as u32, us).unwrap();
            d.check_tag(q.0, 4096, 0x200 + i as u32, us).unwrap();
            (q, a.stats().fence_waits - before)
        });
        gate.open();
        dev.synchronize();
        assert_eq!(q, x, "{name}: the pool's only free range was not reused");
        assert!(waits > 0, "{name}: reused with no wait on the freeing stream's fence");
        assert_clean(&dev, name);
        on(uw, &a, &w, move |a| a.deallocate(q, MIB, us).unwrap());
        on(fw, &a, &w, move |a| a.deallocate(y, MIB, fs).unwrap());
        a.graph_pool_release(pool).unwrap();
        a.check_invariants();
    }
    w.exit();
    assert_all_returned(&a, Some(&dev), 0);
}

/// The same during a capture of stream B: B's capture does not get A's free while A's work on
/// it runs (no wait is possible), grows instead, records and waits on nothing, and gets it once
/// a query sees the fence complete.
#[test]
fn fenced_reuse_during_a_capture_waits_for_completion_and_touches_no_event() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let w = Worker::new(&a);
    let s1 = dev.create_stream();
    let pt = Stream::PER_THREAD;
    let cases = [
        ("user -> captured user", Who::Main, s1, Who::Main, None),
        ("per-thread -> other thread's captured per-thread", Who::Main, pt, Who::Other, Some(pt)),
        ("other thread's per-thread -> captured per-thread", Who::Other, pt, Who::Main, Some(pt)),
        ("legacy -> captured user on another thread", Who::Main, Stream::LEGACY, Who::Other, None),
    ];
    for (i, &(name, fw, fs, uw, cap)) in cases.iter().enumerate() {
        let us = cap.unwrap_or_else(|| dev.create_stream());
        let pool = GraphPoolId(0x19b, 200 + i as u64);
        a.graph_pool_retain(pool);
        let (x, y, gate) = free_one_behind_a_gate(&a, &w, &dev, fw, fs, pool, 0x300 + i as u32);
        let d = dev.clone();
        let (q1, q2) = on(uw, &a, &w, move |a| {
            d.begin_capture(us).unwrap();
            // Both fill a new segment: `x` is not complete.
            let q1 = a.graph_allocate(pool, MIB, us).unwrap();
            let q2 = a.graph_allocate(pool, MIB, us).unwrap();
            d.write_tag(q1.0, 4096, 1, us).unwrap();
            (q1, q2)
        });
        assert!(q1 != x && q2 != x, "{name}: a capture got a free whose stream's work still runs");
        gate.open();
        dev.synchronize();
        let d = dev.clone();
        let r = on(uw, &a, &w, move |a| {
            let r = a.graph_allocate(pool, MIB, us).unwrap(); // x, its fence now seen complete
            d.write_tag(r.0, 4096, 2, us).unwrap();
            for p in [q1, q2, r] {
                a.deallocate(p, MIB, us).unwrap();
            }
            d.end_capture(us).unwrap();
            r
        });
        assert_eq!(r, x, "{name}: a complete free was not reused during the capture");
        assert_clean(&dev, name);
        on(fw, &a, &w, move |a| a.deallocate(y, MIB, fs).unwrap());
        a.graph_pool_release(pool).unwrap();
        a.check_invariants();
    }
    w.exit();
    assert_all_returned(&a, Some(&dev), 0);
}

/// `deallocate_used_on` outside a capture: the declared stream's work (held by a gate) is
/// ordered before the free's fence, so the freeing stream reuses the block at once and another
/// stream behind the fence, both after the declared work; another thread's per-thread stream
/// declared as the legacy stream (as the buffers do) is covered too.
#[test]
fn a_declared_streams_work_is_ordered_before_a_pool_blocks_reuse() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let w = Worker::new(&a);
    let (f, b, u) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
    for (i, (declared, user_who)) in [(u, Who::Main), (Stream::LEGACY, Who::Other)].into_iter().enumerate() {
        let pool = GraphPoolId(0x19b, 300 + i as u64);
        a.graph_pool_retain(pool);
        let x = a.graph_allocate(pool, MIB, f).unwrap();
        let y = a.graph_allocate(pool, MIB, f).unwrap();
        // The declared use: on `u` (this thread), or on the other thread's per-thread stream.
        let d = dev.clone();
        let use_stream = if declared == Stream::LEGACY { Stream::PER_THREAD } else { u };
        let gate = on(user_who, &a, &w, move |_| {
            let g = d.gate(use_stream).unwrap();
            d.hold_and_check(x.0, 4096, 0x400, HOLD, use_stream).unwrap();
            g
        });
        a.deallocate_used_on(x, MIB, f, &[declared]).unwrap();
        // The freeing stream: at once, ordered after the declared work by the free's wait.
        let r = a.graph_allocate(pool, MIB, f).unwrap();
        assert_eq!(r, x);
        dev.write_tag(r.0, 4096, 0x401, f).unwrap();
        a.deallocate(r, MIB, f).unwrap();
        // Another stream: behind the fence, which follows the declared work.
        let q = a.graph_allocate(pool, MIB, b).unwrap();
        assert_eq!(q, x);
        dev.write_tag(q.0, 4096, 0x402, b).unwrap();
        gate.open();
        dev.synchronize();
        assert_clean(&dev, if i == 0 { "declared user stream" } else { "declared legacy stream" });
        a.deallocate(q, MIB, b).unwrap();
        a.deallocate(y, MIB, f).unwrap();
        a.graph_pool_release(pool).unwrap();
    }
    w.exit();
    assert_all_returned(&a, Some(&dev), 0);
}

/// `deallocate_used_on` of graph blocks when a *declared* stream is being captured (the free's
/// stream is not), or one of several is: held (no event on any stream of the free, the
/// capturing one included), never reused while the pool lives, a second free a double free.
#[test]
fn a_free_declaring_a_capturing_stream_is_held_with_no_event_anywhere() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (f, u, c) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(0x19b, 400);
    a.graph_pool_retain(pool);
    let x = a.graph_allocate(pool, 4096, f).unwrap();
    let y = a.graph_allocate(pool, 4096, f).unwrap();
    let z = a.graph_allocate(pool, 4096, f).unwrap();
    let before = a.stats().fences_recorded;
    dev.begin_capture(c).unwrap();
    dev.begin_capture(Stream::PER_THREAD).unwrap();
    a.deallocate_used_on(x, 4096, f, &[c]).unwrap();
    a.deallocate_used_on(y, 4096, f, &[u, c]).unwrap();
    a.deallocate_used_on(z, 4096, f, &[Stream::PER_THREAD]).unwrap();
    dev.end_capture(Stream::PER_THREAD).unwrap();
    dev.end_capture(c).unwrap();
    assert_eq!(a.stats().fences_recorded, before, "held frees record nothing");
    assert_clean(&dev, "held frees");
    for st in [f, u, c] {
        let q = a.graph_allocate(pool, 4096, st).unwrap();
        assert!(![x, y, z].contains(&q), "a held block was reused on {st:?}");
        a.deallocate(q, 4096, st).unwrap();
    }
    for p in [x, y, z] {
        assert!(matches!(
            a.deallocate(p, 4096, f),
            Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
        ));
    }
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 3);
}

/// Touching frees of one stream coalesce (their fences merged) and frees of two streams do not;
/// a capture then allocating around them while their streams' work is held never gets them,
/// records and waits on nothing, and after the work completes reuses them, merged; its own
/// frees merge too. `check_invariants` throughout.
#[test]
fn merged_fenced_ranges_are_safe_for_a_capture_and_touch_no_event() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (sa, sb, c) = (dev.create_stream(), dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(0x19b, 500);
    a.graph_pool_retain(pool);
    const B: usize = 256 << 10;
    let blocks: Vec<DeviceAddr> = (0..8).map(|_| a.graph_allocate(pool, B, sa).unwrap()).collect();
    let seg = (blocks[0].0, 2 * MIB as u64);
    assert!(blocks.iter().all(|p| overlaps((p.0, B as u64), seg)), "one segment");
    let (ga, gb) = (dev.gate(sa).unwrap(), dev.gate(sb).unwrap());
    for (i, &p) in blocks.iter().enumerate() {
        let st = if i == 5 { sb } else { sa };
        dev.hold_and_check(p.0, 4096, 0x500 + i as u32, HOLD, st).unwrap();
    }
    // 1, 2, 3, then 6, then 4 (joins 1..3), and 5 on another stream (joins nothing).
    for i in [1usize, 2, 3, 6, 4, 5] {
        let st = if i == 5 { sb } else { sa };
        a.deallocate(blocks[i], B, st).unwrap();
        a.check_invariants();
    }
    dev.begin_capture(c).unwrap();
    let mut cap = Vec::new();
    for n in [B, 2 * B, 4 * B, B / 2, 3 * B] {
        let p = a.graph_allocate(pool, n, c).unwrap();
        assert!(!overlaps((p.0, n as u64), seg), "a capture got memory whose streams' work runs");
        cap.push((p, n));
    }
    a.check_invariants();
    ga.open();
    gb.open();
    dev.synchronize();
    // Fresh memory left in the capture's segments serves first; ask until the old one serves.
    let mut reused = false;
    for _ in 0..40 {
        let p = a.graph_allocate(pool, 4 * B, c).unwrap();
        dev.write_tag(p.0, 4096, 9, c).unwrap();
        cap.push((p, 4 * B));
        if p == blocks[1] {
            reused = true; // 1..4, merged, seen complete
            break;
        }
    }
    assert!(reused, "the merged range was never reused");
    for (p, n) in cap.drain(..) {
        a.deallocate(p, n, c).unwrap();
    }
    a.check_invariants();
    dev.end_capture(c).unwrap();
    assert_clean(&dev, "capture around merged fenced ranges");
    for i in [0usize, 7] {
        a.deallocate(blocks[i], B, sa).unwrap();
    }
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Out of memory during a capture: at once, no synchronise, no event, a retired pool's parked
/// memory left parked, counted once in `ooms` and not in `alloc_retries`; the same request
/// outside the capture retries once (taking the parked memory) and succeeds.
#[test]
fn out_of_memory_during_a_capture_is_immediate_and_outside_retries_once() {
    let spy = Spy::new(host(0));
    let a = Allocator::new(spy.clone(), small().max_bytes(24 * MIB).build().unwrap()).unwrap();
    let s = spy.sim.create_stream();
    let gone = GraphPoolId(0x19b, 600);
    a.graph_pool_retain(gone);
    let p = a.graph_allocate(gone, 3 * MIB, s).unwrap();
    a.deallocate(p, 3 * MIB, s).unwrap();
    a.graph_pool_release(gone).unwrap();
    let pool = GraphPoolId(0x19b, 601);
    a.graph_pool_retain(pool);
    let before = a.stats();
    spy.begin_capture(s);
    let r = a.graph_allocate(pool, 3 * MIB, s);
    spy.end_capture(s);
    assert!(matches!(r, Err(Error::OutOfMemory { requested, .. }) if requested == 3 * MIB), "{r:?}");
    let mid = a.stats();
    assert_eq!((mid.ooms - before.ooms, mid.alloc_retries - before.alloc_retries), (1, 0));
    assert_eq!(spy.syncs_in_capture.load(Ordering::SeqCst), 0);
    assert_eq!(a.graph_pool_bytes(), 20 << 20, "still parked");
    assert_clean(&spy.sim, "out of memory during a capture");
    let q = a.graph_allocate(pool, 3 * MIB, s).unwrap();
    let after = a.stats();
    assert_eq!((after.ooms - mid.ooms, after.alloc_retries - mid.alloc_retries), (0, 1));
    assert_eq!(a.graph_pool_bytes(), 20 << 20, "the parked segment went back; a new one was made");
    a.deallocate(q, 3 * MIB, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&spy.sim), 0);
}

/// The out-of-memory retry outside a capture under a small cap, on many threads, each making
/// and retiring pools (some retired with a block still live, freed later by another thread),
/// with eager churn alongside: no deadlock, no overlap, `ooms` equals the failures the threads
/// saw, every graph failure was retried once, and everything comes back.
#[test]
fn out_of_memory_retries_on_many_threads_neither_deadlock_lose_nor_double_count() {
    within(60, || {
        let dev = host(2);
        let a = host_allocator(dev.clone(), small().large_max(64 << 10).max_bytes(56 * MIB).build().unwrap())
            .unwrap();
        let live = Arc::new(common::Live::default());
        const T: u64 = 4;
        let (tx, rx) = mpsc::channel::<(DeviceAddr, usize)>();
        let rx = Arc::new(std::sync::Mutex::new(rx));
        let mut hs = Vec::new();
        for t in 0..T {
            let (a, dev, live, tx, rx) = (a.clone(), dev.clone(), live.clone(), tx.clone(), rx.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0x5eed ^ (t + 1);
                let s = if t % 2 == 0 { dev.create_stream() } else { Stream::PER_THREAD };
                let (mut graph_ooms, mut eager_ooms) = (0u64, 0u64);
                for i in 0..60u64 {
                    let pool = GraphPoolId(0x19b_0000 + t, i);
                    a.graph_pool_retain(pool);
                    let mut mine = Vec::new();
                    for _ in 0..3 {
                        let n = 512 + (rng(&mut x) % (12 * MIB as u64)) as usize;
                        match a.graph_allocate(pool, n, s) {
                            Ok(p) => {
                                live.insert(p, n);
                                dev.write_tag(p.0, 512, i as u32, s).unwrap();
                                mine.push((p, n));
                            }
                            Err(Error::OutOfMemory { .. }) => graph_ooms += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    let n = 64 + (rng(&mut x) % (8 * MIB as u64)) as usize;
                    match a.allocate(n, s) {
                        Ok(p) => {
                            live.insert(p, n);
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        }
                        Err(Error::OutOfMemory { .. }) => eager_ooms += 1,
                        Err(e) => panic!("{e}"),
                    }
                    // One block may outlive the pool's release: another thread frees it.
                    let handed = if i % 3 == 0 { mine.pop() } else { None };
                    for (p, n) in mine {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                    if let Some(b) = handed {
                        tx.send(b).unwrap();
                    }
                    a.graph_pool_release(pool).unwrap();
                    // Free what others handed over, on this thread's stream.
                    while let Ok((p, n)) = rx.lock().unwrap().try_recv() {
                        live.remove(p);
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                a.release_thread().unwrap();
                (graph_ooms, eager_ooms)
            }));
        }
        drop(tx);
        let (mut graph_ooms, mut eager_ooms) = (0, 0);
        for h in hs {
            let (g, e) = h.join().unwrap();
            graph_ooms += g;
            eager_ooms += e;
        }
        while let Ok((p, n)) = rx.lock().unwrap().try_recv() {
            live.remove(p);
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        live.assert_clean();
        let st = a.stats();
        eprintln!("graph ooms {graph_ooms}, eager ooms {eager_ooms}, retries {}", st.alloc_retries);
        assert_eq!(st.ooms, graph_ooms + eager_ooms, "ooms counted once per failure");
        assert!(st.alloc_retries >= graph_ooms, "each graph failure outside a capture is retried once");
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// Pass-through mode: pass-through blocks count against a pool's growth (the reverse is
/// `adversarial_s19`'s), the device never holds more than the cap, and once the pass-through
/// block is gone the pool grows.
#[test]
fn pass_through_blocks_count_against_a_pools_growth() {
    let dev = host(0);
    let a =
        host_allocator(dev.clone(), small().passthrough(true).max_bytes(32 * MIB).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(0x19b, 700);
    a.graph_pool_retain(pool);
    let e = a.allocate(24 * MIB, s).unwrap();
    let r = a.graph_allocate(pool, 3 * MIB, s); // a 20 MiB segment: 44 MiB
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    assert!(dev.reserved_bytes() <= 32 * MIB, "{} MiB reserved", dev.reserved_bytes() / MIB);
    a.deallocate(e, 24 * MIB, s).unwrap();
    dev.synchronize(); // the driver's free runs
    let p = a.graph_allocate(pool, 3 * MIB, s).unwrap();
    let r = a.allocate(13 * MIB, s);
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    assert!(dev.reserved_bytes() <= 32 * MIB);
    a.deallocate(p, 3 * MIB, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Pass-through mode: frees of graph blocks (plain, declared used on another stream, and on
/// another thread) go to their pool, not the driver: the pool reuses them, the device still
/// holds the segment, a second free is a double free; `trim(true)` keeps a retained pool's
/// segment and, once it is released, gives it back.
#[test]
fn pass_through_frees_of_graph_blocks_go_to_the_pool() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().passthrough(true).build().unwrap()).unwrap();
    let (s, u) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(0x19b, 800);
    a.graph_pool_retain(pool);
    let p = a.graph_allocate(pool, 4096, s).unwrap();
    let q = a.graph_allocate(pool, 8192, s).unwrap();
    let r = a.graph_allocate(pool, 4096, s).unwrap();
    let reserved = dev.reserved_bytes();
    a.deallocate(p, 4096, s).unwrap();
    a.deallocate_used_on(q, 8192, s, &[u]).unwrap();
    let a2 = a.clone();
    std::thread::spawn(move || {
        a2.deallocate(r, 4096, Stream::PER_THREAD).unwrap();
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    assert_eq!(dev.reserved_bytes(), reserved, "a graph block's free reached the driver");
    assert!(a.graph_pool_live(pool).unwrap().is_empty());
    assert!(matches!(
        a.deallocate(p, 4096, s),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    assert_eq!(a.graph_allocate(pool, 4096, s).unwrap(), p, "reused by its stream");
    a.deallocate(p, 4096, s).unwrap();
    a.trim(true).unwrap();
    assert_eq!(a.graph_pool_bytes(), 2 << 20, "trim(true) kept the retained pool's segment");
    a.graph_pool_release(pool).unwrap();
    a.trim(true).unwrap();
    assert_eq!((a.graph_pool_bytes(), dev.reserved_bytes()), (0, 0));
    assert_clean(&dev, "pass-through graph frees");
    // Pass-through mode's statistics leave graph blocks out (README), but count the refused
    // free (the twentieth session's helper-20 found it uncounted).
    assert_all_returned(&a, Some(&dev), 1);
}

/// The address-span hint: a pool's first block, whose segment widened `[lo, hi)` an instant
/// before, sent at once through a channel to another thread, is found by that thread's free
/// (never refused as unknown), while other threads' new pools widen the span concurrently.
#[test]
fn a_block_handed_over_right_after_its_pools_first_segment_is_found_by_the_free() {
    within(60, || {
        let dev = host(0);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        const T: u64 = 4;
        const N: u64 = 40;
        let mut hs = Vec::new();
        for t in 0..T {
            let a = a.clone();
            let (tx, rx) = mpsc::channel::<(GraphPoolId, DeviceAddr)>();
            let a2 = a.clone();
            let freer = std::thread::spawn(move || {
                let mut refused = 0;
                for (pool, p) in rx {
                    if a2.deallocate(p, 4096, Stream::PER_THREAD).is_err() {
                        refused += 1;
                    }
                    a2.graph_pool_release(pool).unwrap();
                }
                a2.release_thread().unwrap();
                refused
            });
            hs.push(std::thread::spawn(move || {
                for i in 0..N {
                    let pool = GraphPoolId(0x19b_1000 + t, i);
                    a.graph_pool_retain(pool);
                    let p = a.graph_allocate(pool, 4096, Stream::PER_THREAD).unwrap();
                    tx.send((pool, p)).unwrap();
                }
                drop(tx);
                a.release_thread().unwrap();
                freer.join().unwrap()
            }));
        }
        let refused: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(refused, 0, "frees of live graph blocks refused");
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// A device whose chunks start 256 bytes off a 512-byte boundary (`take_segment`'s fallback
/// for a chunk "off `align`", untested so far): every graph block is still 512-byte aligned,
/// during a capture too, with eager traffic in the same chunks; invariants hold and all comes
/// back.
#[test]
fn graph_blocks_stay_512_byte_aligned_on_a_device_whose_chunks_are_not() {
    let spy = Spy::skewed(host(0), 256);
    let a = Allocator::new(spy.clone(), small().build().unwrap()).unwrap();
    let (s, c) = (spy.sim.create_stream(), spy.sim.create_stream());
    let pool = GraphPoolId(0x19b, 900);
    a.graph_pool_retain(pool);
    let e = a.allocate(100_000, s).unwrap();
    let mut blocks = Vec::new();
    for (i, n) in [1000usize, 4096, 70_000, 3 * MIB, 300].into_iter().enumerate() {
        if i == 3 {
            spy.begin_capture(c);
        }
        let st = if i >= 3 { c } else { s };
        let p = a.graph_allocate(pool, n, st).unwrap();
        assert_eq!(p.0 % 512, 0, "a graph block at {p:?}");
        spy.sim.write_tag(p.0, n.next_multiple_of(512), i as u32, st).unwrap();
        blocks.push((p, n, st));
        a.check_invariants();
    }
    for (p, n, st) in blocks {
        a.deallocate(p, n, st).unwrap();
    }
    spy.end_capture(c);
    a.deallocate(e, 100_000, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_clean(&spy.sim, "a skewed device");
    assert_all_returned(&a, Some(&spy.sim), 0);
}

/// Pass-through mode under `c652d04`'s new lock order (graph pools, pass-through, global pool):
/// threads mixing pass-through blocks, graph blocks in and out of captures (announced with
/// `graph_capture_begin/end`), releases, trims and invariant checks under a small cap. No
/// deadlock, no overlap, `ooms` equals the failures seen, and everything comes back.
#[test]
fn pass_through_mode_racing_graph_growth_and_driver_blocks_neither_deadlocks_nor_leaks() {
    within(60, || {
        let dev = host(2);
        let a = host_allocator(dev.clone(), small().passthrough(true).max_bytes(48 * MIB).build().unwrap())
            .unwrap();
        let live = Arc::new(common::Live::default());
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, dev, live) = (a.clone(), dev.clone(), live.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0xfeed ^ (t + 1);
                let s = dev.create_stream();
                let mut ooms = 0u64;
                for i in 0..40u64 {
                    let pool = GraphPoolId(0x19b_2000 + t, i);
                    a.graph_pool_retain(pool);
                    let capture = i % 4 == 1;
                    if capture {
                        a.graph_capture_begin();
                        dev.begin_capture(s).unwrap();
                    }
                    for _ in 0..2 {
                        let n = 512 + (rng(&mut x) % (6 * MIB as u64)) as usize;
                        match a.graph_allocate(pool, n, s) {
                            Ok(p) => {
                                live.insert(p, n);
                                dev.write_tag(p.0, 512, i as u32, s).unwrap();
                                a.deallocate(p, n, s).unwrap(); // reused by the next, if it fits
                                live.remove(p);
                            }
                            Err(Error::OutOfMemory { .. }) => ooms += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    if capture {
                        dev.end_capture(s).unwrap();
                        a.graph_capture_end().unwrap();
                    }
                    let n = 1 + (rng(&mut x) % (12 * MIB as u64)) as usize;
                    match a.allocate(n, s) {
                        Ok(p) => {
                            live.insert(p, n);
                            dev.write_tag(p.0, 4 * (n / 4).min(64), 7, s).unwrap();
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        }
                        Err(Error::OutOfMemory { .. }) => ooms += 1,
                        Err(e) => panic!("{e}"),
                    }
                    a.graph_pool_release(pool).unwrap();
                    match i % 10 {
                        3 => {
                            a.trim(false).unwrap();
                        }
                        7 => a.check_invariants(),
                        _ => {}
                    }
                }
                a.release_thread().unwrap();
                ooms
            }));
        }
        let ooms: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        live.assert_clean();
        eprintln!("ooms {ooms}, retries {}", a.stats().alloc_retries);
        assert_eq!(a.stats().ooms, ooms);
        assert_all_returned(&a, Some(&dev), 0);
    });
}
