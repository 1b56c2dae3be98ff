//! CUDA graph capture on a real GPU (issue 11, item 5), through the driver API
//! (`cuStreamBeginCapture` in the global and thread-local modes). Ignored without a GPU; run
//! with `cargo test --test gpu_capture -- --include-ignored` (`CUARENA_REQUIRE_GPU=1` makes "no
//! driver" a failure).
//!
//! What each test checks: while a stream is being captured, cuarena's allocations and frees
//! (on the capturing thread and on other threads, including ones that grow the pool with
//! `cuMemAlloc`, a call CUDA forbids during a global-mode capture unless the calling thread is
//! in the relaxed mode) never invalidate the capture: `cuStreamEndCapture` succeeds and the
//! graph instantiates and runs. Allocations and frees cuarena detects on the capturing stream
//! are refused with `Error::StreamCapturing`.

use std::sync::Arc;

use cuarena::device::cuda::check;
use cuarena::{Allocator, Config, CudaDevice, Error, Stream, StreamKey};
use cuarena_testkit::gpu_or_skip;
use cudarc::driver::sys;

/// Makes `dev`'s primary context current on this thread without touching its capture mode
/// (`CudaDevice::enter` would switch the thread to the relaxed mode for its guard's life).
fn make_current(dev: &CudaDevice) {
    // SAFETY: the primary context is retained by `dev`.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(dev.context()) }).unwrap();
}

fn create_stream() -> Stream {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer valid; flag 1 = CU_STREAM_NON_BLOCKING (as PyTorch's side streams).
    check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, 1) }).unwrap();
    Stream::from_raw(s as usize)
}

fn raw(s: Stream) -> sys::CUstream {
    s.as_raw() as sys::CUstream
}

/// Ends the capture of `s`, instantiates and launches the graph, and waits for it: every step
/// must succeed (an invalidated capture fails at `cuStreamEndCapture`).
fn end_and_run(s: Stream) {
    let mut graph = std::ptr::null_mut();
    // SAFETY: `s` is capturing; `graph` is a valid out-pointer.
    check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(raw(s), &mut graph) })
        .expect("the capture was invalidated");
    let mut exec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph.
    check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }).unwrap();
    // SAFETY: `exec` is instantiated, `s` is live.
    check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, raw(s)) }).unwrap();
    // SAFETY: `s` is live.
    check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw(s)) }).unwrap();
    // SAFETY: created above, destroyed once.
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
}

