//! The global pool: address-ordered first fit with coalescing over memory reserved from the
//! device in chunks, shared by all threads under one mutex.
//!
//! It serves requests over `large_max` (and, by first fit too, an arena's request while a
//! reclaimer holds the arena, or that still finds no superblock after an out-of-memory reclaim
//! and retry, a user stream's request when its thread has no room for another arena, and a
//! lean user arena's requests over `small_max`: `allocator.rs`), lends superblocks to arenas (normal ones, and large ones of
//! several normal superblocks' size, aligned to the normal size) and takes them back.
//!
//! ## State and invariants (under `state`'s lock)
//! - `free`: free extents keyed by address ([`AddressTree`]); each lies inside one chunk, no two
//!   overlap, and two adjacent extents of the same chunk are always merged.
//! - `used`: every range handed out: blocks, and superblocks lent to arenas.
//! - Every byte of every chunk is in exactly one extent of `free` or one entry of `used`.
//! - `reserved` is the sum of the chunks, `in_use` the sum of `used`; growth never takes
//!   `reserved` above `limit` (lowering the limit later releases nothing by itself).
//! - A free extent carries the fences of every free that produced it (those not known
//!   complete, the latest per stream and recording thread: [`FenceSet`]); a range is handed out
//!   only after [`FenceSet::order_before`] for the receiving stream.
//! - Superblock `owner` fields are written only here, under the lock.
//!
//! ## Lock layering
//! The pool lock is the innermost lock of the allocator, except for the registry's object store
//! (taken when a superblock is lent, or a freed block's flag page made) and the event pool's
//! lock (taken when a fence is recorded or dropped). No callback runs under it. Driver calls
//! made under it are growth (`reserve`, and the non-blocking `trim` it runs when the cap or the
//! device is full) and `trim`: event records for lazy legacy fences, event queries and
//! releases; and the event queries of `alloc_clear` (a legacy-stream allocation while a
//! capture is announced). A blocking `trim` waits on the host for its chunks' fences before it
//! takes the lock to release them, and stream waits are issued after the lock is dropped.

use std::collections::BTreeMap;

use crate::address_tree::{AddressTree, aligned_capacity};
use crate::config::Config;
use crate::device::Device;
use crate::device::counted::Counted;
use crate::error::{Error, InvalidFree, Result};
use crate::fence::{EventPool, Fence, FenceSet, Legacy, LegacyAction};
use crate::registry::Registry;
use crate::shell::ArenaShell;
use crate::size_class::{GRANULE, block_bytes};
use crate::stats::{Counters, Stats};
use crate::stream::{Stream, StreamKey};
use crate::superblock::{Superblock, TagStash};

/// The error of an allocation retried avoiding lazy legacy fences, after the legacy stream was
/// refused (`Error::is_legacy_refusal`: a blocking stream is being captured, so memory behind
/// such a fence cannot go to another stream now): the retry's out of memory is reported as the
/// refusal that caused it (the memory exists, behind a fence the capture forbids), any other
/// error as it is.
fn out_of_other(refused: Error, retried: Error) -> Error {
    if matches!(retried, Error::OutOfMemory { .. }) { refused } else { retried }
}
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering, lock};
use std::sync::Arc;

/// Where a free comes from, for the freed flags of blocks left by dissolved superblocks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Origin {
    /// A caller's free that found no owner for the block: refused while one is on its way.
    Caller,
    /// A free made towards an arena, arriving after the superblock left it: the one on its way.
    Transit,
}

struct FreeExt {
    chunk: u64,
    fences: FenceSet,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum UsedKind {
    Block,
    Superblock,
    /// A segment of a CUDA graph's private pool (`graph_pool.rs`): never freed by a caller's
    /// free (which is refused here as an unknown pointer), only by [`GlobalPool::give_back_segment`].
    GraphSegment,
}

#[derive(Clone, Copy)]
struct Used {
    len: usize,
    kind: UsedKind,
    chunk: u64,
    /// A block handed out by an arena, left here when its superblock was dissolved: its
    /// superblock's freed flag tells whether an arena free of it is on its way.
    from_arena: bool,
    /// A caller's free of it has been accepted and waits in that caller's outbox for the
    /// batch's fence ([`GlobalPool::begin_free`]): further frees are refused.
    freeing: bool,
}

struct PoolState {
    free: AddressTree<FreeExt>,
    used: BTreeMap<u64, Used>,
    chunks: BTreeMap<u64, usize>,
    reserved: usize,
    peak_reserved: usize,
    in_use: usize,
}

/// The shared pool of one allocator.
pub(crate) struct GlobalPool {
    device: Arc<dyn Device>,
    superblock: usize,
    chunk: usize,
    /// The cap on `reserved`, changeable at run time (`set_limit`); read under the lock.
    limit: AtomicUsize,
    small_max: usize,
    total: usize,
    pub(crate) registry: Registry,
    pub(crate) events: Arc<EventPool>,
    /// Zeroed tag buffers of large superblocks between lendings (`superblock.rs`).
    pub(crate) tag_stash: TagStash,
    /// What a legacy arena issues before it reuses its own frees on the legacy stream.
    pub(crate) legacy_action: LegacyAction,
    /// The legacy stream's identity, asked once (0 until then), for lazy legacy fences.
    legacy_key: AtomicU64,
    state: Mutex<PoolState>,
}

impl GlobalPool {
    pub(crate) fn new(device: Arc<dyn Device>, cfg: &Config, total: usize) -> GlobalPool {
        let events = Arc::new(EventPool::new(Arc::clone(&device)));
        GlobalPool {
            superblock: cfg.superblock,
            chunk: cfg.chunk,
            limit: AtomicUsize::new(cfg.limit_bytes(total)),
            total,
            small_max: cfg.small_max,
            registry: Registry::new(cfg.superblock),
            legacy_action: LegacyAction::new(Arc::clone(&events)),
            events,
            tag_stash: TagStash::default(),
            legacy_key: AtomicU64::new(0),
            device,
            state: Mutex::new(PoolState {
                free: AddressTree::new(cfg.superblock as u64),
                used: BTreeMap::new(),
                chunks: BTreeMap::new(),
                reserved: 0,
                peak_reserved: 0,
                in_use: 0,
            }),
        }
    }

