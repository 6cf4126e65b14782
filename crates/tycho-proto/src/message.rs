//! Every master RPC: one [`Request`] variant per call and the [`Response`] variant that
//! answers it. Batch calls answer one result per key, in request order.

use serde::{Deserialize, Serialize};

use crate::error::{ErrorCode, WireResult};
use crate::types::*;

#[cfg(test)]
use proptest_derive::Arbitrary;

/// Start a write (PutStart or UpsertStart) of one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct WriteStart {
    /// The writer.
    pub client: ClientId,
    /// Tenant namespace of the key.
    pub tenant: String,
    /// Key and route.
    pub key: KeyRef,
    /// Object size in bytes.
    pub size: u64,
    /// Placement and pinning.
    pub config: ReplicateConfig,
    /// Identity of this write, chosen by the writer (non-zero, unique among its writes): the
    /// end or revoke names it, so that a retried or late call can only finish this write, and
    /// a start whose answer was lost can still be revoked. A retried start with the same id
    /// gets the same ranges back. The committed value's version is its write id.
    pub write_id: u64,
}

/// Start writes of several keys with one placement config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct BatchWriteStart {
    /// The writer.
    pub client: ClientId,
    /// Tenant namespace of the keys.
    pub tenant: String,
    /// Keys with their sizes.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub items: Vec<(KeyRef, u64)>,
    /// Placement and pinning for every key.
    pub config: ReplicateConfig,
    /// One write id per item (see [`WriteStart::write_id`]).
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub write_ids: Vec<u64>,
}

/// End or revoke a write of one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct WriteFinish {
    /// The writer; must be the client that started the write.
    pub client: ClientId,
    /// Tenant namespace of the key.
    pub tenant: String,
    /// Key and route.
    pub key: KeyRef,
    /// The write to end or revoke, as its start named it.
    pub write_id: u64,
}

/// End or revoke writes of several keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct BatchWriteFinish {
    /// The writer.
    pub client: ClientId,
    /// Tenant namespace of the keys.
    pub tenant: String,
    /// Keys and routes.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub keys: Vec<KeyRef>,
    /// One write id per key.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub write_ids: Vec<u64>,
}

/// A read-side call on one key (GetReplicaList, ExistKey).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct KeyQuery {
    /// Tenant namespace of the key.
    pub tenant: String,
    /// Key and route.
    pub key: KeyRef,
}

/// A read-side call on several keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct BatchKeyQuery {
    /// Tenant namespace of the keys.
    pub tenant: String,
    /// Keys and routes.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub keys: Vec<KeyRef>,
}

/// Remove one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct RemoveKey {
    /// Tenant namespace of the key.
    pub tenant: String,
    /// Key and route.
    pub key: KeyRef,
    /// Remove even while a read lease is held.
    pub force: bool,
}

/// Remove several keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct BatchRemoveKeys {
    /// Tenant namespace of the keys.
    pub tenant: String,
    /// Keys and routes.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub keys: Vec<KeyRef>,
    /// Remove even while read leases are held.
    pub force: bool,
}

/// Drop the replicas of objects the caller wrote, once no read lease holds them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct ReplicaClear {
    /// The caller; only objects whose current value it wrote are cleared.
    pub client: ClientId,
    /// Tenant namespace of the keys.
    pub tenant: String,
    /// Keys and routes.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_BATCH }>")]
    pub keys: Vec<KeyRef>,
    /// Segment name: clear only replicas on it (the object goes when none is left);
    /// empty clears the whole object.
    pub segment: String,
}

/// Create a copy or move task of one key (Mooncake's CreateCopyTask / CreateMoveTask). The
/// task is run by the client that owns the source segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct CreateTask {
    /// Tenant namespace of the key.
    pub tenant: String,
    /// Key and route.
    pub key: KeyRef,
    /// Copy or move.
    pub kind: TaskKind,
    /// The segment (by name) whose replica a move moves; empty for a copy (the master picks a
    /// complete replica).
    pub source: String,
    /// The segments (by name) to put a replica on: one for a move.
    #[serde(deserialize_with = "crate::bounded::vec::<_, _, { crate::bounded::DECODE_MAX_NAMES }>")]
    pub targets: Vec<String>,
}

/// Ask about a task of the caller's tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct TaskQuery {
    /// Tenant namespace of the task's key.
    pub tenant: String,
    /// The task.
    pub id: u128,
    /// A partition of the task's group (the id's top 16 bits are the group's rank), for the
    /// request's route.
    pub route: RouteTag,
}

