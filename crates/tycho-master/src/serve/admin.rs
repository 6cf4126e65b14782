//! The admin HTTP server and the self-probe (spec 02).
//!
//! It runs on its own thread and runtime, apart from the RPC workers, so it answers even when
//! every RPC worker is stuck; that is the point of `/readyz`. The self-probe calls HealthCheck
//! through the real RPC path (TCP connect, accept, dispatch, handler) on the RPC server's own
//! address, every interval, and caches the verdict in atomics that `/readyz` reads.
//!
//! | path | answers |
//! |---|---|
//! | `/livez`, `/health` | 200 while the process lives |
//! | `/readyz` | 200 when serving and the last probe succeeded, else 503 |
//! | `/metrics` | Prometheus text |
//! | `/get_all_segments`, `/get_all_keys`, `/query_key?key=`, `/kvpt_groups`, `/masters`, `/reshard` | JSON; with a cluster secret, only to a request that sends the admin token derived from it (`Authorization: Bearer <token>`, `tycho admin-token`) |

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::get;
use axum::Router;
use tokio::sync::watch;
use tycho_proto::auth::{same_mac, Secret};
use tycho_proto::{Request, Response};
use tycho_rpc::{ClientConfig, RpcClient};

use crate::serve::metrics::RpcMetrics;
use crate::serve::metrics::LATENCY_BUCKETS;
use crate::state::master::KeyCursor;
use crate::state::master::Master;

/// Default self-probe period (spec 02: 5 s).
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// Default self-probe deadline (spec 02: 3 s).
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Self-probe settings.
#[derive(Debug, Clone)]
pub struct ProbeConfig {
    /// Time between probes.
    pub interval: Duration,
    /// Deadline of one probe, connect included.
    pub timeout: Duration,
}

/// Admin server settings.
#[derive(Debug, Clone)]
pub struct AdminConfig {
    /// Address the HTTP server binds.
    pub bind: String,
    /// The RPC server's bound address; the probe calls it (unspecified addresses become
    /// loopback).
    pub rpc_addr: SocketAddr,
    /// `None` disables the probe; `/readyz` then only reflects whether the master serves.
    pub probe: Option<ProbeConfig>,
    /// How the probe authenticates to the RPC server (the master's own secret).
    pub probe_auth: tycho_proto::auth::ClientAuth,
    /// The cluster secret from which the admin token the listing endpoints require is derived
    /// (`Authorization: Bearer <tycho admin-token>`); `None` leaves them open (`--insecure`).
    /// Health and metrics endpoints are always open.
    pub http_secret: Option<Arc<Secret>>,
    /// The coordination store the master's cluster lives in, for `/kvpt_groups` and `/masters`;
    /// `None` for a master alone.
    pub cluster: Option<ClusterView>,
}

/// Where the admin server reads the cluster's records.
#[derive(Clone)]
pub struct ClusterView {
    /// The coordination store.
    pub store: Arc<dyn tycho_meta::MetaStore>,
    /// The cluster's keys in it.
    pub keys: crate::cluster::ownership::ClusterKeys,
    /// This master's id there.
    pub me: String,
}

impl std::fmt::Debug for ClusterView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterView").field("cluster", &self.keys.cluster()).field("me", &self.me).finish()
    }
}

/// What the probe last saw, plus whether the master serves.
#[derive(Default)]
pub struct ProbeState {
    serving: AtomicBool,
    /// Why it does not serve, when it says (an HA master's role).
    note: parking_lot::Mutex<Option<String>>,
    /// What an operator should know while it serves (`/readyz` gives it after `ready`).
    warning: parking_lot::Mutex<Option<String>>,
    responsive: AtomicBool,
    latency_us: AtomicU64,
    failures: AtomicU64,
    probes: AtomicU64,
}

impl ProbeState {
    /// Marks the master as serving (RPC server up, primary) or not (starting, standby,
    /// stopping). The probe runs only while it serves.
    pub fn set_serving(&self, on: bool) {
        self.serving.store(on, Ordering::Release);
    }

    /// Says what the master does, for `/readyz` to give as the reason while it does not serve.
    pub fn set_note(&self, note: String) {
        *self.note.lock() = Some(note);
    }

    /// Sets (or clears) what `/readyz` adds to its answer while the master is ready: a risk the
    /// operator should know of that does not stop it serving.
    pub fn set_warning(&self, warning: Option<String>) {
        *self.warning.lock() = warning;
    }

    /// Whether the master serves.
    pub fn serving(&self) -> bool {
        self.serving.load(Ordering::Acquire)
    }

    /// Whether the last probe succeeded in time.
    pub fn responsive(&self) -> bool {
        self.responsive.load(Ordering::Acquire)
    }

    fn record(&self, ok: bool, latency: Duration) {
        self.latency_us.store(latency.as_micros() as u64, Ordering::Relaxed);
        self.probes.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        self.responsive.store(ok, Ordering::Release);
    }
}

struct AdminState {
    master: Arc<Master>,
    metrics: Arc<RpcMetrics>,
    probe: Arc<ProbeState>,
    probe_enabled: bool,
    /// The admin token requests must show (with a cluster secret).
    token: Option<String>,
    cluster: Option<ClusterView>,
    /// The object walk behind `/metrics`, shared by scrapes that arrive while one runs.
    gauges: Shared<crate::state::master::ObjectGauges>,
    /// The group records behind `/kvpt_groups`, shared likewise.
    groups: Shared<Result<Vec<GroupRow>, String>>,
}

