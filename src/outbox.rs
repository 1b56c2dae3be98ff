//! A thread's outbox: remote frees gathered into batches, one fence per batch.
//!
//! A free of a small block that is not the calling thread's own block on that arena's stream
//! lands here. Frees on the per-thread or the legacy stream, which cannot be destroyed, gather
//! per destination arena until the outbox holds `batch_blocks` blocks or `batch_bytes` bytes,
//! the free stream changes, or the thread flushes, reclaims memory (out of memory, `trim`) or
//! exits, and, if frees of pool blocks wait, when the thread's arena reaches its slow path
//! (they keep superblock ranges from coalescing). (Not at every slow path otherwise: a thread
//! that both allocates and frees others' blocks would then send batches of a few blocks, one
//! event each.) A flush
//! records **one** event on the free stream and pushes one batch per destination. So at most
//! one batch's worth of freed memory per thread waits unsent: the bound on memory a thread
//! strands this way.
//!
//! Frees of pool blocks on those streams gather here too, under a null destination: the pool
//! accepted each already (`GlobalPool::begin_free`), and the flush frees them under the
//! batch's fence (`GlobalPool::finish_frees`).
//!
//! A free on a user stream is sent at once ([`send_now`]) with its own fence: the caller may
//! destroy the stream right after the free, and a later flush could not record on it.

use crate::env::Env;
use crate::error::Result;
use crate::fence::{Fence, FenceSet};
use crate::shell::{ArenaShell, Batch, Freed};
use crate::stream::{Stream, StreamKey};
use std::sync::Arc;

/// Pending remote frees of one thread.
#[derive(Default)]
pub(crate) struct Outbox {
    stream: Option<Stream>,
    dests: Vec<(*const ArenaShell, Vec<Freed>)>,
    count: usize,
    bytes: usize,
}

impl Outbox {
    /// True if frees on `stream` may wait in the outbox: it can never be destroyed.
    pub(crate) fn batchable(stream: Stream) -> bool {
        stream.is_per_thread() || stream.is_legacy()
    }

    /// Adds a free of a block owned by `dest` (null: a pool block the pool has accepted), made
    /// on a [`Outbox::batchable`] stream. If the
    /// stream differs from the gathered frees', those are flushed first; if that fails, `fr`
    /// is not taken and the error is returned. The caller flushes when [`Outbox::is_full`].
    pub(crate) fn push(
        &mut self,
        env: &Env<'_>,
        ptds: StreamKey,
        dest: *const ArenaShell,
        fr: Freed,
        stream: Stream,
    ) -> Result<()> {
        if self.stream.is_some_and(|s| s != stream) {
            self.flush(env, ptds)?;
        }
        self.stream = Some(stream);
        match self.dests.iter_mut().find(|(d, _)| *d == dest) {
            Some((_, v)) => v.push(fr),
            None => self.dests.push((dest, vec![fr])),
        }
        self.count += 1;
        self.bytes += fr.size;
        Ok(())
    }

    /// True if frees of pool blocks wait here.
    pub(crate) fn holds_pool_frees(&self) -> bool {
        self.dests.iter().any(|(d, _)| d.is_null())
    }

    /// True once `blocks` frees or `bytes` bytes are gathered: time to flush.
    pub(crate) fn is_full(&self, blocks: usize, bytes: usize) -> bool {
        self.count >= blocks || self.bytes >= bytes
    }

    /// True if nothing waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Sends every gathered free under one fence, and returns that fence with its stream.
    /// `ptds` is the calling thread's per-thread stream identity. If no fence can be recorded,
    /// the blocks are dropped: never reused, so memory is lost but never corrupted; the error
    /// is returned.
    pub(crate) fn flush(
        &mut self,
        env: &Env<'_>,
        ptds: StreamKey,
    ) -> Result<Option<(Stream, Option<Arc<Fence>>)>> {
        let Some(stream) = self.stream.take() else {
            return Ok(None);
        };
        let dests = std::mem::take(&mut self.dests);
        self.count = 0;
        self.bytes = 0;
        // Frees on the legacy stream that all go to the pool need no event now: the pool keeps
        // a lazy legacy fence, recorded only if a user stream reuses the memory (`FenceSet`).
        if stream.is_legacy() && !env.skip_fences && dests.iter().all(|(d, _)| d.is_null()) {
            for (_, blocks) in dests {
                env.pool.finish_frees(blocks.iter().map(|fr| fr.ptr), FenceSet::lazy_legacy());
            }
            return Ok(Some((stream, None)));
        }
        let key = if stream.is_per_thread() {
            Ok(ptds)
        } else if stream.is_legacy() {
            env.pool.legacy_key(&env.dev)
        } else {
            env.dev.stream_key(stream)
        };
        let fence = key.and_then(|k| env.fence(stream, k))?;
        for (dest, blocks) in dests {
            if dest.is_null() {
                env.pool.finish_frees(blocks.iter().map(|fr| fr.ptr), FenceSet::one(fence.clone()));
            } else {
                deliver(env, dest, Batch { fence: fence.clone(), blocks });
            }
        }
        Ok(Some((stream, fence)))
    }
}

/// Sends one free made on a user stream, fenced now. On error nothing has changed.
pub(crate) fn send_now(env: &Env<'_>, dest: *const ArenaShell, fr: Freed, stream: Stream) -> Result<()> {
    let key = env.dev.stream_key(stream)?;
    let fence = env.fence(stream, key)?;
    deliver(env, dest, Batch { fence, blocks: vec![fr] });
    Ok(())
}

/// Pushes `batch` into `dest`'s inbox, or into the pool if its owner has exited.
fn deliver(env: &Env<'_>, dest: *const ArenaShell, batch: Batch) {
    // SAFETY: shells live as long as the allocator, which `env` borrows.
    if let Err(batch) = unsafe { &*dest }.inbox.push(batch) {
        // The owner has exited: its superblocks are the pool's now.
        for fr in batch.blocks {
            env.pool_free_remote(fr.ptr, fr.size, batch.fence.clone());
        }
    }
}
