//! A KVPT group's OpLog on the coordination store: one ordered group-commit writer.
//!
//! The primary appends each record as it applies it ([`OpLogWriter::append`], which never
//! blocks and is called under shard locks) and acknowledges the mutation only once its record is
//! durable ([`OpLogWriter::wait`]). One task (the writer's own, or the [`TxnCombiner`] of every
//! group a master writes) commits the queued records in batches, bounded by count and bytes
//! (under etcd's request limit), one transaction per batch (a combiner's carries a batch of
//! each group that has one, within the store's limits):
//!
//! ```text
//! if   mod_revision(kvpt_groups/{rank}) == the revision this master became primary at
//! then put oplog/{rank}/b/{first_seq:020} = sealed RecordBatch
//! ```
//!
//! The log's durable prefix is where its last batch ends: there is no other record of it, so a
//! group costs its transaction one compare and one put. A writer finds the end when it opens
//! ([`read_durable`]); a follower reads on from where it stands and watches the batch keys.
//! `oplog/{rank}/durable`, where earlier builds kept the prefix, holds the layout version
//! instead ([`log_layout`]), written by every writer as it opens: a build that kept the prefix
//! there refuses to follow or write the log rather than misread it.
//!
//! A transaction that fails its compares, or whose outcome is unknown (the store did not
//! answer), is resolved by reading the batch's key back: it holds the batch (an attempt landed
//! after all), it is absent (not committed: the same batch is sent again under the same
//! sequence numbers, so the log has no gap), or it holds another (fenced). With the key absent,
//! a failed compare means the ownership record changed: if it still names this primary at this
//! epoch (only its standbys changed) the fence is renewed, else the writer is fenced for good:
//! every waiting and later mutation fails with KVPT_NOT_OWNED, and the master must stop serving
//! the group. Records appended while a batch is in flight form the next batch.
//!
//! Those decisions are made without I/O by [`crate::log::commit::BatchCommit`]; the commit task
//! only carries its messages to the store and back.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;
use tycho_meta::{MetaError, MetaResult, MetaStore, RangeRequest, Txn, TxnResponse};
use tycho_proto::ErrorCode;

use crate::log::commit::{BatchCommit, Io, Reply};
pub use crate::log::fence::Fence;
pub use crate::log::layout::{log_layout, LogError, LogKeys};
use crate::log::record::{Record, RecordBatch, MAX_BATCH_RECORDS};

/// Figures of one group's log on this master, for `/metrics`: what a primary appended and
/// committed and how its commits went, and how far a standby is behind the log.
#[derive(Debug, Default)]
pub struct LogStats {
    /// Primary: the last record number appended.
    appended: AtomicU64,
    /// Primary: the last record committed. Standby: the durable prefix it last read.
    durable: AtomicU64,
    /// Standby: the last record applied.
    applied: AtomicU64,
    /// Standby: Unix ms since when it has been behind the durable prefix (0: caught up).
    behind_since_ms: AtomicU64,
    batches: AtomicU64,
    batch_records: AtomicU64,
    commit: crate::histogram::LatencyHistogram,
    fenced: AtomicU64,
    /// The log position of the last snapshot this master published (0: none).
    snapshot_applied: AtomicU64,
    /// When it published it (Unix ms; 0: never).
    snapshot_at_ms: AtomicU64,
    /// Times this master dropped its replayed state and started over from a snapshot.
    rebootstraps: AtomicU64,
}

/// A snapshot of [`LogStats`].
#[derive(Debug, Clone, Default)]
pub struct LogFigures {
    /// The last record appended (primary).
    pub appended: u64,
    /// The last record known durable.
    pub durable: u64,
    /// The last record applied (standby).
    pub applied: u64,
    /// Records appended but not yet durable (primary).
    pub queued_records: u64,
    /// Records durable but not yet applied (standby).
    pub lag_records: u64,
    /// How long the standby has been behind the durable prefix (0 when caught up).
    pub lag_seconds: f64,
    /// Batches committed.
    pub batches: u64,
    /// Records in those batches.
    pub batch_records: u64,
    /// Sum of commit latencies, seconds.
    pub commit_seconds: f64,
    /// Cumulative commit counts per bucket of [`crate::histogram::LATENCY_BUCKETS`].
    pub commit_cumulative: Vec<u64>,
    /// Times a writer of this group was fenced.
    pub fenced: u64,
    /// The log position of the last snapshot this master published (0: none).
    pub snapshot_applied: u64,
    /// Seconds since it published it (`None`: never).
    pub snapshot_age_seconds: Option<f64>,
    /// Times this master started over from a snapshot.
    pub rebootstraps: u64,
}

impl LogStats {
    fn appended(&self, seq: u64) {
        self.appended.fetch_max(seq, Ordering::Relaxed);
    }

