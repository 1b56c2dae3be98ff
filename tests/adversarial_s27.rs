//! Twenty-seventh session's attacks (helper-34): the allocator's lifecycle (many allocators
//! made and dropped on long-lived threads, threads that outlive the allocator they used,
//! parked arenas at the drop), thread-per-request traffic, and `release_thread`, `flush`,
//! `trim` and `set_limit_bytes` racing allocation traffic under a tight cap.
//!
//! Host memory is measured with a counting global allocator (this binary's own,
//! `common/counting_heap.rs`): the tests that read it hold its `serial()`, and so does every
//! other test here, so that nothing else
//! allocates meanwhile. Device-side leaks are seen on the testkit's `LightDevice`, which
//! counts events created and not destroyed, and through the strong count of the device's
//! `Arc`: an allocator dropped with everything it made gone leaves the device with one owner.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier, Mutex};

use cuarena::{Allocator, Device, DeviceAddr, Error, Event, Stream};
use std::time::Duration;

use cuarena_testkit::{HostDevice, LightDevice};

mod common;
use common::*;

#[path = "common/counting_heap.rs"]
mod counting_heap;
use counting_heap::{heap, serial};

/// A `LightDevice` (no race checker, events that complete `latency_ms` after their record)
/// held by the test, so its owners can be counted.
fn light(latency_ms: u64) -> Arc<LightDevice> {
    Arc::new(LightDevice::new(1 << 30, Duration::from_millis(latency_ms)))
}

/// An allocator over `dev` with `small()`'s configuration.
fn on_light(dev: &Arc<LightDevice>) -> Allocator {
    Allocator::new(Arc::clone(dev) as Arc<dyn cuarena::Device>, small().build().unwrap()).unwrap()
}

/// What an allocator's drop must leave behind once every thread that used it has moved on:
/// the device with no owner but the test, and no event of the allocator's alive.
fn device_let_go(dev: &Arc<LightDevice>, what: &str) {
    assert_eq!(
        (Arc::strong_count(dev), dev.live_events()),
        (1, 0),
        "{what}: (owners of the device, live events) after every allocator was dropped"
    );
}

