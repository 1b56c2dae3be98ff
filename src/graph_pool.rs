//! Private pools for CUDA graphs: memory a graph's capture allocates, kept for that graph.
//!
//! A CUDA graph bakes the addresses its capture used into its kernels, and every replay uses
//! them again, long after the capture's frees. So memory allocated while a stream is being
//! captured must not go back to the allocator's general use while the graph may still be
//! replayed, and cuarena's ordinary paths refuse a capturing stream (`allocator.rs`). A
//! *graph pool* is memory set aside for such allocations, as PyTorch's private pools are: the
//! framework names the pool (PyTorch's `MempoolId_t`, two numbers: [`GraphPoolId`]), routes a
//! capture's allocations to it ([`crate::Allocator::graph_allocate`]), and releases it when
//! its last graph is destroyed. Frees of a pool's blocks come through the ordinary
//! `deallocate`, which finds them here by address.
//!
//! ## The rules (each stated once, here)
//! - **Growth needs no wait.** A pool grows by *segments* from the global pool that need no
//!   stream wait and no query before use (`GlobalPool::take_segment`): a capturing stream
//!   cannot wait on an event recorded outside its capture without breaking it. Segment sizes
//!   follow PyTorch's: 2 MiB for requests up to 1 MiB, 20 MiB under 10 MiB, otherwise the
//!   request rounded up to 2 MiB. Blocks are multiples of [`BLOCK_ALIGN`] bytes and start on
//!   a multiple of it.
//! - **A free made during a capture** ([`FreeAs::Captured`]) records no fence and is reused
//!   only by allocations made during a capture on the same stream handle (the per-thread
//!   stream's is the freeing thread's), as PyTorch's private pools reuse: the graphs that share
//!   a pool must be replayed in the order they were captured (PyTorch's rule). A block taken
//!   outside a capture behind another stream's fences keeps them (`behind`), and so does the
//!   range its capture's free makes: such a range is reused once they are known or queried
//!   complete, for the block may never have been used after its stream's wait, and a replay
//!   need not be ordered after that wait. The handle is all
//!   there is: a capturing stream's identity cannot be asked (`cuStreamGetId` breaks the
//!   capture: `device/cuda.rs`), and it cannot be destroyed while it captures.
//! - **A free made outside a capture** ([`FreeAs::Stream`]) keeps the stream's identity and a
//!   fence recorded at the free: the same stream reuses it at once (the free's contract), an
//!   allocation on another stream only behind a wait on that fence, and an allocation during a
//!   capture only once the fence is known or queried complete. So a destroyed stream's handle
//!   given to a new stream gets nothing early.
//! - **A block declared used on another stream** (`record_stream`) and freed while a stream of
//!   the free is being captured is held ([`FreeAs::Held`]): not reused until the pool retires
//!   (below), since no event can order a capture's streams from outside it. Outside a capture,
//!   the declared streams are ordered before the free's stream first (`allocator.rs`), and the
//!   free is an ordinary one.
//! - **Nothing leaves a pool while it is retained.** A pool is retained once per
//!   [`GraphPools::retain`] (PyTorch: once per capture into it, and once per `MemPool`) and
//!   released once per [`GraphPools::release`]. At the last release, once no block of it is
//!   live, its segments are *parked*: its graphs' replays may still be running on any stream,
//!   so they go back to the global pool only after a device synchronise. Parking never
//!   synchronises (a release may come while another thread captures, and a synchronise would
//!   break that capture); the synchronises that happen anyway (out of memory, `trim(true)`,
//!   the allocator's drop, parked arenas past their bound) take them (`allocator.rs`,
//!   `bury_zombies`).
//! - **A checkpoint restores a pool's live blocks** (PyTorch's `getCheckpointState` and
//!   `setCheckpointPoolState`, which CUDA graph trees use to record a new graph after replaying
//!   others: [`GraphPools::checkpoint`], [`GraphPools::restore`]). A restore frees every block
//!   live now and makes exactly the checkpoint's blocks live again, at their addresses. The
//!   caller, restoring, declares every earlier use of the blocks it frees ordered before the
//!   pool's next use (as PyTorch's own restore assumes), so they become [`Reuse::Fresh`], once
//!   the fences they were taken behind have completed (a block taken from another stream's free
//!   may never have been used after its stream's wait). A block made live again over a free
//!   range that keeps fences (another stream's free outside a capture, or a capture's free of
//!   a block taken behind them) waits for them first. Both waits are
//!   on the host: a restore is rare, and refused instead while a capture is underway. A
//!   checkpoint names its pool's incarnation: it is refused by a pool released and made again.
//!
//! ## Invariants (under `state`'s lock)
//! - Every byte of every segment of a pool is in exactly one of its `live` blocks, its `free`
//!   ranges or its `held` ranges; `fit` holds exactly the entries of `free`; `behind` is keyed
//!   by live blocks only.
//! - Two `free` ranges of one segment that touch have different [`Reuse`]s (same ones merge,
//!   their fences merged); a [`Reuse::Fresh`] range carries none, a [`Reuse::Stream`] range
//!   its frees' fences (and those its blocks were taken behind), a [`Reuse::Captured`] range
//!   only the fences its blocks were taken behind.
//! - `segments` maps each segment of each pool that is not parked to that pool, and every such
//!   segment lies inside `[lo, hi)`.
//! - `retained > 0` for every pool in `pools`, or the pool has live blocks (it is released and
//!   retires at its last free).
//!
//! Lock layering: graph pools' state, then (pass-through mode) that mode's lock, then the
//! global pool's, each only under those before it (a pool's growth); none is taken under a later
//! one. `bury_zombies` takes the state lock alone (its failure path under the parked arenas'
//! lock, which nothing here takes).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, InvalidFree, Result};
use crate::fence::FenceSet;
use crate::stream::Stream;
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

