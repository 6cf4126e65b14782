//! The master behind the RPC server: maps each [`Request`] to the service call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tycho_proto::auth::handshake::Peer;
use tycho_proto::frame::FrameError;
use tycho_proto::{ErrorCode, Request, Response, SegmentId, WireResult};
use tycho_rpc::{Reply, Service};

use crate::state::master::{Master, WriteMode};

use crate::serve::health::HEALTH_CHECK_BUDGET;
use crate::serve::metrics::RpcMetrics;

/// Adapts a [`Master`] to [`tycho_rpc::Service`], recording per-RPC metrics.
pub struct MasterRpc {
    master: Arc<Master>,
    metrics: Arc<RpcMetrics>,
    health_budget: Duration,
    /// Key scans (listings, removal by pattern or all) running now.
    scans: Arc<AtomicUsize>,
    /// Connections to the other masters of the cluster, for reads forwarded to a group's
    /// primary (made on first use; as the admin of the shared secret when there is one).
    forward: Arc<std::sync::OnceLock<tycho_rpc::RpcPool>>,
}

/// How long a master waits for the primary it forwarded a read to.
const FORWARD_DEADLINE: Duration = Duration::from_secs(2);

/// Most key scans run at once; more are answered SCANS_BUSY. Each walks every shard on a
/// blocking thread: two keep a third thread free for the rest of the master's blocking work.
pub const MAX_CONCURRENT_SCANS: usize = 2;

impl MasterRpc {
    /// Serves `master`, recording into `metrics`.
    pub fn new(master: Arc<Master>, metrics: Arc<RpcMetrics>) -> MasterRpc {
        MasterRpc {
            master,
            metrics,
            health_budget: HEALTH_CHECK_BUDGET,
            scans: Arc::new(AtomicUsize::new(0)),
            forward: Arc::default(),
        }
    }

    /// Runs a key scan on a blocking thread, unless [`MAX_CONCURRENT_SCANS`] already run.
    fn scan<F>(&self, f: F) -> Reply<Response>
    where
        F: FnOnce(&Master) -> Response + Send + 'static,
    {
        if self.scans.fetch_add(1, Ordering::AcqRel) >= MAX_CONCURRENT_SCANS {
            self.scans.fetch_sub(1, Ordering::AcqRel);
            return Reply::Ready(Response::Error(ErrorCode::SCANS_BUSY));
        }
        let scans = self.scans.clone();
        self.blocking(move |m| {
            struct Done(Arc<AtomicUsize>);
            impl Drop for Done {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::AcqRel);
                }
            }
            let _done = Done(scans);
            f(m)
        })
    }
}

/// Whether two tenant names are equal. The default tenant is the empty string, whose buffer
/// pointer is dangling: glibc's AVX-512 `memcmp` then takes a masked load from an unmapped
/// address, a microcode assist that cost about 75 ns per call here (a tenth of a small RPC's
/// time on the master). Empty names never reach `memcmp`.
fn same_tenant(a: &str, b: &str) -> bool {
    a.len() == b.len() && (a.is_empty() || a == b)
}

