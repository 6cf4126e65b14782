//! Which objects eviction takes first.
//!
//! Every use of an object — the commit of its value, an existence check, a lookup of its
//! replicas — gives it the next number of its group's *use sequence*, and a lookup also counts
//! as a read. An object's [`UseMark`] keeps both in one word. The sequence is per group and
//! handed out by one atomic counter, so no two uses share a number: equal wall-clock times never
//! decide. A batch takes its numbers in one step and gives them out back to front, so that of
//! the keys of one batch (a prefix chain, in the order engines send them) the last is the
//! oldest: evicting a block makes every block after it in its chain useless, and those go first.
//!
//! Eviction ranks the candidates of a group by [`EvictionPolicy::rank`] and takes the lowest:
//!
//! - [`EvictionPolicy::Lru`]: the use number alone (least recently used first).
//! - [`EvictionPolicy::Reuse`] (the default): least recently used first, but an object that was
//!   read since it was written counts as used one *lifetime* later than it was, where a lifetime
//!   is how many uses an object that nobody read outlived its last use by when the group's
//!   previous round evicted it. KV-cache traces are dominated by blocks written once and never
//!   read (each prompt's own suffix); a block read once is read again far more often (Mooncake's
//!   conversation trace: 0.24 of its blocks are used a second time, 0.42 of those a third). The
//!   credit is measured in the group's own lifetimes, so it scales with the store's size and
//!   load instead of being a constant in uses or seconds. Before a round has measured one, the
//!   policy is LRU.
//!
//! The per-object state is one 8-byte word; a group adds two counters.
//!
//! None of this is logged: a new primary (after a failover or a reshard) numbers its objects in
//! the order it applied their commits from the log (or the snapshot's order), with no reads.

use std::sync::atomic::{AtomicU64, Ordering};

/// Which order eviction takes objects in (`tycho master --eviction-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Least recently used first.
    Lru,
    /// Least recently used first, objects read since their write credited with
    /// [`REUSE_CREDIT`] lifetimes.
    #[default]
    Reuse,
}

impl EvictionPolicy {
    /// Every policy, in the order benchmarks print them.
    pub const ALL: [EvictionPolicy; 2] = [EvictionPolicy::Lru, EvictionPolicy::Reuse];

    /// The policy's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Reuse => "reuse",
        }
    }

    /// Where an object with use mark `m` stands in its group's eviction order: the lowest rank
    /// goes first. `lifetime` is the group's [`Uses::lifetime`].
    pub fn rank(self, m: Mark, lifetime: u64) -> u64 {
        match self {
            EvictionPolicy::Lru => m.seq,
            EvictionPolicy::Reuse if m.reads > 0 => m.seq.saturating_add(REUSE_CREDIT.saturating_mul(lifetime)),
            EvictionPolicy::Reuse => m.seq,
        }
    }
}

impl std::str::FromStr for EvictionPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<EvictionPolicy, String> {
        EvictionPolicy::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("{s:?} is not one of lru, reuse"))
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How many lifetimes having been read buys under [`EvictionPolicy::Reuse`]. On Mooncake's
/// conversation trace 2 serves a few more hits than 1 at the store's size and fewer at twice
/// it, 3 fewer at both (docs/performance.md).
pub const REUSE_CREDIT: u64 = 1;

/// Bits of a use mark that count reads.
const READ_BITS: u32 = 4;
/// Reads counted at most.
pub const MAX_READS: u8 = (1 << READ_BITS) - 1;

/// A use mark, read out: the object's last use number and its reads since its write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mark {
    /// Number of the last use in the group's use sequence (0: never used).
    pub seq: u64,
    /// Reads since the value was written (saturating at [`MAX_READS`]).
    pub reads: u8,
}

impl Mark {
    fn pack(self) -> u64 {
        (self.seq << READ_BITS) | self.reads.min(MAX_READS) as u64
    }

    fn unpack(w: u64) -> Mark {
        Mark { seq: w >> READ_BITS, reads: (w & MAX_READS as u64) as u8 }
    }
}

/// An object's place in its group's use order, in one atomic word (so that readers move it
/// under the shard's read lock). Two uses at once may lose one's move or count: a use mark
/// orders, it does not account.
#[derive(Debug, Default)]
pub struct UseMark(AtomicU64);

impl UseMark {
    /// The mark as it is now.
    pub fn get(&self) -> Mark {
        Mark::unpack(self.0.load(Ordering::Relaxed))
    }

    /// Sets the mark (a new value was committed).
    pub fn set(&self, m: Mark) {
        self.0.store(m.pack(), Ordering::Relaxed);
    }

