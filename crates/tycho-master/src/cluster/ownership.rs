//! Who serves a KVPT group: the ownership records and master registrations in the coordination
//! store, and the rules by which each master decides its own role from them.
//!
//! ```text
//! /tycho/{cluster}/kvpt_groups/{rank:05}   GroupRecord (not leased: the epoch outlives its primary)
//! /tycho/{cluster}/masters/{id}            MasterRegistration (leased: gone when its master is)
//! ```
//!
//! A group record is created only if absent and changed only by a compare-and-swap on the
//! revision it was read at, each change raising its epoch by one; so of any number of masters
//! acting on the same view, one wins and the others learn the new record. Records are sealed in
//! the versioned, checksummed envelope. The rules by which each master decides its roles from
//! them are in [`crate::cluster::cvm`].

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_meta::{LeaseId, MetaError, MetaStore, RangeRequest, Revision};
use tycho_proto::envelope::{self, RecordKind};

pub use crate::log::fence::{GroupRecord, GroupState, OwnershipError, GROUP_RECORD_VERSION};
pub use tycho_proto::cluster::OWNERSHIP_VERSION;

/// Layout version of the cluster's layout record.
pub const CLUSTER_META_VERSION: u16 = 2;

/// Where a cluster's records live.
#[derive(Debug, Clone)]
pub struct ClusterKeys {
    root: String,
}

impl ClusterKeys {
    /// The records of cluster `name`.
    pub fn new(name: &str) -> ClusterKeys {
        ClusterKeys { root: format!("/tycho/{name}/") }
    }

    /// Group `rank`'s ownership record.
    pub fn group(&self, rank: u32) -> Vec<u8> {
        format!("{}kvpt_groups/{rank:05}", self.root).into_bytes()
    }

    /// Every master registration.
    pub fn masters(&self) -> Vec<u8> {
        format!("{}masters/", self.root).into_bytes()
    }

    /// Master `id`'s registration.
    pub fn master(&self, id: &str) -> Vec<u8> {
        format!("{}masters/{id}", self.root).into_bytes()
    }

    /// The cluster's layout record (its group count).
    pub fn meta(&self) -> Vec<u8> {
        format!("{}cluster_meta", self.root).into_bytes()
    }

    /// Every group's ownership record.
    pub fn groups(&self) -> Vec<u8> {
        format!("{}kvpt_groups/", self.root).into_bytes()
    }

    /// Group `rank`'s snapshot pointers.
    pub fn snapshots(&self, rank: u32) -> Vec<u8> {
        format!("{}snapshots/{rank:05}", self.root).into_bytes()
    }

    /// Every group's snapshot pointers.
    pub fn all_snapshots(&self) -> Vec<u8> {
        format!("{}snapshots/", self.root).into_bytes()
    }

    /// Stable segment `id`'s descriptor.
    pub fn segment(&self, id: tycho_proto::SegmentId) -> Vec<u8> {
        format!("{}segments/{id}", self.root).into_bytes()
    }

    /// Every stable segment's descriptor.
    pub fn segments(&self) -> Vec<u8> {
        format!("{}segments/", self.root).into_bytes()
    }

    /// The static VSegment quota, written once by `tycho plan-quota`.
    pub fn quota(&self) -> Vec<u8> {
        format!("{}vsegment/partition-quota/current", self.root).into_bytes()
    }

    /// The cluster's name as it appears in keys.
    pub fn cluster(&self) -> &str {
        self.root.trim_start_matches("/tycho/").trim_end_matches('/')
    }
}

/// The layout of a cluster, fixed when its first master creates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMeta {
    /// The number of KVPT groups G.
    pub groups: u32,
    /// When the cluster was created, in Unix seconds: its groups' epochs start at
    /// [`tycho_routing::first_epoch`] of it, above every epoch of a cluster of the same name
    /// started over before. 0 in a record of version 1 (epochs then start at 1).
    pub incarnation: u64,
}

/// Version 1 of the record, before incarnations.
#[derive(Deserialize)]
struct ClusterMetaV1 {
    groups: u32,
}

pub use tycho_proto::cluster::{MasterRegistration, Role};

