//! Nineteenth session's attack on CUDA graph pools (`src/graph_pool.rs`, the `graph_*` parts of
//! `src/allocator.rs`, `GlobalPool::take_segment` / `give_back_segment`), on the simulated
//! device.
//!
//! Tests marked `// WAS A DEFECT:` failed when helper-18 wrote them, and say why; each passes
//! since its mend (named at the test). Every test is kept as a regression test. The oracles: the host device's race checker (an event recorded or waited
//! on a capturing stream, and unordered overlapping work, are violations) and tag checks, range
//! checks against the pools' blocks, `stats()`, `check_invariants()`, and
//! `assert_all_returned`.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

use cuarena::trace::{self, Action};
use cuarena::{Allocator, DeviceAddr, Error, GraphPoolId, InvalidFree, Stream};
use cuarena_testkit::{HostConfig, HostDevice, assert_all_returned, host_allocator};

mod common;
use common::{Live, host, rng, small, within};

// ---------------------------------------------------------------------------------------------
// Helpers.

const MIB: usize = 1 << 20;

/// The bytes a pool hands out for `n`.
fn rounded(n: usize) -> usize {
    n.next_multiple_of(512)
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Ranges (address, bytes) that eager allocations must stay out of, checked under a lock.
#[derive(Default)]
struct Forbidden(Mutex<Vec<(u64, u64)>>);

impl Forbidden {
    fn add(&self, p: DeviceAddr, n: usize) {
        self.0.lock().unwrap().push((p.0, rounded(n) as u64));
    }
    fn hit(&self, p: DeviceAddr, n: usize) -> Option<(u64, u64)> {
        self.0.lock().unwrap().iter().copied().find(|&g| overlaps((p.0, n as u64), g))
    }
}

fn assert_clean(dev: &HostDevice) {
    let v = dev.violations();
    assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
    assert_eq!(dev.tag_errors(), 0, "tag errors");
}

fn is_invalid(r: &cuarena::Result<()>) -> bool {
    matches!(r, Err(Error::InvalidFree { .. }))
}

// =============================================================================================
// Defects (these fail today).

// WAS A DEFECT (mended: `segment_bytes` checks its rounding and answers `None`, out of
// memory): `graph_pool::segment_bytes` computes `len.next_multiple_of(2 MiB)` unchecked. Under a
// cap above the device (`set_limit_bytes(usize::MAX)`, or `max=` in bytes, which may exceed
// the device), `graph_allocate` lets a size within 2 MiB of `usize::MAX` through its
// `size > limit.max(total)` guard, and the rounding overflows: a panic ("attempt to add with
// overflow") in debug builds; in release builds a segment of 0 bytes, a zero-length
// `GraphSegment` left in the global pool's `used` and a 0-byte segment in the graph pool, then
// the `expect("a new segment fits the request")` panic (checked: `check_invariants` panics
// afterwards; the C ABI's `guard` catches the panic and returns NULL, leaving that state). The
// ordinary `allocate` answers the same sizes with `OutOfMemory`. Fix: `len.checked_next_multiple_of(2 MiB)` in `segment_bytes`
// (returning `Option`, mapped to `OutOfMemory`), or refuse `size > total` in `graph_allocate`
// as no device can hold it.
#[test]
fn a_huge_graph_request_under_an_unbounded_cap_is_out_of_memory_not_a_panic() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    a.set_limit_bytes(usize::MAX);
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 1);
    a.graph_pool_retain(pool);
    let mut panicked = Vec::new();
    for size in [usize::MAX - 4096, usize::MAX - MIB, usize::MAX - 511 - 2 * MIB + 1, usize::MAX / 2 + 1] {
        match catch_unwind(AssertUnwindSafe(|| a.graph_allocate(pool, size, s))) {
            Ok(Err(Error::OutOfMemory { requested, .. })) => assert_eq!(requested, size),
            Ok(other) => panic!("graph_allocate({size:#x}): {other:?}"),
            Err(_) => panicked.push(format!("{size:#x}")),
        }
        // The ordinary path, for comparison: out of memory.
        assert!(matches!(a.allocate(size, s), Err(Error::OutOfMemory { .. })), "allocate({size:#x})");
    }
    assert!(panicked.is_empty(), "graph_allocate panicked for sizes {panicked:?}");
    a.check_invariants();
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

// WAS A DEFECT (mended: `take_segment` cuts a segment on a 512-byte boundary): `graph_allocate` promises 512-byte aligned blocks (doc comment, `BLOCK_ALIGN`,
// PyTorch's kMinBlockSize), but a pool's blocks are 512-byte multiples from its segment's base,
// and `GlobalPool::take_segment` cuts a segment at the start of the lowest clear free extent,
// which is only 256-byte aligned (`GRANULE`): a global-pool block of 1 MiB + 256 bytes leaves
// the rest of its chunk starting on an odd granule, and the pool's segment, and so every block
// in it, is off by 256. Fix: in `take_segment`, cut the segment at the extent's start rounded
// up to 512 (or better, 2 MiB, as cudaMalloc'd segments are) and require the extent to hold it
// from there; `carve` already keeps the piece before.
#[test]
fn graph_blocks_are_512_byte_aligned_in_a_segment_cut_after_a_pool_block_of_odd_granules() {
    let dev = host(0);
    // Pool blocks over 64 KiB; 8 MiB chunks, so a chunk's rest is long enough for a segment.
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).chunk(8 * MIB).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let odd = MIB + 256;
    let e = a.allocate(odd, s).unwrap(); // the pool's block: its end is on an odd granule
    let pool = GraphPoolId(19, 2);
    a.graph_pool_retain(pool);
    let mut blocks = Vec::new();
    for n in [1000usize, 512, 70_000, 300] {
        blocks.push((a.graph_allocate(pool, n, s).unwrap(), n));
    }
    a.check_invariants();
    let misaligned: Vec<String> = blocks
        .iter()
        .filter(|(p, _)| p.0 % 512 != 0)
        .map(|(p, n)| format!("{n} bytes at {:#x}", p.0))
        .collect();
    for (p, n) in blocks {
        a.deallocate(p, n, s).unwrap();
    }
    a.deallocate(e, odd, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(misaligned.is_empty(), "graph blocks not 512-byte aligned: {misaligned:?}");
    assert_all_returned(&a, Some(&dev), 0);
}

// WAS A DEFECT (mended: a free outside a capture keeps the stream's identity and a fence;
// another stream reuses it only behind that fence): reuse inside a pool is keyed by the stream *handle* (`Reuse::On(handle, 0)`) with no
// fence, and CUDA gives a destroyed stream's handle to the next stream created. A block freed on
// user stream `s1` while `s1`'s work on it still runs (a legal free: that work is ordered before
// later work on `s1`), then `s1` destroyed and `s2` created with the same handle: `s2`'s
// allocation gets the block at once and its work races `s1`'s (the race checker reports it).
// cuarena's ordinary paths guard against exactly this (allocator.rs, "A user arena's own
// frees": identities, not handles; see `the_ordinary_path_keeps_a_destroyed_streams_pending_free_from_its_handles_next_stream`
// below, which passes). The module comment justifies the handle by capture (`cuStreamGetId`
// breaks one), but neither this free nor this allocation is on a capturing stream. Fix: a free
// on a stream that is not capturing (`cuStreamIsCapturing` is allowed) records the stream's
// identity in its reuse class (`On(handle, key)`), and an allocation on a stream that is not
// capturing asks its identity and reuses only its own; a capturing stream's allocation reuses
// only frees made while that stream was capturing (or those ranges are fenced), or the rule is
// documented as a hazard in the README and the header.
#[test]
fn a_reused_stream_handle_does_not_get_a_destroyed_streams_pending_pool_free() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let pool = GraphPoolId(19, 3);
    a.graph_pool_retain(pool); // a MemPool, say: used outside any capture
    let s1 = dev.create_stream();
    let p = a.graph_allocate(pool, 4096, s1).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.write_tag(p.0, 4096, 0xaaaa, s1).unwrap(); // s1's work on the block: in flight
    a.deallocate(p, 4096, s1).unwrap();
    dev.destroy_stream(s1).unwrap(); // its queued work still runs
    let s2 = dev.create_stream();
    assert_eq!(s2, s1, "the simulator gives the handle to the next stream, as CUDA does");
    let q = a.graph_allocate(pool, 4096, s2).unwrap();
    dev.write_tag(q.0, 4096, 0xbbbb, s2).unwrap();
    gate.open();
    dev.synchronize();
    let v = dev.violations();
    a.deallocate(q, 4096, s2).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(
        v.is_empty(),
        "s2 got s1's block ({}) while s1's work on it ran: {:?}",
        if q == p { "the same address" } else { "an overlapping one" },
        &v[..v.len().min(2)]
    );
    assert_all_returned(&a, Some(&dev), 0);
}