/// A step of a copy that the task's client runs: start it (CopyStart), commit it (CopyEnd), or
/// give it up (CopyRevoke, which fails the task).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct CopyStep {
    /// The client the task is assigned to.
    pub client: ClientId,
    /// Tenant namespace of the key.
    pub tenant: String,
    /// Key and route.
    pub key: KeyRef,
    /// The task.
    pub task: u128,
    /// Identity of this copy, chosen by the client (non-zero): the end or revoke names it, and
    /// a retried start with the same id gets the same ranges back.
    pub write_id: u64,
    /// Why a revoke gives up (empty otherwise).
    pub message: String,
}

/// Every call a client can make to a master.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum Request {
    /// Liveness heartbeat; never takes a metadata shard lock.
    Ping {
        /// The caller.
        client: ClientId,
    },
    /// Whether the master accepts data-plane calls.
    ServiceReady,
    /// Contribute a segment.
    MountSegment {
        /// The owner.
        client: ClientId,
        /// The segment.
        segment: SegmentDesc,
    },
    /// Re-contribute every segment after NEED_REMOUNT.
    ReMountSegment {
        /// The owner.
        client: ClientId,
        /// All its segments.
        segments: Vec<SegmentDesc>,
    },
    /// Withdraw a segment; its replicas are dropped.
    UnmountSegment {
        /// The owner.
        client: ClientId,
        /// The segment.
        segment: SegmentId,
    },
    /// Begin a put-if-absent.
    PutStart(WriteStart),
    /// Commit a put.
    PutEnd(WriteFinish),
    /// Abandon a put.
    PutRevoke(WriteFinish),
    /// Batch form of PutStart.
    BatchPutStart(BatchWriteStart),
    /// Batch form of PutEnd.
    BatchPutEnd(BatchWriteFinish),
    /// Batch form of PutRevoke.
    BatchPutRevoke(BatchWriteFinish),
    /// Begin a write that replaces any existing value.
    UpsertStart(WriteStart),
    /// Commit an upsert.
    UpsertEnd(WriteFinish),
    /// Abandon an upsert; the old value stays.
    UpsertRevoke(WriteFinish),
    /// Batch form of UpsertStart.
    BatchUpsertStart(BatchWriteStart),
    /// Batch form of UpsertEnd.
    BatchUpsertEnd(BatchWriteFinish),
    /// Batch form of UpsertRevoke.
    BatchUpsertRevoke(BatchWriteFinish),
    /// Where to read a key; grants a read lease.
    GetReplicaList(KeyQuery),
    /// Batch form of GetReplicaList.
    BatchGetReplicaList(BatchKeyQuery),
    /// Whether a complete object exists; extends its lease.
    ExistKey(KeyQuery),
    /// Batch form of ExistKey.
    BatchExistKey(BatchKeyQuery),
    /// Remove one object.
    Remove(RemoveKey),
    /// Remove several objects.
    BatchRemove(BatchRemoveKeys),
    /// Remove every object of a tenant whose key matches a regular expression.
    RemoveByRegex {
        /// Tenant namespace.
        tenant: String,
        /// Regular expression (Rust `regex` syntax) matched against whole keys.
        regex: String,
        /// Remove leased objects too.
        force: bool,
    },
    /// Remove every object.
    RemoveAll {
        /// Remove leased objects too.
        force: bool,
    },
    /// Mounted segments and their usage.
    ListSegments,
    /// Keys, optionally filtered by tenant and regex, at most `limit`.
    ListKeys {
        /// Tenant filter; `None` lists all tenants.
        tenant: Option<String>,
        /// Regex filter on the key.
        regex: Option<String>,
        /// Maximum number of keys returned.
        limit: u32,
    },
    /// Whole-master figures.
    Stats,
    /// Whether every metadata shard can be read-locked within the master's budget (spec 02).
    /// Read-only; answers on a standby too.
    HealthCheck,
    /// Drop replicas of objects whose lease has ended (Mooncake's BatchReplicaClear); one result
    /// per key, Ok for each one cleared.
    BatchReplicaClear(ReplicaClear),
    /// Ask for a client id of `tenant` and its credential (on a connection that proved the
    /// cluster secret). The client then proves that identity on every connection.
    Register {
        /// The tenant the client's keys belong to.
        tenant: String,
    },
    /// The KVPT groups this master serves and their epochs, for the routes of key-addressed
    /// requests (a client asks again when a request answers STALE_EPOCH).
    Routes,
    /// Create a copy or move task; answered with its id.
    CreateTask(CreateTask),
    /// Where a task stands.
    QueryTask(TaskQuery),
    /// The caller's tasks waiting to run, handed to it to run now (at most 16).
    FetchTasks {
        /// The caller.
        client: ClientId,
    },
    /// Start a task's copy: the new ranges are reserved and granted.
    CopyStart(CopyStep),
    /// Commit a task's copy: the new replicas are readable (and a move's source is gone), and
    /// the task has succeeded.
    CopyEnd(CopyStep),
    /// Give up a task's copy: its ranges are free and the task has failed.
    CopyRevoke(CopyStep),
    /// One file of a group snapshot this master holds in its data directory (masters of the
    /// cluster fetch snapshots from each other this way; the cluster's admin only).
    SnapshotFile(SnapshotFileQuery),
    /// Mount (or mount again) the caller's segments with an incarnation per group's slice, in
    /// the groups this master serves; registers the caller (as ReMountSegment does). Answered
    /// with [`Response::Slices`].
    MountSlices {
        /// The owner.
        client: ClientId,
        /// Its segments.
        segments: Vec<SlicedSegment>,
    },
    /// Name one of the caller's mounted segments as a stable segment, one that keeps its id
    /// across restarts of its owner and may hold VSegment extents (docs/vsegment.md). The
    /// master checks that `segment` is the stable id of `name` and that the caller has it
    /// mounted, and answers once the cluster's descriptor of it is stored; a master without a
    /// coordination store answers Done and stores nothing.
    StableSegment {
        /// The owner.
        client: ClientId,
        /// The segment.
        segment: SegmentId,
        /// Its stable name.
        name: String,
        /// What its bytes live on.
        medium: crate::quota::Medium,
    },
}

