//! The public allocator: routing of each request, and each thread's slot.
//!
//! ## Routing (the one place it is decided)
//! - `size == 0`: a null pointer, like `cudaMallocAsync`; freeing null with size 0 is a no-op.
//! - `size <= small_max` on the per-thread stream (`0x2`): the calling thread's per-thread
//!   arena; on the legacy stream (NULL or `0x1`): the calling thread's legacy arena (see
//!   [`arena_index`]). Neither asks the driver anything on the fast path: the per-thread
//!   stream's and the legacy stream's identities are asked once per thread.
//! - anything else (large, or small on a user stream): the global pool.
//! - A free of a small block goes to its superblock's owner: the owner's fast path if the
//!   caller is the owner and frees on that arena's stream; otherwise, with the block's freed
//!   flag taken, the caller's outbox, and from there, fenced, to the owner's inbox. A block
//!   whose superblock has no owner, and every large block, goes to the pool: on the
//!   per-thread and legacy streams accepted at once and fenced with the outbox's next batch,
//!   on a user stream with a fence recorded at once.
//! - On out-of-memory, memory held without live blocks in this thread's and idle threads'
//!   arenas is taken back and the request tried once more (`Slot::reclaim`).

use std::cell::RefCell;

use crate::arena::{Arena, ArenaShell, Freed};
use crate::buffer::DeviceBuffer;
use crate::config::Config;
use crate::device::counted::Counted;
use crate::device::cuda::CudaDevice;
use crate::device::{Device, DeviceKind};
use crate::env::Env;
use crate::error::{Error, InvalidFree, Result};
use crate::fence::Fence;
use crate::global_pool::{GlobalPool, Origin};
use crate::outbox::Outbox;
use crate::size_class::{GRANULE, block_bytes, class_ceil, class_granules, granules_for};
use crate::stats::{CounterRegistry, Counters, Stats};
use crate::stream::{Stream, StreamKey};
use crate::superblock::Superblock;
use std::sync::{Arc, Weak};

use crate::sync::{AtomicUsize, Mutex, Ordering, lock, next_id, thread_local};

/// A device address. Null is `DevicePtr(0)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// True for null.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// A device-memory allocator for one device. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Allocator {
    inner: Arc<Inner>,
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
    device: Arc<dyn Device>,
    cfg: Config,
    pool: GlobalPool,
    counters: CounterRegistry,
    shells: Mutex<Shells>,
    deferred: Mutex<Option<Error>>,
    arenas: AtomicUsize,
    /// Pass-through mode (passthrough.rs): when set, every request goes straight to it.
    passthrough: Option<crate::passthrough::Passthrough>,
}

/// Arena shells: every one ever made (kept so `owner` pointers never dangle) and the idle ones.
#[derive(Default)]
struct Shells {
    all: Vec<Arc<ArenaShell>>,
    idle: Vec<Arc<ArenaShell>>,
}

/// One thread's state for one allocator.
struct Slot {
    id: u64,
    inner: Weak<Inner>,
    /// The thread's arenas, by [`arena_index`]: for its per-thread stream, and for the legacy
    /// stream.
    arenas: [Option<OwnedArena>; 2],
    outbox: Outbox,
    counters: Arc<Counters>,
    ptds: Option<StreamKey>,
    /// The legacy stream's identity, asked of the device once.
    legacy: Option<StreamKey>,
    /// Slow paths taken; every [`PEAK_SAMPLE_EVERY`]th samples the live-byte peak.
    slow_paths: u32,
}

/// The streams a thread's arenas serve, by index: see [`arena_index`].
const HOMES: [Stream; 2] = [Stream::PER_THREAD, Stream::LEGACY];

/// Which of a thread's arenas serves small requests on `stream`: 0 for its per-thread stream,
/// 1 for the legacy stream (NULL or `0x1`, one stream for all threads, whose identity is fixed).
/// User streams have none: their handles are reused by CUDA, so they are served by the pool.
///
/// Only the per-thread arena frees on its fast path. A free on the legacy stream, even of the
/// thread's own legacy-arena block, goes the batched way with one event per batch: that event
/// is a legacy-stream operation, and without one, a block freed on the legacy stream after use
/// on one per-thread stream and handed out again could be used on another per-thread stream
/// with nothing ordering the two (per-thread streams wait for earlier legacy *operations*).
/// The legacy arena's own stream needs no wait on that event: its pending batch is reusable at
/// once (`Arena::complete_ready`).
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
struct OwnedArena {
    ptr: std::ptr::NonNull<Arena>,
    shell: Arc<ArenaShell>,
}

