//! How often each key is read (issue 16, spec 05's heat window): soft state of the master that
//! serves the key, fed by GetReplicaList and its batch form, never logged (a new primary starts
//! with no heat, as a cold cache would).
//!
//! Each key has a tumbling window of `window_ms`: the reads since the window opened are counted,
//! and the key is hot once they reach `threshold_qps × window` within it. A key turns hot at
//! most once per window, so that one hot key makes one admission trigger per window, not one
//! per read.
//!
//! The windows are bounded: at most `max_entries` keys (split evenly over the shards), and a key
//! seen when its shard is full is not counted (dropped). A full shard first tries a cleanup that
//! looks at no more than `cleanup_budget` keys, oldest tracked first, and forgets those whose
//! window has ended; keys still in their window go to the back of the line. Nothing on the read
//! path ever scans every key.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

/// How the heat window is kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeatConfig {
    /// Length of a key's window, ms (Mooncake: 10 s).
    pub window_ms: u64,
    /// Reads per second over a window that make a key hot (Mooncake: 0.8).
    pub threshold_qps: f64,
    /// Most keys tracked at once.
    pub max_entries: usize,
    /// Most keys a full shard looks at to make room.
    pub cleanup_budget: usize,
}

impl Default for HeatConfig {
    fn default() -> HeatConfig {
        HeatConfig { window_ms: 10_000, threshold_qps: 0.8, max_entries: 1 << 16, cleanup_budget: 64 }
    }
}

impl HeatConfig {
    /// Reads within one window that make a key hot (at least one).
    pub fn hits_to_be_hot(&self) -> u64 {
        ((self.threshold_qps * self.window_ms as f64 / 1000.0).ceil() as u64).max(1)
    }
}

/// What one read of a key did to its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Counted; the key is not hot (or was found hot earlier in this window).
    Counted,
    /// This read made the key hot in this window.
    TurnedHot,
    /// Not counted: the key is not tracked and there is no room for it.
    Dropped,
}

struct KeyHeat {
    opened_ms: u64,
    hits: u64,
    hot: bool,
}

#[derive(Default)]
struct Shard {
    keys: HashMap<Box<[u8]>, KeyHeat>,
    /// The tracked keys, oldest tracked first: where a cleanup looks.
    order: VecDeque<Box<[u8]>>,
}

/// The heat windows of the keys a master serves.
pub struct Heat {
    cfg: HeatConfig,
    per_shard: usize,
    shards: Box<[Mutex<Shard>]>,
}

impl Heat {
    /// Empty windows, in `shards` shards (a key's shard comes from a hash of its bytes, so that
    /// the keys of one KVPT group, whose partitions are a contiguous range, use them all).
    pub fn new(cfg: HeatConfig, shards: usize) -> Heat {
        let shards = shards.max(1);
        Heat {
            cfg,
            per_shard: cfg.max_entries.div_ceil(shards).max(1),
            shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &HeatConfig {
        &self.cfg
    }

    /// Counts one read of `key` at `now_ms`.
    pub fn saw(&self, key: &[u8], now_ms: u64) -> Seen {
        // FNV-1a over the key's bytes: spreads keys over the shards whatever their partitions.
        let hash = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3));
        let mut s = self.shards[(hash % self.shards.len() as u64) as usize].lock();
        let need = self.cfg.hits_to_be_hot();
        if let Some(k) = s.keys.get_mut(key) {
            if now_ms >= k.opened_ms.saturating_add(self.cfg.window_ms) {
                *k = KeyHeat { opened_ms: now_ms, hits: 0, hot: false };
            }
            k.hits += 1;
            if !k.hot && k.hits >= need {
                k.hot = true;
                return Seen::TurnedHot;
            }
            return Seen::Counted;
        }
        if s.keys.len() >= self.per_shard {
            self.clean(&mut s, now_ms);
            if s.keys.len() >= self.per_shard {
                return Seen::Dropped;
            }
        }
        let hot = need <= 1;
        s.keys.insert(key.into(), KeyHeat { opened_ms: now_ms, hits: 1, hot });
        s.order.push_back(key.into());
        if hot {
            Seen::TurnedHot
        } else {
            Seen::Counted
        }
    }

