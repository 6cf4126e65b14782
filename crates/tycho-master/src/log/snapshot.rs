//! Group snapshots: a KVPT group's state at one position of its log, written as the
//! apply-path records that rebuild it (a snapshot import replays them like a standby replays
//! the log), sealed in chunks, in a store that the cluster's masters share.
//!
//! ```text
//! {root}/{cluster}/g{rank:05}/{applied:020}-e{epoch}-w{writer:016x}/chunk-{index:06}   sealed SnapshotChunk
//! {root}/{cluster}/g{rank:05}/{applied:020}-e{epoch}-w{writer:016x}/manifest          sealed Manifest (last)
//! ```
//!
//! Each chunk and the manifest are sealed in the versioned, checksummed envelope; the manifest
//! names the snapshot's group, epoch, log position and chunk and record counts, and is written
//! after every chunk, so a snapshot without one is incomplete and never read. Files are written
//! to a temporary name, synced and renamed into place. The store is a trait so that an object
//! store can replace the shared directory later. Which snapshot is `latest` is decided in the
//! coordination store, not here: this module only writes, reads and deletes them.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_proto::envelope::{self, EnvelopeError, RecordKind};

use tycho_proto::SegmentId;

use crate::log::record::Record;

/// Newest layout version of chunks and manifests. A chunk's version is its records' newest
/// layout less one: version 1 holds records of layout 2, version 2 task records too (layout
/// 3), version 3 fan-out's (layout 4). A chunk is written at the oldest version that holds it.
pub const SNAPSHOT_VERSION: u16 = 3;

/// Default most encoded record bytes per chunk.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Which snapshot: of which group, taken where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SnapshotId {
    /// The group's rank.
    pub group: u32,
    /// The last log record the snapshot includes.
    pub applied: u64,
    /// The group's epoch when it was taken.
    pub epoch: u64,
    /// Chosen at random by the master that writes it: two masters that snapshot the same
    /// position never write into each other's files.
    pub writer: u64,
}

impl SnapshotId {
    /// A new snapshot of group `group` at `applied` under `epoch`, by this writer.
    pub fn new(group: u32, applied: u64, epoch: u64) -> SnapshotId {
        SnapshotId { group, applied, epoch, writer: rand::random() }
    }
}

/// What a complete snapshot holds, written after its chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The snapshot.
    pub id: SnapshotId,
    /// Chunks, numbered from 0.
    pub chunks: u32,
    /// Records in all chunks.
    pub records: u64,
}

