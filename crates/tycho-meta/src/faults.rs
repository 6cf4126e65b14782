//! A [`MetaStore`] wrapper that injects the failures tests need (cargo feature `testing`):
//! transactions held until released, or whose request or answer is lost, and lease renewals
//! that fail or answer late. Everything else goes straight to the wrapped store.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{
    BoxFuture, DeleteResponse, GetResponse, LeaseGrant, LeaseId, LeaseInfo, Limits, MetaError, MetaResult, MetaStore,
    RangePage, RangeRequest, Revision, Txn, TxnResponse, Watch, WatchRequest,
};

/// What the next transactions do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum TxnFault {
    /// Run normally.
    None = 0,
    /// Wait for [`FaultyStore::release_txns`] before running (every transaction while set).
    Hold = 1,
    /// Run, then lose the answer (`Unavailable`); the next transaction runs normally.
    ApplyThenLose = 2,
    /// Lose the request before it runs (`Unavailable`); the next transaction runs normally.
    Lose = 3,
    /// Answer `Unavailable` at once but run the transaction late: just before the next
    /// transaction (a request the store applies after its sender gave up on it).
    LoseThenApplyLate = 4,
}

/// The wrapper.
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn MetaStore>,
    txn_fault: AtomicU8,
    txns: AtomicU64,
    release: tokio::sync::Semaphore,
    renew_fails: AtomicBool,
    renew_delay_ms: AtomicU64,
    /// A transaction to run before the next one ([`TxnFault::LoseThenApplyLate`]).
    late: parking_lot::Mutex<Option<Txn>>,
}

impl FaultyStore {
    /// Wraps `inner`, injecting nothing yet.
    pub fn new(inner: Arc<dyn MetaStore>) -> FaultyStore {
        FaultyStore {
            inner,
            txn_fault: AtomicU8::new(TxnFault::None as u8),
            txns: AtomicU64::new(0),
            release: tokio::sync::Semaphore::new(0),
            renew_fails: AtomicBool::new(false),
            renew_delay_ms: AtomicU64::new(0),
            late: parking_lot::Mutex::new(None),
        }
    }

    /// Sets what the next transactions do.
    pub fn set_txn_fault(&self, fault: TxnFault) {
        self.txn_fault.store(fault as u8, Ordering::SeqCst);
    }

    /// Lets `n` held transactions run.
    pub fn release_txns(&self, n: usize) {
        self.release.add_permits(n);
    }

    /// Transactions asked for so far (including held and lost ones).
    pub fn txns(&self) -> u64 {
        self.txns.load(Ordering::SeqCst)
    }

    /// Makes lease renewals fail with `Unavailable` (or work again).
    pub fn set_renewals_fail(&self, fail: bool) {
        self.renew_fails.store(fail, Ordering::SeqCst);
    }

    /// Delays every lease renewal by `delay` before it is sent.
    pub fn set_renewal_delay(&self, delay: Duration) {
        self.renew_delay_ms.store(delay.as_millis().min(u64::MAX as u128) as u64, Ordering::SeqCst);
    }
}

impl MetaStore for FaultyStore {
    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<GetResponse>> {
        self.inner.get(key)
    }
    fn range(&self, req: RangeRequest) -> BoxFuture<'_, MetaResult<RangePage>> {
        self.inner.range(req)
    }
    fn put<'a>(
        &'a self,
        key: &'a [u8],
        value: &'a [u8],
        lease: Option<LeaseId>,
    ) -> BoxFuture<'a, MetaResult<Revision>> {
        self.inner.put(key, value, lease)
    }
    fn delete<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<DeleteResponse>> {
        self.inner.delete(key)
    }
    fn txn(&self, txn: Txn) -> BoxFuture<'_, MetaResult<TxnResponse>> {
        Box::pin(async move {
            self.txns.fetch_add(1, Ordering::SeqCst);
            let once = |f: TxnFault| {
                self.txn_fault
                    .compare_exchange(f as u8, TxnFault::None as u8, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            };
            let late = self.late.lock().take();
            if let Some(late) = late {
                let _ = self.inner.txn(late).await;
            }
            if self.txn_fault.load(Ordering::SeqCst) == TxnFault::Hold as u8 {
                self.release.acquire().await.map_err(|_| MetaError::Closed)?.forget();
            } else if once(TxnFault::ApplyThenLose) {
                self.inner.txn(txn).await?;
                return Err(MetaError::Unavailable("injected: the answer was lost".into()));
            } else if once(TxnFault::Lose) {
                return Err(MetaError::Unavailable("injected: the request was lost".into()));
            } else if once(TxnFault::LoseThenApplyLate) {
                *self.late.lock() = Some(txn);
                return Err(MetaError::Unavailable("injected: no answer (the request runs later)".into()));
            }
            self.inner.txn(txn).await
        })
    }
    fn compact(&self, revision: Revision) -> BoxFuture<'_, MetaResult<()>> {
        self.inner.compact(revision)
    }
    fn watch(&self, req: WatchRequest) -> BoxFuture<'_, MetaResult<Watch>> {
        self.inner.watch(req)
    }
    fn lease_grant(&self, ttl: Duration) -> BoxFuture<'_, MetaResult<LeaseGrant>> {
        self.inner.lease_grant(ttl)
    }
    fn lease_keep_alive_once(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Duration>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(self.renew_delay_ms.load(Ordering::SeqCst))).await;
            if self.renew_fails.load(Ordering::SeqCst) {
                return Err(MetaError::Unavailable("injected".into()));
            }
            self.inner.lease_keep_alive_once(lease).await
        })
    }
    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<()>> {
        self.inner.lease_revoke(lease)
    }
    fn lease_time_to_live(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Option<LeaseInfo>>> {
        self.inner.lease_time_to_live(lease)
    }
    fn limits(&self) -> Limits {
        self.inner.limits()
    }
}
