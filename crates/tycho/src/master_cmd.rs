//! `tycho master` and `tycho up`.

use crate::security::SecurityArgs;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tycho_master::{run_housekeeping, Master, MasterConfig, MasterRpc, SystemClock};
use tycho_proto::auth::{ClientAuth, Secret};
use tycho_proto::AllocStrategy;
use tycho_rpc::{serve, ServerConfig};

use crate::node::Signals;

/// Master flags. Names and defaults are Mooncake's; the underscore spellings Mooncake's
/// scripts use (`--rpc_port=50051`) are accepted as aliases, and every other `mooncake_master`
/// flag is handled by [`crate::mooncake_flags`] before clap parses the rest.
#[derive(Args, Debug, Clone)]
pub struct MasterArgs {
    /// Port of the RPC server.
    #[arg(long = "rpc-port", alias = "rpc_port", default_value_t = 50051)]
    pub rpc_port: u16,
    /// Address the RPC server binds.
    #[arg(long = "rpc-address", alias = "rpc_address", default_value = "0.0.0.0")]
    pub rpc_address: String,
    /// Read-lease TTL granted by reads: milliseconds, or a duration such as 500ms, 5s, 1m, 1h.
    #[arg(long = "default-kv-lease-ttl", alias = "default_kv_lease_ttl", default_value_t = tycho_master::DEFAULT_KV_LEASE_TTL_MS, value_parser = duration_ms)]
    pub default_kv_lease_ttl: u64,
    /// Soft-pin TTL when a write enables the pin without one: milliseconds or a duration.
    #[arg(long = "default-kv-soft-pin-ttl", alias = "default_kv_soft_pin_ttl", default_value_t = tycho_master::DEFAULT_SOFT_PIN_TTL_MS, value_parser = duration_ms)]
    pub default_kv_soft_pin_ttl: u64,
    /// Longest soft-pin TTL a write may ask for: milliseconds or a duration.
    #[arg(long = "max-kv-soft-pin-ttl", alias = "max_kv_soft_pin_ttl", default_value_t = tycho_master::MAX_SOFT_PIN_TTL_MS, value_parser = duration_ms)]
    pub max_kv_soft_pin_ttl: u64,
    /// A client silent this long is expired and its segments unmounted: seconds or a duration.
    #[arg(long = "client-ttl", alias = "client_ttl", default_value = "10", value_parser = duration_s)]
    pub client_ttl: u64,
    /// Eviction starts when used/total exceeds this ratio.
    #[arg(long = "eviction-high-watermark-ratio", alias = "eviction_high_watermark_ratio", default_value_t = 0.90)]
    pub eviction_high_watermark_ratio: f64,
    /// Fraction of evictable objects one eviction round removes.
    #[arg(long = "eviction-ratio", alias = "eviction_ratio", default_value_t = 0.05)]
    pub eviction_ratio: f64,
    /// Which objects eviction takes first: `reuse` (least recently used, with objects read again
    /// since their write kept longer) or `lru` (least recently used).
    #[arg(long = "eviction-policy", default_value_t = tycho_master::policy::EvictionPolicy::default())]
    pub eviction_policy: tycho_master::policy::EvictionPolicy,
    /// Whether eviction may take soft-pinned objects when too few unpinned ones are left.
    #[arg(long = "allow-evict-soft-pinned-objects", alias = "allow_evict_soft_pinned_objects", default_value_t = true, action = clap::ArgAction::Set)]
    pub allow_evict_soft_pinned_objects: bool,
    /// After this long an unfinished PutStart may be pre-empted: seconds or a duration.
    #[arg(long = "put-start-discard-timeout-sec", alias = "put_start_discard_timeout_sec", default_value = "30", value_parser = duration_s)]
    pub put_start_discard_timeout: u64,
    /// After this long the space of an unfinished PutStart is reclaimed: seconds or a duration.
    #[arg(long = "put-start-release-timeout-sec", alias = "put_start_release_timeout_sec", default_value = "600", value_parser = duration_s)]
    pub put_start_release_timeout: u64,
    /// Most copy and move tasks waiting at once, per KVPT group; more are refused
    /// (TASK_PENDING_LIMIT_EXCEEDED).
    #[arg(long = "max-total-pending-tasks", alias = "max_total_pending_tasks", default_value_t = 10_000)]
    pub max_total_pending_tasks: usize,
    /// Most copy and move tasks running at once, per KVPT group; the rest wait.
    #[arg(long = "max-total-processing-tasks", alias = "max_total_processing_tasks", default_value_t = 10_000)]
    pub max_total_processing_tasks: usize,
    /// Most finished tasks kept for queries, per KVPT group; the oldest are forgotten first.
    #[arg(long = "max-total-finished-tasks", alias = "max_total_finished_tasks", default_value_t = 10_000)]
    pub max_total_finished_tasks: usize,
    /// A task waiting this long for its client fails (0: never): seconds or a duration.
    #[arg(long = "pending-task-timeout-sec", alias = "pending_task_timeout_sec", default_value = "300", value_parser = duration_s)]
    pub pending_task_timeout: u64,
    /// A task running this long fails (0: never): seconds or a duration.
    #[arg(long = "processing-task-timeout-sec", alias = "processing_task_timeout_sec", default_value = "300", value_parser = duration_s)]
    pub processing_task_timeout: u64,
    /// Hot-replica fan-out: off, observe (count and log what enforce would do) or enforce
    /// (copy a key that turns hot to another host's segment).
    #[arg(long = "dynamic-replication-mode", alias = "dynamic_replication_mode", default_value = "off")]
    pub dynamic_replication_mode: tycho_master::FanoutMode,
    /// Length of a key's heat window: seconds or a duration.
    #[arg(long = "dynamic-replication-heat-window-seconds", alias = "dynamic_replication_heat_window_seconds", default_value = "10", value_parser = duration_s)]
    pub dynamic_replication_heat_window: u64,
    /// Reads per second over a window that make a key hot.
    #[arg(
        long = "dynamic-replication-admission-qps-threshold",
        alias = "dynamic_replication_admission_qps_threshold",
        default_value_t = 0.8
    )]
    pub dynamic_replication_admission_qps_threshold: f64,
    /// Most memory replicas fan-out gives an object, its first included.
    #[arg(
        long = "dynamic-replication-max-memory-replicas",
        alias = "dynamic_replication_max_memory_replicas",
        default_value_t = 2
    )]
    pub dynamic_replication_max_memory_replicas: u32,
    /// Most unfinished writes (started, neither ended nor revoked) one client may hold.
    #[arg(long = "max-pending-writes-per-client", default_value_t = tycho_master::DEFAULT_MAX_PENDING_WRITES_PER_CLIENT)]
    pub max_pending_writes_per_client: u64,
    /// Largest segment one mount may contribute: bytes or a size such as 16TB.
    #[arg(long = "max-segment-size", default_value = "64TB", value_parser = tycho_client::parse_size)]
    pub max_segment_size: u64,
    /// Most segments one client may have mounted at once.
    #[arg(long = "max-segments-per-client", default_value_t = tycho_master::DEFAULT_MAX_SEGMENTS_PER_CLIENT)]
    pub max_segments_per_client: usize,
    /// Most RPC connections served at once; more are closed as they arrive.
    #[arg(long = "max-connections", default_value_t = tycho_rpc::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Default placement: random, free-ratio-first or local-first.
    #[arg(long = "allocation-strategy", alias = "allocation_strategy", default_value = "random", value_parser = parse_strategy)]
    pub allocation_strategy: AllocStrategy,
    /// Largest request frame accepted, in bytes.
    #[arg(long = "max-frame-bytes", default_value_t = tycho_proto::frame::DEFAULT_MAX_REQUEST_FRAME)]
    pub max_frame_bytes: u32,
    /// Worker threads of the RPC runtime (0: one per core).
    #[arg(long = "rpc-thread-num", alias = "rpc_thread_num", default_value_t = 0)]
    pub rpc_thread_num: usize,
    /// Port of the admin HTTP server (/livez, /readyz, /metrics); 0 picks a free port.
    #[arg(long = "metrics-port", alias = "metrics_port", default_value_t = 9003)]
    pub metrics_port: u16,
    /// Address the admin HTTP server binds (loopback unless told otherwise: its listings need
    /// the cluster secret, but its health and metrics endpoints are open).
    #[arg(long = "metrics-address", alias = "metrics_address", default_value = "127.0.0.1")]
    pub metrics_address: String,
    /// Run the self-probe that feeds /readyz (HealthCheck over the real RPC path).
    #[arg(long = "enable-rpc-health-probe", alias = "enable_rpc_health_probe", default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_rpc_health_probe: bool,
    /// Seconds between self-probes.
    #[arg(long = "rpc-probe-interval", alias = "rpc_probe_interval_seconds", default_value_t = 5.0)]
    pub rpc_probe_interval: f64,
    /// Seconds a self-probe may take before it counts as failed.
    #[arg(long = "rpc-probe-timeout", alias = "rpc_probe_timeout_seconds", default_value_t = 3.0)]
    pub rpc_probe_timeout: f64,
    /// Cluster secret and authentication.
    #[command(flatten)]
    pub ha: HaArgs,
    #[command(flatten)]
    pub security: SecurityArgs,
    /// `mooncake_master` flags Tycho does not implement, set aside before parsing.
    #[arg(skip)]
    pub mooncake_flags: Vec<crate::mooncake_flags::Unhandled>,
}

