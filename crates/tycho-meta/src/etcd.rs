//! `EtcdStore`: the [`MetaStore`] on a real etcd cluster (3.4 and newer), through `etcd-client`.
//!
//! Every call is bounded by [`EtcdOptions::request_timeout`] and checked against
//! [`Limits`] before it is sent. etcd's own errors are mapped to typed [`MetaError`]s by their
//! (stable) gRPC messages. Watches reconnect by themselves after a broken stream and resume at
//! the revision after the last event they delivered; lease renewals reuse one keep-alive stream
//! per lease and open a new one after a failure.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, CompactionOptions, Compare as EtcdCompare, CompareOp as EtcdCompareOp, ConnectOptions, GetOptions,
    KvClient, LeaseKeepAliveStream, LeaseKeeper as EtcdLeaseKeeper, LeaseTimeToLiveOptions, PutOptions, Txn as EtcdTxn,
    TxnOp as EtcdTxnOp, TxnOpResponse, WatchClient, WatchOptions, WatchStream,
};
use parking_lot::Mutex;

use crate::error::{MetaError, MetaResult};
use crate::kv::{
    key_after, prefix_end, DeleteResponse, GetResponse, KeyValue, LeaseId, RangePage, RangeRequest, Revision,
};
use crate::lease::{LeaseGrant, LeaseInfo};
use crate::limits::Limits;
use crate::store::{BoxFuture, MetaStore};
use crate::txn::{CompareOp, CompareTarget, Txn, TxnOp, TxnOpResult, TxnResponse};
use crate::watch::{Watch, WatchEvent, WatchRequest, WatchSender};

/// Largest response accepted from etcd (a range page of large values can exceed tonic's 4 MiB).
const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// A broken watch retries after this, doubling up to [`EtcdOptions::max_reconnect_backoff`].
const FIRST_RECONNECT_BACKOFF: Duration = Duration::from_millis(100);

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Time to open a connection.
    pub connect_timeout: Duration,
    /// Time for one call to complete; past it the call fails with [`MetaError::Unavailable`].
    pub request_timeout: Duration,
    /// Longest pause between attempts to re-open a broken watch.
    pub max_reconnect_backoff: Duration,
    /// The cluster's `--max-request-bytes` and `--max-txn-ops`.
    pub limits: Limits,
    /// TLS to etcd (the endpoints are then `https://`); `None`: plain HTTP.
    pub tls: Option<EtcdTls>,
    /// An etcd user and its password, for a cluster with authentication enabled.
    pub user: Option<(String, String)>,
}

/// How to speak TLS to etcd: the CA that signed its certificates, and this client's own
/// certificate and key when etcd asks for one (`--client-cert-auth`). PEM bytes.
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA certificate(s).
    pub ca_pem: Vec<u8>,
    /// This client's certificate and private key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls").field("client_certificate", &self.identity.is_some()).finish_non_exhaustive()
    }
}

impl EtcdOptions {
    /// Defaults for `endpoints`: 2 s to connect, 5 s per call, etcd's default limits.
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> EtcdOptions {
        EtcdOptions {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            max_reconnect_backoff: Duration::from_secs(2),
            limits: Limits::default(),
            tls: None,
            user: None,
        }
    }

    /// The options every connection to etcd is opened with: timeouts, keep-alives, TLS and
    /// the user.
    fn connect_options(&self) -> ConnectOptions {
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            // HTTP/2 pings notice a dead peer under an idle watch.
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5))
            .with_keep_alive_while_idle(true);
        if let Some(tls) = &self.tls {
            let mut config =
                etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(&tls.ca_pem));
            if let Some((cert, key)) = &tls.identity {
                config = config.identity(etcd_client::Identity::from_pem(cert, key));
            }
            connect = connect.with_tls(config);
        }
        if let Some((name, password)) = &self.user {
            // etcd forgets its tokens when it restarts, and expires them: log in again then.
            connect = connect.with_user(name.clone(), password.clone()).with_auto_token_refresh(true);
        }
        connect
    }
}