fn capture(mode: sys::CUstreamCaptureMode) {
    let Some(dev) = gpu_or_skip(0) else { return };
    make_current(&dev);
    let a = Allocator::new(Arc::clone(&dev) as Arc<dyn cuarena::Device>, Config::default()).unwrap();
    let s = create_stream();
    // Before the capture: a block on `s` for the graph's work, and a warm arena for `s`.
    let target = a.allocate(1 << 20, s).unwrap();
    let warm = a.allocate(4096, s).unwrap();
    a.deallocate(warm, 4096, s).unwrap();
    let pool_block = a.allocate(8 << 20, s).unwrap(); // a large block of `s`'s arena

    // SAFETY: `s` is a live stream of the current context.
    check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(raw(s), mode) }).unwrap();
    // The graph's work: a memset of `target`.
    // SAFETY: `target` is 1 MiB of device memory.
    check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(target.0, 7, 1 << 20, raw(s)) }).unwrap();

    // On the capturing stream: blocks the arena's fast path serves from its superblock are not
    // detected (no driver call there: documented); the slow path that needs a new superblock
    // is refused, within a few 900 KiB blocks (2 MiB superblocks).
    let mut undetected = Vec::new();
    loop {
        match a.allocate(900 << 10, s) {
            Ok(p) => undetected.push(p),
            Err(Error::StreamCapturing { .. }) => break,
            Err(e) => panic!("an allocation slow path on the capturing stream: {e}"),
        }
        assert!(undetected.len() <= 3, "no slow path within 3 blocks of 900 KiB");
    }
    match a.allocate(32 << 20, s) {
        Err(Error::StreamCapturing { .. }) => {}
        r => panic!("a pool allocation on the capturing stream: {r:?}"),
    }
    // A free on the capturing stream: refused (its identity cannot be asked), nothing changed.
    match a.deallocate(pool_block, 8 << 20, s) {
        Err(Error::StreamCapturing { .. }) => {}
        r => panic!("a free on the capturing stream: {r:?}"),
    }
    // This thread on the legacy stream, growing the pool with cuMemAlloc (forbidden on a
    // thread-local- or global-mode capturing thread unless relaxed): works, breaks nothing.
    let big = a.allocate(256 << 20, Stream::LEGACY).unwrap();
    a.deallocate(big, 256 << 20, Stream::LEGACY).unwrap();
    // Another thread allocating and freeing (its slow paths reserve, record and query events):
    // with a global-mode capture, unsafe calls from any thread would invalidate it.
    let a2 = a.clone();
    let d2 = Arc::clone(&dev);
    std::thread::spawn(move || {
        make_current(&d2);
        for i in 0..200usize {
            let n = 4096 + i * 1000;
            let p = a2.allocate_per_thread(n).unwrap();
            a2.deallocate(p, n, Stream::LEGACY).unwrap(); // cross-stream: batched, fenced
        }
        let p = a2.allocate_per_thread(300 << 20).unwrap();
        a2.deallocate_per_thread(p, 300 << 20).unwrap();
        a2.flush().unwrap();
        a2.trim(false).unwrap();
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();

    end_and_run(s);
    // After the capture, everything on `s` works again.
    for p in undetected {
        a.deallocate(p, 900 << 10, s).unwrap();
    }
    a.deallocate(pool_block, 8 << 20, s).unwrap();
    let p = a.allocate(200 << 10, s).unwrap();
    a.deallocate(p, 200 << 10, s).unwrap();
    a.deallocate(target, 1 << 20, s).unwrap();
    assert_eq!(a.take_deferred_error(), None);
    // SAFETY: `s` is idle (synchronised in `end_and_run`) and destroyed once.
    unsafe { sys::cuStreamDestroy_v2(raw(s)) };
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_global_mode_capture_is_never_broken() {
    capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_thread_local_mode_capture_is_never_broken() {
    capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
}

/// `Device::stream_capturing` on the GPU follows `cuStreamBeginCapture`/`cuStreamEndCapture`.
/// A capture announced (`graph_capture_begin`, as the PyTorch shim does) of a non-blocking
/// stream in the global mode: allocations on the legacy stream that the pool serves (every
/// request over `small_max` with `large_max=off`, the framework glue's setting), on this thread
/// and another, are served, reusing blocks freed on the legacy stream before and during the
/// capture, and the capture survives. Until the thirtieth session they were refused with
/// `StreamCapturing` while any capture was announced (helper-45, `tests/adversarial_s30_events.rs`).
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn an_announced_capture_serves_legacy_pool_allocations_and_survives() {
    let Some(dev) = gpu_or_skip(0) else { return };
    make_current(&dev);
    let cfg = Config::parse("large_max=off").unwrap();
    let a = Allocator::new(Arc::clone(&dev) as Arc<dyn cuarena::Device>, cfg).unwrap();
    let s = create_stream();
    let target = a.allocate(1 << 20, s).unwrap();
    let legacy_churn = |a: &Allocator| {
        for i in 0..40usize {
            let n = (2 << 20) + (i % 7) * (256 << 10);
            let p = a.allocate(n, Stream::LEGACY).expect("a legacy pool allocation");
            a.deallocate(p, n, Stream::LEGACY).unwrap();
        }
    };
    legacy_churn(&a); // pool blocks freed on the legacy stream before the capture
    a.graph_capture_begin();
    // SAFETY: `s` is a live stream of the current context.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(raw(s), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
    })
    .unwrap();
    // SAFETY: `target` is 1 MiB of device memory.
    check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(target.0, 7, 1 << 20, raw(s)) }).unwrap();
    legacy_churn(&a);
    let (a2, d2) = (a.clone(), Arc::clone(&dev));
    std::thread::spawn(move || {
        make_current(&d2);
        legacy_churn(&a2);
        a2.release_thread().unwrap();
    })
    .join()
    .unwrap();
    end_and_run(s);
    a.graph_capture_end().unwrap();
    a.deallocate(target, 1 << 20, s).unwrap();
    assert_eq!(a.take_deferred_error(), None);
    // SAFETY: `s` is idle (synchronised in `end_and_run`) and destroyed once.
    unsafe { sys::cuStreamDestroy_v2(raw(s)) };
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn stream_capturing_follows_the_driver() {
    use cuarena::Device;
    let Some(dev) = gpu_or_skip(0) else { return };
    make_current(&dev);
    let s = create_stream();
    assert!(!dev.stream_capturing(s).unwrap());
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: a live stream of the current context.
    check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(raw(s), mode) }).unwrap();
    assert!(dev.stream_capturing(s).unwrap());
    assert!(!dev.stream_capturing(Stream::LEGACY).unwrap());
    end_and_run(s);
    assert!(!dev.stream_capturing(s).unwrap());
    // SAFETY: idle, destroyed once.
    unsafe { sys::cuStreamDestroy_v2(raw(s)) };
}

