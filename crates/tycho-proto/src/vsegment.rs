//! VSegment striping (spec 01, "VSegment"): one replica of a large value striped round-robin
//! over equal-length extents of segments on different hosts, so that a big put or get keeps
//! several devices busy at once instead of queueing on one.
//!
//! This module holds the parts with no I/O: the immutable view of a VSegment, its stored form
//! (sealed in the versioned, checksummed envelope), the stripe mapping and the expansion of a
//! logical range into the physical ranges of its members. Where spec 01 keys views and quotas by
//! partition, Tycho keys them by KVPT group: the group count is fixed for a cluster's life, and
//! a group is what a master owns and what a reshard moves.
//!
//! With `N` members, stripes of `S` bytes and member `m`'s extent starting at `B[m]`, logical
//! byte `L` lives at
//!
//! ```text
//! stripe = L / S        member = stripe mod N        offset = B[member] + (stripe / N)·S + L mod S
//! ```

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::envelope::{self, EnvelopeError, RecordKind};
use crate::SegmentId;

/// Layout version of a stored [`VSegmentView`].
pub const VSEGMENT_VIEW_VERSION: u16 = 1;

/// Most members a VSegment may have.
pub const MAX_MEMBERS: usize = 64;

/// Most pieces one expansion may make (a range of 64 GiB in 64 KiB stripes): a range that
/// would make more is refused rather than listed.
pub const MAX_PIECES: u64 = 1 << 20;

/// How logical bytes are laid over the members. Only round-robin exists; a view of an algorithm
/// this build does not know is refused when read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MappingAlgorithm {
    /// Stripe `k` on member `k mod N`.
    RoundRobin,
}

/// One member's bytes: a range of a segment with a stable identity (one that outlives a
/// restart of its node). Where the segment is served from, and on what medium, is looked up
/// when the range is expanded, not kept here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PSegmentExtent {
    /// The segment.
    pub segment: SegmentId,
    /// Where the extent starts in the segment.
    pub base_offset: u64,
    /// Its length (the same for every member of a view).
    pub length: u64,
}

/// A VSegment's layout: immutable once created (a layout change is a new id), with no owner
/// (its group's primary owns it, whoever that is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VSegmentView {
    /// Unique within the cluster.
    pub id: u64,
    /// The KVPT group whose quota its extents come from.
    pub group: u32,
    /// How logical bytes map to members.
    pub algorithm: MappingAlgorithm,
    /// Bytes per stripe.
    pub stripe_size: u64,
    /// The members, in mapping order.
    pub members: Vec<PSegmentExtent>,
    /// Logical bytes: members × extent length.
    pub logical_capacity: u64,
}

/// Why a view could not be made or read, or a range not expanded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum VSegmentError {
    /// The layout breaks a rule of views.
    #[error("invalid VSegment layout: {0}")]
    Invalid(String),
    /// A range that would expand into more than [`MAX_PIECES`] pieces.
    #[error("a range of {len} bytes in stripes of {stripe_size} makes more than {MAX_PIECES} pieces")]
    TooManyPieces {
        /// The range's length.
        len: u64,
        /// The VSegment's stripe size.
        stripe_size: u64,
    },
    /// A logical range outside the VSegment.
    #[error("logical range {offset}+{len} outside a VSegment of {capacity} bytes")]
    OutOfRange {
        /// Where the range starts.
        offset: u64,
        /// Its length.
        len: u64,
        /// The VSegment's logical capacity.
        capacity: u64,
    },
    /// The stored bytes did not open (kind, version, checksum).
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    /// The payload is not a view this build reads.
    #[error("malformed VSegment view: {0}")]
    Malformed(String),
}

/// One piece of an expanded logical range: bytes of one stripe, on one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Where the piece starts in the logical range's VSegment.
    pub logical_offset: u64,
    /// The member holding it (its index in the view).
    pub member: usize,
    /// The member's segment.
    pub segment: SegmentId,
    /// Where the piece starts in that segment.
    pub physical_offset: u64,
    /// Bytes.
    pub len: u64,
}

impl VSegmentView {
    /// A round-robin view over `members` (all of one length, a multiple of `stripe_size`),
    /// checked.
    pub fn new(
        id: u64,
        group: u32,
        stripe_size: u64,
        members: Vec<PSegmentExtent>,
    ) -> Result<VSegmentView, VSegmentError> {
        let length = members.first().map_or(0, |m| m.length);
        let logical_capacity = length.checked_mul(members.len() as u64).ok_or_else(|| invalid("capacity overflows"))?;
        let view =
            VSegmentView { id, group, algorithm: MappingAlgorithm::RoundRobin, stripe_size, members, logical_capacity };
        view.check()?;
        Ok(view)
    }

