//! Fault tests against a real etcd process: stopped mid-watch, stopped for longer than a lease.

#![cfg(feature = "etcd")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{connect, within};
use tycho_meta::{
    LeaseKeeper, LeaseLost, LeaseState, MetaError, MetaStore, Revision, SystemClock, WatchEvent, WatchRequest,
};
use tycho_testkit::EtcdServer;

async fn start_etcd() -> EtcdServer {
    tokio::task::spawn_blocking(EtcdServer::start_new).await.unwrap().expect("etcd starts")
}

/// Creates `key` once, retrying while the client reconnects after an etcd restart. A retry
/// whose first attempt did land finds its own value, so every key is written exactly once.
async fn create_once(store: &dyn MetaStore, key: &[u8], value: &[u8]) -> Revision {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match store.create_if_absent(key, value, None).await {
            Ok(rev) => return rev,
            Err(MetaError::CompareFailed { current: Some(kv), .. }) if kv.value == value => return kv.mod_revision,
            Err(e) if e.is_unavailable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("create {key:?}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_reports_the_break_and_resumes_without_losing_events() {
    let mut etcd = start_etcd().await;
    let store = connect(&etcd).await;
    let first = store.put(b"f/start", b"0", None).await.unwrap();
    let mut watch = store.watch(WatchRequest::prefix("f/").from_revision(first)).await.unwrap();
    let mut expected = vec![(b"f/start".to_vec(), first)];
    for i in 0..20 {
        let key = format!("f/before/{i:02}").into_bytes();
        let rev = store.put(&key, b"x", None).await.unwrap();
        expected.push((key, rev));
    }

    // Mid-watch: the first event has arrived, the rest may still be on their way.
    let mut got: Vec<(Vec<u8>, Revision)> = Vec::new();
    match within("first event", watch.next()).await.unwrap() {
        WatchEvent::Put(kv) => got.push((kv.key, kv.mod_revision)),
        other => panic!("unexpected {other:?}"),
    }
    tokio::task::block_in_place(|| etcd.stop());
    let resume_from = loop {
        match within("the watcher notices the break", watch.next()).await.unwrap() {
            WatchEvent::Disconnected { resume_from, error } => {
                assert!(error.is_unavailable(), "{error}");
                break resume_from;
            }
            WatchEvent::Put(kv) => got.push((kv.key, kv.mod_revision)),
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(resume_from, got.last().unwrap().1 + 1, "resumes right after the last delivered event");

    // While etcd is down, calls fail fast with a typed error.
    let err = store.put(b"f/while-down", b"x", None).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");

    // Back up; write at once, before the watcher has reconnected (it is backing off).
    tokio::task::block_in_place(|| etcd.start()).expect("etcd restarts");
    for i in 0..20 {
        let key = format!("f/after/{i:02}").into_bytes();
        let rev = create_once(&store, &key, b"y").await;
        expected.push((key, rev));
    }

    let mut resumed = false;
    while got.len() < expected.len() {
        match within("events after the restart", watch.next()).await.unwrap() {
            WatchEvent::Resumed { resume_from: r } => {
                assert_eq!(r, resume_from);
                resumed = true;
            }
            WatchEvent::Put(kv) => {
                assert!(resumed, "no event before the watcher says it resumed");
                got.push((kv.key, kv.mod_revision));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, expected, "every event exactly once, in order, across the outage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_owner_learns_of_the_loss_before_etcd_could_expire_the_lease() {
    let mut etcd = start_etcd().await;
    let store: Arc<dyn MetaStore> = Arc::new(connect(&etcd).await);
    let ttl = Duration::from_secs(2);
    let keeper = LeaseKeeper::grant(store.clone(), ttl, Arc::new(SystemClock)).await.unwrap();
    assert_eq!(keeper.ttl(), ttl);
    store.put(b"masters/me", b"127.0.0.1:50051", Some(keeper.id())).await.unwrap();
    let mut states = keeper.subscribe();

    // A few renewals go through.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(keeper.is_valid());
    assert!(matches!(*states.borrow_and_update(), LeaseState::Held { .. }));

    tokio::task::block_in_place(|| etcd.stop());
    let stopped_at = Instant::now();
    let mut last_deadline = states.borrow().deadline().unwrap();
    let mut saw_renewing = false;
    let lost_at = loop {
        within("the keeper reports a state", states.changed()).await.unwrap();
        let state = states.borrow_and_update().clone();
        let now = Instant::now();
        match state {
            LeaseState::Held { deadline } => last_deadline = deadline,
            LeaseState::Renewing { deadline, error } => {
                assert!(error.is_unavailable(), "{error}");
                // Failing renewals never extend the deadline.
                assert!(deadline <= last_deadline);
                last_deadline = deadline;
                saw_renewing = true;
                assert_eq!(keeper.is_valid(), now < deadline);
            }
            LeaseState::Lost(why) => {
                assert_eq!(why, LeaseLost::DeadlinePassed);
                break now;
            }
        }
    };
    assert!(saw_renewing, "the failure was reported before the loss");
    assert!(!keeper.is_valid());
    assert!(lost_at >= last_deadline, "the owner could rely on the lease until its deadline");
    // The last acknowledged renewal was sent at `last_deadline - ttl/2`, so etcd cannot expire
    // the lease before `last_deadline + ttl/2`: the owner knew before it could be stale.
    assert!(lost_at < last_deadline + ttl / 2, "lost at {:?} after the deadline", lost_at - last_deadline);

    // Stay down longer than the TTL, then come back. etcd restores its leases with a fresh TTL
    // when it restarts, so the server may still hold this one for a while: exactly the stale
    // belief the local deadline protects against. The keeper does not revive.
    tokio::time::sleep((stopped_at + ttl + Duration::from_secs(1)).saturating_duration_since(Instant::now())).await;
    tokio::task::block_in_place(|| etcd.start()).expect("etcd restarts");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(matches!(keeper.state(), LeaseState::Lost(LeaseLost::DeadlinePassed)));
    assert!(!keeper.is_valid());

    // Nobody renews it, so etcd drops the registration.
    let deadline = Instant::now() + ttl + Duration::from_secs(10);
    loop {
        match store.get(b"masters/me").await {
            Ok(r) if r.kv.is_none() => break,
            Ok(_) => {}
            Err(e) => assert!(e.is_unavailable(), "{e}"),
        }
        assert!(Instant::now() < deadline, "the leased key outlived its lease");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The owner starts over with a new lease.
    let again = LeaseKeeper::grant(store.clone(), ttl, Arc::new(SystemClock)).await.unwrap();
    assert!(again.is_valid());
    assert_ne!(again.id(), keeper.id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeper_holds_a_lease_across_many_ttls() {
    let etcd = start_etcd().await;
    let store: Arc<dyn MetaStore> = Arc::new(connect(&etcd).await);
    let keeper = LeaseKeeper::grant(store.clone(), Duration::from_secs(2), Arc::new(SystemClock)).await.unwrap();
    store.put(b"alive", b"yes", Some(keeper.id())).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(keeper.is_valid());
    assert!(matches!(keeper.state(), LeaseState::Held { .. }));
    assert!(store.get(b"alive").await.unwrap().kv.is_some());
    let info = store.lease_time_to_live(keeper.id()).await.unwrap().expect("lease exists");
    assert!(info.remaining > Duration::ZERO);
    assert_eq!(info.keys, vec![b"alive".to_vec()]);
    keeper.revoke().await.unwrap();
    assert_eq!(store.get(b"alive").await.unwrap().kv, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_etcd_keeps_its_data_and_revision() {
    let mut etcd = start_etcd().await;
    let store = connect(&etcd).await;
    let rev = store.put(b"durable", b"v", None).await.unwrap();
    let endpoint = etcd.endpoint();
    tokio::task::block_in_place(|| {
        etcd.stop();
        assert!(!etcd.is_running());
        etcd.start()
    })
    .expect("etcd restarts");
    assert_eq!(etcd.endpoint(), endpoint, "same ports");
    // The same client reconnects by itself.
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        match store.get(b"durable").await {
            Ok(r) => break r,
            Err(e) if e.is_unavailable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(got.kv.unwrap().mod_revision, rev);
    assert_eq!(store.put(b"durable", b"w", None).await.unwrap(), rev + 1);
}

#[test]
fn the_harness_kills_etcd_and_removes_its_data_when_a_test_panics() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(move || {
        let etcd = EtcdServer::start_new().expect("etcd starts");
        tx.send((etcd.pid().unwrap(), etcd.data_dir())).unwrap();
        panic!("a failing test");
    });
    assert!(result.is_err());
    let (pid, data_dir) = rx.recv().unwrap();
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "etcd {pid} still runs");
    assert!(!data_dir.exists(), "data dir {} left behind", data_dir.display());
}
