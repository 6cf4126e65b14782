//! The durable mutations of a KVPT group, as records.
//!
//! Every change to a group's metadata that must survive its master — a write's reservation, its
//! commit or revocation, a removal, an eviction, a segment's mount or unmount — is one
//! [`Record`]. A record says what happened, never what to decide: the primary decides (checks
//! ownership, conflicts, leases, liveness) and then applies the record, a standby replays the
//! same records in the same order, and a snapshot import replays them too. So a record carries
//! what its effect depends on (exact ranges with their generations, times). Not yet everything:
//! applying a commit or a replica drop still reads the applier's segment liveness, and replay
//! still defers ranges by the applier's clock (which only housekeeping releases); both can make
//! a standby diverge from its primary, and are to be replaced by explicit records (the state of
//! issue 12 in docs/architecture.md).
//!
//! Records travel in [`RecordBatch`]es: consecutive sequence numbers of one group under one
//! epoch, sealed in a versioned, checksummed envelope (`tycho_proto::envelope`). A reader
//! refuses a batch of a newer layout, a damaged one, or one whose numbering does not continue
//! its log.

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_proto::envelope::{self, EnvelopeError, RecordKind};
use tycho_proto::{ClientId, ErrorCode, SegmentDesc, SegmentId};

/// Layout version of [`RecordBatch`] this build writes and the only one it reads.
pub const RECORD_VERSION: u16 = 4;

/// A replica's range as the log names it: enough to reserve exactly the same bytes under the
/// same generation on replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeRec {
    /// The segment.
    pub segment: SegmentId,
    /// Its mount incarnation.
    pub incarnation: u32,
    /// Byte offset inside the segment.
    pub offset: u64,
    /// Bytes reserved (rounded up to the segment's block size).
    pub reserved: u64,
    /// Bytes of the value.
    pub len: u64,
    /// Generation the writer stamps on the range.
    pub gen: u32,
}

/// Pin state a write gives its object on commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinsRec {
    /// Soft-pin TTL applied on commit, ms.
    pub soft_pin_ttl_ms: Option<u64>,
    /// Keep the object's current soft pin.
    pub preserve_soft_pin: bool,
    /// Never evict.
    pub hard_pin: bool,
}