/// One entry of a snapshot: together, in order, they rebuild the group's state on a master
/// that holds nothing of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Entry {
    /// An apply-path record, replayed as the log's records are.
    Record(Record),
    /// Where a mounted segment's generations had got to: later allocations must not reuse a
    /// generation a reader may still hold for a range freed before the snapshot.
    NextGen {
        /// The segment.
        segment: SegmentId,
        /// Its incarnation.
        incarnation: u32,
        /// The generation its next allocation takes.
        next_gen: u32,
    },
    /// Ranges of unfinished writes on a segment that went away (offset, bytes, until Unix
    /// ms): they stay reserved if its owner mounts it again before then.
    Orphans {
        /// The segment.
        segment: SegmentId,
        /// The ranges.
        ranges: Vec<(u64, u64, u64)>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
struct Chunk {
    id: SnapshotId,
    index: u32,
    records: Vec<Entry>,
}

/// Why a snapshot could not be written or read.
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// The store failed.
    #[error("snapshot store: {0}")]
    Io(#[from] std::io::Error),
    /// A chunk or the manifest is damaged, of another kind or of a newer version.
    #[error("snapshot {id:?}: {why}")]
    Corrupt {
        /// The snapshot.
        id: SnapshotId,
        /// What is wrong.
        why: String,
    },
    /// The snapshot has no manifest: it was never completed.
    #[error("snapshot {0:?} is incomplete")]
    Incomplete(SnapshotId),
}

/// Where snapshots live: shared by the cluster's masters.
pub trait SnapshotStore: Send + Sync {
    /// Writes `bytes` as `file` of snapshot `id` (replacing it whole, never in part).
    fn put(&self, id: &SnapshotId, file: &str, bytes: &[u8]) -> std::io::Result<()>;
    /// Reads `file` of snapshot `id` (`None` if absent).
    fn get(&self, id: &SnapshotId, file: &str) -> std::io::Result<Option<Vec<u8>>>;
    /// The snapshots of group `group` with at least a file, in log order.
    fn list(&self, group: u32) -> std::io::Result<Vec<SnapshotId>>;
    /// Deletes snapshot `id` whole.
    fn delete(&self, id: &SnapshotId) -> std::io::Result<()>;

    /// How many masters hold snapshot `id` whole, when the store can tell (`None`: it cannot,
    /// or every master reads the same files, a shared volume).
    fn holders(&self, _id: &SnapshotId) -> Option<usize> {
        None
    }

    /// Whether this master holds snapshot `id` whole without fetching it (a shared volume:
    /// always).
    fn holds(&self, _id: &SnapshotId) -> bool {
        true
    }
}

/// A [`SnapshotStore`] in a directory (local, or a shared volume every master mounts).
#[derive(Debug, Clone)]
pub struct DirSnapshotStore {
    root: PathBuf,
}

impl DirSnapshotStore {
    /// The snapshots of cluster `cluster` under `root`.
    pub fn new(root: &Path, cluster: &str) -> DirSnapshotStore {
        DirSnapshotStore { root: root.join(cluster) }
    }

    fn group_dir(&self, group: u32) -> PathBuf {
        self.root.join(format!("g{group:05}"))
    }

    fn dir(&self, id: &SnapshotId) -> PathBuf {
        self.group_dir(id.group).join(format!("{:020}-e{}-w{:016x}", id.applied, id.epoch, id.writer))
    }

    /// Whether `file` of snapshot `id` is here (without reading it).
    pub fn has(&self, id: &SnapshotId, file: &str) -> bool {
        self.dir(id).join(file).is_file()
    }

    /// Bytes of every snapshot file here (all groups).
    pub fn bytes(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            match std::fs::read_dir(p) {
                Ok(entries) => entries
                    .flatten()
                    .map(|e| match e.file_type() {
                        Ok(t) if t.is_dir() => walk(&e.path()),
                        Ok(_) => e.metadata().map_or(0, |m| m.len()),
                        Err(_) => 0,
                    })
                    .sum(),
                Err(_) => 0,
            }
        }
        walk(&self.root)
    }
}

