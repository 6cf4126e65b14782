//! Bounding a group's log: snapshots published in the coordination store, a compaction floor
//! below which batches are deleted, and the bootstrap of a master from the newest snapshot.
//!
//! `/tycho/{cluster}/snapshots/{rank:05}` holds the group's [`Pointers`]: the `latest`
//! snapshot, the one before it as `fallback`, and the `floor`, the log position of the
//! fallback. Batches that end at or below the floor may be deleted; a master that starts
//! from either snapshot still finds every batch it needs. The record changes only by
//! compare-and-swap, so two masters that snapshot at once cannot both win, and every
//! publication also compacts the store's history up to the previous one's revision (watchers
//! behind that resume from the log itself).
//!
//! Who snapshots: the group's standby, from its own replayed state between two records; or,
//! while the group has no live standby, its primary, from a scratch master it fills from the
//! latest snapshot and the log (never from the state it serves, which moves under it).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_meta::{MetaError, MetaStore, RangeRequest, Revision, Txn, TxnOp};
use tycho_proto::envelope::{self, RecordKind};

use crate::cluster::ownership::ClusterKeys;
use crate::log::oplog::{FollowError, LogFollower, LogKeys};
use crate::log::snapshot::{self, Entry, SnapshotError, SnapshotId, SnapshotStore, DEFAULT_CHUNK_BYTES};
use crate::state::master::Master;

/// Layout version of [`Pointers`].
pub const POINTERS_VERSION: u16 = 1;

/// Where a group's snapshots stand.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pointers {
    /// The newest published snapshot.
    pub latest: Option<SnapshotId>,
    /// The one before it, read when `latest` cannot be.
    pub fallback: Option<SnapshotId>,
    /// Log records up to here may be gone: a master needs a snapshot at or past it.
    pub floor: u64,
}

impl Pointers {
    /// The record as stored: sealed, versioned.
    pub fn encode(&self) -> Vec<u8> {
        let payload = postcard::to_stdvec(self).expect("pointers serialize");
        envelope::seal(RecordKind::SnapshotPointers, POINTERS_VERSION, &payload)
    }

    /// Reads a stored record; refuses damage and newer layouts.
    pub fn decode(bytes: &[u8]) -> Result<Pointers, CompactionError> {
        let (_, payload) = envelope::open(RecordKind::SnapshotPointers, POINTERS_VERSION, bytes)
            .map_err(|e| CompactionError::Corrupt(format!("snapshot pointers: {e}")))?;
        postcard::from_bytes(payload).map_err(|e| CompactionError::Corrupt(format!("snapshot pointers: {e}")))
    }

    /// The pointers once `id` is published on top of these.
    fn after(&self, id: SnapshotId) -> Pointers {
        let fallback = self.latest;
        Pointers { latest: Some(id), fallback, floor: fallback.map_or(0, |f| f.applied) }
    }
}