// WAS A DEFECT (mended: `trim(true)` in pass-through mode gives parked segments back after a
// synchronise): in pass-through mode `Allocator::trim` returns `Ok(0)` before anything else, so it
// never runs `bury_zombies`: a retired graph pool's segments stay parked, and their chunks
// reserved, until the allocator is dropped (pass-through allocations never go out of memory
// through the pool either, so no other synchronise takes them). The README promises them back
// at "the next device synchronise that happens anyway (`trim(true)`, `cuarena_empty_cache`,
// ...)". Fix: in pass-through mode `trim(blocking)` still buries parked graph segments when
// blocking and trims the global pool (`inner.pool.trim`), which holds only graph segments then.
#[test]
fn pass_through_mode_gives_a_retired_pools_memory_back_at_trim_true() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().passthrough(true).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 4);
    a.graph_pool_retain(pool);
    let p = a.graph_allocate(pool, 3 * MIB, s).unwrap();
    let e = a.allocate(4096, s).unwrap(); // a pass-through block alongside
    a.deallocate(p, 3 * MIB, s).unwrap();
    a.deallocate(e, 4096, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_eq!(a.graph_pool_bytes(), 20 << 20, "parked");
    a.trim(true).unwrap();
    dev.synchronize();
    assert_eq!(
        (a.graph_pool_bytes(), dev.reserved_bytes()),
        (0, 0),
        "trim(true) in pass-through mode left the retired pool's segment parked and reserved"
    );
    assert_all_returned(&a, Some(&dev), 0);
}

// WAS A DEFECT (mended: pass-through allocations count the pool's reserved bytes, and a
// pool's growth the pass-through blocks): in pass-through mode the cap is checked twice, apart: pass-through allocations count
// only pass-through blocks against it (`Passthrough::allocate(.., limit)`), and a graph pool's
// growth counts only the global pool's chunks (`GlobalPool::grow`). Together they exceed the
// cap (`limit_bytes` is "the cap on reserved_bytes", and `set_memory_fraction` is PyTorch's
// per-process fraction): here 20 MiB of graph segment plus 24 MiB of pass-through blocks under
// a 32 MiB cap. Fix: pass the pool's reserved bytes into the pass-through check (and the
// pass-through live bytes into the pool's `room`), or document that graph pools are outside
// the cap in pass-through mode.
#[test]
fn pass_through_mode_counts_graph_segments_against_the_cap() {
    let dev = host(0);
    let a =
        host_allocator(dev.clone(), small().passthrough(true).max_bytes(32 * MIB).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 5);
    a.graph_pool_retain(pool);
    let p = a.graph_allocate(pool, 3 * MIB, s).unwrap(); // a 20 MiB segment
    let r = a.allocate(24 * MIB, s);
    let reserved = dev.reserved_bytes();
    if let Ok(e) = r {
        a.deallocate(e, 24 * MIB, s).unwrap();
    }
    a.deallocate(p, 3 * MIB, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(
        reserved <= 32 * MIB,
        "{} MiB reserved from the device under a 32 MiB cap (the pass-through allocation: {})",
        reserved / MIB,
        if r.is_ok() { "granted" } else { "refused" }
    );
}

// =============================================================================================
// What holds.

/// Graph-pool allocations are not traced (README), so their frees must not be either: a trace
/// holding frees of addresses it never saw allocated breaks the format's rule that each
/// address's records alternate alloc, free (`trace.rs`). Failed before d5ab8ad, which takes a
/// graph block's free before the trace.
#[test]
fn a_trace_records_graph_blocks_both_ways_or_not_at_all() {
    let dev = Arc::new(host(0));
    let a = Allocator::new(dev.clone(), small().build().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("cuarena-s19-graph-trace-{}.bin", std::process::id()));
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 6);
    a.start_trace(&path).unwrap();
    a.graph_pool_retain(pool);
    let mut blocks = Vec::new();
    for n in [5000usize, 1 << 20, 300] {
        blocks.push((a.graph_allocate(pool, n, s).unwrap(), n));
    }
    for &(p, n) in &blocks {
        a.deallocate(p, n, s).unwrap();
    }
    a.graph_pool_release(pool).unwrap();
    a.stop_trace().unwrap();
    let recs = trace::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let mut per: BTreeMap<u64, (u32, u32)> = BTreeMap::new();
    for r in &recs {
        let e = per.entry(r.ptr).or_default();
        match r.action {
            Action::Alloc => e.0 += 1,
            Action::Free => e.1 += 1,
            _ => {}
        }
    }
    for (p, _) in &blocks {
        let (allocs, frees) = per.get(&p.0).copied().unwrap_or_default();
        assert_eq!(allocs, frees, "graph block {:#x}: {allocs} allocations and {frees} frees traced", p.0);
    }
}

/// The ordinary path's answer to the handle reuse above, for contrast: a free on a user stream
/// whose work still runs is not handed to the next stream that gets the handle.
#[test]
fn the_ordinary_path_keeps_a_destroyed_streams_pending_free_from_its_handles_next_stream() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s1 = dev.create_stream();
    let p = a.allocate(4096, s1).unwrap();
    let gate = dev.gate(s1).unwrap();
    dev.write_tag(p.0, 4096, 0xaaaa, s1).unwrap();
    a.deallocate(p, 4096, s1).unwrap();
    dev.destroy_stream(s1).unwrap();
    let s2 = dev.create_stream();
    assert_eq!(s2, s1);
    let q = a.allocate(4096, s2).unwrap();
    dev.write_tag(q.0, 4096, 0xbbbb, s2).unwrap();
    gate.open();
    a.deallocate(q, 4096, s2).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Bad frees of graph blocks, in every shape: size 0, `usize::MAX`, a size of another 512-byte
/// multiple, interior pointers into live, free and held ranges, one past a segment, a foreign
/// pointer, NULL with a size, a double free (live pool, released pool, retired pool, and after
/// the segment went back to the global pool). Each is refused, counted once, and changes
/// nothing (live bytes, the pool's live list, the invariants). A size that rounds to the
/// block's is accepted (the ordinary path's rule too).
#[test]
fn bad_frees_of_graph_blocks_are_refused_counted_and_change_nothing() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s, t) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(19, 10);
    a.graph_pool_retain(pool);
    let p = a.graph_allocate(pool, 5000, s).unwrap(); // 5120 bytes
    let q = a.graph_allocate(pool, 4096, s).unwrap();
    let h = a.graph_allocate(pool, 2048, s).unwrap();
    let f = a.graph_allocate(pool, 8192, s).unwrap();
    a.deallocate(f, 8192, s).unwrap(); // a free range
    a.deallocate_used_on(h, 2048, s, &[t]).unwrap(); // a held range
    let mut bad = 0u64;
    let before = a.stats();
    let live_before = a.graph_pool_live(pool).unwrap();
    let attempts: Vec<(DeviceAddr, usize, &str)> = vec![
        (p, 0, "size 0"),
        (p, usize::MAX, "usize::MAX"),
        (p, 5121, "the next 512-byte multiple"),
        (p, 4608, "the previous 512-byte multiple"),
        (DeviceAddr(p.0 + 512), 512, "interior of a live block"),
        (DeviceAddr(p.0 + 256), 256, "off the 512 grid inside a live block"),
        (DeviceAddr(f.0 + 1024), 1024, "interior of a free range"),
        (f, 8192, "double free (free range)"),
        (DeviceAddr(h.0 + 512), 512, "interior of a held range"),
        (h, 2048, "double free (held)"),
        (DeviceAddr(0x10), 5000, "foreign"),
        (DeviceAddr::NULL, 5000, "NULL with a size"),
        (DeviceAddr(u64::MAX - 511), 512, "the top of the address space"),
    ];
    for (ptr, n, why) in attempts {
        let r = a.deallocate(ptr, n, s);
        assert!(is_invalid(&r), "{why}: {r:?}");
        bad += 1;
        let r = a.deallocate_used_on(ptr, n, s, &[t]);
        assert!(is_invalid(&r), "{why} (used_on): {r:?}");
        bad += 1;
        a.check_invariants();
    }
    let after = a.stats();
    assert_eq!(after.invalid_frees - before.invalid_frees, bad);
    assert_eq!((after.live_bytes, after.deallocations), (before.live_bytes, before.deallocations));
    assert_eq!(a.graph_pool_live(pool).unwrap(), live_before);
    // A size that rounds to the block's is the block's (as `block_bytes` on the ordinary path).
    a.deallocate(q, 3585, s).unwrap();
    // Released while `p` lives: a double free of `q` is still one.
    a.graph_pool_release(pool).unwrap();
    assert!(matches!(
        a.deallocate(q, 4096, s),
        Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
    ));
    bad += 1;
    // `p`'s free retires the pool: its segment is parked.
    a.deallocate(p, 5000, s).unwrap();
    assert_eq!(a.graph_pool_bytes(), 2 << 20);
    for (ptr, n) in [(p, 5000usize), (q, 4096), (h, 2048), (DeviceAddr(p.0 + 512), 512)] {
        assert!(is_invalid(&a.deallocate(ptr, n, s)), "{ptr:?} after the pool retired");
        bad += 1;
    }
    a.check_invariants();
    // After the synchronise the segment is the global pool's free memory: still refused.
    a.trim(true).unwrap();
    assert_eq!(a.graph_pool_bytes(), 0);
    for (ptr, n) in [(p, 5000usize), (q, 4096)] {
        assert!(is_invalid(&a.deallocate(ptr, n, s)), "{ptr:?} after the segment went back");
        bad += 1;
    }
    assert_all_returned(&a, Some(&dev), bad);
}

