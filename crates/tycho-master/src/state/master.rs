//! The master's object metadata service: every RPC's logic, independent of transport.
//!
//! Lock discipline: a shard lock is never held while taking another shard's lock, and
//! allocation happens before the shard write lock is taken (an allocation failure may run
//! eviction, which visits every shard). Ping only touches the client table.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tycho_proto::*;
use tycho_routing::{decode_object_key, encode_object_key, kvpt_to_rank, partition_of_encoded, validate_key};

use crate::log::record::Record;
use crate::state::clock::Clock;
use crate::state::config::{MasterConfig, MAX_REPLICA_NUM, SWEEP_BATCH};
use crate::state::evict::{Evictor, RoundRequest, EVICTION_WAIT};
use crate::state::object::{ObjectKey, ObjectMeta, PendingWrite, Pins, ShardMap, SHARD_COUNT};
use crate::state::segment::{Grant, Placement, Replica, SegmentTable};
use tycho_proto::auth::capability::{tenant_tag, RIGHT_READ, RIGHT_RETIRE, RIGHT_WRITE};

mod apply;
mod export;
mod fanout;
mod group;
mod stable;
mod tasks;

pub use apply::{Logged, ReplayError};
pub use fanout::{FanoutCounters, Suppressed};
pub use group::Group;
pub use stable::{SegmentDirectory, StoreFuture};

/// Put (put-if-absent) or upsert (replace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Put-if-absent.
    Put,
    /// Insert or replace.
    Upsert,
}

/// Counters of background work, read by stats and metrics.
#[derive(Default)]
pub struct Counters {
    /// Objects the liveness/unmount sweep has visited.
    pub sweep_visited: AtomicU64,
    /// Replicas the sweep dropped.
    pub sweep_replicas_dropped: AtomicU64,
    /// Objects the sweep removed because no replica was left.
    pub sweep_objects_removed: AtomicU64,
    /// Sweeps in progress.
    pub sweeps_running: AtomicU64,
    /// Clients expired for silence.
    pub clients_expired: AtomicU64,
    /// Eviction rounds run.
    pub eviction_rounds: AtomicU64,
    /// Objects evicted.
    pub evicted_objects: AtomicU64,
    /// Bytes evicted.
    pub evicted_bytes: AtomicU64,
    /// Objects evicted, by why the round ran ([`EvictReason`]) and by the policy's queue the
    /// object was in ([`EvictQueue`]).
    pub evicted_by: [[AtomicU64; EvictQueue::ALL.len()]; EvictReason::ALL.len()],
    /// Keys looked up by ExistKey and GetReplicaList (and their batch forms), by answer:
    /// `[exist found, exist not found, get found, get not found]`.
    pub lookups: [AtomicU64; 4],
    /// Unfinished writes pre-empted after the discard timeout.
    pub writes_discarded: AtomicU64,
    /// Unfinished writes reclaimed after the release timeout.
    pub writes_released: AtomicU64,
    /// Objects removed by a client (Remove, its batch form, RemoveByRegex, RemoveAll, replica
    /// clear).
    pub objects_removed: AtomicU64,
    /// Housekeeping rounds that skipped client expiry because the master itself was stalled.
    pub expiry_pauses: AtomicU64,
    /// Copy and move tasks this master decided on, by kind (copy, move).
    pub tasks: [TaskCounters; 2],
}

impl Counters {
    /// Counts keys looked up by GetReplicaList (`get`) or ExistKey: `found` found, `missing` not.
    fn looked_up(&self, get: bool, found: u64, missing: u64) {
        let i = 2 * get as usize;
        for (j, n) in [(i, found), (i + 1, missing)] {
            if n > 0 {
                self.lookups[j].fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// Why an eviction round ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictReason {
    /// The group's use crossed the high watermark.
    Watermark,
    /// A write found no room (the round was asked for bytes).
    Allocation,
}

impl EvictReason {
    /// Every reason, in the order of [`Counters::evicted_by`].
    pub const ALL: [EvictReason; 2] = [EvictReason::Watermark, EvictReason::Allocation];

    /// Its label in metrics.
    pub fn name(self) -> &'static str {
        match self {
            EvictReason::Watermark => "watermark",
            EvictReason::Allocation => "allocation",
        }
    }
}

/// Which of the policy's queues an evicted object was taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictQueue {
    /// Not read since its value was written.
    Unread,
    /// Read since its value was written.
    Read,
    /// Soft-pinned (taken only when the others were too few).
    SoftPinned,
}

impl EvictQueue {
    /// Every queue, in the order of [`Counters::evicted_by`].
    pub const ALL: [EvictQueue; 3] = [EvictQueue::Unread, EvictQueue::Read, EvictQueue::SoftPinned];

    /// Its label in metrics.
    pub fn name(self) -> &'static str {
        match self {
            EvictQueue::Unread => "unread",
            EvictQueue::Read => "read",
            EvictQueue::SoftPinned => "soft_pinned",
        }
    }
}

/// What became of the copy or move tasks of one kind that a master created and ended.
#[derive(Default)]
pub struct TaskCounters {
    /// Tasks created.
    pub created: AtomicU64,
    /// Tasks that succeeded.
    pub succeeded: AtomicU64,
    /// Tasks that failed.
    pub failed: AtomicU64,
    /// Milliseconds from creation to end, summed over the tasks that ended.
    pub duration_ms: AtomicU64,
}

struct ClientEntry {
    last_ping: AtomicU64,
    host: Mutex<Option<String>>,
    segments: Mutex<Vec<SegmentId>>,
    /// Unfinished writes of this client.
    pending: Arc<AtomicU64>,
    /// An admin unmounted one of its segments: its pings are answered NeedRemount until it
    /// remounts.
    must_remount: AtomicBool,
    /// For a client that mounts with MountSlices (an incarnation per group's slice), the
    /// segments of its last one: a served group that lacks one makes its pings answer
    /// NeedRemount (see `lacks_segments_of`).
    sliced: Mutex<Option<Vec<SegmentId>>>,
}

/// Ranges waiting to be freed because an old writer may still be writing into them (a write
/// pre-empted or dropped without its writer's word). Readers never hold ranges back: they
/// check generations instead.
struct Deferred {
    release_at: u64,
    replicas: Vec<Replica>,
}

/// A range of an unfinished write on a segment that went away: offset, bytes, release time.
type OrphanedRange = (u64, u64, u64);

/// Ranges of a force-removed object that readers may still reach through a reused replica list,
/// until the end of its lease (master clock, ms).
struct Tombstone {
    until: u64,
    ranges: Vec<ReplicaDesc>,
}

/// One key after its route was checked.
struct Routed {
    key: ObjectKey,
    group: u32,
    shard: usize,
}

/// The metadata service of one master.
pub struct Master {
    cfg: MasterConfig,
    clock: Arc<dyn Clock>,
    /// Unix milliseconds at master clock 0 (record times are Unix times).
    unix_offset: u64,
    instance: u64,
    /// The group containers, by rank; `None` for a group this master does not hold.
    groups: Box<[Option<Group>]>,
    clients: RwLock<HashMap<ClientId, Arc<ClientEntry>>>,
    deferred: Mutex<Vec<Deferred>>,
    /// Ranges of unfinished writes on segments that went away (their client expired): if the
    /// owner mounts the segment again, they stay reserved until their writers' release timeout,
    /// as the writers may still be copying into the same memory. (segment -> offset, bytes,
    /// release time.)
    orphaned: Mutex<HashMap<SegmentId, Vec<OrphanedRange>>>,
    /// Held while clients' segments are mounted in, or dropped from, the groups this master
    /// serves: a MountSlices' check of what each group holds and its mounts see no expiry or
    /// unmount between them.
    mounting: Mutex<()>,
    last_abandon_scan: AtomicU64,
    /// When the tasks were last checked for timeouts (clock ms).
    last_task_scan: AtomicU64,
    evictor: Evictor,
    /// When the RPC runtime last showed that it runs ([`Master::note_responsive`]); 0 while
    /// nothing watches it.
    rpc_alive: AtomicU64,
    /// When housekeeping last found the master stalled: clients get a full TTL from then on to
    /// ping again, since their pings may have waited behind the stall.
    stalled_at: AtomicU64,
    /// How many of its groups have a record sink (none: nothing is logged, no record is built).
    sinks: std::sync::atomic::AtomicUsize,
    /// Who serves each group, as the cluster's records last said (`None`: a master alone).
    routes: RwLock<Option<Arc<tycho_proto::RouteTable>>>,
    /// The directory of the snapshots this master holds, which it serves to its peers.
    snapshot_files: std::sync::OnceLock<Arc<crate::log::snapshot::DirSnapshotStore>>,
    /// The address this master advertises to its cluster (set once it registers).
    advertised: std::sync::OnceLock<String>,
    /// Where stable segments' descriptors go (set by a master of a cluster).
    segment_directory: std::sync::OnceLock<Arc<dyn SegmentDirectory>>,
    /// The cluster's published VSegment quota, once this master has read it.
    quota: std::sync::OnceLock<Arc<tycho_proto::quota::PartitionQuota>>,
    /// Held while the quota is taken, a group taken over, or a segment mounted in a served
    /// group: each then sees what the others did, so no served slice misses its fences.
    fencing: Mutex<()>,
    /// How many of its groups this master serves.
    serving_groups: std::sync::atomic::AtomicUsize,
    /// Background-work counters.
    pub counters: Counters,
    /// How often each key is read (soft state, for hot-replica fan-out).
    heat: crate::state::heat::Heat,
    /// Keys that turned hot, waiting for admission.
    hot_keys: Mutex<std::collections::VecDeque<ObjectKey>>,
    /// What hot-replica fan-out did.
    pub fanout: FanoutCounters,
}

impl Master {
    /// A master owning every KVPT group of a `cfg.group_count`-group cluster.
    pub fn new(cfg: MasterConfig, clock: Arc<dyn Clock>) -> Master {
        let count = cfg.group_count.max(1);
        let heat = crate::state::heat::Heat::new(cfg.fanout.heat, SHARD_COUNT);
        let groups = (0..count)
            .map(|rank| {
                let table = SegmentTable::with_secret(cfg.secret.clone(), clock.clone(), (rank, count));
                Some(Group::new(rank, cfg.group_epoch, crate::state::object::shards_per_group(count), table))
            })
            .collect();
        Master {
            groups,
            cfg,
            unix_offset: clock.unix_offset_ms(),
            clock,
            instance: rand::random(),
            clients: RwLock::new(HashMap::new()),
            deferred: Mutex::new(Vec::new()),
            orphaned: Mutex::new(HashMap::new()),
            mounting: Mutex::new(()),
            last_abandon_scan: AtomicU64::new(0),
            last_task_scan: AtomicU64::new(0),
            evictor: Evictor::default(),
            rpc_alive: AtomicU64::new(0),
            stalled_at: AtomicU64::new(0),
            sinks: std::sync::atomic::AtomicUsize::new(0),
            routes: RwLock::new(None),
            snapshot_files: std::sync::OnceLock::new(),
            advertised: std::sync::OnceLock::new(),
            segment_directory: std::sync::OnceLock::new(),
            quota: std::sync::OnceLock::new(),
            fencing: Mutex::new(()),
            serving_groups: std::sync::atomic::AtomicUsize::new(count as usize),
            counters: Counters::default(),
            heat,
            hot_keys: Mutex::new(std::collections::VecDeque::new()),
            fanout: FanoutCounters::default(),
        }
    }

    /// An empty master with this one's settings and clock (one a primary fills from a snapshot
    /// and the log to snapshot it, off the state it serves).
    pub fn scratch(&self) -> Master {
        Master::new(self.cfg.clone(), self.clock.clone())
    }

    /// The settings in force.
    pub fn config(&self) -> &MasterConfig {
        &self.cfg
    }

