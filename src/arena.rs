//! A per-thread arena: small blocks (and large ones, from large superblocks) for one stream of
//! one thread, its *home*: the thread's per-thread default stream, the legacy stream, or one of
//! the user streams it uses (a thread has one arena for each; see `allocator.rs` for how
//! user-stream arenas are found and given up, and `Env::home_fence` for the fence on a user
//! stream that may have been destroyed).
//!
//! ## Fast path
//! `alloc` and `free_local` run on the owning thread only, touch only owner-only memory (the
//! free lists and the superblocks' boundary tags) and make no CUDA call, take no lock and do
//! no atomic read-modify-write. Blocks are split on allocation and merged with free
//! neighbours on free, in O(1) (see `free_lists.rs` and `superblock.rs`). The owner runs every
//! arena operation inside its claim (`claim.rs`: two plain stores and a load), so that a
//! reclaimer can take the arena while the owner is idle. A local free whose return rule fires
//! is the exception to "no CUDA call, no lock": `shrink` records a fence and takes the pool
//! lock to give a superblock back.
//!
//! ## The block cache
//! In front of the lists sits a small LIFO cache per size class, for classes up to
//! [`CACHED_CLASSES`] (32 KiB) and [`CACHE_DEPTH`] blocks each, so at most 3 MiB per arena.
//! A local free of such a block pushes it there without merging (so does the release of a
//! kept-back legacy free, below), and an allocation of its class pops it: no list is touched.
//! A cached block's head tag reads `PENDING` (so a second free of it is refused) and it counts
//! as free in `live`. The cache is emptied into the lists before any superblock goes back, at
//! exit, and before taking a new superblock.
//!
//! ## Remote frees
//! A free by another thread, or on another stream, does not touch this arena: the freeing
//! thread takes the block's freed flag (a byte in the superblock, see `superblock.rs`: a
//! second free of a block already freed is refused at once), batches it (`outbox.rs`) and pushes
//! the batch, with one fence, into this arena's [`ArenaShell`] inbox (a parked user-stream
//! batch: with none, after a device synchronise). On its slow path the owner drains the inbox,
//! checks each block against its tags (refusing foreign frees), marks it `PENDING` and its
//! freed flag `ARRIVED`, and keeps the batch aside. A pending block is never handed out as it
//! is. A batch whose fence needs no wait (none, freed on the arena's own stream, as another
//! thread's free on the legacy stream is, or seen complete) is merged into the free lists at
//! the next slow path.
//! When nothing else fits, the owner takes pending batches back behind one `cuStreamWaitEvent`
//! each on its home stream (no event query, no host block) before it takes a new superblock;
//! an explicit `flush` merges those whose fence a query finds complete. Merged blocks keep
//! their freed flags until handed out again. When a superblock goes back to the pool, its
//! pending blocks go with it as free ranges guarded by their own fences, and leave the pending
//! list.
//!
//! ## Frees on the legacy stream
//! The owner's free of its own block on the legacy stream (the legacy stream's arena only) is
//! not reusable at once, although reuse is on the same stream: the block may next be used on a
//! per-thread stream, and a per-thread stream orders its work only after earlier legacy-stream
//! *actions*, of which the free is none; its earlier uses may have been on another thread's
//! per-thread stream (which the free's contract orders before later legacy work only). So
//! `free_legacy` checks the block, marks it `PENDING` and keeps it back until a *legacy
//! action* (`fence.rs`: a `cuStreamWaitEvent` on the legacy stream, which CUDA orders after
//! all earlier per-thread-stream work and before all later) issued after the free has been
//! queued, by this thread or any other. The kept-back frees go in halves (`legacy_kept.rs`):
//! once half of `legacy_batch` blocks or of `legacy_batch_bytes` bytes (`config.rs`) are kept
//! back, they are published under a ticket; once a whole batch is, the published half is
//! released (into the block cache where its class has room, else merged into the free lists)
//! if another thread's action covered its ticket (no driver call) and the rest published in
//! its place, and otherwise one action of this arena covers them all. The slow path, finding
//! no fit in its lists, first takes a covered half, then issues an action for all, before it
//! flushes the block cache; a flush issues one. No event, no outbox, no lock. A superblock
//! that leaves the arena takes its kept-back blocks to the pool as free ranges with a lazy
//! legacy fence. Memory kept back this way is, per thread, fewer than `legacy_batch` blocks and
//! `legacy_batch_bytes` bytes plus one block, and it is not stranded: the owner's slow path
//! releases it before it borrows more, and a reclaim without the owner takes it (below).
//!
//! ## Reclaim without the owner ([`Arena::reclaim`])
//! An owner that is idle (blocked elsewhere, parked in a thread pool) never drains its inbox,
//! so memory freed into it by others would stay stranded. On out-of-memory, and in `trim`,
//! any thread takes the arena through its shell's claim (`claim.rs`) when the owner is not
//! inside an allocator call, drains the inbox, and gives back every superblock that holds no
//! used block (on out-of-memory, every superblock with free or pending space, dissolving it).
//! The free ranges go behind one fence on the legacy stream (which follows all earlier work on
//! every per-thread stream, so the owner's local frees), pending blocks behind their own. A
//! user-stream arena's memory goes only where the reclaim may block (out of memory,
//! `trim(true)`), after a device synchronise (`Env::reclaim_fence`); `trim(false)` leaves it.
//!
//! **Stranded-memory bound.** After an out-of-memory reclaim, memory held by arenas beyond what
//! their used blocks occupy is at most: for each arena whose owner was inside an allocator call
//! at that moment, what the return rule below allows it; plus, per other thread, one outbox
//! batch (`batch_blocks` blocks or `batch_bytes` bytes) of frees not yet sent, and its
//! user-stream batches (as much again, `outbox.rs`). An out-of-memory error is returned only
//! after this reclaim and one retry, and, for an arena's request, the pool's first fit.

//! ## Large superblocks
//! Requests over `small_max` (up to `large_max`) are served by the same lists, from *large
//! superblocks*: spans of several normal superblocks, lent by the pool when a large request
//! finds no fit ([`large_superblock_bytes`]: the power of two at or above 4 × the request, 8 to
//! 128 MiB and at least one normal superblock, aligned to the normal superblock size; under a
//! cap, halved down to the request rounded up to whole normal superblocks, `Arena::grow`).
//! One set of free lists: small requests may be carved from a large superblock's free space,
//! and a large request (over `small_max`, at most `S`) may be placed in a normal superblock's
//! free space of at least its size; that is harmless (a normal superblock with a large block
//! is given back, dissolved, like any other), and keeping the two apart would cost the O(1)
//! fit.
//! Large blocks are rounded to the granule, not to a class (as the pool rounds them), so a
//! block left in the pool by a dissolved superblock is checked by the same rule. Their frees
//! take the same paths as small blocks' (local fast path; remote and cross-stream through the
//! outbox, one fence per batch). Host memory: a large superblock's tags (4 bytes per granule,
//! 2 MiB for 128 MiB) are taken at each lending from the pool's stash of zeroed buffers or made,
//! and go back to the stash (at most 8 MiB, `superblock.rs`) or are dropped when the superblock
//! goes back; its freed flags are the registry's, per address (`registry.rs`).
//! **Under a tight cap** a large request needs its whole size in one piece of the pool. While
//! other threads' superblocks are still on their way back (behind fences the reclaim itself
//! has just recorded), the out-of-memory path, which does not wait for those fences, may find
//! none and return out-of-memory where `trim(true)` and a retry would succeed.