/// Which snapshot file [`Request::SnapshotFile`] asks for: the snapshot's identity (as
/// `tycho_master::snapshot::SnapshotId` has it) and the file's name in it (`manifest`, or
/// `chunk-NNNNNN`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct SnapshotFileQuery {
    /// The group's rank.
    pub group: u32,
    /// The log position the snapshot holds the group at.
    pub applied: u64,
    /// The epoch it was taken under.
    pub epoch: u64,
    /// Its writer's tag.
    pub writer: u64,
    /// The file.
    pub file: String,
}

/// Answer to [`Request::Routes`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct RouteTable {
    /// G, the number of KVPT groups: a key's group is `tycho_routing::kvpt_to_rank(partition, G)`.
    pub groups: u32,
    /// Each group's epoch, by rank (0: unknown).
    pub epochs: Vec<u64>,
    /// The address of each group's primary, by rank, as the master answering knows it (empty:
    /// unknown, or a master without a cluster, which serves every group itself).
    pub owners: Vec<String>,
    /// The answering master's registration lease (`--ha-lease-ttl`) in milliseconds; 0 for a
    /// master without a cluster. A primary that stops answering is replaced within about
    /// this long, so a client's patience with one try is derived from it.
    pub lease_ttl_ms: u64,
}

impl Request {
    /// Whether the request may change durable metadata (and so is logged by an HA master).
    pub fn mutates(&self) -> bool {
        !matches!(
            self,
            Request::Ping { .. }
                | Request::ServiceReady
                | Request::Register { .. }
                | Request::GetReplicaList(_)
                | Request::BatchGetReplicaList(_)
                | Request::ExistKey(_)
                | Request::BatchExistKey(_)
                | Request::ListSegments
                | Request::ListKeys { .. }
                | Request::Stats
                | Request::HealthCheck
                | Request::Routes
                | Request::SnapshotFile(_)
                | Request::QueryTask(_)
        )
    }

    /// The routes of every key the request names, to be recomputed after a route change.
    pub fn routes_mut(&mut self) -> Vec<&mut RouteTag> {
        match self {
            Request::PutStart(r) | Request::UpsertStart(r) => vec![&mut r.key.route],
            Request::PutEnd(r) | Request::PutRevoke(r) | Request::UpsertEnd(r) | Request::UpsertRevoke(r) => {
                vec![&mut r.key.route]
            }
            Request::BatchPutStart(r) | Request::BatchUpsertStart(r) => {
                r.items.iter_mut().map(|(k, _)| &mut k.route).collect()
            }
            Request::BatchPutEnd(r)
            | Request::BatchPutRevoke(r)
            | Request::BatchUpsertEnd(r)
            | Request::BatchUpsertRevoke(r) => r.keys.iter_mut().map(|k| &mut k.route).collect(),
            Request::GetReplicaList(q) | Request::ExistKey(q) => vec![&mut q.key.route],
            Request::BatchGetReplicaList(q) | Request::BatchExistKey(q) => {
                q.keys.iter_mut().map(|k| &mut k.route).collect()
            }
            Request::Remove(r) => vec![&mut r.key.route],
            Request::BatchRemove(r) => r.keys.iter_mut().map(|k| &mut k.route).collect(),
            Request::BatchReplicaClear(r) => r.keys.iter_mut().map(|k| &mut k.route).collect(),
            Request::CreateTask(r) => vec![&mut r.key.route],
            Request::QueryTask(q) => vec![&mut q.route],
            Request::CopyStart(r) | Request::CopyEnd(r) | Request::CopyRevoke(r) => vec![&mut r.key.route],
            _ => Vec::new(),
        }
    }

