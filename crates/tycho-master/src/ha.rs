//! A master's life in a cluster with a coordination store: registration, its role in the
//! group, and the work each role does (G = 1 today; the partitioned issue runs one of these
//! per group).
//!
//! The master registers under a lease (`masters/{id}`), then loops: it reads the live
//! registrations and the group record, applies [`decide`] (the same rules on every master),
//! acts, and waits for the next change of either (watches, no polling). Its roles:
//!
//! - **primary**: it created the group, or took it over. Its mutations are acknowledged once
//!   their records are durable in the group's OpLog, whose commits are fenced on the group
//!   record; if the log ends (another master changed the record) it stops serving and the loop
//!   ends with an error: a fenced primary holds state it can no longer trust, and starts over.
//! - **standby**: listed in the record, it replays the log as it grows (a watch on the durable
//!   prefix). When the primary's registration is gone it promotes itself (see
//!   [`crate::standby::promote`]).
//! - **idle**: it waits. If the group has no live standby when its primary dies, the oldest live
//!   master replays the whole log and takes the group over; nothing acknowledged is lost.
//!
//! Self-fencing: the master acts on its registration only while its [`LeaseKeeper`] says the
//! lease is held (until half its TTL after the last acknowledged renewal). Past that local
//! deadline it stops serving at once, before the store can expire the lease and let a standby
//! take over. A stream error alone never ends the lease.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;
use tycho_meta::{LeaseKeeper, MetaStore, WatchRequest};

use crate::master::Master;
use crate::oplog::{Fence, FollowError, LogError, LogFollower, OpLogWriter, WriterConfig};
use crate::ownership::{
    change_group, change_standbys, create_group, decide, masters, read_group, ClusterKeys, Decision, GroupRecord,
    MasterRegistration, OwnershipError, Role,
};
use crate::standby::{apply_to, log_keys, promote, PromoteError, Promotion};

/// The group an HA pair serves (one group until the partitioned plane).
pub const RANK: u32 = 0;

/// Batches a standby reads per request.
const FOLLOW_PAGE: usize = 64;

/// Longest a master leaving its role waits for its log to commit what waits.
const LOG_DRAIN: Duration = Duration::from_secs(2);

/// Pause before deciding again after a failed store call.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// How a master takes part in a cluster.
#[derive(Debug, Clone)]
pub struct HaConfig {
    /// The cluster's name: its keys live under `/tycho/{cluster}/`.
    pub cluster: String,
    /// This master's id, unique in the cluster.
    pub id: String,
    /// Where clients reach this master.
    pub address: String,
    /// TTL of its registration lease; a primary that stops renewing is replaced after it.
    pub lease_ttl: Duration,
    /// Time a promotion may take to replay the log's end.
    pub catch_up_deadline: Duration,
    /// Bounds of the log writer when primary.
    pub writer: WriterConfig,
}

/// What the master does now, published for `/readyz` and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HaStatus {
    /// Registering.
    Starting,
    /// Serving the group under `epoch`.
    Primary {
        /// The group's epoch.
        epoch: u64,
    },
    /// Replaying the group's log.
    Standby,
    /// Waiting for a role.
    Idle,
    /// Gave its role up when told to stop (SIGTERM).
    Stopped,
    /// Stopped for good, with the reason.
    Failed(String),
}

impl HaStatus {
    /// Whether the master serves requests in this state.
    pub fn serves(&self) -> bool {
        matches!(self, HaStatus::Primary { .. })
    }

    /// One line for `/readyz` and logs.
    pub fn describe(&self) -> String {
        match self {
            HaStatus::Starting => "starting: registering in the coordination store".into(),
            HaStatus::Primary { epoch } => format!("primary of the group at epoch {epoch}"),
            HaStatus::Standby => "standby: replaying the primary's log".into(),
            HaStatus::Idle => "idle: waiting for a role".into(),
            HaStatus::Stopped => "stopped: told to stop; gave its registration up".into(),
            HaStatus::Failed(why) => format!("stopped: {why}"),
        }
    }
}

