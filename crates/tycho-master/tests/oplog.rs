//! The OpLog writer on `MemStore`, with a wrapper that holds transactions or loses their
//! answers: batching, order, fencing, unknown outcomes, back-pressure and reopening.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tycho_master::oplog::{decode_prefix, Fence, LogError, LogKeys, OpLogWriter, WriterConfig};
use tycho_master::record::{Record, RecordBatch};
use tycho_meta::{
    BoxFuture, DeleteResponse, GetResponse, LeaseGrant, LeaseId, LeaseInfo, Limits, MemStore, MetaError, MetaResult,
    MetaStore, RangePage, RangeRequest, Revision, Txn, TxnResponse, Watch, WatchRequest,
};
use tycho_proto::ClientId;

/// What the next transaction does.
const NORMAL: u8 = 0;
/// Waits for `release` before it runs.
const HOLD: u8 = 1;
/// Runs, then its answer is lost (once).
const APPLY_THEN_LOSE: u8 = 2;
/// Is lost before it runs (once).
const LOSE: u8 = 3;

#[derive(Debug)]
struct Store {
    inner: MemStore,
    mode: AtomicU8,
    txns: AtomicU64,
    release: tokio::sync::Semaphore,
}

impl Store {
    fn new() -> Arc<Store> {
        Arc::new(Store {
            inner: MemStore::new(),
            mode: AtomicU8::new(NORMAL),
            txns: AtomicU64::new(0),
            release: tokio::sync::Semaphore::new(0),
        })
    }
}