/// One durable mutation of a group. Keys are storage keys (tenant and key,
/// `tycho_routing::encode_object_key`); times are Unix milliseconds (each master converts them
/// to and from its own monotonic clock).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// A write started (PutStart / UpsertStart): its ranges are reserved for its writer, so
    /// that whoever applies the log knows which bytes a writer may still be copying into.
    WriteStart {
        /// Storage key.
        key: Vec<u8>,
        /// Upsert (replace) rather than put-if-absent.
        upsert: bool,
        /// The writing client.
        writer: ClientId,
        /// The writer's id for this write.
        write_id: u64,
        /// When it started (Unix ms).
        started_ms: u64,
        /// Size of the value.
        size: u64,
        /// Pins the object takes on commit.
        pins: PinsRec,
        /// The reserved ranges, one per replica.
        replicas: Vec<RangeRec>,
    },
    /// The write committed (PutEnd / UpsertEnd); the value it replaced is gone.
    WriteEnd {
        /// Storage key.
        key: Vec<u8>,
        /// The writing client.
        writer: ClientId,
        /// The writer's id for this write.
        write_id: u64,
        /// When it committed (Unix ms): soft pins count from here.
        at_ms: u64,
        /// Segments whose replicas of the write the commit left out, as dead: the primary's
        /// decision, so that a replay decides alike whatever it sees of those segments (an
        /// unmount racing the commit may sit on either side of it in the log).
        dropped: Vec<SegmentId>,
    },
    /// The writer revoked its write: its ranges are free.
    WriteRevoke {
        /// Storage key.
        key: Vec<u8>,
        /// The writing client.
        writer: ClientId,
        /// The writer's id for this write.
        write_id: u64,
    },
    /// A write dropped without its writer's word (pre-empted, abandoned, or every segment it
    /// wrote to died): its ranges stay reserved until `release_at_ms`, as its writer may still
    /// be copying into them.
    WriteDrop {
        /// Storage key.
        key: Vec<u8>,
        /// The writing client.
        writer: ClientId,
        /// The writer's id for this write.
        write_id: u64,
        /// When its ranges may be reused (Unix ms).
        release_at_ms: u64,
    },
    /// An object removed (Remove and its batch, regex and all forms, a replica clear of its
    /// last replicas) or evicted.
    Remove {
        /// Storage key.
        key: Vec<u8>,
        /// When (Unix ms).
        at_ms: u64,
        /// By eviction rather than by a client.
        evicted: bool,
    },
    /// The replicas of an object on one segment dropped (a replica clear naming the segment,
    /// the sweep of a segment that went away); the object goes when none is left.
    DropReplicas {
        /// Storage key.
        key: Vec<u8>,
        /// The segment.
        segment: SegmentId,
    },
    /// A segment mounted for `client`, with ranges reserved from the start (ranges an earlier
    /// incarnation's writers may still write: offset, bytes, release time).
    Mount {
        /// The owner.
        client: ClientId,
        /// As the owner described it.
        desc: SegmentDesc,
        /// Reserved ranges: offset, bytes, until (Unix ms).
        reserved: Vec<(u64, u64, u64)>,
    },
    /// A segment unmounted (by its owner, an admin, or its owner's expiry): its replicas die.
    Unmount {
        /// The segment.
        segment: SegmentId,
    },
    /// A change of the group's copy and move tasks (layout version 3 on).
    Task(crate::log::task_record::TaskRecord),
    /// A task's copy of the current value started (layout version 3 on): its ranges are
    /// reserved for the task's client, as a write's are for its writer. It ends as a
    /// [`Record::CopyEnd`], or as a write does otherwise ([`Record::WriteRevoke`],
    /// [`Record::WriteDrop`]).
    CopyStart {
        /// Storage key.
        key: Vec<u8>,
        /// The client that copies.
        writer: ClientId,
        /// Its id for this copy.
        write_id: u64,
        /// When it started (Unix ms).
        started_ms: u64,
        /// The task.
        task: crate::log::task_record::TaskId,
        /// The version of the value copied.
        version: u64,
        /// A move's source segment, whose replica the end drops.
        source: Option<SegmentId>,
        /// The reserved ranges, one per target.
        replicas: Vec<RangeRec>,
    },
    /// A task's copy committed (layout version 3 on): its ranges are replicas of the value, and
    /// a move's source replica is gone.
    CopyEnd {
        /// Storage key.
        key: Vec<u8>,
        /// The client that copied.
        writer: ClientId,
        /// Its id for this copy.
        write_id: u64,
        /// Segments whose ranges the commit left out, as dead (see [`Record::WriteEnd`]).
        dropped: Vec<SegmentId>,
    },
    /// The object's replicas on these segments are dynamic (layout version 4 on): fan-out
    /// made them, and eviction drops them before the object. Snapshots and exports carry the
    /// marks so; the log needs no such record (the `CopyEnd` of a task that holds a lease
    /// marks its replicas).
    DynamicReplicas {
        /// Storage key.
        key: Vec<u8>,
        /// The segments.
        segments: Vec<SegmentId>,
    },
    /// Fan-out may not add a replica of the object before `until_ms` (layout version 4 on):
    /// eviction just reclaimed one.
    Cooldown {
        /// Storage key.
        key: Vec<u8>,
        /// Until when (Unix ms).
        until_ms: u64,
    },
}