/// How to reach etcd beyond its endpoints: TLS and a user (every command that talks to etcd).
#[derive(Args, Debug, Clone, Default)]
pub struct EtcdAccess {
    /// PEM file of the CA that signed etcd's server certificates: speak TLS to etcd (endpoints
    /// without a scheme become `https://`; `http://` ones are refused).
    #[arg(long = "etcd-ca-file", value_name = "PATH")]
    pub ca_file: Option<std::path::PathBuf>,
    /// PEM file of this process's client certificate, for an etcd run with
    /// `--client-cert-auth` (with `--etcd-key-file`).
    #[arg(long = "etcd-cert-file", value_name = "PATH", requires = "key_file")]
    pub cert_file: Option<std::path::PathBuf>,
    /// PEM file of the client certificate's private key.
    #[arg(long = "etcd-key-file", value_name = "PATH", requires = "cert_file")]
    pub key_file: Option<std::path::PathBuf>,
    /// etcd user, for an etcd with authentication enabled (with `--etcd-password-file`).
    #[arg(long = "etcd-user", value_name = "NAME", requires = "password_file")]
    pub user: Option<String>,
    /// File holding the etcd user's password (surrounding whitespace ignored).
    #[arg(long = "etcd-password-file", value_name = "PATH", requires = "user")]
    pub password_file: Option<std::path::PathBuf>,
}

impl EtcdAccess {
    /// Connection options for `endpoints` with these settings; fails on unreadable files or
    /// on plain-HTTP endpoints given with TLS.
    pub fn options(&self, endpoints: &[String]) -> Result<tycho_meta::EtcdOptions, String> {
        let read = |p: &std::path::Path, what: &str| {
            std::fs::read(p).map_err(|e| format!("cannot read the {what} {}: {e}", p.display()))
        };
        let mut endpoints = endpoints.to_vec();
        let tls = match &self.ca_file {
            None if self.cert_file.is_some() => return Err("--etcd-cert-file needs --etcd-ca-file".into()),
            None => None,
            Some(ca) => {
                for e in &mut endpoints {
                    if e.starts_with("http://") {
                        return Err(format!("TLS to etcd (--etcd-ca-file) needs https:// endpoints, not {e}"));
                    }
                    if !e.starts_with("https://") {
                        *e = format!("https://{e}");
                    }
                }
                let identity = match (&self.cert_file, &self.key_file) {
                    (Some(c), Some(k)) => Some((read(c, "etcd client certificate")?, read(k, "etcd client key")?)),
                    _ => None,
                };
                Some(tycho_meta::EtcdTls { ca_pem: read(ca, "etcd CA file")?, identity })
            }
        };
        let user = match (&self.user, &self.password_file) {
            (Some(u), Some(p)) => {
                let password = String::from_utf8(read(p, "etcd password file")?)
                    .map_err(|_| format!("the etcd password file {} is not UTF-8", p.display()))?;
                Some((u.clone(), password.trim().to_owned()))
            }
            _ => None,
        };
        if user.is_some() && tls.is_none() {
            eprintln!("WARNING: --etcd-user without --etcd-ca-file sends the etcd password in the clear");
        }
        let mut options = tycho_meta::EtcdOptions::new(endpoints);
        options.tls = tls;
        options.user = user;
        Ok(options)
    }

    /// These settings as command-line flags, for a child process.
    pub fn flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut add = |flag: &str, v: Option<String>| {
            if let Some(v) = v {
                out.extend([flag.to_owned(), v]);
            }
        };
        let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
        add("--etcd-ca-file", path(&self.ca_file));
        add("--etcd-cert-file", path(&self.cert_file));
        add("--etcd-key-file", path(&self.key_file));
        add("--etcd-user", self.user.clone());
        add("--etcd-password-file", path(&self.password_file));
        out
    }
}

