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

use crate::compaction::{read_pointers, CompactionError, Snapshots};
use crate::master::Master;
use crate::oplog::{Fence, FollowError, LogError, LogFollower, OpLogWriter, WriterConfig};
use crate::ownership::{
    change_group, change_standbys, create_group, decide, masters, read_group, ClusterKeys, Decision, GroupRecord,
    MasterRegistration, OwnershipError, Role,
};
use crate::snapshot::{SnapshotId, SnapshotStore};
use crate::standby::{apply_to, log_keys, promote, PromoteError, Promotion};

/// The group an HA pair serves (one group until the partitioned plane).
pub const RANK: u32 = 0;

/// Batches a standby reads per request.
const FOLLOW_PAGE: usize = 64;

/// Longest a master leaving its role waits for its log to commit what waits.
const LOG_DRAIN: Duration = Duration::from_secs(2);

/// Pause before deciding again after a failed store call.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// Pause before trying again after a snapshot failed.
const SNAPSHOT_RETRY: Duration = Duration::from_secs(1);

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
    /// Where the group's snapshots go and how often; `None`: no snapshots, and the log is
    /// never shortened.
    pub snapshots: Option<SnapshotConfig>,
}

/// Snapshot settings of an HA master.
#[derive(Clone)]
pub struct SnapshotConfig {
    /// The store the cluster's masters share.
    pub files: Arc<dyn SnapshotStore>,
    /// A snapshot is taken once the log has grown by this many records since the latest.
    pub every_records: u64,
}

impl std::fmt::Debug for SnapshotConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotConfig").field("every_records", &self.every_records).finish_non_exhaustive()
    }
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
    /// The group's state could not be rebuilt from its snapshots and log.
    #[error("cannot rebuild the group from its snapshots: {0}")]
    Snapshot(CompactionError),
}

