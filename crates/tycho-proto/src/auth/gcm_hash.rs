//! GHASH, the universal hash of AES-GCM, fast enough for transfer payloads.
//!
//! The `ghash` crate multiplies and reduces once per 16-byte block, about 1.5 GB/s on the
//! development VM: slower than loopback TCP, so a sealed 1 MiB read took three times as long as
//! one in the clear. Here, with carry-less multiply (PCLMULQDQ), eight blocks are multiplied by
//! the first eight powers of the hash key and their unreduced products summed before one
//! reduction (Karatsuba, three multiplies a block), which is the same polynomial evaluated in
//! another order. CPUs without PCLMULQDQ use the crate.
//!
//! The arithmetic is POLYVAL's (RFC 8452), whose bit order needs no reflection: GHASH with key
//! H over blocks X is the byte reversal of POLYVAL with key mulX(reverse(H)) over the reversed
//! blocks (RFC 8452, appendix A). A POLYVAL product a·b is a·b·x⁻¹²⁸ modulo
//! x¹²⁸ + x¹²⁷ + x¹²⁶ + x¹²¹ + 1, so the reduction folds the low 128 bits of the 256-bit
//! product away (a Montgomery reduction by shifts). Tests compare it with the crate.

use ghash::universal_hash::{KeyInit, UniversalHash};

/// A GHASH computation in progress under one key.
#[derive(Clone)]
pub struct Ghash(Backend);

// The fast state (272 bytes: the key's powers) is cloned per message; boxing it would allocate
// per message instead.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Backend {
    #[cfg(target_arch = "x86_64")]
    Clmul(clmul::State),
    Crate(ghash::GHash),
}

impl Ghash {
    /// GHASH keyed with `h` (AES-GCM's AES_K(0¹²⁸)).
    pub fn new(h: &[u8; 16]) -> Ghash {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("pclmulqdq") && std::arch::is_x86_feature_detected!("ssse3") {
            // SAFETY: the CPU has the features the function is compiled for.
            return Ghash(Backend::Clmul(unsafe { clmul::State::new(h) }));
        }
        Ghash(Backend::Crate(ghash::GHash::new(h.into())))
    }

