//! Model of a user-stream arena whose stream is destroyed while it holds memory freed there
//! (`allocator.rs`, "Arenas of destroyed streams"): the arena is parked at thread exit, and its
//! memory reaches another stream only after a device synchronise, while an out-of-memory
//! allocation and a blocking trim race to give the parked arenas back.
#![cfg(loom)]

use cuarena::{Allocator, Config, Error, Stream};
use loom::thread;
use loom_tests::common::{SB, model, park_an_arena, setup_one_superblock, setup_one_superblock_batched};
use loom_tests::model::ModelDevice;
use std::sync::Arc;

#[test]
fn a_destroyed_streams_arena_is_reused_only_after_a_synchronise() {
    model(|| {
        let (dev, a) = setup_one_superblock();
        let s = Stream::from_raw(0x100);
        // The owner: a block on its user stream, freed there (no event: the fast path), the
        // stream destroyed, the thread gone: its arena must be parked.
        park_an_arena(&a, &dev, s);
        assert_eq!(a.parked_bytes(), SB, "the arena of the destroyed stream is parked");
        // Two threads race to give it back: an allocation that finds the pool empty, and a
        // blocking trim. Whoever gets the memory must have synchronised the device first.
        let (a2, d2) = (a.clone(), dev.clone());
        let alloc = thread::spawn(move || {
            let r = a2.allocate_per_thread(SB / 2);
            if let Ok(q) = r {
                assert!(
                    d2.syncs() > 0 || d2.caught_up(),
                    "memory of a destroyed stream reused unsynchronised"
                );
                a2.deallocate_per_thread(q, SB / 2).unwrap();
            } else {
                // Out of memory only while the trim holds the parked arena on its way back.
                assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
            }
            a2.release_thread().unwrap();
        });
        let a3 = a.clone();
        let trim = thread::spawn(move || {
            a3.trim(true).unwrap();
            a3.release_thread().unwrap();
        });
        alloc.join().unwrap();
        trim.join().unwrap();
        a.trim(true).unwrap();
        a.check_invariants();
        assert_eq!(a.parked_bytes(), 0);
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
        assert_eq!(a.stats().live_bytes, 0);
    });
}

/// Model of a remote free on a user stream whose batch cannot wait for a call on its stream
/// (`outbox.rs`, "Frees on user streams"): the freeing thread destroys the stream and exits,
/// its batch is parked, and the owner gets the block back only after a device synchronise,
/// while a blocking trim races to give the parked memory back.
#[test]
fn a_parked_user_stream_free_is_reused_only_after_a_synchronise() {
    model(|| {
        // Batches of two: the one free waits in its batch.
        let (dev, a) = setup_one_superblock_batched(2);
        let s = Stream::from_raw(0x100);
        // The owner's superblock: two halves, both handed out.
        let p = a.allocate_per_thread(SB / 2).unwrap();
        let q = a.allocate_per_thread(SB / 2).unwrap();
        {
            let (a, dev) = (a.clone(), dev.clone());
            thread::spawn(move || {
                a.deallocate(p, SB / 2, s).unwrap(); // remote, on a user stream: batched
                dev.destroy_stream(s);
                a.release_thread().unwrap(); // the batch cannot be fenced: parked
            })
            .join()
            .unwrap();
        }
        assert_eq!(a.parked_free_bytes(), SB / 2, "the user-stream batch is parked");
        let a3 = a.clone();
        let trim = thread::spawn(move || {
            a3.trim(true).unwrap();
            a3.release_thread().unwrap();
        });
        // The owner needs `p`'s half again: it gets it only once the parked free has arrived,
        // which must follow a synchronise (its own out-of-memory reclaim's, or the trim's).
        match a.allocate_per_thread(SB / 2) {
            Ok(r) => {
                assert!(dev.syncs() > 0 || dev.caught_up(), "a parked free reused unsynchronised");
                a.deallocate_per_thread(r, SB / 2).unwrap();
            }
            // Out of memory only while the trim holds the parked frees on their way.
            Err(e) => assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}"),
        }
        trim.join().unwrap();
        a.deallocate_per_thread(q, SB / 2).unwrap();
        a.release_thread().unwrap();
        a.trim(true).unwrap();
        a.check_invariants();
        assert_eq!((a.parked_bytes(), a.parked_free_bytes()), (0, 0));
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
        assert_eq!(a.stats().live_bytes, 0);
    });
}

/// Adoption of a parked arena (`Slot::new_user_arena`): two arenas are parked with memory
/// freed on their streams, one stream alive (`s`), one destroyed (`t`); the pool has no room
/// left. A thread allocating on `s` adopts `s`'s arena and may reuse its memory at once (the
/// same stream orders it), while another allocates on a third stream `u`, which adopts
/// nothing and gets memory only after a synchronise (its out-of-memory path buries what is
/// still parked), or runs out of memory if the first thread holds it all. The mutation
/// `adopt_any_parked` (adopt whatever is parked) fails it: `u` takes another stream's memory
/// unsynchronised.
#[test]
fn a_parked_arena_is_adopted_only_by_its_own_stream() {
    model(|| {
        let dev = Arc::new(ModelDevice::new(SB as u64, 2 * SB as u64));
        let cfg = Config::builder()
            .superblock(SB)
            .small_max(SB / 2)
            .chunk(SB)
            .max_bytes(2 * SB)
            .keep_empty(8)
            .build()
            .expect("a valid model config");
        let a = Allocator::new(dev.clone(), cfg).expect("allocator");
        let (s, t, u) = (Stream::from_raw(0x100), Stream::from_raw(0x200), Stream::from_raw(0x300));
        // Set up on this thread, before the race: each arena parked by a release. The second
        // stream must not get the first's parked memory (no synchronise has been made).
        let mut first = None;
        for (stream, destroy) in [(s, false), (t, true)] {
            let p = a.allocate(SB / 2, stream).unwrap();
            assert!(first.is_none_or(|f| f != p), "parked memory of another stream reused unsynchronised");
            first = Some(p);
            a.deallocate(p, SB / 2, stream).unwrap();
            if destroy {
                dev.destroy_stream(stream);
            }
            a.release_thread().unwrap();
        }
        assert_eq!(a.parked_bytes(), 2 * SB, "both arenas parked");
        let a2 = a.clone();
        let adopt = thread::spawn(move || {
            // Adopted, or, if the other thread's reclaim buried it first, a new arena.
            match a2.allocate(SB / 2, s) {
                Ok(q) => a2.deallocate(q, SB / 2, s).unwrap(),
                Err(e) => assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}"),
            }
            a2.release_thread().unwrap();
        });
        match a.allocate(SB / 2, u) {
            Ok(r) => {
                assert!(
                    dev.syncs() > 0 || dev.caught_up(),
                    "parked memory reused on another stream unsynchronised"
                );
                a.deallocate(r, SB / 2, u).unwrap();
            }
            Err(e) => assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}"),
        }
        adopt.join().unwrap();
        a.release_thread().unwrap();
        a.trim(true).unwrap();
        a.check_invariants();
        assert_eq!((a.parked_bytes(), a.parked_free_bytes()), (0, 0));
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
        assert_eq!(a.stats().live_bytes, 0);
    });
}