impl MetaStore for Store {
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
            match self.mode.load(Ordering::SeqCst) {
                HOLD => self.release.acquire().await.expect("open").forget(),
                APPLY_THEN_LOSE => {
                    self.mode.store(NORMAL, Ordering::SeqCst);
                    self.inner.txn(txn).await?;
                    return Err(MetaError::Unavailable("answer lost".into()));
                }
                LOSE => {
                    self.mode.store(NORMAL, Ordering::SeqCst);
                    return Err(MetaError::Unavailable("request lost".into()));
                }
                _ => {}
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
        self.inner.lease_keep_alive_once(lease)
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

const OWNER: &[u8] = b"/tycho/test/kvpt_groups/00000";

fn rec(i: u64) -> Record {
    Record::WriteRevoke { key: format!("key-{i}").into_bytes(), writer: ClientId(1), write_id: i }
}

fn cfg() -> WriterConfig {
    WriterConfig { max_batch_records: 4, retry_backoff: Duration::from_millis(1), ..WriterConfig::default() }
}

async fn setup(cfg: WriterConfig) -> (Arc<Store>, OpLogWriter, Fence) {
    let store = Store::new();
    let rev = store.put(OWNER, b"primary: a", None).await.unwrap();
    let fence = Fence { key: OWNER.to_vec(), mod_revision: rev };
    let w = OpLogWriter::open(store.clone(), LogKeys::new("test", 0), fence.clone(), 0, 1, cfg).await.unwrap();
    (store, w, fence)
}

/// The batches of group 0's log, in order.
async fn batches(store: &Store) -> Vec<RecordBatch> {
    let keys = LogKeys::new("test", 0);
    let page = store.range(RangeRequest::prefix(keys.batches(), 1000)).await.unwrap();
    page.kvs.iter().map(|kv| RecordBatch::decode(&kv.value).unwrap()).collect()
}

async fn durable_prefix(store: &Store) -> u64 {
    let kv = store.get(&LogKeys::new("test", 0).durable()).await.unwrap().kv.unwrap();
    decode_prefix(&kv.value).unwrap()
}

/// Waits (bounded) until the store has seen `n` transactions.
async fn until_txns(store: &Store, n: u64) {
    for _ in 0..5000 {
        if store.txns.load(Ordering::SeqCst) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the writer never sent transaction {n}");
}

#[tokio::test]
async fn records_commit_in_order_in_bounded_batches() {
    let (store, w, _) = setup(cfg()).await;
    let seqs: Vec<u64> = (1..=10).map(|i| w.append(rec(i)).unwrap()).collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    w.wait(10).await.unwrap();
    // Durability comes in order: every earlier record is durable too.
    for s in seqs {
        w.wait(s).await.unwrap();
    }
    let log = batches(&store).await;
    assert!(log.iter().all(|b| b.records.len() <= 4 && b.group == 0 && b.epoch == 1));
    let mut next = 1;
    for b in &log {
        assert_eq!(b.first_seq, next, "batches continue one another");
        next = b.last_seq() + 1;
    }
    let all: Vec<Record> = log.into_iter().flat_map(|b| b.records).collect();
    assert_eq!(all, (1..=10).map(rec).collect::<Vec<_>>());
    assert_eq!((durable_prefix(&store).await, w.durable()), (10, 10));
}

#[tokio::test]
async fn records_appended_during_a_commit_form_the_next_batch() {
    let (store, w, _) = setup(cfg()).await;
    store.mode.store(HOLD, Ordering::SeqCst);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    for i in 2..=4 {
        w.append(rec(i)).unwrap();
    }
    assert_eq!(w.durable(), 0);
    store.mode.store(NORMAL, Ordering::SeqCst);
    store.release.add_permits(1);
    w.wait(4).await.unwrap();
    let sizes: Vec<(u64, usize)> = batches(&store).await.iter().map(|b| (b.first_seq, b.records.len())).collect();
    assert_eq!(sizes, vec![(1, 1), (2, 3)]);
}

#[tokio::test]
async fn a_changed_ownership_record_fences_the_writer_for_good() {
    let (store, w, _) = setup(cfg()).await;
    w.append(rec(1)).unwrap();
    w.wait(1).await.unwrap();
    // Another master takes the group over.
    store.put(OWNER, b"primary: b", None).await.unwrap();
    let s = w.append(rec(2)).unwrap();
    let err = w.wait(s).await.unwrap_err();
    assert!(matches!(err, LogError::Fenced(_)), "{err:?}");
    assert_eq!(err.code(), tycho_proto::ErrorCode::KVPT_NOT_OWNED);
    assert!(matches!(w.append(rec(3)), Err(LogError::Fenced(_))), "a fenced writer takes nothing more");
    assert_eq!(batches(&store).await.len(), 1, "nothing was committed after the fence");
    assert_eq!(durable_prefix(&store).await, 1);
}

#[tokio::test]
async fn a_log_written_by_another_writer_fences_this_one() {
    let (store, w, fence) = setup(cfg()).await;
    w.append(rec(1)).unwrap();
    w.wait(1).await.unwrap();
    // A second writer under the same ownership record (a bug or a split brain) commits first.
    let other = OpLogWriter::open(store.clone(), LogKeys::new("test", 0), fence, 0, 1, cfg()).await.unwrap();
    other.wait(other.append(rec(100)).unwrap()).await.unwrap();
    let s = w.append(rec(2)).unwrap();
    assert!(matches!(w.wait(s).await, Err(LogError::Fenced(_))));
    let all: Vec<Record> = batches(&store).await.into_iter().flat_map(|b| b.records).collect();
    assert_eq!(all, vec![rec(1), rec(100)], "one history, no record of the fenced writer after it");
}

#[tokio::test]
async fn an_unknown_outcome_is_read_back_not_repeated_or_skipped() {
    let (store, w, _) = setup(cfg()).await;
    // Committed, but the answer was lost: read back as committed, not written twice.
    store.mode.store(APPLY_THEN_LOSE, Ordering::SeqCst);
    w.wait(w.append(rec(1)).unwrap()).await.unwrap();
    // Lost before it ran: sent again under the same sequence numbers.
    store.mode.store(LOSE, Ordering::SeqCst);
    let s = w.append(rec(2)).unwrap();
    assert_eq!(s, 2);
    w.wait(s).await.unwrap();
    let log = batches(&store).await;
    assert_eq!(
        log.iter().map(|b| (b.first_seq, b.records.clone())).collect::<Vec<_>>(),
        vec![(1, vec![rec(1)]), (2, vec![rec(2)])]
    );
    assert_eq!(store.txns.load(Ordering::SeqCst), 3, "the lost request was sent once more");
    assert_eq!(durable_prefix(&store).await, 2);
}

#[tokio::test]
async fn a_full_queue_is_busy_and_a_reopened_log_continues_its_numbering() {
    let (store, w, fence) = setup(WriterConfig { max_queued_records: 3, ..cfg() }).await;
    store.mode.store(HOLD, Ordering::SeqCst);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    for i in 2..=4 {
        w.append(rec(i)).unwrap();
    }
    let busy = w.append(rec(5)).unwrap_err();
    assert_eq!(busy, LogError::Busy);
    assert!(busy.code().retry_class() == tycho_proto::RetryClass::RetrySame, "busy is retryable");
    store.mode.store(NORMAL, Ordering::SeqCst);
    store.release.add_permits(1);
    w.wait(4).await.unwrap();
    w.close();
    assert!(matches!(w.append(rec(6)), Err(LogError::Closed)));
    drop(w);
    let again = OpLogWriter::open(store.clone(), LogKeys::new("test", 0), fence, 0, 1, cfg()).await.unwrap();
    assert_eq!(again.durable(), 4);
    let s = again.append(rec(5)).unwrap();
    assert_eq!(s, 5);
    again.wait(s).await.unwrap();
    assert_eq!(durable_prefix(&store).await, 5);
}