/// A capture allocates in a graph pool (`Allocator::graph_allocate`) in the global mode, while
/// another thread allocates eagerly: the capture is not broken (the pool grows by `cuMemAlloc`
/// in the relaxed mode, with no event and no wait on the capturing stream), a block the capture
/// frees is reused by the capture on its stream, the graph runs and replays with its memory
/// intact while eager work churns elsewhere, eager blocks never land in the pool's memory, and
/// after the release and a blocking trim everything is back.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_capture_allocates_in_a_graph_pool_and_its_replays_keep_their_memory() {
    use cuarena::GraphPoolId;
    let Some(dev) = gpu_or_skip(0) else { return };
    make_current(&dev);
    let a = Allocator::new(Arc::clone(&dev) as Arc<dyn cuarena::Device>, Config::default()).unwrap();
    let (s, other) = (create_stream(), create_stream());
    let pool = GraphPoolId(42, 7);
    a.graph_pool_retain(pool);
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: `s` is a live stream of the current context.
    check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(raw(s), mode) }).unwrap();
    let words = |n: usize| n / 4;
    let (nx, ny, nz) = (1 << 20, 4 << 20, 96 << 20);
    let x = a.graph_allocate(pool, nx, s).unwrap();
    let y = a.graph_allocate(pool, ny, s).unwrap();
    // SAFETY: `y` holds `ny` bytes; the memset is captured on `s`.
    check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(y.0, 0x2222_2222, words(ny), raw(s)) }).unwrap();
    a.deallocate(y, ny, s).unwrap(); // a temporary, freed inside the capture
    let t = a.graph_allocate(pool, ny, s).unwrap();
    assert_eq!(t, y, "the capture's own free is reused on its stream");
    let z = a.graph_allocate(pool, nz, s).unwrap(); // grows the pool inside the capture
    // SAFETY: `t` holds `ny` bytes; captured on `s`.
    check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(t.0, 0x3333_3333, words(ny), raw(s)) }).unwrap();
    // SAFETY: `z` holds `nz` bytes; captured on `s`.
    check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(z.0, 0x4444_4444, words(nz), raw(s)) }).unwrap();
    // SAFETY: `x` holds `nx` bytes; captured on `s`.
    check("cuMemsetD32Async", unsafe { sys::cuMemsetD32Async(x.0, 0x1111_1111, words(nx), raw(s)) }).unwrap();
    a.deallocate(t, ny, s).unwrap();
    // Another thread allocates eagerly meanwhile (its slow paths reserve and fence).
    let a2 = a.clone();
    let d2 = Arc::clone(&dev);
    let graph_ranges = [(x.0, nx), (y.0, ny), (z.0, nz)];
    let eager = std::thread::spawn(move || {
        make_current(&d2);
        let mut seen = Vec::new();
        for i in 0..300usize {
            let n = 4096 + (i * 7919) % (8 << 20);
            let p = a2.allocate_per_thread(n).unwrap();
            seen.push((p.0, n));
            a2.deallocate(p, n, Stream::LEGACY).unwrap();
        }
        a2.flush().unwrap();
        a2.release_thread().unwrap();
        seen
    });
    let seen = eager.join().unwrap();
    let mut graph = std::ptr::null_mut();
    // SAFETY: `s` is capturing; `graph` is a valid out-pointer.
    check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(raw(s), &mut graph) })
        .expect("the capture was invalidated");
    let mut exec = std::ptr::null_mut();
    // SAFETY: `graph` is the captured graph.
    check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }).unwrap();
    let overlaps =
        |(p, n): (u64, usize)| graph_ranges.iter().any(|&(g, gn)| p < g + gn as u64 && g < p + n as u64);
    assert!(seen.iter().all(|&b| !overlaps(b)), "an eager block during the capture lay in graph memory");
    // Replays, with eager churn on another stream between them, writing every eager block.
    for round in 0..3 {
        // SAFETY: `exec` is instantiated, `s` is live.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, raw(s)) }).unwrap();
        for i in 0..100usize {
            let n = 4096 + (i * 104_729 + round) % (32 << 20);
            let p = a.allocate(n, other).unwrap();
            assert!(!overlaps((p.0, n)), "an eager block after the capture lay in graph memory");
            // SAFETY: `p` holds `n` bytes, on `other`.
            check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(p.0, 0xee, n, raw(other)) }).unwrap();
            a.deallocate(p, n, other).unwrap();
        }
        // SAFETY: `s` is live.
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(raw(s)) }).unwrap();
        let mut host = vec![0u32; words(nx)];
        // SAFETY: `x` holds `nx` bytes and the graph's work on it is done; `host` holds as many.
        check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), x.0, nx) }).unwrap();
        assert!(host.iter().all(|&w| w == 0x1111_1111), "round {round}: the graph's output was overwritten");
    }
    // SAFETY: idle after the synchronise; destroyed once.
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    let mut want = vec![x, z];
    want.sort_by_key(|p| p.0);
    assert_eq!(a.graph_pool_live(pool).unwrap(), want, "the graph's outputs live on");
    a.deallocate(x, nx, s).unwrap();
    a.deallocate(z, nz, s).unwrap();
    a.graph_pool_release(pool).unwrap();
    assert!(a.graph_pool_bytes() >= nz as u64, "parked until a synchronise");
    a.trim(true).unwrap();
    assert_eq!(a.graph_pool_bytes(), 0);
    assert_eq!(a.take_deferred_error(), None);
    a.check_invariants();
    // SAFETY: idle; destroyed once.
    unsafe {
        sys::cuStreamDestroy_v2(raw(s));
        sys::cuStreamDestroy_v2(raw(other));
    }
}