    /// Adds `data`, zero-padded to a whole number of 16-byte blocks.
    pub fn update_padded(&mut self, data: &[u8]) {
        match &mut self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Clmul` state exists only where `new` found the CPU features.
            Backend::Clmul(s) => unsafe { s.update_padded(data) },
            Backend::Crate(g) => g.update_padded(data),
        }
    }

    /// The hash of everything added.
    pub fn finalize(&self) -> [u8; 16] {
        match &self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `update_padded`.
            Backend::Clmul(s) => unsafe { s.finalize() },
            Backend::Crate(g) => g.clone().finalize().into(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod clmul {
    use std::arch::x86_64::*;

    /// Blocks multiplied and summed per reduction.
    const WIDE: usize = 8;

    #[derive(Clone, Copy)]
    pub(super) struct State {
        /// H¹ … H⁸ in the POLYVAL field (`powers[i]` = H^(i+1)).
        powers: [__m128i; WIDE],
        /// For each power, its two 64-bit halves XORed (in the low half): Karatsuba's middle
        /// factor.
        folded: [__m128i; WIDE],
        acc: __m128i,
    }

    /// Reverses the 16 bytes of a block (GHASH's byte order to POLYVAL's and back).
    #[inline]
    #[target_feature(enable = "ssse3")]
    fn reverse(x: __m128i) -> __m128i {
        _mm_shuffle_epi8(x, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
    }

    /// A block of `data` at `at`, in POLYVAL's byte order.
    #[inline]
    #[target_feature(enable = "ssse3")]
    fn load(data: &[u8], at: usize) -> __m128i {
        let b: &[u8; 16] = data[at..at + 16].try_into().expect("a whole block");
        // SAFETY: `b` is 16 readable bytes; the load is unaligned.
        reverse(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
    }

    /// The two 64-bit halves of `x` XORed, in the low half.
    #[inline]
    #[target_feature(enable = "sse2")]
    fn fold(x: __m128i) -> __m128i {
        _mm_xor_si128(x, _mm_shuffle_epi32(x, 0x0E))
    }

    /// The unreduced product of `x` and a power (`h`, `hf` its fold): low, high and Karatsuba
    /// middle products.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn product(x: __m128i, h: __m128i, hf: __m128i) -> (__m128i, __m128i, __m128i) {
        (_mm_clmulepi64_si128(x, h, 0x00), _mm_clmulepi64_si128(x, h, 0x11), _mm_clmulepi64_si128(fold(x), hf, 0x00))
    }

    /// Reduces a sum of unreduced products (low, high, Karatsuba middle) to a field element.
    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn reduce(lo: __m128i, hi: __m128i, kara: __m128i) -> __m128i {
        let x = _mm_xor_si128;
        // The product's four 64-bit words, each in the low half of a register.
        let mid = x(kara, x(lo, hi));
        let w0 = lo;
        let w1 = x(_mm_shuffle_epi32(lo, 0x0E), mid);
        let w2 = x(hi, _mm_shuffle_epi32(mid, 0x0E));
        let w3 = _mm_shuffle_epi32(hi, 0x0E);
        // Fold w0 into w1 and w2, then w1 into w2 and w3: multiplying by x⁻¹²⁸ modulo the
        // polynomial, whose low terms x¹²¹ + x¹²⁶ + x¹²⁷ give the shifts by 57, 62 and 63
        // (and 7, 2 and 1 the other way).
        let down = |w| x(x(w, _mm_srli_epi64(w, 1)), x(_mm_srli_epi64(w, 2), _mm_srli_epi64(w, 7)));
        let up = |w| x(_mm_slli_epi64(w, 63), x(_mm_slli_epi64(w, 62), _mm_slli_epi64(w, 57)));
        let w2 = x(w2, down(w0));
        let w1 = x(w1, up(w0));
        let w3 = x(w3, down(w1));
        let w2 = x(w2, up(w1));
        _mm_unpacklo_epi64(w2, w3)
    }

    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn mul(a: __m128i, b: __m128i) -> __m128i {
        let (lo, hi, kara) = product(a, b, fold(b));
        reduce(lo, hi, kara)
    }

    impl State {
        /// # Safety
        /// The CPU must have PCLMULQDQ and SSSE3.
        #[target_feature(enable = "pclmulqdq,ssse3,sse2")]
        pub(super) unsafe fn new(h: &[u8; 16]) -> State {
            // POLYVAL's key: the reversed key multiplied by x.
            let mut r = *h;
            r.reverse();
            let v = u128::from_le_bytes(r);
            let top = v >> 127;
            let v = (v << 1) ^ top ^ (top << 127) ^ (top << 126) ^ (top << 121);
            // SAFETY: 16 readable bytes.
            let h1 = unsafe { _mm_loadu_si128(v.to_le_bytes().as_ptr().cast()) };
            let mut powers = [h1; WIDE];
            for i in 1..WIDE {
                powers[i] = mul(powers[i - 1], h1);
            }
            State { powers, folded: powers.map(|p| fold(p)), acc: _mm_setzero_si128() }
        }

        /// # Safety
        /// As for [`new`](Self::new).
        #[target_feature(enable = "pclmulqdq,ssse3,sse2")]
        pub(super) unsafe fn update_padded(&mut self, data: &[u8]) {
            let x = _mm_xor_si128;
            let whole = data.len() & !15;
            let mut at = 0;
            while at + 16 * WIDE <= whole {
                // (acc + X1)·H⁸ + X2·H⁷ + … + X8·H¹, reduced once.
                let first = x(self.acc, load(data, at));
                let (mut lo, mut hi, mut kara) = product(first, self.powers[WIDE - 1], self.folded[WIDE - 1]);
                for j in 1..WIDE {
                    let p = WIDE - 1 - j;
                    let (l, h, k) = product(load(data, at + 16 * j), self.powers[p], self.folded[p]);
                    lo = x(lo, l);
                    hi = x(hi, h);
                    kara = x(kara, k);
                }
                self.acc = reduce(lo, hi, kara);
                at += 16 * WIDE;
            }
            while at < whole {
                self.acc = mul(x(self.acc, load(data, at)), self.powers[0]);
                at += 16;
            }
            if whole < data.len() {
                let mut last = [0u8; 16];
                last[..data.len() - whole].copy_from_slice(&data[whole..]);
                self.acc = mul(x(self.acc, load(&last, 0)), self.powers[0]);
            }
        }

        /// # Safety
        /// As for [`new`](Self::new).
        #[target_feature(enable = "pclmulqdq,ssse3,sse2")]
        pub(super) unsafe fn finalize(&self) -> [u8; 16] {
            let mut out = [0u8; 16];
            // SAFETY: 16 writable bytes.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), reverse(self.acc)) };
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_ghash_crate_for_every_length_and_split() {
        let data: Vec<u8> = (0..3000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for key in [[0u8; 16], [0xff; 16], *b"0123456789abcdef", [0x80; 16]] {
            for len in [0, 1, 15, 16, 17, 127, 128, 129, 255, 256, 1000, 3000] {
                let mut want = ghash::GHash::new(&key.into());
                want.update_padded(&data[..len]);
                let want: [u8; 16] = want.finalize().into();
                let mut got = Ghash::new(&key);
                got.update_padded(&data[..len]);
                assert_eq!(got.finalize(), want, "{len} bytes");
                // Whole blocks first, the rest after: as a sealer feeds it.
                let split = (len / 3) & !15;
                let mut got = Ghash::new(&key);
                got.update_padded(&data[..split]);
                got.update_padded(&data[split..len]);
                assert_eq!(got.finalize(), want, "{len} bytes split at {split}");
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(
            matches!(Ghash::new(&[1; 16]).0, Backend::Clmul(_)) || !std::arch::is_x86_feature_detected!("pclmulqdq"),
            "the fast path is used where the CPU has it"
        );
    }
}
