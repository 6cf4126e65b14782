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
//! the versioned, checksummed envelope. The rules ([`decide`]) are a pure function of the
//! registrations and the record, so every master reaches the same conclusion from the same
//! state: the first master creates the group and is its primary; the next one becomes its
//! standby; later ones wait idle; when the primary's registration is gone, its standby promotes
//! itself (or, with no standby, the oldest idle master takes the group over).

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_meta::{LeaseId, MetaError, MetaStore, RangeRequest, Revision};
use tycho_proto::envelope::{self, RecordKind};

pub use tycho_proto::cluster::OWNERSHIP_VERSION;

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

    /// Group `rank`'s snapshot pointers.
    pub fn snapshots(&self, rank: u32) -> Vec<u8> {
        format!("{}snapshots/{rank:05}", self.root).into_bytes()
    }

    /// The cluster's name as it appears in keys.
    pub fn cluster(&self) -> &str {
        self.root.trim_start_matches("/tycho/").trim_end_matches('/')
    }
}

/// A group's ownership state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupState {
    /// Served by its primary.
    Stable,
    /// Moving to `migrating_to` (the reshard issue).
    Migrating,
}

/// Who serves a group, at which epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// The group.
    pub rank: u32,
    /// The master that serves it.
    pub primary: String,
    /// Masters that replay its log, ready to take over.
    pub standbys: Vec<String>,
    /// Stable or migrating.
    pub state: GroupState,
    /// The target of a migration in progress.
    pub migrating_to: Option<String>,
    /// Raised by one whenever who serves the group changes (primary, state, migration
    /// target); a change of the standbys alone keeps it. Requests and capabilities carry it,
    /// and the primary's OpLog commits only while the record names it at its epoch.
    pub epoch: u64,
}

pub use tycho_proto::cluster::{MasterRegistration, Role};

/// Why an ownership call failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum OwnershipError {
    /// The record changed since it was read: here it is now (`None`: absent).
    #[error("the group record changed since it was read")]
    Conflict(Option<Box<(GroupRecord, Revision)>>),
    /// A record cannot be read as this build writes it.
    #[error("unreadable ownership record: {0}")]
    Corrupt(String),
    /// The store failed.
    #[error("coordination store: {0}")]
    Store(String),
}

fn seal<T: Serialize>(value: &T) -> Vec<u8> {
    envelope::seal(RecordKind::Ownership, OWNERSHIP_VERSION, &postcard::to_stdvec(value).expect("records serialize"))
}

fn open<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, OwnershipError> {
    let (_, payload) = envelope::open(RecordKind::Ownership, OWNERSHIP_VERSION, bytes)
        .map_err(|e| OwnershipError::Corrupt(e.to_string()))?;
    postcard::from_bytes(payload).map_err(|e| OwnershipError::Corrupt(e.to_string()))
}

impl GroupRecord {
    /// The record as stored.
    pub fn encode(&self) -> Vec<u8> {
        seal(self)
    }

