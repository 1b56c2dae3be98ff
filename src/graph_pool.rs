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
//!   follow PyTorch's: 2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, otherwise the
//!   request rounded up to 2 MiB. Blocks are multiples of [`BLOCK_ALIGN`] bytes.
//! - **Reuse inside a pool is by stream handle, with no fence**, as PyTorch's private pools
//!   reuse: a block freed on a stream is handed out again only for that stream's handle (the
//!   legacy stream's two handles are one; a per-thread stream's handle is the freeing
//!   thread's), and never-used memory for any stream. A stream's identity cannot be asked
//!   during a capture (`cuStreamGetId` breaks it: `device/cuda.rs`), so the handle is what
//!   there is; the graphs that share a pool must be replayed in the order they were captured,
//!   which is PyTorch's own rule for shared pools.
//! - **A block declared used on another stream** (`record_stream`) is not reused by its pool
//!   at all: it is held until the pool retires (below), since no event can order a capture's
//!   streams from outside it.
//! - **Nothing leaves a pool while it is retained.** A pool is retained once per
//!   [`GraphPools::retain`] (PyTorch: once per capture into it, and once per `MemPool`) and
//!   released once per [`GraphPools::release`]. At the last release, once no block of it is
//!   live, its segments are *parked*: its graphs' replays may still be running on any stream,
//!   so they go back to the global pool only after a device synchronise. Parking never
//!   synchronises (a release may come while another thread captures, and a synchronise would
//!   break that capture); the synchronises that happen anyway (out of memory, `trim(true)`,
//!   the allocator's drop, parked arenas past their bound) take them (`allocator.rs`,
//!   `bury_zombies`).
//!
//! ## Invariants (under `state`'s lock)
//! - Every byte of every segment of a pool is in exactly one of its `live` blocks, its `free`
//!   ranges or its `held` ranges; `fit` holds exactly the entries of `free`.
//! - Two `free` ranges of one segment that touch have different [`Reuse`]s (same ones merge).
//! - `segments` maps each segment of each pool that is not parked to that pool.
//! - `retained > 0` for every pool in `pools`, or the pool has live blocks (it is released and
//!   retires at its last free).
//!
//! Lock layering: the state lock is taken with no other cuarena lock held, and the global pool's
//! lock is taken under it (growth), never the reverse.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, InvalidFree, Result};
use crate::stream::Stream;
use crate::sync::{AtomicBool, Mutex, Ordering, lock};

/// A graph pool's name: PyTorch's `MempoolId_t` (a pair of numbers; any pair not used for
/// another pool will do).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(pub u64, pub u64);

/// Every graph-pool block's size is a multiple of this (PyTorch's rounding).
pub const BLOCK_ALIGN: usize = 512;

/// Which allocations may reuse a free range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Reuse {
    /// Memory no block has used since the pool took it: any stream.
    Fresh,
    /// Freed on this stream handle (the legacy stream as 0; a per-thread stream with the
    /// freeing thread's id): that handle only.
    On(usize, u64),
}

