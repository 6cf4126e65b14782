//! What protects a transfer connection after its greeting: a tag on every request, answer and
//! payload, and on request the payload's encryption.
//!
//! Each message is sealed as AES-256-GCM seals it, fed in pieces as the bytes are sent or
//! received: its header as associated data, then its body. Without encryption the body is the
//! plaintext itself (the tag authenticates it and hides nothing: GCM's GMAC); with encryption it
//! is the plaintext XORed with AES-CTR's key stream, so that a sealed message is exactly
//! AES-256-GCM's ciphertext and tag. The nonce is the message's sequence number in its
//! direction; each direction has its own key, derived from the secret and both greeting nonces.
//! A message injected, replayed, reordered, altered or cut short fails its tag, and the
//! connection closes.
//!
//! Why AES-GCM: with AES-NI a message costs one AES block on top of the hash (about 0.1 µs for
//! a header), and with carry-less multiply GHASH runs at several GB/s when blocks are
//! aggregated ([`super::gcm_hash`]), where HMAC-SHA256 (the RPC frames' tag) manages about
//! 1 GB/s and Poly1305 about 3 to 4 GB/s with a costly set-up per message. docs/security.md has
//! the measured costs.

use aes::cipher::{BlockEncrypt, InnerIvInit, KeyInit as _, StreamCipher};
use aes::Aes256Enc;

use super::gcm_hash::Ghash;
use super::{same_mac, Secret};

/// Bytes of the tag after each sealed transfer message.
pub const STREAM_TAG_LEN: usize = 16;

type Ctr = ctr::Ctr32BE<Aes256Enc>;

/// One direction of a transfer connection: its key and the sequence number of its next message.
#[derive(Clone)]
pub struct StreamMac {
    aes: Aes256Enc,
    /// GHASH keyed with H = AES(0), before any input.
    ghash: Ghash,
    seq: u64,
}

impl std::fmt::Debug for StreamMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamMac(seq {})", self.seq)
    }
}

impl StreamMac {
    pub(crate) fn new(key: [u8; 32]) -> StreamMac {
        let aes = Aes256Enc::new(&key.into());
        let mut h = aes::Block::default();
        aes.encrypt_block(&mut h);
        StreamMac { ghash: Ghash::new(&h.into()), aes, seq: 0 }
    }

    /// Starts the direction's next message, whose header is `head` (authenticated, never
    /// encrypted); its body goes through the returned [`Sealer`].
    pub fn begin(&mut self, head: &[u8]) -> Sealer {
        let mut j0 = [0u8; 16];
        j0[4..12].copy_from_slice(&self.seq.to_le_bytes());
        j0[15] = 1;
        self.seq += 1;
        let mut mask = aes::Block::from(j0);
        self.aes.encrypt_block(&mut mask);
        let mut ghash = self.ghash.clone();
        ghash.update_padded(head);
        Sealer {
            ghash,
            mask: mask.into(),
            aes: self.aes.clone(),
            j0,
            ctr: None,
            pending: [0; 16],
            fill: 0,
            head_len: head.len() as u64,
            body_len: 0,
        }
    }

    /// The tag of a message that is only a header.
    pub fn seal_head(&mut self, head: &[u8]) -> [u8; STREAM_TAG_LEN] {
        self.begin(head).finish()
    }

    /// Whether `tag` is the one the direction's next message, a header only, must carry.
    pub fn open_head(&mut self, head: &[u8], tag: &[u8]) -> bool {
        self.begin(head).check(tag)
    }
}