/// Retain and release out of balance: releases of unknown pools and one too many are refused
/// and change nothing; a retain after the last release while blocks live revives the pool
/// with them; ids differing in either half are different pools; `use_count` and `live` say so.
#[test]
fn retain_and_release_out_of_balance_are_refused_and_a_revived_pool_keeps_its_blocks() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let (p1, p2, p3) = (GraphPoolId(0, 0), GraphPoolId(u64::MAX, u64::MAX), GraphPoolId(0, u64::MAX));
    for id in [p1, p2, p3] {
        assert!(matches!(a.graph_pool_release(id), Err(Error::UnknownGraphPool { .. })));
        assert_eq!(a.graph_pool_use_count(id), 0);
    }
    a.graph_pool_retain(p1);
    a.graph_pool_retain(p1);
    a.graph_pool_retain(p2);
    assert_eq!(
        (a.graph_pool_use_count(p1), a.graph_pool_use_count(p2), a.graph_pool_use_count(p3)),
        (2, 1, 0)
    );
    assert!(matches!(a.graph_allocate(p3, 100, s), Err(Error::UnknownGraphPool { .. })));
    let x = a.graph_allocate(p1, 100, s).unwrap();
    let y = a.graph_allocate(p2, 100, s).unwrap();
    assert!(!overlaps((x.0, 512), (y.0, 512)));
    a.graph_pool_release(p1).unwrap();
    a.graph_pool_release(p1).unwrap();
    assert!(matches!(a.graph_pool_release(p1), Err(Error::UnknownGraphPool { .. })));
    assert_eq!(a.graph_pool_use_count(p1), 0);
    assert!(matches!(a.graph_pool_live(p1), Err(Error::UnknownGraphPool { .. })));
    assert!(matches!(a.graph_allocate(p1, 100, s), Err(Error::UnknownGraphPool { .. })));
    a.check_invariants();
    let bytes = a.graph_pool_bytes();
    assert_eq!(bytes, 4 << 20, "p1's segment stays while x lives; p2's");
    // Revived: the old block is live in it, new ones come from its memory.
    a.graph_pool_retain(p1);
    assert_eq!(a.graph_pool_live(p1).unwrap(), vec![x]);
    let z = a.graph_allocate(p1, 100, s).unwrap();
    assert_eq!(a.graph_pool_bytes(), bytes, "the revived pool's own segment serves");
    a.deallocate(x, 100, s).unwrap();
    assert_eq!(a.graph_pool_live(p1).unwrap(), vec![z]);
    a.graph_pool_release(p1).unwrap();
    assert_eq!(a.graph_pool_bytes(), bytes, "z lives");
    a.deallocate(z, 100, s).unwrap();
    a.deallocate(y, 100, s).unwrap();
    a.graph_pool_release(p2).unwrap();
    a.check_invariants();
    assert_all_returned(&a, Some(&dev), 0);
}

/// The sizes of a pool's segments: PyTorch's (2 MiB up to 1 MiB, 20 MiB below 10 MiB, else
/// rounded up to 2 MiB). A request of exactly 10 MiB takes a 10 MiB segment.
#[test]
fn segment_sizes_follow_pytorchs_boundaries() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let cases = [
        (1usize, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 1, 20 * MIB),
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB - 511, 10 * MIB), // rounds to 10 MiB: not below 10 MiB
        (10 * MIB, 10 * MIB),
        (10 * MIB + 1, 12 * MIB),
        (64 * MIB + 1, 66 * MIB),
    ];
    for (i, (n, seg)) in cases.into_iter().enumerate() {
        let pool = GraphPoolId(19, 100 + i as u64);
        a.graph_pool_retain(pool);
        let before = a.graph_pool_bytes();
        let p = a.graph_allocate(pool, n, s).unwrap();
        assert_eq!(a.graph_pool_bytes() - before, seg as u64, "request {n}");
        a.deallocate(p, n, s).unwrap();
        a.graph_pool_release(pool).unwrap();
    }
    assert_all_returned(&a, Some(&dev), 0);
}

