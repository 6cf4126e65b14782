//! Request limits, checked before anything is sent, identically for every store.
//!
//! etcd refuses a request whose encoded form exceeds `--max-request-bytes` and a transaction
//! with more than `--max-txn-ops` compares or ops in one list. Refusing here, with a typed error
//! that names the limit, means an oversized request never costs a round trip (or a gRPC error
//! whose text must be parsed), and `MemStore` refuses exactly what etcd would.

use std::collections::HashSet;

use crate::error::{MetaError, MetaResult};
use crate::kv::RangeRequest;
use crate::txn::{Compare, CompareTarget, Txn, TxnOp};

/// etcd's default `--max-request-bytes`: 1.5 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1536 * 1024;
/// etcd's default `--max-txn-ops`.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;

/// Bytes of framing counted once per request: an upper bound on the request header etcd adds
/// before it checks the size.
const REQUEST_OVERHEAD: usize = 64;
/// Bytes of framing counted per compare or op: tags, lengths, a lease id.
const ITEM_OVERHEAD: usize = 48;

/// The limits a store enforces; configure them to match the etcd cluster's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest encoded request, in bytes (etcd `--max-request-bytes`).
    pub max_request_bytes: usize,
    /// Most compares, success ops or failure ops in one transaction (etcd `--max-txn-ops`).
    pub max_txn_ops: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_request_bytes: DEFAULT_MAX_REQUEST_BYTES, max_txn_ops: DEFAULT_MAX_TXN_OPS }
    }
}

impl Limits {
    /// Checks a single put. The estimate is an upper bound of etcd's encoding, so a request
    /// accepted here is not refused by an etcd with the same limit.
    pub fn check_put(&self, key: &[u8], value: &[u8]) -> MetaResult<()> {
        check_key(key)?;
        self.check_size(REQUEST_OVERHEAD + ITEM_OVERHEAD + key.len() + value.len())
    }

    /// Checks a key used by a read or a delete.
    pub fn check_key(&self, key: &[u8]) -> MetaResult<()> {
        check_key(key)?;
        self.check_size(REQUEST_OVERHEAD + ITEM_OVERHEAD + key.len())
    }

    /// Checks a range request's keys (an empty prefix, meaning every key, is allowed).
    pub fn check_range(&self, req: &RangeRequest) -> MetaResult<()> {
        let keys = req.prefix.len() + req.start.as_ref().map_or(0, Vec::len);
        self.check_size(REQUEST_OVERHEAD + ITEM_OVERHEAD + 2 * keys)
    }

    /// Checks a transaction: op counts per list, total size, keys, and that no branch writes a
    /// key twice (etcd refuses that as a duplicate key).
    pub fn check_txn(&self, txn: &Txn) -> MetaResult<()> {
        for (what, n) in
            [("compares", txn.compares.len()), ("success ops", txn.success.len()), ("failure ops", txn.failure.len())]
        {
            if n > self.max_txn_ops {
                return Err(MetaError::TooManyOps { what, ops: n, limit: self.max_txn_ops });
            }
        }
        let mut size = REQUEST_OVERHEAD;
        for c in &txn.compares {
            check_key(&c.key)?;
            size += ITEM_OVERHEAD + compare_size(c);
        }
        for branch in [&txn.success, &txn.failure] {
            let mut written = HashSet::new();
            for op in branch {
                check_key(op.key())?;
                size += ITEM_OVERHEAD + op_size(op);
                if matches!(op, TxnOp::Put { .. } | TxnOp::Delete { .. }) && !written.insert(op.key()) {
                    let is_put = |o: &&TxnOp| matches!(o, TxnOp::Put { .. }) && o.key() == op.key();
                    // Deleting a key twice is harmless; writing it twice (or put + delete) is ambiguous.
                    if branch.iter().filter(is_put).count() > 0 {
                        return Err(MetaError::InvalidArgument(format!(
                            "key {:?} is written twice in one transaction branch",
                            String::from_utf8_lossy(op.key())
                        )));
                    }
                }
            }
        }
        self.check_size(size)
    }

    /// The estimated encoded size of `txn` (what [`Limits::check_txn`] compares with
    /// `max_request_bytes`).
    pub fn txn_size(txn: &Txn) -> usize {
        let compares: usize = txn.compares.iter().map(|c| ITEM_OVERHEAD + compare_size(c)).sum();
        let ops: usize = txn.success.iter().chain(&txn.failure).map(|o| ITEM_OVERHEAD + op_size(o)).sum();
        REQUEST_OVERHEAD + compares + ops
    }

    fn check_size(&self, size: usize) -> MetaResult<()> {
        if size > self.max_request_bytes {
            return Err(MetaError::RequestTooLarge { size, limit: self.max_request_bytes });
        }
        Ok(())
    }
}

fn check_key(key: &[u8]) -> MetaResult<()> {
    if key.is_empty() {
        return Err(MetaError::InvalidArgument("empty key".to_owned()));
    }
    Ok(())
}

fn compare_size(c: &Compare) -> usize {
    c.key.len()
        + match &c.target {
            CompareTarget::Value(v) => v.len(),
            _ => 0,
        }
}

fn op_size(op: &TxnOp) -> usize {
    match op {
        TxnOp::Put { key, value, .. } => key.len() + value.len(),
        TxnOp::Delete { key } | TxnOp::Get { key } => key.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_over_the_limit_is_refused() {
        let limits = Limits::default();
        assert!(limits.check_put(b"k", &vec![0; 1024 * 1024]).is_ok());
        let err = limits.check_put(b"k", &vec![0; DEFAULT_MAX_REQUEST_BYTES]).unwrap_err();
        assert!(matches!(err, MetaError::RequestTooLarge { limit: DEFAULT_MAX_REQUEST_BYTES, .. }), "{err}");
        let err = limits.check_key(&vec![b'k'; DEFAULT_MAX_REQUEST_BYTES]).unwrap_err();
        assert!(matches!(err, MetaError::RequestTooLarge { .. }));
        assert!(matches!(limits.check_put(b"", b"v"), Err(MetaError::InvalidArgument(_))));
    }

    #[test]
    fn txn_op_counts_and_duplicates() {
        let limits = Limits::default();
        let ops = |n: usize| (0..n).map(|i| TxnOp::put(format!("k{i}"), "v")).collect::<Vec<_>>();
        assert!(limits.check_txn(&Txn::new().and_then(ops(128))).is_ok());
        let err = limits.check_txn(&Txn::new().and_then(ops(129))).unwrap_err();
        assert!(matches!(err, MetaError::TooManyOps { what: "success ops", ops: 129, limit: 128 }), "{err}");
        let err = limits.check_txn(&Txn::new().or_else(ops(129))).unwrap_err();
        assert!(matches!(err, MetaError::TooManyOps { what: "failure ops", .. }));
        let dup = Txn::new().and_then([TxnOp::put("a", "1"), TxnOp::delete("a")]);
        assert!(matches!(limits.check_txn(&dup), Err(MetaError::InvalidArgument(_))));
        let two_deletes = Txn::new().and_then([TxnOp::delete("a"), TxnOp::delete("a")]);
        assert!(limits.check_txn(&two_deletes).is_ok());
        // The same key may be written in both branches: only one of them runs.
        let both = Txn::new().and_then([TxnOp::put("a", "1")]).or_else([TxnOp::put("a", "2")]);
        assert!(limits.check_txn(&both).is_ok());
    }
}
