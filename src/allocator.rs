//! The public allocator: routing of each request, and each thread's slot.
//!
//! ## Routing (the one place it is decided)
//! - `size == 0`: a null pointer, like `cudaMallocAsync`; freeing null with size 0 is a no-op.
//! - `size <= large_max` (small blocks up to `small_max`, large ones from large superblocks
//!   above it) on the per-thread stream (`0x2`): the calling thread's per-thread arena; on the
//!   legacy stream (NULL or `0x1`): the calling thread's legacy arena (see [`arena_index`]).
//!   Neither asks the driver anything on the fast path: the per-thread stream's identity is
//!   asked once per thread, the legacy stream's once per allocator.
//! - `size <= large_max` on a user stream: the calling thread's arena for that stream, found
//!   by the stream's identity (one `cuStreamGetId` per allocation, never the handle; see
//!   [`Arenas`]), made on first use; a thread keeps at most [`MAX_USER_ARENAS`] of them. With
//!   no room for another (`Slot::new_user_arena`, "Making room"), the pool serves the stream;
//!   past [`LEAN_AFTER_USER_ARENAS`] user arenas they are lean and the pool serves their
//!   requests over `small_max` (`arena.rs`, "Lean arenas").
//! - `size > large_max`: the global pool. So is an arena's request while a reclaimer holds the
//!   arena, or when it still finds no superblock after the out-of-memory reclaim and retry
//!   below (the pool's first fit may find room for the request where it has none for a
//!   superblock).
//! - A free of a block of at most `large_max` bytes goes to its superblock's owner: the
//!   owner's fast path if the caller is the owner and frees on that arena's stream (the
//!   per-thread arena on `0x2`, a user arena on its stream's handle, below); the legacy arena's
//!   own free on the legacy stream is kept back in it (`Arena::free_legacy`); otherwise, with
//!   the block's freed flag taken, the caller's outbox (on a user stream, that stream's batch),
//!   and from there, fenced, to the owner's inbox. A block whose superblock has no owner, and
//!   every block over `large_max`, goes to the pool: on the per-thread and legacy streams
//!   accepted at once and fenced with the outbox's next batch, on a user stream with a fence
//!   recorded at once.
//! - On out-of-memory, memory held without live blocks in this thread's and idle threads'
//!   arenas is taken back and the request tried once more (`Slot::reclaim`).
//!
//! ## A user arena's own frees
//! The owner's free of its user arena's block, given the handle of the arena's stream, is
//! taken on the fast path without asking the stream's identity. It cannot be handed to
//! another stream unfenced, for two facts about CUDA: a stream has one handle for its life, and
//! an identity (`cuStreamGetId`) is never given to another stream. Every allocation from the
//! arena asks the identity of its handle and finds the arena by it. If the handle `h` named the
//! arena's stream `X` at one allocation and names `X` at the next, `X` existed all along and `h`
//! was its handle, so every free on `h` in between was a free on `X`: the arena's own. If `h`
//! names another stream `Y` by then (`X` was destroyed and CUDA gave `h` to `Y`), the frees
//! on `h` since `X` was destroyed were frees on `Y` (or on a destroyed handle, which the
//! contract does not allow), and their blocks lie in `X`'s free lists. They stay out of use
//! until a device synchronise, for the ways memory leaves a user arena are these:
//! - an allocation, whose identity is then `X`'s: never again, since `X` is gone;
//! - the return rule's give-back inside a free on `h`, which asks `h`'s identity first
//!   (`Arena::free_local`) and keeps the superblock unless it is `X`'s (having once found
//!   another, the arena asks no more and keeps everything; after an error, which says nothing
//!   about the stream, it keeps the superblock this time and asks again 64 such frees later);
//! - the arena given up (least recently used, thread exit) or reclaimed: parked until a device
//!   synchronise, or taken only after one (below; with fencing switched off for a test, given
//!   back at once).
//!
//! So a user stream costs one `cuStreamGetId` per allocation (after a `cuStreamIsCapturing`:
//! `Device::stream_key`) and, per free of the arena's own blocks on its handle, the
//! `cuStreamIsCapturing` alone (a block freed into a graph capture must not be handed out
//! after it), plus the identity when the return rule fires (about once per 10^4 frees in
//! steady churn). A free on any other handle asks the identity: it may be a free on another
//! stream (a cross-stream free, fenced) or on a reused handle.
//!
//! ## Arenas of user streams that may be gone
//! A user-stream arena's local frees record no event, and its stream may be destroyed at any
//! moment after the user's last call on it; the stale handle must then never reach the driver
//! (it may name no stream, and crash the driver, or a new stream). So memory leaves a user
//! arena under an event on its stream only inside a call on that stream (the return rule);
//! when the arena is given up elsewhere (thread exit, replacement of the least recently used
//! one) while it holds memory, it is parked ([`Zombies`]) until the next allocation on its own
//! stream adopts it (`Slot::new_user_arena`: that call proves the stream alive), or one device
//! synchronise, which names no stream, gives back everything parked (more than
//! `ZOMBIE_BYTES` parked at a thread's exit, out-of-memory, `trim(true)`, or the allocator's
//! drop). A replacement parks only within `ZOMBIE_BYTES`, and never synchronises: past it the
//! pool serves the stream instead (`Slot::new_user_arena`, "Making room"). Reclaim by another
//! thread takes a user arena's memory only where it may block (out-of-memory, `trim(true)`),
//! after a device synchronise (`Env::reclaim_fence`). Remote frees on a user stream that
//! cannot wait in their thread's outbox for a call on that stream are parked the same way
//! (`outbox.rs`); `flush` parks them, too, only within `ZOMBIE_BYTES` ([`Park`]).

use std::cell::RefCell;

use crate::arena::Arena;
use crate::config::Config;
use crate::device::counted::Counted;
use crate::device::cuda::CudaDevice;
use crate::device::{Device, DeviceKind};
use crate::env::{Env, HomeFence};
use crate::error::{Error, InvalidFree, Result};
use crate::fence::{Fence, FenceSet};
use crate::global_pool::{GlobalPool, Origin};
use crate::graph_pool::{FreeAs, GraphCheckpoint, GraphPoolId, GraphPools, RestoreRefused, Want};
use crate::outbox::{Outbox, ParkedFrees, UserSend};
use crate::shell::{ArenaShell, Freed};
use crate::size_class::{GRANULE, block_bytes, class_ceil, class_granules, granules_for};
use crate::stats::{AllocPath, CounterRegistry, Counters, Stats};
use crate::stream::{Stream, StreamKey, StreamUse};
use crate::superblock::Superblock;
use std::sync::{Arc, Weak};

use crate::sync::{AtomicUsize, Condvar, Mutex, Ordering, lock, next_id, thread_local};

// Re-exported for the C ABI's `crate::allocator::DeviceAddr`; the type lives in `ptr.rs`.
pub use crate::ptr::DeviceAddr;

/// A device-memory allocator for one device. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Allocator {
    inner: Arc<Inner>,
}

/// In a forked child, an allocator made before the fork is never dropped: its pool, events,
/// trace file and device belong to the parent, and their locks may be held by threads the child
/// does not have (`shutdown.rs`, "Fork"). Each handle dropped there leaks one count instead.
impl Drop for Allocator {
    fn drop(&mut self) {
        if self.inner.born.forked() {
            std::mem::forget(Arc::clone(&self.inner));
        }
    }
}

/// Registers, once, the fork handlers of every module an allocator uses (`shutdown.rs`, "Fork").
fn install_fork_handlers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        crate::shutdown::at_fork(None, None, Some(forget_slots_in_child));
        crate::sync::install_fork_handlers();
        crate::trace::install_fork_handlers();
    });
}

/// The fork's child handler: the forking thread's slots, all of allocators made before the
/// fork, are forgotten, never given back (their arenas are the parent's, and giving them back
/// would take the parent's locks). The thread's next call on such an allocator finds no slot and
/// is refused on its slow path.
extern "C" fn forget_slots_in_child() {
    let _ = SLOTS.try_with(|cell| match cell.try_borrow_mut() {
        Ok(mut slots) => std::mem::forget(std::mem::take(&mut *slots)),
        // The fork was made inside a call of this thread's (its device's, or its OOM hook's):
        // forgotten when the call lets the slots go ([`forget_slots_if_forked_inside`]).
        Err(_) => {
            let _ = FORKED_INSIDE_A_CALL.try_with(|f| f.set(true));
        }
    });
}

/// After a call of a pre-fork allocator that held the thread's slots (`with_slot`): forgets
/// them if the process forked inside it (this is the child), before any fast path finds them.
#[inline]
fn forget_slots_if_forked_inside() {
    // The mutation `fork_inside_call_kept` never forgets them late: the test
    // `adversarial_s29b_fork::fork_inside_a_call_leaves_the_forked_allocators_fast_paths_serving_in_the_child`
    // must then fail.
    if !cfg!(cuarena_mutant = "fork_inside_call_kept")
        && FORKED_INSIDE_A_CALL.try_with(|f| f.replace(false)).unwrap_or(false)
    {
        forget_slots_in_child();
    }
}

impl std::fmt::Debug for Allocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("device", &self.inner.device.kind().name())
            .field("ordinal", &self.inner.device.ordinal())
            .field("config", &self.inner.cfg)
            .field("pool_in_use_bytes", &self.inner.pool.in_use())
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    id: u64,
    /// The fork generation it was made in: unusable in a child forked since (`shutdown.rs`).
    born: crate::shutdown::Born,
    device: Arc<dyn Device>,
    cfg: Config,
    pool: GlobalPool,
    counters: CounterRegistry,
    shells: Mutex<Shells>,
    /// Arenas of destroyed user streams (and legacy arenas of threads that exited during a
    /// capture), waiting for a device synchronise (see [`Zombies`]).
    zombies: Mutex<Zombies>,
    deferred: Mutex<Option<Error>>,
    /// Frees refused because a stream was being captured into a CUDA graph and held (see
    /// [`Allocator::deallocate_or_hold`]: dropped buffers', the C ABI's `cuarena_free_or_hold`):
    /// made again by the next `graph_capture_end`, `flush`, `trim` or `release_thread`, until
    /// no capture refuses them. Their blocks count as live meanwhile.
    /// Invariants: at most one entry a block; an entry stays in the list while it is retried
    /// (marked with the retry's token), and a free of that block by anyone else meanwhile
    /// waits (`held_settled`) until the retry settles it: taken (the entry goes: the free is
    /// then of the block's next life, or a plain double free), refused for another reason (the
    /// entry goes, the error is deferred, and the waiting free goes on), or refused again by a
    /// capture (unmarked: the free is refused as a double free); `held_count` is the list's
    /// length, written under its lock. A free that races the hold itself (neither ordered
    /// before the other) may be taken too, as two racing frees may (README).
    held: Mutex<Vec<HeldFree>>,
    /// Signalled, once `held`'s lock is released, whenever a retried entry is settled (gone or
    /// unmarked).
    held_settled: Condvar,
    /// `held.len()`, read without the lock: 0 lets every free skip the held-list check (the
    /// fast path reads it with one `Relaxed` load).
    held_count: AtomicUsize,
    /// Announced captures ended (`graph_capture_end`), counted before each end's retry of the
    /// held frees. A free refused by a capture and held after such an end's retry had marked
    /// the list sees the count changed since its refusal, and retries itself (see
    /// [`Allocator::deallocate_or_hold`]).
    capture_ends: AtomicUsize,
    arenas: AtomicUsize,
    /// Pass-through mode (passthrough.rs): when set, every request goes straight to it.
    passthrough: Option<crate::passthrough::Passthrough>,
    /// The OOM hook (see [`Allocator::set_oom_hook`]).
    oom_hook: Mutex<Option<OomHook>>,
    /// Allocation traces (trace.rs): off, it costs `allocate` and `deallocate` one `Relaxed` load.
    trace: Arc<crate::trace::Shared>,
    /// CUDA graphs' private pools (graph_pool.rs).
    graphs: GraphPools,
}

/// A free held back by a capture: the block, the free's stream and the streams it orders
/// after, each as the holding thread named it (`StreamUse`: a retry on another thread fences
/// that thread's per-thread stream through the legacy stream).
struct HeldFree {
    ptr: DeviceAddr,
    size: usize,
    stream: StreamUse,
    used_on: Vec<StreamUse>,
    /// The token (`next_id`) of the retry making it now, whose own free of the block the
    /// held-list check lets through; 0 if none.
    retrying: u64,
}

/// Arena shells: every one ever made (kept so `owner` pointers never dangle) and the idle ones.
#[derive(Default)]
struct Shells {
    all: Vec<Arc<ArenaShell>>,
    idle: Vec<Arc<ArenaShell>>,
}

/// Parked user-stream arenas (see "Arenas of user streams that may be gone" above).
///
/// A user-stream arena holds memory its owner freed on that stream with no event recorded (the
/// fast path records none). Outside a call on that stream its handle may name no stream or
/// another one, so no event can be recorded there (`Env::home_fence`), and only a device
/// synchronise makes the memory safe for another stream. So when such an arena is given up
/// (thread exit, or replacement of the least recently used user arena), it is parked here,
/// its superblocks kept, rather than synchronising at once; a thread whose exit parks arenas
/// that bring the parked bytes above [`ZOMBIE_BYTES`] synchronises once and gives them all back,
/// as do the out-of-memory paths, `trim(true)` and the allocator's drop. A replacement parks
/// only while the parked bytes stay within the bound, and never synchronises
/// (`Slot::new_user_arena`, "Making room"). A parked arena whose stream is still in use is
/// adopted by the next allocation on it ([`Zombies::adopt`], by identity only).
///
/// A legacy arena that holds memory is parked here too when its thread exits while a blocking
/// stream is being captured (the legacy stream, where its fence would go, may not be used then:
/// `Slot::release_arena`). The legacy stream's identity is no user stream's, so it is never
/// adopted, only given back after a synchronise.
///
/// Remote frees made on user streams that had to leave a thread's outbox outside a call on
/// their stream (`outbox.rs`, "Frees on user streams") are parked here too, unfenced, and
/// delivered after the same synchronise. Parking them never synchronises (it happens inside
/// frees, `flush` and thread exits). Each park adds at most one thread's user-stream batches
/// (under `batch_blocks` blocks and `batch_bytes` bytes plus one block); `flush` and
/// `trim(false)` park them only within `ZOMBIE_BYTES` (past it they wait in the thread's outbox
/// for its next call on their stream: `Park`), so what goes past the bound is a thread's
/// exit's, which then synchronises (`bury_past_bound`), or an event a capture refused; out of
/// memory, `trim(true)`, an exit past `ZOMBIE_BYTES` or the allocator's drop gives them all
/// back.
///
/// A parked arena has no owner to take in the remote frees sent to it: they wait in its inbox
/// until a `flush` (by any thread) or its burial takes them in. One whose block is no longer
/// the arena's (an out-of-memory reclaim or `trim(true)` took its superblock meanwhile, after
/// a synchronise: `reclaim_others`) holds a pool block until then, counted in no arena and no
/// parked free; such blocks were the arena's when it was parked, so they are within what it
/// held then.
///
/// **Bound:** parked arenas hold at most `ZOMBIE_BYTES`, plus one arena's superblocks per
/// thread replacing one at that moment (a replacement's check of the room and its parking are
/// two steps under the lock), plus the arenas of threads exiting at that moment (each buries
/// once it has parked them all), plus what is parked while no synchronise may run (a capture
/// underway: `Inner::may_synchronize`), until the first chance after it. Parked frees count
/// towards `ZOMBIE_BYTES` with them: together at most `ZOMBIE_BYTES`, plus the user-stream
/// batches and arenas of threads exiting at that moment, plus frees whose event a capture
/// refused, plus what is parked while no synchronise may run, until an exit past the bound or
/// another synchronise after it.
/// Invariant: `bytes` is the sum of `held_bytes` of the parked arenas when they were last
/// counted ([`Zombies::recount`], at every park), plus the bytes of the parked frees: a
/// reclaimer on out-of-memory may take superblocks from a parked arena meanwhile, so between
/// counts it may be above the truth.
#[derive(Default)]
struct Zombies {
    /// Parked arenas, each with its stream's identity.
    arenas: Vec<(StreamKey, OwnedArena)>,
    frees: ParkedFrees,
    bytes: usize,
}

impl Zombies {
    /// Adds `frees` to the parked frees, and counts again.
    fn park_frees(&mut self, frees: ParkedFrees) {
        self.frees.append(frees);
        self.recount();
    }

    /// Counts the bytes the parked arenas hold now (one held by a reclaimer this moment counts
    /// as nothing; the reclaimer gives superblocks back, never takes any) and the parked frees.
    fn recount(&mut self) {
        self.bytes =
            self.arenas.iter_mut().map(|(_, a)| a.with(|a| a.held_bytes()).unwrap_or(0)).sum::<usize>()
                + self.frees.bytes();
    }

    /// Takes out the parked arena of the stream with identity `key`, if there is one. Only a
    /// call on that very stream may take it (see [`Slot::new_user_arena`]).
    fn adopt(&mut self, key: StreamKey) -> Option<OwnedArena> {
        let i = self.arenas.iter().position(|(k, _)| *k == key)?;
        let (_, a) = self.arenas.swap_remove(i);
        self.recount();
        Some(a)
    }

    fn is_empty(&self) -> bool {
        self.arenas.is_empty() && self.frees.bytes() == 0
    }
}

/// Parked bytes of destroyed streams' arenas above which they are given back (see [`Zombies`]).
const ZOMBIE_BYTES: usize = 64 << 20;

/// One thread's state for one allocator.
struct Slot {
    id: u64,
    inner: Weak<Inner>,
    /// The thread's arenas: for its per-thread stream, the legacy stream and its user streams.
    arenas: Arenas,
    outbox: Outbox,
    counters: Arc<Counters>,
    ptds: Option<StreamKey>,
    /// The legacy stream's identity, asked of the device once.
    legacy: Option<StreamKey>,
    /// A user stream's identity that [`alloc_fast_user`] asked and then left the allocation to
    /// the slow path: taken by that slow path, in the same call, so that one allocation asks
    /// the driver once. Never set across calls (the slow path always takes it).
    asked: Option<(Stream, StreamKey)>,
    /// Slow paths taken; every [`PEAK_SAMPLE_EVERY`]th samples the live-byte peak.
    slow_paths: u32,
}

/// The streams a thread's arenas serve, by index: see [`arena_index`].
const HOMES: [Stream; 2] = [Stream::PER_THREAD, Stream::LEGACY];

/// Which of a thread's fixed arenas serves small requests on `stream`: 0 for its per-thread
/// stream, 1 for the legacy stream (NULL or `0x1`, one stream for all threads, whose identity
/// is fixed). `None` for a user stream: its arena is found by the stream's identity (see
/// [`Arenas`]).
///
/// Both free on their fast path ([`free_fast`]), the per-thread arena at once, the legacy arena
/// differently: the thread's free of its own legacy-arena block on the legacy stream is kept
/// back in that arena until one *legacy action* per batch (`Arena::free_legacy`): without one, a block freed on the legacy stream after use on one
/// per-thread stream and handed out again could be used on another per-thread stream with
/// nothing ordering the two (per-thread streams wait for earlier legacy *actions*). Another
/// thread's free on the legacy stream goes the batched way with one event per batch, which is
/// such an action; the legacy arena needs no wait on it (`Arena::complete_ready`).
#[inline]
fn arena_index(stream: Stream) -> Option<usize> {
    if stream.is_per_thread() {
        Some(0)
    } else if stream.is_legacy() {
        Some(1)
    } else {
        None
    }
}

/// What an outbox flush sent: the stream and the fence it recorded there, if it sent anything.
type Flushed = Option<(Stream, Option<Arc<Fence>>)>;

