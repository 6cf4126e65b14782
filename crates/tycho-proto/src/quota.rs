//! Stable segments and the static per-group VSegment quota (spec 01, "Static per-partition
//! quotas"), without I/O.
//!
//! A VSegment's extents name segments that outlive a restart of their node: a *stable*
//! segment, whose id is derived from a name its owner gives ([`stable_segment_id`]). The cluster
//! keeps a [`StableSegment`] descriptor per such segment in its coordination store. Once, at
//! cluster initialization, `tycho plan-quota` reads the descriptors, a policy of named
//! [`Profile`]s and the group count, divides each profile's space between the KVPT groups
//! ([`plan`]) and publishes the result, one immutable [`PartitionQuota`]. A group's primary
//! then builds VSegments only from its group's extents, so no two masters ever reach for the
//! same bytes. Spec 01 keys quotas by partition; Tycho keys them by KVPT group (the group count
//! is fixed for a cluster's life, and a group is what a master owns and a reshard moves).
//!
//! Both records are sealed in the versioned, checksummed envelope, and a reader checks every
//! rule a planner checks: a stored plan cannot smuggle in an overlap or a range out of bounds.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use sha2::Digest;
use thiserror::Error;

use crate::envelope::{self, EnvelopeError, RecordKind};
use crate::vsegment::MAX_MEMBERS;
use crate::{SegmentId, MIN_BLOCK_SIZE};

/// Layout version of a stored [`StableSegment`].
pub const SEGMENT_DESCRIPTOR_VERSION: u16 = 1;

/// Layout version of a stored [`PartitionQuota`].
pub const PARTITION_QUOTA_VERSION: u16 = 1;

/// Longest stable segment name, in bytes.
pub const MAX_STABLE_NAME: usize = 128;

/// Most profiles in one plan.
pub const MAX_PROFILES: usize = 16;

/// Most stable segments one plan covers.
pub const MAX_PLAN_SEGMENTS: usize = 4096;

/// Most extents one plan hands out.
pub const MAX_PLAN_EXTENTS: usize = 1 << 16;

/// Most groups a plan may be for: a cluster has at most one group per partition (16384).
pub const MAX_PLAN_GROUPS: u32 = 16384;

/// The id of the stable segment named `name`: the first 16 bytes of a domain-separated SHA-256
/// of the name. Every process that mounts the segment under that name, before or after a
/// restart, mounts the same id.
pub fn stable_segment_id(name: &str) -> SegmentId {
    let mut h = sha2::Sha256::new();
    h.update(b"tycho stable segment v1\0");
    h.update(name.as_bytes());
    let digest = h.finalize();
    SegmentId(u128::from_le_bytes(digest[..16].try_into().expect("16 bytes")))
}

/// Whether `name` may name a stable segment: 1 to [`MAX_STABLE_NAME`] bytes of ASCII letters,
/// digits, `.`, `_`, `-` and `:`.
pub fn check_stable_name(name: &str) -> Result<(), QuotaError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_STABLE_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(QuotaError::Invalid(format!("stable segment name {name:?}: 1 to {MAX_STABLE_NAME} of A-Z a-z 0-9 . _ - :")))
    }
}

/// What a segment's bytes live on.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Medium {
    /// Shared memory (a `tycho node`, a client's own segment, `allocate_and_mount_segment`).
    Dram,
    /// A file mapped into memory (Python's `mount_segment`).
    File,
}

impl Medium {
    /// Its name in profiles and listings.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Dram => "dram",
            Medium::File => "file",
        }
    }
}

