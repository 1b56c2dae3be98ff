//! The superblock registry (`src/registry.rs`): a writer (holding the pool lock) installs a
//! leaf and an entry while a free looks the address up without a lock. A reader that finds the
//! entry must see the superblock fully initialised.
#![cfg(loom)]

use cuarena::loom_api::RegistryModel;
use loom::thread;

#[test]
fn a_lock_free_lookup_sees_an_initialised_superblock_or_nothing() {
    loom::model(|| {
        let r = RegistryModel::new(64 << 10);
        let r2 = r.clone();
        // The writer runs first in loom's first schedule, so the reader's loads are checked
        // against its stores (see loom-tests/README.md).
        let reader = thread::spawn(move || {
            for addr in [(2 << 16) + 256, 3 << 16] {
                if let Some(tags) = r2.lookup(addr) {
                    assert_eq!(tags, r2.granules(), "a published superblock is initialised");
                }
            }
        });
        r.insert(2 << 16);
        r.insert(3 << 16);
        reader.join().unwrap();
        assert_eq!(r.lookup(2 << 16), Some(r.granules()));
        assert_eq!(r.lookup(5 << 16), None);
    });
}