impl Record {
    /// The oldest layout version that holds the record: 2, 3 for tasks and their copies, 4 for
    /// fan-out's leases, dynamic replicas and cooldowns. A batch or snapshot chunk is written
    /// at the newest version among its records, so that a master of an older build follows
    /// what it can and refuses the rest.
    pub fn layout(&self) -> u16 {
        use crate::log::task_record::TaskRecord;
        match self {
            Record::Task(TaskRecord::Leased(_) | TaskRecord::LeaseDropped { .. })
            | Record::DynamicReplicas { .. }
            | Record::Cooldown { .. } => 4,
            Record::Task(_) | Record::CopyStart { .. } | Record::CopyEnd { .. } => 3,
            _ => 2,
        }
    }

    /// The storage key the record changes; `None` for a record of a segment.
    pub fn key(&self) -> Option<&[u8]> {
        match self {
            Record::WriteStart { key, .. }
            | Record::WriteEnd { key, .. }
            | Record::WriteRevoke { key, .. }
            | Record::WriteDrop { key, .. }
            | Record::Remove { key, .. }
            | Record::DropReplicas { key, .. }
            | Record::CopyStart { key, .. }
            | Record::CopyEnd { key, .. }
            | Record::DynamicReplicas { key, .. }
            | Record::Cooldown { key, .. } => Some(key),
            Record::Mount { .. } | Record::Unmount { .. } | Record::Task(_) => None,
        }
    }
}

/// Resolves once a record is durable; an error means it never will be, and the mutation must
/// not be acknowledged.
pub type DurableFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ErrorCode>> + Send>>;

/// Where a primary's records go, in the order it applies them: the group's OpLog writer, or a
/// test's recorder. `append` is called under the lock of the key's shard, so it must not block
/// on anything that takes a shard lock, and it must not refuse a record for lack of room
/// (admission is checked before the decision): the record is applied already.
pub trait RecordSink: Send + Sync {
    /// Takes the next record; returns its sequence number in the log.
    fn append(&self, rec: Record) -> u64;

    /// Resolves once record `seq` is durable.
    fn durable(&self, seq: u64) -> DurableFuture;

    /// The sequence number of the last record taken (0: none yet). An answer that reports an
    /// earlier mutation (a retried PutEnd) waits until everything up to it is durable.
    fn appended(&self) -> u64;

    /// The sequence number of the last durable record (0: none known; a reader then waits
    /// through [`RecordSink::durable`]).
    fn committed(&self) -> u64 {
        0
    }

    /// Whether a mutation may be decided now (checked before the decision: a record that is
    /// applied must then be taken). A full log answers a retryable busy code.
    fn admit(&self) -> Result<(), ErrorCode> {
        Ok(())
    }
}

/// Consecutive records of one group's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordBatch {
    /// The group's rank.
    pub group: u32,
    /// The ownership epoch the records were committed under.
    pub epoch: u64,
    /// Sequence number of the first record (the first record of a log is 1).
    pub first_seq: u64,
    /// The records, numbered `first_seq` on.
    pub records: Vec<Record>,
}

/// Why bytes are not a batch this reader can apply.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecordError {
    /// The envelope is damaged or of another kind or version.
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    /// The envelope is sound but its payload is not a batch of this version.
    #[error("malformed record batch: {0}")]
    Malformed(String),
    /// An empty batch, one of more than [`MAX_BATCH_RECORDS`], or a first sequence number of 0.
    #[error("record batch numbering is invalid (first {first_seq}, {count} records)")]
    Numbering {
        /// First sequence number stated.
        first_seq: u64,
        /// Records in the batch.
        count: usize,
    },
}

/// Most records in one batch: writers never make bigger ones, readers refuse them, and a
/// follower resuming inside a batch looks this far back for it.
pub const MAX_BATCH_RECORDS: usize = 1024;

impl RecordBatch {
    /// Sequence number of the last record.
    pub fn last_seq(&self) -> u64 {
        self.first_seq + self.records.len() as u64 - 1
    }

