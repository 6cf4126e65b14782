//! A master's life in a cluster with a coordination store: registration, its role in each KVPT
//! group, and the work each role does.
//!
//! The master registers under a lease (`masters/{id}`), then runs one loop per group, all on
//! the same registration. Each loop reads the live registrations and every group record,
//! applies [`cvm::plan`] (the same rules on every master), acts on what the plan says about its
//! group, and waits for the next change (watches, no polling). A group's roles here:
//!
//! - **primary** (native, or caretaker of a group without a master of its own): it created the
//!   group, or took it over. Its mutations are acknowledged once their records are durable in
//!   the group's OpLog, whose commits are fenced on the group record; if the log ends (another
//!   master changed the record) it stops serving the group and drops what it held of it.
//! - **standby**: listed in the record, it replays the log as it grows (a watch on the durable
//!   prefix). When the primary's registration is gone it promotes itself (see
//!   [`crate::cluster::standby::promote`]); the standby of a caretaken group claims it as soon as it
//!   follows the log, by the same compare-and-swap.
//! - **reshard target**: named by an operator's request to move the group here
//!   ([`crate::cluster::reshard`]): it joins the standbys, catches up, sets the record migrating, and
//!   promotes itself once the primary has frozen the group's writes; the primary lifts a
//!   freeze that lasts too long and ends requests that no longer hold.
//! - **idle**: nothing to do for the group. If a group has no live standby when its primary
//!   dies, a caretaker (or the oldest live master) replays its snapshot and log and takes it
//!   over; nothing acknowledged is lost.
//!
//! Self-fencing: the master acts on its registration only while its [`LeaseKeeper`] says the
//! lease is held (until half its TTL after the last acknowledged renewal). Past that local
//! deadline it stops serving every group at once, before the store can expire the lease and
//! let another master take over. A stream error alone never ends the lease.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use thiserror::Error;
use tokio::sync::watch;
use tycho_meta::{LeaseKeeper, MetaStore, RangeRequest, WatchRequest};

use crate::cluster::compaction::{read_pointers, CompactionError, Snapshots};
use crate::cluster::cvm::{self, Action, GroupView};
use crate::cluster::ownership::{
    change_group, change_standbys, create_group, masters, set_migrating, ClusterKeys, GroupRecord, GroupState,
    MasterRegistration, OwnershipError, Role,
};
use crate::cluster::reshard::{self, ReshardIntent, FREEZE_GRACE, FREEZE_LIMIT};
use crate::cluster::standby::{apply_to, log_keys, promote, PromoteError, Promotion};
use crate::log::oplog::{Fence, FollowError, LogError, LogFollower, OpLogWriter, WriterConfig};
use crate::log::snapshot::{SnapshotId, SnapshotStore};
use crate::state::master::Master;

/// Batches a standby reads per request.
const FOLLOW_PAGE: usize = 64;

/// Longest a master leaving its role waits for its log to commit what waits.
const LOG_DRAIN: Duration = Duration::from_secs(2);

/// Pause before deciding again after a failed store call.
const STORE_RETRY: Duration = Duration::from_millis(200);

/// Pause before trying again after a snapshot failed.
const SNAPSHOT_RETRY: Duration = Duration::from_secs(1);

/// How often a master compacts the coordination store's history (see [`compact_history`]).
const HISTORY_COMPACTION: Duration = Duration::from_secs(300);

/// Tries to keep a copy of a group's latest snapshot, per change seen.
const COPY_TRIES: usize = 5;

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
    /// Where the groups' snapshots go and how often; `None`: no snapshots, and the logs are
    /// never shortened.
    pub snapshots: Option<SnapshotConfig>,
}

/// Snapshot settings of an HA master.
#[derive(Clone)]
pub struct SnapshotConfig {
    /// Where this master's snapshots are: its own directory (with `peers`), or a volume the
    /// cluster's masters share.
    pub files: Arc<dyn SnapshotStore>,
    /// With snapshots in each master's own directory: the list of the other masters' RPC
    /// addresses, which the role loop keeps current (the files fetch from them).
    pub peers: Option<crate::cluster::snapshot_peers::Peers>,
    /// A snapshot is taken once the log has grown by this many records since the latest.
    pub every_records: u64,
}

impl std::fmt::Debug for SnapshotConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotConfig").field("every_records", &self.every_records).finish_non_exhaustive()
    }
}

/// What a master does about one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRole {
    /// Nothing.
    Idle,
    /// Replays the group's log.
    Standby,
    /// Serves the group under `epoch` (`caretaker`: until a master of its own claims it).
    Primary {
        /// The group's epoch.
        epoch: u64,
        /// As caretaker.
        caretaker: bool,
        /// No other master is live to hold a copy of the group's snapshots: the log is cut below
        /// a snapshot on this master's disk alone (set by the board; callers pass `false`).
        sole_copy: bool,
    },
}

/// What the master does now, published for `/readyz` and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HaStatus {
    /// Registering.
    Starting,
    /// Registered: its role in each group, by rank.
    Active(Vec<GroupRole>),
    /// Gave its roles up when told to stop (SIGTERM).
    Stopped,
    /// Stopped for good, with the reason.
    Failed(String),
}

impl HaStatus {
    /// Whether the master serves requests in this state (of one group at least).
    pub fn serves(&self) -> bool {
        matches!(self, HaStatus::Active(roles) if roles.iter().any(|r| matches!(r, GroupRole::Primary { .. })))
    }

