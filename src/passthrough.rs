//! Pass-through mode (`CUARENA_CONF=passthrough`, `Config::builder().passthrough(true)`): a
//! debug mode that sends every request straight to the driver.
//!
//! Each allocation is one `cuMemAllocAsync` of exactly the size asked for, and each free one
//! `cuMemFreeAsync` on the free's stream, so compute-sanitizer (memcheck, initcheck) sees every
//! block at its true size and catches an access past its end or after its free. Nothing is
//! cached, no arena or pool is used, and the stream-ordering contract is the driver's own.
//!
//! Frees are still checked, against a map of the live blocks (a mutex: this is a debug mode),
//! and refused with the same [`InvalidFree`] reasons as the normal mode: a pointer that is not
//! the start of a live block is `UnknownPointer`, one freed before and not handed out again is
//! `DoubleFree` (the last [`FREED_REMEMBERED`] freed addresses are remembered), and a size that
//! does not round to the block's (the normal mode's rounding, so a program valid in one mode is
//! valid in the other) is `SizeMismatch`. Every check is made at the call: nothing is deferred.
//! A refused free, or one the driver fails, changes nothing.
//!
//! Statistics: `allocations`, `deallocations`, `invalid_frees`, `driver_calls` and the event
//! counters are exact; `live_bytes` is the sum of the sizes asked for (no rounding happens), and
//! `reserved_bytes` is the same figure: what the allocator holds from the driver (the driver's
//! pool may keep more). The arena and pool figures are zero.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, InvalidFree, Result};
use crate::ptr::DevicePtr;
use crate::size_class::block_bytes;
use crate::stats::Stats;
use crate::stream::Stream;
use crate::sync::{Mutex, lock};

/// How many freed addresses are remembered to tell a double free from a foreign pointer.
pub(crate) const FREED_REMEMBERED: usize = 1 << 16;

/// The pass-through allocator of one [`crate::Allocator`].
pub(crate) struct Passthrough {
    device: Arc<dyn Device>,
    small_max: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Live blocks: address → the size asked for.
    live: HashMap<u64, usize>,
    /// Addresses freed and not handed out again: address → the serial of that free.
    freed: HashMap<u64, u64>,
    /// `freed`'s entries oldest first, to forget the oldest (stale entries are skipped).
    freed_order: VecDeque<(u64, u64)>,
    serial: u64,
    live_bytes: usize,
    /// Bytes of allocations under way (counted against the cap before the driver call).
    pending: usize,
    peak_live: usize,
    peak_reserved: usize,
    allocations: u64,
    deallocations: u64,
    invalid_frees: u64,
    driver_calls: u64,
    fences_recorded: u64,
    fence_waits: u64,
}

impl State {
    fn remember_freed(&mut self, ptr: u64) {
        self.serial += 1;
        self.freed.insert(ptr, self.serial);
        self.freed_order.push_back((ptr, self.serial));
        while self.freed_order.len() > FREED_REMEMBERED {
            let (p, serial) = self.freed_order.pop_front().expect("non-empty");
            if self.freed.get(&p) == Some(&serial) {
                self.freed.remove(&p);
            }
        }
    }

    fn add_live(&mut self, ptr: u64, size: usize) {
        self.live.insert(ptr, size);
        self.freed.remove(&ptr);
        self.live_bytes += size;
        self.peak_live = self.peak_live.max(self.live_bytes);
    }
}

impl Passthrough {
    pub(crate) fn new(device: Arc<dyn Device>, small_max: usize) -> Passthrough {
        Passthrough { device, small_max, state: Mutex::new(State::default()) }
    }