//! ## Superblock return rule (Hoard's emptiness rule, on the recent peak, with learnt slack)
//! With `û` the recent peak of the granules in used or remote-pending blocks (below), `a` the
//! granules of the superblocks held, `S` a superblock, `K = keep_empty` and `f = sparse`: after
//! every free, while `û < a - K·S` and `û < (1 - f)·a`, the emptiest superblock goes back to the
//! pool (merely "taken back" if empty; "dissolved" if not, its live blocks becoming pool blocks;
//! cached blocks count as free and are merged first).
//! Such a superblock exists by pigeonhole (the live granules `u <= û`). Hence after every free
//! `a <= max(û + K·S, û / (1 - f))`: **memory stranded in an arena is at most
//! `max(K·S, f/(1-f)·û)` beyond its recent peak**: at the defaults (`K = 2`, `f = 0.6`) two
//! superblocks or 1.5 times that peak, whichever is larger (see `config.rs` for why `f` is not
//! Hoard's 1/4).
//!
//! **The recent peak `û`** is the live granules' running maximum as the rule sees them: at each
//! call of the rule (one per own free of a block of the arena, more inside a give-back; none
//! for the owner's free of a block a dissolved superblock left in the pool) it becomes `u` if
//! `u` is above it, else it decays by 2^-10 of itself, at least a granule
//! ([`RECENT_DECAY_SHIFT`]), or, where `u` is below an eighth of it, halves; and it is 0 while
//! the arena holds no live block. So an arena its thread empties gives back all but `K·S` at
//! that free; one drained to below an eighth of its peak (its last blocks kept back on the
//! legacy stream, or freed by another thread and still on their way, which count in `u`) is
//! within the bound on its live bytes after a few more own frees (`log2(û/u)`); and in one
//! whose live bytes fall to `u` and stay there, above an eighth of the peak, `û` halves every
//! 710 calls until it meets `u` (at most three halvings). A swing deeper than eightfold is
//! taken for a drain. Measured on the live count itself, the rule
//! followed every swing of a working set: the churn workload's live bytes swing twofold over
//! about 17,000 pairs, and each swing gave superblocks back at its low and borrowed them again
//! on the way up (a capture check and an event each, the block cache merged into the lists
//! each time, the pool's lock twice): about 100 driver calls per 10^6 operations on one thread
//! and 140 on 16, against 16 and 25 on `û`, and 9% more pairs a second on 16 threads, for
//! reserved ÷ peak live 3-4% higher (H200, `BENCHMARKS.md`, twenty-second measurement).
//! "Every free" is every free the owner makes (its fast path, and its frees on the legacy
//! stream, which count in `u` while kept back): other threads' frees count in `u` until their
//! batch completes, and a completion, or a release of kept-back legacy frees, at the owner's
//! slow path where it needs memory, does not apply the rule (it gave back superblocks the next
//! allocations borrowed again: `alloc_slow`). An arena whose blocks come back only from other
//! threads thus keeps what its allocations borrowed, until its next own free, `trim`, or out
//! of memory (`reclaim`, without the owner's help).
//!
//! **Learnt slack `E`** ([`EXTRA_MAX`]), only while the arena holds a large superblock (as
//! `L` below; 0 otherwise): the pigeonhole bound does not see fragmentation, so a working set of
//! large blocks of sizes far apart, which needs more than the rule allows, gives a superblock
//! back and borrows one again a little later, an event and the pool's lock each time. A borrow
//! within [`REGRET_WINDOW`] calls of the rule after a give-back by the rule is such a
//! *regretted* give-back: `E` grows by the superblock borrowed, up to `EXTRA_MAX = 384 MiB`. A
//! give-back that no borrow follows within the window halves `E`; `E` also decays by a granule
//! per call, and is forgotten when the last large
//! superblock goes back and at every reclaim (`trim`, out of memory).
//!
//! **With large superblocks** (sizes differ, so `a` is the granules of all superblocks held):
//! the pigeonhole still gives a superblock at most as full as the arena (`live_i / size_i <=
//! u / a`), but the rule gives back a large superblock only when it is empty (dissolving one
//! would scatter its large blocks over a range the pool could otherwise lend whole); while an
//! arena holds any large superblock, the rule keeps `L = 128 MiB` more ([`LARGE_SUPERBLOCK_MAX`]),
//! and `û`, the recent peak of live granules, decays by 1/256 per call (faster than without
//! large superblocks, and with neither the halving below an eighth nor the reset to 0), so a
//! working set that swings does not return and borrow a superblock on every swing. Hence, after every
//! free, `a <= max(û + K·S + L + E, û / (1 - f)) + N`, where `N` is the large superblocks that
//! hold a live block but are not given back for it: **an arena holding large superblocks
//! strands at most `max(K·S + L + E, f/(1-f)·û)` beyond its recent peak (at most
//! `K·S + 512 MiB` or `f/(1-f)·û`), plus its non-empty large superblocks**, each at most
//! `max(8 MiB, 8 × its largest request, S)` and 128 MiB. Without the owner, `trim` takes back
//! every superblock that holds no used block and out of memory everything free (`reclaim`,
//! dissolving superblocks, large ones too), whatever `E` was.
//!
//! **Lean arenas** ([`Arena::set_lean`]): a thread that serves more than `LEAN_AFTER_USER_ARENAS`
//! user streams (`allocator.rs`) multiplies whatever each arena keeps by the streams it cycles
//! through, and a user arena's memory can leave it only inside a call on its stream. So its user
//! arenas keep no slack: no `K`, `f`, `L` or `E`, and they borrow no large superblock (the
//! pool serves their requests over `small_max`: `Slot::alloc_slow_in`). After every own free,
//! while the free granules (`a - u`) come to a normal superblock or more, the rule gives back
//! an empty superblock, if there is one (it fires only while one may be, `may_hold_empty`, so
//! an arena whose free space lies in used superblocks pays nothing per free for it); it
//! dissolves none (each of a dissolved superblock's blocks would then be freed the pool's way,
//! with an event). An arena then gives back every superblock its own frees empty, within the
//! call that empties it (under one event on its stream), and one given up later holds only
//! superblocks with live blocks: **a lean arena strands no empty superblock after its next own
//! free; what it holds beyond its live blocks is their superblocks' free space**. An arena made
//! lean when its thread takes its fifth user stream keeps what it held until its own next free
//! on its stream (only a call there may give memory back); if none comes, it is parked with it
//! at thread exit.
//!
//! ## Thread exit
//! [`Arena::exit`] gives every superblock back (dissolving those with live blocks) under one
//! fence, **then** closes the inbox. It completes no pending batch: frees waiting for their
//! fences (pending batches, those drained at exit included) go to the pool under their own
//! fences, since the exit fence may have been recorded before some of them were made. A free
//! that finds the inbox closed, or a superblock with no owner, goes to the pool, which by then
//! knows the block.

use std::collections::VecDeque;

use crate::env::{Env, HomeFence};
use crate::error::{Error, InvalidFree, Result};
use crate::fence::{Fence, FenceSet};
use crate::free_lists::{FreeBlock, FreeLists};
use crate::legacy_kept::{Kept, LegacyKept, Next};
use crate::shell::{ArenaShell, Batch};
use crate::size_class::{GRANULE_SHIFT, block_bytes, class_floor, class_granules};
use crate::stream::{Stream, StreamKey};
use crate::superblock::{FREE, IN_TRANSIT, PENDING, SbLocal, Superblock, USED};
use crate::sync::Ordering;
use std::sync::Arc;

/// The owner-only arena.
pub(crate) struct Arena {
    pub(crate) shell: Arc<ArenaShell>,
    /// The stream this arena serves: the owner's per-thread default stream, the legacy stream
    /// (one stream for every thread, so each thread's legacy arena serves it too), or a user
    /// stream (its handle; valid while `key` is still its identity).
    pub(crate) home: Stream,
    /// Identity of `home` (for the legacy stream, the same in every thread).
    pub(crate) key: StreamKey,
    /// A user arena's handle was found naming another stream inside a free on it
    /// (`handle_names_home`): the arena's stream is destroyed, and stays so (identities are
    /// never reused), so the identity is not asked again.
    home_gone: bool,
    /// Return-rule frees on a user arena's handle still to pass without asking its identity,
    /// after the driver answered that question with an error (`handle_names_home`): an error
    /// says nothing about the stream (the handle is vouched for by the free that passes it),
    /// so the question is asked again later, not never; at most one failing call per
    /// [`HOME_RETRY`] + 1 such frees.
    home_retry: u16,
    /// Granules of a normal superblock (`S` of the return rule).
    granules: usize,
    /// Granules of every superblock held, normal and large (`a` of the return rule).
    held: usize,
    /// Granules of large superblocks held.
    large_held: usize,
    /// `L` of the return rule: [`LARGE_SUPERBLOCK_MAX`] in granules while a large superblock
    /// is held, else 0.
    large_keep: usize,
    /// The recent peak of `live` (`û` of the return rule, see `over_held`): decays by 2^-10 of
    /// itself, at least a granule, per call of the rule (2^-8 while large superblocks are
    /// held); 0 while `live` is, without large superblocks.
    recent: usize,
    /// `E` of the return rule, in granules: slack learnt from give-backs the arena regretted
    /// (borrowed again within [`REGRET_WINDOW`] calls of the rule), at most [`EXTRA_MAX`]; 0
    /// while no large superblock is held.
    extra: usize,
    /// Calls of the rule (`over_held`) since the last give-back by `shrink`, saturating.
    since_give_back: u32,
    /// A give-back by `shrink` has been followed by no borrow yet, nor by the end of the
    /// window.
    awaiting_regret: bool,
    keep_empty: usize,
    /// A lean arena (see "Lean arenas" above): the rule keeps no slack.
    lean: bool,
    /// Some superblock held may be empty (`live == 0` in it). Invariant, between calls: false
    /// only if none is. Set by every path that can empty one (an own free or a completed
    /// remote free that empties its superblock, legacy frees merged, a range quarantined or
    /// released from quarantine, `set_lean`), cleared by `shrink` when it finds none; an
    /// allocation leaves it as it is (it may only make it stale, never wrong). A superblock
    /// `grow` borrows is empty, but the same call carves the request from it at once, or
    /// quarantines it whole (`carve_around_transit`, which sets the flag), so the flag is not
    /// set there: it would cost a scan and an identity query after every borrow.
    /// A lean arena's rule fires only while it is set, so an arena whose free space is spread
    /// over used superblocks does not scan, flush its cache and ask its stream's identity on
    /// every free, to find nothing to give back.
    may_hold_empty: bool,
    /// `1 - f` of the return rule in units of 2^-20, rounded up and at least 1, so the rule is
    /// integer arithmetic and never off: in 1/1024ths, rounded, a valid `sparse` over
    /// `1 - 1/2048` made it 0, and the rule never gave a superblock back (helper-28).
    dense_q20: usize,
    lists: FreeLists,
    /// Superblocks held.
    owned: Vec<*const Superblock>,
    /// Granules in used or pending blocks.
    live: usize,
    pending: VecDeque<Batch>,
    /// Per-class LIFO of freed blocks not yet merged: `(superblock, first granule)`.
    cache: [Vec<(*const Superblock, u32)>; CACHED_CLASSES],
    /// The owner's own frees on the legacy stream, in the legacy stream's arena: marked
    /// `PENDING` (counted in `live`) until a legacy action issued after them lets them be
    /// reused (see "Frees on the legacy stream" above; `legacy_kept.rs`). Fewer than
    /// `legacy_batch` blocks and `legacy_batch_bytes` bytes, plus the last block.
    legacy_kept: LegacyKept,
    /// Free ranges kept out of the lists because a bad free of the address they start at is
    /// on its way (an `IN_TRANSIT` flag; see `superblock.rs`): tagged `PENDING`, not in `live`,
    /// merged back once that free has arrived and been refused. Empty unless a program frees
    /// pointers it does not own.
    quarantined: Vec<FreeBlock>,
}