impl ClusterMeta {
    /// A new cluster's record: G and this moment as its incarnation.
    pub fn new(groups: u32) -> ClusterMeta {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        ClusterMeta { groups, incarnation: now.max(1) }
    }

    /// The record as stored.
    pub fn encode(&self) -> Vec<u8> {
        envelope::seal(
            RecordKind::ClusterMeta,
            CLUSTER_META_VERSION,
            &postcard::to_stdvec(self).expect("records serialize"),
        )
    }

    /// Reads a stored record (of this version or version 1); refuses a newer version or damaged
    /// bytes.
    pub fn decode(bytes: &[u8]) -> Result<ClusterMeta, OwnershipError> {
        let (version, payload) = envelope::open(RecordKind::ClusterMeta, CLUSTER_META_VERSION, bytes)
            .map_err(|e| OwnershipError::Corrupt(e.to_string()))?;
        let corrupt = |e: postcard::Error| OwnershipError::Corrupt(e.to_string());
        match version {
            1 => postcard::from_bytes::<ClusterMetaV1>(payload)
                .map(|v1| ClusterMeta { groups: v1.groups, incarnation: 0 })
                .map_err(corrupt),
            _ => postcard::from_bytes(payload).map_err(corrupt),
        }
    }

    /// The epoch every group of this cluster starts at.
    pub fn first_epoch(&self) -> u64 {
        tycho_routing::first_epoch(self.incarnation)
    }
}

/// The cluster's record, if it has one.
pub async fn cluster_meta(store: &dyn MetaStore, keys: &ClusterKeys) -> Result<Option<ClusterMeta>, OwnershipError> {
    match store.get(&keys.meta()).await.map_err(store_error)?.kv {
        Some(kv) => ClusterMeta::decode(&kv.value).map(Some),
        None => Ok(None),
    }
}

/// Why a master cannot join a cluster as configured.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum LayoutError {
    /// The cluster was created with another group count.
    #[error("the cluster has {stored} KVPT groups, not {wanted}: G is fixed when the cluster is created (omit --kvpt-groups to adopt it)")]
    GroupCount {
        /// G as stored.
        stored: u32,
        /// G as given.
        wanted: u32,
    },
    /// G is out of range.
    #[error("--kvpt-groups must be between 1 and {max}, not {0}", max = tycho_routing::PARTITION_COUNT)]
    OutOfRange(u32),
    /// The store failed or a record is unreadable.
    #[error(transparent)]
    Ownership(#[from] OwnershipError),
}

/// The cluster's group count G: as stored in `cluster_meta`; or, for a cluster without that
/// record, 1 when it has group records already (a cluster made before the record existed), else
/// `wanted` (default 1), which this call stores: the first master fixes G. A master `wanted`
/// another G than the stored one is refused.
pub async fn cluster_groups(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    wanted: Option<u32>,
) -> Result<u32, LayoutError> {
    if let Some(g) = wanted.filter(|g| !(1..=tycho_routing::PARTITION_COUNT).contains(g)) {
        return Err(LayoutError::OutOfRange(g));
    }
    let check = |stored: u32| match wanted {
        Some(w) if w != stored => Err(LayoutError::GroupCount { stored, wanted: w }),
        _ => Ok(stored),
    };
    loop {
        if let Some(kv) = store.get(&keys.meta()).await.map_err(store_error)?.kv {
            return check(ClusterMeta::decode(&kv.value)?.groups);
        }
        let legacy = !store.range(RangeRequest::prefix(keys.groups(), 1)).await.map_err(store_error)?.kvs.is_empty();
        let groups = if legacy { 1 } else { wanted.unwrap_or(1) };
        match store.create_if_absent(&keys.meta(), &ClusterMeta::new(groups).encode(), None).await {
            Ok(_) => return check(groups),
            // Another master stored it first: read it.
            Err(MetaError::CompareFailed { .. }) => continue,
            Err(e) => return Err(store_error(e).into()),
        }
    }
}

fn store_error(e: MetaError) -> OwnershipError {
    OwnershipError::Store(e.to_string())
}

