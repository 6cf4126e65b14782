//! The one path by which a group's metadata changes: each durable mutation is a [`Record`],
//! and each kind of record has one function here that applies it. The primary calls them after
//! its decision (with the record sent to the [`RecordSink`] first, when one is set); a standby
//! replays the same records through [`Master::replay`], which calls the same functions.
//!
//! Applying decides nothing: a record that does not fit the state it is applied to (a commit of
//! a write that is not pending, a range already taken) is a divergence, reported as a
//! [`ReplayError`] so that a standby stops and rebootstraps instead of serving a guess.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tycho_proto::{ClientId, ErrorCode, SegmentId};

use super::{Group, Master};
use crate::log::record::{RangeRec, Record, RecordSink};
use crate::state::object::{CopyOf, ObjectKey, ObjectMeta, PendingSlot, PendingWrite, Pins, ShardMap};
use crate::state::segment::{DynamicMark, MountedSegment, Replica, SegAlloc};

pub use crate::log::record::ReplayError;

thread_local! {
    /// What this thread logged since [`Master::take_logged`]: per sink, the highest sequence
    /// number.
    static LOGGED: std::cell::RefCell<Vec<(Arc<dyn RecordSink>, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records a thread logged while it ran one request, to be durable before it is answered (see
/// [`Master::take_logged`]).
#[derive(Default)]
pub struct Logged(Vec<(Arc<dyn RecordSink>, u64)>);

impl Logged {
    /// Whether nothing was logged.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The highest sequence number logged (0: none), whatever the group: for tests with one.
    pub fn last(&self) -> u64 {
        self.0.iter().map(|(_, s)| *s).max().unwrap_or(0)
    }
}

/// Notes that this thread's answer waits for record `seq` of `sink`.
fn note_logged(sink: Arc<dyn RecordSink>, seq: u64) {
    LOGGED.with(|l| {
        let mut l = l.borrow_mut();
        match l.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &sink)) {
            Some(e) => e.1 = e.1.max(seq),
            None => l.push((sink, seq)),
        }
    })
}

/// The record of a replica's range.
pub(super) fn range_rec(r: &Replica) -> RangeRec {
    RangeRec {
        segment: r.seg.desc.id,
        incarnation: r.seg.desc.incarnation,
        offset: r.alloc.offset,
        reserved: r.alloc.reserved,
        len: r.alloc.len,
        gen: r.alloc.gen,
    }
}

impl Master {
    /// Sends every record of group `rank` this master applies as its primary to `sink`, in the
    /// order applied (records of one key in the order of its shard lock), replacing the sink
    /// it had; `None` sends them nowhere. Set before serving the group. False if this master
    /// does not hold the group.
    pub fn set_record_sink(&self, rank: u32, sink: Option<Arc<dyn RecordSink>>) -> bool {
        let Some(group) = self.group(rank) else { return false };
        let on = sink.is_some();
        match (group.set_sink(sink).is_some(), on) {
            (false, true) => self.sinks.fetch_add(1, Ordering::AcqRel),
            (true, false) => self.sinks.fetch_sub(1, Ordering::AcqRel),
            _ => 0,
        };
        true
    }

    /// A master clock time as the Unix time records carry.
    pub(super) fn unix_time(&self, t: u64) -> u64 {
        t.saturating_add(self.unix_offset)
    }

    /// A record's Unix time on this master's clock (0 if before its zero).
    fn local_time(&self, unix: u64) -> u64 {
        unix.saturating_sub(self.unix_offset)
    }

    /// Hands the record `make` builds to the sink of its key's group, if that group has one
    /// (it is built only when some group has one), and notes its sequence number for
    /// [`Master::take_logged`]. For records of one key.
    pub(super) fn log(&self, make: impl FnOnce() -> Record) {
        if self.sinks.load(Ordering::Acquire) == 0 {
            return;
        }
        let rec = make();
        let group = rec.key().and_then(|k| self.group_of_key(k));
        debug_assert!(group.is_some(), "log() takes records of a key this master holds");
        if let Some((sink, seq)) = group.and_then(|g| g.append(rec)) {
            note_logged(sink, seq);
        }
    }

    /// Hands the record `make` builds to `group`'s sink, if it has one: for records of the
    /// group's segments.
    pub(super) fn log_to(&self, group: &Group, make: impl FnOnce() -> Record) {
        if self.sinks.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some((sink, seq)) = group.sink().and_then(|_| group.append(make())) {
            note_logged(sink, seq);
        }
    }

    /// Makes the calling thread's answer wait until every record of `key`'s group logged so far
    /// is durable: for an answer that reports a mutation decided earlier (a retried PutEnd
    /// finds its write committed), whose record may not be durable yet.
    pub(super) fn await_logged(&self, key: &[u8]) {
        if let Some(s) = self.group_of_key(key).and_then(Group::sink) {
            let seq = s.appended();
            if seq > 0 {
                note_logged(s, seq);
            }
        }
    }

    /// Makes the calling thread's answer wait until the records logged so far that changed
    /// shard `shard` of `group` are durable: a read answers only state that a failover keeps
    /// (a write it sees is committed, a removal it misses is too). Nothing to wait for in the
    /// common case (no record of the shard in flight) costs two atomic loads.
    pub(super) fn gate_read(&self, group: &Group, shard: usize) {
        if cfg!(feature = "bench-no-read-gate") || self.sinks.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some((sink, seq)) = group.read_barrier(shard) {
            note_logged(sink, seq);
        }
    }

    /// What the calling thread logged since its last call, and starts over. An RPC takes it
    /// before and after running a request on one thread, and answers only once those records
    /// are durable ([`Master::durable`]).
    pub fn take_logged() -> Logged {
        Logged(LOGGED.with(|l| std::mem::take(&mut *l.borrow_mut())))
    }

    /// Whether a mutation may be decided now: busy (retryable) while a log of a group this
    /// master serves is full, the log's error once it has ended.
    pub fn admit(&self) -> Result<(), ErrorCode> {
        if self.sinks.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        self.groups().filter(|g| g.is_serving()).filter_map(Group::sink).try_for_each(|s| s.admit())
    }

    /// [`Master::admit`] for the groups of the keys `req` names alone (every group served when
    /// it names none: a mount, a removal of many): one group's full log does not hold up the
    /// others'.
    pub fn admit_request(&self, req: &tycho_proto::Request) -> Result<(), ErrorCode> {
        if self.sinks.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let partitions = req.partitions();
        if partitions.is_empty() {
            return self.admit();
        }
        let groups = self.cfg.group_count.max(1);
        let mut seen: Vec<u32> = Vec::new();
        for p in partitions {
            let rank = tycho_routing::kvpt_to_rank(p, groups);
            if seen.contains(&rank) {
                continue;
            }
            seen.push(rank);
            if let Some(s) = self.group(rank).filter(|g| g.is_serving()).and_then(Group::sink) {
                s.admit()?;
            }
        }
        Ok(())
    }

    /// Resolves once every record in `logged` is durable, or with the error of a log that will
    /// never make one durable; `None` when there is nothing to wait for.
    pub fn durable(&self, logged: Logged) -> Option<crate::log::record::DurableFuture> {
        let mut waits: Vec<_> = logged.0.into_iter().map(|(sink, seq)| sink.durable(seq)).collect();
        match waits.len() {
            0 => None,
            1 => waits.pop(),
            _ => Some(Box::pin(async move {
                for w in waits {
                    w.await?;
                }
                Ok(())
            })),
        }
    }

    /// A write starts: `replicas` (reserved already) are its ranges.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_write_start(
        &self,
        map: &mut ShardMap,
        key: ObjectKey,
        writer: ClientId,
        write_id: u64,
        started_ms: u64,
        size: u64,
        pins: Pins,
        replicas: Vec<Replica>,
        pending_count: &Arc<AtomicU64>,
    ) {
        let slot = PendingSlot::take(pending_count);
        let pending = PendingWrite { writer, write_id, started_ms, size, replicas, pins, slot, copy: None };
        put_pending(map, key, pending, 0);
    }

    /// The segments of `key`'s pending write that a commit now leaves out, as dead (the
    /// commit's decision, which its record carries).
    pub(super) fn dead_segments_of_pending(map: &ShardMap, key: &[u8]) -> Vec<SegmentId> {
        let Some(p) = map.get(key).and_then(|o| o.pending.as_ref()) else { return Vec::new() };
        p.replicas.iter().filter(|r| !r.seg.is_alive()).map(|r| r.seg.desc.id).collect()
    }

    /// The pending write of `key` commits at `at_ms`. Its replicas on the `dropped` segments
    /// (those the primary saw dead: [`Master::dead_segments_of_pending`]) are left out; with
    /// none left the write is gone (and so is the object, if it had no value), answered as
    /// REPLICA_IS_GONE. Returns the replaced value's replicas and size, for the caller to
    /// describe and release.
    /// The commit is use number `used` of its group (see [`crate::state::policy`]): a new object starts
    /// unread, a new value of one keeps its reads.
    pub(super) fn apply_write_end(
        &self,
        map: &mut ShardMap,
        key: &[u8],
        at_ms: u64,
        dropped: &[SegmentId],
        used: u64,
    ) -> Result<(Vec<Replica>, u64), ErrorCode> {
        let obj = map.get_mut(key).ok_or(ErrorCode::WRITE_DROPPED)?;
        let p = obj.pending.take().ok_or(ErrorCode::WRITE_DROPPED)?;
        let mut replicas = p.replicas;
        replicas.retain(|r| !dropped.contains(&r.seg.desc.id));
        if replicas.is_empty() {
            if !obj.is_complete() {
                map.remove(key);
            }
            return Err(ErrorCode::REPLICA_IS_GONE);
        }
        let old = std::mem::replace(&mut obj.replicas, replicas);
        obj.used.set(crate::state::policy::Mark { seq: used, reads: obj.used.get().reads });
        obj.writer = p.writer;
        obj.version = p.write_id;
        obj.hard_pin = p.pins.hard_pin;
        if !p.pins.preserve_soft_pin {
            obj.soft_pin_until = p.pins.soft_pin_ttl_ms.map_or(0, |ttl| at_ms + ttl);
        }
        let old_size = std::mem::replace(&mut obj.size, p.size);
        Ok((old, old_size))
    }

    /// The pending write of `key` ends without a value: revoked by its writer (`release_at`
    /// `None`: its ranges are free at once) or dropped without its word (its ranges stay
    /// reserved until `release_at`). An object that had no value goes with it.
    pub(super) fn apply_write_cancel(&self, map: &mut ShardMap, key: &[u8], release_at: Option<u64>, now: u64) -> bool {
        let Some(obj) = map.get_mut(key) else { return false };
        let Some(p) = obj.pending.take() else { return false };
        match release_at {
            None => p.replicas.into_iter().for_each(Replica::release),
            Some(at) => self.defer(p.replicas, at, now),
        }
        if !obj.is_complete() {
            map.remove(key);
        }
        true
    }

    /// A task's copy of `key`'s value (of `size` bytes) starts: `replicas` (reserved already)
    /// are its ranges. Refused (nothing changed) when a write is pending. An object without a
    /// value (a snapshot's import drops a value whose segments all went away before the sweep
    /// got to it, where the log still holds it) holds the copy alone, as an import holds an
    /// unfinished write alone; the sweep's record then drops both, as it does on the primary.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_copy_start(
        &self,
        map: &mut ShardMap,
        key: &[u8],
        writer: ClientId,
        write_id: u64,
        started_ms: u64,
        copy: CopyOf,
        size: u64,
        replicas: Vec<Replica>,
        pending_count: &Arc<AtomicU64>,
    ) -> Result<(), Vec<Replica>> {
        if map.get(key).is_some_and(|o| o.pending.is_some()) {
            return Err(replicas);
        }
        let slot = PendingSlot::take(pending_count);
        let pins = Pins::default();
        let pending = PendingWrite { writer, write_id, started_ms, size, replicas, pins, slot, copy: Some(copy) };
        put_pending(map, key, pending, copy.version);
        Ok(())
    }

    /// The pending copy of `key` commits: its ranges (less those on the `dropped` segments)
    /// become replicas of the value, marked dynamic when the copy's task holds a fan-out lease
    /// (`leased` says whether it does), and a move's source replica leaves it. Returns the source
    /// replicas, for the caller to release; REPLICA_IS_GONE when no range is left (the value
    /// stays as it was), WRITE_DROPPED when no copy of the current value is pending.
    pub(super) fn apply_copy_end(
        &self,
        map: &mut ShardMap,
        key: &[u8],
        dropped: &[SegmentId],
        leased: impl FnOnce(crate::state::task::TaskId) -> bool,
    ) -> Result<Vec<Replica>, ErrorCode> {
        let obj = map.get_mut(key).ok_or(ErrorCode::WRITE_DROPPED)?;
        let copy = match &obj.pending {
            Some(p) => p.copy.filter(|c| c.version == obj.version).ok_or(ErrorCode::WRITE_DROPPED)?,
            None => return Err(ErrorCode::WRITE_DROPPED),
        };
        let mut added = obj.pending.take().map(|p| p.replicas).unwrap_or_default();
        added.retain(|r| !dropped.contains(&r.seg.desc.id));
        if added.is_empty() {
            return Err(ErrorCode::REPLICA_IS_GONE);
        }
        if leased(copy.task) {
            added.iter_mut().for_each(|r| r.dynamic = Some(DynamicMark::take(&self.fanout.dynamic_live)));
        }
        let mut gone = Vec::new();
        if let Some(source) = copy.source {
            let (out, kept): (Vec<Replica>, Vec<Replica>) =
                std::mem::take(&mut obj.replicas).into_iter().partition(|r| r.seg.desc.id == source);
            obj.replicas = kept;
            gone = out;
        }
        obj.replicas.extend(added);
        Ok(gone)
    }

    /// The replicas of `key`'s value on `segments` are dynamic (fan-out made them). Returns how
    /// many it marked.
    pub(super) fn apply_dynamic_replicas(&self, map: &mut ShardMap, key: &[u8], segments: &[SegmentId]) -> usize {
        let Some(obj) = map.get_mut(key) else { return 0 };
        let mut marked = 0;
        for r in obj.replicas.iter_mut().filter(|r| segments.contains(&r.seg.desc.id) && r.dynamic.is_none()) {
            r.dynamic = Some(DynamicMark::take(&self.fanout.dynamic_live));
            marked += 1;
        }
        marked
    }

    /// Fan-out adds no replica of `key` before `until` (this master's clock).
    pub(super) fn apply_cooldown(&self, map: &mut ShardMap, key: &[u8], until: u64) {
        if let Some(obj) = map.get_mut(key) {
            obj.cooldown_until = obj.cooldown_until.max(until);
        }
    }

    /// `key` is removed (by a client or by eviction): its value's ranges are free at once
    /// (readers check generations); an unfinished write's stay reserved until its release
    /// timeout. Returns the object, already disposed of, for the caller's accounting.
    pub(super) fn apply_remove(&self, map: &mut ShardMap, key: &[u8], now: u64) -> Option<(u64, usize)> {
        let obj = map.remove(key)?;
        let figures = (obj.size, obj.replicas.len());
        self.dispose(obj, now);
        Some(figures)
    }

    /// The replicas of `key` on `segment` are dropped: a committed one's range is freed (a no-op
    /// on a dead segment), an unfinished write's is kept reserved until its release timeout
    /// (as an orphaned range if its segment died). The object goes when nothing is left.
    /// Returns how many replicas were dropped.
    pub(super) fn apply_drop_replicas(&self, map: &mut ShardMap, key: &[u8], segment: SegmentId, now: u64) -> usize {
        let Some(obj) = map.get_mut(key) else { return 0 };
        let (gone, kept): (Vec<Replica>, Vec<Replica>) =
            std::mem::take(&mut obj.replicas).into_iter().partition(|r| r.seg.desc.id == segment);
        obj.replicas = kept;
        let mut dropped = gone.len();
        gone.into_iter().for_each(Replica::release);
        if let Some(p) = &mut obj.pending {
            let until = p.started_ms + self.cfg.put_start_release_timeout_ms;
            let (gone, kept): (Vec<Replica>, Vec<Replica>) =
                std::mem::take(&mut p.replicas).into_iter().partition(|r| r.seg.desc.id == segment);
            p.replicas = kept;
            dropped += gone.len();
            for r in gone {
                if r.seg.is_alive() {
                    self.defer(vec![r], until, now);
                } else {
                    self.orphaned.lock().entry(r.seg.desc.id).or_default().push((
                        r.alloc.offset,
                        r.alloc.reserved,
                        until,
                    ));
                }
            }
            if p.replicas.is_empty() {
                obj.pending = None;
            }
        }
        // A copy of a value that is gone goes with it (its client may still be writing).
        if obj.replicas.is_empty() && obj.pending.as_ref().is_some_and(|p| p.copy.is_some()) {
            if let Some(p) = obj.pending.take() {
                dropped += p.replicas.len();
                self.defer(p.replicas, p.started_ms + self.cfg.put_start_release_timeout_ms, now);
            }
        }
        if obj.replicas.is_empty() && obj.pending.is_none() {
            map.remove(key);
        }
        dropped
    }

    /// Replays one record of the primary's log on this master (a standby, or an import).
    pub fn replay(&self, rank: u32, rec: &Record) -> Result<(), ReplayError> {
        let now = self.now();
        let not_held = ReplayError::NoSuchObject("a record of a group this master does not hold");
        let group = |key: &[u8]| match self.group_of_key(key) {
            Some(g) if g.rank() == rank => Ok(g),
            _ => Err(not_held.clone()),
        };
        let shard_of = |key: &[u8]| group(key).map(|g| g.shard_of(key));
        match rec {
            Record::WriteStart { key, upsert: _, writer, write_id, started_ms, size, pins, replicas } => {
                let reserved = self.reserve_record_ranges(group(key)?, key, replicas)?;
                let mut map = shard_of(key)?.write();
                if map.get(key.as_slice()).is_some_and(|o| o.pending.is_some()) {
                    drop(map);
                    reserved.into_iter().for_each(Replica::release);
                    return Err(ReplayError::NoSuchWrite("WriteStart over a pending write"));
                }
                let key: ObjectKey = key.clone().into_boxed_slice();
                let count = self.register_client(*writer).pending.clone();
                let pins = (*pins).into();
                let started = self.local_time(*started_ms);
                self.apply_write_start(&mut map, key, *writer, *write_id, started, *size, pins, reserved, &count);
                Ok(())
            }
            Record::WriteEnd { key, writer, write_id, at_ms, dropped } => {
                let group = group(key)?;
                let mut map = group.shard_of(key).write();
                check_pending(&map, key, *writer, *write_id, "WriteEnd")?;
                // An error: every segment it wrote to had died, and the write is gone.
                let at = self.local_time(*at_ms);
                if let Ok((old, _)) = self.apply_write_end(&mut map, key, at, dropped, group.uses.next()) {
                    old.into_iter().for_each(Replica::release);
                }
                Ok(())
            }
            Record::WriteRevoke { key, writer, write_id } => {
                let mut map = shard_of(key)?.write();
                check_pending(&map, key, *writer, *write_id, "WriteRevoke")?;
                self.apply_write_cancel(&mut map, key, None, now);
                Ok(())
            }
            Record::WriteDrop { key, writer, write_id, release_at_ms } => {
                let mut map = shard_of(key)?.write();
                check_pending(&map, key, *writer, *write_id, "WriteDrop")?;
                self.apply_write_cancel(&mut map, key, Some(self.local_time(*release_at_ms)), now);
                Ok(())
            }
            Record::Remove { key, at_ms: _, evicted: _ } => {
                // A missing object is removed already: one whose every replica lay on segments
                // that went away is dropped by a snapshot import at once, while the log drops
                // it only when the primary's sweep or a client gets to it.
                self.apply_remove(&mut shard_of(key)?.write(), key, now);
                Ok(())
            }
            Record::DropReplicas { key, segment } => {
                self.apply_drop_replicas(&mut shard_of(key)?.write(), key, *segment, now);
                Ok(())
            }
            Record::Mount { client, desc, reserved } => {
                let reserved: Vec<(u64, u64, u64)> =
                    reserved.iter().map(|&(o, l, until)| (o, l, self.local_time(until))).collect();
                let group = self.group(rank).ok_or(not_held)?;
                self.apply_mount(group, *client, desc.clone(), &reserved, &[], now, || {})
                    .map_err(|e| ReplayError::Mount(desc.id, e))?;
                Ok(())
            }
            Record::Unmount { segment } => {
                self.apply_unmount(self.group(rank).ok_or(not_held)?, *segment);
                Ok(())
            }
            Record::Task(r) => {
                self.group(rank).ok_or(not_held)?.tasks.lock().apply(r);
                Ok(())
            }
            Record::CopyStart { key, writer, write_id, started_ms, task, version, source, replicas } => {
                let reserved = self.reserve_record_ranges(group(key)?, key, replicas)?;
                let mut map = shard_of(key)?.write();
                let count = self.register_client(*writer).pending.clone();
                let copy = CopyOf { task: *task, version: *version, source: *source };
                let started = self.local_time(*started_ms);
                let size = replicas.first().map_or(0, |r| r.len);
                self.apply_copy_start(&mut map, key, *writer, *write_id, started, copy, size, reserved, &count).map_err(
                    |reserved| {
                        reserved.into_iter().for_each(Replica::release);
                        ReplayError::NoSuchWrite("CopyStart over a pending write")
                    },
                )
            }
            Record::CopyEnd { key, writer, write_id, dropped } => {
                let g = group(key)?;
                let mut map = g.shard_of(key).write();
                check_pending(&map, key, *writer, *write_id, "CopyEnd")?;
                let leased = |task| g.tasks.lock().lease_of(task).is_some();
                match self.apply_copy_end(&mut map, key, dropped, leased) {
                    Ok(gone) => gone.into_iter().for_each(Replica::release),
                    // Every segment it wrote to had died: the copy is gone, as on the primary.
                    Err(ErrorCode::REPLICA_IS_GONE) => {}
                    Err(_) => return Err(ReplayError::NoSuchWrite("CopyEnd of a write that is not a copy")),
                }
                Ok(())
            }
            Record::DynamicReplicas { key, segments } => {
                self.apply_dynamic_replicas(&mut shard_of(key)?.write(), key, segments);
                Ok(())
            }
            Record::Cooldown { key, until_ms } => {
                self.apply_cooldown(&mut shard_of(key)?.write(), key, self.local_time(*until_ms));
                Ok(())
            }
        }
    }

    /// Reserves the ranges a record of a write or a copy of `key` names, exactly. A range on a
    /// segment that went away here already is left out: the primary allocated in it just
    /// before its unmount was logged, and its replica is dead there too (a commit leaves it
    /// out).
    fn reserve_record_ranges(
        &self,
        group: &Group,
        key: &[u8],
        replicas: &[RangeRec],
    ) -> Result<Vec<Replica>, ReplayError> {
        let mut reserved: Vec<Replica> = Vec::with_capacity(replicas.len());
        for r in replicas {
            let fail = |why| ReplayError::Range { segment: r.segment, offset: r.offset, why };
            let got = match group.segments.get(r.segment) {
                None => Ok(None),
                Some(seg) if seg.desc.incarnation < r.incarnation => Err(fail("a later incarnation")),
                Some(seg) if seg.desc.incarnation > r.incarnation || !seg.is_alive() => Ok(None),
                Some(seg) => match self.reserve_replayed(&seg, r) {
                    Some(a) => Ok(Some(Replica::new(seg, a, super::tenant_of(key)))),
                    None => Err(fail("range taken")),
                },
            };
            match got {
                Ok(Some(rep)) => reserved.push(rep),
                Ok(None) => {}
                Err(e) => {
                    reserved.into_iter().for_each(Replica::release);
                    return Err(e);
                }
            }
        }
        Ok(reserved)
    }

    /// Reserves a replayed range exactly. A range this master still holds back (a write's
    /// release timeout or a read grant, by its own clock) is free on the primary, which just
    /// allocated it: what overlaps it is let go first.
    fn reserve_replayed(&self, seg: &Arc<MountedSegment>, r: &RangeRec) -> Option<SegAlloc> {
        if let Some(a) = seg.reserve_as(r.offset, r.reserved, r.len, r.gen) {
            return Some(a);
        }
        let (start, end) = (r.offset, r.offset + r.reserved);
        let overlapping: Vec<Replica> = {
            let mut deferred = self.deferred.lock();
            let mut out = Vec::new();
            for d in deferred.iter_mut() {
                let (hit, keep): (Vec<Replica>, Vec<Replica>) =
                    std::mem::take(&mut d.replicas).into_iter().partition(|x| {
                        Arc::ptr_eq(&x.seg, seg) && x.alloc.offset < end && start < x.alloc.offset + x.alloc.reserved
                    });
                d.replicas = keep;
                out.extend(hit);
            }
            deferred.retain(|d| !d.replicas.is_empty());
            out
        };
        if overlapping.is_empty() {
            return None;
        }
        overlapping.into_iter().for_each(Replica::release);
        seg.reserve_as(r.offset, r.reserved, r.len, r.gen)
    }

    /// A segment is mounted for `client` with `reserved` ranges (offset, bytes, until) taken
    /// and `fences` (offset, bytes: the VSegment quota's, on a primary) set aside before anyone
    /// allocates; `accepted` runs once the mount is certain, before anyone can allocate in it.
    /// Returns whether it replaced an earlier incarnation.
    // The ranges a mount starts with come in two kinds (carried reservations, quota fences)
    // from two callers; a struct for them would only rename the arguments.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_mount(
        &self,
        group: &Group,
        client: ClientId,
        desc: tycho_proto::SegmentDesc,
        reserved: &[(u64, u64, u64)],
        fences: &[(u64, u64)],
        now: u64,
        accepted: impl FnOnce(),
    ) -> Result<bool, ErrorCode> {
        let id = desc.id;
        let ranges: Vec<(u64, u64)> = reserved.iter().map(|&(o, l, _)| (o, l)).collect();
        let (seg, got, replaced) = group.segments.mount_then(client, desc, &ranges, fences, accepted)?;
        for (alloc, &(_, _, until)) in got.into_iter().zip(reserved) {
            if let Some(alloc) = alloc {
                // A new incarnation: no capability of the old one works, so its tenant does not matter.
                self.defer(vec![Replica::new(seg.clone(), alloc, 0)], until, now);
            }
        }
        let entry = self.register_client(client);
        let mut segs = entry.segments.lock();
        if !segs.contains(&id) {
            segs.push(id);
        }
        Ok(replaced)
    }

    /// A segment is unmounted from `group`: its slice and every replica in it are dead from
    /// now on. The client's list forgets it once no group holds it.
    pub(super) fn apply_unmount(&self, group: &Group, id: SegmentId) {
        if let Some(seg) = group.segments.unmount(id) {
            if self.groups().any(|g| g.segments.get(id).is_some()) {
                return;
            }
            if let Some(c) = self.clients.read().get(&seg.client) {
                c.segments.lock().retain(|s| *s != id);
            }
        }
    }
}

