//! The OpLog writer on `MemStore`, with a wrapper that holds transactions or loses their
//! answers: batching, order, fencing, unknown outcomes, back-pressure and reopening.

use std::sync::Arc;
use std::time::Duration;

use tycho_master::oplog::{read_durable, Fence, LogError, LogKeys, OpLogWriter, WriterConfig};
use tycho_master::record::{Record, RecordBatch};
use tycho_meta::faults::{FaultyStore, TxnFault};
use tycho_meta::{MemStore, MetaStore, RangeRequest};
use tycho_proto::ClientId;

type Store = FaultyStore;

const OWNER: &[u8] = b"/tycho/test/kvpt_groups/00000";

fn rec(i: u64) -> Record {
    Record::WriteRevoke { key: format!("key-{i}").into_bytes(), writer: ClientId(1), write_id: i }
}

fn cfg() -> WriterConfig {
    WriterConfig { max_batch_records: 4, retry_backoff: Duration::from_millis(1), ..WriterConfig::default() }
}

async fn setup(cfg: WriterConfig) -> (Arc<Store>, OpLogWriter, Fence) {
    let store = Arc::new(FaultyStore::new(Arc::new(MemStore::new())));
    let rev = store.put(OWNER, b"primary: a", None).await.unwrap();
    let fence = Fence { key: OWNER.to_vec(), mod_revision: rev, owner: None };
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
    read_durable(store, &LogKeys::new("test", 0)).await.unwrap()
}