/// One message being sealed or checked: its body goes through in pieces of any size.
pub struct Sealer {
    ghash: Ghash,
    /// AES(J0), which the hash is XORed with.
    mask: [u8; 16],
    aes: Aes256Enc,
    j0: [u8; 16],
    /// The body's key stream (from counter J0 + 1), made on first use.
    ctr: Option<Ctr>,
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
            self.ghash.update_padded(&self.pending);
            self.fill = 0;
        }
        let whole = data.len() & !15;
        // Whole blocks only, so padding never applies here.
        self.ghash.update_padded(&data[..whole]);
        let rest = &data[whole..];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.fill = rest.len();
    }

    fn keystream(&mut self, data: &mut [u8]) {
        let (aes, j0) = (&self.aes, &self.j0);
        let ctr = self.ctr.get_or_insert_with(|| {
            let mut start = *j0;
            start[15] = 2;
            Ctr::from_core(ctr::CtrCore::inner_iv_init(aes.clone(), &start.into()))
        });
        ctr.apply_keystream(data);
    }

    /// Encrypts `data` in place and adds it (the sender of an encrypted body).
    pub fn encrypt(&mut self, data: &mut [u8]) {
        self.keystream(data);
        self.absorb(data);
    }

    /// Decrypts `data` in place, a piece of a body already [`absorb`](Self::absorb)ed, pieces in
    /// order; the receiver decrypts only after the tag checked.
    pub fn decrypt(&mut self, data: &mut [u8]) {
        self.keystream(data);
    }

    /// The message's tag, once its whole body was added.
    pub fn finish(&mut self) -> [u8; STREAM_TAG_LEN] {
        if self.fill > 0 {
            let (block, fill) = (self.pending, self.fill);
            self.ghash.update_padded(&block[..fill]);
            self.fill = 0;
        }
        let mut lens = [0u8; 16];
        lens[..8].copy_from_slice(&(self.head_len * 8).to_be_bytes());
        lens[8..].copy_from_slice(&(self.body_len * 8).to_be_bytes());
        let mut g = self.ghash.clone();
        g.update_padded(&lens);
        let mut tag = g.finalize();
        for (t, m) in tag.iter_mut().zip(self.mask) {
            *t ^= m;
        }
        tag
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
        let (send, recv) = super::session::direction_keys(
            secret,
            "stream session v1",
            &[b"aes-256-gcm"],
            service,
            client_nonce,
            server_nonce,
            client,
        );
        StreamSession { send: StreamMac::new(send), recv: StreamMac::new(recv) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aes_gcm::aead::AeadInPlace;
    use aes_gcm::Aes256Gcm;

    const KEY: [u8; 32] = [7; 32];

    /// The whole-message AEAD the streamed one must match: ciphertext and tag.
    fn aead(seq: u64, head: &[u8], body: &mut [u8]) -> [u8; 16] {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_le_bytes());
        Aes256Gcm::new(&KEY.into()).encrypt_in_place_detached(&nonce.into(), head, body).unwrap().into()
    }

    #[test]
    fn streamed_messages_match_the_whole_message_aead() {
        let body: Vec<u8> = (0..70_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let cases =
            [(0, 0, 1), (112, 0, 1), (0, 4096, 4096), (16, 5000, 7), (3, 33, 16), (16, 16384, 1000), (0, 70_000, 4099)];
        for (head_len, body_len, piece) in cases {
            let head = &body[..head_len];
            let plain = &body[..body_len];
            // Encrypted: the same bytes and tag as AES-256-GCM over the whole message.
            let mut mac = StreamMac::new(KEY);
            mac.seq = 9;
            let mut s = mac.begin(head);
            let mut sent = plain.to_vec();
            for p in sent.chunks_mut(piece) {
                s.encrypt(p);
            }
            let mut want = plain.to_vec();
            assert_eq!(s.finish(), aead(9, head, &mut want), "{head_len}/{body_len}/{piece}");
            assert!(sent == want, "{head_len}/{body_len}/{piece}");
            // Authenticated only: GCM's tag with the plaintext in the ciphertext's place.
            let mut mac = StreamMac::new(KEY);
            let mut s = mac.begin(head);
            for p in plain.chunks(piece) {
                s.absorb(p);
            }
            let tag = s.finish();
            let mut as_ciphertext = plain.to_vec();
            let nonce = [0u8; 12];
            let gcm = Aes256Gcm::new(&KEY.into());
            assert!(gcm.decrypt_in_place_detached(&nonce.into(), head, &mut as_ciphertext, &tag.into()).is_ok());
            let mut other = StreamMac::new([8; 32]);
            let mut r = other.begin(head);
            r.absorb(plain);
            assert!(!r.check(&tag), "another key");
        }
    }

    #[test]
    fn messages_check_in_order_and_altered_ones_fail() {
        let (mut tx, mut rx) = (StreamMac::new(KEY), StreamMac::new(KEY));
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
            let mut s = tx.begin(b"");
            s.encrypt(&mut body);
            let tag = s.finish();
            let opens = |rx: &mut StreamMac, data: &[u8]| {
                let mut r = rx.begin(b"");
                r.absorb(data);
                r.check(&tag)
            };
            let mut bad = body.clone();
            bad[3] ^= 1;
            assert!(!opens(&mut rx.clone(), &bad), "altered body");
            assert!(!opens(&mut rx.clone(), &body[..len - 1]), "cut short");
            let mut r = rx.begin(b"");
            r.absorb(&body);
            assert!(r.check(&tag));
            r.decrypt(&mut body);
            assert_eq!(body, plain);
        }
    }
}