    /// The partition of every key the request names, in order (none for a request of no key).
    pub fn partitions(&self) -> Vec<u16> {
        let one = |k: &KeyRef| vec![k.route.partition_id];
        let many = |ks: &[KeyRef]| ks.iter().map(|k| k.route.partition_id).collect();
        match self {
            Request::PutStart(r) | Request::UpsertStart(r) => one(&r.key),
            Request::PutEnd(r) | Request::PutRevoke(r) | Request::UpsertEnd(r) | Request::UpsertRevoke(r) => {
                one(&r.key)
            }
            Request::BatchPutStart(r) | Request::BatchUpsertStart(r) => {
                r.items.iter().map(|(k, _)| k.route.partition_id).collect()
            }
            Request::BatchPutEnd(r)
            | Request::BatchPutRevoke(r)
            | Request::BatchUpsertEnd(r)
            | Request::BatchUpsertRevoke(r) => many(&r.keys),
            Request::GetReplicaList(q) | Request::ExistKey(q) => one(&q.key),
            Request::BatchGetReplicaList(q) | Request::BatchExistKey(q) => many(&q.keys),
            Request::Remove(r) => one(&r.key),
            Request::BatchRemove(r) => many(&r.keys),
            Request::BatchReplicaClear(r) => many(&r.keys),
            Request::CreateTask(r) => one(&r.key),
            Request::QueryTask(q) => vec![q.route.partition_id],
            Request::CopyStart(r) | Request::CopyEnd(r) | Request::CopyRevoke(r) => one(&r.key),
            _ => Vec::new(),
        }
    }

    /// The batch request of the keys at `at` (indices into its keys, in that order), with
    /// everything else as in `self`: the part of a batch for one master. `None` for a request
    /// that is not a batch.
    pub fn subset(&self, at: &[usize]) -> Option<Request> {
        fn pick<T: Clone>(v: &[T], at: &[usize]) -> Vec<T> {
            at.iter().filter_map(|&i| v.get(i).cloned()).collect()
        }
        let start = |r: &BatchWriteStart| BatchWriteStart {
            items: pick(&r.items, at),
            write_ids: pick(&r.write_ids, at),
            ..r.clone()
        };
        let finish = |r: &BatchWriteFinish| BatchWriteFinish {
            keys: pick(&r.keys, at),
            write_ids: pick(&r.write_ids, at),
            ..r.clone()
        };
        let query = |q: &BatchKeyQuery| BatchKeyQuery { keys: pick(&q.keys, at), ..q.clone() };
        Some(match self {
            Request::BatchPutStart(r) => Request::BatchPutStart(start(r)),
            Request::BatchUpsertStart(r) => Request::BatchUpsertStart(start(r)),
            Request::BatchPutEnd(r) => Request::BatchPutEnd(finish(r)),
            Request::BatchPutRevoke(r) => Request::BatchPutRevoke(finish(r)),
            Request::BatchUpsertEnd(r) => Request::BatchUpsertEnd(finish(r)),
            Request::BatchUpsertRevoke(r) => Request::BatchUpsertRevoke(finish(r)),
            Request::BatchGetReplicaList(q) => Request::BatchGetReplicaList(query(q)),
            Request::BatchExistKey(q) => Request::BatchExistKey(query(q)),
            Request::BatchRemove(r) => Request::BatchRemove(BatchRemoveKeys { keys: pick(&r.keys, at), ..r.clone() }),
            Request::BatchReplicaClear(r) => {
                Request::BatchReplicaClear(ReplicaClear { keys: pick(&r.keys, at), ..r.clone() })
            }
            _ => return None,
        })
    }

    /// How many keys a batch request names (0 for any other request).
    pub fn batch_len(&self) -> usize {
        match self {
            Request::BatchPutStart(r) | Request::BatchUpsertStart(r) => r.items.len().max(r.write_ids.len()),
            Request::BatchPutEnd(r)
            | Request::BatchPutRevoke(r)
            | Request::BatchUpsertEnd(r)
            | Request::BatchUpsertRevoke(r) => r.keys.len().max(r.write_ids.len()),
            Request::BatchGetReplicaList(q) | Request::BatchExistKey(q) => q.keys.len(),
            Request::BatchRemove(r) => r.keys.len(),
            Request::BatchReplicaClear(r) => r.keys.len(),
            _ => 0,
        }
    }
}

