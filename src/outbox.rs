//! A thread's outbox: remote frees gathered into batches, one fence per batch.
//!
//! A free of an arena's block (up to `large_max`) that is not the calling thread's own block on
//! that arena's stream lands here (the legacy arena's own frees on the legacy stream excepted:
//! `arena.rs` keeps them back). Frees on the per-thread or the legacy stream, which cannot be
//! destroyed, gather per destination arena until the outbox holds `batch_blocks` blocks or
//! `batch_bytes` bytes, the free stream changes, or the thread flushes, reclaims memory (out of
//! memory, `trim`) or exits, and, if frees of pool blocks wait, when the thread's arena reaches
//! its slow path (they keep superblock ranges from coalescing). (Not at every slow path
//! otherwise: a thread that both allocates and frees others' blocks would then send batches of
//! a few blocks, one event each.) A flush records **one** event on the free stream (none if
//! every free in it is a pool block's on the legacy stream: the pool keeps a lazy legacy fence,
//! `FenceSet::lazy_legacy`) and pushes one batch per destination. So at most one batch's worth
//! of freed memory per thread waits unsent: the bound on memory a thread strands this way. (A
//! batch whose fence cannot be made is parked at once: `Inner::park_refused`.)
//!
//! Frees of pool blocks on those streams gather here too, under a null destination: the pool
//! accepted each already (`GlobalPool::begin_free`), and the flush frees them under the
//! batch's fence (`GlobalPool::finish_frees`).
//!
//! ## Frees on user streams
//! A user stream may be destroyed right after any call on it, and CUDA gives its handle to the
//! next new stream, so an event can be recorded on it only inside a call on it, after its
//! identity has been asked (`cuStreamGetId`). Remote frees on a user stream therefore gather in
//! a batch per stream identity ([`UserBatch`], at most [`MAX_USER_BATCHES`] streams per thread)
//! and are sent under **one** event recorded inside a later call on that same stream: the free
//! after which the thread's user-stream batches together hold `batch_blocks` blocks or
//! `batch_bytes` bytes (its stream's batch is sent), or the thread's [`STALE_ALLOCS`]-th
//! allocation of at most `large_max` bytes on that stream since the batch began. Every free in
//! the batch was made on that stream before the event, so the event follows all their earlier
//! uses (the free's contract). A free on a stream being captured into a graph is refused before
//! it joins a batch (one `cuStreamIsCapturing`), so a batch never holds a free whose uses a
//! graph still to be launched may make. A free on a stream past the thread's
//! [`MAX_USER_BATCHES`] batched ones evicts no batch (an evicted batch could not be fenced): it
//! is sent at once, alone, under an event recorded in its own call.
//!
//! A batch that cannot wait for a call on its stream (thread exit, a reclaim that may
//! synchronise, or an event that cannot be recorded, as on a stream being captured when an
//! allocation finds the batch due) is *parked* ([`ParkedFrees`], `allocator.rs`): handed,
//! with no event, to the allocator's parked list, where it waits for the next device
//! synchronise that gives parked memory back (a thread's exit past 64 MiB parked, out of
//! memory, `trim(true)`, the allocator's drop). A synchronise names no stream, and every use of
//! these blocks was queued before it. `flush` and a reclaim that may not synchronise
//! (`trim(false)`) park the thread's user-stream batches only while the parked memory stays
//! within that bound; past it the batches stay here, each sent by the thread's next call
//! on its stream (an allocation or a free there), or parked at the thread's exit (within the
//! bound below). Before, a thread that freed others' blocks on a user
//! stream and flushed after every few frees parked a batch each time, and nothing in steady use
//! synchronises: the parked memory grew without bound (helper-35, `tests/adversarial_s27b.rs`).
//!
//! Parking never synchronises: the memory waits for the next synchronise that happens anyway.
//!
//! **Bound:** besides the batch above, a thread holds unsent, over all its user streams, fewer
//! than `batch_blocks` blocks and `batch_bytes` bytes plus one block; no reclaim by another
//! thread reaches them (as with the batch above). A bad free (wrong size, interior pointer)
//! waiting in a batch holds the block's freed flag as long, so the owner's correct free of
//! that block is refused as a double free meanwhile (the limit stated in the README).

use crate::env::Env;
use crate::error::{Error, Result};
use crate::fence::{Fence, FenceSet};
use crate::shell::{ArenaShell, Batch, Freed};
use crate::size_class::block_bytes;
use crate::stream::{Stream, StreamKey};
use std::sync::Arc;

/// Streams per thread whose remote frees may wait in a batch (see "Frees on user streams"): as
/// many as the user-stream arenas a thread keeps (`allocator.rs`, `MAX_USER_ARENAS`).
pub const MAX_USER_BATCHES: usize = 16;
/// Allocations on its stream after which a partly filled user-stream batch is sent.
pub(crate) const STALE_ALLOCS: u32 = 256;