    fn committed(&self, last: u64, records: usize, took: Duration) {
        // A primary has applied what it commits.
        self.durable.fetch_max(last, Ordering::Relaxed);
        self.applied.fetch_max(last, Ordering::Relaxed);
        self.behind_since_ms.store(0, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.batch_records.fetch_add(records as u64, Ordering::Relaxed);
        self.commit.record(took);
    }

    /// A standby learnt of the durable prefix `durable` (from the store or a watch event)
    /// having applied up to `applied`. It counts as behind until it applied the highest
    /// prefix it learnt of.
    fn seen(&self, durable: u64, applied: u64) {
        let durable = self.durable.fetch_max(durable, Ordering::Relaxed).max(durable);
        self.applied.store(applied, Ordering::Relaxed);
        if durable <= applied {
            self.behind_since_ms.store(0, Ordering::Relaxed);
        } else if self.behind_since_ms.load(Ordering::Relaxed) == 0 {
            self.behind_since_ms.store(tycho_proto::auth::capability::unix_ms().max(1), Ordering::Relaxed);
        }
    }

    /// This master published a snapshot at `applied`, at `at_ms` (Unix ms).
    pub fn note_snapshot(&self, applied: u64, at_ms: u64) {
        self.snapshot_applied.fetch_max(applied, Ordering::Relaxed);
        self.snapshot_at_ms.store(at_ms.max(1), Ordering::Relaxed);
    }

    /// This master dropped its replayed state to start over from a snapshot.
    pub fn note_rebootstrap(&self) {
        self.rebootstraps.fetch_add(1, Ordering::Relaxed);
    }

    /// The figures now.
    pub fn figures(&self) -> LogFigures {
        let appended = self.appended.load(Ordering::Relaxed);
        let durable = self.durable.load(Ordering::Relaxed);
        let applied = self.applied.load(Ordering::Relaxed);
        let since = self.behind_since_ms.load(Ordering::Relaxed);
        LogFigures {
            appended,
            durable,
            applied,
            queued_records: appended.saturating_sub(durable),
            lag_records: durable.saturating_sub(applied),
            lag_seconds: match since {
                0 => 0.0,
                t => tycho_proto::auth::capability::unix_ms().saturating_sub(t) as f64 / 1e3,
            },
            batches: self.batches.load(Ordering::Relaxed),
            batch_records: self.batch_records.load(Ordering::Relaxed),
            commit_seconds: self.commit.sum_seconds(),
            commit_cumulative: self.commit.cumulative(),
            fenced: self.fenced.load(Ordering::Relaxed),
            snapshot_applied: self.snapshot_applied.load(Ordering::Relaxed),
            snapshot_age_seconds: match self.snapshot_at_ms.load(Ordering::Relaxed) {
                0 => None,
                t => Some(tycho_proto::auth::capability::unix_ms().saturating_sub(t) as f64 / 1e3),
            },
            rebootstraps: self.rebootstraps.load(Ordering::Relaxed),
        }
    }
}

/// The sequence number of the last committed record of the log of `keys` (0: an empty log),
/// found from its batch keys alone. Each probe asks for the first batch key at or after a
/// position (one key, no value): galloping up from the log's first batch, then halving, about
/// twice the logarithm of the batch count in requests; the last batch is then read for where
/// it ends. The store is asked again while it does not answer. Meant for a writer that opens
/// (no other may append then): under a live writer the answer may be behind.
pub async fn read_durable(store: &dyn MetaStore, keys: &LogKeys) -> Result<u64, LogError> {
    let Some(mut lo) = first_batch_from(store, keys, 1).await? else { return Ok(0) };
    let mut step = 1u64;
    // Nothing starts at or after `hi`.
    let mut hi = loop {
        let at = lo.saturating_add(step);
        match first_batch_from(store, keys, at).await? {
            // (At the end of the number space the search stops growing.)
            Some(first) if at < u64::MAX => {
                lo = first;
                step = step.saturating_mul(2);
            }
            _ => break at,
        }
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match first_batch_from(store, keys, mid).await? {
            Some(first) if first < hi => lo = first,
            _ => hi = mid,
        }
    }
    let key = keys.batch(lo);
    let Some(kv) = patiently(OPEN_RETRY, || store.get(&key)).await?.kv else {
        return Err(LogError::Corrupt(format!("the log's last batch, at {lo}, went away while it was read")));
    };
    let batch = RecordBatch::decode(&kv.value).map_err(|e| LogError::Corrupt(format!("the log's last batch: {e}")))?;
    if batch.first_seq != lo {
        return Err(LogError::Corrupt(format!("batch of record {} stored as the batch of {lo}", batch.first_seq)));
    }
    Ok(batch.last_seq())
}

/// How long a writer that opens waits before asking a store that did not answer again.
const OPEN_RETRY: Duration = Duration::from_millis(50);

/// Asks the store until it answers: after `pause` while it is unavailable; any other error is
/// the log's refusal.
async fn patiently<T, F>(pause: Duration, mut ask: impl FnMut() -> F) -> Result<T, LogError>
where
    F: std::future::Future<Output = MetaResult<T>>,
{
    loop {
        match ask().await {
            Ok(answer) => return Ok(answer),
            Err(e) if e.is_unavailable() => tokio::time::sleep(pause).await,
            Err(e) => return Err(LogError::Refused(e.to_string())),
        }
    }
}

/// The first record of the first batch of `keys` that starts at or after `at`, if any.
async fn first_batch_from(store: &dyn MetaStore, keys: &LogKeys, at: u64) -> Result<Option<u64>, LogError> {
    let req =
        RangeRequest { prefix: keys.batches(), start: Some(keys.batch(at)), limit: 1, revision: None, keys_only: true };
    let page = patiently(OPEN_RETRY, || store.range(req.clone())).await?;
    match page.kvs.first() {
        None => Ok(None),
        Some(kv) => keys
            .first_seq_of(&kv.key)
            .map(Some)
            .ok_or_else(|| LogError::Corrupt(format!("batch key {:?}", String::from_utf8_lossy(&kv.key)))),
    }
}

/// Batch and queue bounds.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// Most records in one batch (at most [`MAX_BATCH_RECORDS`]).
    pub max_batch_records: usize,
    /// Most encoded record bytes in one batch (etcd refuses requests above 1.5 MiB).
    pub max_batch_bytes: usize,
    /// Most records waiting to be committed; more are refused as busy.
    pub max_queued_records: usize,
    /// Pause before retrying a transaction whose outcome was unknown.
    pub retry_backoff: Duration,
    /// Where the writer reports its figures (the group's, for `/metrics`).
    pub stats: Arc<LogStats>,
    /// Sends the commit transactions of every group this master writes, several at once
    /// ([`TxnCombiner`]); `None`: each writer sends its own.
    pub combiner: Option<Arc<TxnCombiner>>,
}

