//! An address-ordered map of free extents with O(log n) first fit: a treap augmented with the
//! largest extent, and the largest aligned run, in each subtree.
//!
//! ## Invariants (checked by `check`: unit tests, `Allocator::check_invariants`)
//! - In-order traversal is strictly increasing in `key` (the extent's start address).
//! - Heap order: a node's `prio` is not below either child's.
//! - `max_len` is the maximum `len` in the node's subtree; `max_aligned` the maximum
//!   `aligned_capacity` for the tree's alignment.
//!
//! First fit descends to the leftmost subtree whose maximum fits, so it finds the lowest
//! address that fits in expected O(log n) without scanning free extents.

const NIL: u32 = u32::MAX;

struct Node<V> {
    key: u64,
    len: u64,
    prio: u32,
    left: u32,
    right: u32,
    max_len: u64,
    max_aligned: u64,
    val: V,
}

/// The bytes of `[start, start+len)` usable as a run starting and ending on `align` boundaries.
pub(crate) fn aligned_capacity(start: u64, len: u64, align: u64) -> u64 {
    let s = start.next_multiple_of(align);
    let e = (start + len) / align * align;
    e.saturating_sub(s)
}

/// The map. `align` is the alignment whose runs `first_fit_aligned` searches.
pub struct AddressTree<V> {
    nodes: Vec<Option<Node<V>>>,
    spare: Vec<u32>,
    root: u32,
    rng: u64,
    align: u64,
    count: usize,
}

impl<V> AddressTree<V> {
    pub fn new(align: u64) -> Self {
        AddressTree {
            nodes: Vec::new(),
            spare: Vec::new(),
            root: NIL,
            rng: 0x2545_f491_4f6c_dd1d,
            align,
            count: 0,
        }
    }

    fn n(&self, i: u32) -> &Node<V> {
        self.nodes[i as usize].as_ref().expect("live node")
    }

    fn nm(&mut self, i: u32) -> &mut Node<V> {
        self.nodes[i as usize].as_mut().expect("live node")
    }

    fn update(&mut self, i: u32) {
        let (l, r) = (self.n(i).left, self.n(i).right);
        let (mut ml, mut ma) = (self.n(i).len, aligned_capacity(self.n(i).key, self.n(i).len, self.align));
        for c in [l, r] {
            if c != NIL {
                ml = ml.max(self.n(c).max_len);
                ma = ma.max(self.n(c).max_aligned);
            }
        }
        let node = self.nm(i);
        node.max_len = ml;
        node.max_aligned = ma;
    }

    /// Splits `t` into keys `< key` and keys `>= key`.
    fn split(&mut self, t: u32, key: u64) -> (u32, u32) {
        if t == NIL {
            return (NIL, NIL);
        }
        if self.n(t).key < key {
            let (l, r) = self.split(self.n(t).right, key);
            self.nm(t).right = l;
            self.update(t);
            (t, r)
        } else {
            let (l, r) = self.split(self.n(t).left, key);
            self.nm(t).left = r;
            self.update(t);
            (l, t)
        }
    }