    /// Allocates exactly `size` bytes from the driver, ordered on `stream`, under the cap
    /// `limit`. `size == 0` gives null.
    pub(crate) fn allocate(&self, size: usize, stream: Stream, limit: usize) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(DevicePtr::NULL);
        }
        let oom = |st: &State| {
            let held = st.live_bytes + st.pending;
            Error::OutOfMemory { requested: size, reserved: held, in_use: held, largest_free: 0, limit }
        };
        {
            let mut st = lock(&self.state);
            if size > limit.saturating_sub(st.live_bytes + st.pending) {
                return Err(oom(&st));
            }
            st.pending += size;
            st.driver_calls += 1;
            st.peak_reserved = st.peak_reserved.max(st.live_bytes + st.pending);
        }
        let r = self.device.alloc_async(size, stream);
        let mut st = lock(&self.state);
        st.pending -= size;
        match r? {
            None => Err(oom(&st)),
            Some(p) => {
                st.add_live(p, size);
                st.allocations += 1;
                Ok(DevicePtr(p))
            }
        }
    }

    /// Frees a block of [`Passthrough::allocate`] on `stream` (stream-ordered). A bad free is
    /// refused with [`Error::InvalidFree`] and changes nothing; so does a failed driver call.
    pub(crate) fn deallocate(&self, ptr: DevicePtr, size: usize, stream: Stream) -> Result<()> {
        if ptr.is_null() && size == 0 {
            return Ok(());
        }
        let ptr = ptr.0;
        let allocated = {
            let mut st = lock(&self.state);
            match self.check_free(&st, ptr, size) {
                Ok(allocated) => {
                    st.live.remove(&ptr);
                    st.live_bytes -= allocated;
                    st.remember_freed(ptr);
                    st.driver_calls += 1;
                    allocated
                }
                Err(reason) => {
                    st.invalid_frees += 1;
                    return Err(Error::InvalidFree { ptr, size, reason });
                }
            }
        };
        // SAFETY: `ptr` was live with `allocated` bytes from `alloc_async` of this device and has
        // just left the live map under the lock, so this is its only free; the caller's contract
        // (as `cudaFreeAsync`'s) orders its earlier uses before `stream`.
        let r = unsafe { self.device.free_async(ptr, allocated, stream) };
        let mut st = lock(&self.state);
        match r {
            Ok(()) => {
                st.deallocations += 1;
                Ok(())
            }
            Err(e) => {
                st.add_live(ptr, allocated);
                Err(e)
            }
        }
    }

    /// The size `ptr` was allocated with, if freeing it with `size` is valid.
    fn check_free(&self, st: &State, ptr: u64, size: usize) -> Result<usize, InvalidFree> {
        let given = if size == 0 || ptr == 0 { None } else { block_bytes(size, self.small_max) };
        let Some(given) = given else { return Err(InvalidFree::UnknownPointer) };
        match st.live.get(&ptr) {
            Some(&allocated) => {
                let rounded = block_bytes(allocated, self.small_max).expect("allocated sizes round");
                if rounded == given {
                    Ok(allocated)
                } else {
                    Err(InvalidFree::SizeMismatch { allocated: rounded, given: size })
                }
            }
            None if st.freed.contains_key(&ptr) => Err(InvalidFree::DoubleFree),
            None => Err(InvalidFree::UnknownPointer),
        }
    }

    /// [`Passthrough::deallocate`] after making `stream` wait for the work queued so far on each
    /// stream of `used_on` (one event each; no host block).
    pub(crate) fn deallocate_used_on(
        &self,
        ptr: DevicePtr,
        size: usize,
        stream: Stream,
        used_on: &[Stream],
    ) -> Result<()> {
        if !used_on.is_empty() {
            let dev = &*self.device;
            let key = dev.stream_key(stream)?;
            let mut calls = 1;
            let mut waits = 0;
            for &s in used_on {
                calls += 1;
                if dev.stream_key(s)? == key {
                    continue;
                }
                let e = dev.create_event()?;
                let r = dev.record_event(e, s).and_then(|()| dev.stream_wait_event(stream, e));
                dev.destroy_event(e);
                calls += 3;
                r?;
                waits += 1;
            }
            let mut st = lock(&self.state);
            st.driver_calls += calls;
            st.fences_recorded += waits;
            st.fence_waits += waits;
        }
        self.deallocate(ptr, size, stream)
    }

    /// A snapshot of the statistics (see the module comment).
    pub(crate) fn stats(&self) -> Stats {
        let st = lock(&self.state);
        Stats {
            live_bytes: st.live_bytes as u64,
            peak_live_bytes: st.peak_live as u64,
            reserved_bytes: (st.live_bytes + st.pending) as u64,
            peak_reserved_bytes: st.peak_reserved as u64,
            allocations: st.allocations,
            deallocations: st.deallocations,
            invalid_frees: st.invalid_frees,
            driver_calls: st.driver_calls,
            fences_recorded: st.fences_recorded,
            fence_waits: st.fence_waits,
            ..Stats::default()
        }
    }

    /// Checks that the live map and the byte count agree; panics otherwise. For tests.
    pub(crate) fn check(&self) {
        let st = lock(&self.state);
        assert_eq!(st.live.values().sum::<usize>(), st.live_bytes, "pass-through live bytes");
        assert!(st.live.keys().all(|p| !st.freed.contains_key(p)), "a live block is marked freed");
        assert!(st.freed.len() <= FREED_REMEMBERED);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::time::Duration;

    use crate::{Allocator, Config, DevicePtr, Error, HostConfig, HostDevice, InvalidFree, Stream};

    fn device(max_delay_us: u64) -> HostDevice {
        HostDevice::new(HostConfig {
            capacity: 256 << 20,
            min_delay: Duration::ZERO,
            max_delay: Duration::from_micros(max_delay_us),
            ..HostConfig::default()
        })
    }

    fn passthrough(dev: &HostDevice) -> Allocator {
        Allocator::host(
            dev.clone(),
            Config::parse("passthrough,small_max=64KiB,superblock=256KiB,chunk=1MiB").unwrap(),
        )
        .unwrap()
    }

    fn reason(r: crate::Result<()>) -> InvalidFree {
        match r {
            Err(Error::InvalidFree { reason, .. }) => reason,
            other => panic!("expected an invalid free, got {other:?}"),
        }
    }

    fn assert_all_returned(a: &Allocator, dev: &HostDevice) {
        a.check_invariants();
        let s = a.stats();
        assert_eq!(
            (s.live_bytes, s.reserved_bytes, s.pool_in_use_bytes, s.arena_held_bytes),
            (0, 0, 0, 0),
            "{s:?}"
        );
        assert_eq!(s.allocations, s.deallocations, "{s:?}");
        dev.synchronize();
        assert_eq!(dev.reserved_bytes(), 0, "every block went back to the device");
        assert_eq!(a.trim(true).unwrap(), 0);
    }

    /// Many threads, each block its own driver allocation of its exact size, freed on its own
    /// stream, on another thread's stream behind an event, or with `deallocate_used_on`.
    #[test]
    fn concurrent_threads_allocate_and_free_through_the_driver() {
        let dev = device(100);
        let a = passthrough(&dev);
        let (tx, rx) = std::sync::mpsc::channel::<(DevicePtr, usize, crate::Event, u32)>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        const THREADS: usize = 4;
        const STEPS: usize = 200;
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, dev, tx, rx) = (a.clone(), dev.clone(), tx.clone(), rx.clone());
                std::thread::spawn(move || {
                    let user = dev.create_stream();
                    let mut mine: Vec<(DevicePtr, usize, Stream)> = Vec::new();
                    for i in 0..STEPS {
                        let size = 1 + (i * 7919 + t * 104_729) % (300 << 10);
                        let stream = [Stream::PER_THREAD, Stream::LEGACY, user][i % 3];
                        let p = a.allocate(size, stream).unwrap();
                        assert_eq!(p.0 % 256, 0);
                        assert!(
                            mine.iter().all(|&(q, qs, _)| p.0 + size as u64 <= q.0 || q.0 + qs as u64 <= p.0)
                        );
                        let tag = (t * STEPS + i) as u32;
                        dev.write_tag(p.0, size & !3, tag, stream).unwrap();
                        dev.check_tag(p.0, size & !3, tag, stream).unwrap();
                        match i % 4 {
                            0 => a.deallocate(p, size, stream).unwrap(),
                            1 => {
                                let e = a.device().create_event().unwrap();
                                a.device().record_event(e, stream).unwrap();
                                tx.send((p, size, e, tag)).unwrap();
                            }
                            2 => a.deallocate_used_on(p, size, user, &[stream]).unwrap(),
                            _ => mine.push((p, size, stream)),
                        }
                        // Free a block handed over by another thread, after waiting for its work.
                        let handed = rx.lock().unwrap().try_recv();
                        if let Ok((q, qs, e, qtag)) = handed {
                            a.device().stream_wait_event(user, e).unwrap();
                            dev.check_tag(q.0, qs & !3, qtag, user).unwrap();
                            a.deallocate(q, qs, user).unwrap();
                        }
                        if mine.len() > 8 {
                            let (q, qs, qstream) = mine.remove(i % mine.len());
                            a.deallocate(q, qs, qstream).unwrap();
                        }
                    }
                    // The main thread frees these on the legacy stream: order their work first.
                    let e = a.device().create_event().unwrap();
                    let ordered = |(q, qs, qstream): (DevicePtr, usize, Stream)| {
                        a.device().record_event(e, qstream).unwrap();
                        a.device().stream_wait_event(Stream::LEGACY, e).unwrap();
                        (q, qs)
                    };
                    mine.into_iter().map(ordered).collect::<Vec<_>>()
                })
            })
            .collect();
        drop(tx);
        let mut left: Vec<(DevicePtr, usize)> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
        while let Ok((q, qs, e, _)) = rx.lock().unwrap().try_recv() {
            a.device().stream_wait_event(Stream::LEGACY, e).unwrap();
            left.push((q, qs));
        }
        let s = a.stats();
        assert_eq!(s.allocations, (THREADS * STEPS) as u64);
        assert_eq!(s.live_bytes, left.iter().map(|&(_, s)| s as u64).sum::<u64>(), "{s:?}");
        assert!(s.driver_calls >= s.allocations + s.deallocations, "one driver call per request: {s:?}");
        a.check_invariants();
        for (q, qs) in left {
            a.deallocate(q, qs, Stream::LEGACY).unwrap();
        }
        assert_all_returned(&a, &dev);
        assert_eq!(a.stats().invalid_frees, 0);
        assert!(dev.violations().is_empty(), "{:?}", &dev.violations()[..dev.violations().len().min(3)]);
        assert_eq!(dev.tag_errors(), 0);
    }

    /// A free is stream-ordered: the memory goes back only after the work queued before it, and
    /// a free on another stream is ordered by `deallocate_used_on`. Without that ordering the
    /// race checker sees the free (the negative control shows it is watching).
    #[test]
    fn frees_are_stream_ordered() {
        let dev = device(0);
        let a = passthrough(&dev);
        let (s1, s2) = (dev.create_stream(), dev.create_stream());
        let p = a.allocate(4096, s1).unwrap();
        dev.hold_and_check(p.0, 4096, 1, Duration::from_millis(30), s1).unwrap();
        a.deallocate(p, 4096, s1).unwrap();
        assert_eq!(dev.reserved_bytes(), 4096, "released only when the queued work is done");
        assert_eq!(a.stats().live_bytes, 0);
        let q = a.allocate(4096, s1).unwrap();
        dev.hold_and_check(q.0, 4096, 2, Duration::from_millis(30), s1).unwrap();
        a.deallocate_used_on(q, 4096, s2, &[s1]).unwrap();
        dev.synchronize();
        assert_eq!(dev.violations(), Vec::<String>::new());
        assert_eq!(dev.tag_errors(), 0);
        assert_all_returned(&a, &dev);

        let r = a.allocate(4096, s1).unwrap();
        dev.hold_and_check(r.0, 4096, 3, Duration::from_millis(30), s1).unwrap();
        a.deallocate(r, 4096, s2).unwrap(); // breaks the contract: nothing orders s1 before s2
        dev.synchronize();
        assert_eq!(dev.violations().len(), 1, "{:?}", dev.violations());
    }

    #[test]
    fn bad_requests_are_refused_and_lose_nothing() {
        let dev = device(0);
        let a = passthrough(&dev);
        assert_eq!(a.allocate(0, Stream::LEGACY).unwrap(), DevicePtr::NULL);
        a.deallocate(DevicePtr::NULL, 0, Stream::LEGACY).unwrap();
        a.set_limit_bytes(1 << 20);
        for huge in [usize::MAX, (1 << 20) + 1] {
            match a.allocate(huge, Stream::LEGACY) {
                Err(Error::OutOfMemory { requested, limit, reserved, .. }) => {
                    assert_eq!((requested, limit, reserved), (huge, 1 << 20, 0));
                }
                other => panic!("{other:?}"),
            }
        }
        let small = a.allocate(1000, Stream::PER_THREAD).unwrap();
        let large = a.allocate(200 << 10, Stream::LEGACY).unwrap();
        match a.allocate(900 << 10, Stream::LEGACY) {
            Err(Error::OutOfMemory { reserved, in_use, .. }) => {
                assert_eq!((reserved, in_use), (1000 + (200 << 10), 1000 + (200 << 10)))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            reason(a.deallocate(small, 5000, Stream::PER_THREAD)),
            InvalidFree::SizeMismatch { allocated: 1024, given: 5000 }
        ));
        // A size of the same rounded class is accepted, as in the normal mode.
        let alias = a.allocate(1000, Stream::PER_THREAD).unwrap();
        a.deallocate(alias, 1001, Stream::PER_THREAD).unwrap();
        assert_eq!(
            reason(a.deallocate(DevicePtr(small.0 + 256), 256, Stream::PER_THREAD)),
            InvalidFree::UnknownPointer
        );
        assert_eq!(
            reason(a.deallocate(DevicePtr(0xdead_0000), 4096, Stream::LEGACY)),
            InvalidFree::UnknownPointer
        );
        assert_eq!(
            reason(a.deallocate(DevicePtr(u64::MAX), 4096, Stream::LEGACY)),
            InvalidFree::UnknownPointer
        );
        assert_eq!(reason(a.deallocate(DevicePtr::NULL, 8, Stream::LEGACY)), InvalidFree::UnknownPointer);
        assert_eq!(reason(a.deallocate(small, 0, Stream::LEGACY)), InvalidFree::UnknownPointer);
        assert_eq!(reason(a.deallocate(large, usize::MAX, Stream::LEGACY)), InvalidFree::UnknownPointer);
        let gone = dev.create_stream();
        dev.destroy_stream(gone).unwrap();
        assert!(matches!(a.deallocate(large, 200 << 10, gone), Err(Error::Driver { .. })));
        assert!(a.allocate(10, gone).is_err());
        let s = a.stats();
        assert_eq!(s.live_bytes, 1000 + (200 << 10), "the refused frees lost nothing: {s:?}");
        a.check_invariants();
        a.deallocate(small, 1000, Stream::PER_THREAD).unwrap();
        a.deallocate(large, 200 << 10, Stream::LEGACY).unwrap();
        assert_eq!(reason(a.deallocate(small, 1000, Stream::PER_THREAD)), InvalidFree::DoubleFree);
        assert_eq!(reason(a.deallocate(large, 200 << 10, Stream::LEGACY)), InvalidFree::DoubleFree);
        assert_eq!(a.stats().invalid_frees, 9, "every refusal is counted");
        assert_all_returned(&a, &dev);
        assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }

    #[test]
    fn the_builder_switch_and_the_parse_key_agree() {
        let dev = device(0);
        let a = Allocator::host(dev.clone(), Config::builder().passthrough(true).build().unwrap()).unwrap();
        let p = a.allocate_per_thread(100).unwrap();
        assert_eq!(dev.reserved_bytes(), 100, "an exact-size driver allocation, no chunk");
        assert_eq!(a.stats().arenas, 0);
        a.deallocate_per_thread(p, 100).unwrap();
        assert_all_returned(&a, &dev);
    }
}
