//! A group's state as snapshot entries, and back: the export a snapshot is written from, the
//! import a standby or a restoring master starts from, and the reset before a standby starts
//! over.
//!
//! An export is a list of [`Entry`]s that, imported in order into a master holding nothing,
//! rebuild what the log's records had built: every mounted segment (a `Mount` record whose
//! reserved ranges are the ranges still held back on it — released writes, ranges freed while
//! a grant may still reach them — and where its generations had got to), the unfinished writes
//! of segments that went away, and every object (its committed value as a `WriteStart` and a
//! `WriteEnd` at exactly its ranges and generations, then its unfinished write, if any, as a
//! `WriteStart`, or a `CopyStart` for a task's copy, and which of its replicas are dynamic and
//! its fan-out cooldown), and its copy and move tasks (with their dynamic copies' leases) as the
//! task records that rebuild them. Soft state is left out, as the log leaves it out: read
//! leases and client liveness (a promotion grants both afresh), the grants a primary minted (a
//! master that only replays holds every range it frees for as long as such a grant may last),
//! and the heat window (a new primary counts reads afresh).
//!
//! Held ranges come back reserved for everyone until their time, rather than for their tenant
//! alone: stricter, and counted as used until then.
//!
//! The export must see one position of the log: the caller stops applying records while it
//! runs (a standby exports between two records; a primary exports a scratch master it filled
//! from the last snapshot and the log).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use tycho_proto::SegmentId;

use super::apply::range_rec;
use super::{Master, ReplayError};
use crate::log::record::{PinsRec, Record};
use crate::log::snapshot::Entry;

impl Master {
    /// The state of group `rank` as snapshot entries (`None` if this master does not hold it):
    /// the segments mounted for it with the ranges held in its slices, and its objects.
    /// Orphaned ranges (of segments gone) are the master's, and every group's export carries
    /// them: a remount reserves those in its group's slice.
    pub fn export_group(&self, rank: u32) -> Option<Vec<Entry>> {
        let group = self.group(rank)?;
        let live = group.segments.live();
        // Ranges whose time is up are free, whether or not housekeeping got to them.
        let (now, unix_now) = (self.now(), self.clock.unix_now_ms());
        // Ranges held back, by segment: on a live segment they become its mount's reserved
        // ranges; on one that went away, orphans.
        let mut reserved: BTreeMap<SegmentId, Vec<(u64, u64, u64)>> = BTreeMap::new();
        let mut orphans: BTreeMap<SegmentId, Vec<(u64, u64, u64)>> = BTreeMap::new();
        for (id, list) in self.orphaned.lock().iter() {
            let unix = list.iter().filter(|r| r.2 > now).map(|&(o, l, until)| (o, l, self.unix_time(until)));
            orphans.entry(*id).or_default().extend(unix);
        }
        orphans.retain(|_, l| !l.is_empty());
        for d in self.deferred.lock().iter().filter(|d| d.release_at > now) {
            for r in d.replicas.iter().filter(|r| r.seg.rank() == rank) {
                let range = (r.alloc.offset, r.alloc.reserved, self.unix_time(d.release_at));
                let to = if r.seg.is_alive() { &mut reserved } else { &mut orphans };
                to.entry(r.seg.desc.id).or_default().push(range);
            }
        }
        let mut out = Vec::new();
        for seg in live.iter() {
            let mut held = reserved.remove(&seg.desc.id).unwrap_or_default();
            held.extend(seg.held_ranges().into_iter().filter(|h| h.2 > unix_now));
            held.sort_unstable();
            out.push(Entry::Record(Record::Mount { client: seg.client, desc: seg.desc.clone(), reserved: held }));
            out.push(Entry::NextGen {
                segment: seg.desc.id,
                incarnation: seg.desc.incarnation,
                next_gen: seg.next_gen(),
            });
        }
        out.extend(orphans.into_iter().map(|(segment, ranges)| Entry::Orphans { segment, ranges }));
        let (mono_now, now) = (now, self.unix_time(now));
        for shard in group.shards.iter() {
            let map = shard.read();
            // In key order, so that one state always makes the same snapshot.
            let mut objects: Vec<_> = map.iter().collect();
            objects.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (key, obj) in objects {
                if obj.is_complete() {
                    // A soft pin is restored as a zero TTL counted from its end.
                    let (at_ms, soft_pin_ttl_ms) = match obj.soft_pin_until {
                        0 => (now, None),
                        until => (self.unix_time(until), Some(0)),
                    };
                    out.push(Entry::Record(Record::WriteStart {
                        key: key.to_vec(),
                        upsert: false,
                        writer: obj.writer,
                        write_id: obj.version,
                        started_ms: now,
                        size: obj.size,
                        pins: PinsRec { soft_pin_ttl_ms, preserve_soft_pin: false, hard_pin: obj.hard_pin },
                        replicas: obj.replicas.iter().map(range_rec).collect(),
                    }));
                    out.push(Entry::Record(Record::WriteEnd {
                        key: key.to_vec(),
                        writer: obj.writer,
                        write_id: obj.version,
                        at_ms,
                        dropped: Vec::new(),
                    }));
                    let segments: Vec<SegmentId> =
                        obj.replicas.iter().filter(|r| r.is_dynamic()).map(|r| r.seg.desc.id).collect();
                    if !segments.is_empty() {
                        out.push(Entry::Record(Record::DynamicReplicas { key: key.to_vec(), segments }));
                    }
                }
                if obj.cooldown_until > mono_now {
                    let until_ms = self.unix_time(obj.cooldown_until);
                    out.push(Entry::Record(Record::Cooldown { key: key.to_vec(), until_ms }));
                }
                if let Some((p, copy)) = obj.pending.as_ref().and_then(|p| p.copy.map(|c| (p, c))) {
                    out.push(Entry::Record(Record::CopyStart {
                        key: key.to_vec(),
                        writer: p.writer,
                        write_id: p.write_id,
                        started_ms: self.unix_time(p.started_ms),
                        task: copy.task,
                        version: copy.version,
                        source: copy.source,
                        replicas: p.replicas.iter().map(range_rec).collect(),
                    }));
                } else if let Some(p) = &obj.pending {
                    out.push(Entry::Record(Record::WriteStart {
                        key: key.to_vec(),
                        upsert: obj.is_complete(),
                        writer: p.writer,
                        write_id: p.write_id,
                        started_ms: self.unix_time(p.started_ms),
                        size: p.size,
                        pins: p.pins.into(),
                        replicas: p.replicas.iter().map(range_rec).collect(),
                    }));
                }
            }
        }
        // The copy and move tasks, as records that rebuild them.
        out.extend(group.tasks.lock().to_records().into_iter().map(|r| Entry::Record(Record::Task(r))));
        Some(out)
    }

