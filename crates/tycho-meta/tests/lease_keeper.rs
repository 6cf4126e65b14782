//! The lease keeper on `MemStore`, in paused time: renewals, reported failures, the deadline
//! rule, and no revival after a loss. No test waits in real time.

use std::sync::Arc;
use std::time::Duration;

use tycho_meta::faults::FaultyStore;
use tycho_meta::{
    Clock, LeaseKeeper, LeaseLost, LeaseState, ManualClock, MemConfig, MemStore, MetaError, MetaStore, TokioClock,
};

/// A MemStore on `clock` whose renewals can be made to fail or to answer late.
fn flaky(clock: Arc<dyn Clock>) -> Arc<FaultyStore> {
    Arc::new(FaultyStore::new(Arc::new(MemStore::with_clock(clock, MemConfig::default()))))
}

const TTL: Duration = Duration::from_secs(10);

fn now() -> std::time::Instant {
    TokioClock.now()
}

#[tokio::test(start_paused = true)]
async fn keeper_holds_a_lease_for_many_ttls() {
    let store = flaky(Arc::new(TokioClock));
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
    let store = flaky(Arc::new(TokioClock));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, Arc::new(TokioClock)).await.unwrap();
    let mut states = keeper.subscribe();
    tokio::time::sleep(TTL).await;
    let LeaseState::Held { deadline: held } = keeper.state() else { panic!() };
    states.borrow_and_update();

    store.set_renewals_fail(true);
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
    store.set_renewals_fail(false);
    tokio::time::sleep(TTL * 2).await;
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
    assert_eq!(store.lease_time_to_live(keeper.id()).await.unwrap(), None);
}

#[tokio::test(start_paused = true)]
async fn a_renewal_answered_after_the_deadline_does_not_count() {
    let store = flaky(Arc::new(TokioClock));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, Arc::new(TokioClock)).await.unwrap();
    // Renewals are sent every TTL/3 but now take longer than the TTL/2 they would buy.
    store.set_renewal_delay(Duration::from_millis(TTL.as_millis() as u64));
    tokio::time::sleep(TTL * 2).await;
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
}

#[tokio::test(start_paused = true)]
async fn a_lease_gone_from_the_store_is_reported_expired() {
    let store = flaky(Arc::new(TokioClock));
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
    let store = flaky(clock.clone());
    // The renewal never comes back.
    store.set_renewal_delay(Duration::from_millis(u64::MAX / 4));
    let keeper = LeaseKeeper::grant(store.clone(), TTL, clock.clone()).await.unwrap();
    clock.advance(TTL / 2 - Duration::from_millis(1));
    assert!(keeper.is_valid());
    clock.advance(Duration::from_millis(1));
    assert!(!keeper.is_valid());
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
}