impl Default for WriterConfig {
    fn default() -> Self {
        WriterConfig {
            max_batch_records: MAX_BATCH_RECORDS,
            max_batch_bytes: 1 << 20,
            max_queued_records: 64 * 1024,
            retry_backoff: Duration::from_millis(50),
            stats: Arc::default(),
            combiner: None,
        }
    }
}

/// Group commit across groups: one task that commits the logs of every group a master writes,
/// sending their batches together, so that a master of G groups makes about as many
/// transactions, and wakes about as often, as a master of one (each group's writer with its own
/// task would send its own transaction, G times smaller, and the store's per-request cost and
/// the hand-offs between tasks would dominate). Each round takes the next batch of every log
/// that has records waiting (what was appended while the last transaction was in flight) and
/// sends them as one coordination-store transaction, which holds only if every part's compares
/// hold; each part's commit machine ([`crate::log::commit::BatchCommit`]) gets the answer. A part
/// whose compares held, in a transaction that failed because of another part's, reads its
/// prefix and ownership record back, finds both where it left them, and is sent again in the
/// next round; a lost answer is unknown for every part alike, and each finds out from its own
/// prefix. Only writers that settle a failed compare by reading their record back (their
/// fence names the owner) share transactions; two writers of one group (the one a master
/// finishes after giving the group up, and the one of its next term) never go out together; a
/// merged transaction stays within the store's limits, and one the store refuses as a whole is
/// sent again part by part, so that a part's fault stays its own.
pub struct TxnCombiner {
    joins: tokio::sync::mpsc::UnboundedSender<Committer>,
    wake: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for TxnCombiner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxnCombiner").finish_non_exhaustive()
    }
}

impl TxnCombiner {
    /// Starts the combiner's task on the current runtime; it ends once every handle and every
    /// writer on it are gone.
    pub fn start(store: Arc<dyn MetaStore>) -> Arc<TxnCombiner> {
        let (joins, rx) = tokio::sync::mpsc::unbounded_channel();
        let wake = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(drive(store, Some(rx), Vec::new(), wake.clone()));
        Arc::new(TxnCombiner { joins, wake })
    }
}

/// Commits the logs of `writers`, and of those that join later through `joins`, one round at a
/// time (see [`TxnCombiner`]; a writer of its own runs this with itself alone). Wakes on
/// `wake`, which every writer's appends notify.
async fn drive(
    store: Arc<dyn MetaStore>,
    mut joins: Option<tokio::sync::mpsc::UnboundedReceiver<Committer>>,
    mut writers: Vec<Committer>,
    wake: Arc<tokio::sync::Notify>,
) {
    let limits = store.limits();
    let mut turn = 0usize;
    loop {
        if let Some(rx) = joins.as_mut() {
            while let Ok(w) = rx.try_recv() {
                writers.push(w);
            }
        }
        // Every writer to its next transaction: a batch taken, read-backs done, commits noted.
        // (Together: one group's read-back, or its pause while the store does not answer,
        // does not hold up the others'.)
        futures_util::future::join_all(writers.iter_mut().map(Committer::advance)).await;
        writers.retain(|w| !w.gone);
        let ready: Vec<usize> = (0..writers.len()).filter(|&i| writers[i].sending().is_some()).collect();
        if ready.is_empty() {
            match joins.as_mut() {
                Some(rx) => tokio::select! {
                    _ = wake.notified() => {}
                    w = rx.recv() => match w {
                        Some(w) => writers.push(w),
                        None if writers.is_empty() => return,
                        None => joins = None,
                    },
                },
                None if writers.is_empty() => return,
                None => wake.notified().await,
            }
            continue;
        }
        // The parts of this round's transaction, starting at a different writer each round so
        // that none waits behind the others when they do not all fit.
        turn = turn.wrapping_add(1);
        let first = turn % ready.len();
        let mut parts: Vec<usize> = Vec::new();
        let (mut compares, mut success, mut failure, mut size) = (0, 0, 0, 0);
        let mut written: Vec<&[u8]> = Vec::new();
        // Whether the first part may share its transaction.
        let mut lead_shares = false;
        for &i in ready[first..].iter().chain(&ready[..first]) {
            let Some((txn, shares)) = writers[i].sending() else { continue };
            if parts.is_empty() {
                lead_shares = shares;
            } else {
                let fits = lead_shares
                    && shares
                    && compares + txn.compares.len() <= limits.max_txn_ops
                    && success + txn.success.len() <= limits.max_txn_ops
                    && failure + txn.failure.len() <= limits.max_txn_ops
                    && size + tycho_meta::Limits::txn_size(txn) <= limits.max_request_bytes
                    && txn.success.iter().all(|op| !written.contains(&op.key()));
                if !fits {
                    continue;
                }
            }
            compares += txn.compares.len();
            success += txn.success.len();
            failure += txn.failure.len();
            size += tycho_meta::Limits::txn_size(txn);
            written.extend(txn.success.iter().map(|op| op.key()));
            parts.push(i);
        }
        drop(written);
        let (parts, txns): (Vec<usize>, Vec<Txn>) =
            parts.into_iter().filter_map(|i| writers[i].take_send().map(|t| (i, t))).unzip();
        let answers = match txns.len() {
            0 | 1 => {
                let mut answers = Vec::with_capacity(1);
                for t in txns {
                    answers.push(store.txn(t).await);
                }
                answers
            }
            _ => {
                let mut merged = Txn::new();
                for t in &txns {
                    merged.compares.extend(t.compares.iter().cloned());
                    merged.success.extend(t.success.iter().cloned());
                    merged.failure.extend(t.failure.iter().cloned());
                }
                match store.txn(merged).await {
                    // Refused as a whole (a limit of the store lower than configured, say):
                    // each part alone, so that one part's fault is its own.
                    Err(e) if !e.is_unavailable() && !matches!(e, MetaError::Other(_)) => {
                        tracing::warn!(error = %e, parts = txns.len(), "a merged OpLog transaction was refused; sending its parts one by one");
                        let mut answers = Vec::with_capacity(txns.len());
                        for t in txns {
                            answers.push(store.txn(t).await);
                        }
                        answers
                    }
                    answer => vec![answer; txns.len()],
                }
            }
        };
        for (&i, answer) in parts.iter().zip(answers) {
            writers[i].sent(answer);
        }
        for &i in &parts {
            writers[i].tell();
        }
    }
}