/// The answer to a [`Request`]; each variant answers the request of the same name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub enum Response {
    /// The request failed as a whole (malformed, unknown client, routing, ...).
    Error(ErrorCode),
    /// Answer to Ping.
    Ping(PingReply),
    /// Answer to ServiceReady.
    ServiceReady(bool),
    /// Answer to MountSegment, ReMountSegment and UnmountSegment.
    Done,
    /// Answer to PutStart / UpsertStart: one range per placed replica.
    WriteStarted(Vec<ReplicaDesc>),
    /// Answer to BatchPutStart / BatchUpsertStart.
    BatchWriteStarted(Vec<WireResult<Vec<ReplicaDesc>>>),
    /// Per-key answers to batch end, revoke and remove calls.
    BatchDone(Vec<WireResult<()>>),
    /// Answer to GetReplicaList.
    Replicas(ReplicaList),
    /// Answer to BatchGetReplicaList.
    BatchReplicas(Vec<WireResult<ReplicaList>>),
    /// Answer to ExistKey.
    Exists(bool),
    /// Answer to BatchExistKey.
    BatchExists(Vec<WireResult<bool>>),
    /// Answer to RemoveByRegex and RemoveAll: objects removed.
    Removed(u64),
    /// Answer to ListSegments.
    Segments(Vec<SegmentStatus>),
    /// Answer to ListKeys.
    Keys(Vec<KeyInfo>),
    /// Answer to Stats.
    Stats(MasterStats),
    /// Answer to HealthCheck.
    Health(HealthReport),
    /// Answer to PutEnd / UpsertEnd: the ranges of the value the write replaced, already free.
    /// The writer retires them (see `tycho-transfer`'s `Mapping::retire`) before it reports
    /// success, so that no reader whose read starts after that sees the old value through a
    /// replica list it kept. Empty for a first write, and for a repeated end.
    Committed(Vec<ReplicaDesc>),
    /// Answer to BatchPutEnd / BatchUpsertEnd, per key.
    BatchCommitted(Vec<WireResult<Vec<ReplicaDesc>>>),
    /// Answer to Register: a fresh client id and its credential (all zero from a master without
    /// a secret).
    Registered {
        /// The client id to use.
        client: ClientId,
        /// The credential to prove on every connection.
        credential: [u8; 32],
    },
    /// Answer to Routes.
    Routes(RouteTable),
    /// Answer to CreateTask: the new task's id.
    TaskCreated(u128),
    /// Answer to QueryTask.
    Task(TaskInfo),
    /// Answer to FetchTasks: the tasks to run now, oldest first.
    Tasks(Vec<TaskInfo>),
    /// Answer to CopyStart.
    CopyStarted(CopyGrant),
    /// A key-addressed request at a master that does not serve the key's group, which knows
    /// who does (KVPT_NOT_OWNED, with the owner): send it there.
    NotOwned(Redirect),
    /// Answer to SnapshotFile: the file's bytes (sealed and checksummed as stored), or `None`
    /// when this master does not hold it.
    SnapshotFile(Option<Vec<u8>>),
    /// A batch's answer in which some keys were refused because this master does not serve
    /// their groups (KVPT_NOT_OWNED), with the owner of each such group it knows: the client
    /// sends those keys there.
    #[cfg_attr(test, proptest(skip))]
    Redirected {
        /// The batch's answer.
        answer: Box<Response>,
        /// The owners of the groups of the refused keys.
        owners: Vec<Redirect>,
    },
    /// Answer to MountSlices. With `stale` empty, the segments are mounted in the groups of
    /// `mounted` (those this master serves). Otherwise nothing was mounted: the groups of
    /// `stale` no longer hold the caller's segments under the incarnations offered, which were
    /// not fresh; the caller starts new incarnations of those slices and asks again.
    Slices {
        /// The groups the segments are mounted in.
        mounted: Vec<u32>,
        /// The groups that need fresh incarnations.
        stale: Vec<u32>,
    },
}

/// Where a group is served, as the master that refused a request knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(Arbitrary))]
pub struct Redirect {
    /// The group's rank.
    pub group: u32,
    /// Its epoch.
    pub epoch: u64,
    /// Its primary's address.
    pub owner: String,
}

impl Response {
    /// The error the answer is, if it is one (a redirect is KVPT_NOT_OWNED).
    pub fn error_code(&self) -> Option<ErrorCode> {
        match self {
            Response::Error(code) => Some(*code),
            Response::NotOwned(_) => Some(ErrorCode::KVPT_NOT_OWNED),
            _ => None,
        }
    }
}

