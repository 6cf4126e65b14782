//! What can go wrong talking to the coordination store, and the wire code for each case.

use thiserror::Error;
use tycho_proto::ErrorCode;

use crate::kv::{KeyValue, LeaseId, Revision};

/// A failed [`MetaStore`](crate::MetaStore) call. Both stores return the same variant for the
/// same cause, so callers match on it without knowing which store they hold.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MetaError {
    /// A compare-and-set helper's condition did not hold. `current` is the key as it is now
    /// (`None`: absent), read in the same transaction, so the caller can decide without
    /// another round trip.
    #[error("compare failed on key {key:?}: it is now {}", describe(current))]
    CompareFailed {
        /// The key the helper guarded.
        key: String,
        /// The key's current value and revisions, or `None` if it does not exist.
        current: Option<Box<KeyValue>>,
    },
    /// The revision asked for is older than the oldest retained history. Take a fresh snapshot
    /// (a range at the current revision) and watch from its revision + 1.
    #[error("revision {requested} is compacted (history starts at {compact_revision}); re-read and resume")]
    Compacted {
        /// The revision the call asked for.
        requested: Revision,
        /// The oldest revision still available.
        compact_revision: Revision,
    },
    /// The revision asked for has not happened yet.
    #[error("revision {requested} is in the future (current is {current})")]
    FutureRevision {
        /// The revision the call asked for.
        requested: Revision,
        /// The store's revision when it answered (0 if unknown).
        current: Revision,
    },
    /// The lease does not exist: it expired, was revoked, or never was.
    #[error("lease {lease:#x} not found (expired or revoked)")]
    LeaseNotFound {
        /// The lease id.
        lease: LeaseId,
    },
    /// The request is larger than the store accepts (etcd's `--max-request-bytes`). Refused
    /// before it was sent.
    #[error("request of about {size} bytes exceeds the coordinator's limit of {limit} bytes; store large data elsewhere and keep a reference in the key")]
    RequestTooLarge {
        /// Estimated encoded size of the request.
        size: usize,
        /// The limit in force.
        limit: usize,
    },
    /// A transaction has more compares or operations in one branch than the store accepts
    /// (etcd's `--max-txn-ops`). Refused before it was sent.
    #[error("transaction has {ops} {what} but the coordinator accepts at most {limit}; split it")]
    TooManyOps {
        /// Which list is too long: "compares", "success ops" or "failure ops".
        what: &'static str,
        /// Its length.
        ops: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The request is malformed (empty key, a key written twice in one transaction, ...).
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// The store could not be reached or did not answer in time; the outcome of a write is
    /// unknown. Retry reads; retry writes only if they are idempotent or guarded by a compare.
    #[error("coordinator unavailable: {0}")]
    Unavailable(String),
    /// The store answered with an error this layer does not classify.
    #[error("coordinator error: {0}")]
    Other(String),
    /// The watch or store was closed by this process.
    #[error("closed")]
    Closed,
}

fn describe(kv: &Option<Box<KeyValue>>) -> String {
    match kv {
        None => "absent".to_owned(),
        Some(kv) => format!("at mod_revision {} (version {})", kv.mod_revision, kv.version),
    }
}

impl MetaError {
    /// The wire code a caller reports for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            MetaError::CompareFailed { .. } => ErrorCode::ETCD_TRANSACTION_FAIL,
            MetaError::LeaseNotFound { .. } => ErrorCode::ETCD_KEY_NOT_EXIST,
            MetaError::RequestTooLarge { .. } | MetaError::TooManyOps { .. } | MetaError::InvalidArgument(_) => {
                ErrorCode::INVALID_PARAMS
            }
            MetaError::Closed => ErrorCode::ETCD_CTX_CANCELLED,
            MetaError::Compacted { .. }
            | MetaError::FutureRevision { .. }
            | MetaError::Unavailable(_)
            | MetaError::Other(_) => ErrorCode::ETCD_OPERATION_ERROR,
        }
    }

    /// Whether the store could not be reached (as opposed to refusing the request).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, MetaError::Unavailable(_))
    }
}

/// The result of a [`MetaStore`](crate::MetaStore) call.
pub type MetaResult<T> = Result<T, MetaError>;