/// How far the log got: every record up to `durable` is committed; `failed` ends it.
#[derive(Debug, Clone, Default)]
struct Progress {
    durable: u64,
    /// The last record handed to a transaction (at most one batch past `durable`).
    sending: u64,
    failed: Option<LogError>,
}

struct Queue {
    /// Set by [`OpLogWriter::finish`]: nothing more is taken, what waits is still committed.
    draining: bool,
    next_seq: u64,
    waiting: VecDeque<(u64, Record, usize)>,
    closed: Option<LogError>,
}

/// Told once why the log ended.
type OnEnd = Box<dyn FnOnce(&LogError) + Send>;

struct Shared {
    queue: Mutex<Queue>,
    on_end: Mutex<Option<OnEnd>>,
    /// Notified when there is work for the commit task (records appended, the writer closed):
    /// the writer's own, or its combiner's.
    wake: Arc<tokio::sync::Notify>,
    /// Where the log is. Its receivers are woken only when the log ends: a commit changes
    /// `durable` silently and wakes only the waiters it satisfies ([`Shared::waiters`]).
    progress: tokio::sync::watch::Sender<Progress>,
    /// Who waits for which record to become durable (by sequence number, then arrival):
    /// each is told when a commit covers its record, or (its sender dropped) when the log
    /// ends. A waiter checks `progress` and registers under this lock, and a commit notes
    /// `durable` before it takes the lock, so that none misses its commit.
    waiters: Mutex<Waiters>,
    cfg: WriterConfig,
}

/// The waiters of one log (see [`Shared::waiters`]).
#[derive(Default)]
struct Waiters {
    by_seq: BTreeMap<(u64, u64), tokio::sync::oneshot::Sender<()>>,
    next_id: u64,
    /// The count at which the entries of waiters that gave up are dropped next, so that a
    /// waiter that stops waiting (a timeout, a role that decides again) leaves nothing behind
    /// for long: twice the count left by the last pruning (amortized constant per wait).
    prune_at: usize,
}

