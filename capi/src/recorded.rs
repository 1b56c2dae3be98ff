//! The `record_stream` declarations of the C ABI: block address → the streams its work was
//! declared on, as their declaring threads named them (`StreamUse`: `0x2` names a different
//! stream in every thread).
//!
//! ## When a declaration goes
//! Not at the block's free: a free is only *read* from the table ([`Recorded::uses`]), and an
//! accepted one marks the entry freed ([`Recorded::freed`]). The entry goes when a block is next
//! handed out at that address ([`Recorded::forget`], `malloc_with`), or when a freed entry is
//! evicted (below) or its memory released (`purge`). So:
//! - a free that is refused, or accepted and later found invalid by the block's owner (a wrong
//!   size freed by another thread: the owner checks it when the free arrives), leaves the
//!   declarations for the corrected free, which is still fenced after those streams;
//! - two frees of one address that race each other (a bad one and the owner's) both see them;
//! - a declaration made where no live block starts (a freed block, an interior pointer: no
//!   thread but a block's owner can tell those from a live block's start) is dropped before the
//!   next block at that address can be freed.
//!
//! ## Invariants
//! - An entry is *live* (`freed == false`) from its first declaration until a free of that
//!   address is accepted; then *freed* until `forget`, eviction or `purge` removes it.
//! - `live` counts live entries (the cap, [`MAX_RECORDED_BLOCKS`], applies to them); `entries`
//!   counts all, and is 0 only when every shard is empty, so that a free or an allocation skips
//!   the locks when nobody uses `record_stream`. Both change only under a shard's lock, with the
//!   map; they are read without one as hints (a declaration racing its own block's free or
//!   allocation is the caller's race).
//! - Each shard keeps at most [`MAX_FREED_PER_SHARD`] freed entries: past that, the oldest
//!   freed one is evicted, so memory stays bounded by the live entries plus that many. An
//!   evicted entry only loses its protection of a later corrected free, of a free accepted
//!   and then found invalid that many frees of declared blocks ago.
//!
//! Lock order: one shard's lock at a time, and never across an allocator call.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use cuarena::StreamUse;

/// Live blocks that may carry `record_stream` declarations at once: beyond this, a declaration
/// for a new block is refused (a bound on memory whatever the caller passes).
pub const MAX_RECORDED_BLOCKS: usize = 1 << 20;
/// Distinct streams one block may be declared on.
pub const MAX_RECORDED_STREAMS: usize = 1024;
/// Shards of the table, by address: frees and allocations of different blocks rarely meet.
const SHARDS: usize = 64;
/// Freed entries a shard keeps before it evicts the oldest (65,536 in all).
pub const MAX_FREED_PER_SHARD: usize = 1024;

struct Entry {
    uses: Vec<StreamUse>,
    freed: bool,
}

#[derive(Default)]
struct Shard {
    map: HashMap<u64, Entry>,
    /// Addresses marked freed, oldest first (some may have gone since: checked at eviction).
    freed: VecDeque<u64>,
}