/// A graph pool's name: PyTorch's `MempoolId_t` (a pair of numbers; any pair not used for
/// another pool will do).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(pub u64, pub u64);

/// A checkpoint of a graph pool: which of its blocks were live, for
/// [`crate::Allocator::graph_pool_restore`] (PyTorch's `getCheckpointState`; see the module
/// comment's rule). It names the pool's incarnation: a pool released and made again under the
/// same id refuses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphCheckpoint {
    pub(crate) id: GraphPoolId,
    pub(crate) serial: u64,
    /// Live blocks (address, bytes) by address; bytes are multiples of [`BLOCK_ALIGN`].
    pub(crate) blocks: Vec<(u64, u64)>,
}

impl GraphCheckpoint {
    /// The pool it was taken of.
    pub fn pool(&self) -> GraphPoolId {
        self.id
    }

    /// The blocks that were live (address, bytes, the bytes a multiple of 512), by address: the
    /// blocks a restore makes live again.
    pub fn blocks(&self) -> impl ExactSizeIterator<Item = (crate::DeviceAddr, usize)> + '_ {
        self.blocks.iter().map(|&(a, l)| (crate::DeviceAddr(a), l as usize))
    }
}

/// Every graph-pool block's size is a multiple of this (PyTorch's rounding).
pub const BLOCK_ALIGN: usize = 512;

/// Which allocations may reuse a free range (see the module comment's rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Reuse {
    /// Memory no block has used since the pool took it, or that a checkpoint's restore freed
    /// (see the module comment): any allocation.
    Fresh,
    /// Freed during a capture on this stream handle (the per-thread stream's with the freeing
    /// thread's id): allocations during a capture on that handle.
    Captured(usize, u64),
    /// Freed outside a capture on the stream with this identity, behind the range's fences.
    Stream(u64),
}

/// A stream handle as [`Reuse::Captured`] keys it.
fn handle_of(stream: Stream) -> (usize, u64) {
    if stream.is_legacy() {
        (0, 0)
    } else if stream == Stream::PER_THREAD {
        (stream.as_raw(), crate::sync::thread_id())
    } else {
        (stream.as_raw(), 0)
    }
}

/// How a free of a pool's block is kept (the caller decides, from the stream's capture state).
pub(crate) enum FreeAs {
    /// Freed on `stream` while it is being captured.
    Captured(Stream),
    /// Freed outside a capture on the stream with this identity; `fences` guard it for others.
    Stream(u64, FenceSet),
    /// Declared used on another stream and freed during a capture: held until the pool retires.
    Held,
}

/// The stream an allocation is for.
#[derive(Clone, Copy)]
pub(crate) enum Want {
    /// A stream being captured.
    Capturing(Stream),
    /// A stream not being captured, with its identity.
    Stream(u64),
}

#[derive(Clone)]
struct FreeRange {
    len: u64,
    reuse: Reuse,
    /// The segment's base: ranges of two segments never merge.
    segment: u64,
    /// For [`Reuse::Stream`]: what orders the free before another stream's use (with the
    /// fences its blocks were taken behind). For [`Reuse::Captured`]: the fences its blocks
    /// were taken behind outside a capture, complete before it is reused. Clear for
    /// [`Reuse::Fresh`].
    fences: FenceSet,
}

/// One graph pool. See the module comment for its invariants.
#[derive(Default)]
struct Pool {
    /// This incarnation of the pool's name (a checkpoint of an earlier one is refused).
    serial: u64,
    retained: u64,
    /// Segments: base → bytes.
    segments: BTreeMap<u64, u64>,
    /// Live blocks: address → bytes.
    live: HashMap<u64, u64>,
    /// Free ranges by address.
    free: BTreeMap<u64, FreeRange>,
    /// `free` by (reuse, bytes, address), for the best fit of one reuse class.
    fit: BTreeSet<(Reuse, u64, u64)>,
    /// Blocks freed with uses on other streams: kept out of use until the pool is released.
    held: BTreeMap<u64, u64>,
    /// Live blocks carved from free ranges whose fences were not known complete: those fences
    /// (the block's stream was made to wait on them, or is the stream that freed the range).
    /// A free outside a capture merges them into the range it makes, and a restore waits for
    /// them before it frees the block as fresh memory: the block may never have been used
    /// after the wait, so nothing else orders that work before the next user.
    behind: HashMap<u64, FenceSet>,
}

impl Pool {
    fn segment_of(&self, addr: u64) -> Option<u64> {
        self.segments.range(..=addr).next_back().filter(|&(&b, &l)| addr - b < l).map(|(&b, _)| b)
    }

    fn remove_free(&mut self, addr: u64) -> FreeRange {
        let r = self.free.remove(&addr).expect("a free range");
        self.fit.remove(&(r.reuse, r.len, addr));
        r
    }

    fn insert_free_raw(&mut self, addr: u64, r: FreeRange) {
        self.fit.insert((r.reuse, r.len, addr));
        self.free.insert(addr, r);
    }

    /// Returns `[addr, addr + len)` to the free ranges, merged with touching ranges of its
    /// segment and reuse class (their fences with it).
    fn insert_free(&mut self, addr: u64, len: u64, reuse: Reuse, mut fences: FenceSet) {
        let segment = self.segment_of(addr).expect("inside a segment");
        let (mut start, mut end) = (addr, addr + len);
        if let Some((&a, r)) = self.free.range(..addr).next_back()
            && a + r.len == addr
            && r.segment == segment
            && r.reuse == reuse
        {
            fences.merge(self.remove_free(a).fences);
            start = a;
        }
        if let Some(r) = self.free.get(&end)
            && r.segment == segment
            && r.reuse == reuse
        {
            let r = self.remove_free(end);
            end += r.len;
            fences.merge(r.fences);
        }
        self.insert_free_raw(start, FreeRange { len: end - start, reuse, segment, fences });
    }

