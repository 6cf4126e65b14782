//! Copy and move tasks (issue 15): the part of them a KVPT group keeps. Which tasks exist, in
//! which state, assigned to which client, within the limits Mooncake's master applies
//! (`--max_total_pending_tasks`, `--max_total_processing_tasks`, `--max_total_finished_tasks`,
//! `--pending_task_timeout_sec`, `--processing_task_timeout_sec`).
//!
//! Pure state without I/O, on times the caller gives (Unix ms). It is group state and changes
//! only through the group's log: the primary asks for a decision ([`Tasks::submit`],
//! [`Tasks::fetch`], [`Tasks::complete`], [`Tasks::housekeeping`], [`Tasks::client_gone`]),
//! each of which changes nothing and returns the [`TaskRecord`]s to log; the primary and every
//! standby then apply the same records ([`Tasks::apply`]), so that a failover or a reshard
//! carries every task over, and a snapshot carries them as [`Tasks::to_records`] gives them.
//!
//! The lifecycle is Mooncake's: a task is created PENDING in the queue of the client that holds
//! its source replica; that client's fetch takes it (PROCESSING); the client reports SUCCESS or
//! FAILED, and the first report wins. A task waiting or running past its timeout is failed. The
//! finished tasks are kept, oldest dropped first, up to their limit, and a dropped task is
//! unknown (TASK_NOT_FOUND). Unlike Mooncake's master, which waits for the timeouts, a client
//! that goes away fails its unfinished tasks at once.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use tycho_proto::{ClientId, ErrorCode};

pub use crate::log::task_record::{DynamicLease, LeaseRefusal, Task, TaskId, TaskKind, TaskRecord, TaskStatus};

/// The limits on a group's tasks (Mooncake's defaults: 10,000 of each, 300 s timeouts; a
/// timeout of 0 is none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLimits {
    /// Most tasks waiting at once; a new task past it is refused.
    pub max_pending: usize,
    /// Most tasks running at once; past it, fetches hand out nothing (tasks keep waiting).
    pub max_processing: usize,
    /// Most finished tasks kept for queries; the oldest go first.
    pub max_finished: usize,
    /// A task waiting longer than this (from its creation) fails.
    pub pending_timeout_ms: u64,
    /// A task running longer than this (from its fetch) fails.
    pub processing_timeout_ms: u64,
}

impl Default for TaskLimits {
    fn default() -> TaskLimits {
        TaskLimits {
            max_pending: 10_000,
            max_processing: 10_000,
            max_finished: 10_000,
            pending_timeout_ms: 300_000,
            processing_timeout_ms: 300_000,
        }
    }
}

/// A group's tasks.
#[derive(Debug, Default)]
pub struct Tasks {
    all: HashMap<TaskId, Task>,
    /// Per client, its pending tasks in creation order (a task finished while pending is
    /// taken out when it finishes).
    pending: BTreeMap<ClientId, VecDeque<TaskId>>,
    /// Per client, its running tasks.
    processing: BTreeMap<ClientId, BTreeSet<TaskId>>,
    /// Finished tasks, in the order they finished.
    finished: VecDeque<TaskId>,
    pending_count: usize,
    processing_count: usize,
    /// Per object key, how many of its tasks have not ended.
    unfinished: HashMap<Vec<u8>, u32>,
    /// Leases of dynamic copies, by task.
    leases: HashMap<TaskId, DynamicLease>,
}

impl Tasks {
    /// Task `id`, if the group knows it.
    pub fn query(&self, id: TaskId) -> Option<&Task> {
        self.all.get(&id)
    }

    /// How many tasks of object `key` have not ended.
    pub fn unfinished_of(&self, key: &[u8]) -> u32 {
        self.unfinished.get(key).copied().unwrap_or(0)
    }

    /// The lease of task `id`, if it is a dynamic copy that has not ended.
    pub fn lease_of(&self, id: TaskId) -> Option<&DynamicLease> {
        self.leases.get(&id)
    }

    /// How many dynamic copies hold a lease.
    pub fn leases(&self) -> usize {
        self.leases.len()
    }