/// Where an outbox flush puts the thread's user-stream batches, which no event can fence
/// outside a call on their streams (`outbox.rs`, "Frees on user streams").
#[derive(Clone, Copy, PartialEq, Eq)]
enum Park {
    /// Parked, whatever is parked already: the thread exits (its exit then synchronises past
    /// [`ZOMBIE_BYTES`]), or a reclaim that may synchronise gives them back at once.
    All,
    /// Parked while the parked memory stays within [`ZOMBIE_BYTES`], else left in the outbox
    /// for the thread's next call on their stream (`flush`, `trim(false)`): nothing in steady
    /// use synchronises, so parking past the bound would grow without one.
    WithinBound,
}

/// User-stream arenas a thread keeps at most. A thread that allocates small blocks on more
/// user streams than this gives back the least recently used one that holds no memory, or
/// parks the least recently used one while the parked bound allows, to be adopted again by the
/// next call on its stream that needs an arena; otherwise the pool serves the new stream (see
/// `Slot::new_user_arena`). Sixteen covers a thread that round-robins over a stream pool of
/// that size; the lookup is a scan of the thread's arenas by identity.
pub const MAX_USER_ARENAS: usize = 16;

/// User arenas past which a thread's user arenas are all lean (`arena.rs`, "Lean arenas"): a
/// thread cycling through many streams keeps no slack in each, so what it holds stays near what
/// it uses, and an arena given up is seldom parked.
pub(crate) const LEAN_AFTER_USER_ARENAS: usize = 4;

/// A thread's arena for one user stream, found by the stream's identity.
struct UserArena {
    /// The stream's identity (`cuStreamGetId`), never its handle: CUDA gives a destroyed
    /// stream's handle to the next new stream, which then has another identity and so another
    /// arena.
    key: StreamKey,
    /// The stream's handle, the one it has for its life; once the stream is destroyed, CUDA
    /// may give it to a new stream. The owner's frees on it take the fast path without asking
    /// the identity (see "A user arena's own frees" above).
    handle: Stream,
    arena: OwnedArena,
    /// `Arenas::tick` at its last allocation, for least-recently-used replacement.
    last_use: u64,
}

/// Which of a thread's arenas: a fixed one by [`arena_index`], or a user-stream one by its
/// position in [`Arenas::users`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Fixed(usize),
    User(usize),
}

/// A thread's arenas.
///
/// Invariants: `users` holds at most [`MAX_USER_ARENAS`] entries with distinct keys, none of
/// them the per-thread or the legacy stream's; every arena's shell is this thread's alone.
#[derive(Default)]
struct Arenas {
    /// By [`arena_index`]: the per-thread stream's arena, and the legacy stream's.
    fixed: [Option<OwnedArena>; 2],
    /// Arenas of user streams. A user stream's identity costs one `cuStreamGetId` per
    /// allocation (a cached handle could name a new stream by then; frees on the arena's
    /// handle need none: "A user arena's own frees" above); it scales across threads, unlike
    /// the same call on `0x2`, which is why the per-thread stream's identity is asked once.
    users: Vec<UserArena>,
    /// Counts user-stream allocations, for `UserArena::last_use`.
    tick: u64,
    /// Whether every user arena is lean (more than `LEAN_AFTER_USER_ARENAS` of them).
    users_lean: bool,
}

impl Arenas {
    /// Which of these arenas has the shell `owner`, if any.
    #[inline]
    fn find(&self, owner: *const ArenaShell) -> Option<Which> {
        let is = |a: &OwnedArena| std::ptr::eq(Arc::as_ptr(&a.shell), owner);
        if let Some(i) = self.fixed.iter().position(|a| a.as_ref().is_some_and(is)) {
            return Some(Which::Fixed(i));
        }
        self.users.iter().position(|u| is(&u.arena)).map(Which::User)
    }

    #[inline]
    fn get_mut(&mut self, w: Which) -> Option<&mut OwnedArena> {
        match w {
            Which::Fixed(i) => self.fixed[i].as_mut(),
            Which::User(j) => self.users.get_mut(j).map(|u| &mut u.arena),
        }
    }

    /// The user arena for the stream identity `key`, if there is one.
    #[inline]
    fn user(&self, key: StreamKey) -> Option<usize> {
        self.users.iter().position(|u| u.key == key)
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut OwnedArena> {
        self.fixed.iter_mut().flatten().chain(self.users.iter_mut().map(|u| &mut u.arena))
    }

    /// The shells of all these arenas.
    fn shells(&self) -> Vec<*const ArenaShell> {
        let fixed = self.fixed.iter().flatten();
        fixed.chain(self.users.iter().map(|u| &u.arena)).map(|a| Arc::as_ptr(&a.shell)).collect()
    }
}

/// What the owner found when it looked at its own block inside its claim.
enum Local {
    /// Freed on the fast path (or refused: the error).
    Freed(Result<()>),
    /// Checked against the tags for a free on another stream (it goes the remote way).
    Checked(Result<()>),
    /// The superblock is not the owner's any more.
    NotOurs,
}

/// The owning thread's handle on its arena. The arena is on the heap, its address published in
/// its shell (`ArenaShell::arena`), so that a reclaimer holding the shell's claim can work on it
/// while the owner is idle (see `claim.rs`). The owner touches it only inside its own claim,
/// through [`OwnedArena::with`].
///
/// Invariant: `ptr` is the leaked box of a live arena, or dangling once [`OwnedArena::take`]
/// has reclaimed it (`exit`, or the drop). Its memory goes back to the pool through `exit`; a
/// handle dropped without it (the slot of an allocator already dropped, an arena parked when
/// its allocator is dropped: the pool's own drop releases the device memory then) frees the
/// arena's host memory and drops its fences, so that neither it nor the events and the device
/// they hold outlive the allocator.
struct OwnedArena {
    ptr: std::ptr::NonNull<Arena>,
    shell: Arc<ArenaShell>,
}

// SAFETY: an `OwnedArena` is the only owner-side handle on its arena, and the arena (with its
// superblocks' owner-only state) is touched only through it or by a reclaimer holding the
// shell's claim. Moving it to another thread (parking a destroyed stream's arena, see
// `Zombies`) moves that sole ownership; the zombie list's mutex orders the two threads' uses,
// and every use runs inside the claim, so it never races a reclaimer.
unsafe impl Send for OwnedArena {}

impl OwnedArena {
    fn new(arena: Arena) -> OwnedArena {
        let shell = Arc::clone(&arena.shell);
        let ptr = std::ptr::NonNull::from(Box::leak(Box::new(arena)));
        // Release: a reclaimer that loads the pointer (Acquire, under the claim) sees the arena
        // whole.
        shell.arena.store(ptr.as_ptr().cast(), Ordering::Release);
        OwnedArena { ptr, shell }
    }

    /// Runs `f` on the arena inside the owner's claim; `None` if a reclaimer holds it now.
    #[inline]
    fn with<R>(&mut self, f: impl FnOnce(&mut Arena) -> R) -> Option<R> {
        if !self.shell.claim.enter() {
            return None;
        }
        // SAFETY: the arena lives until `exit` below consumes it; inside our claim no
        // reclaimer touches it, and `&mut self` makes this the only owner-side reference.
        let r = f(unsafe { self.ptr.as_mut() });
        self.shell.claim.leave();
        Some(r)
    }

    /// Runs `f` on the arena inside the owner's claim, first waiting out any reclaimer (for
    /// decisions that must see the arena: giving it up).
    #[cold]
    fn with_waiting<R>(&mut self, f: impl FnOnce(&mut Arena) -> R) -> R {
        self.shell.claim.enter_waiting();
        // SAFETY: as in `with`: we hold the claim and `&mut self`.
        let r = f(unsafe { self.ptr.as_mut() });
        self.shell.claim.leave();
        r
    }

    /// Thread exit: waits out any reclaimer, unpublishes the arena and gives it back behind
    /// `fence` (`Some`: one the caller has, `Some(None)` after a device synchronise) or, with
    /// `None`, one made now on its stream ([`Arena::exit_fence`]). If that cannot be made (the
    /// capture check, the record or the synchronise fails), nothing is given back and the
    /// handle comes back with the error, for the caller to park it until the next device
    /// synchronise: given back without a fence, or left with a dead shell, its memory was
    /// reused unfenced, or lost for good (helper-36, `tests/adversarial_s27c.rs`).
    fn exit(
        mut self,
        env: &Env<'_>,
        fence: Option<Option<Arc<Fence>>>,
    ) -> std::result::Result<Arc<ArenaShell>, (OwnedArena, Error)> {
        let fence = match fence {
            Some(f) => f,
            None => match self.with_waiting(|a| a.exit_fence(env)) {
                Ok(f) => f,
                Err(e) => return Err((self, e)),
            },
        };
        self.shell.claim.enter_waiting();
        let arena = self.take();
        let shell = arena.exit(env, fence);
        self.shell.claim.leave();
        Ok(shell)
    }

    /// Unpublishes the arena and reclaims its box, leaving `ptr` dangling. The caller holds the
    /// claim; once, from `exit` or the drop.
    fn take(&mut self) -> Box<Arena> {
        debug_assert!(self.ptr != std::ptr::NonNull::dangling(), "an arena taken twice");
        self.shell.arena.store(std::ptr::null_mut(), Ordering::Relaxed);
        let ptr = std::mem::replace(&mut self.ptr, std::ptr::NonNull::dangling());
        // SAFETY: the pointer came from `Box::leak` in `new` and is reclaimed once, here (`ptr`
        // is dangling from now on, which `exit` and the drop check); it is unpublished and the
        // caller holds the claim, so no reclaimer can reach it any more.
        unsafe { Box::from_raw(ptr.as_ptr()) }
    }
}

impl Drop for OwnedArena {
    /// A handle dropped without `exit` (see the type's comment): the arena's host memory and its
    /// fences go now. Its superblocks stay with the pool, which releases them with its chunks.
    fn drop(&mut self) {
        if self.ptr == std::ptr::NonNull::dangling() {
            return; // given back through `exit`
        }
        if crate::shutdown::process_exiting() {
            // The process ends: nothing to give back, and no reason to wait for a reclaimer
            // (one inside a device call that exit has stopped would never leave).
            return;
        }
        self.shell.claim.enter_waiting();
        drop(self.take());
        self.shell.claim.leave();
    }
}

/// How often a thread's slow path samples the peak of live bytes. Sampling locks the counter
/// list and sums every thread, so it is kept off most slow paths (the peak is a documented
/// lower bound; `stats()` samples too).
const PEAK_SAMPLE_EVERY: u32 = 64;

// Why `std::thread_local!` (through `sync.rs`) plus the allocator's own registry of shells, and
// not the `thread_local` crate the design names: its `ThreadLocal<T>` keeps each thread's value
// until the `ThreadLocal` itself is dropped, and hands it to the next thread that gets the same
// thread id. An arena must instead be given back when its thread exits (its superblocks to the
// pool, its inbox closed), which only a `std` thread-local's destructor does; and loom models
// `std`'s form, not the crate's.
thread_local! {
    // Not `const { .. }`: loom's `thread_local!` has no such form.
    #[allow(clippy::missing_const_for_thread_local)]
    static SLOTS: RefCell<Vec<Slot>> = RefCell::new(Vec::new());
    /// Set in a forked child whose fork was made while this thread's slots were borrowed.
    #[allow(clippy::missing_const_for_thread_local)]
    static FORKED_INSIDE_A_CALL: std::cell::Cell<bool> = std::cell::Cell::new(false);
}

impl Inner {
    /// [`Inner::env`] for the calls made inside an allocation or free on `stream`
    /// (`Counted::on_stream`).
    fn env_on<'a>(&'a self, counters: &'a Counters, stream: Stream) -> Env<'a> {
        let mut env = self.env(counters);
        env.dev = env.dev.on_stream(stream);
        env
    }

    fn env<'a>(&'a self, counters: &'a Counters) -> Env<'a> {
        Env {
            pool: &self.pool,
            dev: Counted::new(&*self.device, counters),
            skip_fences: self.cfg.skip_fences,
            small_max: self.cfg.small_max,
            large_max: self.cfg.large_max,
            deferred: &self.deferred,
            legacy_blocks: self.cfg.legacy_blocks,
            legacy_bytes: self.cfg.legacy_bytes,
        }
    }

    fn take_shell(&self) -> Arc<ArenaShell> {
        let mut s = lock(&self.shells);
        if let Some(sh) = s.idle.pop() {
            // Frees pushed after this reopen may be for blocks of the shell's earlier arena;
            // the new owner's drain finds them not its own and sends them to the pool.
            sh.inbox.reopen();
            return sh;
        }
        let sh = Arc::new(ArenaShell::default());
        s.all.push(Arc::clone(&sh));
        sh
    }

    /// Gives up the arena of the user stream with identity `key` (thread exit, or
    /// replacement): given back if it holds nothing, otherwise parked (see [`Zombies`]). Never
    /// synchronises: a thread's exit then calls [`Inner::bury_past_bound`] once, and a
    /// replacement checked the room first (`Slot::new_user_arena`).
    fn retire_user(&self, env: &Env<'_>, key: StreamKey, mut owned: OwnedArena) {
        // This call is not on the arena's stream, so its handle must not be touched (it may
        // name no stream, or another one, by now: `Env::home_fence`): an arena that holds
        // memory is parked. Waiting: a reclaimer holding the arena at this moment may still be
        // giving superblocks back.
        let gone = owned.with_waiting(|a| {
            a.drain(env); // frees sent to it so far are checked now, whatever happens next
            a.held_bytes() > 0 && !env.skip_fences
        });
        // Mutation for the loom model of parked arenas: never park.
        #[cfg(cuarena_mutant = "zombie_never_parked")]
        let gone = false && gone;
        self.arenas.fetch_sub(1, Ordering::Relaxed);
        if !gone {
            self.give_up(env, owned, None);
            return;
        }
        self.park_arena(key, owned);
    }

    /// Gives `owned` back ([`OwnedArena::exit`]) and its shell to the idle list; if its exit
    /// fence cannot be made, keeps the error and parks the arena until the next device
    /// synchronise.
    fn give_up(&self, env: &Env<'_>, owned: OwnedArena, fence: Option<Option<Arc<Fence>>>) {
        match owned.exit(env, fence) {
            Ok(shell) => lock(&self.shells).idle.push(shell),
            Err((mut owned, e)) => {
                env.defer(e);
                // The mutation `failed_exit_drops_arena` drops the arena instead, as the code
                // before it lost it: `adversarial_s27c::a_failed_capture_check_in_release_thread_loses_no_memory`
                // must then fail.
                if cfg!(cuarena_mutant = "failed_exit_drops_arena") {
                    return;
                }
                let key = owned.with_waiting(|a| a.key);
                self.park_arena(key, owned);
            }
        }
    }

    /// Parks `owned` (its stream's identity `key`) until a device synchronise (see [`Zombies`]).
    fn park_arena(&self, key: StreamKey, owned: OwnedArena) {
        let mut z = lock(&self.zombies);
        z.arenas.push((key, owned));
        z.recount();
    }

    /// Parks the user-stream batches of `outbox` if that keeps the parked bytes within
    /// [`ZOMBIE_BYTES`] (checked and parked under one lock: two flushes at once cannot both
    /// pass the check, helper-37); false, taking nothing, if not.
    fn park_frees_within_bound(&self, outbox: &mut Outbox) -> bool {
        let mut z = lock(&self.zombies);
        if z.bytes.saturating_add(outbox.user_batch_bytes()) > ZOMBIE_BYTES {
            return false;
        }
        if let Some(p) = outbox.take_user_batches() {
            z.park_frees(p);
        }
        true
    }

    /// Gives back everything parked, after one device synchronise, if the parked bytes are
    /// past [`ZOMBIE_BYTES`] (a thread's exit, once it has parked its arenas and frees).
    fn bury_past_bound(&self, env: &Env<'_>) {
        let over = lock(&self.zombies).bytes > ZOMBIE_BYTES;
        if over && let Err(e) = self.bury_zombies(env) {
            env.defer(e);
        }
    }

    /// Parks remote frees of user-stream batches that must leave a thread's outbox outside a
    /// call on their streams (see [`Zombies`]). Never synchronises (it runs inside frees,
    /// `flush` and exits): they wait for the next synchronise that happens anyway.
    fn park_frees(&self, frees: ParkedFrees) {
        lock(&self.zombies).park_frees(frees);
    }

    /// Parks the frees of the outbox's batches whose fence could not be made
    /// (`Outbox::take_refused`), at once: in the parked list the out-of-memory path and a
    /// thread's exit reach them (after a device synchronise), where in the thread's outbox they
    /// piled up, out of every other thread's reach, until its next `flush`, `trim` or exit, as
    /// long as a capture or the driver refused its fences (helper-41; the test
    /// `adversarial_s28d::frees_whose_fence_failed_are_reachable_by_another_threads_out_of_memory`).
    /// The mutation `refused_stay_in_outbox` leaves them there: that test must then fail.
    fn park_refused(&self, outbox: &mut Outbox) {
        if cfg!(cuarena_mutant = "refused_stay_in_outbox") {
            return;
        }
        if let Some(p) = outbox.take_refused() {
            self.park_frees(p);
        }
    }

    /// Parks what a user-stream batch operation left, and keeps its error.
    #[inline]
    fn settle(&self, env: &Env<'_>, sent: UserSend) {
        if let Some(p) = sent.park {
            self.park_frees(p);
        }
        if let Some(e) = sent.err {
            env.defer(e);
        }
    }

    /// Whether a device synchronise may run now. Not while a capture is announced
    /// (`graph_capture_begin`) to any allocator of the device, nor while a blocking stream (a
    /// per-thread stream among them) is being captured, which a synchronise would invalidate:
    /// that is seen without harm through the legacy stream (`Device::stream_capturing`, one
    /// driver call); `Counted::synchronize` checks announcements again, under their lock. A
    /// capture of a non-blocking stream that was not announced cannot be seen (README, "CUDA
    /// graphs").
    /// Either way what waits for a synchronise stays parked for a later one (PyTorch frees its
    /// cached blocks only when no capture is underway).
    fn may_synchronize(&self, env: &Env<'_>) -> bool {
        let announced = if cfg!(cuarena_mutant = "captures_per_allocator") {
            self.graphs.captures_underway()
        } else {
            self.graphs.device_captures_underway()
        };
        !announced && !env.dev.legacy_implicated()
    }

    /// Gives back every parked arena of a destroyed stream (see [`Zombies`]), after one device
    /// synchronise if there are any and one may run ([`Inner::may_synchronize`]). Returns the
    /// bytes they held, and whether it synchronised (everything queued before this call has
    /// completed then).
    #[cold]
    fn bury_zombies(&self, env: &Env<'_>) -> Result<(usize, bool)> {
        let z = std::mem::take(&mut *lock(&self.zombies));
        // Segments of retired graph pools wait for the same synchronise (graph_pool.rs).
        let segments = self.graphs.take_parked();
        if z.is_empty() && segments.is_empty() {
            return Ok((0, false));
        }
        // Nothing given back: parked again.
        let repark = |z: Zombies, segments| {
            let mut back = lock(&self.zombies);
            back.bytes += z.bytes;
            back.arenas.extend(z.arenas);
            back.frees.append(z.frees);
            self.graphs.repark(segments);
        };
        if !self.may_synchronize(env) {
            repark(z, segments);
            return Ok((0, false));
        }
        // Mutation for the loom model of parked arenas: give them back with no synchronise.
        #[cfg(not(cuarena_mutant = "zombie_no_sync"))]
        let synced = env.dev.synchronize();
        #[cfg(cuarena_mutant = "zombie_no_sync")]
        let synced: Result<()> = Ok(());
        if let Err(e) = synced {
            repark(z, segments);
            // A capture begun or announced since `may_synchronize` refused it: as if checked.
            return if e.is_legacy_refusal() { Ok((0, false)) } else { Err(e) };
        }
        // Every replay of the retired pools' graphs was queued before the synchronise.
        let mut graph_bytes = 0;
        for (base, len) in segments {
            self.pool.give_back_segment(base);
            graph_bytes += len as usize;
        }

        for (_, owned) in z.arenas {
            // All work queued before the synchronise, on every stream, has completed.
            self.give_up(env, owned, Some(None));
        }
        // Every use of the parked frees' blocks was queued before the synchronise too. (After
        // the arenas' exits: a free towards one of them now goes to the pool.)
        z.frees.deliver(env, None);
        Ok((z.bytes + graph_bytes, true))
    }

