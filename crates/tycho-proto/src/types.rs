//! Identities, descriptors and per-write options shared by all messages.

use serde::{Deserialize, Serialize};

#[cfg(test)]
use proptest_derive::Arbitrary;

/// A store client (a process that mounts segments or calls the master). Random, chosen by
/// the client once per process life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
#[serde(transparent)]
pub struct ClientId(pub u128);

/// A mounted segment: a contiguous range of memory one client contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
#[serde(transparent)]
pub struct SegmentId(pub u128);

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::fmt::Display for SegmentId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Smallest allocation in a segment, in bytes, and the alignment of every range.
pub const MIN_BLOCK_SIZE: u64 = 64;

/// Size of the blocks a segment of `size` bytes is cut into: the unit of allocation (no block
/// is ever shared by two live ranges) and of generation stamps. 64 bytes, doubled for segments
/// so large that the block count would not fit 32 bits. The master and every reader and writer
/// compute it with this one function.
pub fn segment_block_size(size: u64) -> u64 {
    let mut unit = MIN_BLOCK_SIZE;
    while size / unit >= u32::MAX as u64 {
        unit *= 2;
    }
    unit
}

/// The route a key-addressed request was sent under: the key's partition and the epoch of
/// the partition's KVPT group as the client believes it. The master checks both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct RouteTag {
    /// `crc32c(tenant ‖ key) mod 16384`.
    pub partition_id: u16,
    /// Ownership epoch of the key's KVPT group.
    pub epoch: u64,
}

/// One key of a request, with the route it was sent under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct KeyRef {
    /// The object key.
    pub key: String,
    /// Partition and epoch the client computed for it.
    pub route: RouteTag,
}

/// A segment as a client describes it when mounting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct SegmentDesc {
    /// Stable identity of this segment.
    pub id: SegmentId,
    /// Human-readable name; preferred-segment lists refer to it (`host:port` by convention).
    pub name: String,
    /// Address in the owner's address space where the segment starts; used for overlap checks.
    pub base: u64,
    /// Size in bytes.
    pub size: u64,
    /// Address of the transfer server that serves this segment (`ip:port`).
    pub endpoint: String,
    /// Identity of the host; peers of the same user on the same host may ask the holder for a
    /// mapping of the segment over its local socket (never by a path given here).
    pub host: String,
    /// Incarnation of the segment's memory: its owner bumps it before every (re)mount, so that
    /// readers of ranges handed out by an earlier mount see that they may have been reused.
    pub incarnation: u32,
}

/// Most KVPT groups a segment keeps an incarnation per slice for (its memory header has room
/// for this many): with more groups, a segment has one incarnation for all of them.
pub const MAX_SLICES: u32 = 512;

/// Where group `rank`'s slice of a `size`-byte segment starts, of `groups` slices: whole
/// blocks of `unit` bytes, divided as evenly as they go.
pub fn slice_start(size: u64, unit: u64, rank: u32, groups: u32) -> u64 {
    let blocks = size / unit;
    (blocks as u128 * rank as u128 / groups.max(1) as u128) as u64 * unit
}

/// Group `rank`'s slice `[start, end)` of a segment of `size` bytes, of `groups` slices: the
/// bytes that group's primary allocates in. The master, the segment's owner and its transfer
/// server compute it with this one function.
pub fn slice_of(size: u64, rank: u32, groups: u32) -> std::ops::Range<u64> {
    let unit = segment_block_size(size);
    let end = if rank + 1 >= groups.max(1) { size } else { slice_start(size, unit, rank + 1, groups) };
    slice_start(size, unit, rank, groups)..end
}

