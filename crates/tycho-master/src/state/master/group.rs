//! One KVPT group's metadata on a master: the unit that failover, standby bootstrap and reshard
//! move, and that a master adds or drops whole.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tycho_routing::partition_of_encoded;

use super::Tombstone;
use crate::log::record::{Record, RecordSink};
use crate::state::object::{ObjectKey, ShardMap, Shards};
use crate::state::segment::SegmentTable;

/// A group container: its metadata shards, the tombstones of its force-removed leased objects,
/// its slices of the mounted segments, its ownership epoch, its log and its position in it.
pub struct Group {
    rank: u32,
    epoch: AtomicU64,
    /// Whether this master answers requests for the group: false while it only replays the
    /// group's log (a standby) or has stopped serving it.
    serving: AtomicBool,
    /// Whether the group's record names this master primary while it is not serving the group
    /// yet (it is replaying the log's end after its promotion): requests for it are told to wait
    /// here (KVPT_MIGRATING) rather than to go elsewhere.
    installing: AtomicBool,
    /// Whether the group is moving to another master and its new writes wait
    /// (KVPT_MIGRATING): writes admitted before still end, are revoked, evicted or expire.
    frozen: AtomicBool,
    /// Sequence number of the last record of the group's log applied here (0: none).
    applied: AtomicU64,
    /// How the group's log goes on this master (`/metrics`).
    log_stats: std::sync::Arc<crate::log::oplog::LogStats>,
    pub(super) shards: Shards,
    /// Per shard: the ranges of leased objects removed by force, until their lease ends (see
    /// `Master::commit`). Lock order: the shard's lock, then this one.
    pub(super) tombstones: Box<[Mutex<HashMap<ObjectKey, Tombstone>>]>,
    /// The segments mounted for the group: each an allocator over the group's slice.
    pub(super) segments: SegmentTable,
    /// Where the group's records go while this master is its primary (its OpLog writer).
    sink: RwLock<Option<Arc<dyn RecordSink>>>,
    /// Per shard: the sequence number of the last record logged that changed what a read of
    /// one of its keys sees (a record of the group's segments counts for every shard). Set
    /// under the shard's write lock, with the change, so that a reader that sees the change
    /// sees its number (see `Master::gate_read`).
    logged: Box<[AtomicU64]>,
    /// The highest durable sequence number of the sink a reader has seen (a cache that spares
    /// most reads a look at the log).
    durable_seen: AtomicU64,
    /// The group's copy and move tasks.
    pub(super) tasks: Mutex<crate::state::task::Tasks>,
    /// The group's use sequence and eviction state (not logged; see [`crate::state::policy`]).
    pub(super) uses: crate::state::policy::Uses,
}

impl Group {
    /// An empty container of group `rank` at `epoch` with `shards` metadata shards
    /// ([`crate::state::object::shards_per_group`]), allocating in `segments`.
    pub fn new(rank: u32, epoch: u64, shards: usize, segments: SegmentTable) -> Group {
        let shards = Shards::new(shards);
        Group {
            segments,
            sink: RwLock::new(None),
            rank,
            epoch: AtomicU64::new(epoch),
            serving: AtomicBool::new(true),
            installing: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            log_stats: Default::default(),
            tombstones: (0..shards.len()).map(|_| Mutex::new(HashMap::new())).collect(),
            logged: (0..shards.len()).map(|_| AtomicU64::new(0)).collect(),
            durable_seen: AtomicU64::new(0),
            shards,
            tasks: Mutex::default(),
            uses: Default::default(),
        }
    }

    /// The group's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The lifetime the group's last eviction round measured, in uses (see
    /// [`crate::state::policy::Uses::lifetime`]).
    pub fn eviction_lifetime(&self) -> u64 {
        self.uses.lifetime()
    }