impl AdminState {
    /// `None` when `headers` carry the admin token (or none is required), else the refusal.
    fn refuse(&self, headers: &HeaderMap) -> Option<HttpResponse> {
        let token = self.token.as_ref()?;
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if given.is_some_and(|g| same_mac(g.as_bytes(), token.as_bytes())) {
            return None;
        }
        let why = "this endpoint needs the admin token: send `Authorization: Bearer <token>`, where the token is what \
                   `tycho admin-token` prints for the cluster secret (never the secret itself; docs/security.md)\n";
        Some((StatusCode::UNAUTHORIZED, why).into_response())
    }
}

/// A value that takes a walk to compute (every object, every group record in etcd) and that
/// many requests may ask for at once. A request takes the result of a walk that began after it
/// arrived, or runs one itself; walks run one at a time. So a flood of requests costs about one
/// walk per walk's duration, not one per request, and no answer is older than its request.
struct Shared<T> {
    last: tokio::sync::Mutex<Option<(std::time::Instant, T)>>,
}

impl<T: Clone> Shared<T> {
    fn new() -> Shared<T> {
        Shared { last: tokio::sync::Mutex::new(None) }
    }

    async fn get<F: std::future::Future<Output = T>>(&self, walk: impl FnOnce() -> F) -> T {
        let arrived = std::time::Instant::now();
        let mut last = self.last.lock().await;
        if let Some((began, v)) = &*last {
            if *began >= arrived {
                return v.clone();
            }
        }
        let began = std::time::Instant::now();
        let v = walk().await;
        *last = Some((began, v.clone()));
        v
    }
}

/// Keys one `/get_all_keys` page answers by default, and at most.
pub const KEYS_PAGE_DEFAULT: usize = 1000;
/// See [`KEYS_PAGE_DEFAULT`].
pub const KEYS_PAGE_MAX: usize = 10_000;