    /// A use that is not a read (an existence check): the mark moves to `seq` unless a later
    /// use got there first.
    pub fn touch(&self, seq: u64) {
        self.update(seq, 0);
    }

    /// A read: the mark moves to `seq` (unless a later use got there first) and counts it.
    pub fn read(&self, seq: u64) {
        self.update(seq, 1);
    }

    fn update(&self, seq: u64, reads: u8) {
        // A load and a store, not an atomic read-modify-write: a use racing another may undo
        // its move or its count, which orders one object by a use or a read too few, and
        // saves readers a locked instruction per key.
        let m = Mark::unpack(self.0.load(Ordering::Relaxed));
        let next = Mark { seq: m.seq.max(seq), reads: m.reads.saturating_add(reads).min(MAX_READS) };
        if next != m {
            self.0.store(next.pack(), Ordering::Relaxed);
        }
    }
}

/// One group's use sequence and the lifetime its last eviction round measured.
#[derive(Debug)]
pub struct Uses {
    /// The next use number to hand out.
    next: AtomicU64,
    /// See [`Uses::lifetime`].
    lifetime: AtomicU64,
}

impl Default for Uses {
    fn default() -> Uses {
        Uses { next: AtomicU64::new(1), lifetime: AtomicU64::new(0) }
    }
}

impl Uses {
    /// The next use number.
    pub fn next(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// `n` consecutive use numbers; returns the first.
    pub fn reserve(&self, n: usize) -> u64 {
        self.next.fetch_add(n as u64, Ordering::Relaxed)
    }

    /// The number the next use will get: every use so far has a smaller one.
    pub fn current(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    /// How many uses an object that nobody read outlived its last use by, when the last round
    /// that evicted one took it (0 before any did).
    pub fn lifetime(&self) -> u64 {
        self.lifetime.load(Ordering::Relaxed)
    }

    /// After a round that evicted objects with these marks: measures the lifetime from the
    /// latest of them that nobody read, if any.
    pub fn evicted(&self, marks: impl IntoIterator<Item = Mark>) {
        if let Some(seq) = marks.into_iter().filter(|m| m.reads == 0).map(|m| m.seq).max() {
            self.lifetime.store(self.current().saturating_sub(seq), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_keeps_its_latest_use_and_counts_reads() {
        let m = UseMark::default();
        m.set(Mark { seq: 10, reads: 0 });
        m.touch(12);
        assert_eq!(m.get(), Mark { seq: 12, reads: 0 });
        // A use numbered before the mark's (it raced a later one) does not move it back.
        m.read(11);
        assert_eq!(m.get(), Mark { seq: 12, reads: 1 });
        for s in 13..40 {
            m.read(s);
        }
        assert_eq!(m.get(), Mark { seq: 39, reads: MAX_READS });
    }

    #[test]
    fn reuse_credits_reads_in_lifetimes_and_lru_does_not() {
        let unread = Mark { seq: 100, reads: 0 };
        let read = Mark { seq: 90, reads: 1 };
        assert!(EvictionPolicy::Lru.rank(read, 50) < EvictionPolicy::Lru.rank(unread, 50));
        assert_eq!(EvictionPolicy::Reuse.rank(read, 50), 90 + REUSE_CREDIT * 50);
        assert!(EvictionPolicy::Reuse.rank(read, 50) > EvictionPolicy::Reuse.rank(unread, 50));
        // Before any round measured a lifetime, reuse is LRU.
        assert_eq!(EvictionPolicy::Reuse.rank(read, 0), 90);
    }

    #[test]
    fn the_lifetime_is_measured_from_the_latest_unread_victim() {
        let u = Uses::default();
        assert_eq!(u.reserve(10), 1);
        assert_eq!(u.next(), 11);
        u.evicted([Mark { seq: 3, reads: 0 }, Mark { seq: 9, reads: 2 }, Mark { seq: 5, reads: 0 }]);
        assert_eq!(u.lifetime(), 12 - 5);
        // A round that took only read objects measures nothing.
        u.evicted([Mark { seq: 10, reads: 1 }]);
        assert_eq!(u.lifetime(), 7);
    }

    #[test]
    fn policies_parse_by_name() {
        assert_eq!("LRU".parse::<EvictionPolicy>(), Ok(EvictionPolicy::Lru));
        assert_eq!("reuse".parse::<EvictionPolicy>(), Ok(EvictionPolicy::Reuse));
        assert!("fifo".parse::<EvictionPolicy>().is_err());
        assert_eq!(EvictionPolicy::default(), EvictionPolicy::Reuse);
    }
}