    /// The best fit among free ranges of `reuse`: the shortest of at least `len` bytes.
    fn best_fit(&self, reuse: Reuse, len: u64) -> Option<u64> {
        self.fit.range((reuse, len, 0)..).next().filter(|&&(r, _, _)| r == reuse).map(|&(_, _, a)| a)
    }

    /// The best fit among `own`'s free ranges that the stream may take now: a stream's own
    /// frees at once (it was made to wait on the fences its blocks were carved behind before
    /// it used them), a capture's own frees once the fences they keep (those a block was
    /// carved behind, outside a capture) are complete, which `ready` asks during a capture.
    fn own_fit(
        &self,
        own: Reuse,
        len: u64,
        ready: &mut dyn FnMut(&FenceSet) -> Result<bool>,
    ) -> Result<Option<u64>> {
        if matches!(own, Reuse::Stream(_)) {
            return Ok(self.best_fit(own, len));
        }
        for &(r, _, a) in self.fit.range((own, len, 0)..) {
            if r != own {
                break;
            }
            let fences = &self.free[&a].fences;
            if fences.is_clear() || ready(fences)? {
                return Ok(Some(a));
            }
        }
        Ok(None)
    }

    /// Hands out `len` bytes of the free range at `addr`, the rest staying free as it was; the
    /// block keeps the range's fences not known complete (`behind`).
    fn carve(&mut self, addr: u64, len: u64) -> u64 {
        let r = self.remove_free(addr);
        if !r.fences.is_clear() {
            self.behind.insert(addr, r.fences.clone());
        }
        if r.len > len {
            self.insert_free_raw(addr + len, FreeRange { len: r.len - len, ..r });
        }
        self.live.insert(addr, len);
        addr
    }

    /// Hands out `len` bytes for `want` from a free range, if one may serve it: the stream's
    /// own frees first (no wait), then fresh memory, each by best fit, then the first of the
    /// other streams' frees, in order of (stream, length), for which `ready` says yes (it makes
    /// the stream wait on their fences, or, during a capture, finds them complete): a scan.
    fn take(
        &mut self,
        want: &Want,
        len: u64,
        ready: &mut dyn FnMut(&FenceSet) -> Result<bool>,
    ) -> Result<Option<u64>> {
        let own = match *want {
            Want::Capturing(s) => {
                let (h, t) = handle_of(s);
                Reuse::Captured(h, t)
            }
            Want::Stream(k) => Reuse::Stream(k),
        };
        if let Some(a) = self.own_fit(own, len, ready)?.or_else(|| self.best_fit(Reuse::Fresh, len)) {
            return Ok(Some(self.carve(a, len)));
        }
        let others: Vec<u64> = self
            .fit
            .range((Reuse::Stream(0), 0, 0)..)
            .filter(|&&(r, l, _)| r != own && l >= len)
            .map(|&(_, _, a)| a)
            .collect();
        for a in others {
            if ready(&self.free[&a].fences)? {
                return Ok(Some(self.carve(a, len)));
            }
        }
        Ok(None)
    }

    fn bytes(&self) -> u64 {
        self.segments.values().sum()
    }

    /// The free ranges overlapping `[a, end)`, by address.
    fn free_overlapping(&self, a: u64, end: u64) -> impl Iterator<Item = (u64, &FreeRange)> {
        let first = self.free.range(..=a).next_back().map_or(a, |(&f, _)| f);
        self.free.range(first..end).filter(move |&(&f, r)| f + r.len > a).map(|(&f, r)| (f, r))
    }

    /// Checks that `blocks` can be made live once every live block is freed: sorted, apart,
    /// [`BLOCK_ALIGN`]ed and not empty, each inside one segment of this pool and clear of the
    /// held ranges. Returns the fences that must complete first: those still pending on the
    /// free ranges the blocks cover (memory another stream freed outside a capture, or that a
    /// capture freed after it was taken behind such fences), and those the live blocks were
    /// taken behind (`behind`).
    fn plan_restore(&self, blocks: &[(u64, u64)]) -> Result<Vec<FenceSet>> {
        let bad = |what: String| Error::Unsupported(format!("graph pool checkpoint: {what}"));
        let align = BLOCK_ALIGN as u64;
        // The live blocks become fresh memory: the fences they were taken behind first.
        let mut pending: Vec<FenceSet> = self.behind.values().filter(|f| !f.is_clear()).cloned().collect();
        let mut end_of_last = 0;
        for &(a, l) in blocks {
            if l == 0 || !a.is_multiple_of(align) || !l.is_multiple_of(align) || a < end_of_last {
                return Err(bad(format!("block {a:#x} of {l} bytes is not a block this pool can hold")));
            }
            let end = a.checked_add(l).ok_or_else(|| bad(format!("block {a:#x} overflows")))?;
            end_of_last = end;
            match self.segment_of(a) {
                Some(s) if end <= s + self.segments[&s] => {}
                _ => return Err(bad(format!("block {a:#x} of {l} bytes lies outside the pool's segments"))),
            }
            if self.held.range(..end).next_back().is_some_and(|(&h, &hl)| h + hl > a) {
                return Err(bad(format!(
                    "block {a:#x} covers memory held for another stream's use (freed during a capture \
                     after record_stream)"
                )));
            }
            for (_, r) in self.free_overlapping(a, end) {
                if !r.fences.is_clear() {
                    pending.push(r.fences.clone());
                }
            }
        }
        Ok(pending)
    }