/// A running admin server.
pub struct AdminHandle {
    addr: SocketAddr,
    probe: Arc<ProbeState>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AdminHandle {
    /// The HTTP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The probe's cached state.
    pub fn probe(&self) -> &Arc<ProbeState> {
        &self.probe
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The address a probe on this host uses to reach a server bound to `bound`.
pub fn probe_target(bound: SocketAddr) -> SocketAddr {
    let mut target = bound;
    if bound.ip().is_unspecified() {
        target.set_ip(match bound {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    target
}

/// Starts the admin server (and the probe, if configured) on a thread of its own.
pub fn start_admin(cfg: AdminConfig, master: Arc<Master>, metrics: Arc<RpcMetrics>) -> std::io::Result<AdminHandle> {
    let listener = std::net::TcpListener::bind(&cfg.bind)?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let probe = Arc::new(ProbeState::default());
    let state = Arc::new(AdminState {
        master,
        metrics,
        probe: probe.clone(),
        probe_enabled: cfg.probe.is_some(),
        token: cfg.http_secret.as_deref().map(tycho_proto::auth::admin_http_token),
        cluster: cfg.cluster.clone(),
        gauges: Shared::new(),
        groups: Shared::new(),
    });
    let (stop, stop_rx) = watch::channel(false);
    let target = probe_target(cfg.rpc_addr);
    let thread = std::thread::Builder::new().name("tycho-admin".into()).spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("admin runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("admin listener");
            if let Some(p) = cfg.probe.clone() {
                tokio::spawn(probe_loop(state.probe.clone(), target, p, cfg.probe_auth.clone(), stop_rx.clone()));
            }
            let mut stop_http = stop_rx.clone();
            let app = router(state);
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop_http.changed().await;
                })
                .await;
        });
    })?;
    Ok(AdminHandle { addr, probe, stop, thread: Some(thread) })
}

async fn probe_loop(
    state: Arc<ProbeState>,
    target: SocketAddr,
    cfg: ProbeConfig,
    auth: tycho_proto::auth::ClientAuth,
    mut stop: watch::Receiver<bool>,
) {
    let mut client: Option<RpcClient> = None;
    loop {
        // Not serving (starting, standby, stopping): nothing to probe; look again soon so that
        // the first verdict follows the start of serving closely.
        let mut pause = Duration::from_millis(50).min(cfg.interval);
        if state.serving() {
            let start = Instant::now();
            let verdict = probe_once(&mut client, target, cfg.timeout, &auth).await;
            let ok = verdict.is_ok();
            if let Err(why) = verdict {
                tracing::warn!(%target, %why, "self-probe failed: the master cannot serve data-plane calls");
                client = None;
            }
            state.record(ok, start.elapsed());
            pause = cfg.interval;
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn probe_once(
    client: &mut Option<RpcClient>,
    target: SocketAddr,
    timeout: Duration,
    auth: &tycho_proto::auth::ClientAuth,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    if client.as_ref().is_none_or(RpcClient::is_closed) {
        let cfg = ClientConfig { connect_timeout: timeout, auth: auth.clone(), ..ClientConfig::default() };
        *client = Some(RpcClient::connect(&target.to_string(), &cfg).await.map_err(|e| e.to_string())?);
    }
    let c = client.as_ref().expect("connected above");
    let left = deadline.saturating_duration_since(Instant::now());
    match c.call::<Request, Response>(&Request::HealthCheck, left).await {
        Ok(Response::Health(r)) if r.ok => Ok(()),
        Ok(Response::Health(r)) => Err(format!("shard {} stayed write-locked past the budget", r.shards_blocked)),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

fn router(state: Arc<AdminState>) -> Router {
    let r = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/health", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics));
    // Everything else (listings of every tenant's keys, the cluster's records, reshard
    // requests): with a cluster secret, only for requests that show the admin token.
    let listings = Router::new()
        .route("/kvpt_groups", get(kvpt_groups))
        .route("/masters", get(cluster_masters))
        .route("/get_all_segments", get(all_segments))
        .route("/get_all_keys", get(all_keys))
        .route("/query_key", get(query_key))
        .route("/reshard", get(reshard_intents).post(reshard_request))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_secret));
    let r = r.merge(listings);
    #[cfg(feature = "failpoints")]
    let r = r.route("/fail/{name}", axum::routing::put(fail_set).delete(fail_remove));
    r.with_state(state)
}

async fn readyz(State(s): State<Arc<AdminState>>) -> HttpResponse {
    let serving = s.probe.serving();
    let ready = serving && (!s.probe_enabled || s.probe.responsive());
    if ready {
        match s.probe.warning.lock().as_deref() {
            Some(warning) => (StatusCode::OK, format!("ready\nwarning: {warning}\n")).into_response(),
            None => (StatusCode::OK, "ready\n").into_response(),
        }
    } else if !serving {
        let why = s.probe.note.lock().clone().unwrap_or_else(|| "the master is not serving".into());
        (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: the last self-probe (HealthCheck) failed or timed out\n")
            .into_response()
    }
}

fn json<T: serde::Serialize>(v: &T) -> HttpResponse {
    match serde_json::to_string(v) {
        Ok(body) => ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Passes a request on only when it carries the cluster secret (or none is set).
async fn require_secret(
    State(s): State<Arc<AdminState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> HttpResponse {
    match s.refuse(req.headers()) {
        Some(no) => no,
        None => next.run(req).await,
    }
}

/// One group as `/kvpt_groups` lists it.
#[derive(Clone, serde::Serialize)]
struct GroupRow {
    rank: u32,
    primary: String,
    standbys: Vec<String>,
    state: crate::cluster::ownership::GroupState,
    migrating_to: Option<String>,
    epoch: u64,
    caretaken: bool,
}

/// Every KVPT group's ownership record, by rank (JSON). A master alone serves every group
/// itself; a group not created yet is left out.
async fn kvpt_groups(State(s): State<Arc<AdminState>>) -> HttpResponse {
    let Some(c) = &s.cluster else {
        let rows: Vec<GroupRow> = s
            .master
            .groups()
            .map(|g| GroupRow {
                rank: g.rank(),
                primary: "self".into(),
                standbys: Vec::new(),
                state: crate::cluster::ownership::GroupState::Stable,
                migrating_to: None,
                epoch: g.epoch(),
                caretaken: false,
            })
            .collect();
        return json(&rows);
    };
    // One walk of the group records at a time, shared by the requests that arrive while it
    // runs: a flood of requests does not become a flood of reads on the etcd of the OpLog.
    let rows = s
        .groups
        .get(|| async {
            let mut rows = Vec::new();
            for rank in 0..s.master.config().group_count.max(1) {
                match crate::cluster::ownership::read_group(&*c.store, &c.keys, rank).await {
                    Ok(Some((g, _))) => rows.push(GroupRow {
                        rank: g.rank,
                        primary: g.primary,
                        standbys: g.standbys,
                        state: g.state,
                        migrating_to: g.migrating_to,
                        epoch: g.epoch,
                        caretaken: g.caretaken,
                    }),
                    Ok(None) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(rows)
        })
        .await;
    match rows {
        Ok(rows) => json(&rows),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("coordination store: {e}\n")).into_response(),
    }
}

/// One master as `/masters` lists it.
#[derive(serde::Serialize)]
struct MasterRow {
    id: String,
    address: String,
    registered_at_ms: u64,
    /// Its place in the order the role rules use (etcd create revision).
    revision: i64,
    /// Whether it is the master answering.
    this: bool,
}

/// The live masters of the cluster, oldest first (JSON); a master alone lists nothing.
async fn cluster_masters(State(s): State<Arc<AdminState>>) -> HttpResponse {
    let Some(c) = &s.cluster else { return json(&Vec::<MasterRow>::new()) };
    match crate::cluster::ownership::masters(&*c.store, &c.keys).await {
        Ok(list) => json(
            &list
                .into_iter()
                .map(|(r, rev)| MasterRow {
                    this: r.id == c.me,
                    id: r.id,
                    address: r.address,
                    registered_at_ms: r.registered_at_ms,
                    revision: rev,
                })
                .collect::<Vec<_>>(),
        ),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("coordination store: {e}\n")).into_response(),
    }
}

/// `POST /reshard?rank=R&target=ID[&deadline_ms=N]` query.
#[derive(serde::Deserialize)]
struct ReshardQuery {
    rank: u32,
    target: String,
    deadline_ms: Option<u64>,
}

/// Records a request to move a group to another master (the target carries it out); answers
/// the intent as stored (JSON), or why it was refused.
async fn reshard_request(
    State(s): State<Arc<AdminState>>,
    axum::extract::Query(q): axum::extract::Query<ReshardQuery>,
) -> HttpResponse {
    use crate::cluster::reshard::{request, ReshardError, DEFAULT_RESHARD_DEADLINE_MS};
    let Some(c) = &s.cluster else {
        return (StatusCode::BAD_REQUEST, "a master without a cluster serves every group itself: nothing to move\n")
            .into_response();
    };
    if q.rank >= s.master.config().group_count.max(1) {
        return (StatusCode::NOT_FOUND, format!("no group {} in this cluster\n", q.rank)).into_response();
    }
    let now = tycho_proto::auth::capability::unix_ms();
    let deadline = q.deadline_ms.unwrap_or(DEFAULT_RESHARD_DEADLINE_MS);
    let groups = s.master.config().group_count.max(1);
    match request(&*c.store, &c.keys, groups, q.rank, &q.target, now, deadline).await {
        Ok(intent) => {
            #[cfg(feature = "failpoints")]
            crate::cluster::reshard::kill_point("reshard::requested");
            json(&intent)
        }
        Err(e) => {
            let status = match &e {
                ReshardError::NoGroup(_) => StatusCode::NOT_FOUND,
                ReshardError::UnknownTarget(_) => StatusCode::BAD_REQUEST,
                ReshardError::AlreadyThere { .. }
                | ReshardError::InProgress(_)
                | ReshardError::TargetBusy(_)
                | ReshardError::NotStable(_) => StatusCode::CONFLICT,
                ReshardError::Ownership(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            (status, format!("{e}\n")).into_response()
        }
    }
}

/// The reshards in progress (JSON intents, by rank).
async fn reshard_intents(State(s): State<Arc<AdminState>>) -> HttpResponse {
    let Some(c) = &s.cluster else { return json(&Vec::<crate::cluster::reshard::ReshardIntent>::new()) };
    match crate::cluster::reshard::read_intents(&*c.store, &c.keys, s.master.config().group_count.max(1)).await {
        Ok(list) => json(&list.into_iter().flatten().map(|(i, _)| i).collect::<Vec<_>>()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("coordination store: {e}\n")).into_response(),
    }
}

async fn all_segments(State(s): State<Arc<AdminState>>) -> HttpResponse {
    json(&s.master.list_segments())
}

/// One page of keys: `?limit=N` (default 1000, at most 10,000), `?tenant=T` (one tenant), and
/// `?after=CURSOR` (the `next` of the previous page). Answers
/// `{"keys": [{"tenant", "key"}...], "next": CURSOR or null}`.
async fn all_keys(State(s): State<Arc<AdminState>>, Query(q): Query<HashMap<String, String>>) -> HttpResponse {
    let limit = match q.get("limit").map(|l| l.parse::<usize>()) {
        None => KEYS_PAGE_DEFAULT,
        Some(Ok(n)) => n.clamp(1, KEYS_PAGE_MAX),
        Some(Err(_)) => return (StatusCode::BAD_REQUEST, "limit must be a number\n").into_response(),
    };
    let after = match q.get("after").filter(|a| !a.is_empty()).map(|a| KeyCursor::parse(a)) {
        None => None,
        Some(Some(c)) => Some(c),
        Some(None) => return (StatusCode::BAD_REQUEST, "after is not a cursor from a previous page\n").into_response(),
    };
    let tenant = q.get("tenant").cloned();
    let m = s.master.clone();
    match tokio::task::spawn_blocking(move || m.list_keys_page(tenant.as_deref(), limit, after)).await {
        Ok((keys, next)) => {
            let keys: Vec<serde_json::Value> =
                keys.into_iter().map(|k| serde_json::json!({"tenant": k.tenant, "key": k.key})).collect();
            json(&serde_json::json!({"keys": keys, "next": next.map(|c| c.to_string())}))
        }
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "listing failed\n").into_response(),
    }
}

async fn query_key(State(s): State<Arc<AdminState>>, Query(q): Query<HashMap<String, String>>) -> HttpResponse {
    let Some(key) = q.get("key").cloned() else {
        return (StatusCode::BAD_REQUEST, "missing ?key=\n").into_response();
    };
    let tenant = q.get("tenant").cloned().unwrap_or_default();
    let m = s.master.clone();
    match tokio::task::spawn_blocking(move || m.query_key(&tenant, &key)).await {
        Ok(Ok(Some(info))) => json(&info),
        Ok(Ok(None)) => (StatusCode::NOT_FOUND, "no such key\n").into_response(),
        Ok(Err(code)) => (StatusCode::BAD_REQUEST, format!("{code}: {}\n", code.hint())).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "lookup failed\n").into_response(),
    }
}

#[cfg(feature = "failpoints")]
async fn fail_set(axum::extract::Path(name): axum::extract::Path<String>, body: String) -> HttpResponse {
    match fail::cfg(name, body.trim()) {
        Ok(()) => (StatusCode::OK, "set\n").into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

#[cfg(feature = "failpoints")]
async fn fail_remove(axum::extract::Path(name): axum::extract::Path<String>) -> HttpResponse {
    fail::remove(name);
    (StatusCode::OK, "removed\n").into_response()
}

/// Writes one metric family's HELP and TYPE lines.
/// Each suppression reason's label and count.
fn tycho_master_suppressed(f: &crate::state::master::FanoutCounters) -> Vec<(&'static str, u64)> {
    crate::state::master::Suppressed::ALL
        .iter()
        .zip(&f.suppressed)
        .map(|(s, n)| (s.label(), n.load(Ordering::Relaxed)))
        .collect()
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

async fn metrics(State(s): State<Arc<AdminState>>) -> HttpResponse {
    // Walking the shards takes a few milliseconds with many objects: off the admin thread, and
    // once for the scrapes that arrive while it runs.
    let gauges = s
        .gauges
        .get(|| {
            let m = s.master.clone();
            async move { tokio::task::spawn_blocking(move || m.object_gauges()).await.unwrap_or_default() }
        })
        .await;
    let mut out = String::with_capacity(16 * 1024);
    let p = &s.probe;
    let simple = |out: &mut String, name: &str, kind: &str, help: &str, v: f64| {
        family(out, name, kind, help);
        let _ = writeln!(out, "{name} {v}");
    };
    simple(
        &mut out,
        "tycho_master_serving",
        "gauge",
        "1 while the master serves data-plane calls.",
        p.serving() as u8 as f64,
    );
    simple(
        &mut out,
        "tycho_master_rpc_responsive",
        "gauge",
        "1 when the last self-probe HealthCheck completed within its timeout.",
        p.responsive() as u8 as f64,
    );
    simple(
        &mut out,
        "tycho_master_rpc_probe_latency_seconds",
        "gauge",
        "Latency of the last self-probe.",
        p.latency_us.load(Ordering::Relaxed) as f64 / 1e6,
    );
    simple(
        &mut out,
        "tycho_master_rpc_probe_failures_total",
        "counter",
        "Self-probes that failed or timed out.",
        p.failures.load(Ordering::Relaxed) as f64,
    );
    simple(
        &mut out,
        "tycho_master_rpc_probes_total",
        "counter",
        "Self-probes run.",
        p.probes.load(Ordering::Relaxed) as f64,
    );
    simple(&mut out, "tycho_master_keys", "gauge", "Objects stored (complete or being written).", gauges.keys as f64);
    simple(&mut out, "tycho_master_leased_objects", "gauge", "Objects under a read lease.", gauges.leased as f64);
    simple(
        &mut out,
        "tycho_master_soft_pinned_objects",
        "gauge",
        "Objects with a soft pin in force.",
        gauges.soft_pinned as f64,
    );
    simple(&mut out, "tycho_master_hard_pinned_objects", "gauge", "Hard-pinned objects.", gauges.hard_pinned as f64);
    simple(
        &mut out,
        "tycho_master_metrics_shards_skipped",
        "gauge",
        "Shards this scrape skipped because a writer held them.",
        gauges.shards_skipped as f64,
    );
    simple(
        &mut out,
        "tycho_master_active_clients",
        "gauge",
        "Clients with a live heartbeat.",
        s.master.client_count() as f64,
    );
    if let Some(files) = s.master.snapshot_files().cloned() {
        let bytes = tokio::task::spawn_blocking(move || files.bytes()).await.unwrap_or(0);
        simple(
            &mut out,
            "tycho_master_snapshot_bytes",
            "gauge",
            "Bytes of the group snapshots this master keeps in its data directory.",
            bytes as f64,
        );
    }
    let segments = s.master.list_segments();
    let (total, used) = s.master.usage();
    simple(&mut out, "tycho_master_segments", "gauge", "Mounted segments.", segments.len() as f64);
    simple(
        &mut out,
        "tycho_master_capacity_bytes",
        "gauge",
        "Sum of mounted segment sizes, less the bytes set aside for VSegments.",
        total as f64,
    );
    simple(
        &mut out,
        "tycho_master_vsegment_quota_loaded",
        "gauge",
        "1 once this master has read the cluster's published VSegment quota.",
        if s.master.quota().is_some() { 1.0 } else { 0.0 },
    );
    simple(
        &mut out,
        "tycho_master_vsegment_fenced_bytes",
        "gauge",
        "Bytes of the VSegment quota's extents set aside from replicas in the groups this master serves.",
        s.master.fenced_bytes() as f64,
    );
    simple(&mut out, "tycho_master_allocated_bytes", "gauge", "Bytes allocated to replicas.", used as f64);
    family(&mut out, "tycho_master_segment_capacity_bytes", "gauge", "Size of each mounted segment.");
    for seg in &segments {
        let _ = writeln!(
            out,
            "tycho_master_segment_capacity_bytes{{segment=\"{}\"}} {}",
            escape_label(&seg.desc.name),
            seg.desc.size
        );
    }
    family(&mut out, "tycho_master_segment_allocated_bytes", "gauge", "Bytes allocated in each mounted segment.");
    for seg in &segments {
        let _ = writeln!(
            out,
            "tycho_master_segment_allocated_bytes{{segment=\"{}\"}} {}",
            escape_label(&seg.desc.name),
            seg.used
        );
    }
    let c = &s.master.counters;
    family(
        &mut out,
        "tycho_master_evictions_total",
        "counter",
        "Objects evicted, by why the round ran (watermark, allocation) and the policy's queue the object was in (unread, read, soft_pinned).",
    );
    for reason in crate::state::master::EvictReason::ALL {
        for queue in crate::state::master::EvictQueue::ALL {
            let n = c.evicted_by[reason as usize][queue as usize].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "tycho_master_evictions_total{{reason=\"{}\",queue=\"{}\"}} {n}",
                reason.name(),
                queue.name()
            );
        }
    }
    family(
        &mut out,
        "tycho_master_lookups_total",
        "counter",
        "Keys looked up by ExistKey and GetReplicaList (and their batch forms), by call (exist, get) and answer (hit: found, miss: not).",
    );
    for (i, (op, result)) in [("exist", "hit"), ("exist", "miss"), ("get", "hit"), ("get", "miss")].iter().enumerate() {
        let n = c.lookups[i].load(Ordering::Relaxed);
        let _ = writeln!(out, "tycho_master_lookups_total{{op=\"{op}\",result=\"{result}\"}} {n}");
    }
    simple(
        &mut out,
        "tycho_master_eviction_policy_bytes",
        "gauge",
        "Memory the eviction policy keeps: a use mark per object and each group's counters.",
        gauges.policy_bytes as f64,
    );
    family(
        &mut out,
        "tycho_master_eviction_lifetime_uses",
        "gauge",
        "Per group: how many uses an unread object outlived its last use by when the last eviction round took it (the reuse policy's credit).",
    );
    for g in s.master.groups() {
        let _ =
            writeln!(out, "tycho_master_eviction_lifetime_uses{{group=\"{}\"}} {}", g.rank(), g.eviction_lifetime());
    }
    for (name, help, v) in [
        ("tycho_master_eviction_rounds_total", "Eviction rounds run.", &c.eviction_rounds),
        ("tycho_master_evicted_objects_total", "Objects evicted.", &c.evicted_objects),
        ("tycho_master_evicted_bytes_total", "Bytes evicted (object size times replicas).", &c.evicted_bytes),
        ("tycho_master_sweep_visited_objects_total", "Objects visited by the dead-segment sweep.", &c.sweep_visited),
        ("tycho_master_sweep_dropped_replicas_total", "Replicas dropped by the sweep.", &c.sweep_replicas_dropped),
        (
            "tycho_master_sweep_removed_objects_total",
            "Objects removed by the sweep (no replica left).",
            &c.sweep_objects_removed,
        ),
        ("tycho_master_clients_expired_total", "Clients expired for silence.", &c.clients_expired),
        (
            "tycho_master_expiry_pauses_total",
            "Housekeeping rounds that skipped client expiry while the master itself was stalled.",
            &c.expiry_pauses,
        ),
        ("tycho_master_removed_objects_total", "Objects removed by clients.", &c.objects_removed),
        (
            "tycho_master_writes_discarded_total",
            "Unfinished writes pre-empted after the discard timeout.",
            &c.writes_discarded,
        ),
        (
            "tycho_master_writes_released_total",
            "Unfinished writes reclaimed after the release timeout.",
            &c.writes_released,
        ),
    ] {
        simple(&mut out, name, "counter", help, v.load(Ordering::Relaxed) as f64);
    }
    // Copy and move tasks: decided here, by type and what became of them; and the tasks of the
    // groups served, by state.
    family(
        &mut out,
        "tycho_master_tasks_total",
        "counter",
        "Copy and move tasks, by type and outcome (created, succeeded, failed).",
    );
    let mut durations = String::new();
    for (kind, t) in ["copy", "move"].iter().zip(&c.tasks) {
        let (ok, failed) = (t.succeeded.load(Ordering::Relaxed), t.failed.load(Ordering::Relaxed));
        for (outcome, n) in [("created", t.created.load(Ordering::Relaxed)), ("succeeded", ok), ("failed", failed)] {
            let _ = writeln!(out, "tycho_master_tasks_total{{type=\"{kind}\",outcome=\"{outcome}\"}} {n}");
        }
        let secs = t.duration_ms.load(Ordering::Relaxed) as f64 / 1000.0;
        let _ = writeln!(durations, "tycho_master_task_duration_seconds_sum{{type=\"{kind}\"}} {secs}");
        let _ = writeln!(durations, "tycho_master_task_duration_seconds_count{{type=\"{kind}\"}} {}", ok + failed);
    }
    family(
        &mut out,
        "tycho_master_task_duration_seconds",
        "summary",
        "Time from a task's creation to its end, by type.",
    );
    out.push_str(&durations);
    let (pending, processing, finished) = s.master.task_counts();
    family(&mut out, "tycho_master_tasks", "gauge", "Copy and move tasks of the groups served, by state.");
    for (state, n) in [("pending", pending), ("processing", processing), ("finished", finished)] {
        let _ = writeln!(out, "tycho_master_tasks{{state=\"{state}\"}} {n}");
    }
    // Hot-replica fan-out.
    let f = &s.master.fanout;
    for (name, help, v) in [
        ("tycho_master_fanout_hot_keys_total", "Keys that turned hot (once per key and heat window).", &f.hot),
        (
            "tycho_master_fanout_admissions_total",
            "Hot keys given a copy task (in observe mode: that would have been).",
            &f.admitted,
        ),
        ("tycho_master_fanout_reads_dropped_total", "Reads not counted in the heat window: it was full.", &f.dropped),
        ("tycho_master_fanout_shrunk_total", "Dynamic replicas eviction dropped (before any object).", &f.shrunk),
    ] {
        simple(&mut out, name, "counter", help, v.load(Ordering::Relaxed) as f64);
    }
    family(&mut out, "tycho_master_fanout_suppressed_total", "counter", "Hot keys not given a copy, by reason.");
    for (why, n) in tycho_master_suppressed(f) {
        let _ = writeln!(out, "tycho_master_fanout_suppressed_total{{reason=\"{why}\"}} {n}");
    }
    simple(
        &mut out,
        "tycho_master_fanout_tracked_keys",
        "gauge",
        "Keys in the heat window.",
        s.master.heat_keys() as f64,
    );
    simple(
        &mut out,
        "tycho_master_fanout_dynamic_replicas",
        "gauge",
        "Replicas fan-out added that exist (in the groups this master holds, standby ones included).",
        f.dynamic_live.load(Ordering::Relaxed) as f64,
    );
    simple(
        &mut out,
        "tycho_master_fanout_leases",
        "gauge",
        "Dynamic copies holding a lease (their tasks have not ended).",
        s.master.dynamic_leases() as f64,
    );
    simple(
        &mut out,
        "tycho_master_sweeps_running",
        "gauge",
        "Sweeps in progress.",
        c.sweeps_running.load(Ordering::Relaxed) as f64,
    );
    let rpcs = s.metrics.snapshot();
    family(&mut out, "tycho_master_rpc_requests_total", "counter", "RPC calls handled, by RPC.");
    for r in &rpcs {
        let _ = writeln!(out, "tycho_master_rpc_requests_total{{rpc=\"{}\"}} {}", r.name, r.requests);
    }
    family(&mut out, "tycho_master_rpc_failures_total", "counter", "RPC calls answered with an error, by RPC.");
    for r in &rpcs {
        let _ = writeln!(out, "tycho_master_rpc_failures_total{{rpc=\"{}\"}} {}", r.name, r.failures);
    }
    family(&mut out, "tycho_master_rpc_errors_total", "counter", "RPC calls answered with an error, by RPC and code.");
    for r in &rpcs {
        for (code, n) in &r.by_code {
            let _ = writeln!(out, "tycho_master_rpc_errors_total{{rpc=\"{}\",code=\"{}\"}} {n}", r.name, code.name());
        }
    }
    family(
        &mut out,
        "tycho_master_rpc_failed_items_total",
        "counter",
        "Keys of batch RPCs that failed on their own while the call answered, by RPC.",
    );
    for r in rpcs.iter().filter(|r| r.name.starts_with("batch_")) {
        let _ = writeln!(out, "tycho_master_rpc_failed_items_total{{rpc=\"{}\"}} {}", r.name, r.failed_items);
    }
    family(&mut out, "tycho_master_rpc_duration_seconds", "histogram", "Time to handle an RPC, by RPC.");
    for r in &rpcs {
        for (le, n) in LATENCY_BUCKETS.iter().zip(&r.cumulative) {
            let _ = writeln!(out, "tycho_master_rpc_duration_seconds_bucket{{rpc=\"{}\",le=\"{le}\"}} {n}", r.name);
        }
        let _ =
            writeln!(out, "tycho_master_rpc_duration_seconds_bucket{{rpc=\"{}\",le=\"+Inf\"}} {}", r.name, r.requests);
        let _ = writeln!(out, "tycho_master_rpc_duration_seconds_sum{{rpc=\"{}\"}} {}", r.name, r.sum_seconds);
        let _ = writeln!(out, "tycho_master_rpc_duration_seconds_count{{rpc=\"{}\"}} {}", r.name, r.requests);
    }
    group_metrics(&mut out, &s.master);
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// Per KVPT group: its epoch, whether this master serves it, and how its OpLog goes here.
fn group_metrics(out: &mut String, master: &Master) {
    /// A group's rank, epoch, whether it is served here, and its log's figures.
    type Row = (u32, u64, bool, crate::log::oplog::LogFigures);
    let groups: Vec<Row> =
        master.groups().map(|g| (g.rank(), g.epoch(), g.is_serving(), g.log_stats().figures())).collect();
    /// A series: name, type, help, and its value for a group.
    type Series = (&'static str, &'static str, &'static str, fn(&Row) -> f64);
    let gauges: [Series; 12] = [
        (
            "tycho_master_group_epoch",
            "gauge",
            "The ownership epoch this master holds the group at, counted within the cluster's incarnation.",
            |g| tycho_routing::epoch_in_incarnation(g.1) as f64,
        ),
        ("tycho_master_group_serving", "gauge", "1 while this master answers the group's requests.", |g| {
            g.2 as u8 as f64
        }),
        ("tycho_oplog_appended_seq", "gauge", "Last record appended to the group's log here (primary).", |g| {
            g.3.appended as f64
        }),
        ("tycho_oplog_durable_seq", "gauge", "Last record of the group's log known durable.", |g| g.3.durable as f64),
        ("tycho_oplog_applied_seq", "gauge", "Last record of the group's log applied here.", |g| g.3.applied as f64),
        ("tycho_oplog_queued_records", "gauge", "Records appended but not yet durable (primary).", |g| {
            g.3.queued_records as f64
        }),
        ("tycho_oplog_lag_records", "gauge", "Records durable but not yet applied here (standby).", |g| {
            g.3.lag_records as f64
        }),
        (
            "tycho_oplog_lag_seconds",
            "gauge",
            "How long this standby has been behind the durable prefix (0 when caught up).",
            |g| g.3.lag_seconds,
        ),
        ("tycho_oplog_batches_total", "counter", "Log batches committed by this master.", |g| g.3.batches as f64),
        (
            "tycho_oplog_batch_records_total",
            "counter",
            "Records in those batches (divided by the batches: the mean batch size).",
            |g| g.3.batch_records as f64,
        ),
        ("tycho_snapshot_applied_seq", "gauge", "Log position of the last snapshot this master published.", |g| {
            g.3.snapshot_applied as f64
        }),
        ("tycho_snapshot_rebootstraps_total", "counter", "Times this master started over from a snapshot.", |g| {
            g.3.rebootstraps as f64
        }),
    ];
    for (name, kind, help, value) in gauges {
        family(out, name, kind, help);
        for g in &groups {
            let _ = writeln!(out, "{name}{{group=\"{}\"}} {}", g.0, value(g));
        }
    }
    family(
        out,
        "tycho_snapshot_age_seconds",
        "gauge",
        "Seconds since this master last published a snapshot of the group (absent: never).",
    );
    for g in &groups {
        if let Some(age) = g.3.snapshot_age_seconds {
            let _ = writeln!(out, "tycho_snapshot_age_seconds{{group=\"{}\"}} {age}", g.0);
        }
    }
    family(out, "tycho_oplog_fenced_total", "counter", "Times a log writer of the group was fenced here.");
    for g in &groups {
        let _ = writeln!(out, "tycho_oplog_fenced_total{{group=\"{}\"}} {}", g.0, g.3.fenced);
    }
    family(out, "tycho_oplog_commit_seconds", "histogram", "Time to commit one log batch (one etcd transaction).");
    for (rank, _, _, f) in &groups {
        for (le, n) in LATENCY_BUCKETS.iter().zip(&f.commit_cumulative) {
            let _ = writeln!(out, "tycho_oplog_commit_seconds_bucket{{group=\"{rank}\",le=\"{le}\"}} {n}");
        }
        let _ = writeln!(out, "tycho_oplog_commit_seconds_bucket{{group=\"{rank}\",le=\"+Inf\"}} {}", f.batches);
        let _ = writeln!(out, "tycho_oplog_commit_seconds_sum{{group=\"{rank}\"}} {}", f.commit_seconds);
        let _ = writeln!(out, "tycho_oplog_commit_seconds_count{{group=\"{rank}\"}} {}", f.batches);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::clock::ManualClock;
    use crate::state::config::MasterConfig;

    fn get(addr: SocketAddr, path: &str) -> u16 {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
    }

    #[test]
    fn readyz_is_503_until_the_master_serves_and_livez_is_always_200() {
        let master = Arc::new(Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1))));
        // No RPC server behind this address: a probe would fail, so the probe is off and
        // /readyz follows the serving flag alone (a standby never sets it).
        let cfg = AdminConfig {
            bind: "127.0.0.1:0".into(),
            rpc_addr: "127.0.0.1:9".parse().unwrap(),
            probe: None,
            probe_auth: Default::default(),
            http_secret: None,
            cluster: None,
        };
        let admin = start_admin(cfg, master, Arc::new(RpcMetrics::default())).unwrap();
        let addr = admin.local_addr();
        assert_eq!(get(addr, "/readyz"), 503);
        assert_eq!(get(addr, "/livez"), 200);
        admin.probe().set_serving(true);
        assert_eq!(get(addr, "/readyz"), 200);
        admin.probe().set_serving(false);
        assert_eq!(get(addr, "/readyz"), 503);
        assert_eq!(get(addr, "/metrics"), 200);
    }

    #[test]
    fn a_probe_that_cannot_reach_the_rpc_server_keeps_readyz_503() {
        let master = Arc::new(Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1))));
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let probe = ProbeConfig { interval: Duration::from_millis(20), timeout: Duration::from_millis(200) };
        let cfg = AdminConfig {
            bind: "127.0.0.1:0".into(),
            rpc_addr: dead,
            probe: Some(probe),
            probe_auth: Default::default(),
            http_secret: None,
            cluster: None,
        };
        let admin = start_admin(cfg, master, Arc::new(RpcMetrics::default())).unwrap();
        admin.probe().set_serving(true);
        let end = Instant::now() + Duration::from_secs(5);
        while admin.probe().probes.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < end, "the probe never ran");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!admin.probe().responsive());
        assert_eq!(get(admin.local_addr(), "/readyz"), 503);
    }

    #[test]
    fn unspecified_bind_addresses_are_probed_on_loopback() {
        assert_eq!(probe_target("0.0.0.0:50051".parse().unwrap()), "127.0.0.1:50051".parse().unwrap());
        assert_eq!(probe_target("[::]:50051".parse().unwrap()), "[::1]:50051".parse().unwrap());
        assert_eq!(probe_target("10.1.2.3:50051".parse().unwrap()), "10.1.2.3:50051".parse().unwrap());
    }
}
