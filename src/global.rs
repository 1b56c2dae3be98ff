//! Process-wide allocators, one per CUDA device, created on first use with `CUARENA_CONF`,
//! over the defaults a framework's glue may set first ([`set_defaults`]).
//!
//! They are never dropped: a process-wide allocator lives until the process ends, and once exit
//! has begun (see `shutdown.rs`) cuarena makes no further CUDA call, so threads that outlive
//! `main` and late destructors cannot crash in a torn-down driver.

use std::sync::{Mutex, OnceLock};

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

/// The process-wide allocator of CUDA device `device`, created on first use ([`Error::ShutDown`]
/// instead once process exit has begun).
pub fn global(device: i32) -> Result<&'static Allocator> {
    let Some(slot) = usize::try_from(device).ok().and_then(|d| ALLOCATORS.get(d)) else {
        return Err(out_of_range(device));
    };
    if let Some(a) = slot.get() {
        return Ok(a);
    }
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
    let _g = lock(&CREATING);
    *lock(&DEFAULTS) = items.to_owned();
    Ok(created().count())
}

/// The defaults [`set_defaults`] set last (empty: none).
pub fn defaults() -> String {
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
/// driver call): `None` for a device not used through [`global`] yet, or out of range.
pub fn existing(device: i32) -> Option<&'static Allocator> {
    usize::try_from(device).ok().and_then(|d| ALLOCATORS.get(d)).and_then(OnceLock::get)
}

/// The process-wide allocators created so far.
pub fn created() -> impl Iterator<Item = (i32, &'static Allocator)> {
    ALLOCATORS.iter().enumerate().filter_map(|(i, s)| s.get().map(|a| (i as i32, a)))
}