// ---------------------------------------------------------------------------------------------
// Captures of *blocking* streams. CUDA forbids any use of the legacy stream while a stream not
// created non-blocking is being captured (the legacy stream would wait for it), and such a use
// from any thread invalidates the capture. A per-thread default stream is such a stream too.
// So while thread A captures its blocking stream or its per-thread stream, cuarena's work for
// other threads that never name the legacy stream must not use it either, nor synchronise.

/// The stream a [`blocking_capture`] scenario captures.
#[derive(Clone, Copy, Debug)]
enum Captured {
    /// A stream created with no flags (`cudaStreamCreate`'s default, CuPy's streams).
    Blocking,
    /// The capturing thread's own per-thread default stream.
    PerThread,
}

fn create_blocking_stream() -> Stream {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer valid; flag 0 = a blocking stream.
    check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, 0) }).unwrap();
    Stream::from_raw(s as usize)
}

/// Begins a global-mode capture of `captured` on this thread, runs `work` on other threads
/// (it joins them), then ends the capture and runs the graph. `Err` names what failed.
fn under_capture(
    dev: &Arc<CudaDevice>,
    captured: Captured,
    watch: impl FnOnce(usize),
    work: impl FnOnce() -> cuarena::Result<()> + Send + 'static,
) -> std::result::Result<(), String> {
    make_current(dev);
    let s = match captured {
        Captured::Blocking => create_blocking_stream(),
        Captured::PerThread => Stream::PER_THREAD,
    };
    let mut target = 0;
    // SAFETY: out-pointer valid; a context is current.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut target, 1 << 20) }).unwrap();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // SAFETY: `s` is a live stream of the current context.
    check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(raw(s), mode) }).unwrap();
    // SAFETY: `target` is 1 MiB of device memory.
    check("cuMemsetD8Async", unsafe { sys::cuMemsetD8Async(target, 7, 1 << 20, raw(s)) }).unwrap();
    // Another thread cannot name this thread's per-thread stream: only a blocking one is watched.
    if let Captured::Blocking = captured {
        watch(s.as_raw());
    }
    let d2 = Arc::clone(dev);
    let worked = std::thread::spawn(move || {
        make_current(&d2);
        work()
    })
    .join();
    let mut graph = std::ptr::null_mut();
    // SAFETY: `s` is capturing; `graph` is a valid out-pointer.
    let ended = check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(raw(s), &mut graph) });
    let mut out = Ok(());
    match ended {
        Ok(()) => {
            let mut exec = std::ptr::null_mut();
            // SAFETY: `graph` is the captured graph; `exec` launched on the live `s`, then waited.
            unsafe {
                check("cuGraphInstantiate", sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)).unwrap();
                check("cuGraphLaunch", sys::cuGraphLaunch(exec, raw(s))).unwrap();
                check("cuStreamSynchronize", sys::cuStreamSynchronize(raw(s))).unwrap();
                sys::cuGraphExecDestroy(exec);
                sys::cuGraphDestroy(graph);
            }
        }
        Err(e) => out = Err(format!("the capture was invalidated ({e})")),
    }
    match worked {
        Ok(Ok(())) => {}
        Ok(Err(e)) => out = out.and(Err(format!("cuarena refused the work: {e}"))),
        Err(_) => out = out.and(Err("the work panicked".into())),
    }
    // SAFETY: nothing else uses `target` or `s` now (the graph ran and was waited for).
    unsafe {
        check("cuCtxSynchronize", sys::cuCtxSynchronize()).unwrap();
        sys::cuMemFree_v2(target);
        if let Captured::Blocking = captured {
            sys::cuStreamDestroy_v2(raw(s));
        }
    }
    out
}

