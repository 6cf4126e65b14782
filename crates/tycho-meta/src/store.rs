//! The `MetaStore` trait: what every coordination store offers.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::error::{MetaError, MetaResult};
use crate::kv::{DeleteResponse, GetResponse, KeyValue, LeaseId, RangePage, RangeRequest, Revision};
use crate::lease::{LeaseGrant, LeaseInfo};
use crate::limits::Limits;
use crate::txn::{Compare, Txn, TxnOp, TxnResponse};
use crate::watch::{Watch, WatchRequest};

/// A boxed future, so that `MetaStore` stays object-safe and callers can hold
/// `Arc<dyn MetaStore>`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A strongly consistent key-value store with revisions, leases, transactions and watches:
/// etcd's v3 data model. [`EtcdStore`](crate::EtcdStore) is the real one; [`MemStore`](crate::MemStore)
/// has the same semantics in one process. What both guarantee:
///
/// - **One history.** Every write that changes something gets the next revision; the writes
///   of one transaction share one. A read at revision R sees exactly the writes up to R.
/// - **Per-key metadata.** `create_revision`, `mod_revision` and `version` let a caller guard
///   a write with a compare (see [`compare_and_swap`](MetaStore::compare_and_swap)).
/// - **Leases.** A key put with a lease is deleted when the lease expires or is revoked.
/// - **Watches** report every change at or after their start revision, in revision order, and
///   end with [`MetaError::Compacted`] if that history is gone.
/// - **Limits.** Requests larger than [`Limits`] allow are refused before they are sent.
pub trait MetaStore: Send + Sync + std::fmt::Debug {
    /// Reads one key at the current revision.
    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<GetResponse>>;

    /// Reads one page of keys under a prefix. Continue with [`RangeRequest::next_page`]; every
    /// page of the scan is read at the first page's revision.
    fn range(&self, req: RangeRequest) -> BoxFuture<'_, MetaResult<RangePage>>;

    /// Writes a key, attached to `lease` if given (detached from any earlier lease otherwise).
    /// Returns the write's revision.
    fn put<'a>(&'a self, key: &'a [u8], value: &'a [u8], lease: Option<LeaseId>)
        -> BoxFuture<'a, MetaResult<Revision>>;

    /// Deletes a key if it exists.
    fn delete<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<DeleteResponse>>;

    /// Runs a transaction atomically.
    fn txn(&self, txn: Txn) -> BoxFuture<'_, MetaResult<TxnResponse>>;

    /// Discards history before `revision`: reads and watches below it then fail with
    /// [`MetaError::Compacted`].
    fn compact(&self, revision: Revision) -> BoxFuture<'_, MetaResult<()>>;

    /// Starts a watch. Events arrive through [`Watch::next`].
    fn watch(&self, req: WatchRequest) -> BoxFuture<'_, MetaResult<Watch>>;

    /// Grants a lease of at least `ttl` (whole seconds; etcd may raise it to its minimum).
    fn lease_grant(&self, ttl: Duration) -> BoxFuture<'_, MetaResult<LeaseGrant>>;

    /// Renews a lease once and returns the TTL the store acknowledged. Fails with
    /// [`MetaError::LeaseNotFound`] if the lease is gone. [`LeaseKeeper`](crate::LeaseKeeper)
    /// calls this on its own task.
    fn lease_keep_alive_once(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Duration>>;

    /// Revokes a lease, deleting its keys.
    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<()>>;

    /// A lease's TTL, remaining time and keys, or `None` if it is gone.
    fn lease_time_to_live(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Option<LeaseInfo>>>;

    /// The limits this store enforces before sending.
    fn limits(&self) -> Limits;

    /// Creates `key` only if it does not exist. Returns the write's revision, or
    /// [`MetaError::CompareFailed`] with the existing key. Among concurrent callers exactly one
    /// wins.
    fn create_if_absent<'a>(
        &'a self,
        key: &'a [u8],
        value: &'a [u8],
        lease: Option<LeaseId>,
    ) -> BoxFuture<'a, MetaResult<Revision>> {
        Box::pin(async move {
            let put = TxnOp::Put { key: key.to_vec(), value: value.to_vec(), lease };
            let txn = Txn::new().when([Compare::absent(key)]).and_then([put]).or_else([TxnOp::get(key)]);
            guarded(self.txn(txn).await?, key)
        })
    }

    /// Writes `key` only if its last write was at `expected_mod_revision` (0: only if absent).
    /// Returns the write's revision, or [`MetaError::CompareFailed`] with the key as it is now.
    fn compare_and_swap<'a>(
        &'a self,
        key: &'a [u8],
        expected_mod_revision: Revision,
        value: &'a [u8],
        lease: Option<LeaseId>,
    ) -> BoxFuture<'a, MetaResult<Revision>> {
        Box::pin(async move {
            let put = TxnOp::Put { key: key.to_vec(), value: value.to_vec(), lease };
            let txn = Txn::new()
                .when([Compare::mod_revision_eq(key, expected_mod_revision)])
                .and_then([put])
                .or_else([TxnOp::get(key)]);
            guarded(self.txn(txn).await?, key)
        })
    }

    /// Deletes `key` only if its last write was at `expected_mod_revision`. Returns the
    /// delete's revision, or [`MetaError::CompareFailed`] with the key as it is now.
    fn compare_and_delete<'a>(
        &'a self,
        key: &'a [u8],
        expected_mod_revision: Revision,
    ) -> BoxFuture<'a, MetaResult<Revision>> {
        Box::pin(async move {
            let txn = Txn::new()
                .when([Compare::mod_revision_eq(key, expected_mod_revision)])
                .and_then([TxnOp::delete(key)])
                .or_else([TxnOp::get(key)]);
            guarded(self.txn(txn).await?, key)
        })
    }

    /// Reads every key under `prefix` at one revision, `page_size` keys per request: the
    /// snapshot to take before watching from `revision + 1`.
    fn snapshot<'a>(
        &'a self,
        prefix: &'a [u8],
        page_size: usize,
    ) -> BoxFuture<'a, MetaResult<(Vec<KeyValue>, Revision)>> {
        Box::pin(async move {
            let mut req = RangeRequest::prefix(prefix, page_size);
            let mut kvs = Vec::new();
            loop {
                let page = self.range(req.clone()).await?;
                kvs.extend(page.kvs.iter().cloned());
                match req.next_page(&page) {
                    Some(next) => req = next,
                    None => return Ok((kvs, page.revision)),
                }
            }
        })
    }
}

/// The outcome of a guarded write: its revision, or the key as it is now.
fn guarded(resp: TxnResponse, key: &[u8]) -> MetaResult<Revision> {
    if resp.succeeded {
        return Ok(resp.revision);
    }
    Err(MetaError::CompareFailed {
        key: String::from_utf8_lossy(key).into_owned(),
        current: resp.first_get().cloned().map(Box::new),
    })
}
