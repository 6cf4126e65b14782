//! The envelope of every record Tycho persists or replicates (OpLog batches and their durable
//! prefix, snapshot chunks, ownership records): what it is, which version of its layout, its length and a checksum, so
//! that a reader refuses bytes it does not understand or that were damaged, instead of decoding
//! them into something else.
//!
//! ```text
//! 0       4      5         7            11          15
//! | magic | kind | version | len (LE32) | crc32c (LE32) | payload (len bytes)
//! ```
//!
//! The checksum covers the first eleven bytes and the payload. A reader names the kind it
//! expects and the newest version it knows; anything else is an [`EnvelopeError`].

use thiserror::Error;

/// First four bytes of every sealed record.
pub const ENVELOPE_MAGIC: [u8; 4] = *b"TYRC";
/// Size of the header before the payload.
pub const ENVELOPE_HEADER_LEN: usize = 15;
/// Largest payload a reader accepts (etcd refuses values above 1.5 MiB; snapshot chunks stay
/// well under this too).
pub const MAX_ENVELOPE_PAYLOAD: usize = 64 << 20;

/// What a sealed record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// A batch of a KVPT group's OpLog.
    OpLogBatch = 1,
    /// A chunk of a group's snapshot.
    SnapshotChunk = 2,
    /// A group's ownership record.
    Ownership = 3,
    /// A group's OpLog layout record: at version 1 the log's durable prefix (the last
    /// committed sequence number), from version 2 on only the layout version.
    LogPrefix = 4,
    /// A group's snapshot pointers (latest, fallback, compaction floor).
    SnapshotPointers = 5,
    /// A cluster's fixed layout (its KVPT group count).
    ClusterMeta = 6,
    /// An operator's request to move a group to another master (online reshard).
    ReshardIntent = 7,
    /// A VSegment's immutable layout (`vsegment::VSegmentView`).
    VSegmentView = 8,
    /// A stable segment's descriptor (`quota::StableSegment`).
    SegmentDescriptor = 9,
    /// The cluster's static VSegment quota (`quota::PartitionQuota`).
    PartitionQuota = 10,
}

/// Why bytes could not be opened as the record asked for.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum EnvelopeError {
    /// Shorter than the header or than the length it states.
    #[error("record truncated: {have} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes the header calls for.
        need: usize,
    },
    /// Longer than the length it states.
    #[error("record has {extra} bytes after its payload")]
    Trailing {
        /// Bytes after the payload.
        extra: usize,
    },
    /// Not a Tycho record.
    #[error("not a Tycho record (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// Another kind of record.
    #[error("record of kind {found}, expected kind {expected}")]
    WrongKind {
        /// Kind byte found.
        found: u8,
        /// Kind asked for.
        expected: u8,
    },
    /// A version this reader does not know (written by a newer Tycho, or version 0).
    #[error("record version {found} is not one this build reads (1..={newest})")]
    UnknownVersion {
        /// Version found.
        found: u16,
        /// Newest version this reader knows.
        newest: u16,
    },
    /// Payload larger than any reader accepts.
    #[error("record payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// The bytes do not match their checksum.
    #[error("record checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Checksum in the header.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
}

/// `payload` sealed as a record of `kind`, layout `version`.
pub fn seal(kind: RecordKind, version: u16, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() <= MAX_ENVELOPE_PAYLOAD, "record payload over the envelope limit");
    let mut out = Vec::with_capacity(ENVELOPE_HEADER_LEN + payload.len());
    out.extend_from_slice(&ENVELOPE_MAGIC);
    out.push(kind as u8);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out), payload);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Opens a record of `kind` whose version is at most `newest`: its version and payload.
