//! One conformance suite for every `MetaStore`: each case below runs against `MemStore` and,
//! with the `etcd` feature, against a real etcd started for the test.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{within, Subject};
use tycho_meta::{
    Compare, CompareOp, CompareTarget, KeyValue, LeaseKeeper, LeaseLost, LeaseState, MetaError, RangeRequest,
    SystemClock, Txn, TxnOp, TxnOpResult, WatchEvent, WatchRequest, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TXN_OPS,
};

/// Runs each named case against every store.
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod mem {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Subject::mem()).await;
                }
            )*
        }

        #[cfg(feature = "etcd")]
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Subject::etcd().await).await;
                }
            )*
        }
    };
}

conformance!(
    revisions_increase_per_write,
    key_metadata_follows_etcd,
    cas_with_stale_revision_fails_and_returns_current,
    txn_compares_on_every_target,
    create_if_absent_has_one_winner,
    leased_keys_vanish_on_expiry,
    leased_keys_vanish_on_revoke,
    keeper_revoke_ends_the_lease,
    watch_from_revision_sees_every_later_event_in_order,
    watch_of_one_key_and_from_now,
    watch_from_compacted_revision_reports_compacted,
    paginated_range_at_fixed_revision_is_consistent,
    oversized_requests_are_refused_before_sending,
);

fn value_of(kv: &Option<KeyValue>) -> Option<&[u8]> {
    kv.as_ref().map(|kv| kv.value.as_slice())
}

async fn revisions_increase_per_write(s: Subject) {
    let st = &s.store;
    let r1 = st.put(b"a", b"1", None).await.unwrap();
    let r2 = st.put(b"b", b"1", None).await.unwrap();
    assert_eq!(r2, r1 + 1, "[{}] one revision per put", s.name);

    // A transaction's writes share one revision.
    let t =
        st.txn(Txn::new().and_then([TxnOp::put("c", "1"), TxnOp::put("d", "1"), TxnOp::delete("a")])).await.unwrap();
    assert!(t.succeeded);
    assert_eq!(t.revision, r2 + 1);
    for key in [&b"c"[..], b"d"] {
        assert_eq!(st.get(key).await.unwrap().kv.unwrap().mod_revision, r2 + 1);
    }

    // Deleting nothing changes nothing; a read-only transaction does not advance the revision.
    let d = st.delete(b"missing").await.unwrap();
    assert!(!d.deleted);
    assert_eq!(d.revision, r2 + 1);
    let t = st.txn(Txn::new().and_then([TxnOp::get("c")])).await.unwrap();
    assert_eq!(t.revision, r2 + 1);
    let d = st.delete(b"b").await.unwrap();
    assert!(d.deleted);
    assert_eq!(d.revision, r2 + 2);
    assert_eq!(st.get(b"b").await.unwrap().revision, r2 + 2);
}

async fn key_metadata_follows_etcd(s: Subject) {
    let st = &s.store;
    let r1 = st.put(b"k", b"v1", None).await.unwrap();
    let r2 = st.put(b"k", b"v2", None).await.unwrap();
    let kv = st.get(b"k").await.unwrap().kv.unwrap();
    assert_eq!((kv.create_revision, kv.mod_revision, kv.version, kv.lease), (r1, r2, 2, None), "[{}]", s.name);
    assert_eq!(kv.value, b"v2");

    // After a delete the key starts a new life: version 1, a new create revision.
    st.delete(b"k").await.unwrap();
    assert_eq!(st.get(b"k").await.unwrap().kv, None);
    let r4 = st.put(b"k", b"v3", None).await.unwrap();
    let kv = st.get(b"k").await.unwrap().kv.unwrap();
    assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (r4, r4, 1));

    // Values are bytes, not text.
    let binary = [0u8, 255, 1, 0, 128];
    st.put(b"bin\xff\x00", &binary, None).await.unwrap();
    assert_eq!(st.get(b"bin\xff\x00").await.unwrap().kv.unwrap().value, binary);
}