    /// The legacy stream's identity, asked of the device once per allocator (it is one stream
    /// for every thread, and its identity never changes).
    pub(crate) fn legacy_key(&self, dev: &Counted<'_>) -> Result<StreamKey> {
        let mut k = self.legacy_key.load(Ordering::Relaxed);
        if k == 0 {
            k = dev.stream_key(Stream::LEGACY)?.0;
            self.legacy_key.store(k, Ordering::Relaxed);
        }
        Ok(StreamKey(k))
    }

    /// What a lazy legacy fence needs to be recorded (see `FenceSet`).
    fn legacy(&self, dev: &Counted<'_>) -> Result<Legacy<'_>> {
        Ok(Legacy { events: &self.events, key: self.legacy_key(dev)?, action: &self.legacy_action })
    }

    /// The cap on reserved bytes.
    pub(crate) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Sets the cap on reserved bytes (at least what is reserved now is kept).
    pub(crate) fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
    }

    /// The device's total memory.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    fn oom(&self, st: &PoolState, requested: usize) -> Error {
        Error::OutOfMemory {
            requested,
            reserved: st.reserved,
            in_use: st.in_use,
            largest_free: st.free.max_len() as usize,
            limit: self.limit(),
        }
    }

    /// Reserves a new chunk of at least `min` bytes (a multiple of the superblock) and returns
    /// its base. With `may_trim`, a full cap or device first gives back what it can (`trim`,
    /// non-blocking); a graph pool's growth, which may run inside a capture, does not.
    /// `outside`: bytes reserved outside the pool that count against the cap too (pass-through
    /// mode's blocks, for a graph pool's growth there).
    fn grow(
        &self,
        st: &mut PoolState,
        dev: &Counted<'_>,
        min: usize,
        requested: usize,
        may_trim: bool,
        outside: usize,
    ) -> Result<u64> {
        // Bytes the cap still allows, in whole superblocks.
        let room = |st: &PoolState| {
            self.limit().saturating_sub(st.reserved).saturating_sub(outside) / self.superblock
                * self.superblock
        };
        if min > room(st) {
            if may_trim {
                self.trim_locked(st, dev)?;
            }
            if min > room(st) {
                return Err(self.oom(st, requested));
            }
        }
        let size = self.chunk.max(min).min(room(st));
        let mut got = dev.reserve(size)?.map(|p| (p, size));
        if got.is_none() && may_trim {
            // The device is full (other processes, or our own cache): give back what we can.
            self.trim_locked(st, dev)?;
            got = dev.reserve(min)?.map(|p| (p, min));
        }
        let (base, len) = got.ok_or_else(|| self.oom(st, requested))?;
        st.chunks.insert(base, len);
        st.free.insert(base, len as u64, FreeExt { chunk: base, fences: FenceSet::default() });
        st.reserved += len;
        st.peak_reserved = st.peak_reserved.max(st.reserved);
        Ok(base)
    }

    /// Hands out `[start, start+bytes)` of the free extent starting at `ext` as a `kind`
    /// ([`GlobalPool::carve`], then entered in `used` and counted in `in_use`). Returns the
    /// extent's fences, which the caller orders the use after (or knows settled).
    fn hand_out(st: &mut PoolState, ext: u64, start: u64, bytes: usize, kind: UsedKind) -> FenceSet {
        let (chunk, fences) = Self::carve(st, ext, start, bytes);
        st.used.insert(start, Used { len: bytes, kind, chunk, from_arena: false, freeing: false });
        st.in_use += bytes;
        fences
    }

    /// Takes `[take, take+len)` out of the free extent starting at `ext`, putting the
    /// pieces before and after back. Returns the chunk and the extent's fences.
    fn carve(st: &mut PoolState, ext: u64, take: u64, len: usize) -> (u64, FenceSet) {
        let (elen, e) = st.free.remove(ext).expect("carving a free extent");
        debug_assert!(take >= ext && take + len as u64 <= ext + elen);
        if take > ext {
            st.free.insert(ext, take - ext, FreeExt { chunk: e.chunk, fences: e.fences.clone() });
        }
        let end = take + len as u64;
        if end < ext + elen {
            st.free.insert(end, ext + elen - end, FreeExt { chunk: e.chunk, fences: e.fences.clone() });
        }
        (e.chunk, e.fences)
    }