/// A [`MetaStore`] on etcd. Cloning shares the connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    kv: KvClient,
    options: Arc<EtcdOptions>,
    /// One open keep-alive stream per lease being renewed; taken out while in use.
    keep_alives: Arc<Mutex<HashMap<LeaseId, KeepAliveStream>>>,
}

/// An open keep-alive stream, and when it last renewed (streams nobody uses are closed).
struct KeepAliveStream {
    keeper: EtcdLeaseKeeper,
    stream: LeaseKeepAliveStream,
    last_used: Instant,
    ttl: Duration,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("endpoints", &self.options.endpoints).finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Connects to etcd. The connection is re-established by itself after a failure.
    pub async fn connect(options: EtcdOptions) -> MetaResult<EtcdStore> {
        let connect = options.connect_options();
        let client = tokio::time::timeout(options.request_timeout, Client::connect(&options.endpoints, Some(connect)))
            .await
            .map_err(|_| {
                MetaError::Unavailable(format!(
                    "no connection to {:?} within {:?}",
                    options.endpoints, options.request_timeout
                ))
            })?
            .map_err(map_error)?;
        let kv = client.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
        Ok(EtcdStore { client, kv, options: Arc::new(options), keep_alives: Arc::default() })
    }

    /// Runs one call with the request timeout and maps its error.
    async fn call<T>(&self, fut: impl Future<Output = Result<T, etcd_client::Error>>) -> MetaResult<T> {
        with_timeout(self.options.request_timeout, fut).await
    }

    fn watch_client(&self) -> WatchClient {
        self.client.watch_client().max_decoding_message_size(MAX_RESPONSE_BYTES)
    }

    /// The oldest revision etcd still has, learned from the compaction notice a watch from
    /// revision 1 receives. Only called after etcd reported a compaction, so the notice comes.
    async fn compact_revision(&self) -> Revision {
        let probe = async {
            let opts = WatchOptions::new().with_start_revision(1);
            let mut stream = self.watch_client().watch(vec![0], Some(opts)).await?;
            while let Some(resp) = stream.message().await? {
                if resp.compact_revision() > 0 {
                    return Ok(resp.compact_revision());
                }
                if !resp.events().is_empty() {
                    break;
                }
            }
            Ok::<_, etcd_client::Error>(0)
        };
        self.call(probe).await.unwrap_or(0)
    }

    /// Fills in the revisions of a `Compacted` error mapped from etcd's message.
    async fn with_compact_revision(&self, e: MetaError, requested: Revision) -> MetaError {
        match e {
            MetaError::Compacted { .. } => {
                MetaError::Compacted { requested, compact_revision: self.compact_revision().await }
            }
            MetaError::FutureRevision { current, .. } => MetaError::FutureRevision { requested, current },
            e => e,
        }
    }
}

/// One etcd member's defragmentation, as [`defragment_members`] ran it.
#[derive(Debug, Clone)]
pub struct MemberDefrag {
    /// The member's name.
    pub name: String,
    /// The client URL it was reached at.
    pub endpoint: String,
    /// Its database file's size before, in bytes.
    pub size_before: u64,
    /// The part of it in use before (what a defragmentation leaves, roughly), in bytes.
    pub in_use_before: u64,
    /// Its database file's size after, in bytes.
    pub size_after: u64,
    /// How long the defragmentation call took.
    pub took: Duration,
    /// The longest a read at this member waited while it ran: the stall its clients saw.
    pub longest_read: Duration,
}

/// Longest a defragmentation may take before it is reported as failed (a large database on a
/// slow disk takes minutes).
pub const DEFRAG_TIMEOUT: Duration = Duration::from_secs(300);