    /// Takes memory back from other threads' arenas whose owners are idle, without their
    /// help (see `claim.rs`): each gives back its superblocks that hold no used block (with
    /// `dissolve`, all with free or pending space). Arenas whose owner is inside an allocator
    /// call are skipped: they drain on their own. `own` are the caller's shells, skipped. Free
    /// ranges go back behind a fence on the legacy stream, which follows the owners' earlier
    /// per-thread-stream work, or, for a user-stream arena, on that stream (`Env::home_fence`).
    /// Returns the bytes given back. With `may_block`, a user-stream arena (its stream may be
    /// gone: `Env::home_fence`) gives its memory back after a device synchronise of its own,
    /// made once its claim is held: its owner, idle but alive, may have freed into it after an
    /// earlier one (unlike the caller's own arenas in `Slot::reclaim`, which share one); without
    /// `may_block`, it keeps it.
    #[cold]
    fn reclaim_others(
        &self,
        env: &Env<'_>,
        own: &[*const ArenaShell],
        dissolve: bool,
        may_block: bool,
    ) -> usize {
        let shells: Vec<Arc<ArenaShell>> = lock(&self.shells).all.clone();
        let mut bytes = 0;
        for sh in shells {
            if own.contains(&Arc::as_ptr(&sh)) || sh.arena.load(Ordering::Relaxed).is_null() {
                continue;
            }
            let Some(_held) = sh.claim.try_claim() else { continue };
            // The shell's opaque pointer is an `Arena` (published by `OwnedArena::new`).
            let p = sh.arena.load(Ordering::Acquire).cast::<Arena>();
            if p.is_null() {
                continue; // its owner exited meanwhile
            }
            // SAFETY: we hold the shell's claim, so the owner does not touch its arena, and the
            // arena outlives the claim (its owner unpublishes it, inside its claim, before
            // freeing it).
            let arena = unsafe { &mut *p };
            // A per-thread or legacy arena's local frees are ordered before later legacy-stream
            // work; a user stream's are not (user streams may be non-blocking): its own stream
            // is fenced, if it still exists (`Env::home_fence`).
            let (home, key) = (arena.home, arena.key);
            bytes += arena.reclaim(env, dissolve, || {
                if home.is_user() {
                    return env.reclaim_fence(home, key, may_block);
                }
                // Asked once per allocator (`GlobalPool::legacy_key`), and refused while a
                // capture is announced (`Counted::legacy_key`), as the record after it would be.
                let k = env.pool.legacy_key(&env.dev)?;
                env.fence(Stream::LEGACY, k).map(HomeFence::Fence)
            });
        }
        bytes
    }

    fn oom(&self, requested: usize) -> Error {
        let mut s = Stats::default();
        self.pool.fill_stats(&mut s);
        Error::OutOfMemory {
            requested,
            reserved: s.reserved_bytes as usize,
            in_use: s.pool_in_use_bytes as usize,
            largest_free: s.largest_free_block as usize,
            limit: self.pool.limit(),
        }
    }
}

impl Drop for Inner {
    /// Ends a running trace. Arenas still parked hold memory under work queued on their
    /// destroyed streams, which no fence covers, and need nothing here: the pool (dropped after
    /// this) synchronises the device once before it releases any chunk (`GlobalPool::drop`),
    /// which covers their memory with the rest. (Burying them here synchronised a second time.)
    /// Their host memory and fences go with the parked list (`OwnedArena`'s drop).
    fn drop(&mut self) {
        // A trace still running ends with its allocator (no CUDA call; an error has no one to
        // go to: the file then ends early, which `trace::read` reports).
        if self.trace.running() {
            let _ = self.trace.stop();
        }
        // Captures announced here and never ended no longer hold off other allocators'
        // synchronises, nor the pool's own below.
        self.graphs.end_captures();
    }
}

impl Slot {
    fn new(inner: &Arc<Inner>) -> Slot {
        Slot {
            id: inner.id,
            inner: Arc::downgrade(inner),
            arenas: Arenas::default(),
            outbox: Outbox::default(),
            counters: inner.counters.register(),
            ptds: None,
            legacy: None,
            asked: None,
            slow_paths: 0,
        }
    }

    /// The identity of this thread's per-thread stream, asked of the device once. A function of
    /// the `ptds` field alone, so callers can hold an `Env` borrowing `counters` meanwhile.
    fn ptds_key(ptds: &mut Option<StreamKey>, env: &Env<'_>) -> Result<StreamKey> {
        if let Some(k) = *ptds {
            return Ok(k);
        }
        let k = env.dev.stream_key(Stream::PER_THREAD)?;
        *ptds = Some(k);
        Ok(k)
    }

    /// The identity of `stream` as seen from this thread: the per-thread stream's asked once per
    /// thread, a user stream's every time (its handle may name a new stream), and the legacy
    /// stream's once per allocator (`GlobalPool::legacy_key`: it never changes), refused, as
    /// asking it would be, while a blocking stream is being captured (one
    /// `cuStreamIsCapturing`, where asking is that and a `cuStreamGetId`).
    fn key_of(ptds: &mut Option<StreamKey>, env: &Env<'_>, stream: Stream) -> Result<StreamKey> {
        if stream.is_per_thread() {
            Self::ptds_key(ptds, env)
        } else if stream.is_legacy() {
            env.dev.refuse_capturing(stream)?;
            env.pool.legacy_key(&env.dev)
        } else {
            env.dev.stream_key(stream)
        }
    }

    /// Sends the gathered remote frees, if any, and parks the user-stream batches (no call on
    /// their streams is running: `outbox.rs`).
    /// Returns the fence the flush recorded, with its stream, if it sent anything.
    /// `park`: where the user-stream batches go (see [`Park`]).
    fn flush_outbox(
        outbox: &mut Outbox,
        ptds: &mut Option<StreamKey>,
        inner: &Inner,
        env: &Env<'_>,
        park: Park,
    ) -> Result<Flushed> {
        // The mutation `parking_unbounded` parks whatever `flush` finds, as before: the test
        // `adversarial_s27b::remote_user_stream_frees_flushed_by_a_worker_stay_bounded` must
        // then fail.
        if park == Park::All || cfg!(cuarena_mutant = "parking_unbounded") {
            if let Some(p) = outbox.take_user_batches() {
                // Mutation for the loom model of parked frees: send them at once, unfenced.
                #[cfg(cuarena_mutant = "parked_frees_unfenced")]
                p.deliver(env, None);
                #[cfg(not(cuarena_mutant = "parked_frees_unfenced"))]
                inner.park_frees(p);
            }
        } else if !inner.park_frees_within_bound(outbox) && !cfg!(cuarena_mutant = "kept_batches_wait") {
            // The next call on each batch's stream sends it (`Outbox::keep_user_batches`). The
            // mutation `kept_batches_wait` leaves them to the 256th allocation or a full batch:
            // `adversarial_s27d::user_stream_frees_kept_by_a_flush_are_sent_by_the_next_call_on_their_stream`
            // must then fail.
            outbox.keep_user_batches();
        }
        if let Some(p) = outbox.take_refused() {
            inner.park_frees(p);
        }
        if outbox.is_empty() {
            return Ok(None);
        }
        let k = Self::ptds_key(ptds, env)?;
        let flushed = outbox.flush(env, k);
        // A batch whose event a capture refused left its frees to be parked (`flush`).
        if let Some(p) = outbox.take_refused() {
            inner.park_frees(p);
        }
        flushed
    }

    /// Counts a slow path and now and then samples the peak of live bytes.
    fn sample_peak(&mut self, inner: &Inner) {
        self.slow_paths = self.slow_paths.wrapping_add(1);
        if self.slow_paths % PEAK_SAMPLE_EVERY == 1 {
            inner.counters.sample();
        }
    }

    /// Counts an allocation of `bytes` served by `path` (one counter: see `stats.rs`).
    #[inline]
    fn counted_alloc(&self, bytes: usize, path: AllocPath) {
        self.counters.count_alloc(bytes, path);
    }

    #[inline]
    fn counted_free(&self, bytes: usize) {
        self.counters.count_free(bytes);
    }

    /// The arena path's slow path for the fixed arena `i` (see [`arena_index`]).
    #[cold]
    #[inline(never)]
    fn alloc_small_slow(
        &mut self,
        inner: &Inner,
        i: usize,
        class: usize,
        g: usize,
        large: bool,
    ) -> Result<u64> {
        let env = inner.env_on(&self.counters, HOMES[i]);
        let key = if i == 0 {
            Self::ptds_key(&mut self.ptds, &env)?
        } else {
            Self::legacy_key(&mut self.legacy, &env)?
        };
        self.alloc_slow_in(inner, Which::Fixed(i), (HOMES[i], key), class, g, large)
    }

    /// The arena path for a user stream whose identity is `key`: its arena's fast path if the
    /// thread has one, otherwise the slow path, which makes one (giving back the least
    /// recently used user arena if the thread has [`MAX_USER_ARENAS`]).
    #[inline]
    fn alloc_user(
        &mut self,
        inner: &Inner,
        stream: Stream,
        key: StreamKey,
        class: usize,
        g: usize,
        large: bool,
    ) -> Result<u64> {
        if self.outbox.holds_user_batches() {
            self.tick_user_batches(inner, key, stream);
        }
        match self.alloc_user_arena(key, class, g, large) {
            Some(Ok(p)) => Ok(p),
            Some(Err(j)) => self.alloc_slow_in(inner, Which::User(j), (stream, key), class, g, large),
            None => {
                if !self.new_user_arena(inner, stream, key) {
                    // No room for another arena (`new_user_arena`): the pool serves the request.
                    return self.alloc_pool_keyed(inner, g * GRANULE, stream, key);
                }
                let j = self.arenas.users.len() - 1;
                self.alloc_slow_in(inner, Which::User(j), (stream, key), class, g, large)
            }
        }
    }

    /// The fast path of the thread's arena for the user stream identity `key`, its use
    /// stamped for least-recently-used replacement: the block (counted), or `Err` with the
    /// arena's index if it has no fit (or a reclaimer holds it); `None` if the thread has no
    /// arena for `key`.
    #[inline(always)]
    fn alloc_user_arena(
        &mut self,
        key: StreamKey,
        class: usize,
        g: usize,
        large: bool,
    ) -> Option<Result<u64, usize>> {
        self.arenas.tick = self.arenas.tick.wrapping_add(1);
        let tick = self.arenas.tick;
        let j = self.arenas.user(key)?;
        let u = &mut self.arenas.users[j];
        u.last_use = tick;
        match u.arena.with(|a| a.alloc(class, g)) {
            Some(Some(p)) => {
                self.counted_alloc(g * GRANULE, arena_path(large));
                Some(Ok(p))
            }
            _ => Some(Err(j)),
        }
    }

    /// An allocation on the user stream `stream` (identity `key`) while the thread's outbox
    /// holds user-stream batches: counts it towards sending that stream's batch
    /// (`Outbox::tick_user`).
    #[cold]
    #[inline(never)]
    fn tick_user_batches(&mut self, inner: &Inner, key: StreamKey, stream: Stream) {
        let env = inner.env(&self.counters);
        let sent = self.outbox.tick_user(&env, key, stream);
        inner.settle(&env, sent);
    }

    /// A call on the user stream `stream` (identity `key`, asked in it) that `tick_user_batches`
    /// does not see (a pool block's allocation or free there, the owner's own free of a block
    /// that the fast path sent here): sends that stream's batch if a `flush` kept it
    /// (`Outbox::send_due`). The mutation `due_batches_wait_for_small_calls` skips this: the
    /// tests `adversarial_s28d::a_kept_user_batch_is_sent_by_*` must then fail.
    #[cold]
    #[inline(never)]
    fn send_due_user(&mut self, inner: &Inner, key: StreamKey, stream: Stream) {
        if !self.outbox.holds_user_batches() || cfg!(cuarena_mutant = "due_batches_wait_for_small_calls") {
            return;
        }
        let env = inner.env(&self.counters);
        let sent = self.outbox.send_due(&env, key, stream);
        inner.settle(&env, sent);
    }

    /// Adds an arena for the user stream `stream` with identity `key`: the parked arena of this
    /// stream if there is one (see below), otherwise a new, empty one. Returns false, changing
    /// nothing, if the thread has [`MAX_USER_ARENAS`] already and none can make room without a
    /// device synchronise: the pool then serves the request.
    ///
    /// **Making room.** A full table gives back its least recently used arena that holds no
    /// memory (given back whole, nothing parked); if every arena holds memory, the least
    /// recently used one is parked (see [`Zombies`]), but only while that keeps the parked bytes
    /// within [`ZOMBIE_BYTES`] (counting out the arena this call adopts). Past that the request
    /// goes to the pool, under its lock and with an event at its free, rather than park more
    /// and synchronise the device to bury it: a replacement never synchronises. So a thread
    /// with live blocks on more streams than it keeps arenas for is served by arenas on 16 of
    /// them and by the pool on the rest once the parked bound is reached, and the table follows
    /// the streams again as arenas empty.
    ///
    /// **Adopting a parked arena.** An arena parked by a replacement or a thread's exit (see
    /// [`Zombies`]) holds memory freed on its stream with no event; what makes it unsafe for
    /// another stream is exactly that it is safe for its own. This call is on the stream with
    /// identity `key`, asked just now, and an identity is never given to another stream, so
    /// that stream is alive and `stream` is its handle (one handle for its life): the arena's
    /// frees are ordered before this call's work by the free's contract, whichever thread made
    /// them, and it is adopted as it is, with no fence and no synchronise. So a thread that
    /// cycles through more streams than it keeps arenas for, or a stream served by threads
    /// that come and go, reuses its memory rather than parking more until a synchronise.
    #[cold]
    #[inline(never)]
    fn new_user_arena(&mut self, inner: &Inner, stream: Stream, key: StreamKey) -> bool {
        let victim = if self.arenas.users.len() >= MAX_USER_ARENAS {
            match self.room_for_user_arena(inner, key) {
                Some(j) => Some(j),
                None => return false,
            }
        } else {
            None
        };
        let adopted = if cfg!(cuarena_mutant = "adopt_any_parked") {
            let mut z = lock(&inner.zombies);
            let any = z.arenas.first().map(|(k, _)| *k);
            any.and_then(|k| z.adopt(k))
        } else {
            lock(&inner.zombies).adopt(key)
        };
        if let Some(j) = victim {
            let old = self.arenas.users.swap_remove(j);
            // No synchronise: `room_for_user_arena` checked the room (the mutation below buries
            // past the bound, as the code before it did).
            let env = inner.env(&self.counters);
            inner.retire_user(&env, old.key, old.arena);
            if cfg!(cuarena_mutant = "replacement_parks_past_the_bound") {
                inner.bury_past_bound(&env);
            }
        }
        inner.arenas.fetch_add(1, Ordering::Relaxed);
        let arena = adopted.unwrap_or_else(|| {
            let sb = inner.cfg.superblock / GRANULE;
            let (k, f) = (inner.cfg.keep_empty, inner.cfg.sparse);
            OwnedArena::new(Arena::new(inner.take_shell(), stream, key, sb, k, f))
        });
        let tick = self.arenas.tick;
        self.arenas.users.push(UserArena { key, handle: stream, arena, last_use: tick });
        // Lean once past the threshold; the table never shrinks but at thread exit, when the
        // arenas go too. An adopted arena takes this thread's setting.
        let lean = self.arenas.users.len() > LEAN_AFTER_USER_ARENAS
            && !cfg!(cuarena_mutant = "user_arenas_never_lean");
        let newest = self.arenas.users.len() - 1;
        for (j, u) in self.arenas.users.iter_mut().enumerate() {
            if j == newest || self.arenas.users_lean != lean {
                u.arena.with_waiting(|a| a.set_lean(lean));
            }
        }
        self.arenas.users_lean = lean;
        true
    }

    /// The user arena a full table gives up for the stream with identity `key` (see "Making
    /// room" at [`Slot::new_user_arena`]): the least recently used that holds no memory, else
    /// the least recently used if parking it keeps the parked bytes within [`ZOMBIE_BYTES`];
    /// `None` if neither (or a reclaimer holds the one to weigh at this moment).
    #[cold]
    fn room_for_user_arena(&mut self, inner: &Inner, key: StreamKey) -> Option<usize> {
        let users = &mut self.arenas.users;
        // On every allocation of a stream served by the pool for want of room: no heap.
        let mut held = [None; MAX_USER_ARENAS];
        for (h, u) in held.iter_mut().zip(users.iter_mut()) {
            *h = u.arena.with(|a| a.held_bytes());
        }
        let lru = |empty: bool| {
            (0..users.len()).filter(|&j| !empty || held[j] == Some(0)).min_by_key(|&j| users[j].last_use)
        };
        if let Some(j) = lru(true) {
            return Some(j);
        }
        // The mutation `replacement_parks_past_the_bound` parks whatever it holds and buries the
        // parked arenas past the bound, as the code before it did: the test
        // `a_full_table_of_busy_arenas_overflows_to_the_pool_without_a_synchronise` must then
        // fail.
        if cfg!(cuarena_mutant = "replacement_parks_past_the_bound") {
            return lru(false);
        }
        let j = lru(false)?;
        let bytes = held[j]?;
        // `bytes` may be above the truth between counts (see [`Zombies`]): the check errs
        // towards the pool.
        let mut z = lock(&inner.zombies);
        let adopting: usize = z
            .arenas
            .iter_mut()
            .filter(|(k, _)| *k == key)
            .filter_map(|(_, a)| a.with(|a| a.held_bytes()))
            .sum();
        (z.bytes.saturating_sub(adopting) + bytes <= ZOMBIE_BYTES).then_some(j)
    }

    /// The slow path of the arena `w` serving `home` (identity `key`): drains and grows it,
    /// making it first if it is a fixed arena the thread does not have yet. If a reclaimer
    /// holds the arena at this moment, the request is served by the pool instead (no waiting);
    /// so it is if the arena cannot grow even after a reclaim (the pool's first fit may still
    /// find room for the request where it has none for a superblock).
    #[cold]
    #[inline(never)]
    fn alloc_slow_in(
        &mut self,
        inner: &Inner,
        w: Which,
        (home, key): (Stream, StreamKey),
        class: usize,
        g: usize,
        large: bool,
    ) -> Result<u64> {
        let env = inner.env_on(&self.counters, home);
        let ptds = Self::ptds_key(&mut self.ptds, &env)?;
        // Frees of pool blocks waiting here keep their ranges from coalescing (a superblock
        // range with one such block cannot be lent): send them before the arena may grow.
        if self.outbox.holds_pool_frees() {
            if let Err(e) = self.outbox.flush(&env, ptds) {
                env.defer(e);
            }
            inner.park_refused(&mut self.outbox);
        }
        if let Which::Fixed(i) = w
            && self.arenas.fixed[i].is_none()
        {
            let sb = inner.cfg.superblock / GRANULE;
            inner.arenas.fetch_add(1, Ordering::Relaxed);
            let (k, f) = (inner.cfg.keep_empty, inner.cfg.sparse);
            let arena = Arena::new(inner.take_shell(), home, key, sb, k, f);
            self.arenas.fixed[i] = Some(OwnedArena::new(arena));
        }
        // A lean user arena borrows no large superblock (`arena.rs`, "Lean arenas"): one per
        // stream a thread cycles through would hold four times each large request, and it
        // would give it back at once anyway. The pool serves the request.
        // (With the out-of-memory reclaim and one more try, as every pool request.)
        if large && matches!(w, Which::User(_)) && self.arenas.users_lean {
            return self.alloc_pool_keyed(inner, g * GRANULE, home, key);
        }
        let owned = self.arenas.get_mut(w).expect("the arena exists");
        let r = match owned.with(|arena| arena.alloc_slow(&env, class, g, large)) {
            Some(Err(e)) if e.is_out_of_room() => {
                // Memory may be idle elsewhere: in this thread's outbox, its other arenas,
                // other threads' arenas, and parked arenas of destroyed streams. Take it back,
                // and try once more. (So too after a legacy refusal: memory apart from the
                // legacy stream's may be idle there.)
                Self::reclaim(&mut self.arenas, &mut self.outbox, &mut self.ptds, inner, &env, true, true);
                self.counters.bump(&self.counters.alloc_retries, 1);
                let owned = self.arenas.get_mut(w).expect("reclaim keeps the arenas");
                match owned.with(|arena| arena.alloc_slow(&env, class, g, large)) {
                    // The pool may still hold free ranges that it cannot lend as a superblock
                    // (remnants of dissolved superblocks, smaller than one or not aligned to
                    // one): the request itself may fit there, by first fit.
                    Some(Err(e)) if e.is_out_of_room() => None,
                    r => r,
                }
            }
            r => r,
        };
        let p = match r {
            Some(r) => {
                let p = r?;
                self.counted_alloc(g * GRANULE, arena_path(large));
                p
            }
            None => {
                let pool = || inner.pool.alloc(&env.dev, g * GRANULE, home, key, env.skip_fences);
                let p = match pool() {
                    Err(e) if e.is_out_of_room() => Self::last_try(inner, &env, (e, g * GRANULE), pool)?,
                    r => r?,
                };
                self.counted_alloc(g * GRANULE, AllocPath::Pool);
                p
            }
        };
        self.sample_peak(inner);
        Ok(p)
    }

