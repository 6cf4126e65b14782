//! Ownership records and roles on `MemStore`: creation races, compare-and-swap changes, the
//! failover sequence of a primary, its standby and an idle master, and the fence it puts on the
//! old primary's OpLog writer.

use std::sync::Arc;
use std::time::Duration;

use tycho_master::cvm::{plan, Action, GroupView};
use tycho_master::oplog::{Fence, LogError, LogKeys, OpLogWriter, WriterConfig};
use tycho_master::ownership::{
    change_group, change_standbys, create_group, masters, read_group, register, ClusterKeys, GroupRecord,
    MasterRegistration, OwnershipError, Role,
};
use tycho_master::record::Record;
use tycho_meta::{MemStore, MetaStore};
use tycho_proto::ClientId;

/// What the role rules tell `me` about the one group of a G = 1 cluster.
fn decide(me: &str, live: &[(MasterRegistration, i64)], rec: Option<&GroupRecord>, holds: bool) -> Option<Action> {
    let ids: Vec<String> = live.iter().map(|(r, _)| r.id.clone()).collect();
    plan(me, &ids, &[GroupView::from(rec.cloned())], |_| holds).pop().map(|(_, a)| a)
}

fn reg(id: &str) -> MasterRegistration {
    MasterRegistration { id: id.into(), address: format!("{id}:7000"), role: Role::Idle, registered_at_ms: 0 }
}

#[tokio::test]
async fn of_two_masters_creating_a_group_one_wins() {
    let store = MemStore::new();
    let keys = ClusterKeys::new("c1");
    let (a, b) = tokio::join!(create_group(&store, &keys, 0, "a", false), create_group(&store, &keys, 0, "b", false));
    let (won, lost) = match (a, b) {
        (Ok(w), Err(l)) | (Err(l), Ok(w)) => (w, l),
        other => panic!("exactly one create must win: {other:?}"),
    };
    assert_eq!(won.0.epoch, 1);
    match lost {
        OwnershipError::Conflict(Some(current)) => assert_eq!(*current, won),
        e => panic!("the loser learns the winner's record, got {e:?}"),
    }
    assert_eq!(read_group(&store, &keys, 0).await.unwrap(), Some(won));
    assert_eq!(keys.cluster(), "c1");
}

#[tokio::test]
async fn a_change_from_a_stale_read_is_refused_with_the_current_record() {
    let store = MemStore::new();
    let keys = ClusterKeys::new("c1");
    let first = create_group(&store, &keys, 3, "a", false).await.unwrap();
    let second = change_group(&store, &keys, &first, |g| g.standbys.push("b".into())).await.unwrap();
    assert_eq!((second.0.epoch, second.0.standbys.clone()), (2, vec!["b".to_string()]));
    let stale = change_group(&store, &keys, &first, |g| g.primary = "c".into()).await.unwrap_err();
    assert_eq!(stale, OwnershipError::Conflict(Some(Box::new(second.clone()))));
    // A change cannot move the record to another rank or pick its own epoch.
    let third = change_group(&store, &keys, &second, |g| {
        g.rank = 9;
        g.epoch = 100;
    })
    .await
    .unwrap();
    assert_eq!((third.0.rank, third.0.epoch), (3, 3));
}

#[tokio::test]
async fn a_dead_primary_is_replaced_by_its_standby_and_its_log_is_fenced() {
    let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
    let keys = ClusterKeys::new("c1");
    let mut leases = Vec::new();
    for id in ["a", "b", "c"] {
        let lease = store.lease_grant(Duration::from_secs(10)).await.unwrap().id;
        register(&*store, &keys, &reg(id), lease).await.unwrap();
        leases.push(lease);
    }
    let live = masters(&*store, &keys).await.unwrap();
    assert_eq!(live.iter().map(|(r, _)| r.id.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);

    // a creates the group and serves it; b joins as its standby; c waits.
    assert_eq!(decide("a", &live, None, false), Some(Action::Create { caretake: false }));
    let created = create_group(&*store, &keys, 0, "a", false).await.unwrap();
    assert_eq!(decide("b", &live, Some(&created.0), true), Some(Action::JoinAsStandby));
    let paired = change_standbys(&*store, &keys, &created, |s| *s = vec!["b".into()]).await.unwrap();
    assert_eq!(paired.0.epoch, created.0.epoch, "a standby joining changes nobody's epoch");
    assert_eq!(decide("a", &live, Some(&paired.0), true), Some(Action::Serve));
    assert_eq!(decide("b", &live, Some(&paired.0), true), Some(Action::Follow));
    assert_eq!(decide("c", &live, Some(&paired.0), true), None);

    // a's OpLog writer commits under the record as a became primary of it.
    let fence = Fence { key: keys.group(0), mod_revision: paired.1, owner: Some(("a".into(), paired.0.epoch)) };
    let log =
        OpLogWriter::open(store.clone(), LogKeys::new("c1", 0), fence, 0, paired.0.epoch, WriterConfig::default())
            .await
            .unwrap();
    let rec = |i: u64| Record::WriteRevoke { key: vec![i as u8], writer: ClientId(1), write_id: i };
    log.wait(log.append(rec(1)).unwrap()).await.unwrap();
    // c joins as a second standby and leaves again: the primary's log goes on committing.
    let more = change_standbys(&*store, &keys, &paired, |s| s.push("c".into())).await.unwrap();
    log.wait(log.append(rec(2)).unwrap()).await.unwrap();
    let paired = change_standbys(&*store, &keys, &more, |s| s.retain(|m| m != "c")).await.unwrap();
    log.wait(log.append(rec(3)).unwrap()).await.unwrap();

    // a dies (its lease ends): b takes over; c, acting on the same view, loses the race.
    store.lease_revoke(leases[0]).await.unwrap();
    let live = masters(&*store, &keys).await.unwrap();
    assert_eq!(decide("b", &live, Some(&paired.0), true), Some(Action::TakeOver { caretake: false }));
    assert_eq!(decide("c", &live, Some(&paired.0), true), None);
    let promoted = change_group(&*store, &keys, &paired, |g| {
        g.primary = "b".into();
        g.standbys.clear();
    })
    .await
    .unwrap();
    let late = change_group(&*store, &keys, &paired, |g| g.primary = "c".into()).await.unwrap_err();
    assert!(matches!(late, OwnershipError::Conflict(Some(_))));
    assert_eq!((promoted.0.primary.as_str(), promoted.0.epoch), ("b", 2));
    assert_eq!(decide("c", &live, Some(&promoted.0), true), Some(Action::JoinAsStandby));

    // Anything a (paused, not dead) still tries to commit is refused by the store.
    let after = log.append(rec(4)).unwrap();
    assert!(matches!(log.wait(after).await, Err(LogError::Fenced(_))));
    assert_eq!(log.durable(), 3);
}