/// Why snapshots could not be read, written or published.
#[derive(Debug, Error)]
pub enum CompactionError {
    /// The coordination store failed.
    #[error("coordination store: {0}")]
    Store(String),
    /// The snapshot store failed, or a snapshot is damaged.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// A record cannot be read as this build writes it.
    #[error("{0}")]
    Corrupt(String),
    /// No readable snapshot covers the log's floor: the group's state cannot be rebuilt here.
    #[error("no readable snapshot at or past the log's floor {floor} ({why})")]
    NoBase {
        /// The floor.
        floor: u64,
        /// What failed.
        why: String,
    },
    /// The log could not be replayed on top of the snapshot.
    #[error("the log could not be replayed on the snapshot: {0}")]
    Follow(#[from] FollowError),
    /// A snapshot entry did not import.
    #[error("snapshot entry does not import: {0}")]
    Import(#[from] crate::log::record::ReplayError),
}

fn store_error(e: MetaError) -> CompactionError {
    CompactionError::Store(e.to_string())
}

/// A group's snapshots: where they are written and how often.
#[derive(Clone)]
pub struct Snapshots {
    /// The coordination store (pointers, log).
    pub store: Arc<dyn MetaStore>,
    /// Where snapshot files go (shared by the cluster's masters).
    pub files: Arc<dyn SnapshotStore>,
    /// The cluster's keys.
    pub keys: ClusterKeys,
    /// A snapshot is due once the log has grown by this many records since the latest.
    pub every_records: u64,
    /// Encoded bytes per chunk.
    pub chunk_bytes: usize,
}

impl Snapshots {
    /// Snapshots of `keys`' cluster in `files`, every `every_records` records.
    pub fn new(
        store: Arc<dyn MetaStore>,
        files: Arc<dyn SnapshotStore>,
        keys: ClusterKeys,
        every_records: u64,
    ) -> Snapshots {
        Snapshots { store, files, keys, every_records: every_records.max(1), chunk_bytes: DEFAULT_CHUNK_BYTES }
    }

    fn log_keys(&self, rank: u32) -> LogKeys {
        LogKeys::new(self.keys.cluster(), rank)
    }

    /// Group `rank`'s pointers and their revision (0: none published yet).
    pub async fn pointers(&self, rank: u32) -> Result<(Pointers, Revision), CompactionError> {
        read_pointers(&*self.store, &self.keys, rank).await
    }

    /// The log position at which the next snapshot of a group is due, given its pointers and
    /// the objects it holds: `every_records` records after the latest, or more for a large
    /// group (half as many records as it has objects), so that writing the whole group's state
    /// costs at most about two entries per record logged.
    pub fn next_due(&self, pointers: &Pointers, objects: u64) -> u64 {
        pointers.latest.map_or(0, |l| l.applied) + self.every_records.max(objects / 2)
    }

    /// Writes `entries` as snapshot `id`, publishes it if it is newer than the latest, then
    /// deletes what it makes unneeded (older snapshots, batches below the new floor) and
    /// compacts the store's history. Returns the pointers now in force, or `None` if another
    /// master published a snapshot at least as new first (this one is deleted).
    pub async fn save(&self, id: SnapshotId, entries: Vec<Entry>) -> Result<Option<Pointers>, CompactionError> {
        let files = self.files.clone();
        let chunk = self.chunk_bytes;
        let started = std::time::Instant::now();
        let manifest = tokio::task::spawn_blocking(move || snapshot::write(&*files, id, entries, chunk))
            .await
            .map_err(|e| CompactionError::Corrupt(format!("snapshot writer: {e}")))??;
        let published = loop {
            let (current, revision) = self.pointers(id.group).await?;
            if current.latest.is_some_and(|l| l.applied >= id.applied) {
                break None;
            }
            let next = current.after(id);
            let key = self.keys.snapshots(id.group);
            let swapped = match revision {
                0 => self.store.create_if_absent(&key, &next.encode(), None).await,
                rev => self.store.compare_and_swap(&key, rev, &next.encode(), None).await,
            };
            match swapped {
                Ok(_) => break Some((next, revision)),
                Err(MetaError::CompareFailed { .. }) => continue,
                Err(e) => return Err(store_error(e)),
            }
        };
        let Some((pointers, previous)) = published else {
            tracing::info!(
                group = id.group,
                applied = id.applied,
                "a newer snapshot was published first; dropping this one"
            );
            let files = self.files.clone();
            let _ = tokio::task::spawn_blocking(move || files.delete(&id)).await;
            return Ok(None);
        };
        tracing::info!(
            group = id.group,
            applied = id.applied,
            records = manifest.records,
            chunks = manifest.chunks,
            took = ?started.elapsed(),
            floor = pointers.floor,
            "snapshot published"
        );
        self.prune(id.group, &pointers).await?;
        if previous > 0 {
            // History before the previous publication is no longer needed: a master that was
            // watching from before it reads the log again.
            if let Err(e) = self.store.compact(previous).await {
                tracing::warn!(error = %e, "could not compact the coordination store's history");
            }
        }
        Ok(Some(pointers))
    }

    /// Whether a snapshot of group `rank` may be published now: publishing one makes the
    /// latest the fallback, and cuts the log below it, so the latest must be held whole by at
    /// least `copies` masters (as far as the store can tell; a shared volume counts as every
    /// master's). Losing one master's disk then never loses the only base the log has left.
    /// The group's other masters keep a copy of the latest by themselves ([`Snapshots::keep_copy`]).
    pub async fn base_held(&self, rank: u32, copies: usize) -> Result<bool, CompactionError> {
        let (pointers, _) = self.pointers(rank).await?;
        let Some(base) = pointers.latest.filter(|_| copies > 1) else { return Ok(true) };
        let files = self.files.clone();
        let held = tokio::task::spawn_blocking(move || files.holders(&base))
            .await
            .map_err(|e| CompactionError::Corrupt(format!("snapshot holders: {e}")))?;
        if held.is_some_and(|n| n < copies) {
            tracing::debug!(
                group = rank,
                snapshot = base.applied,
                ?held,
                copies,
                "the latest snapshot lacks copies; not snapshotting yet"
            );
            return Ok(false);
        }
        Ok(true)
    }

    /// Keeps a whole copy of group `rank`'s latest snapshot here, fetching what this master
    /// lacks from the others (nothing to do with a shared volume, or a copy held already).
    pub async fn keep_copy(&self, rank: u32) -> Result<(), CompactionError> {
        let (pointers, _) = self.pointers(rank).await?;
        let Some(id) = pointers.latest else { return Ok(()) };
        if self.files.holds(&id) {
            return Ok(());
        }
        let files = self.files.clone();
        let read = tokio::task::spawn_blocking(move || snapshot::read(&*files, id, |_| Ok(())))
            .await
            .map_err(|e| CompactionError::Corrupt(format!("snapshot copy: {e}")))?;
        let manifest = read?;
        tracing::info!(
            group = rank,
            applied = id.applied,
            chunks = manifest.chunks,
            "kept a copy of the group's latest snapshot"
        );
        Ok(())
    }

    /// Deletes the snapshots older than `p`'s fallback and the batches wholly below its floor.
    async fn prune(&self, rank: u32, p: &Pointers) -> Result<(), CompactionError> {
        if let Some(oldest) = p.fallback.or(p.latest) {
            let files = self.files.clone();
            let gone = tokio::task::spawn_blocking(move || -> std::io::Result<usize> {
                let old: Vec<SnapshotId> =
                    files.list(rank)?.into_iter().filter(|s| s.applied < oldest.applied).collect();
                old.iter().try_for_each(|s| files.delete(s))?;
                Ok(old.len())
            })
            .await
            .map_err(|e| CompactionError::Corrupt(format!("snapshot pruning: {e}")))?
            .map_err(SnapshotError::Io)?;
            if gone > 0 {
                tracing::debug!(group = rank, gone, "older snapshots deleted");
            }
        }
        let deleted = delete_batches_below(&*self.store, &self.log_keys(rank), p.floor).await?;
        if deleted > 0 {
            tracing::debug!(group = rank, deleted, floor = p.floor, "log batches below the floor deleted");
        }
        Ok(())
    }

    /// Rebuilds group `rank` in `master` (which holds nothing of it) from the newest readable
    /// published snapshot: the latest, else the fallback. Returns the log position it stands
    /// at (0 with no snapshot and the log complete from its start). Fails when no snapshot at
    /// or past the floor can be read: the log alone no longer holds the group.
    pub async fn restore(&self, master: &Arc<Master>, rank: u32) -> Result<u64, CompactionError> {
        let (pointers, _) = self.pointers(rank).await?;
        let mut why = String::from("none published");
        for id in [pointers.latest, pointers.fallback].into_iter().flatten() {
            if id.applied < pointers.floor {
                continue;
            }
            let (files, into) = (self.files.clone(), master.clone());
            let read = tokio::task::spawn_blocking(move || {
                snapshot::read(&*files, id, |e| {
                    into.import(rank, e).map_err(|err| SnapshotError::Corrupt { id, why: format!("{err}") })
                })
            })
            .await
            .map_err(|e| CompactionError::Corrupt(format!("snapshot reader: {e}")))?;
            match read {
                Ok(m) => {
                    if let Some(g) = master.group(rank) {
                        g.note_applied(id.applied);
                    }
                    tracing::info!(group = rank, applied = id.applied, records = m.records, "restored from snapshot");
                    return Ok(id.applied);
                }
                Err(e) => {
                    tracing::error!(group = rank, snapshot = ?id, error = %e, "snapshot unreadable");
                    why = e.to_string();
                    master.reset_group(rank);
                }
            }
        }
        if pointers.floor == 0 {
            // Nothing was ever deleted: the log from its start holds everything.
            return Ok(0);
        }
        Err(CompactionError::NoBase { floor: pointers.floor, why })
    }

    /// A scratch master like `like`, holding group `rank` as of the log's durable prefix (the
    /// latest snapshot, then the log), for a primary to snapshot. Returns it with its position.
    pub async fn rebuild(&self, like: &Master, rank: u32) -> Result<(Arc<Master>, u64), CompactionError> {
        let scratch = Arc::new(like.scratch());
        scratch.stand_by(rank);
        let from = self.restore(&scratch, rank).await?;
        let mut follower = LogFollower::new(self.store.clone(), self.log_keys(rank), rank, from, 64);
        let at = {
            let mut apply = crate::cluster::standby::apply_to(&scratch, rank);
            follower.catch_up(&mut apply).await?
        };
        Ok((scratch, at))
    }
}

/// Group `rank`'s snapshot pointers in `store` and their revision (0: none published yet).
pub async fn read_pointers(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    rank: u32,
) -> Result<(Pointers, Revision), CompactionError> {
    match store.get(&keys.snapshots(rank)).await.map_err(store_error)?.kv {
        None => Ok((Pointers::default(), 0)),
        Some(kv) => Ok((Pointers::decode(&kv.value)?, kv.mod_revision)),
    }
}

/// Deletes the batches of `keys` that end at or below `floor`: every batch starting at or
/// below it except the last such one (which may run past it). Returns how many.
pub async fn delete_batches_below(store: &dyn MetaStore, keys: &LogKeys, floor: u64) -> Result<usize, CompactionError> {
    if floor == 0 {
        return Ok(0);
    }
    let mut doomed: Vec<Vec<u8>> = Vec::new();
    let mut req = RangeRequest::prefix(keys.batches(), 512).keys_only();
    'pages: loop {
        let page = store.range(req.clone()).await.map_err(store_error)?;
        for kv in &page.kvs {
            match keys.first_seq_of(&kv.key) {
                Some(f) if f <= floor => doomed.push(kv.key.clone()),
                Some(_) => break 'pages,
                None => {
                    return Err(CompactionError::Corrupt(format!("batch key {:?}", String::from_utf8_lossy(&kv.key))))
                }
            }
        }
        match req.next_page(&page) {
            Some(next) => req = next,
            None => break,
        }
    }
    // The last batch starting at or below the floor may hold records past it.
    doomed.pop();
    let per_txn = store.limits().max_txn_ops.max(1);
    for batch in doomed.chunks(per_txn) {
        let txn = Txn::new().and_then(batch.iter().map(|k| TxnOp::delete(k.clone())));
        store.txn(txn).await.map_err(store_error)?;
    }
    Ok(doomed.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::record::Record;
    use crate::log::snapshot::DirSnapshotStore;
    use crate::state::clock::ManualClock;
    use crate::state::config::MasterConfig;
    use tycho_meta::MemStore;
    use tycho_proto::{ClientId, SegmentDesc, SegmentId};

    /// A directory removed when dropped.
    struct Dir(std::path::PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn setup() -> (Dir, Arc<DirSnapshotStore>, Snapshots) {
        let dir =
            Dir(std::env::temp_dir().join(format!("tycho-compact-{}-{}", std::process::id(), rand::random::<u64>())));
        let files = Arc::new(DirSnapshotStore::new(&dir.0, "c"));
        let snaps = Snapshots::new(Arc::new(MemStore::new()), files.clone(), ClusterKeys::new("c"), 10);
        (dir, files, snaps)
    }

    fn id(applied: u64) -> SnapshotId {
        SnapshotId { group: 0, applied, epoch: 1, writer: applied }
    }

    /// A mount of segment `n` as the only entry.
    fn mount(n: u128) -> Vec<Entry> {
        let desc = SegmentDesc {
            id: SegmentId(n),
            name: format!("s{n}"),
            base: 0,
            size: 1 << 20,
            endpoint: format!("10.0.0.{n}:1"),
            host: "h".into(),
            incarnation: 1,
        };
        vec![Entry::Record(Record::Mount { client: ClientId(n), desc, reserved: Vec::new() })]
    }

    async fn batch_starts(snaps: &Snapshots) -> Vec<u64> {
        let keys = snaps.log_keys(0);
        let page = snaps.store.range(RangeRequest::prefix(keys.batches(), 0).keys_only()).await.unwrap();
        page.kvs
            .iter()
            .map(|kv| std::str::from_utf8(&kv.key[keys.batches().len()..]).unwrap().parse().unwrap())
            .collect()
    }

    #[test]
    fn pointers_are_sealed_and_newer_layouts_refused() {
        let p = Pointers { latest: Some(id(20)), fallback: Some(id(10)), floor: 10 };
        assert_eq!(Pointers::decode(&p.encode()).unwrap(), p);
        let newer = envelope::seal(RecordKind::SnapshotPointers, POINTERS_VERSION + 1, b"x");
        assert!(matches!(Pointers::decode(&newer), Err(CompactionError::Corrupt(_))));
        let mut damaged = p.encode();
        *damaged.last_mut().unwrap() ^= 1;
        assert!(matches!(Pointers::decode(&damaged), Err(CompactionError::Corrupt(_))));
    }

    #[tokio::test]
    async fn publications_move_the_floor_and_cut_the_log_and_old_snapshots_behind_it() {
        let (_dir, files, snaps) = setup();
        let keys = snaps.log_keys(0);
        // Batches of ten records: 1..=10, 11..=20, ...
        for first in [1u64, 11, 21, 31, 41] {
            snaps.store.put(&keys.batch(first), b"batch", None).await.unwrap();
        }
        let p = snaps.save(id(15), mount(1)).await.unwrap().unwrap();
        assert_eq!(p, Pointers { latest: Some(id(15)), fallback: None, floor: 0 });
        assert_eq!(batch_starts(&snaps).await, vec![1, 11, 21, 31, 41], "nothing is cut below a floor of 0");
        let p = snaps.save(id(35), mount(1)).await.unwrap().unwrap();
        assert_eq!(p, Pointers { latest: Some(id(35)), fallback: Some(id(15)), floor: 15 });
        // The batch at 11 holds records past 15: kept.
        assert_eq!(batch_starts(&snaps).await, vec![11, 21, 31, 41]);
        let p = snaps.save(id(45), mount(1)).await.unwrap().unwrap();
        assert_eq!(p.floor, 35);
        assert_eq!(batch_starts(&snaps).await, vec![31, 41]);
        assert_eq!(files.list(0).unwrap(), vec![id(35), id(45)], "snapshots older than the fallback are gone");
        // A snapshot no newer than the latest is not published, and its files go.
        assert!(snaps.save(id(40), mount(1)).await.unwrap().is_none());
        assert_eq!(files.list(0).unwrap(), vec![id(35), id(45)]);
        assert_eq!(snaps.pointers(0).await.unwrap().0.latest, Some(id(45)));
        assert_eq!(snaps.next_due(&p, 0), 55, "every 10 records");
        assert_eq!(snaps.next_due(&p, 40), 65, "a group of 40 objects: every 20 records");
    }

    #[tokio::test]
    async fn a_restore_falls_back_past_a_damaged_latest_and_fails_without_a_readable_base() {
        let (_dir, files, snaps) = setup();
        let master = || Arc::new(Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1_000))));
        let fresh = master();
        assert_eq!(snaps.restore(&fresh, 0).await.unwrap(), 0, "nothing published: the log from its start");
        snaps.save(id(10), mount(1)).await.unwrap().unwrap();
        snaps.save(id(20), mount(2)).await.unwrap().unwrap();
        let m = master();
        assert_eq!(snaps.restore(&m, 0).await.unwrap(), 20);
        assert_eq!(m.list_segments().iter().map(|s| s.desc.id).collect::<Vec<_>>(), vec![SegmentId(2)]);
        assert_eq!(m.group(0).unwrap().applied(), 20);
        // The latest damaged: the fallback, and nothing of the damaged one.
        let mut chunk = files.get(&id(20), "chunk-000000").unwrap().unwrap();
        *chunk.last_mut().unwrap() ^= 1;
        files.put(&id(20), "chunk-000000", &chunk).unwrap();
        let m = master();
        assert_eq!(snaps.restore(&m, 0).await.unwrap(), 10);
        assert_eq!(m.list_segments().iter().map(|s| s.desc.id).collect::<Vec<_>>(), vec![SegmentId(1)]);
        // Both unreadable: the log below the floor is gone, so no restore at all.
        files.delete(&id(10)).unwrap();
        let m = master();
        assert!(matches!(snaps.restore(&m, 0).await, Err(CompactionError::NoBase { floor: 10, .. })));
        assert!(m.list_segments().is_empty());
    }
}
