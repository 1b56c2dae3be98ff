#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]

// The benchmark's host baseline (a locked first-fit pool) uses the pool's address tree.
#[doc(hidden)]
pub mod address_tree;
mod allocator;
mod arena;
mod buffer;
mod claim;
pub mod config;
#[cfg(not(loom))]
pub mod cudarc_interop;
pub mod device;
mod env;
pub mod error;
mod fence;
mod free_lists;
pub mod global;
mod global_pool;
mod graph_pool;
#[doc(hidden)]
pub mod inbox;
mod legacy_kept;
#[cfg(loom)]
#[doc(hidden)]
pub mod loom_api;
mod outbox;
mod passthrough;
mod ptr;
mod registry;
mod shell;
pub mod shutdown;
pub mod size_class;
pub mod stats;
pub mod stream;
mod superblock;
pub(crate) mod sync;
pub mod trace;

pub use allocator::{Allocator, MAX_OOM_RETRIES, MAX_USER_ARENAS, OomHook};
pub use buffer::DeviceBuffer;
pub use config::{Config, ConfigBuilder, Limit};
#[cfg(not(loom))]
pub use cudarc_interop::CudaBuffer;
pub use device::cuda::CudaDevice;
pub use device::{Device, DeviceKind, Event};
pub use error::{Error, InvalidFree, Result};
pub use global::global;
pub use graph_pool::{GraphCheckpoint, GraphPoolId};
#[doc(hidden)]
pub use outbox::MAX_USER_BATCHES;
pub use ptr::DeviceAddr;
pub use stats::Stats;
pub use stream::{Stream, StreamKey, StreamUse};
pub use trace::TraceSummary;
