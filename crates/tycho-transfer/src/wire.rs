//! The transfer protocol: after the connection greeting (`tycho_proto::auth::handshake`), a
//! fixed 112-byte request header, then for writes the bytes; a fixed 16-byte answer, then for
//! reads the bytes and a 16-byte trailer. Bulk bytes never pass through a serializer, so they
//! go from memory to socket and from socket to memory without extra copies.
//!
//! ```text
//! request:  magic "TYXF" (u32) | op (u8) | version (u8) | rights (u8) | flags (u8) | segment (u128)
//!           | offset (u64) | len (u64) | incarnation (u32) | generation (u32)
//!           | grant offset (u64) | grant len (u64) | expiry ms (u64) | epoch (u64)
//!           | tenant tag (u64) | group (u16) | 0 x6 | capability MAC (16)
//! answer:   status (i32, 0 or an error code) | 0 (u32) | len (u64)
//! trailer:  an answer again, after a read's bytes: 0 if the range still carried the request's
//!           incarnation and generation once every byte was sent, else RANGE_REUSED (the bytes
//!           sent are not the object's and must be thrown away)
//! ```
//!
//! On an authenticated connection (a cluster secret) every message is sealed
//! (`tycho_proto::auth::stream`) and followed by its 16-byte tag: a request header; a write's
//! bytes; an answer, with a read's bytes as its body; a trailer. A message whose tag does not
//! check closes the connection, and nothing it asked for is done or kept: a read's bytes count
//! only once both the read's tag and its trailer's checked, a write's only once its tag checked
//! (and the master commits an object only after every write of it was answered). Flag bit 0
//! ([`FLAG_ENCRYPT`]) asks for the payload in both directions encrypted.
//!
//! ```text
//! read:    head | tag      ->   answer | bytes | tag | trailer | tag
//! write:   head | tag | bytes | tag  ->  answer | tag
//! retire:  head | tag      ->   answer | tag
//! ```
//!
//! `offset` and `len` name the bytes this request moves; the grant fields and the MAC are the
//! master's capability for the whole replica range, which must contain them. The server stamps
//! a write's generation on the range before it receives the first byte (see
//! [`Mapping`](crate::segment::Mapping)).

use tycho_proto::auth::capability::Capability;
use tycho_proto::auth::stream::{Sealer, StreamMac, STREAM_TAG_LEN};
use tycho_proto::{ErrorCode, SegmentId};

use crate::error::TransferError;

/// First bytes of every transfer request.
pub const XFER_MAGIC: u32 = u32::from_le_bytes(*b"TYXF");
/// Version of the request layout; a request of another version is refused.
pub const XFER_VERSION: u8 = 4;
/// Request flag: the payload travels encrypted, both ways (only on an authenticated connection).
pub const FLAG_ENCRYPT: u8 = 1;
/// Bytes of a sealed payload hashed (and encrypted) between two socket calls: small enough to
/// stay in cache from the hash to the copy.
pub const SEAL_PIECE: usize = 128 * 1024;
/// Request header size.
pub const REQUEST_LEN: usize = 112;
/// Answer header size.
pub const ANSWER_LEN: usize = 16;
/// Largest single request; larger transfers are split by the client. A write header announcing
/// more is treated as garbage and closes the connection.
pub const MAX_REQUEST_BYTES: u64 = 1 << 30;