impl Waiters {
    /// Registers a waiter for record `seq`.
    fn add(&mut self, seq: u64) -> tokio::sync::oneshot::Receiver<()> {
        if self.by_seq.len() >= self.prune_at {
            self.by_seq.retain(|_, tx| !tx.is_closed());
            self.prune_at = (2 * self.by_seq.len()).max(64);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.by_seq.insert((seq, self.next_id), tx);
        self.next_id += 1;
        rx
    }
}

impl Shared {
    /// Tells the waiters of every record up to `durable`.
    fn wake_durable(&self, durable: u64) {
        let mut w = self.waiters.lock();
        let later = w.by_seq.split_off(&(durable.saturating_add(1), 0));
        let due = std::mem::replace(&mut w.by_seq, later);
        drop(w);
        for (_, tx) in due {
            let _ = tx.send(());
        }
    }
}

/// The ordered group-commit writer of one group's log.
pub struct OpLogWriter {
    shared: Arc<Shared>,
    /// The writer's own commit task (`None`: its combiner's commits it).
    task: Option<tokio::task::JoinHandle<()>>,
}

impl OpLogWriter {
    /// Opens the log of `keys` for appending under `fence`: finds where it ends
    /// ([`read_durable`]), stores its layout record, and starts its commit task on the current
    /// tokio runtime, or joins its combiner's ([`WriterConfig::combiner`]). Records are numbered
    /// from the end on.
    pub async fn open(
        store: Arc<dyn MetaStore>,
        keys: LogKeys,
        fence: Fence,
        group: u32,
        epoch: u64,
        cfg: WriterConfig,
    ) -> Result<OpLogWriter, LogError> {
        let durable = read_durable(&*store, &keys).await?;
        store.put(&keys.layout(), &log_layout(), None).await.map_err(|e| LogError::Refused(e.to_string()))?;
        let combiner = cfg.combiner.clone();
        let wake = combiner.as_ref().map_or_else(Default::default, |c| c.wake.clone());
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue { draining: false, next_seq: durable + 1, waiting: VecDeque::new(), closed: None }),
            on_end: Mutex::new(None),
            wake: wake.clone(),
            progress: tokio::sync::watch::Sender::new(Progress { durable, sending: durable, failed: None }),
            waiters: Mutex::default(),
            cfg,
        });
        shared.cfg.stats.appended(durable);
        let machine = BatchCommit::new(keys.clone(), fence, group, durable);
        let committer = Committer {
            store: store.clone(),
            machine,
            group,
            epoch,
            shared: shared.clone(),
            io: None,
            batch: None,
            gone: false,
            untold: false,
            _ends: EndsLog(shared.clone()),
        };
        let task = match combiner {
            Some(c) => match c.joins.send(committer) {
                Ok(()) => {
                    c.wake.notify_one();
                    None
                }
                // The combiner's task is gone (it could only have panicked): this writer
                // commits on its own, waking on the same notifier its appends use.
                Err(tokio::sync::mpsc::error::SendError(committer)) => {
                    tracing::error!(
                        group,
                        "the OpLog transaction combiner stopped; this group's log commits on its own"
                    );
                    Some(tokio::spawn(drive(store, None, vec![committer], wake)))
                }
            },
            None => Some(tokio::spawn(drive(store, None, vec![committer], wake))),
        };
        Ok(OpLogWriter { shared, task })
    }

    /// Queues `rec` and returns its sequence number; never blocks. Fails at once when the queue
    /// is full (busy), or when the writer is fenced or closed.
    pub fn append(&self, rec: Record) -> Result<u64, LogError> {
        self.admit()?;
        self.append_admitted(rec)
    }

    /// Whether a mutation may be decided now: busy while the queue is full. Checked before the
    /// decision, since a record that is applied must then be logged.
    pub fn admit(&self) -> Result<(), LogError> {
        let q = self.shared.queue.lock();
        if let Some(e) = &q.closed {
            return Err(e.clone());
        }
        if q.draining {
            return Err(LogError::Closed);
        }
        if q.waiting.len() >= self.shared.cfg.max_queued_records {
            return Err(LogError::Busy);
        }
        Ok(())
    }

    /// Queues `rec` whatever the queue's length (it was admitted); fails only once the log has
    /// ended.
    pub fn append_admitted(&self, rec: Record) -> Result<u64, LogError> {
        let size = postcard::serialize_with_flavor(&rec, postcard::ser_flavors::Size::default()).unwrap_or(0);
        let mut q = self.shared.queue.lock();
        if let Some(e) = &q.closed {
            return Err(e.clone());
        }
        if q.draining {
            return Err(LogError::Closed);
        }
        let seq = q.next_seq;
        q.next_seq += 1;
        q.waiting.push_back((seq, rec, size));
        drop(q);
        self.shared.cfg.stats.appended(seq);
        self.shared.wake.notify_one();
        Ok(seq)
    }

    /// Waits until record `seq` is durable; fails if the log ends before it is.
    pub async fn wait(&self, seq: u64) -> Result<(), LogError> {
        wait_for(&self.shared, seq).await
    }

    /// The sequence number of the last record queued (durable or not).
    pub fn appended(&self) -> u64 {
        self.shared.queue.lock().next_seq - 1
    }

    /// The sequence number of the last durable record.
    pub fn durable(&self) -> u64 {
        self.shared.progress.borrow().durable
    }

    /// Why the log ended, if it has.
    pub fn failed(&self) -> Option<LogError> {
        self.shared.progress.borrow().failed.clone()
    }

    /// Completes once the log has ended (fenced, closed, failed), with the reason.
    pub async fn ended(&self) -> LogError {
        let mut rx = self.shared.progress.subscribe();
        let why = match rx.wait_for(|p| p.failed.is_some()).await {
            Ok(p) => p.failed.clone().unwrap_or(LogError::Closed),
            Err(_) => LogError::Closed,
        };
        why
    }

    /// Runs `f` once the log ends (fenced, closed, failed), with the reason: a master stops
    /// serving the group then, reads included, since another master may own it now. Runs at
    /// once if the log has ended already.
    pub fn on_end(&self, f: impl FnOnce(&LogError) + Send + 'static) {
        let ended = self.failed();
        match ended {
            Some(why) => f(&why),
            None => {
                *self.shared.on_end.lock() = Some(Box::new(f));
                // It may have ended meanwhile.
                if let Some(why) = self.failed() {
                    if let Some(f) = self.shared.on_end.lock().take() {
                        f(&why);
                    }
                }
            }
        }
    }

    /// Stops the writer after committing what waits, for at most `grace` (then as
    /// [`OpLogWriter::close`]): a master giving its role up acknowledges what it can. Records
    /// appended meanwhile are refused with `Closed`.
    pub async fn finish(&self, grace: Duration) {
        self.shared.queue.lock().draining = true;
        self.shared.wake.notify_one();
        let mut rx = self.shared.progress.subscribe();
        let ended = rx.wait_for(|p| p.failed.is_some());
        if tokio::time::timeout(grace, ended).await.is_err() {
            tracing::warn!("the OpLog did not commit what waited in time; closing it");
        }
        self.close();
    }

    /// Stops the writer: queued records that are not durable yet fail with `Closed`, and those
    /// of a batch in flight with `Interrupted`.
    pub fn close(&self) {
        end(&self.shared, LogError::Closed);
        match &self.task {
            Some(task) => task.abort(),
            // The combiner lets the writer go on its next round.
            None => self.shared.wake.notify_one(),
        }
    }
}

impl std::fmt::Debug for OpLogWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpLogWriter").field("durable", &self.durable()).finish_non_exhaustive()
    }
}

impl Drop for OpLogWriter {
    fn drop(&mut self) {
        self.close();
    }
}

/// Waits until record `seq` of `shared`'s log is durable, or the log ends first. Woken once,
/// by the commit that covers the record or by the log's end; not by other commits.
async fn wait_for(shared: &Shared, seq: u64) -> Result<(), LogError> {
    let told = {
        let mut w = shared.waiters.lock();
        if let Some(settled) = settled(&shared.progress.borrow(), seq) {
            return settled;
        }
        w.add(seq)
    };
    // Told (durable), or the sender dropped (the log ended): either way `progress` says which.
    let _ = told.await;
    settled(&shared.progress.borrow(), seq).unwrap_or(Err(LogError::Closed))
}

