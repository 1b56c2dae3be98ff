//! Size classes: how a request is rounded, and which free list a free block belongs to.
//!
//! Everything is counted in 256-byte granules (the minimum alignment).
//! - Up to 2 KiB (8 granules) the classes are every granule: 256, 512, .., 2048 B, so the waste
//!   is below one 256 B step.
//! - From 2 KiB up, each power-of-two range `[8·2^k, 16·2^k)` granules is split into 8 equal
//!   classes of `2^k` granules. A request of `b >= 2048` bytes lands in a class less than
//!   `256·2^k <= b/8` bytes above it: waste below 12.5%.
//!
//! Class indices are dense (0, 1, 2, ..) and grow with size, so the arena keeps one bit per
//! class in a bitmap of two `u64` words (`free_lists.rs`) and finds the smallest non-empty
//! class that fits in O(1).

/// Minimum alignment and allocation unit, in bytes.
pub const GRANULE: usize = 256;
/// `log2(GRANULE)`.
pub const GRANULE_SHIFT: u32 = 8;
/// Classes representable in the arena's bitmap (two `u64` words, `free_lists.rs`).
pub const MAX_CLASSES: usize = 128;
/// The largest block (in granules) whose class index is below [`MAX_CLASSES`]: 64 MiB.
pub const MAX_CLASSED_GRANULES: usize = 1 << 18;

/// Granules needed for `bytes`, or `None` if rounding overflows.
#[inline]
pub fn granules_for(bytes: usize) -> Option<usize> {
    bytes.checked_add(GRANULE - 1).map(|b| b >> GRANULE_SHIFT)
}

/// `(k, m)` with `g = m·2^k + r`, `8 <= m < 16`, for `g >= 8`.
#[inline]
fn split(g: usize) -> (u32, usize) {
    let k = (usize::BITS - 1 - g.leading_zeros()) - 3;
    (k, g >> k)
}

/// The class holding free blocks of `g` granules: the largest class not above `g`.
#[inline]
pub fn class_floor(g: usize) -> usize {
    debug_assert!(g >= 1);
    if g <= 8 {
        return g - 1;
    }
    let (k, m) = split(g);
    7 + 8 * k as usize + (m - 8)
}

/// The class a request of `g` granules is rounded up to: the smallest class not below `g`.
#[inline]
pub fn class_ceil(g: usize) -> usize {
    debug_assert!(g >= 1);
    if g <= 8 {
        return g - 1;
    }
    let (k, m) = split(g);
    let exact = g & ((1usize << k) - 1) == 0;
    7 + 8 * k as usize + (m - 8) + usize::from(!exact)
}

/// Size of class `idx` in granules (`idx < MAX_CLASSES`): one load from a table the compiler
/// fills (`class_granules_computed`), where the arithmetic took a dozen instructions, three
/// times a pair on the fast path.
#[inline]
pub fn class_granules(idx: usize) -> usize {
    CLASS_GRANULES[idx] as usize
}

/// Every class's size in granules.
static CLASS_GRANULES: [u32; MAX_CLASSES] = {
    let mut t = [0; MAX_CLASSES];
    let mut i = 0;
    while i < MAX_CLASSES {
        t[i] = class_granules_computed(i) as u32;
        i += 1;
    }
    t
};

/// Size of class `idx` in granules, computed: `idx + 1` up to 8 granules, then
/// `(8 + j % 8) << (j / 8)` for `j = idx - 7`.
const fn class_granules_computed(idx: usize) -> usize {
    if idx < 8 {
        return idx + 1;
    }
    let j = idx - 7;
    let (k, m) = (j / 8, 8 + j % 8);
    m << k
}

/// Bytes a small request of `bytes` occupies after class rounding (`bytes > 0`).
#[inline]
pub fn class_rounded_bytes(bytes: usize) -> Option<usize> {
    let g = granules_for(bytes)?;
    if g > MAX_CLASSED_GRANULES {
        return None;
    }
    Some(class_granules(class_ceil(g)) << GRANULE_SHIFT)
}

/// The bytes a block of `size` occupies: class-rounded if it is small (`<= small_max`),
/// rounded to the granule otherwise. `None` if rounding overflows. One rule for allocation
/// and for checking the size given to a free.
#[inline]
pub fn block_bytes(size: usize, small_max: usize) -> Option<usize> {
    if size <= small_max { class_rounded_bytes(size) } else { granules_for(size).map(|g| g << GRANULE_SHIFT) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_and_ceil_bracket_every_size() {
        for g in 1..=MAX_CLASSED_GRANULES {
            let f = class_floor(g);
            let c = class_ceil(g);
            assert!(class_granules(f) <= g, "floor of {g}");
            assert!(class_granules(c) >= g, "ceil of {g}");
            assert!(c == f || c == f + 1);
            if f + 1 < MAX_CLASSES {
                assert!(class_granules(f + 1) > g, "floor of {g} is not the largest");
            }
            assert!(c < MAX_CLASSES);
        }
    }

    #[test]
    fn classes_are_dense_and_increasing() {
        for i in 0..MAX_CLASSES - 1 {
            assert!(class_granules(i) < class_granules(i + 1));
            assert_eq!(class_floor(class_granules(i)), i);
            assert_eq!(class_ceil(class_granules(i)), i);
        }
        assert_eq!(class_floor(MAX_CLASSED_GRANULES), MAX_CLASSES - 1);
    }

    #[test]
    fn waste_bounds_hold_for_every_byte_size_up_to_4_mib() {
        let mut b = 1usize;
        while b <= 4 << 20 {
            let r = class_rounded_bytes(b).unwrap();
            assert!(r >= b && r.is_multiple_of(GRANULE));
            if b >= 2048 {
                assert!((r - b) * 8 <= b, "waste for {b}: {r}");
            } else {
                assert!(r - b < GRANULE, "waste for {b}: {r}");
            }
            b += if b < 70_000 { 1 } else { 97 };
        }
    }

    #[test]
    fn the_table_is_the_arithmetic() {
        for i in 0..MAX_CLASSES {
            assert_eq!(class_granules(i), class_granules_computed(i), "class {i}");
        }
        assert_eq!(class_granules(MAX_CLASSES - 1), MAX_CLASSED_GRANULES);
    }

    #[test]
    fn no_power_of_two_bins() {
        // Between 64 KiB and 128 KiB there are 8 classes, not one.
        let lo = class_ceil(256);
        let hi = class_ceil(512);
        assert_eq!(hi - lo, 8);
    }

    #[test]
    fn overflow_is_none() {
        assert_eq!(granules_for(usize::MAX), None);
        assert_eq!(class_rounded_bytes(usize::MAX - 10), None);
    }
}