impl std::fmt::Display for Medium {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Medium {
    type Err = String;
    fn from_str(s: &str) -> Result<Medium, String> {
        match s {
            "dram" => Ok(Medium::Dram),
            "file" => Ok(Medium::File),
            other => Err(format!("unknown medium {other:?} (dram or file)")),
        }
    }
}

/// The cluster's descriptor of a stable segment, kept under `segments/{id}`: written by a
/// master when the segment mounts, read by the planner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StableSegment {
    /// Its id: [`stable_segment_id`] of `name`.
    pub id: SegmentId,
    /// The name its owner mounts it under.
    pub name: String,
    /// The host it lives on (a VSegment's members are on distinct hosts).
    pub host: String,
    /// Its size in bytes.
    pub size: u64,
    /// What its bytes live on.
    pub medium: Medium,
    /// Its transfer server when it last mounted (informative: where a member is served from is
    /// looked up when a range is expanded).
    pub endpoint: String,
}

/// Why a descriptor or a plan is refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum QuotaError {
    /// The envelope is damaged or of another kind or version.
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    /// The payload does not parse.
    #[error("malformed record: {0}")]
    Malformed(String),
    /// The record parses but breaks a rule.
    #[error("{0}")]
    Invalid(String),
}

fn invalid<T>(why: String) -> Result<T, QuotaError> {
    Err(QuotaError::Invalid(why))
}

impl StableSegment {
    /// Whether the descriptor keeps the rules: a valid name, the id of that name, a size.
    pub fn check(&self) -> Result<(), QuotaError> {
        check_stable_name(&self.name)?;
        if self.id != stable_segment_id(&self.name) {
            return invalid(format!("segment {} is not the stable id of {:?}", self.id, self.name));
        }
        if self.size == 0 || self.host.is_empty() {
            return invalid(format!("stable segment {:?} has no size or no host", self.name));
        }
        Ok(())
    }

    /// The descriptor as stored.
    pub fn encode(&self) -> Vec<u8> {
        let payload = postcard::to_stdvec(self).expect("descriptors serialize");
        envelope::seal(RecordKind::SegmentDescriptor, SEGMENT_DESCRIPTOR_VERSION, &payload)
    }

    /// Reads a stored descriptor; refuses a newer version, damage and a broken rule.
    pub fn decode(bytes: &[u8]) -> Result<StableSegment, QuotaError> {
        let (_, payload) = envelope::open(RecordKind::SegmentDescriptor, SEGMENT_DESCRIPTOR_VERSION, bytes)?;
        let d: StableSegment = postcard::from_bytes(payload).map_err(|e| QuotaError::Malformed(e.to_string()))?;
        d.check()?;
        Ok(d)
    }
}

/// A named VSegment layout and how much of each segment of its medium it takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Profile {
    /// Its name (the master's `--vsegment-profile` picks it).
    pub name: String,
    /// Members of each VSegment (on distinct hosts).
    pub members: u32,
    /// Length of each member's extent.
    pub extent: u64,
    /// Stripe size.
    pub stripe: u64,
    /// The medium of its segments.
    pub medium: Medium,
    /// Extents it takes from each stable segment of its medium.
    pub per_segment: u32,
}

impl Profile {
    /// Whether the profile keeps the rules: a name, 2 to [`MAX_MEMBERS`] members, a stripe of
    /// whole [`MIN_BLOCK_SIZE`] blocks, an extent of whole stripes, at least one extent per
    /// segment.
    pub fn check(&self) -> Result<(), QuotaError> {
        let name = &self.name;
        if name.is_empty()
            || name.len() > 64
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return invalid(format!("profile name {name:?}: 1 to 64 of A-Z a-z 0-9 _ -"));
        }
        if self.members < 2 || self.members as usize > MAX_MEMBERS {
            return invalid(format!("profile {name}: {} members (2 to {MAX_MEMBERS})", self.members));
        }
        if self.stripe == 0 || !self.stripe.is_multiple_of(MIN_BLOCK_SIZE) {
            return invalid(format!(
                "profile {name}: a stripe of {} bytes is not whole {MIN_BLOCK_SIZE}-byte blocks",
                self.stripe
            ));
        }
        if self.extent == 0 || !self.extent.is_multiple_of(self.stripe) {
            return invalid(format!(
                "profile {name}: an extent of {} bytes is not whole stripes of {}",
                self.extent, self.stripe
            ));
        }
        if self.per_segment == 0 {
            return invalid(format!("profile {name}: takes no extent of any segment"));
        }
        Ok(())
    }
}

