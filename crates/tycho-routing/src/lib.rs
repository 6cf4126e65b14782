//! Routing: which KV partition a key falls in, and which KVPT group (rank) owns it.
//!
//! `partition_id = crc32c(len(tenant) ‖ tenant ‖ key) mod 16384` and
//! `rank = partition_id × G / 16384`. Both are pure functions: a client computes them
//! locally and the master recomputes them to check the route a request was sent under.
//!
//! The tenant is prefixed with its length (u32, little-endian) so that `("ab", "c")` and
//! `("a", "bc")` hash differently.

mod cache;

pub use cache::RouteCache;
use tycho_proto::{ErrorCode, RouteTag, MAX_KEY_LEN, MAX_TENANT_LEN};

/// Number of fixed KV partitions (spec 01).
pub const PARTITION_COUNT: u32 = 16384;

/// Epoch of a KVPT group before its first ownership change (in a cluster without an
/// incarnation: a master alone, or a cluster made before incarnations existed).
pub const INITIAL_GROUP_EPOCH: u64 = 1;

/// The first epoch of every group of a cluster created as `incarnation` (its creation time, in
/// Unix seconds; 0: none). The incarnation is the epoch's high 32 bits, so every epoch of a
/// cluster started over is above every epoch of the one before: the fences that keep the
/// highest epoch seen (nodes' write fences, clients' route caches) follow the new cluster
/// without being reset, and a grant or route of the old one stays stale.
pub fn first_epoch(incarnation: u64) -> u64 {
    (incarnation.min(u64::from(u32::MAX)) << 32) | INITIAL_GROUP_EPOCH
}

/// `epoch` within its cluster's incarnation (its low 32 bits): what people read, counting
/// ownership changes from 1.
pub fn epoch_in_incarnation(epoch: u64) -> u64 {
    epoch & u64::from(u32::MAX)
}

/// The bytes a key is identified by: length-prefixed tenant followed by the key.
/// The master stores objects under these bytes, and the partition is their CRC32C.
pub fn encode_object_key(tenant: &str, key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + tenant.len() + key.len());
    out.extend_from_slice(&(tenant.len() as u32).to_le_bytes());
    out.extend_from_slice(tenant.as_bytes());
    out.extend_from_slice(key.as_bytes());
    out
}

/// Splits bytes made by [`encode_object_key`] back into tenant and key.
pub fn decode_object_key(bytes: &[u8]) -> Option<(&str, &str)> {
    let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let tenant = std::str::from_utf8(bytes.get(4..4 + len)?).ok()?;
    let key = std::str::from_utf8(bytes.get(4 + len..)?).ok()?;
    Some((tenant, key))
}

/// Partition of already-encoded object-key bytes.
pub fn partition_of_encoded(encoded: &[u8]) -> u16 {
    (short_crc::crc32c(&[encoded]) % PARTITION_COUNT) as u16
}

/// Partition of `(tenant, key)`.
pub fn partition_of(tenant: &str, key: &str) -> u16 {
    let len = (tenant.len() as u32).to_le_bytes();
    (short_crc::crc32c(&[&len, tenant.as_bytes(), key.as_bytes()]) % PARTITION_COUNT) as u16
}

/// CRC32C of a few short pieces, as if concatenated.
///
/// Keys are tens of bytes and every key-addressed call hashes one on each side. The `crc32c`
/// crate is tuned for long buffers (three interleaved streams); for a key its set-up cost
/// outweighs the work, so on x86-64 with SSE 4.2 the pieces go through the CRC instruction
/// eight bytes at a time instead. Results are identical; the tests compare both.
mod short_crc {
    /// Standard CRC32C (initial value and final XOR all ones) of the concatenated pieces.
    pub fn crc32c(pieces: &[&[u8]]) -> u32 {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("sse4.2") {
            let mut state = !0u32;
            for piece in pieces {
                // SAFETY: the CPU supports SSE 4.2, checked just above.
                state = unsafe { update_sse42(state, piece) };
            }
            return !state;
        }
        portable(pieces)
    }

    /// The same through the `crc32c` crate, for CPUs without the instruction.
    pub fn portable(pieces: &[&[u8]]) -> u32 {
        pieces.iter().fold(0, |crc, piece| crc32c::crc32c_append(crc, piece))
    }

    /// Folds `data` into a raw (not inverted) CRC32C state.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "sse4.2")]
    unsafe fn update_sse42(state: u32, data: &[u8]) -> u32 {
        use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
        let mut words = data.chunks_exact(8);
        let mut wide = u64::from(state);
        for word in &mut words {
            wide = _mm_crc32_u64(wide, u64::from_le_bytes(word.try_into().expect("eight bytes")));
        }
        let mut state = wide as u32;
        for &byte in words.remainder() {
            state = _mm_crc32_u8(state, byte);
        }
        state
    }
}

