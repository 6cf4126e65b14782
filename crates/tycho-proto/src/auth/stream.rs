//! What protects a transfer connection after its greeting: a tag on every request, answer and
//! payload, and on request the payload's encryption.
//!
//! Transfer payloads are large (up to a GiB per request) and cross the wire at several GB/s,
//! where HMAC-SHA256 (the RPC frames' tag, [`super::session`]) manages about 1 GB/s. Each
//! message is sealed as an AEAD seals it, fed in pieces as the bytes are sent or received: its
//! header as associated data, then its body. Two constructions, chosen by the body's length
//! (which both ends know from an authenticated header before the body comes):
//!
//! - up to [`POLY_FROM`] bytes of body, AES-256-GCM: with AES-NI and carry-less multiply its
//!   cost per message is one AES block on top of GHASH (about 0.1 µs for a header), but GHASH
//!   runs at about 1.5 GB/s;
//! - larger bodies, ChaCha20-Poly1305 (RFC 8439): Poly1305 with AVX2 runs at about 4 GB/s but
//!   costs about 1.7 µs per message to key and finish.
//!
//! Without encryption the body is the plaintext itself (the tag authenticates it and hides
//! nothing); with encryption it is the plaintext XORed with the construction's key stream, so
//! that a sealed message is exactly that AEAD's ciphertext and tag. The nonce is the message's
//! sequence number in its direction; each direction has its own keys (one per construction),
//! derived from the secret and both greeting nonces. A message injected, replayed, reordered,
//! altered or cut short fails its tag, and the connection closes. docs/security.md has the
//! measured costs.

use aes::cipher::{BlockEncrypt, InnerIvInit, KeyIvInit, StreamCipher};
use aes::Aes256Enc;
use chacha20::ChaCha20;
use ghash::GHash;
use poly1305::universal_hash::{KeyInit, UniversalHash};
use poly1305::Poly1305;

use super::{mac32, same_mac, Secret};

/// Bytes of the tag after each sealed transfer message.
pub const STREAM_TAG_LEN: usize = 16;

/// Bodies of at least this many bytes are sealed with ChaCha20-Poly1305, shorter ones with
/// AES-256-GCM: where the two cost the same on the development VM (about 4 KiB), rounded up
/// because GCM's smaller cost per message also saves a cache-cold setup.
pub const POLY_FROM: u64 = 16 * 1024;

type Ctr = ctr::Ctr32BE<Aes256Enc>;

/// One direction of a transfer connection: its keys and the sequence number of its next message.
#[derive(Clone)]
pub struct StreamMac {
    aes: Aes256Enc,
    /// GHASH keyed with H = AES(0), before any input.
    ghash: GHash,
    chacha: [u8; 32],
    seq: u64,
}

impl std::fmt::Debug for StreamMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamMac(seq {})", self.seq)
    }
}

impl StreamMac {
    pub(crate) fn new(aes_key: [u8; 32], chacha: [u8; 32]) -> StreamMac {
        let aes = Aes256Enc::new(&aes_key.into());
        let mut h = aes::Block::default();
        aes.encrypt_block(&mut h);
        StreamMac { ghash: GHash::new(&h), aes, chacha, seq: 0 }
    }

    /// Starts the direction's next message, whose header is `head` (authenticated, never
    /// encrypted) and whose body will be `body_len` bytes; the body goes through the returned
    /// [`Sealer`].
    pub fn begin(&mut self, head: &[u8], body_len: u64) -> Sealer {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&self.seq.to_le_bytes());
        self.seq += 1;
        let hash = if body_len < POLY_FROM {
            let mut j0 = [0u8; 16];
            j0[..12].copy_from_slice(&nonce);
            j0[15] = 1;
            let mut ctr = Ctr::from_core(ctr::CtrCore::inner_iv_init(self.aes.clone(), &j0.into()));
            let mut mask = [0u8; 16];
            ctr.apply_keystream(&mut mask);
            let mut ghash = self.ghash.clone();
            ghash.update_padded(head);
            Hash::Gcm { ghash, mask, ctr }
        } else {
            let mut cipher = ChaCha20::new(&self.chacha.into(), &nonce.into());
            // Block 0 of the key stream keys Poly1305; the body's key stream starts at block 1.
            let mut block0 = [0u8; 64];
            cipher.apply_keystream(&mut block0);
            let mut poly = Poly1305::new(poly1305::Key::from_slice(&block0[..32]));
            poly.update_padded(head);
            Hash::Poly { poly, cipher }
        };
        Sealer { hash, pending: [0; 16], fill: 0, head_len: head.len() as u64, body_len: 0 }
    }

    /// The tag of a message that is only a header.
    pub fn seal_head(&mut self, head: &[u8]) -> [u8; STREAM_TAG_LEN] {
        self.begin(head, 0).finish()
    }

    /// Whether `tag` is the one the direction's next message, a header only, must carry.
    pub fn open_head(&mut self, head: &[u8], tag: &[u8]) -> bool {
        self.begin(head, 0).check(tag)
    }
}

