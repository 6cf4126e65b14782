//! Transactions: compares, then one of two op lists, applied atomically at one revision.

use crate::kv::{KeyValue, LeaseId, Revision};

/// How a compare relates the stored field to the given one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    /// Stored == given.
    Equal,
    /// Stored != given.
    NotEqual,
    /// Stored > given.
    Greater,
    /// Stored < given.
    Less,
}

/// Which field of a key a compare looks at, with the value to compare it to. A missing key has
/// version, create and mod revision 0; a value compare on a missing key is always false.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareTarget {
    /// The value bytes.
    Value(Vec<u8>),
    /// The number of writes since creation.
    Version(i64),
    /// The revision that created the key.
    CreateRevision(Revision),
    /// The revision of the key's last write.
    ModRevision(Revision),
}

/// One condition of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    /// The key compared.
    pub key: Vec<u8>,
    /// The relation.
    pub op: CompareOp,
    /// The field and the value to compare it with.
    pub target: CompareTarget,
}

impl Compare {
    /// `key`'s value equals `value` (false if the key is absent).
    pub fn value_eq(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Compare {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::Value(value.into()) }
    }

    /// `key` does not exist.
    pub fn absent(key: impl Into<Vec<u8>>) -> Compare {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::CreateRevision(0) }
    }

    /// `key` was last written at `revision` (0: it does not exist).
    pub fn mod_revision_eq(key: impl Into<Vec<u8>>, revision: Revision) -> Compare {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::ModRevision(revision) }
    }

    /// `key` has been written exactly `version` times since its creation.
    pub fn version_eq(key: impl Into<Vec<u8>>, version: i64) -> Compare {
        Compare { key: key.into(), op: CompareOp::Equal, target: CompareTarget::Version(version) }
    }

    /// Whether the compare holds for `kv` (`None`: the key is absent).
    pub(crate) fn holds(&self, kv: Option<&KeyValue>) -> bool {
        use std::cmp::Ordering;
        let ordering = match (&self.target, kv) {
            (CompareTarget::Value(_), None) => return false,
            (CompareTarget::Value(v), Some(kv)) => kv.value.as_slice().cmp(v.as_slice()),
            (CompareTarget::Version(v), kv) => kv.map_or(0, |kv| kv.version).cmp(v),
            (CompareTarget::CreateRevision(r), kv) => kv.map_or(0, |kv| kv.create_revision).cmp(r),
            (CompareTarget::ModRevision(r), kv) => kv.map_or(0, |kv| kv.mod_revision).cmp(r),
        };
        match self.op {
            CompareOp::Equal => ordering == Ordering::Equal,
            CompareOp::NotEqual => ordering != Ordering::Equal,
            CompareOp::Greater => ordering == Ordering::Greater,
            CompareOp::Less => ordering == Ordering::Less,
        }
    }
}

/// One operation of a transaction branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    /// Write `value` under `key`, attached to `lease` (or to none).
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The lease to attach, if any.
        lease: Option<LeaseId>,
    },
    /// Remove `key` if it exists.
    Delete {
        /// The key.
        key: Vec<u8>,
    },
    /// Read `key` (as of this point of the transaction).
    Get {
        /// The key.
        key: Vec<u8>,
    },
}

impl TxnOp {
    /// A put without a lease.
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Put { key: key.into(), value: value.into(), lease: None }
    }

    /// A delete.
    pub fn delete(key: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Delete { key: key.into() }
    }

    /// A read.
    pub fn get(key: impl Into<Vec<u8>>) -> TxnOp {
        TxnOp::Get { key: key.into() }
    }

    /// The key the op touches.
    pub fn key(&self) -> &[u8] {
        match self {
            TxnOp::Put { key, .. } | TxnOp::Delete { key } | TxnOp::Get { key } => key,
        }
    }
}

/// If every compare holds, run `success`; otherwise run `failure`. Atomic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// The conditions (all must hold).
    pub compares: Vec<Compare>,
    /// Ops run when every compare holds.
    pub success: Vec<TxnOp>,
    /// Ops run otherwise.
    pub failure: Vec<TxnOp>,
}

impl Txn {
    /// An empty transaction.
    pub fn new() -> Txn {
        Txn::default()
    }

    /// Adds conditions.
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Txn {
        self.compares.extend(compares);
        self
    }

    /// Adds ops to the success branch.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Txn {
        self.success.extend(ops);
        self
    }

    /// Adds ops to the failure branch.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Txn {
        self.failure.extend(ops);
        self
    }
}

/// What one op of the branch that ran produced, in op order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOpResult {
    /// A put happened.
    Put,
    /// A delete ran; whether the key existed.
    Delete {
        /// Whether a key was removed.
        deleted: bool,
    },
    /// A read's result.
    Get(Option<KeyValue>),
}

/// A transaction's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether every compare held (so `success` ran).
    pub succeeded: bool,
    /// The store's revision after the transaction; the revision of its writes if it wrote.
    pub revision: Revision,
    /// One result per op of the branch that ran.
    pub results: Vec<TxnOpResult>,
}

impl TxnResponse {
    /// The first `Get` result of the branch that ran.
    pub fn first_get(&self) -> Option<&KeyValue> {
        self.results.iter().find_map(|r| match r {
            TxnOpResult::Get(kv) => Some(kv.as_ref()),
            _ => None,
        })?
    }
}