    /// Reads a stored record.
    pub fn decode(bytes: &[u8]) -> Result<GroupRecord, OwnershipError> {
        open(bytes)
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

/// Creates group `rank` with `primary` at epoch 1, only if it does not exist.
pub async fn create_group(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    rank: u32,
    primary: &str,
) -> Result<(GroupRecord, Revision), OwnershipError> {
    let record = GroupRecord {
        rank,
        primary: primary.to_string(),
        standbys: Vec::new(),
        state: GroupState::Stable,
        migrating_to: None,
        epoch: 1,
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

/// What a master should do about a group, by the rules every master applies alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The group does not exist and this is the oldest live master: create it as its primary.
    Create,
    /// This master is the group's primary and holds its state: serve it.
    Serve,
    /// This master is named the group's primary but holds none of its state (it restarted):
    /// hand the group to this live standby, which has it (epoch + 1).
    HandTo(String),
    /// This master is a listed standby: replay the log.
    Follow,
    /// Join as the group's standby (it has none, and this is the oldest master without a role).
    JoinAsStandby,
    /// The primary is gone and this master should take the group over: it is the first live
    /// standby, or the group has no live standby and this is the oldest idle master (or the
    /// restarted primary itself), which restores it from snapshot and log first.
    TakeOver,
    /// Nothing to do now.
    Wait,
}

/// The decision of master `me` about a group, given the live registrations (oldest first), the
/// group's record, and whether `me` holds the group's state (it has served or followed it
/// since it started: a restarted master holds nothing).
pub fn decide(
    me: &str,
    live: &[(MasterRegistration, Revision)],
    group: Option<&GroupRecord>,
    holds_state: bool,
) -> Decision {
    let alive = |id: &str| live.iter().any(|(r, _)| r.id == id);
    let Some(g) = group else {
        return if live.first().is_some_and(|(r, _)| r.id == me) { Decision::Create } else { Decision::Wait };
    };
    let live_standbys: Vec<&String> = g.standbys.iter().filter(|s| alive(s)).collect();
    if g.primary == me {
        return match (holds_state, live_standbys.iter().find(|s| s.as_str() != me)) {
            (true, _) => Decision::Serve,
            (false, Some(s)) => Decision::HandTo(s.to_string()),
            (false, None) => Decision::TakeOver,
        };
    }
    if !alive(&g.primary) {
        // The first live standby promotes; without one, the oldest live master not in the
        // record takes over (from snapshot and log).
        let heir = match live_standbys.first() {
            Some(s) => Some(s.as_str()),
            None => live.iter().map(|(r, _)| r.id.as_str()).find(|id| *id != g.primary),
        };
        return if heir == Some(me) { Decision::TakeOver } else { Decision::Wait };
    }
    if g.standbys.iter().any(|s| s == me) {
        return Decision::Follow;
    }
    if live_standbys.is_empty() {
        let first_free =
            live.iter().map(|(r, _)| r.id.as_str()).find(|id| *id != g.primary && !g.standbys.iter().any(|s| s == id));
        if first_free == Some(me) {
            return Decision::JoinAsStandby;
        }
    }
    Decision::Wait
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(id: &str) -> MasterRegistration {
        MasterRegistration { id: id.into(), address: format!("{id}:1"), role: Role::Idle, registered_at_ms: 1 }
    }

    fn live(ids: &[&str]) -> Vec<(MasterRegistration, Revision)> {
        ids.iter().enumerate().map(|(i, id)| (reg(id), i as Revision + 10)).collect()
    }

    fn group(primary: &str, standbys: &[&str]) -> GroupRecord {
        GroupRecord {
            rank: 0,
            primary: primary.into(),
            standbys: standbys.iter().map(|s| s.to_string()).collect(),
            state: GroupState::Stable,
            migrating_to: None,
            epoch: 3,
        }
    }

    #[test]
    fn every_master_reaches_the_same_roles() {
        let all = live(&["a", "b", "c"]);
        // No group yet: only the oldest creates it.
        assert_eq!(decide("a", &all, None, false), Decision::Create);
        assert_eq!(decide("b", &all, None, false), Decision::Wait);
        // A primary without a standby: the oldest master without a role joins.
        let g = group("a", &[]);
        assert_eq!(decide("a", &all, Some(&g), true), Decision::Serve);
        assert_eq!(decide("b", &all, Some(&g), true), Decision::JoinAsStandby);
        assert_eq!(decide("c", &all, Some(&g), true), Decision::Wait);
        // With a standby, later masters wait idle.
        let g = group("a", &["b"]);
        assert_eq!(decide("b", &all, Some(&g), true), Decision::Follow);
        assert_eq!(decide("c", &all, Some(&g), true), Decision::Wait);
        // The primary dies: its standby takes over, nobody else.
        let without_a = live(&["b", "c"]);
        assert_eq!(decide("b", &without_a, Some(&g), true), Decision::TakeOver);
        assert_eq!(decide("c", &without_a, Some(&g), true), Decision::Wait);
        // The standby takes over even when an idle master registered before it.
        let c_then_b = vec![(reg("c"), 10), (reg("b"), 11)];
        assert_eq!(decide("b", &c_then_b, Some(&g), true), Decision::TakeOver);
        assert_eq!(decide("c", &c_then_b, Some(&g), true), Decision::Wait);
        // Primary and standby dead: the oldest live master takes over.
        assert_eq!(decide("c", &live(&["c", "d"]), Some(&g), true), Decision::TakeOver);
        assert_eq!(decide("d", &live(&["c", "d"]), Some(&g), true), Decision::Wait);
        // A restarted primary holds nothing: it hands the group to its live standby, or takes
        // it over itself (from snapshot and log) when it has none.
        assert_eq!(decide("a", &all, Some(&g), false), Decision::HandTo("b".into()));
        assert_eq!(decide("a", &live(&["a", "c"]), Some(&g), false), Decision::TakeOver);
        // A standby listed but dead does not count: a live master joins in its place.
        assert_eq!(decide("c", &live(&["a", "c"]), Some(&g), true), Decision::JoinAsStandby);
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
        let newer = envelope::seal(RecordKind::Ownership, OWNERSHIP_VERSION + 1, &postcard::to_stdvec(&g).unwrap());
        assert!(matches!(GroupRecord::decode(&newer), Err(OwnershipError::Corrupt(_))));
    }
}
