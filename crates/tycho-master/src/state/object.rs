//! Per-object metadata and the 1024 shards that hold it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use tycho_proto::ClientId;

use crate::log::record::PinsRec;
use crate::state::segment::{Counted, Replica};

/// Number of metadata shards (Mooncake: 1024), each behind its own reader/writer lock.
pub const SHARD_COUNT: usize = 1024;

/// Storage key: length-prefixed tenant followed by the key (`tycho_routing::encode_object_key`).
pub type ObjectKey = Box<[u8]>;

/// One shard's map.
pub type ShardMap = HashMap<ObjectKey, ObjectMeta, foldhash::fast::RandomState>;

/// The shards.
pub struct Shards {
    shards: Box<[RwLock<ShardMap>]>,
}

impl Default for Shards {
    fn default() -> Self {
        Shards::new(SHARD_COUNT)
    }
}

/// The metadata shards of each group of a master of `groups` groups: [`SHARD_COUNT`] in all,
/// whatever the number of groups (at least one per group), so that a group's partitions
/// spread over its shards as the 16384 partitions spread over a single group's, and a master
/// of many groups keeps as many maps, of the same sizes, as a master of one.
pub fn shards_per_group(groups: u32) -> usize {
    (SHARD_COUNT / groups.max(1) as usize).max(1)
}

impl Shards {
    /// `count` empty shards (at least one).
    pub fn new(count: usize) -> Shards {
        Shards { shards: (0..count.max(1)).map(|_| RwLock::new(ShardMap::default())).collect() }
    }

    /// How many shards there are.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Whether there is none (never: there is at least one).
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// The shard that holds keys of `partition_id`. A group's partitions are a contiguous range
    /// (`tycho_routing::rank_partitions`), so they spread evenly over its shards.
    pub fn index_of(&self, partition_id: u16) -> usize {
        partition_id as usize % self.shards.len()
    }

    /// Shard `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<&RwLock<ShardMap>> {
        self.shards.get(i)
    }

    /// Shard `i`.
    pub fn shard(&self, i: usize) -> &RwLock<ShardMap> {
        &self.shards[i]
    }

    /// All shards in index order.
    pub fn iter(&self) -> impl Iterator<Item = &RwLock<ShardMap>> {
        self.shards.iter()
    }
}

/// One of a client's unfinished writes, counted while it exists: dropping the pending write,
/// on whatever path (commit, revoke, pre-emption, sweep, reclaim, removal), gives it back.
pub type PendingSlot = Counted;

/// A write that has not been committed.
pub struct PendingWrite {
    /// The client that started it; only it may end or revoke it.
    pub writer: ClientId,
    /// The writer's name for this write; end and revoke must carry it.
    pub write_id: u64,
    /// When it started (clock ms).
    pub started_ms: u64,
    /// Size of the new value.
    pub size: u64,
    /// The ranges being written.
    pub replicas: Vec<Replica>,
    /// Pin state the object takes on commit.
    pub pins: Pins,
    /// The writer's count of unfinished writes.
    pub slot: PendingSlot,
    /// Set when the write is a task's copy of the current value rather than a new value.
    pub copy: Option<CopyOf>,
}

/// What a pending copy adds to: its commit adds its ranges to the value's replicas (and drops
/// a move's source replica) instead of replacing the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOf {
    /// The task that runs it.
    pub task: crate::state::task::TaskId,
    /// The version of the value copied; the commit checks it is still the current one.
    pub version: u64,
    /// A move's source segment, whose replica the commit drops.
    pub source: Option<tycho_proto::SegmentId>,
}

/// Pin state of an object.
#[derive(Clone, Copy, Default)]
pub struct Pins {
    /// Soft-pin TTL to apply on commit, ms; `None` for no soft pin.
    pub soft_pin_ttl_ms: Option<u64>,
    /// Keep the object's current soft pin (upsert with PRESERVE).
    pub preserve_soft_pin: bool,
    /// Never evict.
    pub hard_pin: bool,
}

impl From<Pins> for PinsRec {
    fn from(p: Pins) -> PinsRec {
        PinsRec { soft_pin_ttl_ms: p.soft_pin_ttl_ms, preserve_soft_pin: p.preserve_soft_pin, hard_pin: p.hard_pin }
    }
}

impl From<PinsRec> for Pins {
    fn from(p: PinsRec) -> Pins {
        Pins { soft_pin_ttl_ms: p.soft_pin_ttl_ms, preserve_soft_pin: p.preserve_soft_pin, hard_pin: p.hard_pin }
    }
}

/// Metadata of one object.
pub struct ObjectMeta {
    /// Committed value size; meaningful once `committed` holds replicas.
    pub size: u64,
    /// Replicas of the committed value; empty while the first write is in progress.
    pub replicas: Vec<Replica>,
    /// The write in progress: the first write of the key, or an upsert of a committed value.
    pub pending: Option<PendingWrite>,
    /// Read lease: the object may not be removed or evicted before this time (ms).
    /// Atomic so that readers extend it under the shard's read lock.
    pub lease_until: AtomicU64,
    /// Its place in the group's use order, which eviction ranks by (see [`crate::state::policy`]).
    pub used: crate::state::policy::UseMark,
    /// Soft pin in force until this time (ms); 0 for none.
    pub soft_pin_until: u64,
    /// Never evicted.
    pub hard_pin: bool,
    /// The client whose write created the current value.
    pub writer: ClientId,
    /// Version of the current value: the id of the write that committed it (0 before).
    pub version: u64,
    /// What that commit answered its writer to retire, answered again to a repeated end.
    pub replaced: Vec<tycho_proto::ReplicaDesc>,
    /// Fan-out adds no replica before this time (ms; 0 for none): eviction reclaimed one.
    pub cooldown_until: u64,
}

impl ObjectMeta {
    /// True once a value has been committed.
    pub fn is_complete(&self) -> bool {
        !self.replicas.is_empty()
    }

    /// Current lease deadline.
    pub fn lease(&self) -> u64 {
        self.lease_until.load(Ordering::Relaxed)
    }

    /// Whether a read lease is in force at `now`.
    pub fn is_leased(&self, now: u64) -> bool {
        self.lease() > now
    }

    /// Extends the lease to at least `until`.
    pub fn extend_lease(&self, until: u64) {
        self.lease_until.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether a soft pin is in force at `now`.
    pub fn is_soft_pinned(&self, now: u64) -> bool {
        self.soft_pin_until > now
    }

    /// Whether any replica (committed or pending) lies on a dead segment.
    pub fn touches_dead_segment(&self) -> bool {
        self.replicas.iter().any(|r| !r.seg.is_alive())
            || self.pending.as_ref().is_some_and(|p| p.replicas.iter().any(|r| !r.seg.is_alive()))
    }
}
