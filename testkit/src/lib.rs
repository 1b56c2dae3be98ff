//! cuarena's test kit: what the tests, the benchmark and the examples need beside the allocator.
//!
//! - [`HostDevice`] ([`host`]): a simulated device in host memory with asynchronous streams,
//!   events and a race checker, for CI and machines without a GPU. It implements
//!   [`cuarena::Device`], so `Allocator::new(Arc::new(HostDevice::default()), config)` runs the
//!   allocator on it; [`host_allocator`] says the same in one call.
//! - [`cuda_kernels`]: the kernels the GPU tests, the benchmark and the demo run, loaded from
//!   PTX (no CUDA toolkit needed).
//! - The stress workload, the fence torture, [`LightDevice`], the GPU test gates and
//!   [`assert_all_returned`] (the module `harness`, re-exported here).
//! - [`HookedDevice`] ([`hooked`]): a simulated device with hooks around some calls, for tests
//!   that stall, pause or fail the device at one step of the allocator.
//!
//! Not part of cuarena's API: a separate crate so that the allocator crate ships none of it.

pub mod cuda_kernels;
mod harness;
pub mod hooked;
pub mod host;
pub mod interpose;
pub mod spy;

use std::sync::Arc;

use cuarena::{Allocator, Config, Result};

pub use harness::*;
pub use hooked::{Hooked, HookedDevice, Hooks, Stall};
pub use host::{HostConfig, HostDevice, StreamGate};
pub use interpose::{Interpose, Interposed};
pub use spy::Spy;

/// An allocator over a simulated device (a clone of `device` shares its state, so keep one to
/// ask the race checker).
pub fn host_allocator(device: HostDevice, config: Config) -> Result<Allocator> {
    Allocator::new(Arc::new(device), config)
}