/// The conflict answer for a compare that failed, with the record as it is now.
fn conflict(e: MetaError) -> OwnershipError {
    match e {
        MetaError::CompareFailed { current, .. } => match current {
            None => OwnershipError::Conflict(None),
            Some(kv) => match GroupRecord::decode(&kv.value) {
                Ok(r) => OwnershipError::Conflict(Some(Box::new((r, kv.mod_revision)))),
                Err(e) => e,
            },
        },
        e => store_error(e),
    }
}

/// Group `rank`'s record and the revision it was read at, if it exists.
pub async fn read_group(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    rank: u32,
) -> Result<Option<(GroupRecord, Revision)>, OwnershipError> {
    match store.get(&keys.group(rank)).await.map_err(store_error)?.kv {
        None => Ok(None),
        Some(kv) => Ok(Some((GroupRecord::decode(&kv.value)?, kv.mod_revision))),
    }
}

/// Creates group `rank` with `primary` at the cluster's first epoch (1 without a
/// `cluster_meta` record, or with one of version 1), only if it does not exist.
pub async fn create_group(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    rank: u32,
    primary: &str,
    caretaken: bool,
) -> Result<(GroupRecord, Revision), OwnershipError> {
    let epoch = cluster_meta(store, keys).await?.map_or(tycho_routing::INITIAL_GROUP_EPOCH, |m| m.first_epoch());
    let record = GroupRecord {
        rank,
        primary: primary.to_string(),
        standbys: Vec::new(),
        state: GroupState::Stable,
        migrating_to: None,
        epoch,
        caretaken,
    };
    let rev = store.create_if_absent(&keys.group(rank), &record.encode(), None).await.map_err(conflict)?;
    Ok((record, rev))
}

/// Changes who serves a group, from its record read at `read.1`: `change` edits it and the
/// epoch rises by one, which fences the old primary's log. Fails with the current record if
/// anyone changed it since.
pub async fn change_group(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    read: &(GroupRecord, Revision),
    change: impl FnOnce(&mut GroupRecord),
) -> Result<(GroupRecord, Revision), OwnershipError> {
    let mut next = read.0.clone();
    change(&mut next);
    next.rank = read.0.rank;
    next.epoch = read.0.epoch + 1;
    let rev = store.compare_and_swap(&keys.group(read.0.rank), read.1, &next.encode(), None).await.map_err(conflict)?;
    Ok((next, rev))
}

/// Changes the standbys of a group record read at `read.1`, keeping its primary, state and
/// epoch (the primary's log goes on committing). Fails with the current record if anyone
/// changed it since.
pub async fn change_standbys(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    read: &(GroupRecord, Revision),
    change: impl FnOnce(&mut Vec<String>),
) -> Result<(GroupRecord, Revision), OwnershipError> {
    let mut next = read.0.clone();
    change(&mut next.standbys);
    swap(store, keys, read, next).await
}

/// Sets a group record read at `read.1` migrating towards `target` (`Some`, which joins no
/// list), or back to stable (`None`, with the target that was on its way dropped from the
/// standbys), keeping its primary and epoch: the primary stays primary, and its log goes on
/// committing, until the target's promotion raises the epoch. Fails with the current record
/// if anyone changed it since.
pub async fn set_migrating(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    read: &(GroupRecord, Revision),
    target: Option<&str>,
) -> Result<(GroupRecord, Revision), OwnershipError> {
    let mut next = read.0.clone();
    match target {
        Some(t) => {
            next.state = GroupState::Migrating;
            next.migrating_to = Some(t.to_string());
        }
        None => {
            if let Some(t) = next.migrating_to.take() {
                next.standbys.retain(|s| *s != t);
            }
            next.state = GroupState::Stable;
        }
    }
    swap(store, keys, read, next).await
}

/// Writes `next` over the record read at `read.1`, its epoch kept.
async fn swap(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    read: &(GroupRecord, Revision),
    mut next: GroupRecord,
) -> Result<(GroupRecord, Revision), OwnershipError> {
    next.rank = read.0.rank;
    next.epoch = read.0.epoch;
    let rev = store.compare_and_swap(&keys.group(read.0.rank), read.1, &next.encode(), None).await.map_err(conflict)?;
    Ok((next, rev))
}

/// Registers (or re-registers) a master under `lease`.
pub async fn register(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    reg: &MasterRegistration,
    lease: LeaseId,
) -> Result<Revision, OwnershipError> {
    store.put(&keys.master(&reg.id), &reg.encode(), Some(lease)).await.map_err(store_error)
}

