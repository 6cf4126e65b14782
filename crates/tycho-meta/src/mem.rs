//! `MemStore`: etcd's data model in one process, for unit tests and the single-process
//! `tycho up`.
//!
//! It keeps a multi-version history like etcd's MVCC store: every key has its versions from
//! the compaction point on, so a range at an older revision sees exactly what etcd would, and a
//! watch replays the retained event log from its start revision. History is bounded: once more
//! than [`MemConfig::history_revisions`] revisions are retained, the oldest are compacted, and a
//! watch or read that needs them gets [`MetaError::Compacted`], as from etcd. Leases expire by
//! the injected [`Clock`]: expiry is checked at the start of every call (tests move a
//! [`ManualClock`](crate::ManualClock) and the next call sees the lease gone) and, in a long
//! running process, by [`MemStore::spawn_lease_reaper`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::error::{MetaError, MetaResult};
use crate::kv::{
    in_range, key_after, prefix_end, DeleteResponse, GetResponse, KeyValue, LeaseId, RangePage, RangeRequest, Revision,
};
use crate::lease::{LeaseGrant, LeaseInfo};
use crate::limits::Limits;
use crate::store::{BoxFuture, MetaStore};
use crate::txn::{Txn, TxnOp, TxnOpResult, TxnResponse};
use crate::watch::{Watch, WatchEvent, WatchRequest, WatchSender};

/// Revisions of history a `MemStore` keeps by default before compacting the oldest.
pub const DEFAULT_HISTORY_REVISIONS: i64 = 10_000;

/// How a `MemStore` behaves.
#[derive(Debug, Clone)]
pub struct MemConfig {
    /// The limits to enforce (the same checks `EtcdStore` makes).
    pub limits: Limits,
    /// Keep at most this many revisions of history; older ones are compacted automatically.
    pub history_revisions: i64,
}

impl Default for MemConfig {
    fn default() -> Self {
        MemConfig { limits: Limits::default(), history_revisions: DEFAULT_HISTORY_REVISIONS }
    }
}

/// An in-memory [`MetaStore`] with etcd's semantics. Cloning shares the store.
#[derive(Debug, Clone)]
pub struct MemStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    config: MemConfig,
    /// The current revision, published after every write so that watches wake up.
    revision: watch::Sender<Revision>,
}

/// One version of a key: its value at `mod_revision`, or a tombstone.
#[derive(Debug)]
struct Version {
    mod_revision: Revision,
    kv: Option<KeyValue>,
}

#[derive(Debug)]
struct MemLease {
    ttl: Duration,
    expires_at: Instant,
    keys: BTreeSet<Vec<u8>>,
}

#[derive(Debug)]
struct Event {
    revision: Revision,
    event: WatchEvent,
}

#[derive(Debug)]
struct State {
    revision: Revision,
    compact_revision: Revision,
    /// Every key's versions, oldest first, back to the compaction point.
    keys: BTreeMap<Vec<u8>, Vec<Version>>,
    /// Every change since the compaction point, in revision order.
    events: VecDeque<Event>,
    leases: HashMap<LeaseId, MemLease>,
    next_lease: LeaseId,
}

impl MemStore {
    /// An empty store on the system clock with default limits and history.
    pub fn new() -> MemStore {
        MemStore::with_clock(Arc::new(SystemClock), MemConfig::default())
    }

    /// An empty store whose leases expire by `clock`.
    pub fn with_clock(clock: Arc<dyn Clock>, config: MemConfig) -> MemStore {
        let state = State {
            // etcd starts an empty store at revision 1.
            revision: 1,
            compact_revision: 0,
            keys: BTreeMap::new(),
            events: VecDeque::new(),
            leases: HashMap::new(),
            next_lease: 1,
        };
        let (revision, _) = watch::channel(1);
        MemStore { inner: Arc::new(Inner { state: Mutex::new(state), clock, config, revision }) }
    }