    /// The legacy stream's identity (asked of the device once per allocator).
    fn legacy_key(legacy: &mut Option<StreamKey>, env: &Env<'_>) -> Result<StreamKey> {
        if let Some(k) = *legacy {
            return Ok(k);
        }
        let k = env.pool.legacy_key(&env.dev)?;
        *legacy = Some(k);
        Ok(k)
    }

    #[cold]
    #[inline(never)]
    fn alloc_pool(&mut self, inner: &Inner, bytes: usize, stream: Stream) -> Result<u64> {
        // On the legacy stream, the pool may record on it or wait there inside this call,
        // which is itself a legacy-stream operation (`Counted::on_stream`), so nothing asks
        // before those uses. First, then:
        // - the device is asked whether a blocking stream is being captured (`refuse_capturing`
        //   inside a legacy call asks nothing): then the allocation is refused, nothing changed,
        //   and the capture survives;
        // - while a capture is announced (it may be of a blocking stream, begun at any moment),
        //   the pool serves memory that needs no call on the legacy stream at all
        //   (`GlobalPool::alloc_clear`), outside the legacy call, so that its growth's trim and
        //   an out-of-memory reclaim check their own legacy uses (and avoid them).
        // Until the thirtieth session every legacy pool allocation was refused while a capture
        // was announced (of a non-blocking stream, as PyTorch's are, too); the mutation
        // `pool_legacy_refused_when_announced` does so again: the test
        // `adversarial_s30_events::a_legacy_stream_pool_allocation_is_served_during_an_announced_capture`
        // must then fail. The mutation `pool_legacy_unclear_when_announced` serves it as when
        // none is announced: `adversarial_s30b_legacy_pool::a_capture_announced_before_a_legacy_pool_allocation_and_begun_inside_it_survives`
        // must then fail.
        let mut clear = false;
        if stream.is_legacy() {
            Counted::new(&*inner.device, &self.counters).refuse_legacy_implicated()?;
            let announced = crate::sync::captures_announced(inner.device.device_id());
            if announced && cfg!(cuarena_mutant = "pool_legacy_refused_when_announced") {
                return Err(Error::StreamCapturing { stream: Stream::LEGACY.as_raw() });
            }
            clear = announced && !cfg!(cuarena_mutant = "pool_legacy_unclear_when_announced");
        }
        if clear {
            // No identity asked: the memory served needs no ordering (and asking the legacy
            // stream's, if not known yet, is itself a use of it).
            return match self
                .alloc_pool_with(inner, None, bytes, |env| inner.pool.alloc_clear(&env.dev, bytes))
            {
                // Only memory that needs a legacy-stream call first would do (a lazy legacy
                // fence no action covers yet, or a fence not yet complete): refused as the
                // legacy stream's, as an allocation on another stream is when only such memory
                // is left (README).
                Err(e) if e.is_out_of_room() && inner.pool.has_fit(bytes) => {
                    Err(Error::StreamCapturing { stream: Stream::LEGACY.as_raw() })
                }
                r => r,
            };
        }
        let key = Self::key_of(&mut self.ptds, &inner.env_on(&self.counters, stream), stream)?;
        if stream.is_user() {
            self.send_due_user(inner, key, stream);
        }
        self.alloc_pool_keyed(inner, bytes, stream, key)
    }

    /// [`Slot::alloc_pool`] on `stream`, whose identity `key` the caller has asked.
    #[cold]
    #[inline(never)]
    fn alloc_pool_keyed(
        &mut self,
        inner: &Inner,
        bytes: usize,
        stream: Stream,
        key: StreamKey,
    ) -> Result<u64> {
        // CUDA graphs: the pool refuses a stream being captured (`GlobalPool::alloc`).
        self.alloc_pool_with(inner, Some(stream), bytes, |env| {
            inner.pool.alloc(&env.dev, bytes, stream, key, env.skip_fences)
        })
    }

    /// A pool allocation by `pool`, inside a call on `on` (`Counted::on_stream`; `None`: as
    /// outside any call), with the out-of-memory reclaim, one more try and the last try,
    /// counted.
    fn alloc_pool_with(
        &mut self,
        inner: &Inner,
        on: Option<Stream>,
        bytes: usize,
        pool: impl Fn(&Env<'_>) -> Result<u64>,
    ) -> Result<u64> {
        let env = match on {
            Some(s) => inner.env_on(&self.counters, s),
            None => inner.env(&self.counters),
        };
        let env = &env;
        let pool = || pool(env);
        let p = match pool() {
            Err(e) if e.is_out_of_room() => {
                Self::reclaim(&mut self.arenas, &mut self.outbox, &mut self.ptds, inner, env, true, true);
                self.counters.bump(&self.counters.alloc_retries, 1);
                match pool() {
                    Err(e) if e.is_out_of_room() => Self::last_try(inner, env, (e, bytes), pool)?,
                    r => r?,
                }
            }
            r => r?,
        };
        self.counted_alloc(bytes, AllocPath::Pool);
        self.sample_peak(inner);
        Ok(p)
    }

    /// The last try before out of memory, after the reclaim and its retry (or where a reclaimer
    /// held the arena): a request the pool must grow for finds no room under the cap while
    /// chunks lie wholly free behind fences not yet complete, among them the fences the reclaim
    /// itself has just recorded, which the growth's non-blocking trim finds pending. Where
    /// releasing those chunks would make room under the cap for the request (`bytes`), waits
    /// for their fences on the host, without the pool's lock, and releases them (a blocking
    /// pool trim), then tries once more if any was released; otherwise `e` stands. Out of
    /// memory is the one allocation path that waits so, and it waits on events only (no device
    /// synchronise, which a capture may forbid). The mutation `oom_no_last_try` skips this: the test
    /// `adversarial_s28b::out_of_memory_with_nothing_live_does_not_wait_for_the_reclaims_own_fences`
    /// must then fail.
    #[cold]
    #[inline(never)]
    fn last_try<T>(
        inner: &Inner,
        env: &Env<'_>,
        (e, bytes): (Error, usize),
        again: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        // Only where releasing the wholly free chunks would make room under the cap: no wait
        // that cannot help (`large::out_of_memory_with_large_superblocks_held_by_idle_threads_recovers`).
        let room = inner.pool.limit().saturating_sub(inner.pool.reserved()) + inner.pool.free_chunk_bytes();
        // Nor during a capture that forbids a synchronise: a host wait is held off with it, as
        // PyTorch frees its cached blocks only when no capture is underway
        // (`adversarial_s24c::legacy_refusals_and_their_reclaims_race_on_many_threads_during_a_capture`
        // saw one).
        if cfg!(cuarena_mutant = "oom_no_last_try") || room < bytes || !inner.may_synchronize(env) {
            return Err(e);
        }
        match inner.pool.trim(&env.dev, true) {
            Ok(0) => Err(e),
            Ok(_) => again(),
            Err(t) => {
                env.defer(t);
                Err(e)
            }
        }
    }

    /// Takes back memory held without live blocks: this thread's gathered remote frees are
    /// sent, and its own arena and every idle arena give back their superblocks that hold no
    /// used block (with `dissolve`, every superblock with free or pending space). Returns the
    /// bytes given back. Blocks on the device only with `may_block`: then parked arenas of
    /// destroyed streams are given back after one device synchronise, and a (not parked) arena
    /// whose user stream was destroyed gives its memory back after one.
    #[cold]
    fn reclaim(
        arenas: &mut Arenas,
        outbox: &mut Outbox,
        ptds: &mut Option<StreamKey>,
        inner: &Inner,
        env: &Env<'_>,
        dissolve: bool,
        may_block: bool,
    ) -> usize {
        // No device synchronise while a capture is underway (`Inner::may_synchronize`).
        let may_block = may_block && inner.may_synchronize(env);
        let park = if may_block { Park::All } else { Park::WithinBound };
        if let Err(e) = Self::flush_outbox(outbox, ptds, inner, env, park) {
            env.defer(e);
        }
        let mut bytes = 0;
        // One synchronise covers all of this thread's user arenas: every local free in them
        // was made by this thread before this call (no other thread frees locally into them;
        // remote frees keep their own fences), so after the parked memory's synchronise, or
        // the first user arena's, the others need no fence. The mutation
        // `reclaim_syncs_every_user_arena` synchronises for each: the test
        // `out_of_memory_on_the_overflow_path_synchronises_about_once` (exactly once, since the
        // parked memory's synchronise counts too) must then fail.
        let mut synced = false;
        if may_block {
            // First, so that the parked arenas cost one synchronise, not one each below.
            match inner.bury_zombies(env) {
                Ok((b, s)) => {
                    bytes += b;
                    synced = s;
                }
                Err(e) => env.defer(e),
            }
        }
        for owned in arenas.iter_mut() {
            bytes += owned
                .with(|a| {
                    let (home, key) = (a.home, a.key);
                    a.reclaim(env, dissolve, || {
                        let user = home.is_user() && may_block && !env.skip_fences;
                        if user && synced && !cfg!(cuarena_mutant = "reclaim_syncs_every_user_arena") {
                            return Ok(HomeFence::Fence(None));
                        }
                        let f = env.reclaim_fence(home, key, may_block)?;
                        // `reclaim_fence` synchronised (no call on a user home here), unless a
                        // capture refused it and the memory stays (`HomeFence::Gone`).
                        synced |= user && matches!(f, HomeFence::Fence(_));
                        Ok(f)
                    })
                })
                .unwrap_or(0);
        }
        bytes + inner.reclaim_others(env, &arenas.shells(), dissolve, may_block)
    }

    /// Frees a block on `stream`, also used on the streams `used_on` (empty for a plain free;
    /// see [`Allocator::deallocate_used_on`]): each branch validates the free first, then
    /// orders the declared streams before `stream` ([`order_for_free`]), then takes it. A free
    /// refused, by its validation or by the ordering, changes nothing.
    fn free(
        &mut self,
        inner: &Inner,
        ptr: u64,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let bytes = if size == 0 { None } else { block_bytes(size, inner.cfg.small_max) };
        if size > 0
            && size <= inner.cfg.large_max
            && let Some(sb) = inner.pool.registry.lookup(ptr)
        {
            let owner = sb.owner.load(Ordering::Acquire);
            if !owner.is_null() {
                return self.free_arena_block(inner, sb, owner, (ptr, size, stream), used_on);
            }
        }
        let Some(bytes) = bytes else {
            // Null with size 0 never comes here (`deallocate_rest`).
            return Err(invalid(if size == 0 { InvalidFree::ZeroSize } else { InvalidFree::UnknownPointer }));
        };
        let env = inner.env_on(&self.counters, stream);
        if Outbox::batchable(stream) {
            // Accepted now, fenced with the outbox's next batch: one event per batch.
            let ptds = Self::ptds_key(&mut self.ptds, &env)?;
            inner.pool.begin_free(ptr, size)?;
            let fr = Freed { ptr, size };
            if let Err(e) = order_for_free(inner, &self.counters, stream, used_on).and_then(|_| {
                Self::push_batchable(&mut self.outbox, inner, &env, ptds, std::ptr::null(), fr, stream)
            }) {
                inner.pool.cancel_free(ptr); // not taken: nothing changed
                return Err(e);
            }
            self.counted_free(bytes);
            return Ok(());
        }
        // Validate before recording the fence: a bad free costs no event.
        inner.pool.check_free(ptr, size)?;
        // The identity the ordering asked (and the capture check it made) is not asked again.
        let key = match order_for_free(inner, &self.counters, stream, used_on)? {
            Some(k) => k,
            None => Self::key_of(&mut self.ptds, &env, stream)?,
        };
        let fence = env.fence(stream, key)?;
        inner.pool.free(ptr, size, fence, Origin::Caller)?;
        self.counted_free(bytes);
        self.send_due_user(inner, key, stream); // a user stream (not `batchable`)
        Ok(())
    }

    /// Whether a free of `ptr` with `size`, refused for a capture, may be held: the checks a
    /// plain free makes before it asks the stream anything (`free`), without taking the free.
    /// The owner's blocks are checked exactly (`Arena::check_live`); another thread's by their
    /// freed flag (a free already taken is refused; a wrong size is its owner's to find, as
    /// for any free made from another thread); pool blocks by the pool. Nothing changes.
    fn check_hold(&mut self, inner: &Inner, ptr: u64, size: usize) -> Result<()> {
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let bytes = block_bytes(size, inner.cfg.small_max).ok_or(invalid(InvalidFree::UnknownPointer))?;
        if size <= inner.cfg.large_max
            && let Some(sb) = inner.pool.registry.lookup(ptr)
        {
            let owner = sb.owner.load(Ordering::Acquire);
            if !owner.is_null() {
                if let Some(w) = self.arenas.find(owner)
                    && let Some(r) = self
                        .arenas
                        .get_mut(w)
                        .and_then(|a| a.with(|a| a.owns(sb).then(|| Arena::check_live(sb, ptr, size, bytes))))
                        .flatten()
                {
                    return r;
                }
                let g = sb.granule_of(ptr).ok_or(invalid(InvalidFree::UnknownPointer))?;
                return if sb.is_freed(g) { Err(invalid(InvalidFree::DoubleFree)) } else { Ok(()) };
            }
        }
        inner.pool.check_free(ptr, size)
    }

    /// Frees a block of an arena's superblock (`owner` is that arena's shell): by the owner's
    /// local free if this thread owns it and frees on its stream (what [`free_fast`] did not
    /// take: an invalid free, to be reported, or one whose arena a reclaimer held a moment
    /// ago), otherwise its freed flag taken (see `superblock.rs`) and sent, fenced, towards the
    /// owner.
    #[inline]
    fn free_arena_block(
        &mut self,
        inner: &Inner,
        sb: &Superblock,
        owner: *mut ArenaShell,
        (ptr, size, stream): (u64, usize, Stream),
        used_on: &[Stream],
    ) -> Result<()> {
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let bytes = block_bytes(size, inner.cfg.small_max).ok_or(invalid(InvalidFree::UnknownPointer))?;
        let mine = self.arenas.find(owner);
        if let Some(w) = mine {
            // The owner's local free is on the arena's own stream: the per-thread arena's on
            // `0x2`, a user arena's on a stream with its identity (one `cuStreamGetId`: the fast
            // path, which takes a free on the arena's handle without asking, sent this one here
            // for another handle, an invalid free, a reclaimer holding the arena, a superblock
            // that changed owner meanwhile, or no slot to use: a late destructor). The legacy
            // arena keeps its frees back (below).
            let home = match w {
                Which::Fixed(i) => i == 0 && stream.is_per_thread(),
                Which::User(j) => {
                    stream.is_user()
                        && inner.env(&self.counters).dev.stream_key(stream)? == self.arenas.users[j].key
                }
            };
            // The legacy arena's own free on the legacy stream: kept back in the arena until
            // one legacy action per batch (`Arena::free_legacy`).
            let legacy = w == Which::Fixed(1) && stream.is_legacy();
            // Inside our claim the superblock stays ours (only a reclaimer holding the claim
            // could give it back), so ownership read before it is checked again in it.
            let local = {
                let env = inner.env(&self.counters);
                self.arenas.get_mut(w).and_then(|a| {
                    a.with(|a| {
                        // A free with declared streams is validated, then ordered, then taken.
                        let ordered = || {
                            Arena::check_live(sb, ptr, size, bytes).and_then(|()| {
                                order_for_free(inner, &self.counters, stream, used_on).map(|_| ())
                            })
                        };
                        if !a.owns(sb) {
                            Local::NotOurs
                        } else if (home || legacy)
                            && !used_on.is_empty()
                            && let Err(e) = ordered()
                        {
                            Local::Freed(Err(e))
                        } else if home {
                            Local::Freed(a.free_local(|| env, sb, ptr, size, bytes, true))
                        } else if legacy {
                            Local::Freed(a.free_legacy(&env, sb, ptr, size, bytes))
                        } else {
                            Local::Checked(Arena::check_live(sb, ptr, size, bytes))
                        }
                    })
                })
            };
            match local {
                Some(Local::Freed(r)) => {
                    r?;
                    self.counted_free(bytes);
                    if home && let Which::User(j) = w {
                        self.send_due_user(inner, self.arenas.users[j].key, stream);
                    }
                    return Ok(());
                }
                // A reclaimer gave the superblock back meanwhile: route the free afresh.
                Some(Local::NotOurs) => return self.free(inner, ptr, size, stream, used_on),
                Some(Local::Checked(r)) => r?,
                // A reclaimer holds our arena right now: the free goes the remote way, and
                // the drain checks it.
                None => {}
            }
        }
        let env = inner.env_on(&self.counters, stream);
        let g = sb.granule_of(ptr).ok_or(invalid(InvalidFree::UnknownPointer))?;
        if !sb.claim_free(g) {
            return Err(invalid(InvalidFree::DoubleFree));
        }
        let ordered = match order_for_free(inner, &self.counters, stream, used_on) {
            Ok(k) => k,
            Err(e) => {
                sb.unfree(g); // not taken: nothing changed
                return Err(e);
            }
        };
        let fr = Freed { ptr, size };
        if Outbox::batchable(stream) {
            let ptds = match Self::ptds_key(&mut self.ptds, &env) {
                Ok(k) => k,
                Err(e) => {
                    sb.unfree(g);
                    return Err(e);
                }
            };
            if let Err(e) = Self::push_batchable(&mut self.outbox, inner, &env, ptds, owner, fr, stream) {
                sb.unfree(g); // not taken: nothing changed
                return Err(e);
            }
        } else {
            // A user stream: the free waits in that stream's batch (`outbox.rs`, "Frees on
            // user streams"). Its identity is asked now, inside this call on it, and a stream
            // being captured is refused before the free is taken (by the declared streams'
            // ordering, if it ran: not asked twice).
            let asked =
                || env.dev.stream_key(stream).and_then(|k| env.dev.refuse_capturing(stream).map(|()| k));
            let key = match ordered.map_or_else(asked, Ok) {
                Ok(k) => k,
                Err(e) => {
                    sb.unfree(g); // nothing changed
                    return Err(e);
                }
            };
            let (cfg, outbox) = (&inner.cfg, &mut self.outbox);
            let sent = outbox.push_user(&env, key, owner, fr, stream, cfg.batch_blocks, cfg.batch_bytes);
            inner.settle(&env, sent);
        }
        let c = &*self.counters;
        c.bump(if mine.is_some() { &c.cross_stream_frees } else { &c.cross_thread_frees }, 1);
        self.counted_free(bytes);
        Ok(())
    }

    /// Adds a free made on the per-thread or the legacy stream to the outbox (`Outbox::push`),
    /// and sends the batch once it is full. A free not taken (the flush of the batch gathered
    /// on the other stream failed) is the caller's to undo; a full batch whose fence cannot be
    /// made is reported (deferred: this free was accepted) and its frees are parked
    /// ([`Inner::park_refused`]).
    fn push_batchable(
        outbox: &mut Outbox,
        inner: &Inner,
        env: &Env<'_>,
        ptds: StreamKey,
        dest: *const ArenaShell,
        fr: Freed,
        stream: Stream,
    ) -> Result<()> {
        let pushed = outbox.push(env, ptds, dest, fr, stream);
        if pushed.is_ok()
            && outbox.is_full(inner.cfg.batch_blocks, inner.cfg.batch_bytes)
            && let Err(e) = outbox.flush(env, ptds)
        {
            env.defer(e);
        }
        inner.park_refused(outbox);
        pushed
    }

    /// Sends remote frees and gives the arenas back (what thread exit does).
    fn release_arena(&mut self, inner: &Inner) -> Result<()> {
        let env = inner.env(&self.counters);
        let flushed = Self::flush_outbox(&mut self.outbox, &mut self.ptds, inner, &env, Park::All);
        for (i, slot) in self.arenas.fixed.iter_mut().enumerate() {
            // A fence just recorded on an arena's stream also covers its blocks (every local
            // free came before it): exit reuses it.
            let fence = match &flushed {
                Ok(Some((stream, Some(f)))) if arena_index(*stream) == Some(i) => Some(Some(f.clone())),
                _ => None,
            };
            if let Some(mut arena) = slot.take() {
                inner.arenas.fetch_sub(1, Ordering::Relaxed);
                // An arena's exit fence goes on its stream, which a capture may forbid: the
                // legacy stream while a blocking stream is being captured
                // (`Device::stream_capturing`), the per-thread stream while this thread
                // captures it. An arena that holds memory is parked then, as a destroyed
                // stream's is, and given back after the next device synchronise
                // (`Inner::bury_zombies`); exiting, it would lose that memory for good (its
                // fence refused). The mutations `legacy_arena_never_parked` and
                // `ptds_arena_never_parked` skip this: the tests
                // `capture::a_legacy_arena_whose_thread_exits_during_a_per_thread_capture_is_parked_not_fenced`
                // and `adversarial_s24c::release_thread_during_its_own_capture_*` must then fail.
                let home = HOMES[i];
                let may_park = if home.is_legacy() {
                    !cfg!(cuarena_mutant = "legacy_arena_never_parked")
                } else {
                    !cfg!(cuarena_mutant = "ptds_arena_never_parked")
                };
                // `stream_capturing` of the legacy stream answers for a blocking stream's
                // capture; an unanswered query parks too.
                if may_park
                    && fence.is_none()
                    && let Some(key) = arena.with_waiting(|a| (a.held_bytes() > 0).then_some(a.key))
                    && env.dev.stream_capturing(home).unwrap_or(true)
                {
                    inner.park_arena(key, arena);
                    continue;
                }
                inner.give_up(&env, arena, fence);
            }
        }
        for u in self.arenas.users.drain(..) {
            inner.retire_user(&env, u.key, u.arena);
        }
        // One synchronise at most per exit, past the bound: parked arenas, and parked frees
        // (this thread's user-stream batches, parked above whatever the bound, and any other
        // thread's parked past it meanwhile, which only an exit or a capture's refusal does).
        inner.bury_past_bound(&env);
        flushed.map(|_| ())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            if inner.born.forked() {
                // A forked child's copy of a slot the fork's child handler could not forget (the
                // fork was made inside a call of this thread's): never given back, as there
                // (`shutdown.rs`, "Fork"); its arenas and fences are the parent's.
                std::mem::forget(std::mem::take(&mut self.arenas));
                std::mem::forget(std::mem::take(&mut self.outbox));
                return;
            }
            if crate::shutdown::process_exiting() && inner.device.kind() == DeviceKind::Cuda {
                return; // no CUDA calls once exit has begun
            }
            if let Err(e) = self.release_arena(&inner) {
                *lock(&inner.deferred) = Some(e);
            }
            inner.counters.retire(&self.counters);
        }
    }
}

/// The path of an allocation an arena served.
#[inline(always)]
fn arena_path(large: bool) -> AllocPath {
    if large { AllocPath::Large } else { AllocPath::Arena }
}

/// An arena request for `size` (at least 1 and at most `large_max`): its size class, its
/// granules and whether it is large. Small blocks are class-rounded, large ones
/// granule-rounded (`block_bytes`).
#[inline(always)]
fn arena_request(size: usize, small_max: usize) -> (usize, usize, bool) {
    let g = granules_for(size).expect("sizes up to large_max do not overflow");
    let class = class_ceil(g);
    let large = size > small_max;
    (class, if large { g } else { class_granules(class) }, large)
}

/// The fast path of a small allocation on the per-thread or the legacy stream (arena `i`):
/// the calling thread's arena serves it from its block cache or free lists, with no CUDA call,
/// no lock and no atomic read-modify-write. `None` sends the request to the slow path
/// ([`Allocator::alloc_small_cold`]); the small return value keeps this path in registers.
#[inline]
fn alloc_fast(inner: &Arc<Inner>, i: usize, class: usize, g: usize, large: bool) -> Option<u64> {
    SLOTS
        .try_with(|cell| {
            let mut slots = cell.try_borrow_mut().ok()?;
            let slot = slots.iter_mut().find(|s| s.id == inner.id)?;
            let p = slot.arenas.fixed[i].as_mut()?.with(|a| a.alloc(class, g))??;
            slot.counted_alloc(g * GRANULE, arena_path(large));
            Some(p)
        })
        .ok()
        .flatten()
}

/// The fast path of an allocation on a user stream: the calling thread's arena for the
/// stream's identity (asked now: one `cuStreamGetId`, after a `cuStreamIsCapturing`, never the
/// handle; see [`Arenas`]) serves it from its block cache or free lists, with no lock and no
/// atomic read-modify-write. `None` sends the request to the slow path, which takes the
/// identity asked here from `Slot::asked` rather than asking again; a failed query is asked
/// again there, and reported. Out of line: inlined into `allocate`, it cost the per-thread
/// stream's fast path a dozen instructions.
#[inline(never)]
fn alloc_fast_user(inner: &Arc<Inner>, stream: Stream, class: usize, g: usize, large: bool) -> Option<u64> {
    SLOTS
        .try_with(|cell| {
            let mut slots = cell.try_borrow_mut().ok()?;
            let slot = slots.iter_mut().find(|s| s.id == inner.id)?;
            let key = Counted::new(&*inner.device, &slot.counters).stream_key(stream).ok()?;
            // Kept for the slow path unless this path serves the request; user-stream batches
            // waiting in the outbox count the allocation there (`Slot::alloc_user`).
            slot.asked = Some((stream, key));
            if slot.outbox.holds_user_batches() {
                return None;
            }
            let p = slot.alloc_user_arena(key, class, g, large)?.ok()?;
            slot.asked = None;
            Some(p)
        })
        .ok()
        .flatten()
}

/// The fast path of a free by the owner, on its arena's own stream, of a block of the calling
/// thread's arena for that stream: on the per-thread stream merged back at once
/// (`Arena::free_local`), on the legacy stream kept back until the batch's legacy action
/// (`Arena::free_legacy`), on a user stream, given as the arena's handle, merged back at once
/// without asking the stream's identity (see "A user arena's own frees" above), once one
/// `cuStreamIsCapturing` says the stream is not being captured. No lock and no atomic
/// read-modify-write; no CUDA call on the per-thread and legacy streams (the legacy action,
/// once per batch, and a give-back by the return rule are the cold exceptions). False sends the
/// free to the slow path ([`Allocator::deallocate_cold`]), which also reports an invalid free:
/// the fast path changes nothing when it finds one.
///
/// `refused` gets the error of the capture query (a stream being captured, or a handle the
/// driver refuses), which is this free's answer: the slow path would ask the same stream.
#[inline]
fn free_fast(inner: &Arc<Inner>, stream: Stream, ptr: u64, size: usize, refused: &mut Option<Error>) -> bool {
    let small_max = inner.cfg.small_max;
    if size == 0 || size > inner.cfg.large_max {
        return false;
    }
    let Some(sb) = inner.pool.registry.lookup(ptr) else { return false };
    let owner = sb.owner.load(Ordering::Acquire);
    let mine = |a: &OwnedArena| std::ptr::eq(Arc::as_ptr(&a.shell), owner);
    SLOTS
        .try_with(|cell| {
            let mut slots = cell.try_borrow_mut().ok()?;
            let slot = slots.iter_mut().find(|s| s.id == inner.id)?;
            let bytes = block_bytes(size, small_max)?;
            let counters = &slot.counters;
            // Made only where needed: the legacy arena's frees, and the return rule's give-back.
            let env = || inner.env_on(counters, stream);
            let a = match arena_index(stream) {
                Some(i) => slot.arenas.fixed[i].as_mut().filter(|a| mine(a))?,
                // Only on the handle the arena's stream has: any other handle may name the same
                // stream only if it is the arena's identity's, and it never is (one stream, one
                // handle), so the slow path asks the identity of any other.
                None => {
                    // The mutation `fast_free_any_handle` takes any handle: the test
                    // `owner_free_on_another_user_stream_is_not_reused_before_its_fence` must
                    // then fail.
                    let any = cfg!(cuarena_mutant = "fast_free_any_handle");
                    // A batch a `flush` kept for this handle's stream is sent by the slow path,
                    // which asks the identity (`Slot::send_due_user`).
                    if slot.outbox.holds_user_batches() && slot.outbox.due_on(stream) {
                        return None;
                    }
                    let u = slot
                        .arenas
                        .users
                        .iter_mut()
                        .find(|u| (any || u.handle == stream) && mine(&u.arena))?;
                    // A free on a stream being captured is refused, as on the slow path (whose
                    // identity lookup refuses one): a block freed into a capture and handed out
                    // after it could be overwritten by the graph's replays. The mutation
                    // `fast_free_while_capturing` skips this; `tests/capture.rs` must then fail.
                    if !cfg!(cuarena_mutant = "fast_free_while_capturing")
                        && let Err(e) = Counted::new(&*inner.device, counters).refuse_capturing(stream)
                    {
                        *refused = Some(e);
                        return None;
                    }
                    &mut u.arena
                }
            };
            let legacy = stream.is_legacy();
            // A user stream's identity was not asked: the return rule asks it before a give-back.
            let asked = !stream.is_user();
            // Inside the claim the superblock stays ours, so ownership is checked again there.
            a.with(|a| {
                a.owns(sb).then(|| {
                    if legacy {
                        a.free_legacy(&env(), sb, ptr, size, bytes)
                    } else {
                        a.free_local(env, sb, ptr, size, bytes, asked)
                    }
                })
            })??
            .ok()?;
            slot.counted_free(bytes);
            Some(())
        })
        .ok()
        .flatten()
        .is_some()
}

/// Runs `f` on the calling thread's slot for `inner`.
#[inline]
fn with_slot<R>(inner: &Arc<Inner>, f: impl FnOnce(&mut Slot, &Inner) -> R) -> R {
    let mut f = Some(f);
    let r = SLOTS.try_with(|cell| {
        let mut slots = cell.try_borrow_mut().ok()?;
        let i = match slots.iter().position(|s| s.id == inner.id) {
            Some(i) => i,
            None => {
                // Forget slots of dropped allocators: their device memory went with the
                // allocator's pool, and their arenas' host memory and fences go now
                // (`OwnedArena`'s drop). Until then (this thread's next new slot, or its exit)
                // a dead slot keeps them, and through its fences the device's handle.
                let dead: Vec<Slot> = {
                    let (keep, dead): (Vec<Slot>, Vec<Slot>) =
                        std::mem::take(&mut *slots).into_iter().partition(|s| s.inner.strong_count() > 0);
                    *slots = keep;
                    dead
                };
                slots.push(Slot::new(inner));
                drop(dead);
                slots.len() - 1
            }
        };
        Some((f.take().expect("called once"))(&mut slots[i], inner))
    });
    // Only a call of an allocator made before a fork can have been in flight at it.
    if inner.born.forked() {
        forget_slots_if_forked_inside();
    }
    match r {
        Ok(Some(r)) => r,
        // The thread's slots are being destroyed (a late destructor), or another allocator's
        // call further up this thread's stack holds them (its device calls this allocator, as
        // a device carved from another allocator's blocks does: helper-40,
        // `adversarial_s28c::an_allocator_whose_device_carves_from_another_allocator_works_on_one_thread`):
        // use a temporary slot, released when the call ends.
        _ => {
            let mut slot = Slot::new(inner);
            (f.take().expect("not called"))(&mut slot, inner)
        }
    }
}

impl Allocator {
    /// An allocator over `device`.
    pub fn new(device: Arc<dyn Device>, config: Config) -> Result<Allocator> {
        crate::sync::prepare_barriers();
        install_fork_handlers();
        let total = device.total_memory()?;
        let trace_path = config.trace.clone();
        let device_id = device.device_id();
        let a = Allocator {
            inner: Arc::new(Inner {
                id: next_id(),
                born: crate::shutdown::Born::now(),
                pool: GlobalPool::new(Arc::clone(&device), &config, total),
                passthrough: (config.passthrough)
                    .then(|| crate::passthrough::Passthrough::new(Arc::clone(&device), config.small_max)),
                device,
                counters: CounterRegistry::new(config.exact_stats),
                cfg: config,
                shells: Mutex::new(Shells::default()),
                zombies: Mutex::new(Zombies::default()),
                deferred: Mutex::new(None),
                held: Mutex::new(Vec::new()),
                held_count: AtomicUsize::new(0),
                held_settled: Condvar::new(),
                capture_ends: AtomicUsize::new(0),
                arenas: AtomicUsize::new(0),
                oom_hook: Mutex::new(None),
                trace: crate::trace::Shared::new(crate::trace::BUFFER_RECORDS),
                graphs: GraphPools::new(device_id),
            }),
        };
        if let Some(path) = trace_path {
            a.inner.trace.start_file(&path)?;
        }
        Ok(a)
    }