/// Whether record `seq` is durable (`Ok`), will never be (`Err`), or neither yet (`None`).
fn settled(p: &Progress, seq: u64) -> Option<Result<(), LogError>> {
    if p.durable >= seq {
        return Some(Ok(()));
    }
    Some(Err(match p.failed.clone()? {
        // Stopped mid-commit: this record may be in the log.
        LogError::Closed if seq <= p.sending => LogError::Interrupted,
        e => e,
    }))
}

/// A primary's records go to its group's log. A record the log no longer takes (it was fenced
/// or closed) gets a number that never becomes durable, so its mutation is never acknowledged.
impl crate::log::record::RecordSink for OpLogWriter {
    fn append(&self, rec: Record) -> u64 {
        match self.append_admitted(rec) {
            Ok(seq) => seq,
            Err(e) => {
                tracing::error!(error = %e, "a record was applied but the OpLog no longer takes records");
                u64::MAX
            }
        }
    }

    fn durable(&self, seq: u64) -> crate::log::record::DurableFuture {
        let shared = self.shared.clone();
        Box::pin(async move { wait_for(&shared, seq).await.map_err(|e| e.code()) })
    }

    fn admit(&self) -> Result<(), ErrorCode> {
        OpLogWriter::admit(self).map_err(|e| e.code())
    }

    fn appended(&self) -> u64 {
        self.shared.queue.lock().next_seq - 1
    }

    fn committed(&self) -> u64 {
        self.shared.progress.borrow().durable
    }
}

/// Ends the log: nothing more is queued, and waiters learn why.
fn end(shared: &Shared, why: LogError) {
    let mut q = shared.queue.lock();
    if q.closed.is_none() {
        q.closed = Some(why.clone());
        q.waiting.clear();
    }
    drop(q);
    let first = shared.progress.send_if_modified(|p| {
        if p.failed.is_none() {
            p.failed = Some(why.clone());
            true
        } else {
            false
        }
    });
    if first {
        // Every waiter learns the end from `progress` (their senders dropped).
        std::mem::take(&mut shared.waiters.lock().by_seq);
        if let Some(f) = shared.on_end.lock().take() {
            f(&why);
        }
    }
}

/// One group's log as its commit task holds it: the queue's other end, the fencing machine, and
/// the batch in hand.
struct Committer {
    store: Arc<dyn MetaStore>,
    machine: BatchCommit,
    group: u32,
    epoch: u64,
    shared: Arc<Shared>,
    /// What the machine asked for last, not done yet (`None`: no batch in hand).
    io: Option<Io>,
    /// The batch in hand: its last sequence number, record count, and when it was taken.
    batch: Option<(u64, usize, Instant)>,
    /// The log ended or drained: the task lets the writer go.
    gone: bool,
    /// A commit was noted whose waiters were not woken yet ([`Committer::tell`]).
    untold: bool,
    _ends: EndsLog,
}

/// Ends the log when the commit task lets the writer go, however it does (a panic included),
/// so that no waiter waits forever.
struct EndsLog(Arc<Shared>);

impl Drop for EndsLog {
    fn drop(&mut self) {
        end(&self.0, LogError::Closed);
    }
}