enum Hash {
    Gcm { ghash: GHash, mask: [u8; 16], ctr: Ctr },
    Poly { poly: Poly1305, cipher: ChaCha20 },
}

impl Hash {
    fn blocks(&mut self, data: &[u8]) {
        match self {
            Hash::Gcm { ghash, .. } => ghash.update_padded(data),
            Hash::Poly { poly, .. } => poly.update_padded(data),
        }
    }

    fn keystream(&mut self, data: &mut [u8]) {
        match self {
            Hash::Gcm { ctr, .. } => ctr.apply_keystream(data),
            Hash::Poly { cipher, .. } => cipher.apply_keystream(data),
        }
    }
}

/// One message being sealed or checked: its body goes through in pieces of any size.
pub struct Sealer {
    hash: Hash,
    /// Body bytes not yet a whole block.
    pending: [u8; 16],
    fill: usize,
    head_len: u64,
    body_len: u64,
}

impl Sealer {
    /// Adds body bytes as they go on the wire.
    pub fn absorb(&mut self, mut data: &[u8]) {
        self.body_len += data.len() as u64;
        if self.fill > 0 {
            let take = data.len().min(16 - self.fill);
            self.pending[self.fill..self.fill + take].copy_from_slice(&data[..take]);
            self.fill += take;
            data = &data[take..];
            if self.fill < 16 {
                return;
            }
            let block = self.pending;
            self.hash.blocks(&block);
            self.fill = 0;
        }
        let whole = data.len() & !15;
        // Whole blocks only, so padding never applies here.
        self.hash.blocks(&data[..whole]);
        let rest = &data[whole..];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.fill = rest.len();
    }

    /// Encrypts `data` in place and adds it (the sender of an encrypted body).
    pub fn encrypt(&mut self, data: &mut [u8]) {
        self.hash.keystream(data);
        self.absorb(data);
    }

    /// Decrypts `data` in place, a piece of a body already [`absorb`](Self::absorb)ed, in the
    /// same pieces; the receiver decrypts only after the tag checked.
    pub fn decrypt(&mut self, data: &mut [u8]) {
        self.hash.keystream(data);
    }

    /// The message's tag, once its whole body was added.
    pub fn finish(&mut self) -> [u8; STREAM_TAG_LEN] {
        if self.fill > 0 {
            let (block, fill) = (self.pending, self.fill);
            self.hash.blocks(&block[..fill]);
            self.fill = 0;
        }
        match &mut self.hash {
            Hash::Gcm { ghash, mask, .. } => {
                let mut lens = [0u8; 16];
                lens[..8].copy_from_slice(&(self.head_len * 8).to_be_bytes());
                lens[8..].copy_from_slice(&(self.body_len * 8).to_be_bytes());
                ghash.update_padded(&lens);
                let mut tag: [u8; 16] = ghash.clone().finalize().into();
                for (t, m) in tag.iter_mut().zip(mask.iter()) {
                    *t ^= m;
                }
                tag
            }
            Hash::Poly { poly, .. } => {
                let mut lens = [0u8; 16];
                lens[..8].copy_from_slice(&self.head_len.to_le_bytes());
                lens[8..].copy_from_slice(&self.body_len.to_le_bytes());
                poly.update_padded(&lens);
                poly.clone().finalize().into()
            }
        }
    }

    /// Whether `tag` is the message's tag.
    pub fn check(&mut self, tag: &[u8]) -> bool {
        same_mac(&self.finish(), tag)
    }
}

/// Both directions of one transfer connection, as one end holds them.
#[derive(Debug, Clone)]
pub struct StreamSession {
    /// Seals the messages this end sends.
    pub send: StreamMac,
    /// Checks the messages this end receives.
    pub recv: StreamMac,
}

