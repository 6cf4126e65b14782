//! The lease keeper on `MemStore`, in paused time: renewals, reported failures, the deadline
//! rule, and no revival after a loss. No test waits in real time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tycho_meta::{
    BoxFuture, Clock, DeleteResponse, GetResponse, LeaseGrant, LeaseId, LeaseInfo, LeaseKeeper, LeaseLost, LeaseState,
    Limits, ManualClock, MemConfig, MemStore, MetaError, MetaResult, MetaStore, RangePage, RangeRequest, Revision,
    TokioClock, Txn, TxnResponse, Watch, WatchRequest,
};

/// A MemStore whose renewals can be made to fail or to answer late.
#[derive(Debug)]
struct Flaky {
    inner: MemStore,
    fail: AtomicBool,
    delay_ms: AtomicU64,
}

impl Flaky {
    fn new(clock: Arc<dyn Clock>) -> Arc<Flaky> {
        Arc::new(Flaky {
            inner: MemStore::with_clock(clock, MemConfig::default()),
            fail: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
        })
    }
}

impl MetaStore for Flaky {
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
        self.inner.txn(txn)
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
            tokio::time::sleep(Duration::from_millis(self.delay_ms.load(Ordering::SeqCst))).await;
            if self.fail.load(Ordering::SeqCst) {
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

const TTL: Duration = Duration::from_secs(10);

fn now() -> std::time::Instant {
    TokioClock.now()
}

#[tokio::test(start_paused = true)]
async fn keeper_holds_a_lease_for_many_ttls() {
    let store = Flaky::new(Arc::new(TokioClock));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, Arc::new(TokioClock)).await.unwrap();
    store.put(b"k", b"v", Some(keeper.id())).await.unwrap();
    tokio::time::sleep(TTL * 10).await;
    assert!(keeper.is_valid());
    let LeaseState::Held { deadline } = keeper.state() else { panic!("{:?}", keeper.state()) };
    assert!(deadline > now() && deadline <= now() + TTL / 2);
    assert!(store.get(b"k").await.unwrap().kv.is_some());
}

#[tokio::test(start_paused = true)]
async fn failing_renewals_report_the_deadline_then_the_loss_before_the_store_expires_it() {
    let store = Flaky::new(Arc::new(TokioClock));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, Arc::new(TokioClock)).await.unwrap();
    let mut states = keeper.subscribe();
    tokio::time::sleep(TTL).await;
    let LeaseState::Held { deadline: held } = keeper.state() else { panic!() };
    states.borrow_and_update();

    store.fail.store(true, Ordering::SeqCst);
    states.changed().await.unwrap();
    let renewing = states.borrow_and_update().clone();
    match &renewing {
        LeaseState::Renewing { deadline, error } => {
            assert_eq!(*deadline, held, "a failure keeps, never extends, the deadline");
            assert_eq!(*error, MetaError::Unavailable("injected".into()));
            assert!(keeper.is_valid(), "still valid until the deadline");
        }
        other => panic!("{other:?}"),
    }
    // Retries fail too; the next news is the loss, exactly at the deadline.
    loop {
        states.changed().await.unwrap();
        if let LeaseState::Lost(why) = *states.borrow_and_update() {
            assert_eq!(why, LeaseLost::DeadlinePassed);
            break;
        }
    }
    assert!(now() >= held && now() < held + Duration::from_secs(1));
    assert!(!keeper.is_valid());
    // The store still has the lease: the owner knew before the store could expire it.
    assert!(store.lease_time_to_live(keeper.id()).await.unwrap().is_some());

    // Renewals work again, but nothing revives the lost lease; the store lets it expire.
    store.fail.store(false, Ordering::SeqCst);
    tokio::time::sleep(TTL * 2).await;
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
    assert_eq!(store.lease_time_to_live(keeper.id()).await.unwrap(), None);
}

#[tokio::test(start_paused = true)]
async fn a_renewal_answered_after_the_deadline_does_not_count() {
    let store = Flaky::new(Arc::new(TokioClock));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, Arc::new(TokioClock)).await.unwrap();
    // Renewals are sent every TTL/3 but now take longer than the TTL/2 they would buy.
    store.delay_ms.store(TTL.as_millis() as u64, Ordering::SeqCst);
    tokio::time::sleep(TTL * 2).await;
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
}

#[tokio::test(start_paused = true)]
async fn a_lease_gone_from_the_store_is_reported_expired() {
    let store = Flaky::new(Arc::new(TokioClock));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, Arc::new(TokioClock)).await.unwrap();
    let mut states = keeper.subscribe();
    store.lease_revoke(keeper.id()).await.unwrap();
    states.changed().await.unwrap();
    assert!(matches!(*states.borrow(), LeaseState::Lost(LeaseLost::Expired)));
    assert!(!keeper.is_valid());
}

#[tokio::test(start_paused = true)]
async fn validity_follows_the_clock_even_if_the_keeper_task_is_stuck() {
    let clock = ManualClock::new();
    let store = Flaky::new(clock.clone());
    // The renewal never comes back.
    store.delay_ms.store(u64::MAX / 4, Ordering::SeqCst);
    let keeper = LeaseKeeper::grant(store.clone(), TTL, clock.clone()).await.unwrap();
    clock.advance(TTL / 2 - Duration::from_millis(1));
    assert!(keeper.is_valid());
    clock.advance(Duration::from_millis(1));
    assert!(!keeper.is_valid());
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
}
