//! Whole-cluster answers from the answers of every primary. In a partitioned cluster each
//! primary serves the objects of its own groups, allocates from its own slices of every segment,
//! and knows every client and segment; the library and `tycho stat` / `segments` / `ls` combine
//! their answers the same way.

use tycho_proto::{ErrorCode, KeyInfo, MasterStats, SegmentStatus};

/// Bytes and objects added up; clients and segments counted once (every primary has them all);
/// the sweep as far as the slowest primary's.
pub fn merge_stats(all: impl IntoIterator<Item = MasterStats>) -> MasterStats {
    let mut out: Option<MasterStats> = None;
    for s in all {
        match &mut out {
            None => out = Some(s),
            Some(o) => {
                o.capacity_bytes += s.capacity_bytes;
                o.used_bytes += s.used_bytes;
                o.objects += s.objects;
                o.clients = o.clients.max(s.clients);
                o.segments = o.segments.max(s.segments);
                o.sweep_progress = o.sweep_progress.min(s.sweep_progress);
            }
        }
    }
    out.unwrap_or(MasterStats {
        capacity_bytes: 0,
        used_bytes: 0,
        objects: 0,
        clients: 0,
        segments: 0,
        sweep_progress: 0,
    })
}

/// Each segment once, with the bytes used in it on every primary, by segment id.
pub fn merge_segments(all: impl IntoIterator<Item = Vec<SegmentStatus>>) -> Vec<SegmentStatus> {
    let mut merged: Vec<SegmentStatus> = Vec::new();
    for list in all {
        for s in list {
            match merged.iter_mut().find(|m| m.desc.id == s.desc.id) {
                Some(m) => m.used += s.used,
                None => merged.push(s),
            }
        }
    }
    merged.sort_by_key(|s| s.desc.id);
    merged
}

/// The keys of every primary (each key lives in one group), sorted by tenant and key, at most
/// `limit`.
pub fn merge_keys(all: impl IntoIterator<Item = Vec<KeyInfo>>, limit: u64) -> Vec<KeyInfo> {
    let mut keys: Vec<KeyInfo> = all.into_iter().flatten().collect();
    keys.sort_by(|x, y| (&x.tenant, &x.key).cmp(&(&y.tenant, &y.key)));
    keys.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    keys
}

/// What a removal sent to every primary did when some primary failed it: what the others
/// removed, which primaries did it, and which failed with what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialRemoval {
    /// Objects removed by the primaries that did it.
    pub removed: u64,
    /// The primaries that did it.
    pub done: Vec<String>,
    /// The primaries that failed, with their errors (never empty).
    pub failed: Vec<(String, ErrorCode)>,
}

impl PartialRemoval {
    /// Nothing was done: `code` before any primary was asked.
    pub fn nothing(code: ErrorCode) -> PartialRemoval {
        PartialRemoval { removed: 0, done: Vec::new(), failed: vec![(String::new(), code)] }
    }

    /// The first failure's code.
    pub fn code(&self) -> ErrorCode {
        self.failed.first().map_or(ErrorCode::INTERNAL_ERROR, |f| f.1)
    }

    /// Whether no primary did the removal.
    pub fn none_done(&self) -> bool {
        self.done.is_empty()
    }
}

impl std::fmt::Display for PartialRemoval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "removed {} object(s) at {} primar(ies);", self.removed, self.done.len())?;
        for (at, code) in &self.failed {
            let at = if at.is_empty() { "the client" } else { at.as_str() };
            write!(f, " {at} failed: {code};")?;
        }
        Ok(())
    }
}

impl std::error::Error for PartialRemoval {}

#[cfg(test)]
mod tests {
    use super::*;
    use tycho_proto::{ClientId, SegmentDesc, SegmentId};

    fn seg(id: u128, used: u64) -> SegmentStatus {
        SegmentStatus {
            desc: SegmentDesc {
                id: SegmentId(id),
                name: format!("s{id}"),
                base: 0,
                size: 100,
                endpoint: String::new(),
                host: String::new(),
                incarnation: 1,
            },
            client: ClientId(1),
            used,
        }
    }

    fn key(tenant: &str, k: &str) -> KeyInfo {
        KeyInfo {
            tenant: tenant.into(),
            key: k.into(),
            size: 1,
            replicas: 1,
            complete: true,
            lease_remaining_ms: 0,
            soft_pinned: false,
            hard_pinned: false,
        }
    }

    #[test]
    fn answers_of_every_primary_combine_into_the_clusters() {
        let a =
            MasterStats { capacity_bytes: 10, used_bytes: 4, objects: 2, clients: 3, segments: 2, sweep_progress: 9 };
        let b =
            MasterStats { capacity_bytes: 20, used_bytes: 1, objects: 5, clients: 3, segments: 2, sweep_progress: 4 };
        let m = merge_stats([a, b]);
        assert_eq!((m.capacity_bytes, m.used_bytes, m.objects, m.clients, m.segments), (30, 5, 7, 3, 2));
        assert_eq!(m.sweep_progress, 4);
        let s = merge_segments([vec![seg(2, 5), seg(1, 1)], vec![seg(1, 3)]]);
        assert_eq!(s.iter().map(|s| (s.desc.id.0, s.used)).collect::<Vec<_>>(), [(1, 4), (2, 5)]);
        let k = merge_keys([vec![key("", "b"), key("t", "a")], vec![key("", "a")]], 2);
        assert_eq!(k.iter().map(|k| (k.tenant.as_str(), k.key.as_str())).collect::<Vec<_>>(), [("", "a"), ("", "b")]);
    }
}