/// The slice of `groups` that byte `offset` of a `size`-byte segment lies in (the last one for
/// an offset past the end).
pub fn slice_rank(size: u64, offset: u64, groups: u32) -> u32 {
    let unit = segment_block_size(size);
    // The largest rank whose slice starts at or before `offset`: starts grow with the rank.
    let (mut lo, mut hi) = (0u32, groups.max(1) - 1);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if slice_start(size, unit, mid, groups) <= offset {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The incarnation of one group's slice of a segment, as its owner mounts it (see
/// [`SlicedSegment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct SliceIncarnation {
    /// The slice's incarnation.
    pub incarnation: u32,
    /// Whether no master has mounted the slice under this incarnation yet. A master whose
    /// group no longer has the segment (it dropped it: an expiry, an admin's unmount, a
    /// cluster started over) takes only a fresh incarnation there, so that no range of a
    /// dropped incarnation is ever handed out again.
    pub fresh: bool,
}

/// A segment with an incarnation per KVPT group's slice: what `MountSlices` carries, so that a
/// master that drops the segment's replicas in its groups costs only those groups' slices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct SlicedSegment {
    /// The segment (its `incarnation` is the highest of its slices').
    pub desc: SegmentDesc,
    /// One per group, by rank (as many as the cluster has groups).
    pub slices: Vec<SliceIncarnation>,
}

/// The groups of `serving` that must refuse a MountSlices of one segment: those that do not
/// hold it under its slice's offered incarnation (`held(rank)`: the incarnation group `rank`
/// holds it under, if any), where that incarnation is not fresh. A group that held the segment
/// and dropped it may still have readers of its ranges; a range of the same incarnation handed
/// out again could pass their check. (A group that holds an earlier incarnation takes a fresh
/// one, which replaces it.)
pub fn stale_slices(
    serving: impl IntoIterator<Item = u32>,
    held: impl Fn(u32) -> Option<u32>,
    offered: &[SliceIncarnation],
) -> Vec<u32> {
    serving
        .into_iter()
        .filter(|&rank| {
            let Some(slice) = offered.get(rank as usize) else { return true };
            let holds = held(rank) == Some(slice.incarnation);
            !holds && !slice.fresh
        })
        .collect()
}

/// What a segment's owner knows of each slice's incarnation: whether it was ever offered to a
/// master (then a master may have mounted it, even if its answer was lost, and a group that does
/// not hold it must get a new one, see [`stale_slices`]). The incarnations themselves live in
/// the segment's memory, where its readers check them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SliceBook {
    fresh: Vec<bool>,
}

impl SliceBook {
    /// `groups` slices, none mounted yet.
    pub fn new(groups: u32) -> SliceBook {
        SliceBook { fresh: vec![true; groups as usize] }
    }

    /// How many slices it keeps.
    pub fn groups(&self) -> u32 {
        self.fresh.len() as u32
    }

    /// The slices as MountSlices offers them, with `incarnation(rank)` each.
    pub fn offer(&self, incarnation: impl Fn(u32) -> u32) -> Vec<SliceIncarnation> {
        (0..self.groups())
            .map(|r| SliceIncarnation { incarnation: incarnation(r), fresh: self.fresh[r as usize] })
            .collect()
    }

    /// The slices as MountSlices offers them, with `incarnation(rank)` each; from now on none
    /// is fresh (whatever becomes of the offer: an answer lost is a mount that may have
    /// happened).
    pub fn offer_once(&mut self, incarnation: impl Fn(u32) -> u32) -> Vec<SliceIncarnation> {
        let offer = self.offer(incarnation);
        self.fresh.iter_mut().for_each(|f| *f = false);
        offer
    }

    /// The slices of `ranks` started new incarnations.
    pub fn started_over(&mut self, ranks: &[u32]) {
        self.set(ranks, true);
    }

    fn set(&mut self, ranks: &[u32], fresh: bool) {
        for &r in ranks {
            if let Some(f) = self.fresh.get_mut(r as usize) {
                *f = fresh;
            }
        }
    }
}

/// Where one replica of an object lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct ReplicaDesc {
    /// The segment holding the bytes.
    pub segment: SegmentId,
    /// Offset of the bytes inside the segment.
    pub offset: u64,
    /// Length in bytes (the object size).
    pub len: u64,
    /// Transfer server of the segment.
    pub endpoint: String,
    /// Host identity of the segment's owner.
    pub host: String,
    /// Incarnation of the segment the range was handed out in.
    pub incarnation: u32,
    /// Generation of the range: its writer stamps it on every block of the range before the
    /// first byte; a reader's copy counts only if every block still carries it afterwards.
    pub gen: u32,
    /// The master's grant of this range to the caller; the segment's holder checks it on every
    /// transfer (`auth::capability`). Empty in a cluster without a secret.
    pub cap: crate::auth::capability::Capability,
}