    /// Applies a restore [`Pool::plan_restore`] accepted with no fence pending: frees every
    /// live block as [`Reuse::Fresh`], then carves each of `blocks` out of the free ranges
    /// covering it (the rest of those ranges stays free as it was). Returns the blocks freed.
    fn apply_restore(&mut self, blocks: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut freed: Vec<(u64, u64)> = self.live.drain().collect();
        freed.sort_unstable();
        self.behind.clear(); // planned: every one complete
        for &(a, l) in &freed {
            self.insert_free(a, l, Reuse::Fresh, FenceSet::default());
        }
        for &(a, l) in blocks {
            let end = a + l;
            let covering: Vec<u64> = self.free_overlapping(a, end).map(|(f, _)| f).collect();
            let mut next = a;
            for f in covering {
                let r = self.remove_free(f);
                debug_assert!(f <= next && next < f + r.len, "planned: the free ranges tile the block");
                if f < a {
                    self.insert_free_raw(f, FreeRange { len: a - f, ..r.clone() });
                }
                if f + r.len > end {
                    self.insert_free_raw(end, FreeRange { len: f + r.len - end, ..r });
                }
                next = (f + r.len).min(end);
            }
            debug_assert_eq!(next, end, "planned: the free ranges tile the block");
            self.live.insert(a, l);
        }
        freed
    }
}

/// Why [`GraphPools::restore`] changed nothing.
#[derive(Debug)]
pub(crate) enum RestoreRefused {
    /// More blocks are live than the caller has room to be told of: this many.
    Room(usize),
    /// The checkpoint cannot be restored, or a wait failed.
    Error(Error),
}

#[derive(Default)]
struct State {
    pools: HashMap<GraphPoolId, Pool>,
    /// Segment base → (bytes, pool), for every segment not parked.
    segments: BTreeMap<u64, (u64, GraphPoolId)>,
    /// Segments of retired pools, waiting for a device synchronise: base → bytes.
    parked: Vec<(u64, u64)>,
    /// Captures underway (begun with [`GraphPools::capture_begin`], not ended): while any is,
    /// the allocator makes no device synchronise (`allocator.rs`).
    captures: u64,
    /// The serial the next pool made gets.
    next_serial: u64,
}

impl State {
    /// The pool whose segment holds `addr`.
    fn pool_at(&self, addr: u64) -> Option<GraphPoolId> {
        self.segments.range(..=addr).next_back().filter(|&(&b, &(l, _))| addr - b < l).map(|(_, &(_, id))| id)
    }

    /// Parks the segments of a released pool with no live block, and forgets it.
    fn retire_if_done(&mut self, id: GraphPoolId) {
        let done = self.pools.get(&id).is_some_and(|p| p.retained == 0 && p.live.is_empty());
        if done {
            let p = self.pools.remove(&id).expect("present");
            for (b, l) in p.segments {
                self.segments.remove(&b);
                self.parked.push((b, l));
            }
        }
    }
}

/// The graph pools of one allocator.
pub(crate) struct GraphPools {
    /// `[lo, hi)` covers every segment a pool has held since the allocator was made: widened
    /// (under `state`'s lock, `Release`) before a new segment's first block is handed out,
    /// never narrowed. A free reads them (`Acquire`) before it looks here, so that frees of
    /// other memory never take the lock while the address lies outside (in programs without
    /// graph pools, always). A thread freeing a pool's block got its address from the
    /// allocation through some synchronisation, which orders the widening before its loads: a
    /// free of a pool's block never finds it outside. Loom models:
    /// `loom-tests/tests/graph_pool.rs` (the mutation `graph_flag_unset` fails them).
    lo: AtomicU64,
    hi: AtomicU64,
    state: Mutex<State>,
    /// The device (`Device::device_id`): captures announced here are counted process-wide for
    /// it too (`sync::announce_captures`), since another allocator's synchronise breaks them
    /// as well.
    device: u64,
}

impl GraphPools {
    /// The graph pools of an allocator of `device` (`Device::device_id`).
    pub(crate) fn new(device: u64) -> GraphPools {
        GraphPools {
            lo: AtomicU64::new(u64::MAX),
            hi: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            device,
        }
    }
}

/// What a free of a pool's block did: the bytes it released, for the statistics.
pub(crate) struct GraphFree {
    pub(crate) bytes: u64,
}

impl GraphPools {
    /// Retains pool `id`, making it if new (see the module comment).
    pub(crate) fn retain(&self, id: GraphPoolId) {
        let mut st = lock(&self.state);
        let st = &mut *st;
        let p = st.pools.entry(id).or_insert_with(|| {
            st.next_serial += 1;
            Pool { serial: st.next_serial, ..Pool::default() }
        });
        p.retained += 1;
    }

    /// Releases pool `id` once. Returns false, changing nothing, for a pool not retained.
    pub(crate) fn release(&self, id: GraphPoolId) -> bool {
        let mut st = lock(&self.state);
        match st.pools.get_mut(&id) {
            Some(p) if p.retained > 0 => p.retained -= 1,
            _ => return false,
        }
        st.retire_if_done(id);
        true
    }