impl Committer {
    /// Moves the batch in hand on until it needs a transaction sent (see
    /// [`Committer::sending`]), or until no records wait: notes a committed batch and takes
    /// the next, does the read-backs the machine asks for. Sets `gone` once the log has ended.
    async fn advance(&mut self) {
        loop {
            if self.closed() {
                self.gone = true;
                return;
            }
            // Tests hold a primary's commits here: its records are applied, never durable.
            #[cfg(feature = "failpoints")]
            if self.io.is_none()
                && (|| {
                    fail::fail_point!("oplog::hold_commit", |_| true);
                    false
                })()
            {
                return;
            }
            match self.io.take() {
                None => match self.next_batch() {
                    Ok(Some(batch)) => {
                        let last = batch.last_seq();
                        self.batch = Some((last, batch.records.len(), Instant::now()));
                        self.io = Some(self.machine.begin(batch.first_seq, last, batch.encode()));
                    }
                    Ok(None) => return,
                    Err(()) => {
                        self.gone = true;
                        return;
                    }
                },
                Some(send @ Io::Send(_)) => {
                    self.io = Some(send);
                    return;
                }
                Some(Io::Read { key, pause }) => {
                    if pause {
                        tokio::time::sleep(self.shared.cfg.retry_backoff).await;
                    }
                    let read = self.read(&key).await;
                    self.io = Some(self.machine.on(Reply::Read(read)));
                }
                Some(Io::Done(Ok(()))) => self.committed(true),
                Some(Io::Done(Err(e))) => {
                    if matches!(e, LogError::Fenced(_)) {
                        self.shared.cfg.stats.fenced.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::error!(group = self.group, error = %e, "OpLog writer stopped");
                    end(&self.shared, e);
                    self.gone = true;
                    return;
                }
            }
        }
    }

    /// The transaction the batch in hand waits to send, and whether it may share one with
    /// other groups' (a failed compare is settled by reading the ownership record back).
    /// A closed writer sends nothing more.
    fn sending(&self) -> Option<(&Txn, bool)> {
        match &self.io {
            Some(Io::Send(txn)) if !self.closed() => Some((txn, self.machine.renewable())),
            _ => None,
        }
    }

    /// Whether the log was closed or ended.
    fn closed(&self) -> bool {
        self.shared.queue.lock().closed.is_some()
    }

    /// Takes the transaction to send (see [`Committer::sending`]); `None` once the writer is
    /// closed.
    fn take_send(&mut self) -> Option<Txn> {
        if self.closed() {
            self.gone = true;
            return None;
        }
        match self.io.take() {
            Some(Io::Send(txn)) => Some(txn),
            other => {
                self.io = other;
                None
            }
        }
    }

    /// The answer to the transaction taken: the machine says what next. A writer closed
    /// meanwhile learns nothing more (its waiters were told already).
    fn sent(&mut self, answer: MetaResult<TxnResponse>) {
        if self.closed() {
            self.gone = true;
            return;
        }
        match self.machine.on(Reply::Sent(answer)) {
            // Noted at once, its waiters told once every part's answer is noted (see
            // [`Committer::tell`]).
            Io::Done(Ok(())) => self.committed(false),
            io => self.io = Some(io),
        }
    }

    /// The batch in hand is committed: its waiters are told now, or (`tell` false) by the next
    /// [`Committer::tell`].
    fn committed(&mut self, tell: bool) {
        if let Some((last, records, started)) = self.batch.take() {
            self.shared.cfg.stats.committed(last, records, started.elapsed());
            // The value changes silently: its waiters are told apart.
            self.shared.progress.send_if_modified(|p| {
                p.durable = last;
                false
            });
            if tell {
                self.shared.wake_durable(last);
            } else {
                self.untold = true;
            }
        }
    }

    /// Wakes the waiters of a commit noted without telling them: after every part of a
    /// transaction was noted, so that a request waiting on records of several groups finds
    /// them all durable once the first wakes it, instead of waking once per group.
    fn tell(&mut self) {
        if std::mem::take(&mut self.untold) {
            let durable = self.shared.progress.borrow().durable;
            self.shared.wake_durable(durable);
        }
    }

    /// The next batch: the oldest waiting records, within the count and byte bounds (at least
    /// one record). `Err` once the log is closed, or drained.
    fn next_batch(&self) -> Result<Option<RecordBatch>, ()> {
        let mut q = self.shared.queue.lock();
        if q.closed.is_some() {
            return Err(());
        }
        let Some(&(first_seq, _, _)) = q.waiting.front() else {
            return if q.draining { Err(()) } else { Ok(None) };
        };
        let (mut count, mut bytes) = (0, 0);
        for (_, _, size) in q.waiting.iter() {
            let max_records = self.shared.cfg.max_batch_records.clamp(1, MAX_BATCH_RECORDS);
            if count > 0 && (count >= max_records || bytes + size > self.shared.cfg.max_batch_bytes) {
                break;
            }
            count += 1;
            bytes += size;
        }
        let records: Vec<Record> = q.waiting.drain(..count).map(|(_, r, _)| r).collect();
        // Noted under the queue's lock: a close from now on tells these records' waiters that
        // they may be in the log (Interrupted), not that they are not. No waiter needs waking.
        let last = first_seq + records.len() as u64 - 1;
        self.shared.progress.send_if_modified(|p| {
            p.sending = last;
            false
        });
        drop(q);
        Ok(Some(RecordBatch { group: self.group, epoch: self.epoch, first_seq, records }))
    }

    /// Reads `key`, waiting out a store that does not answer.
    async fn read(&self, key: &[u8]) -> Result<Option<tycho_meta::KeyValue>, LogError> {
        Ok(patiently(self.shared.cfg.retry_backoff, || self.store.get(key)).await?.kv)
    }
}

/// Why a follower stopped. Each means that its state cannot be trusted to go on: a standby
/// stops serving as one and rebootstraps from a snapshot.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum FollowError {
    /// A record is missing: the next batch does not start where the last one ended.
    #[error("gap in the log: expected record {expected}, found {found}")]
    Gap {
        /// The record the follower needs next.
        expected: u64,
        /// The first record of the batch the log has instead.
        found: u64,
    },
    /// A batch cannot be read (damage, another layout, another group's batch).
    #[error("unreadable OpLog: {0}")]
    Corrupt(String),
    /// A record does not apply to the follower's state.
    #[error("record {seq} does not apply: {error}")]
    Diverged {
        /// Its sequence number.
        seq: u64,
        /// Why.
        error: crate::log::record::ReplayError,
    },
    /// The store no longer has the history the follower needs.
    #[error("the store's history is compacted past this follower")]
    Compacted,
    /// The store failed otherwise.
    #[error("coordination store: {0}")]
    Store(String),
}

impl From<LogError> for FollowError {
    fn from(e: LogError) -> FollowError {
        FollowError::Corrupt(e.to_string())
    }
}

fn store_error(e: MetaError) -> FollowError {
    match e {
        MetaError::Compacted { .. } => FollowError::Compacted,
        e => FollowError::Store(e.to_string()),
    }
}

/// Reads a group's log in order from a known position and applies its records: a standby's
/// catch-up and tailing.
pub struct LogFollower {
    store: Arc<dyn MetaStore>,
    keys: LogKeys,
    group: u32,
    applied: u64,
    page: usize,
    /// `applied` is the last record of a batch (or 0), so the next batch starts right after
    /// it. False until the first catch-up when the follower starts from a snapshot, which may
    /// end inside a batch.
    aligned: bool,
    /// Where the follower reports how far behind it is.
    stats: Option<Arc<LogStats>>,
}

impl LogFollower {
    /// A follower of `keys` (group `group`) that has applied every record up to `applied` and
    /// reads at most `page` batches per request.
    pub fn new(store: Arc<dyn MetaStore>, keys: LogKeys, group: u32, applied: u64, page: usize) -> LogFollower {
        LogFollower { store, keys, group, applied, page: page.max(1), aligned: applied == 0, stats: None }
    }

    /// Reports the follower's lag to `stats` (the group's, for `/metrics`).
    pub fn with_stats(mut self, stats: Arc<LogStats>) -> LogFollower {
        self.stats = Some(stats);
        self
    }