impl OwnedArena {
    fn new(arena: Arena) -> OwnedArena {
        let shell = Arc::clone(&arena.shell);
        let ptr = std::ptr::NonNull::from(Box::leak(Box::new(arena)));
        // Release: a reclaimer that loads the pointer (Acquire, under the claim) sees the arena
        // whole.
        shell.arena.store(ptr.as_ptr(), Ordering::Release);
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

    /// Thread exit: waits out any reclaimer, unpublishes the arena and gives it back.
    fn exit(self, env: &Env<'_>, fence: Option<Option<Arc<Fence>>>) -> Option<Arc<ArenaShell>> {
        self.shell.claim.enter_waiting();
        self.shell.arena.store(std::ptr::null_mut(), Ordering::Relaxed);
        // SAFETY: the pointer came from `Box::leak` in `new` and is reclaimed once, here; it is
        // unpublished and we hold the claim, so no reclaimer can reach it any more.
        let arena = unsafe { Box::from_raw(self.ptr.as_ptr()) };
        let r = arena.exit(env, fence);
        self.shell.claim.leave();
        r
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
}

impl Inner {
    fn env<'a>(&'a self, counters: &'a Counters) -> Env<'a> {
        Env {
            pool: &self.pool,
            dev: Counted::new(&*self.device, counters),
            skip_fences: self.cfg.skip_fences,
            small_max: self.cfg.small_max,
            deferred: &self.deferred,
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

    /// Takes memory back from other threads' arenas whose owners are idle, without their
    /// help (see `claim.rs`): each gives back its superblocks that hold no used block (with
    /// `dissolve`, all with free or pending space). Arenas whose owner is inside an allocator
    /// call are skipped: they drain on their own. `own` are the caller's shells, skipped. Free
    /// ranges go back behind a fence on the legacy stream, which follows the owners' earlier
    /// per-thread-stream work. Returns the bytes given back. Never blocks on the device.
    #[cold]
    fn reclaim_others(&self, env: &Env<'_>, own: &[*const ArenaShell], dissolve: bool) -> usize {
        let shells: Vec<Arc<ArenaShell>> = lock(&self.shells).all.clone();
        let mut bytes = 0;
        for sh in shells {
            if own.contains(&Arc::as_ptr(&sh)) || sh.arena.load(Ordering::Relaxed).is_null() {
                continue;
            }
            let Some(_held) = sh.claim.try_claim() else { continue };
            let p = sh.arena.load(Ordering::Acquire);
            if p.is_null() {
                continue; // its owner exited meanwhile
            }
            // SAFETY: we hold the shell's claim, so the owner does not touch its arena, and the
            // arena outlives the claim (its owner unpublishes it, inside its claim, before
            // freeing it).
            let arena = unsafe { &mut *p };
            bytes += arena.reclaim(env, dissolve, || {
                let k = env.dev.stream_key(Stream::LEGACY)?;
                env.fence(Stream::LEGACY, k)
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

impl Slot {
    fn new(inner: &Arc<Inner>) -> Slot {
        Slot {
            id: inner.id,
            inner: Arc::downgrade(inner),
            arenas: [None, None],
            outbox: Outbox::default(),
            counters: inner.counters.register(),
            ptds: None,
            legacy: None,
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

    /// The identity of `stream` as seen from this thread.
    fn key_of(ptds: &mut Option<StreamKey>, env: &Env<'_>, stream: Stream) -> Result<StreamKey> {
        if stream.is_per_thread() { Self::ptds_key(ptds, env) } else { env.dev.stream_key(stream) }
    }

    /// Sends the gathered remote frees, if any.
    /// Returns the fence the flush recorded, with its stream, if it sent anything.
    fn flush_outbox(outbox: &mut Outbox, ptds: &mut Option<StreamKey>, env: &Env<'_>) -> Result<Flushed> {
        if outbox.is_empty() {
            return Ok(None);
        }
        let k = Self::ptds_key(ptds, env)?;
        outbox.flush(env, k)
    }

    /// Counts a slow path and now and then samples the peak of live bytes.
    fn sample_peak(&mut self, inner: &Inner) {
        self.slow_paths = self.slow_paths.wrapping_add(1);
        if self.slow_paths % PEAK_SAMPLE_EVERY == 1 {
            inner.counters.sample();
        }
    }

    #[inline]
    fn counted_alloc(&self, bytes: usize) {
        let c = &*self.counters;
        c.bump(&c.allocations, 1);
        c.bump(&c.live_bytes, bytes as u64);
    }

    #[inline]
    fn counted_free(&self, bytes: usize) {
        let c = &*self.counters;
        c.bump(&c.deallocations, 1);
        c.bump(&c.live_bytes, (bytes as u64).wrapping_neg());
    }

    /// The arena path's slow path: drains and grows the arena `i` (see [`arena_index`]). If a
    /// reclaimer holds the arena at this moment, the request is served by the pool instead (no
    /// waiting).
    #[cold]
    #[inline(never)]
    fn alloc_small_slow(&mut self, inner: &Inner, i: usize, class: usize, g: usize) -> Result<u64> {
        let env = inner.env(&self.counters);
        let ptds = Self::ptds_key(&mut self.ptds, &env)?;
        let home = HOMES[i];
        let key = if i == 0 { ptds } else { Self::legacy_key(&mut self.legacy, &env)? };
        // Frees of pool blocks waiting here keep their ranges from coalescing (a superblock
        // range with one such block cannot be lent): send them before the arena may grow.
        if self.outbox.holds_pool_frees()
            && let Err(e) = self.outbox.flush(&env, ptds)
        {
            env.defer(e);
        }
        let own = self.shells();
        let owned = match &mut self.arenas[i] {
            Some(a) => a,
            None => {
                let sb = inner.cfg.superblock / GRANULE;
                inner.arenas.fetch_add(1, Ordering::Relaxed);
                let (k, f) = (inner.cfg.keep_empty, inner.cfg.sparse);
                let arena = Arena::new(inner.take_shell(), home, key, sb, k, f);
                self.arenas[i].insert(OwnedArena::new(arena))
            }
        };
        let r = owned.with(|arena| match arena.alloc_slow(&env, class, g) {
            Err(Error::OutOfMemory { .. }) => {
                // Memory freed into other threads' arenas may be idle there: take it back, and
                // try once more.
                inner.reclaim_others(&env, &own, true);
                arena.alloc_slow(&env, class, g)
            }
            r => r,
        });
        let c = &*self.counters;
        let p = match r {
            Some(r) => r?,
            None => {
                let p = inner.pool.alloc(&env.dev, g * GRANULE, home, key, env.skip_fences)?;
                c.bump(&c.pool_allocations, 1);
                p
            }
        };
        self.sample_peak(inner);
        Ok(p)
    }

    /// The shells of this thread's arenas (null where it has none).
    fn shells(&self) -> [*const ArenaShell; 2] {
        self.arenas.each_ref().map(|a| a.as_ref().map_or(std::ptr::null(), |a| Arc::as_ptr(&a.shell)))
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
        let env = inner.env(&self.counters);
        let key = Self::key_of(&mut self.ptds, &env, stream)?;
        let p = match inner.pool.alloc(&env.dev, bytes, stream, key, env.skip_fences) {
            Err(Error::OutOfMemory { .. }) => {
                Self::reclaim(&mut self.arenas, &mut self.outbox, &mut self.ptds, inner, &env, true);
                inner.pool.alloc(&env.dev, bytes, stream, key, env.skip_fences)?
            }
            r => r?,
        };
        let c = &*self.counters;
        c.bump(&c.pool_allocations, 1);
        self.counted_alloc(bytes);
        self.sample_peak(inner);
        Ok(p)
    }

    /// Takes back memory held without live blocks: this thread's gathered remote frees are
    /// sent, and its own arena and every idle arena give back their superblocks that hold no
    /// used block (with `dissolve`, every superblock with free or pending space). Returns the
    /// bytes given back. Never blocks on the device.
    #[cold]
    fn reclaim(
        arenas: &mut [Option<OwnedArena>; 2],
        outbox: &mut Outbox,
        ptds: &mut Option<StreamKey>,
        inner: &Inner,
        env: &Env<'_>,
        dissolve: bool,
    ) -> usize {
        if let Err(e) = Self::flush_outbox(outbox, ptds, env) {
            env.defer(e);
        }
        let mut bytes = 0;
        for owned in arenas.iter_mut().flatten() {
            bytes += owned
                .with(|a| {
                    let (home, key) = (a.home, a.key);
                    a.reclaim(env, dissolve, || env.fence(home, key))
                })
                .unwrap_or(0);
        }
        let own = arenas.each_ref().map(|a| a.as_ref().map_or(std::ptr::null(), |a| Arc::as_ptr(&a.shell)));
        bytes + inner.reclaim_others(env, &own, dissolve)
    }

    fn free(&mut self, inner: &Inner, ptr: u64, size: usize, stream: Stream) -> Result<()> {
        let small_max = inner.cfg.small_max;
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let bytes = if size == 0 { None } else { block_bytes(size, small_max) };
        if size > 0
            && size <= small_max
            && let Some(sb) = inner.pool.registry.lookup(ptr)
        {
            let owner = sb.owner.load(Ordering::Acquire);
            if !owner.is_null() {
                return self.free_arena_block(inner, sb, owner, ptr, size, stream);
            }
        }
        let Some(bytes) = bytes else {
            return Err(invalid(InvalidFree::UnknownPointer));
        };
        let env = inner.env(&self.counters);
        if Outbox::batchable(stream) {
            // Accepted now, fenced with the outbox's next batch: one event per batch.
            let ptds = Self::ptds_key(&mut self.ptds, &env)?;
            inner.pool.begin_free(ptr, size)?;
            if let Err(e) = self.outbox.push(&env, ptds, std::ptr::null(), Freed { ptr, size }, stream) {
                inner.pool.cancel_free(ptr); // not taken: nothing changed
                return Err(e);
            }
            if self.outbox.is_full(inner.cfg.batch_blocks, inner.cfg.batch_bytes)
                && let Err(e) = self.outbox.flush(&env, ptds)
            {
                env.defer(e); // this free was accepted; its batch is lost, never reused
            }
            self.counted_free(bytes);
            return Ok(());
        }
        // Validate before recording the fence: a bad free costs no event.
        inner.pool.check_free(ptr, size)?;
        let key = Self::key_of(&mut self.ptds, &env, stream)?;
        let fence = env.fence(stream, key)?;
        inner.pool.free(ptr, size, fence, Origin::Caller)?;
        self.counted_free(bytes);
        Ok(())
    }

    /// Frees a small block of an arena's superblock (`owner` is that arena's shell): on the
    /// owner's fast path if this thread owns it and frees on its per-thread stream, otherwise
    /// its freed flag taken (see `superblock.rs`) and sent, fenced, towards the owner.
    #[inline]
    fn free_arena_block(
        &mut self,
        inner: &Inner,
        sb: &Superblock,
        owner: *mut ArenaShell,
        ptr: u64,
        size: usize,
        stream: Stream,
    ) -> Result<()> {
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let bytes = block_bytes(size, inner.cfg.small_max).ok_or(invalid(InvalidFree::UnknownPointer))?;
        let mine = self.shells().iter().position(|&s| std::ptr::eq(s, owner));
        if let Some(i) = mine {
            // Inside our claim the superblock stays ours (only a reclaimer holding the claim
            // could give it back), so ownership read before it is checked again in it.
            let local = {
                let env = inner.env(&self.counters);
                self.arenas[i].as_mut().and_then(|a| {
                    a.with(|a| {
                        if !a.owns(sb) {
                            Local::NotOurs
                        } else if i == 0 && stream.is_per_thread() {
                            Local::Freed(a.free_local(&env, sb, ptr, size, bytes))
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
                    return Ok(());
                }
                // A reclaimer gave the superblock back meanwhile: route the free afresh.
                Some(Local::NotOurs) => return self.free(inner, ptr, size, stream),
                Some(Local::Checked(r)) => r?,
                // A reclaimer holds our arena right now: the free goes the remote way, and
                // the drain checks it.
                None => {}
            }
        }
        let env = inner.env(&self.counters);
        let g = sb.granule_of(ptr).ok_or(invalid(InvalidFree::UnknownPointer))?;
        if !sb.claim_free(g) {
            return Err(invalid(InvalidFree::DoubleFree));
        }
        let fr = Freed { ptr, size };
        if Outbox::batchable(stream) {
            let ptds = match Self::ptds_key(&mut self.ptds, &env) {
                Ok(k) => k,
                Err(e) => {
                    sb.unfree(g);
                    return Err(e);
                }
            };
            if let Err(e) = self.outbox.push(&env, ptds, owner, fr, stream) {
                sb.unfree(g); // not taken: nothing changed
                return Err(e);
            }
            if self.outbox.is_full(inner.cfg.batch_blocks, inner.cfg.batch_bytes)
                && let Err(e) = self.outbox.flush(&env, ptds)
            {
                // This free was accepted; the batch it joined is lost, never reused.
                env.defer(e);
            }
        } else if let Err(e) = crate::outbox::send_now(&env, owner, fr, stream) {
            sb.unfree(g); // nothing changed
            return Err(e);
        }
        let c = &*self.counters;
        c.bump(if mine.is_some() { &c.cross_stream_frees } else { &c.cross_thread_frees }, 1);
        self.counted_free(bytes);
        Ok(())
    }

    /// Sends remote frees and gives the arenas back (what thread exit does).
    fn release_arena(&mut self, inner: &Inner) -> Result<()> {
        let env = inner.env(&self.counters);
        let flushed = Self::flush_outbox(&mut self.outbox, &mut self.ptds, &env);
        for (i, slot) in self.arenas.iter_mut().enumerate() {
            // A fence just recorded on an arena's stream also covers its blocks (every local
            // free came before it): exit reuses it.
            let fence = match &flushed {
                Ok(Some((stream, Some(f)))) if arena_index(*stream) == Some(i) => Some(Some(f.clone())),
                _ => None,
            };
            if let Some(arena) = slot.take() {
                inner.arenas.fetch_sub(1, Ordering::Relaxed);
                if let Some(shell) = arena.exit(&env, fence) {
                    lock(&inner.shells).idle.push(shell);
                }
            }
        }
        flushed.map(|_| ())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
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

/// Runs `f` on the calling thread's slot for `inner`.
#[inline]
fn with_slot<R>(inner: &Arc<Inner>, f: impl FnOnce(&mut Slot, &Inner) -> R) -> R {
    let mut f = Some(f);
    let r = SLOTS.try_with(|cell| {
        let mut slots = cell.borrow_mut();
        let i = match slots.iter().position(|s| s.id == inner.id) {
            Some(i) => i,
            None => {
                // Forget slots of dropped allocators; their memory went with them.
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
        (f.take().expect("called once"))(&mut slots[i], inner)
    });
    match r {
        Ok(r) => r,
        // The thread's slots are being destroyed (a late destructor): use a temporary slot.
        Err(_) => {
            let mut slot = Slot::new(inner);
            (f.take().expect("not called"))(&mut slot, inner)
        }
    }
}

impl Allocator {
    /// An allocator over `device`.
    pub fn new(device: Arc<dyn Device>, config: Config) -> Result<Allocator> {
        crate::sync::prepare_barriers();
        let total = device.total_memory()?;
        Ok(Allocator {
            inner: Arc::new(Inner {
                id: next_id(),
                pool: GlobalPool::new(Arc::clone(&device), &config, total),
                passthrough: (config.passthrough)
                    .then(|| crate::passthrough::Passthrough::new(Arc::clone(&device), config.small_max)),
                device,
                cfg: config,
                counters: CounterRegistry::new(),
                shells: Mutex::new(Shells::default()),
                deferred: Mutex::new(None),
                arenas: AtomicUsize::new(0),
            }),
        })
    }

    /// An allocator for CUDA device `ordinal`. [`Error::NoDriver`] if there is no driver.
    pub fn cuda(ordinal: i32, config: Config) -> Result<Allocator> {
        let dev = CudaDevice::new(ordinal)?;
        // After cuInit, so the hook runs before the driver's own exit handlers.
        crate::shutdown::install_exit_hook();
        Allocator::new(Arc::new(dev), config)
    }

    /// Allocates `size` bytes, ready for use on `stream` (256-byte aligned).
    /// `size == 0` gives [`DevicePtr::NULL`].
    pub fn allocate(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        if let Some(p) = &self.inner.passthrough {
            return p.allocate(size, stream, self.inner.pool.limit()); // pass-through mode
        }
        if size == 0 {
            return Ok(DevicePtr::NULL);
        }
        let inner = &self.inner;
        if size <= inner.cfg.small_max
            && let Some(i) = arena_index(stream)
        {
            let g = granules_for(size).expect("small sizes do not overflow");
            let class = class_ceil(g);
            let gc = class_granules(class);
            return with_slot(inner, |slot, inner| {
                if let Some(a) = slot.arenas[i].as_mut()
                    && let Some(Some(p)) = a.with(|a| a.alloc(class, gc))
                {
                    slot.counted_alloc(gc * GRANULE);
                    return Ok(DevicePtr(p));
                }
                let p = slot.alloc_small_slow(inner, i, class, gc)?;
                slot.counted_alloc(gc * GRANULE);
                Ok(DevicePtr(p))
            });
        }
        let bytes = match block_bytes(size, inner.cfg.small_max) {
            Some(b) if b <= inner.pool.limit() => b,
            _ => return Err(inner.oom(size)),
        };
        with_slot(inner, |slot, inner| slot.alloc_pool(inner, bytes, stream).map(DevicePtr))
    }

    /// Frees a block from [`Allocator::allocate`]. `size` is the size it was allocated with.
    ///
    /// **Contract:** every earlier use of the block is ordered before later work on `stream`
    /// (like `cudaFreeAsync`). An invalid free (unknown pointer, double free, wrong size) is
    /// refused with [`Error::InvalidFree`] and changes nothing. A free of a block owned by
    /// another thread is checked by that thread later; if found invalid it is counted in
    /// [`Stats::invalid_frees`] and reported by [`Allocator::take_deferred_error`].
    pub fn deallocate(&self, ptr: DevicePtr, size: usize, stream: Stream) -> Result<()> {
        if let Some(p) = &self.inner.passthrough {
            return p.deallocate(ptr, size, stream); // pass-through mode
        }
        if ptr.is_null() && size == 0 {
            return Ok(());
        }
        with_slot(&self.inner, |slot, inner| {
            let r = if ptr.is_null() {
                Err(Error::InvalidFree { ptr: 0, size, reason: InvalidFree::UnknownPointer })
            } else {
                slot.free(inner, ptr.0, size, stream)
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
    /// host block.
    pub fn deallocate_used_on(
        &self,
        ptr: DevicePtr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        if let Some(p) = &self.inner.passthrough {
            return p.deallocate_used_on(ptr, size, stream, used_on); // pass-through mode
        }
        if !used_on.is_empty() {
            with_slot(&self.inner, |slot, inner| -> Result<()> {
                let env = inner.env(&slot.counters);
                let key = env.dev.stream_key(stream)?;
                for &s in used_on {
                    let ks = env.dev.stream_key(s)?;
                    if ks != key
                        && let Some(f) = env.fence(s, ks)?
                    {
                        f.order_before(&env.dev, stream, key)?;
                    }
                }
                Ok(())
            })?;
        }
        self.deallocate(ptr, size, stream)
    }

    /// Caps reserved memory at `bytes`. Memory already reserved above it is kept until freed
    /// blocks let `trim` release it.
    pub fn set_limit_bytes(&self, bytes: usize) {
        self.inner.pool.set_limit(bytes);
    }

    /// Caps reserved memory at `fraction` (0, 1] of the device's memory.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::Config(format!("memory fraction {fraction} must be in (0, 1]")));
        }
        self.inner.pool.set_limit((self.inner.pool.total() as f64 * fraction) as usize);
        Ok(())
    }

    /// [`Allocator::allocate`] on the calling thread's per-thread default stream.
    pub fn allocate_per_thread(&self, size: usize) -> Result<DevicePtr> {
        self.allocate(size, Stream::PER_THREAD)
    }

    /// [`Allocator::deallocate`] on the calling thread's per-thread default stream.
    pub fn deallocate_per_thread(&self, ptr: DevicePtr, size: usize) -> Result<()> {
        self.deallocate(ptr, size, Stream::PER_THREAD)
    }

    /// An owning buffer of `size` bytes on `stream`, freed on that stream when dropped.
    pub fn buffer(&self, size: usize, stream: Stream) -> Result<DeviceBuffer> {
        let ptr = self.allocate(size, stream)?;
        Ok(DeviceBuffer::from_parts(self.clone(), ptr, size, stream))
    }

    /// Sends this thread's gathered remote frees and takes back frees sent to it.
    pub fn flush(&self) -> Result<()> {
        with_slot(&self.inner, |slot, inner| {
            let env = inner.env(&slot.counters);
            Slot::flush_outbox(&mut slot.outbox, &mut slot.ptds, &env)?;
            for a in slot.arenas.iter_mut().flatten() {
                a.with(|a| a.tidy(&env));
            }
            Ok(())
        })
    }

    /// Does now what thread exit does: sends this thread's remote frees, gives its arena back
    /// to the global pool and folds its counters. The thread may go on allocating; it then
    /// gets a new arena.
    pub fn release_thread(&self) -> Result<()> {
        let id = self.inner.id;
        let slot = SLOTS.try_with(|cell| {
            let mut v = cell.borrow_mut();
            v.iter().position(|s| s.id == id).map(|i| v.swap_remove(i))
        });
        let Ok(Some(mut slot)) = slot else { return Ok(()) };
        let r = slot.release_arena(&self.inner);
        self.inner.counters.retire(&slot.counters);
        drop(slot); // its drop finds nothing left to do
        r
    }

    /// Gives memory back to the device: first every superblock that holds no used block
    /// goes back to the pool from this thread's arena and from every idle thread's arena (its
    /// owner's help not needed), then every wholly free chunk is released. With `blocking`,
    /// waits for the chunks' pending fences (a host synchronisation); otherwise releases only
    /// chunks whose fences are done. Returns the bytes released to the device.
    pub fn trim(&self, blocking: bool) -> Result<usize> {
        if self.inner.passthrough.is_some() {
            return Ok(0); // pass-through mode holds nothing to release
        }
        with_slot(&self.inner, |slot, inner| {
            let env = inner.env(&slot.counters);
            Slot::reclaim(&mut slot.arenas, &mut slot.outbox, &mut slot.ptds, inner, &env, false);
            inner.pool.trim(&env.dev, blocking)
        })
    }

    /// The latest error found after the call that caused it (an invalid remote free, a
    /// failed fence on a background path), taken.
    pub fn take_deferred_error(&self) -> Option<Error> {
        lock(&self.inner.deferred).take()
    }

    /// A snapshot of the allocator's state.
    pub fn stats(&self) -> Stats {
        if let Some(p) = &self.inner.passthrough {
            return p.stats(); // pass-through mode
        }
        let mut s = Stats::default();
        self.inner.counters.fill(&mut s);
        self.inner.pool.fill_stats(&mut s);
        s.arenas = self.inner.arenas.load(Ordering::Relaxed) as u64;
        // Counted on the pool's paths only, so the arena's fast path counts nothing extra.
        s.arena_allocations = s.allocations.wrapping_sub(s.pool_allocations);
        s
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    /// Checks the global pool's invariants; panics on a violation. For tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        self.inner.pool.check();
        self.inner.passthrough.iter().for_each(|p| p.check()); // pass-through mode
    }

    /// Ranges the pool has handed out: `(address, bytes, is_superblock)`. For tests.
    #[doc(hidden)]
    pub fn pool_used_ranges(&self) -> Vec<(u64, usize, bool)> {
        self.inner.pool.used_ranges()
    }

    /// Bytes the pool has handed out (blocks and lent superblocks). For tests.
    #[doc(hidden)]
    pub fn pool_in_use(&self) -> usize {
        self.inner.pool.in_use()
    }
}

impl Allocator {
    pub(crate) fn defer_error(&self, e: Error) {
        *lock(&self.inner.deferred) = Some(e);
    }
}

// For the C ABI (capi/src/lib.rs): is an address inside memory this allocator has reserved?
impl Allocator {
    /// True if `ptr` lies inside a chunk this allocator has reserved from the device.
    #[doc(hidden)]
    pub fn contains_reserved(&self, ptr: u64) -> bool {
        self.inner.pool.contains(ptr)
    }
}