/// High availability: with etcd endpoints, the master joins a cluster in etcd and logs its
/// metadata there (docs/ha.md); without, it keeps everything in memory.
#[derive(Args, Debug, Clone)]
pub struct HaArgs {
    /// etcd endpoints, separated by commas or semicolons (`http://h1:2379,h2:2379`). With them
    /// the master joins the cluster `--cluster-name` in etcd: the first master serves, the
    /// second replays its log as a standby and takes over when it dies, later ones wait.
    #[arg(long = "etcd-endpoints", alias = "etcd_endpoints", value_parser = parse_endpoints, value_name = "URLS", default_value = "")]
    pub etcd_endpoints: Endpoints,
    /// Number of KVPT groups G the key space is divided into, fixed when the cluster is created:
    /// the first master of a cluster in etcd stores it, a later one adopts it (given another
    /// G, it refuses to start). Each group has one primary; each segment is cut into G slices,
    /// one per group, so the largest value is about a segment's size / G (docs/cluster.md).
    #[arg(long = "kvpt-groups", alias = "groups", value_name = "G")]
    pub kvpt_groups: Option<u32>,
    /// Name of the cluster in etcd: its keys live under `/tycho/NAME/`.
    #[arg(long = "cluster-name", alias = "cluster_id", default_value = "tycho", value_name = "NAME")]
    pub cluster_name: String,
    /// TLS and authentication to etcd.
    #[command(flatten)]
    pub etcd_access: EtcdAccess,
    /// This master's id in the cluster (default: its advertised address). A master restarted
    /// with the same id knows it held the group before.
    #[arg(long = "master-id", value_name = "ID")]
    pub master_id: Option<String>,
    /// Address clients reach this master at, published in etcd (default: the RPC address, with
    /// the host's name for an unspecified one).
    #[arg(long = "advertise-address", value_name = "HOST:PORT")]
    pub advertise_address: Option<String>,
    /// TTL of the master's registration in etcd: seconds or a duration. A primary that stops
    /// renewing it (dead, paused, cut off) is replaced about this long after its last renewal;
    /// it stops serving by itself after half of it.
    #[arg(long = "ha-lease-ttl", default_value = "5", value_parser = duration_s)]
    pub ha_lease_ttl: u64,
    /// Longest a promotion may take to replay the log's end: seconds or a duration.
    #[arg(long = "ha-catch-up-deadline", default_value = "30", value_parser = duration_s)]
    pub ha_catch_up_deadline: u64,
    /// Directory of the group's snapshots, shared by every master of the cluster (a volume
    /// they all mount), instead of each master's own data directory (`--data-dir`).
    #[arg(long = "snapshot-dir", value_name = "DIR")]
    pub snapshot_dir: Option<std::path::PathBuf>,
    /// This master's state directory: the snapshots of the groups it serves or follows, which
    /// the cluster's other masters fetch from it (default: `$XDG_STATE_HOME/tycho`, else
    /// `/var/lib/tycho` for root, else `~/.local/state/tycho`; never a tmpfs). With etcd,
    /// snapshots are always on: each cuts the group's log and etcd's history behind it.
    #[arg(long = "data-dir", value_name = "DIR")]
    pub data_dir: Option<std::path::PathBuf>,
    /// A snapshot is taken each time the log has grown by this many records (or by half as
    /// many records as the group has objects, when that is more).
    #[arg(long = "snapshot-every", default_value = "10000", value_name = "RECORDS")]
    pub snapshot_every: u64,
    /// Mooncake's `--enable_ha`: HA is on whenever `--etcd-endpoints` is given; on without
    /// them, the master refuses to start.
    #[arg(long = "enable-ha", hide = true, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enable_ha: bool,
}

/// etcd endpoints as given.
#[derive(Debug, Clone, Default)]
pub struct Endpoints(pub Vec<String>);

impl Endpoints {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn parse_endpoints(s: &str) -> Result<Endpoints, String> {
    Ok(Endpoints(s.split([',', ';']).map(str::trim).filter(|e| !e.is_empty()).map(String::from).collect()))
}

fn duration_ms(s: &str) -> Result<u64, String> {
    crate::mooncake_flags::parse_duration_ms(s, 1)
}

fn duration_s(s: &str) -> Result<u64, String> {
    crate::mooncake_flags::parse_duration_ms(s, 1000)
}

impl MasterArgs {
    fn admin(
        &self,
        rpc_addr: SocketAddr,
        secret: Option<Arc<Secret>>,
        cluster: Option<tycho_master::ClusterView>,
    ) -> Result<tycho_master::AdminConfig, String> {
        let sane = |v: f64| v.is_finite() && v > 0.0 && v <= 86_400.0;
        if !(sane(self.rpc_probe_interval) && sane(self.rpc_probe_timeout)) {
            return Err(
                "--rpc-probe-interval and --rpc-probe-timeout must be positive numbers of seconds (at most a day)"
                    .into(),
            );
        }
        Ok(tycho_master::AdminConfig {
            bind: format!("{}:{}", self.metrics_address, self.metrics_port),
            rpc_addr,
            probe: self.enable_rpc_health_probe.then(|| tycho_master::ProbeConfig {
                interval: Duration::from_secs_f64(self.rpc_probe_interval),
                timeout: Duration::from_secs_f64(self.rpc_probe_timeout),
            }),
            probe_auth: probe_auth(secret.clone()),
            http_secret: secret,
            cluster,
        })
    }
}

fn parse_strategy(s: &str) -> Result<AllocStrategy, String> {
    match s.replace('_', "-").to_ascii_lowercase().as_str() {
        "random" => Ok(AllocStrategy::Random),
        "free-ratio-first" => Ok(AllocStrategy::FreeRatioFirst),
        "local-first" => Ok(AllocStrategy::LocalFirst),
        other => Err(format!("unknown allocation strategy {other:?}; use random, free-ratio-first or local-first")),
    }
}

impl MasterArgs {
    fn config(&self) -> Result<MasterConfig, String> {
        crate::mooncake_flags::check(&self.mooncake_flags)?;
        if !(0.0..=1.0).contains(&self.eviction_high_watermark_ratio) || !(0.0..=1.0).contains(&self.eviction_ratio) {
            return Err("eviction ratios must lie in [0, 1]".into());
        }
        if self.client_ttl < 1000 {
            return Err("--client-ttl must be at least 1 second".into());
        }
        if self.default_kv_lease_ttl == 0 {
            return Err("--default-kv-lease-ttl must be positive".into());
        }
        let threshold = self.dynamic_replication_admission_qps_threshold;
        if self.dynamic_replication_heat_window == 0 || !threshold.is_finite() || threshold <= 0.0 {
            return Err("the heat window and the admission threshold must be positive".into());
        }
        if self.default_kv_soft_pin_ttl > self.max_kv_soft_pin_ttl {
            return Err("--default-kv-soft-pin-ttl cannot exceed --max-kv-soft-pin-ttl".into());
        }
        Ok(MasterConfig {
            default_kv_lease_ttl_ms: self.default_kv_lease_ttl,
            default_kv_soft_pin_ttl_ms: self.default_kv_soft_pin_ttl,
            max_kv_soft_pin_ttl_ms: self.max_kv_soft_pin_ttl,
            allow_evict_soft_pinned_objects: self.allow_evict_soft_pinned_objects,
            client_ttl_ms: self.client_ttl,
            eviction_high_watermark_ratio: self.eviction_high_watermark_ratio,
            eviction_ratio: self.eviction_ratio,
            eviction_policy: self.eviction_policy,
            put_start_discard_timeout_ms: self.put_start_discard_timeout,
            put_start_release_timeout_ms: self.put_start_release_timeout,
            default_strategy: self.allocation_strategy,
            max_pending_writes_per_client: self.max_pending_writes_per_client.max(1),
            max_segment_size: self.max_segment_size,
            max_segments_per_client: self.max_segments_per_client.max(1),
            task_limits: tycho_master::task::TaskLimits {
                max_pending: self.max_total_pending_tasks,
                max_processing: self.max_total_processing_tasks,
                max_finished: self.max_total_finished_tasks,
                pending_timeout_ms: self.pending_task_timeout,
                processing_timeout_ms: self.processing_task_timeout,
            },
            fanout: tycho_master::FanoutConfig {
                mode: self.dynamic_replication_mode,
                heat: tycho_master::heat::HeatConfig {
                    window_ms: self.dynamic_replication_heat_window,
                    threshold_qps: self.dynamic_replication_admission_qps_threshold,
                    ..Default::default()
                },
                max_memory_replicas: self.dynamic_replication_max_memory_replicas,
                ..Default::default()
            },
            ..MasterConfig::default()
        })
    }
}

/// `tycho up` flags.
#[derive(Args, Debug)]
pub struct UpArgs {
    /// Port of the master's RPC server (loopback).
    #[arg(long = "rpc-port", default_value_t = 50051)]
    pub rpc_port: u16,
    /// Memory the embedded node contributes: bytes or a size such as 1GB.
    #[arg(long = "segment-size", default_value = "1GB", value_parser = tycho_client::parse_size)]
    pub segment_size: u64,
    /// Port of the admin HTTP server (loopback).
    #[arg(long = "metrics-port", default_value_t = 9003)]
    pub metrics_port: u16,
    /// Masters (SubMasters) to run, in this process, on an in-memory coordination store: the
    /// i-th listens on `--rpc-port` + i and serves admin HTTP on `--metrics-port` + i
    /// (docs/cluster.md).
    #[arg(long = "masters", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub masters: u16,
    /// KVPT groups G of the local cluster.
    #[arg(long = "groups", alias = "kvpt-groups", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub groups: u32,
    /// With them, the masters are separate `tycho master` processes of cluster `--cluster-name`
    /// on this etcd (comma-separated URLs), instead of tasks of this process on an in-memory
    /// store: kill one and watch its groups fail over.
    #[arg(long = "etcd-endpoints", value_parser = parse_endpoints, value_name = "URLS", default_value = "")]
    pub etcd_endpoints: Endpoints,
    /// Name of the cluster in etcd (with `--etcd-endpoints`).
    #[arg(long = "cluster-name", default_value = "tycho-up", value_name = "NAME")]
    pub cluster_name: String,
    /// TLS and authentication to etcd (with `--etcd-endpoints`).
    #[command(flatten)]
    pub etcd_access: EtcdAccess,
    /// Cluster secret and authentication.
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// How a master's own probe authenticates: with the master's secret, or not at all.
fn probe_auth(secret: Option<Arc<Secret>>) -> ClientAuth {
    secret.map_or(ClientAuth::Insecure, ClientAuth::Secret)
}

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        b.worker_threads(threads);
    }
    b.enable_all().thread_name("tycho-rpc").build().expect("tokio runtime")
}