    /// The group containers this master holds, by rank.
    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.iter().flatten()
    }

    /// The container of group `rank`, if this master holds it.
    pub fn group(&self, rank: u32) -> Option<&Group> {
        self.groups.get(rank as usize).and_then(Option::as_ref)
    }

    /// The container holding the storage key `key`, if this master holds its group.
    fn group_of_key(&self, key: &[u8]) -> Option<&Group> {
        self.group(kvpt_to_rank(partition_of_encoded(key), self.cfg.group_count.max(1)))
    }

    /// The container of a routed key (routing checked that this master holds it).
    fn routed(&self, r: &Routed) -> &Group {
        self.group(r.group).expect("routing admits only keys of groups this master holds")
    }

    /// The group containers this master serves (their primary or caretaker), by rank.
    pub fn serving(&self) -> impl Iterator<Item = &Group> {
        self.groups().filter(|g| g.is_serving())
    }

    /// Every metadata shard of every group served with its index across groups
    /// (`rank * SHARD_COUNT + shard`: a group has at most `SHARD_COUNT` shards), group by group.
    fn indexed_shards(&self) -> impl Iterator<Item = (usize, &RwLock<ShardMap>)> {
        self.serving()
            .flat_map(|g| g.shards.iter().enumerate().map(move |(i, s)| (g.rank() as usize * SHARD_COUNT + i, s)))
    }

    /// Every metadata shard of every group served, group by group: what housekeeping, scans
    /// and health checks visit (a group only replayed here changes only through its log).
    pub fn all_shards(&self) -> impl Iterator<Item = &RwLock<ShardMap>> {
        self.serving().flat_map(|g| g.shards.iter())
    }

    /// The segment `id` as the first group served that has it mounted.
    fn mounted(&self, id: SegmentId) -> Option<Arc<crate::state::segment::MountedSegment>> {
        self.serving().find_map(|g| g.segments.get(id))
    }

    /// Slice capacity and used bytes over the groups held (served, or replayed as a standby):
    /// what the figures report.
    pub fn usage(&self) -> (u64, u64) {
        Self::sum_usage(self.groups())
    }

    fn sum_usage<'a>(groups: impl Iterator<Item = &'a Group>) -> (u64, u64) {
        groups.map(|g| g.segments.usage()).fold((0, 0), |(t, u), (a, b)| (t + a, u + b))
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// What a descriptor of `key`'s replicas grants for `ttl_ms` from now. Expiries are wall
    /// clock: the segment holder checks them by its own clock.
    fn grant(&self, rights: u8, ttl_ms: u64, key: &[u8]) -> Grant {
        if self.cfg.secret.is_none() {
            return Grant::default();
        }
        self.grant_until(rights, self.clock.unix_now_ms().saturating_add(ttl_ms), key)
    }

    /// When a write grant handed out now expires (Unix ms): read once per call, batch or not.
    fn write_grant_expiry(&self) -> u64 {
        match self.cfg.secret {
            Some(_) => self.clock.unix_now_ms().saturating_add(self.cfg.put_start_discard_timeout_ms),
            None => 0,
        }
    }

    /// [`Master::grant`] with its expiry given.
    fn grant_until(&self, rights: u8, expires_ms: u64, key: &[u8]) -> Grant {
        if self.cfg.secret.is_none() {
            return Grant::default();
        }
        let group = kvpt_to_rank(partition_of_encoded(key), self.cfg.group_count.max(1));
        self.grant_in(rights, expires_ms, group, tenant_of(key))
    }

    /// [`Master::grant_until`] for a key already routed to `group`, of the tenant tagged
    /// `tenant`.
    fn grant_in(&self, rights: u8, expires_ms: u64, group: u32, tenant: u64) -> Grant {
        if self.cfg.secret.is_none() {
            return Grant::default();
        }
        Grant { rights, expires_ms, epoch: self.group(group).map_or(0, Group::epoch), group: group as u16, tenant }
    }

    // ---- routing -------------------------------------------------------------------------

    fn route(&self, tenant: &str, k: &KeyRef) -> WireResult<Routed> {
        validate_key(tenant, &k.key)?;
        let key = encode_object_key(tenant, &k.key);
        let pid = partition_of_encoded(&key);
        // The partition is a pure function of the key: a mismatch means the client hashed
        // differently (another tenant, a stale library); it must recompute its route.
        if pid != k.route.partition_id {
            return Err(ErrorCode::STALE_ROUTE);
        }
        let rank = kvpt_to_rank(pid, self.cfg.group_count.max(1));
        let Some(group) = self.group(rank).filter(|g| g.is_serving()) else { return Err(self.refusal(rank)) };
        // Epoch fence: an older epoch is a stale route; a newer one means the client has
        // seen an owner change this master has not, so it must not serve the key.
        let epoch = group.epoch();
        if k.route.epoch < epoch {
            return Err(ErrorCode::STALE_EPOCH);
        }
        if k.route.epoch > epoch {
            return Err(ErrorCode::KVPT_NOT_OWNED);
        }
        Ok(Routed { key: key.into_boxed_slice(), group: rank, shard: group.shards.index_of(pid) })
    }

    /// Routes every key; keys that fail carry their error. Returns the routed keys in an order
    /// that groups them by shard, so that batch calls lock each shard once.
    fn route_batch<'a, I>(&self, tenant: &str, keys: I) -> (Vec<Option<ErrorCode>>, Vec<(usize, Routed)>)
    where
        I: Iterator<Item = &'a KeyRef>,
    {
        let mut errors = Vec::new();
        let mut routed = Vec::new();
        for (i, k) in keys.enumerate() {
            match self.route(tenant, k) {
                Ok(r) => {
                    errors.push(None);
                    routed.push((i, r));
                }
                Err(e) => errors.push(Some(e)),
            }
        }
        routed.sort_unstable_by_key(|(i, r)| (r.group, r.shard, *i));
        (errors, routed)
    }

    // ---- clients and segments ------------------------------------------------------------

    /// Heartbeat. Touches only the client table.
    pub fn ping(&self, client: ClientId) -> PingReply {
        let status = match self.clients.read().get(&client) {
            Some(c) => {
                c.last_ping.store(self.now(), Ordering::Relaxed);
                if c.must_remount.load(Ordering::Relaxed) || self.lacks_segments_of(c) {
                    ClientStatus::NeedRemount
                } else {
                    ClientStatus::Ok
                }
            }
            None => ClientStatus::NeedRemount,
        };
        PingReply { status, master_instance: self.instance }
    }

    /// Whether a group this master serves lacks a segment of the client's last MountSlices (the
    /// group came from a master that had dropped it): the client mounts its segments again,
    /// and MountSlices fills the gap. Only for clients that mount with MountSlices, so that
    /// the remount costs no other group.
    fn lacks_segments_of(&self, c: &ClientEntry) -> bool {
        let sliced = c.sliced.lock();
        let Some(segments) = sliced.as_ref() else { return false };
        segments.iter().any(|&id| self.serving().any(|g| g.segments.get(id).is_none()))
    }

    fn register_client(&self, client: ClientId) -> Arc<ClientEntry> {
        let now = self.now();
        if let Some(c) = self.clients.read().get(&client) {
            c.last_ping.store(now, Ordering::Relaxed);
            return c.clone();
        }
        self.clients
            .write()
            .entry(client)
            .or_insert_with(|| {
                Arc::new(ClientEntry {
                    last_ping: AtomicU64::new(now),
                    host: Mutex::new(None),
                    segments: Mutex::new(Vec::new()),
                    pending: Arc::new(AtomicU64::new(0)),
                    must_remount: AtomicBool::new(false),
                    sliced: Mutex::new(None),
                })
            })
            .clone()
    }

    /// Mounts a segment for `client` (idempotent) in every group this master serves, and
    /// registers the client.
    pub fn mount_segment(&self, client: ClientId, desc: SegmentDesc) -> WireResult<()> {
        let _mounting = self.mounting.lock();
        let incarnation = desc.incarnation;
        let serving: Vec<&Group> = self.serving().collect();
        self.mount_in_each(client, desc, &serving, |_| incarnation)
    }

    /// Mounts `client`'s segments with an incarnation per group's slice (MountSlices) in every
    /// group this master serves, and registers the client; the groups mounted in. A group that
    /// does not hold a segment under its slice's incarnation, or an earlier one, takes only a
    /// fresh incarnation: one that held it and dropped it (an expiry, an admin's unmount) may
    /// still have readers of its ranges, and a range of the same incarnation handed out again
    /// could pass their check. Those groups come back as `Err(stale)` and nothing is mounted.
    pub fn mount_slices(
        &self,
        client: ClientId,
        segments: Vec<SlicedSegment>,
    ) -> WireResult<Result<Vec<u32>, Vec<u32>>> {
        let groups = self.cfg.group_count.max(1) as usize;
        if segments.iter().any(|s| s.slices.len() != groups) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        // The check and the mounts see one set of groups, and no expiry or unmount between
        // them: a group that passed the check still holds what it was checked for.
        let _mounting = self.mounting.lock();
        let serving: Vec<&Group> = self.serving().collect();
        let mut stale: Vec<u32> = Vec::new();
        for s in &segments {
            let held = |rank: u32| {
                let group = serving.iter().find(|g| g.rank() == rank)?;
                group.segments.get(s.desc.id).filter(|h| h.client == client).map(|h| h.desc.incarnation)
            };
            stale.extend(tycho_proto::stale_slices(serving.iter().map(|g| g.rank()), held, &s.slices));
        }
        if !stale.is_empty() {
            stale.sort_unstable();
            stale.dedup();
            return Ok(Err(stale));
        }
        let entry = self.register_client(client);
        entry.must_remount.store(false, Ordering::Relaxed);
        let ids: Vec<SegmentId> = segments.iter().map(|s| s.desc.id).collect();
        for s in segments {
            let slices = s.slices;
            self.mount_in_each(client, s.desc, &serving, |rank| slices[rank as usize].incarnation)?;
        }
        *entry.sliced.lock() = Some(ids);
        Ok(Ok(serving.iter().map(|g| g.rank()).collect()))
    }

    /// Mounts `desc` in each of `groups` (those this master serves), under `incarnation(rank)`
    /// in each. The caller holds `mounting`.
    fn mount_in_each(
        &self,
        client: ClientId,
        desc: SegmentDesc,
        groups: &[&Group],
        incarnation: impl Fn(u32) -> u32,
    ) -> WireResult<()> {
        let (id, host) = (desc.id, desc.host.clone());
        // Caps first, so that a refused mount changes nothing: a huge segment would inflate the
        // capacity eviction is measured against; many segments, the master's tables.
        if desc.size > self.cfg.max_segment_size {
            return Err(ErrorCode::RESOURCE_LIMIT);
        }
        let already =
            self.clients.read().get(&client).map_or(0, |c| c.segments.lock().iter().filter(|s| **s != id).count());
        if already >= self.cfg.max_segments_per_client {
            return Err(ErrorCode::RESOURCE_LIMIT);
        }
        // Every group's table holds the same segments (natively mounted ones, at least), so a
        // mount one refuses (another client's id, overlapping memory) the first refuses.
        for group in groups {
            let desc = SegmentDesc { incarnation: incarnation(group.rank()), ..desc.clone() };
            self.mount_in(group, client, &desc)?;
        }
        self.register_client(client).host.lock().get_or_insert(host);
        Ok(())
    }

    /// [`Master::mount_segment`] in one group.
    fn mount_in(&self, group: &Group, client: ClientId, desc: &SegmentDesc) -> WireResult<()> {
        let id = desc.id;
        let table = &group.segments;
        // A newer incarnation of a segment this client has mounted replaces it. The old one is
        // taken down and swept first, and so is any earlier incarnation the expiry sweep has not
        // reached yet: their unfinished writes must be known (as orphaned ranges) before
        // anything is allocated in the new incarnation.
        if let Some(old) = table.get(id) {
            if old.client == client && old.desc.incarnation < desc.incarnation {
                self.log_to(group, || Record::Unmount { segment: id });
                self.apply_unmount(group, id);
            }
        }
        if table.was_unmounted(id) {
            self.sweep_dead_segments_of(group);
        }
        let now = self.now();
        // Ranges that writers of an earlier incarnation may still be copying into stay taken:
        // those in this group's slice.
        let slice = crate::state::segment::slice_of(desc.size, group.rank(), self.cfg.group_count.max(1));
        let carried: Vec<(u64, u64, u64)> = {
            let mut orphaned = self.orphaned.lock();
            let mut list = Vec::new();
            if let Some(all) = orphaned.get_mut(&id) {
                let (mine, rest): (Vec<_>, Vec<_>) =
                    all.drain(..).partition(|&(o, l, _)| o >= slice.start && o + l <= slice.end);
                list = mine;
                *all = rest;
                if all.is_empty() {
                    orphaned.remove(&id);
                }
            }
            for d in self.deferred.lock().iter() {
                for r in d.replicas.iter().filter(|r| r.seg.desc.id == id && !r.seg.is_alive()) {
                    if r.seg.rank() == group.rank() {
                        list.push((r.alloc.offset, r.alloc.reserved, d.release_at));
                    }
                }
            }
            list.retain(|&(_, _, until)| until > now);
            list
        };
        let logged = desc.clone();
        let accepted = || {
            let reserved = carried.iter().map(|&(o, l, until)| (o, l, self.unix_time(until))).collect();
            self.log_to(group, || Record::Mount { client, desc: logged, reserved })
        };
        // On the group's primary, the VSegment quota's extents are set aside as the segment
        // mounts, before a replica can be placed there (under the fence lock, so that a quota
        // or a take-over at the same moment sees this mount or is seen by it).
        let _fencing = self.fencing.lock();
        let fences = if group.is_serving() { self.quota_ranges(id) } else { Vec::new() };
        if self.apply_mount(group, client, desc.clone(), &carried, &fences, now, accepted)? {
            self.sweep_dead_segments_of(group);
        }
        Ok(())
    }

    /// Registers `client` and mounts all its segments; used after NEED_REMOUNT. An empty list
    /// registers a client that contributes no memory.
    pub fn remount_segments(&self, client: ClientId, descs: Vec<SegmentDesc>) -> WireResult<()> {
        self.register_client(client).must_remount.store(false, Ordering::Relaxed);
        for d in descs {
            self.mount_segment(client, d)?;
        }
        Ok(())
    }

    /// The cluster secret capabilities are minted under, if any.
    pub fn secret(&self) -> Option<&Arc<tycho_proto::auth::Secret>> {
        self.cfg.secret.as_ref()
    }

    /// Register: a fresh client id of `tenant` and its credential (zero without a secret).
    /// Nothing is stored: any master of the cluster checks the credential from the secret.
    pub fn register(&self, tenant: &str) -> WireResult<(ClientId, [u8; 32])> {
        if tenant.len() > MAX_TENANT_LEN {
            return Err(ErrorCode::INVALID_KEY);
        }
        let mut raw = [0u8; 16];
        tycho_proto::auth::random_bytes(&mut raw).map_err(|_| ErrorCode::INTERNAL_ERROR)?;
        let id = u128::from_le_bytes(raw).max(1);
        let credential =
            self.cfg.secret.as_ref().map_or([0; 32], |s| tycho_proto::auth::handshake::credential(s, id, tenant));
        Ok((ClientId(id), credential))
    }

    /// An admin's unmount of any client's segment: its replicas are dropped, and its owner's
    /// pings are answered NeedRemount until it mounts its segments again under a new
    /// incarnation. Unmounting an unknown segment succeeds.
    pub fn admin_unmount(&self, id: SegmentId) -> WireResult<()> {
        let Some(seg) = self.mounted(id) else { return Ok(()) };
        let owner = seg.client;
        self.unmount_segment(owner, id)?;
        if let Some(c) = self.clients.read().get(&owner) {
            c.must_remount.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Unmounts a segment and drops its replicas; unmounting an unknown segment succeeds.
    /// Runs the sweep before returning: call from a thread that may block.
    pub fn unmount_segment(&self, client: ClientId, id: SegmentId) -> WireResult<()> {
        let _mounting = self.mounting.lock();
        if let Some(c) = self.clients.read().get(&client) {
            if let Some(list) = c.sliced.lock().as_mut() {
                list.retain(|s| *s != id);
            }
        }
        match self.mounted(id) {
            None => return Ok(()),
            Some(seg) if seg.client != client => return Err(ErrorCode::ILLEGAL_CLIENT),
            Some(_) => {}
        }
        for group in self.serving() {
            if group.segments.get(id).is_some() {
                self.log_to(group, || Record::Unmount { segment: id });
                self.apply_unmount(group, id);
                self.sweep_dead_segments_of(group);
            }
        }
        Ok(())
    }

    /// The writer's host and its count of unfinished writes.
    fn writer(&self, client: ClientId) -> WireResult<(Option<String>, Arc<AtomicU64>)> {
        let clients = self.clients.read();
        let c = clients.get(&client).ok_or(ErrorCode::CLIENT_NOT_FOUND)?;
        let host = c.host.lock().clone();
        Ok((host, c.pending.clone()))
    }

    /// Whether `client` may start `more` writes now.
    fn pending_room(&self, pending: &AtomicU64, more: u64) -> WireResult<()> {
        if pending.load(Ordering::Relaxed) + more > self.cfg.max_pending_writes_per_client {
            return Err(ErrorCode::TOO_MANY_PENDING_WRITES);
        }
        Ok(())
    }

    // ---- writes --------------------------------------------------------------------------

    fn pins_of(&self, cfg: &ReplicateConfig) -> WireResult<Pins> {
        let soft_pin_ttl_ms = match (cfg.soft_pin_action, cfg.soft_pin_ttl_ms) {
            (SoftPinAction::Enable, None) => Some(self.cfg.default_kv_soft_pin_ttl_ms),
            (SoftPinAction::Enable, Some(ttl)) if ttl == 0 || ttl > self.cfg.max_kv_soft_pin_ttl_ms => {
                return Err(ErrorCode::INVALID_PARAMS)
            }
            (SoftPinAction::Enable, Some(ttl)) => Some(ttl),
            // A TTL only makes sense when the write enables the pin.
            (_, Some(_)) => return Err(ErrorCode::INVALID_PARAMS),
            (_, None) => None,
        };
        if cfg.replica_num == 0 || cfg.replica_num > MAX_REPLICA_NUM {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        // Placement compares every preferred name with the group's segments, per key: more
        // names than a value can have replicas are refused before any is looked at.
        if cfg.preferred_segments.len() > MAX_REPLICA_NUM as usize {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        Ok(Pins {
            soft_pin_ttl_ms,
            preserve_soft_pin: cfg.soft_pin_action == SoftPinAction::Preserve,
            hard_pin: cfg.hard_pin,
        })
    }

    fn placement<'a>(&self, cfg: &'a ReplicateConfig, host: Option<&'a str>, tenant: &str) -> Placement<'a> {
        let mut strategy = cfg.strategy.unwrap_or(self.cfg.default_strategy);
        if cfg.prefer_alloc_in_same_node {
            strategy = AllocStrategy::LocalFirst;
        }
        Placement {
            replicas: cfg.replica_num,
            strategy,
            preferred: &cfg.preferred_segments,
            local_host: host,
            tenant: tenant_tag(tenant),
            unix_ms: if self.cfg.secret.is_some() { self.clock.unix_now_ms() } else { 0 },
        }
    }

    /// Allocates replicas. If nothing fits and `may_wait` is set, asks for an eviction round
    /// of at least the bytes needed, waits (bounded) for it, and retries once; `may_wait` is
    /// then cleared, so that a batch waits at most once.
    fn allocate(&self, size: u64, group: u32, p: &Placement<'_>, may_wait: &mut bool) -> WireResult<Vec<Replica>> {
        let table = &self.group(group).ok_or(ErrorCode::KVPT_NOT_OWNED)?.segments;
        // A value no segment's slice could ever hold is refused outright: evicting would not
        // help.
        if !table.live().iter().any(|s| s.room() >= size) {
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        match table.place(size, p) {
            Err(ErrorCode::NO_AVAILABLE_HANDLE) if *may_wait => {
                *may_wait = false;
                let need = RoundRequest {
                    bytes: size.saturating_mul(p.replicas as u64),
                    watermark: false,
                    group: Some(group),
                };
                if self.evictor.request_and_wait(need, EVICTION_WAIT, |r| self.evict_round(r).1) {
                    table.place(size, p)
                } else {
                    Err(ErrorCode::NO_AVAILABLE_HANDLE)
                }
            }
            r => r,
        }
    }

    /// Whether a put of `key` is moot: the key holds a value, or another write of it is in
    /// progress and too young to pre-empt. Mooncake answers both with OBJECT_ALREADY_EXISTS,
    /// which `put` reports as success.
    fn is_put_conflict(&self, map: &ShardMap, key: &ObjectKey, now: u64) -> bool {
        map.get(key).is_some_and(|o| o.is_complete() || o.pending.as_ref().is_some_and(|p| !self.is_stale(p, now)))
    }

    /// Whether an unfinished write is old enough for another writer to pre-empt it.
    fn is_stale(&self, p: &PendingWrite, now: u64) -> bool {
        now >= p.started_ms + self.cfg.put_start_discard_timeout_ms
    }

    /// Records a new write of `key` in `map`. On error the caller still owns `replicas`.
    #[allow(clippy::too_many_arguments)]
    fn install_write(
        &self,
        map: &mut ShardMap,
        key: ObjectKey,
        mode: WriteMode,
        writer: ClientId,
        write_id: u64,
        size: u64,
        pins: Pins,
        replicas: Vec<Replica>,
        now: u64,
        pending_count: &Arc<AtomicU64>,
    ) -> Result<(), (ErrorCode, Vec<Replica>)> {
        // A segment may have died since allocation; the check is under the shard lock, which
        // the sweep also takes after marking segments dead, so nothing dead slips in.
        if replicas.iter().any(|r| !r.seg.is_alive()) {
            return Err((ErrorCode::NO_AVAILABLE_HANDLE, replicas));
        }
        if let Some(obj) = map.get(&key) {
            if mode == WriteMode::Put && obj.is_complete() {
                return Err((ErrorCode::OBJECT_ALREADY_EXISTS, replicas));
            }
            if let Some(old) = &obj.pending {
                if old.writer == writer && old.write_id == write_id {
                    // A retried start that raced its first attempt: that one stands.
                    return Err((ErrorCode::INVALID_WRITE, replicas));
                }
                if !self.is_stale(old, now) {
                    // A put loses to the write in progress as Mooncake's does; an upsert is
                    // told to come back once it (or a task's copy) has finished.
                    let code = if mode == WriteMode::Put {
                        ErrorCode::OBJECT_ALREADY_EXISTS
                    } else if old.copy.is_some() {
                        ErrorCode::OBJECT_HAS_REPLICATION_TASK
                    } else {
                        ErrorCode::REPLICA_IS_NOT_READY
                    };
                    return Err((code, replicas));
                }
                // Pre-empt the stale write. Its writer may still be copying into its ranges,
                // so they stay reserved until the release timeout.
                let (old_writer, old_id) = (old.writer, old.write_id);
                let release_at = old.started_ms + self.cfg.put_start_release_timeout_ms;
                self.log(|| Record::WriteDrop {
                    key: key.to_vec(),
                    writer: old_writer,
                    write_id: old_id,
                    release_at_ms: self.unix_time(release_at),
                });
                self.apply_write_cancel(map, &key, Some(release_at), now);
                self.counters.writes_discarded.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.log(|| Record::WriteStart {
            key: key.to_vec(),
            upsert: mode == WriteMode::Upsert,
            writer,
            write_id,
            started_ms: self.unix_time(now),
            size,
            pins: pins.into(),
            replicas: replicas.iter().map(apply::range_rec).collect(),
        });
        self.apply_write_start(map, key, writer, write_id, now, size, pins, replicas, pending_count);
        Ok(())
    }

    /// PutStart / UpsertStart; a start that finds no room waits for one eviction round.
    pub fn write_start(&self, mode: WriteMode, req: &WriteStart) -> WireResult<Vec<ReplicaDesc>> {
        self.write_start_with(mode, req, true)
    }

    /// [`Master::write_start`]; with `may_wait` false a start that finds no room fails at once
    /// (an RPC worker calls it so, and retries on a blocking thread).
    pub fn write_start_with(&self, mode: WriteMode, req: &WriteStart, may_wait: bool) -> WireResult<Vec<ReplicaDesc>> {
        let r = self.route(&req.tenant, &req.key)?;
        if req.size == 0 || req.write_id == 0 {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let pins = self.pins_of(&req.config)?;
        let (host, pending) = self.writer(req.client)?;
        let shard = self.routed(&r).shards.shard(r.shard);
        {
            let map = shard.read();
            let grant = || self.grant(RIGHT_WRITE, self.cfg.put_start_discard_timeout_ms, &r.key);
            if let Some(descs) = retried_start(&map, &r.key, req.client, req.write_id, grant) {
                // Answered once its start is durable, as the first answer would have been.
                self.await_logged(&r.key);
                return Ok(descs);
            }
            self.admit_write(&r)?;
            if mode == WriteMode::Put && self.is_put_conflict(&map, &r.key, self.now()) {
                return Err(ErrorCode::OBJECT_ALREADY_EXISTS);
            }
        }
        self.pending_room(&pending, 1)?;
        let mut may_wait = may_wait;
        let replicas = self.allocate(
            req.size,
            r.group,
            &self.placement(&req.config, host.as_deref(), &req.tenant),
            &mut may_wait,
        )?;
        let grant = self.grant(RIGHT_WRITE, self.cfg.put_start_discard_timeout_ms, &r.key);
        let descs: Vec<ReplicaDesc> = replicas.iter().map(|x| x.desc(req.size, &grant)).collect();
        let now = self.now();
        let res = self.install_write(
            &mut shard.write(),
            r.key,
            mode,
            req.client,
            req.write_id,
            req.size,
            pins,
            replicas,
            now,
            &pending,
        );
        match res {
            Ok(()) => Ok(descs),
            Err((code, replicas)) => {
                replicas.into_iter().for_each(Replica::release);
                Err(code)
            }
        }
    }

    /// BatchPutStart / BatchUpsertStart: one result per item, each shard locked once for the
    /// existence check and once for the install. Waits for at most one eviction round.
    pub fn batch_write_start(&self, mode: WriteMode, req: &BatchWriteStart) -> Vec<WireResult<Vec<ReplicaDesc>>> {
        self.batch_write_start_with(mode, req, true)
    }

    /// [`Master::batch_write_start`], waiting for eviction only if `may_wait`. Repeating a
    /// batch is safe: items already started under the same write ids get their ranges back.
    pub fn batch_write_start_with(
        &self,
        mode: WriteMode,
        req: &BatchWriteStart,
        may_wait: bool,
    ) -> Vec<WireResult<Vec<ReplicaDesc>>> {
        let mut may_wait = may_wait;
        let n = req.items.len();
        let fail_all = |e| vec![Err(e); n];
        if req.write_ids.len() != n || req.write_ids.contains(&0) {
            return fail_all(ErrorCode::INVALID_PARAMS);
        }
        let pins = match self.pins_of(&req.config) {
            Ok(p) => p,
            Err(e) => return fail_all(e),
        };
        let (host, pending) = match self.writer(req.client) {
            Ok(h) => h,
            Err(e) => return fail_all(e),
        };
        let mut room = self.cfg.max_pending_writes_per_client.saturating_sub(pending.load(Ordering::Relaxed));
        let (errors, routed) = self.route_batch(&req.tenant, req.items.iter().map(|(k, _)| k));
        let mut out: Vec<WireResult<Vec<ReplicaDesc>>> =
            errors.into_iter().map(|e| e.map_or(Ok(Vec::new()), Err)).collect();
        let placement = self.placement(&req.config, host.as_deref(), &req.tenant);
        let expires = self.write_grant_expiry();
        // Allocate for every key that is not already complete (for puts).
        let mut staged: Vec<(usize, Routed, Vec<Replica>)> = Vec::with_capacity(routed.len());
        for run in group_by_shard(routed) {
            let (conflicts, retried): (Vec<bool>, Vec<Option<Vec<ReplicaDesc>>>) = {
                let map = self.routed(&run[0].1).shards.shard(run[0].1.shard).read();
                let now = self.now();
                run.iter()
                    .map(|(i, r)| {
                        let grant = || self.grant_in(RIGHT_WRITE, expires, r.group, placement.tenant);
                        let retried = retried_start(&map, &r.key, req.client, req.write_ids[*i], grant);
                        (mode == WriteMode::Put && self.is_put_conflict(&map, &r.key, now), retried)
                    })
                    .unzip()
            };
            for (((i, r), conflict), retried) in run.into_iter().zip(conflicts).zip(retried) {
                let size = req.items[i].1;
                // Parameters first, as in the single-key form.
                if size == 0 {
                    out[i] = Err(ErrorCode::INVALID_PARAMS);
                } else if let Some(descs) = retried {
                    self.await_logged(&r.key);
                    out[i] = Ok(descs);
                } else if let Err(e) = self.admit_write(&r) {
                    out[i] = Err(e);
                } else if conflict {
                    out[i] = Err(ErrorCode::OBJECT_ALREADY_EXISTS);
                } else if room == 0 {
                    out[i] = Err(ErrorCode::TOO_MANY_PENDING_WRITES);
                } else {
                    room -= 1;
                    match self.allocate(size, r.group, &placement, &mut may_wait) {
                        Ok(reps) => staged.push((i, r, reps)),
                        Err(e) => out[i] = Err(e),
                    }
                }
            }
        }
        let now = self.now();
        let mut staged = staged.into_iter().peekable();
        while let Some(first) = staged.next() {
            let (group, shard) = (first.1.group, first.1.shard);
            let mut map = self.routed(&first.1).shards.shard(shard).write();
            let mut next = Some(first);
            while let Some((i, r, reps)) = next.take() {
                let size = req.items[i].1;
                let grant = self.grant_in(RIGHT_WRITE, expires, r.group, placement.tenant);
                let descs: Vec<ReplicaDesc> = reps.iter().map(|x| x.desc(size, &grant)).collect();
                let id = req.write_ids[i];
                match self.install_write(&mut map, r.key, mode, req.client, id, size, pins, reps, now, &pending) {
                    Ok(()) => out[i] = Ok(descs),
                    Err((code, reps)) => {
                        reps.into_iter().for_each(Replica::release);
                        out[i] = Err(code);
                    }
                }
                if staged.peek().is_some_and(|n| n.1.group == group && n.1.shard == shard) {
                    next = staged.next();
                }
            }
        }
        out
    }

    /// Commits the write `(client, write_id)` of `key`. Anything else in its place (no object,
    /// another write pending, a value another write committed) means this write was dropped.
    /// Returns the replaced value's ranges (on live segments), for the writer to retire.
    fn commit(
        &self,
        map: &mut ShardMap,
        key: &ObjectKey,
        client: ClientId,
        write_id: u64,
        now: u64,
        used: u64,
    ) -> WireResult<Vec<ReplicaDesc>> {
        let obj = map.get(key).ok_or(ErrorCode::WRITE_DROPPED)?;
        let ours =
            obj.pending.as_ref().is_some_and(|p| p.writer == client && p.write_id == write_id && p.copy.is_none());
        if !ours {
            // A retried end of a write that already committed is harmless.
            // It gets the same ranges to retire: its first answer may have been lost.
            // It is answered once the commit is durable, as the first answer would have been.
            let done = obj.is_complete() && obj.writer == client && obj.version == write_id;
            if !done {
                return Err(ErrorCode::WRITE_DROPPED);
            }
            self.await_logged(key);
            return Ok(obj.replaced.clone());
        }
        // The commit's outcome depends on which of its segments are alive now: the record
        // carries that decision, so that a replay reaches the same one.
        let dropped = Self::dead_segments_of_pending(map, key);
        self.log(|| Record::WriteEnd {
            key: key.to_vec(),
            writer: client,
            write_id,
            at_ms: self.unix_time(now),
            dropped: dropped.clone(),
        });
        let (old, old_size) = self.apply_write_end(map, key, now, &dropped, used)?;
        // Readers still copying the old value find its generations changed once the space is
        // reused (or retired by the writer), and read again: the old value's space is free at
        // once.
        // A retire grant moves no bytes: it may outlive the range's next allocation.
        let grant = if old.is_empty() {
            Grant::default()
        } else {
            self.grant(RIGHT_RETIRE, self.cfg.put_start_discard_timeout_ms, key)
        };
        let mut replaced: Vec<ReplicaDesc> =
            old.iter().filter(|r| r.seg.is_alive()).map(|r| r.seg.replica_desc(&r.alloc, old_size, &grant)).collect();
        old.into_iter().for_each(Replica::release);
        if let Some(t) = self.group_of_key(key).and_then(|g| g.tombstones_of(key).lock().remove(key)) {
            if t.until > now {
                replaced.extend(t.ranges);
            }
        }
        if let Some(obj) = map.get_mut(key) {
            obj.replaced.clone_from(&replaced);
        }
        Ok(replaced)
    }

    /// Revokes the write `(client, write_id)` of `key`; a write that is not pending (never
    /// started, or dropped already) answers WRITE_DROPPED and changes nothing.
    fn revoke(&self, map: &mut ShardMap, key: &ObjectKey, client: ClientId, write_id: u64) -> WireResult<()> {
        let obj = map.get(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        match &obj.pending {
            // (A task's copy is given up by CopyRevoke, which ends its task too.)
            Some(p) if p.writer == client && p.write_id == write_id && p.copy.is_none() => {}
            _ if obj.writer == client && obj.version == write_id => return Err(ErrorCode::INVALID_WRITE),
            _ => return Err(ErrorCode::WRITE_DROPPED),
        }
        // The writer says it stopped writing: its ranges are free at once.
        self.log(|| Record::WriteRevoke { key: key.to_vec(), writer: client, write_id });
        self.apply_write_cancel(map, key, None, self.now());
        Ok(())
    }

    /// PutEnd / UpsertEnd (`end = true`, answering the replaced value's ranges) or PutRevoke /
    /// UpsertRevoke (answering none).
    pub fn write_finish(&self, req: &WriteFinish, end: bool) -> WireResult<Vec<ReplicaDesc>> {
        let r = self.route(&req.tenant, &req.key)?;
        let now = self.now();
        let group = self.routed(&r);
        let mut map = group.shards.shard(r.shard).write();
        if end {
            self.commit(&mut map, &r.key, req.client, req.write_id, now, group.uses.next())
        } else {
            self.revoke(&mut map, &r.key, req.client, req.write_id).map(|()| Vec::new())
        }
    }

    /// Batch forms of [`Master::write_finish`].
    pub fn batch_write_finish(&self, req: &BatchWriteFinish, end: bool) -> Vec<WireResult<Vec<ReplicaDesc>>> {
        let now = self.now();
        if req.write_ids.len() != req.keys.len() {
            return vec![Err(ErrorCode::INVALID_PARAMS); req.keys.len()];
        }
        self.batch_write(&req.tenant, &req.keys, false, |map, i, key, used| {
            let id = req.write_ids[i];
            if end {
                self.commit(map, key, req.client, id, now, used)
            } else {
                self.revoke(map, key, req.client, id).map(|()| Vec::new())
            }
        })
    }

    /// Applies `f` to each key's object under its shard's write lock; `new` writes are refused
    /// in a frozen group (the ends of admitted writes are not). `f` is given the shard, the key's
    /// index in the batch, the key and its use number ([`BatchUses`]).
    fn batch_write<T: Default, F>(&self, tenant: &str, keys: &[KeyRef], new: bool, mut f: F) -> Vec<WireResult<T>>
    where
        F: FnMut(&mut ShardMap, usize, &ObjectKey, u64) -> WireResult<T>,
    {
        let (errors, routed) = self.route_batch(tenant, keys.iter());
        let mut out: Vec<WireResult<T>> = errors.into_iter().map(|e| e.map_or(Ok(T::default()), Err)).collect();
        let mut uses = BatchUses::new(keys.len());
        for run in routed.chunk_by(|a, b| (a.1.group, a.1.shard) == (b.1.group, b.1.shard)) {
            let group = self.routed(&run[0].1);
            if new && group.is_frozen() {
                run.iter().for_each(|(i, _)| out[*i] = Err(ErrorCode::KVPT_MIGRATING));
                continue;
            }
            let mut map = group.shards.shard(run[0].1.shard).write();
            for (i, r) in run {
                out[*i] = f(&mut map, *i, &r.key, uses.of(group, *i));
            }
        }
        out
    }

    /// Applies `f` to each key's object under its shard's read lock; `f` is given the key's
    /// group, the shard, the key and its use number ([`BatchUses`]).
    fn batch_read<T, F>(&self, tenant: &str, keys: &[KeyRef], mut f: F) -> Vec<WireResult<T>>
    where
        F: FnMut(&Group, &ShardMap, &ObjectKey, u64) -> WireResult<T>,
    {
        let (errors, routed) = self.route_batch(tenant, keys.iter());
        let mut out: Vec<Option<WireResult<T>>> = errors.into_iter().map(|e| e.map(Err)).collect();
        let mut uses = BatchUses::new(keys.len());
        for run in routed.chunk_by(|a, b| (a.1.group, a.1.shard) == (b.1.group, b.1.shard)) {
            let group = self.routed(&run[0].1);
            let map = group.shards.shard(run[0].1.shard).read();
            for (i, r) in run {
                out[*i] = Some(f(group, &map, &r.key, uses.of(group, *i)));
            }
            drop(map);
            self.gate_read(group, run[0].1.shard);
        }
        out.into_iter().map(|o| o.expect("every key has a result")).collect()
    }

    // ---- reads ---------------------------------------------------------------------------

    /// What a cached read grant must satisfy to be handed out now: the group epoch it was
    /// granted under, and the wall-clock time (Unix ms) it must last until. Read grants last two
    /// leases and are shared by readers while at least one is left, so that every reader's grant
    /// outlasts its lease and a hot object costs one MAC per lease. The clock is read once per
    /// call, batch or not ([`Master::read_grant_until`]).
    fn read_grant_floor(&self, group: &Group, until: u64) -> (u64, u64) {
        match self.cfg.secret {
            Some(_) => (group.epoch(), until),
            None => (0, 0),
        }
    }

    /// The wall-clock time (Unix ms) a read grant handed out now must last until.
    fn read_grant_until(&self) -> u64 {
        match self.cfg.secret {
            Some(_) => self.clock.unix_now_ms().saturating_add(self.cfg.default_kv_lease_ttl_ms),
            None => 0,
        }
    }

    fn replica_list(
        &self,
        map: &ShardMap,
        key: &ObjectKey,
        now: u64,
        (epoch, fresh_until): (u64, u64),
        used: u64,
    ) -> WireResult<ReplicaList> {
        let obj = map.get(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        if !obj.is_complete() {
            return Err(ErrorCode::REPLICA_IS_NOT_READY);
        }
        let ttl = self.cfg.default_kv_lease_ttl_ms;
        let replicas: Vec<ReplicaDesc> = obj
            .replicas
            .iter()
            .filter(|r| r.seg.is_alive())
            .map(|r| r.read_desc(obj.size, epoch, fresh_until, || self.grant(RIGHT_READ, 2 * ttl, key)))
            .collect();
        if replicas.is_empty() {
            // Its only segments are being swept.
            return Err(ErrorCode::OBJECT_NOT_FOUND);
        }
        obj.extend_lease(now + ttl);
        obj.used.read(used);
        self.note_read(key, now);
        Ok(ReplicaList { size: obj.size, replicas, lease_ttl_ms: ttl })
    }

    /// GetReplicaList: where to read, with a read lease. Takes only the shard's read lock.
    pub fn get_replica_list(&self, q: &KeyQuery) -> WireResult<ReplicaList> {
        let r = self.route(&q.tenant, &q.key)?;
        let now = self.now();
        let group = self.routed(&r);
        let floor = self.read_grant_floor(group, self.read_grant_until());
        let got = self.replica_list(&group.shards.shard(r.shard).read(), &r.key, now, floor, group.uses.next());
        self.gate_read(group, r.shard);
        self.counters.looked_up(true, got.is_ok() as u64, got.is_err() as u64);
        got
    }

    /// BatchGetReplicaList.
    pub fn batch_get_replica_list(&self, q: &BatchKeyQuery) -> Vec<WireResult<ReplicaList>> {
        let now = self.now();
        let until = self.read_grant_until();
        let got = self.batch_read(&q.tenant, &q.keys, |group, map, key, used| {
            self.replica_list(map, key, now, self.read_grant_floor(group, until), used)
        });
        let found = got.iter().filter(|g| g.is_ok()).count() as u64;
        self.counters.looked_up(true, found, got.len() as u64 - found);
        got
    }

    fn exists(&self, map: &ShardMap, key: &ObjectKey, now: u64, used: u64) -> bool {
        match map.get(key) {
            Some(o) if o.replicas.iter().any(|r| r.seg.is_alive()) => {
                o.extend_lease(now + self.cfg.default_kv_lease_ttl_ms);
                o.used.touch(used);
                true
            }
            _ => false,
        }
    }

    /// ExistKey: true for a complete object; extends its lease.
    pub fn exist_key(&self, q: &KeyQuery) -> WireResult<bool> {
        let r = self.route(&q.tenant, &q.key)?;
        let now = self.now();
        let group = self.routed(&r);
        let found = self.exists(&group.shards.shard(r.shard).read(), &r.key, now, group.uses.next());
        self.gate_read(group, r.shard);
        self.counters.looked_up(false, found as u64, !found as u64);
        Ok(found)
    }

    /// BatchExistKey.
    pub fn batch_exist_key(&self, q: &BatchKeyQuery) -> Vec<WireResult<bool>> {
        let now = self.now();
        let found = self.batch_read(&q.tenant, &q.keys, |_, map, key, used| Ok(self.exists(map, key, now, used)));
        let n = found.iter().filter(|f| matches!(f, Ok(true))).count() as u64;
        self.counters.looked_up(false, n, found.len() as u64 - n);
        found
    }

    // ---- removal -------------------------------------------------------------------------

    /// Frees `replicas` now, or when `until` passes (for ranges a writer may still use).
    fn defer(&self, mut replicas: Vec<Replica>, until: u64, now: u64) {
        if replicas.is_empty() {
            return;
        }
        // A range held back is no replica, dynamic or not.
        replicas.iter_mut().for_each(|r| r.dynamic = None);
        if until <= now {
            replicas.into_iter().for_each(Replica::release);
        } else {
            self.deferred.lock().push(Deferred { release_at: until, replicas });
        }
    }

    /// Drops an object removed from its shard. Its value's ranges are free at once (readers
    /// check generations); an unfinished write's stay reserved until its release timeout, as
    /// its writer may still be copying into them.
    fn dispose(&self, obj: ObjectMeta, now: u64) {
        obj.replicas.into_iter().for_each(Replica::release);
        if let Some(p) = obj.pending {
            self.defer(p.replicas, p.started_ms + self.cfg.put_start_release_timeout_ms, now);
        }
    }

    fn remove_one(&self, map: &mut ShardMap, key: &ObjectKey, force: bool, now: u64) -> WireResult<()> {
        let obj = map.get(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        if !force {
            if !obj.is_complete() {
                return Err(ErrorCode::REPLICA_IS_NOT_READY);
            }
            // A task copies it: removed by force only (the copy then fails).
            if obj.pending.as_ref().is_some_and(|p| p.copy.is_some()) {
                return Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK);
            }
            if obj.is_leased(now) {
                return Err(ErrorCode::OBJECT_HAS_LEASE);
            }
        }
        if obj.is_leased(now) {
            // Retired by the key's next writer, at the latest when the lease ends. (Leases are
            // not logged: a new primary grants fresh ones, and so keeps no tombstones.)
            let ttl = obj.lease().saturating_sub(now) + self.cfg.put_start_discard_timeout_ms;
            let grant = self.grant(RIGHT_RETIRE, ttl, key);
            let ranges: Vec<ReplicaDesc> = obj
                .replicas
                .iter()
                .filter(|r| r.seg.is_alive())
                .map(|r| r.seg.replica_desc(&r.alloc, obj.size, &grant))
                .collect();
            if !ranges.is_empty() {
                let Some(group) = self.group_of_key(key) else { return Err(ErrorCode::KVPT_NOT_OWNED) };
                let mut t = group.tombstones_of(key).lock();
                let entry = t.entry(key.clone()).or_insert(Tombstone { until: 0, ranges: Vec::new() });
                entry.until = entry.until.max(obj.lease());
                entry.ranges.extend(ranges);
            }
        }
        self.log(|| Record::Remove { key: key.to_vec(), at_ms: self.unix_time(now), evicted: false });
        self.apply_remove(map, key, now);
        self.counters.objects_removed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Drops tombstones whose lease has ended.
    fn expire_tombstones(&self, now: u64) {
        for t in self.groups().flat_map(|g| g.tombstones.iter()) {
            let mut t = t.lock();
            if !t.is_empty() {
                t.retain(|_, x| x.until > now);
            }
        }
    }

    // ---- failover ------------------------------------------------------------------------

    /// Serves group `rank` as its primary under `epoch` from now on, with the state replayed
    /// from its log (a standby's promotion, or a master that restored the group). What the
    /// log does not carry is made safe here: every known client counts as just heard from
    /// (pings are not logged), and every object as read-leased for one lease (the old
    /// primary's readers may still be copying, and its leases are unknown), and every replica
    /// as granted for the longest a grant lasts (its grants are unknown too: a range freed
    /// later stays with its tenant that long). Unfinished writes keep their start times: they
    /// are discarded and released by the usual timeouts. False if this master does not hold
    /// the group.
    pub fn take_over(&self, rank: u32, epoch: u64) -> bool {
        let Some(group) = self.group(rank) else { return false };
        let now = self.now();
        for c in self.clients.read().values() {
            c.last_ping.fetch_max(now, Ordering::Relaxed);
        }
        let lease = self.cfg.default_kv_lease_ttl_ms;
        // The previous primary may have granted transfers of any range until this long from
        // now: freed ranges stay with their tenants as long.
        let granted = self.clock.unix_now_ms().saturating_add(self.grant_lifetime_ms());
        for shard in group.shards.iter() {
            for obj in shard.read().values() {
                obj.extend_lease(now + lease);
                let pending = obj.pending.iter().flat_map(|p| &p.replicas);
                obj.replicas.iter().chain(pending).for_each(|r| r.assume_granted_until(granted));
            }
        }
        for d in self.deferred.lock().iter() {
            d.replicas.iter().for_each(|r| r.assume_granted_until(granted));
        }
        group.set_epoch(epoch);
        // Its allocations are this master's from now on: they keep out of the VSegment quota,
        // set aside before the group takes its first write.
        let fencing = self.fencing.lock();
        self.fence_group(group);
        if !group.set_serving(true) {
            self.serving_groups.fetch_add(1, Ordering::AcqRel);
        }
        drop(fencing);
        group.set_installing(false);
        group.set_frozen(false);
        group.segments.set_standby_grants(0);
        true
    }

    /// Notes whether the group record names this master primary of group `rank` while it does
    /// not serve the group yet (`on`: it won the record and replays the log's end; off: it
    /// serves now, or the record names another master). Meanwhile requests for the group are
    /// answered KVPT_MIGRATING, which clients retry here with back-off, instead of
    /// KVPT_NOT_OWNED, which would send them to the master the record no longer names.
    pub fn installing(&self, rank: u32, on: bool) {
        if let Some(group) = self.group(rank) {
            group.set_installing(on && !group.is_serving());
        }
    }

    /// What a request for a key of group `rank` gets at this master while it does not serve
    /// the group: KVPT_MIGRATING while it is about to ([`Master::installing`]), else
    /// KVPT_NOT_OWNED.
    pub fn refusal(&self, rank: u32) -> ErrorCode {
        if self.group(rank).is_some_and(Group::is_installing) {
            ErrorCode::KVPT_MIGRATING
        } else {
            ErrorCode::KVPT_NOT_OWNED
        }
    }

    /// Freezes (`on`) or thaws new writes of group `rank` while a reshard moves it to another
    /// master: a write start, an upsert start, a remove or a replica clear of its keys is
    /// answered KVPT_MIGRATING (the client retries it with back-off, and reaches the new primary
    /// after the switch), while writes admitted before still end or are revoked, and evictions,
    /// expiries and RemoveAll / RemoveByRegex sweeps go on. Reads are served as usual. The
    /// freeze only spares clients errors: what the source commits before the switch is in the
    /// log the target replays, and commit-time fencing refuses the rest. Returns whether they
    /// were frozen before.
    pub fn freeze(&self, rank: u32, on: bool) -> bool {
        self.group(rank).is_some_and(|g| g.set_frozen(on))
    }

    /// Refuses a new write of the routed key while its group is frozen.
    fn admit_write(&self, r: &Routed) -> WireResult<()> {
        if self.routed(r).is_frozen() {
            return Err(ErrorCode::KVPT_MIGRATING);
        }
        Ok(())
    }

    /// Mounts in group `rank` every segment the other groups served here have and it has not:
    /// for a group created after clients mounted their segments on this master (they mount
    /// on the masters they know of, once), so that it can allocate on them too.
    pub fn adopt_segments(&self, rank: u32) {
        let Some(group) = self.group(rank) else { return };
        let mut seen = std::collections::HashSet::new();
        let others: Vec<(ClientId, SegmentDesc)> = self
            .serving()
            .filter(|g| g.rank() != rank)
            .flat_map(|g| g.segments.live().iter().map(|s| (s.client, s.desc.clone())).collect::<Vec<_>>())
            .filter(|(_, d)| seen.insert(d.id))
            .collect();
        for (client, desc) in others {
            if group.segments.get(desc.id).is_none() {
                if let Err(e) = self.mount_in(group, client, &desc) {
                    tracing::warn!(group = rank, segment = %desc.id, error = ?e, "could not mount a segment in a new group");
                }
            }
        }
    }

    /// The longest a capability this master mints lasts: a write's (the put-start discard
    /// timeout) or a read's (two read leases).
    fn grant_lifetime_ms(&self) -> u64 {
        self.cfg.put_start_discard_timeout_ms.max(2 * self.cfg.default_kv_lease_ttl_ms)
    }

    /// Stops answering requests for group `rank` (they get KVPT_NOT_OWNED): this master only
    /// replays its log (a standby), or lost it. False if this master does not hold the group.
    pub fn stand_by(&self, rank: u32) -> bool {
        let Some(group) = self.group(rank) else { return false };
        if group.set_serving(false) {
            self.serving_groups.fetch_sub(1, Ordering::AcqRel);
        }
        group.set_installing(false);
        group.set_frozen(false);
        // Ranges the log frees from now on may carry the primary's grants, unknown here.
        group.segments.set_standby_grants(self.grant_lifetime_ms());
        true
    }

    /// Stops serving group `rank` (reads included) once `log`, the group's OpLog as this master
    /// writes it, ends: another master may own the group then.
    pub fn stop_serving_when_log_ends(self: &Arc<Self>, log: &crate::log::oplog::OpLogWriter, rank: u32) {
        let weak = Arc::downgrade(self);
        let this = log as *const crate::log::oplog::OpLogWriter as usize;
        log.on_end(move |why| {
            let Some(m) = weak.upgrade() else { return };
            // An old log of the group finishing after the master took the group again (with a
            // new log) says nothing about the group now.
            let current = m.group(rank).and_then(Group::sink).map(|s| Arc::as_ptr(&s) as *const () as usize);
            if current.is_some_and(|c| c != this) {
                return;
            }
            tracing::warn!(group = rank, reason = %why, "the group's log ended: no longer serving it");
            m.stand_by(rank);
        });
    }

    /// Who serves each group, for clients' routes: as the cluster's records last said
    /// ([`Master::publish_routes`]); for a master alone, the epochs of the groups it serves (0
    /// for the others) and no owners (it serves every group itself).
    pub fn route_table(&self) -> tycho_proto::RouteTable {
        if let Some(t) = self.routes.read().as_ref() {
            return (**t).clone();
        }
        let groups = self.cfg.group_count.max(1);
        let epochs =
            (0..groups).map(|rank| self.group(rank).filter(|g| g.is_serving()).map_or(0, Group::epoch)).collect();
        tycho_proto::RouteTable { groups, epochs, owners: Vec::new(), lease_ttl_ms: 0 }
    }

    /// Serves the snapshots in `files` to the cluster's other masters (`SnapshotFile`). Set
    /// once, before serving.
    pub fn serve_snapshots(&self, files: Arc<crate::log::snapshot::DirSnapshotStore>) {
        let _ = self.snapshot_files.set(files);
    }

    /// Notes the address this master advertises to its cluster. Set once.
    pub fn advertise(&self, address: &str) {
        let _ = self.advertised.set(address.to_owned());
    }

    /// Whether `owner` (an address from the route table) is this master: a table that names it
    /// for a group it does not serve is behind, and must not send clients back here.
    pub fn is_me(&self, owner: &str) -> bool {
        self.advertised.get().is_some_and(|me| me == owner)
    }

    /// The snapshot directory this master serves, if any.
    pub fn snapshot_files(&self) -> Option<&Arc<crate::log::snapshot::DirSnapshotStore>> {
        self.snapshot_files.get()
    }

    /// One file of a snapshot this master holds (`None`: not held, or not a snapshot file's
    /// name).
    pub fn snapshot_file(&self, q: &tycho_proto::SnapshotFileQuery) -> Option<Vec<u8>> {
        use crate::log::snapshot::{SnapshotId, SnapshotStore};
        if !crate::cluster::snapshot_peers::is_snapshot_file(&q.file) {
            return None;
        }
        let id = SnapshotId { group: q.group, applied: q.applied, epoch: q.epoch, writer: q.writer };
        self.snapshot_files.get()?.get(&id, &q.file).ok().flatten()
    }

    /// Records who serves each group (from the cluster's records), for [`Master::route_table`].
    /// A group's entry only moves forward: one read before a later change (another role loop's
    /// older view) does not undo it.
    pub fn publish_routes(&self, table: tycho_proto::RouteTable) {
        let mut routes = self.routes.write();
        let merged = match routes.as_deref() {
            Some(old) if old.groups == table.groups => {
                let mut t = table.clone();
                for r in 0..t.epochs.len().min(old.epochs.len()) {
                    if old.epochs[r] > t.epochs[r] {
                        t.epochs[r] = old.epochs[r];
                        t.owners[r] = old.owners.get(r).cloned().unwrap_or_default();
                    }
                }
                t
            }
            _ => table,
        };
        if routes.as_deref() != Some(&merged) {
            *routes = Some(Arc::new(merged));
        }
    }

    /// Notes that `owner` serves group `rank` at `epoch` from now on (this master, right after
    /// it took the group), before its next read of the records says so.
    pub fn note_route(&self, rank: u32, epoch: u64, owner: &str) {
        let mut routes = self.routes.write();
        let Some(old) = routes.as_deref() else { return };
        let mut t = old.clone();
        if let (Some(e), Some(o)) = (t.epochs.get_mut(rank as usize), t.owners.get_mut(rank as usize)) {
            if *e <= epoch {
                *e = epoch;
                *o = owner.to_string();
                *routes = Some(Arc::new(t));
            }
        }
    }

    /// Whether this master serves any group; one that serves none answers only probes.
    pub fn is_serving(&self) -> bool {
        self.serving_groups.load(Ordering::Acquire) > 0
    }

    /// Whether this master serves every group (a single master, or a cluster's only one).
    pub fn serves_every_group(&self) -> bool {
        self.serving_groups.load(Ordering::Acquire) >= self.cfg.group_count.max(1) as usize
    }

    /// Remove one object; a leased or unfinished one only with `force`.
    pub fn remove(&self, req: &RemoveKey) -> WireResult<()> {
        let r = self.route(&req.tenant, &req.key)?;
        self.admit_write(&r)?;
        let now = self.now();
        self.remove_one(&mut self.routed(&r).shards.shard(r.shard).write(), &r.key, req.force, now)
    }

    /// BatchRemove.
    pub fn batch_remove(&self, req: &BatchRemoveKeys) -> Vec<WireResult<()>> {
        let now = self.now();
        self.batch_write(&req.tenant, &req.keys, true, |map, _, key, _| self.remove_one(map, key, req.force, now))
    }

    /// BatchReplicaClear: drops the replicas of objects whose current value `req.client` wrote,
    /// once no read lease holds them — all of an object, or only its replicas on the named
    /// segment (the object goes when none is left). Objects with a write in progress stay.
    pub fn batch_replica_clear(&self, req: &ReplicaClear) -> Vec<WireResult<()>> {
        let now = self.now();
        self.batch_write(&req.tenant, &req.keys, true, |map, _, key, _| {
            let obj = map.get_mut(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
            if obj.writer != req.client {
                return Err(ErrorCode::ILLEGAL_CLIENT);
            }
            if !obj.is_complete() || obj.pending.is_some() {
                return Err(ErrorCode::REPLICA_IS_NOT_READY);
            }
            if obj.is_leased(now) {
                return Err(ErrorCode::OBJECT_HAS_LEASE);
            }
            if !req.segment.is_empty() {
                let mut gone: Vec<SegmentId> =
                    obj.replicas.iter().filter(|r| r.seg.desc.name == req.segment).map(|r| r.seg.desc.id).collect();
                if gone.is_empty() {
                    return Err(ErrorCode::REPLICA_NOT_FOUND);
                }
                if gone.len() < obj.replicas.len() {
                    gone.dedup();
                    for segment in gone {
                        self.log(|| Record::DropReplicas { key: key.to_vec(), segment });
                        self.apply_drop_replicas(map, key, segment, now);
                    }
                    return Ok(());
                }
            }
            self.log(|| Record::Remove { key: key.to_vec(), at_ms: self.unix_time(now), evicted: false });
            self.apply_remove(map, key, now);
            self.counters.objects_removed.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Removes every object for which `pick` holds, shard by shard, in bounded batches; leased
    /// and unfinished objects are skipped unless `force`. Returns the number removed. (A sweep
    /// goes on in a group frozen for a reshard: its records commit before the switch, or its
    /// answer fails with the log's error.)
    fn remove_matching<F>(&self, force: bool, pick: F) -> u64
    where
        F: Fn(&[u8]) -> bool,
    {
        let mut removed = 0;
        for shard in self.all_shards() {
            // The filter (maybe a regular expression) runs after the shard's lock is released.
            let mut keys: Vec<ObjectKey> = shard.read().keys().cloned().collect();
            keys.retain(|k| pick(k));
            for chunk in keys.chunks(SWEEP_BATCH) {
                let now = self.now();
                let mut map = shard.write();
                for k in chunk {
                    if self.remove_one(&mut map, k, force, now).is_ok() {
                        removed += 1;
                    }
                }
            }
        }
        removed
    }

    /// RemoveByRegex: objects of `tenant` whose whole key matches `regex`.
    pub fn remove_by_regex(&self, tenant: &str, regex: &str, force: bool) -> WireResult<u64> {
        let re = whole_key_regex(regex)?;
        Ok(self
            .remove_matching(force, |k| decode_object_key(k).is_some_and(|(t, key)| t == tenant && re.is_match(key))))
    }

    /// RemoveAll.
    pub fn remove_all(&self, force: bool) -> u64 {
        self.remove_matching(force, |_| true)
    }

    // ---- admin ---------------------------------------------------------------------------

    /// Mounted segments with usage.
    pub fn list_segments(&self) -> Vec<SegmentStatus> {
        // One entry per segment, with the bytes used in every slice held here.
        let mut out: Vec<SegmentStatus> = Vec::new();
        let mut at: HashMap<SegmentId, usize> = HashMap::new();
        for group in self.groups() {
            for s in group.segments.live().iter() {
                match at.get(&s.desc.id) {
                    Some(&i) => out[i].used += s.used(),
                    None => {
                        at.insert(s.desc.id, out.len());
                        out.push(SegmentStatus { desc: s.desc.clone(), client: s.client, used: s.used() });
                    }
                }
            }
        }
        out.sort_by_key(|s| s.desc.id);
        out
    }

    /// Keys matching the filters, at most `limit` (and at most [`MAX_LIST_KEYS`] keys or
    /// [`MAX_LIST_BYTES`] of key bytes, so that the answer fits in a frame). The regular
    /// expression runs outside the shards' locks.
    pub fn list_keys(&self, tenant: Option<&str>, regex: Option<&str>, limit: u32) -> WireResult<Vec<KeyInfo>> {
        let re = regex.map(whole_key_regex).transpose()?;
        let limit = (limit as usize).min(MAX_LIST_KEYS);
        let mut out = Vec::new();
        let mut bytes = 0;
        for shard in self.all_shards() {
            if out.len() >= limit || bytes >= MAX_LIST_BYTES {
                break;
            }
            let mut keys: Vec<ObjectKey> = {
                let map = shard.read();
                map.keys()
                    .filter(|k| decode_object_key(k).is_some_and(|(t, _)| tenant.is_none_or(|want| want == t)))
                    .cloned()
                    .collect()
            };
            if let Some(re) = &re {
                keys.retain(|k| decode_object_key(k).is_some_and(|(_, key)| re.is_match(key)));
            }
            if keys.is_empty() {
                continue;
            }
            let now = self.now();
            let map = shard.read();
            for k in &keys {
                if out.len() >= limit || bytes >= MAX_LIST_BYTES {
                    break;
                }
                // Removed since the keys were collected: skip it.
                let (Some(o), Some((t, key))) = (map.get(k), decode_object_key(k)) else { continue };
                bytes += k.len();
                out.push(key_info(t, key, o, now));
            }
        }
        Ok(out)
    }

    /// One page of keys (of `tenant`, or of all tenants), in a stable order (by shard, then by
    /// encoded key), after `after`; at most `limit`. The second value is where the next page
    /// starts, `None` after the last page.
    pub fn list_keys_page(
        &self,
        tenant: Option<&str>,
        limit: usize,
        after: Option<KeyCursor>,
    ) -> (Vec<KeyInfo>, Option<KeyCursor>) {
        let now = self.now();
        let first = after.as_ref().map_or(0, |c| c.shard as usize);
        let mut out = Vec::new();
        for (i, shard) in self.indexed_shards().skip_while(|(i, _)| *i < first) {
            let map = shard.read();
            let mut keys: Vec<&ObjectKey> = map
                .keys()
                .filter(|k| decode_object_key(k).is_some_and(|(t, _)| tenant.is_none_or(|want| want == t)))
                .filter(|k| after.as_ref().is_none_or(|c| i > c.shard as usize || k[..] > c.key[..]))
                .collect();
            keys.sort_unstable();
            for k in keys {
                let (Some(o), Some((t, key))) = (map.get(k), decode_object_key(k)) else { continue };
                out.push(key_info(t, key, o, now));
                if out.len() >= limit {
                    // The next page may turn out empty; that one says it is the last.
                    return (out, Some(KeyCursor { shard: i as u32, key: k.to_vec() }));
                }
            }
        }
        (out, None)
    }

    /// What the master holds for one key, found through its partition's shard.
    pub fn query_key(&self, tenant: &str, key: &str) -> WireResult<Option<KeyInfo>> {
        validate_key(tenant, key)?;
        let encoded = encode_object_key(tenant, key);
        let group = self.group_of_key(&encoded).ok_or(ErrorCode::KVPT_NOT_OWNED)?;
        let map = group.shard_of(&encoded).read();
        Ok(map.get(encoded.as_slice()).map(|o| key_info(tenant, key, o, self.now())))
    }

    /// Objects of group `rank` held here (served or replayed).
    pub fn group_objects(&self, rank: u32) -> u64 {
        self.group(rank).map_or(0, |g| g.shards.iter().map(|s| s.read().len() as u64).sum())
    }

    /// Whole-master figures.
    pub fn stats(&self) -> MasterStats {
        let (capacity_bytes, used_bytes) = self.usage();
        MasterStats {
            capacity_bytes,
            used_bytes,
            objects: self.groups().flat_map(|g| g.shards.iter()).map(|s| s.read().len() as u64).sum(),
            clients: self.clients.read().len() as u64,
            segments: self.list_segments().len() as u64,
            sweep_progress: self.counters.sweep_visited.load(Ordering::Relaxed),
        }
    }

    // ---- background work -----------------------------------------------------------------

    /// One round of housekeeping: expire silent clients, free deferred ranges, reclaim
    /// abandoned writes, evict above the high watermark. Production calls it every ~100 ms;
    /// tests call it after moving a manual clock.
    pub fn tick(&self) {
        // Tests hold shard 0's write lock from here to reproduce a stalled shard (spec 02).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("master::hold_shard_write", |arg: Option<String>| {
            let ms = arg.and_then(|a| a.parse().ok()).unwrap_or(1000);
            let _held = self.all_shards().next().expect("a master holds a group").write();
            std::thread::sleep(std::time::Duration::from_millis(ms));
        });
        // A master that serves nothing only replays its groups' logs: expiring clients or
        // evicting here would decide what only the primary decides. Held ranges are let go
        // (a replayed start that needs one would let it go anyway).
        if !self.is_serving() {
            self.free_deferred();
            return;
        }
        self.expire_clients();
        self.free_deferred();
        self.expire_tombstones(self.now());
        self.reclaim_abandoned_writes();
        self.task_housekeeping();
        self.admit_hot_keys();
        // Each group's slices fill on their own: a full group is evicted from alone.
        for group in self.serving() {
            let (total, used) = group.segments.stored_usage();
            if total > 0 && used as f64 > total as f64 * self.cfg.eviction_high_watermark_ratio {
                let watermark = RoundRequest { bytes: 0, watermark: true, group: Some(group.rank()) };
                if !self.evictor.request(watermark) {
                    self.evict_round(watermark);
                }
            }
        }
    }

    /// Runs eviction rounds as they are asked for, on the calling thread, until
    /// [`Master::stop_evictor`]. While it runs, no RPC worker evicts.
    pub fn run_evictor(&self) {
        self.evictor.run(|r| {
            let freed = self.evict_round(r).1;
            // Nobody waits for what eviction logs: forget it (and the logs it names).
            drop(Master::take_logged());
            freed
        });
    }

    /// Whether [`Master::run_evictor`] is running (eviction is then off the request path).
    pub fn evictor_running(&self) -> bool {
        self.evictor.is_background()
    }

    /// Stops [`Master::run_evictor`].
    pub fn stop_evictor(&self) {
        self.evictor.stop();
    }

    /// Notes that the RPC runtime runs: a task on it calls this every
    /// [`RESPONSIVE_INTERVAL_MS`]. Once called, a gap longer than [`STALL_MS`] counts as the
    /// master's own stall, and client expiry waits.
    pub fn note_responsive(&self) {
        self.rpc_alive.store(self.now(), Ordering::Relaxed);
    }

    fn expire_clients(&self) {
        let now = self.now();
        let ttl = self.cfg.client_ttl_ms;
        let alive = self.rpc_alive.load(Ordering::Relaxed);
        if alive != 0 && now.saturating_sub(alive) > STALL_MS {
            // Pings may be waiting behind the stall: expiring their senders would punish them
            // for the master's own delay.
            if self.stalled_at.swap(now, Ordering::Relaxed) + STALL_MS < now {
                tracing::warn!(stalled_ms = now - alive, "the master is not answering in time; client expiry paused");
            }
            self.counters.expiry_pauses.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let since = self.stalled_at.load(Ordering::Relaxed);
        let silent_since = |c: &ClientEntry| c.last_ping.load(Ordering::Relaxed).max(since) + ttl <= now;
        let silent: Vec<ClientId> =
            self.clients.read().iter().filter(|(_, c)| silent_since(c)).map(|(id, _)| *id).collect();
        if silent.is_empty() {
            return;
        }
        for id in silent {
            // Taken before the client is forgotten: a remount that the forgetting provokes
            // (its next ping is answered NeedRemount) waits for this expiry's unmounts, instead
            // of mounting in between and having them undo it.
            let _mounting = self.mounting.lock();
            let entry = {
                let mut clients = self.clients.write();
                // It may have pinged since the read above.
                match clients.get(&id) {
                    Some(c) if silent_since(c) => clients.remove(&id),
                    _ => None,
                }
            };
            if let Some(entry) = entry {
                self.counters.clients_expired.fetch_add(1, Ordering::Relaxed);
                self.fail_tasks_of(id);
                tracing::info!(client = %id, "client expired; unmounting its segments");
                let segments: Vec<SegmentId> = entry.segments.lock().drain(..).collect();
                for group in self.serving() {
                    for &segment in &segments {
                        if group.segments.get(segment).is_some() {
                            self.log_to(group, || Record::Unmount { segment });
                            self.apply_unmount(group, segment);
                        }
                    }
                }
            }
        }
        self.sweep_dead_segments();
    }

    /// Drops every replica on a dead segment and every object left with none, holding each
    /// shard's write lock for at most [`SWEEP_BATCH`] objects at a time.
    pub fn sweep_dead_segments(&self) {
        for group in self.serving() {
            self.sweep_dead_segments_of(group);
        }
    }

    /// [`Master::sweep_dead_segments`] in one group.
    fn sweep_dead_segments_of(&self, group: &Group) {
        self.counters.sweeps_running.fetch_add(1, Ordering::Relaxed);
        for shard in group.shards.iter() {
            let keys: Vec<ObjectKey> =
                shard.read().iter().filter(|(_, o)| o.touches_dead_segment()).map(|(k, _)| k.clone()).collect();
            for chunk in keys.chunks(SWEEP_BATCH) {
                let mut map = shard.write();
                let now = self.now();
                for k in chunk {
                    let Some(obj) = map.get(k) else { continue };
                    let mut dead: Vec<SegmentId> = obj
                        .replicas
                        .iter()
                        .chain(obj.pending.iter().flat_map(|p| p.replicas.iter()))
                        .filter(|r| !r.seg.is_alive())
                        .map(|r| r.seg.desc.id)
                        .collect();
                    dead.sort_unstable();
                    dead.dedup();
                    let mut dropped = 0;
                    for segment in dead {
                        self.log(|| Record::DropReplicas { key: k.to_vec(), segment });
                        dropped += self.apply_drop_replicas(&mut map, k, segment, now);
                    }
                    self.counters.sweep_replicas_dropped.fetch_add(dropped as u64, Ordering::Relaxed);
                    if !map.contains_key(k) {
                        self.counters.sweep_objects_removed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                drop(map);
                self.counters.sweep_visited.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                // Tests slow the sweep down here to watch calls complete during it.
                #[cfg(feature = "failpoints")]
                fail::fail_point!("master::sweep_batch");
            }
        }
        self.counters.sweeps_running.fetch_sub(1, Ordering::Relaxed);
    }

    fn free_deferred(&self) {
        let now = self.now();
        let due: Vec<Deferred> = {
            let mut d = self.deferred.lock();
            let (due, keep): (Vec<_>, Vec<_>) = d.drain(..).partition(|x| x.release_at <= now);
            *d = keep;
            due
        };
        for d in due {
            d.replicas.into_iter().for_each(Replica::release);
        }
        let mut orphaned = self.orphaned.lock();
        orphaned.values_mut().for_each(|l| l.retain(|&(_, _, until)| until > now));
        orphaned.retain(|_, l| !l.is_empty());
    }

    /// Reclaims writes unfinished for longer than the release timeout: their writer is gone.
    fn reclaim_abandoned_writes(&self) {
        let now = self.now();
        // A full scan costs a read lock per shard; once a second is plenty for a 600 s timeout.
        let last = self.last_abandon_scan.load(Ordering::Relaxed);
        if now < last + 1000 {
            return;
        }
        self.last_abandon_scan.store(now, Ordering::Relaxed);
        let release = self.cfg.put_start_release_timeout_ms;
        let stale = |o: &ObjectMeta| o.pending.as_ref().is_some_and(|p| p.started_ms + release <= now);
        for shard in self.all_shards() {
            let keys: Vec<ObjectKey> = shard.read().iter().filter(|(_, o)| stale(o)).map(|(k, _)| k.clone()).collect();
            for chunk in keys.chunks(SWEEP_BATCH) {
                let mut map = shard.write();
                for k in chunk {
                    let Some(obj) = map.get_mut(k) else { continue };
                    if !stale(obj) {
                        continue;
                    }
                    let p = obj.pending.as_ref().expect("stale implies pending");
                    let (writer, write_id, release_at) = (p.writer, p.write_id, p.started_ms + release);
                    let release_at_ms = self.unix_time(release_at);
                    self.log(|| Record::WriteDrop { key: k.to_vec(), writer, write_id, release_at_ms });
                    self.apply_write_cancel(&mut map, k, Some(release_at), now);
                    self.counters.writes_released.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// One watermark eviction round on the calling thread (see [`Master::evict_round`]).
    pub fn evict(&self) -> (u64, u64) {
        self.evict_round(RoundRequest { bytes: 0, watermark: true, group: None })
    }

    /// One eviction round: in each group it is for (`req.group`, or every group served), removes
    /// evictable objects (complete, not leased, not being rewritten, not hard-pinned) in the
    /// order of the eviction policy ([`crate::state::policy`]); soft-pinned objects only in a second
    /// pass when the first found too few. Before any object, it drops the dynamic replicas
    /// fan-out added (of objects not leased nor being rewritten, which keep a replica that is
    /// not dynamic), each object's at once, and fan-out then leaves the object be for its
    /// cooldown. Pins do not hold dynamic replicas: they keep the object, which stays. A
    /// watermark round takes `eviction_ratio` of a group's evictable objects; a round asked for
    /// bytes takes objects until they add up to the bytes (at least 1 % of the group's capacity,
    /// so that a stream of misses does not run a round per write). Returns (objects, bytes)
    /// evicted; the objects do not count those that only lost dynamic replicas.
    pub fn evict_round(&self, req: RoundRequest) -> (u64, u64) {
        if !self.is_serving() {
            return (0, 0);
        }
        let now = self.now();
        let (mut objects, mut bytes, mut ran) = (0, 0, false);
        for group in self.serving().filter(|g| req.group.is_none_or(|r| r == g.rank())) {
            if let Some((o, b)) = self.evict_group(group, req, now) {
                objects += o;
                bytes += b;
                ran = true;
            }
        }
        if !ran {
            // Nothing was evictable anywhere: no round.
            return (0, 0);
        }
        self.counters.eviction_rounds.fetch_add(1, Ordering::Relaxed);
        // (Dynamic replicas dropped are counted by `shrink`.)
        self.counters.evicted_objects.fetch_add(objects, Ordering::Relaxed);
        self.counters.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
        (objects, bytes)
    }

    /// [`Master::evict_round`]'s work in one group: use numbers and lifetimes are the group's own.
    /// `None` when nothing in it was evictable.
    fn evict_group(&self, group: &Group, req: RoundRequest, now: u64) -> Option<(u64, u64)> {
        let policy = self.cfg.eviction_policy;
        let lifetime = group.uses.lifetime();
        let mut dynamic: Vec<Candidate> = Vec::new();
        let mut plain: Vec<Candidate> = Vec::new();
        let mut pinned: Vec<Candidate> = Vec::new();
        for (shard, map) in group.shards.iter().enumerate() {
            let map = map.read();
            for (k, o) in map.iter() {
                if !o.is_complete() || o.pending.is_some() || o.is_leased(now) {
                    continue;
                }
                let mark = o.used.get();
                // Use numbers are unique in a group: with them ties of rank break the same way
                // every time.
                let rank = (policy.rank(mark, lifetime), mark.seq);
                if shrinks(o) {
                    // (A replica on a dead segment frees nothing.)
                    let n = o.replicas.iter().filter(|r| r.is_dynamic() && r.seg.is_alive()).count() as u64;
                    dynamic.push(Candidate { rank, shard, key: k.clone(), bytes: o.size * n, shrink: true });
                    continue;
                }
                if o.hard_pin {
                    continue;
                }
                let list = if o.is_soft_pinned(now) { &mut pinned } else { &mut plain };
                let bytes = o.size * o.replicas.len() as u64;
                list.push(Candidate { rank, shard, key: k.clone(), bytes, shrink: false });
            }
        }
        let evictable = dynamic.len() + plain.len() + pinned.len();
        if evictable == 0 {
            return None;
        }
        let by_ratio =
            if req.watermark { ((evictable as f64 * self.cfg.eviction_ratio).ceil() as usize).max(1) } else { 0 };
        let (capacity, _) = group.segments.usage();
        let bytes_goal = if req.bytes > 0 { req.bytes.max(capacity / 100) } else { 0 };
        if !self.cfg.allow_evict_soft_pinned_objects {
            pinned.clear();
        }
        dynamic.sort_unstable_by_key(|c| c.rank);
        plain.sort_unstable_by_key(|c| c.rank);
        pinned.sort_unstable_by_key(|c| c.rank);
        let mut victims = Vec::new();
        let mut goal_bytes = 0u64;
        let reason = if req.bytes > 0 { EvictReason::Allocation } else { EvictReason::Watermark };
        let by_queue = &self.counters.evicted_by[reason as usize];
        for c in dynamic.into_iter().chain(plain).chain(pinned) {
            if victims.len() >= by_ratio && goal_bytes >= bytes_goal {
                break;
            }
            goal_bytes += c.bytes;
            victims.push(c);
        }
        victims.sort_by_key(|c| c.shard);
        let (mut objects, mut bytes) = (0, 0);
        let mut gone = Vec::new();
        for run in victims.chunk_by(|a, b| a.shard == b.shard) {
            for chunk in run.chunks(SWEEP_BATCH) {
                let mut map = group.shards.shard(chunk[0].shard).write();
                for c in chunk {
                    if c.shrink {
                        bytes += self.shrink(&mut map, &c.key, now);
                        continue;
                    }
                    // Re-check: a reader or writer may have arrived since the scan.
                    let mark = map
                        .get(&c.key)
                        .filter(|o| o.is_complete() && o.pending.is_none() && !o.hard_pin && !o.is_leased(now))
                        .map(|o| (o.used.get(), o.is_soft_pinned(now)));
                    if let Some((mark, soft_pinned)) = mark {
                        let k = &c.key;
                        self.log(|| Record::Remove { key: k.to_vec(), at_ms: self.unix_time(now), evicted: true });
                        if let Some((size, replicas)) = self.apply_remove(&mut map, k, now) {
                            bytes += size * replicas as u64;
                            objects += 1;
                            gone.push(mark);
                            let queue = match (soft_pinned, mark.reads) {
                                (true, _) => EvictQueue::SoftPinned,
                                (false, 0) => EvictQueue::Unread,
                                (false, _) => EvictQueue::Read,
                            };
                            by_queue[queue as usize].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        group.uses.evicted(gone);
        Some((objects, bytes))
    }
}

impl Master {
    /// Drops the dynamic replicas of `key` (checked again: a reader or writer may have arrived
    /// since the scan) and starts its cooldown. Returns the bytes freed.
    fn shrink(&self, map: &mut ShardMap, key: &[u8], now: u64) -> u64 {
        let Some(o) = map.get(key).filter(|o| o.pending.is_none() && !o.is_leased(now) && shrinks(o)) else {
            return 0;
        };
        let freed = o.size * o.replicas.iter().filter(|r| r.is_dynamic() && r.seg.is_alive()).count() as u64;
        let mut segments: Vec<SegmentId> =
            o.replicas.iter().filter(|r| r.is_dynamic()).map(|r| r.seg.desc.id).collect();
        segments.sort_unstable();
        segments.dedup();
        let mut dropped = 0u64;
        for segment in segments {
            self.log(|| Record::DropReplicas { key: key.to_vec(), segment });
            dropped += self.apply_drop_replicas(map, key, segment, now) as u64;
        }
        let until = now + self.cfg.fanout.cooldown_ms;
        self.log(|| Record::Cooldown { key: key.to_vec(), until_ms: self.unix_time(until) });
        self.apply_cooldown(map, key, until);
        self.fanout.shrunk.fetch_add(dropped, Ordering::Relaxed);
        freed
    }
}

/// What `list_keys` and `query_key` report for one object.
/// Tag of the tenant of an encoded object key, as capabilities carry it.
pub(crate) fn tenant_of(key: &[u8]) -> u64 {
    decode_object_key(key).map_or(0, |(t, _)| tenant_tag(t))
}

fn key_info(tenant: &str, key: &str, o: &ObjectMeta, now: u64) -> KeyInfo {
    KeyInfo {
        tenant: tenant.to_string(),
        key: key.to_string(),
        size: o.pending.as_ref().filter(|_| !o.is_complete()).map_or(o.size, |p| p.size),
        replicas: o.replicas.len() as u32,
        complete: o.is_complete(),
        lease_remaining_ms: o.lease().saturating_sub(now),
        soft_pinned: o.is_soft_pinned(now),
        hard_pinned: o.hard_pin,
    }
}

/// Where a page of a key listing ends: a shard and the last encoded key taken from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyCursor {
    /// Shard index.
    pub shard: u32,
    /// Last encoded key (tenant and key) taken from that shard.
    pub key: Vec<u8>,
}

impl KeyCursor {
    /// Parses the text form `<shard>.<hex of the encoded key>`.
    pub fn parse(s: &str) -> Option<KeyCursor> {
        let (shard, hex) = s.split_once('.')?;
        let shard: u32 = shard.parse().ok()?;
        if hex.len() % 2 != 0 || hex.len() > 2 * (tycho_proto::MAX_KEY_LEN + tycho_proto::MAX_TENANT_LEN + 4) {
            return None;
        }
        let key = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect::<Option<_>>()?;
        Some(KeyCursor { shard, key })
    }
}

impl std::fmt::Display for KeyCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.shard, tycho_proto::auth::hex(&self.key))
    }
}

/// How often the RPC runtime notes that it runs ([`Master::note_responsive`]).
pub const RESPONSIVE_INTERVAL_MS: u64 = 100;
/// A gap this long in those notes counts as the master's own stall.
pub const STALL_MS: u64 = 1_000;

/// Longest regular expression a listing or a removal by pattern accepts, in bytes.
pub const MAX_REGEX_LEN: usize = 1024;
/// Memory one compiled regular expression, and its lazy DFA, may use.
const REGEX_SIZE_LIMIT: usize = 1 << 20;
/// Most keys one listing answers.
pub const MAX_LIST_KEYS: usize = 10_000;
/// Most key bytes one listing answers (well inside the 64 MiB frame).
pub const MAX_LIST_BYTES: usize = 16 << 20;

/// Compiles `pattern` to match whole keys. The pattern is checked on its own first: wrapped,
/// an unbalanced one such as `a)|(.*` would compile and match far more than a whole key. Both
/// compile within bounded memory; the engine matches in time linear in the key.
fn whole_key_regex(pattern: &str) -> WireResult<regex::Regex> {
    if pattern.len() > MAX_REGEX_LEN {
        return Err(ErrorCode::INVALID_PARAMS);
    }
    let build = |p: &str| {
        regex::RegexBuilder::new(p)
            .size_limit(REGEX_SIZE_LIMIT)
            .dfa_size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map_err(|_| ErrorCode::INVALID_PARAMS)
    };
    build(pattern)?;
    build(&format!("^(?:{pattern})$"))
}

/// The use numbers of a batch's keys: each group's are taken in one step when the batch first
/// meets the group, and given out back to front (the batch's last key gets the lowest), so that
/// eviction takes the end of a prefix chain before its start (see [`crate::state::policy`]).
struct BatchUses {
    len: usize,
    /// The group whose numbers were taken last, and the first of them.
    taken: Option<(u32, u64)>,
}

impl BatchUses {
    fn new(len: usize) -> BatchUses {
        BatchUses { len, taken: None }
    }

    /// The use number of the batch's key `i`, of `group`. Keys come group by group.
    fn of(&mut self, group: &Group, i: usize) -> u64 {
        let base = match self.taken {
            Some((rank, base)) if rank == group.rank() => base,
            _ => {
                let base = group.uses.reserve(self.len);
                self.taken = Some((group.rank(), base));
                base
            }
        };
        base + (self.len - 1 - i) as u64
    }
}

/// An eviction candidate of one group.
struct Candidate {
    /// Its place in the policy's order (lowest first), then its use number.
    rank: (u64, u64),
    /// Its shard in the group.
    shard: usize,
    key: ObjectKey,
    /// Bytes evicting it frees.
    bytes: u64,
    /// Whether only its dynamic replicas go.
    shrink: bool,
}

/// Whether eviction would drop only `o`'s dynamic replicas: it has some, and a replica that is
/// not dynamic stays.
fn shrinks(o: &ObjectMeta) -> bool {
    let live = |r: &&Replica| r.seg.is_alive();
    o.replicas.iter().filter(live).any(Replica::is_dynamic) && o.replicas.iter().filter(live).any(|r| !r.is_dynamic())
}

/// The ranges of `client`'s pending write `write_id` of `key`, if that write is in progress (its
/// start is being retried).
fn retried_start(
    map: &ShardMap,
    key: &ObjectKey,
    client: ClientId,
    write_id: u64,
    grant: impl FnOnce() -> Grant,
) -> Option<Vec<ReplicaDesc>> {
    let p =
        map.get(key)?.pending.as_ref().filter(|p| p.writer == client && p.write_id == write_id && p.copy.is_none())?;
    let grant = grant();
    Some(p.replicas.iter().map(|r| r.desc(p.size, &grant)).collect())
}

/// Splits routed keys (already sorted by shard) into runs of one shard each.
fn group_by_shard(routed: Vec<(usize, Routed)>) -> Vec<Vec<(usize, Routed)>> {
    let mut runs: Vec<Vec<(usize, Routed)>> = Vec::new();
    for item in routed {
        match runs.last_mut() {
            Some(run) if (run[0].1.group, run[0].1.shard) == (item.1.group, item.1.shard) => run.push(item),
            _ => runs.push(vec![item]),
        }
    }
    runs
}

/// Object figures for metrics, gathered without waiting on any lock.
#[derive(Debug, Default, Clone, Copy)]
pub struct ObjectGauges {
    /// Objects (complete or being written).
    pub keys: u64,
    /// Objects under a read lease.
    pub leased: u64,
    /// Objects with a soft pin in force.
    pub soft_pinned: u64,
    /// Hard-pinned objects.
    pub hard_pinned: u64,
    /// Shards skipped because a writer held them.
    pub shards_skipped: u64,
    /// Bytes the eviction policy keeps: a use mark per object and each group's counters.
    pub policy_bytes: u64,
}

impl Master {
    /// Counts objects, leases and pins, skipping any shard that is write-locked right now, so
    /// that a metrics scrape never waits behind a sweep.
    pub fn object_gauges(&self) -> ObjectGauges {
        let now = self.now();
        let mut g = ObjectGauges::default();
        // Every group held, replayed ones too: a standby reports what it would serve.
        for shard in self.groups().flat_map(|g| g.shards.iter()) {
            let Some(map) = shard.try_read() else {
                g.shards_skipped += 1;
                continue;
            };
            g.keys += map.len() as u64;
            for o in map.values() {
                g.leased += u64::from(o.is_leased(now));
                g.soft_pinned += u64::from(o.is_soft_pinned(now));
                g.hard_pinned += u64::from(o.hard_pin);
            }
        }
        let mark = std::mem::size_of::<crate::state::policy::UseMark>() as u64;
        let group = std::mem::size_of::<crate::state::policy::Uses>() as u64;
        g.policy_bytes = g.keys * mark + self.groups().count() as u64 * group;
        g
    }

    /// Live clients.
    pub fn client_count(&self) -> u64 {
        self.clients.read().len() as u64
    }
}
