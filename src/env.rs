//! What the slow paths need: the pool, the counted device, and the fencing switch.

use crate::device::counted::Counted;
use crate::error::{Error, Result};
use crate::fence::Fence;
use crate::global_pool::{GlobalPool, Origin};
use crate::stream::{Stream, StreamKey};
use crate::sync::{Mutex, lock};
use std::sync::Arc;

/// Borrowed context of one slow-path operation on one thread.
pub(crate) struct Env<'a> {
    pub(crate) pool: &'a GlobalPool,
    pub(crate) dev: Counted<'a>,
    pub(crate) skip_fences: bool,
    pub(crate) small_max: usize,
    /// Largest request an arena serves (from large superblocks above `small_max`).
    pub(crate) large_max: usize,
    /// Where errors found after the call that caused them (invalid remote frees) are kept.
    pub(crate) deferred: &'a Mutex<Option<Error>>,
}

impl Env<'_> {
    /// Records a fence on `stream`, or none when fencing is switched off for a test.
    pub(crate) fn fence(&self, stream: Stream, key: StreamKey) -> Result<Option<Arc<Fence>>> {
        if self.skip_fences {
            return Ok(None);
        }
        Fence::record(&self.pool.events, &self.dev, stream, key).map(Some)
    }

    /// Keeps an error found away from its caller for `take_deferred_error`.
    pub(crate) fn defer(&self, e: Error) {
        *lock(self.deferred) = Some(e);
    }

    /// A remote free of `size` bytes was refused by the block's owner or the pool: counts it,
    /// undoes the statistics its sender counted, and keeps the error.
    pub(crate) fn refuse_remote(&self, e: Error, size: usize) {
        let c = self.dev.counters;
        c.bump(&c.invalid_frees, 1);
        c.bump(&c.deallocations, u64::MAX); // -1
        if let Some(b) = crate::size_class::block_bytes(size, self.small_max) {
            c.bump(&c.live_bytes, b as u64);
        }
        self.defer(e);
    }

    /// Frees through the pool a block freed towards an arena that no longer holds it (the
    /// free was on its way: see `superblock.rs`), refusing it if invalid.
    pub(crate) fn pool_free_remote(&self, ptr: u64, size: usize, fence: Option<Arc<Fence>>) {
        if let Err(e) = self.pool.free(ptr, size, fence, Origin::Transit) {
            self.refuse_remote(e, size);
        }
    }
}
