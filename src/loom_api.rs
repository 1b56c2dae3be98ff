//! Entry points for the loom models in `loom-tests/` to reach internals that have no public
//! API. Built only with `--cfg loom`.

use std::sync::Arc;

use crate::registry::Registry;
use crate::sync::{Mutex, lock};

/// The superblock registry with the pool lock its writers hold.
pub struct RegistryModel {
    registry: Registry,
    writers: Mutex<()>,
    granules: usize,
}

impl RegistryModel {
    /// A registry for superblocks of `superblock` bytes.
    pub fn new(superblock: usize) -> Arc<RegistryModel> {
        Arc::new(RegistryModel {
            registry: Registry::new(superblock),
            writers: Mutex::new(()),
            granules: superblock / 256,
        })
    }

    /// Registers the superblock at `base` under the writers' lock, as the pool does.
    pub fn insert(&self, base: u64) {
        let _g = lock(&self.writers);
        self.registry.get_or_insert(base, self.granules);
    }

    /// Looks `addr` up without a lock, as a free does, and reads state that `Superblock::new`
    /// set before publication: `Some(tag capacity)` if found.
    pub fn lookup(&self, addr: u64) -> Option<usize> {
        let sb = self.registry.lookup(addr)?;
        // SAFETY: nobody owns the superblock in this model, so nothing writes `local` after
        // its creation; the read checks that the creation is visible (the property under test).
        Some(unsafe { sb.with_local(|l| l.tags.capacity()) })
    }

    /// The tag capacity a registered superblock has.
    pub fn granules(&self) -> usize {
        self.granules
    }
}