/// Defragments every member of the etcd cluster `options` reaches, one after the other with
/// `between` in between, so that only one member stalls at a time. A member stops serving
/// reads and writes while it defragments (it rewrites its database file); a reader polls the
/// member every 10 ms meanwhile, and the longest wait it saw is reported as the pause.
/// `report` is called after each member. Stops at the first member that fails.
pub async fn defragment_members(
    options: &EtcdOptions,
    between: Duration,
    mut report: impl FnMut(&MemberDefrag),
) -> MetaResult<Vec<MemberDefrag>> {
    let mut client =
        with_timeout(options.request_timeout, Client::connect(&options.endpoints, Some(options.connect_options())))
            .await?;
    let members = with_timeout(options.request_timeout, client.member_list()).await?;
    let mut done = Vec::new();
    for (i, member) in members.members().iter().enumerate() {
        // A member may advertise plain and TLS URLs: the one of the scheme the options speak.
        let scheme = if options.tls.is_some() { "https://" } else { "http://" };
        let Some(endpoint) = member.client_urls().iter().find(|u| u.starts_with(scheme)).cloned() else {
            return Err(MetaError::Other(format!(
                "etcd member {:?} advertises no {scheme} client URL ({:?})",
                member.name(),
                member.client_urls()
            )));
        };
        if i > 0 {
            tokio::time::sleep(between).await;
        }
        let mut one = with_timeout(
            options.request_timeout,
            Client::connect([endpoint.as_str()], Some(options.connect_options())),
        )
        .await?;
        let before = with_timeout(options.request_timeout, one.status()).await?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = tokio::spawn({
            let (mut kv, stop) = (one.kv_client(), stop.clone());
            async move {
                let mut longest = Duration::ZERO;
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    let started = Instant::now();
                    let _ = tokio::time::timeout(DEFRAG_TIMEOUT, kv.get("tycho-defrag-probe", None)).await;
                    longest = longest.max(started.elapsed());
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                longest
            }
        });
        let started = Instant::now();
        let defragmented = with_timeout(DEFRAG_TIMEOUT, one.defragment()).await;
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Release);
        let longest_read = reader.await.unwrap_or_default();
        defragmented?;
        let after = with_timeout(options.request_timeout, one.status()).await?;
        let d = MemberDefrag {
            name: member.name().to_owned(),
            endpoint,
            size_before: before.db_size().max(0) as u64,
            in_use_before: before.raft_used_db_size().max(0) as u64,
            size_after: after.db_size().max(0) as u64,
            took,
            longest_read,
        };
        report(&d);
        done.push(d);
    }
    Ok(done)
}

async fn with_timeout<T>(limit: Duration, fut: impl Future<Output = Result<T, etcd_client::Error>>) -> MetaResult<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(result) => result.map_err(map_error),
        Err(_) => Err(MetaError::Unavailable(format!("etcd did not answer within {limit:?}"))),
    }
}

/// Maps an etcd-client error to a typed one. etcd's error messages are part of its API
/// (`rpctypes`), stable from 3.4 on.
fn map_error(e: etcd_client::Error) -> MetaError {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(status) => {
            let msg = status.message();
            if msg.contains("required revision has been compacted") {
                MetaError::Compacted { requested: 0, compact_revision: 0 }
            } else if msg.contains("required revision is a future revision") {
                MetaError::FutureRevision { requested: 0, current: 0 }
            } else if msg.contains("requested lease not found") {
                MetaError::LeaseNotFound { lease: 0 }
            } else if msg.contains("request is too large") || status.code() as i32 == tonic_code::RESOURCE_EXHAUSTED {
                MetaError::RequestTooLarge { size: 0, limit: 0 }
            } else if msg.contains("too many operations in txn request") {
                MetaError::TooManyOps { what: "ops", ops: 0, limit: 0 }
            } else if msg.contains("duplicate key given in txn request") || msg.contains("key is not provided") {
                MetaError::InvalidArgument(msg.to_owned())
            } else if matches!(
                status.code() as i32,
                tonic_code::UNAVAILABLE | tonic_code::DEADLINE_EXCEEDED | tonic_code::CANCELLED | tonic_code::UNKNOWN
            ) {
                MetaError::Unavailable(format!("{:?}: {msg}", status.code()))
            } else {
                MetaError::Other(format!("{:?}: {msg}", status.code()))
            }
        }
        E::TransportError(e) => MetaError::Unavailable(e.to_string()),
        E::IoError(e) => MetaError::Unavailable(e.to_string()),
        E::WatchError(m) => MetaError::Unavailable(format!("watch: {m}")),
        E::LeaseKeepAliveError(m) if m.contains("lease not found") => MetaError::LeaseNotFound { lease: 0 },
        E::LeaseKeepAliveError(m) => MetaError::Unavailable(format!("keep-alive: {m}")),
        other => MetaError::Other(other.to_string()),
    }
}

