//! Master settings. Defaults are Mooncake Store's (see `shared/reference/mooncake-facts.md`).

use tycho_proto::AllocStrategy;

/// Default read-lease TTL granted by GetReplicaList / ExistKey (Mooncake: 10 s).
pub const DEFAULT_KV_LEASE_TTL_MS: u64 = 10_000;
/// Default soft-pin TTL (Mooncake: 30 min).
pub const DEFAULT_SOFT_PIN_TTL_MS: u64 = 30 * 60 * 1000;
/// Longest soft-pin TTL a write may ask for (Mooncake: 24 h).
pub const MAX_SOFT_PIN_TTL_MS: u64 = 24 * 60 * 60 * 1000;
/// A client silent this long is expired (Mooncake: 10 s).
pub const DEFAULT_CLIENT_TTL_MS: u64 = 10_000;
/// After this, an unfinished PutStart may be pre-empted by another writer (Mooncake: 30 s).
pub const DEFAULT_PUT_START_DISCARD_MS: u64 = 30_000;
/// After this, the space of an unfinished PutStart is reclaimed (Mooncake: 600 s).
pub const DEFAULT_PUT_START_RELEASE_MS: u64 = 600_000;
/// Objects touched under one shard write lock by background sweeps; bounds how long any RPC
/// can wait behind a sweep.
pub const SWEEP_BATCH: usize = 64;
/// Most unfinished writes one client may hold at once.
pub const DEFAULT_MAX_PENDING_WRITES_PER_CLIENT: u64 = 1 << 20;
/// Largest segment one mount may contribute (64 TiB).
pub const DEFAULT_MAX_SEGMENT_SIZE: u64 = 64 << 40;
/// Most segments one client may have mounted at once.
pub const DEFAULT_MAX_SEGMENTS_PER_CLIENT: usize = 64;
/// Most replicas one object may ask for.
pub const MAX_REPLICA_NUM: u32 = 16;

/// Everything an operator can tune on a master.
#[derive(Debug, Clone)]
pub struct MasterConfig {
    /// Read-lease TTL in ms.
    pub default_kv_lease_ttl_ms: u64,
    /// Soft-pin TTL used when a write enables the pin without a TTL, in ms.
    pub default_kv_soft_pin_ttl_ms: u64,
    /// Liveness TTL of clients in ms.
    pub client_ttl_ms: u64,
    /// Eviction starts above this used/total ratio.
    pub eviction_high_watermark_ratio: f64,
    /// Fraction of evictable objects one eviction round removes.
    pub eviction_ratio: f64,
    /// Which objects eviction takes first.
    pub eviction_policy: crate::state::policy::EvictionPolicy,
    /// Pre-emption age of an unfinished write, ms.
    pub put_start_discard_timeout_ms: u64,
    /// Reclaim age of an unfinished write, ms.
    pub put_start_release_timeout_ms: u64,
    /// Longest soft-pin TTL a write may ask for, ms.
    pub max_kv_soft_pin_ttl_ms: u64,
    /// Whether eviction may take soft-pinned objects when unpinned ones are too few.
    pub allow_evict_soft_pinned_objects: bool,
    /// Placement strategy when a write does not name one.
    pub default_strategy: AllocStrategy,
    /// Number of KVPT groups in the cluster (G). 1 today.
    pub group_count: u32,
    /// Ownership epoch of the groups this master serves.
    pub group_epoch: u64,
    /// Most unfinished writes one client may hold at once; more starts get
    /// TOO_MANY_PENDING_WRITES.
    pub max_pending_writes_per_client: u64,
    /// Largest segment a mount may contribute; larger ones get RESOURCE_LIMIT.
    pub max_segment_size: u64,
    /// Most segments one client may have mounted; more get RESOURCE_LIMIT.
    pub max_segments_per_client: usize,
    /// The cluster secret: replica descriptors carry capabilities minted under it. `None`
    /// (`--insecure`) grants without capabilities.
    pub secret: Option<std::sync::Arc<tycho_proto::auth::Secret>>,
    /// Limits and timeouts of each group's copy and move tasks (Mooncake's defaults).
    pub task_limits: crate::state::task::TaskLimits,
    /// Hot-replica fan-out (spec 05): off by default, as in Mooncake.
    pub fanout: FanoutConfig,
}

/// What the master does about hot keys (Mooncake's `--dynamic_replication_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FanoutMode {
    /// No heat is kept.
    #[default]
    Off,
    /// Heat is kept, and what enforce would do is counted and logged, not done.
    Observe,
    /// A key that turns hot gets a copy on another segment, up to the replica limit.
    Enforce,
}

impl std::str::FromStr for FanoutMode {
    type Err = String;

    fn from_str(s: &str) -> Result<FanoutMode, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" => Ok(FanoutMode::Off),
            "observe" => Ok(FanoutMode::Observe),
            "enforce" => Ok(FanoutMode::Enforce),
            other => Err(format!("{other:?} is not off, observe or enforce")),
        }
    }
}

/// Hot-replica fan-out settings (Mooncake's `--dynamic_replication_*` flags and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FanoutConfig {
    /// Off, observe or enforce.
    pub mode: FanoutMode,
    /// The heat window: its length, the reads per second that make a key hot, its bounds.
    pub heat: crate::state::heat::HeatConfig,
    /// Most memory replicas fan-out gives an object (its first included).
    pub max_memory_replicas: u32,
    /// Most hot keys waiting for the admission worker; more are suppressed.
    pub queue: usize,
    /// How long a dynamic copy's lease lasts, ms: its task fails if the copy has not ended by then.
    pub lease_ms: u64,
    /// How long after eviction dropped a dynamic replica of an object fan-out leaves it be, ms.
    pub cooldown_ms: u64,
}

impl Default for FanoutConfig {
    fn default() -> FanoutConfig {
        FanoutConfig {
            mode: FanoutMode::Off,
            heat: crate::state::heat::HeatConfig::default(),
            max_memory_replicas: 2,
            queue: 1024,
            lease_ms: 30_000,
            cooldown_ms: 60_000,
        }
    }
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            default_kv_lease_ttl_ms: DEFAULT_KV_LEASE_TTL_MS,
            default_kv_soft_pin_ttl_ms: DEFAULT_SOFT_PIN_TTL_MS,
            client_ttl_ms: DEFAULT_CLIENT_TTL_MS,
            eviction_high_watermark_ratio: 0.90,
            eviction_ratio: 0.05,
            eviction_policy: crate::state::policy::EvictionPolicy::default(),
            put_start_discard_timeout_ms: DEFAULT_PUT_START_DISCARD_MS,
            put_start_release_timeout_ms: DEFAULT_PUT_START_RELEASE_MS,
            max_kv_soft_pin_ttl_ms: MAX_SOFT_PIN_TTL_MS,
            allow_evict_soft_pinned_objects: true,
            default_strategy: AllocStrategy::Random,
            group_count: 1,
            group_epoch: tycho_routing::INITIAL_GROUP_EPOCH,
            max_pending_writes_per_client: DEFAULT_MAX_PENDING_WRITES_PER_CLIENT,
            secret: None,
            max_segment_size: DEFAULT_MAX_SEGMENT_SIZE,
            max_segments_per_client: DEFAULT_MAX_SEGMENTS_PER_CLIENT,
            task_limits: crate::state::task::TaskLimits::default(),
            fanout: FanoutConfig::default(),
        }
    }
}
