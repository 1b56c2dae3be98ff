//! Pass-through mode (`CUARENA_CONF=passthrough`, `Config::builder().passthrough(true)`): a
//! debug mode that sends every request straight to the driver.
//!
//! Each allocation is one `cuMemAllocAsync` of exactly the size asked for, and each free one
//! `cuMemFreeAsync` on the free's stream, so compute-sanitizer (memcheck, initcheck) sees every
//! block at its true size and catches an access past its end or after its free. No memory is
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
//! A free declared used on other streams (`Allocator::deallocate_used_on`) is ordered after
//! their work by the normal mode's fences (events from the allocator's event pool, kept idle
//! there until `trim` or the drop), with its capture checks, before this mode's free. So, as
//! in the normal mode, such a free is refused with `StreamCapturing` while its stream or a
//! declared one is being captured, or names the legacy stream while a capture is announced;
//! a plain free on a capturing stream goes to `cuMemFreeAsync`, which the capture records. A
//! declared-stream free the driver fails part-way leaves the waits already queued (harmless)
//! and the block live.
//!
//! Statistics: `allocations`, `deallocations`, `invalid_frees`, `driver_calls` and the event
//! counters are exact (the fences' counts, and the calls made outside this module, are kept per
//! thread as in the normal mode and added by `Allocator::stats`); `live_bytes` is the sum of
//! the sizes asked for (no rounding happens), and `reserved_bytes` is the same figure: what the
//! allocator holds from the driver (the driver's pool may keep more). The arena and pool
//! figures are zero.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::device::Device;
use crate::error::{Error, InvalidFree, Result};
use crate::ptr::DeviceAddr;
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
    size_hist: [u64; crate::stats::SIZE_HISTOGRAM_BUCKETS],
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
    /// `limit`, of which `outside()` (read under this mode's lock: the global pool's graph
    /// segments) is taken. `size == 0` gives null.
    pub(crate) fn allocate(
        &self,
        size: usize,
        stream: Stream,
        limit: usize,
        outside: impl FnOnce() -> usize,
    ) -> Result<DeviceAddr> {
        if size == 0 {
            return Ok(DeviceAddr::NULL);
        }
        let oom = |st: &State| {
            let held = st.live_bytes + st.pending;
            Error::OutOfMemory { requested: size, reserved: held, in_use: held, largest_free: 0, limit }
        };
        {
            let mut st = lock(&self.state);
            if size > limit.saturating_sub(outside()).saturating_sub(st.live_bytes + st.pending) {
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
                st.size_hist[crate::stats::size_bucket(size)] += 1;
                Ok(DeviceAddr(p))
            }
        }
    }

    /// Runs `f` with the bytes this mode holds (live and being allocated), under its lock: a
    /// graph pool's growth in this mode checks the one cap there, so that it and this mode's
    /// allocations never both fit against figures read apart (lock order: graph pools, this
    /// mode's, the global pool's).
    pub(crate) fn with_held<R>(&self, f: impl FnOnce(usize) -> R) -> R {
        let st = lock(&self.state);
        f(st.live_bytes + st.pending)
    }

    /// Frees a block of [`Passthrough::allocate`] on `stream` (stream-ordered). A bad free is
    /// refused with [`Error::InvalidFree`] and changes nothing; so does a failed driver call.
    pub(crate) fn deallocate(&self, ptr: DeviceAddr, size: usize, stream: Stream) -> Result<()> {
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
        if size == 0 && ptr != 0 {
            return Err(InvalidFree::ZeroSize);
        }
        let given = if ptr == 0 { None } else { block_bytes(size, self.small_max) };
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

    /// True if freeing `ptr` with `size` would be accepted now (`Allocator::deallocate_used_on`
    /// orders the declared streams only for such a free: a bad one is refused by
    /// [`Passthrough::deallocate`] without a driver call).
    pub(crate) fn is_valid_free(&self, ptr: DeviceAddr, size: usize) -> bool {
        self.check_free(&lock(&self.state), ptr.0, size).is_ok()
    }

    /// [`Passthrough::is_valid_free`] with the reason: whether a free refused for a capture may
    /// be held (`Allocator::deallocate_or_hold`).
    pub(crate) fn check_hold(&self, ptr: DeviceAddr, size: usize) -> Result<()> {
        self.check_free(&lock(&self.state), ptr.0, size).map(|_| ()).map_err(|reason| Error::InvalidFree {
            ptr: ptr.0,
            size,
            reason,
        })
    }

    /// True if a live block starts at `ptr`.
    pub(crate) fn is_live(&self, ptr: u64) -> bool {
        lock(&self.state).live.contains_key(&ptr)
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
            peak_live_bytes_upper: st.peak_live as u64,
            peak_exact: 1,
            ..Stats::default()
        }
    }

    /// Restarts the peaks at the values now.
    pub(crate) fn reset_peak(&self) {
        let mut st = lock(&self.state);
        st.peak_live = st.live_bytes;
        st.peak_reserved = st.live_bytes + st.pending;
    }

    /// Restarts the accumulated counters at zero (the live map and byte counts are kept).
    pub(crate) fn reset_counters(&self) {
        let mut st = lock(&self.state);
        st.allocations = 0;
        st.deallocations = 0;
        st.invalid_frees = 0;
        st.driver_calls = 0;
        st.size_hist = Default::default();
    }

    /// Allocations by the size asked for, since the last `reset_counters`.
    pub(crate) fn size_histogram(&self) -> [u64; crate::stats::SIZE_HISTOGRAM_BUCKETS] {
        lock(&self.state).size_hist
    }

    /// Checks that the live map and the byte count agree; panics otherwise. For tests.
    pub(crate) fn check(&self) {
        let st = lock(&self.state);
        assert_eq!(st.live.values().sum::<usize>(), st.live_bytes, "pass-through live bytes");
        assert!(st.live.keys().all(|p| !st.freed.contains_key(p)), "a live block is marked freed");
        assert!(st.freed.len() <= FREED_REMEMBERED);
    }
}