    /// The batch sealed for storage, at the oldest version that holds it ([`Record::layout`]),
    /// so that a master of an older build follows what it can.
    pub fn encode(&self) -> Vec<u8> {
        let payload = postcard::to_stdvec(self).expect("records always serialize");
        let version = self.records.iter().map(Record::layout).max().unwrap_or(2);
        envelope::seal(RecordKind::OpLogBatch, version, &payload)
    }

    /// Opens a stored batch; refuses newer layouts, damage, and invalid numbering.
    pub fn decode(bytes: &[u8]) -> Result<RecordBatch, RecordError> {
        let (version, payload) = envelope::open(RecordKind::OpLogBatch, RECORD_VERSION, bytes)?;
        // Version 1 (a WriteEnd without its dropped segments) was never released: refused.
        // Versions 2 and 3 are version 4 without its newer records: read alike.
        if version < 2 {
            return Err(RecordError::Envelope(EnvelopeError::UnknownVersion {
                found: version,
                newest: RECORD_VERSION,
            }));
        }
        let batch: RecordBatch = postcard::from_bytes(payload).map_err(|e| RecordError::Malformed(e.to_string()))?;
        let count = batch.records.len();
        if count == 0
            || count > MAX_BATCH_RECORDS
            || batch.first_seq == 0
            || batch.first_seq.checked_add(count as u64).is_none()
        {
            return Err(RecordError::Numbering { first_seq: batch.first_seq, count });
        }
        Ok(batch)
    }
}

