//! Data-path capabilities: the master's grant of one replica range, checked by the segment's
//! holder on every transfer without a round trip.
//!
//! A capability binds the segment and its mount generation (through the key), the granted
//! range and the range's allocation generation, the rights, an expiry, the group epoch and the
//! tenant. The key is `HMAC(cluster secret, "segment key v3" ‖ segment ‖ incarnation)`: any
//! master of the cluster can mint one and the holder can check it, and no key travels on the
//! wire. The tag is the first 16 bytes of
//! `SHA-256((key ‖ 0³²) ⊕ 0x36⁶⁴ ‖ offset ‖ length ‖ rights ‖ expiry ‖ epoch ‖ group ‖ tenant ‖ generation ‖ 0²)`,
//! HMAC-SHA256's inner hash: every tagged message is exactly 49 bytes, one block with its
//! padding, so no valid message extends another, and the outer hash HMAC adds against length
//! extension would buy nothing; what makes the tag unforgeable is SHA-256's compression
//! function keyed through its chaining value, the assumption HMAC's own proof rests on. Bound
//! to the generation, a grant is worth nothing once its range is reused: the holder compares it
//! with the range's current generation before it sends a byte.

use serde::{Deserialize, Serialize};

use super::{same_mac, Secret};
use crate::{ErrorCode, SegmentId};

/// Right to read the range.
pub const RIGHT_READ: u8 = 1;
/// Right to write the range.
pub const RIGHT_WRITE: u8 = 2;
/// Right to retire the range once its value is replaced (op 3: blocks that still carry the
/// range's generation get 0). It moves no bytes, so it is safe to hand out for a range that
/// may already belong to another object; a write grant does not include it.
pub const RIGHT_RETIRE: u8 = 4;
/// How far a holder's clock may run ahead of the minting master's before a fresh capability
/// looks expired. Hosts of a cluster must keep their clocks within this of each other.
pub const CLOCK_SKEW_MS: u64 = 5_000;

/// A grant as it travels in a replica descriptor. The range it covers is the descriptor's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Capability {
    /// [`RIGHT_READ`], [`RIGHT_WRITE`] and/or [`RIGHT_RETIRE`]; 0 in a cluster without a
    /// secret.
    pub rights: u8,
    /// Wall-clock expiry, milliseconds since the Unix epoch.
    pub expires_ms: u64,
    /// Ownership epoch of the group that granted it.
    pub epoch: u64,
    /// KVPT group that granted it.
    pub group: u16,
    /// Tag of the tenant the object belongs to ([`tenant_tag`]).
    pub tenant: u64,
    /// The MAC.
    pub mac: [u8; 16],
}

/// A short tag naming a tenant inside a capability (FNV-1a of its name).
pub fn tenant_tag(tenant: &str) -> u64 {
    tenant.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Milliseconds since the Unix epoch by the wall clock.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Capability {
    /// The last moment (Unix ms, by the holder's clock) at which the holder may still move a
    /// byte under this capability: its expiry plus the allowed clock skew. A transfer still
    /// under way then is cut off, so that a master, which reuses the range across tenants only
    /// after `expires_ms + 2 * CLOCK_SKEW_MS` by its own clock, never sees a byte move under an
    /// old grant afterwards.
    pub fn deadline_ms(&self) -> u64 {
        self.expires_ms.saturating_add(CLOCK_SKEW_MS)
    }
}

/// The key of one mounted segment generation, ready to mint or check many capabilities.
///
/// It keeps the SHA-256 state after the key block, so that a tag costs one compression (see
/// the module's notes); a tag is a minted write's main cost on the master.
#[derive(Clone)]
pub struct SegmentKey {
    keyed: [u32; 8],
}

impl std::fmt::Debug for SegmentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SegmentKey(..)")
    }
}

/// SHA-256's initial state.
const SHA256_IV: [u32; 8] =
    [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

/// Bytes of the message a tag covers.
const TAG_MSG: usize = 49;

fn compress(state: &mut [u32; 8], block: &[u8; 64]) {
    sha2::compress256(state, std::slice::from_ref(block.into()));
}

/// The final block of a message made of one key block and `data` (at most 55 bytes): `data`
/// and SHA-256's padding.
fn last_block(data: &[u8]) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..data.len()].copy_from_slice(data);
    b[data.len()] = 0x80;
    b[56..].copy_from_slice(&((64 + data.len() as u64) * 8).to_be_bytes());
    b
}