/// A capture's blocks, "replayed" behind a closed gate (so the replay's work is surely in
/// flight) while eager work on every kind of stream, on several threads, churns and trims
/// without blocking: no eager block ever overlaps the retained pool's blocks (those freed in
/// the capture included), the race checker sees no unordered overlap, and the replay's tags are
/// intact when it runs.
#[test]
fn eager_work_never_lands_in_a_retained_pool_while_its_replay_runs() {
    within(120, || {
        let dev = host(20);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let s = dev.create_stream();
        let pool = GraphPoolId(19, 20);
        let forbidden = Arc::new(Forbidden::default());
        a.graph_pool_retain(pool);
        dev.begin_capture(s).unwrap();
        let mut x = 0x5151u64;
        let mut graph = Vec::new();
        for i in 0..60usize {
            let n = 256 + (rng(&mut x) % (if i % 10 == 0 { 3 * MIB } else { 200 << 10 }) as u64) as usize;
            let p = a.graph_allocate(pool, n, s).unwrap();
            forbidden.add(p, n);
            graph.push((p, n));
            if rng(&mut x).is_multiple_of(3) {
                let (p, n) = graph.swap_remove(rng(&mut x) as usize % graph.len());
                a.deallocate(p, n, s).unwrap(); // a temporary of the capture
            }
        }
        dev.end_capture(s).unwrap();
        // The replay: every block the capture handed out, behind the gate.
        let gate = dev.gate(s).unwrap();
        let all: Vec<(u64, u64)> = forbidden.0.lock().unwrap().clone();
        for (i, &(p, n)) in all.iter().enumerate() {
            dev.hold_and_check(p, n as usize, 0x7000 + i as u32, Duration::ZERO, s).unwrap();
        }
        let churned = Arc::new(Barrier::new(5));
        let opened = Arc::new(Barrier::new(5));
        let hits = Arc::new(Mutex::new(Vec::new()));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, dev, forbidden, churned, opened, hits) =
                (a.clone(), dev.clone(), forbidden.clone(), churned.clone(), opened.clone(), hits.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0x9e37_79b9u64 ^ (t + 1);
                let user = dev.create_stream();
                let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
                let mut mine: Vec<(DeviceAddr, usize, Stream)> = Vec::new();
                for i in 0..1500usize {
                    let st = streams[rng(&mut x) as usize % 3];
                    let n = match rng(&mut x) % 10 {
                        0 => 256 + (rng(&mut x) % (2 * MIB) as u64) as usize,
                        1..=3 => 64 * 1024 + (rng(&mut x) % (256 << 10)) as usize,
                        _ => 16 + (rng(&mut x) % 8192) as usize,
                    };
                    let p = a.allocate(n, st).unwrap();
                    if let Some(g) = forbidden.hit(p, n) {
                        hits.lock().unwrap().push(format!("eager {:#x}+{n} in graph block {g:x?}", p.0));
                    }
                    common::tag(&dev, p, n, ((t as u32) << 24) | i as u32, st);
                    mine.push((p, n, st));
                    while mine.len() > 12 || (!mine.is_empty() && rng(&mut x).is_multiple_of(2)) {
                        let (p, n, st) = mine.swap_remove(rng(&mut x) as usize % mine.len());
                        a.deallocate(p, n, st).unwrap();
                    }
                    // Nothing that may synchronise while the gate is closed (it would wait for
                    // ever): no release_thread (a parked user arena past its bound), no
                    // blocking trim, and no out of memory (the device is roomy).
                    match i % 300 {
                        100 => {
                            a.trim(false).unwrap();
                        }
                        200 => a.flush().unwrap(),
                        _ => {}
                    }
                }
                for (p, n, st) in mine {
                    a.deallocate(p, n, st).unwrap();
                }
                churned.wait();
                opened.wait(); // anything that synchronises only once the gate is open
                a.release_thread().unwrap();
            }));
        }
        churned.wait();
        gate.open();
        opened.wait();
        for h in hs {
            h.join().unwrap();
        }
        dev.synchronize();
        let hits = hits.lock().unwrap().clone();
        assert!(
            hits.is_empty(),
            "{} eager blocks in graph memory, first: {:?}",
            hits.len(),
            &hits[..hits.len().min(3)]
        );
        assert_clean(&dev);
        for (p, n) in graph {
            a.deallocate(p, n, s).unwrap();
        }
        a.graph_pool_release(pool).unwrap();
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// Pools grow during captures while eager threads churn on the per-thread, legacy and user
/// streams with work in flight on what they free (cross-thread frees included), and retired
/// pools' memory goes back to eager use (a blocking trim now and then): no event is recorded or
/// waited on the capturing stream, and no segment is cut from memory whose eager work may
/// still run (the capture's writes over whole blocks, and each graph's replays after its
/// capture, would race it). A stress test: it counts graph blocks that landed in memory eager
/// blocks had used before.
#[test]
fn pools_never_grow_into_memory_whose_eager_work_still_runs() {
    within(180, || {
        let dev = host(30);
        let a = host_allocator(dev.clone(), small().large_max(128 << 10).build().unwrap()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        // 64 KiB pages that eager blocks have covered.
        let eager_pages = Arc::new(Mutex::new(std::collections::HashSet::<u64>::new()));
        let (tx, rx) = mpsc::channel::<(DeviceAddr, usize)>();
        let rx = Arc::new(Mutex::new(rx));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let (a, dev, stop, tx, rx, pages) =
                (a.clone(), dev.clone(), stop.clone(), tx.clone(), rx.clone(), eager_pages.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0xdead_beefu64 ^ (t + 7);
                let user = dev.create_stream();
                let streams = [Stream::PER_THREAD, Stream::LEGACY, user];
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let st = streams[rng(&mut x) as usize % 3];
                    let n = match rng(&mut x) % 6 {
                        0 => (128 << 10) + (rng(&mut x) % (3 * MIB) as u64) as usize,
                        1 => 64 * 1024 + (rng(&mut x) % (64 << 10)) as usize,
                        _ => 16 + (rng(&mut x) % 16384) as usize,
                    };
                    let p = a.allocate(n, st).unwrap();
                    {
                        let mut pg = pages.lock().unwrap();
                        for page in (p.0 >> 16)..=((p.0 + n as u64 - 1) >> 16) {
                            pg.insert(page);
                        }
                    }
                    let hold = Duration::from_micros(rng(&mut x) % 300);
                    // The whole block for most; head and tail of the largest.
                    if n <= 256 << 10 {
                        dev.hold_and_check(p.0, n & !3, ((t as u32) << 24) | i, hold, st).unwrap();
                    } else {
                        dev.hold_and_check(p.0, 64 << 10, ((t as u32) << 24) | i, hold, st).unwrap();
                        dev.write_tag(p.0 + (n as u64 & !255) - 4096, 4096, i, st).unwrap();
                    }
                    if rng(&mut x).is_multiple_of(4) {
                        // Another thread frees it.
                        tx.send((p, n)).unwrap();
                        let got = rx.lock().unwrap().try_recv();
                        if let Ok((q, m)) = got {
                            // Its work ran on another thread's stream, which no stream of ours
                            // orders after (user streams are non-blocking): wait for the
                            // device, then free it on a stream of ours.
                            dev.synchronize();
                            a.deallocate(q, m, streams[rng(&mut x) as usize % 3]).unwrap();
                        }
                    } else {
                        a.deallocate(p, n, st).unwrap();
                    }
                    if i.is_multiple_of(500) {
                        a.trim(false).unwrap();
                    }
                }
                a.release_thread().unwrap();
            }));
        }
        drop(tx);
        let s = dev.create_stream();
        let mut x = 0x1234u64;
        let mut retained: Vec<(GraphPoolId, Vec<(DeviceAddr, usize)>)> = Vec::new();
        let mut into_eager = 0usize;
        for round in 0..24u64 {
            let pool = GraphPoolId(19, 200 + round);
            a.graph_pool_retain(pool);
            dev.begin_capture(s).unwrap();
            let mut mine = Vec::new();
            let mut all = Vec::new();
            for _ in 0..30 {
                let n = 256
                    + (rng(&mut x) % (if rng(&mut x).is_multiple_of(8) { 2 * MIB } else { 96 << 10 }) as u64)
                        as usize;
                let p = a.graph_allocate(pool, n, s).unwrap();
                {
                    let pg = eager_pages.lock().unwrap();
                    if ((p.0 >> 16)..=((p.0 + n as u64 - 1) >> 16)).any(|page| pg.contains(&page)) {
                        into_eager += 1;
                    }
                }
                dev.write_tag(p.0, rounded(n), 0x6000 + round as u32, s).unwrap();
                mine.push((p, n));
                all.push((p, n));
                if rng(&mut x).is_multiple_of(3) {
                    let (p, n) = mine.swap_remove(rng(&mut x) as usize % mine.len());
                    a.deallocate(p, n, s).unwrap();
                }
            }
            for (p, n) in mine {
                a.deallocate(p, n, s).unwrap();
            }
            dev.end_capture(s).unwrap();
            retained.push((pool, all));
            // Replays of every live graph, while the eager threads go on.
            for (k, (_, blocks)) in retained.iter().enumerate() {
                for &(p, n) in blocks {
                    dev.write_tag(p.0, rounded(n), 0x9000 + k as u32, s).unwrap();
                }
            }
            // Graphs destroyed: the oldest pool released once two newer ones exist.
            if retained.len() > 2 {
                let (old, _) = retained.remove(0);
                a.graph_pool_release(old).unwrap();
            }
            if round % 4 == 3 {
                a.trim(true).unwrap(); // retired pools' memory goes back to eager use
            }
            std::thread::sleep(Duration::from_millis(3));
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        // The blocks sent and never taken.
        while let Ok((q, m)) = rx.lock().unwrap().try_recv() {
            dev.synchronize();
            a.deallocate(q, m, Stream::LEGACY).unwrap();
        }
        for (pool, _) in retained {
            a.graph_pool_release(pool).unwrap();
        }
        dev.synchronize();
        assert_clean(&dev);
        // Usually some tens of the 720 (none in about one run in ten under load, so not
        // asserted: `no_source_of_pending_memory_feeds_a_pool_segment` is the deterministic
        // check, and fails when `FenceSet::is_clear` ignores fences or lazy legacy fences).
        eprintln!("graph blocks in memory eager blocks had used: {into_eager} of 720");
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// `record_stream` on graph blocks (`deallocate_used_on` naming another stream, a capturing one
/// included): the block is held, never reused by its pool on any stream while the pool lives
/// (across a release and revive), no event is recorded on the capturing stream, and the held
/// memory comes back once the pool retires.
#[test]
fn record_stream_on_graph_blocks_holds_them_until_the_pool_retires() {
    let dev = host(5);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let (s, t) = (dev.create_stream(), dev.create_stream());
    let pool = GraphPoolId(19, 30);
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    let mut held = Vec::new();
    for i in 0..16usize {
        let n = 1000 + i * 700;
        let p = a.graph_allocate(pool, n, s).unwrap();
        let on = if i % 2 == 0 { t } else { Stream::PER_THREAD };
        // Declared used on `t`, the per-thread stream, and the capturing stream itself.
        a.deallocate_used_on(p, n, s, &[on, s]).unwrap();
        held.push((p, n));
    }
    // Same stream only: not held, reused at once.
    let r = a.graph_allocate(pool, 4096, s).unwrap();
    a.deallocate_used_on(r, 4096, s, &[s]).unwrap();
    assert_eq!(a.graph_allocate(pool, 4096, s).unwrap(), r);
    a.deallocate(r, 4096, s).unwrap();
    dev.end_capture(s).unwrap();
    assert_clean(&dev);
    // Released to zero with a block live, then revived: still held.
    let live = a.graph_allocate(pool, 512, t).unwrap();
    a.graph_pool_release(pool).unwrap();
    a.graph_pool_retain(pool);
    for st in [s, t, Stream::PER_THREAD, Stream::LEGACY] {
        for _ in 0..20 {
            let n = 1000 + (st.as_raw() % 7) * 512;
            let q = a.graph_allocate(pool, n, st).unwrap();
            for &(p, m) in &held {
                assert!(
                    !overlaps((q.0, rounded(n) as u64), (p.0, rounded(m) as u64)),
                    "a held block was reused"
                );
            }
            a.deallocate(q, n, st).unwrap();
        }
    }
    for &(p, m) in &held {
        assert!(matches!(
            a.deallocate(p, m, s),
            Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. })
        ));
    }
    a.deallocate(live, 512, t).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(a.graph_pool_bytes() > 0, "parked");
    a.check_invariants();
    assert_all_returned(&a, Some(&dev), held.len() as u64);
}