/// How a write treats the soft pin (Mooncake's `SoftPinAction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum SoftPinAction {
    /// No soft pin (an upsert clears an existing one).
    #[default]
    Disable,
    /// Soft-pin the object for `soft_pin_ttl_ms` or the default TTL.
    Enable,
    /// Keep whatever pin state the object had (for upserts; a new object gets none).
    Preserve,
}

/// How the master picks segments for the replicas of a new object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum AllocStrategy {
    /// Uniformly random among segments with room (Mooncake's default).
    #[default]
    Random,
    /// The segments with the largest free fraction first.
    FreeRatioFirst,
    /// A segment on the writer's host first, then random.
    LocalFirst,
}

/// Per-write placement and pinning options (Mooncake's `ReplicateConfig`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct ReplicateConfig {
    /// Replicas wanted; placement is best effort, at least one.
    pub replica_num: u32,
    /// Soft-pin handling.
    pub soft_pin_action: SoftPinAction,
    /// Soft-pin TTL; only valid with [`SoftPinAction::Enable`].
    pub soft_pin_ttl_ms: Option<u64>,
    /// Never evict this object.
    pub hard_pin: bool,
    /// Segment names to place replicas on first, in order.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_NAMES }>")]
    pub preferred_segments: Vec<String>,
    /// Place the first replica on the writer's host when possible.
    pub prefer_alloc_in_same_node: bool,
    /// Placement strategy; `None` uses the master's default.
    pub strategy: Option<AllocStrategy>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig {
            replica_num: 1,
            soft_pin_action: SoftPinAction::Disable,
            soft_pin_ttl_ms: None,
            hard_pin: false,
            preferred_segments: Vec::new(),
            prefer_alloc_in_same_node: false,
            strategy: None,
        }
    }
}

/// Answer to Ping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum ClientStatus {
    /// The master knows this client.
    Ok,
    /// The master does not know this client (it expired or the master restarted):
    /// remount every segment.
    NeedRemount,
}

/// Answer to Ping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct PingReply {
    /// Whether the client must remount.
    pub status: ClientStatus,
    /// Identity of the master process; changes when the master restarts.
    pub master_instance: u64,
}

/// Answer to GetReplicaList: where to read, and for how long the read lease holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct ReplicaList {
    /// Object size in bytes.
    pub size: u64,
    /// Complete replicas.
    pub replicas: Vec<ReplicaDesc>,
    /// The lease granted with this answer; a read finishing later must fail.
    pub lease_ttl_ms: u64,
}

/// A mounted segment with its usage, for admin listings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct SegmentStatus {
    /// The segment as mounted.
    pub desc: SegmentDesc,
    /// The client that mounted it.
    pub client: ClientId,
    /// Bytes allocated to replicas.
    pub used: u64,
}

/// One object in an admin key listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct KeyInfo {
    /// Tenant the key belongs to.
    pub tenant: String,
    /// The key.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Number of replicas.
    pub replicas: u32,
    /// Whether the write has completed.
    pub complete: bool,
    /// Remaining read lease in milliseconds (0 when none).
    pub lease_remaining_ms: u64,
    /// Whether a soft pin is in force.
    pub soft_pinned: bool,
    /// Whether the object is hard-pinned.
    pub hard_pinned: bool,
}

/// Whole-master figures for `tycho stat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct MasterStats {
    /// Sum of mounted segment sizes.
    pub capacity_bytes: u64,
    /// Bytes allocated to replicas.
    pub used_bytes: u64,
    /// Objects (complete and in progress).
    pub objects: u64,
    /// Live clients.
    pub clients: u64,
    /// Mounted segments.
    pub segments: u64,
    /// Objects the liveness sweep has visited since the master started.
    pub sweep_progress: u64,
}

/// Answer to HealthCheck.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct HealthReport {
    /// Every shard's read lock was taken within the budget.
    pub ok: bool,
    /// Shards whose read lock was taken.
    pub shards_checked: u64,
    /// Index of the first shard that stayed write-locked past the budget (0 when `ok`).
    pub shards_blocked: u64,
}