impl SegmentKey {
    /// The key of `segment` in its mount generation `incarnation`.
    pub fn new(secret: &Secret, segment: SegmentId, incarnation: u32) -> SegmentKey {
        let key = secret.derive("segment key v3", &[&segment.0.to_le_bytes(), &incarnation.to_le_bytes()]);
        // HMAC's inner key block: the key zero-padded to 64 bytes, XOR 0x36.
        let mut block = [0x36u8; 64];
        block.iter_mut().zip(key).for_each(|(b, k)| *b ^= k);
        let mut keyed = SHA256_IV;
        compress(&mut keyed, &block);
        SegmentKey { keyed }
    }

    fn tag(&self, offset: u64, len: u64, gen: u32, c: &Capability) -> [u8; 16] {
        let mut msg = [0u8; TAG_MSG];
        msg[0..8].copy_from_slice(&offset.to_le_bytes());
        msg[8..16].copy_from_slice(&len.to_le_bytes());
        msg[16] = c.rights;
        msg[17..25].copy_from_slice(&c.expires_ms.to_le_bytes());
        msg[25..33].copy_from_slice(&c.epoch.to_le_bytes());
        msg[33..35].copy_from_slice(&c.group.to_le_bytes());
        msg[35..43].copy_from_slice(&c.tenant.to_le_bytes());
        msg[43..47].copy_from_slice(&gen.to_le_bytes());
        let mut state = self.keyed;
        compress(&mut state, &last_block(&msg));
        let mut tag = [0u8; 16];
        for (t, w) in tag.chunks_exact_mut(4).zip(state) {
            t.copy_from_slice(&w.to_be_bytes());
        }
        tag
    }

    /// A capability for `len` bytes at `offset`, allocated under generation `gen`, with the
    /// other fields of `c` (its MAC is replaced).
    pub fn mint(&self, offset: u64, len: u64, gen: u32, mut c: Capability) -> Capability {
        c.mac = self.tag(offset, len, gen, &c);
        c
    }

