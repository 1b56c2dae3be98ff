//! What the slow paths need: the pool, the counted device, and the fencing switch.

use crate::device::counted::Counted;
use crate::error::{Error, Result};
use crate::fence::{Fence, FenceSet};
use crate::global_pool::{GlobalPool, Origin};
use crate::stream::{Stream, StreamKey};
use crate::sync::{Mutex, lock};
use std::sync::Arc;

/// What [`Env::home_fence`] found.
pub(crate) enum HomeFence {
    /// A fence after the home stream's work so far (`None`: none needed).
    Fence(Option<Arc<Fence>>),
    /// The home stream (a user stream) was destroyed: no event can follow its work.
    Gone,
}

/// Borrowed context of one slow-path operation on one thread (a few references and numbers:
/// `Copy`, so a fast path can make one only where it needs one).
#[derive(Clone, Copy)]
pub(crate) struct Env<'a> {
    pub(crate) pool: &'a GlobalPool,
    pub(crate) dev: Counted<'a>,
    pub(crate) skip_fences: bool,
    pub(crate) small_max: usize,
    /// Largest request an arena serves (from large superblocks above `small_max`).
    pub(crate) large_max: usize,
    /// Where errors found after the call that caused them (invalid remote frees) are kept.
    pub(crate) deferred: &'a Mutex<Option<Error>>,
    /// The owner's frees on the legacy stream kept back before one legacy action lets them be
    /// reused: `legacy_batch` blocks or `legacy_batch_bytes` bytes (`config.rs`).
    pub(crate) legacy_blocks: usize,
    pub(crate) legacy_bytes: usize,
}

impl Env<'_> {
    /// Records a fence on `stream`, or none when fencing is switched off for a test.
    pub(crate) fn fence(&self, stream: Stream, key: StreamKey) -> Result<Option<Arc<Fence>>> {
        if self.skip_fences {
            return Ok(None);
        }
        Fence::record(&self.pool.events, &self.dev, stream, key).map(Some)
    }

    /// Queues a legacy action (`fence.rs`), or nothing when fencing is switched off for a test.
    pub(crate) fn legacy_action(&self) -> Result<()> {
        if self.skip_fences || cfg!(cuarena_mutant = "legacy_no_action") {
            return Ok(());
        }
        self.pool.legacy_action.issue(&self.dev)
    }

    /// Publishes the calling thread's frees on the legacy stream so far as one batch: its
    /// ticket for [`Env::legacy_covers`] (`fence.rs`, "One action for every thread's kept-back
    /// frees").
    pub(crate) fn legacy_request(&self) -> u64 {
        self.pool.legacy_action.request()
    }

    /// A lazy legacy fence for the calling thread's frees on the legacy stream so far, under a
    /// ticket taken now, after them (`FenceSet`).
    pub(crate) fn lazy_legacy_fence(&self) -> FenceSet {
        FenceSet::lazy_legacy(self.legacy_request())
    }

    /// True if a legacy action issued after ticket `t` (by any thread) has been queued. With
    /// fencing switched off for a test, never: the batch then goes by the arena's own (empty)
    /// action, as every batch did before tickets.
    pub(crate) fn legacy_covers(&self, t: u64) -> bool {
        !self.skip_fences && self.pool.legacy_action.covers(t)
    }

    /// A fence after all earlier work on an arena's home stream `home` (identity `key`), for
    /// memory leaving that arena: the rule for every such fence.
    ///
    /// The per-thread and legacy streams exist as long as the thread and the process. A user
    /// stream may have been destroyed since the arena was made, and its handle is then not
    /// to be passed to the driver at all: CUDA may have freed what it points to (a call
    /// crashes inside the driver), or given it to a new stream (an event recorded there
    /// orders nothing). So a user stream's handle is used only while the caller is inside a
    /// call that passed that very stream (`live`: the user vouches for it then); otherwise
    /// the stream is [`HomeFence::Gone`] as far as cuarena can know, and only a device
    /// synchronise, which touches no stream, can follow its work (see `allocator.rs`, "Arenas
    /// of user streams that may be gone").
    pub(crate) fn home_fence(&self, home: Stream, key: StreamKey, live: bool) -> Result<HomeFence> {
        if self.skip_fences {
            return Ok(HomeFence::Fence(None));
        }
        if home.is_user() && !live {
            return Ok(HomeFence::Gone);
        }
        self.fence(home, key).map(HomeFence::Fence)
    }

    /// The fence for memory a reclaim takes from an arena outside any call on its home stream:
    /// [`Env::home_fence`], or, where the caller may block (`may_block`: out-of-memory,
    /// `trim(true)`), [`Env::home_fence_or_sync`], so that a user stream's arena can give
    /// memory back after a device synchronise instead of keeping it.
    /// A synchronise refused because a capture forbids it now (one announced, or of a blocking
    /// stream, begun since the caller asked `Inner::may_synchronize`: `Counted::synchronize`)
    /// leaves the memory where it is, as without `may_block`.
    pub(crate) fn reclaim_fence(&self, home: Stream, key: StreamKey, may_block: bool) -> Result<HomeFence> {
        match self.home_fence(home, key, false)? {
            HomeFence::Gone if may_block => match self.dev.synchronize() {
                Ok(()) => Ok(HomeFence::Fence(None)),
                Err(e) if e.is_legacy_refusal() => Ok(HomeFence::Gone),
                Err(e) => Err(e),
            },
            f => Ok(f),
        }
    }

    /// [`Env::home_fence`], synchronising the device where the stream may be gone (a host
    /// block: out-of-memory, blocking trim and exit paths only). Never [`HomeFence::Gone`].
    pub(crate) fn home_fence_or_sync(
        &self,
        home: Stream,
        key: StreamKey,
        live: bool,
    ) -> Result<Option<Arc<Fence>>> {
        match self.home_fence(home, key, live)? {
            HomeFence::Gone => {
                self.dev.synchronize()?;
                Ok(None)
            }
            HomeFence::Fence(f) => Ok(f),
        }
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
            c.add_live(b as u64);
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
