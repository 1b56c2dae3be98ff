//! `Stats::limit_bytes` and `device_total_bytes` read back the cap the allocator enforces (the
//! `limit` of its out-of-memory error) in every mode and after every way of setting it
//! (helper-17's review of the fields).

use std::time::Duration;

use cuarena::{Allocator, Config, Error, Stream};
use cuarena_testkit::{HostConfig, HostDevice, host_allocator};

fn make(conf: &str) -> Allocator {
    let dev = HostDevice::new(HostConfig {
        capacity: 256 << 20,
        min_delay: Duration::ZERO,
        max_delay: Duration::ZERO,
        ..HostConfig::default()
    });
    host_allocator(dev, Config::parse(conf).unwrap()).unwrap()
}

fn oom_limit(a: &Allocator, size: usize) -> u64 {
    match a.allocate(size, Stream::LEGACY) {
        Err(Error::OutOfMemory { limit, .. }) => limit as u64,
        other => panic!("expected out of memory, got {other:?}"),
    }
}

#[test]
fn the_statistics_cap_is_the_enforced_cap_in_every_mode() {
    for mode in [
        "small_max=64KiB,superblock=256KiB,chunk=1MiB",
        "passthrough,small_max=64KiB,superblock=256KiB,chunk=1MiB",
    ] {
        let a = make(mode);
        let s = a.stats();
        assert_eq!((s.limit_bytes, s.device_total_bytes), (256 << 20, 256 << 20), "{mode}: default max=100%");
        a.set_memory_fraction(0.5).unwrap();
        assert_eq!(a.stats().limit_bytes, 128 << 20, "{mode}");
        assert_eq!(oom_limit(&a, 200 << 20), a.stats().limit_bytes, "{mode}");
        a.set_limit_bytes(3 << 20);
        assert_eq!(a.stats().limit_bytes, 3 << 20, "{mode}");
        assert_eq!(oom_limit(&a, 8 << 20), a.stats().limit_bytes, "{mode}");
        a.set_limit_bytes(usize::MAX); // over the device: reported as is (the shim clamps its fraction to 1)
        assert_eq!(a.stats().limit_bytes, u64::MAX, "{mode}");
        assert_eq!(a.stats().device_total_bytes, 256 << 20, "{mode}");
    }
}

#[test]
fn a_configured_max_over_the_device_is_reported_as_configured() {
    let a = make("small_max=64KiB,superblock=256KiB,chunk=1MiB,max=1GiB"); // a 256 MiB device
    let s = a.stats();
    assert_eq!((s.limit_bytes, s.device_total_bytes), (1 << 30, 256 << 20));
    let a = make("small_max=64KiB,superblock=256KiB,chunk=1MiB,max=12.5%");
    assert_eq!(a.stats().limit_bytes, 32 << 20);
}
