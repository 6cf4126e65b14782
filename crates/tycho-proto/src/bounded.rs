//! Sequences in requests decoded with a bound on their length. The encoding announces a
//! sequence's length before its items; a length past the bound is refused there, before
//! anything is allocated or decoded, so a frame of millions of tiny keys costs a few bytes of
//! reading instead of a vector of millions of keys that a later check throws away.
//!
//! The bounds are above what a well-formed request holds (twice [`crate::MAX_BATCH_KEYS`] for
//! batches, so that a batch just past the limit still gets its typed BATCH_TOO_LARGE), and a
//! request past one fails to decode (INVALID_PARAMS from the master).

use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

/// Most items a batch's sequences (keys, items, write ids) may announce.
pub const DECODE_MAX_BATCH: usize = 2 * crate::MAX_BATCH_KEYS;

/// Most names a placement or task list (preferred segments, copy targets) may announce.
pub const DECODE_MAX_NAMES: usize = 128;

/// A `Vec<T>` of at most `N` items (for `#[serde(deserialize_with = ...)]`).
pub fn vec<'de, D, T, const N: usize>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T, const N: usize>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for Bounded<T, N> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a sequence of at most {N} items")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let announced = seq.size_hint().unwrap_or(0);
            if announced > N {
                return Err(A::Error::invalid_length(announced, &self));
            }
            let mut out = Vec::with_capacity(announced);
            while let Some(item) = seq.next_element()? {
                if out.len() == N {
                    return Err(A::Error::invalid_length(N + 1, &self));
                }
                out.push(item);
            }
            Ok(out)
        }
    }

    d.deserialize_seq(Bounded::<T, N>(PhantomData))
}

#[cfg(test)]
mod tests {
    use crate::frame::decode_payload;
    use crate::*;

    #[test]
    fn a_batch_past_the_bound_fails_before_its_keys_are_decoded() {
        let key = |i: usize| KeyRef { key: format!("k{i}"), route: RouteTag { partition_id: 0, epoch: 0 } };
        let at = |n: usize| {
            let q = BatchKeyQuery { tenant: String::new(), keys: (0..n).map(key).collect() };
            postcard::to_stdvec(&Request::BatchExistKey(q)).unwrap()
        };
        // At the bound: decodes (the master answers BATCH_TOO_LARGE past MAX_BATCH_KEYS).
        assert!(decode_payload::<Request>(&at(bounded::DECODE_MAX_BATCH)).is_ok());
        // One past it: refused.
        assert!(decode_payload::<Request>(&at(bounded::DECODE_MAX_BATCH + 1)).is_err());
        // A length of billions announced by a few bytes: refused without allocating.
        let mut forged =
            postcard::to_stdvec(&Request::BatchExistKey(BatchKeyQuery { tenant: String::new(), keys: vec![] }))
                .unwrap();
        let last = forged.len() - 1;
        forged.truncate(last);
        forged.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(decode_payload::<Request>(&forged).is_err());
    }
}
