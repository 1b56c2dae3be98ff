//! Device calls made on behalf of one thread, counted in that thread's statistics.
//!
//! Every driver operation the allocator makes goes through [`Counted`] (pass-through mode's
//! allocations and frees excepted: it counts its own, `passthrough.rs`), a trace's stream
//! identities too (`Allocator::trace_key`), so `driver_calls`, `fences_recorded`,
//! `fence_waits`, `fence_polls` and `host_syncs` are exact; the exception is the allocator's
//! drop, whose event destroys, releases and device synchronise are not counted. `driver_calls`
//! counts every call that does the work, a failed one too (a stream identity lookup on CUDA is
//! two: `Device::stream_key_calls`), not the bookkeeping around each on CUDA
//! (`cuCtxGetCurrent`, and the capture-mode switch around calls CUDA restricts during a
//! capture: `CudaDevice::enter`); `fences_recorded` and `fence_waits` count the records and waits that
//! succeeded, `fence_polls` and `host_syncs` every one made.

use super::{Device, Event};
use crate::error::Result;
use crate::stats::Counters;
use crate::stream::{Stream, StreamKey};

/// A device and the counters its calls are charged to.
#[derive(Clone, Copy)]
pub(crate) struct Counted<'a> {
    pub(crate) device: &'a dyn Device,
    pub(crate) counters: &'a Counters,
    /// Made inside an allocation or free on the legacy stream ([`Counted::on_stream`]): such a
    /// call is itself a legacy-stream operation, as `cudaMallocAsync` or `cudaFreeAsync` on
    /// stream 0 would be (its caller's work on the block is legacy-stream work too), so the
    /// legacy stream is used without first asking whether a blocking stream is being captured.
    legacy_call: bool,
}

impl<'a> Counted<'a> {
    pub(crate) fn new(device: &'a dyn Device, counters: &'a Counters) -> Self {
        Counted { device, counters, legacy_call: false }
    }

    /// For the calls made inside an allocation or free on `stream`.
    pub(crate) fn on_stream(mut self, stream: Stream) -> Self {
        self.legacy_call = stream.is_legacy();
        self
    }

    fn call(&self) {
        self.counters.bump(&self.counters.driver_calls, 1);
    }

    pub(crate) fn reserve(&self, bytes: usize) -> Result<Option<u64>> {
        self.call();
        self.device.reserve(bytes)
    }

    /// # Safety
    /// As [`Device::release`].
    pub(crate) unsafe fn release(&self, ptr: u64, bytes: usize) -> Result<()> {
        self.call();
        // SAFETY: forwarded from the caller.
        unsafe { self.device.release(ptr, bytes) }
    }

    pub(crate) fn create_event(&self) -> Result<Event> {
        self.call();
        self.device.create_event()
    }

    pub(crate) fn destroy_event(&self, e: Event) {
        self.call();
        self.device.destroy_event(e)
    }

    /// Refuses a stream being captured into a graph, where an event recorded or waited on
    /// would become a graph node instead of a fence (one `cuStreamIsCapturing`). The legacy
    /// stream cannot be captured, but it is refused while a blocking stream is, whose capture
    /// any use of the legacy stream would invalidate (`Device::stream_capturing`); inside a
    /// call on the legacy stream it is not asked (see `legacy_call`). The mutation
    /// `legacy_never_asked` never asks it: the test
    /// `capture::legacy_frees_wanted_by_a_user_stream_during_a_capture_are_avoided_not_fenced`
    /// must then fail.
    fn not_capturing(&self, s: Stream) -> Result<()> {
        if s.is_legacy() && (self.legacy_call || cfg!(cuarena_mutant = "legacy_never_asked")) {
            return Ok(());
        }
        self.refuse_if_capturing(s)
    }

    /// `Error::StreamCapturing` of `s` if [`Counted::stream_capturing`] says so.
    fn refuse_if_capturing(&self, s: Stream) -> Result<()> {
        if self.stream_capturing(s)? {
            return Err(crate::error::Error::StreamCapturing { stream: s.as_raw() });
        }
        Ok(())
    }

    /// True while the legacy stream may not be used (a blocking stream is being captured:
    /// `Device::stream_capturing`), or its state could not be asked.
    pub(crate) fn legacy_implicated(&self) -> bool {
        self.stream_capturing(Stream::LEGACY).unwrap_or(true)
    }

    pub(crate) fn record_fence(&self, e: Event, s: Stream) -> Result<()> {
        self.checked(s, || {
            self.call();
            let r = self.device.record_event(e, s);
            if r.is_ok() {
                self.counters.bump(&self.counters.fences_recorded, 1);
            }
            r
        })
    }

    /// Runs `call` on `s` once [`Counted::not_capturing`] allows it. Where that asks the legacy
    /// stream's state (outside a call on it, which [`Counted::stream_capturing`] also refuses
    /// while a capture is announced), the check and the call run with capture announcements held
    /// off (`sync::holding_off_announcements`): an announced capture, which may be of a blocking
    /// stream, cannot begin between them (an announcement comes before its capture begins, as
    /// PyTorch's does). The mutation `legacy_check_unlocked` checks the capture
    /// alone: the test
    /// `adversarial_s28a::a_legacy_record_racing_an_announced_per_thread_capture_never_breaks_it`
    /// must then fail (and `chaos_without_the_legacy_stream_with_per_thread_captures` in some
    /// runs).
    fn checked<R>(&self, s: Stream, call: impl FnOnce() -> Result<R>) -> Result<R> {
        if !s.is_legacy() || self.legacy_call || cfg!(cuarena_mutant = "legacy_check_unlocked") {
            self.not_capturing(s)?;
            return call();
        }
        crate::sync::holding_off_announcements(self.device.device_id(), || {
            self.not_capturing(s)?;
            call()
        })
    }

