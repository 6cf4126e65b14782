//! Online reshard: an operator's request to move one KVPT group's metadata (never its bytes)
//! from its primary (the source) to another master (the target), kept in the coordination
//! store so that whoever received it may die without the move being lost or stuck.
//!
//! ```text
//! /tycho/{cluster}/reshard_intent/{rank:05}   ReshardIntent (not leased; one per group at most)
//! ```
//!
//! The steps, each a compare-and-swap on one record, so that a master that dies between two
//! leaves a state any other master knows how to finish or undo:
//!
//! 1. **Requested.** Any master writes the intent, only if the group has none, names the
//!    target, is stable and served by another master (its primary is recorded as the source).
//! 2. **Catch-up.** The target joins the group's standbys and replays its log while the source
//!    serves reads and writes as usual.
//! 3. **Barrier.** Caught up, the target sets the group record to `migrating` towards it (the
//!    epoch stays: the source is still primary and its log still commits).
//! 4. **Freeze.** The source sees it and admits no new write of the group (KVPT_MIGRATING);
//!    writes it admitted before still end or are revoked, and evictions and expiries go on. After
//!    a short grace it waits until its log holds all of that and marks the intent frozen at that
//!    log position.
//! 5. **Switch.** The target replays the log to that position and promotes itself (primary =
//!    target, stable, epoch + 1): from that revision the source's log commits nothing. The target
//!    replays whatever the source committed between freezing and the switch, takes over the
//!    read leases and write grants the source handed out (as any promotion does), and serves.
//! 6. **Clean-up.** The new primary deletes the intent; the source sees the record no longer
//!    names it and drops the group; the group's other standbys go on following the same log.
//!
//! It never stays stuck: the intent carries a deadline, and the freeze a shorter limit of its
//! own. Past either, or when the target is gone, the source lifts the freeze (the record goes
//! back to stable under it, same epoch) and deletes the intent; a failover of the group in the
//! meantime (its primary is no longer the intent's source) voids the intent the same way.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_meta::{MetaError, MetaStore, RangeRequest, Revision};
use tycho_proto::envelope::{self, RecordKind};

use crate::cluster::ownership::{masters, read_group, ClusterKeys, GroupState, OwnershipError};

/// Layout version of a reshard intent.
pub const RESHARD_INTENT_VERSION: u16 = 1;

/// How long a reshard may take, from the request to the switch, unless the request says
/// otherwise: past it, the reshard is abandoned and the group stays with its source.
pub const DEFAULT_RESHARD_DEADLINE_MS: u64 = 120_000;

/// How long the source lets writes admitted before the freeze end before it waits for its log
/// and marks the intent frozen. Writes that end later still end (at the source until the
/// switch, at the target after it, which replays their starts).
pub const FREEZE_GRACE: Duration = Duration::from_millis(50);

/// The longest a group's writes stay frozen: past it, the source lifts the freeze and the
/// reshard is abandoned. Clients retry KVPT_MIGRATING for longer than this.
pub const FREEZE_LIMIT: Duration = Duration::from_secs(5);

/// A request to move group `rank` from `source` to `target`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReshardIntent {
    /// The group.
    pub rank: u32,
    /// Its primary when the reshard was requested.
    pub source: String,
    /// The master it moves to.
    pub target: String,
    /// The group's epoch when it was requested: a request outlives no change of primary (a
    /// failover voids it, even one that comes back to the same master).
    pub epoch: u64,
    /// When it was requested (Unix ms, the requesting master's clock).
    pub requested_ms: u64,
    /// Past this (Unix ms), the reshard is abandoned.
    pub deadline_ms: u64,
    /// Set by the source once it admits no new writes and its log holds everything it
    /// admitted before: the log's durable position then.
    pub frozen_at: Option<u64>,
}

impl ReshardIntent {
    /// The record as stored.
    pub fn encode(&self) -> Vec<u8> {
        envelope::seal(
            RecordKind::ReshardIntent,
            RESHARD_INTENT_VERSION,
            &postcard::to_stdvec(self).expect("records serialize"),
        )
    }