/// What a copy or move task does (Mooncake's `TaskType`: REPLICA_COPY = 0, REPLICA_MOVE = 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum TaskKind {
    /// Add replicas of an object on the target segments.
    Copy,
    /// Move an object's replica from its source segment to the target segment.
    Move,
}

/// Where a task stands (Mooncake's `TaskStatus`, in its order: PENDING = 0, PROCESSING = 1,
/// FAILED = 2, SUCCESS = 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum TaskStatus {
    /// Waiting for its client to fetch it.
    Pending,
    /// Fetched by its client, which runs it.
    Processing,
    /// Ended without doing what it was for.
    Failed,
    /// Done.
    Success,
}

impl TaskStatus {
    /// Whether the task has ended.
    pub fn is_finished(self) -> bool {
        matches!(self, TaskStatus::Failed | TaskStatus::Success)
    }
}

/// A copy or move task as the master describes it: to its user (QueryTask) and to the client
/// that runs it (FetchTasks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct TaskInfo {
    /// Its id: the KVPT group's rank in the top 16 bits.
    pub id: u128,
    /// Copy or move.
    pub kind: TaskKind,
    /// Where it stands.
    pub status: TaskStatus,
    /// The tenant of its object.
    pub tenant: String,
    /// Its object's key.
    pub key: String,
    /// The segment (by name) whose replica is copied or moved.
    pub source: String,
    /// The segments (by name) that receive a replica.
    pub targets: Vec<String>,
    /// The client that runs it: the owner of the source segment.
    pub assigned: ClientId,
    /// When it was created (Unix ms).
    pub created_ms: u64,
    /// When its status last changed (Unix ms).
    pub updated_ms: u64,
    /// Why it failed, or a word on its success.
    pub message: String,
}

/// What a task's client is granted to run a copy: read the source replica, write the targets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct CopyGrant {
    /// The version of the object copied: the write id of the write that committed it.
    pub version: u64,
    /// The replica to copy from, with a read grant.
    pub source: ReplicaDesc,
    /// The new ranges, one per target segment, with write grants.
    pub targets: Vec<ReplicaDesc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_that_dropped_a_segment_takes_only_a_fresh_incarnation_of_its_slice() {
        let mut book = SliceBook::new(3);
        let incs = [5u32, 5, 5];
        let offered = book.offer_once(|r| incs[r as usize]);
        // Never offered: every group takes it.
        assert!(stale_slices(0..3, |_| None, &offered).is_empty());
        // Offered once (taken, or the answer lost): no longer fresh.
        let offered = book.offer(|r| incs[r as usize]);
        assert!(offered.iter().all(|s| !s.fresh));
        // Held under it: taken again; held under an earlier one: only a fresh one replaces it.
        assert!(stale_slices(0..3, |_| Some(5), &offered).is_empty());
        assert_eq!(stale_slices(0..3, |r| Some(if r == 2 { 4 } else { 5 }), &offered), vec![2]);
        // Group 1 dropped it: only group 1 refuses, until its slice starts over.
        assert_eq!(stale_slices(0..3, |r| (r != 1).then_some(5), &offered), vec![1]);
        book.started_over(&[1]);
        let incs = [5u32, 6, 5];
        assert!(stale_slices(0..3, |r| (r != 1).then_some(5), &book.offer(|r| incs[r as usize])).is_empty());
        // A group the offer has no slice for refuses.
        assert_eq!(stale_slices([3], |_| None, &book.offer(|r| incs[r as usize])), vec![3]);
    }

    #[test]
    fn every_byte_lies_in_the_slice_slice_rank_names() {
        for (size, groups) in
            [(1u64 << 20, 1u32), (1 << 20, 2), (1 << 20, 3), (1 << 20, 7), (4096 + 64, 512), (64 * 5, 8)]
        {
            let mut covered = 0;
            for rank in 0..groups {
                let slice = slice_of(size, rank, groups);
                assert_eq!(slice.start, covered, "slices of {size} bytes in {groups} are contiguous");
                covered = slice.end;
                for offset in [slice.start, slice.start + (slice.end - slice.start) / 2, slice.end.saturating_sub(1)] {
                    if slice.start < slice.end {
                        assert_eq!(slice_rank(size, offset, groups), rank, "{offset} of {size} in {groups}");
                    }
                }
            }
            assert_eq!(covered, size);
        }
    }
}