    /// Returns `[addr, addr+len)` of `chunk` to the free tree, merging with its neighbours.
    fn insert_free(st: &mut PoolState, addr: u64, len: usize, chunk: u64, mut fences: FenceSet) {
        let (mut start, mut size) = (addr, len as u64);
        if let Some((pk, pl, pv)) = st.free.below(addr) {
            debug_assert!(pk + pl <= addr, "free extents overlap at {addr:#x}");
            if pk + pl == addr && pv.chunk == chunk {
                let (pl, pv) = st.free.remove(pk).expect("present");
                fences.merge(pv.fences);
                start = pk;
                size += pl;
            }
        }
        let end = addr + len as u64;
        if st.free.get(end).is_some_and(|(_, v)| v.chunk == chunk) {
            let (nl, nv) = st.free.remove(end).expect("present");
            fences.merge(nv.fences);
            size += nl;
        }
        st.free.insert(start, size, FreeExt { chunk, fences });
    }

    /// Allocates `bytes` (already rounded) for `stream`. A stream being captured into a CUDA
    /// graph is refused first (the block's fences would need a wait on it; see README).
    pub(crate) fn alloc(
        &self,
        dev: &Counted<'_>,
        bytes: usize,
        stream: Stream,
        key: StreamKey,
        skip_fences: bool,
    ) -> Result<u64> {
        dev.refuse_capturing(stream)?;
        match self.alloc_from(dev, bytes, stream, key, skip_fences, false) {
            Err(e) if e.is_legacy_refusal() => {
                self.alloc_from(dev, bytes, stream, key, skip_fences, true).map_err(|o| out_of_other(e, o))
            }
            r => r,
        }
    }

    /// [`GlobalPool::alloc`] from the lowest extent that fits, or, with `avoid_legacy`, from
    /// the lowest that fits and holds no lazy legacy fence ([`GlobalPool::fit_avoiding_legacy`]).
    fn alloc_from(
        &self,
        dev: &Counted<'_>,
        bytes: usize,
        stream: Stream,
        key: StreamKey,
        skip_fences: bool,
        avoid_legacy: bool,
    ) -> Result<u64> {
        let fit = |st: &PoolState| {
            if avoid_legacy {
                Self::fit_avoiding_legacy(st, bytes as u64, None)
            } else {
                st.free.first_fit(bytes as u64)
            }
        };
        let (addr, fences) = {
            let mut st = lock(&self.state);
            let addr = match fit(&st) {
                Some(a) => a,
                None => {
                    let min = bytes
                        .checked_next_multiple_of(self.superblock)
                        .ok_or_else(|| self.oom(&st, bytes))?;
                    self.grow(&mut st, dev, min, bytes, true, 0)?;
                    fit(&st).expect("a new chunk fits the request")
                }
            };
            (addr, Self::hand_out(&mut st, addr, addr, bytes, UsedKind::Block))
        };
        if !skip_fences && let Err(e) = fences.order_before(dev, stream, key, || self.legacy(dev)) {
            let mut st = lock(&self.state);
            let u = st.used.remove(&addr).expect("just allocated");
            st.in_use -= u.len;
            Self::insert_free(&mut st, addr, u.len, u.chunk, fences);
            return Err(e);
        }
        Ok(addr)
    }

    /// True if a free extent of at least `bytes` exists, whatever its fences.
    pub(crate) fn has_fit(&self, bytes: usize) -> bool {
        lock(&self.state).free.first_fit(bytes as u64).is_some()
    }

    /// [`GlobalPool::alloc`] for a request on the legacy stream while a capture is announced
    /// (`Slot::alloc_pool`): memory that needs no call on the legacy stream before its use
    /// there, which a capture of a blocking stream, begun at any moment, would not survive.
    /// That is the lowest free extent that fits and whose fences are settled for the legacy
    /// stream ([`FenceSet::settled_for_legacy`]: a lazy legacy fence only if a legacy action
    /// already covers it, recorded fences complete, seen by a query), found by a scan of the
    /// free extents (only while a capture is announced), or else a new chunk (its growth's
    /// trim, outside a legacy call, checks its own legacy uses: `Counted::checked`).
    pub(crate) fn alloc_clear(&self, dev: &Counted<'_>, bytes: usize) -> Result<u64> {
        let fit = |st: &PoolState| -> Result<Option<u64>> {
            let mut candidates = Vec::new();
            st.free.for_each(|ext, l, _| {
                if l >= bytes as u64 {
                    candidates.push(ext);
                }
            });
            for ext in candidates {
                let fences = &st.free.get(ext).expect("listed").1.fences;
                // The mutation `clear_takes_unsettled` takes any extent that fits: the race
                // checker must then fail
                // `adversarial_s30_events::trims_during_an_announced_capture_of_a_user_stream`
                // and `adversarial_s30b_legacy_pool::per_thread_captures_in_a_loop_race_legacy_pool_allocations`.
                if cfg!(cuarena_mutant = "clear_takes_unsettled")
                    || fences.settled_for_legacy(dev, &self.legacy_action)?
                {
                    return Ok(Some(ext));
                }
            }
            Ok(None)
        };
        let mut st = lock(&self.state);
        let addr = match fit(&st)? {
            Some(a) => a,
            None => {
                let min =
                    bytes.checked_next_multiple_of(self.superblock).ok_or_else(|| self.oom(&st, bytes))?;
                self.grow(&mut st, dev, min, bytes, true, 0)?;
                fit(&st)?.expect("a new chunk fits the request, with no fence")
            }
        };
        // Settled for the legacy stream: nothing to order (`FenceSet::settled_for_legacy`).
        let _settled = Self::hand_out(&mut st, addr, addr, bytes, UsedKind::Block);
        Ok(addr)
    }