/// `resp` once the records in `logged` are durable; a log's error instead if one never will be.
async fn when_durable(m: &Master, logged: crate::state::master::Logged, resp: Response) -> Response {
    match m.durable(logged) {
        None => resp,
        Some(wait) => match wait.await {
            Ok(()) => resp,
            Err(code) => Response::Error(code),
        },
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
            let m = master.clone();
            let run = move || {
                Master::take_logged();
                let resp = f(&m);
                (resp, Master::take_logged())
            };
            match tokio::task::spawn_blocking(run).await {
                Ok((resp, logged)) => when_durable(&master, logged, resp).await,
                Err(_) => Response::Error(ErrorCode::INTERNAL_ERROR),
            }
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

    fn call(&self, req: Request, peer: &Peer) -> Reply<Response> {
        // Tests stall RPC workers here to reproduce worker-pool exhaustion (spec 02).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("master::rpc::stall");
        let index = req.index();
        let start = Instant::now();
        // A mutation is answered only once its records are durable: what this thread logs
        // while it runs the request inline is waited for below (`blocking` does the same on
        // its thread).
        Master::take_logged();
        // A key's request at a master that does not serve its group but knows who does.
        if let Some(reply) = self.elsewhere(&req) {
            let reply = match self.authorize(&req, peer) {
                Ok(_) => reply,
                Err(code) => Reply::Ready(Response::Error(code)),
            };
            return self.recorded(index, start, reply);
        }
        // A master that serves no group (a standby) answers only probes.
        // (and who serves each group, so that a client asking it finds the primaries).
        if !self.master.is_serving()
            && !matches!(req, Request::ServiceReady | Request::HealthCheck | Request::Routes | Request::SnapshotFile(_))
        {
            // (Told to wait when the key's group is about to be served here.)
            let groups = self.master.config().group_count.max(1);
            let code = match req.partitions().first() {
                Some(&p) => self.master.refusal(tycho_routing::kvpt_to_rank(p, groups)),
                None => ErrorCode::KVPT_NOT_OWNED,
            };
            let resp = Response::Error(code);
            self.metrics.record(index, start.elapsed(), &resp);
            return Reply::Ready(resp);
        }
        // A batch at a master that does not serve every group: the keys it refuses for their
        // group come back with their groups' owners (see [`name_owners`]).
        let partitions = (req.batch_len() > 0 && !self.master.serves_every_group()).then(|| req.partitions());
        // A mutation is admitted only while the log can take its records (busy otherwise):
        // once decided and applied, a record must be logged.
        let checked = self.authorize(&req, peer).and_then(|r| {
            if req.mutates() {
                self.master.admit_request(&req)?;
            }
            Ok(r)
        });
        let reply = match checked {
            Ok(Authorized::AsIs) => self.dispatch(req),
            Ok(Authorized::Narrowed(narrowed)) => self.dispatch(narrowed),
            Ok(Authorized::AdminUnmount(segment)) => self.blocking(move |m| done(m.admin_unmount(segment))),
            Err(code) => Reply::Ready(Response::Error(code)),
        };
        // (A request that went on to a blocking thread may have logged records here first: a
        // batch start's first attempt. Its answer waits for those too.)
        let reply = match self.master.durable(Master::take_logged()) {
            None => reply,
            Some(wait) => Reply::Later(Box::pin(async move {
                let resp = match reply {
                    Reply::Ready(resp) => resp,
                    Reply::Later(later) => later.await,
                };
                match wait.await {
                    Ok(()) => resp,
                    Err(code) => Response::Error(code),
                }
            })),
        };
        let reply = match partitions {
            None => reply,
            Some(partitions) => {
                let master = self.master.clone();
                match reply {
                    Reply::Ready(resp) => Reply::Ready(name_owners(&master, &partitions, resp)),
                    Reply::Later(later) => {
                        Reply::Later(Box::pin(async move { name_owners(&master, &partitions, later.await) }))
                    }
                }
            }
        };
        self.recorded(index, start, reply)
    }

    fn malformed(&self, _err: &FrameError) -> Response {
        Response::Error(ErrorCode::INVALID_PARAMS)
    }
}

impl MasterRpc {
    /// `reply`, its figures recorded when it is ready.
    fn recorded(&self, index: usize, start: Instant, reply: Reply<Response>) -> Reply<Response> {
        match reply {
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

    /// The answer to a one-key request for a group this master does not serve, when its route
    /// table names the group's primary: a read sent under an older epoch than the table's (a
    /// badly stale route) is forwarded to that primary, under the table's epoch, and its answer
    /// relayed; anything else (a write, whatever its route) is refused with the owner named, so
    /// that the client goes there itself. `None`: serve (or refuse) the request here.
    ///
    /// Forwarding cannot loop: each hop carries a strictly higher epoch than the one before.
    fn elsewhere(&self, req: &Request) -> Option<Reply<Response>> {
        // (The common case first, without looking at the request.)
        if self.master.serves_every_group() || req.batch_len() > 0 {
            return None;
        }
        let partitions = req.partitions();
        let [partition] = partitions[..] else { return None };
        let groups = self.master.config().group_count.max(1);
        let rank = tycho_routing::kvpt_to_rank(partition, groups);
        if self.master.group(rank).is_some_and(|g| g.is_serving()) {
            return None;
        }
        // About to be served here: the client waits rather than goes elsewhere.
        if self.master.group(rank).is_some_and(|g| g.is_installing()) {
            return Some(Reply::Ready(Response::Error(ErrorCode::KVPT_MIGRATING)));
        }
        let table = self.master.route_table();
        // A table that still names this master is behind (it was deposed): no owner to name.
        let owner = table.owners.get(rank as usize).filter(|o| !o.is_empty() && !self.master.is_me(o))?.clone();
        let epoch = table.epochs.get(rank as usize).copied().unwrap_or(0);
        let redirect = Response::NotOwned(tycho_proto::Redirect { group: rank, epoch, owner: owner.clone() });
        let mut forwarded = match req {
            Request::GetReplicaList(_) | Request::ExistKey(_) => req.clone(),
            _ => return Some(Reply::Ready(redirect)),
        };
        let mut stale = false;
        for r in forwarded.routes_mut() {
            stale |= r.epoch < epoch;
            r.epoch = epoch;
        }
        if !stale {
            return Some(Reply::Ready(redirect));
        }
        let pool = self.forward.clone();
        let secret = self.master.secret().cloned();
        Some(Reply::Later(Box::pin(async move {
            let pool = pool.get_or_init(|| {
                use tycho_proto::auth::handshake::{admin_credential, Identity};
                use tycho_proto::auth::ClientAuth;
                let (auth, identity) = match secret {
                    Some(s) => {
                        let identity = Identity::Admin { credential: admin_credential(&s) };
                        (ClientAuth::Secret(s), Some(identity))
                    }
                    None => (ClientAuth::Insecure, None),
                };
                tycho_rpc::RpcPool::new(tycho_rpc::ClientConfig { auth, identity, ..Default::default() })
            });
            // Connecting and calling both within the deadline; past it, the client is told
            // where to go instead.
            let call = async {
                let conn = pool.get(&owner).await.map_err(|e| e.to_string())?;
                conn.call::<Request, Response>(&forwarded, FORWARD_DEADLINE).await.map_err(|e| e.to_string())
            };
            let answer = tokio::time::timeout(FORWARD_DEADLINE, call)
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {FORWARD_DEADLINE:?}")));
            match answer {
                Ok(resp) => resp,
                Err(e) => {
                    tracing::debug!(%owner, error = %e, "could not forward a read to its group's primary");
                    pool.evict(&owner);
                    redirect
                }
            }
        })))
    }
}

/// `resp`, a batch's answer, with the owners of the groups whose keys it refused as not
/// served here (KVPT_NOT_OWNED), as far as this master's route table names them; unchanged
/// when it refused none, or knows no owner.
fn name_owners(m: &Master, partitions: &[u16], resp: Response) -> Response {
    let Some(errors) = resp.batch_errors() else { return resp };
    if !errors.contains(&Some(ErrorCode::KVPT_NOT_OWNED)) {
        return resp;
    }
    let groups = m.config().group_count.max(1);
    let table = m.route_table();
    let mut owners: Vec<tycho_proto::Redirect> = Vec::new();
    for (e, &p) in errors.iter().zip(partitions) {
        let rank = tycho_routing::kvpt_to_rank(p, groups);
        if *e != Some(ErrorCode::KVPT_NOT_OWNED) || owners.iter().any(|r| r.group == rank) {
            continue;
        }
        if let Some(owner) = table.owners.get(rank as usize).filter(|o| !o.is_empty() && !m.is_me(o)) {
            let epoch = table.epochs.get(rank as usize).copied().unwrap_or(0);
            owners.push(tycho_proto::Redirect { group: rank, epoch, owner: owner.clone() });
        }
    }
    if owners.is_empty() {
        return resp;
    }
    Response::Redirected { answer: Box::new(resp), owners }
}

/// What [`MasterRpc::authorize`] lets a request do.
enum Authorized {
    /// Serve it as it is.
    AsIs,
    /// Serve this instead: the request narrowed to the caller's tenant.
    Narrowed(Request),
    /// The admin unmounts a segment, whoever holds it; its owner is told to remount.
    AdminUnmount(SegmentId),
}

/// Batches of more keys than this run on a blocking thread, so that RPC workers stay free for
/// heartbeats and small calls.
pub const BATCH_INLINE_KEYS: usize = 1024;

/// A batch request answered on a blocking thread (writes may wait there for one eviction
/// round, as the inline path's retry does).
fn batch_off_worker(m: &Master, req: Request) -> Response {
    match req {
        Request::BatchPutStart(r) => Response::BatchWriteStarted(m.batch_write_start(WriteMode::Put, &r)),
        Request::BatchUpsertStart(r) => Response::BatchWriteStarted(m.batch_write_start(WriteMode::Upsert, &r)),
        Request::BatchPutEnd(r) | Request::BatchUpsertEnd(r) => {
            Response::BatchCommitted(m.batch_write_finish(&r, true))
        }
        Request::BatchPutRevoke(r) | Request::BatchUpsertRevoke(r) => {
            Response::BatchDone(m.batch_write_finish(&r, false).into_iter().map(|x| x.map(drop)).collect())
        }
        Request::BatchGetReplicaList(q) => Response::BatchReplicas(m.batch_get_replica_list(&q)),
        Request::BatchExistKey(q) => Response::BatchExists(m.batch_exist_key(&q)),
        Request::BatchRemove(r) => Response::BatchDone(m.batch_remove(&r)),
        Request::BatchReplicaClear(r) => Response::BatchDone(m.batch_replica_clear(&r)),
        _ => Response::Error(ErrorCode::INTERNAL_ERROR),
    }
}

impl MasterRpc {
    /// Who may do what, when the master has a secret (see docs/security.md): a request that
    /// names a client must come from a connection that proved that client's credential; one
    /// that names a tenant, from a client of that tenant; listings without a tenant and RemoveAll
    /// are narrowed to the caller's tenant. The admin credential may do anything, and its
    /// UnmountSegment takes any client's segment. Borrowing keeps the common case free of
    /// copies of the request.
    fn authorize(&self, req: &Request, peer: &Peer) -> Result<Authorized, ErrorCode> {
        if self.master.secret().is_none() {
            return Ok(Authorized::AsIs);
        }
        if peer.admin {
            return Ok(match req {
                Request::UnmountSegment { segment, .. } => Authorized::AdminUnmount(*segment),
                _ => Authorized::AsIs,
            });
        }
        // Snapshots hold every tenant's keys: the cluster's masters fetch them as its admin.
        if matches!(req, Request::SnapshotFile(_)) {
            return Err(ErrorCode::PERMISSION_DENIED);
        }
        let own = peer.client.as_ref();
        if let Some(c) = req.client() {
            if own.is_none_or(|(id, _)| *id != c.0) {
                return Err(ErrorCode::ILLEGAL_CLIENT);
            }
        }
        if let Some(t) = req.tenant() {
            if own.is_none_or(|(_, tenant)| !same_tenant(tenant, t)) {
                return Err(ErrorCode::PERMISSION_DENIED);
            }
        }
        Ok(match req {
            Request::ListKeys { tenant: None, regex, limit } => {
                let (_, tenant) = own.ok_or(ErrorCode::PERMISSION_DENIED)?;
                Authorized::Narrowed(Request::ListKeys {
                    tenant: Some(tenant.clone()),
                    regex: regex.clone(),
                    limit: *limit,
                })
            }
            // RemoveAll of a tenant's client: every object of its tenant.
            Request::RemoveAll { force } => {
                let (_, tenant) = own.ok_or(ErrorCode::PERMISSION_DENIED)?;
                Authorized::Narrowed(Request::RemoveByRegex {
                    tenant: tenant.clone(),
                    regex: "(?s).*".into(),
                    force: *force,
                })
            }
            _ => Authorized::AsIs,
        })
    }

    fn dispatch(&self, req: Request) -> Reply<Response> {
        let m = &*self.master;
        match req.batch_len() {
            n if n > tycho_proto::MAX_BATCH_KEYS => return Reply::Ready(Response::Error(ErrorCode::BATCH_TOO_LARGE)),
            n if n > BATCH_INLINE_KEYS => return self.blocking(move |m| batch_off_worker(m, req)),
            _ => {}
        }
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
            Request::MountSlices { client, segments } => {
                return self.blocking(move |m| match m.mount_slices(client, segments) {
                    Ok(Ok(mounted)) => Response::Slices { mounted, stale: Vec::new() },
                    Ok(Err(stale)) => Response::Slices { mounted: Vec::new(), stale },
                    Err(code) => Response::Error(code),
                })
            }
            Request::UnmountSegment { client, segment } => {
                return self.blocking(move |m| done(m.unmount_segment(client, segment)))
            }
            Request::StableSegment { client, segment, name, medium } => {
                match (m.stable_descriptor(client, segment, &name, medium), m.segment_directory()) {
                    (Err(code), _) => Response::Error(code),
                    (Ok(_), None) => Response::Done,
                    (Ok(desc), Some(dir)) => {
                        let stored = dir.store(desc);
                        return Reply::Later(Box::pin(async move {
                            stored.await.map_or_else(Response::Error, |()| Response::Done)
                        }));
                    }
                }
            }
            Request::Routes => Response::Routes(m.route_table()),
            Request::Register { tenant } => match m.register(&tenant) {
                Ok((client, credential)) => Response::Registered { client, credential },
                Err(code) => Response::Error(code),
            },
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
                return self.scan(move |m| {
                    m.remove_by_regex(&tenant, &regex, force).map_or_else(Response::Error, Response::Removed)
                })
            }
            Request::RemoveAll { force } => return self.scan(move |m| Response::Removed(m.remove_all(force))),
            Request::ListSegments => Response::Segments(m.list_segments()),
            Request::ListKeys { tenant, regex, limit } => {
                return self.scan(move |m| {
                    m.list_keys(tenant.as_deref(), regex.as_deref(), limit).map_or_else(Response::Error, Response::Keys)
                })
            }
            Request::BatchReplicaClear(r) => Response::BatchDone(m.batch_replica_clear(&r)),
            Request::CreateTask(r) => m.create_task(&r).map_or_else(Response::Error, Response::TaskCreated),
            Request::QueryTask(q) => m.query_task(&q).map_or_else(Response::Error, Response::Task),
            Request::FetchTasks { client } => Response::Tasks(m.fetch_tasks(client)),
            Request::CopyStart(s) => m.copy_start(&s).map_or_else(Response::Error, Response::CopyStarted),
            Request::CopyEnd(s) => done(m.copy_finish(&s, true)),
            Request::CopyRevoke(s) => done(m.copy_finish(&s, false)),
            Request::Stats => Response::Stats(m.stats()),
            Request::SnapshotFile(q) => return self.blocking(move |m| Response::SnapshotFile(m.snapshot_file(&q))),
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

#[cfg(test)]
mod tests {
    use super::same_tenant;

    #[test]
    fn tenant_names_compare_by_content() {
        assert!(same_tenant("", ""));
        // The default tenant as it arrives: an empty, never-allocated String.
        let decoded = String::new();
        assert!(same_tenant("", decoded.as_str()));
        assert!(same_tenant("tenant-a", "tenant-a"));
        assert!(!same_tenant("", "tenant-a"));
        assert!(!same_tenant("tenant-a", ""));
        assert!(!same_tenant("tenant-a", "tenant-b"));
        assert!(!same_tenant("tenant-a", "tenant-ab"));
    }

    /// Issue 47: a deposed master whose route table still names itself for a group refuses
    /// that group's keys without naming an owner (the client refreshes its routes), never
    /// sending the client back to itself.
    #[test]
    fn a_refusal_never_names_the_refusing_master_as_owner() {
        use std::sync::Arc;

        use tycho_proto::{ErrorCode, Response, RouteTable};

        use super::name_owners;
        use crate::state::clock::ManualClock;
        use crate::{Master, MasterConfig};

        let m = Master::new(MasterConfig { group_count: 2, ..Default::default() }, Arc::new(ManualClock::new(1_000)));
        m.advertise("10.0.0.1:50051");
        let p = (0..u16::MAX).find(|&p| tycho_routing::kvpt_to_rank(p, 2) == 1).unwrap();
        let refused = || Response::BatchExists(vec![Err(ErrorCode::KVPT_NOT_OWNED)]);
        let table = |owner: &str| RouteTable {
            groups: 2,
            epochs: vec![1, 3],
            owners: vec!["10.0.0.1:50051".into(), owner.into()],
            lease_ttl_ms: 0,
        };
        m.publish_routes(table("10.0.0.1:50051"));
        assert_eq!(name_owners(&m, &[p], refused()), refused(), "a stale table names this master: no owner");
        m.publish_routes(RouteTable { epochs: vec![1, 4], ..table("10.0.0.2:50051") });
        match name_owners(&m, &[p], refused()) {
            Response::Redirected { owners, .. } => {
                assert_eq!((owners[0].group, owners[0].epoch, owners[0].owner.as_str()), (1, 4, "10.0.0.2:50051"))
            }
            other => panic!("{other:?}"),
        }
    }
}
