//! A legacy-stream arena's own frees kept back until a legacy action follows them (see
//! `arena.rs`, "Frees on the legacy stream"), in two generations:
//! - `open`: frees not yet published;
//! - `sealed`: frees published as one batch under a ticket (`fence.rs`, "One action for every
//!   thread's kept-back frees"), reusable once any thread's legacy action covers the ticket.
//!
//! Once half a batch (half of `legacy_batch` blocks or of `legacy_batch_bytes` bytes) is open
//! and nothing is sealed, the arena seals it. Once a whole batch is kept back, if the sealed
//! half is covered it is released (no driver call) and the open frees sealed in its place;
//! otherwise (or with nothing sealed) the arena issues its own action, which covers them all.
//! So the memory kept back is what it was with one batch (fewer than `legacy_batch` blocks and
//! `legacy_batch_bytes` bytes, plus the last block), a thread alone issues an action per batch
//! as before, and with many threads an action issued by one releases the sealed halves of every
//! other thread (an action costs about 20 µs on the legacy stream with 16 threads at once).
//!
//! Each free is kept as its block ([`Kept`]: superblock, first granule, length), so that
//! releasing it needs no registry lookup and no size arithmetic.
//!
//! Owner-thread only (the arena's state); the ticket protocol is `fence.rs`'s.
//!
//! Invariants: `open_bytes` and `sealed_bytes` are the block bytes of `open` and `sealed`;
//! `ticket` is 0 when `sealed` is empty, and otherwise the ticket `sealed` was published under.

use crate::size_class::GRANULE_SHIFT;
use crate::superblock::Superblock;

/// A kept-back free: the block, in a superblock its arena owns, tagged `PENDING` and counted
/// live until it is released.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Kept {
    pub(crate) sb: *const Superblock,
    /// Its first granule in `sb`.
    pub(crate) first: u32,
    /// Its length in granules.
    pub(crate) granules: u32,
}

impl Kept {
    /// The block's address, given its superblock's base.
    #[inline]
    pub(crate) fn addr(&self, base: u64) -> u64 {
        base + ((self.first as u64) << GRANULE_SHIFT)
    }

    /// The block's bytes.
    #[inline]
    pub(crate) fn bytes(&self) -> usize {
        (self.granules as usize) << GRANULE_SHIFT
    }
}

/// The kept-back frees of one legacy-stream arena.
#[derive(Default)]
pub(crate) struct LegacyKept {
    open: Vec<Kept>,
    open_bytes: usize,
    sealed: Vec<Kept>,
    sealed_bytes: usize,
    ticket: u64,
}

/// What the arena must do after a free joined the kept-back frees ([`LegacyKept::push`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing yet.
    Keep,
    /// Half a batch is open and nothing is sealed: publish it ([`LegacyKept::seal`]).
    Seal,
    /// A whole batch is kept back and a half of it is sealed under this ticket: release that
    /// half if an action covered it and seal the rest, or else issue an action for all.
    Settle(u64),
    /// A whole batch is kept back and nothing is sealed: issue an action for all.
    Act,
}

impl LegacyKept {
    /// Adds a free; `blocks` and `max_bytes` are the batch bounds (`legacy_batch`,
    /// `legacy_batch_bytes`: at least 1).
    #[inline]
    pub(crate) fn push(&mut self, k: Kept, blocks: usize, max_bytes: usize) -> Next {
        self.open.push(k);
        self.open_bytes += k.bytes();
        let sealed = !self.sealed.is_empty();
        if self.open.len() + self.sealed.len() >= blocks || self.open_bytes + self.sealed_bytes >= max_bytes {
            if sealed { Next::Settle(self.ticket) } else { Next::Act }
        } else if !sealed
            && (self.open.len() >= blocks.div_ceil(2) || self.open_bytes >= max_bytes.div_ceil(2))
        {
            Next::Seal
        } else {
            Next::Keep
        }
    }

    /// Seals the open half under `ticket`. The sealed half must be empty.
    pub(crate) fn seal(&mut self, ticket: u64) {
        debug_assert!(self.sealed.is_empty() && ticket > 0);
        std::mem::swap(&mut self.open, &mut self.sealed);
        self.sealed_bytes = std::mem::take(&mut self.open_bytes);
        self.ticket = ticket;
    }

    /// The sealed batch's ticket, if one is sealed.
    pub(crate) fn sealed_ticket(&self) -> Option<u64> {
        (!self.sealed.is_empty()).then_some(self.ticket)
    }