    /// Expires every lease whose deadline has passed on the clock, deleting its keys. Every
    /// call does this first; a process whose store may sit idle runs
    /// [`spawn_lease_reaper`](Self::spawn_lease_reaper) so that watchers see expiries promptly.
    pub fn expire_leases(&self) {
        let mut w = self.inner.writer();
        w.expire_leases();
    }

    /// Runs [`expire_leases`](Self::expire_leases) every `every` on a tokio task, until the
    /// store is dropped.
    pub fn spawn_lease_reaper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.writer().expire_leases();
            }
        })
    }

    /// The current revision.
    pub fn revision(&self) -> Revision {
        self.inner.state.lock().revision
    }
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::new()
    }
}

impl Inner {
    /// Locks the state for a series of changes that share one revision.
    fn writer(&self) -> Writer<'_> {
        let state = self.state.lock();
        let base = state.revision;
        Writer { inner: self, state: Some(state), base, changed: false }
    }
}

/// The state, locked, with the changes made so far at revision `base + 1`. Dropping it
/// commits: the revision advances if anything changed, old history is compacted and
/// watchers are woken.
struct Writer<'a> {
    inner: &'a Inner,
    state: Option<parking_lot::MutexGuard<'a, State>>,
    base: Revision,
    changed: bool,
}

impl Writer<'_> {
    fn state(&mut self) -> &mut State {
        self.state.as_mut().expect("state held until drop")
    }

    fn now(&self) -> Instant {
        self.inner.clock.now()
    }

    /// The revision of the changes being made.
    fn write_revision(&self) -> Revision {
        self.base + 1
    }

    fn put(&mut self, key: &[u8], value: &[u8], lease: Option<LeaseId>) {
        let rev = self.write_revision();
        let state = self.state();
        let current = state.latest(key).cloned();
        let kv = KeyValue {
            key: key.to_vec(),
            value: value.to_vec(),
            create_revision: current.as_ref().map_or(rev, |c| c.create_revision),
            mod_revision: rev,
            version: current.as_ref().map_or(1, |c| c.version + 1),
            lease,
        };
        if let Some(old) = current.and_then(|c| c.lease).filter(|old| Some(*old) != lease) {
            if let Some(l) = state.leases.get_mut(&old) {
                l.keys.remove(key);
            }
        }
        if let Some(l) = lease.and_then(|id| state.leases.get_mut(&id)) {
            l.keys.insert(key.to_vec());
        }
        state.keys.entry(key.to_vec()).or_default().push(Version { mod_revision: rev, kv: Some(kv.clone()) });
        state.events.push_back(Event { revision: rev, event: WatchEvent::Put(kv) });
        self.changed = true;
    }

    /// Deletes `key`; whether it existed.
    fn delete(&mut self, key: &[u8]) -> bool {
        let rev = self.write_revision();
        let state = self.state();
        let Some(current) = state.latest(key).cloned() else { return false };
        if let Some(l) = current.lease.and_then(|id| state.leases.get_mut(&id)) {
            l.keys.remove(key);
        }
        state.keys.entry(key.to_vec()).or_default().push(Version { mod_revision: rev, kv: None });
        // etcd's delete event carries only the key and the delete's revision.
        let tombstone = KeyValue {
            key: key.to_vec(),
            value: Vec::new(),
            create_revision: 0,
            mod_revision: rev,
            version: 0,
            lease: None,
        };
        state.events.push_back(Event { revision: rev, event: WatchEvent::Delete(tombstone) });
        self.changed = true;
        true
    }

    /// Revokes a lease: its keys go at one revision, like etcd's revoke.
    fn revoke(&mut self, id: LeaseId) -> bool {
        let Some(lease) = self.state().leases.remove(&id) else { return false };
        for key in &lease.keys {
            self.delete(key);
        }
        true
    }

    fn expire_leases(&mut self) {
        let now = self.now();
        let mut expired: Vec<(Instant, LeaseId)> = self
            .state()
            .leases
            .iter()
            .filter(|(_, l)| l.expires_at <= now)
            .map(|(id, l)| (l.expires_at, *id))
            .collect();
        expired.sort();
        for (_, id) in expired {
            // Each expiry is its own revoke, so each gets its own revision.
            self.commit();
            self.revoke(id);
        }
    }

    /// Ends the current revision's changes (if any) so that the next change gets a new one.
    fn commit(&mut self) {
        if !self.changed {
            return;
        }
        self.changed = false;
        let limit = self.inner.config.history_revisions.max(1);
        let rev = self.write_revision();
        let state = self.state();
        state.revision = rev;
        if rev - state.compact_revision > limit {
            state.compact(rev - limit);
        }
        self.base = rev;
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        self.commit();
        let rev = self.state().revision;
        drop(self.state.take());
        self.inner.revision.send_if_modified(|r| std::mem::replace(r, rev) != rev);
    }
}

