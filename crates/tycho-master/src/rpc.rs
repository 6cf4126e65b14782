//! The master behind the RPC server: maps each [`Request`] to the service call.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tycho_proto::frame::FrameError;
use tycho_proto::{ErrorCode, Request, Response, WireResult};
use tycho_rpc::{Reply, Service};

use crate::master::{Master, WriteMode};

use crate::health::HEALTH_CHECK_BUDGET;
use crate::metrics::RpcMetrics;

/// Adapts a [`Master`] to [`tycho_rpc::Service`], recording per-RPC metrics.
pub struct MasterRpc {
    master: Arc<Master>,
    metrics: Arc<RpcMetrics>,
    health_budget: Duration,
}

impl MasterRpc {
    /// Serves `master`, recording into `metrics`.
    pub fn new(master: Arc<Master>, metrics: Arc<RpcMetrics>) -> MasterRpc {
        MasterRpc { master, metrics, health_budget: HEALTH_CHECK_BUDGET }
    }
}

fn done(r: WireResult<()>) -> Response {
    r.map_or_else(Response::Error, |()| Response::Done)
}

impl MasterRpc {
    /// Runs work that walks many shards (sweeps, bulk removal) on the blocking pool, so the
    /// connection keeps serving other calls.
    fn blocking<F>(&self, f: F) -> Reply<Response>
    where
        F: FnOnce(&Master) -> Response + Send + 'static,
    {
        let master = self.master.clone();
        Reply::Later(Box::pin(async move {
            tokio::task::spawn_blocking(move || f(&master)).await.unwrap_or(Response::Error(ErrorCode::INTERNAL_ERROR))
        }))
    }
}

impl MasterRpc {
    /// A write start that finds no room does not wait for eviction on the RPC worker: it is
    /// answered again from a blocking thread, where it may wait for one eviction round.
    fn write_start(&self, mode: WriteMode, r: tycho_proto::WriteStart) -> Reply<Response> {
        match self.master.write_start_with(mode, &r, false) {
            Err(ErrorCode::NO_AVAILABLE_HANDLE) => {
                self.blocking(move |m| m.write_start(mode, &r).map_or_else(Response::Error, Response::WriteStarted))
            }
            res => Reply::Ready(res.map_or_else(Response::Error, Response::WriteStarted)),
        }
    }

    /// As [`MasterRpc::write_start`] for batches. The repeat on the blocking thread is safe:
    /// items already started answer with the same ranges (their write ids match).
    fn batch_write_start(&self, mode: WriteMode, r: tycho_proto::BatchWriteStart) -> Reply<Response> {
        let res = self.master.batch_write_start_with(mode, &r, false);
        if res.contains(&Err(ErrorCode::NO_AVAILABLE_HANDLE)) {
            return self.blocking(move |m| Response::BatchWriteStarted(m.batch_write_start(mode, &r)));
        }
        Reply::Ready(Response::BatchWriteStarted(res))
    }
}

impl Service for MasterRpc {
    type Request = Request;
    type Response = Response;

    fn call(&self, req: Request) -> Reply<Response> {
        // Tests stall RPC workers here to reproduce worker-pool exhaustion (spec 02).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("master::rpc::stall");
        let index = req.index();
        let start = Instant::now();
        match self.dispatch(req) {
            Reply::Ready(resp) => {
                self.metrics.record(index, start.elapsed(), &resp);
                Reply::Ready(resp)
            }
            Reply::Later(fut) => {
                let metrics = self.metrics.clone();
                Reply::Later(Box::pin(async move {
                    let resp = fut.await;
                    metrics.record(index, start.elapsed(), &resp);
                    resp
                }))
            }
        }
    }

    fn malformed(&self, _err: &FrameError) -> Response {
        Response::Error(ErrorCode::INVALID_PARAMS)
    }
}

impl MasterRpc {
    fn dispatch(&self, req: Request) -> Reply<Response> {
        let m = &*self.master;
        let resp = match req {
            Request::Ping { client } => Response::Ping(m.ping(client)),
            Request::ServiceReady => Response::ServiceReady(true),
            // A remount may sweep an earlier incarnation first: off the RPC worker.
            Request::MountSegment { client, segment } => {
                return self.blocking(move |m| done(m.mount_segment(client, segment)))
            }
            Request::ReMountSegment { client, segments } => {
                return self.blocking(move |m| done(m.remount_segments(client, segments)))
            }
            Request::UnmountSegment { client, segment } => {
                return self.blocking(move |m| done(m.unmount_segment(client, segment)))
            }
            Request::PutStart(r) => return self.write_start(WriteMode::Put, r),
            Request::UpsertStart(r) => return self.write_start(WriteMode::Upsert, r),
            Request::PutEnd(r) | Request::UpsertEnd(r) => {
                m.write_finish(&r, true).map_or_else(Response::Error, Response::Committed)
            }
            Request::PutRevoke(r) | Request::UpsertRevoke(r) => done(m.write_finish(&r, false).map(drop)),
            Request::BatchPutStart(r) => return self.batch_write_start(WriteMode::Put, r),
            Request::BatchUpsertStart(r) => return self.batch_write_start(WriteMode::Upsert, r),
            Request::BatchPutEnd(r) | Request::BatchUpsertEnd(r) => {
                Response::BatchCommitted(m.batch_write_finish(&r, true))
            }
            Request::BatchPutRevoke(r) | Request::BatchUpsertRevoke(r) => {
                Response::BatchDone(m.batch_write_finish(&r, false).into_iter().map(|x| x.map(drop)).collect())
            }
            Request::GetReplicaList(q) => m.get_replica_list(&q).map_or_else(Response::Error, Response::Replicas),
            Request::BatchGetReplicaList(q) => Response::BatchReplicas(m.batch_get_replica_list(&q)),
            Request::ExistKey(q) => m.exist_key(&q).map_or_else(Response::Error, Response::Exists),
            Request::BatchExistKey(q) => Response::BatchExists(m.batch_exist_key(&q)),
            Request::Remove(r) => done(m.remove(&r)),
            Request::BatchRemove(r) => Response::BatchDone(m.batch_remove(&r)),
            Request::RemoveByRegex { tenant, regex, force } => {
                return self.blocking(move |m| {
                    m.remove_by_regex(&tenant, &regex, force).map_or_else(Response::Error, Response::Removed)
                })
            }
            Request::RemoveAll { force } => return self.blocking(move |m| Response::Removed(m.remove_all(force))),
            Request::ListSegments => Response::Segments(m.list_segments()),
            Request::ListKeys { tenant, regex, limit } => {
                return self.blocking(move |m| {
                    m.list_keys(tenant.as_deref(), regex.as_deref(), limit).map_or_else(Response::Error, Response::Keys)
                })
            }
            Request::BatchReplicaClear(r) => Response::BatchDone(m.batch_replica_clear(&r)),
            Request::Stats => Response::Stats(m.stats()),
            Request::HealthCheck => match m.health_check_now() {
                Some(report) => Response::Health(report),
                // Some shard is write-locked: wait for it off the connection's task.
                None => {
                    let budget = self.health_budget;
                    return self.blocking(move |m| Response::Health(m.health_check(budget)));
                }
            },
        };
        Reply::Ready(resp)
    }
}