    pub(crate) fn query_fence(&self, e: Event) -> Result<bool> {
        self.call();
        self.counters.bump(&self.counters.fence_polls, 1);
        self.device.query_event(e)
    }

    pub(crate) fn sync_fence(&self, e: Event) -> Result<()> {
        self.call();
        self.counters.bump(&self.counters.host_syncs, 1);
        self.device.sync_event(e)
    }

    /// Blocks until all work on the device has completed (`cuCtxSynchronize`). Refused, as
    /// [`Error::StreamCapturing`](crate::error::Error::StreamCapturing) of the legacy stream,
    /// while a blocking stream is being captured: a synchronise during any capture invalidates
    /// it (measured on the H200), and that kind of capture can be seen (one
    /// `cuStreamIsCapturing` of the legacy stream). A capture of a non-blocking stream cannot
    /// be seen without its handle; only an announced one is spared (`graph_capture_begin`, to
    /// any allocator of this device: refused the same way while one is, and none is announced
    /// until this returns, `sync::holding_off_announcements`).
    pub(crate) fn synchronize(&self) -> Result<()> {
        let sync = || {
            self.refuse_if_capturing(Stream::LEGACY)?;
            self.call();
            self.counters.bump(&self.counters.host_syncs, 1);
            self.device.synchronize()
        };
        // The mutation `synchronise_after_unlock` lets an announcement in between the check and
        // the synchronise: the `adversarial_s28a::*_racing_an_announced_capture_*` tests must
        // then fail.
        if cfg!(cuarena_mutant = "synchronise_after_unlock") {
            return sync();
        }
        crate::sync::holding_off_announcements(self.device.device_id(), sync)
    }

    pub(crate) fn wait_fence(&self, s: Stream, e: Event) -> Result<()> {
        self.checked(s, || {
            self.call();
            let r = self.device.stream_wait_event(s, e);
            if r.is_ok() {
                self.counters.bump(&self.counters.fence_waits, 1);
            }
            r
        })
    }

    /// Refuses `s` if it is being captured into a graph (see [`Counted::record_fence`]).
    pub(crate) fn refuse_capturing(&self, s: Stream) -> Result<()> {
        self.not_capturing(s)
    }

    /// Refuses the legacy stream while the device says a blocking stream is being captured
    /// (one `cuStreamIsCapturing` of it, the query CUDA allows during any capture), whatever
    /// the announcements: for an allocation on the legacy stream that the pool serves, which
    /// may record on the legacy stream inside that call. A capture announced elsewhere (of a
    /// non-blocking stream, as PyTorch's are) does not refuse it; a blocking stream's capture
    /// does, before anything changes, and is left intact.
    pub(crate) fn refuse_legacy_implicated(&self) -> Result<()> {
        self.call();
        if self.device.stream_capturing(Stream::LEGACY)? {
            return Err(crate::error::Error::StreamCapturing { stream: Stream::LEGACY.as_raw() });
        }
        Ok(())
    }

    /// Is `s` being captured into a graph (`cuStreamIsCapturing`)? Of the legacy stream: may it
    /// not be used, because a blocking stream is being captured (`Device::stream_capturing`), or
    /// a capture is announced to an allocator of the device, which may be of a blocking stream
    /// (see [`Counted::checked`]; then no driver call)?
    ///
    /// Inlined with its legacy branch out of line: on a user stream this runs at every own free
    /// (`free_fast`), and the announcement check, inlined, had made it a call of its own with
    /// 24 instructions more a pair (callgrind, own-stream churn on the host).
    #[inline]
    pub(crate) fn stream_capturing(&self, s: Stream) -> Result<bool> {
        if s.is_legacy() && self.legacy_announced() {
            return Ok(true);
        }
        self.call();
        self.device.stream_capturing(s)
    }

    /// Is a capture announced to an allocator of this device ([`Counted::stream_capturing`]
    /// of the legacy stream)?
    #[inline(never)]
    fn legacy_announced(&self) -> bool {
        crate::sync::captures_announced(self.device.device_id())
    }

    /// The device checks for a capture first (`Device::stream_key`); of the legacy stream, with
    /// announcements held off, so that no capture is announced in between (see
    /// [`Counted::legacy_key`] for one announced before). Inlined
    /// with that branch out of line, as [`Counted::stream_capturing`]: this runs at every
    /// user-stream allocation.
    #[inline]
    pub(crate) fn stream_key(&self, s: Stream) -> Result<StreamKey> {
        if s.is_legacy() {
            return self.legacy_key();
        }
        self.asked_key(s)
    }

    /// The device's answer for `s`'s identity, its calls counted (`Device::stream_key_calls`).
    #[inline]
    fn asked_key(&self, s: Stream) -> Result<StreamKey> {
        let key = self.device.stream_key(s);
        self.counters.bump(&self.counters.driver_calls, self.device.stream_key_calls(s, &key));
        key
    }

    /// [`Counted::stream_key`] of the legacy stream. Outside a call on it, refused while a
    /// capture is announced, as any use of it is then ([`Counted::stream_capturing`]): the
    /// hold keeps new announcements off, but one made before may begin its capture (of a
    /// blocking stream) at any moment, and `cuStreamGetId` of the legacy stream would break it.
    #[inline(never)]
    fn legacy_key(&self) -> Result<StreamKey> {
        let s = Stream::LEGACY;
        crate::sync::holding_off_announcements(self.device.device_id(), || {
            if !self.legacy_call && self.legacy_announced() {
                return Err(crate::error::Error::StreamCapturing { stream: s.as_raw() });
            }
            self.asked_key(s)
        })
    }
}