/// Reuse on the per-thread stream is by thread: thread B's free of thread A's block on B's
/// per-thread stream is not handed to A's per-thread stream (another stream), and a fresh
/// thread whose first cuarena call is `graph_allocate` on its own per-thread stream, captured,
/// makes no driver call that the capture would see.
#[test]
fn per_thread_stream_reuse_is_per_thread_and_a_fresh_thread_may_start_in_a_capture() {
    let dev = host(5);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let pool = GraphPoolId(19, 40);
    a.graph_pool_retain(pool);
    let p = a.graph_allocate(pool, 8192, Stream::PER_THREAD).unwrap();
    let (a2, dev2) = (a.clone(), dev.clone());
    let freed_by_b = std::thread::spawn(move || {
        // B frees A's block on B's per-thread stream while B's stream is being captured.
        dev2.begin_capture(Stream::PER_THREAD).unwrap();
        a2.deallocate(p, 8192, Stream::PER_THREAD).unwrap();
        let again = a2.graph_allocate(pool, 8192, Stream::PER_THREAD).unwrap();
        a2.deallocate(again, 8192, Stream::PER_THREAD).unwrap();
        dev2.end_capture(Stream::PER_THREAD).unwrap();
        // A fresh thread, capturing its per-thread stream, allocates and frees in the pool.
        let (a3, dev3) = (a2.clone(), dev2.clone());
        std::thread::spawn(move || {
            dev3.begin_capture(Stream::PER_THREAD).unwrap();
            let q = a3.graph_allocate(pool, 100_000, Stream::PER_THREAD).unwrap();
            dev3.write_tag(q.0, rounded(100_000), 7, Stream::PER_THREAD).unwrap();
            a3.deallocate(q, 100_000, Stream::PER_THREAD).unwrap();
            dev3.end_capture(Stream::PER_THREAD).unwrap();
            a3.release_thread().unwrap();
        })
        .join()
        .unwrap();
        a2.release_thread().unwrap();
        again
    })
    .join()
    .unwrap();
    assert_eq!(freed_by_b, p, "B reuses its own free on its per-thread stream");
    // A's per-thread stream never gets B's free.
    let mine = a.graph_allocate(pool, 8192, Stream::PER_THREAD).unwrap();
    assert_ne!(mine, p, "A's per-thread stream got a free made on B's");
    a.deallocate(mine, 8192, Stream::PER_THREAD).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_clean(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// `trim(true)`, `trim(false)`, `flush`, `release_thread` and thread exits, with eager churn,
/// leave a retained pool's memory and contents alone: tags written into its blocks (live and
/// freed) are intact after, and its bytes unchanged. After its release they come back.
#[test]
fn trims_flushes_and_thread_exits_leave_a_retained_pool_alone() {
    let dev = host(10);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 50);
    a.graph_pool_retain(pool);
    let mut blocks = Vec::new();
    for i in 0..24usize {
        let n = 512 + i * 37_000;
        blocks.push((a.graph_allocate(pool, n, s).unwrap(), n));
    }
    for (i, &(p, n)) in blocks.iter().enumerate() {
        dev.write_tag(p.0, rounded(n), 0x3000 + i as u32, s).unwrap();
    }
    // Half freed: their memory is the pool's, and a replay would still write it.
    let freed: Vec<(DeviceAddr, usize)> = blocks.iter().copied().skip(12).collect();
    for &(p, n) in &freed {
        a.deallocate(p, n, s).unwrap();
    }
    let bytes = a.graph_pool_bytes();
    for round in 0..4u64 {
        let (a2, dev2) = (a.clone(), dev.clone());
        std::thread::spawn(move || {
            let mut x = round + 1;
            let mut held = Vec::new();
            for i in 0..400u32 {
                let n = 16 + (rng(&mut x) % (3 * MIB as u64)) as usize;
                let st = if rng(&mut x).is_multiple_of(2) { Stream::PER_THREAD } else { Stream::LEGACY };
                let p = a2.allocate(n, st).unwrap();
                common::tag(&dev2, p, n, 0x0100_0000 | i, st);
                held.push((p, n, st));
                if held.len() > 8 {
                    let (p, n, st) = held.swap_remove(0);
                    a2.deallocate(p, n, st).unwrap();
                }
            }
            for (p, n, st) in held {
                a2.deallocate(p, n, st).unwrap();
            }
            a2.flush().unwrap();
            // No release_thread: the thread's exit does it.
        })
        .join()
        .unwrap();
        a.trim(false).unwrap();
        a.flush().unwrap();
        a.trim(true).unwrap();
        a.release_thread().unwrap();
        assert_eq!(a.graph_pool_bytes(), bytes);
        a.check_invariants();
    }
    for (i, &(p, n)) in blocks.iter().enumerate() {
        dev.check_tag(p.0, rounded(n), 0x3000 + i as u32, s).unwrap();
    }
    dev.synchronize();
    assert_clean(&dev);
    for &(p, n) in &blocks[..12] {
        a.deallocate(p, n, s).unwrap();
    }
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Out of memory under a small cap: a pool's growth fails at once and changes nothing (no
/// segment, no live block, no count); a retained pool's memory is never taken by an eager
/// out-of-memory reclaim; a retired pool's parked memory is (the reclaim synchronises).
#[test]
fn out_of_memory_in_a_pool_is_clean_and_an_eager_oom_takes_only_retired_pools_memory() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).max_bytes(40 * MIB).build().unwrap())
        .unwrap();
    let s = dev.create_stream();
    let (keep, gone) = (GraphPoolId(19, 60), GraphPoolId(19, 61));
    a.graph_pool_retain(keep);
    a.graph_pool_retain(gone);
    let k = a.graph_allocate(keep, 1000, s).unwrap(); // 2 MiB
    dev.write_tag(k.0, 1024, 0x4444, s).unwrap();
    let g1 = a.graph_allocate(gone, 3 * MIB, s).unwrap(); // 20 MiB
    let g2 = a.graph_allocate(gone, 18 * MIB, s).unwrap(); // 18 MiB (over the 17 left): 40 MiB in all
    let before = (a.stats(), a.graph_pool_bytes(), a.graph_pool_live(gone).unwrap());
    // `gone`'s 20 MiB segment has 17 MiB free: 18 MiB and more need a segment, past the cap.
    for n in [18 * MIB, 24 * MIB, 40 * MIB, 41 * MIB] {
        assert!(
            matches!(a.graph_allocate(gone, n, s), Err(Error::OutOfMemory { requested, .. }) if requested == n)
        );
        a.check_invariants();
    }
    let after = (a.stats(), a.graph_pool_bytes(), a.graph_pool_live(gone).unwrap());
    assert_eq!((after.0.live_bytes, after.0.allocations), (before.0.live_bytes, before.0.allocations));
    assert_eq!((after.1, &after.2), (before.1, &before.2));
    // Retire `gone`: 38 MiB parked, waiting for a synchronise.
    a.deallocate(g1, 3 * MIB, s).unwrap();
    a.deallocate(g2, 18 * MIB, s).unwrap();
    a.graph_pool_release(gone).unwrap();
    assert_eq!(a.graph_pool_bytes(), 40 << 20);
    // An eager 30 MiB needs the parked memory: its out-of-memory reclaim synchronises and takes it.
    let e = a.allocate(30 * MIB, s).unwrap();
    assert_eq!(a.graph_pool_bytes(), 2 << 20, "only the retained pool's segment is left");
    assert!(!overlaps((e.0, 30 * MIB as u64), (k.0, 1024)));
    // The retained pool still grows into what the cap allows, and its block is intact.
    assert!(matches!(a.graph_allocate(keep, 9 * MIB, s), Err(Error::OutOfMemory { .. })));
    dev.check_tag(k.0, 1024, 0x4444, s).unwrap();
    a.deallocate(e, 30 * MIB, s).unwrap();
    // The eager block's fence is not known complete until a query or a wait sees it (see the
    // next test): trim first.
    a.trim(true).unwrap();
    let k2 = a.graph_allocate(keep, 9 * MIB, s).unwrap();
    a.deallocate(k2, 9 * MIB, s).unwrap();
    a.deallocate(k, 1000, s).unwrap();
    a.graph_pool_release(keep).unwrap();
    assert_clean(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// A cap filled by eager memory that is free and idle, but whose fences no query has seen
/// complete: during a capture the pool cannot use it (it takes only memory known clear, and
/// runs no reclaim) and is out of memory; outside a capture its out-of-memory reclaim trims the
/// idle chunks (it polls their fences), and the pool grows. (Before the reclaim was added, the
/// pool was out of memory outside a capture too, until a `trim`.)
#[test]
fn a_cap_full_of_idle_cached_memory_is_recovered_for_a_pool_outside_a_capture() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).max_bytes(40 * MIB).build().unwrap())
        .unwrap();
    let s = dev.create_stream();
    let e = a.allocate(36 * MIB, s).unwrap();
    dev.write_tag(e.0, 4096, 1, s).unwrap();
    a.deallocate(e, 36 * MIB, s).unwrap(); // a fence on `s`, not yet seen complete
    dev.synchronize();
    let pool = GraphPoolId(19, 70);
    a.graph_pool_retain(pool);
    let c = dev.create_stream();
    dev.begin_capture(c).unwrap();
    assert!(matches!(a.graph_allocate(pool, 3 * MIB, c), Err(Error::OutOfMemory { .. })));
    dev.end_capture(c).unwrap();
    let p = a.graph_allocate(pool, 3 * MIB, s).unwrap();
    a.deallocate(p, 3 * MIB, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert_clean(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// Many threads, each with its own pool, hand half their blocks to the next thread, which frees
/// them on its own stream, while the owner releases its pool (often before those frees land)
/// and retains it again; eager churn and `check_invariants`, `stats` and `graph_pool_bytes`
/// run alongside. No overlap, no deadlock, and everything comes back.
#[test]
fn threads_race_releases_against_cross_thread_frees_of_their_pools_blocks() {
    within(120, || {
        let dev = host(5);
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let live = Arc::new(Live::default());
        const T: usize = 6;
        let mut txs = Vec::new();
        let mut rxs = Vec::new();
        for _ in 0..T {
            let (tx, rx) = mpsc::channel::<Option<(DeviceAddr, usize)>>();
            txs.push(tx);
            rxs.push(Some(rx));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let checker = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    a.check_invariants();
                    let _ = a.stats();
                    let _ = a.graph_pool_bytes();
                    std::thread::yield_now();
                }
            })
        };
        let mut hs = Vec::new();
        for t in 0..T {
            let (a, dev, live) = (a.clone(), dev.clone(), live.clone());
            let next = txs[(t + 1) % T].clone();
            let rx = rxs[t].take().unwrap();
            hs.push(std::thread::spawn(move || {
                let mut x = 0xabcdu64 ^ (t as u64 + 1);
                let s = dev.create_stream();
                let pool = GraphPoolId(19, 300 + t as u64);
                let mut received_end = false;
                for round in 0..30 {
                    a.graph_pool_retain(pool);
                    let mut mine = Vec::new();
                    for _ in 0..20 {
                        let n = 1
                            + (rng(&mut x)
                                % (if rng(&mut x).is_multiple_of(10) { 4 * MIB } else { 64 << 10 }) as u64)
                                as usize;
                        let p = a.graph_allocate(pool, n, s).unwrap();
                        live.insert(p, rounded(n));
                        mine.push((p, n));
                        let e = 1 + (rng(&mut x) % 100_000) as usize;
                        let q = a.allocate(e, Stream::PER_THREAD).unwrap();
                        live.insert(q, e);
                        live.remove(q);
                        a.deallocate(q, e, Stream::PER_THREAD).unwrap();
                    }
                    for (i, (p, n)) in mine.into_iter().enumerate() {
                        if i % 2 == 0 {
                            next.send(Some((p, n))).unwrap();
                        } else {
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        }
                    }
                    a.graph_pool_release(pool).unwrap();
                    // Frees of the previous thread's blocks, on this thread's stream.
                    while let Ok(m) = rx.try_recv() {
                        match m {
                            Some((p, n)) => {
                                live.remove(p);
                                a.deallocate(p, n, if round % 2 == 0 { s } else { Stream::PER_THREAD })
                                    .unwrap();
                            }
                            None => received_end = true,
                        }
                    }
                }
                next.send(None).unwrap();
                while !received_end {
                    match rx.recv().unwrap() {
                        Some((p, n)) => {
                            live.remove(p);
                            a.deallocate(p, n, s).unwrap();
                        }
                        None => received_end = true,
                    }
                }
                a.release_thread().unwrap();
            }));
        }
        drop(txs);
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        checker.join().unwrap();
        live.assert_clean();
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// Lock order under pressure: pools growing (graph state lock, then the global pool's) on some
/// threads while others hit the cap eagerly (reclaim, `bury_zombies`: the global pool's lock,
/// and the graph state lock apart), trim blocking and not, release pools (parking segments),
/// and free across threads. Errors of out of memory are expected; a deadlock or a broken
/// invariant is not.
#[test]
fn pool_growth_against_eager_reclaim_and_trims_never_deadlocks() {
    within(120, || {
        let dev = HostDevice::new(HostConfig {
            capacity: 256 * MIB,
            max_delay: Duration::from_micros(5),
            ..HostConfig::default()
        });
        let a =
            host_allocator(dev.clone(), small().large_max(64 << 10).max_bytes(160 * MIB).build().unwrap())
                .unwrap();
        let ooms = Arc::new(AtomicU64::new(0));
        let mut hs = Vec::new();
        for t in 0..8u64 {
            let (a, dev, ooms) = (a.clone(), dev.clone(), ooms.clone());
            hs.push(std::thread::spawn(move || {
                let mut x = 0x7777u64 ^ (t + 1);
                let s = dev.create_stream();
                let mut kept: Vec<(DeviceAddr, usize, bool, Stream)> = Vec::new();
                for i in 0..300u64 {
                    let pool = GraphPoolId(19, 400 + t * 1000 + i / 10);
                    if i % 10 == 0 {
                        a.graph_pool_retain(pool);
                    }
                    let graph = t % 2 == 0;
                    let n = 1 + (rng(&mut x) % (12 * MIB) as u64) as usize;
                    let r = if graph {
                        a.graph_allocate(pool, n, s)
                    } else {
                        a.allocate(n, if i % 3 == 0 { Stream::LEGACY } else { s })
                    };
                    match r {
                        Ok(p) => {
                            kept.push((p, n, graph, if graph || i % 3 != 0 { s } else { Stream::LEGACY }))
                        }
                        Err(Error::OutOfMemory { .. }) => {
                            ooms.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("{e}"),
                    }
                    while kept.len() > 3 {
                        let (p, n, _, st) = kept.swap_remove(rng(&mut x) as usize % kept.len());
                        a.deallocate(p, n, st).unwrap();
                    }
                    if i % 10 == 9 {
                        // The pool's blocks die with its graph.
                        let (theirs, rest): (Vec<_>, Vec<_>) = kept.drain(..).partition(|k| k.2);
                        for (p, n, _, st) in theirs {
                            a.deallocate(p, n, st).unwrap();
                        }
                        kept = rest;
                        a.graph_pool_release(pool).unwrap();
                    }
                    match i % 50 {
                        13 => {
                            a.trim(true).unwrap();
                        }
                        27 => {
                            a.trim(false).unwrap();
                        }
                        41 => a.flush().unwrap(),
                        _ => {}
                    }
                }
                for (p, n, _, st) in kept {
                    a.deallocate(p, n, st).unwrap();
                }
                a.release_thread().unwrap();
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
        assert!(ooms.load(Ordering::Relaxed) > 0, "the cap was never hit: the test did not test");
        assert_all_returned(&a, Some(&dev), 0);
    });
}

/// A free of a pool's last live block racing the pool's last release, from another thread:
/// the pool retires exactly once, whichever comes last, and its memory comes back.
#[test]
fn the_last_free_racing_the_last_release_retires_the_pool_once() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    for i in 0..200u64 {
        let pool = GraphPoolId(19, 10_000 + i % 3); // ids reused once retired
        a.graph_pool_retain(pool);
        let blocks: Vec<(DeviceAddr, usize)> =
            (0..4).map(|k| (a.graph_allocate(pool, 1000 + k * 3000, s).unwrap(), 1000 + k * 3000)).collect();
        let go = Arc::new(Barrier::new(2));
        let (a2, go2) = (a.clone(), go.clone());
        let h = std::thread::spawn(move || {
            go2.wait();
            for (p, n) in blocks {
                a2.deallocate(p, n, s).unwrap();
            }
            a2.release_thread().unwrap();
        });
        go.wait();
        a.graph_pool_release(pool).unwrap();
        h.join().unwrap();
        assert_eq!(a.graph_pool_use_count(pool), 0);
        assert!(matches!(a.graph_pool_release(pool), Err(Error::UnknownGraphPool { .. })));
        assert_eq!(a.graph_pool_bytes(), 2 << 20, "one segment, parked once");
        a.check_invariants();
        a.trim(true).unwrap();
        assert_eq!(a.graph_pool_bytes(), 0);
    }
    assert_all_returned(&a, Some(&dev), 0);
}

/// Statistics through graph traffic: `live_bytes` is exact (512-byte rounding) after every
/// step, `allocations` and `deallocations` match at the end, each graph allocation counts as a
/// pool allocation, and bad frees count as invalid.
#[test]
fn statistics_stay_exact_through_graph_traffic() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 80);
    a.graph_pool_retain(pool);
    let base = a.stats();
    let mut x = 99u64;
    let mut live = Vec::new();
    let mut bytes = 0u64;
    for i in 0..300 {
        if live.is_empty() || rng(&mut x).is_multiple_of(2) {
            let n = 1 + (rng(&mut x) % 300_000) as usize;
            live.push((a.graph_allocate(pool, n, s).unwrap(), n));
            bytes += rounded(n) as u64;
        } else {
            let (p, n) = live.swap_remove(rng(&mut x) as usize % live.len());
            a.deallocate(p, n, s).unwrap();
            bytes -= rounded(n) as u64;
        }
        let st = a.stats();
        assert_eq!(st.live_bytes - base.live_bytes, bytes, "step {i}");
    }
    let st = a.stats();
    assert_eq!(st.pool_allocations - base.pool_allocations, st.allocations - base.allocations);
    for (p, n) in live {
        a.deallocate(p, n, s).unwrap();
    }
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// Dropping the allocator with a pool retained, live graph blocks, a held block and a parked
/// pool gives every byte back to the device, after the replays' work (it synchronises).
#[test]
fn dropping_the_allocator_with_pools_in_every_state_gives_the_device_everything_back() {
    let dev = host(20);
    {
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let (s, t) = (dev.create_stream(), dev.create_stream());
        let (live, parked) = (GraphPoolId(19, 90), GraphPoolId(19, 91));
        a.graph_pool_retain(live);
        a.graph_pool_retain(parked);
        let p = a.graph_allocate(live, 3 * MIB, s).unwrap();
        let h = a.graph_allocate(live, 4096, s).unwrap();
        a.deallocate_used_on(h, 4096, s, &[t]).unwrap();
        let q = a.graph_allocate(parked, 1000, s).unwrap();
        for (b, n) in [(p, 3 * MIB), (q, 1024)] {
            dev.hold_and_check(b.0, n, 5, Duration::from_millis(2), s).unwrap();
        }
        a.deallocate(q, 1000, s).unwrap();
        a.graph_pool_release(parked).unwrap();
        assert!(a.graph_pool_bytes() >= 22 << 20);
        drop(a);
    }
    dev.synchronize();
    assert_eq!(dev.reserved_bytes(), 0);
    assert_clean(&dev);
}

/// The `used` flag's ordering, exercised: a fresh allocator's first pool is retained and
/// allocated from on one thread and its block freed on another at once, many times over, each
/// with a new allocator (so the flag is freshly set each time). Every free finds its pool.
#[test]
fn the_first_pools_blocks_are_found_by_frees_on_other_threads_at_once() {
    let dev = host(0);
    for i in 0..100u64 {
        let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
        let (tx, rx) = mpsc::channel::<(DeviceAddr, usize)>();
        let a2 = a.clone();
        let freer = std::thread::spawn(move || {
            let (p, n) = rx.recv().unwrap();
            let r = a2.deallocate(p, n, Stream::LEGACY);
            a2.release_thread().unwrap();
            r
        });
        let pool = GraphPoolId(i, i);
        a.graph_pool_retain(pool);
        let n = 100 + i as usize * 1000;
        tx.send((a.graph_allocate(pool, n, Stream::LEGACY).unwrap(), n)).unwrap();
        freer.join().unwrap().unwrap();
        a.graph_pool_release(pool).unwrap();
        assert_all_returned(&a, Some(&dev), 0);
    }
}

/// Size 0 gives NULL (and frees as a no-op), in a known pool and (before the pool check, like
/// `allocate`) in an unknown one; NULL's free with size 0 changes no count.
#[test]
fn size_zero_is_null_and_its_free_a_no_op() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().build().unwrap()).unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 95);
    assert_eq!(a.graph_allocate(pool, 0, s).unwrap(), DeviceAddr::NULL);
    a.graph_pool_retain(pool);
    assert_eq!(a.graph_allocate(pool, 0, s).unwrap(), DeviceAddr::NULL);
    let before = a.stats();
    a.deallocate(DeviceAddr::NULL, 0, s).unwrap();
    let after = a.stats();
    assert_eq!(
        (after.allocations, after.deallocations, after.invalid_frees),
        (before.allocations, before.deallocations, before.invalid_frees)
    );
    assert_eq!(a.graph_pool_bytes(), 0, "no segment for size 0");
    a.graph_pool_release(pool).unwrap();
    assert_all_returned(&a, Some(&dev), 0);
}

/// An eager out of memory on the arena path (small blocks needing superblocks) takes a retired
/// pool's parked memory too (the reclaim synchronises), and never a retained pool's.
#[test]
fn an_eager_arena_out_of_memory_takes_parked_graph_memory_and_no_retained_one() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().max_bytes(24 * MIB).build().unwrap()).unwrap();
    let s = dev.create_stream();
    let (gone, keep) = (GraphPoolId(19, 500), GraphPoolId(19, 501));
    a.graph_pool_retain(gone);
    a.graph_pool_retain(keep);
    let k = a.graph_allocate(keep, 1000, s).unwrap(); // 2 MiB, kept
    dev.write_tag(k.0, 1024, 0x1234, s).unwrap();
    let g = a.graph_allocate(gone, 3 * MIB, s).unwrap(); // 20 MiB
    a.deallocate(g, 3 * MIB, s).unwrap();
    a.graph_pool_release(gone).unwrap(); // parked: 22 of the 24 MiB are graph pools'
    let mut small_blocks = Vec::new();
    for _ in 0..(16 * MIB / (32 << 10)) {
        let p = a.allocate(32 << 10, Stream::PER_THREAD).unwrap();
        assert!(!overlaps((p.0, 32 << 10), (k.0, 1024)), "an eager block in a retained pool");
        small_blocks.push(p);
    }
    assert_eq!(a.graph_pool_bytes(), 2 << 20, "the retired pool's memory was taken, the kept one's not");
    dev.check_tag(k.0, 1024, 0x1234, s).unwrap();
    for p in small_blocks {
        a.deallocate(p, 32 << 10, Stream::PER_THREAD).unwrap();
    }
    a.deallocate(k, 1000, s).unwrap();
    a.graph_pool_release(keep).unwrap();
    assert_clean(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// The OOM hook may free graph blocks and release their pool (it runs with no cuarena lock
/// held): the retried allocation's reclaim then takes the retired pool's memory. A graph
/// allocation's out of memory calls no hook.
#[test]
fn an_oom_hook_that_releases_a_graph_pool_lets_the_retry_have_its_memory() {
    let dev = host(0);
    let a = host_allocator(dev.clone(), small().large_max(64 << 10).max_bytes(24 * MIB).build().unwrap())
        .unwrap();
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 510);
    a.graph_pool_retain(pool);
    let g = a.graph_allocate(pool, 3 * MIB, s).unwrap(); // 20 MiB
    let calls = Arc::new(AtomicU64::new(0));
    let (a2, calls2) = (a.clone(), calls.clone());
    let block = Mutex::new(Some(g));
    a.set_oom_hook(Some(Arc::new(move |_, _| {
        calls2.fetch_add(1, Ordering::Relaxed);
        match block.lock().unwrap().take() {
            Some(g) => {
                a2.deallocate(g, 3 * MIB, s).unwrap();
                a2.graph_pool_release(pool).unwrap();
                true
            }
            None => false,
        }
    })));
    // A graph allocation out of memory: no hook.
    assert!(matches!(a.graph_allocate(pool, 18 * MIB, s), Err(Error::OutOfMemory { .. })));
    assert_eq!(calls.load(Ordering::Relaxed), 0);
    let e = a.allocate(12 * MIB, s).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    assert_eq!(a.graph_pool_bytes(), 0);
    a.deallocate(e, 12 * MIB, s).unwrap();
    a.set_oom_hook(None);
    assert_all_returned(&a, Some(&dev), 0);
}

/// A trace running while a stream is captured: frees of graph blocks on the capturing stream
/// (which the trace records, asking the stream's identity) break nothing: no event on the
/// capturing stream, no error.
#[test]
fn a_running_trace_does_not_break_a_capture_that_frees_graph_blocks() {
    let dev = Arc::new(host(0));
    let a = Allocator::new(dev.clone(), small().build().unwrap()).unwrap();
    let path = std::env::temp_dir().join(format!("cuarena-s19-capture-trace-{}.bin", std::process::id()));
    let s = dev.create_stream();
    let pool = GraphPoolId(19, 520);
    a.start_trace(&path).unwrap();
    a.graph_pool_retain(pool);
    dev.begin_capture(s).unwrap();
    for n in [100usize, 5000, 3 * MIB] {
        let p = a.graph_allocate(pool, n, s).unwrap();
        a.deallocate(p, n, s).unwrap();
        let q = a.graph_allocate(pool, n, s).unwrap();
        a.deallocate_used_on(q, n, s, &[s]).unwrap();
    }
    dev.end_capture(s).unwrap();
    a.stop_trace().unwrap();
    let _ = std::fs::remove_file(&path);
    a.graph_pool_release(pool).unwrap();
    assert_clean(&dev);
    assert_all_returned(&a, Some(&dev), 0);
}

/// Memory under pending work from every source the global pool takes it back from, each held
/// in flight by a closed gate: a pool block freed on a user stream (its fence), pool blocks
/// freed on the legacy stream (a lazy legacy fence, through the outbox), a per-thread arena's
/// superblocks given back at its thread's release (a fence on that stream), a user-stream
/// arena's memory after its stream was destroyed (parked until a synchronise), and another
/// thread's arena blocks freed remotely. Pools then grow during a capture by many segments:
/// none is cut from that memory, no event is recorded or waited on the capturing stream, and
/// the capture's writes over its blocks race nothing.
#[test]
fn no_source_of_pending_memory_feeds_a_pool_segment() {
    within(60, || {
        let dev = host(0);
        let a = host_allocator(dev.clone(), small().large_max(64 << 10).build().unwrap()).unwrap();
        let mut pending: Vec<(u64, u64, &str)> = Vec::new();
        let mut gates = Vec::new();
        // A: a pool block freed on a user stream whose work on it waits behind a gate.
        let u1 = dev.create_stream();
        gates.push(dev.gate(u1).unwrap());
        for _ in 0..3 {
            let p = a.allocate(6 * MIB, u1).unwrap();
            dev.write_tag(p.0, 6 * MIB, 0xa, u1).unwrap();
            a.deallocate(p, 6 * MIB, u1).unwrap();
            pending.push((p.0, 6 * MIB as u64, "user-stream pool free"));
        }
        // B: pool blocks freed on the legacy stream (lazy legacy fences), flushed to the pool.
        gates.push(dev.gate(Stream::LEGACY).unwrap());
        for _ in 0..3 {
            let p = a.allocate(5 * MIB, Stream::LEGACY).unwrap();
            dev.write_tag(p.0, 5 * MIB, 0xb, Stream::LEGACY).unwrap();
            a.deallocate(p, 5 * MIB, Stream::LEGACY).unwrap();
            pending.push((p.0, 5 * MIB as u64, "legacy pool free"));
        }
        a.flush().unwrap();
        // C: a thread's per-thread arena, its blocks used behind a gate, freed, then released.
        // D: a user-stream arena whose stream is destroyed with work in flight (parked).
        // E: blocks of that thread's arena freed by this thread on a user stream.
        let (a2, dev2) = (a.clone(), dev.clone());
        let (more, more_gates, remote) = std::thread::spawn(move || {
            let mut pending = Vec::new();
            let mut gates = Vec::new();
            gates.push(dev2.gate(Stream::PER_THREAD).unwrap());
            let mut mine = Vec::new();
            for _ in 0..200 {
                let p = a2.allocate(40 << 10, Stream::PER_THREAD).unwrap();
                dev2.write_tag(p.0, 40 << 10, 0xc, Stream::PER_THREAD).unwrap();
                mine.push(p);
                pending.push((p.0, 40u64 << 10, "per-thread arena"));
            }
            let mut remote = Vec::new();
            for (i, p) in mine.into_iter().enumerate() {
                if i % 4 == 0 {
                    remote.push(p);
                } else {
                    a2.deallocate(p, 40 << 10, Stream::PER_THREAD).unwrap();
                }
            }
            let u = dev2.create_stream();
            gates.push(dev2.gate(u).unwrap());
            for _ in 0..100 {
                let p = a2.allocate(48 << 10, u).unwrap();
                dev2.write_tag(p.0, 48 << 10, 0xd, u).unwrap();
                a2.deallocate(p, 48 << 10, u).unwrap();
                pending.push((p.0, 48u64 << 10, "destroyed stream's arena"));
            }
            dev2.destroy_stream(u).unwrap();
            a2.release_thread().unwrap();
            (pending, gates, remote)
        })
        .join()
        .unwrap();
        pending.extend(more);
        gates.extend(more_gates);
        // E: the remote frees, on a user stream that first waits for the owner's work through
        // the legacy stream (a synchronising free would block on the gates): the per-thread
        // stream's work is ordered before later legacy work, which this stream waits for.
        let u2 = dev.create_stream();
        let ev = {
            use cuarena::Device;
            let e = dev.create_event().unwrap();
            dev.record_event(e, Stream::LEGACY).unwrap();
            dev.stream_wait_event(u2, e).unwrap();
            e
        };
        for p in remote {
            a.deallocate(p, 40 << 10, u2).unwrap();
        }
        a.trim(false).unwrap(); // non-blocking: polls, gives back what it may
        // The pools grow during a capture: many segments, some large.
        let s = dev.create_stream();
        let pools = [GraphPoolId(19, 600), GraphPoolId(19, 601)];
        for &pool in &pools {
            a.graph_pool_retain(pool);
        }
        dev.begin_capture(s).unwrap();
        let mut graph = Vec::new();
        for i in 0..24usize {
            let n = [12 * MIB, 3 * MIB, 700 << 10, 1000][i % 4];
            let pool = pools[i % 2];
            let p = a.graph_allocate(pool, n, s).unwrap();
            for &(q, l, what) in &pending {
                assert!(
                    !overlaps((p.0, rounded(n) as u64), (q, l)),
                    "a graph block over pending memory ({what})"
                );
            }
            dev.write_tag(p.0, rounded(n), 0xe0 + i as u32, s).unwrap();
            graph.push((pools[i % 2], p, n));
        }
        dev.end_capture(s).unwrap();
        let v = dev.violations();
        drop(gates); // opened
        {
            use cuarena::Device;
            dev.destroy_event(ev);
        }
        assert!(v.is_empty(), "{} violations, first: {:?}", v.len(), &v[..v.len().min(3)]);
        for (_, p, n) in graph {
            a.deallocate(p, n, s).unwrap();
        }
        for pool in pools {
            a.graph_pool_release(pool).unwrap();
        }
        assert_all_returned(&a, Some(&dev), 0);
    });
}