impl From<CompactionError> for HaError {
    fn from(e: CompactionError) -> HaError {
        match e {
            CompactionError::Store(why) | CompactionError::Follow(FollowError::Store(why)) => HaError::Store(why),
            e => HaError::Snapshot(e),
        }
    }
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
    let keys = ClusterKeys::new(&cfg.cluster);
    let snaps =
        cfg.snapshots.as_ref().map(|s| Snapshots::new(store.clone(), s.files.clone(), keys.clone(), s.every_records));
    let mut role = Roles::default();
    let mut registered_before = false;
    let (result, keeper) = loop {
        let registered = async {
            let keeper = LeaseKeeper::grant(store.clone(), cfg.lease_ttl, Arc::new(tycho_meta::SystemClock))
                .await
                .map_err(|e| HaError::Store(e.to_string()))?;
            let reg = MasterRegistration {
                id: cfg.id.clone(),
                address: cfg.address.clone(),
                role: Role::Idle,
                registered_at_ms: tycho_proto::auth::capability::unix_ms(),
            };
            let done = register_alone(&*store, &keys, &reg, &keeper, &mut stop).await?;
            Ok::<_, HaError>(done.then_some(keeper))
        };
        let keeper = match registered.await {
            Ok(Some(k)) => k,
            Ok(None) => {
                status.send_replace(HaStatus::Stopped);
                return Ok(());
            }
            // Registering again after a lost lease: the store is likely unwell; keep trying.
            Err(HaError::Store(e) | HaError::Lease(e)) if registered_before => {
                tracing::warn!(error = %e, "could not register again; retrying");
                tokio::select! {
                    _ = stop.as_mut() => {
                        status.send_replace(HaStatus::Stopped);
                        return Ok(());
                    }
                    _ = tokio::time::sleep(STORE_RETRY) => continue,
                }
            }
            Err(e) => return Err(e),
        };
        registered_before = true;
        tracing::info!(id = %cfg.id, cluster = %cfg.cluster, "registered");
        let watchdog = tokio::spawn(fence_at_deadline(master.clone(), keeper.subscribe()));
        let ctx =
            Ctx { master: &master, store: &store, cfg: &cfg, keys: &keys, keeper: &keeper, snaps: snaps.as_ref() };
        let result = loop {
            match step(&ctx, &mut role, &status, &mut stop).await {
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
        watchdog.abort();
        match result {
            // A master that serves nothing loses nothing with its lease: it registers again
            // and goes on (a standby keeps its place in the log, and finds out there whether
            // the log still holds what it needs). A primary's state is stale: it leaves.
            Err(HaError::Lease(why)) if role.log.is_none() => {
                tracing::warn!(%why, "registration lease lost while not serving; registering again");
                status.send_replace(HaStatus::Starting);
                let _ = keeper.revoke().await;
            }
            result => break (result, keeper),
        }
    };
    // Leaving: serve nothing more, end the log, give up the registration (a standby takes
    // over now rather than after the lease's TTL).
    master.stand_by(RANK);
    if let Some(task) = role.snapshotting.take() {
        task.abort();
    }
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
/// process given the same id waits for the first to go). False if `stop` completed first.
async fn register_alone(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    reg: &MasterRegistration,
    keeper: &LeaseKeeper,
    stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<bool, HaError> {
    let key = keys.master(&reg.id);
    let mut warned = false;
    loop {
        check_lease(keeper)?;
        let mut gone = store.watch(WatchRequest::key(key.clone())).await.map_err(|e| HaError::Store(e.to_string()))?;
        match store.create_if_absent(&key, &reg.encode(), Some(keeper.id())).await {
            Ok(_) => return Ok(true),
            Err(tycho_meta::MetaError::CompareFailed { .. }) => {
                if !warned {
                    tracing::warn!(id = %reg.id, "a live master is registered with this id; waiting for its registration to end");
                    warned = true;
                }
                tokio::select! {
                    _ = stop.as_mut() => return Ok(false),
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

/// What one master brings to each decision.
struct Ctx<'a> {
    master: &'a Arc<Master>,
    store: &'a Arc<dyn MetaStore>,
    cfg: &'a HaConfig,
    keys: &'a ClusterKeys,
    keeper: &'a LeaseKeeper,
    snaps: Option<&'a Snapshots>,
}

/// What this master holds of the group.
#[derive(Default)]
struct Roles {
    /// As standby: its position in the log.
    follower: Option<LogFollower>,
    /// As primary: the log it writes.
    log: Option<Arc<OpLogWriter>>,
    /// As primary without a standby: the snapshot being taken.
    snapshotting: Option<tokio::task::JoinHandle<()>>,
}

/// One decision and its action. `Ok(false)` when `stop` completed.
async fn step(
    ctx: &Ctx<'_>,
    role: &mut Roles,
    status: &watch::Sender<HaStatus>,
    stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<bool, HaError> {
    let Ctx { master, store, cfg, keys, keeper, .. } = *ctx;
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
            if !promote_here(ctx, role, status, read, stop).await? {
                return Ok(false);
            }
        }
        (Decision::Serve, group) => {
            let log = role.log.clone().expect("a serving primary has its log");
            if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
                role.snapshotting = None;
            }
            // Without a live standby to snapshot the group, the primary does, off its own state.
            let standby_alive = group
                .as_ref()
                .is_some_and(|(g, _)| g.standbys.iter().any(|s| *s != cfg.id && live.iter().any(|(r, _)| r.id == *s)));
            let mut due_at = None;
            if let (Some(snaps), false, None) = (ctx.snaps, standby_alive, &role.snapshotting) {
                let (pointers, _) = snaps.pointers(RANK).await?;
                let at = pointers.latest.map_or(0, |l| l.applied) + snaps.every_records;
                if log.durable() >= at {
                    let epoch = group.as_ref().map_or(0, |(g, _)| g.epoch);
                    role.snapshotting = Some(tokio::spawn(snapshot_as_primary(snaps.clone(), master.clone(), epoch)));
                } else {
                    due_at = Some(at);
                }
            }
            let snapshotting = &mut role.snapshotting;
            let wake = async {
                tokio::select! {
                    _ = log.ended() => {}
                    _ = async {
                        match snapshotting.as_mut() {
                            Some(task) => drop(task.await),
                            None => std::future::pending().await,
                        }
                    } => {}
                    _ = async {
                        match due_at {
                            Some(at) => drop(log.wait(at).await),
                            None => std::future::pending().await,
                        }
                    } => {}
                }
            };
            let r = changes.wait(keeper, stop, wake).await;
            if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
                role.snapshotting = None;
            }
            return r;
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
        (Decision::Follow, Some((g, _))) => {
            status.send_replace(HaStatus::Standby);
            if role.follower.is_none() {
                role.follower = Some(bootstrap(ctx).await?);
            }
            let follower = role.follower.as_mut().expect("set above");
            if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
                role.snapshotting = None;
            }
            // A snapshot is due once the log reaches this record (one at a time).
            let due_at = match ctx.snaps.filter(|_| role.snapshotting.is_none()) {
                Some(snaps) => {
                    let (pointers, _) = snaps.pointers(RANK).await?;
                    Some(pointers.latest.map_or(0, |l| l.applied) + snaps.every_records)
                }
                None => None,
            };
            let due = tokio::sync::Notify::new();
            let mut replay = apply_to(master, RANK);
            let mut apply = |seq: u64, rec: &crate::record::Record| {
                replay(seq, rec)?;
                if due_at.is_some_and(|at| seq >= at) {
                    due.notify_one();
                }
                Ok(())
            };
            let (mut stopped, mut snapshot) = (false, false);
            let saving = &mut role.snapshotting;
            let followed = follower
                .follow(&mut apply, async {
                    tokio::select! {
                        r = changes.wait(keeper, stop, std::future::pending()) => stopped = !r.unwrap_or(true),
                        _ = due.notified() => snapshot = true,
                        // A snapshot written meanwhile was published (or not): decide again.
                        _ = async {
                            match saving.as_mut() {
                                Some(task) => drop(task.await),
                                None => std::future::pending().await,
                            }
                        } => {}
                    }
                })
                .await;
            if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
                role.snapshotting = None;
            }
            match followed {
                Ok(()) => {}
                // The follower keeps its place: the next step follows on from it. A compacted
                // read raced a compaction of the store's history: it reads again.
                Err(FollowError::Store(why)) => return Err(HaError::Store(why)),
                Err(FollowError::Compacted) => return Err(HaError::Store("history compacted under a read".into())),
                Err(e) => {
                    rebootstrap(master, role, &e);
                    tokio::select! {
                        _ = stop.as_mut() => return Ok(false),
                        _ = tokio::time::sleep(SNAPSHOT_RETRY) => {}
                    }
                    return Ok(true);
                }
            }
            if snapshot {
                let snaps = ctx.snaps.expect("a snapshot is due only with snapshots configured").clone();
                let applied = follower.applied();
                // The follower applies nothing meanwhile: the export is of one log position.
                // Writing and publishing it goes on in the background while the log is followed.
                let entries = master.export_group(RANK).unwrap_or_default();
                let id = SnapshotId::new(RANK, applied, g.epoch);
                let m = master.clone();
                role.snapshotting = Some(tokio::spawn(async move {
                    match snaps.save(id, entries).await {
                        Ok(Some(_)) => note_snapshot(&m, applied),
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "could not take a snapshot; the standby goes on");
                            tokio::time::sleep(SNAPSHOT_RETRY).await;
                        }
                    }
                }));
            }
            return Ok(!stopped);
        }
        (Decision::TakeOver, Some(read)) => {
            if !promote_here(ctx, role, status, read, stop).await? {
                return Ok(false);
            }
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

/// Drops what this master replayed of the group, which may not be what the log says (`why`):
/// the next step starts over from the newest snapshot.
fn rebootstrap(master: &Master, role: &mut Roles, why: &FollowError) {
    tracing::error!(error = %why, "cannot follow the group's log: starting over from the latest snapshot");
    master.reset();
    role.follower = None;
    if let Some(g) = master.group(RANK) {
        g.log_stats().note_rebootstrap();
    }
}

/// A primary without a standby snapshots its group: from a scratch master rebuilt from the
/// latest snapshot and the log, never from the state it serves.
async fn snapshot_as_primary(snaps: Snapshots, master: Arc<Master>, epoch: u64) {
    // Replaying and exporting the scratch copy is long work: on a thread of its own, so that the
    // runtime's workers keep serving.
    let handle = tokio::runtime::Handle::current();
    let work = tokio::task::spawn_blocking(move || {
        handle.block_on(async move {
            let started = std::time::Instant::now();
            let (entries, applied) = match snaps.rebuild(&master, RANK).await {
                Ok((scratch, applied)) => (scratch.export_group(RANK).unwrap_or_default(), applied),
                Err(e) => {
                    tracing::warn!(error = %e, "could not rebuild the group to snapshot it");
                    return false;
                }
            };
            match snaps.save(SnapshotId::new(RANK, applied, epoch), entries).await {
                Ok(published) => {
                    if published.is_some() {
                        note_snapshot(&master, applied);
                    }
                    tracing::debug!(applied, took = ?started.elapsed(), "primary snapshot done");
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not take a snapshot");
                    false
                }
            }
        })
    });
    if !work.await.unwrap_or(false) {
        tokio::time::sleep(SNAPSHOT_RETRY).await;
    }
}

/// Notes in the group's figures that a snapshot at `applied` was published.
fn note_snapshot(master: &Master, applied: u64) {
    if let Some(g) = master.group(RANK) {
        g.log_stats().note_snapshot(applied, tycho_proto::auth::capability::unix_ms());
    }
}

/// A follower of the group's log for a master that holds nothing of it: from the newest
/// snapshot when there is one (its state imported into the master), else from the log's
/// start.
async fn bootstrap(ctx: &Ctx<'_>) -> Result<LogFollower, HaError> {
    let master = ctx.master;
    master.reset();
    let from = match ctx.snaps {
        Some(snaps) => snaps.restore(master, RANK).await?,
        None => {
            let (pointers, _) = read_pointers(&**ctx.store, ctx.keys, RANK).await?;
            if pointers.floor > 0 {
                return Err(HaError::Snapshot(CompactionError::NoBase {
                    floor: pointers.floor,
                    why: "this master has no snapshot store (--snapshot-dir)".into(),
                }));
            }
            0
        }
    };
    let follower = LogFollower::new(ctx.store.clone(), log_keys(ctx.keys, RANK), RANK, from, FOLLOW_PAGE);
    Ok(match master.group(RANK) {
        Some(g) => follower.with_stats(g.log_stats().clone()),
        None => follower,
    })
}

/// Promotes this master from the group record `read` (replaying the log from where it
/// stands, or from the newest snapshot when it followed nothing). `Ok(false)` when `stop`
/// completed first: the promotion is abandoned (the group is not served here, and the next
/// master takes it over once this one's registration is gone).
async fn promote_here(
    ctx: &Ctx<'_>,
    role: &mut Roles,
    status: &watch::Sender<HaStatus>,
    read: (GroupRecord, tycho_meta::Revision),
    stop: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
) -> Result<bool, HaError> {
    let Ctx { master, store, cfg, keys, .. } = *ctx;
    if role.follower.is_none() {
        tokio::select! {
            _ = stop.as_mut() => return Ok(false),
            f = bootstrap(ctx) => role.follower = Some(f?),
        }
    }
    let follower = role.follower.as_mut().expect("set above");
    let started = std::time::Instant::now();
    let promotion = Promotion {
        store: store.clone(),
        keys,
        me: &cfg.id,
        read,
        catch_up_deadline: cfg.catch_up_deadline,
        writer: writer_config(master, cfg),
    };
    let promoted = tokio::select! {
        _ = stop.as_mut() => {
            tracing::warn!("told to stop during a promotion: abandoning it, the group is not served here");
            master.stand_by(RANK);
            return Ok(false);
        }
        p = promote(master, follower, promotion) => p,
    };
    match promoted {
        Ok((record, log)) => {
            tracing::info!(epoch = record.epoch, took = ?started.elapsed(), "took the group over");
            status.send_replace(HaStatus::Primary { epoch: record.epoch });
            role.follower = None;
            role.log = Some(log);
            Ok(true)
        }
        // Someone else changed the record first: decide again.
        Err(PromoteError::Lost(OwnershipError::Conflict(_))) => Ok(true),
        // The store failed on the way: decide again once it answers (a record this master
        // already raised names it primary, and the next promotion raises it again).
        Err(PromoteError::Lost(OwnershipError::Store(e))) | Err(PromoteError::CatchUp(FollowError::Store(e))) => {
            Err(HaError::Store(e))
        }
        Err(PromoteError::CatchUp(FollowError::Compacted)) => {
            Err(HaError::Store("history compacted under a read".into()))
        }
        // What this master replayed cannot reach the log's end (it fell behind the floor, or
        // the log does not apply to it): it starts over from the newest snapshot, and the next
        // step promotes again (the record names it primary already).
        Err(PromoteError::CatchUp(e)) => {
            rebootstrap(master, role, &e);
            Ok(true)
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