impl SnapshotStore for DirSnapshotStore {
    fn put(&self, id: &SnapshotId, file: &str, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let dir = self.dir(id);
        std::fs::create_dir_all(&dir)?;
        let tmp = dir.join(format!(".{file}.tmp"));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(file))?;
        // The rename itself is durable once the directory is synced.
        std::fs::File::open(&dir)?.sync_all()
    }

    fn get(&self, id: &SnapshotId, file: &str) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.dir(id).join(file)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn list(&self, group: u32) -> std::io::Result<Vec<SnapshotId>> {
        let entries = match std::fs::read_dir(self.group_dir(group)) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for entry in entries {
            let name = entry?.file_name();
            // Names this module did not write are not snapshots.
            let parts = name.to_str().and_then(|n| {
                let (applied, rest) = n.split_once("-e")?;
                let (epoch, writer) = rest.split_once("-w")?;
                Some((applied.parse().ok()?, epoch.parse().ok()?, u64::from_str_radix(writer, 16).ok()?))
            });
            if let Some((applied, epoch, writer)) = parts {
                out.push(SnapshotId { group, applied, epoch, writer });
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete(&self, id: &SnapshotId) -> std::io::Result<()> {
        match std::fs::remove_dir_all(self.dir(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The name of a snapshot's manifest (its chunks are `chunk-NNNNNN`).
pub const MANIFEST: &str = "manifest";

/// The name of chunk `index` of a snapshot.
pub fn chunk_file(index: u32) -> String {
    format!("chunk-{index:06}")
}

/// Seals a chunk or manifest at `version`: the oldest that holds it, so that a master of an
/// older build reads what it can.
fn seal<T: Serialize>(value: &T, version: u16) -> Vec<u8> {
    envelope::seal(RecordKind::SnapshotChunk, version, &postcard::to_stdvec(value).expect("snapshots serialize"))
}

fn open<T: for<'de> Deserialize<'de>>(id: &SnapshotId, bytes: &[u8]) -> Result<T, SnapshotError> {
    let corrupt = |why: String| SnapshotError::Corrupt { id: *id, why };
    let (_, payload) = envelope::open(RecordKind::SnapshotChunk, SNAPSHOT_VERSION, bytes)
        .map_err(|e: EnvelopeError| corrupt(e.to_string()))?;
    postcard::from_bytes(payload).map_err(|e| corrupt(e.to_string()))
}

/// Checks that `bytes` are a sound file of a snapshot (its kind, a version this build reads,
/// its checksum), without decoding it.
pub fn check_file(id: &SnapshotId, bytes: &[u8]) -> Result<(), SnapshotError> {
    envelope::open(RecordKind::SnapshotChunk, SNAPSHOT_VERSION, bytes)
        .map(drop)
        .map_err(|e: EnvelopeError| SnapshotError::Corrupt { id: *id, why: e.to_string() })
}

/// The number of chunks the manifest `bytes` of snapshot `id` lists.
pub fn manifest_chunks(id: &SnapshotId, bytes: &[u8]) -> Result<u32, SnapshotError> {
    let manifest: Manifest = open(id, bytes)?;
    if manifest.id != *id {
        return Err(SnapshotError::Corrupt { id: *id, why: format!("the manifest describes {:?}", manifest.id) });
    }
    Ok(manifest.chunks)
}

/// Writes snapshot `id` of `entries` in chunks of about `chunk_bytes` encoded bytes, then its
/// manifest. Returns the manifest.
pub fn write(
    store: &dyn SnapshotStore,
    id: SnapshotId,
    entries: impl IntoIterator<Item = Entry>,
    chunk_bytes: usize,
) -> Result<Manifest, SnapshotError> {
    let (mut index, mut total) = (0u32, 0u64);
    let (mut pending, mut bytes) = (Vec::new(), 0usize);
    let flush = |pending: &mut Vec<Entry>, index: &mut u32| -> Result<(), SnapshotError> {
        let chunk = Chunk { id, index: *index, records: std::mem::take(pending) };
        // Chunk version 1 holds records of layout 2, version 2 those of layout 3, and so on.
        let layout = chunk.records.iter().filter_map(|e| match e {
            Entry::Record(r) => Some(r.layout()),
            _ => None,
        });
        let version = layout.max().unwrap_or(2) - 1;
        store.put(&id, &chunk_file(*index), &seal(&chunk, version))?;
        *index += 1;
        Ok(())
    };
    for rec in entries {
        bytes += postcard::serialize_with_flavor(&rec, postcard::ser_flavors::Size::default()).unwrap_or(0);
        pending.push(rec);
        total += 1;
        if bytes >= chunk_bytes.max(1) {
            flush(&mut pending, &mut index)?;
            bytes = 0;
        }
    }
    if !pending.is_empty() || index == 0 {
        flush(&mut pending, &mut index)?;
    }
    let manifest = Manifest { id, chunks: index, records: total };
    store.put(&id, MANIFEST, &seal(&manifest, 1))?;
    Ok(manifest)
}

/// Reads complete snapshot `id`, checking its manifest and every chunk (group, position,
/// numbering, counts), and hands its entries to `apply` in order.
pub fn read(
    store: &dyn SnapshotStore,
    id: SnapshotId,
    mut apply: impl FnMut(&Entry) -> Result<(), SnapshotError>,
) -> Result<Manifest, SnapshotError> {
    let corrupt = |why: String| SnapshotError::Corrupt { id, why };
    let Some(bytes) = store.get(&id, MANIFEST)? else { return Err(SnapshotError::Incomplete(id)) };
    let manifest: Manifest = open(&id, &bytes)?;
    if manifest.id != id {
        return Err(corrupt(format!("the manifest describes {:?}", manifest.id)));
    }
    let mut seen = 0u64;
    for index in 0..manifest.chunks {
        let bytes = store.get(&id, &chunk_file(index))?.ok_or_else(|| corrupt(format!("chunk {index} is missing")))?;
        let chunk: Chunk = open(&id, &bytes)?;
        if chunk.id != id || chunk.index != index {
            return Err(corrupt(format!("chunk file {index} holds chunk {} of {:?}", chunk.index, chunk.id)));
        }
        for rec in &chunk.records {
            apply(rec)?;
        }
        seen += chunk.records.len() as u64;
    }
    if seen != manifest.records {
        return Err(corrupt(format!("{seen} records in the chunks, {} in the manifest", manifest.records)));
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tycho_proto::ClientId;

    fn rec(i: u64) -> Entry {
        Entry::Record(Record::WriteRevoke {
            key: format!("key/{i}").into_bytes(),
            writer: ClientId(i as u128),
            write_id: i,
        })
    }

    fn store() -> (tempdir::Dir, DirSnapshotStore) {
        let dir = tempdir::Dir::new();
        let s = DirSnapshotStore::new(dir.path(), "c");
        (dir, s)
    }

    /// A directory removed when dropped.
    mod tempdir {
        pub struct Dir(std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p =
                    std::env::temp_dir().join(format!("tycho-snap-{}-{}", std::process::id(), rand::random::<u64>()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
            pub fn path(&self) -> &std::path::Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn read_all(s: &DirSnapshotStore, id: SnapshotId) -> Result<Vec<Entry>, SnapshotError> {
        let mut out = Vec::new();
        read(s, id, |r| {
            out.push(r.clone());
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn a_snapshot_reads_back_in_order_across_chunks() {
        let (_d, s) = store();
        let id = SnapshotId { group: 0, applied: 42, epoch: 3, writer: 0 };
        let records: Vec<Entry> = (0..1000).map(rec).collect();
        let m = write(&s, id, records.clone(), 2048).unwrap();
        assert!(m.chunks > 5, "{m:?}");
        assert_eq!(m.records, 1000);
        assert_eq!(read_all(&s, id).unwrap(), records);
        let empty = SnapshotId { group: 0, applied: 7, epoch: 1, writer: 0 };
        assert_eq!(write(&s, empty, Vec::new(), 2048).unwrap().chunks, 1);
        assert!(read_all(&s, empty).unwrap().is_empty());
        assert_eq!(s.list(0).unwrap(), vec![empty, id]);
        s.delete(&id).unwrap();
        assert_eq!(s.list(0).unwrap(), vec![empty]);
    }

    #[test]
    fn damaged_missing_or_unfinished_snapshots_are_refused() {
        let (_d, s) = store();
        let id = SnapshotId { group: 1, applied: 9, epoch: 2, writer: 0 };
        write(&s, id, (0..300).map(rec), 1024).unwrap();
        // A flipped byte in a chunk.
        let mut chunk = s.get(&id, &chunk_file(1)).unwrap().unwrap();
        let last = chunk.len() - 1;
        chunk[last] ^= 1;
        s.put(&id, &chunk_file(1), &chunk).unwrap();
        assert!(matches!(read_all(&s, id), Err(SnapshotError::Corrupt { .. })));
        // A chunk of another snapshot in its place.
        let other = SnapshotId { group: 1, applied: 10, epoch: 2, writer: 0 };
        write(&s, other, (0..300).map(rec), 1024).unwrap();
        s.put(&id, &chunk_file(1), &s.get(&other, &chunk_file(1)).unwrap().unwrap()).unwrap();
        assert!(matches!(read_all(&s, id), Err(SnapshotError::Corrupt { .. })));
        // A missing chunk.
        std::fs::remove_file(s.dir(&other).join(chunk_file(0))).unwrap();
        assert!(matches!(read_all(&s, other), Err(SnapshotError::Corrupt { .. })));
        // No manifest: never completed.
        let unfinished = SnapshotId { group: 1, applied: 11, epoch: 2, writer: 0 };
        s.put(&unfinished, &chunk_file(0), b"partial").unwrap();
        assert!(matches!(read_all(&s, unfinished), Err(SnapshotError::Incomplete(_))));
        // A newer layout is refused, not guessed at.
        let newer = envelope::seal(RecordKind::SnapshotChunk, SNAPSHOT_VERSION + 1, b"x");
        s.put(&unfinished, MANIFEST, &newer).unwrap();
        assert!(matches!(read_all(&s, unfinished), Err(SnapshotError::Corrupt { .. })));
    }
}
