//! Hot-replica fan-out (issue 16, spec 05): the master counts each key's reads in its heat
//! window ([`crate::state::heat`]), and a key that turns hot is, in enforce mode, queued for a
//! background admission that checks it (a value, no write or copy in flight, no cooldown,
//! fewer replicas than the limit, a target to put one on) and creates a copy task from a
//! replica of the key to a segment on another host under a lease ([`crate::state::task::DynamicLease`])
//! that fences its copy by time, version and client; the source's client runs it as any copy,
//! and its replicas are marked dynamic when it commits, for eviction to drop first (see
//! `Master::evict_round`). In observe mode the admission decides the same and only counts and
//! logs it. The read path only counts and, at most once per key and window, queues the key.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tycho_proto::*;
use tycho_routing::{decode_object_key, partition_of_encoded};

use super::Master;
use crate::state::config::FanoutMode;
use crate::state::heat::Seen;
use crate::state::object::ObjectKey;
use crate::state::segment::{MountedSegment, Replica};

/// Why an admission did not create a copy (the label of its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suppressed {
    /// The admission queue was full.
    QueueFull,
    /// The key is gone, or has no value.
    NoObject,
    /// A write or a copy of the key is in flight, or a task of it waits.
    InFlight,
    /// The key has as many replicas as fan-out may give it.
    ReplicaLimit,
    /// No segment can take a copy.
    NoTarget,
    /// The task could not be created (the pending-task limit, a group that moved).
    TaskRefused,
    /// Eviction dropped a dynamic replica of the key a short while ago.
    Cooldown,
}

impl Suppressed {
    /// Every reason, in counter order.
    pub const ALL: [Suppressed; 7] = [
        Suppressed::QueueFull,
        Suppressed::NoObject,
        Suppressed::InFlight,
        Suppressed::ReplicaLimit,
        Suppressed::NoTarget,
        Suppressed::TaskRefused,
        Suppressed::Cooldown,
    ];

    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            Suppressed::QueueFull => "queue_full",
            Suppressed::NoObject => "no_object",
            Suppressed::InFlight => "in_flight",
            Suppressed::ReplicaLimit => "replica_limit",
            Suppressed::NoTarget => "no_target",
            Suppressed::TaskRefused => "task_refused",
            Suppressed::Cooldown => "cooldown",
        }
    }

    /// Its place in [`Suppressed::ALL`] (and so in the counters).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What fan-out did, for the metrics.
#[derive(Default)]
pub struct FanoutCounters {
    /// Keys that turned hot (once per key and window).
    pub hot: AtomicU64,
    /// Reads not counted: the heat window was full.
    pub dropped: AtomicU64,
    /// Admissions that created a copy task (in observe mode: that would have).
    pub admitted: AtomicU64,
    /// Admissions that did not, by reason ([`Suppressed::ALL`]'s order).
    pub suppressed: [AtomicU64; 7],
    /// Dynamic replicas that exist (each counts itself while it does).
    pub dynamic_live: Arc<AtomicU64>,
    /// Dynamic replicas eviction dropped.
    pub shrunk: AtomicU64,
}

/// The source a copy is taken from: a live replica, the same one whichever master decides
/// (the lowest segment name, then id).
pub(crate) fn pick_source(replicas: &[Replica]) -> Option<&Replica> {
    replicas
        .iter()
        .filter(|r| r.seg.is_alive())
        .min_by(|a, b| (a.seg.desc.name.as_str(), a.seg.desc.id).cmp(&(b.seg.desc.name.as_str(), b.seg.desc.id)))
}

/// Where a copy of `size` bytes goes, among `segments`: not one that holds a replica, nor one
/// without that many bytes left; a host that holds none first; then one that stays at or below
/// 85% full after the copy; then the lowest id. (Free bytes may be fragmented: the copy's start
/// can still find no room, and its task then fails.)
pub(crate) fn pick_target(
    segments: &[Arc<MountedSegment>],
    replicas: &[Replica],
    size: u64,
) -> Option<Arc<MountedSegment>> {
    let holds = |s: &MountedSegment| replicas.iter().any(|r| r.seg.desc.id == s.desc.id);
    let host_holds = |s: &MountedSegment| replicas.iter().any(|r| r.seg.is_alive() && r.seg.desc.host == s.desc.host);
    let too_full = |s: &MountedSegment| (s.used() + size) as f64 > 0.85 * s.room() as f64;
    segments
        .iter()
        .filter(|s| s.is_alive() && !holds(s) && s.used().saturating_add(size) <= s.room())
        .min_by_key(|s| (host_holds(s), too_full(s), s.desc.id))
        .cloned()
}

