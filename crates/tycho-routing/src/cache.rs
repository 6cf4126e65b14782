//! Who serves each KVPT group, as one process has learned it, without I/O: the route cache of
//! a client (and the published table of a master). Masters answer route tables from their own
//! view of the ownership records, and a master's view may be older than another's; the cache
//! keeps, per group, the entry of the highest epoch it has seen. Every ownership change raises
//! its group's epoch, so an entry at a higher epoch is always the later one, and an answer from
//! a master that is behind never takes a client back to a former primary.

use tycho_proto::RouteTable;

use crate::{kvpt_to_rank, INITIAL_GROUP_EPOCH};

/// A route table that only moves forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCache {
    table: RouteTable,
}

impl Default for RouteCache {
    fn default() -> Self {
        RouteCache::new()
    }
}

impl RouteCache {
    /// Nothing known yet: one group, at its initial epoch, served by the master in use.
    pub fn new() -> RouteCache {
        RouteCache { table: RouteTable { groups: 1, epochs: Vec::new(), owners: Vec::new(), lease_ttl_ms: 0 } }
    }

    /// The table as it stands.
    pub fn table(&self) -> &RouteTable {
        &self.table
    }

    /// Learns a table a master answered. Per group, an entry at a higher epoch replaces the
    /// cached one, and one at the same epoch fills in an owner the cache does not know; older
    /// entries are ignored. A table of another group count replaces the cache (the first
    /// answer; the cache cannot compare groups of different layouts). Says whether anything
    /// changed.
    pub fn learn(&mut self, t: &RouteTable) -> bool {
        if t.groups != self.table.groups || (self.table.epochs.is_empty() && self.table.owners.is_empty()) {
            let changed = self.table != *t;
            self.table = t.clone();
            return changed;
        }
        let mut changed = false;
        for rank in 0..t.groups as usize {
            let epoch = t.epochs.get(rank).copied().unwrap_or(0);
            let owner = t.owners.get(rank).map(String::as_str).unwrap_or("");
            changed |= self.note(rank as u32, epoch, owner);
        }
        changed
    }

    /// Notes that `owner` serves group `rank` at `epoch`, unless the cache knows a later
    /// entry. Says whether anything changed.
    pub fn note(&mut self, rank: u32, epoch: u64, owner: &str) -> bool {
        let r = rank as usize;
        if r >= self.table.groups as usize {
            return false;
        }
        let t = &mut self.table;
        let n = t.groups as usize;
        t.epochs.resize(n.max(t.epochs.len()), 0);
        t.owners.resize(n.max(t.owners.len()), String::new());
        let newer = epoch > t.epochs[r] || (epoch == t.epochs[r] && t.owners[r].is_empty() && !owner.is_empty());
        if newer {
            t.epochs[r] = epoch;
            t.owners[r] = owner.to_string();
        }
        newer
    }

    /// The group of `partition`.
    pub fn rank_of(&self, partition: u16) -> u32 {
        kvpt_to_rank(partition, self.table.groups.max(1))
    }

    /// The epoch of `partition`'s group (the initial epoch when unknown).
    pub fn epoch_of(&self, partition: u16) -> u64 {
        let rank = self.rank_of(partition) as usize;
        self.table.epochs.get(rank).copied().filter(|&e| e > 0).unwrap_or(INITIAL_GROUP_EPOCH)
    }

    /// The primary of `partition`'s group ("" when unknown: the master in use).
    pub fn owner_of(&self, partition: u16) -> &str {
        let rank = self.rank_of(partition) as usize;
        self.table.owners.get(rank).map(String::as_str).unwrap_or("")
    }

    /// The primary of group `rank` ("" when unknown).
    pub fn owner(&self, rank: u32) -> &str {
        self.table.owners.get(rank as usize).map(String::as_str).unwrap_or("")
    }

    /// Every primary the cache names, each once, sorted.
    pub fn owners(&self) -> Vec<String> {
        let mut all: Vec<String> = self.table.owners.iter().filter(|o| !o.is_empty()).cloned().collect();
        all.sort();
        all.dedup();
        all
    }

    /// Whether the cache names the primaries of several groups: keys are then routed to their
    /// group's primary rather than to the master in use.
    pub fn partitioned(&self) -> bool {
        self.table.partitioned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(epochs: &[u64], owners: &[&str]) -> RouteTable {
        RouteTable {
            groups: epochs.len() as u32,
            epochs: epochs.to_vec(),
            owners: owners.iter().map(|s| s.to_string()).collect(),
            lease_ttl_ms: 0,
        }
    }

    #[test]
    fn entries_move_forward_only() {
        let mut c = RouteCache::new();
        assert!(c.learn(&table(&[1, 1], &["a", "a"])));
        assert!(c.learn(&table(&[1, 2], &["a", "b"])));
        assert_eq!(c.owner(1), "b");
        // A master behind answers the old entry: ignored.
        assert!(!c.learn(&table(&[1, 1], &["a", "a"])));
        assert_eq!(c.owner(1), "b");
        assert_eq!(c.owners(), vec!["a".to_string(), "b".to_string()]);
        // Same epoch fills an unknown owner only.
        let mut c = RouteCache::new();
        c.learn(&table(&[3, 3], &["", "x"]));
        assert!(c.note(0, 3, "y"));
        assert!(!c.note(1, 3, "z"));
        assert_eq!((c.owner(0), c.owner(1)), ("y", "x"));
        // Another layout replaces the cache.
        assert!(c.learn(&table(&[1], &[""])));
        assert!(!c.partitioned());
        assert_eq!(c.epoch_of(77), 1);
    }

    #[test]
    fn unknown_epochs_read_as_the_initial_one() {
        let mut c = RouteCache::new();
        assert_eq!(c.epoch_of(0), INITIAL_GROUP_EPOCH);
        assert_eq!(c.owner_of(0), "");
        c.learn(&table(&[0, 5], &["", "m"]));
        assert_eq!(c.epoch_of(0), INITIAL_GROUP_EPOCH);
        assert_eq!(c.epoch_of(u16::MAX >> 2), 5);
        assert_eq!(c.owner_of(16383), "m");
        assert!(!c.note(7, 9, "out of range"));
    }
}
