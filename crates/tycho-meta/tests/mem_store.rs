//! `MemStore` specifics: bounded history, lease expiry by the injected clock, the reaper.

use std::sync::Arc;
use std::time::Duration;

use tycho_meta::{
    ManualClock, MemConfig, MemStore, MetaError, MetaStore, RangeRequest, TokioClock, WatchEvent, WatchRequest,
};

fn store_with_history(revisions: i64) -> MemStore {
    MemStore::with_clock(ManualClock::new(), MemConfig { history_revisions: revisions, ..MemConfig::default() })
}

#[tokio::test]
async fn history_is_bounded_and_older_revisions_are_compacted() {
    let store = store_with_history(10);
    let first = store.put(b"h", b"0", None).await.unwrap();
    for i in 1..30 {
        store.put(b"h", format!("{i}").as_bytes(), None).await.unwrap();
    }
    let now = store.revision();
    let compacted = now - 10;
    let mut watch = store.watch(WatchRequest::key("h").from_revision(first)).await.unwrap();
    assert_eq!(watch.next().await, Err(MetaError::Compacted { requested: first, compact_revision: compacted }));
    let old = store.range(RangeRequest::prefix("h", 1).at_revision(first)).await;
    assert!(matches!(old, Err(MetaError::Compacted { .. })));
    // The retained window still reads exactly.
    let page = store.range(RangeRequest::prefix("h", 1).at_revision(compacted)).await.unwrap();
    assert_eq!(page.kvs[0].mod_revision, compacted);
    let mut watch = store.watch(WatchRequest::key("h").from_revision(compacted)).await.unwrap();
    let WatchEvent::Put(kv) = watch.next().await.unwrap() else { panic!() };
    assert_eq!(kv.mod_revision, compacted);
}

#[tokio::test]
async fn a_watcher_that_falls_behind_the_history_is_told_it_was_compacted() {
    let store = store_with_history(50);
    let mut watch = store.watch(WatchRequest::prefix("")).await.unwrap();
    // Far more writes than the watch buffers plus the history holds, without reading.
    for i in 0..2000 {
        store.put(format!("k{}", i % 10).as_bytes(), b"v", None).await.unwrap();
    }
    let mut delivered = 0;
    let end = loop {
        match watch.next().await {
            Ok(WatchEvent::Put(_)) => delivered += 1,
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert!(matches!(end, MetaError::Compacted { .. }), "{end}");
    assert!(delivered < 2000);
}

#[tokio::test]
async fn leases_expire_exactly_by_the_injected_clock() {
    let clock = ManualClock::new();
    let store = MemStore::with_clock(clock.clone(), MemConfig::default());
    let grant = store.lease_grant(Duration::from_millis(4500)).await.unwrap();
    assert_eq!(grant.ttl, Duration::from_secs(5), "whole seconds, rounded up, as etcd");
    store.put(b"k", b"v", Some(grant.id)).await.unwrap();
    clock.advance(Duration::from_secs(4));
    assert_eq!(store.lease_keep_alive_once(grant.id).await.unwrap(), grant.ttl);
    clock.advance(Duration::from_millis(4999));
    assert!(store.get(b"k").await.unwrap().kv.is_some(), "renewed 4.999 s ago");
    let info = store.lease_time_to_live(grant.id).await.unwrap().unwrap();
    assert_eq!(info.remaining, Duration::from_millis(1));
    clock.advance(Duration::from_millis(1));
    assert!(store.get(b"k").await.unwrap().kv.is_none(), "expired at 5 s");
}

#[tokio::test(start_paused = true)]
async fn the_reaper_expires_leases_of_an_idle_store() {
    let store = MemStore::with_clock(Arc::new(TokioClock), MemConfig::default());
    let _reaper = store.spawn_lease_reaper(Duration::from_millis(100));
    let grant = store.lease_grant(Duration::from_secs(2)).await.unwrap();
    let rev = store.put(b"k", b"v", Some(grant.id)).await.unwrap();
    let mut watch = store.watch(WatchRequest::key("k").from_revision(rev + 1)).await.unwrap();
    // No call touches the store; the reaper notices the expiry and the watcher hears of it.
    let WatchEvent::Delete(kv) = watch.next().await.unwrap() else { panic!() };
    assert_eq!(kv.key, b"k");
}