    /// Takes the sealed batch (its ticket was covered).
    pub(crate) fn take_sealed(&mut self) -> Vec<Kept> {
        self.sealed_bytes = 0;
        self.ticket = 0;
        std::mem::take(&mut self.sealed)
    }

    /// Takes every kept-back free (an action issued now covers them all).
    pub(crate) fn take_all(&mut self) -> Vec<Kept> {
        let mut all = self.take_sealed();
        all.append(&mut self.open);
        self.open_bytes = 0;
        all
    }

    /// Takes back a buffer `take_sealed` or `take_all` gave out, emptied, for the frees to
    /// come (a batch's worth of pushes then grows no buffer).
    pub(crate) fn recycle(&mut self, v: Vec<Kept>) {
        debug_assert!(v.is_empty());
        if self.open.is_empty() && self.open.capacity() < v.capacity() {
            self.open = v;
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.open.is_empty() && self.sealed.is_empty()
    }

    /// Every kept-back free, sealed first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Kept> {
        self.sealed.iter().chain(&self.open)
    }

    /// Takes out the frees `take` selects (true), in both generations; a sealed batch left
    /// empty forgets its ticket.
    pub(crate) fn take_where(&mut self, mut take: impl FnMut(&Kept) -> bool) {
        let mut out = |v: &mut Vec<Kept>, bytes: &mut usize| {
            v.retain(|k| {
                let taken = take(k);
                if taken {
                    *bytes -= k.bytes();
                }
                !taken
            })
        };
        out(&mut self.sealed, &mut self.sealed_bytes);
        out(&mut self.open, &mut self.open_bytes);
        if self.sealed.is_empty() {
            self.ticket = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept free whose first granule stands for its identity, of `bytes` (whole granules).
    fn fr(first: u32, bytes: usize) -> Kept {
        Kept { sb: std::ptr::null(), first, granules: (bytes >> GRANULE_SHIFT) as u32 }
    }

    #[test]
    fn half_a_batch_is_sealed_and_a_whole_one_settled() {
        let mut k = LegacyKept::default();
        // A batch of 4 blocks or 2000 bytes.
        assert_eq!(k.push(fr(1, 256), 4, 2000), Next::Keep);
        assert_eq!(k.push(fr(2, 256), 4, 2000), Next::Seal);
        k.seal(7);
        assert_eq!(k.sealed_ticket(), Some(7));
        assert_eq!(k.push(fr(3, 256), 4, 2000), Next::Keep);
        assert_eq!(k.push(fr(4, 256), 4, 2000), Next::Settle(7));
        // Covered: the sealed half goes, the rest is sealed in its place.
        let sealed: Vec<u32> = k.take_sealed().iter().map(|f| f.first).collect();
        assert_eq!(sealed, [1, 2]);
        assert_eq!(k.sealed_ticket(), None);
        k.seal(9);
        assert_eq!(k.iter().map(|f| f.first).collect::<Vec<_>>(), [3, 4]);
        // The byte bound (6 granules here) makes a whole batch too: not covered, an action takes everything.
        assert_eq!(k.push(fr(5, 1536), 4, 2000), Next::Settle(9));
        let all: Vec<u32> = k.take_all().iter().map(|f| f.first).collect();
        assert_eq!(all, [3, 4, 5]);
        assert!(k.is_empty() && k.sealed_ticket().is_none());
        assert_eq!((k.open_bytes, k.sealed_bytes), (0, 0));
    }

    #[test]
    fn a_whole_batch_with_nothing_sealed_is_acted_on() {
        let mut k = LegacyKept::default();
        // A batch of one block: every free makes a whole batch, as before halves.
        assert_eq!(k.push(fr(1, 256), 1, 1 << 20), Next::Act);
        assert_eq!(k.take_all().len(), 1);
        // A byte bound reached before half the blocks, with nothing sealed.
        assert_eq!(k.push(fr(2, 4096), 64, 4096), Next::Act);
    }

    #[test]
    fn taking_frees_out_keeps_the_byte_counts_and_forgets_an_emptied_ticket() {
        let mut k = LegacyKept::default();
        k.push(fr(1, 256), 4, 1 << 20);
        k.push(fr(2, 512), 4, 1 << 20);
        k.seal(3);
        k.push(fr(3, 256), 4, 1 << 20);
        k.take_where(|f| f.first == 2);
        assert_eq!((k.sealed_bytes, k.open_bytes, k.sealed_ticket()), (256, 256, Some(3)));
        k.take_where(|f| f.first == 1);
        assert_eq!(k.sealed_ticket(), None, "an emptied sealed batch has no ticket");
        assert_eq!(k.iter().map(|f| f.first).collect::<Vec<_>>(), [3]);
    }
}