async fn cas_with_stale_revision_fails_and_returns_current(s: Subject) {
    let st = &s.store;
    let created = st.create_if_absent(b"owner", b"node-1", None).await.unwrap();
    let swapped = st.compare_and_swap(b"owner", created, b"node-2", None).await.unwrap();
    assert!(swapped > created);

    // The stale revision loses, and the error carries what is there now.
    match st.compare_and_swap(b"owner", created, b"node-3", None).await {
        Err(MetaError::CompareFailed { current: Some(kv), .. }) => {
            assert_eq!(kv.value, b"node-2", "[{}]", s.name);
            assert_eq!(kv.mod_revision, swapped);
            assert_eq!(kv.version, 2);
        }
        other => panic!("[{}] stale CAS: {other:?}", s.name),
    }
    assert_eq!(value_of(&st.get(b"owner").await.unwrap().kv), Some(&b"node-2"[..]));

    // A CAS on a missing key reports it missing; expected revision 0 means "absent".
    match st.compare_and_swap(b"nobody", 5, b"x", None).await {
        Err(MetaError::CompareFailed { current: None, .. }) => {}
        other => panic!("[{}] CAS on a missing key: {other:?}", s.name),
    }
    st.compare_and_swap(b"nobody", 0, b"x", None).await.unwrap();

    // Guarded delete: stale loses, current wins.
    let err = st.compare_and_delete(b"owner", created).await.unwrap_err();
    assert!(matches!(&err, MetaError::CompareFailed { current: Some(kv), .. } if kv.mod_revision == swapped), "{err}");
    assert_eq!(err.code(), tycho_proto::ErrorCode::ETCD_TRANSACTION_FAIL);
    st.compare_and_delete(b"owner", swapped).await.unwrap();
    assert_eq!(st.get(b"owner").await.unwrap().kv, None);
}

async fn txn_compares_on_every_target(s: Subject) {
    let st = &s.store;
    let rev = st.put(b"t", b"m", None).await.unwrap();
    st.put(b"t", b"m", None).await.unwrap(); // version 2, mod revision rev + 1
    let cmp = |op, target| Compare { key: b"t".to_vec(), op, target };
    let cases = [
        (cmp(CompareOp::Equal, CompareTarget::Value(b"m".to_vec())), true),
        (cmp(CompareOp::Greater, CompareTarget::Value(b"a".to_vec())), true),
        (cmp(CompareOp::Less, CompareTarget::Value(b"a".to_vec())), false),
        (cmp(CompareOp::NotEqual, CompareTarget::Value(b"m".to_vec())), false),
        (cmp(CompareOp::Equal, CompareTarget::Version(2)), true),
        (cmp(CompareOp::Less, CompareTarget::Version(2)), false),
        (cmp(CompareOp::Equal, CompareTarget::CreateRevision(rev)), true),
        (cmp(CompareOp::Greater, CompareTarget::CreateRevision(rev)), false),
        (cmp(CompareOp::Equal, CompareTarget::ModRevision(rev + 1)), true),
        (cmp(CompareOp::Less, CompareTarget::ModRevision(rev + 5)), true),
        // A missing key has version and revisions 0, and no value compare holds on it.
        (Compare::version_eq("absent", 0), true),
        (Compare::absent("absent"), true),
        (Compare::mod_revision_eq("absent", 0), true),
        (
            Compare { key: b"absent".to_vec(), op: CompareOp::NotEqual, target: CompareTarget::Value(b"x".to_vec()) },
            false,
        ),
        (Compare::value_eq("absent", ""), false),
    ];
    for (i, (compare, expect)) in cases.into_iter().enumerate() {
        let t = st
            .txn(Txn::new().when([compare.clone()]).and_then([TxnOp::get("t")]).or_else([TxnOp::delete("none")]))
            .await
            .unwrap();
        assert_eq!(t.succeeded, expect, "[{}] case {i}: {compare:?}", s.name);
        assert_eq!(t.results.len(), 1);
        assert_eq!(matches!(t.results[0], TxnOpResult::Get(_)), expect);
    }

    // Ops see each other in order; all compares must hold.
    let t = st
        .txn(Txn::new().when([Compare::value_eq("t", "m"), Compare::absent("new")]).and_then([
            TxnOp::put("new", "1"),
            TxnOp::get("new"),
            TxnOp::delete("t"),
            TxnOp::get("t"),
        ]))
        .await
        .unwrap();
    assert!(t.succeeded);
    assert!(matches!(&t.results[1], TxnOpResult::Get(Some(kv)) if kv.value == b"1"), "[{}] {:?}", s.name, t.results);
    assert_eq!(t.results[2], TxnOpResult::Delete { deleted: true });
    assert_eq!(t.results[3], TxnOpResult::Get(None));
}

