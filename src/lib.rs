//! cuarena: a CUDA device-memory allocator for many threads.
pub mod config;
pub mod device;
pub mod error;
pub mod size_class;
pub mod stream;
pub(crate) mod sync;
pub mod shutdown;