impl State {
    /// The key's live value now.
    fn latest(&self, key: &[u8]) -> Option<&KeyValue> {
        self.keys.get(key)?.last()?.kv.as_ref()
    }

    /// The key's value as of `revision`.
    fn at(&self, key: &[u8], revision: Revision) -> Option<&KeyValue> {
        let versions = self.keys.get(key)?;
        let i = versions.partition_point(|v| v.mod_revision <= revision);
        versions[..i].last()?.kv.as_ref()
    }

    fn check_revision(&self, requested: Revision) -> MetaResult<()> {
        if requested < self.compact_revision {
            return Err(MetaError::Compacted { requested, compact_revision: self.compact_revision });
        }
        if requested > self.revision {
            return Err(MetaError::FutureRevision { requested, current: self.revision });
        }
        Ok(())
    }

    /// Drops history before `revision`: for each key, versions older than its latest version at
    /// `revision`, and that version too if it is a tombstone.
    fn compact(&mut self, revision: Revision) {
        self.keys.retain(|_, versions| {
            let i = versions.partition_point(|v| v.mod_revision <= revision);
            let keep_from = match versions[..i].last() {
                Some(v) if v.kv.is_some() => i - 1,
                _ => i,
            };
            versions.drain(..keep_from);
            !versions.is_empty()
        });
        while self.events.front().is_some_and(|e| e.revision < revision) {
            self.events.pop_front();
        }
        self.compact_revision = revision;
    }

    fn lease_exists(&self, lease: Option<LeaseId>) -> MetaResult<()> {
        match lease {
            Some(id) if !self.leases.contains_key(&id) => Err(MetaError::LeaseNotFound { lease: id }),
            _ => Ok(()),
        }
    }
}

/// etcd treats lease 0 as "no lease".
fn no_zero(lease: Option<LeaseId>) -> Option<LeaseId> {
    lease.filter(|id| *id != 0)
}