impl RouteTable {
    /// Whether the table names the primaries of several groups: a client then routes each key to
    /// its group's primary.
    pub fn partitioned(&self) -> bool {
        self.groups > 1 && self.owners.iter().any(|o| !o.is_empty())
    }
}

impl Response {
    /// Each key's error in a batch answer (`None` for a key that succeeded); `None` for an
    /// answer that is not a batch's.
    pub fn batch_errors(&self) -> Option<Vec<Option<ErrorCode>>> {
        fn errors<T>(v: &[WireResult<T>]) -> Vec<Option<ErrorCode>> {
            v.iter().map(|r| r.as_ref().err().copied()).collect()
        }
        match self {
            Response::BatchWriteStarted(v) | Response::BatchCommitted(v) => Some(errors(v)),
            Response::BatchDone(v) => Some(errors(v)),
            Response::BatchReplicas(v) => Some(errors(v)),
            Response::BatchExists(v) => Some(errors(v)),
            _ => None,
        }
    }

    /// The answer to a batch of `n` keys put together from the answers to its parts: each part
    /// is the indices of its keys (as given to [`Request::subset`]) and its answer. A part that
    /// failed as a whole fails its own keys only. `None` if the parts answered with different
    /// kinds of batch answers, or a part's answer does not fit its keys.
    pub fn merge_batch(n: usize, parts: Vec<(Vec<usize>, Response)>) -> Option<Response> {
        fn fill<T: Clone>(
            n: usize,
            parts: Vec<(Vec<usize>, Response)>,
            take: impl Fn(Response) -> Option<Vec<WireResult<T>>>,
        ) -> Option<Vec<WireResult<T>>> {
            let mut out: Vec<WireResult<T>> = vec![Err(ErrorCode::INTERNAL_ERROR); n];
            for (at, resp) in parts {
                match resp {
                    Response::Error(code) => at.iter().for_each(|&i| out[i] = Err(code)),
                    resp => {
                        let results = take(resp)?;
                        if results.len() != at.len() {
                            return None;
                        }
                        for (&i, r) in at.iter().zip(results) {
                            *out.get_mut(i)? = r;
                        }
                    }
                }
            }
            Some(out)
        }
        let kind = parts.iter().map(|(_, r)| r).find(|r| !matches!(r, Response::Error(_)))?.clone();
        Some(match kind {
            Response::BatchWriteStarted(_) => Response::BatchWriteStarted(fill(n, parts, |r| match r {
                Response::BatchWriteStarted(v) => Some(v),
                _ => None,
            })?),
            Response::BatchCommitted(_) => Response::BatchCommitted(fill(n, parts, |r| match r {
                Response::BatchCommitted(v) => Some(v),
                _ => None,
            })?),
            Response::BatchDone(_) => Response::BatchDone(fill(n, parts, |r| match r {
                Response::BatchDone(v) => Some(v),
                _ => None,
            })?),
            Response::BatchReplicas(_) => Response::BatchReplicas(fill(n, parts, |r| match r {
                Response::BatchReplicas(v) => Some(v),
                _ => None,
            })?),
            Response::BatchExists(_) => Response::BatchExists(fill(n, parts, |r| match r {
                Response::BatchExists(v) => Some(v),
                _ => None,
            })?),
            _ => return None,
        })
    }
}

