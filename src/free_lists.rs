//! Segregated free lists over an arena's superblocks (two-level segregated fit, one level per
//! size class).
//!
//! A free block of `len` granules sits in list [`class_floor`]`(len)`, or the last list for a
//! block beyond the largest class (the whole of a large superblock: at least 64 MiB, so it fits
//! every class); a request rounded to class `c` takes the head of the first non-empty list
//! `>= c`, found with at most two bit scans of a bitmap (two `u64` words: a `u128`'s variable
//! shifts cost a dozen instructions each). Every block in list `i >= c` holds at least
//! `class_granules(c)` granules, so the head always fits: allocation and free are O(1) with no
//! search.
//!
//! Nodes live in a slab (`nodes`); a free block's tags hold its node index, so a neighbour can
//! be unlinked in O(1) when blocks merge. Owner-thread only.

use crate::size_class::{MAX_CLASSES, class_floor};
use crate::superblock::Superblock;

const NIL: u32 = u32::MAX;
/// Words of the lists' bitmap: one bit per class.
const BITMAP_WORDS: usize = MAX_CLASSES / 64;
const _: () = assert!(MAX_CLASSES == 64 * BITMAP_WORDS && BITMAP_WORDS == 2);

#[derive(Clone, Copy)]
struct FNode {
    sb: *const Superblock,
    first: u32,
    len: u32,
    prev: u32,
    next: u32,
    class: u8,
}

/// A free block: its superblock, first granule and length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FreeBlock {
    pub(crate) sb: *const Superblock,
    pub(crate) first: usize,
    pub(crate) len: usize,
}

/// The lists. Invariant: bit `i % 64` of `bitmap[i / 64]` is set iff list `i` is non-empty.
pub(crate) struct FreeLists {
    heads: [u32; MAX_CLASSES],
    bitmap: [u64; BITMAP_WORDS],
    nodes: Vec<FNode>,
    spare: Vec<u32>,
}

impl Default for FreeLists {
    fn default() -> Self {
        FreeLists {
            heads: [NIL; MAX_CLASSES],
            bitmap: [0; BITMAP_WORDS],
            nodes: Vec::new(),
            spare: Vec::new(),
        }
    }
}

impl FreeLists {
    /// Adds a free block; returns its node index (to be stored in its tags).
    #[inline(always)]
    pub(crate) fn insert(&mut self, b: FreeBlock) -> usize {
        let class = class_floor(b.len).min(MAX_CLASSES - 1);
        let head = self.heads[class];
        let node = FNode {
            sb: b.sb,
            first: b.first as u32,
            len: b.len as u32,
            prev: NIL,
            next: head,
            class: class as u8,
        };
        let id = match self.spare.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if head != NIL {
            self.nodes[head as usize].prev = id;
        }
        self.heads[class] = id;
        self.bitmap[class / 64] |= 1 << (class % 64);
        id as usize
    }

    /// Unlinks node `id` and returns its block.
    #[inline(always)]
    pub(crate) fn remove(&mut self, id: usize) -> FreeBlock {
        let n = self.nodes[id];
        if n.prev != NIL {
            self.nodes[n.prev as usize].next = n.next;
        } else {
            self.heads[n.class as usize] = n.next;
            if n.next == NIL {
                let c = n.class as usize;
                self.bitmap[c / 64] &= !(1 << (c % 64));
            }
        }
        if n.next != NIL {
            self.nodes[n.next as usize].prev = n.prev;
        }
        self.spare.push(id as u32);
        FreeBlock { sb: n.sb, first: n.first as usize, len: n.len as usize }
    }

    /// Takes a free block of class `class` or larger.
    #[inline]
    pub(crate) fn take_fit(&mut self, class: usize) -> Option<FreeBlock> {
        let i = self.first_at_or_above(class)?;
        Some(self.remove(self.heads[i] as usize))
    }

    /// True if no block is free.
    pub(crate) fn is_empty(&self) -> bool {
        self.bitmap == [0; BITMAP_WORDS]
    }

    /// The first non-empty list at or above `class`.
    #[inline(always)]
    fn first_at_or_above(&self, class: usize) -> Option<usize> {
        let (w, b) = (class / 64, class % 64);
        let low = self.bitmap[w] & (!0u64 << b);
        if low != 0 {
            return Some(w * 64 + low.trailing_zeros() as usize);
        }
        let high = self.bitmap.get(w + 1).copied().unwrap_or(0);
        (high != 0).then(|| (w + 1) * 64 + high.trailing_zeros() as usize)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::size_class::class_granules;

    fn block(first: usize, len: usize) -> FreeBlock {
        FreeBlock { sb: std::ptr::null(), first, len }
    }

    /// Blocks of one class each, across the bitmap's two words: each request takes the
    /// smallest list that fits, lists empty themselves out of the bitmap, and the last list
    /// holds what no class reaches.
    #[test]
    fn a_fit_is_the_first_non_empty_list_at_or_above_across_both_words() {
        let mut l = FreeLists::default();
        let classes = [0, 62, 63, 64, 65, 126];
        let ids: Vec<usize> = classes.iter().map(|&c| l.insert(block(c * 1000, class_granules(c)))).collect();
        let huge = l.insert(block(1 << 20, 1 << 19)); // beyond every class: the last list
        assert_eq!(l.nodes[huge].class as usize, MAX_CLASSES - 1);
        for (&c, &id) in classes.iter().zip(&ids) {
            assert_eq!(l.first_at_or_above(c), Some(c));
            assert_eq!(l.nodes[id].class as usize, c);
        }
        assert_eq!(l.first_at_or_above(1), Some(62), "the next list up, in the first word");
        assert_eq!(l.first_at_or_above(66), Some(126), "the next list up, in the second word");
        // Taking 63 leaves 64 the fit for a request of 63; taking 64 and 65, 126.
        assert_eq!(l.take_fit(63).map(|b| b.first), Some(63_000));
        assert_eq!(l.take_fit(63).map(|b| b.first), Some(64_000));
        assert_eq!(l.take_fit(63).map(|b| b.first), Some(65_000));
        assert_eq!(l.take_fit(63).map(|b| b.first), Some(126_000));
        assert_eq!(l.take_fit(63).map(|b| b.len), Some(1 << 19), "then the last list");
        assert_eq!(l.take_fit(63).map(|b| b.first), None, "nothing left at or above 63");
        assert_eq!(l.take_fit(0).map(|b| b.first), Some(0));
        assert_eq!(l.take_fit(0).map(|b| b.first), Some(62_000));
        assert!(l.is_empty() && l.take_fit(0).is_none());
    }

    /// Removing a node from the middle of a list keeps the list and the bitmap right.
    #[test]
    fn removal_keeps_the_list_and_its_bit() {
        let mut l = FreeLists::default();
        let c = 64;
        let a = l.insert(block(0, class_granules(c)));
        let b = l.insert(block(100, class_granules(c)));
        let d = l.insert(block(200, class_granules(c)));
        assert_eq!(l.remove(b).first, 100);
        assert_eq!(l.first_at_or_above(c), Some(c));
        assert_eq!(l.remove(d).first, 200);
        assert_eq!(l.remove(a).first, 0);
        assert_eq!(l.first_at_or_above(0), None);
        assert!(l.is_empty());
    }
}