/// 1 in the fixed point of `Arena::dense_q20`. Granule counts times this stay far inside a
/// `usize` (2^32 granules are a TiB).
const DENSE_ONE: usize = 1 << 20;

/// The smallest large superblock: 8 MiB.
pub(crate) const LARGE_SUPERBLOCK_MIN: usize = 8 << 20;
/// The largest large superblock: 128 MiB (twice the largest classed request).
pub(crate) const LARGE_SUPERBLOCK_MAX: usize = 128 << 20;

/// The size of the large superblock an arena borrows for a request of `requested` bytes (over
/// `small_max`, at most 64 MiB): the power of two at or above 4 × `requested`, clamped to
/// [`LARGE_SUPERBLOCK_MIN`] ..= [`LARGE_SUPERBLOCK_MAX`], and at least one normal superblock
/// `superblock` (a power of two, so the result is a multiple of it). So one request pins at
/// most `max(8 MiB, 8 × requested)` and at most 128 MiB, and the superblock holds the request
/// with room for three more of its size (fewer above 32 MiB: one at 64 MiB) before the arena
/// borrows again.
pub(crate) fn large_superblock_bytes(requested: usize, superblock: usize) -> usize {
    requested
        .saturating_mul(4)
        .checked_next_power_of_two()
        .unwrap_or(LARGE_SUPERBLOCK_MAX)
        .clamp(LARGE_SUPERBLOCK_MIN, LARGE_SUPERBLOCK_MAX)
        .max(superblock)
        .max(requested.next_multiple_of(superblock))
}

/// A borrow within this many calls of the return rule (about one per free) after a give-back
/// by the rule is a regretted give-back; a give-back with no borrow within it halves `E`
/// ("Learnt slack" above). At 1,024 the halving came too soon in the `large` workload's steady
/// state (give-backs and borrows at 58-74 driver calls per 10^6 operations, against 11-13 at
/// 8,192; host device, 2026-12-01).
const REGRET_WINDOW: u32 = 8192;
/// The most slack regretted give-backs can add to the return rule while large superblocks are
/// held (`E`, "Learnt slack" above), in granules: three of the largest large superblocks, 384
/// MiB. With 8 live blocks of 1 to 64 MiB a thread's large superblocks need about 2.5 times its
/// recent peak of live bytes (fragmentation among sizes that differ 64-fold), which `L` alone
/// did not keep: it gave back a 128 MiB superblock and borrowed one again every 200 frees or so
/// (an event record and the pool's lock each time: 8,000 driver calls per 10^6 operations).
/// With `E` that fell to 11-13 (host device, 2026-12-01).
const EXTRA_MAX: usize = (3 * LARGE_SUPERBLOCK_MAX) >> GRANULE_SHIFT;

/// `û` of the return rule, the recent peak of live granules, decays by 2^-this of itself per
/// call of the rule while no large superblock is held (about one call per own free). At 8,
/// the large superblocks' shift, the churn workload's swings (about 17,000 pairs each) still
/// cost 75 driver calls per 10^6 operations, against 15 at 10 (host device, 2026-12-04).
pub(crate) const RECENT_DECAY_SHIFT: u32 = 10;

/// After an identity query of a user arena's handle fails, the return-rule frees that pass
/// before it is asked again (`Arena::home_retry`): a driver that keeps failing costs one call
/// per 65 such frees, and memory the rule would give back waits that long.
const HOME_RETRY: u16 = 64;

/// Pending batches polled per slow path at most (one event query each).
const MAX_POLLS: usize = 16;
/// Size classes served by the block cache: classes up to 32 KiB.
pub(crate) const CACHED_CLASSES: usize = 40;
/// Blocks cached per class at most.
pub(crate) const CACHE_DEPTH: usize = 8;

impl Arena {
    pub(crate) fn new(
        shell: Arc<ArenaShell>,
        home: Stream,
        key: StreamKey,
        granules: usize,
        keep_empty: usize,
        sparse: f64,
    ) -> Arena {
        Arena {
            shell,
            home,
            key,
            home_gone: false,
            home_retry: 0,
            granules,
            held: 0,
            large_held: 0,
            large_keep: 0,
            recent: 0,
            extra: 0,
            since_give_back: 0,
            awaiting_regret: false,
            keep_empty,
            lean: false,
            may_hold_empty: false,
            dense_q20: ((1.0 - sparse) * DENSE_ONE as f64).ceil().max(1.0) as usize,
            lists: FreeLists::default(),
            owned: Vec::new(),
            live: 0,
            pending: VecDeque::new(),
            cache: std::array::from_fn(|_| Vec::with_capacity(CACHE_DEPTH)),
            legacy_kept: LegacyKept::default(),
            quarantined: Vec::new(),
        }
    }

    fn shell_ptr(&self) -> *mut ArenaShell {
        Arc::as_ptr(&self.shell) as *mut ArenaShell
    }

    /// True if this arena owns `sb`.
    #[inline]
    pub(crate) fn owns(&self, sb: &Superblock) -> bool {
        sb.owner.load(Ordering::Acquire) == self.shell_ptr()
    }

    /// Fast path: a block of `g` granules (class `class`), or `None` if no free block fits.
    #[inline]
    pub(crate) fn alloc(&mut self, class: usize, g: usize) -> Option<u64> {
        // The cache holds whole blocks of its class only: a large request of `g` granules
        // rounded up to a class must not take a bigger cached block (its free, with its own
        // size, would be refused as a size mismatch).
        if let Some((sbp, first)) =
            self.cache.get_mut(class).filter(|_| class_granules(class) == g).and_then(Vec::pop)
        {
            // SAFETY: cached blocks lie in superblocks we own (the cache is emptied before any
            // superblock leaves), and superblocks live as long as the registry.
            let sb = unsafe { &*sbp };
            // SAFETY: we own `sb` (the caller holds the owner's claim) and no other
            // `with_local` on it is active.
            unsafe {
                sb.with_local(|l| {
                    l.restate(first as usize, USED);
                    l.live += g;
                })
            };
            if sb.is_freed(first as usize) {
                sb.unfree(first as usize); // skipped when clear: no write to a shared line
            }
            self.live += g;
            return Some(sb.base + ((first as u64) << GRANULE_SHIFT));
        }
        loop {
            let b = self.lists.take_fit(class)?;
            if let Some(p) = self.carve(b, g) {
                return Some(p);
            }
        }
    }

    /// Hands out the first `g` granules of the free block `b` (taken out of the lists), putting
    /// the rest back; if a bad free of `b`'s first granule is on its way, the last `g` instead,
    /// or, if that cannot be, none: `b` is quarantined and `None` returned (see `superblock.rs`).
    #[inline(always)]
    fn carve(&mut self, b: FreeBlock, g: usize) -> Option<u64> {
        debug_assert!(b.len >= g);
        // SAFETY: every block in our free lists lies in a superblock we own.
        let sb = unsafe { &*b.sb };
        // The mutation `carve_ignores_transit` hands such a block out as any other; the test
        // `a_bad_free_on_its_way_is_not_taken_...` in `tests/adversarial_s4_large_legacy.rs`
        // must then fail.
        let flag = sb.freed_flag(b.first);
        if !cfg!(cuarena_mutant = "carve_ignores_transit") && flag == IN_TRANSIT {
            return self.carve_around_transit(b, g);
        }
        Some(self.carve_at(b, g, flag))
    }