    /// Whether the group has no task at all (nor a lease).
    pub fn is_empty(&self) -> bool {
        self.all.is_empty() && self.leases.is_empty()
    }

    /// The records that create a dynamic copy's task under its lease: the lease first, so
    /// that the task is never without it. Refused as [`Tasks::submit`] refuses, with nothing to
    /// roll back.
    pub fn submit_leased(
        &self,
        limits: &TaskLimits,
        task: Task,
        lease: DynamicLease,
    ) -> Result<[TaskRecord; 2], ErrorCode> {
        if lease.task != task.id || lease.key != task.key || lease.source != task.assigned {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let created = self.submit(limits, task)?;
        Ok([TaskRecord::Leased(lease), created])
    }

    /// How many tasks wait, run, and are kept finished.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.pending_count, self.processing_count, self.finished.len())
    }

    /// The record that creates `task` (pending), or TASK_PENDING_LIMIT_EXCEEDED when as many
    /// tasks wait as the limit allows.
    pub fn submit(&self, limits: &TaskLimits, task: Task) -> Result<TaskRecord, ErrorCode> {
        if self.pending_count >= limits.max_pending {
            return Err(ErrorCode::TASK_PENDING_LIMIT_EXCEEDED);
        }
        if self.all.contains_key(&task.id) || task.status != TaskStatus::Pending {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        Ok(TaskRecord::Created(task))
    }

    /// The record that hands `client` up to `max` of its pending tasks, oldest first, as many
    /// as the running limit leaves room for; `None` when there is none to hand out.
    pub fn fetch(&self, limits: &TaskLimits, client: ClientId, max: usize, now_ms: u64) -> Option<TaskRecord> {
        let room = limits.max_processing.saturating_sub(self.processing_count).min(max);
        let ids: Vec<TaskId> = self.pending.get(&client)?.iter().take(room).copied().collect();
        (!ids.is_empty()).then_some(TaskRecord::Started { client, ids, at_ms: now_ms })
    }

    /// The record of `client`'s report on task `id`: `None` when the task ended already (the
    /// first report wins). INVALID_PARAMS for a status that is not an end, TASK_NOT_FOUND for
    /// an unknown task, ILLEGAL_CLIENT when the task is another client's.
    pub fn complete(
        &self,
        client: ClientId,
        id: TaskId,
        status: TaskStatus,
        message: String,
        now_ms: u64,
    ) -> Result<Option<TaskRecord>, ErrorCode> {
        if !status.is_finished() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let task = self.all.get(&id).ok_or(ErrorCode::TASK_NOT_FOUND)?;
        if task.assigned != client {
            return Err(ErrorCode::ILLEGAL_CLIENT);
        }
        if task.status.is_finished() {
            return Ok(None);
        }
        Ok(Some(TaskRecord::Finished { id, status, message, at_ms: now_ms }))
    }

    /// The records of the periodic clean-up at `now_ms`: tasks past their timeout fail, then
    /// the oldest finished tasks beyond the limit (counting those) are forgotten.
    pub fn housekeeping(&self, limits: &TaskLimits, now_ms: u64) -> Vec<TaskRecord> {
        let mut out = Vec::new();
        let late = |t: &Task| match t.status {
            TaskStatus::Pending if limits.pending_timeout_ms > 0 => {
                (now_ms.saturating_sub(t.created_ms) > limits.pending_timeout_ms).then_some("pending timeout")
            }
            TaskStatus::Processing if limits.processing_timeout_ms > 0 => {
                (now_ms.saturating_sub(t.updated_ms) > limits.processing_timeout_ms).then_some("processing timeout")
            }
            _ => None,
        };
        let mut timed_out: Vec<(TaskId, &str)> =
            self.all.values().filter_map(|t| late(t).map(|why| (t.id, why))).collect();
        for l in self.leases.values().filter(|l| now_ms >= l.expires_ms) {
            let unfinished = self.all.get(&l.task).is_some_and(|t| !t.status.is_finished());
            if unfinished && !timed_out.iter().any(|(id, _)| *id == l.task) {
                timed_out.push((l.task, "its dynamic copy lease expired"));
            }
        }
        timed_out.sort_unstable();
        let over = (self.finished.len() + timed_out.len()).saturating_sub(limits.max_finished);
        // Finished order: those kept, then these failures as they are logged.
        let ids: Vec<TaskId> =
            self.finished.iter().copied().chain(timed_out.iter().map(|(id, _)| *id)).take(over).collect();
        out.extend(timed_out.into_iter().map(|(id, why)| TaskRecord::Finished {
            id,
            status: TaskStatus::Failed,
            message: why.to_string(),
            at_ms: now_ms,
        }));
        if !ids.is_empty() {
            out.push(TaskRecord::Forgotten { ids });
        }
        // A lease without a task (its creation record lost to a failover between the two).
        let mut orphans: Vec<TaskId> =
            self.leases.keys().filter(|id| self.all.get(id).is_none_or(|t| t.status.is_finished())).copied().collect();
        orphans.sort_unstable();
        out.extend(orphans.into_iter().map(|task| TaskRecord::LeaseDropped { task }));
        out
    }

    /// The records that fail every unfinished task of `client`, which went away (expired,
    /// unmounted its source): nobody else can run them.
    pub fn client_gone(&self, client: ClientId, now_ms: u64) -> Vec<TaskRecord> {
        let mut ids: Vec<TaskId> = self.pending.get(&client).into_iter().flatten().copied().collect();
        ids.extend(self.processing.get(&client).into_iter().flatten().copied());
        ids.sort_unstable();
        ids.into_iter()
            .map(|id| TaskRecord::Finished {
                id,
                status: TaskStatus::Failed,
                message: "its client went away".into(),
                at_ms: now_ms,
            })
            .collect()
    }

    /// Applies a logged change. A record that does not fit the state (a task started twice, a
    /// report on a task that ended) changes nothing: replaying a log gives the state its
    /// primary had.
    pub fn apply(&mut self, rec: &TaskRecord) {
        match rec {
            TaskRecord::Created(task) => {
                if self.all.contains_key(&task.id) {
                    return;
                }
                self.pending.entry(task.assigned).or_default().push_back(task.id);
                self.pending_count += 1;
                *self.unfinished.entry(task.key.clone()).or_default() += 1;
                self.all.insert(task.id, Task { status: TaskStatus::Pending, ..task.clone() });
            }
            TaskRecord::Started { client, ids, at_ms } => {
                for id in ids {
                    let Some(task) = self.all.get_mut(id).filter(|t| t.status == TaskStatus::Pending) else { continue };
                    if task.assigned != *client {
                        continue;
                    }
                    task.status = TaskStatus::Processing;
                    task.updated_ms = *at_ms;
                    Self::unqueue(&mut self.pending, *client, *id);
                    self.pending_count -= 1;
                    self.processing.entry(*client).or_default().insert(*id);
                    self.processing_count += 1;
                }
            }
            TaskRecord::Finished { id, status, message, at_ms } => {
                let Some(task) = self.all.get_mut(id).filter(|t| !t.status.is_finished()) else { return };
                if !status.is_finished() {
                    return;
                }
                match task.status {
                    TaskStatus::Pending => {
                        Self::unqueue(&mut self.pending, task.assigned, *id);
                        self.pending_count -= 1;
                    }
                    _ => {
                        if let Some(set) = self.processing.get_mut(&task.assigned) {
                            set.remove(id);
                            if set.is_empty() {
                                self.processing.remove(&task.assigned);
                            }
                        }
                        self.processing_count -= 1;
                    }
                }
                task.status = *status;
                task.message = message.clone();
                task.updated_ms = *at_ms;
                self.finished.push_back(*id);
                self.leases.remove(id);
                if let Some(n) = self.unfinished.get_mut(&task.key) {
                    *n -= 1;
                    if *n == 0 {
                        self.unfinished.remove(&task.key);
                    }
                }
            }
            TaskRecord::Forgotten { ids } => {
                let gone: std::collections::HashSet<TaskId> =
                    ids.iter().filter(|id| self.all.get(id).is_some_and(|t| t.status.is_finished())).copied().collect();
                if !gone.is_empty() {
                    gone.iter().for_each(|id| drop(self.all.remove(id)));
                    self.finished.retain(|f| !gone.contains(f));
                }
            }
            TaskRecord::Leased(lease) => {
                // A lease comes before its task; a task that exists already (a replayed log
                // over a snapshot) or ended gets none.
                if !self.all.contains_key(&lease.task) {
                    self.leases.insert(lease.task, lease.clone());
                }
            }
            TaskRecord::LeaseDropped { task } => {
                self.leases.remove(task);
            }
        }
    }

    /// Takes `id` out of `client`'s queue (usually its front: fetches take the oldest).
    fn unqueue(pending: &mut BTreeMap<ClientId, VecDeque<TaskId>>, client: ClientId, id: TaskId) {
        if let Some(q) = pending.get_mut(&client) {
            if let Some(i) = q.iter().position(|x| *x == id) {
                q.remove(i);
            }
            if q.is_empty() {
                pending.remove(&client);
            }
        }
    }

    /// Records that rebuild this state when applied to an empty one, in order: for a snapshot
    /// (the log's own records may be gone). Each running task is created and at once started,
    /// each finished one created and at once ended (in the order they ended), then the waiting
    /// ones are created in their queues' order: every step is at a queue's front or back.
    pub fn to_records(&self) -> Vec<TaskRecord> {
        let mut out = Vec::with_capacity(self.all.len() * 2 + self.leases.len());
        // Leases first: each comes before its task.
        let mut leases: Vec<&DynamicLease> = self.leases.values().collect();
        leases.sort_unstable_by_key(|l| l.task);
        out.extend(leases.into_iter().map(|l| TaskRecord::Leased(l.clone())));
        let created = |t: &Task| TaskRecord::Created(Task { status: TaskStatus::Pending, ..t.clone() });
        for (client, ids) in &self.processing {
            for t in ids.iter().filter_map(|id| self.all.get(id)) {
                out.push(created(t));
                out.push(TaskRecord::Started { client: *client, ids: vec![t.id], at_ms: t.updated_ms });
            }
        }
        for t in self.finished.iter().filter_map(|id| self.all.get(id)) {
            out.push(created(t));
            out.push(TaskRecord::Finished {
                id: t.id,
                status: t.status,
                message: t.message.clone(),
                at_ms: t.updated_ms,
            });
        }
        out.extend(self.pending.values().flatten().filter_map(|id| self.all.get(id)).map(created));
        out
    }

    /// Every task, waiting ones first (in their queues' order), then running, then finished
    /// (in the order they ended).
    pub fn list(&self) -> Vec<&Task> {
        let ids = self.pending.values().flatten().chain(self.processing.values().flatten()).chain(self.finished.iter());
        ids.filter_map(|id| self.all.get(id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ClientId = ClientId(1);
    const B: ClientId = ClientId(2);

    fn task(n: u128, client: ClientId, at: u64) -> Task {
        Task {
            id: TaskId::new(3, n),
            kind: TaskKind::Copy,
            key: format!("k{n}").into_bytes(),
            source: "seg-a".into(),
            targets: vec!["seg-b".into()],
            assigned: client,
            status: TaskStatus::Pending,
            created_ms: at,
            updated_ms: at,
            message: String::new(),
        }
    }

    /// Decides and applies, as a primary does, keeping the log.
    struct Primary {
        tasks: Tasks,
        log: Vec<TaskRecord>,
        limits: TaskLimits,
    }

    impl Primary {
        fn new(limits: TaskLimits) -> Primary {
            Primary { tasks: Tasks::default(), log: Vec::new(), limits }
        }

        fn take(&mut self, recs: impl IntoIterator<Item = TaskRecord>) {
            for r in recs {
                self.tasks.apply(&r);
                self.log.push(r);
            }
        }

        fn submit(&mut self, t: Task) -> Result<(), ErrorCode> {
            let r = self.tasks.submit(&self.limits, t)?;
            self.take([r]);
            Ok(())
        }

        fn fetch(&mut self, c: ClientId, max: usize, now: u64) -> Vec<TaskId> {
            match self.tasks.fetch(&self.limits, c, max, now) {
                Some(r) => {
                    let TaskRecord::Started { ids, .. } = &r else { unreachable!() };
                    let ids = ids.clone();
                    self.take([r]);
                    ids
                }
                None => Vec::new(),
            }
        }

        fn complete(&mut self, c: ClientId, id: TaskId, s: TaskStatus, now: u64) -> Result<(), ErrorCode> {
            let r = self.tasks.complete(c, id, s, "done".into(), now)?;
            self.take(r);
            Ok(())
        }

        /// A standby's state: the log replayed from nothing.
        fn replayed(&self) -> Tasks {
            let mut t = Tasks::default();
            self.log.iter().for_each(|r| t.apply(r));
            t
        }
    }

    fn same(a: &Tasks, b: &Tasks) {
        assert_eq!(a.list(), b.list());
        assert_eq!(a.counts(), b.counts());
    }

    #[test]
    fn ids_carry_their_group() {
        let id = TaskId::new(513, u128::MAX);
        assert_eq!(id.rank(), 513);
        assert_eq!(TaskId::new(0, 7).rank(), 0);
    }

    #[test]
    fn a_task_waits_for_its_client_then_runs_then_ends_once() {
        let mut p = Primary::new(TaskLimits::default());
        p.submit(task(1, A, 10)).unwrap();
        p.submit(task(2, A, 11)).unwrap();
        assert!(p.fetch(B, 16, 12).is_empty(), "another client's fetch gets nothing");
        assert_eq!(p.fetch(A, 1, 12), vec![TaskId::new(3, 1)], "oldest first, at most max");
        assert_eq!(p.tasks.counts(), (1, 1, 0));
        let t1 = TaskId::new(3, 1);
        assert_eq!(p.tasks.query(t1).unwrap().status, TaskStatus::Processing);
        assert_eq!(p.complete(A, t1, TaskStatus::Pending, 13), Err(ErrorCode::INVALID_PARAMS));
        assert_eq!(p.complete(B, t1, TaskStatus::Success, 13), Err(ErrorCode::ILLEGAL_CLIENT));
        assert_eq!(p.complete(A, TaskId::new(3, 99), TaskStatus::Success, 13), Err(ErrorCode::TASK_NOT_FOUND));
        p.complete(A, t1, TaskStatus::Success, 14).unwrap();
        p.complete(A, t1, TaskStatus::Failed, 15).unwrap();
        let t = p.tasks.query(t1).unwrap();
        assert_eq!((t.status, t.updated_ms), (TaskStatus::Success, 14), "the first report wins");
        assert_eq!(p.tasks.counts(), (1, 0, 1));
        // A pending task may be reported on too (it leaves its queue).
        p.complete(A, TaskId::new(3, 2), TaskStatus::Failed, 16).unwrap();
        assert_eq!(p.tasks.counts(), (0, 0, 2));
        assert!(p.fetch(A, 16, 17).is_empty());
        same(&p.tasks, &p.replayed());
    }

    #[test]
    fn the_pending_limit_refuses_new_tasks_and_the_running_limit_holds_them_back() {
        let limits = TaskLimits { max_pending: 2, max_processing: 1, ..TaskLimits::default() };
        let mut p = Primary::new(limits);
        p.submit(task(1, A, 0)).unwrap();
        p.submit(task(2, B, 0)).unwrap();
        assert_eq!(p.submit(task(3, A, 0)), Err(ErrorCode::TASK_PENDING_LIMIT_EXCEEDED));
        assert!(p.tasks.query(TaskId::new(3, 3)).is_none(), "a refused task changes nothing");
        assert_eq!(p.fetch(A, 16, 1).len(), 1);
        assert!(p.fetch(B, 16, 1).is_empty(), "one may run at a time: B's task waits");
        p.submit(task(3, A, 2)).unwrap();
        p.complete(A, TaskId::new(3, 1), TaskStatus::Success, 3).unwrap();
        assert_eq!(p.fetch(B, 16, 4), vec![TaskId::new(3, 2)]);
        same(&p.tasks, &p.replayed());
    }

    #[test]
    fn timeouts_fail_tasks_and_the_oldest_finished_are_forgotten() {
        let limits =
            TaskLimits { max_finished: 2, pending_timeout_ms: 100, processing_timeout_ms: 50, ..TaskLimits::default() };
        let mut p = Primary::new(limits);
        for n in 1..=4 {
            p.submit(task(n, A, 0)).unwrap();
        }
        assert_eq!(p.fetch(A, 1, 70).len(), 1, "task 1 runs from 70");
        assert!(p.tasks.housekeeping(&p.limits, 100).is_empty(), "nothing late at 100");
        // At 121: task 1 ran for 51 ms, tasks 2-4 waited 121 ms. Four failures, and the two
        // oldest of them forgotten at once (finished limit 2).
        let recs = p.tasks.housekeeping(&p.limits, 121);
        assert_eq!(recs.len(), 5, "{recs:?}");
        p.take(recs);
        let t1 = p.tasks.query(TaskId::new(3, 1));
        assert!(t1.is_none(), "forgotten: {t1:?}");
        assert_eq!(p.tasks.counts(), (0, 0, 2));
        let t4 = p.tasks.query(TaskId::new(3, 4)).unwrap();
        assert_eq!((t4.status, t4.message.as_str()), (TaskStatus::Failed, "pending timeout"));
        assert!(p.tasks.housekeeping(&p.limits, 1000).is_empty(), "nothing more to do");
        same(&p.tasks, &p.replayed());
        // A timeout of 0 is none.
        let mut q = Primary::new(TaskLimits { pending_timeout_ms: 0, processing_timeout_ms: 0, ..limits });
        q.submit(task(1, A, 0)).unwrap();
        assert!(q.tasks.housekeeping(&q.limits, u64::MAX).is_empty());
    }

    #[test]
    fn a_client_that_goes_away_fails_its_tasks_and_only_its_own() {
        let mut p = Primary::new(TaskLimits::default());
        p.submit(task(1, A, 0)).unwrap();
        p.submit(task(2, A, 0)).unwrap();
        p.submit(task(3, B, 0)).unwrap();
        p.fetch(A, 1, 1);
        let recs = p.tasks.client_gone(A, 5);
        assert_eq!(recs.len(), 2);
        p.take(recs);
        for n in [1, 2] {
            assert_eq!(p.tasks.query(TaskId::new(3, n)).unwrap().status, TaskStatus::Failed);
        }
        assert_eq!(p.tasks.query(TaskId::new(3, 3)).unwrap().status, TaskStatus::Pending);
        p.fetch(B, 1, 6);
        assert_eq!(p.tasks.query(TaskId::new(3, 3)).unwrap().status, TaskStatus::Processing);
        assert_eq!((p.tasks.unfinished_of(b"k1"), p.tasks.unfinished_of(b"k3")), (0, 1));
        same(&p.tasks, &p.replayed());
    }

    #[test]
    fn a_snapshot_of_the_tasks_gives_the_same_state_and_records_survive_the_wire() {
        let mut p = Primary::new(TaskLimits::default());
        for n in 1..=5 {
            p.submit(task(n, if n % 2 == 0 { B } else { A }, n as u64)).unwrap();
        }
        p.fetch(A, 1, 6);
        p.complete(B, TaskId::new(3, 2), TaskStatus::Success, 7).unwrap();
        let mut restored = Tasks::default();
        p.tasks.to_records().iter().for_each(|r| restored.apply(r));
        same(&p.tasks, &restored);
        assert_eq!(restored.to_records(), p.tasks.to_records());
        // The next decisions agree too.
        assert_eq!(
            restored.fetch(&p.limits, A, 16, 8),
            p.tasks.fetch(&p.limits, A, 16, 8),
            "the queues keep their order through a snapshot"
        );
        for r in &p.log {
            let bytes = postcard::to_stdvec(r).unwrap();
            assert_eq!(&postcard::from_bytes::<TaskRecord>(&bytes).unwrap(), r);
        }
    }

    #[test]
    fn records_that_do_not_fit_change_nothing() {
        let mut p = Primary::new(TaskLimits::default());
        p.submit(task(1, A, 0)).unwrap();
        let before: Vec<Task> = p.tasks.list().into_iter().cloned().collect();
        let id = TaskId::new(3, 1);
        p.tasks.apply(&TaskRecord::Started { client: B, ids: vec![id], at_ms: 1 });
        p.tasks.apply(&TaskRecord::Finished { id, status: TaskStatus::Processing, message: String::new(), at_ms: 1 });
        p.tasks.apply(&TaskRecord::Forgotten { ids: vec![id] });
        p.tasks.apply(&TaskRecord::Created(Task { targets: vec![], ..task(1, B, 9) }));
        assert_eq!(p.tasks.list().into_iter().cloned().collect::<Vec<_>>(), before);
        assert_eq!(p.tasks.counts(), (1, 0, 0));
    }

    fn lease(n: u128, client: ClientId, expires_ms: u64) -> DynamicLease {
        DynamicLease {
            task: TaskId::new(3, n),
            key: format!("k{n}").into_bytes(),
            version: 7,
            source: client,
            expires_ms,
        }
    }

    #[test]
    fn a_lease_fences_its_copy_expires_with_the_reaper_and_ends_with_its_task() {
        let limits = TaskLimits::default();
        let mut p = Primary::new(limits);
        // A lease must match its task.
        assert_eq!(p.tasks.submit_leased(&limits, task(1, A, 0), lease(1, B, 100)), Err(ErrorCode::INVALID_PARAMS));
        let recs = p.tasks.submit_leased(&limits, task(1, A, 0), lease(1, A, 100)).unwrap();
        assert!(matches!(recs[0], TaskRecord::Leased(_)), "the lease is installed before the task");
        p.take(recs);
        let recs = p.tasks.submit_leased(&limits, task(2, A, 0), lease(2, A, 10_000)).unwrap();
        p.take(recs);
        let l = p.tasks.lease_of(TaskId::new(3, 1)).unwrap().clone();
        assert_eq!(l.check(A, 7, 99), Ok(()));
        assert_eq!(l.check(B, 7, 99), Err(LeaseRefusal::NotSource));
        assert_eq!(l.check(A, 8, 99), Err(LeaseRefusal::Version));
        assert_eq!(l.check(A, 7, 100), Err(LeaseRefusal::Expired));
        // A snapshot carries the leases, each before its task.
        let mut restored = Tasks::default();
        p.tasks.to_records().iter().for_each(|r| restored.apply(r));
        assert_eq!(restored.to_records(), p.tasks.to_records());
        assert_eq!(restored.lease_of(TaskId::new(3, 1)), Some(&l));
        // Past its lease the reaper fails the task, and the lease goes with it; the other stays.
        let recs = p.tasks.housekeeping(&limits, 100);
        assert_eq!(recs.len(), 1, "{recs:?}");
        assert!(matches!(&recs[0], TaskRecord::Finished { id, .. } if *id == TaskId::new(3, 1)));
        p.take(recs);
        assert_eq!((p.tasks.lease_of(TaskId::new(3, 1)), p.tasks.leases()), (None, 1));
        // A task that ends otherwise ends its lease too.
        p.fetch(A, 16, 200);
        p.complete(A, TaskId::new(3, 2), TaskStatus::Success, 300).unwrap();
        assert_eq!(p.tasks.leases(), 0);
        same(&p.tasks, &p.replayed());
        // A lease whose task record never came (a failover between the two) is dropped.
        p.take([TaskRecord::Leased(lease(9, A, 1_000_000))]);
        assert_eq!(p.tasks.housekeeping(&limits, 400), vec![TaskRecord::LeaseDropped { task: TaskId::new(3, 9) }]);
        for r in &p.log {
            let bytes = postcard::to_stdvec(r).unwrap();
            assert_eq!(&postcard::from_bytes::<TaskRecord>(&bytes).unwrap(), r);
        }
    }
}