    /// An allocator for CUDA device `ordinal`. [`Error::NoDriver`] if there is no driver.
    pub fn cuda(ordinal: i32, config: Config) -> Result<Allocator> {
        let dev = CudaDevice::new(ordinal)?;
        // After cuInit, so the hook runs before the driver's own exit handlers.
        crate::shutdown::install_exit_hook();
        Allocator::new(Arc::new(dev), config)
    }

    /// True in a child process forked after this allocator was made. It is unusable there
    /// (`Error::Forked`): every call that can fail is refused before it takes a lock; the
    /// others do nothing (`set_limit_bytes`, `reset_peak`, `reset_counters`, `set_oom_hook`,
    /// `graph_pool_retain`, `graph_capture_begin`) or answer zeros (`stats`, `size_histogram`,
    /// `graph_pool_use_count`, `graph_pool_bytes`); and dropping it leaks it. Make allocators
    /// after a fork in the child (`shutdown.rs`, "Fork").
    pub fn forked(&self) -> bool {
        self.inner.born.forked()
    }

    /// [`Error::Forked`] in a child forked after this allocator was made.
    #[inline]
    fn usable(&self) -> Result<()> {
        if self.inner.born.forked() { Err(Error::Forked) } else { Ok(()) }
    }

    /// Allocates `size` bytes, ready for use on `stream` (256-byte aligned).
    /// `size == 0` gives [`DeviceAddr::NULL`].
    ///
    /// Out of memory: memory idle in this thread's and idle threads' arenas is taken back and
    /// the request tried once more; then, if an OOM hook is set ([`Allocator::set_oom_hook`]),
    /// it is called and the request retried while it asks to, at most [`MAX_OOM_RETRIES`]
    /// times; then [`Error::OutOfMemory`].
    #[inline(always)]
    pub fn allocate(&self, size: usize, stream: Stream) -> Result<DeviceAddr> {
        // The fast path gives a bare address, kept in registers: the 48-byte `Result` is made
        // once, here, in the caller, not copied out of a callee's frame (that copy, read back
        // wider than it was written, stalled store forwarding and cost a third of a cache-hit
        // allocation). So this wrapper is always inlined, whatever the compiler makes of the
        // fast path behind it (when it stopped inlining the whole of `allocate` into the
        // benchmark, one-thread churn lost a tenth on the host and a fifth on the H200).
        match self.allocate_fast_traced(size, stream) {
            Some(p) => Ok(DeviceAddr(p)),
            None => self.allocate_slow(size, stream),
        }
    }

    /// [`Allocator::allocate_fast`] with the trace's rule: whether a trace runs is asked after
    /// the allocation (trace.rs).
    #[inline]
    fn allocate_fast_traced(&self, size: usize, stream: Stream) -> Option<u64> {
        crate::trace::allocation(
            &self.inner.trace,
            || self.allocate_fast(size, stream),
            |p| {
                if let Some(p) = p {
                    // A block in hand stays `Ok`: recording does not change the result.
                    let _ = self.trace_allocation(size, stream, Ok(DeviceAddr(p)));
                }
                p
            },
        )
    }

    /// The fast path of [`Allocator::allocate`]: a request up to `large_max` on the per-thread
    /// or the legacy stream, served by the calling thread's arena without a CUDA call, a lock or
    /// an atomic read-modify-write (`alloc_fast`). `None` changes nothing and sends the request
    /// to [`Allocator::allocate_slow`].
    #[inline(always)]
    fn allocate_fast(&self, size: usize, stream: Stream) -> Option<u64> {
        let inner = &self.inner;
        if inner.passthrough.is_some() || size == 0 || size > inner.cfg.large_max {
            return None;
        }
        let (class, gc, large) = arena_request(size, inner.cfg.small_max);
        match arena_index(stream) {
            Some(i) => alloc_fast(inner, i, class, gc, large),
            None => alloc_fast_user(inner, stream, class, gc, large),
        }
    }

    /// Every allocation the fast path did not serve, with the trace's rule and the OOM hook.
    /// Out of line, but not `#[cold]`: it is the path of every user-stream allocation, and a
    /// cold function gets its callees inlined less (own-stream churn lost a tenth with it).
    #[inline(never)]
    fn allocate_slow(&self, size: usize, stream: Stream) -> Result<DeviceAddr> {
        self.usable()?;
        crate::trace::allocation(
            &self.inner.trace,
            || self.allocate_untraced(size, stream),
            |r| self.trace_allocation(size, stream, r),
        )
    }

    /// [`Allocator::allocate`] without the trace: with the OOM hook.
    #[inline(always)]
    fn allocate_untraced(&self, size: usize, stream: Stream) -> Result<DeviceAddr> {
        match self.allocate_once(size, stream) {
            Err(e @ Error::OutOfMemory { .. }) => self.after_oom(size, stream, e),
            r => r,
        }
    }

    /// [`Allocator::allocate`] without the trace and the OOM hook. Out of memory reports `size`
    /// whichever path ran out (an arena's rounds the request to a class or a granule).
    #[inline]
    fn allocate_once(&self, size: usize, stream: Stream) -> Result<DeviceAddr> {
        self.allocate_by_path(size, stream).map_err(|e| e.for_request(size))
    }