/// Pending remote frees of one thread.
#[derive(Default)]
pub(crate) struct Outbox {
    stream: Option<Stream>,
    dests: Vec<(*const ArenaShell, Vec<Freed>)>,
    count: usize,
    bytes: usize,
    /// Batches of frees on user streams, one per stream identity (at most
    /// [`MAX_USER_BATCHES`]); none is empty.
    users: Vec<UserBatch>,
    /// Frees towards other arenas from a batch whose fence could not be made (`Outbox::flush`:
    /// a capture refused it, a legacy-stream batch while a blocking stream was being captured
    /// or a per-thread batch while this thread's per-thread stream was, or the driver failed):
    /// taken by the caller right after the flush ([`Outbox::take_refused`], or with the
    /// user-stream batches, [`Outbox::take_user_batches`]), to be parked.
    refused: ParkedFrees,
}

/// Remote frees made on one user stream, waiting for a call on it to fence them.
struct UserBatch {
    key: StreamKey,
    frees: ParkedFrees,
    count: usize,
    /// The thread's allocations on this stream since the batch began.
    allocs: u32,
    /// A `flush` kept the batch here (the parked bound was reached: `Outbox::keep_user_batches`):
    /// the thread's next call on its stream sends it.
    due: bool,
    /// The handle of the batch's latest free: a hint for the owner's fast free on a user stream,
    /// which asks no identity, that a due batch may be this stream's ([`Outbox::due_on`]).
    handle: Stream,
}

/// What a user-stream batch operation leaves its caller: frees to park, an error to keep.
#[derive(Default)]
pub(crate) struct UserSend {
    pub(crate) park: Option<ParkedFrees>,
    pub(crate) err: Option<Error>,
}

impl UserSend {
    fn park(&mut self, frees: ParkedFrees) {
        match &mut self.park {
            Some(p) => p.append(frees),
            None => self.park = Some(frees),
        }
    }
}

/// Remote frees grouped by destination arena (its shell): a user stream's batch, or batches
/// that had to leave the outbox outside a call on their streams (or a batch of the per-thread
/// or legacy stream whose fence could not be made), to be delivered only after a device
/// synchronise that follows every free in them. No destination is null (pool blocks are never parked).
#[derive(Default)]
pub(crate) struct ParkedFrees {
    dests: Vec<(*const ArenaShell, Vec<Freed>)>,
    bytes: usize,
}

// SAFETY: the shell pointers name shells that live as long as the allocator (`Shells::all`),
// and they are only read through `deliver`, by whichever thread holds the parked list's lock.
unsafe impl Send for ParkedFrees {}

impl ParkedFrees {
    /// Adds `fr`, a block of `bytes` bytes (its size rounded as the allocator rounds it).
    fn push(&mut self, dest: *const ArenaShell, fr: Freed, bytes: usize) {
        group(&mut self.dests, dest).push(fr);
        self.bytes += bytes;
    }

    /// Bytes of the blocks held (sizes rounded as the allocator rounds them).
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Moves `other`'s frees into these.
    pub(crate) fn append(&mut self, other: ParkedFrees) {
        for (dest, blocks) in other.dests {
            group(&mut self.dests, dest).extend(blocks);
        }
        self.bytes += other.bytes;
    }

    /// Sends every free under `fence` (`None` only after a device synchronise that followed
    /// them all).
    pub(crate) fn deliver(self, env: &Env<'_>, fence: Option<Arc<Fence>>) {
        for (dest, blocks) in self.dests {
            deliver(env, dest, Batch { fence: fence.clone(), blocks });
        }
    }
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
        group(&mut self.dests, dest).push(fr);
        self.count += 1;
        // The block's bytes, as the user-stream batches count them (`batch_bytes` bounds blocks).
        self.bytes += block_bytes(fr.size, env.small_max).unwrap_or(fr.size);
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

    /// True if frees made on user streams wait here (`tick_user` has work to do).
    #[inline]
    pub(crate) fn holds_user_batches(&self) -> bool {
        !self.users.is_empty()
    }

