//! The shared face of an arena: what other threads may touch while its owner runs. It sits
//! below both the arena (`arena.rs`, the owner-only part) and the global pool, which hands a
//! superblock's owner pointer to frees (`superblock.rs`), so neither names the other: as a
//! slab's shared page state is apart from its local one.
//!
//! Invariants: a shell lives as long as its allocator (shells are kept in the allocator's list
//! and reused by later arenas), so a raw pointer to one, such as a superblock's `owner`, never
//! dangles; its `arena` pointer is non-null exactly while an arena uses it.

use crate::claim::Claim;
use crate::fence::Fence;
use crate::inbox::Inbox;
use crate::sync::AtomicPtr;
use std::sync::Arc;

/// A block freed remotely: its address and the size given to the free.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Freed {
    pub(crate) ptr: u64,
    pub(crate) size: usize,
}

/// Remote frees sent together under one fence (`None`: none is needed, as with fencing off for a
/// test, or the frees were parked and a device synchronise followed them).
pub(crate) struct Batch {
    pub(crate) fence: Option<Arc<Fence>>,
    pub(crate) blocks: Vec<Freed>,
}

/// The owner-only arena, as the shell holds it: opaque here (only `allocator.rs`, which
/// publishes and takes it, knows it is an `arena::Arena`).
pub(crate) enum OpaqueArena {}

/// The part of an arena other threads may touch: its inbox (remote frees arrive there), and
/// the claim through which a reclaimer may take the arena from an idle owner (`claim.rs`).
#[derive(Default)]
pub(crate) struct ArenaShell {
    pub(crate) inbox: Inbox<Batch>,
    pub(crate) claim: Claim,
    /// The arena using this shell, or null. Written by the owner: set (`Release`) when the arena
    /// is made (`OwnedArena::new`, before the owner first enters the claim), cleared at exit
    /// inside the claim. A reclaimer may load it as a hint before it tries the claim, and uses
    /// it only as loaded (`Acquire`) while it holds the claim.
    pub(crate) arena: AtomicPtr<OpaqueArena>,
}
