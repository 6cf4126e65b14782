//! Length-prefixed frames.
//!
//! ```text
//! 0      2        3      4          8                16
//! | magic | version | kind | len (LE) | request id (LE) | payload (len bytes) ...
//! ```
//!
//! Every connection opens with greeting frames (kind 2, see [`crate::auth::handshake`]); the
//! server sends the first one, so a client of another version fails on the first header it
//! reads, with an error that names both versions.
//!
//! The header is fixed-size so a reader knows, after 16 bytes, whether the peer speaks Tycho
//! and how much more to read. A frame whose length exceeds the reader's limit is refused before
//! any of its payload is buffered.

use thiserror::Error;

/// First two bytes of every frame: "TY".
pub const FRAME_MAGIC: u16 = 0x5954;
/// Version of the frame layout and of the message encoding inside it.
pub const FRAME_VERSION: u8 = 8;
/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 16;
/// Default limit on one frame's payload as a client reads it (the master's answers): large
/// enough for a batch of thousands of keys with all their replicas.
pub const DEFAULT_MAX_FRAME: u32 = 64 << 20;
/// Default limit on one request frame's payload as the master reads it (`--max-frame-bytes`):
/// above the largest legitimate request, a `BatchPutStart` of `MAX_BATCH_KEYS` (8192) keys at
/// the 4096-byte key limit, which encodes to 33.8 MB (`the_largest_request_fits` in
/// `message.rs` measures it).
pub const DEFAULT_MAX_REQUEST_FRAME: u32 = 40 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A call; the id is chosen by the caller.
    Request = 0,
    /// The answer to the request with the same id.
    Response = 1,
    /// A connection greeting ([`crate::auth::handshake`]); only before the first request.
    Hello = 2,
}

/// The decoded fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Request or response.
    pub kind: FrameKind,
    /// Payload length in bytes.
    pub len: u32,
    /// Matches a response to its request.
    pub request_id: u64,
}

/// Why bytes could not be read as a frame or a message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// The stream does not start with the Tycho magic.
    #[error("bad frame magic {0:#06x}; the peer does not speak the Tycho protocol")]
    BadMagic(u16),
    /// The peer speaks a newer or older frame version.
    #[error("unsupported frame version {0} (this build speaks {FRAME_VERSION})")]
    UnsupportedVersion(u8),
    /// The kind byte is not a known kind.
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    /// The frame is larger than the reader accepts.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced payload length.
        len: u32,
        /// The reader's limit.
        max: u32,
    },
    /// The payload is not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A frame after the greeting does not carry the tag the connection's key gives it: it was
    /// injected, altered, replayed or reordered on the way ([`crate::auth::session`]).
    #[error("a frame failed its integrity check (injected, altered, replayed or reordered); the connection closes")]
    BadTag,
}

impl FrameHeader {
    /// Writes the header into the first [`HEADER_LEN`] bytes of `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..2].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        out[2] = FRAME_VERSION;
        out[3] = self.kind as u8;
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
    }

    /// Parses and validates a header; `max_len` bounds the payload length.
    pub fn decode(buf: &[u8; HEADER_LEN], max_len: u32) -> Result<FrameHeader, FrameError> {
        let magic = u16::from_le_bytes([buf[0], buf[1]]);
        if magic != FRAME_MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if buf[2] != FRAME_VERSION {
            return Err(FrameError::UnsupportedVersion(buf[2]));
        }
        let kind = match buf[3] {
            0 => FrameKind::Request,
            1 => FrameKind::Response,
            2 => FrameKind::Hello,
            k => return Err(FrameError::BadKind(k)),
        };
        let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
        if len > max_len {
            return Err(FrameError::TooLarge { len, max: max_len });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&buf[8..16]);
        Ok(FrameHeader { kind, len, request_id: u64::from_le_bytes(id) })
    }
}

/// Appends one frame (header and serialized `msg`) to `out`.
pub fn encode_frame<T: serde::Serialize>(
    out: &mut Vec<u8>,
    kind: FrameKind,
    request_id: u64,
    msg: &T,
) -> Result<(), FrameError> {
    let start = out.len();
    out.resize(start + HEADER_LEN, 0);
    let taken = std::mem::take(out);
    let mut full = postcard::to_extend(msg, taken).map_err(|e| FrameError::Malformed(e.to_string()))?;
    let len = full.len() - start - HEADER_LEN;
    let len = u32::try_from(len).map_err(|_| FrameError::TooLarge { len: u32::MAX, max: u32::MAX })?;
    let header = FrameHeader { kind, len, request_id };
    let mut h = [0u8; HEADER_LEN];
    header.encode(&mut h);
    full[start..start + HEADER_LEN].copy_from_slice(&h);
    *out = full;
    Ok(())
}

/// A whole frame found at the front of a buffer: its header, its payload and the number of
/// bytes it occupies.
pub type SplitFrame<'a> = (FrameHeader, &'a [u8], usize);

/// Tries to take one whole frame from the front of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed, or the header, the payload and the total
/// number of bytes the frame occupies.
pub fn split_frame(buf: &[u8], max_len: u32) -> Result<Option<SplitFrame<'_>>, FrameError> {
    let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = FrameHeader::decode(head, max_len)?;
    let total = HEADER_LEN + header.len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((header, &buf[HEADER_LEN..total], total)))
}

/// Decodes a message payload; trailing bytes are an error.
pub fn decode_payload<'a, T: serde::Deserialize<'a>>(payload: &'a [u8]) -> Result<T, FrameError> {
    let (msg, rest) = postcard::take_from_bytes(payload).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(FrameError::Malformed(format!("{} trailing bytes", rest.len())));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = FrameHeader { kind: FrameKind::Response, len: 77, request_id: u64::MAX - 3 };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(FrameHeader::decode(&b, 100), Ok(h));
    }

    #[test]
    fn rejects_bad_headers() {
        let h = FrameHeader { kind: FrameKind::Request, len: 1000, request_id: 1 };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(FrameHeader::decode(&b, 999), Err(FrameError::TooLarge { len: 1000, max: 999 }));
        let mut bad = b;
        bad[0] = 0;
        assert!(matches!(FrameHeader::decode(&bad, 4096), Err(FrameError::BadMagic(_))));
        let mut bad = b;
        bad[2] = 9;
        assert_eq!(FrameHeader::decode(&bad, 4096), Err(FrameError::UnsupportedVersion(9)));
        let mut bad = b;
        bad[3] = 7;
        assert_eq!(FrameHeader::decode(&bad, 4096), Err(FrameError::BadKind(7)));
    }

    #[test]
    fn truncated_frames_wait_for_more() {
        let mut out = Vec::new();
        encode_frame(&mut out, FrameKind::Request, 5, &"hello".to_string()).unwrap();
        for cut in 0..out.len() {
            assert_eq!(split_frame(&out[..cut], 1024), Ok(None), "cut at {cut}");
        }
        let (h, payload, used) = split_frame(&out, 1024).unwrap().unwrap();
        assert_eq!((h.request_id, used), (5, out.len()));
        assert_eq!(decode_payload::<String>(payload).unwrap(), "hello");
    }

    #[test]
    fn trailing_bytes_are_malformed() {
        let mut p = postcard::to_stdvec(&7u32).unwrap();
        p.push(0);
        assert!(matches!(decode_payload::<u32>(&p), Err(FrameError::Malformed(_))));
    }
}