/// Every live registration with its create revision, oldest first.
pub async fn masters(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
) -> Result<Vec<(MasterRegistration, Revision)>, OwnershipError> {
    let mut req = RangeRequest::prefix(keys.masters(), 256);
    let mut out = Vec::new();
    loop {
        let page = store.range(req.clone()).await.map_err(store_error)?;
        for kv in &page.kvs {
            // One unreadable registration (a newer build's, a hand-written key) must not stop
            // every master: it is not counted as a live master.
            match MasterRegistration::decode(&kv.value) {
                Ok(reg) => out.push((reg, kv.create_revision)),
                Err(e) => {
                    tracing::warn!(key = %String::from_utf8_lossy(&kv.key), error = %e, "skipping an unreadable master registration")
                }
            }
        }
        match req.next_page(&page) {
            Some(next) => req = next,
            None => break,
        }
    }
    out.sort_by_key(|(r, rev)| (*rev, r.id.clone()));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(id: &str) -> MasterRegistration {
        MasterRegistration { id: id.into(), address: format!("{id}:1"), role: Role::Idle, registered_at_ms: 1 }
    }

    fn group(primary: &str, standbys: &[&str]) -> GroupRecord {
        GroupRecord {
            rank: 0,
            primary: primary.into(),
            standbys: standbys.iter().map(|s| s.to_string()).collect(),
            state: GroupState::Stable,
            migrating_to: None,
            epoch: 3,
            caretaken: false,
        }
    }

    #[test]
    fn records_are_sealed_and_refuse_damage() {
        let g = group("a", &["b"]);
        assert_eq!(GroupRecord::decode(&g.encode()), Ok(g.clone()));
        let mut bad = g.encode();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(matches!(GroupRecord::decode(&bad), Err(OwnershipError::Corrupt(_))));
        let r = reg("a");
        assert_eq!(MasterRegistration::decode(&r.encode()), Ok(r));
        let newer = envelope::seal(RecordKind::Ownership, GROUP_RECORD_VERSION + 1, &postcard::to_stdvec(&g).unwrap());
        assert!(matches!(GroupRecord::decode(&newer), Err(OwnershipError::Corrupt(_))));
        // A first-version record (before caretaking) reads as not caretaken.
        #[derive(Serialize)]
        struct V1<'a>(u32, &'a str, &'a [String], GroupState, Option<String>, u64);
        let v1 = V1(g.rank, &g.primary, &g.standbys, g.state, None, g.epoch);
        let old = envelope::seal(RecordKind::Ownership, 1, &postcard::to_stdvec(&v1).unwrap());
        assert_eq!(GroupRecord::decode(&old), Ok(g.clone()));
        // And one that is not caretaken is written so, for builds from before caretaking.
        assert_eq!(g.encode(), old);
        let cg = GroupRecord { caretaken: true, ..g };
        assert_eq!(envelope::open(RecordKind::Ownership, GROUP_RECORD_VERSION, &cg.encode()).unwrap().0, 2);
        assert_eq!(GroupRecord::decode(&cg.encode()), Ok(cg));
        let meta = ClusterMeta::new(4);
        assert_eq!(ClusterMeta::decode(&meta.encode()), Ok(meta));
        assert!(meta.first_epoch() > u64::from(u32::MAX), "an incarnation's epochs are above any of version 1");
        // A version 1 record (before incarnations) reads with none: epochs start at 1.
        let v1 = envelope::seal(RecordKind::ClusterMeta, 1, &postcard::to_stdvec(&4u32).unwrap());
        let old = ClusterMeta::decode(&v1).unwrap();
        assert_eq!((old, old.first_epoch()), (ClusterMeta { groups: 4, incarnation: 0 }, 1));
        // A newer version is refused.
        let v3 = envelope::seal(RecordKind::ClusterMeta, 3, &postcard::to_stdvec(&meta).unwrap());
        assert!(matches!(ClusterMeta::decode(&v3), Err(OwnershipError::Corrupt(_))));
        assert!(ClusterMeta::decode(&reg("a").encode()).is_err(), "another kind of record is refused");
    }
}