impl Request {
    /// Every RPC name, indexed by [`Request::index`].
    pub const NAMES: &'static [&'static str] = &[
        "ping",
        "service_ready",
        "mount_segment",
        "remount_segment",
        "unmount_segment",
        "put_start",
        "put_end",
        "put_revoke",
        "batch_put_start",
        "batch_put_end",
        "batch_put_revoke",
        "upsert_start",
        "upsert_end",
        "upsert_revoke",
        "batch_upsert_start",
        "batch_upsert_end",
        "batch_upsert_revoke",
        "get_replica_list",
        "batch_get_replica_list",
        "exist_key",
        "batch_exist_key",
        "remove",
        "batch_remove",
        "remove_by_regex",
        "remove_all",
        "list_segments",
        "list_keys",
        "stats",
        "health_check",
        "batch_replica_clear",
        "register",
        "routes",
        "create_task",
        "query_task",
        "fetch_tasks",
        "copy_start",
        "copy_end",
        "copy_revoke",
        "snapshot_file",
        "mount_slices",
        "stable_segment",
    ];

    /// The RPC's name, for metrics and logs.
    pub fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }

    /// Dense index of the RPC into [`Request::NAMES`], for per-RPC metrics.
    pub fn index(&self) -> usize {
        match self {
            Request::Ping { .. } => 0,
            Request::ServiceReady => 1,
            Request::MountSegment { .. } => 2,
            Request::ReMountSegment { .. } => 3,
            Request::UnmountSegment { .. } => 4,
            Request::PutStart(_) => 5,
            Request::PutEnd(_) => 6,
            Request::PutRevoke(_) => 7,
            Request::BatchPutStart(_) => 8,
            Request::BatchPutEnd(_) => 9,
            Request::BatchPutRevoke(_) => 10,
            Request::UpsertStart(_) => 11,
            Request::UpsertEnd(_) => 12,
            Request::UpsertRevoke(_) => 13,
            Request::BatchUpsertStart(_) => 14,
            Request::BatchUpsertEnd(_) => 15,
            Request::BatchUpsertRevoke(_) => 16,
            Request::GetReplicaList(_) => 17,
            Request::BatchGetReplicaList(_) => 18,
            Request::ExistKey(_) => 19,
            Request::BatchExistKey(_) => 20,
            Request::Remove(_) => 21,
            Request::BatchRemove(_) => 22,
            Request::RemoveByRegex { .. } => 23,
            Request::RemoveAll { .. } => 24,
            Request::ListSegments => 25,
            Request::ListKeys { .. } => 26,
            Request::Stats => 27,
            Request::HealthCheck => 28,
            Request::BatchReplicaClear(_) => 29,
            Request::Register { .. } => 30,
            Request::Routes => 31,
            Request::CreateTask(_) => 32,
            Request::QueryTask(_) => 33,
            Request::FetchTasks { .. } => 34,
            Request::CopyStart(_) => 35,
            Request::CopyEnd(_) => 36,
            Request::CopyRevoke(_) => 37,
            Request::SnapshotFile(_) => 38,
            Request::MountSlices { .. } => 39,
            Request::StableSegment { .. } => 40,
        }
    }

    /// The client a request acts for, when it names one.
    pub fn client(&self) -> Option<ClientId> {
        match self {
            Request::Ping { client }
            | Request::MountSegment { client, .. }
            | Request::ReMountSegment { client, .. }
            | Request::MountSlices { client, .. }
            | Request::StableSegment { client, .. }
            | Request::UnmountSegment { client, .. } => Some(*client),
            Request::PutStart(r) | Request::UpsertStart(r) => Some(r.client),
            Request::PutEnd(r) | Request::PutRevoke(r) | Request::UpsertEnd(r) | Request::UpsertRevoke(r) => {
                Some(r.client)
            }
            Request::BatchPutStart(r) | Request::BatchUpsertStart(r) => Some(r.client),
            Request::BatchPutEnd(r)
            | Request::BatchPutRevoke(r)
            | Request::BatchUpsertEnd(r)
            | Request::BatchUpsertRevoke(r) => Some(r.client),
            Request::BatchReplicaClear(r) => Some(r.client),
            Request::FetchTasks { client } => Some(*client),
            // (Not the tenant: a task's client may hold replicas of other tenants' objects; the
            // master checks that the task is the caller's.)
            Request::CopyStart(r) | Request::CopyEnd(r) | Request::CopyRevoke(r) => Some(r.client),
            _ => None,
        }
    }

    /// The tenant whose keys a request touches, when it names one.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Request::PutStart(r) | Request::UpsertStart(r) => Some(&r.tenant),
            Request::PutEnd(r) | Request::PutRevoke(r) | Request::UpsertEnd(r) | Request::UpsertRevoke(r) => {
                Some(&r.tenant)
            }
            Request::BatchPutStart(r) | Request::BatchUpsertStart(r) => Some(&r.tenant),
            Request::BatchPutEnd(r)
            | Request::BatchPutRevoke(r)
            | Request::BatchUpsertEnd(r)
            | Request::BatchUpsertRevoke(r) => Some(&r.tenant),
            Request::GetReplicaList(q) | Request::ExistKey(q) => Some(&q.tenant),
            Request::BatchGetReplicaList(q) | Request::BatchExistKey(q) => Some(&q.tenant),
            Request::Remove(r) => Some(&r.tenant),
            Request::BatchRemove(r) => Some(&r.tenant),
            Request::RemoveByRegex { tenant, .. } => Some(tenant),
            Request::BatchReplicaClear(r) => Some(&r.tenant),
            Request::ListKeys { tenant, .. } => tenant.as_deref(),
            Request::CreateTask(r) => Some(&r.tenant),
            Request::QueryTask(q) => Some(&q.tenant),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{decode_payload, encode_frame, split_frame, FrameKind, DEFAULT_MAX_FRAME};
    use proptest::prelude::*;

    /// The master's default request limit holds the largest request a client may send: a
    /// batch write start of the most keys, each of the longest key, with the longest tenant
    /// and a full list of preferred segments, every number at its widest encoding.
    #[test]
    fn the_largest_request_fits() {
        let key = |i: usize| KeyRef {
            key: format!("{i:0>width$}", width = crate::MAX_KEY_LEN),
            route: RouteTag { partition_id: u16::MAX, epoch: u64::MAX },
        };
        let config = ReplicateConfig {
            replica_num: u32::MAX,
            preferred_segments: vec!["s".repeat(255); 16],
            soft_pin_ttl_ms: Some(u64::MAX),
            ..Default::default()
        };
        let req = Request::BatchPutStart(BatchWriteStart {
            client: ClientId(u128::MAX),
            tenant: "t".repeat(crate::MAX_TENANT_LEN),
            items: (0..crate::MAX_BATCH_KEYS).map(|i| (key(i), u64::MAX)).collect(),
            config,
            write_ids: vec![u64::MAX; crate::MAX_BATCH_KEYS],
        });
        let mut buf = Vec::new();
        encode_frame(&mut buf, FrameKind::Request, 1, &req).unwrap();
        let len = buf.len() as u32;
        eprintln!("largest request: {len} bytes");
        assert!(len > 33_000_000, "{len}: not the largest request");
        assert!(len + 16 < crate::frame::DEFAULT_MAX_REQUEST_FRAME, "{len} bytes and a tag exceed the default limit");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn every_request_round_trips(req: Request, id: u64) {
            let mut buf = Vec::new();
            encode_frame(&mut buf, FrameKind::Request, id, &req).unwrap();
            let (h, payload, used) = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
            prop_assert_eq!(used, buf.len());
            prop_assert_eq!(h.request_id, id);
            prop_assert_eq!(h.kind, FrameKind::Request);
            prop_assert_eq!(decode_payload::<Request>(payload).unwrap(), req);
        }

        #[test]
        fn every_response_round_trips(resp: Response, id: u64) {
            let mut buf = Vec::new();
            encode_frame(&mut buf, FrameKind::Response, id, &resp).unwrap();
            let (h, payload, _) = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap().unwrap();
            prop_assert_eq!(h.kind, FrameKind::Response);
            prop_assert_eq!(decode_payload::<Response>(payload).unwrap(), resp);
        }

        /// Random bytes never panic the decoder: they are a frame, "need more", or an error.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            if let Ok(Some((_, payload, _))) = split_frame(&bytes, 1 << 20) {
                let _ = decode_payload::<Request>(payload);
                let _ = decode_payload::<Response>(payload);
            }
            let _ = decode_payload::<Request>(&bytes);
            let _ = decode_payload::<Response>(&bytes);
        }

        /// A valid frame with one byte flipped decodes to something or to an error, never a panic.
        #[test]
        fn corrupted_frames_never_panic(req: Request, pos: usize, flip: u8) {
            let mut buf = Vec::new();
            encode_frame(&mut buf, FrameKind::Request, 1, &req).unwrap();
            let at = pos % buf.len();
            buf[at] ^= flip | 1;
            if let Ok(Some((_, payload, _))) = split_frame(&buf, DEFAULT_MAX_FRAME) {
                let _ = decode_payload::<Request>(payload);
            }
        }
    }

    #[test]
    fn names_and_indices_agree() {
        assert_eq!(Request::HealthCheck.name(), "health_check");
        assert_eq!(Request::Stats.name(), "stats");
        let last = Request::CopyRevoke(CopyStep {
            client: ClientId(1),
            tenant: String::new(),
            key: KeyRef { key: "k".into(), route: RouteTag { partition_id: 0, epoch: 0 } },
            task: 1,
            write_id: 1,
            message: String::new(),
        });
        assert_eq!(last.name(), "copy_revoke");
        let last = Request::SnapshotFile(SnapshotFileQuery {
            group: 0,
            applied: 1,
            epoch: 1,
            writer: 1,
            file: "manifest".into(),
        });
        assert_eq!(last.name(), "snapshot_file");
        let last = Request::StableSegment {
            client: ClientId(1),
            segment: SegmentId(2),
            name: "n".into(),
            medium: crate::quota::Medium::Dram,
        };
        assert_eq!(last.name(), "stable_segment");
        assert_eq!(Request::NAMES.len(), last.index() + 1);
        let mut sorted = Request::NAMES.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), Request::NAMES.len());
    }

    #[test]
    fn huge_announced_vector_is_an_error_not_an_allocation() {
        // A varint claiming 2^60 elements must fail cleanly.
        let mut payload = vec![26u8]; // variant index of BatchGetReplicaList is not 26; any index works
        payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(decode_payload::<Request>(&payload).is_err());
        let mut payload = vec![18u8, 0]; // BatchGetReplicaList, empty tenant
        payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(decode_payload::<Request>(&payload).is_err());
    }
}
