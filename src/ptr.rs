//! Device addresses as the allocator hands them out.

/// A device address. Null is `DevicePtr(0)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// True for null.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}
