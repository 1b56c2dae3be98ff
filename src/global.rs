//! Process-wide allocators, one per CUDA device, created on first use with `CUARENA_CONF`,
//! over the defaults a framework's glue may set first ([`set_defaults`]).
//!
//! They are never dropped: a process-wide allocator lives until the process ends, and once exit
//! has begun (see `shutdown.rs`) cuarena makes no further CUDA call, so threads that outlive
//! `main` and late destructors cannot crash in a torn-down driver.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};

use crate::allocator::Allocator;
use crate::config::Config;
use crate::error::{Error, Result};

/// Devices a process may use through [`global`].
pub const MAX_DEVICES: usize = 64;

static ALLOCATORS: [OnceLock<Allocator>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
/// Held while an allocator is made and while the defaults change, so that one is made with
/// the defaults of before a change or of after it, whole. Lock order: `CREATING`, then
/// `DEFAULTS` (taken only to read or write the string, nothing under it); `Allocator::cuda`
/// runs under `CREATING` and takes the driver's and the trace's locks, none of whose holders
/// calls [`global`] or [`set_defaults`].
static CREATING: Mutex<()> = Mutex::new(());
/// Items in `CUARENA_CONF`'s form, under `CUARENA_CONF` for every allocator made from now on
/// (empty: none). Valid on their own (checked by [`set_defaults`]).
static DEFAULTS: Mutex<String> = Mutex::new(String::new());
/// Set in a forked child whose parent had a thread inside `CREATING` or `DEFAULTS` at the fork:
/// those locks stay held there, so no allocator is made ([`Error::Forked`]). (The creation
/// holds `CREATING` across `cuInit`, too long to hold forks off for.)
static LOCKED_BY_THE_PARENT: AtomicBool = AtomicBool::new(false);

/// The fork's child handler (`shutdown.rs`, "Fork"): notes whether a thread of the parent held
/// `CREATING` or `DEFAULTS`.
extern "C" fn check_locks_in_child() {
    let creating = matches!(CREATING.try_lock(), Err(TryLockError::WouldBlock));
    let defaults = matches!(DEFAULTS.try_lock(), Err(TryLockError::WouldBlock));
    if creating || defaults {
        LOCKED_BY_THE_PARENT.store(true, Ordering::SeqCst);
    }
}

/// Before `CREATING` or `DEFAULTS` is taken (every path that takes them calls this first, so
/// the child handler is registered before either can be held at a fork): the handler
/// registered (once), and [`Error::Forked`] in a child whose parent held either lock.
fn not_locked_by_the_parent() -> Result<()> {
    static FORK_HANDLER: std::sync::Once = std::sync::Once::new();
    FORK_HANDLER.call_once(|| crate::shutdown::at_fork(None, None, Some(check_locks_in_child)));
    if LOCKED_BY_THE_PARENT.load(Ordering::SeqCst) { Err(Error::Forked) } else { Ok(()) }
}

/// The process-wide allocator of CUDA device `device`, created on first use ([`Error::ShutDown`]
/// instead once process exit has begun).
pub fn global(device: i32) -> Result<&'static Allocator> {
    let Some(slot) = usize::try_from(device).ok().and_then(|d| ALLOCATORS.get(d)) else {
        return Err(out_of_range(device));
    };
    if let Some(a) = slot.get() {
        return if a.forked() { Err(Error::Forked) } else { Ok(a) };
    }
    not_locked_by_the_parent()?;
    // Creation can fail (no driver, bad ordinal, bad CUARENA_CONF): keep trying on later calls
    // rather than caching the failure, and never create two.
    let _g = lock(&CREATING);
    if let Some(a) = slot.get() {
        return Ok(a);
    }
    // Once exit has begun no allocator is made: that would load the driver, initialise it and
    // make a context from an `atexit` handler or a late destructor (`shutdown.rs`).
    if crate::shutdown::process_exiting() {
        return Err(Error::ShutDown);
    }
    let config = Config::from_env_over(&lock(&DEFAULTS))?;
    let a = Allocator::cuda(device, config)?;
    Ok(slot.get_or_init(|| a))
}

/// Sets the defaults under `CUARENA_CONF` for the process-wide allocators made from now on:
/// `items` in the same form (`legacy_batch_bytes=16MiB`), which `CUARENA_CONF`'s own items
/// override (an empty string: none). It replaces any defaults set before, and touches no
/// environment variable, so child processes and later readers of `CUARENA_CONF` see what the
/// user set. Returns how many devices' allocators exist already: they keep their
/// configuration (0: the defaults apply to every device). Invalid `items`, and any `trace`
/// item (a trace is the user's to ask for, and `CUARENA_CONF` could not turn a default one
/// off), are refused ([`Error::Config`], naming this call) and change nothing.
pub fn set_defaults(items: &str) -> Result<usize> {
    let shown = crate::config::Echo(items);
    let refused = |why: String| {
        Error::Config(format!("set_defaults (C: cuarena_set_defaults) refused `{shown}`: {why}"))
    };
    let c = Config::parse(items).map_err(|e| match e {
        Error::Config(m) => refused(m),
        e => e,
    })?;
    if c.trace.is_some() {
        return Err(refused(
            "defaults may not start a trace (the user's CUARENA_CONF could not turn it off)".into(),
        ));
    }
    not_locked_by_the_parent()?;
    let _g = lock(&CREATING);
    *lock(&DEFAULTS) = items.to_owned();
    Ok(created().count())
}

/// The defaults [`set_defaults`] set last (empty: none, and in a forked child whose parent
/// held them at the fork, when they cannot be read).
pub fn defaults() -> String {
    if not_locked_by_the_parent().is_err() {
        return String::new();
    }
    lock(&DEFAULTS).clone()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why `device` (negative, or not below [`MAX_DEVICES`]) has no slot: the driver's own answer
/// when it has one (no driver, or the real device count), else cuarena's per-process limit.
fn out_of_range(device: i32) -> Error {
    match crate::device::cuda::device_count() {
        Err(e) => e,
        Ok(count) if device < 0 || device >= count => Error::NoDevice { ordinal: device, count },
        Ok(count) => Error::Config(format!(
            "CUDA device {device} exists (the driver reports {count}) but cuarena supports at most \
             {MAX_DEVICES} devices per process (its own limit, MAX_DEVICES)"
        )),
    }
}

/// The process-wide allocator of `device` if it has been created, without creating it (no
/// driver call): `None` for a device not used through [`global`] yet, or out of range, and in
/// a forked child for one made before the fork (unusable there: [`Allocator::forked`]).
pub fn existing(device: i32) -> Option<&'static Allocator> {
    usize::try_from(device)
        .ok()
        .and_then(|d| ALLOCATORS.get(d))
        .and_then(OnceLock::get)
        .filter(|a| !a.forked())
}

/// The process-wide allocators created so far (in a forked child, none made before the fork).
pub fn created() -> impl Iterator<Item = (i32, &'static Allocator)> {
    ALLOCATORS.iter().enumerate().filter_map(|(i, s)| s.get().filter(|a| !a.forked()).map(|a| (i as i32, a)))
}