    /// Allocates `size` (> 0) bytes for `want` in pool `id`. `ready(fences)` says whether a
    /// range another stream freed may serve it (see [`Pool::take`]); `grow(bytes)` takes a new
    /// segment of `bytes` from the global pool. Returns the address and the bytes handed out.
    pub(crate) fn alloc(
        &self,
        id: GraphPoolId,
        size: usize,
        want: Want,
        ready: &mut dyn FnMut(&FenceSet) -> Result<bool>,
        grow: impl FnOnce(usize) -> Result<u64>,
    ) -> Result<(u64, u64)> {
        let oom =
            || Error::OutOfMemory { requested: size, reserved: 0, in_use: 0, largest_free: 0, limit: 0 };
        let len = size.checked_next_multiple_of(BLOCK_ALIGN).ok_or_else(oom)?;
        let mut st = lock(&self.state);
        let pool = match st.pools.get_mut(&id) {
            Some(p) if p.retained > 0 => p,
            _ => return Err(Error::UnknownGraphPool { id: (id.0, id.1) }),
        };
        if let Some(a) = pool.take(&want, len as u64, ready)? {
            return Ok((a, len as u64));
        }
        let seg = segment_bytes(len).ok_or_else(oom)?;
        let base = grow(seg)?;
        debug_assert!(base.is_multiple_of(BLOCK_ALIGN as u64));
        pool.segments.insert(base, seg as u64);
        let fresh =
            FreeRange { len: seg as u64, reuse: Reuse::Fresh, segment: base, fences: FenceSet::default() };
        pool.insert_free_raw(base, fresh);
        let a = pool.take(&want, len as u64, ready)?.expect("a new segment fits the request");
        st.segments.insert(base, (seg as u64, id));
        // Widened before the block is handed out (see `lo`). The mutation `graph_flag_unset`
        // leaves the range empty: the loom model
        // `a_graph_block_freed_by_another_thread_is_taken_back_by_its_pool` must then fail.
        if !cfg!(cuarena_mutant = "graph_flag_unset") {
            self.lo.store(self.lo.load(Ordering::Relaxed).min(base), Ordering::Release);
            self.hi.store(self.hi.load(Ordering::Relaxed).max(base + seg as u64), Ordering::Release);
        }
        Ok((a, len as u64))
    }

    /// True if `ptr` may lie in a pool's segment (else no free needs to look here): two loads.
    #[inline]
    pub(crate) fn may_hold(&self, ptr: u64) -> bool {
        self.lo.load(Ordering::Acquire) <= ptr && ptr < self.hi.load(Ordering::Acquire)
    }

    /// Checks a free of `ptr` with `size` as [`GraphPools::free`] would, changing nothing:
    /// `None` if `ptr` lies in no pool's segment (not a graph pool's), else the free's answer.
    pub(crate) fn check_free(&self, ptr: u64, size: usize) -> Option<Result<()>> {
        if !self.may_hold(ptr) {
            return None;
        }
        let st = lock(&self.state);
        let id = st.pool_at(ptr)?;
        Some(Self::validate(&st.pools[&id], ptr, size).map(|_| ()))
    }

    /// The bytes of the live block a free of `ptr` with `size` releases, or why it is refused.
    fn validate(pool: &Pool, ptr: u64, size: usize) -> Result<u64> {
        let invalid = |reason| Error::InvalidFree { ptr, size, reason };
        let Some(&len) = pool.live.get(&ptr) else {
            let freed = pool.free.range(..=ptr).next_back().is_some_and(|(&a, r)| ptr - a < r.len)
                || pool.held.range(..=ptr).next_back().is_some_and(|(&a, &l)| ptr - a < l);
            return Err(invalid(if freed { InvalidFree::DoubleFree } else { InvalidFree::UnknownPointer }));
        };
        if size == 0 || size.checked_next_multiple_of(BLOCK_ALIGN) != Some(len as usize) {
            return Err(invalid(InvalidFree::SizeMismatch { allocated: len as usize, given: size }));
        }
        Ok(len)
    }

    /// A free of `ptr` with `size`, kept as `how` says, if `ptr` lies in a graph pool's segment
    /// (else `None`: not a graph pool's). A refused free changes nothing.
    pub(crate) fn free(&self, ptr: u64, size: usize, how: FreeAs) -> Option<Result<GraphFree>> {
        if !self.may_hold(ptr) {
            return None;
        }
        let mut st = lock(&self.state);
        let id = st.pool_at(ptr)?;
        let pool = st.pools.get_mut(&id).expect("a segment's pool");
        let len = match Self::validate(pool, ptr, size) {
            Ok(l) => l,
            Err(e) => return Some(Err(e)),
        };
        pool.live.remove(&ptr);
        let behind = pool.behind.remove(&ptr);
        match how {
            FreeAs::Held => {
                pool.held.insert(ptr, len);
            }
            // A capture's free records no fence (the module comment's rule), but the range
            // keeps the fences the block was taken behind: the block may never have been used
            // after its stream's wait, and a graph replayed on another stream is not ordered
            // after that wait, so a capture reuses the range only once they are complete.
            FreeAs::Captured(s) => {
                let (h, t) = handle_of(s);
                let kept = if cfg!(cuarena_mutant = "captured_free_drops_fences") {
                    FenceSet::default()
                } else {
                    behind.unwrap_or_default()
                };
                pool.insert_free(ptr, len, Reuse::Captured(h, t), kept);
            }
            FreeAs::Stream(k, mut fences) => {
                fences.merge(behind.unwrap_or_default());
                pool.insert_free(ptr, len, Reuse::Stream(k), fences);
            }
        }
        st.retire_if_done(id);
        Some(Ok(GraphFree { bytes: len }))
    }

    /// A capture begins (PyTorch: a route to a pool opens, for a capture or a `use_mem_pool`).
    /// Announced for the device first (waiting for a synchronise that runs: `sync.rs`), and
    /// never under the state lock.
    pub(crate) fn capture_begin(&self) {
        crate::sync::announce_captures(self.device, 1, true);
        lock(&self.state).captures += 1;
    }