/// gRPC status codes (stable numbers), so this module needs no direct tonic dependency.
mod tonic_code {
    pub const CANCELLED: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const UNAVAILABLE: i32 = 14;
}

/// Puts the lease id into a `LeaseNotFound` mapped from etcd's message.
fn for_lease(e: MetaError, lease: LeaseId) -> MetaError {
    match e {
        MetaError::LeaseNotFound { .. } => MetaError::LeaseNotFound { lease },
        e => e,
    }
}

/// Puts the limits into errors mapped from etcd's refusals (which happen only if the
/// configured limits are larger than the cluster's).
fn with_limits(e: MetaError, limits: Limits) -> MetaError {
    match e {
        MetaError::RequestTooLarge { size, .. } => MetaError::RequestTooLarge { size, limit: limits.max_request_bytes },
        MetaError::TooManyOps { what, ops, .. } => MetaError::TooManyOps { what, ops, limit: limits.max_txn_ops },
        e => e,
    }
}

fn from_etcd(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: kv.key().to_vec(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: (kv.lease() != 0).then_some(kv.lease()),
    }
}

fn header_revision(h: Option<&etcd_client::ResponseHeader>) -> Revision {
    h.map_or(0, |h| h.revision())
}

fn put_options(lease: Option<LeaseId>) -> Option<PutOptions> {
    lease.filter(|l| *l != 0).map(|l| PutOptions::new().with_lease(l))
}

fn seconds(s: i64) -> Duration {
    Duration::from_secs(s.max(0) as u64)
}

fn to_etcd_txn(txn: &Txn) -> EtcdTxn {
    let compares: Vec<EtcdCompare> = txn
        .compares
        .iter()
        .map(|c| {
            let op = match c.op {
                CompareOp::Equal => EtcdCompareOp::Equal,
                CompareOp::NotEqual => EtcdCompareOp::NotEqual,
                CompareOp::Greater => EtcdCompareOp::Greater,
                CompareOp::Less => EtcdCompareOp::Less,
            };
            let key = c.key.clone();
            match &c.target {
                CompareTarget::Value(v) => EtcdCompare::value(key, op, v.clone()),
                CompareTarget::Version(v) => EtcdCompare::version(key, op, *v),
                CompareTarget::CreateRevision(r) => EtcdCompare::create_revision(key, op, *r),
                CompareTarget::ModRevision(r) => EtcdCompare::mod_revision(key, op, *r),
            }
        })
        .collect();
    let ops = |ops: &[TxnOp]| -> Vec<EtcdTxnOp> {
        ops.iter()
            .map(|op| match op {
                TxnOp::Put { key, value, lease } => EtcdTxnOp::put(key.clone(), value.clone(), put_options(*lease)),
                TxnOp::Delete { key } => EtcdTxnOp::delete(key.clone(), None),
                TxnOp::Get { key } => EtcdTxnOp::get(key.clone(), None),
            })
            .collect()
    };
    EtcdTxn::new().when(compares).and_then(ops(&txn.success)).or_else(ops(&txn.failure))
}