fn churn_per_thread(a: &Allocator, n: usize) -> cuarena::Result<()> {
    for i in 0..n {
        let size = 256 + (i * 7919) % (1 << 20);
        let p = a.allocate_per_thread(size)?;
        a.deallocate_per_thread(p, size)?;
    }
    Ok(())
}

/// A [`CudaDevice`] that notes the first of cuarena's calls after which the capture of
/// `watched` (a raw stream handle; 0: none) is found invalidated, to name what broke it.
struct Watch {
    dev: Arc<CudaDevice>,
    watched: std::sync::atomic::AtomicUsize,
    first: std::sync::Mutex<Option<String>>,
}

impl Watch {
    fn after<T>(&self, what: impl FnOnce() -> String, r: T) -> T {
        let s = self.watched.load(std::sync::atomic::Ordering::Relaxed);
        let mut first = self.first.lock().unwrap();
        if s != 0 && first.is_none() {
            let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // SAFETY: `s` is live while watched; `st` is a valid out-pointer.
            unsafe { sys::cuStreamIsCapturing(s as sys::CUstream, &mut st) };
            if st == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED {
                *first = Some(what());
            }
        }
        r
    }
}

impl cuarena::Device for Watch {
    fn kind(&self) -> cuarena::DeviceKind {
        self.dev.kind()
    }
    fn ordinal(&self) -> i32 {
        self.dev.ordinal()
    }
    fn device_id(&self) -> u64 {
        self.dev.device_id()
    }
    fn total_memory(&self) -> cuarena::Result<usize> {
        self.dev.total_memory()
    }
    fn reserve(&self, bytes: usize) -> cuarena::Result<Option<u64>> {
        self.after(|| "reserve".into(), self.dev.reserve(bytes))
    }
    unsafe fn release(&self, ptr: u64, bytes: usize) -> cuarena::Result<()> {
        // SAFETY: forwarded from the caller.
        self.after(|| "release".into(), unsafe { self.dev.release(ptr, bytes) })
    }
    fn alloc_async(&self, bytes: usize, stream: Stream) -> cuarena::Result<Option<u64>> {
        self.after(|| format!("alloc_async on {stream:?}"), self.dev.alloc_async(bytes, stream))
    }
    unsafe fn free_async(&self, ptr: u64, bytes: usize, stream: Stream) -> cuarena::Result<()> {
        // SAFETY: forwarded from the caller.
        self.after(|| format!("free_async on {stream:?}"), unsafe { self.dev.free_async(ptr, bytes, stream) })
    }
    fn create_event(&self) -> cuarena::Result<cuarena::device::Event> {
        self.after(|| "create_event".into(), self.dev.create_event())
    }
    fn destroy_event(&self, event: cuarena::device::Event) {
        self.dev.destroy_event(event);
        self.after(|| "destroy_event".into(), ())
    }
    fn record_event(&self, event: cuarena::device::Event, stream: Stream) -> cuarena::Result<()> {
        self.after(|| format!("record_event on {stream:?}"), self.dev.record_event(event, stream))
    }
    fn query_event(&self, event: cuarena::device::Event) -> cuarena::Result<bool> {
        self.after(|| "query_event".into(), self.dev.query_event(event))
    }
    fn sync_event(&self, event: cuarena::device::Event) -> cuarena::Result<()> {
        self.after(|| "sync_event".into(), self.dev.sync_event(event))
    }
    fn synchronize(&self) -> cuarena::Result<()> {
        self.after(|| "synchronize".into(), self.dev.synchronize())
    }
    fn stream_wait_event(&self, stream: Stream, event: cuarena::device::Event) -> cuarena::Result<()> {
        self.after(|| format!("stream_wait_event on {stream:?}"), self.dev.stream_wait_event(stream, event))
    }
    fn stream_key(&self, stream: Stream) -> cuarena::Result<StreamKey> {
        self.after(|| format!("stream_key of {stream:?}"), self.dev.stream_key(stream))
    }
    fn stream_key_calls(&self, stream: Stream, answer: &cuarena::Result<StreamKey>) -> u64 {
        self.dev.stream_key_calls(stream, answer)
    }
    fn stream_capturing(&self, stream: Stream) -> cuarena::Result<bool> {
        self.after(|| format!("stream_capturing of {stream:?}"), self.dev.stream_capturing(stream))
    }
}