/// Runs a master until SIGINT or SIGTERM. Returns the process exit code.
pub fn run_master(args: MasterArgs) -> i32 {
    if args.ha.enable_ha && args.ha.etcd_endpoints.is_empty() {
        eprintln!("error: --enable_ha needs --etcd-endpoints (Mooncake's --etcd_endpoints): the etcd the masters coordinate through");
        return 2;
    }
    let mut cfg = match args.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let rt = runtime(args.rpc_thread_num);
    rt.block_on(async move {
        // With etcd, G is the cluster's: stored by its first master, adopted by the others.
        let store = match connect_etcd(&args.ha).await {
            Ok(store) => store,
            Err(e) => {
                eprintln!("error: {e}");
                return 1;
            }
        };
        let keys = tycho_master::ownership::ClusterKeys::new(&args.ha.cluster_name);
        let groups = match &store {
            None => match args.ha.kvpt_groups {
                Some(g) if !(1..=tycho_routing::PARTITION_COUNT).contains(&g) => {
                    Err(tycho_master::ownership::LayoutError::OutOfRange(g))
                }
                g => Ok(g.unwrap_or(1)),
            },
            Some(store) => tycho_master::ownership::cluster_groups(&**store, &keys, args.ha.kvpt_groups).await,
        };
        cfg.group_count = match groups {
            Ok(g) => g,
            Err(e @ tycho_master::ownership::LayoutError::Ownership(_)) => {
                eprintln!("error: cluster layout in etcd: {e}");
                return 1;
            }
            Err(e) => {
                eprintln!("error: {e}");
                return 2;
            }
        };
        let addr = format!("{}:{}", args.rpc_address, args.rpc_port);
        let server = ServerConfig {
            max_frame: args.max_frame_bytes,
            max_connections: args.max_connections,
            ..Default::default()
        };
        let running = match start_master(&addr, cfg, server, &args.security).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}");
                return 1;
            }
        };
        let view = store.as_ref().map(|store| tycho_master::ClusterView {
            store: store.clone(),
            keys: keys.clone(),
            me: identity(&args.ha, running.addr).0,
        });
        let admin = match args
            .admin(running.addr, running.secret.clone(), view)
            .map_err(std::io::Error::other)
            .and_then(|cfg| {
                let bind = cfg.bind.clone();
                tycho_master::start_admin(cfg, running.master.clone(), running.metrics.clone())
                    .map_err(|e| std::io::Error::other(format!("admin HTTP on {bind}: {e}")))
            }) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("error: {e}");
                running.stop().await;
                return 1;
            }
        };
        let signals = Signals::install();
        println!("tycho master listening on {}", running.addr);
        println!("tycho master admin HTTP on http://{}", admin.local_addr());
        let code = match store {
            None => {
                admin.probe().set_serving(true);
                signals.wait().await;
                0
            }
            Some(store) => run_ha(&args.ha, store, running.addr, running.master.clone(), &admin, signals).await,
        };
        admin.probe().set_serving(false);
        running.stop().await;
        drop(admin);
        code
    })
}

/// The master's id in the cluster and the address it advertises there. An unspecified bind
/// address is advertised under the host's name: 127.0.0.1 would reach no client elsewhere, and
/// would give masters on different hosts the same default id.
fn identity(ha: &HaArgs, rpc: SocketAddr) -> (String, String) {
    let address = ha.advertise_address.clone().unwrap_or_else(|| match rpc.ip().is_unspecified() {
        true => format!("{}:{}", host_name(), rpc.port()),
        false => rpc.to_string(),
    });
    (ha.master_id.clone().unwrap_or_else(|| address.clone()), address)
}