impl MetaStore for EtcdStore {
    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<GetResponse>> {
        Box::pin(async move {
            self.options.limits.check_key(key)?;
            let mut kv = self.kv.clone();
            let resp = self.call(kv.get(key, None)).await?;
            Ok(GetResponse { kv: resp.kvs().first().map(from_etcd), revision: header_revision(resp.header()) })
        })
    }

    fn range(&self, req: RangeRequest) -> BoxFuture<'_, MetaResult<RangePage>> {
        Box::pin(async move {
            self.options.limits.check_range(&req)?;
            let mut opts = GetOptions::new().with_range(req.end_key()).with_limit(req.limit as i64);
            if let Some(rev) = req.revision {
                opts = opts.with_revision(rev);
            }
            if req.keys_only {
                opts = opts.with_keys_only();
            }
            let mut kv = self.kv.clone();
            let resp = match self.call(kv.get(req.start_key(), Some(opts))).await {
                Ok(resp) => resp,
                Err(e) => return Err(self.with_compact_revision(e, req.revision.unwrap_or(0)).await),
            };
            let kvs: Vec<KeyValue> = resp.kvs().iter().map(from_etcd).collect();
            let next = if resp.more() { kvs.last().map(|kv| key_after(&kv.key)) } else { None };
            Ok(RangePage { kvs, revision: req.revision.unwrap_or(header_revision(resp.header())), next })
        })
    }

    fn put<'a>(
        &'a self,
        key: &'a [u8],
        value: &'a [u8],
        lease: Option<LeaseId>,
    ) -> BoxFuture<'a, MetaResult<Revision>> {
        Box::pin(async move {
            self.options.limits.check_put(key, value)?;
            let mut kv = self.kv.clone();
            let resp = self.call(kv.put(key, value, put_options(lease))).await.map_err(|e| {
                let e = with_limits(e, self.options.limits);
                for_lease(e, lease.unwrap_or(0))
            })?;
            Ok(header_revision(resp.header()))
        })
    }

    fn delete<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, MetaResult<DeleteResponse>> {
        Box::pin(async move {
            self.options.limits.check_key(key)?;
            let mut kv = self.kv.clone();
            let resp = self.call(kv.delete(key, None)).await?;
            Ok(DeleteResponse { deleted: resp.deleted() > 0, revision: header_revision(resp.header()) })
        })
    }

    fn txn(&self, txn: Txn) -> BoxFuture<'_, MetaResult<TxnResponse>> {
        Box::pin(async move {
            self.options.limits.check_txn(&txn)?;
            let mut kv = self.kv.clone();
            let resp = self.call(kv.txn(to_etcd_txn(&txn))).await.map_err(|e| with_limits(e, self.options.limits))?;
            let results = resp
                .op_responses()
                .into_iter()
                .map(|r| match r {
                    TxnOpResponse::Put(_) => TxnOpResult::Put,
                    TxnOpResponse::Delete(d) => TxnOpResult::Delete { deleted: d.deleted() > 0 },
                    TxnOpResponse::Get(g) => TxnOpResult::Get(g.kvs().first().map(from_etcd)),
                    // Nested transactions are never sent.
                    TxnOpResponse::Txn(_) => TxnOpResult::Put,
                })
                .collect();
            Ok(TxnResponse { succeeded: resp.succeeded(), revision: header_revision(resp.header()), results })
        })
    }

    fn compact(&self, revision: Revision) -> BoxFuture<'_, MetaResult<()>> {
        Box::pin(async move {
            let mut kv = self.kv.clone();
            // Physical: return only once the history is really gone, so that what follows
            // observes the compaction.
            match self.call(kv.compact(revision, Some(CompactionOptions::new().with_physical()))).await {
                Ok(_) => Ok(()),
                Err(e) => Err(self.with_compact_revision(e, revision).await),
            }
        })
    }

    fn watch(&self, req: WatchRequest) -> BoxFuture<'_, MetaResult<Watch>> {
        Box::pin(async move {
            let filter = WatchFilter::new(&req);
            let (stream, created_at) =
                with_timeout(self.options.request_timeout, filter.open(self.watch_client(), req.start_revision))
                    .await?;
            let next = if req.start_revision > 0 { req.start_revision } else { created_at + 1 };
            let (tx, watch) = Watch::channel();
            tokio::spawn(run_watch(self.clone(), filter, stream, next, tx));
            Ok(watch)
        })
    }

    fn lease_grant(&self, ttl: Duration) -> BoxFuture<'_, MetaResult<LeaseGrant>> {
        Box::pin(async move {
            let secs = (ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(1) as i64;
            let mut lease = self.client.lease_client();
            let resp = self.call(lease.grant(secs, None)).await?;
            if !resp.error().is_empty() {
                return Err(MetaError::Other(format!("lease grant: {}", resp.error())));
            }
            Ok(LeaseGrant { id: resp.id(), ttl: seconds(resp.ttl()) })
        })
    }

    fn lease_keep_alive_once(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Duration>> {
        Box::pin(async move {
            let cached = {
                let mut streams = self.keep_alives.lock();
                // A keeper renews every TTL/3; a stream idle for two TTLs has no keeper left.
                streams.retain(|_, s| s.last_used.elapsed() < s.ttl * 2);
                streams.remove(&lease)
            };
            let renew = async {
                let (mut keeper, mut stream) = match cached {
                    Some(open) => (open.keeper, open.stream),
                    // Opening the stream renews once, but does not return the TTL: the
                    // renewal below is the one whose answer counts.
                    None => self.client.lease_client().keep_alive(lease).await?,
                };
                keeper.keep_alive().await?;
                let resp = stream
                    .message()
                    .await?
                    .ok_or_else(|| etcd_client::Error::LeaseKeepAliveError("keep-alive stream closed".into()))?;
                Ok((keeper, stream, resp.ttl()))
            };
            let (keeper, stream, ttl) = self.call(renew).await.map_err(|e| for_lease(e, lease))?;
            if ttl <= 0 {
                return Err(MetaError::LeaseNotFound { lease });
            }
            let ttl = seconds(ttl);
            self.keep_alives.lock().insert(lease, KeepAliveStream { keeper, stream, last_used: Instant::now(), ttl });
            Ok(ttl)
        })
    }

    fn lease_revoke(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<()>> {
        Box::pin(async move {
            self.keep_alives.lock().remove(&lease);
            let mut client = self.client.lease_client();
            self.call(client.revoke(lease)).await.map_err(|e| for_lease(e, lease))?;
            Ok(())
        })
    }

    fn lease_time_to_live(&self, lease: LeaseId) -> BoxFuture<'_, MetaResult<Option<LeaseInfo>>> {
        Box::pin(async move {
            let mut client = self.client.lease_client();
            let resp = self.call(client.time_to_live(lease, Some(LeaseTimeToLiveOptions::new().with_keys()))).await;
            let resp = match resp {
                Ok(resp) => resp,
                Err(MetaError::LeaseNotFound { .. }) => return Ok(None),
                Err(e) => return Err(e),
            };
            if resp.ttl() < 0 {
                return Ok(None);
            }
            Ok(Some(LeaseInfo {
                id: lease,
                granted_ttl: seconds(resp.granted_ttl()),
                remaining: seconds(resp.ttl()),
                keys: resp.keys().to_vec(),
            }))
        })
    }

    fn limits(&self) -> Limits {
        self.options.limits
    }
}

