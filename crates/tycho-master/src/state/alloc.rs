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
//!
//! A freed range may also be *held* for the tenant whose object it held, until a given time:
//! until then only allocations for that tenant may take it (see [`RangeAllocator::hold`]). The
//! master holds a range while a capability it minted for the range may still be used, so that
//! a grant kept by one tenant never reaches another tenant's bytes. The tenant itself reuses its
//! held space before free space once held space exceeds a share of free space (and whenever
//! free space has no range large enough), so it never runs short of room it freed.

use std::collections::{BTreeMap, BTreeSet};

/// Held space above this fraction (1 / `HELD_SHARE`) of free space makes a tenant's allocations
/// take its held ranges before free space (see [`RangeAllocator::allocate_for`]).
pub const HELD_SHARE: u64 = 8;

/// Free-range allocator over `[0, size)` in units of `unit` bytes.
pub struct RangeAllocator {
    unit: u64,
    size: u64,
    by_offset: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    free_bytes: u64,
    /// Held ranges by their *end* offset (never adjacent with the same tenant: those are
    /// merged). Keyed by the end, so that an allocation taken off a held range's front, the
    /// common case, changes the entry in place and leaves `held_due` alone.
    held: BTreeMap<u64, Held>,
    /// Held ranges by (tenant, length, end), for best fit within a tenant's.
    held_fit: BTreeSet<(u64, u64, u64)>,
    /// Held ranges by (until, end), to give them back once due.
    held_due: BTreeSet<(u64, u64)>,
    held_bytes: u64,
    /// Ranges taken by [`RangeAllocator::take_unallocated`], by end (start as the value): never
    /// free, and a free or hold over them is refused as over a free range.
    fenced: BTreeMap<u64, u64>,
}

/// A freed range that only `tenant` may take until `until`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    len: u64,
    tenant: u64,
    until: u64,
}