/// The etcd of `--etcd-endpoints`, connected; `None` without endpoints.
async fn connect_etcd(ha: &HaArgs) -> Result<Option<Arc<dyn tycho_meta::MetaStore>>, String> {
    if ha.etcd_endpoints.is_empty() {
        return Ok(None);
    }
    let options = ha.etcd_access.options(&ha.etcd_endpoints.0)?;
    let at = options.endpoints.join(",");
    let hint = match options.tls.is_some() {
        true => {
            " (TLS: is --etcd-ca-file the CA that signed etcd's certificate, and does etcd accept this client's \
             certificate?)"
        }
        false => "",
    };
    let store = match tycho_meta::EtcdStore::connect(options).await {
        Ok(s) => s,
        Err(e) => return Err(format!("etcd at {at}: {e}{hint}")),
    };
    // One read of the cluster's record, so that a wrong CA, certificate or user stops the
    // master here, with the reason, rather than in its first role step.
    let meta = tycho_master::ownership::ClusterKeys::new(&ha.cluster_name).meta();
    if let Err(e) = tycho_meta::MetaStore::get(&store, &meta).await {
        return Err(format!("etcd at {at}: {e}{hint}"));
    }
    Ok(Some(Arc::new(store)))
}

/// `tycho up --masters N --groups G`: N masters of a G-group cluster in this process, on an
/// in-memory coordination store, and a node given the first one's address. Returns the exit
/// code.
fn run_up_cluster(args: UpArgs) -> i32 {
    use tycho_master::ha::{HaConfig, HaStatus};
    use tycho_master::ownership::ClusterKeys;
    let rt = runtime(0);
    let store: Arc<dyn tycho_meta::MetaStore> = Arc::new(tycho_meta::MemStore::new());
    let keys = ClusterKeys::new("local");
    if let Err(e) = rt.block_on(tycho_master::ownership::cluster_groups(&*store, &keys, Some(args.groups))) {
        eprintln!("error: {e}");
        return 1;
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut masters = Vec::new();
    let mut roles = Vec::new();
    let mut secret = None;
    for i in 0..args.masters {
        let port = args.rpc_port.checked_add(i).filter(|_| args.rpc_port != 0);
        let addr = format!("127.0.0.1:{}", port.unwrap_or(0));
        let cfg = MasterConfig { group_count: args.groups, ..MasterConfig::default() };
        // The first master settles the secret (as `tycho up` alone does); the others share it.
        let started = rt.block_on(async {
            if i == 0 {
                return start_master(&addr, cfg, ServerConfig::default(), &args.security).await;
            }
            let listener =
                tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            serve_master(listener, cfg, ServerConfig::default(), secret.clone())
        });
        let running = match started {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: master {i}: {e} (is another master running? pass --rpc-port)");
                let _ = stop_tx.send(true);
                for (m, _) in masters {
                    rt.block_on(RunningMaster::stop(m));
                }
                return 1;
            }
        };
        secret = running.secret.clone();
        let id = format!("m{i}");
        let metrics_port = args.metrics_port.checked_add(i).filter(|_| args.metrics_port != 0).unwrap_or(0);
        let admin_cfg = tycho_master::AdminConfig {
            bind: format!("127.0.0.1:{metrics_port}"),
            rpc_addr: running.addr,
            probe: None,
            probe_auth: probe_auth(running.secret.clone()),
            http_secret: running.secret.clone(),
            cluster: Some(tycho_master::ClusterView { store: store.clone(), keys: keys.clone(), me: id.clone() }),
        };
        let admin = match tycho_master::start_admin(admin_cfg, running.master.clone(), running.metrics.clone()) {
            Ok(a) => a,
            Err(e) => {
                eprintln!(
                    "error: cannot start the admin HTTP server on 127.0.0.1:{metrics_port}: {e} (pass --metrics-port)"
                );
                let _ = stop_tx.send(true);
                rt.block_on(running.stop());
                for (m, _) in masters {
                    rt.block_on(RunningMaster::stop(m));
                }
                return 1;
            }
        };
        let cfg = HaConfig {
            cluster: "local".into(),
            id,
            address: running.addr.to_string(),
            lease_ttl: Duration::from_secs(3),
            catch_up_deadline: Duration::from_secs(30),
            writer: Default::default(),
            snapshots: None,
        };
        let (status, mut seen) = tokio::sync::watch::channel(HaStatus::Starting);
        let probe = admin.probe().clone();
        let mut stop = stop_rx.clone();
        let (master, store) = (running.master.clone(), store.clone());
        roles.push(rt.spawn(async move {
            let follow = tokio::spawn(async move {
                loop {
                    let now = seen.borrow_and_update().clone();
                    probe.set_serving(now.serves());
                    probe.set_note(now.describe());
                    if seen.changed().await.is_err() {
                        return;
                    }
                }
            });
            let r = tycho_master::ha::run(master, store, cfg, status, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
            follow.abort();
            r
        }));
        masters.push((running, admin));
    }
    // The first master creates every group; each later one claims a caretaken group or pairs
    // up as a standby. The node comes once every group has the primary it will keep.
    let first = masters[0].0.master.clone();
    let want = args.masters.min(args.groups as u16) as usize;
    let settled = rt.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let t = first.route_table();
            let mut owners: Vec<&String> = t.owners.iter().filter(|o| !o.is_empty()).collect();
            let named = owners.len() == args.groups as usize;
            owners.sort();
            owners.dedup();
            if named && owners.len() == want {
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    if !settled {
        eprintln!("warning: the masters had not settled their roles after 20 s; going on");
    }
    let auth = probe_auth(masters[0].0.secret.clone());
    let master_addr = masters[0].0.addr.to_string();
    let node = match embedded_node_settling(&master_addr, args.segment_size, &auth) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("error: {e}");
            let _ = stop_tx.send(true);
            for (m, _) in masters {
                rt.block_on(m.stop());
            }
            return 1;
        }
    };
    let signals = rt.block_on(async { Signals::install() });
    println!("tycho up: {} masters, {} KVPT groups, on an in-memory coordination store", args.masters, args.groups);
    for (i, (m, admin)) in masters.iter().enumerate() {
        println!("  master m{i}      RPC {}  admin http://{}", m.addr, admin.local_addr());
    }
    let addrs: Vec<String> = masters.iter().map(|(m, _)| m.addr.to_string()).collect();
    print_groups(Some(&first.route_table()), &addrs);
    let admin = masters[0].1.local_addr().to_string();
    print_up_tail(&args, &node, self_check(&master_addr, &auth), &admin, &[]);
    rt.block_on(signals.wait());
    let _ = node.close();
    let _ = stop_tx.send(true);
    for role in roles {
        let _ = rt.block_on(role);
    }
    for (m, admin) in masters {
        admin.probe().set_serving(false);
        rt.block_on(m.stop());
        drop(admin);
    }
    0
}

/// The `tycho master` children of `tycho up`, and the secret links made for them; when dropped,
/// every child still running gets SIGTERM at once (each hands its groups over), those left
/// after 10 s SIGKILL, and the links go.
struct MasterChildren {
    children: Vec<std::process::Child>,
    links: Vec<std::path::PathBuf>,
}

