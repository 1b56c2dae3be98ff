//! Segregated free lists over an arena's superblocks (two-level segregated fit, one level per
//! size class).
//!
//! A free block of `len` granules sits in list [`class_floor`]`(len)`, or the last list for a
//! block beyond the largest class (the whole of a large superblock: at least 64 MiB, so it fits
//! every class); a request rounded to
//! class `c` takes the head of the first non-empty list `>= c`, found with one bit scan of a
//! `u128`. Every block in list `i >= c` holds at least `class_granules(c)` granules, so the head
//! always fits: allocation and free are O(1) with no search.
//!
//! Nodes live in a slab (`nodes`); a free block's tags hold its node index, so a neighbour can
//! be unlinked in O(1) when blocks merge. Owner-thread only.

use crate::size_class::{MAX_CLASSES, class_floor};
use crate::superblock::Superblock;

const NIL: u32 = u32::MAX;

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

/// The lists. Invariant: bit `i` of `bitmap` is set iff list `i` is non-empty.
pub(crate) struct FreeLists {
    heads: [u32; MAX_CLASSES],
    bitmap: u128,
    nodes: Vec<FNode>,
    spare: Vec<u32>,
}

impl Default for FreeLists {
    fn default() -> Self {
        FreeLists { heads: [NIL; MAX_CLASSES], bitmap: 0, nodes: Vec::new(), spare: Vec::new() }
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
        self.bitmap |= 1u128 << class;
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
                self.bitmap &= !(1u128 << n.class);
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
        let candidates = self.bitmap & (!0u128 << class);
        if candidates == 0 {
            return None;
        }
        let i = candidates.trailing_zeros() as usize;
        Some(self.remove(self.heads[i] as usize))
    }

    /// True if no block is free.
    pub(crate) fn is_empty(&self) -> bool {
        self.bitmap == 0
    }
}