    /// Reads a stored intent; refuses a newer version or damaged bytes.
    pub fn decode(bytes: &[u8]) -> Result<ReshardIntent, OwnershipError> {
        let (_, payload) = envelope::open(RecordKind::ReshardIntent, RESHARD_INTENT_VERSION, bytes)
            .map_err(|e| OwnershipError::Corrupt(e.to_string()))?;
        postcard::from_bytes(payload).map_err(|e| OwnershipError::Corrupt(e.to_string()))
    }

    /// Whether its deadline has passed at `now_ms` (Unix ms).
    pub fn expired(&self, now_ms: u64) -> bool {
        now_ms >= self.deadline_ms
    }
}

/// Why a reshard request was refused.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ReshardError {
    /// No such group (yet).
    #[error("group {0} does not exist")]
    NoGroup(u32),
    /// The target is not a live master of the cluster.
    #[error("{0} is not a live master of this cluster")]
    UnknownTarget(String),
    /// The target serves the group already.
    #[error("{target} is group {rank}'s primary already")]
    AlreadyThere {
        /// The group.
        rank: u32,
        /// Its primary.
        target: String,
    },
    /// The group is moving already (one reshard per group at a time).
    #[error("group {} is moving to {} already", .0.rank, .0.target)]
    InProgress(Box<ReshardIntent>),
    /// The target is taking another group already (one move towards a master at a time).
    #[error("{} is taking group {} already; one move towards a master at a time", .0.target, .0.rank)]
    TargetBusy(Box<ReshardIntent>),
    /// The group record is migrating without an intent (a reshard being undone): try again.
    #[error("group {0} is not stable; try again")]
    NotStable(u32),
    /// The store failed or a record is unreadable.
    #[error(transparent)]
    Ownership(#[from] OwnershipError),
}

impl ClusterKeys {
    /// Group `rank`'s reshard intent.
    pub fn reshard_intent(&self, rank: u32) -> Vec<u8> {
        format!("/tycho/{}/reshard_intent/{rank:05}", self.cluster()).into_bytes()
    }

    /// Every reshard intent.
    pub fn reshard_intents(&self) -> Vec<u8> {
        format!("/tycho/{}/reshard_intent/", self.cluster()).into_bytes()
    }
}