    /// The rules every view keeps: two to [`MAX_MEMBERS`] members of one non-zero length, a
    /// whole number of stripes each, in bounds of `u64`, no two overlapping on one segment, and
    /// the capacity they add up to.
    fn check(&self) -> Result<(), VSegmentError> {
        let n = self.members.len();
        if !(2..=MAX_MEMBERS).contains(&n) {
            return Err(invalid(format!("{n} members (2 to {MAX_MEMBERS})")));
        }
        if self.stripe_size == 0 {
            return Err(invalid("a stripe size of 0"));
        }
        let length = self.members[0].length;
        if length == 0 || !length.is_multiple_of(self.stripe_size) {
            return Err(invalid(format!(
                "extents of {length} bytes: not a positive multiple of the stripe {}",
                self.stripe_size
            )));
        }
        for (i, m) in self.members.iter().enumerate() {
            if m.length != length {
                return Err(invalid(format!("member {i} is {} bytes, member 0 {length}", m.length)));
            }
            if m.base_offset.checked_add(m.length).is_none() {
                return Err(invalid(format!("member {i} ends past 2^64")));
            }
            for (j, o) in self.members[..i].iter().enumerate() {
                if o.segment == m.segment
                    && m.base_offset < o.base_offset + o.length
                    && o.base_offset < m.base_offset + m.length
                {
                    return Err(invalid(format!("members {j} and {i} overlap on segment {}", m.segment)));
                }
            }
        }
        if Some(self.logical_capacity) != length.checked_mul(n as u64) {
            return Err(invalid(format!("capacity {} is not {n} × {length}", self.logical_capacity)));
        }
        Ok(())
    }

    /// Where logical byte `l` lives: its member and the offset in that member's segment.
    /// (`None` past the end, and for a view built without [`VSegmentView::new`] or `decode`
    /// that breaks the rules so that no offset can be computed.)
    pub fn locate(&self, l: u64) -> Option<(usize, u64)> {
        if l >= self.logical_capacity || self.stripe_size == 0 || self.members.is_empty() {
            return None;
        }
        let n = self.members.len() as u64;
        let stripe = l / self.stripe_size;
        let member = (stripe % n) as usize;
        let within = (stripe / n).checked_mul(self.stripe_size)?.checked_add(l % self.stripe_size)?;
        Some((member, self.members[member].base_offset.checked_add(within)?))
    }

    /// The pieces of the logical range `[offset, offset + len)`, in logical order, split at
    /// stripe boundaries: each lies in one stripe of one member. Nothing for an empty range.
    pub fn expand(&self, offset: u64, len: u64) -> Result<Vec<Piece>, VSegmentError> {
        let out = || VSegmentError::OutOfRange { offset, len, capacity: self.logical_capacity };
        let end = offset.checked_add(len).filter(|&e| e <= self.logical_capacity).ok_or_else(out)?;
        if self.stripe_size == 0 {
            return Err(invalid("a stripe size of 0"));
        }
        // One piece per stripe the range touches.
        let count = if len == 0 { 0 } else { (end - 1) / self.stripe_size - offset / self.stripe_size + 1 };
        if count > MAX_PIECES {
            return Err(VSegmentError::TooManyPieces { len, stripe_size: self.stripe_size });
        }
        let mut pieces = Vec::with_capacity(count.min(1024) as usize);
        let mut at = offset;
        while at < end {
            let stripe_end = (at / self.stripe_size + 1) * self.stripe_size;
            let piece_len = stripe_end.min(end) - at;
            let (member, physical_offset) = self.locate(at).ok_or_else(out)?;
            pieces.push(Piece {
                logical_offset: at,
                member,
                segment: self.members[member].segment,
                physical_offset,
                len: piece_len,
            });
            at += piece_len;
        }
        Ok(pieces)
    }

    /// The view as stored: sealed in the versioned, checksummed envelope.
    pub fn encode(&self) -> Vec<u8> {
        let payload = postcard::to_stdvec(self).expect("views serialize");
        envelope::seal(RecordKind::VSegmentView, VSEGMENT_VIEW_VERSION, &payload)
    }