impl Drop for MasterChildren {
    fn drop(&mut self) {
        for c in &mut self.children {
            // A child already reaped is not signalled: its pid may belong to another process.
            if let Ok(None) = c.try_wait() {
                // SAFETY: kill has no memory effects; the pid is our child's, not yet reaped.
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        for c in &mut self.children {
            while let Ok(None) = c.try_wait() {
                if std::time::Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for l in &self.links {
            let _ = std::fs::remove_file(l);
        }
    }
}

/// A free loopback port (for a child whose port must be known before it starts; another
/// process may take it in between, and the child then fails to start, which `up` reports).
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// `tycho up --masters N --groups G --etcd-endpoints URLS`: N `tycho master` processes of one
/// cluster on that etcd, and the node in this process. Returns the exit code.
/// `tycho up`'s lines for the groups: each one's primary, by its name (`m{i}`, its index in
/// `addrs`) and address, and its epoch.
fn print_groups(routes: Option<&tycho_proto::RouteTable>, addrs: &[String]) {
    let Some(t) = routes else {
        println!("  groups         the masters had not settled their roles in time");
        return;
    };
    for (rank, owner) in t.owners.iter().enumerate() {
        let name = addrs.iter().position(|a| a == owner).map_or("?".into(), |i| format!("m{i}"));
        let epoch = tycho_routing::epoch_in_incarnation(t.epochs.get(rank).copied().unwrap_or(0));
        println!("  group {rank:<5}    primary {name} ({owner}), epoch {epoch}");
    }
}

/// `tycho up`'s last lines for several masters: the node's segment, the self-check, what to try
/// (with `hints` added), how to stop.
fn print_up_tail(
    args: &UpArgs,
    node: &tycho_client::Client,
    check: Result<String, String>,
    admin: &str,
    hints: &[&str],
) {
    println!(
        "  node segment   {} bytes ({} per group), transfer server {}",
        args.segment_size,
        args.segment_size / args.groups as u64,
        node.hostname()
    );
    match check {
        Ok(line) => println!("  self-check     {line}"),
        Err(e) => println!("  self-check     FAILED: {e}"),
    }
    println!("  try            echo hello | tycho put greeting - && tycho get greeting");
    println!("                 tycho groups --admin {admin}");
    for h in hints {
        println!("                 {h}");
    }
    println!("  stop           Ctrl-C");
}

fn run_up_processes(args: UpArgs) -> i32 {
    // Signals first: a SIGTERM while the masters start lets `up` stop them (they are stopped
    // when `children` drops); each child also gets SIGTERM if `up` dies without that.
    let rt = runtime(1);
    let signals = rt.block_on(async { Signals::install() });
    let mut ports: Vec<(u16, u16)> = Vec::new();
    for i in 0..args.masters {
        let port = |base: u16| match base {
            0 => loop {
                // (Distinct from every port chosen so far.)
                let p = free_port()?;
                if !ports.iter().any(|&(r, a)| r == p || a == p) {
                    break Ok(p);
                }
            },
            b => b.checked_add(i).ok_or_else(|| format!("port {b} + {i} is out of range")),
        };
        match (port(args.rpc_port), port(args.metrics_port)) {
            (Ok(rpc), Ok(admin)) if rpc != admin => ports.push((rpc, admin)),
            (Ok(_), Ok(_)) => {
                eprintln!("error: master m{i}'s RPC and admin ports coincide; pass other --rpc-port / --metrics-port");
                return 2;
            }
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("error: {e}");
                return 2;
            }
        }
    }
    // Every master proves the secret of the first one's port (or the one given).
    let secret = match args.security.server_secret(ports[0].0) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let runtime_file = secret.is_some()
        && args.security.secret_file.is_none()
        && tycho_proto::auth::files::from_env().ok().flatten().is_none();
    let first_file = tycho_proto::auth::files::runtime_dir().join(tycho_proto::auth::files::port_name(ports[0].0));
    let secret_flags: Vec<String> = match (&secret, &args.security.secret_file) {
        (None, _) => vec!["--insecure".into()],
        (Some(_), Some(f)) => vec!["--secret-file".into(), f.display().to_string()],
        (Some(_), None) if !runtime_file => Vec::new(),
        (Some(_), None) => vec!["--secret-file".into(), first_file.display().to_string()],
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return 1;
        }
    };
    let endpoints = args.etcd_endpoints.0.join(",");
    let mut children = MasterChildren { children: Vec::new(), links: Vec::new() };
    for (i, (rpc, admin)) in ports.iter().enumerate() {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["master", "--rpc-address", "127.0.0.1", "--rpc-port", &rpc.to_string()])
            .args(["--metrics-address", "127.0.0.1", "--metrics-port", &admin.to_string()])
            .args(["--etcd-endpoints", &endpoints, "--cluster-name", &args.cluster_name])
            .args(args.etcd_access.flags())
            .args(["--kvpt-groups", &args.groups.to_string(), "--master-id", &format!("m{i}")])
            .args(&secret_flags)
            .stdout(std::process::Stdio::null());
        // SAFETY: between fork and exec the closure only calls prctl, which allocates nothing.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(c) => children.children.push(c),
            Err(e) => {
                eprintln!("error: cannot start master m{i}: {e}");
                return 1;
            }
        }
        // The first master fixes the cluster's layout before the others look for it.
        let addr = format!("127.0.0.1:{rpc}");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let listening = std::net::TcpStream::connect(&addr).is_ok();
            if let Ok(Some(status)) = children.children[i].try_wait() {
                eprintln!("error: master m{i} exited ({status}); its error is above");
                return 1;
            }
            if listening {
                break;
            }
            if std::time::Instant::now() > deadline {
                eprintln!("error: master m{i} did not listen on {addr} within 20 s");
                return 1;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // The same secret under every master's port (once each listens there), so that tools on
    // this host find it for whichever master they talk to; removed when `up` stops.
    if runtime_file {
        for (rpc, _) in &ports[1..] {
            let other = tycho_proto::auth::files::runtime_dir().join(tycho_proto::auth::files::port_name(*rpc));
            let _ = std::fs::remove_file(&other);
            match std::fs::hard_link(&first_file, &other) {
                Ok(()) => children.links.push(other),
                Err(e) => eprintln!("warning: cannot link the secret to {}: {e}", other.display()),
            }
        }
    }
    let auth = probe_auth(secret);
    let first = format!("127.0.0.1:{}", ports[0].0);
    // The node comes once every group has the primary it will keep (bounded), then retries
    // while a claim is still under way.
    let want = (args.masters as usize).min(args.groups as usize);
    let routes = settle_routes(&first, &auth, args.groups, want, Duration::from_secs(30));
    let node = match embedded_node_settling(&first, args.segment_size, &auth) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    println!(
        "tycho up: {} masters (separate processes), {} KVPT groups, cluster {:?} on etcd {endpoints}",
        args.masters, args.groups, args.cluster_name
    );
    for (i, ((rpc, admin), child)) in ports.iter().zip(&children.children).enumerate() {
        println!("  master m{i}      RPC 127.0.0.1:{rpc}  admin http://127.0.0.1:{admin}  pid {}", child.id());
    }
    let addrs: Vec<String> = ports.iter().map(|(rpc, _)| format!("127.0.0.1:{rpc}")).collect();
    print_groups(routes.as_ref(), &addrs);
    let admin = format!("127.0.0.1:{}", ports[0].1);
    let hint = ["kill one master's pid: its groups fail over to the others"];
    print_up_tail(&args, &node, self_check(&first, &auth), &admin, &hint);
    rt.block_on(signals.wait());
    let _ = node.close();
    // The masters stop (SIGTERM: each hands its groups over) as `children` drops.
    drop(children);
    0
}

/// Polls the route table of the master at `addr` until it names a primary for each of
/// `groups` groups, `distinct` different ones; `None` if that does not happen within `wait`.
fn settle_routes(
    addr: &str,
    auth: &ClientAuth,
    groups: u32,
    distinct: usize,
    wait: Duration,
) -> Option<tycho_proto::RouteTable> {
    use tycho_proto::{Request, Response};
    let cfg = tycho_rpc::ClientConfig { auth: auth.clone(), ..Default::default() };
    let client = tycho_rpc::BlockingClient::new(addr, cfg);
    let deadline = std::time::Instant::now() + wait;
    while std::time::Instant::now() < deadline {
        if let Ok(Response::Routes(t)) = client.call::<Request, Response>(&Request::Routes, Duration::from_secs(2)) {
            let mut owners: Vec<&String> = t.owners.iter().filter(|o| !o.is_empty()).collect();
            let named = owners.len() == groups as usize;
            owners.sort();
            owners.dedup();
            if named && owners.len() == distinct {
                return Some(t);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// This host's name, as `gethostname` gives it.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; the result is NUL-terminated on success.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(0);
    match ok && end > 0 {
        true => String::from_utf8_lossy(&buf[..end]).into_owned(),
        false => "localhost".into(),
    }
}

/// `--data-dir`'s default: `$XDG_STATE_HOME/tycho`, else `/var/lib/tycho` for root, else
/// `~/.local/state/tycho`.
fn default_data_dir() -> std::path::PathBuf {
    if let Some(state) = std::env::var_os("XDG_STATE_HOME").filter(|s| !s.is_empty()) {
        return std::path::PathBuf::from(state).join("tycho");
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    match std::env::var_os("HOME").filter(|h| !h.is_empty() && !root) {
        Some(home) => std::path::PathBuf::from(home).join(".local/state/tycho"),
        None => std::path::PathBuf::from("/var/lib/tycho"),
    }
}

/// Whether `dir` is on a tmpfs (its snapshots would not outlive the machine).
fn on_tmpfs(dir: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a buffer of the right type.
    let ok = unsafe { libc::statfs(path.as_ptr(), &mut st) } == 0;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    ok && st.f_type as i64 == TMPFS_MAGIC
}

/// Where this master's snapshots go: the shared `--snapshot-dir`, or (the default) a directory
/// of its own under `--data-dir`, served to the other masters, which fetch what they lack.
fn snapshot_config(ha: &HaArgs, id: &str, master: &Arc<Master>) -> Result<tycho_master::ha::SnapshotConfig, String> {
    use tycho_master::snapshot::DirSnapshotStore;
    if let Some(dir) = &ha.snapshot_dir {
        let files = Arc::new(DirSnapshotStore::new(dir, &ha.cluster_name));
        master.serve_snapshots(files.clone());
        return Ok(tycho_master::ha::SnapshotConfig { files, peers: None, every_records: ha.snapshot_every });
    }
    let base = ha.data_dir.clone().unwrap_or_else(default_data_dir);
    // One directory per master id: masters of one host keep their copies apart.
    let own: String =
        id.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    let dir = base.join("snapshots").join(own);
    // Snapshots hold every tenant's keys: the directories are the master's user's alone.
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("cannot create the data directory {}: {e}", dir.display()))?;
    if on_tmpfs(&dir) {
        eprintln!(
            "WARNING: the data directory {} is on a tmpfs: its snapshots do not outlive this machine (set --data-dir)",
            dir.display()
        );
    }
    eprintln!(
        "tycho master: snapshots in {} (a group with a standby keeps each on two masters; a group without one, \
         on its primary alone: losing this disk then loses the group's log below its latest snapshot)",
        dir.display()
    );
    let local = Arc::new(DirSnapshotStore::new(&dir, &ha.cluster_name));
    master.serve_snapshots(local.clone());
    let rpc = match master.secret() {
        Some(s) => {
            use tycho_proto::auth::handshake::{admin_credential, Identity};
            tycho_rpc::ClientConfig {
                auth: tycho_proto::auth::ClientAuth::Secret(s.clone()),
                identity: Some(Identity::Admin { credential: admin_credential(s) }),
                ..Default::default()
            }
        }
        None => tycho_rpc::ClientConfig { auth: tycho_proto::auth::ClientAuth::Insecure, ..Default::default() },
    };
    let peers = tycho_master::snapshot_peers::Peers::default();
    let files = Arc::new(tycho_master::snapshot_peers::PeerSnapshotStore::new(local, peers.clone(), rpc));
    Ok(tycho_master::ha::SnapshotConfig { files, peers: Some(peers), every_records: ha.snapshot_every })
}

/// Runs the master's part in an HA cluster until a signal (it then hands its role over at
/// once) or until it must leave; `/readyz` follows its role. Returns the exit code.
async fn run_ha(
    ha: &HaArgs,
    store: Arc<dyn tycho_meta::MetaStore>,
    rpc: SocketAddr,
    master: Arc<Master>,
    admin: &tycho_master::AdminHandle,
    signals: Signals,
) -> i32 {
    use tycho_master::ha::{HaConfig, HaStatus};
    let (id, address) = identity(ha, rpc);
    let snapshots = match snapshot_config(ha, &id, &master) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let cfg = HaConfig {
        cluster: ha.cluster_name.clone(),
        id,
        address,
        lease_ttl: Duration::from_millis(ha.ha_lease_ttl),
        catch_up_deadline: Duration::from_millis(ha.ha_catch_up_deadline),
        writer: Default::default(),
        snapshots: Some(snapshots),
    };
    let (status, mut seen) = tokio::sync::watch::channel(HaStatus::Starting);
    let probe = admin.probe().clone();
    let follow = tokio::spawn(async move {
        let mut last_warning = None;
        loop {
            let now = seen.borrow_and_update().clone();
            probe.set_serving(now.serves());
            probe.set_note(now.describe());
            println!("tycho master role: {}", now.describe());
            let warning = now.warning();
            if warning.is_some() && warning != last_warning {
                eprintln!("WARNING: {}", warning.as_deref().unwrap_or_default());
            }
            probe.set_warning(warning.clone());
            last_warning = warning;
            if seen.changed().await.is_err() {
                return;
            }
        }
    });
    let result = tycho_master::ha::run(master, store, cfg, status, signals.wait()).await;
    let _ = follow.await;
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// Runs the all-in-one: a master and a node with a DRAM segment on loopback, then a
/// self-check. Returns the process exit code.
pub fn run_up(args: UpArgs) -> i32 {
    if !args.etcd_endpoints.is_empty() {
        return run_up_processes(args);
    }
    if args.masters > 1 || args.groups > 1 {
        return run_up_cluster(args);
    }
    let rt = runtime(0);
    let addr = format!("127.0.0.1:{}", args.rpc_port);
    let running =
        match rt.block_on(start_master(&addr, MasterConfig::default(), ServerConfig::default(), &args.security)) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e} (is another master running? pass --rpc-port)");
                return 1;
            }
        };
    let auth = probe_auth(running.secret.clone());
    let master_addr = running.addr.to_string();
    let admin_cfg = tycho_master::AdminConfig {
        bind: format!("127.0.0.1:{}", args.metrics_port),
        rpc_addr: running.addr,
        probe: Some(tycho_master::ProbeConfig {
            interval: tycho_master::DEFAULT_PROBE_INTERVAL,
            timeout: tycho_master::DEFAULT_PROBE_TIMEOUT,
        }),
        probe_auth: auth.clone(),
        http_secret: running.secret.clone(),
        cluster: None,
    };
    let admin = match tycho_master::start_admin(admin_cfg, running.master.clone(), running.metrics.clone()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "error: cannot start the admin HTTP server on 127.0.0.1:{}: {e} (pass --metrics-port)",
                args.metrics_port
            );
            rt.block_on(running.stop());
            return 1;
        }
    };
    admin.probe().set_serving(true);
    let node = match embedded_node(&master_addr, args.segment_size, &auth) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("error: {e}");
            rt.block_on(running.stop());
            return 1;
        }
    };
    // Python processes of this user attach to the store here (`setup_dummy`), as to a node.
    let attach = crate::node::listen_for_attaching(&node, None).unwrap_or(None);
    let signals = rt.block_on(async { Signals::install() });
    println!("tycho up");
    println!("  master RPC     {master_addr}");
    println!("  node segment   {} bytes, transfer server {}", args.segment_size, node.hostname());
    if let Some((_, port)) = &attach {
        println!("  attach         setup_dummy(..., \"127.0.0.1:{port}\") from this user's processes");
    }
    println!("  admin HTTP     http://{}  (/readyz /livez /metrics)", admin.local_addr());
    match self_check(&master_addr, &auth) {
        Ok(line) => println!("  self-check     {line}"),
        Err(e) => println!("  self-check     FAILED: {e}"),
    }
    println!("  try            echo hello | tycho put greeting - && tycho get greeting");
    println!("  stop           Ctrl-C");
    rt.block_on(signals.wait());
    admin.probe().set_serving(false);
    let _ = node.close();
    rt.block_on(running.stop());
    drop(admin);
    0
}