    /// One line for `/readyz` and logs.
    pub fn describe(&self) -> String {
        match self {
            HaStatus::Starting => "starting: registering in the coordination store".into(),
            HaStatus::Active(roles) if roles.len() == 1 => match roles[0] {
                GroupRole::Primary { epoch, .. } => {
                    format!("primary of the group at epoch {}", tycho_routing::epoch_in_incarnation(epoch))
                }
                GroupRole::Standby => "standby: replaying the primary's log".into(),
                GroupRole::Idle => "idle: waiting for a role".into(),
            },
            HaStatus::Active(roles) => {
                let primary: Vec<String> = (0..roles.len())
                    .filter_map(|r| match roles[r] {
                        GroupRole::Primary { epoch, caretaker, .. } => Some(format!(
                            "{r} (epoch {}{})",
                            tycho_routing::epoch_in_incarnation(epoch),
                            if caretaker { ", caretaker" } else { "" }
                        )),
                        _ => None,
                    })
                    .collect();
                let standby: Vec<String> =
                    (0..roles.len()).filter(|&r| roles[r] == GroupRole::Standby).map(|r| r.to_string()).collect();
                match (primary.is_empty(), standby.is_empty()) {
                    (true, true) => "idle: waiting for a role".into(),
                    (true, false) => format!("standby of group {}: replaying its primary's log", standby.join(", ")),
                    (false, true) => format!("primary of groups {}", primary.join(", ")),
                    (false, false) => {
                        format!("primary of groups {}; standby of group {}", primary.join(", "), standby.join(", "))
                    }
                }
            }
            HaStatus::Stopped => "stopped: told to stop; gave its registration up".into(),
            HaStatus::Failed(why) => format!("stopped: {why}"),
        }
    }