/// Makes a block of the calling thread's arena for `s` wait in that arena as a fenced remote
/// free: another thread frees it on its per-thread stream and exits (its batch goes out under
/// an event), and this thread's `flush` takes the batch in while the event is still running.
/// Also leaves one block freed by its owner in the arena.
fn fenced_free_in_own_arena(a: &Allocator, s: Stream) {
    let p = a.allocate(1000, s).unwrap();
    let q = a.allocate(1000, s).unwrap();
    let a2 = a.clone();
    std::thread::spawn(move || {
        a2.deallocate_per_thread(p, 1000).unwrap();
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    a.flush().unwrap();
    a.deallocate(q, 1000, s).unwrap();
}

/// Runs `per_thread` lifetimes on two long-lived threads (50 first to warm up, then `n`
/// measured) and returns the heap bytes the measured ones left behind.
fn heap_left_by_lifetimes(
    dev: &Arc<LightDevice>,
    n: usize,
    life: fn(&Arc<LightDevice>, Stream, &Live),
) -> isize {
    let sync = Arc::new(Barrier::new(3));
    let hs: Vec<_> = (0..2)
        .map(|t| {
            let (dev, sync) = (Arc::clone(dev), Arc::clone(&sync));
            std::thread::spawn(move || {
                let u = Stream::from_raw(0x5000 + t);
                let live = Live::default();
                for k in [50, n] {
                    for _ in 0..k {
                        life(&dev, u, &live);
                    }
                    sync.wait();
                    sync.wait();
                }
                live.assert_clean();
            })
        })
        .collect();
    sync.wait();
    let before = heap();
    sync.wait();
    sync.wait();
    let grown = heap() - before;
    sync.wait();
    hs.into_iter().for_each(|h| h.join().unwrap());
    grown
}

/// One allocator's life on the calling thread: small, medium and large blocks on `streams`,
/// all freed (own frees: the arenas keep the memory), and `release_thread` if `release`.
fn lifetime_on(dev: &Arc<LightDevice>, streams: &[Stream], live: &Live, release: bool) {
    let a = on_light(dev);
    let mut blocks = Vec::new();
    for &s in streams {
        for size in [1000, 40_000, 3 << 20] {
            let p = a.allocate(size, s).unwrap();
            assert_eq!(p.0 % 256, 0);
            live.insert(p, size);
            blocks.push((p, size, s));
        }
    }
    for (p, size, s) in blocks {
        live.remove(p);
        a.deallocate(p, size, s).unwrap();
    }
    assert_eq!(a.stats().live_bytes, 0);
    if release {
        a.release_thread().unwrap();
    }
}

/// Allocators made and dropped one after another on two long-lived threads that never call
/// `release_thread` (the per-thread and legacy streams): each thread's slot for a dropped
/// allocator is forgotten when the thread makes its next one (`with_slot`, "Forget slots of
/// dropped allocators; their memory went with them"). Host memory must stay flat. It does not:
/// each lifetime leaves about 15 KB behind, the dropped slot's two arenas (`Box<Arena>`,
/// leaked by `OwnedArena::new` and reclaimed only by `OwnedArena::exit`, which `Slot::drop`
/// skips once the allocator is gone). With `release_thread` before each drop (the control,
/// second half) nothing is left.
#[test]
fn allocators_dropped_on_long_lived_threads_leave_no_host_memory_behind() {
    let _g = serial();
    let dev = light(0);
    let fixed = |dev: &Arc<LightDevice>, _u: Stream, live: &Live| {
        lifetime_on(dev, &[Stream::PER_THREAD, Stream::LEGACY], live, true)
    };
    let released = heap_left_by_lifetimes(&dev, 400, fixed);
    device_let_go(&dev, "released slots");
    assert!(released < 800 * 256, "the control left {released} B behind");
    let fixed = |dev: &Arc<LightDevice>, _u: Stream, live: &Live| {
        lifetime_on(dev, &[Stream::PER_THREAD, Stream::LEGACY], live, false)
    };
    let grown = heap_left_by_lifetimes(&dev, 400, fixed);
    device_let_go(&dev, "forgotten slots");
    assert!(
        grown < 800 * 256,
        "800 allocator lifetimes on two long-lived threads left {grown} B of host memory behind \
         ({} B each; with release_thread: {released} B in all)",
        grown / 800
    );
}

/// The same with user streams and `release_thread` before every drop, as a careful program
/// does: the thread's user arena holds the memory its owner freed, so `release_thread` parks
/// it (`Inner::retire_user`), and the allocator's drop then drops the parked list
/// (`Inner::drop` leaves it to the pool's synchronise) without giving the arenas' host memory
/// back: about 7.5 KB a lifetime.
#[test]
fn arenas_parked_at_the_allocators_drop_leave_no_host_memory_behind() {
    let _g = serial();
    let dev = light(0);
    let user = |dev: &Arc<LightDevice>, u: Stream, live: &Live| lifetime_on(dev, &[u], live, true);
    let grown = heap_left_by_lifetimes(&dev, 400, user);
    device_let_go(&dev, "parked arenas");
    assert!(
        grown < 800 * 256,
        "800 allocator lifetimes with a parked user arena each left {grown} B of host memory behind ({} B each)",
        grown / 800
    );
}

/// An allocator dropped while a thread's arena holds a remote free still waiting for its
/// event (the free's batch was taken in by the owner's `flush`): once every thread has moved
/// on, the device must have no owner but the test and no event alive. Three ways the arena
/// meets the drop: the owner makes another allocator (its dead slot is forgotten then), the
/// owner exits after the drop (its slot's destructor), and the owner exited before the drop
/// with the arena parked (a user stream's arena holding memory).
/// On this session's code each way keeps the leaked arena's fence, and through it the event
/// pool and the device, alive for good: the event is never destroyed (on CUDA, a
/// `cuEventDestroy` never made and the `CudaDevice` never dropped).
#[test]
fn an_allocator_dropped_with_fenced_frees_in_an_arena_lets_the_device_and_its_events_go() {
    let _g = serial();
    let mut found = Vec::new();
    for way in ["next allocator", "exit after the drop", "parked before the drop"] {
        let dev = light(300);
        let a = on_light(&dev);
        let (to_thread, rx) = std::sync::mpsc::channel::<Option<Allocator>>();
        let (done, from_thread) = std::sync::mpsc::channel::<()>();
        let a2 = a.clone();
        let u = Stream::from_raw(0x7000);
        let h = std::thread::spawn(move || {
            let s = if way == "parked before the drop" { u } else { Stream::PER_THREAD };
            fenced_free_in_own_arena(&a2, s);
            drop(a2);
            if way == "parked before the drop" {
                return; // exits: the user arena, holding memory, is parked
            }
            done.send(()).unwrap();
            // Waits for the drop, then moves on.
            if let Some(b) = rx.recv().unwrap() {
                let p = b.allocate_per_thread(512).unwrap();
                b.deallocate_per_thread(p, 512).unwrap();
                b.release_thread().unwrap();
            }
        });
        let mut h = Some(h);
        if way == "parked before the drop" {
            h.take().unwrap().join().unwrap();
            assert!(a.parked_bytes() > 0, "the user arena was parked");
        } else {
            from_thread.recv().unwrap();
        }
        drop(a);
        if way == "next allocator" {
            to_thread.send(Some(on_light(&dev))).unwrap();
        } else if way == "exit after the drop" {
            to_thread.send(None).unwrap();
        }
        if let Some(h) = h {
            h.join().unwrap();
        }
        found.push((way, Arc::strong_count(&dev), dev.live_events()));
    }
    assert!(
        found.iter().all(|&(_, owners, events)| (owners, events) == (1, 0)),
        "(way, owners of the device, live events) after every allocator was dropped: {found:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Thread per request.

/// A block handed from a thread that exits to a later one: where it was last used, its tag,
/// and an event recorded on that stream after the use (the next owner's free stream waits on
/// it, so the free's promise holds).
struct Handed {
    p: DeviceAddr,
    size: usize,
    t: u32,
    after: Event,
}

/// Frees the blocks still handed on, from the calling thread on the legacy stream (after the
/// event of each one's last use, checking its tag), then checks that no block is live.
fn free_handed(a: &Allocator, sim: &HostDevice, live: &Live, handed: &Mutex<Vec<Handed>>) {
    for h in handed.lock().unwrap().drain(..) {
        sim.stream_wait_event(Stream::LEGACY, h.after).unwrap();
        check(sim, h.p, h.size, h.t, Stream::LEGACY);
        live.remove(h.p);
        a.deallocate(h.p, h.size, Stream::LEGACY).unwrap();
    }
    live.assert_clean();
}

/// A size for a request: mostly small, some medium, a few large (arena large superblocks) and
/// a few over `large_max` (the pool).
fn request_size(x: &mut u64) -> usize {
    match rng(x) % 16 {
        0 => (1 << 20) + (rng(x) as usize % (3 << 20)),
        1 => (64 << 20) + 1 + (rng(x) as usize % (1 << 20)),
        2..=4 => 1 + rng(x) as usize % (64 << 10),
        _ => 1 + rng(x) as usize % 4096,
    }
}

/// One request's thread: blocks on its per-thread stream, the legacy stream and a user stream
/// it makes, tagged there; some freed by it (some on another of its streams, ordered after
/// the use), some handed on to later threads; blocks handed on by earlier threads checked and
/// freed on a stream of its own. The user stream is destroyed at the end.
fn request(a: &Allocator, sim: &HostDevice, live: &Live, handed: &Mutex<Vec<Handed>>, seed: u64) {
    let mut x = seed | 1;
    let u = sim.create_stream();
    let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
    let mut mine = Vec::new();
    for (k, &s) in streams.iter().enumerate() {
        for j in 0..3 {
            let size = request_size(&mut x);
            let p = a.allocate(size, s).unwrap();
            assert_eq!(p.0 % 256, 0, "alignment");
            let t = (seed as u32).wrapping_mul(16) + (k * 3 + j) as u32;
            let h = Held::taken(sim, live, p, size, s, &mut { t });
            mine.push(h);
        }
    }
    // Blocks of earlier, exited threads: checked and freed here.
    let theirs: Vec<Handed> = {
        let mut v = handed.lock().unwrap();
        let n = v.len().min(2 + rng(&mut x) as usize % 3);
        let at = v.len() - n;
        v.drain(at..).collect()
    };
    for h in theirs {
        let s = streams[rng(&mut x) as usize % 3];
        sim.stream_wait_event(s, h.after).unwrap();
        check(sim, h.p, h.size, h.t, s);
        live.remove(h.p);
        a.deallocate(h.p, h.size, s).unwrap();
    }
    for h in mine {
        match rng(&mut x) % 3 {
            0 => {
                live.remove(h.p);
                a.deallocate(h.p, h.size, h.s).unwrap();
            }
            1 => {
                // On another of its streams, ordered after the use.
                let s = streams[rng(&mut x) as usize % 3];
                if s != h.s {
                    let e = sim.create_event().unwrap();
                    sim.record_event(e, h.s).unwrap();
                    sim.stream_wait_event(s, e).unwrap();
                }
                live.remove(h.p);
                a.deallocate(h.p, h.size, s).unwrap();
            }
            _ => {
                let after = sim.create_event().unwrap();
                sim.record_event(after, h.s).unwrap();
                handed.lock().unwrap().push(Handed { p: h.p, size: h.size, t: h.t, after });
            }
        }
    }
    sim.destroy_stream(u).unwrap();
}

/// Thread per request: 400 short-lived threads, four at a time, each allocating on its
/// per-thread stream, the legacy stream and a user stream it makes and destroys, some blocks
/// outliving their thread and freed by later threads (or the main thread) on any of their
/// streams. No overlap, no reuse before a fence (race checker and tags), every byte back,
/// no arena left once the last thread is gone, and the reserved memory bounded by the working
/// set rather than by the number of threads.
#[test]
fn thread_per_request_with_blocks_outliving_their_threads() {
    let _g = serial();
    within(120, || {
        let sim = host(20);
        let a = alloc_with(&sim, small());
        let live = Arc::new(Live::default());
        let handed = Arc::new(Mutex::new(Vec::new()));
        let mut peak_reserved = Vec::new();
        for wave in 0..100u64 {
            let hs: Vec<_> = (0..4u64)
                .map(|i| {
                    let (a, sim, live, handed) =
                        (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&handed));
                    std::thread::spawn(move || request(&a, &sim, &live, &handed, wave * 4 + i + 1))
                })
                .collect();
            hs.into_iter().for_each(|h| h.join().unwrap());
            if wave % 25 == 24 {
                let st = a.stats();
                peak_reserved.push(st.reserved_bytes);
                // Only the handed blocks are live, and no thread is alive: no arena is left
                // but parked ones (destroyed user streams' arenas waiting for a synchronise).
                let handed_bytes: usize = handed.lock().unwrap().iter().map(|h| h.size).sum();
                assert!(st.live_bytes as usize >= handed_bytes, "{st:?}");
                assert_eq!(st.arenas, 0, "arenas of exited threads still counted: {st:?}");
            }
        }
        // The rest, from the main thread on the legacy stream.
        free_handed(&a, &sim, &live, &handed);
        let last = *peak_reserved.last().unwrap();
        let first = peak_reserved[0];
        assert!(last <= first.max(64 << 20) * 2, "reserved memory grows with threads: {peak_reserved:?}");
        all_back(&a, &sim);
    });
}

/// Thread per request on a device with no per-thread state of its own (`LightDevice`): after a
/// warm-up, 1,000 more short-lived threads (two at a time), each on its per-thread stream, the
/// legacy stream and a user stream never seen before (its arena is parked at the thread's
/// exit), blocks up to 64 KiB (normal superblocks only: one registry layout per address), with
/// blocks freed by later threads. The allocator's host structures (per-thread
/// counters, shells, parked lists) must not grow with the number of threads: measured after a
/// blocking `trim` at both ends, the heap may differ by little. One chunk of 512 MiB, kept by a
/// block live throughout, serves everything, so the same addresses are lent again (the
/// registry keeps host memory per address ever lent, `registry.rs`, and the `LightDevice`
/// never gives an address twice). Also every byte comes back and no arena is left.
#[test]
fn thread_per_request_leaves_host_memory_flat() {
    let _g = serial();
    let dev = light(0);
    let a = Allocator::new(Arc::clone(&dev) as Arc<dyn Device>, small().chunk(512 << 20).build().unwrap())
        .unwrap();
    let keeper = a.allocate_per_thread(4096).unwrap();
    let handed: Arc<Mutex<Vec<(DeviceAddr, usize)>>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let run = |n: usize| {
        for _ in 0..n / 2 {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let (a, handed, next) = (a.clone(), Arc::clone(&handed), Arc::clone(&next));
                    std::thread::spawn(move || {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let mut x = i as u64 * 7919 + 1;
                        let u = Stream::from_raw(0x10_0000 + i);
                        let mut mine = Vec::new();
                        for s in [Stream::PER_THREAD, Stream::LEGACY, u] {
                            for _ in 0..3 {
                                let size = 1 + rng(&mut x) as usize % (64 << 10);
                                mine.push((a.allocate(size, s).unwrap(), size, s));
                            }
                        }
                        let theirs: Vec<_> = {
                            let mut v = handed.lock().unwrap();
                            let k = v.len().min(3);
                            let at = v.len() - k;
                            v.drain(at..).collect()
                        };
                        for (p, size) in theirs {
                            a.deallocate_per_thread(p, size).unwrap();
                        }
                        for (j, (p, size, s)) in mine.into_iter().enumerate() {
                            if j % 3 == 0 {
                                handed.lock().unwrap().push((p, size));
                            } else {
                                a.deallocate(p, size, s).unwrap();
                            }
                        }
                    })
                })
                .collect();
            hs.into_iter().for_each(|h| h.join().unwrap());
        }
    };
    let settle = || {
        a.trim(true).unwrap();
        heap()
    };
    run(400);
    let before = settle();
    let mut grown = Vec::new();
    for _ in 0..8 {
        run(200);
        grown.push(settle() - before);
    }
    let st = a.stats();
    assert_eq!(st.arenas, 1, "only the main thread's arena (the keeper's) is left: {st:?}");
    for (p, size) in handed.lock().unwrap().drain(..) {
        a.deallocate_per_thread(p, size).unwrap();
    }
    a.deallocate_per_thread(keeper, 4096).unwrap();
    cuarena_testkit::assert_all_returned(&a, None, 0);
    drop(a);
    device_let_go(&dev, "thread per request");
    println!("heap grown after each 200 threads: {grown:?}");
    // The registry's pages fill in as more of the chunk is lent (bounded by the chunk): the
    // last 800 threads may add little.
    assert!(
        grown[7] - grown[3] < 64 << 10,
        "heap after each 200 more request threads, against the start: {grown:?} B"
    );
}

// ---------------------------------------------------------------------------------------------
// Maintenance calls racing traffic under a tight cap.

/// One traffic thread's life: `ops` random operations on its per-thread stream, the legacy
/// stream and a user stream of its own, under the cap. Blocks are tagged where they are used
/// and freed there; some are handed to other threads through `handed` (with an event after
/// their use); `flush` and `release_thread` now and then. Returns the out-of-memory errors it
/// got; any other error fails the test.
fn traffic(
    a: &Allocator,
    sim: &HostDevice,
    live: &Live,
    handed: &Mutex<Vec<Handed>>,
    seed: u64,
    ops: usize,
) -> u64 {
    let mut x = seed | 1;
    let u = sim.create_stream();
    let streams = [Stream::PER_THREAD, Stream::LEGACY, u];
    let mut held: Vec<Held> = Vec::new();
    let mut ooms = 0;
    let mut t = (seed as u32) << 20;
    for _ in 0..ops {
        match rng(&mut x) % 16 {
            0..=6 => {
                let s = streams[rng(&mut x) as usize % 3];
                let size = match rng(&mut x) % 8 {
                    0 => (1 << 20) + rng(&mut x) as usize % (2 << 20),
                    1 => (64 << 20) + 1, // over large_max: the pool, and always over the cap
                    _ => 1 + rng(&mut x) as usize % (64 << 10),
                };
                match a.allocate(size, s) {
                    Ok(p) => {
                        assert_eq!(p.0 % 256, 0, "alignment");
                        held.push(Held::taken(sim, live, p, size, s, &mut t));
                    }
                    Err(Error::OutOfMemory { requested, .. }) => {
                        assert_eq!(requested, size, "the error names the size asked");
                        ooms += 1;
                    }
                    Err(e) => panic!("allocation of {size} B on {s:?}: {e}"),
                }
            }
            7..=11 if !held.is_empty() => {
                let h = held.swap_remove(rng(&mut x) as usize % held.len());
                live.remove(h.p);
                a.deallocate(h.p, h.size, h.s).unwrap();
            }
            12 if !held.is_empty() => {
                let h = held.swap_remove(rng(&mut x) as usize % held.len());
                let after = sim.create_event().unwrap();
                sim.record_event(after, h.s).unwrap();
                handed.lock().unwrap().push(Handed { p: h.p, size: h.size, t: h.t, after });
            }
            13 => {
                let h = handed.lock().unwrap().pop();
                if let Some(h) = h {
                    let s = streams[rng(&mut x) as usize % 3];
                    sim.stream_wait_event(s, h.after).unwrap();
                    check(sim, h.p, h.size, h.t, s);
                    live.remove(h.p);
                    a.deallocate(h.p, h.size, s).unwrap();
                }
            }
            14 => a.flush().unwrap(),
            _ => a.release_thread().unwrap(),
        }
    }
    for h in held {
        live.remove(h.p);
        a.deallocate(h.p, h.size, h.s).unwrap();
    }
    a.release_thread().unwrap();
    sim.destroy_stream(u).unwrap();
    ooms
}

/// Three threads of traffic on all three stream kinds under a cap of a few superblocks, while
/// a fourth runs `trim(false)`, `trim(true)`, `flush`, `release_thread` and moves the cap
/// between 2 and 16 MiB. No panic, no deadlock, out of memory only as `OutOfMemory` with the
/// size asked, no overlap, no reuse before a fence; then, everything freed and trimmed, the
/// whole cap can be allocated again, and every byte comes back.
#[test]
fn maintenance_racing_traffic_under_a_moving_tight_cap() {
    let _g = serial();
    within(120, || {
        let sim = host(30);
        let a = alloc_with(&sim, small());
        a.set_limit_bytes(8 << 20);
        let live = Arc::new(Live::default());
        let handed = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let maint = {
            let (a, stop) = (a.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut x = 0x1234_5678u64;
                let mut calls = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match rng(&mut x) % 6 {
                        0 => drop(a.trim(false).unwrap()),
                        1 => drop(a.trim(true).unwrap()),
                        2 => a.flush().unwrap(),
                        3 => a.release_thread().unwrap(),
                        _ => a.set_limit_bytes((2 << 20) + (rng(&mut x) as usize % (14 << 20))),
                    }
                    calls += 1;
                    std::thread::sleep(Duration::from_micros(200));
                }
                a.release_thread().unwrap();
                calls
            })
        };
        let hs: Vec<_> = (0..3u64)
            .map(|i| {
                let (a, sim, live, handed) = (a.clone(), sim.clone(), Arc::clone(&live), Arc::clone(&handed));
                std::thread::spawn(move || traffic(&a, &sim, &live, &handed, i + 1, 20_000))
            })
            .collect();
        let ooms: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        stop.store(true, Ordering::Relaxed);
        let calls = maint.join().unwrap();
        free_handed(&a, &sim, &live, &handed);
        println!("{ooms} out-of-memory errors, {calls} maintenance calls: {:?}", a.stats());
        assert!(
            ooms > 0 && calls > 100,
            "the cap was reached ({ooms} OOMs) and maintenance ran ({calls} calls)"
        );
        no_violations(&sim);
        // Everything freed: under an 8 MiB cap, 8 MiB can be had again (2 MiB large blocks
        // on the per-thread stream, then small ones to the last superblock).
        a.set_limit_bytes(8 << 20);
        a.trim(true).unwrap();
        let mut got = Vec::new();
        let mut total = 0;
        for size in [2 << 20, 64 << 10] {
            while let Ok(p) = a.allocate_per_thread(size) {
                got.push((p, size));
                total += size;
            }
        }
        assert!(total >= 6 << 20, "only {total} B of an 8 MiB cap could be had again: {:?}", a.stats());
        for (p, size) in got {
            a.deallocate_per_thread(p, size).unwrap();
        }
        a.set_limit_bytes(1 << 30);
        all_back(&a, &sim);
    });
}