/// A segment as the plan was made against it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedSegment {
    /// Its id.
    pub id: SegmentId,
    /// Its name.
    pub name: String,
    /// Its host.
    pub host: String,
    /// Its size: a master refuses to use the plan's extents on a segment that mounts smaller.
    pub size: u64,
    /// Its medium.
    pub medium: Medium,
}

/// One extent of the quota: a range of a segment that only `group`'s VSegments of `profile`
/// may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaExtent {
    /// The group.
    pub group: u32,
    /// Index into the plan's profiles.
    pub profile: u16,
    /// The segment.
    pub segment: SegmentId,
    /// Where the extent starts in the segment.
    pub offset: u64,
    /// Its length (its profile's extent length).
    pub len: u64,
}

/// The cluster's static quota: written once by the planner under
/// `vsegment/partition-quota/current`, never rewritten.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionQuota {
    /// The cluster's group count.
    pub groups: u32,
    /// When it was planned (Unix ms).
    pub planned_ms: u64,
    /// The profiles.
    pub profiles: Vec<Profile>,
    /// The segments planned over.
    pub segments: Vec<PlannedSegment>,
    /// The extents, grouped by profile, then run by run.
    pub extents: Vec<QuotaExtent>,
}

impl PartitionQuota {
    /// Whether the plan keeps every rule: sound profiles of distinct names; segments listed
    /// once; every extent of a listed segment of its profile's medium, of its profile's length,
    /// stripe-aligned, inside the segment, overlapping no other extent, for a group that
    /// exists; and every group able to build a VSegment of each profile (its extents of the
    /// profile span at least as many hosts as the profile has members).
    pub fn check(&self) -> Result<(), QuotaError> {
        if self.groups == 0 || self.groups > MAX_PLAN_GROUPS {
            return invalid(format!("a plan for {} groups (1 to {MAX_PLAN_GROUPS})", self.groups));
        }
        if self.profiles.is_empty() || self.profiles.len() > MAX_PROFILES {
            return invalid(format!("{} profiles (1 to {MAX_PROFILES})", self.profiles.len()));
        }
        if self.segments.len() > MAX_PLAN_SEGMENTS || self.extents.len() > MAX_PLAN_EXTENTS {
            return invalid(format!("{} segments and {} extents: too many", self.segments.len(), self.extents.len()));
        }
        let mut names = BTreeSet::new();
        for p in &self.profiles {
            p.check()?;
            if !names.insert(p.name.as_str()) {
                return invalid(format!("profile {} listed twice", p.name));
            }
        }
        let mut segments = BTreeMap::new();
        for s in &self.segments {
            // The rules of a descriptor: a plan cannot name a segment no node could mount, or
            // invent hosts to pass the rule of distinct hosts.
            StableSegment {
                id: s.id,
                name: s.name.clone(),
                host: s.host.clone(),
                size: s.size,
                medium: s.medium,
                endpoint: String::new(),
            }
            .check()?;
            if segments.insert(s.id, s).is_some() {
                return invalid(format!("segment {} listed twice", s.name));
            }
        }
        let mut ranges: Vec<(SegmentId, u64, u64)> = Vec::with_capacity(self.extents.len());
        let mut hosts: BTreeMap<(u32, u16), BTreeSet<&str>> = BTreeMap::new();
        for e in &self.extents {
            let Some(p) = self.profiles.get(e.profile as usize) else {
                return invalid(format!("an extent of profile #{}, of {}", e.profile, self.profiles.len()));
            };
            let Some(s) = segments.get(&e.segment) else {
                return invalid(format!("an extent on segment {}, which the plan does not list", e.segment));
            };
            if e.group >= self.groups {
                return invalid(format!("an extent for group {} of {}", e.group, self.groups));
            }
            if s.medium != p.medium {
                return invalid(format!(
                    "profile {} ({}) has an extent on {} ({})",
                    p.name, p.medium, s.name, s.medium
                ));
            }
            if e.len != p.extent || e.offset % alignment(p.stripe, s.size) != 0 {
                return invalid(format!(
                    "extent at {} of {}: not a {} extent on a stripe and block boundary",
                    e.offset, s.name, p.name
                ));
            }
            if e.offset.checked_add(e.len).is_none_or(|end| end > s.size) {
                return invalid(format!(
                    "extent at {} (+{}) is past the end of {} ({} bytes)",
                    e.offset, e.len, s.name, s.size
                ));
            }
            ranges.push((e.segment, e.offset, e.len));
            hosts.entry((e.group, e.profile)).or_default().insert(s.host.as_str());
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[0].0 == w[1].0 && w[0].1 + w[0].2 > w[1].1 {
                let name = &segments[&w[0].0].name;
                return invalid(format!("extents at {} and {} of {name} overlap", w[0].1, w[1].1));
            }
        }
        for (i, p) in self.profiles.iter().enumerate() {
            for g in 0..self.groups {
                let spans = hosts.get(&(g, i as u16)).map_or(0, BTreeSet::len);
                if spans < p.members as usize {
                    return invalid(format!(
                        "group {g}'s extents of profile {} span {spans} hosts; a VSegment of it needs {} distinct hosts",
                        p.name, p.members
                    ));
                }
            }
        }
        Ok(())
    }