/// `tycho up`'s node: a client of `master` contributing `size` bytes.
fn embedded_node(master: &str, size: u64, auth: &ClientAuth) -> Result<tycho_client::Client, String> {
    let mut cfg = tycho_client::ClientConfig::new(master);
    cfg.segment_size = size;
    cfg.staging_buffer_size = 0;
    cfg.auth = auth.clone();
    tycho_client::Client::connect(cfg).map_err(|e| format!("the embedded node could not start: {e}: {}", e.hint()))
}

/// [`embedded_node`] in a cluster whose roles may still be moving (a claim under way): it tries
/// again for up to 10 s.
fn embedded_node_settling(master: &str, size: u64, auth: &ClientAuth) -> Result<tycho_client::Client, String> {
    let mut tries = 0;
    loop {
        match embedded_node(master, size, auth) {
            Err(e) if tries < 40 => {
                tracing::debug!(error = %e, "the embedded node could not start yet; retrying");
                tries += 1;
                std::thread::sleep(Duration::from_millis(250));
            }
            r => return r,
        }
    }
}

/// Puts, gets and removes a test object through a separate client; reports the latencies.
fn self_check(master: &str, auth: &ClientAuth) -> Result<String, String> {
    let mut cfg = tycho_client::ClientConfig::new(master);
    cfg.auth = auth.clone();
    let client = tycho_client::Client::connect(cfg).map_err(|e| e.to_string())?;
    let key = format!("tycho-up-self-check-{}", std::process::id());
    let value: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let t = std::time::Instant::now();
    client.put(&key, &value, &Default::default()).map_err(|e| format!("put: {e}"))?;
    let put = t.elapsed();
    let t = std::time::Instant::now();
    let back = client.get(&key).map_err(|e| format!("get: {e}"))?;
    let get = t.elapsed();
    if back != value {
        return Err("get returned different bytes".into());
    }
    client.remove(&key, true).map_err(|e| format!("remove: {e}"))?;
    let _ = client.close();
    Ok(format!("ok: put {:?}, get {:?} of 4 KiB, removed", put, get))
}