/// Waits (bounded) until the store has seen `n` transactions.
async fn until_txns(store: &Store, n: u64) {
    for _ in 0..5000 {
        if store.txns() >= n {
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
    store.set_txn_fault(TxnFault::Hold);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    for i in 2..=4 {
        w.append(rec(i)).unwrap();
    }
    assert_eq!(w.durable(), 0);
    store.set_txn_fault(TxnFault::None);
    store.release_txns(1);
    w.wait(4).await.unwrap();
    let sizes: Vec<(u64, usize)> = batches(&store).await.iter().map(|b| (b.first_seq, b.records.len())).collect();
    assert_eq!(sizes, vec![(1, 1), (2, 3)]);
}

/// A waker that counts its wakes.
#[derive(Default)]
struct Wakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Wakes {
    fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Polls `f` once with `wakes`' waker.
fn poll_with<F: std::future::Future + Unpin>(f: &mut F, wakes: &Arc<Wakes>) -> std::task::Poll<F::Output> {
    let waker = std::task::Waker::from(wakes.clone());
    std::pin::Pin::new(f).poll(&mut std::task::Context::from_waker(&waker))
}

#[tokio::test]
async fn a_commit_wakes_the_waiters_of_its_records_and_no_others() {
    let (store, w, _) = setup(cfg()).await;
    store.set_txn_fault(TxnFault::Hold);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    // Record 2 waits for the next batch while the first is in flight.
    w.append(rec(2)).unwrap();
    let (first, second, end) = (Arc::new(Wakes::default()), Arc::new(Wakes::default()), Arc::new(Wakes::default()));
    let mut wait_first = Box::pin(w.wait(1));
    let mut wait_second = Box::pin(w.wait(2));
    let mut ended = Box::pin(w.ended());
    assert!(poll_with(&mut wait_first, &first).is_pending());
    assert!(poll_with(&mut wait_second, &second).is_pending());
    assert!(poll_with(&mut ended, &end).is_pending());
    // The first batch commits; the second is sent (and held) after its waiters were told.
    store.release_txns(1);
    until_txns(&store, 2).await;
    assert_eq!(first.count(), 1, "the waiter of the committed record is woken once");
    assert_eq!(poll_with(&mut wait_first, &first), std::task::Poll::Ready(Ok(())));
    assert_eq!((second.count(), end.count()), (0, 0), "a commit wakes neither a later record's waiter nor the end's");
    assert!(poll_with(&mut wait_second, &second).is_pending());
    store.set_txn_fault(TxnFault::None);
    store.release_txns(1);
    for _ in 0..5000 {
        if second.count() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(second.count(), 1);
    assert_eq!(poll_with(&mut wait_second, &second), std::task::Poll::Ready(Ok(())));
    assert_eq!(end.count(), 0);
    // The end wakes what still waits, with the reason.
    let mut wait_never = Box::pin(w.wait(3));
    let never = Arc::new(Wakes::default());
    assert!(poll_with(&mut wait_never, &never).is_pending());
    w.close();
    assert_eq!((never.count(), end.count()), (1, 1));
    assert_eq!(poll_with(&mut wait_never, &never), std::task::Poll::Ready(Err(LogError::Closed)));
    assert_eq!(poll_with(&mut ended, &end), std::task::Poll::Ready(LogError::Closed));
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
    // A second writer, opened under the record as another master changed it, commits first:
    // this writer's transaction fails, and the read-back finds the other's batch at its place.
    let rev = store.put(OWNER, b"primary: b", None).await.unwrap();
    let newer = Fence { mod_revision: rev, ..fence };
    let other = OpLogWriter::open(store.clone(), LogKeys::new("test", 0), newer, 0, 2, cfg()).await.unwrap();
    other.wait(other.append(rec(100)).unwrap()).await.unwrap();
    let s = w.append(rec(2)).unwrap();
    let err = w.wait(s).await.unwrap_err();
    assert!(matches!(&err, LogError::Fenced(why) if why.contains("another writer")), "{err:?}");
    let all: Vec<Record> = batches(&store).await.into_iter().flat_map(|b| b.records).collect();
    assert_eq!(all, vec![rec(1), rec(100)], "one history, no record of the fenced writer after it");
}

#[tokio::test]
async fn an_unknown_outcome_is_read_back_not_repeated_or_skipped() {
    let (store, w, _) = setup(cfg()).await;
    // Committed, but the answer was lost: read back as committed, not written twice.
    store.set_txn_fault(TxnFault::ApplyThenLose);
    w.wait(w.append(rec(1)).unwrap()).await.unwrap();
    // Lost before it ran: sent again under the same sequence numbers.
    store.set_txn_fault(TxnFault::Lose);
    let s = w.append(rec(2)).unwrap();
    assert_eq!(s, 2);
    w.wait(s).await.unwrap();
    let log = batches(&store).await;
    assert_eq!(
        log.iter().map(|b| (b.first_seq, b.records.clone())).collect::<Vec<_>>(),
        vec![(1, vec![rec(1)]), (2, vec![rec(2)])]
    );
    assert_eq!(store.txns(), 3, "the lost request was sent once more");
    assert_eq!(durable_prefix(&store).await, 2);
}

#[tokio::test]
async fn a_transaction_that_lands_after_it_was_read_back_as_lost_is_not_a_fence() {
    let (store, w, _) = setup(cfg()).await;
    // The first attempt goes unanswered and the read-back finds nothing, so the batch is sent
    // again; the first attempt lands just before the second, which writes the same bytes again.
    store.set_txn_fault(TxnFault::LoseThenApplyLate);
    let s = w.append(rec(1)).unwrap();
    w.wait(s).await.unwrap();
    assert_eq!(store.txns(), 2);
    // The log goes on: the next batch follows.
    w.wait(w.append(rec(2)).unwrap()).await.unwrap();
    let log = batches(&store).await;
    assert_eq!(
        log.iter().map(|b| (b.first_seq, b.records.clone())).collect::<Vec<_>>(),
        vec![(1, vec![rec(1)]), (2, vec![rec(2)])]
    );
    assert_eq!(durable_prefix(&store).await, 2);
}

#[tokio::test]
async fn a_full_queue_is_busy_and_a_reopened_log_continues_its_numbering() {
    let (store, w, fence) = setup(WriterConfig { max_queued_records: 3, ..cfg() }).await;
    store.set_txn_fault(TxnFault::Hold);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    for i in 2..=4 {
        w.append(rec(i)).unwrap();
    }
    let busy = w.append(rec(5)).unwrap_err();
    assert_eq!(busy, LogError::Busy);
    assert!(busy.code().retry_class() == tycho_proto::RetryClass::RetrySame, "busy is retryable");
    store.set_txn_fault(TxnFault::None);
    store.release_txns(1);
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

#[tokio::test]
async fn finishing_commits_what_waits_and_then_takes_nothing() {
    let (store, w, _) = setup(cfg()).await;
    store.set_txn_fault(TxnFault::Hold);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    w.append(rec(2)).unwrap();
    w.append(rec(3)).unwrap();
    tokio::join!(w.finish(Duration::from_secs(10)), async {
        store.set_txn_fault(TxnFault::None);
        store.release_txns(1);
    });
    w.wait(3).await.unwrap();
    assert_eq!(durable_prefix(&store).await, 3);
    assert_eq!(w.append(rec(4)).unwrap_err(), LogError::Closed);
}

#[tokio::test]
async fn closing_mid_commit_leaves_the_batch_in_flight_unknown_and_the_rest_not_owned() {
    let (store, w, _) = setup(cfg()).await;
    store.set_txn_fault(TxnFault::Hold);
    w.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    w.append(rec(2)).unwrap();
    w.close();
    // Record 1 was sent and may land: its writer must not be told to go elsewhere and resend.
    let unknown = w.wait(1).await.unwrap_err();
    assert_eq!(unknown, LogError::Interrupted);
    assert_eq!(unknown.code().retry_class(), tycho_proto::RetryClass::Fail);
    // Record 2 never left this master: the next owner is the place to ask.
    let never_sent = w.wait(2).await.unwrap_err();
    assert_eq!(never_sent.code(), tycho_proto::ErrorCode::KVPT_NOT_OWNED);
}

// ---- the follower (a standby's reader) -----------------------------------------------------

use tycho_master::oplog::{FollowError, LogFollower};

/// Applies into a list, so that a test sees what was applied and in which order.
fn collect(into: &mut Vec<(u64, Record)>) -> impl FnMut(u64, &Record) -> Result<(), tycho_master::ReplayError> + '_ {
    move |seq, r| {
        into.push((seq, r.clone()));
        Ok(())
    }
}

async fn written(n: u64) -> (Arc<Store>, OpLogWriter) {
    let (store, w, _) = setup(cfg()).await;
    for i in 1..=n {
        w.append(rec(i)).unwrap();
    }
    w.wait(n).await.unwrap();
    (store, w)
}

#[tokio::test]
async fn a_follower_applies_every_record_in_order_across_pages() {
    let (store, w) = written(10).await;
    // One batch per page: a full page continues on the next one.
    let mut f = LogFollower::new(store.clone(), LogKeys::new("test", 0), 0, 0, 1);
    let mut got = Vec::new();
    assert_eq!(f.catch_up(&mut collect(&mut got)).await.unwrap(), 10);
    assert_eq!(got, (1..=10).map(|i| (i, rec(i))).collect::<Vec<_>>());
    // Nothing new: nothing applied twice.
    f.catch_up(&mut collect(&mut got)).await.unwrap();
    assert_eq!(got.len(), 10);
    // It resumes where it stopped.
    for i in 11..=13 {
        w.append(rec(i)).unwrap();
    }
    w.wait(13).await.unwrap();
    f.catch_up(&mut collect(&mut got)).await.unwrap();
    assert_eq!(got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (1..=13).collect::<Vec<_>>());
    // A follower that starts from a position reads only what follows it.
    let mut later = LogFollower::new(store.clone(), LogKeys::new("test", 0), 0, 8, 100);
    let mut tail = Vec::new();
    later.catch_up(&mut collect(&mut tail)).await.unwrap();
    assert_eq!(tail.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (9..=13).collect::<Vec<_>>());
    // From any position, inside a batch too (a snapshot need not end where a batch does),
    // with pages of one batch or of many.
    let boundaries: Vec<u64> = batches(&store).await.iter().map(|b| b.first_seq).collect();
    assert!(boundaries.len() < 13, "some batch holds several records: {boundaries:?}");
    for page in [1, 100] {
        for from in 0..13 {
            let mut f = LogFollower::new(store.clone(), LogKeys::new("test", 0), 0, from, page);
            let mut tail = Vec::new();
            assert_eq!(f.catch_up(&mut collect(&mut tail)).await.unwrap(), 13);
            assert_eq!(tail, (from + 1..=13).map(|i| (i, rec(i))).collect::<Vec<_>>(), "from {from}, page {page}");
        }
    }
}

#[tokio::test]
async fn gaps_and_damage_fail_closed() {
    let keys = LogKeys::new("test", 0);
    // A missing batch inside the log.
    let (store, _w) = written(10).await;
    let second = batches(&store).await[1].first_seq;
    store.delete(&keys.batch(second)).await.unwrap();
    let mut f = LogFollower::new(store.clone(), keys.clone(), 0, 0, 100);
    let mut got = Vec::new();
    let gap = f.catch_up(&mut collect(&mut got)).await;
    assert!(matches!(gap, Err(FollowError::Gap { expected, .. }) if expected == second), "{gap:?}");
    assert_eq!(f.applied(), second - 1, "it applied what came before the gap and nothing after");
    assert_eq!(got.len() as u64, second - 1);

    // A damaged batch, and a record that does not apply.
    let (store, _w) = written(6).await;
    let first = batches(&store).await[0].clone();
    let mut bad = first.encode();
    let at = bad.len() - 3;
    bad[at] ^= 1;
    store.put(&keys.batch(1), &bad, None).await.unwrap();
    let mut f = LogFollower::new(store.clone(), keys.clone(), 0, 0, 100);
    assert!(matches!(f.catch_up(&mut collect(&mut Vec::new())).await, Err(FollowError::Corrupt(_))));
    assert_eq!(f.applied(), 0);
    store.put(&keys.batch(1), &first.encode(), None).await.unwrap();
    let mut refuse = |seq: u64, _: &Record| {
        if seq == 3 {
            Err(tycho_master::ReplayError::NoSuchObject("test"))
        } else {
            Ok(())
        }
    };
    assert!(matches!(f.catch_up(&mut refuse).await, Err(FollowError::Diverged { seq: 3, .. })));

    // Another group's batch under this log's keys.
    let (store, _w) = written(2).await;
    let mut stray = batches(&store).await[0].clone();
    stray.group = 1;
    store.put(&keys.batch(1), &stray.encode(), None).await.unwrap();
    let mut f = LogFollower::new(store.clone(), keys.clone(), 0, 0, 100);
    assert!(matches!(f.catch_up(&mut collect(&mut Vec::new())).await, Err(FollowError::Corrupt(_))));
}

#[tokio::test]
async fn the_log_ends_where_its_last_batch_ends() {
    let keys = LogKeys::new("test", 0);
    let store = MemStore::new();
    assert_eq!(read_durable(&store, &keys).await.unwrap(), 0, "an empty log");
    // Batches of uneven sizes, the early ones deleted as compaction does, and numbers far
    // apart: every probe sequence of the search is walked.
    let mut sizes = vec![1u64, 3, 1, 7, 2, 1, 1, 5];
    sizes.extend((0..300).map(|i| 1 + i % 4));
    let mut first = 1u64;
    let mut ends = Vec::new();
    for n in sizes {
        let records = (first..first + n).map(rec).collect();
        let batch = RecordBatch { group: 0, epoch: 1, first_seq: first, records };
        store.put(&keys.batch(first), &batch.encode(), None).await.unwrap();
        first += n;
        ends.push((batch.first_seq, first - 1));
    }
    assert_eq!(read_durable(&store, &keys).await.unwrap(), first - 1);
    // Compaction keeps the last batch, so the end stays readable however much goes below it;
    // and with one batch left, it is that batch's end.
    for &(f, _) in &ends[..ends.len() - 1] {
        store.delete(&keys.batch(f)).await.unwrap();
        assert_eq!(read_durable(&store, &keys).await.unwrap(), first - 1, "after deleting {f}");
    }
    // A log that starts far out (restored from a snapshot long ago).
    let store = MemStore::new();
    for f in [1_000_000_007u64, 1_000_000_009, 1_000_001_000] {
        let batch = RecordBatch { group: 0, epoch: 1, first_seq: f, records: vec![rec(f), rec(f + 1)] };
        store.put(&keys.batch(f), &batch.encode(), None).await.unwrap();
    }
    assert_eq!(read_durable(&store, &keys).await.unwrap(), 1_000_001_001);
    // A batch under the wrong key is refused, not trusted.
    let moved = RecordBatch { group: 0, epoch: 1, first_seq: 5, records: vec![rec(5)] };
    store.put(&keys.batch(2_000_000_000), &moved.encode(), None).await.unwrap();
    assert!(matches!(read_durable(&store, &keys).await, Err(LogError::Corrupt(_))));
}

#[tokio::test]
async fn a_writer_marks_the_log_with_a_layout_that_earlier_builds_refuse() {
    let (store, w, _) = setup(cfg()).await;
    w.wait(w.append(rec(1)).unwrap()).await.unwrap();
    let kv = store.get(&LogKeys::new("test", 0).layout()).await.unwrap().kv.expect("the layout record");
    assert_eq!(kv.value, tycho_master::oplog::log_layout());
    // What a build of layout 1 did with the key: open it as its durable prefix, at most at
    // version 1.
    let old = tycho_proto::envelope::open(tycho_proto::envelope::RecordKind::LogPrefix, 1, &kv.value);
    assert!(
        matches!(old, Err(tycho_proto::envelope::EnvelopeError::UnknownVersion { found: 2, newest: 1 })),
        "{old:?}"
    );
}

#[tokio::test]
async fn a_log_of_layout_1_is_continued_where_its_batches_end() {
    // A log as layout 1 left it: batches, and the durable prefix (record 5) beside them.
    let store = Arc::new(FaultyStore::new(Arc::new(MemStore::new())));
    let keys = LogKeys::new("test", 0);
    for (first, n) in [(1u64, 2u64), (3, 3)] {
        let batch =
            RecordBatch { group: 0, epoch: 1, first_seq: first, records: (first..first + n).map(rec).collect() };
        store.put(&keys.batch(first), &batch.encode(), None).await.unwrap();
    }
    let v1 = tycho_proto::envelope::seal(tycho_proto::envelope::RecordKind::LogPrefix, 1, &5u64.to_le_bytes());
    store.put(&keys.layout(), &v1, None).await.unwrap();
    // A primary of layout 2 takes it over (a new record revision, the next epoch).
    let rev = store.put(OWNER, b"primary: b", None).await.unwrap();
    let fence = Fence { key: OWNER.to_vec(), mod_revision: rev, owner: None };
    let w = OpLogWriter::open(store.clone(), keys.clone(), fence, 0, 2, cfg()).await.unwrap();
    assert_eq!(w.durable(), 5, "numbering goes on after the last batch");
    assert_eq!(w.append(rec(6)).unwrap(), 6);
    w.wait(6).await.unwrap();
    let layout = store.get(&keys.layout()).await.unwrap().kv.unwrap();
    assert_eq!(layout.value, tycho_master::oplog::log_layout(), "the prefix gave way to the layout record");
    // A standby reads the whole log, old batches and new, as one.
    let mut f = LogFollower::new(store.clone(), keys, 0, 0, 100);
    let mut got = Vec::new();
    assert_eq!(f.catch_up(&mut collect(&mut got)).await.unwrap(), 6);
    assert_eq!(got, (1..=6).map(|i| (i, rec(i))).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_follower_tails_the_log_as_it_grows() {
    let (store, w) = written(3).await;
    let mut f = LogFollower::new(store.clone(), LogKeys::new("test", 0), 0, 0, 100);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let follower = tokio::spawn(async move {
        let mut apply = |seq: u64, _: &Record| {
            let _ = tx.send(seq);
            Ok(())
        };
        let r = f
            .follow(&mut apply, async {
                let _ = stop_rx.await;
            })
            .await;
        (r, f.applied())
    });
    for i in 4..=20 {
        w.append(rec(i)).unwrap();
    }
    w.wait(20).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 20 {
        let seq =
            tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("the follower keeps up").unwrap();
        seen.push(seq);
    }
    assert_eq!(seen, (1..=20).collect::<Vec<_>>());
    stop_tx.send(()).unwrap();
    let (r, applied) = follower.await.unwrap();
    assert_eq!((r, applied), (Ok(()), 20));
}

/// Segment, offset and generation of each replica.
type Ranges = Vec<(tycho_proto::SegmentId, u64, u32)>;

#[tokio::test]
async fn a_standby_master_follows_a_primary_through_the_log() {
    use tycho_master::{ManualClock, Master, MasterConfig, WriteMode};
    use tycho_proto::*;
    let (store, w, _) = setup(WriterConfig::default()).await;
    let sink = Arc::new(w);
    let primary = Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1_000)));
    assert!(primary.set_record_sink(0, Some(sink.clone())));
    let a = ClientId(7);
    let desc = |id: u128| SegmentDesc {
        id: SegmentId(id),
        name: format!("s{id}"),
        base: 0,
        size: 1 << 24,
        endpoint: format!("10.0.0.{id}:1"),
        host: "h".into(),
        incarnation: 1,
    };
    primary.mount_segment(a, desc(1)).unwrap();
    primary.mount_segment(a, desc(2)).unwrap();
    let kref = |k: &str| KeyRef { key: k.into(), route: tycho_routing::route_for("", k, 1) };
    for i in 0..50u64 {
        let key = kref(&format!("obj-{i}"));
        let start = WriteStart {
            client: a,
            tenant: String::new(),
            key: key.clone(),
            size: 1000 + i,
            config: ReplicateConfig { replica_num: 1 + (i % 2) as u32, ..Default::default() },
            write_id: i + 1,
        };
        primary.write_start(WriteMode::Put, &start).unwrap();
        let finish = WriteFinish { client: a, tenant: String::new(), key, write_id: i + 1 };
        primary.write_finish(&finish, i % 10 != 3).unwrap();
    }
    for i in (0..50).step_by(7) {
        let _ = primary.remove(&RemoveKey { tenant: String::new(), key: kref(&format!("obj-{i}")), force: true });
    }
    let last = sink.append(Record::Unmount { segment: SegmentId(99) }).unwrap();
    sink.wait(last).await.unwrap();

    let standby = Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1_000)));
    let mut f = LogFollower::new(store.clone(), LogKeys::new("test", 0), 0, 0, 16);
    let group = standby.group(0).unwrap();
    f.catch_up(&mut |seq, r| {
        standby.replay(0, r)?;
        group.note_applied(seq);
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!((f.applied(), group.applied()), (last, last));
    let view = |m: &Master| {
        let mut keys: Vec<(String, u64, Ranges)> = m
            .list_keys(Some(""), None, u32::MAX)
            .unwrap()
            .into_iter()
            .map(|k| {
                let q = KeyQuery { tenant: String::new(), key: kref(&k.key) };
                let ranges =
                    m.get_replica_list(&q).unwrap().replicas.iter().map(|r| (r.segment, r.offset, r.gen)).collect();
                (k.key, k.size, ranges)
            })
            .collect();
        keys.sort();
        let used: Vec<u64> = m.list_segments().iter().map(|s| s.used).collect();
        (keys, used)
    };
    let (objects, used) = view(&primary);
    assert_eq!(objects.len(), 37, "45 committed (5 revoked), 8 removed");
    assert_eq!(view(&standby), (objects, used));
}

#[tokio::test]
async fn the_master_answers_a_mutation_only_once_its_record_is_durable() {
    use tycho_master::{ManualClock, Master, MasterConfig, MasterRpc, RpcMetrics, WriteMode};
    use tycho_proto::auth::handshake::Peer;
    use tycho_proto::*;
    use tycho_rpc::{Reply, Service};

    let (store, w, _) = setup(cfg()).await;
    let log = Arc::new(w);
    let master = Arc::new(Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1_000))));
    assert!(master.set_record_sink(0, Some(log.clone())));
    let rpc = MasterRpc::new(master.clone(), Arc::new(RpcMetrics::default()));
    let admin = Peer { authenticated: true, client: None, admin: true };
    let a = ClientId(7);
    let desc = SegmentDesc {
        id: SegmentId(1),
        name: "s".into(),
        base: 0,
        size: 1 << 24,
        endpoint: "10.0.0.1:1".into(),
        host: "h".into(),
        incarnation: 1,
    };
    master.mount_segment(a, desc).unwrap();
    let key = |k: &str| KeyRef { key: k.into(), route: tycho_routing::route_for("", k, 1) };
    let start = |k: &str, id: u64| WriteStart {
        client: a,
        tenant: String::new(),
        key: key(k),
        size: 4096,
        config: ReplicateConfig::default(),
        write_id: id,
    };
    master.write_start(WriteMode::Put, &start("k1", 1)).unwrap();
    master.write_start(WriteMode::Put, &start("k2", 2)).unwrap();
    log.wait(Master::take_logged().last()).await.unwrap();

    // The commit's record cannot become durable while the store holds the transaction: no
    // answer until it does.
    let txns = store.txns();
    store.set_txn_fault(TxnFault::Hold);
    let end =
        |k: &str, id: u64| Request::PutEnd(WriteFinish { client: a, tenant: String::new(), key: key(k), write_id: id });
    let Reply::Later(answer) = rpc.call(end("k1", 1), &admin) else { panic!("a logged mutation was answered at once") };
    let mut answer = tokio::spawn(answer);
    until_txns(&store, txns + 1).await;
    assert!(tokio::time::timeout(Duration::from_millis(20), &mut answer).await.is_err(), "answered before durable");
    // A retried end of the same write finds it committed already: it waits for the record too.
    let Reply::Later(retry) = rpc.call(end("k1", 1), &admin) else {
        panic!("a retried commit was answered before its record was durable")
    };
    let mut retry = tokio::spawn(retry);
    assert!(tokio::time::timeout(Duration::from_millis(20), &mut retry).await.is_err(), "retry answered early");
    // A retried start of a write whose start is not durable yet waits for it too.
    let put_start = Request::PutStart(start("k3", 3));
    let Reply::Later(first) = rpc.call(put_start.clone(), &admin) else { panic!("a start was answered at once") };
    let Reply::Later(again) = rpc.call(put_start, &admin) else {
        panic!("a retried start was answered before its record was durable")
    };
    let (first, mut again) = (tokio::spawn(first), tokio::spawn(again));
    assert!(tokio::time::timeout(Duration::from_millis(20), &mut again).await.is_err(), "retried start answered early");
    store.set_txn_fault(TxnFault::None);
    store.release_txns(2);
    assert!(matches!(answer.await.unwrap(), Response::Committed(_)));
    assert!(matches!(retry.await.unwrap(), Response::Committed(_)));
    let (a, b) = (first.await.unwrap(), (&mut again).await.unwrap());
    assert!(matches!((&a, &b), (Response::WriteStarted(x), Response::WriteStarted(y)) if x == y), "{a:?} {b:?}");

    // Reads log nothing and are answered at once.
    let read = Request::ExistKey(KeyQuery { tenant: String::new(), key: key("k1") });
    assert!(matches!(rpc.call(read, &admin), Reply::Ready(Response::Exists(true))));

    // Once the group moved, a commit is applied here but never durable: it is refused.
    store.put(OWNER, b"primary: b", None).await.unwrap();
    let Reply::Later(answer) = rpc.call(end("k2", 2), &admin) else { panic!("a logged mutation was answered at once") };
    match answer.await {
        Response::Error(code) => assert_eq!(code, ErrorCode::KVPT_NOT_OWNED),
        other => panic!("a commit that cannot be durable was answered {other:?}"),
    }
}

