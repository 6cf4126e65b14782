//! Copy and move tasks (issue 15) on the client side: asking for them, asking about them, and
//! running those the master assigns to this client, which owns their source segments.
//!
//! The worker is a thread of each client that contributes a segment. Every
//! [`ClientConfig::task_poll_interval`](crate::ClientConfig::task_poll_interval) it asks each
//! primary for the tasks waiting for it (FetchTasks), and runs them one after the other:
//! CopyStart (the master reserves the target ranges and grants the source replica), the copy of
//! the bytes, chunk by chunk, then CopyEnd, which commits the new replicas and ends the task in
//! one decision; on a failure, CopyRevoke, which frees the ranges and fails the task. Every step
//! names the copy by a fresh write id, so that a step repeated after a lost answer does no harm.

use std::sync::Arc;
use std::time::Duration;

use tycho_proto::*;

use super::{new_write_id, Client, Inner};

/// Starts the task worker of `inner` unless it runs already or tasks are off; false when the
/// thread could not be started.
pub(super) fn ensure_worker(inner: &Arc<Inner>) -> bool {
    let every = inner.cfg.task_poll_interval;
    let mut slot = inner.task_thread.lock();
    if every.is_zero() || slot.is_some() {
        return true;
    }
    let w = inner.clone();
    match std::thread::Builder::new().name("tycho-tasks".into()).spawn(move || w.task_loop(every)) {
        Ok(t) => {
            *slot = Some(t);
            true
        }
        Err(_) => false,
    }
}

/// Bytes copied per read-then-write step of a task's copy: bounds the worker's buffer.
const COPY_CHUNK: usize = 8 << 20;

impl Client {
    /// Asks for a copy of `key`'s value onto each of the `targets` segments (by name); returns
    /// the task's id. The task runs on the client that holds the replica copied.
    pub fn create_copy_task(&self, key: &str, targets: &[String]) -> Result<u128, ErrorCode> {
        self.create_task(key, TaskKind::Copy, String::new(), targets.to_vec())
    }

    /// Asks for `key`'s replica on segment `source` to move to segment `target`; returns the
    /// task's id. The source replica is dropped only once the target's is complete.
    pub fn create_move_task(&self, key: &str, source: &str, target: &str) -> Result<u128, ErrorCode> {
        self.create_task(key, TaskKind::Move, source.to_string(), vec![target.to_string()])
    }

    fn create_task(&self, key: &str, kind: TaskKind, source: String, targets: Vec<String>) -> Result<u128, ErrorCode> {
        self.check_open()?;
        let req = Request::CreateTask(CreateTask { tenant: self.tenant(), key: self.key(key), kind, source, targets });
        match self.inner.call(&req)? {
            Response::TaskCreated(id) => Ok(id),
            _ => Err(ErrorCode::INTERNAL_ERROR),
        }
    }

    /// Where task `id` stands (TASK_NOT_FOUND for a task of another tenant, or one forgotten).
    pub fn query_task(&self, id: u128) -> Result<TaskInfo, ErrorCode> {
        self.check_open()?;
        let route = {
            let routes = self.inner.routes.read();
            let groups = routes.table().groups.max(1);
            let rank = (id >> 112) as u32;
            if rank >= groups {
                return Err(ErrorCode::TASK_NOT_FOUND);
            }
            let partition = tycho_routing::rank_partitions(rank, groups).start as u16;
            RouteTag { partition_id: partition, epoch: routes.epoch_of(partition) }
        };
        let req = Request::QueryTask(TaskQuery { tenant: self.tenant(), id, route });
        match self.inner.call(&req)? {
            Response::Task(info) => Ok(info),
            _ => Err(ErrorCode::INTERNAL_ERROR),
        }
    }
}

impl Inner {
    /// The worker: fetches this client's tasks and runs them, until the client closes.
    pub(super) fn task_loop(&self, every: Duration) {
        loop {
            {
                let mut stop = self.heartbeat.stop.lock();
                if *stop {
                    return;
                }
                self.heartbeat.wake.wait_for(&mut stop, every);
                if *stop {
                    return;
                }
            }
            let tasks = match self.call(&Request::FetchTasks { client: self.id }) {
                Ok(Response::Tasks(tasks)) => tasks,
                Ok(other) => {
                    tracing::debug!(answer = ?other, "unexpected answer to FetchTasks");
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not fetch tasks; will retry");
                    continue;
                }
            };
            for task in tasks {
                if *self.heartbeat.stop.lock() {
                    return;
                }
                match self.run_task(&task) {
                    Ok(()) => {
                        tracing::info!(task = format_args!("{:032x}", task.id), key = %task.key, kind = ?task.kind, "task done")
                    }
                    Err(e) => {
                        tracing::warn!(task = format_args!("{:032x}", task.id), key = %task.key, error = %e, "task failed")
                    }
                }
            }
        }
    }

    /// Runs one task: CopyStart, the copy, CopyEnd (or CopyRevoke on a failure).
    fn run_task(&self, task: &TaskInfo) -> Result<(), ErrorCode> {
        let mut route = tycho_routing::route_for(&task.tenant, &task.key, tycho_routing::INITIAL_GROUP_EPOCH);
        route.epoch = self.routes.read().epoch_of(route.partition_id);
        let mut step = CopyStep {
            client: self.id,
            tenant: task.tenant.clone(),
            key: KeyRef { key: task.key.clone(), route },
            task: task.id,
            write_id: new_write_id(),
            message: String::new(),
        };
        let grant = match self.call(&Request::CopyStart(step.clone())) {
            Ok(Response::CopyStarted(g)) => g,
            Ok(_) => return Err(ErrorCode::INTERNAL_ERROR),
            Err(e) => {
                // Whatever kept the start from being answered (a lost answer, a group that kept
                // moving), the task ends now rather than at its timeout: a revoke by the copy's
                // id gives up a start that did reach the master, and fails the task if it still
                // runs (the master failed it already when it refused the start itself).
                step.message = format!("its start failed ({e:?})");
                let _ = self.call(&Request::CopyRevoke(step));
                return Err(e);
            }
        };
        // Tests hold a copy here (its ranges reserved, its object fenced) to act on it.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("client::task::copy_started");
        if let Err(e) = self.copy_bytes(&grant) {
            step.message = format!("the copy failed ({e:?})");
            let _ = self.call(&Request::CopyRevoke(step));
            return Err(e);
        }
        match self.call(&Request::CopyEnd(step))? {
            Response::Done => Ok(()),
            _ => Err(ErrorCode::INTERNAL_ERROR),
        }
    }

    /// Copies the source replica of `grant` into each of its targets, a chunk at a time.
    fn copy_bytes(&self, grant: &CopyGrant) -> Result<(), ErrorCode> {
        let size = grant.source.len as usize;
        let mut buf = vec![0u8; size.min(COPY_CHUNK)];
        let mut at = 0usize;
        while at < size {
            let n = (size - at).min(COPY_CHUNK);
            self.engine.read(&grant.source, at as u64, &mut buf[..n]).map_err(|e| e.code())?;
            for target in &grant.targets {
                self.engine.write(target, at as u64, &buf[..n]).map_err(|e| e.code())?;
            }
            at += n;
        }
        Ok(())
    }
}
