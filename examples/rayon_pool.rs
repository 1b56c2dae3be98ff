//! A rayon pool passing device buffers between its threads.
//!
//! `cargo run --release --example rayon_pool` (from the repository root). On a GPU it uses
//! device 0; without one it runs on the host-simulated device of `cuarena-testkit` and says so.
//! `CUARENA_CONF` configures the allocator as usual.
//!
//! Each round, the pool's threads allocate blocks in parallel (each from its own arena, for its
//! per-thread default stream), the blocks are collected, and the pool frees them in parallel in
//! the reverse order, so most are freed by a thread other than the one that allocated them.
//! cuarena sends those frees back to their owners' arenas, fenced by a CUDA event per batch.
//!
//! The free contract is `cudaFreeAsync`'s: every earlier use of a block must be ordered before
//! later work on the stream it is freed on. No kernel touches these blocks, so there is nothing
//! to order. A program that ran work on the allocating thread's stream would record an event
//! there and make the freeing thread's stream wait on it before the free (or free with
//! `Allocator::deallocate_used_on`).

use std::process::ExitCode;

use cuarena::{Allocator, Config, DeviceAddr, Error};
use cuarena_testkit::{HostDevice, host_allocator};
use rayon::prelude::*;

const THREADS: usize = 8;
const ROUNDS: usize = 20;
const BLOCKS: usize = 4096;

/// Block `i`'s size: 256 B to 256 KiB, varied so several size classes are used.
fn size(i: usize) -> usize {
    256 << (i % 11)
}

fn allocator() -> Result<(Allocator, String), Error> {
    let config = Config::from_env()?;
    match Allocator::cuda(0, config.clone()) {
        Ok(a) => Ok((a, "GPU 0".to_string())),
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => Ok((
            host_allocator(HostDevice::default(), config)?,
            format!("the host-simulated device (no GPU: {e})"),
        )),
        Err(e) => Err(e),
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (alloc, device) = allocator()?;
    println!("rayon_pool: {THREADS} threads, {ROUNDS} rounds of {BLOCKS} blocks, on {device}");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(THREADS).build()?;
    pool.install(|| -> Result<(), Error> {
        for _ in 0..ROUNDS {
            let blocks: Vec<(DeviceAddr, usize)> = (0..BLOCKS)
                .into_par_iter()
                .map(|i| alloc.allocate_per_thread(size(i)).map(|p| (p, size(i))))
                .collect::<Result<_, _>>()?;
            blocks.into_par_iter().rev().try_for_each(|(p, len)| alloc.deallocate_per_thread(p, len))?;
        }
        Ok(())
    })?;
    // Each pool thread sends its pending remote frees and gives its arena back.
    for r in pool.broadcast(|_| alloc.release_thread()) {
        r?;
    }
    let s = alloc.stats();
    println!(
        "{} allocations, {} freed by another thread; {} B live, {} B reserved, {} driver calls",
        s.allocations, s.cross_thread_frees, s.live_bytes, s.reserved_bytes, s.driver_calls
    );
    if s.live_bytes != 0 || s.allocations != s.deallocations {
        return Err(format!("blocks were lost: {s:?}").into());
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rayon_pool: {e}");
            ExitCode::FAILURE
        }
    }
}