#[tokio::test]
async fn a_full_log_turns_mutations_away_before_deciding_them() {
    use tycho_master::{ManualClock, Master, MasterConfig, MasterRpc, RpcMetrics};
    use tycho_proto::auth::handshake::Peer;
    use tycho_proto::*;
    use tycho_rpc::{Reply, Service};

    let (store, w, _) = setup(WriterConfig { max_queued_records: 2, ..cfg() }).await;
    let log = Arc::new(w);
    let master = Arc::new(Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1_000))));
    assert!(master.set_record_sink(0, Some(log.clone())));
    let rpc = MasterRpc::new(master.clone(), Arc::new(RpcMetrics::default()));
    let admin = Peer { authenticated: true, client: None, admin: true };
    // Fill the queue behind a held transaction.
    store.set_txn_fault(TxnFault::Hold);
    log.append(rec(1)).unwrap();
    until_txns(&store, 1).await;
    for i in 2..=3 {
        log.append(rec(i)).unwrap();
    }
    assert_eq!(log.admit(), Err(LogError::Busy));
    let remove = Request::Remove(RemoveKey {
        tenant: String::new(),
        key: KeyRef { key: "k".into(), route: tycho_routing::route_for("", "k", 1) },
        force: true,
    });
    match rpc.call(remove, &admin) {
        Reply::Ready(Response::Error(code)) => {
            assert_eq!(code, ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS);
            assert_eq!(code.retry_class(), RetryClass::RetrySame);
        }
        _ => panic!("a mutation was admitted into a full log"),
    }
    assert!(Master::take_logged().is_empty(), "nothing was decided or logged");
    // Reads are not turned away.
    let read = Request::ExistKey(KeyQuery {
        tenant: String::new(),
        key: KeyRef { key: "k".into(), route: tycho_routing::route_for("", "k", 1) },
    });
    assert!(matches!(rpc.call(read, &admin), Reply::Ready(Response::Exists(false))));
    store.set_txn_fault(TxnFault::None);
    store.release_txns(1);
    log.wait(3).await.unwrap();
    assert_eq!(log.admit(), Ok(()));
}