    /// A capture begun ends; false, changing nothing, if none is underway.
    pub(crate) fn capture_end(&self) -> bool {
        let underway = {
            let mut st = lock(&self.state);
            let underway = st.captures > 0;
            st.captures -= u64::from(underway);
            underway
        };
        if underway {
            crate::sync::announce_captures(self.device, 1, false);
        }
        underway
    }

    /// Ends every capture still announced here (the allocator is dropped), for the device too.
    pub(crate) fn end_captures(&self) {
        let n = std::mem::take(&mut lock(&self.state).captures);
        crate::sync::announce_captures(self.device, n, false);
    }

    /// True while a capture is underway (see `captures`).
    pub(crate) fn captures_underway(&self) -> bool {
        lock(&self.state).captures > 0
    }

    /// True while a capture is announced to any allocator of this device.
    pub(crate) fn device_captures_underway(&self) -> bool {
        crate::sync::captures_announced(self.device)
    }

    /// How many times pool `id` is retained now (0 for a pool not retained).
    pub(crate) fn use_count(&self, id: GraphPoolId) -> u64 {
        lock(&self.state).pools.get(&id).map_or(0, |p| p.retained)
    }

    /// The live blocks of pool `id`, or `None` for a pool not retained.
    pub(crate) fn live(&self, id: GraphPoolId) -> Option<Vec<u64>> {
        let st = lock(&self.state);
        let p = st.pools.get(&id).filter(|p| p.retained > 0)?;
        let mut v: Vec<u64> = p.live.keys().copied().collect();
        v.sort_unstable();
        Some(v)
    }

    /// A checkpoint of pool `id`: its serial and its live blocks (address, bytes), by address;
    /// `None` for a pool not retained.
    pub(crate) fn checkpoint(&self, id: GraphPoolId) -> Option<(u64, Vec<(u64, u64)>)> {
        let st = lock(&self.state);
        let p = st.pools.get(&id).filter(|p| p.retained > 0)?;
        let mut v: Vec<(u64, u64)> = p.live.iter().map(|(&a, &l)| (a, l)).collect();
        v.sort_unstable();
        Some((p.serial, v))
    }

    /// Restores pool `id` to the checkpoint `(serial, blocks)` from [`GraphPools::checkpoint`]
    /// (the module comment's rule): frees every live block and makes exactly `blocks` live.
    /// `wait(fences)` waits for the fences of memory another stream freed that a block made
    /// live again covers; it is called with the lock released, and the restore is planned
    /// again after it. Returns the blocks freed (address, bytes), by address, or
    /// [`RestoreRefused::Room`] if there are more than `room` (nothing changed). Any refusal
    /// changes nothing.
    pub(crate) fn restore(
        &self,
        id: GraphPoolId,
        serial: u64,
        blocks: &[(u64, u64)],
        room: usize,
        wait: &mut dyn FnMut(&FenceSet) -> Result<()>,
    ) -> std::result::Result<Vec<(u64, u64)>, RestoreRefused> {
        loop {
            let mut st = lock(&self.state);
            let pool = match st.pools.get_mut(&id) {
                Some(p) if p.retained > 0 => p,
                _ => return Err(RestoreRefused::Error(Error::UnknownGraphPool { id: (id.0, id.1) })),
            };
            if pool.serial != serial {
                return Err(RestoreRefused::Error(Error::Unsupported(format!(
                    "graph pool ({}, {}) was released and made again since this checkpoint",
                    id.0, id.1
                ))));
            }
            if pool.live.len() > room {
                return Err(RestoreRefused::Room(pool.live.len()));
            }
            let pending = pool.plan_restore(blocks).map_err(RestoreRefused::Error)?;
            if pending.is_empty() {
                return Ok(pool.apply_restore(blocks));
            }
            drop(st);
            for f in &pending {
                wait(f).map_err(RestoreRefused::Error)?;
            }
        }
    }

    /// Bytes of the segments parked for a device synchronise.
    #[cfg(test)]
    fn parked_bytes(&self) -> u64 {
        lock(&self.state).parked.iter().map(|&(_, l)| l).sum()
    }

