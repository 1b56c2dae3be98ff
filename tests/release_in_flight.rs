//! Found by helper-22 (the one failure of `adversarial_slack::large_torture_legacy_with_trims`
//! in a CI run; older than that test, from the commit that let legacy arenas complete frees
//! on their own stream without a wait), and fixed: `Arena::exit` completes no batch, so each
//! pending block goes to the pool under its own batch's fence. Both tests failed every run
//! before the fix.
//!
//! A chunk released (or handed out again) while work on it is still in flight: thread exit
//! gives a legacy arena's superblocks back under the fence its outbox flush has *just*
//! recorded (`Slot::release_arena` passes it to `Arena::exit` as `recorded`), but `exit`
//! drains the inbox *after* that fence: a batch another thread freed on the legacy stream in
//! between (its uses queued after the exiting thread's fence) is completed at once by `poll`
//! (same stream as the arena's home: no wait) and merged into the free lists, which then go
//! to the pool guarded only by the older fence. `trim(false)` polls that fence, finds it
//! complete, and releases the chunk under the other thread's still-running kernel.
//!
//! The window (between the flush's record and the drain) is made wide here by a hook that
//! holds the exiting thread right after its flush's record.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use cuarena::{Allocator, Config, Device, DeviceAddr, Stream};
use cuarena_testkit::{HookedDevice, Hooks, HostConfig, HostDevice, Stall};

/// Runs the sequence up to the exiting thread's end: returns the simulated device and the
/// allocator, with thread T's 128 MiB superblock back in the pool under T's flush fence only,
/// while U's 400 ms kernel on it (queued after that fence) still runs.
fn exit_after_a_late_legacy_free() -> (HostDevice, Allocator) {
    let sim = HostDevice::new(HostConfig {
        capacity: 4 << 30,
        min_delay: Duration::ZERO,
        max_delay: Duration::ZERO,
        ..HostConfig::default()
    });
    // The thread armed here stalls right after its next record on the legacy stream (its
    // exit's outbox flush), until the test lets it go on.
    let stall = Stall::new();
    let stall_h = Arc::clone(&stall);
    let record: cuarena_testkit::hooked::EventHook = Box::new(move |sim, event, stream| {
        sim.record_event(event, stream)?;
        stall_h.here(stream.is_legacy());
        Ok(())
    });
    let dev = HookedDevice::new(sim.clone(), Hooks { record_event: Some(record), ..Hooks::default() });
    let a = Allocator::new(dev, Config::default()).unwrap();
    let legacy = Stream::LEGACY;

    // The main thread (U): a small block of its legacy arena (a 32 MiB chunk).
    let u = a.allocate(4096, legacy).unwrap();

    // Thread T: a 64 MiB block of its legacy arena, in a 128 MiB large superblock (its own
    // chunk); frees U's small block on the legacy stream (it waits in T's outbox: one block,
    // under `batch_bytes`), hands its own block to U and exits.
    let (to_t, t_rx) = mpsc::channel::<DeviceAddr>();
    let (to_main, main_rx) = mpsc::channel::<DeviceAddr>();
    let (a_t, stall_t) = (a.clone(), Arc::clone(&stall));
    let t = std::thread::spawn(move || {
        let b = a_t.allocate(64 << 20, legacy).unwrap();
        let u = t_rx.recv().unwrap();
        a_t.deallocate(u, 4096, legacy).unwrap();
        to_main.send(b).unwrap();
        stall_t.arm();
        // Flush: records F_T on the legacy stream (stalls here), then exit's drain, poll,
        // and give-back under F_T.
        a_t.release_thread().unwrap();
    });
    to_t.send(u).unwrap();
    let b = main_rx.recv().unwrap();
    stall.wait_stalled(); // T's flush has recorded F_T

    // U uses T's block on the legacy stream (queued after F_T) and frees it there: a batch of
    // 64 MiB is sent at once, under an event recorded after the use, into T's inbox.
    sim.hold_and_check(b.0, 4096, 0x5a5a_5a5a, Duration::from_millis(400), legacy).unwrap();
    a.deallocate(b, 64 << 20, legacy).unwrap();
    stall.release();
    t.join().unwrap();
    (sim, a)
}

#[test]
fn exit_gives_back_a_legacy_free_drained_after_its_flush_fence() {
    let (sim, a) = exit_after_a_late_legacy_free();
    // F_T has completed (it was queued before the use); the use has not.
    std::thread::sleep(Duration::from_millis(50));
    let released = a.trim(false).unwrap();
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "released {released} bytes: {v:?}");
    assert_eq!(sim.tag_errors(), 0);
}

/// The same memory handed to a user stream: the pool orders the new stream after F_T only
/// (seen complete), so the new owner's write overlaps U's kernel.
#[test]
fn exit_hands_a_range_in_use_to_another_stream() {
    let (sim, a) = exit_after_a_late_legacy_free();
    std::thread::sleep(Duration::from_millis(50));
    let s = sim.create_stream();
    let p = a.allocate(64 << 20, s).unwrap();
    sim.write_tag(p.0, 4096, 0x1234_5678, s).unwrap();
    sim.synchronize();
    let v = sim.violations();
    assert!(v.is_empty(), "{v:?}");
    assert_eq!(sim.tag_errors(), 0, "U's kernel saw its block overwritten");
}