impl RangeAllocator {
    /// An allocator with all of `[0, size)` free; `size` is cut down to a whole number of units.
    pub fn new(size: u64, unit: u64) -> RangeAllocator {
        assert!(unit.is_power_of_two(), "unit must be a power of two");
        let size = size / unit * unit;
        let mut a = RangeAllocator {
            unit,
            size,
            by_offset: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free_bytes: 0,
            held: BTreeMap::new(),
            held_fit: BTreeSet::new(),
            held_due: BTreeSet::new(),
            held_bytes: 0,
            fenced: BTreeMap::new(),
        };
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

    /// Reserves exactly `[offset, offset + len)` (`len` rounded up to the unit), whether its
    /// pieces are free or held (a replay takes what the primary allocated, whatever this copy
    /// still holds). Fails if any of it is allocated or the offset is not aligned.
    pub fn reserve(&mut self, offset: u64, len: u64) -> Option<u64> {
        let want = self.rounded(len)?;
        if !offset.is_multiple_of(self.unit) || offset.checked_add(want)? > self.size {
            return None;
        }
        let end = offset + want;
        // Check that free and held ranges cover all of it before taking anything.
        let mut pieces = Vec::new();
        let mut at = offset;
        while at < end {
            let free = self.by_offset.range(..=at).next_back().map(|(&o, &l)| (o, o + l, false));
            let held = self.held_around(at).map(|(_, e)| (e, e, true));
            let (key, stop, is_held) = [free, held].into_iter().flatten().find(|&(_, stop, _)| stop > at)?;
            pieces.push((key, is_held));
            at = stop;
        }
        for (o, is_held) in pieces {
            if is_held {
                self.carve_held(o, offset, end);
            } else {
                let l = self.by_offset[&o];
                self.remove_free(o, l);
                if o < offset {
                    self.insert_free(o, offset - o);
                }
                if end < o + l {
                    self.insert_free(end, o + l - end);
                }
            }
        }
        Some(want)
    }

    /// Takes every part of `[offset, end)` that is free or held, so that it is never handed
    /// out (a fence: bytes set aside for VSegments); allocated parts stay allocated. Returns the
    /// bytes taken. The range is clipped to the allocator; its ends must be whole units.
    pub fn take_unallocated(&mut self, offset: u64, end: u64) -> u64 {
        let end = end.min(self.size);
        if offset >= end || !offset.is_multiple_of(self.unit) || !end.is_multiple_of(self.unit) {
            return 0;
        }
        let mut taken = 0;
        let mut frees: Vec<(u64, u64)> = Vec::new();
        if let Some((&o, &l)) = self.by_offset.range(..=offset).next_back() {
            if o + l > offset {
                frees.push((o, l));
            }
        }
        frees.extend(self.by_offset.range(offset + 1..end).map(|(&o, &l)| (o, l)));
        for (o, l) in frees {
            self.remove_free(o, l);
            let (from, to) = (o.max(offset), (o + l).min(end));
            if o < from {
                self.insert_free(o, from - o);
            }
            if to < o + l {
                self.insert_free(to, o + l - to);
            }
            taken += to - from;
            self.fenced.insert(to, from);
        }
        let held: Vec<(u64, u64)> = (self.held.range(offset + 1..))
            .take_while(|(&e, h)| e - h.len < end)
            .map(|(&e, h)| (e, e - h.len))
            .collect();
        for (e, start) in held {
            let (from, to) = (start.max(offset), e.min(end));
            taken += to - from;
            self.carve_held(e, offset, end);
            self.fenced.insert(to, from);
        }
        taken
    }

    /// Whether any of `[offset, end)` was taken by [`RangeAllocator::take_unallocated`].
    fn any_fenced(&self, offset: u64, end: u64) -> bool {
        self.fenced.range(offset + 1..).next().is_some_and(|(_, &start)| start < end)
    }

    /// The held range that contains `at`: (start, end).
    fn held_around(&self, at: u64) -> Option<(u64, u64)> {
        let (&e, h) = self.held.range(at + 1..).next()?;
        (e - h.len <= at).then_some((e - h.len, e))
    }

    /// Whether any of `[offset, end)` is held.
    fn any_held(&self, offset: u64, end: u64) -> bool {
        self.held.range(offset + 1..).next().is_some_and(|(&e, h)| e - h.len < end)
    }

    /// Takes `[from, to)` out of the held range that ends at `e`, keeping the parts of it
    /// outside `[from, to)` held.
    fn carve_held(&mut self, e: u64, from: u64, to: u64) {
        let h = self.held[&e];
        let s = e - h.len;
        let (from, to) = (from.max(s), to.min(e));
        if from == s && to < e {
            self.take_front(e, to - from);
            return;
        }
        self.remove_held(e);
        if s < from {
            self.insert_held(s, from - s, h.tenant, h.until, false);
        }
        if to < e {
            self.insert_held(to, e - to, h.tenant, h.until, false);
        }
    }

    /// Takes `n` bytes (fewer than it holds) off the front of the held range that ends at `e`;
    /// returns until when it is held. The end, and so the entry's keys but one, stay as they
    /// are: one lookup, and the fit index moves the entry.
    fn take_front(&mut self, e: u64, n: u64) -> u64 {
        let h = self.held.get_mut(&e).expect("a held range ending here");
        let (tenant, was, until) = (h.tenant, h.len, h.until);
        h.len -= n;
        self.held_fit.remove(&(tenant, was, e));
        self.held_fit.insert((tenant, was - n, e));
        self.held_bytes -= n;
        until
    }

    /// Allocates `len` bytes for `tenant` at `now`. While held space is small next to free space
    /// (at most 1 / [`HELD_SHARE`] of it), like [`allocate`](Self::allocate); otherwise, or when no
    /// free range is large enough, from the ranges held for the tenant first (best fit), and
    /// then from free space. Held ranges that are due go back first. Returns `(offset,
    /// reserved, held_until)`: until when the range was held (0 if it was free), which its next
    /// free must hold it at least as long.
    ///
    /// Why free space first: a master that took every allocation of a tenant from its held
    /// ranges served 16-key batch puts 3-5 % slower than one without holding, with the same CPU
    /// per call but more idle CPU (see docs/security.md); taking free space while there is
    /// plenty costs nothing measurable. The share bounds what a tenant that frees and writes
    /// without pause keeps from others: its held space grows only until it reaches the share,
    /// and from then on the tenant reuses it.
    pub fn allocate_for(&mut self, len: u64, tenant: u64, now: u64) -> Option<(u64, u64, u64)> {
        self.release_due(now);
        let want = self.rounded(len)?;
        if self.held_bytes <= self.free_bytes / HELD_SHARE {
            if let Some((o, r)) = self.allocate(len) {
                return Some((o, r, 0));
            }
        }
        let Some(&(_, held_len, e)) = self.held_fit.range((tenant, want, 0)..=(tenant, u64::MAX, u64::MAX)).next()
        else {
            return self.allocate(len).map(|(o, r)| (o, r, 0));
        };
        let until = if held_len == want { self.remove_held(e).until } else { self.take_front(e, want) };
        Some((e - held_len, want, until))
    }

    /// Frees `[offset, offset + reserved)` but keeps it for `tenant` until `until`: only
    /// [`allocate_for`](Self::allocate_for) of that tenant (or an exact
    /// [`reserve`](Self::reserve)) takes it before then. Due already at `now`: a plain free.
    /// Refused like [`free`](Self::free).
    pub fn hold(&mut self, offset: u64, reserved: u64, tenant: u64, until: u64, now: u64) -> bool {
        if until <= now {
            return self.free(offset, reserved);
        }
        if !self.is_allocated(offset, reserved) {
            return false;
        }
        self.insert_held(offset, reserved, tenant, until, true);
        true
    }

    /// Gives every held range due at `now` back to everyone.
    pub fn release_due(&mut self, now: u64) {
        while let Some(&(until, e)) = self.held_due.first() {
            if until > now {
                break;
            }
            let h = self.remove_held(e);
            let freed = self.free(e - h.len, h.len);
            debug_assert!(freed, "a held range overlapped free space");
        }
    }

    /// The held ranges: offset, bytes, until when.
    pub fn held_ranges(&self) -> Vec<(u64, u64, u64)> {
        self.held.iter().map(|(&e, h)| (e - h.len, h.len, h.until)).collect()
    }

    /// Bytes held for their tenants.
    #[cfg(test)]
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Panics unless the three indexes of held ranges agree with each other and with
    /// `held_bytes`, and no held range overlaps another or free space.
    #[cfg(test)]
    fn check_held(&self) {
        assert_eq!(self.held_fit.len(), self.held.len());
        assert_eq!(self.held_due.len(), self.held.len());
        let mut last_end = 0;
        for (&e, h) in &self.held {
            assert!(h.len > 0 && e - h.len >= last_end, "held ranges overlap at {e}");
            assert!(self.held_fit.contains(&(h.tenant, h.len, e)) && self.held_due.contains(&(h.until, e)));
            let s = e - h.len;
            assert!(self.by_offset.range(..e).next_back().is_none_or(|(&o, &l)| o + l <= s), "held overlaps free");
            last_end = e;
        }
        assert_eq!(self.held.values().map(|h| h.len).sum::<u64>(), self.held_bytes);
    }

    /// Whether none of `[offset, offset + reserved)` is free or held (and it lies inside).
    fn is_allocated(&self, offset: u64, reserved: u64) -> bool {
        let end = match offset.checked_add(reserved) {
            Some(e) if reserved > 0 && e <= self.size => e,
            _ => return false,
        };
        let free_before = self.by_offset.range(..end).next_back().is_some_and(|(&o, &l)| o + l > offset);
        !free_before && !self.any_held(offset, end) && !self.any_fenced(offset, end)
    }

    /// Adds a held range; with `merge`, joins held neighbours of the same tenant (the later
    /// `until` wins: a merged range is due when all of it is).
    fn insert_held(&mut self, offset: u64, len: u64, tenant: u64, until: u64, merge: bool) {
        let (mut start, mut stop, mut until) = (offset, offset + len, until);
        if merge {
            // The range that ends where this one starts, then the one that starts where it ends.
            if let Some(h) = self.held.get(&offset).copied().filter(|h| h.tenant == tenant) {
                self.remove_held(offset);
                start = offset - h.len;
                until = until.max(h.until);
            }
            let next = self.held.range(stop + 1..).next().map(|(&e, &h)| (e, h));
            if let Some((e, h)) = next.filter(|(e, h)| e - h.len == stop && h.tenant == tenant) {
                self.remove_held(e);
                stop = e;
                until = until.max(h.until);
            }
        }
        let h = Held { len: stop - start, tenant, until };
        self.held.insert(stop, h);
        self.held_fit.insert((tenant, h.len, stop));
        self.held_due.insert((until, stop));
        self.held_bytes += h.len;
    }

    /// Removes the held range that ends at `end`.
    fn remove_held(&mut self, end: u64) -> Held {
        let h = self.held.remove(&end).expect("a held range ending here");
        self.held_fit.remove(&(h.tenant, h.len, end));
        self.held_due.remove(&(h.until, end));
        self.held_bytes -= h.len;
        h
    }

    /// Returns `[offset, offset + reserved)`, merging it with free neighbours. Freeing a range
    /// that is (partly) free already is a bug in the caller; it is refused and reported.
    pub fn free(&mut self, offset: u64, reserved: u64) -> bool {
        let end = match offset.checked_add(reserved) {
            Some(e) if reserved > 0 && e <= self.size => e,
            _ => return false,
        };
        if self.any_held(offset, end) || self.any_fenced(offset, end) {
            return false;
        }
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
    fn a_fence_takes_what_is_free_or_held_and_leaves_what_is_allocated() {
        let mut a = RangeAllocator::new(1 << 20, 64);
        let (x, xr) = a.allocate(4096).unwrap(); // [0, 4096)
        let (y, yr) = a.allocate(4096).unwrap(); // [4096, 8192)
        let (z, zr) = a.allocate(4096).unwrap(); // [8192, 12288)
        assert!(a.hold(y, yr, 7, 1_000, 0), "y freed, held for tenant 7");
        // Fence [2048, 16384): x's and z's parts stay allocated; y's held range and the free
        // [12288, 16384) are taken.
        assert_eq!(a.take_unallocated(2048, 16384), 4096 + 4096);
        a.check_held();
        assert_eq!(a.held_bytes(), 0);
        assert_eq!(a.free_bytes(), (1 << 20) - 16384);
        // Nothing of the fence is handed out again, even to tenant 7.
        for _ in 0..1000 {
            match a.allocate_for(64, 7, 0) {
                Some((o, _, _)) => assert!(o >= 16384, "allocated {o} inside the fence"),
                None => break,
            }
        }
        // Freeing x gives back its part outside the fence only once the caller fences again.
        assert!(a.free(x, xr));
        assert_eq!(a.take_unallocated(2048, 16384), 2048);
        assert!(a.free(z, zr));
        assert_eq!(a.take_unallocated(2048, 16384), 4096);
        assert_eq!(a.take_unallocated(2048, 16384), 0, "all of it is taken");
        // A second free (or hold) of a range now in the fence is refused, as over free space.
        assert!(!a.free(z, zr) && !a.hold(y, yr, 7, 1_000, 0));
        assert!(!a.free(x, xr), "x's part outside the fence is free already");
        // Unaligned or empty ranges take nothing.
        assert_eq!(a.take_unallocated(100, 200), 0);
        assert_eq!(a.take_unallocated(5000, 5000), 0);
    }

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

    #[test]
    fn a_held_range_goes_only_to_its_tenant_until_due() {
        let mut a = RangeAllocator::new(4096, 64);
        let (x, rx, _) = a.allocate_for(1024, 1, 0).unwrap();
        let (y, ry, _) = a.allocate_for(3072, 1, 0).unwrap();
        assert!(a.hold(x, rx, 1, 100, 0));
        assert_eq!(a.held_bytes(), 1024);
        assert!(!a.hold(x, rx, 1, 100, 0), "held twice");
        assert!(!a.free(x, rx), "freed while held");
        // Tenant 2 finds no room; tenant 1 gets its own range back at once.
        assert_eq!(a.allocate_for(64, 2, 50), None);
        assert_eq!(a.allocate_for(512, 1, 50), Some((x, 512, 100)), "with the hold it came from");
        // Adjacent ranges of one tenant merge (the later due time wins), across tenants not.
        assert!(a.hold(x, 512, 1, 120, 60));
        assert!(a.hold(y, ry, 2, 90, 60));
        assert_eq!(a.allocate_for(1024, 1, 60), Some((x, 1024, 120)), "merged with the rest of x");
        assert_eq!(a.allocate_for(2048, 2, 60), Some((y, 2048, 90)));
        assert!(a.hold(x, 1024, 1, 120, 60));
        // Due: everyone may take it. y's tail (tenant 2's until 90) is due at 119, x's not yet.
        assert_eq!(a.allocate_for(1024, 3, 119), Some((y + 2048, 1024, 0)));
        assert_eq!(a.allocate_for(1024, 3, 119), None);
        assert_eq!(a.allocate_for(1024, 3, 120), Some((x, 1024, 0)));
        assert_eq!(a.held_bytes(), 0);
        // A hold already due is a plain free, and merges with free neighbours.
        assert!(a.hold(x, 1024, 1, 10, 200));
        assert_eq!(a.held_bytes(), 0);
        assert_eq!(a.free_bytes(), 1024);
    }

    #[test]
    fn a_tenant_takes_free_space_first_until_its_held_space_reaches_the_share() {
        let unit = 64;
        let mut a = RangeAllocator::new(64 * unit, unit);
        let (x, rx, _) = a.allocate_for(4 * unit, 1, 0).unwrap();
        assert!(a.hold(x, rx, 1, 100, 0));
        // 4 units held, 60 free: under the share, so tenant 1 writes into free space.
        assert_eq!(a.allocate_for(unit, 1, 0), Some((4 * unit, unit, 0)));
        assert_eq!(a.held_bytes(), 4 * unit);
        // 8 units held against 55 free: over it, so tenant 1 reuses its held space first.
        let (y, ry, _) = a.allocate_for(4 * unit, 2, 0).unwrap();
        assert!(a.hold(y, ry, 1, 100, 0));
        assert!(a.held_bytes() > a.free_bytes() / HELD_SHARE);
        assert_eq!(a.allocate_for(unit, 1, 0), Some((x, unit, 100)), "the best fit of its held ranges");
        // Another tenant still never gets them: free space, past y.
        let before = a.held_bytes();
        assert_eq!(a.allocate_for(unit, 2, 0), Some((y + ry, unit, 0)));
        assert_eq!(a.held_bytes(), before);
        a.check_held();
    }

    #[test]
    fn an_exact_reserve_takes_free_and_held_pieces_alike() {
        let mut a = RangeAllocator::new(4096, 64);
        let (x, rx, _) = a.allocate_for(1024, 1, 0).unwrap();
        assert!(a.hold(x, rx, 7, 100, 0));
        // [512, 1536) spans the held range and the free space after it.
        assert_eq!(a.reserve(512, 1024), Some(1024));
        assert_eq!(a.held_bytes(), 512, "the held part before it stays held");
        assert_eq!(a.reserve(0, 1024), None, "half of it is taken");
        assert_eq!(a.allocate_for(512, 7, 0), Some((0, 512, 100)));
        assert_eq!(a.free_bytes(), 4096 - 1536);
    }

    proptest! {
        #[test]
        fn tenants_never_share_a_held_range(ops in proptest::collection::vec((0u8..4, 1u64..5000, 0u64..3), 1..300)) {
            let mut a = RangeAllocator::new(64 * 1024, 64);
            // Live allocations: (offset, reserved, tenant); held: (offset, reserved, tenant, until).
            let mut live: Vec<(u64, u64, u64)> = Vec::new();
            let mut held: Vec<(u64, u64, u64, u64)> = Vec::new();
            let mut now = 0u64;
            for (op, n, tenant) in ops {
                now += n % 7;
                held.retain(|h| h.3 > now);
                match op {
                    0 => if let Some((o, r, _)) = a.allocate_for(n, tenant, now) {
                        for h in &held {
                            let overlaps = o < h.0 + h.1 && h.0 < o + r;
                            prop_assert!(!overlaps || h.2 == tenant, "tenant {} got {:?}, held for {:?}", tenant, (o, r), h);
                        }
                        // The rest of a held range it came from stays held; the model forgets it.
                        held.retain(|h| !(o < h.0 + h.1 && h.0 < o + r));
                        live.push((o, r, tenant));
                    },
                    1 | 2 => if !live.is_empty() {
                        let (o, r, t) = live.swap_remove(n as usize % live.len());
                        let until = now + n % 20;
                        prop_assert!(a.hold(o, r, t, until, now));
                        if until > now {
                            held.push((o, r, t, until));
                        }
                    },
                    _ => {
                        let off = (n * 64) % (64 * 1024);
                        if let Some(r) = a.reserve(off, n) {
                            held.retain(|h| !(off < h.0 + h.1 && h.0 < off + r));
                            live.push((off, r, tenant));
                        }
                    }
                }
                let mut sorted = live.clone();
                sorted.sort();
                for w in sorted.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                let used: u64 = live.iter().map(|x| x.1).sum();
                a.check_held();
                prop_assert_eq!(used + a.free_bytes() + a.held_bytes(), 64 * 1024);
            }
        }

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
