//! A group's tasks as the log and snapshots keep them: ids, tasks, their changes and the
//! leases of dynamic copies. Object state's task table (`state/task.rs`) applies them.

use serde::{Deserialize, Serialize};
use tycho_proto::ClientId;

/// A task's id: the group's rank in the top 16 bits (so that any master can route a query to
/// the group's primary), the rest random.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TaskId(pub u128);

impl TaskId {
    /// A task id of group `rank` (below 65,536: a cluster has at most 16,384 groups) with the
    /// random part `random`.
    pub fn new(rank: u32, random: u128) -> TaskId {
        debug_assert!(rank <= u32::from(u16::MAX), "group rank {rank} does not fit a task id");
        TaskId((u128::from(rank as u16) << 112) | (random & ((1u128 << 112) - 1)))
    }

    /// The group the task belongs to.
    pub fn rank(self) -> u32 {
        (self.0 >> 112) as u32
    }
}

pub use tycho_proto::{TaskKind, TaskStatus};

/// One task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// Its id.
    pub id: TaskId,
    /// Copy or move.
    pub kind: TaskKind,
    /// The object's storage key (`tycho_routing::encode_object_key`).
    pub key: Vec<u8>,
    /// The segment whose replica is copied or moved (by name, as the user names segments).
    pub source: String,
    /// The segments that receive a replica (one for a move).
    pub targets: Vec<String>,
    /// The client that runs it: the owner of the source segment.
    pub assigned: ClientId,
    /// Where it stands.
    pub status: TaskStatus,
    /// When it was created (Unix ms).
    pub created_ms: u64,
    /// When its status last changed (Unix ms).
    pub updated_ms: u64,
    /// Why it failed, or a word on its success.
    pub message: String,
}

/// One change of a group's tasks, as logged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskRecord {
    /// A task was created, pending.
    Created(Task),
    /// `client` fetched these pending tasks of its own: they run.
    Started {
        /// The fetching client.
        client: ClientId,
        /// The tasks, in the order it got them.
        ids: Vec<TaskId>,
        /// When (Unix ms).
        at_ms: u64,
    },
    /// A task ended.
    Finished {
        /// The task.
        id: TaskId,
        /// Failed or Success.
        status: TaskStatus,
        /// Why, in a few words.
        message: String,
        /// When (Unix ms).
        at_ms: u64,
    },
    /// Finished tasks dropped (past the finished limit): queries no longer find them.
    Forgotten {
        /// The tasks.
        ids: Vec<TaskId>,
    },
    /// A dynamic copy's lease (hot-replica fan-out, record layout 4 on), installed before its
    /// task is created; it ends when its task does.
    Leased(DynamicLease),
    /// A lease whose task was never created (its creation was refused): rolled back.
    LeaseDropped {
        /// The task it was for.
        task: TaskId,
    },
}

/// The fence of a copy that fan-out started (spec 05): the copy may start and end only while
/// the lease lasts, on the version of the value it was granted for, by the client that holds
/// the source replica. Named by its task, which it goes with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamicLease {
    /// The copy task it fences.
    pub task: TaskId,
    /// The object's storage key.
    pub key: Vec<u8>,
    /// The version of the value to copy.
    pub version: u64,
    /// The client that holds the source replica and alone may run the copy.
    pub source: ClientId,
    /// When it runs out (Unix ms): its task fails then, and its copy is dropped.
    pub expires_ms: u64,
}

/// Why a dynamic copy's step is refused by its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRefusal {
    /// The lease ran out.
    Expired,
    /// The value changed since the lease was granted.
    Version,
    /// The caller is not the source's client.
    NotSource,
}

impl DynamicLease {
    /// Whether `client` may take a step of the copy of `version` at `now_ms`.
    pub fn check(&self, client: ClientId, version: u64, now_ms: u64) -> Result<(), LeaseRefusal> {
        if client != self.source {
            Err(LeaseRefusal::NotSource)
        } else if now_ms >= self.expires_ms {
            Err(LeaseRefusal::Expired)
        } else if version != self.version {
            Err(LeaseRefusal::Version)
        } else {
            Ok(())
        }
    }
}