    /// The sequence number of the last record applied.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Applies every record from the one after [`LogFollower::applied`] to the log's end,
    /// batch by batch, checking each batch's envelope, group and numbering. Returns where it
    /// stands.
    pub async fn catch_up(
        &mut self,
        apply: &mut impl FnMut(u64, &Record) -> Result<(), crate::log::record::ReplayError>,
    ) -> Result<u64, FollowError> {
        // A follower that may stand inside a batch starts early enough to find the batch that
        // holds its next record.
        let from = match self.aligned {
            true => self.applied + 1,
            false => (self.applied + 1).saturating_sub(MAX_BATCH_RECORDS as u64 - 1).max(1),
        };
        // Every page at the first one's revision: one state of the log.
        let mut req = RangeRequest {
            prefix: self.keys.batches(),
            start: Some(self.keys.batch(from)),
            limit: self.page,
            revision: None,
            keys_only: false,
        };
        loop {
            let page = self.store.range(req.clone()).await.map_err(store_error)?;
            for kv in &page.kvs {
                self.apply_batch(&kv.key, &kv.value, apply)?;
            }
            match req.next_page(&page) {
                Some(next) => req = next,
                None => break,
            }
        }
        if let Some(s) = &self.stats {
            s.seen(self.applied, self.applied);
        }
        Ok(self.applied)
    }

    /// Applies the records of the batch stored as `key`, `value` that follow
    /// [`LogFollower::applied`] (none when it ends there or before). Fails on a batch that does
    /// not continue the log.
    fn apply_batch(
        &mut self,
        key: &[u8],
        value: &[u8],
        apply: &mut impl FnMut(u64, &Record) -> Result<(), crate::log::record::ReplayError>,
    ) -> Result<(), FollowError> {
        let batch = RecordBatch::decode(value).map_err(|e| FollowError::Corrupt(e.to_string()))?;
        if batch.group != self.group || key != self.keys.batch(batch.first_seq) {
            return Err(FollowError::Corrupt(format!(
                "batch of group {} at {} stored under another key",
                batch.group, batch.first_seq
            )));
        }
        if batch.last_seq() <= self.applied {
            return Ok(());
        }
        if batch.first_seq > self.applied + 1 || (self.aligned && batch.first_seq != self.applied + 1) {
            return Err(FollowError::Gap { expected: self.applied + 1, found: batch.first_seq });
        }
        let done = self.applied;
        for (seq, rec) in (batch.first_seq..).zip(&batch.records).filter(|(seq, _)| *seq > done) {
            apply(seq, rec).map_err(|error| FollowError::Diverged { seq, error })?;
            self.applied = seq;
        }
        self.aligned = true;
        Ok(())
    }

    /// Catches up, then applies new batches as they are committed (a watch on the batch keys,
    /// no polling), until `stop` completes (`Ok`) or the log cannot be followed (`Err`). A
    /// batch that continues what was applied is applied from the watch's event; after anything
    /// else (a gap in the events, a watch that fell behind the store's history) the follower
    /// reads on from the log.
    pub async fn follow(
        &mut self,
        apply: &mut impl FnMut(u64, &Record) -> Result<(), crate::log::record::ReplayError>,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), FollowError> {
        tokio::pin!(stop);
        let batches = tycho_meta::WatchRequest::prefix(self.keys.batches());
        // The watch starts before the first catch-up, so no batch is missed.
        let mut watch = self.store.watch(batches.clone()).await.map_err(store_error)?;
        self.catch_up(apply).await?;
        loop {
            tokio::select! {
                _ = &mut stop => return Ok(()),
                event = watch.next() => match event {
                    Ok(tycho_meta::WatchEvent::Put(kv)) => {
                        let next = self.keys.first_seq_of(&kv.key).is_some_and(|f| f <= self.applied + 1);
                        if next && self.aligned {
                            self.apply_batch(&kv.key, &kv.value, apply)?;
                            if let Some(s) = &self.stats {
                                s.seen(self.applied, self.applied);
                            }
                        } else {
                            // The lag shows from the moment the batch is committed, whatever
                            // the catch-up then takes.
                            if let (Some(s), Ok(batch)) = (&self.stats, RecordBatch::decode(&kv.value)) {
                                s.seen(batch.last_seq(), self.applied);
                            }
                            self.catch_up(apply).await?;
                        }
                    }
                    // Deletions (compaction below a snapshot) and reconnections change nothing.
                    Ok(_) => {}
                    Err(MetaError::Compacted { .. }) => {
                        // The watch fell behind the store's history: watch again from now, and
                        // read what was missed from the log itself.
                        watch = self.store.watch(batches.clone()).await.map_err(store_error)?;
                        self.catch_up(apply).await?;
                    }
                    Err(e) => return Err(store_error(e)),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Waiters;

    #[test]
    fn waiters_that_gave_up_are_dropped_and_the_live_ones_kept() {
        let mut w = Waiters::default();
        // A role that decides again and again, waiting each time for a record far ahead.
        for _ in 0..10_000 {
            drop(w.add(1_000_000));
        }
        assert!(w.by_seq.len() <= 64, "{} entries of waiters that gave up", w.by_seq.len());
        // Live waiters stay, however many come and go beside them.
        let live: Vec<_> = (1..=100).map(|seq| w.add(seq)).collect();
        for _ in 0..10_000 {
            drop(w.add(1_000_000));
        }
        assert!(w.by_seq.len() <= 2 * live.len(), "{} entries", w.by_seq.len());
        let kept = w.by_seq.values().filter(|tx| !tx.is_closed()).count();
        assert_eq!(kept, live.len());
    }
}