/// `KvptToRank`: the KVPT group of a partition when there are `groups` groups.
pub fn kvpt_to_rank(partition_id: u16, groups: u32) -> u32 {
    debug_assert!((1..=PARTITION_COUNT).contains(&groups));
    ((partition_id as u64 * groups as u64) / PARTITION_COUNT as u64) as u32
}

/// The first partition of `rank` and one past its last, when there are `groups` groups.
pub fn rank_partitions(rank: u32, groups: u32) -> std::ops::Range<u32> {
    // Smallest p with p*G/16384 >= r is ceil(r*16384/G).
    let first = |r: u32| ((r as u64 * PARTITION_COUNT as u64).div_ceil(groups as u64)) as u32;
    first(rank)..first(rank + 1).min(PARTITION_COUNT)
}

/// Checks that a tenant and key are acceptable to store.
pub fn validate_key(tenant: &str, key: &str) -> Result<(), ErrorCode> {
    if key.is_empty() || key.len() > MAX_KEY_LEN || tenant.len() > MAX_TENANT_LEN {
        return Err(ErrorCode::INVALID_KEY);
    }
    Ok(())
}

/// The route a client attaches to a key under `epoch`.
pub fn route_for(tenant: &str, key: &str, epoch: u64) -> RouteTag {
    RouteTag { partition_id: partition_of(tenant, key), epoch }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_crc_matches_the_crc32c_crate() {
        let data: Vec<u8> = (0..200u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in 0..data.len() {
            for split in [0, len / 3, len / 2, len] {
                let (a, b) = data[..len].split_at(split);
                let whole = crc32c::crc32c(&data[..len]);
                assert_eq!(short_crc::crc32c(&[a, b]), whole, "len {len} split {split}");
                assert_eq!(short_crc::portable(&[a, b]), whole, "len {len} split {split}");
            }
        }
        assert_eq!(short_crc::crc32c(&[]), 0);
        // The published check value of CRC32C.
        assert_eq!(short_crc::crc32c(&[b"123456789"]), 0xE306_9283);
    }

    /// Fixed values: a change here changes where every stored key lives.
    #[test]
    fn golden_partitions() {
        let cases: &[(&str, &str, u16)] = &[
            ("", "a", GOLDEN[0]),
            ("", "hello", GOLDEN[1]),
            ("tenant-1", "hello", GOLDEN[2]),
            ("", "kv/layer0/block/00000001", GOLDEN[3]),
            ("ab", "c", GOLDEN[4]),
            ("a", "bc", GOLDEN[5]),
        ];
        for &(t, k, want) in cases {
            assert_eq!(partition_of(t, k), want, "tenant {t:?} key {k:?}");
            assert_eq!(partition_of_encoded(&encode_object_key(t, k)), want);
        }
        assert_ne!(partition_of("ab", "c"), partition_of("a", "bc"));
    }

    const GOLDEN: [u16; 6] = [GOLDEN_A, GOLDEN_HELLO, GOLDEN_T1_HELLO, GOLDEN_BLOCK, GOLDEN_AB_C, GOLDEN_A_BC];
    // CRC32C (Castagnoli) of the length-prefixed encoding, mod 16384, computed by a bitwise
    // reference implementation in Python, independent of the crate under test.
    const GOLDEN_A: u16 = 9812;
    const GOLDEN_HELLO: u16 = 9690;
    const GOLDEN_T1_HELLO: u16 = 11956;
    const GOLDEN_BLOCK: u16 = 2239;
    const GOLDEN_AB_C: u16 = 12080;
    const GOLDEN_A_BC: u16 = 6760;

    #[test]
    fn crc32c_is_castagnoli() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn ranks_are_contiguous_and_cover_all_partitions() {
        for g in [1u32, 2, 3, 7, 16, 1000, 16384] {
            let mut next = 0;
            for r in 0..g {
                let range = rank_partitions(r, g);
                assert_eq!(range.start, next, "G={g} rank={r}");
                for p in [range.start, range.end - 1] {
                    assert_eq!(kvpt_to_rank(p as u16, g), r);
                }
                next = range.end;
            }
            assert_eq!(next, PARTITION_COUNT);
        }
        assert_eq!(kvpt_to_rank(16383, 1), 0);
        assert_eq!(kvpt_to_rank(8191, 2), 0);
        assert_eq!(kvpt_to_rank(8192, 2), 1);
    }

    #[test]
    fn object_key_encoding_round_trips() {
        let e = encode_object_key("t", "k/1");
        assert_eq!(decode_object_key(&e), Some(("t", "k/1")));
        assert_eq!(decode_object_key(&[1, 0]), None);
    }

    #[test]
    fn key_validation() {
        assert_eq!(validate_key("", ""), Err(ErrorCode::INVALID_KEY));
        assert_eq!(validate_key("", &"x".repeat(MAX_KEY_LEN + 1)), Err(ErrorCode::INVALID_KEY));
        assert!(validate_key("", &"x".repeat(MAX_KEY_LEN)).is_ok());
    }
}