    /// [`Allocator::allocate_once`] before its error names the request.
    #[inline(always)]
    fn allocate_by_path(&self, size: usize, stream: Stream) -> Result<DeviceAddr> {
        if let Some(p) = &self.inner.passthrough {
            return self.passthrough_allocate(p, size, stream); // pass-through mode
        }
        if size == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let inner = &self.inner;
        if size <= inner.cfg.large_max {
            let (class, gc, large) = arena_request(size, inner.cfg.small_max);
            match arena_index(stream) {
                Some(i) => {
                    if let Some(p) = alloc_fast(inner, i, class, gc, large) {
                        return Ok(DeviceAddr(p));
                    }
                    return self.alloc_small_cold(i, class, gc, large);
                }
                // A user stream: its arena, found by its identity.
                None => {
                    return with_slot(inner, |slot, inner| {
                        let key = match slot.asked.take() {
                            // Asked by the fast path in this call.
                            Some((s, k)) if s == stream => k,
                            _ => inner.env(&slot.counters).dev.stream_key(stream)?,
                        };
                        // Counted where it is served (`alloc_user`), with its path.
                        let p = slot.alloc_user(inner, stream, key, class, gc, large)?;
                        Ok(DeviceAddr(p))
                    });
                }
            }
        }
        // More than both the cap and the device is refused before the pool's lock. A request
        // over the cap but not over the device may still fit in memory reserved before the cap
        // was lowered (`set_memory_fraction(0)`): the pool's first fit looks, and its growth
        // obeys the cap.
        let bytes = match block_bytes(size, inner.cfg.small_max) {
            Some(b) if b <= inner.pool.limit().max(inner.pool.total()) => b,
            _ => return Err(inner.oom(size)),
        };
        with_slot(inner, |slot, inner| slot.alloc_pool(inner, bytes, stream).map(DeviceAddr))
    }

    /// A pass-through allocation. The global pool holds graph pools' segments only, under the
    /// same cap; out of memory with any of them reserved takes back retired pools' memory (a
    /// device synchronise, unless a capture is underway) and wholly free chunks, and tries
    /// once more.
    #[cold]
    fn passthrough_allocate(
        &self,
        p: &crate::passthrough::Passthrough,
        size: usize,
        stream: Stream,
    ) -> Result<DeviceAddr> {
        let pool = &self.inner.pool;
        match p.allocate(size, stream, pool.limit(), || pool.reserved()) {
            Err(Error::OutOfMemory { .. }) if pool.reserved() > 0 => {
                with_slot(&self.inner, |slot, inner| {
                    let env = inner.env(&slot.counters);
                    if let Err(e) = inner.bury_zombies(&env) {
                        env.defer(e);
                    }
                    inner.pool.trim(&env.dev, false)?;
                    slot.counters.bump(&slot.counters.alloc_retries, 1);
                    Ok::<(), Error>(())
                })?;
                p.allocate(size, stream, pool.limit(), || pool.reserved())
            }
            r => r,
        }
    }

    /// The slow path of a small allocation on the per-thread or the legacy stream.
    #[cold]
    #[inline(never)]
    fn alloc_small_cold(&self, i: usize, class: usize, g: usize, large: bool) -> Result<DeviceAddr> {
        with_slot(&self.inner, |slot, inner| {
            // Counted where it is served (`alloc_slow_in`), with its path.
            let p = slot.alloc_small_slow(inner, i, class, g, large)?;
            Ok(DeviceAddr(p))
        })
    }

    /// Frees a block from [`Allocator::allocate`]. `size` is the size it was allocated with.
    ///
    /// **Contract:** every earlier use of the block is ordered before later work on `stream`
    /// (like `cudaFreeAsync`). An invalid free (unknown pointer, double free, wrong size) is
    /// refused with [`Error::InvalidFree`] and changes nothing; a free of a block whose free is
    /// held ([`Allocator::deallocate_or_hold`]) is a double free. A free of a block owned by
    /// another thread is checked by that thread later; if found invalid it is counted in
    /// [`Stats::invalid_frees`] and reported by [`Allocator::take_deferred_error`].
    #[inline(always)]
    pub fn deallocate(&self, ptr: DeviceAddr, size: usize, stream: Stream) -> Result<()> {
        // As in `allocate`: the fast path answers in a register and the `Result` is made here,
        // in the caller; every other free goes out of line.
        let mut refused = None;
        if self.deallocate_fast(ptr, size, stream, &mut refused) {
            return Ok(());
        }
        self.deallocate_slow(ptr, size, stream, refused, 0)
    }

    /// [`free_fast`] when no trace runs, not in pass-through mode and no free is held (the slow
    /// path checks a free against the held ones: [`Allocator::deallocate_or_hold`]): true if it
    /// took the free.
    #[inline]
    fn deallocate_fast(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        refused: &mut Option<Error>,
    ) -> bool {
        let inner = &self.inner;
        !inner.trace.on()
            && inner.passthrough.is_none()
            && inner.held_count.load(Ordering::Relaxed) == 0
            && free_fast(inner, stream, ptr.0, size, refused)
    }

    /// Every free [`Allocator::deallocate_fast`] did not take (entered directly too by
    /// [`Allocator::free_declared`]'s plain frees): the usable and held-list checks
    /// ([`Allocator::refuse_held`]), a graph pool's block, then [`Allocator::deallocate_checked`].
    /// `retrier`: the token of the retry of a held free making this free, or 0.
    #[cold]
    #[inline(never)]
    fn deallocate_slow(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        refused: Option<Error>,
        retrier: u64,
    ) -> Result<()> {
        self.usable()?;
        self.refuse_held(ptr, size, retrier)?;
        // A CUDA graph pool's block; not traced, as its allocation was not.
        if refused.is_none()
            && self.inner.graphs.may_hold(ptr.0)
            && let Some(r) = self.free_graph(ptr, size, stream, &[])
        {
            return r;
        }
        self.deallocate_checked(ptr, size, stream, refused)
    }

    /// [`Allocator::deallocate_slow`] after its checks and a graph pool's block: traced if a
    /// trace runs (and the fast path did not refuse the free), then as
    /// [`Allocator::deallocate_rest`].
    #[inline]
    fn deallocate_checked(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        refused: Option<Error>,
    ) -> Result<()> {
        if refused.is_none() && self.inner.trace.on() {
            return self.deallocate_traced(ptr, size, stream, &[]); // a trace records (trace.rs)
        }
        self.deallocate_rest(ptr, size, stream, refused, &[])
    }

    /// [`Allocator::deallocate_used_on`] without the trace (what a traced free runs), in
    /// either mode for a plain free (`used_on` empty), in the normal mode for a declared one:
    /// that never takes the fast path, which orders nothing.
    fn deallocate_untraced(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        let mut refused = None;
        if self.inner.passthrough.is_none()
            && used_on.is_empty()
            && free_fast(&self.inner, stream, ptr.0, size, &mut refused)
        {
            return Ok(());
        }
        self.deallocate_rest(ptr, size, stream, refused, used_on)
    }

    /// A free the fast path did not take, without the trace: its refusal (`refused`: the
    /// stream is being captured, or its handle is refused), pass-through mode (never with
    /// `used_on`: [`Allocator::free_declared`] orders those itself), the free of null,
    /// and the slow path.
    #[inline(always)]
    fn deallocate_rest(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        refused: Option<Error>,
        used_on: &[Stream],
    ) -> Result<()> {
        if let Some(e) = refused {
            return Err(e);
        }
        if let Some(p) = &self.inner.passthrough {
            debug_assert!(used_on.is_empty(), "pass-through mode orders declared streams before");
            return p.deallocate(ptr, size, stream); // pass-through mode
        }
        if ptr.is_null() && size == 0 {
            return Ok(());
        }
        self.deallocate_cold(ptr, size, stream, used_on)
    }

    /// Every free the fast path did not take, and every invalid one.
    #[cold]
    #[inline(never)]
    fn deallocate_cold(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        with_slot(&self.inner, |slot, inner| {
            let r = if ptr.is_null() {
                Err(Error::InvalidFree { ptr: 0, size, reason: InvalidFree::UnknownPointer })
            } else {
                slot.free(inner, ptr.0, size, stream, used_on)
            };
            if let Err(Error::InvalidFree { .. }) = r {
                slot.counters.bump(&slot.counters.invalid_frees, 1);
            }
            r
        })
    }

    /// [`Allocator::deallocate`] for a block also used on the streams `used_on` (what
    /// `record_stream` declares). Each of those streams, if not `stream` itself, gets an event
    /// that `stream` is made to wait on first, so the free's fence covers their work too. No
    /// host block. Like every stream passed here, `Stream::PER_THREAD` in `used_on` names the
    /// calling thread's per-thread stream: a declaration made on another thread's must not be
    /// passed as one (`DeviceBuffer`, `CudaBuffer` and the C ABI keep the declaring thread, and
    /// pass [`Stream::LEGACY`] for it instead, whose event follows all earlier work on every
    /// thread's per-thread stream).
    pub fn deallocate_used_on(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        self.free_declared(ptr, size, stream, used_on, 0)
    }

    /// [`Allocator::deallocate_used_on`], made by the retry of a held free with token `retrier`
    /// (0: by a caller; see [`Allocator::refuse_held`]).
    fn free_declared(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
        retrier: u64,
    ) -> Result<()> {
        if used_on.is_empty() {
            // A plain free: `deallocate`'s paths (its slow path makes the checks below).
            let mut refused = None;
            if self.deallocate_fast(ptr, size, stream, &mut refused) {
                return Ok(());
            }
            return self.deallocate_slow(ptr, size, stream, refused, retrier);
        }
        self.usable()?;
        self.refuse_held(ptr, size, retrier)?;
        // A graph pool's block: kept by its pool's rules (graph_pool.rs), which order or hold
        // the declared streams.
        if self.inner.graphs.may_hold(ptr.0)
            && let Some(r) = self.free_graph(ptr, size, stream, used_on)
        {
            return r;
        }
        let Some(p) = &self.inner.passthrough else {
            // The normal mode validates the free first, with the owner's knowledge of the
            // block, then orders the declared streams, then takes it (`Slot::free`).
            if self.inner.trace.on() {
                return self.deallocate_traced(ptr, size, stream, used_on);
            }
            return self.deallocate_untraced(ptr, size, stream, used_on);
        };
        // Pass-through mode orders the declared streams as the normal mode does, for a free it
        // will accept: a bad one is refused (traced and counted) without a driver call. (A free
        // of the same block racing this one may still win between the check and the free: the
        // ordering is then spent on waits, and nothing else changes.)
        if p.is_valid_free(ptr, size) {
            with_slot(&self.inner, |slot, inner| order_for_free(inner, &slot.counters, stream, used_on))?;
        }
        // Pass-through mode has no fast path, and the checks of the slow path were made above.
        self.deallocate_checked(ptr, size, stream, None)
    }

    /// Caps reserved memory at `bytes`. Memory already reserved above it is kept until freed
    /// blocks let `trim` release it.
    pub fn set_limit_bytes(&self, bytes: usize) {
        if self.forked() {
            return;
        }
        self.inner.pool.set_limit(bytes);
    }

    /// Caps reserved memory at `fraction` [0, 1] of the device's memory, as PyTorch's
    /// `set_per_process_memory_fraction` does: at 0 nothing more is reserved (blocks already
    /// reserved still serve). Anything else (NaN, below 0, above 1) is refused and changes
    /// nothing.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        self.usable()?;
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::Config(format!("memory fraction {fraction} must be in [0, 1]")));
        }
        self.inner.pool.set_limit((self.inner.pool.total() as f64 * fraction) as usize);
        Ok(())
    }

    /// [`Allocator::allocate`] on the calling thread's per-thread default stream.
    pub fn allocate_per_thread(&self, size: usize) -> Result<DeviceAddr> {
        self.allocate(size, Stream::PER_THREAD)
    }

    /// [`Allocator::deallocate`] on the calling thread's per-thread default stream.
    pub fn deallocate_per_thread(&self, ptr: DeviceAddr, size: usize) -> Result<()> {
        self.deallocate(ptr, size, Stream::PER_THREAD)
    }

    /// Sends this thread's gathered remote frees and takes back frees sent to it (and to
    /// arenas parked without an owner: see "Arenas of user streams that may be gone"). Remote
    /// frees this thread made on user streams cannot be fenced outside a call on their stream:
    /// they are parked while the parked memory stays within 64 MiB, and reach their owners after
    /// the next device synchronise (out of memory, `trim(true)`, a thread's exit past 64 MiB
    /// parked); past that they stay with this thread until its next call on their stream sends
    /// them under an event (fewer than `batch_blocks` blocks and `batch_bytes` bytes in all).
    /// Never blocks.
    pub fn flush(&self) -> Result<()> {
        self.usable()?;
        self.retry_held(false);
        with_slot(&self.inner, |slot, inner| {
            let env = inner.env(&slot.counters);
            Slot::flush_outbox(&mut slot.outbox, &mut slot.ptds, inner, &env, Park::WithinBound)?;
            for a in slot.arenas.iter_mut() {
                a.with(|a| a.tidy(&env));
            }
            // Parked arenas have no owner to take in frees sent to them: any flush does, so
            // that a bad one among them is found and reported now (the memory stays parked).
            for (_, a) in lock(&inner.zombies).arenas.iter_mut() {
                a.with(|a| a.drain(&env));
            }
            Ok(())
        })
    }

    /// Does now what thread exit does: sends this thread's remote frees, gives its arena back
    /// to the global pool and folds its counters. The thread may go on allocating; it then
    /// gets a new arena.
    pub fn release_thread(&self) -> Result<()> {
        self.usable()?;
        self.retry_held(false);
        let id = self.inner.id;
        let slot = SLOTS.try_with(|cell| {
            // Held by another allocator's call further up this thread's stack (its device calls
            // this one): this thread's slot cannot be reached now.
            let Ok(mut v) = cell.try_borrow_mut() else {
                return Err(Error::Unsupported(
                    "release_thread inside another cuarena allocator's call on this thread (its device calls this one)"
                        .into(),
                ));
            };
            Ok(v.iter().position(|s| s.id == id).map(|i| v.swap_remove(i)))
        });
        let Some(mut slot) = slot.unwrap_or(Ok(None))? else { return Ok(()) };
        let r = slot.release_arena(&self.inner);
        self.inner.counters.retire(&slot.counters);
        // Released: its drop must not release again. A second release (every one may bury
        // the parked arenas past their bound) counted its give-backs on retired counters, and
        // `arena_held_bytes` stayed up by them for good (`tests/adversarial_s27c.rs`).
        if !cfg!(cuarena_mutant = "release_thread_releases_twice") {
            slot.inner = Weak::new();
        }
        drop(slot);
        r
    }

    /// Gives memory back to the device: first every superblock that holds no used block
    /// goes back to the pool from this thread's arena and from every idle thread's arena (its
    /// owner's help not needed), then every wholly free chunk is released. With `blocking`,
    /// waits for the chunks' pending fences (a host synchronisation); otherwise releases only
    /// chunks whose fences are done; blocking, it also gives back memory of arenas whose user
    /// stream was destroyed, after a device synchronise. Last, it destroys the CUDA events kept
    /// for reuse that no fence holds now. Returns the bytes released to the device.
    pub fn trim(&self, blocking: bool) -> Result<usize> {
        self.usable()?;
        self.retry_held(false);
        with_slot(&self.inner, |slot, inner| {
            let env = inner.env(&slot.counters);
            // Pass-through mode has no arenas: its pool holds graph pools' segments only.
            if inner.passthrough.is_none() {
                Slot::reclaim(
                    &mut slot.arenas,
                    &mut slot.outbox,
                    &mut slot.ptds,
                    inner,
                    &env,
                    false,
                    blocking,
                );
            }
            if blocking {
                // Arenas parked meanwhile, or kept by a failed synchronise above (deferred):
                // tried again, the error returned this time.
                inner.bury_zombies(&env)?;
            }
            let released = inner.pool.trim(&env.dev, blocking);
            // Last, whatever the pool's trim answered: the reclaims above release fences, whose
            // events come back idle.
            inner.pool.events.shrink(&env.dev);
            released
        })
    }

    /// The latest error found after the call that caused it (an invalid remote free, a
    /// failed fence on a background path), taken.
    pub fn take_deferred_error(&self) -> Option<Error> {
        if self.forked() {
            return None;
        }
        lock(&self.inner.deferred).take()
    }

    /// A snapshot of the allocator's state.
    pub fn stats(&self) -> Stats {
        if self.forked() {
            return Stats::default();
        }
        let pool = &self.inner.pool;
        let mut s = if let Some(p) = &self.inner.passthrough {
            // Pass-through mode; the OOM path's counts are kept per thread as usual, and so are
            // refused frees of graph pools' blocks (`free_graph`; pass-through's own are its),
            // and the driver calls and fences made outside `passthrough.rs` (the declared
            // streams' fences of `deallocate_used_on`, the trace's identity lookups, graph pools).
            let (mut s, mut c) = (p.stats(), Stats::default());
            self.inner.counters.fill(&mut c);
            (s.alloc_retries, s.ooms, s.oom_hook_calls) = (c.alloc_retries, c.ooms, c.oom_hook_calls);
            s.invalid_frees += c.invalid_frees;
            s.driver_calls += c.driver_calls;
            (s.fences_recorded, s.fence_waits, s.fence_polls, s.host_syncs) =
                (c.fences_recorded, c.fence_waits, c.fence_polls, c.host_syncs);
            s
        } else {
            let mut s = Stats::default();
            self.inner.counters.fill(&mut s);
            pool.fill_stats(&mut s);
            s.arenas = self.inner.arenas.load(Ordering::Relaxed) as u64;
            // `pool_allocations` is part of `allocations` (one counter per allocation, see
            // `stats.rs`), so this is never below 0, even read racing allocations or a reset.
            s.arena_allocations = s.allocations.saturating_sub(s.pool_allocations);
            s
        };
        // The pool's cap, which pass-through allocations obey too.
        (s.limit_bytes, s.device_total_bytes) = (pool.limit() as u64, pool.total() as u64);
        s
    }

    /// Restarts every peak at its value now: `peak_live_bytes` (and its upper bound
    /// `peak_live_bytes_upper`, and the exact peak of `stats=exact`) at the live bytes now,
    /// `peak_reserved_bytes` at the reserved bytes now (`torch.cuda.reset_peak_memory_stats`).
    /// Safe while other threads allocate: no thread's counters are written (see `stats.rs`).
    pub fn reset_peak(&self) {
        if self.forked() {
            return;
        }
        if let Some(p) = &self.inner.passthrough {
            return p.reset_peak(); // pass-through mode
        }
        self.inner.counters.reset_peak();
        self.inner.pool.reset_peak_reserved();
    }

    /// Restarts every accumulated counter at zero: allocations, deallocations, frees by kind,
    /// fences, polls, waits, driver calls, host syncs, invalid frees, superblock moves, per-path
    /// counts, retries, out-of-memory counts and the size histogram
    /// (`torch.cuda.reset_accumulated_memory_stats`). Gauges (`live_bytes`, `reserved_bytes`,
    /// `arena_held_bytes`, ...) and peaks are kept. Safe while other threads allocate: each
    /// thread's counters are only read, into a baseline that later reads subtract (see
    /// `stats.rs`), so no bump racing the reset is lost or torn; each counter of an operation
    /// racing it is counted before or after it (two counters of one operation may fall on
    /// either side; `allocations` and the size histogram are the same counters, never apart).
    pub fn reset_counters(&self) {
        if self.forked() {
            return;
        }
        if let Some(p) = &self.inner.passthrough {
            p.reset_counters(); // pass-through mode
        }
        self.inner.counters.reset_counters();
    }

    /// Allocations since the last `reset_counters` by block size (the request rounded to its
    /// size class for small blocks, to 256 B for large ones): bucket `k` counts blocks up to
    /// [`size_bucket_limit(k)`](crate::stats::size_bucket_limit) bytes and over the previous
    /// bucket's limit (bucket 0: up to 256 B; the last bucket: over 2 GiB). Pass-through mode
    /// counts the sizes asked for.
    pub fn size_histogram(&self) -> [u64; crate::stats::SIZE_HISTOGRAM_BUCKETS] {
        if self.forked() {
            return [0; crate::stats::SIZE_HISTOGRAM_BUCKETS];
        }
        if let Some(p) = &self.inner.passthrough {
            return p.size_histogram(); // pass-through mode
        }
        self.inner.counters.size_histogram()
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// Checks the global pool's and the graph pools' invariants; panics on a violation. For
    /// tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        self.inner.pool.check();
        self.inner.graphs.check(|b| self.inner.pool.segment_len(b));
        self.inner.passthrough.iter().for_each(|p| p.check()); // pass-through mode
    }

    /// Ranges the pool has handed out: `(address, bytes, is_superblock)`. For tests.
    #[doc(hidden)]
    pub fn pool_used_ranges(&self) -> Vec<(u64, usize, bool)> {
        self.inner.pool.used_ranges()
    }

    /// Bytes held by parked arenas of destroyed user streams, waiting for a device synchronise
    /// (`trim(true)`, out-of-memory, or more parked; see `allocator.rs`). For tests.
    #[doc(hidden)]
    pub fn parked_bytes(&self) -> usize {
        let mut z = lock(&self.inner.zombies);
        z.recount();
        z.bytes - z.frees.bytes()
    }

    /// Bytes of the blocks of parked remote frees made on user streams, waiting for the same
    /// synchronise (see `outbox.rs`). For tests.
    #[doc(hidden)]
    pub fn parked_free_bytes(&self) -> usize {
        lock(&self.inner.zombies).frees.bytes()
    }

    /// Bytes the pool has handed out (blocks and lent superblocks). For tests.
    #[doc(hidden)]
    pub fn pool_in_use(&self) -> usize {
        self.inner.pool.in_use()
    }

    /// Frees held for a capture now ([`Allocator::deallocate_or_hold`]). For tests.
    #[doc(hidden)]
    pub fn held_frees(&self) -> usize {
        lock(&self.inner.held).len()
    }
}

