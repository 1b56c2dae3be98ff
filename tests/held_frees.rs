//! Frees of dropped buffers held for a CUDA graph capture (`Allocator::free_or_hold`), thirty-
//! second and thirty-third sessions: made again when the capture's announcement ends (`graph_capture_end`, as
//! PyTorch's route to a pool closes after the stream's capture), fenced after the streams the
//! buffer was declared used on, and, retried on the legacy stream, without breaking a blocking
//! stream's capture (helper-53's review asked whether a retry turned into a plain legacy free
//! could: its outbox parks the legacy event while the capture runs, so it does not).

use std::sync::{Arc, Mutex};

use cuarena::{Allocator, Device, Error, Result, Stream, StreamKey};
use cuarena_testkit::{HostDevice, Interpose, Interposed, assert_all_returned, host_allocator};

mod common;
use common::{host, parse};

fn allocator(sim: &HostDevice) -> Allocator {
    host_allocator(sim.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,large_max=1MiB,batch=1"))
        .unwrap()
}

/// Small, arena large and pool blocks.
const SIZES: [usize; 3] = [4096, 300 << 10, 3 << 20];

/// A buffer dropped while its stream is being captured: its free is held (the block stays
/// live), and `graph_capture_end` makes it, with no flush or trim.
#[test]
fn a_held_free_is_made_when_the_capture_ends() {
    let sim = host(0);
    let a = allocator(&sim);
    let w = sim.create_stream();
    for size in SIZES {
        let b = a.buffer(size, w).unwrap();
        let live = a.stats().live_bytes;
        a.graph_capture_begin();
        sim.begin_capture(w).unwrap();
        drop(b);
        assert!(a.take_deferred_error().is_none());
        assert_eq!(a.stats().live_bytes, live, "size {size}: freed during the capture");
        sim.end_capture(w).unwrap();
        a.graph_capture_end().unwrap();
        assert!(
            a.stats().live_bytes < live,
            "size {size}: the held free was not made when the capture ended: {:?}",
            a.stats()
        );
        assert!(a.take_deferred_error().is_none());
    }
    sim.destroy_stream(w).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A buffer declared used on a stream being captured (`record_stream`): its held free, made
/// when the capture ends, is fenced after that stream's work. The block, freed on its own user
/// stream (reused there at once), must come back, or the test checks nothing.
#[test]
fn a_held_free_is_fenced_after_its_declared_stream() {
    let sim = host(0);
    let a = allocator(&sim);
    let (w, v) = (sim.create_stream(), sim.create_stream());
    for size in SIZES {
        let mut b = a.buffer(size, w).unwrap();
        let p = b.ptr().0;
        b.record_stream(v);
        a.graph_capture_begin();
        sim.begin_capture(v).unwrap();
        drop(b);
        sim.end_capture(v).unwrap();
        // The declared stream's work, still running when the held free is made.
        let gate = sim.gate(v).unwrap();
        sim.write_tag(p, 256, 0x5a, v).unwrap();
        a.graph_capture_end().unwrap();
        let mut got = Vec::new();
        while got.len() < 16 && got.last() != Some(&p) {
            let q = a.allocate(size, w).unwrap().0;
            // Overwrites p's first bytes under v's work if the free was not fenced after it.
            sim.write_tag(q, 256, 0x11, w).unwrap();
            got.push(q);
        }
        assert_eq!(got.last(), Some(&p), "size {size}: the block never came back: the test checks nothing");
        gate.open();
        sim.synchronize();
        assert_eq!(
            sim.tag_errors(),
            0,
            "size {size}: the held free's block was reused before its declared work"
        );
        assert!(sim.violations().is_empty(), "size {size}: {:?}", sim.violations());
        for q in got {
            a.deallocate(cuarena::DeviceAddr(q), size, w).unwrap();
        }
    }
    sim.destroy_stream(w).unwrap();
    sim.destroy_stream(v).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A buffer on the legacy stream declared used on its thread's per-thread stream, dropped
/// while a capture is announced: held. Another thread, whose own per-thread stream (a blocking
/// stream) is being captured, ends the announcement: the retry there names the legacy stream
/// alone (the first thread's per-thread stream is fenced through it), a plain legacy free,
/// and must not use the legacy stream during that capture (it would break it); the free is
/// made, its fence parked until the capture has ended.
#[test]
fn a_held_free_retried_on_the_legacy_stream_spares_a_blocking_capture() {
    let sim = host(0);
    let a = allocator(&sim);
    for size in SIZES {
        let live = a.stats().live_bytes;
        let mut b = a.buffer(size, Stream::LEGACY).unwrap();
        b.record_stream(Stream::PER_THREAD);
        a.graph_capture_begin();
        drop(b);
        assert!(a.take_deferred_error().is_none());
        assert!(a.stats().live_bytes > live, "size {size}: not held during the announcement");
        let (a2, sim2) = (a.clone(), sim.clone());
        std::thread::spawn(move || {
            sim2.begin_capture(Stream::PER_THREAD).unwrap();
            a2.graph_capture_end().unwrap(); // the retry: a plain legacy free
            a2.flush().unwrap();
            sim2.end_capture(Stream::PER_THREAD).expect("the retry broke a blocking stream's capture");
            a2.flush().unwrap(); // no capture now: made
            a2.release_thread().unwrap();
        })
        .join()
        .unwrap();
        assert!(sim.violations().is_empty(), "size {size}: {:?}", sim.violations());
        assert!(a.take_deferred_error().is_none());
        assert_eq!(a.stats().live_bytes, live, "size {size}: the held free was never made");
    }
    a.release_thread().unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

type Hook = Box<dyn FnOnce() + Send>;

/// A simulated device that runs a hook inside the next query of one stream that answers
/// "capturing" (a capture query, or an identity lookup refused for a capture), after the
/// answer is taken and before it is returned.
struct EndsInsideQuery {
    sim: HostDevice,
    on: Stream,
    hook: Mutex<Option<Hook>>,
}

impl EndsInsideQuery {
    fn after<T>(&self, stream: Stream, r: Result<T>, capturing: impl Fn(&Result<T>) -> bool) -> Result<T> {
        if stream == self.on && capturing(&r) {
            let hook = self.hook.lock().unwrap().take();
            if let Some(hook) = hook {
                hook();
            }
        }
        r
    }
}

impl Interpose for EndsInsideQuery {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        self.after(stream, self.sim.stream_capturing(stream), |r| matches!(r, Ok(true)))
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        self.after(stream, self.sim.stream_key(stream), |r| matches!(r, Err(Error::StreamCapturing { .. })))
    }
}

/// A buffer dropped while its stream is captured: its free is refused, and before it is held
/// another thread ends the capture and the announcement (`graph_capture_end`, whose retry finds
/// the list empty). The free, held after that end, is made at once (it sees a capture's end
/// since its refusal) rather than waiting for the next call that retries (helper-53's case,
/// left in the thirty-second session). The mutation `hold_ignores_capture_end` must fail this.
#[test]
fn a_free_held_just_after_the_capture_ended_is_made_at_once() {
    let sim = host(0);
    let w = sim.create_stream();
    let dev = Arc::new(Interposed(EndsInsideQuery { sim: sim.clone(), on: w, hook: Mutex::new(None) }));
    let a = Allocator::new(
        dev.clone(),
        parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,large_max=1MiB,batch=1"),
    )
    .unwrap();
    for size in SIZES {
        let b = a.buffer(size, w).unwrap();
        let live = a.stats().live_bytes;
        a.graph_capture_begin();
        sim.begin_capture(w).unwrap();
        let (a2, sim2) = (a.clone(), sim.clone());
        *dev.hook.lock().unwrap() = Some(Box::new(move || {
            std::thread::spawn(move || {
                sim2.end_capture(w).unwrap();
                a2.graph_capture_end().unwrap();
                a2.release_thread().unwrap();
            })
            .join()
            .unwrap();
        }));
        drop(b);
        assert!(
            dev.hook.lock().unwrap().is_none(),
            "size {size}: the free asked no capture query of its stream"
        );
        assert!(a.take_deferred_error().is_none());
        assert!(
            a.stats().live_bytes < live,
            "size {size}: the free held after the capture's end waits for a later call: {:?}",
            a.stats()
        );
    }
    sim.destroy_stream(w).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A simulated device that, armed, runs a hook in the `n`th identity lookup of one stream
/// (counting from the arming).
struct HookAtKey {
    sim: HostDevice,
    on: Stream,
    n: usize,
    seen: std::sync::atomic::AtomicUsize,
    hook: Mutex<Option<Hook>>,
}

impl Interpose for HookAtKey {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        let r = self.sim.stream_key(stream);
        if stream == self.on
            && r.is_ok()
            && self.hook.lock().unwrap().is_some()
            && self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == self.n
        {
            let hook = self.hook.lock().unwrap().take();
            if let Some(hook) = hook {
                hook();
            }
        }
        r
    }
}

/// With a trace running, the retry of a held pool-block free asks the stream's identity
/// (for the trace) after the free was taken and before the entry is unlisted. In that window
/// another thread is handed the same block and frees it: a valid free of the block's next life.
/// It must be taken once the retry has settled, not refused as a double free of the held one
/// (helper-55; before, it was refused and the block stayed live). The hook lets the other
/// thread try for 50 ms before the retry goes on: the mutation `held_free_no_wait` (a free
/// refused while another thread's retry of its block is in flight) must fail this.
#[test]
fn the_next_owners_free_during_a_retry_is_taken() {
    let sim = host(0);
    let w = sim.create_stream();
    let dev = Arc::new(Interposed(HookAtKey {
        sim: sim.clone(),
        on: w,
        n: 2,
        seen: std::sync::atomic::AtomicUsize::new(0),
        hook: Mutex::new(None),
    }));
    let a = Allocator::new(dev.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,large_max=1MiB"))
        .unwrap();
    let path = std::env::temp_dir().join(format!("cuarena-held-next-owner-{}.trace", std::process::id()));
    a.start_trace(&path).unwrap();
    let size = 3 << 20;
    let p = a.allocate(size, w).unwrap();
    a.graph_capture_begin();
    sim.begin_capture(w).unwrap();
    assert!(!a.deallocate_or_hold(p, size, w, &[]).unwrap());
    sim.end_capture(w).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (got_tx, got_rx) = std::sync::mpsc::channel();
    let a2 = a.clone();
    let next_owner = std::thread::spawn(move || {
        rx.recv().unwrap();
        let q = a2.allocate(size, w).unwrap();
        got_tx.send(q).unwrap();
        let r = a2.deallocate(q, size, w);
        a2.release_thread().unwrap();
        (q, r)
    });
    *dev.hook.lock().unwrap() = Some(Box::new(move || {
        tx.send(()).unwrap();
        got_rx.recv().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
    }));
    a.graph_capture_end().unwrap();
    let (q, r) = next_owner.join().unwrap();
    assert!(dev.hook.lock().unwrap().is_none(), "the hook never ran: the test checks nothing");
    assert_eq!(q, p, "the next owner was not handed the block: the test checks nothing");
    assert!(r.is_ok(), "the next owner's valid free was refused: {r:?}");
    assert_eq!(a.held_frees(), 0);
    a.stop_trace().unwrap();
    let _ = std::fs::remove_file(&path);
    sim.destroy_stream(w).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}

/// A simulated device that runs a hook in its next event record on one stream, before the
/// record reaches the simulator (between the caller's capture check and its record).
struct HookAtRecord {
    sim: HostDevice,
    on: Stream,
    hook: Mutex<Option<Hook>>,
}

impl Interpose for HookAtRecord {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn record_event(&self, event: cuarena::Event, stream: Stream) -> Result<()> {
        if stream == self.on {
            let hook = self.hook.lock().unwrap().take();
            if let Some(hook) = hook {
                hook();
            }
        }
        self.sim.record_event(event, stream)
    }
}

/// A held free's retry is made by whichever thread calls next (here `flush` on the main
/// thread), while the stream's user announces and begins a capture of that stream. The retry
/// holds announcements off while it checks the stream and records its fence, so the capture
/// begins after the retry, and no event lands in it. The hook, inside the retry's event
/// record (after its capture check), starts the announcing thread and gives it 50 ms: the mutation
/// `retry_ignores_announcements` lets the capture begin there, and the simulator then reports
/// the retry's event recorded on a capturing stream (helper-54's test saw that on the GPU
/// machine's 16 cores before the retry held announcements off).
#[test]
fn a_retry_holds_off_a_capture_announced_meanwhile() {
    let sim = host(0);
    let w = sim.create_stream();
    let dev = Arc::new(Interposed(HookAtRecord { sim: sim.clone(), on: w, hook: Mutex::new(None) }));
    let a = Allocator::new(dev.clone(), parse("superblock=256KiB,small_max=64KiB,chunk=1MiB,large_max=1MiB"))
        .unwrap();
    let size = 3 << 20; // a pool block: its free records a fence on `w`
    let p = a.allocate(size, w).unwrap();
    sim.begin_capture(w).unwrap(); // not announced: the hold is refused by the stream's query
    assert!(!a.deallocate_or_hold(p, size, w, &[]).unwrap());
    sim.end_capture(w).unwrap();
    let (a2, sim2) = (a.clone(), sim.clone());
    let (began_tx, began_rx) = std::sync::mpsc::channel();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let announcer = Arc::new(Mutex::new(None));
    let slot = announcer.clone();
    *dev.hook.lock().unwrap() = Some(Box::new(move || {
        *slot.lock().unwrap() = Some(std::thread::spawn(move || {
            a2.graph_capture_begin(); // waits for the retry, which holds announcements off
            sim2.begin_capture(w).unwrap();
            began_tx.send(()).unwrap();
            end_rx.recv().unwrap(); // the capture stays open until the retry has returned
            sim2.end_capture(w).unwrap();
            a2.graph_capture_end().unwrap();
            a2.release_thread().unwrap();
        }));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }));
    a.flush().unwrap();
    assert!(
        dev.hook.lock().unwrap().is_none(),
        "the retry recorded nothing on the stream: the test checks nothing"
    );
    began_rx.recv().unwrap();
    end_tx.send(()).unwrap();
    announcer.lock().unwrap().take().unwrap().join().unwrap();
    assert_eq!(a.held_frees(), 0);
    // The block again, on another stream: its fence is consulted (an event recorded into the
    // capture would be a graph node, never complete: the simulator reports it).
    let q = a.allocate(size, Stream::PER_THREAD).unwrap();
    assert_eq!(q, p, "the block did not come back: the test checks nothing");
    a.deallocate(q, size, Stream::PER_THREAD).unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert!(a.take_deferred_error().is_none());
    sim.destroy_stream(w).unwrap();
    assert_all_returned(&a, Some(&sim), 0);
}