    /// [`Arena::carve`] of a block whose first granule a bad free on its way holds.
    #[cold]
    #[inline(never)]
    fn carve_around_transit(&mut self, b: FreeBlock, g: usize) -> Option<u64> {
        // SAFETY: as in `carve`.
        let sb = unsafe { &*b.sb };
        let tail = b.first + b.len - g;
        if b.len > g && !sb.in_transit(tail) {
            let front = FreeBlock { sb: b.sb, first: b.first, len: b.len - g };
            let lists = &mut self.lists;
            // SAFETY: we own `sb` and no other `with_local` on it is active.
            unsafe {
                sb.with_local(|l| {
                    let id = lists.insert(front);
                    l.mark(front.first, front.len, FREE, id);
                })
            };
            let flag = sb.freed_flag(tail);
            return Some(self.carve_at(FreeBlock { sb: b.sb, first: tail, len: g }, g, flag));
        }
        // SAFETY: as above.
        unsafe { sb.with_local(|l| l.mark(b.first, b.len, PENDING, b.len)) };
        self.quarantined.push(b);
        // A quarantined range counts as free, not live: its superblock may be empty (one
        // borrowed for this very request, quarantined whole).
        self.may_hold_empty = true;
        None
    }

    /// Merges back every quarantined range whose bad free has arrived (flag no longer
    /// `IN_TRANSIT`).
    fn release_quarantine(&mut self) {
        if self.quarantined.is_empty() {
            return;
        }
        self.may_hold_empty = true; // as when the range was quarantined
        let lists = &mut self.lists;
        self.quarantined.retain(|b| {
            // SAFETY: quarantined ranges lie in superblocks we own (`give_back` takes them out).
            let sb = unsafe { &*b.sb };
            if sb.in_transit(b.first) {
                return true;
            }
            // SAFETY: as above.
            unsafe {
                sb.with_local(|l| {
                    l.live += b.len; // `merge_free` counts it out again
                    Self::merge_free(lists, l, b.sb, b.first, b.len);
                })
            };
            false
        });
    }

    /// Hands out the first `g` granules of the free block `b`, putting the rest back; `flag` is
    /// the freed flag at its first granule, not [`IN_TRANSIT`] (a stale `ARRIVED` is cleared).
    #[inline(always)]
    fn carve_at(&mut self, b: FreeBlock, g: usize, flag: u8) -> u64 {
        debug_assert!(cfg!(cuarena_mutant = "carve_ignores_transit") || flag != IN_TRANSIT);
        // SAFETY: every block in our free lists lies in a superblock we own.
        let sb = unsafe { &*b.sb };
        let lists = &mut self.lists;
        // SAFETY: we own `sb` (see above) and no other `with_local` on it is active.
        unsafe {
            sb.with_local(|l| {
                if b.len > g {
                    let rest = FreeBlock { sb: b.sb, first: b.first + g, len: b.len - g };
                    // The carve that takes `rest` reads its head's freed flag, a line nothing
                    // touched since `rest.first` last started a block (a split point is new
                    // each time): fetched now, the read finds it in the cache.
                    sb.prefetch_flag(rest.first);
                    let id = lists.insert(rest);
                    l.mark(rest.first, rest.len, FREE, id);
                }
                l.mark(b.first, g, USED, g);
                l.live += g;
            })
        };
        if flag != 0 {
            sb.unfree(b.first);
        }
        self.live += g;
        sb.base + ((b.first as u64) << GRANULE_SHIFT)
    }

    /// The owner's own free of the block at `ptr` (`g` granules) in `sb`: checked against the
    /// tags and the freed flag (set by a free already on its way, on another stream or by
    /// another thread: a double free), then the flag set, with a plain store. Returns the
    /// block's first granule; a refused free changes nothing.
    #[inline(always)]
    fn accept_own_free(
        l: &SbLocal,
        sb: &Superblock,
        ptr: u64,
        size: usize,
        g: usize,
    ) -> Result<usize, InvalidFree> {
        let first = Self::validate(l, sb, ptr, size, g)?;
        if sb.is_freed(first) {
            return Err(InvalidFree::DoubleFree);
        }
        sb.set_freed(first);
        Ok(first)
    }

    /// The block cache's list for a freed block of `g` granules, if the cache takes it: only a
    /// block of exactly its class's size is cached (a large block, granule-rounded, may lie
    /// between two classes: `alloc` would hand it out as its class's size), and only while its
    /// class has room.
    #[inline(always)]
    fn cache_room(
        cache: &mut [Vec<(*const Superblock, u32)>; CACHED_CLASSES],
        g: usize,
    ) -> Option<&mut Vec<(*const Superblock, u32)>> {
        let class = class_floor(g);
        cache.get_mut(class).filter(|c| c.len() < CACHE_DEPTH && class_granules(class) == g)
    }

    /// Checks that a block of `g` granules starts at `ptr` in `l` and is live.
    #[inline(always)]
    fn validate(l: &SbLocal, sb: &Superblock, ptr: u64, size: usize, g: usize) -> Result<usize, InvalidFree> {
        let off = ptr - sb.base;
        if off & ((1 << GRANULE_SHIFT) - 1) != 0 {
            return Err(InvalidFree::UnknownPointer);
        }
        let first = (off >> GRANULE_SHIFT) as usize;
        match l.head(first) {
            Some((USED, len)) if len == g => Ok(first),
            Some((USED, len)) => {
                Err(InvalidFree::SizeMismatch { allocated: len << GRANULE_SHIFT, given: size })
            }
            Some((PENDING | FREE, _)) => Err(InvalidFree::DoubleFree),
            _ => Err(InvalidFree::UnknownPointer),
        }
    }

    /// Merges the block `[first, first+len)` of `sb` into the free lists.
    #[inline]
    fn merge_free(lists: &mut FreeLists, l: &mut SbLocal, sb: *const Superblock, first: usize, len: usize) {
        l.clear(first, len);
        let (mut start, mut n) = (first, len);
        if let Some(id) = l.free_before(first) {
            let b = lists.remove(id);
            l.clear(b.first, b.len);
            start = b.first;
            n += b.len;
        }
        if let Some(id) = l.free_at(first + len) {
            let b = lists.remove(id);
            l.clear(b.first, b.len);
            n += b.len;
        }
        let id = lists.insert(FreeBlock { sb, first: start, len: n });
        l.mark(start, n, FREE, id);
        l.live -= len;
    }

    /// Checks that `ptr` is a live block of `bytes` in `sb` whose free is not already on its
    /// way: the owner's check of its own free on another stream, made at once (it then goes
    /// the remote way and is applied after its fence).
    pub(crate) fn check_live(sb: &Superblock, ptr: u64, size: usize, bytes: usize) -> Result<()> {
        let g = bytes >> GRANULE_SHIFT;
        // SAFETY: the caller owns `sb` and holds its claim; no other `with_local` is active.
        let r = unsafe {
            sb.with_local(|l| {
                let first = Self::validate(l, sb, ptr, size, g)?;
                if sb.is_freed(first) { Err(InvalidFree::DoubleFree) } else { Ok(()) }
            })
        };
        r.map_err(|reason| Error::InvalidFree { ptr, size, reason })
    }