/// Why a record could not be replayed: the replaying state has diverged from the primary's.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ReplayError {
    /// The record names a write that is not the one pending on its key.
    #[error("record {0} names a write that is not pending")]
    NoSuchWrite(&'static str),
    /// The record names an object that does not exist.
    #[error("record {0} names an object that does not exist")]
    NoSuchObject(&'static str),
    /// A range the record reserves is not free, or its segment is not mounted.
    #[error("cannot reserve {segment} at {offset}: {why}")]
    Range {
        /// The segment.
        segment: SegmentId,
        /// Offset of the range.
        offset: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// A mount the primary made is refused here.
    #[error("mount of {0} refused: {1:?}")]
    Mount(SegmentId, ErrorCode),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RecordBatch {
        let range = RangeRec { segment: SegmentId(7), incarnation: 2, offset: 4096, reserved: 8192, len: 5000, gen: 9 };
        RecordBatch {
            group: 3,
            epoch: 12,
            first_seq: 41,
            records: vec![
                Record::Mount {
                    client: ClientId(5),
                    desc: SegmentDesc {
                        id: SegmentId(7),
                        name: "seg".into(),
                        base: 0,
                        size: 1 << 30,
                        endpoint: "127.0.0.1:9".into(),
                        host: "h".into(),
                        incarnation: 2,
                    },
                    reserved: vec![(0, 4096, 77)],
                },
                Record::WriteStart {
                    key: b"\x01tkey".to_vec(),
                    upsert: false,
                    writer: ClientId(5),
                    write_id: 99,
                    started_ms: 1000,
                    size: 5000,
                    pins: PinsRec { soft_pin_ttl_ms: Some(60_000), preserve_soft_pin: false, hard_pin: true },
                    replicas: vec![range],
                },
                Record::WriteEnd {
                    key: b"\x01tkey".to_vec(),
                    writer: ClientId(5),
                    write_id: 99,
                    at_ms: 1005,
                    dropped: vec![SegmentId(8)],
                },
                Record::WriteRevoke { key: b"k".to_vec(), writer: ClientId(5), write_id: 3 },
                Record::WriteDrop { key: b"k".to_vec(), writer: ClientId(6), write_id: 4, release_at_ms: 9 },
                Record::Remove { key: b"\x01tkey".to_vec(), at_ms: 2000, evicted: true },
                Record::DropReplicas { key: b"k".to_vec(), segment: SegmentId(7) },
                Record::Unmount { segment: SegmentId(7) },
            ],
        }
    }

    #[test]
    fn a_batch_survives_encoding() {
        let b = sample();
        assert_eq!(b.last_seq(), 48);
        assert_eq!(RecordBatch::decode(&b.encode()), Ok(b));
    }

    #[test]
    fn a_version_2_batch_reads_as_before_and_a_task_record_needs_version_3() {
        let b = sample();
        let v2 = envelope::seal(RecordKind::OpLogBatch, 2, &postcard::to_stdvec(&b).unwrap());
        assert_eq!(RecordBatch::decode(&v2), Ok(b.clone()));
        let v1 = envelope::seal(RecordKind::OpLogBatch, 1, &postcard::to_stdvec(&b).unwrap());
        assert!(RecordBatch::decode(&v1).is_err(), "version 1 was never released");
        let task =
            crate::log::task_record::TaskRecord::Forgotten { ids: vec![crate::log::task_record::TaskId::new(0, 9)] };
        let plain = b.encode();
        assert_eq!(u16::from_le_bytes([plain[5], plain[6]]), 2, "an older build still reads it");
        let with_task = RecordBatch { records: vec![Record::Task(task)], ..b };
        let sealed = with_task.encode();
        assert_eq!(u16::from_le_bytes([sealed[5], sealed[6]]), 3);
        assert_eq!(RecordBatch::decode(&sealed), Ok(with_task.clone()));
        // Fan-out's records need version 4.
        let cooldown = Record::Cooldown { key: b"k".to_vec(), until_ms: 5 };
        let dynamic = Record::DynamicReplicas { key: b"k".to_vec(), segments: vec![SegmentId(7)] };
        for rec in [cooldown, dynamic] {
            let b = RecordBatch {
                records: vec![Record::Task(crate::log::task_record::TaskRecord::Forgotten { ids: vec![] }), rec],
                ..with_task.clone()
            };
            let sealed = b.encode();
            assert_eq!(u16::from_le_bytes([sealed[5], sealed[6]]), 4);
            assert_eq!(RecordBatch::decode(&sealed), Ok(b));
        }
    }

    #[test]
    fn newer_layouts_and_damage_are_refused() {
        let b = sample();
        let payload = postcard::to_stdvec(&b).unwrap();
        let newer = envelope::seal(RecordKind::OpLogBatch, RECORD_VERSION + 1, &payload);
        assert!(matches!(
            RecordBatch::decode(&newer),
            Err(RecordError::Envelope(EnvelopeError::UnknownVersion { .. }))
        ));
        let mut damaged = b.encode();
        let last = damaged.len() - 1;
        damaged[last] ^= 0x40;
        assert!(matches!(RecordBatch::decode(&damaged), Err(RecordError::Envelope(EnvelopeError::Checksum { .. }))));
        let snapshot = envelope::seal(RecordKind::SnapshotChunk, RECORD_VERSION, &payload);
        assert!(matches!(RecordBatch::decode(&snapshot), Err(RecordError::Envelope(EnvelopeError::WrongKind { .. }))));
    }

    #[test]
    fn sound_envelopes_around_bad_payloads_are_refused() {
        let garbage = envelope::seal(RecordKind::OpLogBatch, RECORD_VERSION, &[0xff; 40]);
        assert!(matches!(RecordBatch::decode(&garbage), Err(RecordError::Malformed(_))));
        for bad in [RecordBatch { records: Vec::new(), ..sample() }, RecordBatch { first_seq: 0, ..sample() }] {
            assert!(matches!(RecordBatch::decode(&bad.encode()), Err(RecordError::Numbering { .. })));
        }
    }

    proptest::proptest! {
        #[test]
        fn decoding_arbitrary_payloads_never_panics(payload in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let sealed = envelope::seal(RecordKind::OpLogBatch, RECORD_VERSION, &payload);
            let _ = RecordBatch::decode(&sealed);
            let _ = RecordBatch::decode(&payload);
        }
    }
}
