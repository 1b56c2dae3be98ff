//! Device addresses as the allocator hands them out.

/// A device address. Null is `DeviceAddr(0)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceAddr(pub u64);

impl DeviceAddr {
    /// The null pointer.
    pub const NULL: DeviceAddr = DeviceAddr(0);

    /// True for null.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}