    /// Takes the parked segments; the caller gives them back after a device synchronise.
    pub(crate) fn take_parked(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut lock(&self.state).parked)
    }

    /// Puts segments taken by [`GraphPools::take_parked`] back (their synchronise failed).
    pub(crate) fn repark(&self, segs: Vec<(u64, u64)>) {
        lock(&self.state).parked.extend(segs);
    }

    /// Bytes in graph pools (segments of retained or live pools, and parked ones).
    pub(crate) fn bytes(&self) -> u64 {
        let st = lock(&self.state);
        st.pools.values().map(Pool::bytes).sum::<u64>() + st.parked.iter().map(|&(_, l)| l).sum::<u64>()
    }

    /// Checks the invariants in the module comment, and that the global pool holds every
    /// segment (parked ones too) as a graph segment of its length (`segment_len`); panics on a
    /// violation.
    pub(crate) fn check(&self, segment_len: impl Fn(u64) -> Option<usize>) {
        let st = lock(&self.state);
        for (&b, &l) in
            st.segments.iter().map(|(b, (l, _))| (b, l)).chain(st.parked.iter().map(|(b, l)| (b, l)))
        {
            assert_eq!(segment_len(b), Some(l as usize), "segment {b:#x} is not the global pool's");
        }
        for (id, p) in &st.pools {
            assert!(p.retained > 0 || !p.live.is_empty(), "pool {id:?} released and empty but kept");
            assert_eq!(p.fit.len(), p.free.len());
            assert!(
                p.behind.keys().all(|a| p.live.contains_key(a)),
                "pool {id:?}: fences kept for a block not live"
            );
            for (&a, r) in &p.free {
                assert!(p.fit.contains(&(r.reuse, r.len, a)), "fit misses {a:#x}");
            }
            let mut ranges: Vec<(u64, u64)> = p.live.iter().map(|(&a, &l)| (a, l)).collect();
            ranges.extend(p.free.iter().map(|(&a, r)| (a, r.len)));
            ranges.extend(p.held.iter().map(|(&a, &l)| (a, l)));
            ranges.sort_unstable();
            for w in ranges.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "graph pool ranges overlap at {:#x}", w[1].0);
            }
            let mut per_segment: BTreeMap<u64, u64> = BTreeMap::new();
            for &(a, l) in &ranges {
                let s = p.segment_of(a).expect("a range inside a segment");
                assert!(a + l <= s + p.segments[&s], "range {a:#x} past its segment");
                *per_segment.entry(s).or_default() += l;
            }
            for (&s, &l) in &p.segments {
                assert_eq!(per_segment.get(&s).copied().unwrap_or(0), l, "segment {s:#x} not covered");
                assert_eq!(st.segments.get(&s), Some(&(l, *id)));
            }
            let mut prev: Option<(u64, &FreeRange)> = None;
            for (&a, r) in &p.free {
                if let Some((pa, pr)) = prev {
                    assert!(
                        !(pa + pr.len == a && pr.segment == r.segment && pr.reuse == r.reuse),
                        "unmerged free ranges at {a:#x}"
                    );
                }
                prev = Some((a, r));
            }
        }
        let owned: usize = st.pools.values().map(|p| p.segments.len()).sum();
        assert_eq!(owned, st.segments.len(), "segment index out of step");
        let (lo, hi) = (self.lo.load(Ordering::Relaxed), self.hi.load(Ordering::Relaxed));
        for (&b, &(l, _)) in &st.segments {
            assert!(lo <= b && b + l <= hi, "segment {b:#x} outside [{lo:#x}, {hi:#x})");
        }
    }
}