impl Master {
    /// Counts a read of `key` that found its replicas (GetReplicaList and its batch form); a key
    /// that turns hot is queued for admission (enforce and observe modes). Takes only the heat
    /// window's shard lock, and the queue's when the key turns hot.
    pub(super) fn note_read(&self, key: &[u8], now: u64) {
        if self.cfg.fanout.mode == FanoutMode::Off {
            return;
        }
        match self.heat.saw(key, now) {
            Seen::Counted => {}
            Seen::Dropped => {
                self.fanout.dropped.fetch_add(1, Ordering::Relaxed);
            }
            Seen::TurnedHot => {
                self.fanout.hot.fetch_add(1, Ordering::Relaxed);
                let mut queue = self.hot_keys.lock();
                if queue.len() >= self.cfg.fanout.queue {
                    drop(queue);
                    self.suppress(Suppressed::QueueFull);
                } else {
                    queue.push_back(key.into());
                }
            }
        }
    }

    /// How many keys the heat window tracks.
    pub fn heat_keys(&self) -> usize {
        self.heat.len()
    }

    /// How many dynamic copies hold a lease, over the groups served.
    pub fn dynamic_leases(&self) -> usize {
        self.serving().map(|g| g.tasks.lock().leases()).sum()
    }

    /// How many replicas fan-out added exist, over the groups this master holds.
    pub fn dynamic_replicas(&self) -> u64 {
        self.fanout.dynamic_live.load(Ordering::Relaxed)
    }

    fn suppress(&self, why: Suppressed) {
        self.fanout.suppressed[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Runs the admissions queued since the last call (housekeeping calls it each tick).
    pub(super) fn admit_hot_keys(&self) {
        let keys: Vec<ObjectKey> = std::mem::take(&mut *self.hot_keys.lock()).into();
        for key in keys {
            match self.admit_hot(&key) {
                Ok(()) => {
                    self.fanout.admitted.fetch_add(1, Ordering::Relaxed);
                }
                Err(why) => self.suppress(why),
            }
        }
    }

    /// Checks a hot key and, in enforce mode, creates its copy task.
    fn admit_hot(&self, key: &[u8]) -> Result<(), Suppressed> {
        let group = self.group_of_key(key).filter(|g| g.is_serving()).ok_or(Suppressed::NoObject)?;
        let (source, target) = {
            let map = group.shard_of(key).read();
            let obj = map.get(key).filter(|o| o.is_complete()).ok_or(Suppressed::NoObject)?;
            if obj.pending.is_some() || group.tasks.lock().unfinished_of(key) > 0 {
                return Err(Suppressed::InFlight);
            }
            if obj.cooldown_until > self.now() {
                return Err(Suppressed::Cooldown);
            }
            let live = obj.replicas.iter().filter(|r| r.seg.is_alive()).count();
            if live >= self.cfg.fanout.max_memory_replicas as usize {
                return Err(Suppressed::ReplicaLimit);
            }
            let source = pick_source(&obj.replicas).ok_or(Suppressed::NoObject)?;
            let target = pick_target(&group.segments.live(), &obj.replicas, obj.size).ok_or(Suppressed::NoTarget)?;
            (source.seg.desc.name.clone(), target.desc.name.clone())
        };
        let (tenant, user_key) = decode_object_key(key).ok_or(Suppressed::NoObject)?;
        if self.cfg.fanout.mode == FanoutMode::Observe {
            tracing::info!(tenant, key = user_key, %source, %target, "hot key: enforce mode would copy it");
            return Ok(());
        }
        let route = RouteTag { partition_id: partition_of_encoded(key), epoch: group.epoch() };
        let req = CreateTask {
            tenant: tenant.to_string(),
            key: KeyRef { key: user_key.to_string(), route },
            kind: TaskKind::Copy,
            source,
            targets: vec![target],
        };
        match self.create_task_with(&req, Some(self.cfg.fanout.lease_ms)) {
            Ok(id) => {
                tracing::debug!(tenant, key = user_key, task = format_args!("{id:032x}"), "hot key: copy task created");
                Ok(())
            }
            Err(e) => {
                tracing::debug!(tenant, key = user_key, error = %e, "hot key: no copy task");
                Err(Suppressed::TaskRefused)
            }
        }
    }
}
