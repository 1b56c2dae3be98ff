//! cuarena's names and cudarc's side by side under glob imports: none of the names a user
//! writes is ambiguous (a `DevicePtr` struct once collided with cudarc's `DevicePtr` trait).

use cuarena::*;
use cudarc::driver::*;

/// Names cudarc's slice traits, so their names resolve to cudarc's here.
fn cudarc_traits<T, S: DevicePtr<T> + DevicePtrMut<T> + DeviceSlice<T>>(s: &S) -> usize {
    s.len()
}

#[test]
fn both_crates_glob_imported() {
    let p: DeviceAddr = DeviceAddr::NULL;
    assert!(p.is_null());
    let s: Stream = Stream::PER_THREAD;
    assert!(s.is_per_thread());
    let cfg: Config = Config::default();
    assert!(cfg.superblock() > 0);
    let _: fn(&CudaBuffer<u8>) -> usize = cudarc_traits::<u8, CudaBuffer<u8>>;
    let e: Error = Error::NoDriver;
    let r: cuarena::Result<()> = Err(e);
    assert!(r.is_err());
}