/// Kills this process at once (SIGKILL) when failpoint `name` is set: tests crash a master at a
/// chosen step of a reshard.
#[cfg(feature = "failpoints")]
pub(crate) fn kill_point(name: &str) {
    if fail::eval(name, |_| ()).is_some() {
        tracing::error!(failpoint = name, "failpoint: killing this process");
        // SAFETY: kill(2) on this process's own id has no memory effects here.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

fn store_error(e: MetaError) -> OwnershipError {
    OwnershipError::Store(e.to_string())
}

/// Records a request to move group `rank` (of `groups`) to `target`, due within `deadline_ms`
/// of `now_ms` (Unix ms). One per group, and one per target: a group moving already answers
/// [`ReshardError::InProgress`], a target taking another group [`ReshardError::TargetBusy`].
pub async fn request(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    groups: u32,
    rank: u32,
    target: &str,
    now_ms: u64,
    deadline_ms: u64,
) -> Result<ReshardIntent, ReshardError> {
    let Some((group, _)) = read_group(store, keys, rank).await? else { return Err(ReshardError::NoGroup(rank)) };
    for (existing, _) in read_intents(store, keys, groups).await?.into_iter().flatten() {
        if existing.rank == rank {
            return Err(ReshardError::InProgress(Box::new(existing)));
        }
        if existing.target == target {
            return Err(ReshardError::TargetBusy(Box::new(existing)));
        }
    }
    if group.primary == target {
        return Err(ReshardError::AlreadyThere { rank, target: target.to_string() });
    }
    if group.state != GroupState::Stable {
        return Err(ReshardError::NotStable(rank));
    }
    if !masters(store, keys).await?.iter().any(|(m, _)| m.id == target) {
        return Err(ReshardError::UnknownTarget(target.to_string()));
    }
    let intent = ReshardIntent {
        rank,
        source: group.primary,
        target: target.to_string(),
        epoch: group.epoch,
        requested_ms: now_ms,
        deadline_ms: now_ms.saturating_add(deadline_ms),
        frozen_at: None,
    };
    match store.create_if_absent(&keys.reshard_intent(rank), &intent.encode(), None).await {
        Ok(_) => Ok(intent),
        Err(MetaError::CompareFailed { current: Some(kv), .. }) => {
            Err(ReshardError::InProgress(Box::new(ReshardIntent::decode(&kv.value)?)))
        }
        Err(e) => Err(store_error(e).into()),
    }
}

/// Every group's intent (index = rank) with the revision it was read at. An unreadable intent
/// reads as none (a newer build's; this build will not act on it).
pub async fn read_intents(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    groups: u32,
) -> Result<Vec<Option<(ReshardIntent, Revision)>>, OwnershipError> {
    let mut out = vec![None; groups as usize];
    let mut req = RangeRequest::prefix(keys.reshard_intents(), 256);
    loop {
        let page = store.range(req.clone()).await.map_err(store_error)?;
        for kv in &page.kvs {
            match ReshardIntent::decode(&kv.value) {
                Ok(intent) => {
                    if let Some(slot) = out.get_mut(intent.rank as usize) {
                        if kv.key == keys.reshard_intent(intent.rank) {
                            *slot = Some((intent, kv.mod_revision));
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(key = %String::from_utf8_lossy(&kv.key), error = %e, "skipping an unreadable reshard intent")
                }
            }
        }
        match req.next_page(&page) {
            Some(next) => req = next,
            None => break,
        }
    }
    Ok(out)
}

/// Marks the intent read at `read.1` frozen at log position `at`. Fails with
/// [`OwnershipError::Conflict`] if it changed (or went) since.
pub async fn mark_frozen(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    read: &(ReshardIntent, Revision),
    at: u64,
) -> Result<Revision, OwnershipError> {
    let next = ReshardIntent { frozen_at: Some(at), ..read.0.clone() };
    store.compare_and_swap(&keys.reshard_intent(read.0.rank), read.1, &next.encode(), None).await.map_err(|e| match e {
        MetaError::CompareFailed { .. } => OwnershipError::Conflict(None),
        e => store_error(e),
    })
}

/// Deletes the intent read at revision `rev` (done, abandoned or void). One deleted or changed
/// by someone else meanwhile is left as it is.
pub async fn clear(store: &dyn MetaStore, keys: &ClusterKeys, rank: u32, rev: Revision) -> Result<(), OwnershipError> {
    match store.compare_and_delete(&keys.reshard_intent(rank), rev).await {
        Ok(_) | Err(MetaError::CompareFailed { .. }) => Ok(()),
        Err(e) => Err(store_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intents_are_sealed_and_refuse_damage_and_newer_versions() {
        let i = ReshardIntent {
            rank: 3,
            source: "a".into(),
            target: "b".into(),
            epoch: 4,
            requested_ms: 10,
            deadline_ms: 20,
            frozen_at: Some(7),
        };
        assert_eq!(ReshardIntent::decode(&i.encode()), Ok(i.clone()));
        let mut bad = i.encode();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(matches!(ReshardIntent::decode(&bad), Err(OwnershipError::Corrupt(_))));
        let newer =
            envelope::seal(RecordKind::ReshardIntent, RESHARD_INTENT_VERSION + 1, &postcard::to_stdvec(&i).unwrap());
        assert!(matches!(ReshardIntent::decode(&newer), Err(OwnershipError::Corrupt(_))));
        assert!(!i.expired(19) && i.expired(20));
    }
}
