//! Loom models of cuarena's lock-free protocols. The models are in `tests/`; this crate holds
//! what they share, and [`model::ModelDevice`], the device they run on. Build with
//! `RUSTFLAGS="--cfg loom"`; see `README.md`.

pub mod model;

#[cfg(loom)]
pub mod common {
    use std::sync::Arc;

    use crate::model::ModelDevice;
    use cuarena::{Allocator, Config};

    /// Superblocks of 64 KiB (the smallest allowed), so the registry and the device stay tiny.
    pub const SB: usize = 64 << 10;

    /// A model device and an allocator over it: 8 superblocks of room, remote frees sent one
    /// at a time (so every free crosses the inbox at once).
    pub fn setup(keep_empty: usize, sparse: f64) -> (Arc<ModelDevice>, Allocator) {
        setup_batched(keep_empty, sparse, 1)
    }

    /// [`setup`] with remote frees gathered `batch` at a time (so a free can wait in an outbox).
    pub fn setup_batched(keep_empty: usize, sparse: f64, batch: usize) -> (Arc<ModelDevice>, Allocator) {
        setup_sized(SB, 8, keep_empty, sparse, batch)
    }

    /// [`setup`] with the owner's legacy-stream frees kept back `legacy_batch` at a time.
    pub fn setup_legacy(legacy_batch: usize) -> (Arc<ModelDevice>, Allocator) {
        let dev = Arc::new(ModelDevice::new(SB as u64, (8 * SB) as u64));
        let cfg = Config::builder()
            .superblock(SB)
            .small_max(SB / 2)
            .chunk(SB)
            .max_bytes(8 * SB)
            .legacy_batch_blocks(legacy_batch)
            .build()
            .expect("a valid model config");
        let a = Allocator::new(dev.clone(), cfg).expect("allocator");
        (dev, a)
    }

    /// [`setup_legacy`] (batches of one) with no large superblocks: a request over `SB / 2` is
    /// the global pool's.
    pub fn setup_legacy_pool() -> (Arc<ModelDevice>, Allocator) {
        let dev = Arc::new(ModelDevice::new(SB as u64, (8 * SB) as u64));
        let cfg = Config::builder()
            .superblock(SB)
            .small_max(SB / 2)
            .no_large()
            .chunk(SB)
            .max_bytes(8 * SB)
            .legacy_batch_blocks(1)
            .build()
            .expect("a valid model config");
        let a = Allocator::new(dev.clone(), cfg).expect("allocator");
        (dev, a)
    }

    /// One superblock of room in all, so a second thread can only get memory a parked arena
    /// gives back; no superblock goes back by the return rule (`keep_empty` 8).
    pub fn setup_one_superblock() -> (Arc<ModelDevice>, Allocator) {
        setup_one_superblock_batched(1)
    }

    /// [`setup_one_superblock`] with remote frees in batches of `batch` blocks.
    pub fn setup_one_superblock_batched(batch: usize) -> (Arc<ModelDevice>, Allocator) {
        let dev = Arc::new(ModelDevice::new(SB as u64, SB as u64));
        let cfg = Config::builder()
            .superblock(SB)
            .small_max(SB / 2)
            .chunk(SB)
            .max_bytes(SB)
            .batch_blocks(batch)
            .keep_empty(8)
            .build()
            .expect("a valid model config");
        (dev.clone(), Allocator::new(dev, cfg).expect("allocator"))
    }

    /// A thread allocates half a superblock on the user stream `s`, frees it there (no event:
    /// the fast path), destroys the stream and ends: its arena is parked until a device
    /// synchronise.
    pub fn park_an_arena(a: &Allocator, dev: &Arc<ModelDevice>, s: cuarena::Stream) {
        let (a, dev) = (a.clone(), dev.clone());
        loom::thread::spawn(move || {
            let p = a.allocate(SB / 2, s).unwrap();
            a.deallocate(p, SB / 2, s).unwrap();
            dev.destroy_stream(s);
            a.release_thread().unwrap();
        })
        .join()
        .unwrap();
    }

    /// [`setup_batched`] with superblocks of `sb` bytes and room for `superblocks` of them.
    pub fn setup_sized(
        sb: usize,
        superblocks: usize,
        keep_empty: usize,
        sparse: f64,
        batch: usize,
    ) -> (Arc<ModelDevice>, Allocator) {
        let dev = Arc::new(ModelDevice::new(sb as u64, (superblocks * sb) as u64));
        let cfg = Config::builder()
            .superblock(sb)
            .small_max(sb / 2)
            .chunk(sb)
            .max_bytes(superblocks * sb)
            .batch_blocks(batch)
            .keep_empty(keep_empty)
            .sparse_fraction(sparse)
            .build()
            .expect("a valid model config");
        let a = Allocator::new(dev.clone(), cfg).expect("allocator");
        (dev, a)
    }

    /// Every byte back in the pool, nothing refused, invariants intact.
    pub fn assert_all_returned(a: &Allocator) {
        a.release_thread().expect("release");
        a.check_invariants();
        let s = a.stats();
        assert_eq!(s.invalid_frees, 0, "a free was lost: {:?}", a.take_deferred_error());
        assert_eq!(s.live_bytes, 0);
        assert_eq!(a.pool_in_use(), 0, "{:?}", a.pool_used_ranges());
    }

    /// Runs a model. The real allocator takes many more steps per execution than loom's
    /// default branch limit allows; `LOOM_MAX_PREEMPTIONS` and the other `LOOM_*` variables
    /// still apply.
    pub fn model(f: impl Fn() + Sync + Send + 'static) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let mut b = loom::model::Builder::new();
        if std::env::var("LOOM_MAX_BRANCHES").is_err() {
            b.max_branches = 100_000;
        }
        let runs = std::sync::Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        b.check(move || {
            r.fetch_add(1, Ordering::Relaxed);
            f()
        });
        eprintln!("explored {} executions", runs.load(Ordering::Relaxed));
    }

    /// Spins (yielding to loom) until `f` returns `Some`.
    pub fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
        loop {
            if let Some(v) = f() {
                return v;
            }
            loom::thread::yield_now();
        }
    }
}