    /// Checks `c` as the grant of `len` bytes at `offset` of generation `gen`, and that it
    /// allows `rights` now (`now_ms`, the holder's wall clock).
    pub fn check(
        &self,
        offset: u64,
        len: u64,
        gen: u32,
        c: &Capability,
        rights: u8,
        now_ms: u64,
    ) -> Result<(), ErrorCode> {
        if !same_mac(&self.tag(offset, len, gen, c), &c.mac) {
            return Err(ErrorCode::CAPABILITY_INVALID);
        }
        if c.rights & rights != rights {
            return Err(ErrorCode::CAPABILITY_INVALID);
        }
        if now_ms > c.deadline_ms() {
            return Err(ErrorCode::CAPABILITY_EXPIRED);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(inc: u32) -> SegmentKey {
        SegmentKey::new(&Secret::from_text(b"capability-test-secret-of-enough-length").unwrap(), SegmentId(77), inc)
    }

    #[test]
    fn tags_are_the_inner_hash_of_hmac_sha256() {
        use sha2::Digest;
        let secret = Secret::from_text(b"capability-test-secret-of-enough-length").unwrap();
        let k = key(9);
        let raw = secret.derive("segment key v3", &[&77u128.to_le_bytes(), &9u32.to_le_bytes()]);
        let c = Capability { rights: 3, expires_ms: 1 << 40, epoch: 12, group: 7, tenant: 0xfeed, mac: [0; 16] };
        let mut msg = [0u8; 49];
        msg[0..8].copy_from_slice(&4096u64.to_le_bytes());
        msg[8..16].copy_from_slice(&100u64.to_le_bytes());
        msg[16] = c.rights;
        msg[17..25].copy_from_slice(&c.expires_ms.to_le_bytes());
        msg[25..33].copy_from_slice(&c.epoch.to_le_bytes());
        msg[33..35].copy_from_slice(&c.group.to_le_bytes());
        msg[35..43].copy_from_slice(&c.tenant.to_le_bytes());
        msg[43..47].copy_from_slice(&5u32.to_le_bytes());
        let mut block = [0x36u8; 64];
        block.iter_mut().zip(raw).for_each(|(b, k)| *b ^= k);
        let want = sha2::Sha256::new().chain_update(block).chain_update(msg).finalize();
        assert_eq!(k.mint(4096, 100, 5, c).mac, want[..16]);
    }

    #[test]
    fn a_capability_grants_exactly_what_it_names() {
        let k = key(1);
        let base = Capability {
            rights: RIGHT_READ,
            expires_ms: 10_000,
            epoch: 3,
            group: 0,
            tenant: tenant_tag("a"),
            mac: [0; 16],
        };
        let c = k.mint(4096, 100, 5, base);
        assert_eq!(k.check(4096, 100, 5, &c, RIGHT_READ, 10_000), Ok(()));
        assert_eq!(k.check(4096, 100, 6, &c, RIGHT_READ, 10_000), Err(ErrorCode::CAPABILITY_INVALID));
        // Another range, another right, another generation, an altered field: refused.
        assert_eq!(k.check(4096, 101, 5, &c, RIGHT_READ, 0), Err(ErrorCode::CAPABILITY_INVALID));
        assert_eq!(k.check(0, 100, 5, &c, RIGHT_READ, 0), Err(ErrorCode::CAPABILITY_INVALID));
        assert_eq!(k.check(4096, 100, 5, &c, RIGHT_WRITE, 0), Err(ErrorCode::CAPABILITY_INVALID));
        assert_eq!(key(2).check(4096, 100, 5, &c, RIGHT_READ, 0), Err(ErrorCode::CAPABILITY_INVALID));
        let widened = Capability { rights: RIGHT_READ | RIGHT_WRITE, ..c };
        assert_eq!(k.check(4096, 100, 5, &widened, RIGHT_WRITE, 0), Err(ErrorCode::CAPABILITY_INVALID));
        let later = Capability { expires_ms: u64::MAX, ..c };
        assert_eq!(k.check(4096, 100, 5, &later, RIGHT_READ, 0), Err(ErrorCode::CAPABILITY_INVALID));
        // A write grant neither retires nor reads; a retire grant neither writes nor reads.
        let w = k.mint(4096, 100, 5, Capability { rights: RIGHT_WRITE, ..base });
        assert_eq!(k.check(4096, 100, 5, &w, RIGHT_WRITE, 0), Ok(()));
        assert_eq!(k.check(4096, 100, 5, &w, RIGHT_RETIRE, 0), Err(ErrorCode::CAPABILITY_INVALID));
        let r = k.mint(4096, 100, 5, Capability { rights: RIGHT_RETIRE, ..base });
        assert_eq!(k.check(4096, 100, 5, &r, RIGHT_RETIRE, 0), Ok(()));
        assert_eq!(k.check(4096, 100, 5, &r, RIGHT_WRITE, 0), Err(ErrorCode::CAPABILITY_INVALID));
        assert_eq!(k.check(4096, 100, 5, &r, RIGHT_READ, 0), Err(ErrorCode::CAPABILITY_INVALID));
        // Expiry, with the allowed skew.
        assert_eq!(c.deadline_ms(), 10_000 + CLOCK_SKEW_MS);
        assert_eq!(k.check(4096, 100, 5, &c, RIGHT_READ, 10_000 + CLOCK_SKEW_MS), Ok(()));
        assert_eq!(k.check(4096, 100, 5, &c, RIGHT_READ, 10_001 + CLOCK_SKEW_MS), Err(ErrorCode::CAPABILITY_EXPIRED));
        assert_eq!(k.check(4096, 100, 5, &Capability::default(), RIGHT_READ, 0), Err(ErrorCode::CAPABILITY_INVALID));
    }

    #[test]
    fn tenant_tags_differ() {
        assert_ne!(tenant_tag(""), tenant_tag("a"));
        assert_ne!(tenant_tag("ab"), tenant_tag("ba"));
    }
}