/// Why a master left the cluster.
#[derive(Debug, Error)]
pub enum HaError {
    /// Its registration lease can no longer be relied on.
    #[error("registration lease lost ({0})")]
    Lease(String),
    /// The coordination store failed (retried while the lease holds).
    #[error("coordination store: {0}")]
    Store(String),
    /// A record in the store cannot be read as this build writes it: nothing to retry.
    #[error("unreadable cluster record: {0}")]
    Corrupt(String),
    /// A promotion failed (the group stays unserved here).
    #[error("promotion failed: {0}")]
    Promote(#[from] PromoteError),
    /// The log this master wrote as primary ended: another master owns the group.
    #[error("no longer the group's primary: {0}")]
    Fenced(LogError),
    /// The log could not be followed (a gap, damage, compaction): this standby starts over.
    #[error("cannot follow the group's log: {0}")]
    Follow(#[from] FollowError),
}

impl From<OwnershipError> for HaError {
    fn from(e: OwnershipError) -> HaError {
        match e {
            OwnershipError::Corrupt(why) => HaError::Corrupt(why),
            e => HaError::Store(e.to_string()),
        }
    }
}

/// Runs `master`'s part in the cluster until `stop` completes (then it gives up its
/// registration, so that a standby takes over at once) or the master must leave (`Err`: it
/// serves nothing any more and should be restarted). `status` follows its role.
pub async fn run(
    master: Arc<Master>,
    store: Arc<dyn MetaStore>,
    cfg: HaConfig,
    status: watch::Sender<HaStatus>,
    stop: impl Future<Output = ()>,
) -> Result<(), HaError> {
    tokio::pin!(stop);
    master.stand_by(RANK);
    status.send_replace(HaStatus::Starting);
    let keeper = LeaseKeeper::grant(store.clone(), cfg.lease_ttl, Arc::new(tycho_meta::SystemClock))
        .await
        .map_err(|e| HaError::Store(e.to_string()))?;
    let keys = ClusterKeys::new(&cfg.cluster);
    let reg = MasterRegistration {
        id: cfg.id.clone(),
        address: cfg.address.clone(),
        role: Role::Idle,
        registered_at_ms: tycho_proto::auth::capability::unix_ms(),
    };
    register_alone(&*store, &keys, &reg, &keeper, &mut stop).await?;
    tracing::info!(id = %cfg.id, cluster = %cfg.cluster, "registered");
    let watchdog = tokio::spawn(fence_at_deadline(master.clone(), keeper.subscribe()));
    let mut role = Roles { follower: None, log: None };
    let result = loop {
        match step(&master, &store, &cfg, &keys, &keeper, &mut role, &status, &mut stop).await {
            Ok(true) => {}
            Ok(false) => break Ok(()),
            // The store is unreachable for a moment: keep the role while the lease holds
            // (`step` checks it first) and try again.
            Err(HaError::Store(e)) => {
                tracing::warn!(error = %e, "coordination store call failed; retrying");
                tokio::select! {
                    _ = stop.as_mut() => break Ok(()),
                    _ = tokio::time::sleep(STORE_RETRY) => {}
                }
            }
            Err(e) => break Err(e),
        }
    };
    // Leaving: serve nothing more, end the log, give up the registration (a standby takes
    // over now rather than after the lease's TTL).
    watchdog.abort();
    master.stand_by(RANK);
    if let Some(log) = &role.log {
        // Commit what waits (bounded), so that its writers get their answers.
        log.finish(LOG_DRAIN).await;
    }
    if let Err(e) = keeper.revoke().await {
        tracing::warn!(error = %e, "could not revoke the registration lease; it expires by itself");
    }
    match &result {
        Ok(()) => status.send_replace(HaStatus::Stopped),
        Err(e) => status.send_replace(HaStatus::Failed(e.to_string())),
    };
    result
}

/// Registers `reg` under the keeper's lease, only if no live process holds the same id (a
/// process restarted quickly waits for its predecessor's registration to run out; a second
/// process given the same id waits for the first to go).
async fn register_alone(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    reg: &MasterRegistration,
    keeper: &LeaseKeeper,
    stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<(), HaError> {
    let key = keys.master(&reg.id);
    let mut warned = false;
    loop {
        check_lease(keeper)?;
        let mut gone = store.watch(WatchRequest::key(key.clone())).await.map_err(|e| HaError::Store(e.to_string()))?;
        match store.create_if_absent(&key, &reg.encode(), Some(keeper.id())).await {
            Ok(_) => return Ok(()),
            Err(tycho_meta::MetaError::CompareFailed { .. }) => {
                if !warned {
                    tracing::warn!(id = %reg.id, "a live master is registered with this id; waiting for its registration to end");
                    warned = true;
                }
                tokio::select! {
                    _ = stop.as_mut() => return Err(HaError::Store("stopped before registering".into())),
                    _ = gone.next() => {}
                    _ = tokio::time::sleep(keeper.ttl()) => {}
                }
            }
            Err(e) => return Err(HaError::Store(e.to_string())),
        }
    }
}

/// Stops `master` serving the group once the lease's local deadline passes without a renewal,
/// whatever else the master is doing then (a store call may take longer than the deadline).
async fn fence_at_deadline(master: Arc<Master>, mut lease: watch::Receiver<tycho_meta::LeaseState>) {
    loop {
        let Some(deadline) = lease.borrow().deadline() else { break };
        tokio::select! {
            _ = tokio::time::sleep_until(deadline.into()) => {
                if !lease.borrow().is_valid_at(std::time::Instant::now()) {
                    break;
                }
            }
            changed = lease.changed() => if changed.is_err() { break },
        }
    }
    tracing::error!("registration lease can no longer be relied on: no longer serving");
    master.stand_by(RANK);
}

/// What this master holds of the group.
struct Roles {
    /// As standby: its position in the log.
    follower: Option<LogFollower>,
    /// As primary: the log it writes.
    log: Option<Arc<OpLogWriter>>,
}

/// One decision and its action. `Ok(false)` when `stop` completed.
#[allow(clippy::too_many_arguments)]
async fn step(
    master: &Arc<Master>,
    store: &Arc<dyn MetaStore>,
    cfg: &HaConfig,
    keys: &ClusterKeys,
    keeper: &LeaseKeeper,
    role: &mut Roles,
    status: &watch::Sender<HaStatus>,
    stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<bool, HaError> {
    check_lease(keeper)?;
    if let Some(e) = role.log.as_ref().and_then(|l| l.failed()) {
        return Err(HaError::Fenced(e));
    }
    // Watches start before the reads, so no change between them is missed.
    let mut changes = Changes::open(&**store, keys).await?;
    let live = masters(&**store, keys).await?;
    let group = read_group(&**store, keys, RANK).await?;
    let holds_state = role.follower.is_some() || role.log.is_some();
    let decision = decide(&cfg.id, &live, group.as_ref().map(|(g, _)| g), holds_state);
    tracing::debug!(?decision, "role decision");
    if role.log.is_some() && decision != Decision::Serve {
        // The record names another primary: whatever this master holds is stale from now on.
        master.stand_by(RANK);
        return Err(HaError::Fenced(LogError::Fenced("the group record no longer names this master primary".into())));
    }
    match (decision, group) {
        (Decision::Create, _) => match create_group(&**store, keys, RANK, &cfg.id).await {
            Ok(created) => {
                let log = open_as_primary(master, store, cfg, keys, &created).await?;
                master.take_over(RANK, created.0.epoch);
                status.send_replace(HaStatus::Primary { epoch: created.0.epoch });
                tracing::info!(epoch = created.0.epoch, "created the group: serving it");
                role.log = Some(log);
            }
            Err(OwnershipError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        },
        (Decision::Serve, Some(read)) if role.log.is_none() => {
            // Named primary by a restarted primary that handed the group over: take it.
            promote_here(master, store, cfg, keys, role, status, read).await?;
        }
        (Decision::Serve, _) => {
            let log = role.log.clone().expect("a serving primary has its log");
            return changes.wait(keeper, stop, async move { drop(log.ended().await) }).await;
        }
        (Decision::HandTo(heir), Some(read)) => {
            tracing::info!(%heir, "restarted without the group's state: handing it to its standby");
            match change_group(&**store, keys, &read, |g| {
                g.primary = heir.clone();
                g.standbys.retain(|s| *s != heir);
            })
            .await
            {
                Ok(_) | Err(OwnershipError::Conflict(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        (Decision::JoinAsStandby, Some(read)) => {
            let me = cfg.id.clone();
            match change_standbys(&**store, keys, &read, |s| s.push(me)).await {
                Ok(_) | Err(OwnershipError::Conflict(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        (Decision::Follow, _) => {
            status.send_replace(HaStatus::Standby);
            let follower = role.follower.get_or_insert_with(|| new_follower(master, store, keys));
            let mut apply = apply_to(master, RANK);
            let mut stopped = false;
            follower
                .follow(&mut apply, async {
                    stopped = !changes.wait(keeper, stop, std::future::pending()).await.unwrap_or(true);
                })
                .await
                .map_err(|e| match e {
                    // The follower keeps its place: the next step follows on from it.
                    FollowError::Store(why) => HaError::Store(why),
                    e => HaError::Follow(e),
                })?;
            return Ok(!stopped);
        }
        (Decision::TakeOver, Some(read)) => {
            promote_here(master, store, cfg, keys, role, status, read).await?;
        }
        _ => {
            if !status.borrow().serves() {
                status.send_replace(HaStatus::Idle);
            }
            return changes.wait(keeper, stop, std::future::pending()).await;
        }
    }
    Ok(true)
}

/// Promotes this master from the group record `read` (replaying the log from where it
/// stands, or from its start when it followed nothing).
async fn promote_here(
    master: &Arc<Master>,
    store: &Arc<dyn MetaStore>,
    cfg: &HaConfig,
    keys: &ClusterKeys,
    role: &mut Roles,
    status: &watch::Sender<HaStatus>,
    read: (GroupRecord, tycho_meta::Revision),
) -> Result<(), HaError> {
    let follower = role.follower.get_or_insert_with(|| new_follower(master, store, keys));
    let started = std::time::Instant::now();
    let promotion = Promotion {
        store: store.clone(),
        keys,
        me: &cfg.id,
        read,
        catch_up_deadline: cfg.catch_up_deadline,
        writer: writer_config(master, cfg),
    };
    match promote(master, follower, promotion).await {
        Ok((record, log)) => {
            tracing::info!(epoch = record.epoch, took = ?started.elapsed(), "took the group over");
            status.send_replace(HaStatus::Primary { epoch: record.epoch });
            role.follower = None;
            role.log = Some(log);
            Ok(())
        }
        // Someone else changed the record first: decide again.
        Err(PromoteError::Lost(OwnershipError::Conflict(_))) => Ok(()),
        // The store failed on the way: decide again once it answers (a record this master
        // already raised names it primary, and the next promotion raises it again).
        Err(PromoteError::Lost(OwnershipError::Store(e))) | Err(PromoteError::CatchUp(FollowError::Store(e))) => {
            Err(HaError::Store(e))
        }
        Err(e) => Err(e.into()),
    }
}

/// Opens the group's log for writing under the record this master just created and makes it
/// the master's record sink.
async fn open_as_primary(
    master: &Arc<Master>,
    store: &Arc<dyn MetaStore>,
    cfg: &HaConfig,
    keys: &ClusterKeys,
    created: &(GroupRecord, tycho_meta::Revision),
) -> Result<Arc<OpLogWriter>, HaError> {
    let (record, revision) = created;
    let fence = Fence { key: keys.group(RANK), mod_revision: *revision, owner: Some((cfg.id.clone(), record.epoch)) };
    let log =
        OpLogWriter::open(store.clone(), log_keys(keys, RANK), fence, RANK, record.epoch, writer_config(master, cfg))
            .await
            .map_err(HaError::Fenced)?;
    let log = Arc::new(log);
    master.stop_serving_when_log_ends(&log, RANK);
    if !master.set_record_sink(log.clone()) {
        return Err(HaError::Fenced(LogError::Refused("the master already had a record sink".into())));
    }
    Ok(log)
}

/// A follower of the group's log from its start, reporting to the group's figures.
fn new_follower(master: &Master, store: &Arc<dyn MetaStore>, keys: &ClusterKeys) -> LogFollower {
    let follower = LogFollower::new(store.clone(), log_keys(keys, RANK), RANK, 0, FOLLOW_PAGE);
    match master.group(RANK) {
        Some(g) => follower.with_stats(g.log_stats().clone()),
        None => follower,
    }
}

/// The log writer's settings, reporting to the group's figures.
fn writer_config(master: &Master, cfg: &HaConfig) -> WriterConfig {
    let mut w = cfg.writer.clone();
    if let Some(g) = master.group(RANK) {
        w.stats = g.log_stats().clone();
    }
    w
}

/// Fails once the registration lease can no longer be relied on.
fn check_lease(keeper: &LeaseKeeper) -> Result<(), HaError> {
    if keeper.is_valid() {
        Ok(())
    } else {
        Err(HaError::Lease(format!("{:?}", keeper.state())))
    }
}

/// Whether a watch event is a change of what it watches (a lost or resumed connection is not:
/// the watch resumes where it stopped and reports what happened meanwhile).
fn is_change(e: tycho_meta::MetaResult<tycho_meta::WatchEvent>) -> Result<bool, HaError> {
    match e.map_err(|e| HaError::Store(e.to_string()))? {
        tycho_meta::WatchEvent::Put(_) | tycho_meta::WatchEvent::Delete(_) => Ok(true),
        tycho_meta::WatchEvent::Disconnected { .. } | tycho_meta::WatchEvent::Resumed { .. } => Ok(false),
    }
}

/// Watches of what a decision reads: the registrations and the group record.
struct Changes {
    masters: tycho_meta::Watch,
    group: tycho_meta::Watch,
}

impl Changes {
    async fn open(store: &dyn MetaStore, keys: &ClusterKeys) -> Result<Changes, HaError> {
        let w = |r| async move { store.watch(r).await.map_err(|e| HaError::Store(e.to_string())) };
        Ok(Changes {
            masters: w(WatchRequest::prefix(keys.masters())).await?,
            group: w(WatchRequest::key(keys.group(RANK))).await?,
        })
    }

    /// Waits for a change of the registrations or the group record (`Ok(true)`), `stop`
    /// (`Ok(false)`), `also` (`Ok(true)`), or the end of the lease (`Err`).
    async fn wait(
        &mut self,
        keeper: &LeaseKeeper,
        stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        also: impl Future<Output = ()>,
    ) -> Result<bool, HaError> {
        let mut lease = keeper.subscribe();
        tokio::pin!(also);
        loop {
            // Act on the lease only until its local deadline, without waiting to be told.
            let deadline = keeper.state().deadline().ok_or_else(|| HaError::Lease("lost".into()))?;
            tokio::select! {
                _ = stop.as_mut() => return Ok(false),
                _ = tokio::time::sleep_until(deadline.into()) => check_lease(keeper)?,
                changed = lease.changed() => {
                    if changed.is_err() {
                        return Err(HaError::Lease("its keeper stopped".into()));
                    }
                    check_lease(keeper)?;
                }
                e = self.masters.next() => if is_change(e)? { return Ok(true) },
                e = self.group.next() => if is_change(e)? { return Ok(true) },
                _ = &mut also => return Ok(true),
            }
        }
    }
}