    /// The extents `group` may build VSegments of profile `profile` from.
    pub fn extents_of(&self, group: u32, profile: u16) -> impl Iterator<Item = &QuotaExtent> {
        self.extents.iter().filter(move |e| e.group == group && e.profile == profile)
    }

    /// The profile named `name`, with its index.
    pub fn profile(&self, name: &str) -> Option<(u16, &Profile)> {
        self.profiles.iter().enumerate().find(|(_, p)| p.name == name).map(|(i, p)| (i as u16, p))
    }

    /// The plan as stored.
    pub fn encode(&self) -> Vec<u8> {
        let payload = postcard::to_stdvec(self).expect("plans serialize");
        envelope::seal(RecordKind::PartitionQuota, PARTITION_QUOTA_VERSION, &payload)
    }

    /// Reads a stored plan; refuses a newer version, damage and a broken rule.
    pub fn decode(bytes: &[u8]) -> Result<PartitionQuota, QuotaError> {
        let (_, payload) = envelope::open(RecordKind::PartitionQuota, PARTITION_QUOTA_VERSION, bytes)?;
        let q: PartitionQuota = postcard::from_bytes(payload).map_err(|e| QuotaError::Malformed(e.to_string()))?;
        q.check()?;
        Ok(q)
    }
}

/// Where an extent of stripes of `stripe` bytes may start in a segment of `size` bytes: on a
/// boundary of both a stripe and a block of the segment (their least common multiple).
fn alignment(stripe: u64, size: u64) -> u64 {
    let block = crate::segment_block_size(size);
    let (mut a, mut b) = (stripe.max(1), block);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    (stripe.max(1) / a).saturating_mul(block)
}