    /// Forgets keys whose window has ended, looking at no more than the cleanup budget.
    fn clean(&self, s: &mut Shard, now_ms: u64) {
        for _ in 0..self.cfg.cleanup_budget.min(s.order.len()) {
            let Some(key) = s.order.pop_front() else { break };
            let ended = s.keys.get(&key).is_none_or(|k| now_ms >= k.opened_ms.saturating_add(self.cfg.window_ms));
            if ended {
                s.keys.remove(&key);
            } else {
                s.order.push_back(key);
            }
        }
    }

    /// How many keys are tracked.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().keys.len()).sum()
    }

    /// Whether no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every key.
    pub fn clear(&self) {
        for s in self.shards.iter() {
            *s.lock() = Shard::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heat(max_entries: usize, budget: usize) -> Heat {
        Heat::new(HeatConfig { window_ms: 10_000, threshold_qps: 0.8, max_entries, cleanup_budget: budget }, 1)
    }

    #[test]
    fn a_key_turns_hot_once_per_window_at_the_threshold() {
        let h = heat(100, 8);
        assert_eq!(h.config().hits_to_be_hot(), 8, "0.8 reads/s over 10 s");
        for i in 0..7 {
            assert_eq!(h.saw(b"k", 1000 + i), Seen::Counted);
        }
        assert_eq!(h.saw(b"k", 2000), Seen::TurnedHot);
        for i in 0..20 {
            assert_eq!(h.saw(b"k", 3000 + i), Seen::Counted, "once per window");
        }
        // A new window starts from nothing: seven reads are not enough again.
        for i in 0..7 {
            assert_eq!(h.saw(b"k", 11_000 + i), Seen::Counted);
        }
        assert_eq!(h.saw(b"k", 12_000), Seen::TurnedHot);
        // Reads spread thinner than the threshold never make a key hot.
        for i in 0..100 {
            assert_eq!(h.saw(b"slow", i * 1500), Seen::Counted, "read {i}");
        }
    }

    #[test]
    fn a_full_window_drops_new_keys_and_cleans_up_within_its_budget() {
        let h = heat(10, 4);
        for i in 0..10u8 {
            assert_eq!(h.saw(&[i], 100), Seen::Counted);
        }
        assert_eq!(h.len(), 10);
        // Every window still open: a new key is dropped, and the old ones are kept (the
        // clean-up looked at keys 0..4 and moved them to the back of the line).
        assert_eq!(h.saw(b"new", 5000), Seen::Dropped);
        assert_eq!(h.len(), 10);
        // At 10,100 every first window has ended; keys 4..8, read again then, open new ones.
        for i in 4..8u8 {
            assert_eq!(h.saw(&[i], 10_100), Seen::Counted);
        }
        // Keys 4..8 are at the front of the line and open: one clean-up of four finds nothing
        // to drop, and moves them to the back.
        assert_eq!(h.saw(b"new", 10_100), Seen::Dropped);
        assert_eq!(h.len(), 10);
        // The next looks at 8, 9, 0 and 1, whose windows ended: room at last.
        assert_eq!(h.saw(b"new", 10_200), Seen::Counted);
        assert_eq!(h.len(), 7, "four forgotten, no more than the budget, and the new key counted");
        h.clear();
        assert!(h.is_empty());
    }

    #[test]
    fn a_threshold_of_one_read_makes_the_first_read_hot() {
        let h = Heat::new(HeatConfig { window_ms: 1000, threshold_qps: 0.5, ..HeatConfig::default() }, 4);
        assert_eq!(h.config().hits_to_be_hot(), 1);
        assert_eq!(h.saw(b"k", 0), Seen::TurnedHot);
        assert_eq!(h.saw(b"k", 1), Seen::Counted);
        assert_eq!(h.saw(b"k", 1000), Seen::TurnedHot);
    }
}