    /// Joins `a` and `b`, every key of `a` below every key of `b`.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.n(a).prio >= self.n(b).prio {
            let r = self.merge(self.n(a).right, b);
            self.nm(a).right = r;
            self.update(a);
            a
        } else {
            let l = self.merge(a, self.n(b).left);
            self.nm(b).left = l;
            self.update(b);
            b
        }
    }

    /// Inserts an extent. `key` must not be present.
    pub fn insert(&mut self, key: u64, len: u64, val: V) {
        debug_assert!(self.get(key).is_none(), "duplicate key {key:#x}");
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let node =
            Node { key, len, prio: self.rng as u32, left: NIL, right: NIL, max_len: 0, max_aligned: 0, val };
        let i = match self.spare.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as u32
            }
        };
        self.update(i);
        let (l, r) = self.split(self.root, key);
        let l = self.merge(l, i);
        self.root = self.merge(l, r);
        self.count += 1;
    }

    /// Removes the extent starting at `key`.
    pub fn remove(&mut self, key: u64) -> Option<(u64, V)> {
        let (l, r) = self.split(self.root, key);
        let (m, r) = self.split(r, key + 1);
        self.root = self.merge(l, r);
        if m == NIL {
            return None;
        }
        let node = self.nodes[m as usize].take().expect("live node");
        self.spare.push(m);
        self.count -= 1;
        Some((node.len, node.val))
    }

    /// The extent starting exactly at `key`.
    pub fn get(&self, key: u64) -> Option<(u64, &V)> {
        let mut t = self.root;
        while t != NIL {
            let n = self.n(t);
            if key == n.key {
                return Some((n.len, &n.val));
            }
            t = if key < n.key { n.left } else { n.right };
        }
        None
    }

    /// The extent with the greatest start below `key`.
    pub fn below(&self, key: u64) -> Option<(u64, u64, &V)> {
        let (mut t, mut best) = (self.root, NIL);
        while t != NIL {
            let n = self.n(t);
            if n.key < key {
                best = t;
                t = n.right;
            } else {
                t = n.left;
            }
        }
        (best != NIL).then(|| {
            let n = self.n(best);
            (n.key, n.len, &n.val)
        })
    }

    /// The lowest-addressed extent of at least `len` bytes.
    pub fn first_fit(&self, len: u64) -> Option<u64> {
        self.descend(|n| n.max_len >= len, |n| n.len >= len)
    }

    /// The lowest-addressed extent holding an `align`-aligned run of `len` bytes.
    pub(crate) fn first_fit_aligned(&self, len: u64) -> Option<u64> {
        let a = self.align;
        self.descend(|n| n.max_aligned >= len, |n| aligned_capacity(n.key, n.len, a) >= len)
    }

    fn descend(&self, sub: impl Fn(&Node<V>) -> bool, this: impl Fn(&Node<V>) -> bool) -> Option<u64> {
        let mut t = self.root;
        while t != NIL {
            let n = self.n(t);
            if n.left != NIL && sub(self.n(n.left)) {
                t = n.left;
            } else if this(n) {
                return Some(n.key);
            } else if n.right != NIL && sub(self.n(n.right)) {
                t = n.right;
            } else {
                return None;
            }
        }
        None
    }

    /// The largest extent's length.
    pub(crate) fn max_len(&self) -> u64 {
        if self.root == NIL { 0 } else { self.n(self.root).max_len }
    }

    /// Number of extents.
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Every extent in address order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(u64, u64, &V)) {
        let mut stack = Vec::new();
        let mut t = self.root;
        while t != NIL || !stack.is_empty() {
            while t != NIL {
                stack.push(t);
                t = self.n(t).left;
            }
            let i = stack.pop().expect("non-empty");
            let n = self.n(i);
            f(n.key, n.len, &n.val);
            t = n.right;
        }
    }

    /// Checks every invariant; panics with a description if one fails.
    pub(crate) fn check(&self) {
        fn walk<V>(t: &AddressTree<V>, i: u32, lo: Option<u64>, hi: Option<u64>) -> (u64, u64, usize) {
            if i == NIL {
                return (0, 0, 0);
            }
            let n = t.n(i);
            assert!(lo.is_none_or(|lo| n.key > lo) && hi.is_none_or(|hi| n.key < hi), "order");
            for c in [n.left, n.right] {
                assert!(c == NIL || t.n(c).prio <= n.prio, "heap");
            }
            let (ll, la, lc) = walk(t, n.left, lo, Some(n.key));
            let (rl, ra, rc) = walk(t, n.right, Some(n.key), hi);
            let ml = n.len.max(ll).max(rl);
            let ma = aligned_capacity(n.key, n.len, t.align).max(la).max(ra);
            assert_eq!((n.max_len, n.max_aligned), (ml, ma), "augmentation at {:#x}", n.key);
            (ml, ma, lc + rc + 1)
        }
        let (_, _, c) = walk(self, self.root, None, None);
        assert_eq!(c, self.count, "count");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn matches_a_naive_model_under_random_operations() {
        let align = 4096u64;
        let mut t = AddressTree::new(align);
        let mut m: BTreeMap<u64, u64> = BTreeMap::new();
        let mut x = 12345u64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for step in 0..20_000 {
            let key = rnd(1 << 20) * 256;
            match rnd(3) {
                0 if !m.contains_key(&key) => {
                    let len = (1 + rnd(64)) * 256;
                    t.insert(key, len, key ^ len);
                    m.insert(key, len);
                }
                1 => {
                    let want = m.remove(&key);
                    assert_eq!(t.remove(key).map(|(l, v)| (l, v == key ^ l)), want.map(|l| (l, true)));
                }
                _ => {
                    let need = (1 + rnd(64)) * 256;
                    let naive = m.iter().find(|&(_, &l)| l >= need).map(|(&k, _)| k);
                    assert_eq!(t.first_fit(need), naive);
                    let naive_a =
                        m.iter().find(|&(&k, &l)| aligned_capacity(k, l, align) >= need).map(|(&k, _)| k);
                    assert_eq!(t.first_fit_aligned(need), naive_a);
                    let below = m.range(..key).next_back().map(|(&k, &l)| (k, l));
                    assert_eq!(t.below(key).map(|(k, l, _)| (k, l)), below);
                    assert_eq!(t.max_len(), m.values().copied().max().unwrap_or(0));
                }
            }
            if step % 1000 == 0 {
                t.check();
            }
        }
        t.check();
        let mut seen = Vec::new();
        t.for_each(|k, l, _| seen.push((k, l)));
        assert_eq!(seen, m.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn aligned_capacity_edges() {
        assert_eq!(aligned_capacity(0, 4096, 4096), 4096);
        assert_eq!(aligned_capacity(256, 4096, 4096), 0);
        assert_eq!(aligned_capacity(256, 8192, 4096), 4096);
        assert_eq!(aligned_capacity(4096, 100, 4096), 0);
    }
}