impl StreamSession {
    /// The keys of the connection whose greeting had these nonces, for service `service`, as
    /// the client (`client`) or the server holds them.
    pub fn derive(
        secret: &Secret,
        service: u8,
        client_nonce: &[u8],
        server_nonce: &[u8],
        client: bool,
    ) -> StreamSession {
        let base = secret.derive("stream session v1", &[&[service], client_nonce, server_nonce]);
        let keys = |way: &str| {
            StreamMac::new(mac32(&base, way, &[b"aes-256-gcm"]), mac32(&base, way, &[b"chacha20-poly1305"]))
        };
        let (up, down) = (keys("client to server"), keys("server to client"));
        if client {
            StreamSession { send: up, recv: down }
        } else {
            StreamSession { send: down, recv: up }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aes_gcm::Aes256Gcm;
    use chacha20poly1305::aead::AeadInPlace;
    use chacha20poly1305::ChaCha20Poly1305;

    const AES: [u8; 32] = [7; 32];
    const CHACHA: [u8; 32] = [9; 32];

    /// The whole-message AEAD the streamed one must match: ciphertext and tag.
    fn aead(seq: u64, head: &[u8], body: &mut [u8]) -> [u8; 16] {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_le_bytes());
        if (body.len() as u64) < POLY_FROM {
            Aes256Gcm::new(&AES.into()).encrypt_in_place_detached(&nonce.into(), head, body).unwrap().into()
        } else {
            ChaCha20Poly1305::new(&CHACHA.into()).encrypt_in_place_detached(&nonce.into(), head, body).unwrap().into()
        }
    }

    #[test]
    fn streamed_messages_match_the_whole_message_aead() {
        let body: Vec<u8> = (0..70_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let cases = [(0, 0, 1), (112, 0, 1), (0, 4096, 4096), (16, 5000, 7), (3, 33, 16), (16, 16384, 1000), (0, 70_000, 4099)];
        for (head_len, body_len, piece) in cases {
            let head = &body[..head_len];
            let plain = &body[..body_len];
            // Encrypted: the same bytes and tag as the AEAD over the whole message.
            let mut mac = StreamMac::new(AES, CHACHA);
            mac.seq = 9;
            let mut s = mac.begin(head, body_len as u64);
            let mut sent = plain.to_vec();
            for p in sent.chunks_mut(piece) {
                s.encrypt(p);
            }
            let mut want = plain.to_vec();
            assert_eq!(s.finish(), aead(9, head, &mut want), "{head_len}/{body_len}/{piece}");
            assert!(sent == want, "{head_len}/{body_len}/{piece}");
            // Authenticated only: the AEAD's tag with the plaintext in the ciphertext's place,
            // which the receiver checks and then (were it encrypted) decrypts.
            let mut mac = StreamMac::new(AES, CHACHA);
            let mut s = mac.begin(head, body_len as u64);
            for p in plain.chunks(piece) {
                s.absorb(p);
            }
            let tag = s.finish();
            let mut rx = StreamMac::new(AES, CHACHA);
            let mut r = rx.begin(head, body_len as u64);
            r.absorb(plain);
            assert!(r.check(&tag));
            let mut other = StreamMac::new([8; 32], [8; 32]);
            let mut r = other.begin(head, body_len as u64);
            r.absorb(plain);
            assert!(!r.check(&tag), "another key");
        }
    }

    #[test]
    fn messages_check_in_order_and_altered_ones_fail() {
        let (mut tx, mut rx) = (StreamMac::new(AES, CHACHA), StreamMac::new(AES, CHACHA));
        let a = tx.seal_head(b"first");
        let b = tx.seal_head(b"second");
        assert!(!rx.clone().open_head(b"second", &b), "reordered");
        assert!(rx.open_head(b"first", &a));
        assert!(!rx.clone().open_head(b"first", &a), "replayed");
        assert!(!rx.clone().open_head(b"secone", &b), "altered");
        assert!(rx.open_head(b"second", &b));
        for len in [13usize, 20_000] {
            let plain: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut body = plain.clone();
            let mut s = tx.begin(b"", len as u64);
            s.encrypt(&mut body);
            let tag = s.finish();
            let opens = |rx: &mut StreamMac, data: &[u8]| {
                let mut r = rx.begin(b"", len as u64);
                r.absorb(data);
                r.check(&tag)
            };
            let mut bad = body.clone();
            bad[3] ^= 1;
            assert!(!opens(&mut rx.clone(), &bad), "altered body");
            assert!(!opens(&mut rx.clone(), &body[..len - 1]), "cut short");
            let mut r = rx.begin(b"", len as u64);
            r.absorb(&body);
            assert!(r.check(&tag));
            r.decrypt(&mut body);
            assert_eq!(body, plain);
        }
    }
}
