//! A standby master promoted in-process, on `MemStore` (through the fault wrapper): it serves
//! everything the old primary acknowledged, the old primary's later commits are refused, and a
//! promotion that cannot read the whole log fails closed.

use std::sync::Arc;
use std::time::Duration;

use tycho_master::oplog::{Fence, LogError, LogFollower, OpLogWriter, WriterConfig};
use tycho_master::ownership::{change_standbys, create_group, ClusterKeys, GroupRecord};
use tycho_master::standby::{apply_to, log_keys, promote, PromoteError, Promotion};
use tycho_master::{ManualClock, Master, MasterConfig, WriteMode};
use tycho_meta::faults::{FaultyStore, TxnFault};
use tycho_meta::{MemStore, MetaStore, Revision};
use tycho_proto::*;

const A: ClientId = ClientId(7);

struct Cluster {
    store: Arc<FaultyStore>,
    keys: ClusterKeys,
    /// The group record with primary "a" and standby "b".
    paired: (GroupRecord, Revision),
    primary: Arc<Master>,
    log: Arc<OpLogWriter>,
    standby: Arc<Master>,
    standby_clock: Arc<ManualClock>,
}

fn master() -> Arc<Master> {
    Arc::new(Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1_000))))
}

async fn cluster() -> Cluster {
    let store = Arc::new(FaultyStore::new(Arc::new(MemStore::new())));
    let keys = ClusterKeys::new("t");
    let created = create_group(&*store, &keys, 0, "a", false).await.unwrap();
    let paired = change_standbys(&*store, &keys, &created, |s| s.push("b".into())).await.unwrap();
    let fence = Fence { key: keys.group(0), mod_revision: paired.1, owner: Some(("a".into(), paired.0.epoch)) };
    let writer = WriterConfig { max_batch_records: 8, retry_backoff: Duration::from_millis(1), ..Default::default() };
    let log = OpLogWriter::open(store.clone(), log_keys(&keys, 0), fence, 0, paired.0.epoch, writer).await.unwrap();
    let log = Arc::new(log);
    let primary = master();
    assert!(primary.set_record_sink(0, Some(log.clone())));
    primary.stop_serving_when_log_ends(&log, 0);
    let standby_clock = Arc::new(ManualClock::new(1_000));
    let standby = Arc::new(Master::new(MasterConfig::default(), standby_clock.clone()));
    assert!(standby.stand_by(0));
    Cluster { store, keys, paired, primary, log, standby, standby_clock }
}

/// A promotion of `me` from the paired record, with a generous deadline.
fn promotion<'a>(c: &'a Cluster, me: &'a str) -> Promotion<'a> {
    Promotion {
        store: c.store.clone(),
        keys: &c.keys,
        me,
        read: c.paired.clone(),
        caretake: false,
        catch_up_deadline: Duration::from_secs(5),
        writer: WriterConfig::default(),
    }
}

fn kref(k: &str, epoch: u64) -> KeyRef {
    KeyRef { key: k.into(), route: tycho_routing::route_for("", k, epoch) }
}

fn start(m: &Master, k: &str, id: u64, epoch: u64) -> WireResult<Vec<ReplicaDesc>> {
    let req = WriteStart {
        client: A,
        tenant: String::new(),
        key: kref(k, epoch),
        size: 1000 + id,
        config: ReplicateConfig::default(),
        write_id: id,
    };
    m.write_start(WriteMode::Put, &req)
}

fn end(m: &Master, k: &str, id: u64, epoch: u64) -> WireResult<Vec<ReplicaDesc>> {
    m.write_finish(&WriteFinish { client: A, tenant: String::new(), key: kref(k, epoch), write_id: id }, true)
}

/// Waits until everything this thread logged is durable, as an RPC answer does.
async fn acknowledged(m: &Master) -> Result<(), ErrorCode> {
    match m.durable(Master::take_logged()) {
        Some(wait) => wait.await,
        None => Ok(()),
    }
}

fn segment() -> SegmentDesc {
    SegmentDesc {
        id: SegmentId(1),
        name: "s".into(),
        base: 0,
        size: 1 << 24,
        endpoint: "10.0.0.1:1".into(),
        host: "h".into(),
        incarnation: 1,
    }
}