    /// The ownership epoch this master serves the group under.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether this master answers requests for the group.
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Acquire)
    }

    /// Starts or stops answering requests for the group; returns whether it did before.
    pub(super) fn set_serving(&self, on: bool) -> bool {
        self.serving.swap(on, Ordering::AcqRel)
    }

    /// Whether this master is about to serve the group: named its primary, replaying the log's
    /// end (see [`crate::state::master::Master::installing`]).
    pub fn is_installing(&self) -> bool {
        self.installing.load(Ordering::Acquire)
    }

    /// Notes that this master is (or no longer is) about to serve the group.
    pub(super) fn set_installing(&self, on: bool) {
        self.installing.store(on, Ordering::Release);
    }

    /// Whether new writes of the group wait for a reshard's switch (see [`crate::state::master::Master::freeze`]).
    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Acquire)
    }

    /// Freezes or thaws new writes of the group; returns whether they were frozen before.
    pub(super) fn set_frozen(&self, on: bool) -> bool {
        self.frozen.swap(on, Ordering::AcqRel)
    }

    /// Serves the group under `epoch` from now on (a promotion or an ownership change).
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
    }

    /// The sequence number of the last log record applied.
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Notes that the group's log record `seq` has been applied.
    pub fn note_applied(&self, seq: u64) {
        self.applied.fetch_max(seq, Ordering::AcqRel);
    }

    /// Forgets the log position (the group's state was dropped to start over).
    pub(super) fn reset_applied(&self) {
        self.applied.store(0, Ordering::Release);
    }

    /// Where the group's log writer and follower report their figures.
    pub fn log_stats(&self) -> &std::sync::Arc<crate::log::oplog::LogStats> {
        &self.log_stats
    }

    /// The segments mounted for the group (its slices of them).
    pub fn segments(&self) -> &SegmentTable {
        &self.segments
    }

    /// Sends the group's records to `sink` from now on (`None`: nowhere); returns the previous
    /// one.
    pub(super) fn set_sink(&self, sink: Option<Arc<dyn RecordSink>>) -> Option<Arc<dyn RecordSink>> {
        let mut held = self.sink.write();
        // A new log starts from state that is durable already (replayed, or empty).
        self.logged.iter().for_each(|l| l.store(0, Ordering::Release));
        self.durable_seen.store(0, Ordering::Release);
        std::mem::replace(&mut *held, sink)
    }

    /// The group's record sink, if it has one.
    pub(super) fn sink(&self) -> Option<Arc<dyn RecordSink>> {
        self.sink.read().clone()
    }

    /// Hands `rec` to the group's sink; returns the sink and the record's sequence number, or
    /// `None` (and drops the record) without a sink.
    pub(super) fn append(&self, rec: Record) -> Option<(Arc<dyn RecordSink>, u64)> {
        let sink = self.sink.read();
        let s = sink.as_ref()?;
        let shard = rec.key().map(|k| self.shards.index_of(partition_of_encoded(k)));
        let seq = s.append(rec);
        match shard {
            Some(i) => {
                self.logged[i].fetch_max(seq, Ordering::AcqRel);
            }
            None => self.logged.iter().for_each(|l| {
                l.fetch_max(seq, Ordering::AcqRel);
            }),
        }
        Some((s.clone(), seq))
    }

    /// The record a read of shard `shard` must find durable before it answers, with the
    /// group's sink; `None` when there is none to wait for (nothing logged, or all of it known
    /// durable).
    pub(super) fn read_barrier(&self, shard: usize) -> Option<(Arc<dyn RecordSink>, u64)> {
        let seq = self.logged.get(shard)?.load(Ordering::Acquire);
        if seq == 0 || self.durable_seen.load(Ordering::Acquire) >= seq {
            return None;
        }
        let sink = self.sink()?;
        let durable = sink.committed();
        self.durable_seen.fetch_max(durable, Ordering::AcqRel);
        (durable < seq).then_some((sink, seq))
    }

    /// The metadata shards (for health checks and tests).
    pub fn shards(&self) -> &Shards {
        &self.shards
    }

    /// The shard that holds the storage key `key`.
    pub(super) fn shard_of(&self, key: &[u8]) -> &RwLock<ShardMap> {
        self.shards.shard(self.shards.index_of(partition_of_encoded(key)))
    }

    /// The tombstones of the shard that holds `key`.
    pub(super) fn tombstones_of(&self, key: &[u8]) -> &Mutex<HashMap<ObjectKey, Tombstone>> {
        &self.tombstones[self.shards.index_of(partition_of_encoded(key))]
    }
}