/// Whole seconds, rounded up, at least one: etcd's TTL granularity.
fn whole_seconds(ttl: Duration) -> Duration {
    Duration::from_secs(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(Duration::from_secs(1))
}

impl MetaStore for MemStore {
    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<GetResponse>> {
        Box::pin(async move {
            self.inner.config.limits.check_key(key)?;
            let mut w = self.inner.writer();
            w.expire_leases();
            w.commit();
            let state = w.state();
            Ok(GetResponse { kv: state.latest(key).cloned(), revision: state.revision })
        })
    }

    fn range(&self, req: RangeRequest) -> BoxFuture<'_, MetaResult<RangePage>> {
        Box::pin(async move {
            self.inner.config.limits.check_range(&req)?;
            let mut w = self.inner.writer();
            w.expire_leases();
            w.commit();
            let state = w.state();
            let revision = req.revision.unwrap_or(state.revision);
            state.check_revision(revision)?;
            let (start, end) = (req.start_key(), req.end_key());
            let upper = if end == [0] { Bound::Unbounded } else { Bound::Excluded(end.clone()) };
            let mut kvs = Vec::new();
            let mut next = None;
            for (key, _) in state.keys.range((Bound::Included(start.clone()), upper)) {
                debug_assert!(in_range(key, &start, &end));
                let Some(kv) = state.at(key, revision) else { continue };
                if req.limit > 0 && kvs.len() == req.limit {
                    next = kvs.last().map(|last: &KeyValue| key_after(&last.key));
                    break;
                }
                let mut kv = kv.clone();
                if req.keys_only {
                    kv.value.clear();
                }
                kvs.push(kv);
            }
            Ok(RangePage { kvs, revision, next })
        })
    }

    fn put<'a>(
        &'a self,
        key: &'a [u8],
        value: &'a [u8],
        lease: Option<LeaseId>,
    ) -> BoxFuture<'a, MetaResult<Revision>> {
        Box::pin(async move {
            self.inner.config.limits.check_put(key, value)?;
            let lease = no_zero(lease);
            let mut w = self.inner.writer();
            w.expire_leases();
            w.commit();
            w.state().lease_exists(lease)?;
            w.put(key, value, lease);
            Ok(w.write_revision())
        })
    }

    fn delete<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<DeleteResponse>> {
        Box::pin(async move {
            self.inner.config.limits.check_key(key)?;
            let mut w = self.inner.writer();
            w.expire_leases();
            w.commit();
            let deleted = w.delete(key);
            w.commit();
            Ok(DeleteResponse { deleted, revision: w.state().revision })
        })
    }

    fn txn(&self, txn: Txn) -> BoxFuture<'_, MetaResult<TxnResponse>> {
        Box::pin(async move {
            self.inner.config.limits.check_txn(&txn)?;
            let mut w = self.inner.writer();
            w.expire_leases();
            w.commit();
            let state = w.state();
            let succeeded = txn.compares.iter().all(|c| c.holds(state.latest(&c.key)));
            let ops = if succeeded { txn.success } else { txn.failure };
            // Check everything that can fail before changing anything: a transaction is atomic.
            for op in &ops {
                if let TxnOp::Put { lease, .. } = op {
                    state.lease_exists(no_zero(*lease))?;
                }
            }
            let mut results = Vec::with_capacity(ops.len());
            for op in ops {
                results.push(match op {
                    TxnOp::Put { key, value, lease } => {
                        w.put(&key, &value, no_zero(lease));
                        TxnOpResult::Put
                    }
                    TxnOp::Delete { key } => TxnOpResult::Delete { deleted: w.delete(&key) },
                    TxnOp::Get { key } => TxnOpResult::Get(w.state().latest(&key).cloned()),
                });
            }
            w.commit();
            Ok(TxnResponse { succeeded, revision: w.state().revision, results })
        })
    }

    fn compact(&self, revision: Revision) -> BoxFuture<'_, MetaResult<()>> {
        Box::pin(async move {
            let mut state = self.inner.state.lock();
            if revision <= state.compact_revision {
                return Err(MetaError::Compacted { requested: revision, compact_revision: state.compact_revision });
            }
            state.check_revision(revision)?;
            state.compact(revision);
            Ok(())
        })
    }

    fn watch(&self, req: WatchRequest) -> BoxFuture<'_, MetaResult<Watch>> {
        Box::pin(async move {
            let start = match req.start_revision {
                r if r > 0 => r,
                _ => self.inner.state.lock().revision + 1,
            };
            let (end, start_key) = if req.prefix {
                (prefix_end(&req.key), if req.key.is_empty() { vec![0] } else { req.key.clone() })
            } else {
                (key_after(&req.key), req.key.clone())
            };
            let (tx, watch) = Watch::channel();
            let filter = KeyFilter { start: start_key, end };
            tokio::spawn(run_watch(self.inner.clone(), filter, start, tx));
            Ok(watch)
        })
    }

    fn lease_grant(&self, ttl: Duration) -> BoxFuture<'_, MetaResult<LeaseGrant>> {
        Box::pin(async move {
            let ttl = whole_seconds(ttl);
            let mut w = self.inner.writer();
            w.expire_leases();
            let expires_at = w.now() + ttl;
            let state = w.state();
            let id = state.next_lease;
            state.next_lease += 1;
            state.leases.insert(id, MemLease { ttl, expires_at, keys: BTreeSet::new() });
            Ok(LeaseGrant { id, ttl })
        })
    }

    fn lease_keep_alive_once(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Duration>> {
        Box::pin(async move {
            let mut w = self.inner.writer();
            w.expire_leases();
            let now = w.now();
            let l = w.state().leases.get_mut(&lease).ok_or(MetaError::LeaseNotFound { lease })?;
            l.expires_at = now + l.ttl;
            Ok(l.ttl)
        })
    }

    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<()>> {
        Box::pin(async move {
            let mut w = self.inner.writer();
            w.expire_leases();
            w.commit();
            if w.revoke(lease) {
                Ok(())
            } else {
                Err(MetaError::LeaseNotFound { lease })
            }
        })
    }

    fn lease_time_to_live(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Option<LeaseInfo>>> {
        Box::pin(async move {
            let mut w = self.inner.writer();
            w.expire_leases();
            let now = w.now();
            Ok(w.state().leases.get(&lease).map(|l| LeaseInfo {
                id: lease,
                granted_ttl: l.ttl,
                remaining: l.expires_at.saturating_duration_since(now),
                keys: l.keys.iter().cloned().collect(),
            }))
        })
    }

    fn limits(&self) -> Limits {
        self.inner.config.limits
    }
}

/// The keys a watch covers: `[start, end)`, where an `end` of `[0]` is unbounded.
struct KeyFilter {
    start: Vec<u8>,
    end: Vec<u8>,
}

/// Events copied out of the log per lock hold, so a long replay does not stall writers.
const WATCH_BATCH: usize = 1024;

/// Feeds one watch from the event log: replays history from `next`, then follows new writes.
/// A watch that falls behind the compaction point ends with `Compacted`, as in etcd.
async fn run_watch(inner: Arc<Inner>, filter: KeyFilter, mut next: Revision, tx: WatchSender) {
    let mut revisions = inner.revision.subscribe();
    loop {
        revisions.borrow_and_update();
        let batch = {
            let state = inner.state.lock();
            if next < state.compact_revision {
                Err(MetaError::Compacted { requested: next, compact_revision: state.compact_revision })
            } else {
                let from = state.events.partition_point(|e| e.revision < next);
                let mut batch = Vec::new();
                let (mut scanned, mut last) = (0, None);
                let mut resume = state.revision + 1;
                for e in state.events.range(from..) {
                    // Stop between revisions, never inside one, so that `next` stays exact.
                    if scanned >= WATCH_BATCH && last != Some(e.revision) {
                        resume = e.revision;
                        break;
                    }
                    scanned += 1;
                    last = Some(e.revision);
                    let key = &e.event.kv().expect("logged events carry a key").key;
                    if in_range(key, &filter.start, &filter.end) {
                        batch.push(e.event.clone());
                    }
                }
                // A watch may start beyond the current revision; it then waits there.
                next = next.max(resume);
                Ok(batch)
            }
        };
        let batch = match batch {
            Ok(batch) => batch,
            Err(compacted) => {
                let _ = tx.send(Err(compacted)).await;
                return;
            }
        };
        for event in batch {
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
        }
        if inner.state.lock().revision >= next {
            continue;
        }
        tokio::select! {
            _ = tx.closed() => return,
            changed = revisions.changed() => if changed.is_err() { return },
        }
    }
}