    /// Hands out `bytes` (a multiple of [`GRANULE`]) as a segment of a CUDA graph's private
    /// pool (`graph_pool.rs`), starting on a multiple of `align` (a power of two): memory that
    /// needs no stream wait and no driver call before use, so that a pool may grow while its
    /// stream is being captured (a wait on an event recorded outside the capture would break
    /// it). That is the lowest-addressed free extent that holds an aligned run of `bytes` and
    /// whose fences are all known complete without a query ([`FenceSet::is_clear`]), found by
    /// a scan of the free extents (a graph pool grows seldom), or else a new chunk, reserved
    /// without the `trim` that growth otherwise runs when full (its queries and releases are
    /// not for a capture). `outside`: bytes reserved outside the pool that count against the
    /// cap. The segment stays in `used` until [`GlobalPool::give_back_segment`]; a caller's
    /// free of it is refused.
    pub(crate) fn take_segment(
        &self,
        dev: &Counted<'_>,
        bytes: usize,
        align: usize,
        outside: usize,
    ) -> Result<u64> {
        let a = align as u64;
        let mut st = lock(&self.state);
        let mut found = None;
        st.free.for_each(|ext, l, v| {
            if found.is_none() && v.fences.is_clear() && aligned_capacity(ext, l, a) >= bytes as u64 {
                found = Some(ext);
            }
        });
        let ext = match found {
            Some(ext) => ext,
            None => {
                let min =
                    bytes.checked_next_multiple_of(self.superblock).ok_or_else(|| self.oom(&st, bytes))?;
                let base = self.grow(&mut st, dev, min, bytes, false, outside)?;
                let len = st.free.get(base).expect("a new chunk").0;
                if aligned_capacity(base, len, a) >= bytes as u64 {
                    base
                } else {
                    // The device gave a chunk off `align` (as `lend` meets it): one more
                    // superblock's room.
                    let more = min.checked_add(self.superblock).ok_or_else(|| self.oom(&st, bytes))?;
                    self.grow(&mut st, dev, more, bytes, false, outside)?
                }
            }
        };
        let start = ext.next_multiple_of(a);
        let _clear = Self::hand_out(&mut st, ext, start, bytes, UsedKind::GraphSegment);
        Ok(start)
    }

    /// Bytes reserved from the device now.
    pub(crate) fn reserved(&self) -> usize {
        lock(&self.state).reserved
    }

    /// The bytes of the graph segment at `addr`, if one is there (for the graph pools' check).
    pub(crate) fn segment_len(&self, addr: u64) -> Option<usize> {
        lock(&self.state).used.get(&addr).filter(|u| u.kind == UsedKind::GraphSegment).map(|u| u.len)
    }

    /// Takes back a segment from [`GlobalPool::take_segment`]. The caller guarantees that no
    /// work queued so far uses it (a device synchronise came after its last use), so it
    /// becomes free with no fence.
    pub(crate) fn give_back_segment(&self, addr: u64) {
        let mut st = lock(&self.state);
        match st.used.remove(&addr) {
            Some(u) if u.kind == UsedKind::GraphSegment => {
                st.in_use -= u.len;
                Self::insert_free(&mut st, addr, u.len, u.chunk, FenceSet::default());
            }
            other => {
                debug_assert!(false, "giving back a segment not taken at {addr:#x}");
                if let Some(u) = other {
                    st.used.insert(addr, u);
                }
            }
        }
    }

    /// Checks a free of `[ptr, ptr + size)` as [`GlobalPool::free`] would, changing nothing:
    /// the caller validates before it records the free's fence, so a bad free costs no event.
    pub(crate) fn check_free(&self, ptr: u64, size: usize) -> Result<()> {
        let st = lock(&self.state);
        self.validate(&st, ptr, size, Origin::Caller).map(|_| ())
    }

    /// Accepts a caller's free of `[ptr, ptr + size)` whose fence is recorded later, once for a
    /// batch (`outbox.rs`): the block stays handed out, marked `freeing`, so a second free is
    /// refused, until [`GlobalPool::finish_frees`]. Returns the block's bytes.
    pub(crate) fn begin_free(&self, ptr: u64, size: usize) -> Result<usize> {
        let mut st = lock(&self.state);
        let u = self.validate(&st, ptr, size, Origin::Caller)?;
        st.used.get_mut(&ptr).expect("validated").freeing = true;
        Ok(u.len)
    }