/// The balanced plan of `profiles` over `segments` for `groups` groups, at `planned_ms`.
///
/// Each profile takes `per_segment` extents from the end of every segment of its medium, below
/// the extents of the profiles before it, each starting on a stripe boundary (and on a block of
/// the segment). The extents are then dealt out in runs of up to `members` extents on distinct
/// hosts (shorter only once fewer hosts have extents left), one run to each group in turn:
/// every group gets the same number of extents, give or take one run, and each run prefers the
/// hosts that gave its group the fewest extents, so that a group's extents spread over the
/// hosts as far as the extents allow. Segments are taken in order of host and name, so the
/// same input always gives the same plan. Fails, naming the cause, when a segment has no room,
/// when a profile has no segment, or when a group's share cannot make a VSegment (too few
/// extents or hosts).
pub fn plan(
    groups: u32,
    segments: &[StableSegment],
    profiles: &[Profile],
    planned_ms: u64,
) -> Result<PartitionQuota, QuotaError> {
    if groups == 0 || groups > MAX_PLAN_GROUPS {
        return invalid(format!("a plan for {groups} groups (1 to {MAX_PLAN_GROUPS})"));
    }
    if segments.len() > MAX_PLAN_SEGMENTS {
        return invalid(format!("{} stable segments: at most {MAX_PLAN_SEGMENTS} per plan", segments.len()));
    }
    for s in segments {
        s.check()?;
    }
    let mut sorted: Vec<&StableSegment> = segments.iter().collect();
    sorted.sort_by(|a, b| (&a.host, &a.name).cmp(&(&b.host, &b.name)));
    // Bytes of each segment not yet planned, from the start: profiles take from the end down.
    let mut free_end: BTreeMap<SegmentId, u64> = sorted.iter().map(|s| (s.id, s.size)).collect();
    let mut extents = Vec::new();
    for (index, p) in profiles.iter().enumerate() {
        p.check()?;
        let of_medium = sorted.iter().filter(|s| s.medium == p.medium).count();
        if (p.per_segment as usize).saturating_mul(of_medium).saturating_add(extents.len()) > MAX_PLAN_EXTENTS {
            return invalid(format!("more than {MAX_PLAN_EXTENTS} extents: take fewer per segment"));
        }
        // Per host, in order: the profile's extents on that host's segments.
        let mut by_host: BTreeMap<&str, std::collections::VecDeque<(SegmentId, u64)>> = BTreeMap::new();
        for s in sorted.iter().filter(|s| s.medium == p.medium) {
            let end = free_end.get_mut(&s.id).expect("every segment");
            let align = alignment(p.stripe, s.size);
            for k in 0..p.per_segment {
                let start = end.checked_sub(p.extent).map(|o| o - o % align);
                let Some(start) = start else {
                    return invalid(format!(
                        "segment {} ({} bytes) has room for {k} of the {} extents of {} bytes profile {} takes from it",
                        s.name, s.size, p.per_segment, p.extent, p.name
                    ));
                };
                by_host.entry(s.host.as_str()).or_default().push_back((s.id, start));
                *end = start;
            }
        }
        if by_host.is_empty() {
            return invalid(format!("profile {}: no stable segment is on {}", p.name, p.medium));
        }
        // Runs of up to `members` extents on distinct hosts, to the groups in turn. A run takes
        // the hosts that gave its group the fewest extents yet (so that each group's extents
        // spread over every host), then those with the most left (so that later runs still
        // find distinct hosts), then by name.
        let mut given: BTreeMap<(u32, &str), usize> = BTreeMap::new();
        for run in 0usize.. {
            let group = (run % groups.max(1) as usize) as u32;
            let mut hosts: Vec<&str> = by_host.iter().filter(|(_, q)| !q.is_empty()).map(|(h, _)| *h).collect();
            if hosts.is_empty() {
                break;
            }
            hosts.sort_by_key(|h| {
                (given.get(&(group, *h)).copied().unwrap_or(0), std::cmp::Reverse(by_host[h].len()), *h)
            });
            for h in hosts.into_iter().take(p.members as usize) {
                let (segment, offset) =
                    by_host.get_mut(h).and_then(|q| q.pop_front()).expect("a host with extents left");
                extents.push(QuotaExtent { group, profile: index as u16, segment, offset, len: p.extent });
                *given.entry((group, h)).or_default() += 1;
            }
        }
    }
    let quota = PartitionQuota {
        groups,
        planned_ms,
        profiles: profiles.to_vec(),
        segments: sorted
            .iter()
            .map(|s| PlannedSegment {
                id: s.id,
                name: s.name.clone(),
                host: s.host.clone(),
                size: s.size,
                medium: s.medium,
            })
            .collect(),
        extents,
    };
    quota.check()?;
    Ok(quota)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn seg(name: &str, host: &str, size: u64, medium: Medium) -> StableSegment {
        StableSegment {
            id: stable_segment_id(name),
            name: name.into(),
            host: host.into(),
            size,
            medium,
            endpoint: format!("{host}:1"),
        }
    }

    fn profile(name: &str, members: u32, extent: u64, stripe: u64, per_segment: u32) -> Profile {
        Profile { name: name.into(), members, extent, stripe, medium: Medium::Dram, per_segment }
    }

    #[test]
    fn a_stable_id_depends_on_the_name_alone() {
        assert_eq!(stable_segment_id("node-a"), stable_segment_id("node-a"));
        assert_ne!(stable_segment_id("node-a"), stable_segment_id("node-b"));
        assert!(check_stable_name("rack1:node-7.dram_0").is_ok());
        for bad in ["", "a b", "ä", &"x".repeat(MAX_STABLE_NAME + 1)] {
            assert!(check_stable_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_descriptor_round_trips_and_a_wrong_one_is_refused() {
        let d = seg("node-a", "h1", 64 * MIB, Medium::Dram);
        assert_eq!(StableSegment::decode(&d.encode()), Ok(d.clone()));
        let forged = StableSegment { id: stable_segment_id("node-b"), ..d.clone() };
        assert!(matches!(StableSegment::decode(&forged.encode()), Err(QuotaError::Invalid(_))));
        let newer = envelope::seal(
            RecordKind::SegmentDescriptor,
            SEGMENT_DESCRIPTOR_VERSION + 1,
            &postcard::to_stdvec(&d).unwrap(),
        );
        assert!(matches!(
            StableSegment::decode(&newer),
            Err(QuotaError::Envelope(EnvelopeError::UnknownVersion { .. }))
        ));
        let mut damaged = d.encode();
        *damaged.last_mut().unwrap() ^= 1;
        assert!(StableSegment::decode(&damaged).is_err());
    }

    /// The plan of four hosts' 64 MiB segments, two groups, one profile of 2 members × 8 MiB
    /// extents taking two per segment: the extents sit at the end of each segment, and each
    /// group gets runs of two extents on two different hosts, its second run on the hosts its
    /// first did not use.
    #[test]
    fn a_golden_plan() {
        let segments: Vec<_> =
            ["d", "c", "b", "a"].iter().map(|h| seg(&format!("seg-{h}"), h, 64 * MIB, Medium::Dram)).collect();
        let q = plan(2, &segments, &[profile("p", 2, 8 * MIB, MIB, 2)], 7).unwrap();
        let id = |h: &str| stable_segment_id(&format!("seg-{h}"));
        let table: Vec<(u32, SegmentId, u64)> =
            q.extents.iter().map(|e| (e.group, e.segment, e.offset / MIB)).collect();
        assert_eq!(
            table,
            vec![
                (0, id("a"), 56),
                (0, id("b"), 56),
                (1, id("c"), 56),
                (1, id("d"), 56),
                (0, id("c"), 48),
                (0, id("d"), 48),
                (1, id("a"), 48),
                (1, id("b"), 48),
            ]
        );
        assert_eq!(q.segments.iter().map(|s| s.host.as_str()).collect::<Vec<_>>(), ["a", "b", "c", "d"]);
        assert_eq!(PartitionQuota::decode(&q.encode()), Ok(q));
    }

    #[test]
    fn profiles_stack_from_the_end_and_keep_to_their_medium() {
        let mut segments: Vec<_> =
            (0..3).map(|h| seg(&format!("m{h}"), &format!("h{h}"), 32 * MIB, Medium::Dram)).collect();
        segments.extend((0..2).map(|h| seg(&format!("f{h}"), &format!("h{h}"), 16 * MIB, Medium::File)));
        let file = Profile { medium: Medium::File, ..profile("f", 2, 4 * MIB, MIB, 1) };
        let q =
            plan(1, &segments, &[profile("big", 3, 8 * MIB, MIB, 1), profile("small", 2, 2 * MIB, MIB, 2), file], 0)
                .unwrap();
        let on = |name: &str| -> Vec<(u16, u64)> {
            let mut v: Vec<_> = q
                .extents
                .iter()
                .filter(|e| e.segment == stable_segment_id(name))
                .map(|e| (e.profile, e.offset / MIB))
                .collect();
            v.sort_unstable();
            v
        };
        assert_eq!(on("m0"), vec![(0, 24), (1, 20), (1, 22)]);
        assert_eq!(on("f1"), vec![(2, 12)]);
    }

    #[test]
    fn plans_that_cannot_serve_are_refused_with_their_cause() {
        let two_hosts: Vec<_> =
            (0..2).map(|h| seg(&format!("s{h}"), &format!("h{h}"), 64 * MIB, Medium::Dram)).collect();
        let err = |r: Result<PartitionQuota, QuotaError>| match r {
            Err(QuotaError::Invalid(why)) => why,
            other => panic!("{other:?}"),
        };
        // Three members, two hosts.
        assert!(err(plan(1, &two_hosts, &[profile("p", 3, MIB, MIB, 4)], 0)).contains("distinct hosts"));
        // Two groups, one run of extents.
        assert!(err(plan(2, &two_hosts, &[profile("p", 2, MIB, MIB, 1)], 0)).contains("group 1"));
        // No room.
        assert!(err(plan(1, &two_hosts, &[profile("p", 2, 40 * MIB, MIB, 2)], 0)).contains("room for 1"));
        // No segment of the medium.
        let file = Profile { medium: Medium::File, ..profile("p", 2, MIB, MIB, 1) };
        assert!(err(plan(1, &two_hosts, &[file], 0)).contains("no stable segment"));
        // Bad profiles.
        for bad in [
            profile("p", 1, MIB, MIB, 1),
            profile("p", 2, MIB + 64, MIB, 1),
            profile("p", 2, MIB, 100, 1),
            profile("", 2, MIB, MIB, 1),
        ] {
            assert!(plan(1, &two_hosts, &[bad], 0).is_err());
        }
    }

    #[test]
    fn a_stored_plan_that_breaks_a_rule_is_refused() {
        let segments: Vec<_> =
            (0..2).map(|h| seg(&format!("s{h}"), &format!("h{h}"), 64 * MIB, Medium::Dram)).collect();
        let good = plan(1, &segments, &[profile("p", 2, 8 * MIB, MIB, 2)], 0).unwrap();
        let mut overlap = good.clone();
        overlap.extents[1].offset = overlap.extents[0].offset - MIB;
        overlap.extents[1].segment = overlap.extents[0].segment;
        let mut past_end = good.clone();
        past_end.extents[0].offset = 60 * MIB;
        let mut no_group = good.clone();
        no_group.extents[0].group = 1;
        let mut unaligned = good.clone();
        unaligned.extents[0].offset += 64;
        let mut forged_host = good.clone();
        forged_host.segments[0].host = String::new();
        let mut forged_id = good.clone();
        forged_id.segments[0].name = "not-its-name".into();
        for (bad, says) in [
            (overlap, "overlap"),
            (past_end, "past the end"),
            (no_group, "for group 1 of 1"),
            (unaligned, "boundary"),
            (forged_host, "no host"),
            (forged_id, "not the stable id"),
        ] {
            let sealed = envelope::seal(
                RecordKind::PartitionQuota,
                PARTITION_QUOTA_VERSION,
                &postcard::to_stdvec(&bad).unwrap(),
            );
            match PartitionQuota::decode(&sealed) {
                Err(QuotaError::Invalid(why)) => assert!(why.contains(says), "{says}: {why}"),
                other => panic!("{says}: {other:?}"),
            }
        }
        let garbage = envelope::seal(RecordKind::PartitionQuota, PARTITION_QUOTA_VERSION, &[0xff; 30]);
        assert!(matches!(PartitionQuota::decode(&garbage), Err(QuotaError::Malformed(_))));
    }

    /// Segments and profiles for the property test: up to 16 segments on up to 6 hosts, mostly
    /// DRAM, and one or two profiles.
    #[allow(clippy::type_complexity)]
    fn inputs() -> impl Strategy<Value = (u32, usize, Vec<(u64, bool)>, Vec<(u32, u64, u32, u32, bool)>)> {
        (
            1u32..4,
            1usize..7,
            proptest::collection::vec((1u64..128, proptest::bool::weighted(0.15)), 1..16),
            proptest::collection::vec((2u32..4, 1u64..9, 0u32..3, 1u32..5, proptest::bool::weighted(0.15)), 1..3),
        )
    }

    /// Whatever the segments and profiles, a plan that is made has extents that never overlap,
    /// stay inside their segments, keep to their profile's medium, length and alignment, and
    /// give each group its share give or take one run; the same segments in another order give
    /// the same plan. At least a quarter of the cases must make a plan, so that the test checks
    /// plans and not only refusals.
    #[test]
    fn plans_never_overlap_and_stay_in_bounds() {
        let made = std::sync::atomic::AtomicUsize::new(0);
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(256));
        runner
            .run(&inputs(), |(groups, hosts, sizes, profiles)| {
                let segments: Vec<StableSegment> = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &(mib, file))| {
                        let medium = if file { Medium::File } else { Medium::Dram };
                        seg(&format!("s{i}"), &format!("h{}", i % hosts), mib * MIB + 4096 * i as u64, medium)
                    })
                    .collect();
                let profiles: Vec<Profile> = profiles
                    .iter()
                    .enumerate()
                    .map(|(i, &(members, extent_stripes, stripe_pow, per_segment, file))| Profile {
                        name: format!("p{i}"),
                        members,
                        stripe: (64 << 10) << stripe_pow,
                        extent: extent_stripes * ((64 << 10) << stripe_pow),
                        medium: if file { Medium::File } else { Medium::Dram },
                        per_segment,
                    })
                    .collect();
                let Ok(q) = plan(groups, &segments, &profiles, 1) else { return Ok(()) };
                made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let reversed: Vec<StableSegment> = segments.iter().rev().cloned().collect();
                prop_assert_eq!(plan(groups, &reversed, &profiles, 1), Ok(q.clone()));
                let by_id: BTreeMap<SegmentId, &StableSegment> = segments.iter().map(|s| (s.id, s)).collect();
                let mut used: Vec<(SegmentId, u64, u64)> = Vec::new();
                for e in &q.extents {
                    let s = by_id[&e.segment];
                    let p = &profiles[e.profile as usize];
                    prop_assert!(e.offset + e.len <= s.size);
                    prop_assert_eq!(e.len, p.extent);
                    prop_assert_eq!(s.medium, p.medium);
                    prop_assert_eq!(e.offset % p.stripe, 0);
                    prop_assert_eq!(e.offset % crate::segment_block_size(s.size), 0);
                    used.push((e.segment, e.offset, e.offset + e.len));
                }
                used.sort_unstable();
                for w in used.windows(2) {
                    prop_assert!(w[0].0 != w[1].0 || w[0].2 <= w[1].1, "{:?} overlaps {:?}", w[0], w[1]);
                }
                for (i, p) in profiles.iter().enumerate() {
                    let counts: Vec<usize> = (0..groups).map(|g| q.extents_of(g, i as u16).count()).collect();
                    let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                    prop_assert!(hi - lo <= p.members as usize, "{counts:?}");
                }
                prop_assert_eq!(PartitionQuota::decode(&q.encode()), Ok(q));
                Ok(())
            })
            .unwrap();
        let made = made.into_inner();
        assert!(made >= 64, "only {made} of 256 cases made a plan");
    }

    proptest! {
        /// Stored records of any bytes are refused or read, never a panic.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(payload in proptest::collection::vec(any::<u8>(), 0..600)) {
            for kind in [RecordKind::PartitionQuota, RecordKind::SegmentDescriptor] {
                let sealed = envelope::seal(kind, 1, &payload);
                let _ = PartitionQuota::decode(&sealed);
                let _ = StableSegment::decode(&sealed);
            }
            let _ = PartitionQuota::decode(&payload);
            let _ = StableSegment::decode(&payload);
        }
    }
}
