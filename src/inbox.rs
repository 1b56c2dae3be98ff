//! An arena's inbox: a lock-free multi-producer stack of batches that the owner takes whole.
//!
//! ## Protocol
//! - `head` is null (empty), a node pointer (a list of pushed batches), or the `closed()` marker.
//! - **push** (any thread): CAS the new node in front of `head` with `Release`, so the batch's
//!   contents are visible to whoever takes the node (the failure ordering is `Relaxed`: a failed
//!   CAS only learns the head to retry with). If `head` is `CLOSED`, push fails and hands the
//!   batch back: the caller then frees the blocks through the global pool.
//! - **take** (owner): `swap(null, Acquire)` takes every node pushed so far, pairing with the
//!   pushes' `Release`.
//! - **close** (owner, at exit): `swap(CLOSED, Acquire)` takes the rest and refuses later pushes.
//! - **reopen** (a new owner of a recycled shell): `CLOSED -> null`.
//!
//! No node is ever popped singly, so there is no ABA: a node is reachable from `head` from its
//! push until the one swap that takes it, and is owned by exactly one thread at a time.
//! Loom model: `loom-tests/tests/inbox.rs`.

use crate::sync::{AtomicPtr, Ordering, UnsafeCell, ordering};

struct Node<T> {
    /// Written by the pusher before publication, taken by the owner after (a tracked cell, so
    /// loom checks the hand-off).
    value: UnsafeCell<Option<T>>,
    next: *mut Node<T>,
}

impl<T> Node<T> {
    fn take(&self) -> T {
        // SAFETY: only the single thread that owns the node (the pusher before publication, or
        // the taker after its swap) calls this.
        self.value.with_mut(|v| unsafe { (*v).take() }).expect("a node's value is taken once")
    }
}

/// The marker of a closed inbox. Never dereferenced; no `Box` can have this address.
fn closed<T>() -> *mut Node<T> {
    std::ptr::dangling_mut::<Node<T>>().wrapping_byte_add(1)
}

/// A multi-producer stack drained whole by its owner.
pub struct Inbox<T> {
    head: AtomicPtr<Node<T>>,
}

// SAFETY: values move between threads through the stack; the Release/Acquire pairs above make
// each node's contents visible to the thread that takes it.
unsafe impl<T: Send> Send for Inbox<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Inbox<T> {}

impl<T> Default for Inbox<T> {
    fn default() -> Self {
        Inbox { head: AtomicPtr::new(std::ptr::null_mut()) }
    }
}

impl<T> Inbox<T> {
    /// Pushes `value`, or gives it back if the inbox is closed.
    pub fn push(&self, value: T) -> Result<(), T> {
        let node = Box::into_raw(Box::new(Node { value: UnsafeCell::new(None), next: std::ptr::null_mut() }));
        // SAFETY: the node is ours alone until the CAS below publishes it.
        unsafe { (*node).value.with_mut(|v| *v = Some(value)) };
        // Start from an assumed-empty head: the CAS fails with the real head if not. (No
        // leading load: one atomic on an empty inbox, and nothing that hides this CAS from
        // loom's conflict tracking; see loom-tests/README.md.)
        let mut head = std::ptr::null_mut();
        loop {
            if head == closed() {
                // SAFETY: `node` came from Box::into_raw above and was never shared.
                let node = unsafe { Box::from_raw(node) };
                return Err(node.take());
            }
            // SAFETY: `node` is still exclusively ours until the CAS publishes it.
            unsafe { (*node).next = head };
            let publish = ordering!(Ordering::Release, "inbox_push_relaxed" => Ordering::Relaxed);
            match self.head.compare_exchange(head, node, publish, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(h) => head = h,
            }
        }
    }

    /// True if nothing is waiting (a hint: a push may land right after).
    pub fn is_empty(&self) -> bool {
        let h = self.head.load(Ordering::Relaxed);
        h.is_null() || h == closed()
    }

    /// Takes every value pushed so far (most recent first).
    /// Does nothing on a closed inbox (it stays closed).
    pub fn take_all(&self) -> Vec<T> {
        // Only the owner closes or reopens, and the owner is here: a head that is not closed
        // now cannot become closed before the swap; pushes may only add nodes.
        let h = self.head.load(Ordering::Relaxed);
        if h.is_null() || h == closed() {
            return Vec::new();
        }
        let acquire = ordering!(Ordering::Acquire, "inbox_take_relaxed" => Ordering::Relaxed);
        Self::collect(self.head.swap(std::ptr::null_mut(), acquire))
    }

    /// Closes the inbox and takes what it held. Later pushes fail.
    pub fn close(&self) -> Vec<T> {
        let h = self.head.swap(closed(), Ordering::Acquire);
        if h == closed() { Vec::new() } else { Self::collect(h) }
    }

    /// Opens a closed inbox again for a new owner.
    pub fn reopen(&self) {
        let _ =
            self.head.compare_exchange(closed(), std::ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed);
    }

    fn collect(mut h: *mut Node<T>) -> Vec<T> {
        let mut out = Vec::new();
        while !h.is_null() {
            // SAFETY: the swap made us the only owner of this list; each node came from
            // Box::into_raw in `push`, and the Acquire swap saw its initialisation.
            let node = unsafe { Box::from_raw(h) };
            h = node.next;
            out.push(node.take());
        }
        out
    }
}

impl<T> Drop for Inbox<T> {
    fn drop(&mut self) {
        let h = self.head.swap(std::ptr::null_mut(), Ordering::Acquire);
        if h != closed() {
            drop(Self::collect(h));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn pushes_are_taken_once_and_close_refuses() {
        let ib = Inbox::default();
        ib.push(1).unwrap();
        ib.push(2).unwrap();
        assert_eq!(ib.take_all(), vec![2, 1]);
        assert!(ib.is_empty());
        ib.push(3).unwrap();
        assert_eq!(ib.close(), vec![3]);
        assert_eq!(ib.push(4), Err(4));
        assert!(ib.take_all().is_empty(), "a closed inbox gives nothing");
        assert_eq!(ib.push(4), Err(4), "and stays closed");
        ib.reopen();
        ib.push(5).unwrap();
        assert_eq!(ib.take_all(), vec![5]);
    }

    #[test]
    fn concurrent_pushes_all_arrive() {
        let ib = std::sync::Arc::new(Inbox::default());
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let ib = ib.clone();
                std::thread::spawn(move || (0..10_000).for_each(|i| ib.push(t * 10_000 + i).unwrap()))
            })
            .collect();
        let mut got = Vec::new();
        while got.len() < 40_000 {
            got.extend(ib.take_all());
        }
        hs.into_iter().for_each(|h| h.join().unwrap());
        got.sort();
        assert_eq!(got, (0..40_000).collect::<Vec<_>>());
    }
}