    /// Undoes [`GlobalPool::begin_free`] (the free could not be queued).
    pub(crate) fn cancel_free(&self, ptr: u64) {
        if let Some(u) = lock(&self.state).used.get_mut(&ptr) {
            u.freeing = false;
        }
    }

    /// Frees blocks accepted by [`GlobalPool::begin_free`], all guarded by `fences`.
    pub(crate) fn finish_frees(&self, blocks: impl Iterator<Item = u64>, fences: FenceSet) {
        let mut st = lock(&self.state);
        for ptr in blocks {
            match st.used.remove(&ptr) {
                Some(u) if u.freeing => {
                    st.in_use -= u.len;
                    self.mark_freed(ptr, Origin::Caller);
                    Self::insert_free(&mut st, ptr, u.len, u.chunk, fences.clone());
                }
                other => {
                    debug_assert!(false, "finishing a free not begun at {ptr:#x}");
                    if let Some(u) = other {
                        st.used.insert(ptr, u);
                    }
                }
            }
        }
    }

    /// The used block a free of `ptr` with `size` releases, or why the free is refused.
    fn validate(&self, st: &PoolState, ptr: u64, size: usize, origin: Origin) -> Result<Used> {
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let u = match st.used.get(&ptr) {
            Some(u) if u.freeing => return Err(invalid(InvalidFree::DoubleFree)),
            Some(u) if u.kind == UsedKind::Block => *u,
            _ => {
                let inside_free =
                    st.free.below(ptr.saturating_add(1)).is_some_and(|(k, l, _)| ptr < k.saturating_add(l));
                return Err(invalid(if inside_free {
                    InvalidFree::DoubleFree
                } else {
                    InvalidFree::UnknownPointer
                }));
            }
        };
        // A free that came the arena way (`Origin::Transit`) is valid only for a block an arena
        // handed out: any other pool block at that address came later than the free was made
        // (a bad free on its way meanwhile; see `superblock.rs`).
        if origin == Origin::Transit && !u.from_arena {
            return Err(invalid(InvalidFree::UnknownPointer));
        }
        // A block left by a dissolved superblock whose first free is still on its way (see
        // `superblock.rs`): a second free.
        if origin == Origin::Caller
            && u.from_arena
            && let Some(sb) = self.registry.lookup(ptr)
            && sb.granule_of(ptr).is_some_and(|g| sb.is_freed(g))
        {
            return Err(invalid(InvalidFree::DoubleFree));
        }
        if block_bytes(size, self.small_max) != Some(u.len) {
            return Err(invalid(InvalidFree::SizeMismatch { allocated: u.len, given: size }));
        }
        Ok(u)
    }

    /// Frees a block handed out by [`GlobalPool::alloc`] or left by a dissolved superblock.
    /// `fence` guards its reuse. A refused free changes nothing, except the freed flag of a
    /// refused free in transit (it set it): cleared where a live block starts, else `ARRIVED`.
    pub(crate) fn free(
        &self,
        ptr: u64,
        size: usize,
        fence: Option<Arc<Fence>>,
        origin: Origin,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        let u = match self.validate(&st, ptr, size, origin) {
            Ok(u) => u,
            Err(e) => {
                if origin == Origin::Transit
                    && let Some((sb, g)) = self.flag_of(ptr)
                {
                    // Refused now, under the lock: the flag was this free's.
                    sb.refuse_transit(g, st.used.get(&ptr).is_some_and(|u| u.kind == UsedKind::Block));
                }
                return Err(e);
            }
        };
        st.used.remove(&ptr);
        st.in_use -= u.len;
        self.mark_freed(ptr, origin);
        Self::insert_free(&mut st, ptr, u.len, u.chunk, FenceSet::one(fence));
        Ok(())
    }

    /// The superblock and granule whose freed flag belongs to `ptr`, if a superblock was ever
    /// lent over it (`registry.rs`).
    fn flag_of(&self, ptr: u64) -> Option<(&Superblock, usize)> {
        let sb = self.registry.lookup(ptr)?;
        Some((sb, sb.granule_of(ptr)?))
    }

    /// A free of the block at `ptr` was applied (under the lock): its freed flag says so until
    /// the block's address is handed out again by an arena, so that once the range is lent
    /// again, another thread's second free of the block is refused at once by the flag, as in
    /// the arena the block came from (`superblock.rs`, "Freed flags"). A free that came in
    /// transit set the flag itself; a caller's free leaves a flag of a bad free on its way.
    fn mark_freed(&self, ptr: u64, origin: Origin) {
        // Mutation for the loom model of a range lent again: the flag left as it was.
        if cfg!(cuarena_mutant = "pool_free_unmarked") {
            return;
        }
        match (self.flag_of(ptr), origin) {
            (Some((sb, g)), Origin::Transit) => sb.mark_arrived(g),
            (Some((sb, g)), Origin::Caller) => sb.mark_pool_freed(g),
            // No superblock has covered the slot yet (a block the pool's first fit served in a
            // range it could not lend): the flag's page is made now, for the arena the slot is
            // lent to later.
            (None, _) => self.registry.mark_freed_unlent(ptr),
        }
    }