impl Allocator {
    pub(crate) fn defer_error(&self, e: Error) {
        if self.forked() {
            return; // its lock may be held by a thread the child does not have
        }
        *lock(&self.inner.deferred) = Some(e);
    }

    /// [`Allocator::deallocate_used_on`] for a caller that cannot make a refused free again:
    /// a free refused because a stream is being captured into a CUDA graph is held, and made
    /// again by the next [`Allocator::graph_capture_end`], [`Allocator::flush`],
    /// [`Allocator::trim`] or [`Allocator::release_thread`], on whatever thread makes that call
    /// (its streams kept as [`StreamUse`]s: another thread's per-thread stream is fenced
    /// through the legacy stream), until no capture refuses it. True if the free was taken
    /// now, false if held (a capture that ended meanwhile may have had it made before this
    /// returns); any other refusal is returned, and the block stays live. A held free's later
    /// refusal (other than for a capture, which holds it again) is deferred
    /// ([`Allocator::take_deferred_error`]) and the block stays live.
    ///
    /// Holds are per allocator: a free held by one allocator because a capture announced to
    /// another allocator of the device forbade what it needed is made by this allocator's next
    /// `graph_capture_end`, `flush`, `trim` or `release_thread`, not by the other's end.
    ///
    /// **The streams must outlive the held free**: it is made on the same handles (the free's
    /// and `used_on`), so a stream destroyed before then, whose handle CUDA may give to a new
    /// stream, would order the block's reuse after the wrong work. Callers whose streams are
    /// never destroyed (the per-thread and legacy streams, PyTorch's pooled streams) or that
    /// keep them alive (an owning buffer) may use it; others free with
    /// [`Allocator::deallocate_used_on`] and retry themselves.
    ///
    /// A free of a held block, by anyone but the held free's retry, is refused as a double
    /// free ([`InvalidFree::DoubleFree`], counted in `invalid_frees`): holding must not let two
    /// frees of one block be made. While that retry runs, such a free waits for it and is then
    /// judged afresh. A free that races the hold itself (neither ordered before the other) may
    /// be taken as well, as two racing frees of one block may (README); the held one is then
    /// made at the retry, when the block may have a new owner.
    ///
    /// A retry runs on another thread's call, so a capture of the held free's streams must be
    /// announced ([`Allocator::graph_capture_begin`]), which holds retries off, or wait until
    /// the free is made.
    pub fn deallocate_or_hold(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<bool> {
        let ends = self.inner.capture_ends.load(Ordering::Acquire);
        match self.deallocate_used_on(ptr, size, stream, used_on) {
            Ok(()) => Ok(true),
            Err(Error::StreamCapturing { .. }) => {
                // Some paths ask the stream before they validate the free (the fast path's
                // capture query, a user arena's identity): only a free that is otherwise valid
                // is held. A bad one held would be made later, by then perhaps of the block's
                // next owner (helper-54). The mutation `hold_unchecked` skips this:
                // `adversarial_s33_held` must then fail.
                if !cfg!(cuarena_mutant = "hold_unchecked") {
                    self.check_hold(ptr, size)?;
                }
                let mut held = lock(&self.inner.held);
                // Another free of this block refused and held meanwhile (two frees racing).
                if held.iter().any(|h| h.ptr == ptr) {
                    drop(held);
                    return Err(self.double_free(ptr, size));
                }
                held.push(HeldFree {
                    ptr,
                    size,
                    stream: StreamUse::here(stream),
                    used_on: used_on.iter().map(|&s| StreamUse::here(s)).collect(),
                    retrying: 0,
                });
                self.inner.held_count.store(held.len(), Ordering::Relaxed);
                drop(held);
                // A capture's end between the refusal and the hold may have retried the list
                // before this entry was in it: retry now rather than wait for the next call that
                // retries. (An end after the push finds the entry itself: the lock orders the
                // push before its marking, or its count before this load.) The mutation
                // `hold_ignores_capture_end` skips this: `held_frees` must then fail.
                if !cfg!(cuarena_mutant = "hold_ignores_capture_end")
                    && self.inner.capture_ends.load(Ordering::Acquire) != ends
                {
                    self.retry_held(false);
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// [`Allocator::deallocate_or_hold`] for an owning buffer's drop ([`crate::DeviceBuffer`],
    /// `CudaBuffer`), which keeps its stream alive until then, and whose refusal is deferred
    /// ([`Allocator::take_deferred_error`]).
    pub(crate) fn free_or_hold(&self, ptr: DeviceAddr, size: usize, stream: Stream, used_on: &[Stream]) {
        if let Err(e) = self.deallocate_or_hold(ptr, size, stream, used_on) {
            self.defer_error(e);
        }
    }

    /// [`Slot::check_hold`] on the calling thread's slot (pass-through mode: its own check);
    /// a refusal is counted in `invalid_frees`.
    fn check_hold(&self, ptr: DeviceAddr, size: usize) -> Result<()> {
        let r = match &self.inner.passthrough {
            Some(p) => p.check_hold(ptr, size),
            None => with_slot(&self.inner, |slot, inner| slot.check_hold(inner, ptr.0, size)),
        };
        if let Err(Error::InvalidFree { .. }) = r {
            self.count(|c| &c.invalid_frees);
        }
        r
    }

    /// A double free of `ptr`, counted.
    #[cold]
    fn double_free(&self, ptr: DeviceAddr, size: usize) -> Error {
        self.count(|c| &c.invalid_frees);
        Error::InvalidFree { ptr: ptr.0, size, reason: InvalidFree::DoubleFree }
    }

    /// The held-list check of every free: a free of a held block is a double free, unless it
    /// is that held free's own retry (`retrier`, its token; 0 for a caller's free). A free of a
    /// block whose held free another retry is making now waits until that retry has settled:
    /// the entry gone (its free taken, or refused otherwise and deferred), this free goes on (of
    /// the block's next life, if it was handed out again meanwhile; helper-55 found such a free
    /// refused while the retry relocked); the entry unmarked (refused again by a capture), this
    /// free is a double free. One `Relaxed` load while nothing is held. The
    /// mutation `held_check_off` skips it: `c_abi_capture_frees` must then fail.
    ///
    /// The wait cannot close a cycle: the caller holds no cuarena lock and no slot here (the
    /// top of the slow free paths), and a retry's free never waits for another free.
    #[inline]
    fn refuse_held(&self, ptr: DeviceAddr, size: usize, retrier: u64) -> Result<()> {
        if cfg!(cuarena_mutant = "held_check_off") || self.inner.held_count.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        self.refuse_held_slow(ptr, size, retrier)
    }

    #[cold]
    #[inline(never)]
    fn refuse_held_slow(&self, ptr: DeviceAddr, size: usize, retrier: u64) -> Result<()> {
        let mut held = lock(&self.inner.held);
        loop {
            match held.iter().find(|h| h.ptr == ptr).map(|h| h.retrying) {
                None => return Ok(()),
                Some(t) if t != 0 && t == retrier => return Ok(()),
                Some(0) => {
                    drop(held);
                    return Err(self.double_free(ptr, size));
                }
                // The mutation `held_free_no_wait` refuses at once: the tests
                // `held_frees::the_next_owners_free_during_a_retry_is_taken` and
                // `adversarial_s33_held::retries_on_several_threads_race_new_holds_of_other_blocks`
                // must then fail.
                Some(_) if cfg!(cuarena_mutant = "held_free_no_wait") => {
                    drop(held);
                    return Err(self.double_free(ptr, size));
                }
                Some(_) => {
                    held = self.inner.held_settled.wait(held).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// Makes the held frees again (see [`Allocator::deallocate_or_hold`]). Each entry stays in
    /// the list, marked with this retry's token, while its free is made without the lock; then
    /// it goes (taken, or refused otherwise: deferred) or is unmarked (refused again by a
    /// capture), and waiting frees of it are woken. Entries another retry is making are left to
    /// it. A retry that became a plain free on the legacy stream (another thread's per-thread
    /// stream is fenced through it, `StreamUse::fence_stream`) goes the way of any legacy free
    /// towards another thread's arena or the pool: into the outbox, whose legacy event is
    /// parked while a capture forbids one (`tests/held_frees.rs`).
    ///
    /// `graph_capture_end` passes `look = true`: it reads the list under its lock even when
    /// `held_count` reads 0. Its protocol with a hold (count the end, then take the lock; push
    /// under the lock, then read the count of ends) needs the lock's ordering: a `Relaxed` 0
    /// read after the count of ends was raised may be stale, and the hold, seeing no end, would
    /// then wait for a later call (`loom-tests/tests/held.rs`, the mutation
    /// `capture_end_skips_on_count`).
    ///
    /// A capture's end skips entries another retry has marked; if that retry's free is then
    /// refused by the capture that has just ended, the entry would stay held with no end left
    /// to make it (helper-55). So a retry reads the count of ends before it marks, and, having
    /// unmarked an entry refused by a capture, goes round again if an end came meanwhile (the
    /// lock orders the end's marking before the unmarking, or the unmarking before it).
    fn retry_held(&self, look: bool) {
        if !look && self.inner.held_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        // The mutation `retry_unlists_held` takes the entries out while they are retried (and
        // holds a refused one again): `c_abi_capture_frees` must then fail, as a second free
        // slips in between.
        if cfg!(cuarena_mutant = "retry_unlists_held") {
            let held = std::mem::take(&mut *lock(&self.inner.held));
            self.inner.held_count.store(0, Ordering::Relaxed);
            for h in held {
                let stream = h.stream.fence_stream();
                self.free_or_hold(h.ptr, h.size, stream, &StreamUse::fence_streams(&h.used_on, stream));
            }
            return;
        }
        let token = next_id();
        // Unmarks this retry's entries if a free below unwinds (a panic the C ABI catches), so
        // they are not left marked for good; a no-op otherwise.
        let _unmark = Unmark { alloc: self, token };
        loop {
            let ends = self.inner.capture_ends.load(Ordering::Acquire);
            let mine: Vec<(DeviceAddr, usize, Stream, Vec<Stream>)> = {
                let mut held = lock(&self.inner.held);
                held.iter_mut()
                    .filter(|h| h.retrying == 0)
                    .map(|h| {
                        h.retrying = token;
                        let stream = h.stream.fence_stream();
                        (h.ptr, h.size, stream, StreamUse::fence_streams(&h.used_on, stream))
                    })
                    .collect()
            };
            let mut refused_again = false;
            let device = self.inner.device.device_id();
            for (ptr, size, stream, used_on) in mine {
                // A held free is made on its streams at a later call, perhaps on another thread
                // than the stream's user, who may begin a capture of it meanwhile: the free's
                // capture checks and its events would race that capture (helper-54's test on the
                // GPU machine's 16 cores saw an event recorded into one). So a retry runs as a
                // reader of the announced captures, and while any capture is announced on the
                // device it is refused and stays held: an announced capture (PyTorch's, through
                // its routes to pools) cannot begin during it. A capture that is not announced
                // must not be begun on a held free's stream before the free is made (README).
                // The mutation `retry_ignores_announcements` skips this: the test
                // `held_frees::a_retry_holds_off_a_capture_announced_meanwhile` must then fail
                // (and `adversarial_s33_held::retries_on_several_threads_race_new_holds_of_other_blocks`
                // did, on 16 cores).
                let r = if cfg!(cuarena_mutant = "retry_ignores_announcements") {
                    self.free_declared(ptr, size, stream, &used_on, token)
                } else {
                    crate::sync::holding_off_announcements(device, || {
                        if crate::sync::captures_announced(device) {
                            Err(Error::StreamCapturing { stream: stream.as_raw() })
                        } else {
                            self.free_declared(ptr, size, stream, &used_on, token)
                        }
                    })
                };
                let mut held = lock(&self.inner.held);
                // Only the retry that marked an entry settles it, so it is still listed.
                let Some(i) = held.iter().position(|h| h.ptr == ptr && h.retrying == token) else { continue };
                let failed = match r {
                    Err(Error::StreamCapturing { .. }) => {
                        held[i].retrying = 0;
                        refused_again = true;
                        None
                    }
                    r => {
                        held.swap_remove(i);
                        self.inner.held_count.store(held.len(), Ordering::Relaxed);
                        r.err()
                    }
                };
                drop(held);
                self.inner.held_settled.notify_all();
                if let Some(e) = failed {
                    self.defer_error(e);
                }
            }
            // The mutation `retry_ignores_capture_end` never goes round again: the loom test
            // `held::a_retry_racing_the_captures_end_leaves_nothing_held` must then fail.
            if !refused_again
                || cfg!(cuarena_mutant = "retry_ignores_capture_end")
                || self.inner.capture_ends.load(Ordering::Acquire) == ends
            {
                return;
            }
        }
    }
}

/// Unmarks, at its drop, the held frees a retry (`token`) left marked: none, unless a free of
/// the retry unwound. Waiting frees are woken.
struct Unmark<'a> {
    alloc: &'a Allocator,
    token: u64,
}

impl Drop for Unmark<'_> {
    fn drop(&mut self) {
        let mut held = lock(&self.alloc.inner.held);
        let mut any = false;
        for h in held.iter_mut().filter(|h| h.retrying == self.token) {
            h.retrying = 0;
            any = true;
        }
        drop(held);
        if any {
            self.alloc.inner.held_settled.notify_all();
        }
    }
}

// For the C ABI (capi/src/lib.rs): is an address inside memory this allocator has reserved?
impl Allocator {
    /// True if `ptr` lies inside a chunk this allocator has reserved from the device, or, in
    /// pass-through mode, starts a live block (which the driver gave it, outside any chunk).
    #[doc(hidden)]
    pub fn contains_reserved(&self, ptr: u64) -> bool {
        self.inner.pool.contains(ptr) || self.inner.passthrough.as_ref().is_some_and(|p| p.is_live(ptr))
    }
}

// ---- CUDA graph pools (graph_pool.rs) ----

impl Allocator {
    /// Retains the CUDA graph pool `id`, making it if new: allocations may then be routed to
    /// it with [`Allocator::graph_allocate`]. A pool is retained once per capture into it (and
    /// per other user, such as a PyTorch `MemPool`) and released as often
    /// ([`Allocator::graph_pool_release`]). See `graph_pool.rs` for how its memory is kept and
    /// reused.
    pub fn graph_pool_retain(&self, id: GraphPoolId) {
        if self.forked() {
            return;
        }
        self.inner.graphs.retain(id);
    }

    /// Releases the CUDA graph pool `id` once. At the last release, once no block of the pool
    /// is live, its memory waits for a device synchronise that happens anyway (out of memory,
    /// `trim(true)`, the allocator's drop), then returns to the global pool: its graphs'
    /// replays may still run. Never blocks. [`Error::UnknownGraphPool`] for a pool not
    /// retained.
    pub fn graph_pool_release(&self, id: GraphPoolId) -> Result<()> {
        self.usable()?;
        if self.inner.graphs.release(id) { Ok(()) } else { Err(Error::UnknownGraphPool { id: (id.0, id.1) }) }
    }

    /// Allocates `size` bytes for `stream` in the retained CUDA graph pool `id` (512-byte
    /// aligned; `size == 0` gives [`DeviceAddr::NULL`]), for allocations made while `stream` is
    /// being captured (PyTorch's private pools; `graph_pool.rs` has the rules). It asks
    /// `cuStreamIsCapturing` of `stream`; during a capture it records and waits on no event
    /// (memory another stream freed serves only once its fence is complete), outside one it
    /// also asks the stream's identity and may make it wait on a fence. The block is freed with
    /// [`Allocator::deallocate`] like any other, and goes back to its pool. Out of memory: on a
    /// stream not being captured, what the ordinary out-of-memory path takes back is taken (it
    /// may synchronise, which gives back retired pools' memory) and the request tried once more;
    /// during a capture, [`Error::OutOfMemory`] at once (no reclaim, which may synchronise and
    /// so break the capture). Never the OOM hook. Counted in `ooms`.
    pub fn graph_allocate(&self, id: GraphPoolId, size: usize, stream: Stream) -> Result<DeviceAddr> {
        self.usable()?;
        if size == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let inner = &self.inner;
        let r = if size > inner.pool.limit().max(inner.pool.total()) {
            Err(inner.oom(size))
        } else {
            with_slot(inner, |slot, inner| {
                let env = inner.env(&slot.counters);
                let capturing = env.dev.stream_capturing(stream)?;
                let key = if capturing { None } else { Some(env.dev.stream_key(stream)?) };
                let want = key.map_or(Want::Capturing(stream), |k| Want::Stream(k.0));
                // Another stream's free: during a capture only once its fence is complete (a
                // query, in the relaxed capture mode); otherwise behind a wait on it.
                let mut ready = |f: &FenceSet| -> Result<bool> {
                    match key {
                        None => Ok(f.is_clear() || f.poll_all(&env.dev)?),
                        Some(k) => f
                            .order_before(&env.dev, stream, k, || {
                                Err(Error::Unsupported(
                                    "a graph pool's fence is never a lazy legacy one".into(),
                                ))
                            })
                            .map(|()| true),
                    }
                };
                // In pass-through mode the driver's blocks count against the cap too, read under
                // that mode's lock while the pool grows (`Passthrough::with_held`).
                let grow = |b| {
                    let take = |outside| {
                        inner.pool.take_segment(&env.dev, b, crate::graph_pool::BLOCK_ALIGN, outside)
                    };
                    match &inner.passthrough {
                        Some(p) => p.with_held(take),
                        None => take(0),
                    }
                };
                let (addr, bytes) = match inner.graphs.alloc(id, size, want, &mut ready, grow) {
                    // Not during a capture: what the ordinary out-of-memory path takes back (it
                    // may synchronise: retired pools' parked segments too), and once more.
                    Err(Error::OutOfMemory { .. }) if key.is_some() => {
                        Slot::reclaim(
                            &mut slot.arenas,
                            &mut slot.outbox,
                            &mut slot.ptds,
                            inner,
                            &env,
                            true,
                            true,
                        );
                        // Wholly free chunks go to the device, so that a segment of another
                        // size can be had (a segment's growth does not trim).
                        inner.pool.trim(&env.dev, false)?;
                        slot.counters.bump(&slot.counters.alloc_retries, 1);
                        inner.graphs.alloc(id, size, want, &mut ready, grow)?
                    }
                    r => r?,
                };
                slot.counted_alloc(bytes as usize, AllocPath::Pool);
                Ok(DeviceAddr(addr))
            })
            .map_err(|e| match e {
                // The size asked for, not the segment's.
                Error::OutOfMemory { .. } => inner.oom(size),
                e => e,
            })
        };
        if let Err(Error::OutOfMemory { .. }) = r {
            self.count(|c| &c.ooms);
        }
        r
    }

    /// The live blocks of the retained CUDA graph pool `id`, by address
    /// (PyTorch's `checkPoolLiveAllocations` compares them with the tensors it expects).
    /// [`Error::UnknownGraphPool`] for a pool not retained.
    pub fn graph_pool_live(&self, id: GraphPoolId) -> Result<Vec<DeviceAddr>> {
        self.usable()?;
        let v = self.inner.graphs.live(id).ok_or(Error::UnknownGraphPool { id: (id.0, id.1) })?;
        Ok(v.into_iter().map(DeviceAddr).collect())
    }

    /// A checkpoint of the retained CUDA graph pool `id`: its live blocks now (PyTorch's
    /// `getCheckpointState`, which CUDA graph trees take after each recording), for
    /// [`Allocator::graph_pool_restore`]. [`Error::UnknownGraphPool`] for a pool not retained.
    pub fn graph_pool_checkpoint(&self, id: GraphPoolId) -> Result<GraphCheckpoint> {
        self.usable()?;
        let (serial, blocks) =
            self.inner.graphs.checkpoint(id).ok_or(Error::UnknownGraphPool { id: (id.0, id.1) })?;
        Ok(GraphCheckpoint { id, serial, blocks })
    }

    /// Restores the checkpoint's pool to it (PyTorch's `setCheckpointPoolState`, which CUDA
    /// graph trees use to record a new graph after replaying others): every block live in the
    /// pool now is freed, and exactly the checkpoint's blocks are live again, at their
    /// addresses (freed later with [`Allocator::deallocate`], as any block). Returns the blocks
    /// freed (address, bytes), by address; a block may be both freed and made live again.
    ///
    /// **Contract:** every earlier use of the blocks it frees is ordered before the pool's next
    /// use (PyTorch's own restore assumes it: the graphs of a pool are replayed in order).
    /// Another stream's work on memory it freed outside a capture is waited for on the host
    /// first, where a restored block covers that memory or a live block was taken from it
    /// (a query, and a wait only when no capture is underway: otherwise
    /// [`Error::Unsupported`]). Refused, changing nothing: a pool not retained
    /// ([`Error::UnknownGraphPool`]), a pool released and made again since the checkpoint, a
    /// restored block over memory held for another stream ([`Error::Unsupported`]).
    pub fn graph_pool_restore(&self, checkpoint: &GraphCheckpoint) -> Result<Vec<(DeviceAddr, usize)>> {
        self.usable()?;
        match self.graph_pool_restore_within(checkpoint, usize::MAX)? {
            Ok(freed) => Ok(freed),
            Err(_) => unreachable!("room for every live block"),
        }
    }

    /// [`Allocator::graph_pool_restore`] with room to report at most `room` freed blocks:
    /// `Ok(Err(n))`, changing nothing, if `n > room` blocks are live (the C ABI's fixed
    /// buffer).
    #[doc(hidden)]
    pub fn graph_pool_restore_within(
        &self,
        c: &GraphCheckpoint,
        room: usize,
    ) -> Result<std::result::Result<Vec<(DeviceAddr, usize)>, usize>> {
        self.usable()?;
        let graphs = &self.inner.graphs;
        let r = with_slot(&self.inner, |slot, inner| {
            let env = inner.env(&slot.counters);
            let mut wait = |f: &FenceSet| -> Result<()> {
                if f.poll_all(&env.dev)? {
                    return Ok(());
                }
                if graphs.captures_underway() {
                    return Err(Error::Unsupported(
                        "graph pool restore: memory it makes live again waits for another stream's work, and a \
                         capture is underway (a host wait could break it); restore after the capture"
                            .into(),
                    ));
                }
                f.wait_host(&env.dev)
            };
            let r = graphs.restore(c.id, c.serial, &c.blocks, room, &mut wait);
            // Each block freed and made live again is counted as a free and an allocation.
            if let Ok(freed) = &r {
                freed.iter().for_each(|&(_, l)| slot.counted_free(l as usize));
                c.blocks.iter().for_each(|&(_, l)| slot.counted_alloc(l as usize, AllocPath::Pool));
            }
            r
        });
        match r {
            Ok(freed) => Ok(Ok(freed.into_iter().map(|(a, l)| (DeviceAddr(a), l as usize)).collect())),
            Err(RestoreRefused::Room(n)) => Ok(Err(n)),
            Err(RestoreRefused::Error(e)) => Err(e),
        }
    }

    /// A CUDA graph capture begins (the PyTorch shim: a route to a pool opens, for a capture or
    /// a `use_mem_pool`). While any capture begun is not ended, cuarena makes no device
    /// synchronise, which could break it: memory that waits for one (retired pools, arenas of
    /// destroyed streams) stays parked, and out of memory and `trim(true)` take back only what
    /// needs none, as PyTorch's own allocator does while captures are underway.
    pub fn graph_capture_begin(&self) {
        if self.forked() {
            return;
        }
        self.inner.graphs.capture_begin();
    }

    /// Ends a capture begun with [`Allocator::graph_capture_begin`], and makes again the frees
    /// held for a capture ([`Allocator::deallocate_or_hold`]). [`Error::Unsupported`], changing
    /// nothing, if none is underway.
    pub fn graph_capture_end(&self) -> Result<()> {
        self.usable()?;
        if self.inner.graphs.capture_end() {
            // Frees held for a capture (`deallocate_or_hold`) are made again: PyTorch ends the
            // stream's capture before this call; one refused again is held again. The end is
            // counted first (see `retry_held`). The mutation `capture_end_keeps_held` skips the
            // retry (the end is still counted): `held_frees` must then fail.
            self.inner.capture_ends.fetch_add(1, Ordering::AcqRel);
            // The mutation `capture_end_skips_on_count` lets it skip on a `Relaxed` 0:
            // `loom-tests/tests/held.rs` must then fail.
            if !cfg!(cuarena_mutant = "capture_end_keeps_held") {
                self.retry_held(!cfg!(cuarena_mutant = "capture_end_skips_on_count"));
            }
            Ok(())
        } else {
            Err(Error::Unsupported(
                "graph_capture_end: no capture begun with graph_capture_begin is underway".into(),
            ))
        }
    }

    /// How many times the CUDA graph pool `id` is retained now: 0 for a pool not retained
    /// (PyTorch's `MemPool.use_count()`).
    pub fn graph_pool_use_count(&self, id: GraphPoolId) -> u64 {
        if self.forked() {
            return 0;
        }
        self.inner.graphs.use_count(id)
    }

    /// Bytes of device memory in CUDA graph pools: their segments, retained or waiting for a
    /// synchronise. Part of `reserved_bytes` and `pool_in_use_bytes` (not in pass-through mode,
    /// whose statistics are its own blocks').
    pub fn graph_pool_bytes(&self) -> u64 {
        if self.forked() {
            return 0;
        }
        self.inner.graphs.bytes()
    }

    /// A free of a graph pool's block, also used on the streams `used_on` (declared by
    /// `record_stream`), kept as `graph_pool.rs` says and counted; `None` if `ptr` is not in a
    /// graph pool. Checked before any driver call: a bad free costs none.
    #[cold]
    fn free_graph(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Option<Result<()>> {
        let checked = self.inner.graphs.check_free(ptr.0, size)?;
        Some(with_slot(&self.inner, |slot, inner| {
            let r = checked.and_then(|()| {
                let how = graph_free_as(&inner.env(&slot.counters), stream, used_on)?;
                // `None`: the pool retired since the check (another free of this block raced it).
                let unknown = Error::InvalidFree { ptr: ptr.0, size, reason: InvalidFree::UnknownPointer };
                inner.graphs.free(ptr.0, size, how).unwrap_or(Err(unknown))
            });
            match r {
                Ok(f) => {
                    slot.counted_free(f.bytes as usize);
                    Ok(())
                }
                Err(e) => {
                    if let Error::InvalidFree { .. } = e {
                        slot.counters.bump(&slot.counters.invalid_frees, 1);
                    }
                    Err(e)
                }
            }
        }))
    }
}

/// How a graph pool's block freed on `stream`, declared used on `used_on`, is kept
/// (`graph_pool.rs`, "The rules"): during a capture of `stream` or of a declared stream, by
/// handle or held; otherwise with `stream`'s identity and a fence recorded on it now, after the
/// declared streams' work is ordered before it (as [`Allocator::deallocate_used_on`] does).
fn graph_free_as(env: &Env<'_>, stream: Stream, used_on: &[Stream]) -> Result<FreeAs> {
    let others: Vec<Stream> = used_on.iter().copied().filter(|&s| s != stream).collect();
    if env.dev.stream_capturing(stream)? {
        return Ok(if others.is_empty() { FreeAs::Captured(stream) } else { FreeAs::Held });
    }
    for &s in &others {
        if env.dev.stream_capturing(s)? {
            return Ok(FreeAs::Held);
        }
    }
    let key = env.dev.stream_key(stream)?;
    order_declared(env, stream, key, &others)?;
    Ok(FreeAs::Stream(key.0, FenceSet::one(env.fence(stream, key)?)))
}

/// For a free on `stream` of a block also used on `used_on`, validated and not yet taken:
/// refuses it if any of the streams is being captured (no event on a stream being captured),
/// then orders the declared streams' work before later work on `stream` ([`order_declared`]),
/// its calls counted on `counters`. Nothing to do for an empty `used_on` (a plain free).
/// `stream`'s identity if it was asked (with `stream` checked not to be being captured), for
/// the free not to ask again.
///
/// The calls are not taken as the caller's own use of `stream` (`Counted::on_stream`): the
/// free's stream may be one cuarena chose, the legacy stream for another thread's per-thread
/// stream (`StreamUse`), a held free retried by another call (`Allocator::deallocate_or_hold`). So a
/// wait on the legacy stream is refused (`Error::StreamCapturing`) while a capture is announced
/// or a blocking stream is being captured, as a declared legacy stream is, in every branch of
/// `Slot::free` alike: an event or wait there would break such a capture.
fn order_for_free(
    inner: &Inner,
    counters: &Counters,
    stream: Stream,
    used_on: &[Stream],
) -> Result<Option<StreamKey>> {
    // The mutation `declared_free_unordered` orders nothing: the tests of declared frees
    // (`adversarial_s31b_used_on`, `adversarial_s32_declared`, `held_frees`) must then
    // see a block reused before the declared streams' work.
    if used_on.is_empty() || cfg!(cuarena_mutant = "declared_free_unordered") {
        return Ok(None);
    }
    let env = &inner.env(counters);
    env.dev.refuse_capturing(stream)?;
    for &s in used_on {
        env.dev.refuse_capturing(s)?;
    }
    let key = env.dev.stream_key(stream)?;
    order_declared(env, stream, key, used_on)?;
    Ok(Some(key))
}

/// Orders the work on each of `used_on` (streams a block was declared used on) before later work
/// on `stream` (identity `key`): an event on each other stream, which `stream` waits for. None of
/// them may be being captured (the callers ask first).
///
/// A fence just recorded is waited on, never polled first (`Fence::wait_for`): it has almost
/// never completed yet, and a stream wait costs less than an event query, which, unlike the
/// wait, does not scale across threads (measured on the H200: 32 ns against 237 ns on one
/// thread, 36 ns against 9.5 µs on 16).
fn order_declared(env: &Env<'_>, stream: Stream, key: StreamKey, used_on: &[Stream]) -> Result<()> {
    for &s in used_on {
        let ks = env.dev.stream_key(s)?;
        if ks != key
            && let Some(f) = env.fence(s, ks)?
        {
            f.wait_for(&env.dev, stream, key)?;
        }
    }
    Ok(())
}

// ---- The OOM hook (issue 11, item 4) ----

/// An OOM hook: called with the bytes requested and the device ordinal; returns true to have
/// the allocation tried again (see [`Allocator::set_oom_hook`]).
pub type OomHook = Arc<dyn Fn(usize, i32) -> bool + Send + Sync>;

/// The most times one allocation is retried at its OOM hook's request.
pub const MAX_OOM_RETRIES: u32 = 3;

thread_local! {
    // Allocators whose OOM hook runs on this thread now: an out-of-memory inside a hook does
    // not call that allocator's hook again (no recursion).
    #[allow(clippy::missing_const_for_thread_local)]
    static IN_OOM_HOOK: RefCell<Vec<u64>> = RefCell::new(Vec::new());
}

impl Allocator {
    /// Sets (or, with `None`, removes) the hook called when an allocation is out of memory
    /// after cuarena's own reclaim: `hook(requested_bytes, device_ordinal)`. If it returns true
    /// (it freed memory, spilled, or raised the cap), the allocation is tried again, at most
    /// [`MAX_OOM_RETRIES`] times; if false, or once the retries are spent, the allocation fails
    /// with [`Error::OutOfMemory`].
    ///
    /// The hook runs on the allocating thread with no cuarena lock held and no arena claimed:
    /// it may free blocks, allocate (an out-of-memory there returns [`Error::OutOfMemory`] at
    /// once, without calling the hook again), call `stats`, `trim`, or set the hook. A panic
    /// in the hook propagates to the caller of `allocate`, leaving the allocator intact (the C
    /// ABI catches it: the allocation fails with "internal error (caught panic)").
    /// [`Stats::oom_hook_calls`], [`Stats::alloc_retries`] and [`Stats::ooms`] count what
    /// happens.
    pub fn set_oom_hook(&self, hook: Option<OomHook>) {
        if self.forked() {
            return;
        }
        *lock(&self.inner.oom_hook) = hook;
    }

    /// Counts `f`'s counter on this thread's block.
    fn count(&self, f: impl FnOnce(&Counters) -> &crate::stats::Counter) {
        with_slot(&self.inner, |slot, _| slot.counters.bump(f(&slot.counters), 1));
    }

    /// The out-of-memory path of [`Allocator::allocate`]: the hook and bounded retries.
    #[cold]
    #[inline(never)]
    fn after_oom(&self, size: usize, stream: Stream, mut err: Error) -> Result<DeviceAddr> {
        let id = self.inner.id;
        let nested = IN_OOM_HOOK.try_with(|v| v.borrow().contains(&id)).unwrap_or(true);
        let mut retries = 0;
        while !nested && retries < MAX_OOM_RETRIES {
            // Cloned out of the lock: the hook runs with no cuarena lock held.
            let Some(hook) = lock(&self.inner.oom_hook).clone() else { break };
            self.count(|c| &c.oom_hook_calls);
            let _ = IN_OOM_HOOK.try_with(|v| v.borrow_mut().push(id));
            struct Leave(u64);
            impl Drop for Leave {
                fn drop(&mut self) {
                    let _ = IN_OOM_HOOK.try_with(|v| {
                        let mut v = v.borrow_mut();
                        if let Some(i) = v.iter().rposition(|&x| x == self.0) {
                            v.remove(i);
                        }
                    });
                }
            }
            let leave = Leave(id);
            let retry = hook(size, self.inner.device.ordinal());
            drop(leave);
            if !retry {
                break;
            }
            // A hook that forked: its child retries on an allocator made before the fork.
            self.usable()?;
            retries += 1;
            self.count(|c| &c.alloc_retries);
            match self.allocate_once(size, stream) {
                Err(e @ Error::OutOfMemory { .. }) => err = e,
                r => return r,
            }
        }
        self.count(|c| &c.ooms);
        Err(err)
    }
}

// --- Allocation traces (issue 11; the recorder is trace.rs) ---
impl Allocator {
    /// Starts recording every allocate and free into the file at `path` (created or
    /// truncated); `trace.rs` documents the format. Refused if a trace runs on this allocator
    /// already, or if another trace of this process writes `path`.
    pub fn start_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.usable()?;
        self.inner.trace.start_file(path.as_ref())
    }

    /// Ends the running trace: every thread's records are written (also those of threads that
    /// are alive and recording this moment: it waits for their call to end) and the file
    /// closed. Refused if no trace runs; a write error of the whole trace is returned here.
    pub fn stop_trace(&self) -> Result<crate::trace::TraceSummary> {
        self.usable()?;
        self.inner.trace.stop()
    }

    /// Where the block at `ptr` lives, as the allocator sees it now.
    fn trace_path(&self, ptr: u64, size: usize) -> crate::trace::TracePath {
        use crate::trace::TracePath;
        let inner = &self.inner;
        if inner.passthrough.is_some() {
            TracePath::Passthrough
        } else if inner
            .pool
            .registry
            .lookup(ptr)
            .is_some_and(|sb| !sb.owner.load(Ordering::Acquire).is_null())
        {
            if size > inner.cfg.small_max { TracePath::LargeArena } else { TracePath::Arena }
        } else {
            TracePath::Pool
        }
    }

    /// A stream's identity for the trace, 0 where it cannot be told: asked through `Counted`, as
    /// the allocator asks every identity, so the lookups are counted in `driver_calls`; the
    /// legacy stream's comes from the pool's cache, or is not asked while a capture is announced
    /// (`Counted::stream_key`: `cuStreamGetId` of it could break a capture of a blocking stream,
    /// begun at any moment), and the per-thread stream's from the thread's slot where it knows
    /// it. Charged to the calling thread's counters; where its slots are busy (a call of another
    /// allocator further up this thread's stack) or gone (late destructors), to counters
    /// registered for this lookup alone: no slot is made for it.
    fn trace_key(&self, stream: Stream) -> u64 {
        let inner = &*self.inner;
        let ask = |counters: &Counters, ptds: Option<StreamKey>| {
            let dev = Counted::new(&*inner.device, counters);
            let key = match ptds {
                Some(k) if stream.is_per_thread() => Ok(k),
                _ if stream.is_legacy() => inner.pool.legacy_key(&dev),
                _ => dev.stream_key(stream),
            };
            key.map_or(0, |k| k.0)
        };
        let in_slot = SLOTS.try_with(|cell| {
            let slots = cell.try_borrow().ok()?;
            let slot = slots.iter().find(|s| s.id == inner.id)?;
            Some(ask(&slot.counters, slot.ptds))
        });
        in_slot.ok().flatten().unwrap_or_else(|| {
            let counters = inner.counters.register();
            let key = ask(&counters, None);
            inner.counters.retire(&counters);
            key
        })
    }

    /// Records the allocation that returned `r` (a trace records).
    #[cold]
    #[inline(never)]
    fn trace_allocation(&self, size: usize, stream: Stream, r: Result<DeviceAddr>) -> Result<DeviceAddr> {
        use crate::trace::{Action, Event, TracePath};
        if size == 0 {
            return r; // no request: nothing to record
        }
        crate::trace::record(&self.inner.trace, &|s| self.trace_key(s), stream, false, || {
            let ev = match &r {
                Ok(p) => Event { action: Action::Alloc, ptr: p.0, size, path: self.trace_path(p.0, size) },
                Err(_) => Event { action: Action::FailedAlloc, ptr: 0, size, path: TracePath::None },
            };
            (r, ev)
        })
    }

    #[cold]
    #[inline(never)]
    fn deallocate_traced(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        use crate::trace::{Action, Event, TracePath};
        if ptr.is_null() && size == 0 {
            return Ok(()); // no request: nothing to record
        }
        crate::trace::record(&self.inner.trace, &|s| self.trace_key(s), stream, true, || {
            let path = self.trace_path(ptr.0, size); // before the free changes it
            let r = self.deallocate_untraced(ptr, size, stream, used_on);
            let ev = match &r {
                Ok(()) => Event { action: Action::Free, ptr: ptr.0, size, path },
                Err(_) => Event { action: Action::RefusedFree, ptr: ptr.0, size, path: TracePath::None },
            };
            (r, ev)
        })
    }
}