/// A named piece of work for [`blocking_capture`], given a warm allocator.
type Scenario = (&'static str, fn(Allocator, Arc<CudaDevice>) -> cuarena::Result<()>);

/// What other threads do through cuarena on their per-thread and non-blocking streams while a
/// blocking stream or a per-thread stream is captured: each scenario under its own capture.
fn blocking_capture(captured: Captured) {
    let Some(dev) = gpu_or_skip(0) else { return };
    let scenarios: [Scenario; 7] = [
        ("per-thread churn, small and large", |a, _| {
            churn_per_thread(&a, 300)?;
            for _ in 0..3 {
                let p = a.allocate_per_thread(64 << 20)?;
                a.deallocate_per_thread(p, 64 << 20)?;
            }
            a.release_thread()
        }),
        ("frees across a thread's per-thread and non-blocking streams", |a, _| {
            let u = create_stream();
            for i in 0..200usize {
                let n = 4096 + i * 1000;
                let p = a.allocate_per_thread(n)?;
                a.deallocate(p, n, u)?;
                let q = a.allocate(n, u)?;
                a.deallocate_per_thread(q, n)?;
            }
            a.flush()?;
            a.trim(false)?;
            a.release_thread()?;
            // SAFETY: the stream's work is queued; destroying it is deferred by CUDA until done.
            unsafe { sys::cuStreamDestroy_v2(raw(u)) };
            Ok(())
        }),
        ("frees to another thread, and reuse of what it sent back", |a, dev| {
            let blocks: Vec<_> = (0..500usize)
                .map(|i| (i * 4099) % (256 << 10) + 64)
                .map(|n| a.allocate_per_thread(n).map(|p| (p, n)))
                .collect::<cuarena::Result<_>>()?;
            let a2 = a.clone();
            std::thread::spawn(move || {
                make_current(&dev);
                for (p, n) in blocks {
                    a2.deallocate_per_thread(p, n)?;
                }
                a2.flush()?;
                a2.release_thread()
            })
            .join()
            .unwrap()?;
            churn_per_thread(&a, 1000)?;
            a.release_thread()
        }),
        ("a thread exits with its blocks held by another, which frees them after", |a, dev| {
            let a2 = a.clone();
            let blocks = std::thread::spawn(move || {
                make_current(&dev);
                (0..100usize)
                    .map(|i| 512 + i * 3001)
                    .map(|n| a2.allocate_per_thread(n).map(|p| (p, n)))
                    .collect::<cuarena::Result<Vec<_>>>()
            })
            .join()
            .unwrap()?;
            for (p, n) in blocks {
                a.deallocate_per_thread(p, n)?;
            }
            churn_per_thread(&a, 300)?;
            a.release_thread()
        }),
        ("own non-blocking stream churn, then the stream destroyed", |a, _| {
            let u = create_stream();
            for i in 0..300usize {
                let n = 256 + (i * 7919) % (1 << 20);
                let p = a.allocate(n, u)?;
                a.deallocate(p, n, u)?;
            }
            a.release_thread()?;
            // SAFETY: destroyed once; CUDA defers the destruction until its work is done.
            unsafe { sys::cuStreamDestroy_v2(raw(u)) };
            Ok(())
        }),
        ("out of memory, with an idle thread's per-thread arena to reclaim", |a, dev| {
            // An idle thread holds freed memory in its arena (it stays alive, parked).
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<cuarena::Result<()>>();
            let a2 = a.clone();
            let idle = std::thread::spawn(move || {
                make_current(&dev);
                let r = (|| {
                    let ps: Vec<_> =
                        (0..64).map(|_| a2.allocate_per_thread(512 << 10)).collect::<cuarena::Result<_>>()?;
                    ps.into_iter().try_for_each(|p| a2.deallocate_per_thread(p, 512 << 10))
                })();
                ready_tx.send(r).unwrap();
                let _ = rx.recv();
                a2.release_thread()
            });
            ready_rx.recv().unwrap()?;
            a.set_limit_bytes(a.stats().reserved_bytes as usize);
            // Needs what the idle thread holds: the out-of-memory path reclaims it.
            let r = a.allocate_per_thread(24 << 20).and_then(|p| a.deallocate_per_thread(p, 24 << 20));
            a.set_limit_bytes(usize::MAX);
            tx.send(()).unwrap();
            idle.join().unwrap()?;
            match r {
                Ok(()) | Err(Error::OutOfMemory { .. }) => a.release_thread(),
                Err(e) => Err(e),
            }
        }),
        ("out of memory with a destroyed stream's memory, and a blocking trim", |a, _| {
            let u = create_stream();
            let ps: Vec<_> = (0..32).map(|_| a.allocate(512 << 10, u)).collect::<cuarena::Result<_>>()?;
            ps.into_iter().try_for_each(|p| a.deallocate(p, 512 << 10, u))?;
            // SAFETY: destroyed once; its memory in the arena now waits for a synchronise.
            unsafe { sys::cuStreamDestroy_v2(raw(u)) };
            a.set_limit_bytes(a.stats().reserved_bytes as usize);
            let r = a.allocate_per_thread(24 << 20).and_then(|p| a.deallocate_per_thread(p, 24 << 20));
            a.set_limit_bytes(usize::MAX);
            match r {
                Ok(()) | Err(Error::OutOfMemory { .. }) => {}
                Err(e) => return Err(e),
            }
            a.trim(true)?;
            a.release_thread()
        }),
    ];
    let mut broken = Vec::new();
    for (name, work) in scenarios {
        let watch = Arc::new(Watch { dev: Arc::clone(&dev), watched: 0.into(), first: None.into() });
        let a = Allocator::new(Arc::clone(&watch) as Arc<dyn cuarena::Device>, Config::default()).unwrap();
        // Warm: the pool holds a chunk before the capture (its first growth happens anyway).
        let p = a.allocate_per_thread(4096).unwrap();
        a.deallocate_per_thread(p, 4096).unwrap();
        let (a2, d2) = (a.clone(), Arc::clone(&dev));
        let w = Arc::clone(&watch);
        let set = move |s| w.watched.store(s, std::sync::atomic::Ordering::Relaxed);
        let r = under_capture(&dev, captured, set, move || work(a2, d2));
        watch.watched.store(0, std::sync::atomic::Ordering::Relaxed);
        let first = watch.first.lock().unwrap().take();
        let s = a.stats();
        eprintln!(
            "{captured:?} / {name}: {r:?} (host syncs {}, driver calls {}; first call found to break it: {first:?})",
            s.host_syncs, s.driver_calls
        );
        if let Err(e) = r {
            broken.push(format!("{name}: {e} (first call found to break it: {first:?})"));
        }
        a.trim(true).unwrap();
    }
    assert!(broken.is_empty(), "{captured:?} capture broken or work refused by: {broken:#?}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_blocking_streams_capture_survives_other_threads_work() {
    blocking_capture(Captured::Blocking);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_per_thread_streams_capture_survives_other_threads_work() {
    blocking_capture(Captured::PerThread);
}
