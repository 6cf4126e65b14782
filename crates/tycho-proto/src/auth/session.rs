//! What protects a connection's frames after its greeting.
//!
//! The greeting proves the secret over two fresh nonces; on its own it would leave the rest of
//! the connection to whoever sits on its path, who could pass an honest greeting through and
//! then inject, replay, reorder or alter frames. So both ends derive a key for the connection
//! from the secret and both nonces (one key per direction), and every frame after the greeting
//! carries a tag: AES-256-GCM's, over the frame's header (whose length counts the tag) as
//! associated data and its payload as the (unencrypted) body, with the frame's sequence number
//! in its direction (counted from 0, never sent) as the nonce — the sealing of transfer
//! messages ([`super::stream`]).
//!
//! ```text
//! | header (16, len = payload + 16) | payload | tag (16) |
//! tag = GMAC(direction key, nonce = seq, header, payload)
//! ```
//!
//! A frame whose tag does not check (injected, altered, replayed, reordered, or cut short and
//! followed by another) fails [`FrameMac::open`] and the connection closes; the receiver acts
//! on nothing it did not check. Why GMAC rather than HMAC-SHA256 (the first tag, frame version
//! 6): a batch frame of 1 to 3 KB cost 1 to 2 µs to tag with HMAC-SHA256 and costs a fraction of
//! that with AES-NI and carry-less multiply (docs/security.md has the figures).

use super::stream::StreamMac;
use super::{mac32, Secret};
use crate::frame::{FrameError, HEADER_LEN};

/// Bytes of the tag at the end of every frame after the greeting.
pub const TAG_LEN: usize = 16;

/// One direction of a connection: its key, and the sequence number of its next frame.
#[derive(Clone, Debug)]
pub struct FrameMac {
    mac: StreamMac,
}

impl FrameMac {
    fn new(key: [u8; 32]) -> FrameMac {
        FrameMac { mac: StreamMac::new(key) }
    }

    fn tag(&mut self, head: &[u8], payload: &[u8]) -> [u8; TAG_LEN] {
        let mut s = self.mac.begin(head);
        s.absorb(payload);
        s.finish()
    }

    /// Tags the frame at `frame[start..]` (a header and its payload, as `encode_frame` wrote
    /// them): counts the tag in the header's length and appends it.
    pub fn seal(&mut self, frame: &mut Vec<u8>, start: usize) -> Result<(), FrameError> {
        let len_at = start + 4..start + 8;
        let len = u32::from_le_bytes(frame[len_at.clone()].try_into().expect("4 bytes"));
        let len = len
            .checked_add(TAG_LEN as u32)
            .ok_or(FrameError::TooLarge { len: u32::MAX, max: u32::MAX - TAG_LEN as u32 })?;
        frame[len_at].copy_from_slice(&len.to_le_bytes());
        let (head, payload) = frame[start..].split_at(HEADER_LEN);
        let tag = self.tag(head, payload);
        frame.extend_from_slice(&tag);
        Ok(())
    }

    /// Checks the frame whose header is `head` and whose body (payload and tag) is `body`;
    /// the payload when the tag is the one this direction's next frame must carry.
    pub fn open<'a>(&mut self, head: &[u8; HEADER_LEN], body: &'a [u8]) -> Result<&'a [u8], FrameError> {
        let Some(split) = body.len().checked_sub(TAG_LEN) else { return Err(FrameError::BadTag) };
        let (payload, tag) = body.split_at(split);
        // A frame that does not check ends the connection, so the count it used does not matter.
        let mut s = self.mac.begin(head);
        s.absorb(payload);
        if !s.check(tag) {
            return Err(FrameError::BadTag);
        }
        Ok(payload)
    }
}

/// Both directions of one connection, as one end holds them.
#[derive(Debug, Clone)]
pub struct Session {
    /// Tags the frames this end sends.
    pub send: FrameMac,
    /// Checks the frames this end receives.
    pub recv: FrameMac,
}

impl Session {
    /// The keys of the connection whose greeting had these nonces, for service `service`, as
    /// the client (`client`) or the server holds them.
    pub fn derive(secret: &Secret, service: u8, client_nonce: &[u8], server_nonce: &[u8], client: bool) -> Session {
        let (send, recv) = direction_keys(secret, "session v2", &[], service, client_nonce, server_nonce, client);
        Session { send: FrameMac::new(send), recv: FrameMac::new(recv) }
    }
}