pub fn open(kind: RecordKind, newest: u16, bytes: &[u8]) -> Result<(u16, &[u8]), EnvelopeError> {
    let Some(head) = bytes.get(..ENVELOPE_HEADER_LEN) else {
        return Err(EnvelopeError::Truncated { have: bytes.len(), need: ENVELOPE_HEADER_LEN });
    };
    let magic: [u8; 4] = head[..4].try_into().expect("four bytes");
    if magic != ENVELOPE_MAGIC {
        return Err(EnvelopeError::BadMagic(magic));
    }
    if head[4] != kind as u8 {
        return Err(EnvelopeError::WrongKind { found: head[4], expected: kind as u8 });
    }
    let version = u16::from_le_bytes([head[5], head[6]]);
    if version == 0 || version > newest {
        return Err(EnvelopeError::UnknownVersion { found: version, newest });
    }
    let len = u32::from_le_bytes(head[7..11].try_into().expect("four bytes")) as usize;
    if len > MAX_ENVELOPE_PAYLOAD {
        return Err(EnvelopeError::TooLarge(len));
    }
    let need = ENVELOPE_HEADER_LEN + len;
    if bytes.len() < need {
        return Err(EnvelopeError::Truncated { have: bytes.len(), need });
    }
    if bytes.len() > need {
        return Err(EnvelopeError::Trailing { extra: bytes.len() - need });
    }
    let stored = u32::from_le_bytes(head[11..15].try_into().expect("four bytes"));
    let payload = &bytes[ENVELOPE_HEADER_LEN..];
    let computed = crc32c::crc32c_append(crc32c::crc32c(&head[..11]), payload);
    if stored != computed {
        return Err(EnvelopeError::Checksum { stored, computed });
    }
    Ok((version, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_record_opens_to_its_payload() {
        let sealed = seal(RecordKind::OpLogBatch, 1, b"payload");
        assert_eq!(open(RecordKind::OpLogBatch, 1, &sealed), Ok((1, &b"payload"[..])));
        assert_eq!(open(RecordKind::OpLogBatch, 3, &sealed), Ok((1, &b"payload"[..])));
        let empty = seal(RecordKind::Ownership, 2, b"");
        assert_eq!(open(RecordKind::Ownership, 2, &empty), Ok((2, &b""[..])));
    }

    #[test]
    fn a_reader_refuses_what_it_does_not_understand() {
        let sealed = seal(RecordKind::OpLogBatch, 2, b"newer layout");
        assert_eq!(
            open(RecordKind::OpLogBatch, 1, &sealed),
            Err(EnvelopeError::UnknownVersion { found: 2, newest: 1 })
        );
        assert_eq!(
            open(RecordKind::SnapshotChunk, 2, &sealed),
            Err(EnvelopeError::WrongKind { found: 1, expected: 2 })
        );
        let zero = seal(RecordKind::OpLogBatch, 0, b"x");
        assert!(matches!(open(RecordKind::OpLogBatch, 1, &zero), Err(EnvelopeError::UnknownVersion { .. })));
        let mut other = sealed.clone();
        other[0] = b'X';
        assert!(matches!(open(RecordKind::OpLogBatch, 2, &other), Err(EnvelopeError::BadMagic(_))));
    }

    #[test]
    fn damage_anywhere_is_detected() {
        let sealed = seal(RecordKind::OpLogBatch, 1, b"some payload bytes");
        for i in 0..sealed.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = sealed.clone();
                bad[i] ^= bit;
                assert!(open(RecordKind::OpLogBatch, 1, &bad).is_err(), "flip of bit {bit:#x} at byte {i} went unseen");
            }
        }
        for cut in 0..sealed.len() {
            assert!(open(RecordKind::OpLogBatch, 1, &sealed[..cut]).is_err());
        }
        let mut long = sealed.clone();
        long.push(0);
        assert_eq!(open(RecordKind::OpLogBatch, 1, &long), Err(EnvelopeError::Trailing { extra: 1 }));
    }

    #[test]
    fn a_huge_stated_length_is_refused_before_anything_is_read() {
        let mut sealed = seal(RecordKind::OpLogBatch, 1, b"x");
        sealed[7..11].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(open(RecordKind::OpLogBatch, 1, &sealed), Err(EnvelopeError::TooLarge(u32::MAX as usize)));
    }
}