    /// What an operator should know while the master serves: the groups whose snapshots are on
    /// this master's disk alone, and what losing that disk costs.
    pub fn warning(&self) -> Option<String> {
        let HaStatus::Active(roles) = self else { return None };
        let sole: Vec<String> = (0..roles.len())
            .filter(|&r| matches!(roles[r], GroupRole::Primary { sole_copy: true, .. }))
            .map(|r| r.to_string())
            .collect();
        (!sole.is_empty()).then(|| {
            format!(
                "group {}: no other master is live, so the snapshots the log is cut below are on this master's \
                 disk alone; losing that disk loses the metadata below the latest snapshot (objects come back as \
                 their nodes remount). Start a second master.",
                sole.join(", ")
            )
        })
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
/// registration, so that other masters take its groups over at once) or the master must leave
/// (`Err`: it serves nothing any more and should be restarted). `status` follows its roles.
pub async fn run(
    master: Arc<Master>,
    store: Arc<dyn MetaStore>,
    cfg: HaConfig,
    status: watch::Sender<HaStatus>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), HaError> {
    tokio::pin!(stop);
    let groups = master.config().group_count.max(1);
    // Every group this master writes commits through one combiner (group commit across
    // groups), unless the caller chose otherwise.
    let mut cfg = cfg;
    if cfg.writer.combiner.is_none() && groups > 1 {
        cfg.writer.combiner = Some(crate::log::oplog::TxnCombiner::start(store.clone()));
    }
    master.advertise(&cfg.address);
    stand_by_all(&master);
    status.send_replace(HaStatus::Starting);
    let keys = ClusterKeys::new(&cfg.cluster);
    master.set_segment_directory(Arc::new(crate::cluster::segments::EtcdSegmentDirectory::new(
        store.clone(),
        keys.clone(),
    )));
    let _quota = crate::cluster::segments::QuotaReader::start(master.clone(), store.clone(), keys.clone());
    let snaps =
        cfg.snapshots.as_ref().map(|s| Snapshots::new(store.clone(), s.files.clone(), keys.clone(), s.every_records));
    let mut roles: Vec<Roles> = (0..groups).map(|_| Roles::default()).collect();
    let board = Board { roles: Mutex::new((vec![GroupRole::Idle; groups as usize], false)), status: &status };
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
        tracing::info!(id = %cfg.id, cluster = %cfg.cluster, groups, "registered");
        board.publish();
        let watchdog = tokio::spawn(fence_at_deadline(master.clone(), keeper.subscribe()));
        let compactor = tokio::spawn(compact_history(store.clone(), keys.clone()));
        let ctx =
            Ctx { master: &master, store: &store, cfg: &cfg, keys: &keys, keeper: &keeper, snaps: snaps.as_ref() };
        // One loop per group; the first that must end the master's registration ends them all.
        // Stopping drops them wherever they wait: a promotion under way is abandoned (the
        // group is not served here, and another master takes it once this one's registration
        // is gone).
        let loops = futures_util::future::try_join_all(
            roles.iter_mut().enumerate().map(|(rank, role)| group_loop(&ctx, rank as u32, role, &board)),
        );
        let result = tokio::select! {
            _ = stop.as_mut() => Ok(()),
            r = loops => r.map(|_| ()),
        };
        watchdog.abort();
        compactor.abort();
        match result {
            // A master that serves nothing loses nothing with its lease: it registers again
            // and goes on (a standby keeps its place in the log, and finds out there whether
            // the log still holds what it needs). A primary's state is stale: it leaves.
            Err(HaError::Lease(why)) if roles.iter().all(|r| r.log.is_none()) => {
                tracing::warn!(%why, "registration lease lost while not serving; registering again");
                status.send_replace(HaStatus::Starting);
                // (Nor about to serve: a promotion under way was abandoned.)
                stand_by_all(&master);
                let _ = keeper.revoke().await;
            }
            result => break (result, keeper),
        }
    };
    // Leaving: serve nothing more, end the logs, give up the registration (other masters take
    // the groups over now rather than after the lease's TTL).
    stand_by_all(&master);
    for role in &mut roles {
        if let Some(task) = role.snapshotting.take() {
            task.abort();
        }
    }
    for log in roles.iter().filter_map(|r| r.log.as_ref()) {
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

/// Stops serving every group (reads included).
fn stand_by_all(master: &Master) {
    for rank in 0..master.config().group_count.max(1) {
        master.stand_by(rank);
    }
}

/// The roles of every group, published together as the master's status.
struct Board<'a> {
    /// Each group's role, and whether this master keeps snapshots that no other live master
    /// copies (which every primary role then carries as `sole_copy`).
    roles: Mutex<(Vec<GroupRole>, bool)>,
    status: &'a watch::Sender<HaStatus>,
}

impl Board<'_> {
    /// Notes the master's role in group `rank` (a primary's `sole_copy` is the board's).
    fn set(&self, rank: u32, role: GroupRole) {
        let mut guard = self.roles.lock();
        let (roles, alone) = &mut *guard;
        let role = match role {
            GroupRole::Primary { epoch, caretaker, .. } => GroupRole::Primary { epoch, caretaker, sole_copy: *alone },
            other => other,
        };
        if roles[rank as usize] != role {
            roles[rank as usize] = role;
            self.status.send_replace(HaStatus::Active(roles.clone()));
        }
    }

    /// Notes whether this master's snapshots are copied by no other live master.
    fn set_alone(&self, now: bool) {
        let mut guard = self.roles.lock();
        let (roles, alone) = &mut *guard;
        if *alone == now {
            return;
        }
        *alone = now;
        for r in roles.iter_mut() {
            if let GroupRole::Primary { sole_copy, .. } = r {
                *sole_copy = now;
            }
        }
        self.status.send_replace(HaStatus::Active(roles.clone()));
    }

    /// Publishes the roles as they are (after registering).
    fn publish(&self) {
        self.status.send_replace(HaStatus::Active(self.roles.lock().0.clone()));
    }
}

/// Group `rank`'s loop: decides and acts until an error that ends the registration.
async fn group_loop(ctx: &Ctx<'_>, rank: u32, role: &mut Roles, board: &Board<'_>) -> Result<(), HaError> {
    loop {
        match step(ctx, rank, role, board).await {
            Ok(()) => {}
            // The store is unreachable for a moment: keep the role while the lease holds
            // (`step` checks it first) and try again.
            Err(HaError::Store(e)) => {
                tracing::warn!(group = rank, error = %e, "coordination store call failed; retrying");
                tokio::time::sleep(STORE_RETRY).await;
            }
            // The group's log could not be opened under the record just read (another master
            // changed it), or a takeover of it failed (the log's end was not reached in time,
            // no snapshot to start from, a log that does not replay): this group starts over
            // after a pause; the others go on.
            Err(e @ (HaError::Fenced(_) | HaError::Promote(_) | HaError::Snapshot(_) | HaError::Follow(_))) => {
                drop_group(ctx.master, rank, role, board, &e.to_string());
                tokio::time::sleep(SNAPSHOT_RETRY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Registers `reg` under the keeper's lease, only if no live process holds the same id (a
/// process restarted quickly waits for its predecessor's registration to run out; a second
/// process given the same id waits for the first to go). False if `stop` completed first.
async fn register_alone(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    reg: &MasterRegistration,
    keeper: &LeaseKeeper,
    stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
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

/// Compacts the coordination store's history every [`HISTORY_COMPACTION`], up to the revision
/// it stood at one period before, whatever else happens (each snapshot publication compacts
/// too, up to the publication before it): history grows with every write of the cluster,
/// and nothing reads further back than a watcher that fell that far behind, which reads the
/// log again. Every master does it; a compaction to a revision compacted already is refused
/// by the store and ignored.
async fn compact_history(store: Arc<dyn MetaStore>, keys: ClusterKeys) {
    let mut tick = tokio::time::interval(HISTORY_COMPACTION);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut previous = None;
    loop {
        tick.tick().await;
        let Ok(now) = store.get(&keys.all_snapshots()).await.map(|r| r.revision) else { continue };
        if let Some(revision) = previous.filter(|&r| r > 0) {
            match store.compact(revision).await {
                Ok(()) => tracing::debug!(revision, "coordination store history compacted"),
                Err(e) => tracing::debug!(revision, error = %e, "history compaction skipped"),
            }
        }
        previous = Some(now);
    }
}

/// Stops `master` serving every group once the lease's local deadline passes without a
/// renewal, whatever else the master is doing then (a store call may take longer than the
/// deadline).
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
    stand_by_all(&master);
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

/// What this master holds of one group.
#[derive(Default)]
struct Roles {
    /// As standby: its position in the log.
    follower: Option<LogFollower>,
    /// As primary: the log it writes.
    log: Option<Arc<OpLogWriter>>,
    /// As primary without a standby, or as standby: the snapshot being taken.
    snapshotting: Option<tokio::task::JoinHandle<()>>,
    /// As primary of a group migrating to a reshard's target: since when its writes are
    /// frozen.
    frozen_since: Option<tokio::time::Instant>,
    /// As primary or standby: the copy of the latest snapshot being fetched.
    copying: Option<tokio::task::JoinHandle<()>>,
}

/// Every group's record (by rank, `None` while it does not exist) with the revision it was read
/// at.
type Records = Vec<Option<(GroupRecord, tycho_meta::Revision)>>;

/// Every group's reshard intent (by rank) with the revision it was read at.
type Intents = Vec<Option<(ReshardIntent, tycho_meta::Revision)>>;

/// The live registrations (oldest first), every group's record and every reshard intent, read
/// after the watches that report their changes were opened. The records are published to the
/// master as its route table too.
async fn view(ctx: &Ctx<'_>, groups: u32) -> Result<(Vec<String>, Records, Intents), HaError> {
    let registrations = masters(&**ctx.store, ctx.keys).await?;
    let mut records = vec![None; groups as usize];
    let mut req = RangeRequest::prefix(ctx.keys.groups(), 256);
    loop {
        let page = ctx.store.range(req.clone()).await.map_err(|e| HaError::Store(e.to_string()))?;
        for kv in &page.kvs {
            let record = GroupRecord::decode(&kv.value)?;
            // A record of a rank past G (hand-written, or of another layout) is not this
            // cluster's: it is not read.
            if let Some(slot) = records.get_mut(record.rank as usize) {
                if kv.key == ctx.keys.group(record.rank) {
                    *slot = Some((record, kv.mod_revision));
                }
            }
        }
        match req.next_page(&page) {
            Some(next) => req = next,
            None => break,
        }
    }
    let owner = |g: &GroupRecord| {
        registrations.iter().find(|(r, _)| r.id == g.primary).map_or(String::new(), |(r, _)| r.address.clone())
    };
    ctx.master.publish_routes(tycho_proto::RouteTable {
        groups,
        epochs: records.iter().map(|r| r.as_ref().map_or(0, |(g, _)| g.epoch)).collect(),
        owners: records.iter().map(|r| r.as_ref().map_or(String::new(), |(g, _)| owner(g))).collect(),
        lease_ttl_ms: ctx.cfg.lease_ttl.as_millis() as u64,
    });
    let intents = reshard::read_intents(&**ctx.store, ctx.keys, groups).await?;
    if let Some(peers) = ctx.cfg.snapshots.as_ref().and_then(|s| s.peers.as_ref()) {
        peers.set(registrations.iter().filter(|(r, _)| r.id != ctx.cfg.id).map(|(r, _)| r.address.clone()).collect());
    }
    Ok((registrations.into_iter().map(|(r, _)| r.id).collect(), records, intents))
}

/// One decision about group `rank` and its action.
async fn step(ctx: &Ctx<'_>, rank: u32, role: &mut Roles, board: &Board<'_>) -> Result<(), HaError> {
    let Ctx { master, store, cfg, keys, keeper, .. } = *ctx;
    check_lease(keeper)?;
    if let Some(e) = role.log.as_ref().and_then(|l| l.failed()) {
        // Another master changed the group's record: what this one holds of it is stale.
        drop_group(master, rank, role, board, &format!("its log ended: {e}"));
    }
    // Watches start before the reads, so no change between them is missed.
    let mut changes = Changes::open(&**store, keys).await?;
    let groups = master.config().group_count.max(1);
    let (live, records, intents) = view(ctx, groups).await?;
    // Snapshots in each master's own directory, and no other master to copy them.
    board.set_alone(
        ctx.cfg.snapshots.as_ref().is_some_and(|s| s.peers.is_some()) && !live.iter().any(|l| *l != ctx.cfg.id),
    );
    // Every master keeps a copy of every group's latest snapshot (from the peers the view just
    // listed): whoever takes a group over finds one at home, and the log is cut only below
    // snapshots two masters hold.
    keep_copy(ctx, rank, role);
    let now_ms = tycho_proto::auth::capability::unix_ms();
    let views: Vec<GroupView> = records
        .iter()
        .zip(&intents)
        .map(|(r, i)| GroupView::of(r.as_ref().map(|(g, _)| g), i.as_ref().map(|(i, _)| i), now_ms))
        .collect();
    let intent = intents[rank as usize].clone();
    let holds = |r: u32| r == rank && (role.follower.is_some() || role.log.is_some());
    let action = cvm::plan(&cfg.id, &live, &views, holds).into_iter().find(|(r, _)| *r == rank).map(|(_, a)| a);
    tracing::debug!(group = rank, ?action, "role decision");
    let group = records[rank as usize].clone();
    if role.log.is_some() && !matches!(action, Some(Action::Serve | Action::EndReshard)) {
        drop_group(master, rank, role, board, "the group record no longer names this master primary");
    }
    // Named primary and not serving yet (a promotion that has not finished, a restart that
    // takes the group back): clients wait here, unless the group goes to its standby.
    let named = group.as_ref().is_some_and(|(g, _)| g.primary == cfg.id);
    master.installing(rank, named && !matches!(action, Some(Action::HandTo(_))));
    let listed = group.as_ref().is_some_and(|(g, _)| g.standbys.contains(&cfg.id));
    let nothing_to_do = action.is_none();
    match (action, group) {
        (Some(Action::Create { caretake }), _) => match create_group(&**store, keys, rank, &cfg.id, caretake).await {
            Ok(created) => {
                let log = open_as_primary(ctx, rank, &created).await?;
                master.take_over(rank, created.0.epoch);
                master.adopt_segments(rank);
                master.note_route(rank, created.0.epoch, &cfg.address);
                board.set(rank, GroupRole::Primary { epoch: created.0.epoch, caretaker: caretake, sole_copy: false });
                tracing::info!(group = rank, epoch = created.0.epoch, caretake, "created the group: serving it");
                role.log = Some(log);
            }
            Err(OwnershipError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        },
        (Some(Action::Serve), Some(read)) if role.log.is_none() => {
            // Named primary by a restarted primary that handed the group over, or by a
            // promotion of this master that did not finish: take it, as what it was named.
            let caretake = read.0.caretaken;
            promote_here(ctx, rank, role, board, read, caretake).await?;
        }
        (Some(Action::Serve), group) => {
            let log = role.log.clone().expect("a serving primary has its log");
            if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
                role.snapshotting = None;
            }
            let migrating = group.as_ref().is_some_and(|(g, _)| g.state == GroupState::Migrating);
            if !migrating {
                role.frozen_since = None;
                if master.freeze(rank, false) {
                    tracing::info!(group = rank, "writes thawed");
                }
            } else if source_freezes(ctx, rank, role, &log, group.as_ref(), intent.as_ref()).await? {
                // The intent or the record changed: decide again.
                return Ok(());
            }
            if let Some((g, _)) = &group {
                board.set(rank, GroupRole::Primary { epoch: g.epoch, caretaker: g.caretaken, sole_copy: false });
            }
            // Without a live standby to snapshot the group, the primary does, off its own state.
            let standby_alive = group
                .as_ref()
                .is_some_and(|(g, _)| g.standbys.iter().any(|s| *s != cfg.id && live.iter().any(|l| l == s)));
            let mut due_at = None;
            if let (Some(snaps), false, None) = (ctx.snaps, standby_alive, &role.snapshotting) {
                let (pointers, _) = snaps.pointers(rank).await?;
                let at = snaps.next_due(&pointers, master.group_objects(rank));
                if log.durable() >= at {
                    let epoch = group.as_ref().map_or(0, |(g, _)| g.epoch);
                    // Cut the log below the latest only once another master holds it too, when
                    // there is another.
                    let copies = if live.len() > 1 { 2 } else { 1 };
                    role.snapshotting =
                        Some(tokio::spawn(snapshot_as_primary(snaps.clone(), master.clone(), rank, epoch, copies)));
                } else {
                    due_at = Some(at);
                }
            }
            let snapshotting = &mut role.snapshotting;
            // A reshard's deadline, and a freeze's limit, end it without any other change.
            let reshard_due = intent.as_ref().map(|(i, _)| {
                tokio::time::Instant::now() + Duration::from_millis(i.deadline_ms.saturating_sub(now_ms))
            });
            let due = [reshard_due, role.frozen_since.map(|t| t + FREEZE_LIMIT)].into_iter().flatten().min();
            let wake = async {
                tokio::select! {
                    _ = async {
                        match due {
                            Some(at) => tokio::time::sleep_until(at).await,
                            None => std::future::pending().await,
                        }
                    } => {}
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
            changes.wait(keeper, wake).await?;
            if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
                role.snapshotting = None;
            }
        }
        (Some(Action::HandTo(heir)), Some(read)) => {
            tracing::info!(group = rank, %heir, "restarted without the group's state: handing it to its standby");
            match change_group(&**store, keys, &read, |g| {
                g.primary = heir.clone();
                g.standbys.retain(|s| *s != heir);
                g.state = GroupState::Stable;
                g.migrating_to = None;
                g.caretaken = false;
            })
            .await
            {
                Ok(_) | Err(OwnershipError::Conflict(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        (Some(Action::JoinAsStandby), Some(read)) => {
            let me = cfg.id.clone();
            match change_standbys(&**store, keys, &read, |s| s.push(me)).await {
                Ok(_) | Err(OwnershipError::Conflict(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        (Some(Action::Follow), Some((g, _))) => follow(ctx, rank, role, board, &g, changes, true).await?,
        (Some(Action::Claim), Some(read)) => {
            // A planned switch: catch up while the caretaker still serves, then promote (the
            // compare-and-swap fences the caretaker's log), so that the group waits only for
            // the log's last records.
            board.set(rank, GroupRole::Standby);
            if role.follower.is_none() {
                role.follower = Some(bootstrap(ctx, rank).await?);
            }
            let follower = role.follower.as_mut().expect("set above");
            let mut apply = apply_to(master, rank);
            match tokio::time::timeout(cfg.catch_up_deadline, follower.catch_up(&mut apply)).await {
                Ok(Ok(_)) => promote_here(ctx, rank, role, board, read, false).await?,
                Ok(Err(FollowError::Store(why))) => return Err(HaError::Store(why)),
                Ok(Err(FollowError::Compacted)) => return Err(HaError::Store("history compacted under a read".into())),
                Ok(Err(e)) => rebootstrap(master, rank, role, &e),
                // The log grows faster than it is read: follow on and decide again.
                Err(_) => tracing::info!(group = rank, "not caught up with the caretaker yet; claiming later"),
            }
        }
        (Some(Action::TakeOver { caretake }), Some(read)) => {
            promote_here(ctx, rank, role, board, read, caretake).await?;
        }
        (Some(Action::Migrate), Some(read)) => migrate(ctx, rank, role, board, read, intent, changes).await?,
        (Some(Action::EndReshard), Some(read)) => end_reshard(ctx, rank, role, read, intent).await?,
        _ => {
            // What a master replayed of a group it no longer follows (a reshard's target whose
            // move was abandoned) goes: it would only grow stale.
            if nothing_to_do && role.log.is_none() && role.follower.is_some() && !listed {
                drop_group(master, rank, role, board, "no longer a standby of the group");
            }
            if role.log.is_none() && role.follower.is_none() {
                board.set(rank, GroupRole::Idle);
            }
            changes.wait(keeper, std::future::pending()).await?;
        }
    }
    Ok(())
}

/// The source's part in a reshard of group `rank`, whose record is migrating to the target:
/// freeze new writes; after a short grace for the writes in flight, wait until the log holds
/// everything admitted and mark the intent frozen at that position (true: the intent changed,
/// decide again); past the freeze's limit, lift it (true too).
async fn source_freezes(
    ctx: &Ctx<'_>,
    rank: u32,
    role: &mut Roles,
    log: &OpLogWriter,
    group: Option<&(GroupRecord, tycho_meta::Revision)>,
    intent: Option<&(ReshardIntent, tycho_meta::Revision)>,
) -> Result<bool, HaError> {
    let Ctx { master, store, keys, .. } = *ctx;
    let since = *role.frozen_since.get_or_insert_with(tokio::time::Instant::now);
    if !master.freeze(rank, true) {
        let target = group.and_then(|(g, _)| g.migrating_to.clone()).unwrap_or_default();
        tracing::info!(group = rank, %target, "reshard: writes frozen for the switch");
    }
    if since.elapsed() >= FREEZE_LIMIT {
        let Some(read) = group else { return Ok(true) };
        tracing::warn!(group = rank, limit = ?FREEZE_LIMIT, "reshard: the target did not switch in time; lifting the freeze");
        end_reshard(ctx, rank, role, read.clone(), intent.cloned()).await?;
        return Ok(true);
    }
    let Some(read) = intent.filter(|(i, _)| i.frozen_at.is_none()) else { return Ok(false) };
    tokio::time::sleep_until(since + FREEZE_GRACE).await;
    let at = log.appended();
    if log.wait(at).await.is_err() {
        // The log ended (the target switched meanwhile, or the store fenced it): decide again.
        return Ok(true);
    }
    match reshard::mark_frozen(&**store, keys, read, at).await {
        Ok(_) => {
            tracing::info!(group = rank, at, "reshard: the log holds every write admitted before the freeze");
            #[cfg(feature = "failpoints")]
            reshard::kill_point("reshard::source_frozen");
        }
        Err(OwnershipError::Conflict(_)) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(true)
}

/// The target's part in a reshard of group `rank` (it is a standby of the group): catch up and
/// set the record migrating to it; once the source has marked the intent frozen, replay the
/// log to there and promote (the compare-and-swap fences the source's log; the promotion then
/// replays whatever the source committed since). Until then, follow the log.
async fn migrate(
    ctx: &Ctx<'_>,
    rank: u32,
    role: &mut Roles,
    board: &Board<'_>,
    read: (GroupRecord, tycho_meta::Revision),
    intent: Option<(ReshardIntent, tycho_meta::Revision)>,
    changes: Changes,
) -> Result<(), HaError> {
    let Ctx { master, store, cfg, keys, .. } = *ctx;
    board.set(rank, GroupRole::Standby);
    if role.follower.is_none() {
        role.follower = Some(bootstrap(ctx, rank).await?);
    }
    let mine = read.0.migrating_to.as_deref() == Some(cfg.id.as_str());
    let frozen_at = intent.as_ref().and_then(|(i, _)| i.frozen_at);
    if read.0.state == GroupState::Migrating && !(mine && frozen_at.is_some()) {
        // Waiting for the source to freeze (or for the record to change). No snapshot meanwhile:
        // exporting a large group holds this loop for seconds, while the source's writes wait
        // for it to switch.
        return follow(ctx, rank, role, board, &read.0, changes, false).await;
    }
    let follower = role.follower.as_mut().expect("set above");
    let mut apply = apply_to(master, rank);
    match tokio::time::timeout(cfg.catch_up_deadline, follower.catch_up(&mut apply)).await {
        Ok(Ok(_)) => {}
        Ok(Err(FollowError::Store(why))) => return Err(HaError::Store(why)),
        Ok(Err(FollowError::Compacted)) => return Err(HaError::Store("history compacted under a read".into())),
        Ok(Err(e)) => {
            rebootstrap(master, rank, role, &e);
            return Ok(());
        }
        Err(_) => {
            tracing::info!(group = rank, "reshard: not caught up with the source yet");
            return Ok(());
        }
    }
    if read.0.state == GroupState::Stable {
        match set_migrating(&**store, keys, &read, Some(&cfg.id)).await {
            Ok(_) => {
                tracing::info!(group = rank, source = %read.0.primary, "reshard: caught up; the group is migrating here");
                #[cfg(feature = "failpoints")]
                reshard::kill_point("reshard::target_migrating");
            }
            Err(OwnershipError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(());
    }
    #[cfg(feature = "failpoints")]
    {
        // A target that hangs short of the switch while it keeps its lease (tests).
        let hang = (|| {
            fail::fail_point!("reshard::switch", |_| true);
            false
        })();
        if hang {
            tracing::warn!(group = rank, "failpoint reshard::switch: not switching");
            return follow(ctx, rank, role, board, &read.0, changes, false).await;
        }
    }
    tracing::info!(group = rank, source = %read.0.primary, at = ?frozen_at, "reshard: the source froze writes; switching");
    promote_here(ctx, rank, role, board, read, false).await
}

/// Ends group `rank`'s reshard at its primary: deletes the request first (so that no master
/// acts on it any more), then lifts the freeze (the record back to stable, the target that was
/// on its way dropped from the standbys). Done, when this master is the target, promoted; else
/// abandoned (past its deadline or the freeze's limit, the target gone, or the group failed
/// over meanwhile). A record left migrating after the request is gone is ended by the next
/// step, by the same rule.
async fn end_reshard(
    ctx: &Ctx<'_>,
    rank: u32,
    role: &mut Roles,
    read: (GroupRecord, tycho_meta::Revision),
    intent: Option<(ReshardIntent, tycho_meta::Revision)>,
) -> Result<(), HaError> {
    let Ctx { master, store, cfg, keys, .. } = *ctx;
    let done = intent.as_ref().is_some_and(|(i, _)| i.target == cfg.id);
    if let Some((i, rev)) = &intent {
        reshard::clear(&**store, keys, rank, *rev).await?;
        if done {
            tracing::info!(group = rank, source = %i.source, "reshard done: serving the group");
        } else {
            tracing::warn!(group = rank, target = %i.target, "reshard abandoned: the group stays here");
        }
    }
    let target = intent.as_ref().map(|(i, _)| i.target.clone()).filter(|t| !done && read.0.standbys.contains(t));
    let lifted = if read.0.state == GroupState::Migrating {
        set_migrating(&**store, keys, &read, None).await.map(drop)
    } else if let Some(target) = target {
        change_standbys(&**store, keys, &read, |s| s.retain(|x| *x != target)).await.map(drop)
    } else {
        Ok(())
    };
    match lifted {
        Ok(()) => {}
        // Changed meanwhile: the next step decides from the new record.
        Err(OwnershipError::Conflict(_)) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    role.frozen_since = None;
    if master.freeze(rank, false) {
        tracing::info!(group = rank, "writes thawed");
    }
    Ok(())
}

/// Replays group `rank`'s log as its standby until a change of the records to decide on (or,
/// when `may_snapshot`, a snapshot falls due, which it takes).
async fn follow(
    ctx: &Ctx<'_>,
    rank: u32,
    role: &mut Roles,
    board: &Board<'_>,
    g: &GroupRecord,
    mut changes: Changes,
    may_snapshot: bool,
) -> Result<(), HaError> {
    let Ctx { master, keeper, .. } = *ctx;
    board.set(rank, GroupRole::Standby);
    if role.follower.is_none() {
        role.follower = Some(bootstrap(ctx, rank).await?);
    }
    let follower = role.follower.as_mut().expect("set above");
    if role.snapshotting.as_ref().is_some_and(|t| t.is_finished()) {
        role.snapshotting = None;
    }
    // A snapshot is due once the log reaches this record (one at a time).
    let due_at = match ctx.snaps.filter(|_| may_snapshot && role.snapshotting.is_none()) {
        Some(snaps) => {
            let (pointers, _) = snaps.pointers(rank).await?;
            Some(snaps.next_due(&pointers, master.group_objects(rank)))
        }
        None => None,
    };
    let due = tokio::sync::Notify::new();
    let mut replay = apply_to(master, rank);
    let mut apply = |seq: u64, rec: &crate::log::record::Record| {
        replay(seq, rec)?;
        if due_at.is_some_and(|at| seq >= at) {
            due.notify_one();
        }
        Ok(())
    };
    let (mut lease_lost, mut snapshot) = (None, false);
    let saving = &mut role.snapshotting;
    let followed = follower
        .follow(&mut apply, async {
            tokio::select! {
                r = changes.wait(keeper, std::future::pending()) => lease_lost = r.err(),
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
        // The follower keeps its place: the next step follows on from it. A compacted read
        // raced a compaction of the store's history: it reads again.
        Err(FollowError::Store(why)) => return Err(HaError::Store(why)),
        Err(FollowError::Compacted) => return Err(HaError::Store("history compacted under a read".into())),
        Err(e) => {
            rebootstrap(master, rank, role, &e);
            tokio::time::sleep(SNAPSHOT_RETRY).await;
            return Ok(());
        }
    }
    if let Some(e) = lease_lost {
        return Err(e);
    }
    if snapshot {
        let snaps = ctx.snaps.expect("a snapshot is due only with snapshots configured").clone();
        // Publishing cuts the log below the latest snapshot: only once another master (the
        // primary) holds a copy of it too. Asked again a second later.
        if !snaps.base_held(rank, 2).await.unwrap_or(false) {
            role.snapshotting = Some(tokio::spawn(tokio::time::sleep(SNAPSHOT_RETRY)));
            return Ok(());
        }
        let follower = role.follower.as_ref().expect("following");
        let applied = follower.applied();
        // The follower applies nothing meanwhile: the export is of one log position. Writing
        // and publishing it goes on in the background while the log is followed.
        let entries = master.export_group(rank).unwrap_or_default();
        let id = SnapshotId::new(rank, applied, g.epoch);
        let m = master.clone();
        role.snapshotting = Some(tokio::spawn(async move {
            match snaps.save(id, entries).await {
                Ok(Some(_)) => note_snapshot(&m, rank, applied),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(group = rank, error = %e, "could not take a snapshot; the standby goes on");
                    tokio::time::sleep(SNAPSHOT_RETRY).await;
                }
            }
        }));
    }
    Ok(())
}

/// Fetches a copy of group `rank`'s latest snapshot in the background if this master lacks
/// one and no fetch runs (snapshots in each master's own directory; see
/// [`Snapshots::keep_copy`]). Every master does, for every group: a master that takes a group
/// over then starts from a copy of its own.
fn keep_copy(ctx: &Ctx<'_>, rank: u32, role: &mut Roles) {
    let Some(snaps) = ctx.snaps.filter(|_| ctx.cfg.snapshots.as_ref().is_some_and(|s| s.peers.is_some())) else {
        return;
    };
    if role.copying.as_ref().is_some_and(|t| !t.is_finished()) {
        return;
    }
    let snaps = snaps.clone();
    role.copying = Some(tokio::spawn(async move {
        // (A peer may be restarting, or the view of the peers not yet current: a few tries.)
        for _ in 0..COPY_TRIES {
            match snaps.keep_copy(rank).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(group = rank, error = %e, "could not keep a copy of the group's latest snapshot")
                }
            }
            tokio::time::sleep(SNAPSHOT_RETRY).await;
        }
    }));
}

/// Stops serving group `rank` and forgets what this master held of it (another master owns
/// it now, or its log cannot be trusted): the other groups go on.
fn drop_group(master: &Master, rank: u32, role: &mut Roles, board: &Board<'_>, why: &str) {
    tracing::warn!(group = rank, %why, "no longer serving the group; dropping what this master held of it");
    master.stand_by(rank);
    role.frozen_since = None;
    if let Some(task) = role.snapshotting.take() {
        task.abort();
    }
    // Commits in flight find out they were fenced (their writers get KVPT_NOT_OWNED, not an
    // unknown outcome); nothing new is admitted, as the group is not served any more.
    if let Some(log) = role.log.take() {
        tokio::spawn(async move { log.finish(LOG_DRAIN).await });
    }
    role.follower = None;
    // The group keeps its ended log as its sink until a new one replaces it: a request admitted
    // before the group stopped being served that logs now gets the log's error, never an
    // answer without a record.
    master.reset_group(rank);
    board.set(rank, GroupRole::Idle);
}

/// Drops what this master replayed of group `rank`, which may not be what the log says
/// (`why`): the next step starts over from the newest snapshot.
fn rebootstrap(master: &Master, rank: u32, role: &mut Roles, why: &FollowError) {
    tracing::error!(group = rank, error = %why, "cannot follow the group's log: starting over from the latest snapshot");
    master.reset_group(rank);
    role.follower = None;
    if let Some(g) = master.group(rank) {
        g.log_stats().note_rebootstrap();
    }
}

/// A primary without a standby snapshots its group: from a scratch master rebuilt from the
/// latest snapshot and the log, never from the state it serves.
async fn snapshot_as_primary(snaps: Snapshots, master: Arc<Master>, rank: u32, epoch: u64, copies: usize) {
    if !snaps.base_held(rank, copies).await.unwrap_or(false) {
        tokio::time::sleep(SNAPSHOT_RETRY).await;
        return;
    }
    // Replaying and exporting the scratch copy is long work: on a thread of its own, so that the
    // runtime's workers keep serving.
    let handle = tokio::runtime::Handle::current();
    let work = tokio::task::spawn_blocking(move || {
        handle.block_on(async move {
            let started = std::time::Instant::now();
            let (entries, applied) = match snaps.rebuild(&master, rank).await {
                Ok((scratch, applied)) => (scratch.export_group(rank).unwrap_or_default(), applied),
                Err(e) => {
                    tracing::warn!(group = rank, error = %e, "could not rebuild the group to snapshot it");
                    return false;
                }
            };
            match snaps.save(SnapshotId::new(rank, applied, epoch), entries).await {
                Ok(published) => {
                    if published.is_some() {
                        note_snapshot(&master, rank, applied);
                    }
                    tracing::debug!(group = rank, applied, took = ?started.elapsed(), "primary snapshot done");
                    true
                }
                Err(e) => {
                    tracing::warn!(group = rank, error = %e, "could not take a snapshot");
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
fn note_snapshot(master: &Master, rank: u32, applied: u64) {
    if let Some(g) = master.group(rank) {
        g.log_stats().note_snapshot(applied, tycho_proto::auth::capability::unix_ms());
    }
}

/// A follower of group `rank`'s log for a master that holds nothing of it: from the newest
/// snapshot when there is one (its state imported into the master), else from the log's
/// start.
async fn bootstrap(ctx: &Ctx<'_>, rank: u32) -> Result<LogFollower, HaError> {
    let master = ctx.master;
    master.reset_group(rank);
    let from = match ctx.snaps {
        Some(snaps) => snaps.restore(master, rank).await?,
        None => {
            let (pointers, _) = read_pointers(&**ctx.store, ctx.keys, rank).await?;
            if pointers.floor > 0 {
                return Err(HaError::Snapshot(CompactionError::NoBase {
                    floor: pointers.floor,
                    why: "this master has no snapshot store (--snapshot-dir)".into(),
                }));
            }
            0
        }
    };
    let follower = LogFollower::new(ctx.store.clone(), log_keys(ctx.keys, rank), rank, from, FOLLOW_PAGE);
    Ok(match master.group(rank) {
        Some(g) => follower.with_stats(g.log_stats().clone()),
        None => follower,
    })
}

/// Promotes this master from group `rank`'s record `read` (replaying the log from where it
/// stands, or from the newest snapshot when it followed nothing); `caretake`: as the group's
/// caretaker.
async fn promote_here(
    ctx: &Ctx<'_>,
    rank: u32,
    role: &mut Roles,
    board: &Board<'_>,
    read: (GroupRecord, tycho_meta::Revision),
    caretake: bool,
) -> Result<(), HaError> {
    let Ctx { master, store, cfg, keys, .. } = *ctx;
    if role.follower.is_none() {
        role.follower = Some(bootstrap(ctx, rank).await?);
    }
    let follower = role.follower.as_mut().expect("set above");
    let started = std::time::Instant::now();
    let promotion = Promotion {
        store: store.clone(),
        keys,
        me: &cfg.id,
        read,
        caretake,
        catch_up_deadline: cfg.catch_up_deadline,
        writer: writer_config(master, rank, cfg),
    };
    match promote(master, follower, promotion).await {
        Ok((record, log)) => {
            tracing::info!(group = rank, epoch = record.epoch, caretake, took = ?started.elapsed(), "took the group over");
            board.set(rank, GroupRole::Primary { epoch: record.epoch, caretaker: record.caretaken, sole_copy: false });
            master.note_route(rank, record.epoch, &cfg.address);
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
        Err(PromoteError::CatchUp(FollowError::Compacted)) => {
            Err(HaError::Store("history compacted under a read".into()))
        }
        // What this master replayed cannot reach the log's end (it fell behind the floor, or
        // the log does not apply to it): it starts over from the newest snapshot, and the next
        // step promotes again (the record names it primary already).
        Err(PromoteError::CatchUp(e)) => {
            rebootstrap(master, rank, role, &e);
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Opens group `rank`'s log for writing under the record this master just created and makes it
/// the group's record sink.
async fn open_as_primary(
    ctx: &Ctx<'_>,
    rank: u32,
    created: &(GroupRecord, tycho_meta::Revision),
) -> Result<Arc<OpLogWriter>, HaError> {
    let Ctx { master, store, cfg, keys, .. } = *ctx;
    let (record, revision) = created;
    let fence = Fence { key: keys.group(rank), mod_revision: *revision, owner: Some((cfg.id.clone(), record.epoch)) };
    let log = OpLogWriter::open(
        store.clone(),
        log_keys(keys, rank),
        fence,
        rank,
        record.epoch,
        writer_config(master, rank, cfg),
    )
    .await
    .map_err(HaError::Fenced)?;
    let log = Arc::new(log);
    master.stop_serving_when_log_ends(&log, rank);
    if !master.set_record_sink(rank, Some(log.clone())) {
        return Err(HaError::Fenced(LogError::Refused(format!("this master holds no container for group {rank}"))));
    }
    Ok(log)
}

/// The log writer's settings, reporting to group `rank`'s figures.
fn writer_config(master: &Master, rank: u32, cfg: &HaConfig) -> WriterConfig {
    let mut w = cfg.writer.clone();
    if let Some(g) = master.group(rank) {
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

/// Watches of what a decision reads: the registrations, the group records and the reshard
/// intents.
struct Changes {
    masters: tycho_meta::Watch,
    groups: tycho_meta::Watch,
    intents: tycho_meta::Watch,
    /// Snapshot publications: the group's other masters keep a copy of each.
    snapshots: tycho_meta::Watch,
}

impl Changes {
    async fn open(store: &dyn MetaStore, keys: &ClusterKeys) -> Result<Changes, HaError> {
        let w = |r| async move { store.watch(r).await.map_err(|e| HaError::Store(e.to_string())) };
        Ok(Changes {
            masters: w(WatchRequest::prefix(keys.masters())).await?,
            groups: w(WatchRequest::prefix(keys.groups())).await?,
            intents: w(WatchRequest::prefix(keys.reshard_intents())).await?,
            snapshots: w(WatchRequest::prefix(keys.all_snapshots())).await?,
        })
    }

    /// Waits for a change of the registrations or the group records, or for `also` (`Ok`), or
    /// for the end of the lease (`Err`).
    async fn wait(&mut self, keeper: &LeaseKeeper, also: impl std::future::Future<Output = ()>) -> Result<(), HaError> {
        let mut lease = keeper.subscribe();
        tokio::pin!(also);
        loop {
            // Act on the lease only until its local deadline, without waiting to be told.
            let deadline = keeper.state().deadline().ok_or_else(|| HaError::Lease("lost".into()))?;
            tokio::select! {
                _ = tokio::time::sleep_until(deadline.into()) => check_lease(keeper)?,
                changed = lease.changed() => {
                    if changed.is_err() {
                        return Err(HaError::Lease("its keeper stopped".into()));
                    }
                    check_lease(keeper)?;
                }
                e = self.masters.next() => if is_change(e)? { return Ok(()) },
                e = self.groups.next() => if is_change(e)? { return Ok(()) },
                e = self.intents.next() => if is_change(e)? { return Ok(()) },
                e = self.snapshots.next() => if is_change(e)? { return Ok(()) },
                _ = &mut also => return Ok(()),
            }
        }
    }
}