    /// Group `rank`'s copy and move tasks (`None` if this master does not hold the group).
    pub fn tasks(&self, rank: u32) -> Option<Vec<crate::state::task::Task>> {
        Some(self.group(rank)?.tasks.lock().list().into_iter().cloned().collect())
    }

    /// Imports one snapshot entry (in the order the export made them).
    pub fn import(&self, rank: u32, entry: &Entry) -> Result<(), ReplayError> {
        match entry {
            Entry::Record(rec) => self.replay(rank, rec),
            Entry::NextGen { segment, incarnation, next_gen } => {
                match self.group(rank).and_then(|g| g.segments.get(*segment)) {
                    Some(seg) if seg.desc.incarnation == *incarnation => seg.raise_next_gen(*next_gen),
                    _ => {
                        return Err(ReplayError::Range {
                            segment: *segment,
                            offset: 0,
                            why: "generation of a segment not mounted",
                        })
                    }
                }
                Ok(())
            }
            Entry::Orphans { segment, ranges } => {
                let local = ranges.iter().map(|&(o, l, until)| (o, l, until.saturating_sub(self.unix_offset)));
                self.orphaned.lock().entry(*segment).or_default().extend(local);
                Ok(())
            }
        }
    }

    /// Forgets what this master holds of group `rank`: its objects, tombstones, segments (its
    /// slices, and the ranges held in them) and log position. For a group this master does not
    /// serve (a standby starting over, or a primary another master replaced).
    pub fn reset_group(&self, rank: u32) {
        let Some(g) = self.group(rank) else { return };
        for shard in g.shards.iter() {
            shard.write().clear();
        }
        g.tombstones.iter().for_each(|t| t.lock().clear());
        *g.tasks.lock() = Default::default();
        g.reset_applied();
        g.segments.clear();
        self.deferred.lock().retain_mut(|d| {
            d.replicas.retain(|r| r.seg.rank() != rank);
            !d.replicas.is_empty()
        });
        // What the master keeps for all its groups is this group's alone when it holds no
        // other: it goes too.
        if self.groups().count() == 1 {
            self.orphaned.lock().clear();
            self.clients.write().clear();
            self.last_abandon_scan.store(0, Ordering::Relaxed);
        }
    }

    /// Forgets everything: objects, segments, clients, held ranges, and the log position of
    /// every group. For a master that does not serve (a standby about to start over from a
    /// snapshot): anything it held may have diverged from the log.
    pub fn reset(&self) {
        for g in self.groups() {
            for shard in g.shards.iter() {
                shard.write().clear();
            }
            g.tombstones.iter().for_each(|t| t.lock().clear());
            *g.tasks.lock() = Default::default();
            g.reset_applied();
            g.segments.clear();
        }
        self.deferred.lock().clear();
        self.orphaned.lock().clear();
        self.clients.write().clear();
        self.last_abandon_scan.store(0, Ordering::Relaxed);
    }
}
