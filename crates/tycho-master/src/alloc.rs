//! The range allocator of one segment.
//!
//! Free space is kept as a set of maximal free ranges, indexed twice: by offset (to merge a
//! freed range with its neighbours and to find the range that holds a given offset) and by
//! (length, offset) (best fit: the smallest free range that is large enough, lowest offset
//! first). Its memory grows with the number of free ranges, never with a cap fixed at mount
//! time, so a segment fills with values of any size; an allocation's own record is the
//! caller's `(offset, len)`. Besides allocate and free it reserves an exact range, which a
//! replica of the metadata (a standby, a snapshot import, a remount that keeps the ranges of
//! writes still in flight) needs to rebuild the same allocations.

use std::collections::{BTreeMap, BTreeSet};

/// Free-range allocator over `[0, size)` in units of `unit` bytes.
pub struct RangeAllocator {
    unit: u64,
    size: u64,
    by_offset: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl RangeAllocator {
    /// An allocator with all of `[0, size)` free; `size` is cut down to a whole number of units.
    pub fn new(size: u64, unit: u64) -> RangeAllocator {
        assert!(unit.is_power_of_two(), "unit must be a power of two");
        let size = size / unit * unit;
        let mut a = RangeAllocator { unit, size, by_offset: BTreeMap::new(), by_len: BTreeSet::new(), free_bytes: 0 };
        if size > 0 {
            a.insert_free(0, size);
        }
        a
    }

    /// Bytes an allocation of `len` takes: `len` rounded up to the unit.
    pub fn rounded(&self, len: u64) -> Option<u64> {
        len.checked_next_multiple_of(self.unit).filter(|&r| r > 0)
    }

    /// Free bytes.
    #[cfg(test)]
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Number of free ranges (a measure of fragmentation and of the allocator's own memory).
    #[cfg(test)]
    pub fn free_ranges(&self) -> usize {
        self.by_offset.len()
    }

    /// Allocates `len` bytes (rounded up to the unit) from the smallest free range that holds
    /// them. Returns `(offset, reserved)`.
    pub fn allocate(&mut self, len: u64) -> Option<(u64, u64)> {
        let want = self.rounded(len)?;
        let &(flen, foff) = self.by_len.range((want, 0)..).next()?;
        self.remove_free(foff, flen);
        if flen > want {
            self.insert_free(foff + want, flen - want);
        }
        Some((foff, want))
    }

    /// Reserves exactly `[offset, offset + len)` (`len` rounded up to the unit). Fails if any
    /// of it is not free or the offset is not aligned.
    pub fn reserve(&mut self, offset: u64, len: u64) -> Option<u64> {
        let want = self.rounded(len)?;
        if !offset.is_multiple_of(self.unit) || offset.checked_add(want)? > self.size {
            return None;
        }
        let (&foff, &flen) = self.by_offset.range(..=offset).next_back()?;
        if foff + flen < offset + want {
            return None;
        }
        self.remove_free(foff, flen);
        if foff < offset {
            self.insert_free(foff, offset - foff);
        }
        let end = offset + want;
        if end < foff + flen {
            self.insert_free(end, foff + flen - end);
        }
        Some(want)
    }

    /// Returns `[offset, offset + reserved)`, merging it with free neighbours. Freeing a range
    /// that is (partly) free already is a bug in the caller; it is refused and reported.
    pub fn free(&mut self, offset: u64, reserved: u64) -> bool {
        let end = match offset.checked_add(reserved) {
            Some(e) if reserved > 0 && e <= self.size => e,
            _ => return false,
        };
        let prev = self.by_offset.range(..=offset).next_back().map(|(&o, &l)| (o, l));
        if prev.is_some_and(|(o, l)| o + l > offset) {
            return false;
        }
        let next = self.by_offset.range(offset..).next().map(|(&o, &l)| (o, l));
        if next.is_some_and(|(o, _)| o < end) {
            return false;
        }
        let (mut start, mut stop) = (offset, end);
        if let Some((o, l)) = prev.filter(|(o, l)| o + l == offset) {
            self.remove_free(o, l);
            start = o;
        }
        if let Some((o, l)) = next.filter(|(o, _)| *o == end) {
            self.remove_free(o, l);
            stop = o + l;
        }
        self.insert_free(start, stop - start);
        true
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_len.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_len.remove(&(len, offset));
        self.free_bytes -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fills_completely_with_small_values_and_merges_on_free() {
        let mut a = RangeAllocator::new(1 << 20, 64);
        let mut got = Vec::new();
        while let Some(x) = a.allocate(600) {
            got.push(x);
        }
        // 640 bytes each: every byte but the tail that cannot hold one more.
        assert_eq!(got.len() as u64, (1 << 20) / 640);
        assert!(a.free_bytes() < 640);
        for (o, r) in got {
            assert!(a.free(o, r));
        }
        assert_eq!(a.free_bytes(), 1 << 20);
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.allocate(1 << 20), Some((0, 1 << 20)));
    }

    #[test]
    fn reserves_exact_ranges_and_refuses_overlaps() {
        let mut a = RangeAllocator::new(4096, 64);
        assert_eq!(a.reserve(1024, 100), Some(128));
        assert_eq!(a.reserve(1088, 64), None, "overlaps the reservation");
        assert_eq!(a.reserve(1000, 64), None, "unaligned");
        assert_eq!(a.reserve(4032, 128), None, "past the end");
        assert_eq!(a.free_bytes(), 4096 - 128);
        // Best fit: the 1024-byte hole before the reservation is used for a 1000-byte value.
        assert_eq!(a.allocate(1000), Some((0, 1024)));
        assert!(a.free(1024, 128));
        assert!(!a.free(1024, 128), "double free is refused");
    }

    proptest! {
        #[test]
        fn never_hands_out_overlapping_ranges(ops in proptest::collection::vec((0u8..3, 1u64..5000), 1..300)) {
            let mut a = RangeAllocator::new(64 * 1024, 64);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (op, n) in ops {
                match op {
                    0 => if let Some((o, r)) = a.allocate(n) { live.push((o, r)); },
                    1 => if !live.is_empty() {
                        let (o, r) = live.swap_remove(n as usize % live.len());
                        prop_assert!(a.free(o, r));
                    },
                    _ => { let off = (n * 64) % (64 * 1024); if let Some(r) = a.reserve(off, n) { live.push((off, r)); } }
                }
                let mut sorted = live.clone();
                sorted.sort();
                for w in sorted.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                let used: u64 = live.iter().map(|x| x.1).sum();
                prop_assert_eq!(used + a.free_bytes(), 64 * 1024);
            }
        }
    }
}
