//! Threads that take a stream from a shared pool for every request, as PyTorch's
//! `torch.cuda.Stream()` hands out a pool of 32 streams in turn: more streams than a thread keeps
//! user arenas for (`MAX_USER_ARENAS`). On the GPU, with `CUARENA_REQUIRE_GPU=1` as every GPU
//! test; ignored elsewhere.
//!
//! The test asserts that no device synchronise is made, that every block comes back and that
//! memory reserved stays within 64 MiB per thread, and prints pairs per second and memory (the
//! figures in `BENCHMARKS.md`, seventeenth measurement). With `CUARENA_MEASURE_ONLY=1` it only
//! prints (the same file built at an older commit, for the side-by-side figure).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use cuarena::{Allocator, Config, Stream};
use cuarena_testkit::{GpuOps, TagOps, gpu_or_skip};

/// `threads` threads, each making `requests` requests of 8 blocks (256 B to 512 KiB) on the
/// next stream of a pool of `streams`, with a tag kernel over one block of each request when
/// `kernels`. Returns (pairs per second, device synchronises, peak reserved MiB, peak live MiB,
/// driver calls per pair, events recorded per 1,000 pairs).
fn run(
    a: &Allocator,
    ops: &Arc<GpuOps>,
    threads: usize,
    streams: usize,
    requests: usize,
    kernels: bool,
) -> (f64, u64, u64, u64, f64, f64) {
    let pool: Arc<Vec<Stream>> =
        Arc::new((0..streams).map(|_| ops.kernels.create_stream().unwrap()).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (a, ops, pool, next) = (a.clone(), ops.clone(), pool.clone(), next.clone());
            std::thread::spawn(move || {
                let mut x = 0x2545_f491_4f6c_dd1du64 ^ (t as u64 + 1);
                for req in 0..requests {
                    let s = pool[next.fetch_add(1, Ordering::Relaxed) % pool.len()];
                    let mut v = Vec::with_capacity(8);
                    for _ in 0..8 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let n = 256usize << (x % 12);
                        v.push((a.allocate(n, s).unwrap(), n));
                    }
                    if kernels {
                        let (p, n) = v[req % 8];
                        ops.kernels.tag_hold_check(p.0, n.min(4096), req as u32 | 1, 0, s).unwrap();
                    }
                    for (p, n) in v {
                        a.deallocate(p, n, s).unwrap();
                    }
                }
                a.release_thread().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    for &s in pool.iter() {
        ops.kernels.destroy_stream(s).unwrap();
    }
    let st = a.stats();
    let pairs = (threads * requests * 8) as f64;
    (
        pairs / secs,
        st.host_syncs,
        st.peak_reserved_bytes >> 20,
        st.peak_live_bytes >> 20,
        st.driver_calls as f64 / pairs,
        st.fences_recorded as f64 * 1000.0 / pairs,
    )
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_threads_sharing_a_pool_of_streams() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let ops = Arc::new(GpuOps::new(Arc::clone(&dev)).unwrap());
    let measure_only = std::env::var("CUARENA_MEASURE_ONLY").is_ok_and(|v| v == "1");
    for (threads, streams, kernels) in
        [(1, 32, false), (8, 32, false), (16, 32, false), (8, 32, true), (8, 8, false)]
    {
        let a = Allocator::new(dev.clone(), Config::default()).unwrap();
        let requests = if kernels { 2_000 } else { 10_000 };
        let (rate, syncs, reserved, live, calls, events) = run(&a, &ops, threads, streams, requests, kernels);
        println!(
            "pool-of-streams threads={threads} streams={streams} kernels={kernels}: {:.3} M pairs/s, \
             device syncs {syncs}, peak reserved {reserved} MiB, peak live {live} MiB, \
             {calls:.2} driver calls a pair, {events:.1} events per 1,000 pairs",
            rate / 1e6
        );
        if !measure_only {
            assert_eq!(syncs, 0, "a device synchronise: {:?}", a.stats());
            assert!(reserved <= 64 * threads as u64, "reserved {reserved} MiB: {:?}", a.stats());
        }
        a.trim(true).unwrap();
        let st = a.stats();
        assert_eq!((st.live_bytes, st.invalid_frees), (0, 0), "{st:?}");
    }
    assert_eq!(ops.finish().unwrap(), 0, "a block was written under another request's kernel");
}

/// One thread with a live 4 KiB block on 48 streams (16 arenas in its table, 32 parked: the
/// parked bound, 64 MiB, with 2 MiB superblocks), then 4,000 pairs of 4 KiB round robin over
/// `n` more streams, which the pool serves (`Slot::new_user_arena`, "Making room"); `n = 0`:
/// over the table's 16 streams instead. Returns (pairs per second, driver calls per pair,
/// stream waits per pair, event queries per pair, device synchronises).
fn overflow_churn(dev: &Arc<cuarena::CudaDevice>, ops: &GpuOps, n: usize) -> (f64, f64, f64, f64, u64) {
    let a = Allocator::new(dev.clone(), Config::default()).unwrap();
    let mut made = Vec::new();
    let mut held = Vec::new();
    for _ in 0..cuarena::MAX_USER_ARENAS + 32 {
        let s = ops.kernels.create_stream().unwrap();
        held.push((a.allocate(4096, s).unwrap(), s));
        made.push(s);
    }
    let churn: Vec<Stream> = if n == 0 {
        held[held.len() - cuarena::MAX_USER_ARENAS..].iter().map(|&(_, s)| s).collect()
    } else {
        (0..n)
            .map(|_| {
                let s = ops.kernels.create_stream().unwrap();
                made.push(s);
                s
            })
            .collect()
    };
    let pairs = 4_000;
    let before = a.stats();
    let t0 = Instant::now();
    for i in 0..pairs {
        let s = churn[i % churn.len()];
        let p = a.allocate(4096, s).unwrap();
        a.deallocate(p, 4096, s).unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let after = a.stats();
    for (p, s) in held {
        a.deallocate(p, 4096, s).unwrap();
    }
    a.release_thread().unwrap();
    a.trim(true).unwrap();
    let st = a.stats();
    assert_eq!((st.live_bytes, st.invalid_frees), (0, 0), "{st:?}");
    for s in made {
        ops.kernels.destroy_stream(s).unwrap();
    }
    let per = |x: u64, y: u64| (x - y) as f64 / pairs as f64;
    (
        pairs as f64 / secs,
        per(after.driver_calls, before.driver_calls),
        per(after.fence_waits, before.fence_waits),
        per(after.fence_polls, before.fence_polls),
        after.host_syncs - before.host_syncs,
    )
}

/// The cost of streams past a full table of busy arenas on the GPU, where events complete
/// while the host works (the host device completes them later: `RELIABILITY.md`,
/// twenty-second session, `overflow_churn_costs_a_bounded_number_of_driver_calls`). Prints
/// the figures; asserts no device synchronise and every block back.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_streams_past_a_full_table() {
    let Some(dev) = gpu_or_skip(0) else { return };
    let ops = GpuOps::new(Arc::clone(&dev)).unwrap();
    for n in [0, 4, 16, 48] {
        let (rate, calls, waits, polls, syncs) = overflow_churn(&dev, &ops, n);
        println!(
            "streams past a full table: {n} overflow streams: {:.3} M pairs/s, {calls:.1} driver calls, \
             {waits:.1} stream waits, {polls:.1} event queries a pair, {syncs} synchronises",
            rate / 1e6
        );
        assert_eq!(syncs, 0);
    }
}