/// The key range of a watch, in etcd's form.
struct WatchFilter {
    key: Vec<u8>,
    /// `None`: the single key.
    end: Option<Vec<u8>>,
}

impl WatchFilter {
    fn new(req: &WatchRequest) -> WatchFilter {
        match (req.prefix, req.key.is_empty()) {
            (false, _) => WatchFilter { key: req.key.clone(), end: None },
            // etcd reads key "\0" with range end "\0" as every key.
            (true, true) => WatchFilter { key: vec![0], end: Some(vec![0]) },
            (true, false) => WatchFilter { key: req.key.clone(), end: Some(prefix_end(&req.key)) },
        }
    }

    /// Opens a watch stream from `start` (0: now) and waits for etcd to confirm it; returns the
    /// stream and the revision at creation.
    async fn open(
        &self,
        mut client: WatchClient,
        start: Revision,
    ) -> Result<(WatchStream, Revision), etcd_client::Error> {
        let mut opts = WatchOptions::new().with_start_revision(start);
        if let Some(end) = &self.end {
            opts = opts.with_range(end.clone());
        }
        let mut stream = client.watch(self.key.clone(), Some(opts)).await?;
        match stream.message().await? {
            Some(resp) if resp.created() && !resp.canceled() => Ok((stream, header_revision(resp.header()))),
            Some(resp) => Err(etcd_client::Error::WatchError(format!("watch not created: {}", resp.cancel_reason()))),
            None => Err(etcd_client::Error::WatchError("stream closed before the watch was created".into())),
        }
    }
}

