//! helper-24's attacks (twenty-third session) on the rule that cuarena makes no use of the legacy
//! stream, and no device synchronise, while a per-thread (blocking) stream is being captured.

mod common;

use common::{Worker, all_back, host, small};
use cuarena::{Allocator, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, host_allocator};

fn capturing(e: &Error) -> bool {
    matches!(e, Error::StreamCapturing { .. })
}

/// Ok, or a clear refusal (out of memory, or a capture refusal).
fn refused_ok(r: cuarena::Result<()>) -> cuarena::Result<()> {
    match r {
        Ok(()) | Err(Error::OutOfMemory { .. }) => Ok(()),
        Err(e) if capturing(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Captures this thread's per-thread stream around `work` (run on this thread, which must not
/// touch its own per-thread stream), then checks the capture ended intact with no violation.
fn captured<R>(dev: &HostDevice, work: impl FnOnce() -> R) -> R {
    dev.begin_capture(Stream::PER_THREAD).unwrap();
    let r = work();
    let ended = dev.end_capture(Stream::PER_THREAD);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    ended.expect("the capture was invalidated");
    r
}

/// Runs `setup` on a new thread, then captures this thread's per-thread stream while that
/// thread exits (its slot's drop runs during the capture); returns what `setup` gave.
fn exits_during_a_capture<R: Send + 'static>(
    dev: &HostDevice,
    setup: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<R>();
    let worker = std::thread::spawn(move || {
        ready_tx.send(setup()).unwrap();
        go_rx.recv().unwrap();
    });
    let r = ready_rx.recv().unwrap();
    captured(dev, || {
        go_tx.send(()).unwrap();
        worker.join().unwrap();
    });
    r
}

/// Blocks of a live `owner` freed by `freer` on the legacy stream: they wait in `freer`'s
/// outbox, not a full batch.
fn legacy_frees_waiting(dev: &HostDevice, owner: &Worker, freer: &Worker, n: usize) {
    let blocks = owned_blocks(dev, owner, n);
    freer.run(move |a| {
        for (p, n) in blocks {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
}

fn finish(a: &Allocator, dev: &HostDevice) {
    let _ = a.take_deferred_error();
    all_back(a, dev);
}

/// Blocks owned by worker `owner` (its per-thread arena), tagged.
fn owned_blocks(dev: &HostDevice, owner: &Worker, n: usize) -> Vec<(DeviceAddr, usize)> {
    let d = dev.clone();
    owner.run(move |a| {
        (0..n)
            .map(|i| {
                let size = 512 + i * 1031;
                let p = a.allocate_per_thread(size).unwrap();
                d.write_tag(p.0, 256, 0x1000 + i as u32, Stream::PER_THREAD).unwrap();
                (p, size)
            })
            .collect()
    })
}

/// (b) A thread's remote frees on the legacy stream wait in its outbox (to a live owner)
/// from before the capture; during the capture it calls `flush`.
#[test]
fn pending_remote_legacy_frees_flushed_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    legacy_frees_waiting(&dev, &owner, &freer, 4);
    let r = captured(&dev, || freer.run(|a| a.flush()));
    eprintln!("flush during the capture: {r:?}");
    refused_ok(r).expect("a clear result");
    freer.run(|a| a.flush()).unwrap();
    owner.run(|a| a.flush()).unwrap();
    drop(freer);
    drop(owner);
    finish(&a, &dev);
}

/// (b) The same, the freeing thread releasing itself during the capture.
#[test]
fn pending_remote_legacy_frees_at_release_thread_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    legacy_frees_waiting(&dev, &owner, &freer, 4);
    let r = captured(&dev, || freer.run(|a| refused_ok(a.release_thread())));
    r.expect("a clear result");
    owner.run(|a| a.flush()).unwrap();
    drop(freer);
    drop(owner);
    finish(&a, &dev);
}

/// (b) The same, the freeing thread exiting during the capture (its slot's drop).
#[test]
fn pending_remote_legacy_frees_at_thread_exit_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let blocks = owned_blocks(&dev, &owner, 4);
    let a2 = a.clone();
    // The freeing thread exits with the frees pending.
    exits_during_a_capture(&dev, move || {
        for (p, n) in blocks {
            a2.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
    owner.run(|a| a.flush()).unwrap();
    drop(owner);
    finish(&a, &dev);
}

/// (a) Pending remote legacy frees, then during the capture the same thread frees on its
/// per-thread stream (the outbox switches stream: its legacy batch is sent first).
#[test]
fn pending_remote_legacy_frees_then_a_per_thread_free_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    let blocks = owned_blocks(&dev, &owner, 6);
    let (legacy, later) = blocks.split_at(3);
    let (legacy, later) = (legacy.to_vec(), later.to_vec());
    freer.run(move |a| {
        for (p, n) in legacy {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
    let later2 = later.clone();
    let refused: Vec<_> = captured(&dev, || {
        freer.run(move |a| {
            later2
                .into_iter()
                .filter_map(|(p, n)| match a.deallocate_per_thread(p, n) {
                    Ok(()) => None,
                    Err(e) if capturing(&e) => Some((p, n)),
                    Err(e) => panic!("unclear refusal: {e}"),
                })
                .collect()
        })
    });
    // Whatever was refused is still live: free it now.
    freer.run(move |a| {
        for (p, n) in refused {
            a.deallocate_per_thread(p, n).unwrap();
        }
        a.flush().unwrap();
    });
    owner.run(|a| a.flush()).unwrap();
    drop(freer);
    drop(owner);
    finish(&a, &dev);
}

/// (b) A thread with kept-back own legacy frees (a few, below a batch) and live legacy blocks
/// exits during the capture; the live blocks are freed after it on another thread.
#[test]
fn kept_back_legacy_frees_and_live_legacy_blocks_at_exit_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (a2, d2) = (a.clone(), dev.clone());
    let live = exits_during_a_capture(&dev, move || {
        let mut live = Vec::new();
        for i in 0..6usize {
            let n = 1024 + i * 512;
            let p = a2.allocate(n, Stream::LEGACY).unwrap();
            d2.write_tag(p.0, 256, 0x2000 + i as u32, Stream::LEGACY).unwrap();
            if i % 2 == 0 {
                a2.deallocate(p, n, Stream::LEGACY).unwrap(); // kept back
            } else {
                live.push((p, n));
            }
        }
        live
    });
    assert_eq!(a.take_deferred_error(), None);
    for (i, &(p, n)) in live.iter().enumerate() {
        dev.check_tag(p.0, 256, 0x2001 + 2 * i as u32, Stream::LEGACY).unwrap();
        a.deallocate(p, n, Stream::LEGACY).unwrap();
    }
    finish(&a, &dev);
}

/// (b) A thread holding only kept-back legacy frees (nothing else held) exits during the capture.
#[test]
fn only_kept_back_legacy_frees_at_exit_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let a2 = a.clone();
    exits_during_a_capture(&dev, move || {
        let p = a2.allocate(4096, Stream::LEGACY).unwrap();
        a2.deallocate(p, 4096, Stream::LEGACY).unwrap();
    });
    assert_eq!(a.take_deferred_error(), None);
    finish(&a, &dev);
}

/// (a) Memory freed on the legacy stream by several threads (pool blocks: lazy legacy fence;
/// arena blocks) reused during the capture on per-thread streams and on user streams of other
/// threads, tags checked; a user stream's reuse may be refused, never unfenced.
#[test]
fn legacy_frees_reused_on_per_thread_and_user_streams_during_a_capture() {
    let dev = host(50);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
    for t in 0..3u32 {
        let (a2, d2) = (a.clone(), dev.clone());
        std::thread::spawn(move || {
            for i in 0..6u32 {
                let n = if i.is_multiple_of(2) { 1 << 20 } else { 8 << 10 };
                let p = a2.allocate(n, Stream::LEGACY).unwrap();
                d2.write_tag(p.0, 256, 0x3000 + t * 16 + i, Stream::LEGACY).unwrap();
                a2.deallocate(p, n, Stream::LEGACY).unwrap();
            }
            a2.release_thread().unwrap();
        })
        .join()
        .unwrap();
    }
    let results: Vec<cuarena::Result<()>> = captured(&dev, || {
        (0..3u32)
            .map(|t| {
                let (a2, d2) = (a.clone(), dev.clone());
                std::thread::spawn(move || -> cuarena::Result<()> {
                    let u = d2.create_stream();
                    let mut out = Ok(());
                    for i in 0..12u32 {
                        let n = if i.is_multiple_of(2) { 1 << 20 } else { 8 << 10 };
                        let s = if (i + t) % 3 == 0 { u } else { Stream::PER_THREAD };
                        match a2.allocate(n, s) {
                            Ok(p) => {
                                d2.write_tag(p.0, 256, 0x4000 + t * 64 + i, s)?;
                                d2.check_tag(p.0, 256, 0x4000 + t * 64 + i, s)?;
                                a2.deallocate(p, n, s)?;
                            }
                            Err(e) if capturing(&e) || matches!(e, Error::OutOfMemory { .. }) => {}
                            Err(e) => out = Err(e),
                        }
                    }
                    refused_ok(a2.release_thread())?;
                    d2.destroy_stream(u)?;
                    out
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect()
    });
    for r in results {
        r.expect("a clear result");
    }
    finish(&a, &dev);
}

/// (c) Out of memory under a limit with lazy-legacy pool memory, parked arenas and idle
/// arenas, `trim(true)`, `trim(false)`, `flush`, `release_thread`, on other threads.
#[test]
fn out_of_memory_trim_flush_release_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
    // Lazy legacy pool memory and a legacy arena with free memory on an idle thread.
    let idle = Worker::new(&a);
    idle.run(|a| {
        let ps: Vec<_> = (0..4).map(|_| a.allocate(1 << 20, Stream::LEGACY).unwrap()).collect();
        ps.into_iter().for_each(|p| a.deallocate(p, 1 << 20, Stream::LEGACY).unwrap());
        let qs: Vec<_> = (0..16).map(|_| a.allocate(32 << 10, Stream::LEGACY).unwrap()).collect();
        qs.into_iter().for_each(|p| a.deallocate(p, 32 << 10, Stream::LEGACY).unwrap());
        a.flush().unwrap();
    });
    let r: cuarena::Result<()> = captured(&dev, || {
        let (a2, d2) = (a.clone(), dev.clone());
        std::thread::spawn(move || -> cuarena::Result<()> {
            let u = d2.create_stream();
            a2.set_limit_bytes(a2.stats().reserved_bytes as usize);
            for s in [Stream::PER_THREAD, u] {
                for n in [4 << 20, 1 << 20, 32 << 10] {
                    match a2.allocate(n, s) {
                        Ok(p) => {
                            d2.write_tag(p.0, 256, 7, s)?;
                            a2.deallocate(p, n, s)?;
                        }
                        Err(e) if capturing(&e) || matches!(e, Error::OutOfMemory { .. }) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            for blocking in [false, true] {
                match a2.trim(blocking) {
                    Ok(_) => {}
                    Err(e) if capturing(&e) => {}
                    Err(e) => return Err(e),
                }
            }
            refused_ok(a2.flush())?;
            a2.set_limit_bytes(usize::MAX);
            refused_ok(a2.release_thread())?;
            d2.destroy_stream(u)
        })
        .join()
        .unwrap()
    });
    r.expect("a clear result");
    drop(idle);
    finish(&a, &dev);
}

/// (d) `deallocate_used_on` during the capture naming per-thread and user streams, for blocks
/// owned by another thread.
#[test]
fn record_stream_frees_during_a_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let blocks = owned_blocks(&dev, &owner, 8);
    let b2 = blocks.clone();
    let (a2, d2) = (a.clone(), dev.clone());
    let left: Vec<(DeviceAddr, usize)> = captured(&dev, || {
        std::thread::spawn(move || {
            let u = d2.create_stream();
            let mut left = Vec::new();
            for (i, (p, n)) in b2.into_iter().enumerate() {
                let r = match i % 4 {
                    0 => a2.deallocate_used_on(p, n, Stream::PER_THREAD, &[u]),
                    1 => a2.deallocate_used_on(p, n, u, &[Stream::PER_THREAD]),
                    2 => a2.deallocate_used_on(p, n, u, &[Stream::PER_THREAD, u]),
                    _ => a2.deallocate_used_on(p, n, Stream::PER_THREAD, &[Stream::PER_THREAD]),
                };
                match r {
                    Ok(()) => {}
                    Err(e) if capturing(&e) => left.push((p, n)),
                    Err(e) => panic!("unclear: {e}"),
                }
            }
            a2.flush().unwrap();
            a2.release_thread().unwrap();
            d2.destroy_stream(u).unwrap();
            left
        })
        .join()
        .unwrap()
    });
    assert!(left.is_empty(), "refused for no reason: {left:?}");
    owner.run(|a| a.flush()).unwrap();
    drop(owner);
    finish(&a, &dev);
}

/// (e) The capturing thread allocates and frees on its own user streams during its capture,
/// after using the legacy stream (its legacy arena holds memory, the pool lazy fences).
#[test]
fn the_capturing_thread_uses_its_user_streams_during_its_capture() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
    for n in [4096usize, 1 << 20, 40 << 10] {
        let p = a.allocate(n, Stream::LEGACY).unwrap();
        a.deallocate(p, n, Stream::LEGACY).unwrap();
    }
    a.flush().unwrap();
    let u = dev.create_stream();
    let v = dev.create_stream();
    let mut held = Vec::new();
    captured(&dev, || {
        for i in 0..60usize {
            let n = [512, 40 << 10, 1 << 20, 3 << 20][i % 4];
            let s = if i % 2 == 0 { u } else { v };
            match a.allocate(n, s) {
                Ok(p) => {
                    dev.write_tag(p.0, 256, i as u32, s).unwrap();
                    // free half on the other stream
                    let fs = if i % 3 == 0 { if s == u { v } else { u } } else { s };
                    match a.deallocate_used_on(p, n, fs, &[s]) {
                        Ok(()) => {}
                        Err(e) if capturing(&e) => held.push((p, n, fs)),
                        Err(e) => panic!("unclear: {e}"),
                    }
                }
                Err(e) if capturing(&e) => {}
                Err(e) => panic!("unclear: {e}"),
            }
        }
        match a.trim(false) {
            Ok(_) => {}
            Err(e) if capturing(&e) => {}
            Err(e) => panic!("unclear: {e}"),
        }
        refused_ok(a.flush()).unwrap();
    });
    for (p, n, s) in held {
        a.deallocate(p, n, s).unwrap();
    }
    a.flush().unwrap();
    a.release_thread().unwrap();
    dev.synchronize();
    a.trim(true).unwrap();
    dev.destroy_stream(u).unwrap();
    dev.destroy_stream(v).unwrap();
    finish(&a, &dev);
}

/// Race checker: memory freed on the legacy stream under long legacy work, wanted during the
/// capture on a per-thread stream (its reuse needs a legacy event: refused, or served from
/// other memory) and, after it, reused on a per-thread and a user stream (must be fenced).
#[test]
fn legacy_frees_under_long_legacy_work_reused_without_race() {
    let dev = host(200);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
    let size = |i: usize| if i.is_multiple_of(2) { 1 << 20 } else { 16 << 10 };
    let ps: Vec<_> = (0..6).map(|i| (a.allocate(size(i), Stream::LEGACY).unwrap(), size(i))).collect();
    for (i, &(p, _)) in ps.iter().enumerate() {
        let hold = std::time::Duration::from_millis(30);
        dev.hold_and_check(p.0, 256, 0x5000 + i as u32, hold, Stream::LEGACY).unwrap();
    }
    for &(p, n) in &ps {
        a.deallocate(p, n, Stream::LEGACY).unwrap();
    }
    a.flush().unwrap();
    let (a2, d2) = (a.clone(), dev.clone());
    captured(&dev, || {
        std::thread::spawn(move || {
            for i in 0..6u32 {
                let n = if i.is_multiple_of(2) { 1 << 20 } else { 16 << 10 };
                match a2.allocate_per_thread(n) {
                    Ok(p) => {
                        d2.write_tag(p.0, 256, 0x6000 + i, Stream::PER_THREAD).unwrap();
                        a2.deallocate_per_thread(p, n).unwrap();
                    }
                    Err(cuarena::Error::StreamCapturing { stream: 1 }) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            a2.release_thread().unwrap();
        })
        .join()
        .unwrap();
    });
    let a2 = a.clone();
    let d2 = dev.clone();
    std::thread::spawn(move || {
        for (i, n) in [(0u32, 1usize << 20), (1, 16 << 10)] {
            let p = a2.allocate_per_thread(n).unwrap();
            d2.write_tag(p.0, 256, 0x6100 + i, Stream::PER_THREAD).unwrap();
            a2.deallocate_per_thread(p, n).unwrap();
        }
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    let u = dev.create_stream();
    let ps2: Vec<_> = ps.iter().map(|&(_, n)| (a.allocate(n, u).unwrap(), n)).collect();
    for &(p, n) in &ps2 {
        dev.write_tag(p.0, 256, 0x7000, u).unwrap();
        a.deallocate(p, n, u).unwrap();
    }
    a.flush().unwrap();
    dev.synchronize();
    a.trim(true).unwrap();
    dev.destroy_stream(u).unwrap();
    finish(&a, &dev);
}

/// Control: the race checker does catch an unfenced reuse on a user stream of memory under
/// running legacy work (so the test above would see a missing fence).
#[test]
fn the_race_checker_catches_unfenced_user_stream_reuse() {
    let dev = host(200);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let p = a.allocate(4096, Stream::LEGACY).unwrap();
    dev.write_tag(p.0, 256, 1, Stream::LEGACY).unwrap();
    dev.hold_and_check(p.0, 256, 1, std::time::Duration::from_millis(50), Stream::LEGACY).unwrap();
    let u = dev.create_stream();
    dev.write_tag(p.0, 256, 2, u).unwrap(); // no fence: a race
    dev.synchronize();
    assert!(!dev.violations().is_empty() || dev.tag_errors() > 0, "the checker saw nothing");
    a.deallocate(p, 4096, Stream::LEGACY).unwrap();
    dev.destroy_stream(u).unwrap();
}

/// Control for the `pending_remote_legacy_frees_*` tests: the same without a capture.
#[test]
fn pending_remote_legacy_frees_without_a_capture_come_back() {
    let dev = host(20);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let owner = Worker::new(&a);
    let freer = Worker::new(&a);
    let blocks = owned_blocks(&dev, &owner, 4);
    freer.run(move |a| {
        for (p, n) in blocks {
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    });
    freer.run(|a| a.flush()).unwrap();
    owner.run(|a| a.flush()).unwrap();
    drop(freer);
    drop(owner);
    finish(&a, &dev);
}