/// The table (module comment).
pub(crate) struct Recorded {
    shards: Box<[Mutex<Shard>]>,
    live: AtomicUsize,
    entries: AtomicUsize,
    cap: usize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Recorded {
    /// An empty table that holds at most `cap` live entries.
    pub(crate) fn new(cap: usize) -> Recorded {
        Recorded {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            live: AtomicUsize::new(0),
            entries: AtomicUsize::new(0),
            cap,
        }
    }

    fn shard(&self, ptr: u64) -> &Mutex<Shard> {
        // Blocks start on 256-byte granules.
        &self.shards[(ptr >> 8) as usize % SHARDS]
    }

    /// Adds `s` to `ptr`'s declarations; refused (nothing changes) past the caps. A declaration
    /// on a freed entry (a block already freed) joins it and goes with it.
    pub(crate) fn record(&self, ptr: u64, s: StreamUse) -> Result<(), String> {
        let mut sh = lock(self.shard(ptr));
        match sh.map.get_mut(&ptr) {
            Some(e) if e.uses.contains(&s) => {}
            Some(e) if e.uses.len() >= MAX_RECORDED_STREAMS => {
                return Err(format!(
                    "cuarena_record_stream: {ptr:#x} is already declared on {MAX_RECORDED_STREAMS} streams \
                     (the limit); refused"
                ));
            }
            Some(e) => e.uses.push(s),
            None => {
                let n = self.live.load(Ordering::Relaxed);
                if n >= self.cap {
                    return Err(format!(
                        "cuarena_record_stream: {n} blocks already carry record_stream declarations (the limit); \
                         {ptr:#x} refused"
                    ));
                }
                sh.map.insert(ptr, Entry { uses: vec![s], freed: false });
                self.live.fetch_add(1, Ordering::Relaxed);
                self.entries.fetch_add(1, Ordering::Release);
            }
        }
        Ok(())
    }

    /// `ptr`'s declarations, live or freed (a free is fenced after them), left in the table.
    pub(crate) fn uses(&self, ptr: u64) -> Vec<StreamUse> {
        if self.entries.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        lock(self.shard(ptr)).map.get(&ptr).map(|e| e.uses.clone()).unwrap_or_default()
    }

    /// A free of `ptr` was accepted: its entry, if live, becomes freed (evicting the shard's
    /// oldest freed entry past [`MAX_FREED_PER_SHARD`]).
    pub(crate) fn freed(&self, ptr: u64) {
        let mut sh = lock(self.shard(ptr));
        match sh.map.get_mut(&ptr) {
            Some(e) if !e.freed => e.freed = true,
            _ => return,
        }
        self.live.fetch_sub(1, Ordering::Relaxed);
        sh.freed.push_back(ptr);
        while sh.freed.len() > MAX_FREED_PER_SHARD {
            let old = sh.freed.pop_front().expect("longer than the bound");
            if sh.map.get(&old).is_some_and(|e| e.freed) {
                sh.map.remove(&old);
                self.entries.fetch_sub(1, Ordering::Release);
            }
        }
    }

    /// Drops `ptr`'s entry: a block is being handed out at `ptr`, so whatever was declared
    /// there belongs to no live block.
    pub(crate) fn forget(&self, ptr: u64) {
        if self.entries.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut sh = lock(self.shard(ptr));
        if let Some(e) = sh.map.remove(&ptr) {
            if !e.freed {
                self.live.fetch_sub(1, Ordering::Relaxed);
            }
            self.entries.fetch_sub(1, Ordering::Release);
        }
    }

    /// Drops the freed entries whose address `keep` refuses (memory given back to the driver).
    pub(crate) fn purge(&self, keep: impl Fn(u64) -> bool) {
        if self.entries.load(Ordering::Acquire) == 0 {
            return;
        }
        for s in self.shards.iter() {
            let mut sh = lock(s);
            let before = sh.map.len();
            sh.map.retain(|&p, e| !e.freed || keep(p));
            let gone = before - sh.map.len();
            if gone > 0 {
                let Shard { map, freed } = &mut *sh;
                freed.retain(|p| map.contains_key(p));
                self.entries.fetch_sub(gone, Ordering::Release);
            }
        }
    }

    /// Live entries: blocks that carry declarations and have not been freed.
    pub(crate) fn live(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.values().filter(|e| !e.freed).count()).sum()
    }