/// Puts `pending` on `key`'s object; with no object there, on a new one without a value (of
/// `version`, the version a copy copies; 0 for a first write).
fn put_pending<K: AsRef<[u8]> + Into<ObjectKey>>(map: &mut ShardMap, key: K, pending: PendingWrite, version: u64) {
    if let Some(obj) = map.get_mut(key.as_ref()) {
        obj.pending = Some(pending);
        return;
    }
    let (size, writer) = (pending.size, pending.writer);
    let obj = ObjectMeta {
        size,
        replicas: Vec::new(),
        pending: Some(pending),
        lease_until: Default::default(),
        used: Default::default(),
        soft_pin_until: 0,
        hard_pin: false,
        writer,
        version,
        replaced: Vec::new(),
        cooldown_until: 0,
    };
    map.insert(key.into(), obj);
}

/// Checks that the write `(writer, write_id)` is the one pending on `key`.
fn check_pending(
    map: &ShardMap,
    key: &[u8],
    writer: ClientId,
    write_id: u64,
    what: &'static str,
) -> Result<(), ReplayError> {
    let ours =
        map.get(key).and_then(|o| o.pending.as_ref()).is_some_and(|p| p.writer == writer && p.write_id == write_id);
    if ours {
        Ok(())
    } else {
        Err(ReplayError::NoSuchWrite(what))
    }
}