    /// Reads a stored view: refuses a newer version, damaged bytes, and a layout that breaks
    /// the rules of views.
    pub fn decode(bytes: &[u8]) -> Result<VSegmentView, VSegmentError> {
        let (_, payload) = envelope::open(RecordKind::VSegmentView, VSEGMENT_VIEW_VERSION, bytes)?;
        let (view, rest): (VSegmentView, _) =
            postcard::take_from_bytes(payload).map_err(|e| VSegmentError::Malformed(e.to_string()))?;
        if !rest.is_empty() {
            return Err(VSegmentError::Malformed(format!("{} bytes after the view", rest.len())));
        }
        view.check()?;
        Ok(view)
    }
}

fn invalid(why: impl Into<String>) -> VSegmentError {
    VSegmentError::Invalid(why.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn extent(segment: u128, base_offset: u64, length: u64) -> PSegmentExtent {
        PSegmentExtent { segment: SegmentId(segment), base_offset, length }
    }

    /// Three members of 12 bytes at 100, 200 and 300 of segments 1, 2 and 3; stripes of 4.
    fn three() -> VSegmentView {
        VSegmentView::new(7, 1, 4, vec![extent(1, 100, 12), extent(2, 200, 12), extent(3, 300, 12)]).unwrap()
    }

    #[test]
    fn logical_bytes_map_as_the_golden_table_says() {
        let v = three();
        assert_eq!(v.logical_capacity, 36);
        // (logical byte, member, physical offset)
        let golden = [
            (0, 0, 100),
            (3, 0, 103),
            (4, 1, 200),
            (5, 1, 201),
            (8, 2, 300),
            (11, 2, 303),
            (12, 0, 104),
            (13, 0, 105),
            (16, 1, 204),
            (24, 0, 108),
            (34, 2, 310),
            (35, 2, 311),
        ];
        for (l, member, offset) in golden {
            assert_eq!(v.locate(l), Some((member, offset)), "logical byte {l}");
        }
        assert_eq!(v.locate(36), None);
    }

    #[test]
    fn a_range_expands_at_stripe_boundaries_as_the_golden_table_says() {
        let v = three();
        // (offset, len) -> [(logical offset, member, physical offset, len)]
        // A piece: (logical offset, member, physical offset, len).
        type Pieces = &'static [(u64, usize, u64, u64)];
        let golden: [((u64, u64), Pieces); 6] = [
            // Inside one stripe.
            ((1, 2), &[(1, 0, 101, 2)]),
            // Exactly one stripe.
            ((4, 4), &[(4, 1, 200, 4)]),
            // Across every member, starting and ending mid-stripe, wrapping to member 0.
            ((2, 12), &[(2, 0, 102, 2), (4, 1, 200, 4), (8, 2, 300, 4), (12, 0, 104, 2)]),
            // Ending mid-stripe after a whole round.
            ((0, 13), &[(0, 0, 100, 4), (4, 1, 200, 4), (8, 2, 300, 4), (12, 0, 104, 1)]),
            // The last bytes.
            ((33, 3), &[(33, 2, 309, 3)]),
            // The whole VSegment: 9 stripes, each member's three in order.
            (
                (0, 36),
                &[
                    (0, 0, 100, 4),
                    (4, 1, 200, 4),
                    (8, 2, 300, 4),
                    (12, 0, 104, 4),
                    (16, 1, 204, 4),
                    (20, 2, 304, 4),
                    (24, 0, 108, 4),
                    (28, 1, 208, 4),
                    (32, 2, 308, 4),
                ],
            ),
        ];
        for ((offset, len), want) in golden {
            let got: Vec<_> = v
                .expand(offset, len)
                .unwrap()
                .iter()
                .map(|p| {
                    assert_eq!(p.segment, v.members[p.member].segment);
                    (p.logical_offset, p.member, p.physical_offset, p.len)
                })
                .collect();
            assert_eq!(got, want, "range {offset}+{len}");
        }
        assert_eq!(v.expand(5, 0).unwrap(), vec![]);
        // A range that would make too many pieces is refused, not listed.
        let wide = VSegmentView::new(1, 0, 1, vec![extent(1, 0, 1 << 40), extent(2, 0, 1 << 40)]).unwrap();
        assert_eq!(wide.expand(0, 1 << 41), Err(VSegmentError::TooManyPieces { len: 1 << 41, stripe_size: 1 }));
        assert_eq!(wide.expand(0, MAX_PIECES).unwrap().len(), MAX_PIECES as usize);
        // A view made without the checks cannot make locate or expand panic.
        let unchecked = VSegmentView { stripe_size: 0, ..three() };
        assert_eq!(unchecked.locate(1), None);
        assert!(unchecked.expand(0, 4).is_err());
        let no_members = VSegmentView { members: Vec::new(), ..three() };
        assert_eq!(no_members.locate(1), None);
        assert!(no_members.expand(0, 4).is_err());
        for (offset, len) in [(0, 37), (36, 1), (35, 2), (u64::MAX, 2)] {
            assert_eq!(v.expand(offset, len), Err(VSegmentError::OutOfRange { offset, len, capacity: 36 }));
        }
    }

    #[test]
    fn layouts_that_break_the_rules_are_refused() {
        let bad = [
            (4, vec![extent(1, 0, 12)]),                                          // one member
            (0, vec![extent(1, 0, 12), extent(2, 0, 12)]),                        // no stripe
            (4, vec![extent(1, 0, 12), extent(2, 0, 8)]),                         // unequal
            (5, vec![extent(1, 0, 12), extent(2, 0, 12)]),                        // not whole stripes
            (4, vec![extent(1, 0, 0), extent(2, 0, 0)]),                          // empty
            (4, vec![extent(1, 0, 12), extent(1, 8, 12)]),                        // overlap on one segment
            (4, vec![extent(1, u64::MAX - 4, 12), extent(2, 0, 12)]),             // past 2^64
            (4, (0..MAX_MEMBERS as u128 + 1).map(|s| extent(s, 0, 4)).collect()), // too many
        ];
        for (stripe, members) in bad {
            assert!(
                matches!(VSegmentView::new(1, 0, stripe, members.clone()), Err(VSegmentError::Invalid(_))),
                "{members:?}"
            );
        }
        // Adjacent extents of one segment are fine.
        VSegmentView::new(1, 0, 4, vec![extent(1, 0, 12), extent(1, 12, 12)]).unwrap();
    }

    #[test]
    fn a_stored_view_reads_back_and_damage_or_a_broken_layout_is_refused() {
        let v = three();
        assert_eq!(VSegmentView::decode(&v.encode()), Ok(v.clone()));
        let mut damaged = v.encode();
        let last = damaged.len() - 1;
        damaged[last] ^= 1;
        assert!(matches!(VSegmentView::decode(&damaged), Err(VSegmentError::Envelope(_))));
        // A newer layout version is refused, not guessed at.
        let payload = postcard::to_stdvec(&v).unwrap();
        let newer = envelope::seal(RecordKind::VSegmentView, VSEGMENT_VIEW_VERSION + 1, &payload);
        assert!(matches!(VSegmentView::decode(&newer), Err(VSegmentError::Envelope(_))));
        // Another kind of record is refused.
        let other = envelope::seal(RecordKind::ClusterMeta, 1, &payload);
        assert!(VSegmentView::decode(&other).is_err());
        // A checksummed record whose layout breaks the rules is refused too.
        let lying = VSegmentView { logical_capacity: 40, ..v.clone() };
        let sealed =
            envelope::seal(RecordKind::VSegmentView, VSEGMENT_VIEW_VERSION, &postcard::to_stdvec(&lying).unwrap());
        assert!(matches!(VSegmentView::decode(&sealed), Err(VSegmentError::Invalid(_))));
        assert!(VSegmentView::decode(&[]).is_err());
    }

    proptest! {
        /// Expansion covers the logical range exactly once, in order, each piece inside one
        /// stripe of its member's extent; and no two logical bytes share a physical byte.
        #[test]
        fn expansion_covers_the_range_exactly_once(
            n in 2usize..6,
            stripe in 1u64..64,
            stripes_per_member in 1u64..6,
            start in 0u64..2000,
            len in 0u64..2000,
        ) {
            let length = stripe * stripes_per_member;
            let members: Vec<_> = (0..n).map(|m| extent(m as u128 % 3, m as u64 * length * 2, length)).collect();
            let v = VSegmentView::new(1, 0, stripe, members).unwrap();
            let start = start % v.logical_capacity;
            let len = len.min(v.logical_capacity - start);
            let pieces = v.expand(start, len).unwrap();
            let mut at = start;
            let mut seen = std::collections::BTreeSet::new();
            for p in &pieces {
                prop_assert_eq!(p.logical_offset, at);
                prop_assert!(p.len > 0);
                prop_assert_eq!(p.logical_offset / stripe, (p.logical_offset + p.len - 1) / stripe);
                let m = &v.members[p.member];
                prop_assert!(p.physical_offset >= m.base_offset && p.physical_offset + p.len <= m.base_offset + m.length);
                for b in 0..p.len {
                    prop_assert!(seen.insert((m.segment, p.physical_offset + b)), "a physical byte used twice");
                    prop_assert_eq!(v.locate(p.logical_offset + b), Some((p.member, p.physical_offset + b)));
                }
                at += p.len;
            }
            prop_assert_eq!(at, start + len);
        }
    }
}