/// Transfer direction, seen from the requester.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    /// Bytes flow from the server's segment to the requester.
    Read = 1,
    /// Bytes flow from the requester into the server's segment.
    Write = 2,
    /// No bytes: the range's value was replaced; mark its blocks so that old readers fail.
    Retire = 3,
}

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XferRequest {
    /// Direction.
    pub op: XferOp,
    /// Target segment.
    pub segment: SegmentId,
    /// Offset inside the segment.
    pub offset: u64,
    /// Bytes to move.
    pub len: u64,
    /// Incarnation of the segment the range was handed out in.
    pub incarnation: u32,
    /// Generation of the range.
    pub gen: u32,
    /// Start of the granted replica range inside the segment.
    pub grant_offset: u64,
    /// Length of the granted replica range.
    pub grant_len: u64,
    /// The master's capability for the granted range.
    pub cap: Capability,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

impl XferRequest {
    /// Serializes the header.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&XFER_MAGIC.to_le_bytes());
        b[4] = self.op as u8;
        b[5] = XFER_VERSION;
        b[6] = self.cap.rights;
        b[8..24].copy_from_slice(&self.segment.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..44].copy_from_slice(&self.incarnation.to_le_bytes());
        b[44..48].copy_from_slice(&self.gen.to_le_bytes());
        b[48..56].copy_from_slice(&self.grant_offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.grant_len.to_le_bytes());
        b[64..72].copy_from_slice(&self.cap.expires_ms.to_le_bytes());
        b[72..80].copy_from_slice(&self.cap.epoch.to_le_bytes());
        b[80..88].copy_from_slice(&self.cap.tenant.to_le_bytes());
        b[88..90].copy_from_slice(&self.cap.group.to_le_bytes());
        b[96..112].copy_from_slice(&self.cap.mac);
        b
    }

    /// Parses a header; anything that is not a request of this protocol is an error.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<XferRequest, TransferError> {
        let magic = u32_at(b, 0);
        if magic != XFER_MAGIC {
            return Err(TransferError::Protocol(format!("bad magic {magic:#010x}")));
        }
        if b[5] != XFER_VERSION {
            return Err(TransferError::Protocol(format!(
                "transfer version {} (this build speaks {XFER_VERSION})",
                b[5]
            )));
        }
        if b[7] & !FLAG_ENCRYPT != 0 {
            return Err(TransferError::Protocol(format!("unknown request flags {:#04x}", b[7])));
        }
        let op = match b[4] {
            1 => XferOp::Read,
            2 => XferOp::Write,
            3 => XferOp::Retire,
            o => return Err(TransferError::Protocol(format!("unknown op {o}"))),
        };
        let len = u64_at(b, 32);
        // A retire moves no bytes: its range may be as large as a replica.
        if len > MAX_REQUEST_BYTES && op != XferOp::Retire {
            return Err(TransferError::Protocol(format!("request of {len} bytes exceeds {MAX_REQUEST_BYTES}")));
        }
        Ok(XferRequest {
            op,
            segment: SegmentId(u128::from_le_bytes(b[8..24].try_into().expect("16 bytes"))),
            offset: u64_at(b, 24),
            len,
            incarnation: u32_at(b, 40),
            gen: u32_at(b, 44),
            grant_offset: u64_at(b, 48),
            grant_len: u64_at(b, 56),
            cap: Capability {
                rights: b[6],
                expires_ms: u64_at(b, 64),
                epoch: u64_at(b, 72),
                tenant: u64_at(b, 80),
                group: u16::from_le_bytes([b[88], b[89]]),
                mac: b[96..112].try_into().expect("16 bytes"),
            },
        })
    }

    /// Whether the bytes this request moves lie inside its granted range.
    pub fn within_grant(&self) -> bool {
        let end = self.offset.checked_add(self.len);
        let grant_end = self.grant_offset.checked_add(self.grant_len);
        matches!((end, grant_end), (Some(e), Some(g)) if self.offset >= self.grant_offset && e <= g)
    }
}

/// The flags of an encoded request header ([`FLAG_ENCRYPT`]).
pub fn request_flags(b: &[u8; REQUEST_LEN]) -> u8 {
    b[7]
}

/// Sends `bytes` with `send`, piece by piece, as the body of the message `sealer` seals: as
/// they are, or (`encrypt`) encrypted through `scratch`.
pub fn send_sealed(
    bytes: &[u8],
    sealer: &mut Sealer,
    encrypt: bool,
    scratch: &mut Vec<u8>,
    mut send: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    for piece in bytes.chunks(SEAL_PIECE) {
        if encrypt {
            scratch.clear();
            scratch.extend_from_slice(piece);
            sealer.encrypt(scratch);
            send(scratch)?;
        } else {
            sealer.absorb(piece);
            send(piece)?;
        }
    }
    Ok(())
}

