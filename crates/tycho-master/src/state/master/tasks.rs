//! Copy and move tasks on the master (issue 15): creating and answering about them, handing
//! them to their clients, and the copy a task's client runs — CopyStart, CopyEnd, CopyRevoke —
//! as a pending write of the object that adds replicas to its value instead of replacing it.
//!
//! The copy is fenced three ways: by the task (it must be running, assigned to the caller, and
//! of this key), by the object's version (a copy starts only on a committed value with no write
//! pending, holds the object's one pending slot while it runs, so that no other write can
//! commit meanwhile, and its end checks the version again), and by the copy's write id (the
//! end or revoke must name the copy that is pending). A task's state changes in the same
//! decision as its copy's, under the key's shard lock (lock order: the shard's, then the
//! group's tasks), so that a copy never commits for a task that ended, nor a task succeeds
//! without its copy.

use std::sync::atomic::Ordering;

use tycho_proto::auth::capability::{RIGHT_READ, RIGHT_WRITE};
use tycho_proto::*;
use tycho_routing::{decode_object_key, kvpt_to_rank, PARTITION_COUNT};

use super::{Group, Master, Routed};
use crate::log::record::Record;
use crate::state::object::{CopyOf, ShardMap};
use crate::state::segment::{MountedSegment, Replica};
use crate::state::task::{DynamicLease, LeaseRefusal, Task, TaskId, TaskRecord, Tasks};

/// Most tasks one fetch hands out (Mooncake's clients ask for 16 at a time).
pub const FETCH_BATCH: usize = 16;

/// The description of `task` for its user or its client.
fn info(task: &Task) -> TaskInfo {
    let (tenant, key) = decode_object_key(&task.key).unwrap_or(("", ""));
    TaskInfo {
        id: task.id.0,
        kind: task.kind,
        status: task.status,
        tenant: tenant.to_string(),
        key: key.to_string(),
        source: task.source.clone(),
        targets: task.targets.clone(),
        assigned: task.assigned,
        created_ms: task.created_ms,
        updated_ms: task.updated_ms,
        message: task.message.clone(),
    }
}

fn kind_index(kind: TaskKind) -> usize {
    match kind {
        TaskKind::Copy => 0,
        TaskKind::Move => 1,
    }
}