    /// Lends a superblock of `bytes` (a multiple of the normal superblock size, aligned to it)
    /// to the arena `shell`, ordered for its stream `home` (identity `key`). `requested` is the
    /// arena's request that needed it (reported if out of memory).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lend(
        &self,
        dev: &Counted<'_>,
        shell: *mut ArenaShell,
        home: Stream,
        key: StreamKey,
        skip_fences: bool,
        bytes: usize,
        requested: usize,
    ) -> Result<&Superblock> {
        let lend =
            |avoid_legacy| self.lend_from(dev, shell, home, key, skip_fences, bytes, requested, avoid_legacy);
        match lend(false) {
            Err(e) if e.is_legacy_refusal() => lend(true).map_err(|o| out_of_other(e, o)),
            r => r,
        }
    }

    /// [`GlobalPool::lend`] from the lowest extent that holds an aligned run, or, with
    /// `avoid_legacy`, from the lowest such that holds no lazy legacy fence.
    #[allow(clippy::too_many_arguments)] // `lend`'s own, and the one choice it retries with
    fn lend_from(
        &self,
        dev: &Counted<'_>,
        shell: *mut ArenaShell,
        home: Stream,
        key: StreamKey,
        skip_fences: bool,
        bytes: usize,
        requested: usize,
        avoid_legacy: bool,
    ) -> Result<&Superblock> {
        let (s, len) = (self.superblock, bytes);
        debug_assert!(len >= s && len.is_multiple_of(s));
        let fit = |st: &PoolState| {
            if avoid_legacy {
                Self::fit_avoiding_legacy(st, len as u64, Some(s as u64))
            } else {
                st.free.first_fit_aligned(len as u64)
            }
        };
        let (sb, fences) = {
            let mut st = lock(&self.state);
            let ext = match fit(&st) {
                Some(a) => a,
                None => {
                    self.grow(&mut st, dev, len, requested, true, 0)?;
                    match fit(&st) {
                        Some(a) => a,
                        // The device returned a chunk not aligned to the superblock size.
                        None => {
                            self.grow(&mut st, dev, len + s, requested, true, 0)?;
                            fit(&st).expect("a chunk of one superblock more holds an aligned run")
                        }
                    }
                }
            };
            let base = ext.next_multiple_of(s as u64);
            let last = base + (len - s) as u64;
            if !self.registry.covers(base) || !self.registry.covers(last) {
                return Err(Error::Unsupported(format!(
                    "the device gave an address ({last:#x}) beyond what the superblock registry covers"
                )));
            }
            let (chunk, fences) = Self::carve(&mut st, ext, base, len);
            st.used.insert(
                base,
                Used { len, kind: UsedKind::Superblock, chunk, from_arena: false, freeing: false },
            );
            st.in_use += len;
            // The range was free: no live block lies in it, so its slots may be re-entered.
            let sb = self.registry.get_or_insert(base, len / GRANULE);
            debug_assert!(sb.owner.load(Ordering::Relaxed).is_null());
            sb.owner.store(shell, Ordering::Release);
            (sb, fences)
        };
        if !skip_fences && let Err(e) = fences.order_before(dev, home, key, || self.legacy(dev)) {
            self.take_back(sb, &[], &[(sb.base, len)], fences, Vec::new());
            return Err(e);
        }
        Ok(sb)
    }

    /// The lowest free extent with room for `len` bytes (aligned to `align`, if given) whose
    /// fences hold no lazy legacy fence: what an allocation takes while a blocking stream is
    /// being captured, when such a fence cannot be recorded (`Error::is_legacy_refusal`). A
    /// scan of the free extents, made only then.
    fn fit_avoiding_legacy(st: &PoolState, len: u64, align: Option<u64>) -> Option<u64> {
        let mut found = None;
        st.free.for_each(|ext, l, v| {
            let room = align.map_or(l, |a| aligned_capacity(ext, l, a));
            if found.is_none() && room >= len && !v.fences.has_lazy_legacy() {
                found = Some(ext);
            }
        });
        found
    }

    /// Takes a superblock back from its arena: `used` ranges stay live as pool blocks (their
    /// frees come here from now on), `free` ranges become free extents guarded by `fences`, and
    /// each `fenced` range (a block freed remotely, its fence pending) a free extent guarded by
    /// its own fences.
    pub(crate) fn take_back(
        &self,
        sb: &Superblock,
        used: &[(u64, usize)],
        free: &[(u64, usize)],
        fences: FenceSet,
        fenced: Vec<(u64, usize, FenceSet)>,
    ) {
        // Mutation for the loom model of superblock return: clearing the owner before the
        // pool knows the blocks lets a free reach the pool too early.
        #[cfg(cuarena_mutant = "owner_cleared_early")]
        sb.owner.store(std::ptr::null_mut(), Ordering::Release);
        let mut st = lock(&self.state);
        let u = st.used.remove(&sb.base).expect("a lent superblock");
        debug_assert!(u.kind == UsedKind::Superblock);
        st.in_use -= u.len;
        for &(a, l) in used {
            st.used.insert(
                a,
                Used { len: l, kind: UsedKind::Block, chunk: u.chunk, from_arena: true, freeing: false },
            );
            st.in_use += l;
        }
        for &(a, l) in free {
            Self::insert_free(&mut st, a, l, u.chunk, fences.clone());
        }
        for (a, l, f) in fenced {
            Self::insert_free(&mut st, a, l, u.chunk, f);
        }
        // Cleared under the lock, after the ranges are registered: a free that sees no owner
        // and then takes this lock finds its block in `used`.
        sb.owner.store(std::ptr::null_mut(), Ordering::Release);
    }

    /// Releases every chunk that is wholly free to the device. With `blocking`, waits for
    /// their pending fences first, on the host, without the pool's lock (other threads' pool
    /// calls go on meanwhile: helper-42, `tests/adversarial_s28e.rs`, found an out-of-memory's
    /// last try holding every pool call, `stats` among them, behind device work); otherwise
    /// skips chunks whose fences have not completed.
    pub(crate) fn trim(&self, dev: &Counted<'_>, blocking: bool) -> Result<usize> {
        if blocking {
            let fences = self.free_chunk_fences(dev)?;
            // The mutation `trim_waits_locked` waits holding the lock, as before: the test
            // `adversarial_s28e::statistics_read_during_another_threads_last_try_do_not_wait_for_device_work`
            // must then fail.
            let held = cfg!(cuarena_mutant = "trim_waits_locked").then(|| lock(&self.state));
            for f in &fences {
                f.wait_host(dev)?;
            }
            drop(held);
        }
        let mut st = lock(&self.state);
        self.trim_locked(&mut st, dev)
    }

    /// The bytes of the chunks wholly free now: what a blocking trim could release.
    pub(crate) fn free_chunk_bytes(&self) -> usize {
        let st = lock(&self.state);
        Self::free_chunks(&st).iter().map(|&(_, l)| l).sum()
    }

    /// The chunks wholly free (base, bytes).
    fn free_chunks(st: &PoolState) -> Vec<(u64, usize)> {
        st.chunks
            .iter()
            .filter(|&(&b, &l)| st.free.get(b).is_some_and(|(fl, _)| fl as usize == l))
            .map(|(&b, &l)| (b, l))
            .collect()
    }

    /// The fences of the chunks wholly free now, their lazy legacy fences recorded (one a
    /// capture refuses is left out: its chunk is kept, as `trim_locked` keeps it), to be
    /// waited for without the lock.
    fn free_chunk_fences(&self, dev: &Counted<'_>) -> Result<Vec<FenceSet>> {
        let mut st = lock(&self.state);
        let mut out = Vec::new();
        for (base, _) in Self::free_chunks(&st) {
            match self.materialize_chunk(&mut st, dev, base) {
                Err(e) if e.is_legacy_refusal() => continue,
                r => r?,
            }
            out.push(st.free.get(base).expect("wholly free").1.fences.clone());
        }
        Ok(out)
    }

    /// Records the lazy legacy fence of the wholly free chunk at `base`, if it has one, so that
    /// it can be polled or waited for. The legacy stream's identity is asked before the extent
    /// is taken out: an error there must leave it in place.
    fn materialize_chunk(&self, st: &mut PoolState, dev: &Counted<'_>, base: u64) -> Result<()> {
        if !st.free.get(base).expect("wholly free").1.fences.has_lazy_legacy() {
            return Ok(());
        }
        self.legacy(dev).and_then(|legacy| {
            let (l, mut e) = st.free.remove(base).expect("checked");
            let r = e.fences.materialize(dev, legacy);
            st.free.insert(base, l, e);
            r
        })
    }

    /// Releases every chunk wholly free whose fences have completed.
    fn trim_locked(&self, st: &mut PoolState, dev: &Counted<'_>) -> Result<usize> {
        let mut released = 0;
        for (base, len) in Self::free_chunks(st) {
            match self.materialize_chunk(st, dev, base) {
                // While a blocking stream is being captured (or a capture is announced) the
                // legacy stream may not be used (`Device::stream_capturing`): the chunk is kept
                // for a later trim.
                Err(e) if e.is_legacy_refusal() => continue,
                r => r?,
            }
            // Known complete without a query after a blocking trim's waits (`trim`).
            if !st.free.get(base).expect("checked").1.fences.poll_all(dev)? {
                continue;
            }
            // SAFETY: the chunk came from `reserve`, is wholly free, and its fences have
            // completed, so no queued work uses it. Released first: a release the driver refuses
            // leaves the chunk where it was, free and counted, for a later trim (taken out
            // first, it was lost to the pool and its figures while the device still held it:
            // helper-36, `tests/adversarial_s27c.rs`).
            unsafe { dev.release(base, len)? };
            st.free.remove(base);
            st.chunks.remove(&base);
            st.reserved -= len;
            released += len;
        }
        Ok(released)
    }

    /// Fills the pool's part of `s`.
    /// Restarts the peak of reserved bytes at the reserved bytes now.
    pub(crate) fn reset_peak_reserved(&self) {
        let mut st = lock(&self.state);
        st.peak_reserved = st.reserved;
    }

    pub(crate) fn fill_stats(&self, s: &mut Stats) {
        let st = lock(&self.state);
        s.reserved_bytes = st.reserved as u64;
        s.peak_reserved_bytes = st.peak_reserved as u64;
        s.pool_in_use_bytes = st.in_use as u64;
        s.largest_free_block = st.free.max_len();
        s.free_extents = st.free.len() as u64;
    }

    /// Checks the invariants in the module comment; panics on a violation.
    pub(crate) fn check(&self) {
        let st = lock(&self.state);
        st.free.check();
        let mut ranges: Vec<(u64, u64, u64)> = Vec::new();
        let mut prev: Option<(u64, u64, u64)> = None;
        st.free.for_each(|k, l, v| {
            if let Some((pk, pl, pc)) = prev {
                assert!(!(pk + pl == k && pc == v.chunk), "unmerged free neighbours at {k:#x}");
            }
            prev = Some((k, l, v.chunk));
            ranges.push((k, l, v.chunk));
        });
        ranges.extend(st.used.iter().map(|(&k, u)| (k, u.len as u64, u.chunk)));
        ranges.sort();
        let mut covered: BTreeMap<u64, u64> = BTreeMap::new();
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap at {:#x}", w[1].0);
        }
        for (k, l, c) in &ranges {
            let clen = st.chunks[c] as u64;
            assert!(*k >= *c && k + l <= c + clen, "range {k:#x} outside its chunk");
            *covered.entry(*c).or_default() += l;
        }
        for (c, l) in &st.chunks {
            assert_eq!(covered.get(c).copied().unwrap_or(0), *l as u64, "chunk {c:#x} not fully accounted");
        }
        assert_eq!(st.reserved, st.chunks.values().sum::<usize>());
        assert_eq!(st.in_use, st.used.values().map(|u| u.len).sum::<usize>());
    }

    /// Ranges handed out: `(address, bytes, is_superblock)`.
    pub(crate) fn used_ranges(&self) -> Vec<(u64, usize, bool)> {
        lock(&self.state).used.iter().map(|(&a, u)| (a, u.len, u.kind == UsedKind::Superblock)).collect()
    }

    /// Bytes handed out (blocks and lent superblocks).
    pub(crate) fn in_use(&self) -> usize {
        lock(&self.state).in_use
    }

    /// True if `ptr` lies inside a chunk reserved from the device (for the C ABI's
    /// `record_stream`, which must refuse foreign pointers; it is rare, so the lock is fine).
    pub(crate) fn contains(&self, ptr: u64) -> bool {
        let st = lock(&self.state);
        st.chunks.range(..=ptr).next_back().is_some_and(|(&base, &len)| ptr - base < len as u64)
    }
}

