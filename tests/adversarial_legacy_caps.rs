//! Adversarial pass on the legacy keep-back caps (`legacy_batch` = 256 blocks, `legacy_batch_bytes`
//! = 64 MiB by default, were the remote batch's 64 / 4 MiB): a thread's own frees on the legacy
//! stream are kept back in its legacy arena (`Arena::free_legacy`) until one legacy action. With
//! the larger caps much more memory can be kept back, so these tests lean on what must then
//! hold: kept-back memory is never stranded (out of memory on another thread or on the owner's
//! other arena, `trim`, `release_thread`, thread exit, `flush` all take it), its reuse is
//! ordered after its earlier uses on another thread's per-thread stream (the race checker; each
//! fencing test fails with `skip_fences_for_testing`), bad frees of kept-back blocks are refused
//! and change nothing, and `live_bytes` is exact while frees are kept back.

use std::sync::mpsc;
use std::time::Duration;

use cuarena::{Allocator, Config, ConfigBuilder, DeviceAddr, Error, Stream};
use cuarena_testkit::{HostDevice, assert_all_returned, host_allocator};

mod common;
use common::*;

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

/// The configuration, with fences skipped where `skip` (to show a fencing test can fail).
fn build(b: ConfigBuilder, skip: bool) -> Config {
    if skip { b.skip_fences_for_testing().build().unwrap() } else { b.build().unwrap() }
}

/// Uses `blocks` on a fresh thread's per-thread stream (a long hold with a tag check), and
/// returns while those uses still run. The blocks' later free on the legacy stream covers
/// them (legacy work waits for all earlier per-thread work); a reuse on yet another per-thread
/// stream is ordered after them only through a legacy-stream action.
fn use_elsewhere(sim: &HostDevice, blocks: &[(DeviceAddr, usize)], tag0: u32, hold_ms: u64) {
    let (sim2, blocks) = (sim.clone(), blocks.to_vec());
    std::thread::spawn(move || {
        for (i, (p, len)) in blocks.iter().enumerate() {
            sim2.hold_and_check(
                p.0,
                *len,
                tag0 + i as u32,
                Duration::from_millis(hold_ms),
                Stream::PER_THREAD,
            )
            .unwrap();
        }
    })
    .join()
    .unwrap();
}

/// Races and tag errors seen by the simulator, after the device is idle.
fn races(sim: &HostDevice) -> (Vec<String>, u64) {
    sim.synchronize();
    (sim.violations(), sim.tag_errors())
}

// ---------------------------------------------------------------------------------------------
// Out of memory with kept-back frees in superblocks that also hold used blocks.

/// A large superblock (8 MiB, for 2 MiB requests) full of the owner's legacy blocks: the first
/// two (4 MiB, adjacent) freed on the legacy stream and kept back, the last two still in use.
/// The owner then idles. Another thread needs 4 MiB under a cap of 8 MiB: only the kept-back
/// frees can give it. Out of memory must take them (the reclaim dissolves superblocks "with
/// free or pending space", and the kept-back blocks are pending), ordered after their uses on
/// a third thread's per-thread stream.
/// With `same_thread`, the owner itself needs the 4 MiB on its per-thread stream (another arena
/// of its own: the legacy arena's slow path, which releases kept-back frees, does not run).
fn oom_takes_kept_back_frees_from_a_full_superblock(
    skip: bool,
    same_thread: bool,
) -> (bool, Vec<String>, u64) {
    let sim = host(0);
    let cfg = build(Config::builder().max_bytes(8 * MIB).chunk(8 * MIB), skip);
    let a = host_allocator(sim.clone(), cfg).unwrap();
    let owner = Worker::new(&a);
    let sim2 = sim.clone();
    let live: Vec<DeviceAddr> = owner.run(move |a| {
        let ps: Vec<_> = (0..4).map(|_| a.allocate(2 * MIB, Stream::LEGACY).unwrap()).collect();
        let mut sorted = ps.clone();
        sorted.sort();
        assert_eq!(sorted[3].0 - sorted[0].0, 6 * MIB as u64, "one 8 MiB superblock: {ps:?}");
        use_elsewhere(&sim2, &[(sorted[0], 2 * MIB), (sorted[1], 2 * MIB)], 100, 40);
        a.deallocate(sorted[0], 2 * MIB, Stream::LEGACY).unwrap();
        a.deallocate(sorted[1], 2 * MIB, Stream::LEGACY).unwrap();
        sorted[2..].to_vec()
    });
    assert_eq!(a.stats().reserved_bytes as usize, 8 * MIB);
    assert_eq!(a.stats().live_bytes as usize, 4 * MIB, "kept-back frees are not live");
    // The owner is idle, holding 4 MiB kept back (or needs them itself).
    let need = move |a: &Allocator, sim: &HostDevice| {
        let got = a.allocate_per_thread(4 * MIB);
        if let Ok(p) = got {
            sim.fill(p.0, 4 * MIB, 0xee, Stream::PER_THREAD).unwrap();
        }
        let r = races(sim);
        if let Ok(p) = got {
            a.deallocate_per_thread(p, 4 * MIB).unwrap();
        }
        (got.is_ok(), r)
    };
    let (ok, (v, t)) = if same_thread {
        let sim2 = sim.clone();
        owner.run(move |a| need(a, &sim2))
    } else {
        need(&a, &sim)
    };
    owner.run(move |a| {
        for p in live {
            a.deallocate(p, 2 * MIB, Stream::LEGACY).unwrap();
        }
    });
    owner.exit();
    if !skip {
        assert_all_returned(&a, Some(&sim), 0);
    }
    (ok, v, t)
}

#[test]
fn oom_on_another_thread_takes_kept_back_frees_from_a_superblock_with_used_blocks() {
    let (ok, v, t) = oom_takes_kept_back_frees_from_a_full_superblock(false, false);
    assert!(ok, "out of memory while 4 MiB were only kept back by an idle thread");
    assert!(v.is_empty(), "{v:?}");
    assert_eq!(t, 0);
}

#[test]
fn oom_on_the_owners_per_thread_stream_takes_its_own_kept_back_frees_from_a_superblock_with_used_blocks() {
    let (ok, v, t) = oom_takes_kept_back_frees_from_a_full_superblock(false, true);
    assert!(ok, "out of memory while 4 MiB were only kept back in the thread's own legacy arena");
    assert!(v.is_empty(), "{v:?}");
    assert_eq!(t, 0);
}