    /// True if nothing waits in the batch of the per-thread and legacy streams (user-stream
    /// batches aside).
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Adds a free of a block owned by `dest`, made on the user stream `stream` whose identity
    /// the caller asked in this call (`key`). Once the thread's user-stream batches together
    /// hold `blocks` blocks or `bytes` bytes, sends this stream's batch under one event. A new
    /// stream's free past [`MAX_USER_BATCHES`] is sent at once, alone, under its own event.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push_user(
        &mut self,
        env: &Env<'_>,
        key: StreamKey,
        dest: *const ArenaShell,
        fr: Freed,
        stream: Stream,
        blocks: usize,
        bytes: usize,
    ) -> UserSend {
        let mut out = UserSend::default();
        let i = self.users.iter().position(|b| b.key == key);
        // Past `MAX_USER_BATCHES` streams no batch is evicted: none can be fenced outside a
        // call on its stream, so an evicted one would be parked until a device synchronise.
        // This free is sent at once instead, alone, under an event recorded now on its stream
        // (one event for one free, never a synchronise).
        if i.is_none() && self.users.len() >= MAX_USER_BATCHES {
            let mut alone = ParkedFrees::default();
            alone.push(dest, fr, block_bytes(fr.size, env.small_max).unwrap_or(fr.size));
            if cfg!(cuarena_mutant = "user_free_alone_unfenced") {
                alone.deliver(env, None); // the mutation `tests/user_stream_batches.rs` must catch
            } else {
                Self::send_frees(env, alone, key, stream, &mut out);
            }
            return out;
        }
        let i = i.unwrap_or_else(|| {
            self.users.push(UserBatch {
                key,
                frees: ParkedFrees::default(),
                count: 0,
                allocs: 0,
                due: false,
                handle: stream,
            });
            self.users.len() - 1
        });
        let b = &mut self.users[i];
        b.frees.push(dest, fr, block_bytes(fr.size, env.small_max).unwrap_or(fr.size));
        b.count += 1;
        b.handle = stream;
        let due = b.due;
        let (n, total) = self.user_totals();
        if n >= blocks || total >= bytes || due {
            self.send_user(env, i, stream, &mut out);
        }
        out
    }

    /// A `flush` that may not park the user-stream batches (the parked bound is reached) keeps
    /// them here: each is sent by the thread's next call on its stream (an allocation of at
    /// most `large_max`, [`Outbox::tick_user`]; a free of another arena's block,
    /// [`Outbox::push_user`]; any other allocation or free there, [`Outbox::send_due`]), or
    /// parked at its exit.
    pub(crate) fn keep_user_batches(&mut self) {
        for b in &mut self.users {
            b.due = true;
        }
    }

    /// An allocation on the user stream `stream` (identity `key`, asked in this call): sends
    /// that stream's batch once it has waited [`STALE_ALLOCS`] of them, or at once if a `flush`
    /// kept it ([`Outbox::keep_user_batches`]).
    #[inline]
    pub(crate) fn tick_user(&mut self, env: &Env<'_>, key: StreamKey, stream: Stream) -> UserSend {
        let mut out = UserSend::default();
        if let Some(i) = self.users.iter().position(|b| b.key == key) {
            self.users[i].allocs += 1;
            if self.users[i].allocs >= STALE_ALLOCS || self.users[i].due {
                self.send_user(env, i, stream, &mut out);
            }
        }
        out
    }

    /// Sends the batch of the user stream `stream` (identity `key`, asked in this call on it)
    /// if a `flush` kept it ([`Outbox::keep_user_batches`]): the calls on a user stream that
    /// neither [`Outbox::tick_user`] nor [`Outbox::push_user`] sees (a pool block's allocation
    /// or free, the owner's own free).
    pub(crate) fn send_due(&mut self, env: &Env<'_>, key: StreamKey, stream: Stream) -> UserSend {
        let mut out = UserSend::default();
        if let Some(i) = self.users.iter().position(|b| b.key == key && b.due) {
            self.send_user(env, i, stream, &mut out);
        }
        out
    }

    /// True if a batch kept by a `flush` may be `stream`'s: its latest free was on this handle
    /// (a hint; [`Outbox::send_due`] goes by identity).
    #[inline]
    pub(crate) fn due_on(&self, stream: Stream) -> bool {
        self.users.iter().any(|b| b.due && b.handle == stream)
    }

    /// Sends `users[i]` under one event recorded on `stream`, which the caller is inside a
    /// call on and whose identity is the batch's. If no event can be recorded, the batch goes
    /// to `out` to be parked (its frees were made while the stream was not being captured, so
    /// a device synchronise follows every use of their blocks), with the error unless it is
    /// only that the stream is being captured now.
    fn send_user(&mut self, env: &Env<'_>, i: usize, stream: Stream, out: &mut UserSend) {
        let b = self.users.swap_remove(i);
        Self::send_frees(env, b.frees, b.key, stream, out);
    }

    /// Sends `frees`, made on `stream` (identity `key`, inside this call on it), under one
    /// event recorded there now; parks them in `out` if none can be (see [`Outbox::send_user`]).
    fn send_frees(env: &Env<'_>, frees: ParkedFrees, key: StreamKey, stream: Stream, out: &mut UserSend) {
        match env.fence(stream, key) {
            Ok(fence) => frees.deliver(env, fence),
            Err(e) => {
                out.park(frees);
                if !matches!(e, Error::StreamCapturing { .. }) {
                    out.err = Some(e);
                }
            }
        }
    }

    /// Takes every user-stream batch, to be parked: outside a call on their streams none can
    /// be fenced. The refused legacy frees go with them.
    pub(crate) fn take_user_batches(&mut self) -> Option<ParkedFrees> {
        let mut all = std::mem::take(&mut self.refused);
        for b in self.users.drain(..) {
            all.append(b.frees);
        }
        (!all.dests.is_empty()).then_some(all)
    }

    /// Takes the frees a capture refused (`refused`), to be parked; the user-stream batches
    /// stay, for a later call on their streams (or the thread's exit) to send.
    pub(crate) fn take_refused(&mut self) -> Option<ParkedFrees> {
        let all = std::mem::take(&mut self.refused);
        (!all.dests.is_empty()).then_some(all)
    }

    /// Bytes of the blocks in the user-stream batches.
    pub(crate) fn user_batch_bytes(&self) -> usize {
        self.user_totals().1
    }

    /// Blocks and bytes in the user-stream batches.
    fn user_totals(&self) -> (usize, usize) {
        self.users.iter().fold((0, 0), |(n, t), b| (n + b.count, t + b.frees.bytes))
    }

    /// Sends every gathered free under one fence, and returns that fence with its stream.
    /// `ptds` is the calling thread's per-thread stream identity. If no fence can be made, the
    /// pool's blocks take a lazy legacy fence, as when all go to the pool (a legacy operation
    /// at their reuse follows the earlier work of every per-thread stream too, `fence.rs`),
    /// and the others wait in `refused` to be parked until a device synchronise. Where a
    /// capture refused the record, that is no error (no fence is returned): on the legacy
    /// stream while a blocking stream is being captured (`Device::stream_capturing`: the record
    /// would invalidate that capture), or on the per-thread stream while this thread captures
    /// it (frees made before the capture began; or during it, which cuarena does not see on the
    /// per-thread stream, as it does not see the owner's own frees there (README, "CUDA
    /// graphs"): they are taken as made before it). Any other failure is returned.
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
        // a lazy legacy fence under a ticket taken after them, ordered at reuse (`FenceSet`).
        if stream.is_legacy() && !env.skip_fences && dests.iter().all(|(d, _)| d.is_null()) {
            let lazy = env.lazy_legacy_fence();
            for (_, blocks) in dests {
                env.pool.finish_frees(blocks.iter().map(|fr| fr.ptr), lazy.clone());
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
        let fence = match key.and_then(|k| env.fence(stream, k)) {
            Ok(f) => f,
            // The batch's stream is the per-thread or the legacy stream (`batchable`), and a
            // capture refuses either by its own name (the legacy stream's refusal is
            // `is_legacy_refusal`'s): no error then. Any other failure (the identity, the
            // capture check, the record) is returned, and the frees are kept the same way: a
            // driver that refuses one call may take the next, and a synchronise follows every
            // use of them. The mutation `legacy_refusal_drops_frees` drops them on a capture's
            // refusal, and `failed_flush_drops_frees` on any other failure, as the code before
            // each did: the `adversarial_s23::pending_remote_legacy_frees_*` tests and
            // `capture::remote_per_thread_frees_flushed_during_the_threads_own_capture_come_back`,
            // and `adversarial_s27c::a_failed_capture_check_in_release_thread_loses_no_memory`,
            // must then fail.
            Err(e) => {
                let refusal = e.is_capture_of(stream);
                if (refusal && cfg!(cuarena_mutant = "legacy_refusal_drops_frees"))
                    || (!refusal && cfg!(cuarena_mutant = "failed_flush_drops_frees"))
                {
                    return Err(e);
                }
                let lazy = env.lazy_legacy_fence();
                for (dest, blocks) in dests {
                    if dest.is_null() {
                        env.pool.finish_frees(blocks.iter().map(|fr| fr.ptr), lazy.clone());
                    } else {
                        for fr in blocks {
                            self.refused.push(
                                dest,
                                fr,
                                block_bytes(fr.size, env.small_max).unwrap_or(fr.size),
                            );
                        }
                    }
                }
                return if refusal { Ok(Some((stream, None))) } else { Err(e) };
            }
        };
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

/// The frees gathered for `dest`, a new empty group if none.
fn group(dests: &mut Vec<(*const ArenaShell, Vec<Freed>)>, dest: *const ArenaShell) -> &mut Vec<Freed> {
    let i = match dests.iter().position(|(d, _)| *d == dest) {
        Some(i) => i,
        None => {
            dests.push((dest, Vec::new()));
            dests.len() - 1
        }
    };
    &mut dests[i].1
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