/// The keys of both directions of a connection whose greeting had these nonces, for service
/// `service`, derived under `label` (and `parts`): (send, receive) as the client (`client`) or
/// the server uses them.
pub(crate) fn direction_keys(
    secret: &Secret,
    label: &str,
    parts: &[&[u8]],
    service: u8,
    client_nonce: &[u8],
    server_nonce: &[u8],
    client: bool,
) -> ([u8; 32], [u8; 32]) {
    let base = secret.derive(label, &[&[service], client_nonce, server_nonce]);
    let up = mac32(&base, "client to server", parts);
    let down = mac32(&base, "server to client", parts);
    if client {
        (up, down)
    } else {
        (down, up)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{encode_frame, split_frame, FrameKind, DEFAULT_MAX_FRAME};

    fn pair() -> (Session, Session) {
        let s = Secret::from_text(b"session-test-cluster-secret-of-enough-length").unwrap();
        (Session::derive(&s, 1, &[1; 16], &[2; 16], true), Session::derive(&s, 1, &[1; 16], &[2; 16], false))
    }

    fn frame(mac: &mut FrameMac, id: u64, msg: &str) -> Vec<u8> {
        let mut out = Vec::new();
        encode_frame(&mut out, FrameKind::Request, id, &msg).unwrap();
        mac.seal(&mut out, 0).unwrap();
        out
    }

    fn open(mac: &mut FrameMac, buf: &[u8]) -> Result<String, FrameError> {
        let (_, body, _) = split_frame(buf, DEFAULT_MAX_FRAME)?.expect("a whole frame");
        let head: [u8; HEADER_LEN] = buf[..HEADER_LEN].try_into().unwrap();
        crate::frame::decode_payload(mac.open(&head, body)?)
    }

    #[test]
    fn frames_open_in_order_and_nothing_else_does() {
        let (mut client, mut server) = pair();
        let a = frame(&mut client.send, 1, "first");
        let b = frame(&mut client.send, 2, "second");
        // Reordered: the second frame where the first belongs.
        assert_eq!(open(&mut server.recv.clone(), &b), Err(FrameError::BadTag));
        assert_eq!(open(&mut server.recv, &a).unwrap(), "first");
        // Replayed.
        assert_eq!(open(&mut server.recv.clone(), &a), Err(FrameError::BadTag));
        // Altered anywhere: header, payload or tag.
        for i in [3, 9, HEADER_LEN + 1, b.len() - 1] {
            let mut bad = b.clone();
            bad[i] ^= 1;
            assert!(open(&mut server.recv.clone(), &bad).is_err(), "byte {i} altered");
        }
        assert_eq!(open(&mut server.recv, &b).unwrap(), "second");
        // The other direction's key, or another connection's, does not open it.
        let c = frame(&mut client.send, 3, "third");
        assert!(open(&mut client.recv.clone(), &c).is_err());
        let (_, mut other) = {
            let s = Secret::from_text(b"session-test-cluster-secret-of-enough-length").unwrap();
            (0, Session::derive(&s, 1, &[1; 16], &[3; 16], false))
        };
        for _ in 0..2 {
            let _ = other.recv.open(&[0; HEADER_LEN], &[0; TAG_LEN]);
        }
        assert!(open(&mut other.recv, &c).is_err());
        // Injected: a frame made without the key.
        let mut forged = Vec::new();
        encode_frame(&mut forged, FrameKind::Request, 4, &"injected").unwrap();
        forged.extend_from_slice(&[0; TAG_LEN]);
        let len = u32::from_le_bytes(forged[4..8].try_into().unwrap()) + TAG_LEN as u32;
        forged[4..8].copy_from_slice(&len.to_le_bytes());
        assert_eq!(open(&mut server.recv.clone(), &forged), Err(FrameError::BadTag));
        assert_eq!(open(&mut server.recv, &c).unwrap(), "third");
        // Too short to hold a tag.
        assert_eq!(server.recv.open(&[0; HEADER_LEN], &[0; 5]), Err(FrameError::BadTag));
    }
}