    /// Fast path: frees a block of this arena on its home stream, merged back at once.
    /// `bytes` is `block_bytes(size)`, which the caller has computed already; `env` makes the
    /// context the return rule needs, if it fires. `asked`: the
    /// call's stream is known to be the home stream (the per-thread stream, or a user stream
    /// whose identity the caller asked); false for a user arena's handle whose identity was not
    /// asked (`allocator.rs`, "A user arena's own frees"), which the return rule then asks
    /// (once it finds another stream there, never again) before it passes the handle to the
    /// driver for a fence.
    #[inline]
    pub(crate) fn free_local<'e>(
        &mut self,
        env: impl FnOnce() -> Env<'e>,
        sb: &Superblock,
        ptr: u64,
        size: usize,
        bytes: usize,
        asked: bool,
    ) -> Result<()> {
        let g = bytes >> GRANULE_SHIFT;
        let lists = &mut self.lists;
        let cache = Self::cache_room(&mut self.cache, g);
        // SAFETY: the caller saw `owns(sb)`; only this thread touches its local state.
        let r = unsafe {
            sb.with_local(|l| {
                let first = Self::accept_own_free(l, sb, ptr, size, g)?;
                match cache {
                    Some(c) => {
                        l.restate(first, PENDING);
                        l.live -= g;
                        c.push((sb as *const Superblock, first as u32));
                    }
                    None => Self::merge_free(lists, l, sb, first, g),
                }
                Ok(l.live == 0)
            })
        };
        let emptied = r.map_err(|reason| Error::InvalidFree { ptr, size, reason })?;
        self.may_hold_empty |= emptied;
        self.live -= g;
        if self.over_held() {
            // Inside a free on the home stream, or on its handle, which may name another stream
            // by now if this free did not ask.
            let env = env();
            let live = asked || self.handle_names_home(&env);
            self.shrink(&env, live);
        }
        Ok(())
    }

    /// True if the handle `home` names this arena's stream (identity `key`) now: asked of the
    /// driver, inside a call that passed that handle (the caller vouches for it then). Once the
    /// answer is another stream, false for good (`home_gone`); after an error (a transient
    /// driver failure, or a capture begun by another thread since this free's capture query),
    /// false without asking for the next [`HOME_RETRY`] calls (`home_retry`), then asked again.
    #[cold]
    #[inline(never)]
    fn handle_names_home(&mut self, env: &Env<'_>) -> bool {
        // The mutation `give_back_unasked` trusts the handle: the tests
        // `frees_on_a_reused_handle_stay_out_of_use_until_a_synchronise` and
        // `a_give_back_after_the_handle_is_reused_is_refused_for_legal_frees` must then fail.
        if cfg!(cuarena_mutant = "give_back_unasked") {
            return true;
        }
        if self.home_gone {
            return false;
        }
        if self.home_retry > 0 {
            self.home_retry -= 1;
            return false;
        }
        match env.dev.stream_key(self.home) {
            Ok(k) if k == self.key => true,
            Ok(_) => {
                self.home_gone = true;
                false
            }
            // The mutation `home_error_latches` treats an error as another stream: the test
            // `a_failed_identity_query_does_not_stop_the_return_rule` must then fail.
            Err(_) if cfg!(cuarena_mutant = "home_error_latches") => {
                self.home_gone = true;
                false
            }
            Err(_) => {
                self.home_retry = HOME_RETRY;
                false
            }
        }
    }

    /// The owner's free, on the legacy stream, of a block of this arena (the legacy stream's):
    /// checked and kept back, not yet reusable; the batch's legacy action is queued once
    /// `legacy_batch` blocks or `legacy_batch_bytes` bytes are kept back (see "Frees on the
    /// legacy stream" above). An invalid free changes nothing.
    pub(crate) fn free_legacy(
        &mut self,
        env: &Env<'_>,
        sb: &Superblock,
        ptr: u64,
        size: usize,
        bytes: usize,
    ) -> Result<()> {
        debug_assert!(self.home.is_legacy(), "only the legacy stream's arena keeps frees back");
        let g = bytes >> GRANULE_SHIFT;
        // SAFETY: the caller saw `owns(sb)`; only this thread touches its local state.
        let r = unsafe {
            sb.with_local(|l| {
                let first = Self::accept_own_free(l, sb, ptr, size, g)?;
                l.mark(first, g, PENDING, g);
                Ok(first)
            })
        };
        let first = r.map_err(|reason| Error::InvalidFree { ptr, size, reason })?;
        let kept = Kept { sb, first: first as u32, granules: g as u32 };
        match self.legacy_kept.push(kept, env.legacy_blocks, env.legacy_bytes) {
            Next::Keep => {}
            Next::Seal => self.legacy_kept.seal(env.legacy_request()),
            Next::Settle(t) => self.settle_legacy(env, t),
            Next::Act => {
                self.release_legacy(env);
            }
        }
        // After every free, as on the fast path (a kept-back free leaves `live` as it was; what
        // a release, here or at a slow path, made free is given back now).
        if self.over_held() {
            self.shrink(env, true); // inside a call on the legacy stream, the home stream
        }
        Ok(())
    }

    /// A whole batch of legacy frees is kept back, half of it sealed under ticket `t`: if
    /// another thread's legacy action covered that half, it is merged back with no driver call
    /// and the rest sealed in its place; otherwise one action of this arena covers them all.
    #[cold]
    #[inline(never)]
    fn settle_legacy(&mut self, env: &Env<'_>, t: u64) {
        // The mutation `legacy_covered_unchecked` takes the published half as covered: the
        // test `legacy_frees::a_published_half_waits_for_an_action_issued_after_it` must then
        // fail.
        if !(cfg!(cuarena_mutant = "legacy_covered_unchecked") || env.legacy_covers(t)) {
            self.release_legacy(env);
            return;
        }
        let blocks = self.legacy_kept.take_sealed();
        self.legacy_kept.seal(env.legacy_request());
        self.merge_legacy(blocks);
    }

    /// Merges back the sealed legacy frees if a legacy action has covered them (no driver
    /// call); true if any were.
    fn release_covered_legacy(&mut self, env: &Env<'_>) -> bool {
        match self.legacy_kept.sealed_ticket() {
            Some(t) if env.legacy_covers(t) => {
                let blocks = self.legacy_kept.take_sealed();
                self.merge_legacy(blocks);
                true
            }
            _ => false,
        }
    }

    /// Queues one legacy action, then merges every frees kept back before it into the free
    /// lists; true if any were. If the action cannot be queued they stay kept back (never
    /// reused unordered) and the error is kept for the caller of `take_deferred_error`.
    #[cold]
    #[inline(never)]
    fn release_legacy(&mut self, env: &Env<'_>) -> bool {
        if self.legacy_kept.is_empty() {
            return false;
        }
        if let Err(e) = env.legacy_action() {
            // A capture's refusal is no error: the frees wait for the next action after it.
            if !e.is_legacy_refusal() {
                env.defer(e);
            }
            return false;
        }
        let blocks = self.legacy_kept.take_all();
        self.merge_legacy(blocks);
        true
    }

    /// Makes kept-back legacy frees a legacy action has followed reusable, as the owner's
    /// frees on its per-thread stream are: each into the block cache if its class is cached
    /// and has room (a cached block's head tag reads `PENDING`, as a kept one's does), else
    /// merged into the free lists. The return rule is not applied here but after every legacy
    /// free (`free_legacy`), and not in the slow path, where the arena needs memory
    /// (`alloc_slow`: applied there, it gave back superblocks the next allocations borrowed
    /// again).
    fn merge_legacy(&mut self, mut blocks: Vec<Kept>) {
        for k in blocks.drain(..) {
            let (first, g) = (k.first as usize, k.granules as usize);
            // SAFETY: kept blocks lie in superblocks we own: `give_back` takes out those of a
            // superblock leaving the arena.
            let sb = unsafe { &*k.sb };
            let cache = Self::cache_room(&mut self.cache, g);
            let lists = &mut self.lists;
            // SAFETY: as above; no other `with_local` on `sb` is active.
            unsafe {
                sb.with_local(|l| {
                    debug_assert_eq!(l.head(first), Some((PENDING, g)), "a kept block not kept");
                    match cache {
                        Some(c) => {
                            // The tags a cached block has: a used block's, its head `PENDING`.
                            l.mark(first, g, USED, g);
                            l.restate(first, PENDING);
                            l.live -= g;
                            c.push((k.sb, k.first));
                        }
                        None => Self::merge_free(lists, l, k.sb, first, g),
                    }
                })
            };
            self.live -= g;
        }
        self.may_hold_empty = true;
        self.legacy_kept.recycle(blocks);
    }

    /// Makes the arena lean, or not (see "Lean arenas" above). Its learnt slack is forgotten.
    #[cold]
    pub(crate) fn set_lean(&mut self, lean: bool) {
        self.lean = lean;
        self.may_hold_empty = true;
        self.extra = 0;
        self.awaiting_regret = false;
        self.recent = self.live;
    }

    /// True if the return rule asks for a superblock back.
    #[inline]
    fn over_held(&mut self) -> bool {
        self.since_give_back = self.since_give_back.saturating_add(1);
        if self.lean {
            // Room for an empty superblock, and maybe one (`shrink` gives back only empty ones).
            // The mutation `lean_rule_unflagged` ignores the flag: the tests
            // `lean_arena_churn_over_{half,quarter}_used_superblocks_asks_the_driver_nothing_more`
            // must then fail.
            let maybe = self.may_hold_empty || cfg!(cuarena_mutant = "lean_rule_unflagged");
            return maybe && self.live + self.granules <= self.held;
        }
        let (u, slack) = if self.large_held == 0 {
            // `û`: the recent peak of `live`, so that a working set that swings keeps its
            // superblocks through the swing; 0 with nothing live, so that an emptied arena
            // gives back at once, and halving below an eighth of it, so that a drain whose last
            // blocks are kept back or in flight (which count in `live`) gives back within a few
            // frees. The mutation `rule_on_live` uses `live` itself: the test
            // `return_rule::a_swinging_working_set_keeps_its_superblocks` must then fail.
            self.recent = if self.live == 0 || cfg!(cuarena_mutant = "rule_on_live") {
                self.live
            } else if self.live < self.recent >> 3 {
                // A drain, not a swing: halved at every call (see "The recent peak" above).
                self.live.max(self.recent >> 1)
            } else {
                // `recent` may be below `live` (allocations do not update it): saturating.
                self.live.max(self.recent.saturating_sub((self.recent >> RECENT_DECAY_SHIFT).max(1)))
            };
            (self.recent, 0)
        } else {
            // With large superblocks, `u` is the recent peak of `live`: it decays by 1/256 per
            // call (one per free), so a working set that swings (a few large blocks freed and
            // then allocated again) keeps its superblocks instead of returning and borrowing.
            self.recent = self.live.max(self.recent - (self.recent >> 8));
            if self.extra != 0 {
                // `E` decays by a granule per call (`EXTRA_MAX` is 384 MiB: about 1.6 million
                // calls from the top), and halves when the rule's last give-back found no
                // borrow within the window.
                self.extra -= 1;
                if self.awaiting_regret && self.since_give_back == REGRET_WINDOW {
                    self.extra /= 2;
                    self.awaiting_regret = false;
                }
            }
            (self.recent, self.large_keep + self.extra)
        };
        let (a, s) = (self.held, self.granules);
        u + self.keep_empty * s + slack < a && u * DENSE_ONE < self.dense_q20 * a
    }

    /// Merges every cached block into the free lists.
    fn flush_cache(&mut self) {
        for (class, c) in self.cache.iter_mut().enumerate() {
            let g = class_granules(class);
            for (sbp, first) in c.drain(..) {
                // SAFETY: cached blocks lie in superblocks we own.
                let sb = unsafe { &*sbp };
                let lists = &mut self.lists;
                // SAFETY: as above.
                unsafe {
                    sb.with_local(|l| {
                        debug_assert_eq!(l.head(first as usize), Some((PENDING, g)));
                        l.restate(first as usize, USED);
                        l.live += g;
                        Self::merge_free(lists, l, sbp, first as usize, g);
                    })
                };
            }
        }
    }

    /// Gives superblocks back until the return rule holds.
    /// `live`: the caller is inside a call on the home stream (see `Env::home_fence`).
    fn shrink(&mut self, env: &Env<'_>, live: bool) {
        self.flush_cache();
        let normal = self.granules;
        while self.over_held() {
            // The emptiest superblock, the largest of equally empty ones; a large superblock
            // only if it is empty (dissolving one would leave its large blocks in the pool,
            // scattered over a range the pool could otherwise lend again whole), and in a lean
            // arena any superblock only if it is empty (its blocks' frees would each take the
            // pool's way, with an event, where the arena's own take none).
            let lean = self.lean;
            let Some(idx) = (0..self.owned.len())
                .filter_map(|i| {
                    let sb = self.owned[i];
                    // SAFETY: we own every superblock in `owned`.
                    let (live, granules) = unsafe { ((*sb).with_local(|l| l.live), (*sb).granules) };
                    (live == 0 || (granules == normal && !lean)).then_some((
                        i,
                        live,
                        std::cmp::Reverse(granules),
                    ))
                })
                .min_by_key(|&(_, live, big)| (live, big))
                .map(|(i, ..)| i)
            else {
                // Only large superblocks in use (they go back when empty), or in a lean arena
                // no empty superblock (the cache was flushed above, so `live` is exact).
                self.may_hold_empty = false;
                return;
            };
            let fence = match env.home_fence(self.home, self.key, live) {
                Ok(HomeFence::Fence(f)) => f,
                // A user stream, outside a call on it: keep the superblock, which goes back with
                // the arena (see `allocator.rs`, "Arenas of user streams that may be gone").
                Ok(HomeFence::Gone) => return,
                // Keep the superblock; try again later (a capture's refusal is no error).
                Err(e) if e.is_legacy_refusal() => return,
                Err(e) => return env.defer(e),
            };
            self.awaiting_regret = true;
            self.since_give_back = 0;
            self.give_back(env, idx, FenceSet::one(fence));
        }
    }

    /// Returns `owned[idx]` to the pool, guarded by `fences` (recorded on our stream).
    fn give_back(&mut self, env: &Env<'_>, idx: usize, fences: FenceSet) {
        let sbp = self.owned.swap_remove(idx);
        // SAFETY: we own `sbp` until `take_back` clears its owner.
        let sb = unsafe { &*sbp };
        let granules = sb.granules;
        // Blocks freed remotely and waiting for their fence are free, not live: they go to the
        // pool as free ranges guarded by their own fence, and leave `pending`, so a second
        // (invalid) free of one is refused by the pool, and no stale entry can later touch this
        // superblock if it is lent to us again.
        let end = sb.base + ((granules as u64) << GRANULE_SHIFT);
        let mut fenced: Vec<(u64, usize, FenceSet)> = Vec::new();
        for batch in &mut self.pending {
            batch.blocks.retain(|fr| {
                let inside = (sb.base..end).contains(&fr.ptr);
                if inside {
                    let bytes = block_bytes(fr.size, env.small_max).unwrap_or(0);
                    fenced.push((fr.ptr, bytes, FenceSet::one(batch.fence.clone())));
                    // Its freed flag stays set: the pool holds the block as free, and whoever
                    // hands that address out again clears it (`superblock.rs`).
                }
                !inside
            });
        }
        self.pending.retain(|b| !b.blocks.is_empty());
        // The owner's frees on the legacy stream kept back here go as free ranges with a lazy
        // legacy fence under a ticket taken now (after them): the pool orders them before any
        // reuse, behind a legacy action issued after the ticket or an event recorded on the
        // legacy stream (`FenceSet::lazy_legacy`). `fences` would not do: it may be an event on the
        // owner's per-thread stream (thread exit), which orders nothing another thread's
        // per-thread stream did before the free.
        let mut lazy = None;
        self.legacy_kept.take_where(|k| {
            let inside = std::ptr::eq(k.sb, sbp);
            if inside {
                let f = lazy.get_or_insert_with(|| env.lazy_legacy_fence()).clone();
                fenced.push((k.addr(sb.base), k.bytes(), f));
            }
            inside
        });
        // Quarantined ranges are free ranges taken out of the lists: free for this arena's
        // stream only (a block freed on it, a pending block made safe by a wait on it, a
        // superblock lent behind a wait on it), so they go behind `fences`, as the free ranges
        // below do. The bad free on its way reaches the pool, which refuses it.
        self.quarantined.retain(|b| {
            let inside = std::ptr::eq(b.sb, sbp);
            if inside {
                let addr = sb.base + ((b.first as u64) << GRANULE_SHIFT);
                fenced.push((addr, b.len << GRANULE_SHIFT, fences.clone()));
            }
            !inside
        });
        let (mut used, mut free) = (Vec::new(), Vec::new());
        let lists = &mut self.lists;
        // SAFETY: as above.
        let live = unsafe {
            sb.with_local(|l| {
                let mut g = 0;
                while g < granules {
                    let addr = sb.base + ((g as u64) << GRANULE_SHIFT);
                    // Each block's tags are cleared as it is passed, so the superblock leaves
                    // with zeroed tags (`SbLocal`'s invariant).
                    let len = match l.head(g) {
                        Some((FREE, id)) => {
                            let b = lists.remove(id);
                            free.push((addr, b.len << GRANULE_SHIFT));
                            b.len
                        }
                        Some((PENDING, len)) => {
                            debug_assert!(
                                fenced.iter().any(|f| f.0 == addr),
                                "a pending block without its batch"
                            );
                            len
                        }
                        Some((_, len)) => {
                            used.push((addr, len << GRANULE_SHIFT));
                            len
                        }
                        None => {
                            unreachable!("boundary tags broken at granule {g} of {:#x}", sb.base)
                        }
                    };
                    l.clear(g, len);
                    g += len;
                }
                l.live
            })
        };
        self.live -= live;
        self.held -= granules;
        if granules > self.granules {
            self.large_held -= granules;
            if self.large_held == 0 {
                self.large_keep = 0;
                self.extra = 0;
            }
            // A large superblock's tags do not stay with it: they go to the pool's bounded
            // stash of zeroed buffers (or are dropped), so the host memory they take is bounded
            // by what arenas hold now, plus the stash.
            // SAFETY: we still own `sb` (until `take_back`).
            env.pool.tag_stash.put(unsafe { sb.with_local(SbLocal::take_tags) });
        }
        let c = env.dev.counters;
        c.bump(if used.is_empty() { &c.superblocks_returned } else { &c.superblocks_dissolved }, 1);
        c.bump(&c.arena_held_bytes, ((granules as u64) << GRANULE_SHIFT).wrapping_neg());
        env.pool.take_back(sb, &used, &free, fences, fenced);
    }

    /// Takes a superblock from the pool, for a request of `g` granules: a normal one for a small
    /// request, a large one ([`large_superblock_bytes`]) for a `large` one (over `small_max`,
    /// as the allocator decided: a small request's `g` is its class's, which may lie above a
    /// `small_max` that is not a class size, so `g` alone cannot tell). If
    /// the pool cannot lend a large one of that size (its cap, or a legacy refusal: see
    /// `Error::is_out_of_room`), smaller ones are asked for, halving down to the request
    /// rounded up to whole normal superblocks. Returns the free-list node of the superblock's
    /// one free block.
    fn grow(&mut self, env: &Env<'_>, g: usize, large: bool) -> Result<usize> {
        // CUDA graphs: an arena does not grow for a stream being captured (see README).
        env.dev.refuse_capturing(self.home)?;
        let s = self.granules << GRANULE_SHIFT;
        let requested = g << GRANULE_SHIFT;
        let least = requested.next_multiple_of(s);
        let mut bytes = if large { large_superblock_bytes(requested, s) } else { s };
        let sb = loop {
            match env.pool.lend(
                &env.dev,
                self.shell_ptr(),
                self.home,
                self.key,
                env.skip_fences,
                bytes,
                requested,
            ) {
                Err(e) if e.is_out_of_room() && bytes > least => {
                    bytes = (bytes / 2).next_multiple_of(s).max(least);
                }
                r => break r?,
            }
        };
        let sbp: *const Superblock = sb;
        let lists = &mut self.lists;
        let granules = sb.granules;
        // SAFETY: the pool just made us the owner.
        let id = unsafe {
            sb.with_local(|l| {
                l.init(granules, &env.pool.tag_stash);
                let id = lists.insert(FreeBlock { sb: sbp, first: 0, len: granules });
                l.mark(0, granules, FREE, id);
                id
            })
        };
        self.owned.push(sbp);
        self.held += granules;
        if granules > self.granules {
            self.large_held += granules;
            self.large_keep = LARGE_SUPERBLOCK_MAX >> GRANULE_SHIFT;
        }
        // A borrow soon after a give-back: the rule returned what the arena still needed (a
        // working set the pigeonhole bound does not see: fragmentation among large blocks of
        // sizes far apart), so keep that much more from now on (only while large superblocks
        // are held, as `L`).
        if self.awaiting_regret && self.since_give_back < REGRET_WINDOW && self.large_held != 0 {
            self.extra = (self.extra + granules).min(EXTRA_MAX);
        }
        self.awaiting_regret = false;
        let c = env.dev.counters;
        c.bump(&c.superblocks_taken, 1);
        c.bump(&c.arena_held_bytes, (granules as u64) << GRANULE_SHIFT);
        Ok(id)
    }

    /// Takes remote frees from the inbox: checks them and sets them aside until their fence.
    pub(crate) fn drain(&mut self, env: &Env<'_>) {
        if self.shell.inbox.is_empty() {
            return;
        }
        for batch in self.shell.inbox.take_all() {
            let mut mine = Vec::with_capacity(batch.blocks.len());
            for fr in batch.blocks {
                match env.pool.registry.lookup(fr.ptr) {
                    Some(sb) if fr.size <= env.large_max && self.owns(sb) => {
                        let g = block_bytes(fr.size, env.small_max).map_or(0, |b| b >> GRANULE_SHIFT);
                        // SAFETY: we own `sb`.
                        let r = unsafe {
                            sb.with_local(|l| {
                                let first = Self::validate(l, sb, fr.ptr, fr.size, g)?;
                                l.mark(first, g, PENDING, g);
                                sb.mark_arrived(first);
                                Ok(())
                            })
                        };
                        match r {
                            Ok(()) => mine.push(fr),
                            Err(reason) => {
                                // This free set the flag (see `superblock.rs`); it is dropped.
                                // A live block starts there only if the size was wrong.
                                if let Some(g) = sb.granule_of(fr.ptr) {
                                    sb.refuse_transit(g, matches!(reason, InvalidFree::SizeMismatch { .. }));
                                }
                                env.refuse_remote(
                                    Error::InvalidFree { ptr: fr.ptr, size: fr.size, reason },
                                    fr.size,
                                )
                            }
                        }
                    }
                    // Not ours (any more): the pool has it, or it is invalid.
                    _ => env.pool_free_remote(fr.ptr, fr.size, batch.fence.clone()),
                }
            }
            if !mine.is_empty() {
                self.pending.push_back(Batch { fence: batch.fence, blocks: mine });
            }
        }
    }

    /// Frees the blocks of a batch whose fence is satisfied.
    fn complete(&mut self, env: &Env<'_>, batch: Batch) {
        let Batch { fence, blocks } = batch;
        for fr in blocks {
            let g = block_bytes(fr.size, env.small_max).map_or(0, |b| b >> GRANULE_SHIFT);
            match env.pool.registry.lookup(fr.ptr) {
                Some(sb) if self.owns(sb) => {
                    let first = ((fr.ptr - sb.base) >> GRANULE_SHIFT) as usize;
                    let lists = &mut self.lists;
                    // SAFETY: we own `sb`; the block was marked PENDING by `drain`.
                    let emptied = unsafe {
                        sb.with_local(|l| {
                            debug_assert_eq!(l.head(first), Some((PENDING, g)));
                            Self::merge_free(lists, l, sb, first, g);
                            l.live == 0
                        })
                    };
                    self.live -= g;
                    self.may_hold_empty |= emptied;
                }
                // `give_back` takes a superblock's pending blocks out of `pending`, so every
                // entry here is in a superblock we own.
                // (Defensively, in release builds: free it through the pool, still fenced.)
                _ => {
                    debug_assert!(false, "a pending block outside our superblocks");
                    env.pool_free_remote(fr.ptr, fr.size, fence.clone());
                }
            }
        }
    }

    /// Completes pending batches whose fences have completed; returns true if any did.
    fn poll(&mut self, env: &Env<'_>) -> bool {
        let (key, dev) = (self.key, env.dev);
        let mut polls = 0;
        self.complete_where(env, |b| match &b.fence {
            None => true,
            // Freed on this arena's own stream (another thread's free on the legacy stream):
            // work on one stream is ordered, so the blocks are free for it now.
            Some(f) if f.stream() == key => true,
            // At most MAX_POLLS queries per call (each is a driver call).
            Some(_) if polls >= MAX_POLLS => false,
            Some(f) => {
                polls += usize::from(!f.known_done());
                f.poll(&dev).unwrap_or(false)
            }
        })
    }

    /// Slow path: drains remote frees, then finds room in this order, asking the device for
    /// nothing it need not: batches whose fence needs no wait (known complete, or freed on this
    /// arena's own stream); the owner's kept-back legacy frees, a covered half first, then all
    /// behind one legacy action (before the cache is flushed: on one thread on the legacy
    /// stream, flushing first merged some 300 cached blocks at nearly every slow path, which
    /// then released the kept-back frees all the same, a quarter of a churn pair's
    /// instructions); cached blocks merged; then pending batches, oldest first, each made safe
    /// for the home stream by one `cuStreamWaitEvent` (no event query, no host block); only
    /// then a new superblock (a large one for a `large` request: see [`Arena::grow`]).
    pub(crate) fn alloc_slow(&mut self, env: &Env<'_>, class: usize, g: usize, large: bool) -> Result<u64> {
        self.drain(env);
        self.release_quarantine();
        // No return rule here, where the arena needs memory: applied after the batches that
        // just completed (64 remote frees that arrive at once), it gave back superblocks the
        // next allocations borrowed again (on 4 threads handing blocks on the legacy stream,
        // one give-back, an event and the pool's lock, every 77 pairs; none on the per-thread
        // stream, whose batches complete below). The next local free applies it.
        if self.complete_ready(env)
            && let Some(p) = self.alloc(class, g)
        {
            return Ok(p);
        }
        // The owner's frees on the legacy stream: the sealed batch if another thread's legacy
        // action covered it, else all behind one action of this arena.
        if self.release_covered_legacy(env)
            && let Some(p) = self.alloc(class, g)
        {
            return Ok(p);
        }
        if self.release_legacy(env)
            && let Some(p) = self.alloc(class, g)
        {
            return Ok(p);
        }
        // Cached blocks may merge into a fit.
        self.flush_cache();
        if let Some(p) = self.alloc(class, g) {
            return Ok(p);
        }
        while let Some(b) = self.pending.pop_front() {
            if let Some(f) = &b.fence
                && let Err(w) = f.wait_for(&env.dev, self.home, self.key)
            {
                self.pending.push_front(b);
                env.defer(w);
                break;
            }
            self.complete(env, b);
            if let Some(p) = self.alloc(class, g) {
                return Ok(p);
            }
        }
        // The fresh superblock's one free block holds the request, but is taken by its id, not
        // by fit: under a cap it may be only the request rounded up to whole superblocks, which
        // can be less than the request's size class (4 MiB + 1 byte is class 4.5 MiB, in 4.25
        // MiB of 256 KiB superblocks), so a fit by class would miss it.
        // (A fresh superblock whose first granule a bad free on its way holds is carved from
        // its end; only one of exactly the request's size is quarantined, and then another is
        // taken.)
        loop {
            let id = self.grow(env, g, large)?;
            let b = self.lists.remove(id);
            if let Some(p) = self.carve(b, g) {
                return Ok(p);
            }
        }
    }

    /// Completes the pending batches that need no wait: fencing off, freed on this arena's
    /// own stream (work on one stream is ordered), or fence already seen complete. No driver
    /// call. True if any did.
    fn complete_ready(&mut self, env: &Env<'_>) -> bool {
        let key = self.key;
        self.complete_where(env, |b| b.fence.as_ref().is_none_or(|f| f.stream() == key || f.known_done()))
    }

    /// Completes, in order, every pending batch for which `done` holds; true if any did.
    fn complete_where(&mut self, env: &Env<'_>, mut done: impl FnMut(&Batch) -> bool) -> bool {
        let (mut i, mut any) = (0, false);
        while i < self.pending.len() {
            if done(&self.pending[i]) {
                let b = self.pending.remove(i).expect("index in range");
                self.complete(env, b);
                any = true;
            } else {
                i += 1;
            }
        }
        any
    }

    /// Gives back to the pool every superblock that holds no used block (with `dissolve`,
    /// every superblock that holds any free or pending space, its used blocks becoming pool
    /// blocks), after taking in the remote frees waiting in the inbox. Returns the bytes given
    /// back. Called by the owner, or by a reclaimer that holds this arena's claim: the free
    /// ranges are guarded by one fence from `fence`, recorded only if something goes back, on
    /// a stream ordered after the owner's local frees (the owner's per-thread stream, or the
    /// legacy stream, which every per-thread stream's earlier work precedes). Pending blocks go
    /// with their own fences. No host block: nothing here waits for the device.
    #[cold]
    pub(crate) fn reclaim(
        &mut self,
        env: &Env<'_>,
        dissolve: bool,
        fence: impl FnOnce() -> Result<HomeFence>,
    ) -> usize {
        // Memory is wanted back: the slack learnt from regretted give-backs is forgotten.
        self.extra = 0;
        self.awaiting_regret = false;
        self.flush_cache();
        self.drain(env);
        // Granules of pending blocks per superblock: the rest of `live` is used.
        let mut pending: Vec<(*const Superblock, usize)> = Vec::new();
        let remote = self.pending.iter().flat_map(|b| b.blocks.iter()).filter_map(|fr| {
            let sb = env.pool.registry.lookup(fr.ptr)?;
            let g = block_bytes(fr.size, env.small_max).map_or(0, |b| b >> GRANULE_SHIFT);
            Some((sb as *const Superblock, g))
        });
        let kept = self.legacy_kept.iter().map(|k| (k.sb, k.granules as usize));
        for (sb, g) in remote.chain(kept) {
            match pending.iter_mut().find(|(p, _)| std::ptr::eq(*p, sb)) {
                Some((_, n)) => *n += g,
                None => pending.push((sb, g)),
            }
        }
        let picks: Vec<usize> = (0..self.owned.len())
            .filter(|&i| {
                let sbp = self.owned[i];
                // SAFETY: we own every superblock in `owned` (or hold the owner's claim).
                let (live, granules) = unsafe { ((*sbp).with_local(|l| l.live), (*sbp).granules) };
                let pend = pending.iter().find(|(p, _)| std::ptr::eq(*p, sbp)).map_or(0, |p| p.1);
                let used = live - pend;
                // Pending and kept-back blocks count in `live` but are free space to give:
                // a superblock full of used and kept-back blocks is dissolved too.
                used == 0 || (dissolve && used < granules)
            })
            .collect();
        if picks.is_empty() {
            return 0;
        }
        let fence = match fence() {
            Ok(HomeFence::Fence(f)) => f,
            Ok(HomeFence::Gone) => return 0, // a destroyed user stream: nothing can go now
            // During a capture that forbids the legacy stream, nothing goes (no error).
            Err(e) if e.is_legacy_refusal() => return 0,
            Err(e) => {
                env.defer(e);
                return 0;
            }
        };
        // Highest index first: `give_back` swap-removes, which then moves only unpicked ones.
        let mut bytes = 0;
        for &idx in picks.iter().rev() {
            // SAFETY: as above.
            bytes += unsafe { (*self.owned[idx]).granules } << GRANULE_SHIFT;
            self.give_back(env, idx, FenceSet::one(fence.clone()));
        }
        bytes
    }

    /// Bytes of the superblocks this arena holds, normal and large.
    pub(crate) fn held_bytes(&self) -> usize {
        self.held << GRANULE_SHIFT
    }

    /// Drains, polls and returns what the return rule allows (an explicit flush).
    pub(crate) fn tidy(&mut self, env: &Env<'_>) {
        self.drain(env);
        self.release_quarantine();
        self.poll(env);
        self.release_legacy(env);
        if self.over_held() {
            self.shrink(env, false); // on no particular stream: a user home is not touched
        }
    }

    /// Thread exit: every superblock back to the pool, then the inbox closed; see the module
    /// comment for why in this order. Returns the shell for reuse. `fence` follows every local
    /// free of the arena (recorded on its stream after them: [`Arena::exit_fence`], or the
    /// owner's last outbox flush there), or is `None` after a device synchronise or where no
    /// superblock is held; making it is the caller's, so that a failure to make it leaves the
    /// arena whole, to be parked (`OwnedArena::exit`).
    pub(crate) fn exit(mut self, env: &Env<'_>, fence: Option<Arc<Fence>>) -> Arc<ArenaShell> {
        self.flush_cache();
        // Frees sent here so far are taken in, and keep their own fences: `fence` (or the
        // synchronise behind `None`) may come before some of them, so none is completed here,
        // not even one freed on this arena's stream (a legacy arena's batch from another
        // thread, whose work follows `fence` on that stream). `give_back` sends each pending
        // block to the pool under its batch's fence.
        self.drain(env);
        // Mutation for the loom model of thread exit: closing first lets a late free reach the
        // pool before the pool knows its block.
        #[cfg(cuarena_mutant = "exit_close_first")]
        let late = self.shell.inbox.close();
        while !self.owned.is_empty() {
            let idx = self.owned.len() - 1;
            self.give_back(env, idx, FenceSet::one(fence.clone()));
        }
        #[cfg(not(cuarena_mutant = "exit_close_first"))]
        let late = self.shell.inbox.close();
        debug_assert!(self.pending.is_empty(), "give_back took every pending block");
        debug_assert!(self.legacy_kept.is_empty(), "give_back took every kept-back legacy free");
        debug_assert!(self.quarantined.is_empty(), "give_back took every quarantined range");
        for batch in late {
            for fr in batch.blocks {
                env.pool_free_remote(fr.ptr, fr.size, batch.fence.clone());
            }
        }
        debug_assert!(self.lists.is_empty());
        // The inbox stays closed while the shell is idle, so late frees go to the pool; the
        // next arena to take the shell reopens it (`Inner::take_shell`).
        Arc::clone(&self.shell)
    }

    /// The fence [`Arena::exit`] needs when its caller has none: none if no superblock is
    /// held, else one recorded now on the home stream, after every local free (a user
    /// stream's arena that holds memory is parked by its caller instead, and comes to `exit`
    /// with the device synchronised; any other way here costs a device synchronise rather than
    /// a call on a handle that may be gone). An error leaves the arena as it was.
    pub(crate) fn exit_fence(&self, env: &Env<'_>) -> Result<Option<Arc<Fence>>> {
        if self.owned.is_empty() { Ok(None) } else { env.home_fence_or_sync(self.home, self.key, false) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_superblocks_are_four_requests_rounded_up_and_clamped() {
        let s = 2 << 20;
        assert_eq!(large_superblock_bytes((1 << 20) + 1, s), 8 << 20);
        assert_eq!(large_superblock_bytes(3 << 20, s), 16 << 20);
        assert_eq!(large_superblock_bytes(8 << 20, s), 32 << 20);
        assert_eq!(large_superblock_bytes((8 << 20) + 256, s), 64 << 20);
        assert_eq!(large_superblock_bytes(64 << 20, s), 128 << 20);
        // A superblock larger than the minimum: at least one of it.
        assert_eq!(large_superblock_bytes(3 << 20, 64 << 20), 64 << 20);
        for r in [(1 << 20) + 1, 5 << 20, 17 << 20, 33 << 20, 64 << 20] {
            let b = large_superblock_bytes(r, s);
            assert!(b >= r && b.is_multiple_of(s) && b <= LARGE_SUPERBLOCK_MAX.max(8 * r));
        }
    }

    /// An arena whose bookkeeping says it holds `large` large superblocks of 128 MiB, all
    /// empty (only the return rule's arithmetic is exercised: it owns no real superblock).
    fn holding_empty_large(large: usize) -> Arena {
        let mut a =
            Arena::new(Arc::default(), Stream::PER_THREAD, StreamKey(7), (2 << 20) >> GRANULE_SHIFT, 2, 0.6);
        a.held = large * (LARGE_SUPERBLOCK_MAX >> GRANULE_SHIFT);
        a.large_held = a.held;
        a.large_keep = LARGE_SUPERBLOCK_MAX >> GRANULE_SHIFT;
        a
    }

    #[test]
    fn slack_at_its_cap_decays_until_the_rule_gives_back() {
        // Four empty 128 MiB superblocks: `K·S + L + E` = 4 + 128 + 384 MiB is more than the
        // 512 MiB held, so the rule keeps them until `E` has decayed by 4 MiB (16,384
        // granules, one per call); without the decay, never.
        let mut a = holding_empty_large(4);
        a.extra = EXTRA_MAX;
        let calls = (1..=1 << 20).find(|_| a.over_held());
        assert_eq!(calls, Some((4 << 20 >> GRANULE_SHIFT) + 1), "calls of the rule until a give-back");
    }

    #[test]
    fn slack_halves_when_no_borrow_follows_a_give_back_within_the_window() {
        let mut a = holding_empty_large(1);
        a.extra = 1 << 20;
        a.awaiting_regret = true;
        a.since_give_back = 0;
        for _ in 0..REGRET_WINDOW {
            a.over_held();
        }
        let decayed = (1 << 20) - REGRET_WINDOW as usize;
        assert_eq!(a.extra, decayed / 2, "halved once, at the end of the window");
        assert!(!a.awaiting_regret);
        for _ in 0..REGRET_WINDOW {
            a.over_held();
        }
        assert_eq!(a.extra, decayed / 2 - REGRET_WINDOW as usize, "not halved again without a give-back");
    }
}