/// The segment a pool takes for a block of `len` bytes (PyTorch's sizes; a 64th of them in the
/// loom models, whose device is tiny), or `None` past the address space.
fn segment_bytes(len: usize) -> Option<usize> {
    #[cfg(not(loom))]
    const MIB: usize = 1 << 20;
    #[cfg(loom)]
    const MIB: usize = 16 << 10;
    Some(if len <= MIB {
        2 * MIB
    } else if len < 10 * MIB {
        20 * MIB
    } else {
        len.checked_next_multiple_of(2 * MIB)?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools_with(id: GraphPoolId) -> (GraphPools, std::cell::Cell<u64>) {
        let g = GraphPools::new(u64::MAX);
        g.retain(id);
        (g, std::cell::Cell::new(1 << 30))
    }

    fn grow(next: &std::cell::Cell<u64>) -> impl FnOnce(usize) -> Result<u64> + '_ {
        move |b| {
            let a = next.get();
            next.set(a + b as u64 + (64 << 20)); // segments never touch
            Ok(a)
        }
    }

    /// [`GraphPools::check`], the segments' lengths taken from the pools themselves (no global
    /// pool here).
    fn checked(g: &GraphPools) {
        let lens: HashMap<u64, usize> = {
            let st = lock(&g.state);
            let pooled = st.segments.iter().map(|(&b, &(l, _))| (b, l as usize));
            pooled.chain(st.parked.iter().map(|&(b, l)| (b, l as usize))).collect()
        };
        g.check(|b| lens.get(&b).copied());
    }

    fn no_grow(_: usize) -> Result<u64> {
        panic!("fits a segment the pool has")
    }

    /// `ready` that answers `yes` and counts its calls.
    fn ready(yes: bool, calls: &std::cell::Cell<u32>) -> impl FnMut(&FenceSet) -> Result<bool> + '_ {
        move |_| {
            calls.set(calls.get() + 1);
            Ok(yes)
        }
    }

    fn cap(s: Stream) -> Want {
        Want::Capturing(s)
    }

    #[test]
    fn a_captures_frees_are_reused_by_its_handle_and_fresh_memory_serves_any() {
        let id = GraphPoolId(1, 0);
        let (g, next) = pools_with(id);
        let (s1, s2) = (Stream::from_raw(0x1000), Stream::from_raw(0x2000));
        let calls = std::cell::Cell::new(0);
        let (a, l) = g.alloc(id, 1000, cap(s1), &mut ready(true, &calls), grow(&next)).unwrap();
        assert_eq!(l, 1024);
        let (b, _) = g.alloc(id, 1000, cap(s2), &mut ready(true, &calls), no_grow).unwrap();
        assert_ne!(a, b);
        assert!(g.free(a, 1000, FreeAs::Captured(s1)).unwrap().is_ok());
        // s2 does not get s1's block back, even when asked; s1 does.
        let (c, _) = g.alloc(id, 1000, cap(s2), &mut ready(true, &calls), no_grow).unwrap();
        assert_ne!(c, a);
        let (d, _) = g.alloc(id, 1000, cap(s1), &mut ready(true, &calls), no_grow).unwrap();
        assert_eq!(d, a);
        assert_eq!(calls.get(), 0, "a capture's frees carry no fence to ask about");
        checked(&g);
    }

    #[test]
    fn a_free_outside_a_capture_is_reused_by_its_stream_at_once_and_by_others_only_when_ready() {
        let id = GraphPoolId(6, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let calls = std::cell::Cell::new(0);
        let (a, _) = g.alloc(id, 4096, Want::Stream(7), &mut ready(true, &calls), grow(&next)).unwrap();
        // The rest of the segment is fresh; fill it so that only `a` could serve.
        let mut rest = Vec::new();
        while let Ok((p, _)) = g.alloc(id, 4096, Want::Stream(7), &mut ready(true, &calls), |_| {
            Err(Error::OutOfMemory { requested: 0, reserved: 0, in_use: 0, largest_free: 0, limit: 0 })
        }) {
            rest.push(p);
        }
        assert!(g.free(a, 4096, FreeAs::Stream(7, FenceSet::default())).unwrap().is_ok());
        // Another stream, not ready: no reuse (and no growth allowed here: out of memory).
        assert!(
            g.alloc(id, 4096, Want::Stream(8), &mut ready(false, &calls), |_| Err(Error::ShutDown)).is_err()
        );
        assert!(g.alloc(id, 4096, cap(s), &mut ready(false, &calls), |_| Err(Error::ShutDown)).is_err());
        assert_eq!(calls.get(), 2);
        // Ready (a wait made, or found complete): reused.
        let (b, _) = g.alloc(id, 4096, cap(s), &mut ready(true, &calls), no_grow).unwrap();
        assert_eq!(b, a);
        assert!(g.free(b, 4096, FreeAs::Stream(7, FenceSet::default())).unwrap().is_ok());
        // The same stream: at once, nothing asked.
        let before = calls.get();
        let (c, _) = g.alloc(id, 4096, Want::Stream(7), &mut ready(false, &calls), no_grow).unwrap();
        assert_eq!((c, calls.get()), (a, before));
        checked(&g);
    }

    #[test]
    fn bad_frees_are_refused_and_change_nothing() {
        let id = GraphPoolId(2, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let calls = std::cell::Cell::new(0);
        let (a, _) = g.alloc(id, 4096, cap(s), &mut ready(true, &calls), grow(&next)).unwrap();
        assert!(matches!(
            g.free(a, 8192, FreeAs::Captured(s)),
            Some(Err(Error::InvalidFree {
                reason: InvalidFree::SizeMismatch { allocated: 4096, given: 8192 },
                ..
            }))
        ));
        assert!(matches!(
            g.check_free(a + 512, 512),
            Some(Err(Error::InvalidFree { reason: InvalidFree::UnknownPointer, .. }))
        ));
        assert!(matches!(g.check_free(a, 4096), Some(Ok(()))));
        assert!(g.free(a, 4096, FreeAs::Captured(s)).unwrap().is_ok());
        assert!(matches!(
            g.free(a, 4096, FreeAs::Captured(s)),
            Some(Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
        ));
        assert!(g.free(0x10, 4096, FreeAs::Held).is_none(), "not a graph pool's address");
        checked(&g);
    }

    #[test]
    fn a_released_pool_parks_its_segments_after_its_last_free() {
        let id = GraphPoolId(3, 0);
        let (g, next) = pools_with(id);
        g.retain(id); // two graphs share it
        let s = Stream::from_raw(0x1000);
        let calls = std::cell::Cell::new(0);
        let (a, _) = g.alloc(id, 3 << 20, cap(s), &mut ready(true, &calls), grow(&next)).unwrap();
        assert!(g.release(id));
        assert_eq!(g.parked_bytes(), 0);
        assert!(g.release(id));
        assert_eq!(g.parked_bytes(), 0, "a block still lives");
        assert!(g.alloc(id, 512, cap(s), &mut ready(true, &calls), no_grow).is_err(), "released");
        assert!(g.free(a, 3 << 20, FreeAs::Captured(s)).unwrap().is_ok());
        assert_eq!(g.parked_bytes(), 20 << 20);
        assert!(!g.release(id), "released already");
        assert_eq!(g.take_parked().len(), 1);
        checked(&g);
    }

    #[test]
    fn held_blocks_are_not_reused() {
        let id = GraphPoolId(4, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let calls = std::cell::Cell::new(0);
        let (a, _) = g.alloc(id, 512, cap(s), &mut ready(true, &calls), grow(&next)).unwrap();
        assert!(g.free(a, 512, FreeAs::Held).unwrap().is_ok());
        let (b, _) = g.alloc(id, 512, cap(s), &mut ready(true, &calls), no_grow).unwrap();
        assert_ne!(a, b, "a held block is not reused");
        assert!(matches!(
            g.free(a, 512, FreeAs::Captured(s)),
            Some(Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
        ));
        checked(&g);
    }

    #[test]
    fn touching_frees_of_one_stream_merge() {
        let id = GraphPoolId(5, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let calls = std::cell::Cell::new(0);
        let mut next_grow = Some(grow(&next));
        let blocks: Vec<u64> = (0..4)
            .map(|_| {
                let gr = next_grow.take();
                g.alloc(id, 512, cap(s), &mut ready(true, &calls), |b| {
                    gr.map_or_else(|| no_grow(b), |f| f(b))
                })
                .unwrap()
                .0
            })
            .collect();
        for &b in &blocks {
            assert!(g.free(b, 512, FreeAs::Captured(s)).unwrap().is_ok());
        }
        checked(&g);
        // One range of 2048 bytes for `s` now holds a 2048-byte request.
        let (c, _) = g.alloc(id, 2048, cap(s), &mut ready(true, &calls), no_grow).unwrap();
        assert_eq!(c, blocks[0]);
        checked(&g);
    }

    #[test]
    fn segment_sizes_follow_pytorchs_and_refuse_the_impossible() {
        assert_eq!(segment_bytes(512), Some(2 << 20));
        assert_eq!(segment_bytes(1 << 20), Some(2 << 20));
        assert_eq!(segment_bytes((1 << 20) + 512), Some(20 << 20));
        assert_eq!(segment_bytes(10 << 20), Some(10 << 20));
        assert_eq!(segment_bytes((10 << 20) + 512), Some(12 << 20));
        assert_eq!(segment_bytes(usize::MAX - 4095), None);
    }
}
