//! A group's standby: it replays the group's OpLog into a [`Master`] that does not serve the
//! group, and promotes itself when its role decision says so, failing closed.
//!
//! Promotion, in order:
//!
//! 1. CAS the ownership record to name this master primary (epoch + 1). From that revision on
//!    the old primary's log commits nothing: its batch transactions compare the record. Until
//!    step 3, requests for the group here are answered KVPT_MIGRATING (wait and retry here).
//! 2. Catch up to the log's durable prefix, within a deadline. The prefix cannot move any more
//!    (step 1), so what is read is everything the old primary acknowledged.
//! 3. [`Master::take_over`]: clients get a fresh TTL, objects a read lease, ranges freed from then
//!    on stay with their tenants for as long as a grant of the old primary may last, and the
//!    group is served under the new epoch.
//! 4. Open the log for writing under the new record (fenced on it) and make it the master's
//!    record sink: from now on a mutation is acknowledged once its record is durable. When the
//!    log ends (fenced by a later owner, or closed), the master stops serving the group, reads
//!    included.
//!
//! A failover calls it once the old primary's registration is gone (its lease expired, or it
//! released it when handing over): an old primary stops serving before its lease can expire in
//! the store (its lease keeper's local deadline), so nobody else serves the group meanwhile. A
//! planned switch (a claim of a caretaken group, a reshard) calls it while the old primary
//! lives: that one serves reads until its watch reports the new record and its log, fenced by
//! the record's new revision, commits nothing from step 1 on, so no write it acknowledges is
//! missing from what this master replays. Any doubt — a gap or damage in the log, a record that does not replay, the deadline —
//! leaves the group unserved here and says why.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tycho_meta::{MetaStore, Revision};

use crate::cluster::ownership::{change_group, ClusterKeys, GroupRecord, GroupState, OwnershipError};
use crate::log::oplog::{Fence, FollowError, LogError, LogFollower, LogKeys, OpLogWriter, WriterConfig};
use crate::log::record::Record;
use crate::state::master::Master;

/// Why a promotion did not end with the group served here.
#[derive(Debug, Error)]
pub enum PromoteError {
    /// Another master changed the group record first: it is that master's now.
    #[error("another master changed the group record first")]
    Lost(#[source] OwnershipError),
    /// The log could not be read to its end: the group is not served here.
    #[error("the log could not be replayed to its end: {0}")]
    CatchUp(#[source] FollowError),
    /// The log's end was not reached within the deadline.
    #[error("the log was not replayed to its end within {0:?}")]
    Deadline(Duration),
    /// The log could not be opened for writing, or moved after the catch-up.
    #[error("the log could not be opened for writing: {0}")]
    Log(#[source] LogError),
    /// This master does not hold the group.
    #[error("this master holds no container for group {0}")]
    NoGroup(u32),
}

/// Replays group `rank`'s records into `master` as `follower` reads them (a standby's apply
/// function): each record through [`Master::replay`], noting its sequence number.
pub fn apply_to(
    master: &Master,
    rank: u32,
) -> impl FnMut(u64, &Record) -> Result<(), crate::log::record::ReplayError> + '_ {
    move |seq, rec| {
        master.replay(rank, rec)?;
        if let Some(g) = master.group(rank) {
            g.note_applied(seq);
        }
        Ok(())
    }
}

/// What a promotion needs to know.
pub struct Promotion<'a> {
    /// The coordination store.
    pub store: Arc<dyn MetaStore>,
    /// The cluster's keys.
    pub keys: &'a ClusterKeys,
    /// This master's id.
    pub me: &'a str,
    /// The group record as this master last read it, with its revision.
    pub read: (GroupRecord, Revision),
    /// Whether this master takes the group over as its caretaker (it is another group's
    /// primary, or the only master left) rather than as its own primary.
    pub caretake: bool,
    /// Time allowed for the catch-up after the record changed.
    pub catch_up_deadline: Duration,
    /// The log writer's bounds.
    pub writer: WriterConfig,
}

/// Promotes this master to primary of the group of `p.read`, which `master` holds replayed up
/// to `follower`'s position. Returns the group's new record and the open log, which is also
/// the master's record sink now.
pub async fn promote(
    master: &Arc<Master>,
    follower: &mut LogFollower,
    p: Promotion<'_>,
) -> Result<(GroupRecord, Arc<OpLogWriter>), PromoteError> {
    let rank = p.read.0.rank;
    if master.group(rank).is_none() {
        return Err(PromoteError::NoGroup(rank));
    }
    let me = p.me.to_string();
    let (record, revision) = change_group(&*p.store, p.keys, &p.read, |g| {
        g.primary = me.clone();
        g.standbys.retain(|s| *s != me);
        g.state = GroupState::Stable;
        g.migrating_to = None;
        g.caretaken = p.caretake;
    })
    .await
    .map_err(PromoteError::Lost)?;
    // Clients sent here by the new record wait (KVPT_MIGRATING) until the group is served.
    master.installing(rank, true);
    tracing::info!(
        group = rank,
        epoch = record.epoch,
        "group record names this master primary; replaying the log's end"
    );
    let mut apply = apply_to(master, rank);
    let durable = match tokio::time::timeout(p.catch_up_deadline, follower.catch_up(&mut apply)).await {
        Ok(Ok(durable)) => durable,
        Ok(Err(e)) => {
            tracing::error!(group = rank, error = %e, "promotion failed: the group stays unserved here");
            return Err(PromoteError::CatchUp(e));
        }
        Err(_) => {
            tracing::error!(group = rank, deadline = ?p.catch_up_deadline, "promotion failed: the log's end was not reached in time");
            return Err(PromoteError::Deadline(p.catch_up_deadline));
        }
    };
    let fence = Fence { key: p.keys.group(rank), mod_revision: revision, owner: Some((me, record.epoch)) };
    let log = OpLogWriter::open(p.store.clone(), log_keys(p.keys, rank), fence, rank, record.epoch, p.writer)
        .await
        .map_err(PromoteError::Log)?;
    if log.durable() != durable {
        return Err(PromoteError::Log(LogError::Fenced(format!(
            "the log ends at {} but the replay stopped at {durable}: it moved after the group record changed, or went back",
            log.durable()
        ))));
    }
    let log = Arc::new(log);
    master.stop_serving_when_log_ends(&log, rank);
    if !master.set_record_sink(rank, Some(log.clone())) {
        return Err(PromoteError::NoGroup(rank));
    }
    master.take_over(rank, record.epoch);
    tracing::info!(group = rank, epoch = record.epoch, durable, "promoted: serving the group");
    Ok((record, log))
}

/// The log keys of group `rank` of the cluster `keys` names.
pub fn log_keys(keys: &ClusterKeys, rank: u32) -> LogKeys {
    LogKeys::new(keys.cluster(), rank)
}