struct RunningMaster {
    addr: SocketAddr,
    secret: Option<Arc<Secret>>,
    master: Arc<Master>,
    metrics: Arc<tycho_master::RpcMetrics>,
    server: tycho_rpc::ServerHandle,
    stop: Arc<AtomicBool>,
    housekeeping: std::thread::JoinHandle<()>,
}

impl RunningMaster {
    async fn stop(self) {
        self.server.shutdown().await;
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.housekeeping.join();
    }
}

/// Settles the cluster secret (named after the port when it comes from the runtime directory),
/// binds `addr` and starts serving.
async fn start_master(
    addr: &str,
    cfg: MasterConfig,
    server: ServerConfig,
    security: &SecurityArgs,
) -> Result<RunningMaster, String> {
    // With the port given, the secret comes first: a client that finds the port open must find
    // its secret file too (one that connected in between would find none). A port the kernel
    // picks is known only once bound, and announced only after the secret is settled.
    let given = addr.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()).filter(|&p| p != 0);
    let early = given.map(|p| security.server_secret(p)).transpose()?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let secret = match early {
        Some(secret) => secret,
        None => security.server_secret(port)?,
    };
    serve_master(listener, cfg, server, secret)
}

/// Serves a master with `secret` on `listener`, with its housekeeping.
fn serve_master(
    listener: tokio::net::TcpListener,
    mut cfg: MasterConfig,
    server: ServerConfig,
    secret: Option<Arc<Secret>>,
) -> Result<RunningMaster, String> {
    cfg.secret = secret.clone();
    let master = Arc::new(Master::new(cfg, Arc::new(SystemClock::new())));
    let metrics = Arc::new(tycho_master::RpcMetrics::default());
    let server = serve(
        listener,
        Arc::new(MasterRpc::new(master.clone(), metrics.clone())),
        ServerConfig { secret: secret.clone(), ..server },
    )
    .map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicBool::new(false));
    // A task on the RPC runtime shows housekeeping that the master answers: if every worker is
    // stuck, it stops, and client expiry waits rather than punishing clients for the stall.
    let watched = master.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(tycho_master::RESPONSIVE_INTERVAL_MS));
        loop {
            every.tick().await;
            watched.note_responsive();
        }
    });
    let housekeeping = run_housekeeping(master.clone(), Duration::from_millis(100), stop.clone());
    Ok(RunningMaster { addr: server.local_addr(), secret, master, metrics, server, stop, housekeeping })
}