/// Feeds one watch: forwards events, and after a broken stream reports `Disconnected`, re-opens
/// the watch at the revision after the last delivered event (backing off between attempts)
/// and reports `Resumed`. Ends on compaction or when the caller drops the watch.
async fn run_watch(
    store: EtcdStore,
    filter: WatchFilter,
    mut stream: WatchStream,
    mut next: Revision,
    tx: WatchSender,
) {
    loop {
        let error = loop {
            let msg = tokio::select! {
                _ = tx.closed() => return,
                msg = stream.message() => msg,
            };
            let resp = match msg {
                Ok(Some(resp)) => resp,
                Ok(None) => break MetaError::Unavailable("watch stream ended".into()),
                Err(e) => break map_error(e),
            };
            if resp.compact_revision() > 0 {
                let compacted = MetaError::Compacted { requested: next, compact_revision: resp.compact_revision() };
                let _ = tx.send(Err(compacted)).await;
                return;
            }
            if resp.canceled() {
                break MetaError::Unavailable(format!("watch canceled by etcd: {}", resp.cancel_reason()));
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let kv = from_etcd(kv);
                // etcd never splits one revision across responses (without fragmenting, which
                // is not requested), so after a response every event below `next` is delivered.
                next = next.max(kv.mod_revision + 1);
                let event = match ev.event_type() {
                    etcd_client::EventType::Put => WatchEvent::Put(kv),
                    etcd_client::EventType::Delete => WatchEvent::Delete(kv),
                };
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        };
        tracing::warn!(%error, resume_from = next, "etcd watch broke; reconnecting");
        if tx.send(Ok(WatchEvent::Disconnected { resume_from: next, error })).await.is_err() {
            return;
        }
        let mut backoff = FIRST_RECONNECT_BACKOFF;
        stream = loop {
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            let opened = with_timeout(store.options.request_timeout, filter.open(store.watch_client(), next)).await;
            match opened {
                Ok((stream, _)) => break stream,
                Err(e) => tracing::debug!(error = %e, "watch reconnect failed"),
            }
            // Streams do not log in again by themselves (unary calls do): a restarted etcd has
            // forgotten the login, and a watcher may make no other call to renew it.
            if store.options.user.is_some() {
                let refreshed = with_timeout(store.options.request_timeout, store.client.refresh_token()).await;
                if let Err(e) = refreshed {
                    tracing::debug!(error = %e, "could not log in to etcd again");
                }
            }
            backoff = (backoff * 2).min(store.options.max_reconnect_backoff);
        };
        if tx.send(Ok(WatchEvent::Resumed { resume_from: next })).await.is_err() {
            return;
        }
    }
}
