//! A simulated device a test can step into: [`HookedDevice`] forwards every call to a
//! [`HostDevice`], except that a hook, where one is set, runs *around* the call. A hook gets the
//! simulated device and the call's arguments, makes the call itself (or not) and returns what
//! the allocator sees, so one wrapper serves a stall after a record, a pause inside an identity
//! lookup, or a driver error injected into a stream wait.

use std::sync::Arc;

use cuarena::{Device, Event, Result, Stream, StreamKey};

use crate::HostDevice;
use crate::interpose::{Interpose, Interposed};

/// A hook around `record_event` or `stream_wait_event`.
pub type EventHook = Box<dyn Fn(&HostDevice, Event, Stream) -> Result<()> + Send + Sync>;
/// A hook around `stream_key`.
pub type KeyHook = Box<dyn Fn(&HostDevice, Stream) -> Result<StreamKey> + Send + Sync>;

/// Which calls of a [`HookedDevice`] have hooks (`None`: forwarded as they are).
#[derive(Default)]
pub struct Hooks {
    pub record_event: Option<EventHook>,
    pub stream_wait_event: Option<EventHook>,
    pub stream_key: Option<KeyHook>,
}

/// A [`HostDevice`] with [`Hooks`], as a device ([`HookedDevice`]). Clones of `sim` share its
/// state: keep one to ask the race checker.
pub struct Hooked {
    pub sim: HostDevice,
    pub hooks: Hooks,
}

/// [`Hooked`] as a [`Device`]; its fields are reached through `Deref`.
pub type HookedDevice = Interposed<Hooked>;

impl Interposed<Hooked> {
    /// `sim` with `hooks`, ready for `Allocator::new`.
    pub fn new(sim: HostDevice, hooks: Hooks) -> Arc<HookedDevice> {
        Arc::new(Interposed(Hooked { sim, hooks }))
    }
}

impl Interpose for Hooked {
    fn base(&self) -> &dyn Device {
        &self.sim
    }
    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        match &self.hooks.record_event {
            Some(h) => h(&self.sim, event, stream),
            None => self.sim.record_event(event, stream),
        }
    }
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        match &self.hooks.stream_wait_event {
            Some(h) => h(&self.sim, event, stream),
            None => self.sim.stream_wait_event(stream, event),
        }
    }
    fn stream_key(&self, stream: Stream) -> Result<StreamKey> {
        match &self.hooks.stream_key {
            Some(h) => h(&self.sim, stream),
            None => self.sim.stream_key(stream),
        }
    }
}

/// A one-shot pause for a hook: the thread that called [`Stall::arm`] stops in its next hooked
/// call for which the hook passes `true` to [`Stall::here`], until the test calls
/// [`Stall::release`]; meanwhile [`Stall::wait_stalled`] returns in the test's thread. Other
/// threads, and later calls, pass through.
#[derive(Default)]
pub struct Stall {
    state: std::sync::Mutex<StallState>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct StallState {
    armed: Option<std::thread::ThreadId>,
    stalled: bool,
    released: bool,
}

impl Stall {
    pub fn new() -> Arc<Stall> {
        Arc::default()
    }

    /// The calling thread stops in its next hooked call that matches.
    pub fn arm(&self) {
        self.state.lock().unwrap().armed = Some(std::thread::current().id());
    }

    /// Called by a hook: stops here if the calling thread is armed and `matches`.
    pub fn here(&self, matches: bool) {
        let mut st = self.state.lock().unwrap();
        if !matches || st.armed != Some(std::thread::current().id()) {
            return;
        }
        st.armed = None;
        st.stalled = true;
        self.cv.notify_all();
        while !st.released {
            st = self.cv.wait(st).unwrap();
        }
    }

    /// Waits until the armed thread has stopped.
    pub fn wait_stalled(&self) {
        let mut st = self.state.lock().unwrap();
        while !st.stalled {
            st = self.cv.wait(st).unwrap();
        }
    }

    /// Lets the stopped thread (or the next one to stop) go on.
    pub fn release(&self) {
        self.state.lock().unwrap().released = true;
        self.cv.notify_all();
    }
}