#[tokio::test]
async fn a_promoted_standby_serves_everything_acknowledged_and_fences_the_old_primary() {
    let c = cluster().await;
    let p = &c.primary;
    p.mount_segment(A, segment()).unwrap();
    acknowledged(p).await.unwrap();
    for i in 1..=40u64 {
        start(p, &format!("k{i}"), i, 1).unwrap();
        end(p, &format!("k{i}"), i, 1).unwrap();
        acknowledged(p).await.unwrap();
    }
    // A write its writer has not finished yet, acknowledged as started.
    start(p, "open", 100, 1).unwrap();
    acknowledged(p).await.unwrap();

    // The standby follows part of the way, and answers nobody meanwhile.
    let mut follower = LogFollower::new(c.store.clone(), log_keys(&c.keys, 0), 0, 0, 4);
    follower.catch_up(&mut apply_to(&c.standby, 0)).await.unwrap();
    assert_eq!(
        c.standby.exist_key(&KeyQuery { tenant: String::new(), key: kref("k1", 1) }),
        Err(ErrorCode::KVPT_NOT_OWNED)
    );
    assert!(!c.standby.is_serving());
    // Its housekeeping decides nothing only a primary decides: long past every client's TTL,
    // nobody is expired and nothing is evicted.
    c.standby_clock.advance(tycho_master::DEFAULT_CLIENT_TTL_MS * 10);
    c.standby.tick();
    assert_eq!(c.standby.evict(), (0, 0));
    assert_eq!(c.standby.counters.clients_expired.load(std::sync::atomic::Ordering::Relaxed), 0);
    for i in 41..=50u64 {
        start(p, &format!("k{i}"), i, 1).unwrap();
        end(p, &format!("k{i}"), i, 1).unwrap();
        acknowledged(p).await.unwrap();
    }

    // The old primary goes quiet with a commit in flight: its transaction is held in the store.
    c.store.set_txn_fault(TxnFault::Hold);
    start(p, "late", 200, 1).unwrap();
    let late_start = Master::take_logged();
    let held = c.store.txns();

    // The standby promotes.
    c.store.set_txn_fault(TxnFault::None);
    let how = promotion(&c, "b");
    let (record, _log) = promote(&c.standby, &mut follower, how).await.unwrap();
    assert_eq!((record.primary.as_str(), record.epoch, record.standbys.len()), ("b", c.paired.0.epoch + 1, 0));
    assert!(c.standby.is_serving());
    assert!(!c.standby.group(0).unwrap().is_installing(), "served, no longer about to be");

    // The old primary's held transaction now runs, and fails its fence: the write it started
    // is never acknowledged, nor anything after it.
    c.store.release_txns(1);
    assert!(c.store.txns() > held);
    let err = c.log.wait(late_start.last()).await.unwrap_err();
    assert!(matches!(err, LogError::Fenced(_)), "{err:?}");
    // Its log ended, so it serves nothing any more, reads included.
    assert_eq!(end(p, "late", 200, 1), Err(ErrorCode::KVPT_NOT_OWNED));
    let old_read = KeyQuery { tenant: String::new(), key: kref("k1", 1) };
    assert_eq!(p.get_replica_list(&old_read).map(|l| l.size), Err(ErrorCode::KVPT_NOT_OWNED));
    assert!(!p.is_serving());

    // Everything acknowledged is served by the new primary under the new epoch, with its size.
    let epoch = record.epoch;
    for i in 1..=50u64 {
        let q = KeyQuery { tenant: String::new(), key: kref(&format!("k{i}"), epoch) };
        let list = c.standby.get_replica_list(&q).unwrap_or_else(|e| panic!("k{i}: {e:?}"));
        assert_eq!(list.size, 1000 + i);
    }
    let stale = KeyQuery { tenant: String::new(), key: kref("k1", 1) };
    assert_eq!(c.standby.exist_key(&stale), Err(ErrorCode::STALE_EPOCH));
    let q = |k: &str| KeyQuery { tenant: String::new(), key: kref(k, epoch) };
    assert_eq!(c.standby.exist_key(&q("late")), Ok(false), "never acknowledged, never replayed");
    // The open write's writer finishes it on the new primary; its commit is logged there.
    end(&c.standby, "open", 100, epoch).unwrap();
    acknowledged(&c.standby).await.unwrap();
    assert_eq!(c.standby.get_replica_list(&q("open")).unwrap().size, 1100);
    // Objects just taken over carry a read lease (the old primary's readers may be copying).
    let rm = RemoveKey { tenant: String::new(), key: kref("k2", epoch), force: false };
    assert_eq!(c.standby.remove(&rm), Err(ErrorCode::OBJECT_HAS_LEASE));
}

#[tokio::test]
async fn a_promotion_that_cannot_read_the_whole_log_fails_closed() {
    let c = cluster().await;
    let p = &c.primary;
    p.mount_segment(A, segment()).unwrap();
    acknowledged(p).await.unwrap();
    for i in 1..=20u64 {
        start(p, &format!("k{i}"), i, 1).unwrap();
        acknowledged(p).await.unwrap();
    }
    // A batch in the middle of the log is lost.
    let batches = c.store.range(tycho_meta::RangeRequest::prefix(log_keys(&c.keys, 0).batches(), 100)).await.unwrap();
    assert!(batches.kvs.len() > 2);
    c.store.delete(&batches.kvs[1].key).await.unwrap();
    let mut follower = LogFollower::new(c.store.clone(), log_keys(&c.keys, 0), 0, 0, 4);
    let how = promotion(&c, "b");
    let err = promote(&c.standby, &mut follower, how).await.unwrap_err();
    assert!(matches!(err, PromoteError::CatchUp(_)), "{err:?}");
    assert!(!c.standby.is_serving(), "a standby that could not replay the log does not serve");
    // The record names it primary now: clients are told to wait here, not to go elsewhere.
    let named = c.paired.0.epoch + 1;
    let read = |epoch| KeyQuery { tenant: String::new(), key: kref("k1", epoch) };
    assert_eq!(c.standby.exist_key(&read(named)), Err(ErrorCode::KVPT_MIGRATING));
    assert_eq!(start(&c.standby, "k99", 99, named), Err(ErrorCode::KVPT_MIGRATING));
    // Once it gives the group up (the record names another master), they are sent on.
    c.standby.installing(0, false);
    assert_eq!(c.standby.exist_key(&read(named)), Err(ErrorCode::KVPT_NOT_OWNED));
    c.standby.installing(0, true);
    assert!(c.standby.stand_by(0));
    assert_eq!(c.standby.exist_key(&read(named)), Err(ErrorCode::KVPT_NOT_OWNED));
    // A promotion from a stale read of the record loses to the one that changed it.
    let again = promotion(&c, "c");
    let mut follower = LogFollower::new(c.store.clone(), log_keys(&c.keys, 0), 0, 0, 4);
    assert!(matches!(promote(&master(), &mut follower, again).await, Err(PromoteError::Lost(_))));
}