/// Fills `dst` with `recv`, piece by piece, as the body of the message `sealer` checks; the
/// caller checks the tag, then decrypts ([`decrypt_sealed`]) if the body was encrypted.
pub fn recv_sealed(
    dst: &mut [u8],
    sealer: &mut Sealer,
    mut recv: impl FnMut(&mut [u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    for piece in dst.chunks_mut(SEAL_PIECE) {
        recv(piece)?;
        sealer.absorb(piece);
    }
    Ok(())
}

/// Decrypts a body received with [`recv_sealed`] whose tag checked.
pub fn decrypt_sealed(dst: &mut [u8], sealer: &mut Sealer) {
    for piece in dst.chunks_mut(SEAL_PIECE) {
        sealer.decrypt(piece);
    }
}

/// `head` followed by its tag under `mac` (none on an unauthenticated connection), ready to send.
pub fn sealed_head<const N: usize>(head: &[u8; N], mac: Option<&mut StreamMac>) -> ([u8; 128], usize) {
    let mut out = [0u8; 128];
    out[..N].copy_from_slice(head);
    match mac {
        Some(mac) => {
            out[N..N + STREAM_TAG_LEN].copy_from_slice(&mac.seal_head(head));
            (out, N + STREAM_TAG_LEN)
        }
        None => (out, N),
    }
}

/// Appends `head` and its tag under `mac` (if any) to `out`.
pub fn push_head(out: &mut Vec<u8>, head: &[u8], mac: Option<&mut StreamMac>) {
    out.extend_from_slice(head);
    if let Some(mac) = mac {
        out.extend_from_slice(&mac.seal_head(head));
    }
}

/// Appends `body` to `out` as the body of the message `sealer` (if any) seals, encrypted if
/// `encrypt`, and then its tag.
pub fn push_body(out: &mut Vec<u8>, body: &[u8], sealer: Option<&mut Sealer>, encrypt: bool) {
    let at = out.len();
    out.extend_from_slice(body);
    if let Some(s) = sealer {
        if encrypt {
            s.encrypt(&mut out[at..]);
        } else {
            s.absorb(&out[at..]);
        }
        out.extend_from_slice(&s.finish());
    }
}

/// Reads a header of `N` bytes, and its tag under `mac` if there is one; a tag that does not
/// check is an error (the connection must close).
pub fn recv_head<const N: usize>(
    stream: &mut impl std::io::Read,
    mac: Option<&mut StreamMac>,
) -> Result<[u8; N], TransferError> {
    let mut head = [0u8; N];
    stream.read_exact(&mut head)?;
    if let Some(mac) = mac {
        let mut tag = [0u8; STREAM_TAG_LEN];
        stream.read_exact(&mut tag)?;
        if !mac.open_head(&head, &tag) {
            return Err(TransferError::BadTag("a header"));
        }
    }
    Ok(head)
}

/// Serializes an answer header.
pub fn encode_answer(status: Result<u64, ErrorCode>) -> [u8; ANSWER_LEN] {
    let mut b = [0u8; ANSWER_LEN];
    let (code, len) = match status {
        Ok(len) => (0i32, len),
        Err(c) => (c.as_i32(), 0),
    };
    b[0..4].copy_from_slice(&code.to_le_bytes());
    b[8..16].copy_from_slice(&len.to_le_bytes());
    b
}

/// The byte count an answer header announces, whatever its status (0 for a refusal).
pub fn answer_len(b: &[u8; ANSWER_LEN]) -> u64 {
    if i32::from_le_bytes(b[0..4].try_into().expect("4 bytes")) == 0 {
        u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"))
    } else {
        0
    }
}

/// Parses an answer header into the byte count that follows, or the peer's error.
pub fn decode_answer(b: &[u8; ANSWER_LEN]) -> Result<u64, TransferError> {
    let code = i32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    if code == 0 {
        return Ok(len);
    }
    match ErrorCode::from_i32(code) {
        Some(ErrorCode::SEGMENT_NOT_FOUND) => Err(TransferError::SegmentNotFound),
        Some(c) => Err(TransferError::Remote(c)),
        None => Err(TransferError::Protocol(format!("unknown status {code}"))),
    }
}

/// Reads and writes of at most this many bytes travel as one buffer with their headers and
/// tags (one system call each way, the bytes copied once, which costs less than the calls it
/// saves); larger ones go from memory to socket in pieces.
pub const SMALL_PAYLOAD: usize = 16 * 1024;

/// Sends what it can of `buf`, a part of a message whose end is still to come: with `MSG_MORE`
/// the kernel holds the bytes until the call that sends the end (or a full segment), so the
/// peer is woken once for the whole message. Sent as separate plain writes, a read's head,
/// bytes and trailer (or a write's head and bytes) woke the peer once per part, each a context
/// switch on both sides: on the development VM a 4 KiB read over TCP took 15 to 25 % longer.
pub(crate) fn send_more(stream: &std::net::TcpStream, buf: &[u8]) -> std::io::Result<usize> {
    send_flagged(stream, buf, true)
}

/// One `send` of `buf`, with `MSG_MORE` when more of the message follows.
pub(crate) fn send_flagged(stream: &std::net::TcpStream, buf: &[u8], more: bool) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let flags = if more { libc::MSG_MORE | libc::MSG_NOSIGNAL } else { libc::MSG_NOSIGNAL };
    // SAFETY: the socket is open for the call, and `buf` is valid for `buf.len()` bytes.
    let sent = unsafe { libc::send(stream.as_raw_fd(), buf.as_ptr().cast(), buf.len(), flags) };
    match sent {
        n if n < 0 => Err(std::io::Error::last_os_error()),
        n => Ok(n as usize),
    }
}

/// [`send_more`] until all of `buf` is sent.
pub(crate) fn send_all_more(stream: &std::net::TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match send_more(stream, buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_garbage_is_refused() {
        let r = XferRequest {
            op: XferOp::Write,
            segment: SegmentId(7 << 100),
            offset: 12,
            len: 4096,
            incarnation: 3,
            gen: 0xdead_beef,
            grant_offset: 8,
            grant_len: 8192,
            cap: Capability { rights: 2, expires_ms: 99, epoch: 4, group: 5, tenant: 6, mac: [7; 16] },
        };
        assert!(r.within_grant());
        assert!(!XferRequest { offset: 4, ..r }.within_grant());
        assert!(!XferRequest { len: 8189, ..r }.within_grant());
        assert!(!XferRequest { offset: u64::MAX, ..r }.within_grant());
        assert_eq!(XferRequest::decode(&r.encode()).unwrap(), r);
        let mut bad = r.encode();
        bad[0] = b'X';
        assert!(XferRequest::decode(&bad).is_err());
        let mut bad = r.encode();
        bad[4] = 9;
        assert!(XferRequest::decode(&bad).is_err());
        let mut old = r.encode();
        old[5] = 2;
        assert!(XferRequest::decode(&old).is_err());
        let huge = XferRequest { len: MAX_REQUEST_BYTES + 1, ..r };
        assert!(XferRequest::decode(&huge.encode()).is_err());
    }

    #[test]
    fn answers_round_trip() {
        assert_eq!(decode_answer(&encode_answer(Ok(99))).unwrap(), 99);
        assert!(matches!(
            decode_answer(&encode_answer(Err(ErrorCode::SEGMENT_NOT_FOUND))),
            Err(TransferError::SegmentNotFound)
        ));
        assert!(matches!(
            decode_answer(&encode_answer(Err(ErrorCode::INVALID_PARAMS))),
            Err(TransferError::Remote(ErrorCode::INVALID_PARAMS))
        ));
    }
}