impl Master {
    /// The group a request that names a partition of it (rather than a key) is routed to,
    /// fenced by epoch as a key's route is.
    fn route_group(&self, route: &RouteTag) -> WireResult<&Group> {
        if u32::from(route.partition_id) >= PARTITION_COUNT {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let rank = kvpt_to_rank(route.partition_id, self.cfg.group_count.max(1));
        let group = self.group(rank).filter(|g| g.is_serving()).ok_or_else(|| self.refusal(rank))?;
        match route.epoch.cmp(&group.epoch()) {
            std::cmp::Ordering::Less => Err(ErrorCode::STALE_EPOCH),
            std::cmp::Ordering::Greater => Err(ErrorCode::KVPT_NOT_OWNED),
            std::cmp::Ordering::Equal => Ok(group),
        }
    }

    /// Logs and applies task records of `group` decided under its tasks' lock, counting the
    /// tasks that end.
    fn take_task_records(&self, group: &Group, tasks: &mut crate::state::task::Tasks, recs: Vec<TaskRecord>) {
        for rec in recs {
            match &rec {
                TaskRecord::Created(t) => {
                    self.counters.tasks[kind_index(t.kind)].created.fetch_add(1, Ordering::Relaxed);
                }
                TaskRecord::Finished { id, status, at_ms, .. } => {
                    if let Some(t) = tasks.query(*id).filter(|t| !t.status.is_finished()) {
                        let c = &self.counters.tasks[kind_index(t.kind)];
                        let ended = if *status == TaskStatus::Success { &c.succeeded } else { &c.failed };
                        ended.fetch_add(1, Ordering::Relaxed);
                        c.duration_ms.fetch_add(at_ms.saturating_sub(t.created_ms), Ordering::Relaxed);
                    }
                }
                _ => {}
            }
            self.log_to(group, || Record::Task(rec.clone()));
            tasks.apply(&rec);
        }
    }

    /// Ends task `id` (the first end wins), as `client`'s copy step decided, under the group's
    /// tasks lock the caller holds.
    fn end_task(
        &self,
        group: &Group,
        tasks: &mut Tasks,
        client: ClientId,
        id: TaskId,
        status: TaskStatus,
        why: String,
    ) {
        if let Ok(Some(rec)) = tasks.complete(client, id, status, why, self.clock.unix_now_ms()) {
            self.take_task_records(group, tasks, vec![rec]);
        }
    }

    /// Drops `key`'s pending copy if it is task `id`'s, whatever its copy id: its ranges stay
    /// held until the release timeout, as its client may still be writing into them.
    fn drop_copy_of(&self, map: &mut ShardMap, key: &[u8], id: TaskId) {
        let pending = map.get(key).and_then(|o| o.pending.as_ref());
        let Some(p) = pending.filter(|p| p.copy.is_some_and(|c| c.task == id)) else { return };
        let release = p.started_ms + self.cfg.put_start_release_timeout_ms;
        let (writer, write_id, release_at_ms) = (p.writer, p.write_id, self.unix_time(release));
        self.log(|| Record::WriteDrop { key: key.to_vec(), writer, write_id, release_at_ms });
        self.apply_write_cancel(map, key, Some(release), self.now());
    }

    /// Ends the dynamic copy pending on `key` if its lease ran out (failing its task and
    /// dropping the copy), so that nothing waits for the reaper to free the object for another
    /// copy.
    fn end_expired_dynamic_copy(&self, group: &Group, key: &[u8]) {
        let mut map = group.shard_of(key).write();
        let Some((task, writer)) =
            map.get(key).and_then(|o| o.pending.as_ref()).and_then(|p| p.copy.map(|c| (c.task, p.writer)))
        else {
            return;
        };
        let mut tasks = group.tasks.lock();
        if tasks.lease_of(task).is_some_and(|l| self.clock.unix_now_ms() >= l.expires_ms) {
            let why = "its dynamic copy lease expired".to_string();
            self.end_task(group, &mut tasks, writer, task, TaskStatus::Failed, why);
            self.drop_copy_of(&mut map, key, task);
        }
    }

    /// Drops the pending copies of tasks that have ended (each task with its key), once the
    /// tasks lock is no longer held (a shard's lock comes first).
    fn drop_copies(&self, group: &Group, ended: Vec<(TaskId, Vec<u8>)>) {
        for (id, key) in ended {
            self.drop_copy_of(&mut group.shard_of(&key).write(), &key, id);
        }
    }

    /// A live segment of `group` named `name`.
    fn segment_named(group: &Group, name: &str) -> Option<std::sync::Arc<MountedSegment>> {
        group.segments.live().iter().find(|s| s.desc.name == name && s.is_alive()).cloned()
    }

    /// CreateTask: a copy of `key`'s value to the target segments, or a move of its replica on
    /// the source segment to the target, assigned to the client that owns the source segment.
    /// As Mooncake's master does, it is refused with INVALID_PARAMS when a target is not
    /// mounted, the source holds no replica, a move's source is its target, or there is no
    /// target; with OBJECT_NOT_FOUND for no object, REPLICA_IS_NOT_READY for one not written
    /// yet, TASK_PENDING_LIMIT_EXCEEDED when too many tasks wait. A target that holds a replica
    /// already needs nothing: a copy to such targets alone succeeds at once, and a move to one
    /// drops the source replica at once.
    pub fn create_task(&self, req: &CreateTask) -> WireResult<u128> {
        self.create_task_with(req, None)
    }

    /// [`Master::create_task`], for a dynamic copy when `lease_ms` is set: the task gets a lease
    /// of that many ms on the current version of the value, for the source's client, installed
    /// (logged) before the task. A dynamic copy needs something to copy: a target that holds
    /// the value already refuses it (REPLICA_ALREADY_EXISTS).
    pub(super) fn create_task_with(&self, req: &CreateTask, lease_ms: Option<u64>) -> WireResult<u128> {
        let r = self.route(&req.tenant, &req.key)?;
        self.admit_write(&r)?;
        // More targets than a value can have replicas: refused before they are sorted.
        if req.targets.len() > crate::state::config::MAX_REPLICA_NUM as usize {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mut targets = req.targets.clone();
        targets.sort_unstable();
        targets.dedup();
        let moving = req.kind == TaskKind::Move;
        let shape_ok = !targets.is_empty()
            && targets.len() == req.targets.len()
            && targets.len() <= crate::state::config::MAX_REPLICA_NUM as usize
            && (!moving || (targets.len() == 1 && !req.source.is_empty()))
            && !targets.contains(&req.source);
        if !shape_ok {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let group = self.routed(&r);
        let mounted = |name: &str| Self::segment_named(group, name).is_some();
        if !req.targets.iter().all(|t| mounted(t)) || !(req.source.is_empty() || mounted(&req.source)) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let (source, assigned, needed, version) = {
            let map = group.shards.shard(r.shard).read();
            let obj = map.get(&r.key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
            if !obj.is_complete() {
                return Err(ErrorCode::REPLICA_IS_NOT_READY);
            }
            let live = || obj.replicas.iter().filter(|x| x.seg.is_alive());
            let from = match req.source.as_str() {
                // A copy from whichever replica comes first.
                "" => live().next().ok_or(ErrorCode::OBJECT_NOT_FOUND)?,
                name => live().find(|x| x.seg.desc.name == name).ok_or(ErrorCode::INVALID_PARAMS)?,
            };
            let holds = |t: &String| live().any(|x| x.seg.desc.name == *t);
            let needed: Vec<String> = req.targets.iter().filter(|t| !holds(t)).cloned().collect();
            if live().count() + needed.len() > crate::state::config::MAX_REPLICA_NUM as usize {
                return Err(ErrorCode::INVALID_PARAMS);
            }
            (from.seg.desc.name.clone(), from.seg.client, needed, obj.version)
        };
        let now = self.clock.unix_now_ms();
        let mut task = Task {
            id: TaskId::new(r.group, rand::random()),
            kind: req.kind,
            key: r.key.to_vec(),
            source,
            targets: req.targets.clone(),
            assigned,
            status: TaskStatus::Pending,
            created_ms: now,
            updated_ms: now,
            message: String::new(),
        };
        let id = task.id;
        if let Some(ttl) = lease_ms {
            if needed.len() != req.targets.len() {
                return Err(ErrorCode::REPLICA_ALREADY_EXISTS);
            }
            let lease =
                DynamicLease { task: id, key: task.key.clone(), version, source: assigned, expires_ms: now + ttl };
            let mut tasks = group.tasks.lock();
            let recs = tasks.submit_leased(&self.cfg.task_limits, task, lease)?;
            self.take_task_records(group, &mut tasks, recs.into());
            return Ok(id.0);
        }
        if !needed.is_empty() {
            task.targets = needed;
            let mut tasks = group.tasks.lock();
            let rec = tasks.submit(&self.cfg.task_limits, task)?;
            self.take_task_records(group, &mut tasks, vec![rec]);
            return Ok(id.0);
        }
        // Nothing to copy: the task is done as it is created (a move's source replica goes
        // first, while the target still holds one).
        let mut map = group.shards.shard(r.shard).write();
        let source = Self::segment_named(group, &task.source).map(|s| s.desc.id);
        let mut tasks = group.tasks.lock();
        let created = tasks.submit(&self.cfg.task_limits, task)?;
        if moving {
            let obj = map.get(&r.key).filter(|o| o.pending.is_none());
            let target_holds =
                obj.is_some_and(|o| o.replicas.iter().any(|x| x.seg.desc.name == req.targets[0] && x.seg.is_alive()));
            let (Some(segment), true) = (source, target_holds) else { return Err(ErrorCode::REPLICA_IS_NOT_READY) };
            self.log(|| Record::DropReplicas { key: r.key.to_vec(), segment });
            self.apply_drop_replicas(&mut map, &r.key, segment, self.now());
        }
        let done = TaskRecord::Finished {
            id,
            status: TaskStatus::Success,
            message: "every target holds a replica already".into(),
            at_ms: now,
        };
        self.take_task_records(group, &mut tasks, vec![created, done]);
        Ok(id.0)
    }

    /// QueryTask: a task of the caller's tenant (TASK_NOT_FOUND for any other, or one
    /// forgotten past the finished limit).
    pub fn query_task(&self, q: &TaskQuery) -> WireResult<TaskInfo> {
        let group = self.route_group(&q.route)?;
        let id = TaskId(q.id);
        if id.rank() != group.rank() {
            return Err(ErrorCode::TASK_NOT_FOUND);
        }
        let tasks = group.tasks.lock();
        let task = tasks.query(id).ok_or(ErrorCode::TASK_NOT_FOUND)?;
        let info = info(task);
        if info.tenant != q.tenant {
            return Err(ErrorCode::TASK_NOT_FOUND);
        }
        Ok(info)
    }

    /// FetchTasks: up to [`FETCH_BATCH`] of `client`'s waiting tasks, over the groups this
    /// master serves, oldest first in each; they run from now on.
    pub fn fetch_tasks(&self, client: ClientId) -> Vec<TaskInfo> {
        let mut out = Vec::new();
        for group in self.serving() {
            let room = FETCH_BATCH - out.len();
            if room == 0 {
                break;
            }
            let mut tasks = group.tasks.lock();
            let Some(rec) = tasks.fetch(&self.cfg.task_limits, client, room, self.clock.unix_now_ms()) else {
                continue;
            };
            let TaskRecord::Started { ids, .. } = &rec else { continue };
            let ids = ids.clone();
            self.take_task_records(group, &mut tasks, vec![rec]);
            out.extend(ids.iter().filter_map(|id| tasks.query(*id)).map(info));
        }
        out
    }

    /// The running task `step` names, checked against the caller and the key.
    fn running_task(&self, group: &Group, r: &Routed, step: &CopyStep) -> WireResult<Task> {
        let tasks = group.tasks.lock();
        let task = tasks.query(TaskId(step.task)).ok_or(ErrorCode::TASK_NOT_FOUND)?;
        if task.assigned != step.client {
            return Err(ErrorCode::ILLEGAL_CLIENT);
        }
        if *task.key != *r.key {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        Ok(task.clone())
    }

    /// CopyStart: reserves a range on each of the task's targets and grants its client the
    /// source replica to read and the ranges to write. A copy that cannot run fails its task
    /// (and answers why); a repeated start of the same copy gets the same ranges back. The copy
    /// is installed only while its task runs, under the key's shard lock and the tasks lock
    /// together, so that a task that ended (a timeout, its client's expiry) never gets one.
    pub fn copy_start(&self, step: &CopyStep) -> WireResult<CopyGrant> {
        let r = self.route(&step.tenant, &step.key)?;
        self.admit_write(&r)?;
        if step.write_id == 0 {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let group = self.routed(&r);
        let task = self.running_task(group, &r, step)?;
        let shard = group.shards.shard(r.shard);
        let read = || self.grant(RIGHT_READ, self.cfg.put_start_discard_timeout_ms, &r.key);
        let write = || self.grant(RIGHT_WRITE, self.cfg.put_start_discard_timeout_ms, &r.key);
        let is_source = |x: &Replica| x.seg.desc.name == task.source && x.seg.is_alive();
        // Fails the task (if it still runs) and drops any copy of it; answers `code`.
        let fail = |code: ErrorCode, why: &str| -> WireResult<CopyGrant> {
            {
                let mut map = shard.write();
                let mut tasks = group.tasks.lock();
                self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, format!("{why} ({code:?})"));
                self.drop_copy_of(&mut map, &r.key, task.id);
            }
            Err(code)
        };
        // A repeated start of this very copy: its ranges again, while its source is there.
        let repeated = {
            let map = shard.read();
            map.get(&r.key).and_then(|obj| {
                let p = obj.pending.as_ref()?;
                let copy =
                    p.copy.filter(|c| c.task == task.id && p.writer == step.client && p.write_id == step.write_id)?;
                Some(obj.replicas.iter().find(|x| is_source(x)).map(|source| CopyGrant {
                    version: copy.version,
                    source: source.desc(obj.size, &read()),
                    targets: p.replicas.iter().map(|x| x.desc(obj.size, &write())).collect(),
                }))
            })
        };
        match repeated {
            Some(Some(grant)) => {
                let lease = group.tasks.lock().lease_of(task.id).cloned();
                if lease.is_some_and(|l| l.check(step.client, grant.version, self.clock.unix_now_ms()).is_err()) {
                    return fail(ErrorCode::LEASE_EXPIRED, "its dynamic copy lease expired");
                }
                self.await_logged(&r.key);
                return Ok(grant);
            }
            Some(None) => return fail(ErrorCode::REPLICA_NOT_FOUND, "no replica on the source segment"),
            None => {}
        }
        if task.status != TaskStatus::Processing {
            return Err(ErrorCode::OBJECT_NO_REPLICATION_TASK);
        }
        self.end_expired_dynamic_copy(group, &r.key);
        // What to copy, as things stand: checked again under the write lock. (The read lock
        // is let go before `fail`, which takes the write lock.)
        let checked = {
            let map = shard.read();
            match map.get(&r.key) {
                None => Err((ErrorCode::OBJECT_NOT_FOUND, "the object is gone")),
                Some(obj) => match &obj.pending {
                    Some(p) if p.copy.is_some() => {
                        Err((ErrorCode::OBJECT_HAS_REPLICATION_TASK, "another copy of the object is running"))
                    }
                    Some(_) => Err((ErrorCode::REPLICA_IS_NOT_READY, "a write of the object is in progress")),
                    None if !obj.is_complete() => Err((ErrorCode::REPLICA_IS_NOT_READY, "the object has no value")),
                    None if !obj.replicas.iter().any(is_source) => {
                        Err((ErrorCode::REPLICA_NOT_FOUND, "no replica on the source segment"))
                    }
                    None if obj
                        .replicas
                        .iter()
                        .any(|x| x.seg.is_alive() && task.targets.contains(&x.seg.desc.name)) =>
                    {
                        Err((ErrorCode::REPLICA_ALREADY_EXISTS, "a target holds a replica already"))
                    }
                    None => Ok((obj.size, obj.version)),
                },
            }
        };
        let (size, version) = match checked {
            Ok(v) => v,
            Err((code, why)) => return fail(code, why),
        };
        // A dynamic copy starts only under its lease.
        let lease = group.tasks.lock().lease_of(task.id).cloned();
        if let Some(lease) = &lease {
            if let Err(why) = lease.check(step.client, version, self.clock.unix_now_ms()) {
                return match why {
                    LeaseRefusal::NotSource => Err(ErrorCode::ILLEGAL_CLIENT),
                    LeaseRefusal::Expired => fail(ErrorCode::LEASE_EXPIRED, "its dynamic copy lease expired"),
                    LeaseRefusal::Version => {
                        fail(ErrorCode::INVALID_VERSION, "the value changed since its dynamic copy lease was granted")
                    }
                };
            }
        }
        let tenant = crate::state::master::tenant_of(&r.key);
        let mut reserved: Vec<Replica> = Vec::with_capacity(task.targets.len());
        for name in &task.targets {
            let got = Self::segment_named(group, name)
                .and_then(|seg| seg.allocate(size, tenant).map(|a| Replica::new(seg, a, tenant)));
            match got {
                Some(x) => reserved.push(x),
                None => {
                    reserved.into_iter().for_each(Replica::release);
                    return fail(ErrorCode::NO_AVAILABLE_HANDLE, &format!("no room on target {name}"));
                }
            }
        }
        let release = |reserved: Vec<Replica>| reserved.into_iter().for_each(Replica::release);
        let count = match self.writer(step.client) {
            Ok((_, count)) => count,
            Err(code) => {
                release(reserved);
                return Err(code);
            }
        };
        let source = (task.kind == TaskKind::Move)
            .then(|| Self::segment_named(group, &task.source).map(|s| s.desc.id))
            .flatten();
        let mut map = shard.write();
        let mut tasks = group.tasks.lock();
        if tasks.query(task.id).is_none_or(|t| t.status != TaskStatus::Processing) {
            release(reserved);
            return Err(ErrorCode::OBJECT_NO_REPLICATION_TASK);
        }
        // The lease may have run out meanwhile (the reaper has not got to it yet).
        if tasks.lease_of(task.id).is_some_and(|l| l.check(step.client, version, self.clock.unix_now_ms()).is_err()) {
            release(reserved);
            let why = "its dynamic copy lease expired".to_string();
            self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why);
            return Err(ErrorCode::LEASE_EXPIRED);
        }
        // A segment may have died since allocation (the sweep marks segments dead, then takes
        // this lock): nothing dead goes into the copy.
        let still = map.get(&r.key).filter(|o| o.version == version && o.pending.is_none() && o.is_complete());
        let source_desc = still.and_then(|o| o.replicas.iter().find(|x| is_source(x))).map(|x| x.desc(size, &read()));
        let (Some(source_desc), true) = (source_desc, reserved.iter().all(|x| x.seg.is_alive())) else {
            release(reserved);
            let why = "the object or a segment changed while the copy started".to_string();
            self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why);
            return Err(ErrorCode::REPLICA_IS_NOT_READY);
        };
        let targets: Vec<ReplicaDesc> = reserved.iter().map(|x| x.desc(size, &write())).collect();
        let now = self.now();
        self.log(|| Record::CopyStart {
            key: r.key.to_vec(),
            writer: step.client,
            write_id: step.write_id,
            started_ms: self.unix_time(now),
            task: task.id,
            version,
            source,
            replicas: reserved.iter().map(super::apply::range_rec).collect(),
        });
        let copy = CopyOf { task: task.id, version, source };
        if let Err(reserved) =
            self.apply_copy_start(&mut map, &r.key, step.client, step.write_id, now, copy, size, reserved, &count)
        {
            // Checked above under this lock: cannot happen.
            release(reserved);
            return Err(ErrorCode::INTERNAL_ERROR);
        }
        drop(tasks);
        Ok(CopyGrant { version, source: source_desc, targets })
    }

    /// CopyEnd (`end`) or CopyRevoke: commits the copy `step` names (its ranges become
    /// replicas, a move's source replica goes) and the task succeeds, or drops it and the task
    /// fails; both in one decision under the key's shard lock and the tasks lock. A step with no
    /// such copy pending for a running task answers OBJECT_NO_REPLICATION_TASK, drops whatever
    /// copy the task has, and fails the task if it still runs (its copy was dropped:
    /// pre-empted, its object removed by force, its targets gone); a repeated step whose task
    /// ended as it asked is answered Ok. A copy whose value has no live replica left is not
    /// committed (REPLICA_IS_GONE): the value is about to be swept.
    pub fn copy_finish(&self, step: &CopyStep, end: bool) -> WireResult<()> {
        let r = self.route(&step.tenant, &step.key)?;
        let group = self.routed(&r);
        let task = self.running_task(group, &r, step)?;
        let mut map = group.shards.shard(r.shard).write();
        let mut tasks = group.tasks.lock();
        let status = tasks.query(task.id).map(|t| t.status);
        let pending = map.get(&r.key).and_then(|o| o.pending.as_ref());
        let copy = pending.filter(|p| p.copy.is_some_and(|c| c.task == task.id)).map(|p| (p.writer, p.write_id));
        let ours = copy == Some((step.client, step.write_id));
        if !ours || status != Some(TaskStatus::Processing) {
            self.drop_copy_of(&mut map, &r.key, task.id);
            return match status {
                Some(TaskStatus::Success) if end => {
                    self.await_logged(&r.key);
                    Ok(())
                }
                Some(TaskStatus::Failed) if !end => {
                    self.await_logged(&r.key);
                    Ok(())
                }
                _ => {
                    let why = "its copy was dropped".to_string();
                    self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why);
                    Err(ErrorCode::OBJECT_NO_REPLICATION_TASK)
                }
            };
        }
        // A dynamic copy ends only under its lease: past it, or on another version of the
        // value, the copy is dropped and its task fails, whichever step was asked for.
        let lease = tasks.lease_of(task.id).cloned();
        let copied = map.get(&r.key).and_then(|o| o.pending.as_ref()).and_then(|p| p.copy).map_or(0, |c| c.version);
        if let Some(Err(why)) = lease.as_ref().map(|l| l.check(step.client, copied, self.clock.unix_now_ms())) {
            let (code, why) = match why {
                LeaseRefusal::NotSource => return Err(ErrorCode::ILLEGAL_CLIENT),
                LeaseRefusal::Expired => (ErrorCode::LEASE_EXPIRED, "its dynamic copy lease expired"),
                LeaseRefusal::Version => (ErrorCode::INVALID_VERSION, "the copy is not of its lease's version"),
            };
            self.drop_copy_of(&mut map, &r.key, task.id);
            self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why.into());
            return Err(code);
        }
        if !end {
            self.log(|| Record::WriteRevoke { key: r.key.to_vec(), writer: step.client, write_id: step.write_id });
            self.apply_write_cancel(&mut map, &r.key, None, self.now());
            let why = if step.message.is_empty() { "revoked by its client".to_string() } else { step.message.clone() };
            self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why);
            return Ok(());
        }
        if !map.get(&r.key).is_some_and(|o| o.replicas.iter().any(|x| x.seg.is_alive())) {
            self.drop_copy_of(&mut map, &r.key, task.id);
            let why = "the value's replicas went away".to_string();
            self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why);
            return Err(ErrorCode::REPLICA_IS_GONE);
        }
        let dropped = Self::dead_segments_of_pending(&map, &r.key);
        self.log(|| Record::CopyEnd {
            key: r.key.to_vec(),
            writer: step.client,
            write_id: step.write_id,
            dropped: dropped.clone(),
        });
        // The commit marks a leased copy's replicas dynamic itself (a standby replaying it
        // holds the lease too), so that no failover can part the mark from its replicas.
        match self.apply_copy_end(&mut map, &r.key, &dropped, |_| lease.is_some()) {
            Ok(gone) => {
                gone.into_iter().for_each(Replica::release);
                self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Success, "done".into());
                Ok(())
            }
            Err(code) => {
                let why = format!("every target went away ({code:?})");
                self.end_task(group, &mut tasks, step.client, task.id, TaskStatus::Failed, why);
                Err(code)
            }
        }
    }

    /// Fails every unfinished task of `client` (it expired: nobody else can run them), and
    /// drops the copies it had started, whose ranges stay reserved until the release timeout
    /// (it may still be writing, if only paused).
    pub(super) fn fail_tasks_of(&self, client: ClientId) {
        for group in self.serving() {
            let ended = {
                let mut tasks = group.tasks.lock();
                let recs = tasks.client_gone(client, self.clock.unix_now_ms());
                self.end_tasks(group, &mut tasks, recs)
            };
            self.drop_copies(group, ended);
        }
    }

    /// Applies `recs` (ends of tasks, and forgetting) and returns the tasks among them that were
    /// running, with their keys: their copies are to be dropped.
    fn end_tasks(&self, group: &Group, tasks: &mut Tasks, recs: Vec<TaskRecord>) -> Vec<(TaskId, Vec<u8>)> {
        let running = |id: &TaskId| {
            tasks.query(*id).filter(|t| t.status == TaskStatus::Processing).map(|t| (t.id, t.key.clone()))
        };
        let ended: Vec<(TaskId, Vec<u8>)> = recs
            .iter()
            .filter_map(|r| match r {
                TaskRecord::Finished { id, .. } => running(id),
                _ => None,
            })
            .collect();
        self.take_task_records(group, tasks, recs);
        ended
    }

    /// Fails the tasks past their timeouts (dropping the copies of those that ran) and forgets
    /// the oldest finished ones past the limit, in every group served.
    pub(super) fn task_housekeeping(&self) {
        // Timeouts are minutes long: a look once a second is plenty.
        let now = self.now();
        if now < self.last_task_scan.load(Ordering::Relaxed) + 1000 {
            return;
        }
        self.last_task_scan.store(now, Ordering::Relaxed);
        for group in self.serving() {
            let ended = {
                let mut tasks = group.tasks.lock();
                if tasks.is_empty() {
                    continue;
                }
                let recs = tasks.housekeeping(&self.cfg.task_limits, self.clock.unix_now_ms());
                self.end_tasks(group, &mut tasks, recs)
            };
            self.drop_copies(group, ended);
        }
    }

    /// How many tasks wait, run, and are kept finished, over the groups served.
    pub fn task_counts(&self) -> (usize, usize, usize) {
        self.serving().map(|g| g.tasks.lock().counts()).fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2))
    }
}