/// How long a pool's drop waits for captures announced to other allocators of its device to end
/// before it gives up its synchronise and keeps its chunks (`GlobalPool`'s drop), in ms.
const DROP_CAPTURE_WAIT_MS: u32 = 10_000;

impl Drop for GlobalPool {
    /// Releases every chunk, after one device synchronise. Fences alone do not cover what the
    /// chunks may still be used for: superblocks still lent to the arenas of live threads (the
    /// dropping thread's own among them) hold blocks their owners freed with no event (own frees
    /// on the per-thread, legacy or a user stream, kept-back legacy frees, frees still in an
    /// outbox), and the work queued on those blocks before their frees may still be running. The
    /// synchronise orders every release after all work queued so far, as `cuMemPoolDestroy`
    /// defers its pool's release until outstanding frees complete (`cuMemFree` of `cuMemAlloc`'d
    /// memory "may" synchronise by itself; the driver promises nothing). If it fails, or a capture
    /// announced to another allocator of the device forbids it for longer than
    /// [`DROP_CAPTURE_WAIT_MS`], no chunk is released (they stay reserved until the process
    /// ends): releasing memory that work may still use is worse.
    fn drop(&mut self) {
        if crate::shutdown::process_exiting() {
            return; // the driver is going away; the process teardown frees the memory
        }
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if st.chunks.is_empty() {
            return;
        }
        let counters = Counters::new_shared();
        let dev = Counted::new(&*self.device, &counters);
        // A capture announced to another allocator of this device forbids the synchronise
        // (`Counted::synchronize`): wait for it to end, a while (captures are short), and
        // otherwise keep the chunks reserved, as when the synchronise fails.
        let mut waited = 0;
        while crate::sync::captures_announced(self.device.device_id()) && waited < DROP_CAPTURE_WAIT_MS {
            std::thread::sleep(std::time::Duration::from_millis(1));
            waited += 1;
        }
        // The mutation `drop_without_sync` releases the chunks at once, with no synchronise:
        // the tests `dropping_an_allocator_...` in `tests/adversarial_s15.rs` must then fail.
        if !cfg!(cuarena_mutant = "drop_without_sync") && dev.synchronize().is_err() {
            return;
        }
        for (&base, &len) in &st.chunks {
            // SAFETY: the allocator is being dropped, so no thread can use its blocks through it
            // any more, and every piece of work queued before now has completed (above): no work
            // uses the chunk.
            let _ = unsafe { dev.release(base, len) };
        }
    }
}
