//! Models of CUDA graph pools (`src/graph_pool.rs`) driving the real allocator: a pool's block
//! freed by a thread that got its address from the allocating thread is found by the free (the
//! pools' address span is widened before any block of a new segment is handed out; the
//! mutation `graph_flag_unset` leaves it empty), and a pool's last release
//! racing its last free retires it exactly once, so all its memory comes back.
#![cfg(loom)]

use cuarena::{DeviceAddr, GraphPoolId, Stream};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use loom_tests::common::{assert_all_returned, model, setup, wait_for};
use std::sync::Arc;

/// A user stream's handle (the model device answers its capture and identity queries).
fn s() -> Stream {
    Stream::from_raw(0x10)
}

#[test]
fn a_graph_block_freed_by_another_thread_is_taken_back_by_its_pool() {
    model(|| {
        let (_dev, a) = setup(8, 0.9);
        let id = GraphPoolId(1, 1);
        let shared = Arc::new(AtomicU64::new(0));
        let (a2, s2) = (a.clone(), shared.clone());
        let t = thread::spawn(move || {
            a2.graph_pool_retain(id);
            let p = a2.graph_allocate(id, 4096, s()).unwrap();
            s2.store(p.0, Ordering::Release);
            a2.release_thread().unwrap();
        });
        let p = wait_for(|| Some(shared.load(Ordering::Acquire)).filter(|&v| v != 0));
        a.deallocate(DeviceAddr(p), 4096, s()).expect("the pool takes its block back");
        t.join().unwrap();
        assert!(a.graph_pool_live(id).unwrap().is_empty());
        a.graph_pool_release(id).unwrap();
        a.trim(true).unwrap(); // the retired pool's segment, after a synchronise
        assert_eq!(a.graph_pool_bytes(), 0);
        assert_all_returned(&a);
    });
}

#[test]
fn a_pools_last_release_racing_its_last_free_retires_it_once() {
    model(|| {
        let (_dev, a) = setup(8, 0.9);
        let id = GraphPoolId(2, 0);
        a.graph_pool_retain(id);
        let p = a.graph_allocate(id, 4096, s()).unwrap();
        let a2 = a.clone();
        let t = thread::spawn(move || {
            a2.graph_pool_release(id).unwrap();
            a2.release_thread().unwrap();
        });
        a.deallocate(p, 4096, s()).unwrap();
        t.join().unwrap();
        assert!(a.graph_pool_release(id).is_err(), "released once");
        a.trim(true).unwrap();
        assert_eq!(a.graph_pool_bytes(), 0);
        assert_all_returned(&a);
    });
}