/// Every record of group `rank`'s log, in order.
async fn log_of(store: &Store, rank: u32) -> Vec<Record> {
    let keys = LogKeys::new("test", rank);
    let page = store.range(RangeRequest::prefix(keys.batches(), 1000)).await.unwrap();
    page.kvs.iter().flat_map(|kv| RecordBatch::decode(&kv.value).unwrap().records).collect()
}

/// Three groups' writers on one combiner: what they append while a transaction is in flight
/// goes out as one transaction; a group whose record changed is fenced alone.
#[tokio::test]
async fn a_combiner_sends_several_groups_batches_in_one_transaction_and_fences_each_alone() {
    use tycho_master::oplog::TxnCombiner;
    use tycho_master::ownership::{GroupRecord, GroupState};
    const OWNER_1: &[u8] = b"/tycho/test/kvpt_groups/00001";
    const OWNER_2: &[u8] = b"/tycho/test/kvpt_groups/00002";
    let store = Arc::new(FaultyStore::new(Arc::new(MemStore::new())));
    let combiner = TxnCombiner::start(store.clone());
    let shared = WriterConfig { combiner: Some(combiner.clone()), ..cfg() };
    let mut writers = Vec::new();
    let record = |rank, primary: &str| GroupRecord {
        rank,
        primary: primary.into(),
        standbys: Vec::new(),
        state: GroupState::Stable,
        migrating_to: None,
        epoch: 1,
        caretaken: false,
    };
    for (rank, owner) in [(0u32, OWNER), (1, OWNER_1), (2, OWNER_2)] {
        let rev = store.put(owner, &record(rank, "a").encode(), None).await.unwrap();
        // (Writers that share transactions name their owner: another group's failure is then
        // told apart from a change of their own record.)
        let fence = Fence { key: owner.to_vec(), mod_revision: rev, owner: Some(("a".into(), 1)) };
        let keys = LogKeys::new("test", rank);
        writers.push(OpLogWriter::open(store.clone(), keys, fence, rank, 1, shared.clone()).await.unwrap());
    }
    let before = store.txns();
    // Group 0's batch is held in the store; meanwhile groups 1 and 2 append.
    store.set_txn_fault(TxnFault::Hold);
    writers[0].append(rec(1)).unwrap();
    until_txns(&store, before + 1).await;
    writers[1].append(rec(2)).unwrap();
    writers[2].append(rec(3)).unwrap();
    // Both wait while the held transaction is in flight: nothing else was sent.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(store.txns() - before, 1);
    store.set_txn_fault(TxnFault::None);
    store.release_txns(1);
    for w in &writers {
        w.wait(1).await.unwrap();
    }
    assert_eq!(store.txns() - before, 2, "three groups' batches in two transactions");
    assert_eq!(log_of(&store, 0).await, vec![rec(1)]);
    assert_eq!(log_of(&store, 1).await, vec![rec(2)]);
    assert_eq!(log_of(&store, 2).await, vec![rec(3)]);

    // Group 1 moves to another master: its next commit, sent with group 0's, makes the merged
    // transaction fail; group 0 finds its own record and prefix unchanged and commits again,
    // group 1 is fenced.
    store.put(OWNER_1, &GroupRecord { epoch: 2, ..record(1, "b") }.encode(), None).await.unwrap();
    let s0 = writers[0].append(rec(4)).unwrap();
    let s1 = writers[1].append(rec(5)).unwrap();
    writers[0].wait(s0).await.unwrap();
    assert!(matches!(writers[1].wait(s1).await, Err(LogError::Fenced(_))));
    assert_eq!(log_of(&store, 0).await, vec![rec(1), rec(4)]);
    assert_eq!(log_of(&store, 1).await, vec![rec(2)], "nothing of the fenced group was committed");
}