    /// All entries, freed ones included.
    #[cfg_attr(not(test), allow(dead_code))] // tests read it
    pub(crate) fn entries(&self) -> usize {
        self.shards.iter().map(|s| lock(s).map.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuarena::Stream;

    #[test]
    fn caps_blocks_and_streams_and_refuses_cleanly() {
        let r = Recorded::new(3);
        let here = StreamUse::here;
        for p in [0x100, 0x200, 0x300] {
            r.record(p, here(Stream::LEGACY)).unwrap();
        }
        r.record(0x100, here(Stream::LEGACY)).unwrap(); // already there: no new entry
        let e = r.record(0x400, here(Stream::PER_THREAD)).unwrap_err();
        assert!(e.contains("(the limit)") && e.contains("0x400"), "{e}");
        assert_eq!(r.live(), 3);
        // A declaration for a block already there still works at the block cap.
        r.record(0x100, here(Stream::PER_THREAD)).unwrap();
        assert_eq!(r.uses(0x100), vec![here(Stream::LEGACY), here(Stream::PER_THREAD)]);
        // A freed entry no longer counts against the cap, and is still read by a later free.
        r.freed(0x100);
        r.record(0x400, here(Stream::PER_THREAD)).unwrap(); // room again
        assert_eq!(r.uses(0x100).len(), 2);
        assert_eq!((r.live(), r.entries()), (3, 4));
        for i in 1..MAX_RECORDED_STREAMS {
            r.record(0x200, here(Stream::from_raw(0x1000 + i))).unwrap();
        }
        assert!(r.record(0x200, here(Stream::from_raw(0x10_0000))).unwrap_err().contains("streams"));
        assert_eq!(r.uses(0x200).len(), MAX_RECORDED_STREAMS);
        r.forget(0x200);
        assert!(r.uses(0x200).is_empty());
        // The per-thread stream, declared by two threads: two declarations, each naming its
        // thread's stream, and only the other thread's is fenced through the legacy stream here.
        let there = std::thread::spawn(|| StreamUse::here(Stream::PER_THREAD)).join().unwrap();
        let r = Recorded::new(1);
        r.record(0x500, here(Stream::PER_THREAD)).unwrap();
        r.record(0x500, there).unwrap();
        r.record(0x500, here(Stream::PER_THREAD)).unwrap(); // already there
        let v = r.uses(0x500);
        assert_eq!(v.len(), 2);
        assert_eq!(
            v.iter().map(|u| u.fence_stream()).collect::<Vec<_>>(),
            [Stream::PER_THREAD, Stream::LEGACY]
        );
        assert!(here(Stream::LEGACY).fence_stream() == Stream::LEGACY && !there.stream().is_legacy());
    }

    #[test]
    fn freed_entries_stay_until_a_hand_out_eviction_or_purge() {
        let r = Recorded::new(1 << 20);
        let d = |h| StreamUse::here(Stream::from_raw(h));
        r.record(0x100, d(7)).unwrap();
        r.freed(0x100);
        r.freed(0x100); // a second accepted free changes nothing
        assert_eq!(r.uses(0x100), vec![d(7)]);
        r.record(0x100, d(9)).unwrap(); // on a freed block: joins the freed entry
        assert_eq!((r.live(), r.entries()), (0, 1));
        r.forget(0x100);
        assert!(r.uses(0x100).is_empty());
        assert_eq!(r.entries.load(Ordering::Relaxed), 0, "the lock-free emptiness hint follows the maps");
        // Eviction: one shard's addresses (a multiple of SHARDS granules apart).
        let addr = |i: u64| 0x10_0000 + i * (SHARDS as u64) * 256;
        let n = MAX_FREED_PER_SHARD as u64 + 10;
        for i in 0..n {
            r.record(addr(i), d(1)).unwrap();
            r.freed(addr(i));
        }
        assert_eq!(r.entries(), MAX_FREED_PER_SHARD);
        assert!(r.uses(addr(0)).is_empty() && r.uses(addr(9)).is_empty(), "the oldest go first");
        assert_eq!(r.uses(addr(10)), vec![d(1)]);
        // A live entry is never evicted or purged.
        r.record(0x200, d(3)).unwrap();
        r.purge(|p| p < addr(500));
        assert_eq!(r.uses(0x200), vec![d(3)]);
        assert_eq!(r.entries(), 1 + 500 - 10);
        r.purge(|_| false);
        assert_eq!((r.live(), r.entries()), (1, 1));
        assert_eq!(r.entries.load(Ordering::Relaxed), 1);
    }
}