impl Reuse {
    fn of(stream: Stream) -> Reuse {
        if stream.is_legacy() {
            Reuse::On(0, 0)
        } else if stream == Stream::PER_THREAD {
            Reuse::On(stream.as_raw(), crate::sync::thread_id())
        } else {
            Reuse::On(stream.as_raw(), 0)
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct FreeRange {
    len: u64,
    reuse: Reuse,
    /// The segment's base: ranges of two segments never merge.
    segment: u64,
}

/// One graph pool. See the module comment for its invariants.
#[derive(Default)]
struct Pool {
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
    /// segment and reuse class.
    fn insert_free(&mut self, addr: u64, len: u64, reuse: Reuse) {
        let segment = self.segment_of(addr).expect("inside a segment");
        let (mut start, mut end) = (addr, addr + len);
        if let Some((&a, r)) = self.free.range(..addr).next_back()
            && a + r.len == addr
            && r.segment == segment
            && r.reuse == reuse
        {
            self.remove_free(a);
            start = a;
        }
        if let Some(r) = self.free.get(&end).copied()
            && r.segment == segment
            && r.reuse == reuse
        {
            self.remove_free(end);
            end += r.len;
        }
        self.insert_free_raw(start, FreeRange { len: end - start, reuse, segment });
    }

    /// The best fit among free ranges of `reuse`: the shortest of at least `len` bytes.
    fn best_fit(&self, reuse: Reuse, len: u64) -> Option<u64> {
        self.fit.range((reuse, len, 0)..).next().filter(|&&(r, _, _)| r == reuse).map(|&(_, _, a)| a)
    }

    /// Hands out `len` bytes for `reuse` from a free range, if one fits: that stream's own
    /// frees first, then fresh memory.
    fn take(&mut self, reuse: Reuse, len: u64) -> Option<u64> {
        let addr = self.best_fit(reuse, len).or_else(|| self.best_fit(Reuse::Fresh, len))?;
        let r = self.remove_free(addr);
        if r.len > len {
            self.insert_free_raw(addr + len, FreeRange { len: r.len - len, ..r });
        }
        self.live.insert(addr, len);
        Some(addr)
    }

    fn bytes(&self) -> u64 {
        self.segments.values().sum()
    }
}

#[derive(Default)]
struct State {
    pools: HashMap<GraphPoolId, Pool>,
    /// Segment base → (bytes, pool), for every segment not parked.
    segments: BTreeMap<u64, (u64, GraphPoolId)>,
    /// Segments of retired pools, waiting for a device synchronise: base → bytes.
    parked: Vec<(u64, u64)>,
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
#[derive(Default)]
pub(crate) struct GraphPools {
    /// Set (under `state`'s lock, `Release`) when the first pool is retained, never cleared. A
    /// free reads it (`Acquire`) before it looks here, so that programs without graph pools
    /// never take the lock. A block of a pool is handed out only after the store, and a thread
    /// freeing it got its address from the allocation through some synchronisation, which
    /// orders the store before the load: a free of a pool's block never reads `false`. Loom
    /// models: `loom-tests/tests/graph_pool.rs` (the mutation `graph_flag_unset` fails them).
    used: AtomicBool,
    state: Mutex<State>,
}

/// What a free of a pool's block did: the bytes it released, for the statistics.
pub(crate) struct GraphFree {
    pub(crate) bytes: u64,
}

impl GraphPools {
    /// Retains pool `id`, making it if new (see the module comment).
    pub(crate) fn retain(&self, id: GraphPoolId) {
        let mut st = lock(&self.state);
        st.pools.entry(id).or_default().retained += 1;
        // The mutation `graph_flag_unset` leaves the flag down: the loom model
        // `a_graph_block_freed_by_another_thread_is_taken_back_by_its_pool` must then fail.
        if !cfg!(cuarena_mutant = "graph_flag_unset") {
            self.used.store(true, Ordering::Release);
        }
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

    /// Allocates `size` (> 0) bytes for `stream` in pool `id`; `grow(bytes)` takes a new
    /// segment of `bytes` from the global pool. Returns the address and the bytes handed out.
    pub(crate) fn alloc(
        &self,
        id: GraphPoolId,
        size: usize,
        stream: Stream,
        grow: impl FnOnce(usize) -> Result<u64>,
    ) -> Result<(u64, u64)> {
        let len = size.checked_next_multiple_of(BLOCK_ALIGN).ok_or(Error::OutOfMemory {
            requested: size,
            reserved: 0,
            in_use: 0,
            largest_free: 0,
            limit: 0,
        })?;
        let mut st = lock(&self.state);
        let reuse = Reuse::of(stream);
        let pool = match st.pools.get_mut(&id) {
            Some(p) if p.retained > 0 => p,
            _ => return Err(Error::UnknownGraphPool { id: (id.0, id.1) }),
        };
        if let Some(a) = pool.take(reuse, len as u64) {
            return Ok((a, len as u64));
        }
        let seg = segment_bytes(len);
        let base = grow(seg)?;
        pool.segments.insert(base, seg as u64);
        pool.insert_free_raw(base, FreeRange { len: seg as u64, reuse: Reuse::Fresh, segment: base });
        let a = pool.take(reuse, len as u64).expect("a new segment fits the request");
        st.segments.insert(base, (seg as u64, id));
        Ok((a, len as u64))
    }

    /// True once any pool was retained: until then no free needs to look here.
    #[inline]
    pub(crate) fn in_use(&self) -> bool {
        self.used.load(Ordering::Acquire)
    }

    /// A free of `ptr` with `size` on `stream`, if `ptr` lies in a graph pool's segment (else
    /// `None`: not a graph pool's). `other_streams`: the block was declared used on a stream
    /// other than `stream` (it is then held; see the module comment). A refused free changes
    /// nothing.
    pub(crate) fn free(
        &self,
        ptr: u64,
        size: usize,
        stream: Stream,
        other_streams: bool,
    ) -> Option<Result<GraphFree>> {
        if !self.in_use() {
            return None;
        }
        let mut st = lock(&self.state);
        let id = st.pool_at(ptr)?;
        let pool = st.pools.get_mut(&id).expect("a segment's pool");
        let invalid = |reason| Some(Err(Error::InvalidFree { ptr, size, reason }));
        let Some(&len) = pool.live.get(&ptr) else {
            let freed = pool.free.range(..=ptr).next_back().is_some_and(|(&a, r)| ptr - a < r.len)
                || pool.held.range(..=ptr).next_back().is_some_and(|(&a, &l)| ptr - a < l);
            return invalid(if freed { InvalidFree::DoubleFree } else { InvalidFree::UnknownPointer });
        };
        if size.checked_next_multiple_of(BLOCK_ALIGN) != Some(len as usize) || size == 0 {
            return invalid(InvalidFree::SizeMismatch { allocated: len as usize, given: size });
        }
        pool.live.remove(&ptr);
        if other_streams {
            pool.held.insert(ptr, len);
        } else {
            pool.insert_free(ptr, len, Reuse::of(stream));
        }
        st.retire_if_done(id);
        Some(Ok(GraphFree { bytes: len }))
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

    /// Checks the invariants in the module comment; panics on a violation.
    pub(crate) fn check(&self) {
        let st = lock(&self.state);
        for (id, p) in &st.pools {
            assert!(p.retained > 0 || !p.live.is_empty(), "pool {id:?} released and empty but kept");
            assert_eq!(p.fit.len(), p.free.len());
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
            let mut prev: Option<(u64, FreeRange)> = None;
            for (&a, r) in &p.free {
                if let Some((pa, pr)) = prev {
                    assert!(
                        !(pa + pr.len == a && pr.segment == r.segment && pr.reuse == r.reuse),
                        "unmerged free ranges at {a:#x}"
                    );
                }
                prev = Some((a, *r));
            }
        }
        let owned: usize = st.pools.values().map(|p| p.segments.len()).sum();
        assert_eq!(owned, st.segments.len(), "segment index out of step");
    }
}

/// The segment a pool takes for a block of `len` bytes (PyTorch's sizes; a 64th of them in the
/// loom models, whose device is tiny).
fn segment_bytes(len: usize) -> usize {
    #[cfg(not(loom))]
    const MIB: usize = 1 << 20;
    #[cfg(loom)]
    const MIB: usize = 16 << 10;
    if len <= MIB {
        2 * MIB
    } else if len < 10 * MIB {
        20 * MIB
    } else {
        len.next_multiple_of(2 * MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools_with(id: GraphPoolId) -> (GraphPools, std::cell::Cell<u64>) {
        let g = GraphPools::default();
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

    #[test]
    fn reuse_is_by_stream_and_fresh_memory_serves_any() {
        let id = GraphPoolId(1, 0);
        let (g, next) = pools_with(id);
        let s1 = Stream::from_raw(0x1000);
        let s2 = Stream::from_raw(0x2000);
        let (a, l) = g.alloc(id, 1000, s1, grow(&next)).unwrap();
        assert_eq!(l, 1024);
        let (b, _) = g.alloc(id, 1000, s2, |_| panic!("fits the first segment")).unwrap();
        assert_ne!(a, b);
        assert!(g.free(a, 1000, s1, false).unwrap().is_ok());
        // s2 does not get s1's block back; s1 does.
        let (c, _) = g.alloc(id, 1000, s2, |_| panic!("fits")).unwrap();
        assert_ne!(c, a);
        let (d, _) = g.alloc(id, 1000, s1, |_| panic!("fits")).unwrap();
        assert_eq!(d, a);
        g.check();
    }

    #[test]
    fn bad_frees_are_refused_and_change_nothing() {
        let id = GraphPoolId(2, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let (a, _) = g.alloc(id, 4096, s, grow(&next)).unwrap();
        assert!(matches!(
            g.free(a, 8192, s, false),
            Some(Err(Error::InvalidFree {
                reason: InvalidFree::SizeMismatch { allocated: 4096, given: 8192 },
                ..
            }))
        ));
        assert!(matches!(
            g.free(a + 512, 512, s, false),
            Some(Err(Error::InvalidFree { reason: InvalidFree::UnknownPointer, .. }))
        ));
        assert!(g.free(a, 4096, s, false).unwrap().is_ok());
        assert!(matches!(
            g.free(a, 4096, s, false),
            Some(Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
        ));
        assert!(g.free(0x10, 4096, s, false).is_none(), "not a graph pool's address");
        g.check();
    }

    #[test]
    fn a_released_pool_parks_its_segments_after_its_last_free() {
        let id = GraphPoolId(3, 0);
        let (g, next) = pools_with(id);
        g.retain(id); // two graphs share it
        let s = Stream::from_raw(0x1000);
        let (a, _) = g.alloc(id, 3 << 20, s, grow(&next)).unwrap();
        assert!(g.release(id));
        assert_eq!(g.parked_bytes(), 0);
        assert!(g.release(id));
        assert_eq!(g.parked_bytes(), 0, "a block still lives");
        assert!(g.alloc(id, 512, s, |_| panic!("no")).is_err(), "a released pool takes no allocation");
        assert!(g.free(a, 3 << 20, s, false).unwrap().is_ok());
        assert_eq!(g.parked_bytes(), 20 << 20);
        assert!(!g.release(id), "released already");
        assert_eq!(g.take_parked().len(), 1);
        g.check();
    }

    #[test]
    fn blocks_used_on_other_streams_are_held_until_release() {
        let id = GraphPoolId(4, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let (a, _) = g.alloc(id, 512, s, grow(&next)).unwrap();
        assert!(g.free(a, 512, s, true).unwrap().is_ok());
        let (b, _) = g.alloc(id, 512, s, |_| panic!("fits")).unwrap();
        assert_ne!(a, b, "a held block is not reused");
        assert!(matches!(
            g.free(a, 512, s, false),
            Some(Err(Error::InvalidFree { reason: InvalidFree::DoubleFree, .. }))
        ));
        g.check();
    }

    #[test]
    fn touching_frees_of_one_stream_merge() {
        let id = GraphPoolId(5, 0);
        let (g, next) = pools_with(id);
        let s = Stream::from_raw(0x1000);
        let blocks: Vec<u64> =
            (0..4).map(|_| g.alloc(id, 512, s, grow(&next)).map(|(a, _)| a).unwrap()).collect();
        for &b in &blocks {
            assert!(g.free(b, 512, s, false).unwrap().is_ok());
        }
        g.check();
        // One range of 2048 bytes for `s` now holds a 2048-byte request.
        let (c, _) = g.alloc(id, 2048, s, |_| panic!("fits")).unwrap();
        assert_eq!(c, blocks[0]);
        g.check();
    }
}