async fn create_if_absent_has_one_winner(s: Subject) {
    const CALLERS: usize = 16;
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let tasks: Vec<_> = (0..CALLERS)
        .map(|i| {
            let (store, barrier) = (s.store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let me = format!("candidate-{i}");
                (me.clone(), store.create_if_absent(b"leader", me.as_bytes(), None).await)
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut seen_by_losers = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            (me, Ok(_)) => winners.push(me),
            (_, Err(MetaError::CompareFailed { current: Some(kv), .. })) => seen_by_losers.push(kv.value),
            (_, Err(e)) => panic!("[{}] unexpected error: {e}", s.name),
        }
    }
    assert_eq!(winners.len(), 1, "[{}] exactly one winner: {winners:?}", s.name);
    assert_eq!(seen_by_losers.len(), CALLERS - 1);
    assert!(seen_by_losers.iter().all(|v| *v == winners[0].as_bytes()), "losers see the winner");
    assert_eq!(value_of(&s.store.get(b"leader").await.unwrap().kv), Some(winners[0].as_bytes()));
}

async fn leased_keys_vanish_on_expiry(s: Subject) {
    let st = &s.store;
    let grant = st.lease_grant(Duration::from_secs(2)).await.unwrap();
    assert!(grant.ttl >= Duration::from_secs(2));
    st.put(b"members/a", b"alive", Some(grant.id)).await.unwrap();
    st.put(b"members/forever", b"no lease", None).await.unwrap();
    let kv = st.get(b"members/a").await.unwrap().kv.unwrap();
    assert_eq!(kv.lease, Some(grant.id));
    let info = st.lease_time_to_live(grant.id).await.unwrap().expect("lease exists");
    assert_eq!(info.keys, vec![b"members/a".to_vec()]);
    assert_eq!(info.granted_ttl, grant.ttl);
    assert!(info.remaining <= grant.ttl);

    // A renewal answers with the full TTL.
    assert_eq!(st.lease_keep_alive_once(grant.id).await.unwrap(), grant.ttl);

    s.let_leases_age(grant.ttl);
    s.eventually(grant.ttl + Duration::from_secs(5), "leased key deleted on expiry", || async {
        st.get(b"members/a").await.unwrap().kv.is_none()
    })
    .await;
    assert!(st.get(b"members/forever").await.unwrap().kv.is_some(), "unleased key stays");
    assert_eq!(st.lease_time_to_live(grant.id).await.unwrap(), None);
    assert_eq!(st.lease_keep_alive_once(grant.id).await, Err(MetaError::LeaseNotFound { lease: grant.id }));
    assert_eq!(st.put(b"members/b", b"x", Some(grant.id)).await, Err(MetaError::LeaseNotFound { lease: grant.id }));
    let t = st.txn(Txn::new().and_then([TxnOp::Put {
        key: b"members/c".to_vec(),
        value: b"x".to_vec(),
        lease: Some(grant.id),
    }]));
    assert!(matches!(t.await, Err(MetaError::LeaseNotFound { .. })));
    assert_eq!(st.get(b"members/c").await.unwrap().kv, None, "a failed transaction changes nothing");
}

async fn leased_keys_vanish_on_revoke(s: Subject) {
    let st = &s.store;
    let grant = st.lease_grant(Duration::from_secs(60)).await.unwrap();
    st.put(b"l/1", b"x", Some(grant.id)).await.unwrap();
    let before = st.put(b"l/2", b"x", Some(grant.id)).await.unwrap();
    // Re-putting a key without the lease detaches it.
    st.put(b"l/3", b"x", Some(grant.id)).await.unwrap();
    st.put(b"l/3", b"y", None).await.unwrap();
    let mut watch = st.watch(WatchRequest::prefix("l/").from_revision(before + 1)).await.unwrap();
    assert!(matches!(watch.next().await.unwrap(), WatchEvent::Put(_)));
    assert!(matches!(watch.next().await.unwrap(), WatchEvent::Put(_)));

    st.lease_revoke(grant.id).await.unwrap();
    assert_eq!(st.get(b"l/1").await.unwrap().kv, None, "[{}]", s.name);
    assert_eq!(st.get(b"l/2").await.unwrap().kv, None);
    assert!(st.get(b"l/3").await.unwrap().kv.is_some(), "detached key survives the revoke");
    // Both deletes happen at one revision, like any transaction.
    let (a, b) =
        (within("delete event", watch.next()).await.unwrap(), within("delete event", watch.next()).await.unwrap());
    match (a, b) {
        (WatchEvent::Delete(a), WatchEvent::Delete(b)) => {
            assert_eq!(a.mod_revision, b.mod_revision);
            assert_eq!((a.key.as_slice(), b.key.as_slice()), (&b"l/1"[..], &b"l/2"[..]));
        }
        other => panic!("[{}] expected two deletes, got {other:?}", s.name),
    }
    assert_eq!(st.lease_revoke(grant.id).await, Err(MetaError::LeaseNotFound { lease: grant.id }));
    assert_eq!(st.lease_time_to_live(grant.id).await.unwrap(), None);
}

async fn keeper_revoke_ends_the_lease(s: Subject) {
    let keeper = LeaseKeeper::grant(s.store.clone(), Duration::from_secs(30), Arc::new(SystemClock)).await.unwrap();
    assert!(keeper.is_valid());
    let mut states = keeper.subscribe();
    assert!(matches!(*states.borrow(), LeaseState::Held { .. }));
    s.store.put(b"registration", b"me", Some(keeper.id())).await.unwrap();
    keeper.revoke().await.unwrap();
    assert!(matches!(*states.borrow_and_update(), LeaseState::Lost(LeaseLost::Revoked)));
    assert_eq!(s.store.get(b"registration").await.unwrap().kv, None, "[{}]", s.name);
}

/// What a watch reports, reduced to compare: (key, is_put, value, mod_revision).
type Seen = (Vec<u8>, bool, Vec<u8>, i64);

fn seen(event: WatchEvent) -> Seen {
    match event {
        WatchEvent::Put(kv) => (kv.key, true, kv.value, kv.mod_revision),
        WatchEvent::Delete(kv) => (kv.key, false, Vec::new(), kv.mod_revision),
        other => panic!("unexpected watch event {other:?}"),
    }
}

async fn watch_from_revision_sees_every_later_event_in_order(s: Subject) {
    let st = &s.store;
    st.put(b"w/before", b"0", None).await.unwrap();
    let start = st.put(b"w/a", b"1", None).await.unwrap();
    let mut expected: Vec<Seen> = vec![(b"w/a".to_vec(), true, b"1".to_vec(), start)];

    // Writes before the watch exists are replayed from history ...
    for i in 0..20 {
        let key = format!("w/k{}", i % 7).into_bytes();
        let rev = st.put(&key, format!("v{i}").as_bytes(), None).await.unwrap();
        expected.push((key, true, format!("v{i}").into_bytes(), rev));
        st.put(b"other/noise", b"x", None).await.unwrap();
    }
    let d = st.delete(b"w/k3").await.unwrap();
    expected.push((b"w/k3".to_vec(), false, Vec::new(), d.revision));
    let t = st
        .txn(Txn::new().and_then([TxnOp::put("w/t1", "a"), TxnOp::put("w/t2", "b"), TxnOp::delete("w/k4")]))
        .await
        .unwrap();
    expected.push((b"w/t1".to_vec(), true, b"a".to_vec(), t.revision));
    expected.push((b"w/t2".to_vec(), true, b"b".to_vec(), t.revision));
    expected.push((b"w/k4".to_vec(), false, Vec::new(), t.revision));

    let mut watch = st.watch(WatchRequest::prefix("w/").from_revision(start)).await.unwrap();

    // ... and writes made while it runs follow, from another task.
    let writer = {
        let store = s.store.clone();
        tokio::spawn(async move {
            let mut more = Vec::new();
            for i in 0..30 {
                let key = format!("w/live{}", i % 5).into_bytes();
                let rev = store.put(&key, format!("x{i}").as_bytes(), None).await.unwrap();
                more.push((key, true, format!("x{i}").into_bytes(), rev));
            }
            more
        })
    };
    expected.extend(writer.await.unwrap());

    let mut got = Vec::new();
    while got.len() < expected.len() {
        got.push(seen(within("watch event", watch.next()).await.unwrap()));
    }
    assert_eq!(got, expected, "[{}] every event, in order, exactly once", s.name);
    // Nothing else is pending.
    let extra = tokio::time::timeout(Duration::from_millis(300), watch.next()).await;
    assert!(extra.is_err(), "[{}] unexpected extra event {extra:?}", s.name);
}

async fn watch_of_one_key_and_from_now(s: Subject) {
    let st = &s.store;
    st.put(b"one", b"old", None).await.unwrap();
    let mut key_watch = st.watch(WatchRequest::key("one")).await.unwrap();
    let mut all_watch = st.watch(WatchRequest::prefix("")).await.unwrap();
    st.put(b"one/child", b"x", None).await.unwrap();
    st.put(b"onf", b"x", None).await.unwrap();
    let r = st.put(b"one", b"new", None).await.unwrap();
    let got = seen(within("key watch", key_watch.next()).await.unwrap());
    assert_eq!(got, (b"one".to_vec(), true, b"new".to_vec(), r), "[{}] only the key, only from now", s.name);
    let mut all = Vec::new();
    for _ in 0..3 {
        all.push(seen(within("prefix watch", all_watch.next()).await.unwrap()).0);
    }
    assert_eq!(all, vec![b"one/child".to_vec(), b"onf".to_vec(), b"one".to_vec()]);
}

async fn watch_from_compacted_revision_reports_compacted(s: Subject) {
    let st = &s.store;
    let old = st.put(b"c/a", b"1", None).await.unwrap();
    for i in 0..5 {
        st.put(b"c/b", format!("{i}").as_bytes(), None).await.unwrap();
    }
    let now = st.put(b"c/a", b"2", None).await.unwrap();
    st.compact(now).await.unwrap();

    let mut watch = st.watch(WatchRequest::prefix("c/").from_revision(old)).await.unwrap();
    let expected = MetaError::Compacted { requested: old, compact_revision: now };
    assert_eq!(within("compaction notice", watch.next()).await, Err(expected.clone()), "[{}]", s.name);
    assert_eq!(watch.next().await, Err(expected.clone()), "the end is final");

    let range = st.range(RangeRequest::prefix("c/", 10).at_revision(old)).await;
    assert_eq!(range, Err(expected), "[{}] reads below the compaction fail too", s.name);
    assert!(matches!(st.compact(now).await, Err(MetaError::Compacted { .. })));

    // The remedy: a fresh snapshot, and a watch from just after it.
    let (snapshot, at) = st.snapshot(b"c/", 1).await.unwrap();
    assert_eq!(snapshot.iter().map(|kv| kv.value.clone()).collect::<Vec<_>>(), vec![b"2".to_vec(), b"4".to_vec()]);
    let mut watch = st.watch(WatchRequest::prefix("c/").from_revision(at + 1)).await.unwrap();
    let r = st.put(b"c/z", b"after", None).await.unwrap();
    assert_eq!(
        seen(within("resumed watch", watch.next()).await.unwrap()),
        (b"c/z".to_vec(), true, b"after".to_vec(), r)
    );
    // Watching from exactly the compaction revision is still allowed.
    let mut at_compaction = st.watch(WatchRequest::key("c/a").from_revision(now)).await.unwrap();
    assert_eq!(seen(within("watch at compaction", at_compaction.next()).await.unwrap()).3, now);
}

async fn paginated_range_at_fixed_revision_is_consistent(s: Subject) {
    let st = &s.store;
    for i in 0..50 {
        st.put(format!("p/{i:03}").as_bytes(), format!("v{i}").as_bytes(), None).await.unwrap();
    }
    st.put(b"p0", b"outside the prefix", None).await.unwrap();
    st.put(b"o/zzz", b"outside the prefix", None).await.unwrap();

    let first_req = RangeRequest::prefix("p/", 7);
    let mut page = st.range(first_req.clone()).await.unwrap();
    let at = page.revision;
    let mut req = first_req;
    let mut collected: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut pages = 0;
    loop {
        pages += 1;
        assert!(page.kvs.len() <= 7);
        for kv in &page.kvs {
            assert!(collected.insert(kv.key.clone(), kv.value.clone()).is_none(), "no key twice");
            assert!(kv.mod_revision <= at);
        }
        // Writes continue between pages: updates, deletes, and inserts before and after the cursor.
        st.put(format!("p/{:03}", pages * 3).as_bytes(), b"changed", None).await.unwrap();
        st.delete(format!("p/{:03}", 49 - pages).as_bytes()).await.unwrap();
        st.put(format!("p/{:03}x", pages * 5).as_bytes(), b"new", None).await.unwrap();
        let Some(next) = req.next_page(&page) else { break };
        req = next;
        page = st.range(req.clone()).await.unwrap();
        assert_eq!(page.revision, at, "every page at the first page's revision");
    }
    assert_eq!(pages, 8, "[{}] 50 keys in pages of 7", s.name);
    let expected: BTreeMap<Vec<u8>, Vec<u8>> =
        (0..50).map(|i| (format!("p/{i:03}").into_bytes(), format!("v{i}").into_bytes())).collect();
    assert_eq!(collected, expected, "[{}] the scan is the state at its revision", s.name);

    // The same scan now sees the writes.
    let (now, _) = st.snapshot(b"p/", 10).await.unwrap();
    assert!(now.iter().any(|kv| kv.value == b"changed"));
    assert!(now.iter().all(|kv| kv.key != b"p/048"));

    // Unlimited pages, and an empty prefix covers everything.
    let all = st.range(RangeRequest::prefix("", 0)).await.unwrap();
    assert_eq!(all.next, None);
    assert!(all.kvs.iter().any(|kv| kv.key == b"o/zzz") && all.kvs.iter().any(|kv| kv.key == b"p0"));
    assert!(matches!(
        st.range(RangeRequest::prefix("p/", 5).at_revision(at + 10_000)).await,
        Err(MetaError::FutureRevision { .. })
    ));
}

async fn oversized_requests_are_refused_before_sending(s: Subject) {
    let st = &s.store;
    let before = st.get(b"probe").await.unwrap().revision;
    let too_big = vec![7u8; DEFAULT_MAX_REQUEST_BYTES + 1];
    let refused = |r: Result<i64, MetaError>| match r {
        Err(MetaError::RequestTooLarge { size, limit }) => {
            // A size > 0 shows the refusal is ours, computed before sending (etcd's own
            // refusal carries no size).
            assert!(size > limit && limit == DEFAULT_MAX_REQUEST_BYTES, "size {size} limit {limit}");
        }
        other => panic!("[{}] expected RequestTooLarge, got {other:?}", s.name),
    };
    refused(st.put(b"big", &too_big, None).await);
    refused(st.put(&too_big, b"v", None).await);
    refused(st.create_if_absent(b"big", &too_big, None).await);
    let err = st.get(&too_big).await.unwrap_err();
    assert!(matches!(err, MetaError::RequestTooLarge { .. }));
    assert_eq!(err.code(), tycho_proto::ErrorCode::INVALID_PARAMS);
    assert!(err.to_string().contains("exceeds the coordinator's limit"), "clear message: {err}");
    let scan = st.range(RangeRequest::prefix(too_big.clone(), 1)).await;
    assert!(matches!(scan, Err(MetaError::RequestTooLarge { .. })), "[{}] {scan:?}", s.name);

    // Many small values that add up to too much, in one transaction.
    let chunk = vec![1u8; 64 * 1024];
    let ops: Vec<TxnOp> = (0..30).map(|i| TxnOp::put(format!("chunk/{i}"), chunk.clone())).collect();
    assert!(matches!(st.txn(Txn::new().and_then(ops)).await, Err(MetaError::RequestTooLarge { .. })));

    // Too many ops in one list.
    let ops = |n: usize| (0..n).map(|i| TxnOp::put(format!("ops/{i}"), "v")).collect::<Vec<_>>();
    let err = st.txn(Txn::new().and_then(ops(DEFAULT_MAX_TXN_OPS + 1))).await.unwrap_err();
    assert!(matches!(err, MetaError::TooManyOps { ops: 129, limit: 128, .. }), "[{}] {err}", s.name);
    let compares: Vec<Compare> = (0..DEFAULT_MAX_TXN_OPS + 1).map(|i| Compare::absent(format!("ops/{i}"))).collect();
    assert!(matches!(st.txn(Txn::new().when(compares)).await, Err(MetaError::TooManyOps { what: "compares", .. })));
    assert!(matches!(st.put(b"", b"v", None).await, Err(MetaError::InvalidArgument(_))));
    let dup = Txn::new().and_then([TxnOp::put("d", "1"), TxnOp::put("d", "2")]);
    assert!(matches!(st.txn(dup).await, Err(MetaError::InvalidArgument(_))));

    // Nothing was written.
    assert_eq!(st.get(b"probe").await.unwrap().revision, before, "[{}] refused requests write nothing", s.name);

    // At the limits, the store accepts: 128 ops, and a value just under the request limit.
    st.txn(Txn::new().and_then(ops(DEFAULT_MAX_TXN_OPS))).await.unwrap();
    let near = vec![9u8; DEFAULT_MAX_REQUEST_BYTES - 1024];
    st.put(b"near-limit", &near, None).await.unwrap();
    assert_eq!(st.get(b"near-limit").await.unwrap().kv.unwrap().value.len(), near.len());
}
