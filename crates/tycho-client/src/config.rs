//! Client settings.

use std::time::Duration;

use tycho_proto::ErrorCode;

pub use tycho_proto::auth::ClientAuth;

/// How replicas are reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// This process's own segment by memcpy, same-host peers through shared memory, others
    /// over TCP.
    #[default]
    Auto,
    /// Always TCP, even on the same host (tests and benchmarks).
    Tcp,
}

impl std::str::FromStr for Protocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Protocol, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "shm" | "" => Ok(Protocol::Auto),
            "tcp" => Ok(Protocol::Tcp),
            other => Err(format!("unknown protocol {other:?}; use auto or tcp")),
        }
    }
}

/// Everything a client needs to start.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Master RPC address (`host:port`); or the addresses of an HA cluster's masters separated
    /// by commas: the client uses the one that serves and moves on when it stops serving (a
    /// failover); or `etcd://host:port[,host:port...][/CLUSTER]`, where the client reads the
    /// cluster's masters from etcd once (see `discover.rs`).
    pub master_addr: String,
    /// Where this client's transfer server listens: `host:port`, or `host` alone to pick a
    /// free port in [12300, 14300] (Mooncake's rule).
    pub local_hostname: String,
    /// Identity of this machine; clients with the same identity use shared memory.
    pub host_id: String,
    /// Bytes of memory this client contributes to the store (0: contributes none).
    pub segment_size: u64,
    /// The stable name of that segment (`tycho node --stable-id`): its id is derived from the
    /// name, so that it is the same segment after a restart, one VSegment extents may name
    /// (docs/vsegment.md). `None`: a segment of a fresh random id.
    pub stable_segment: Option<String>,
    /// Largest value `put`/`get` of caller memory handle (0: this client cannot put).
    /// Zero-copy calls on registered buffers are not bounded by it.
    pub staging_buffer_size: u64,
    /// Transport choice.
    pub protocol: Protocol,
    /// Tenant namespace of every key this client uses.
    pub tenant: String,
    /// Deadline of one master call.
    pub rpc_timeout: Duration,
    /// Heartbeat interval (Mooncake: 1 s).
    pub heartbeat_interval: Duration,
    /// Reuse a key's replica list for reads during the first half of the read lease it came
    /// with (at most 1 s), so a hot object is read without a master round trip. A reader may
    /// then see a value replaced or dropped elsewhere up to that long late (Mooncake's Get
    /// promises a complete value, not the latest one); this client's own writes and removes are
    /// seen at once, and metadata queries (exist, size, replica lists) always ask the master.
    pub reuse_leases: bool,
    /// How long a master call polls for its answer before sleeping (see
    /// [`tycho_rpc::ClientConfig::spin`]). `TYCHO_RPC_SPIN_US` in the environment overrides
    /// the default; 0 turns polling off, for hosts where a caller must never busy-wait.
    pub rpc_spin: Duration,
    /// How this client proves the cluster secret to the master and to peers (by default it
    /// looks for it: see [`ClientAuth::Discover`]).
    pub auth: ClientAuth,
    /// How often a client that holds a segment asks for copy and move tasks to run (Mooncake:
    /// 1 s); zero runs none (they wait, then fail at their timeout).
    pub task_poll_interval: Duration,
    /// Most bytes per second this client's transfer server sends for reads (`None`: no cap).
    /// For benchmarks that need a node to be the bottleneck (`tycho node --max-serve-rate`).
    pub serve_rate: Option<u64>,
    /// How long this client's transfer server keeps a peer's connection that sends no request
    /// (`tycho node --transfer-idle-timeout`; peers pool idle connections for less).
    pub transfer_idle_timeout: Duration,
    /// Encrypt value bytes on TCP transfers, and have this client's transfer server refuse
    /// peers' transfers that are not (`ENCRYPTION_REQUIRED`): `TYCHO_ENCRYPT=1` in the
    /// environment, `tycho node --encrypt`. Needs the cluster secret (the keys come from the
    /// greeting); same-host shared-memory transfers cross no wire and stay as they are.
    pub encrypt: bool,
}

impl ClientConfig {
    /// The master addresses `master_addr` names, in order (for an `etcd://` address, those
    /// registered in etcd now, in registration order). Fails for an `etcd://` address that does not
    /// parse (INVALID_PARAMS), whose etcd does not answer (ETCD_OPERATION_ERROR) or where no
    /// master is registered (ETCD_KEY_NOT_EXIST).
    pub fn master_addrs(&self) -> Result<Vec<String>, ErrorCode> {
        match crate::discover::EtcdAddress::parse(&self.master_addr) {
            Some(Ok(etcd)) => etcd.masters(),
            Some(Err(why)) => {
                tracing::error!(address = %self.master_addr, "{why}");
                Err(ErrorCode::INVALID_PARAMS)
            }
            None => {
                Ok(self.master_addr.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect())
            }
        }
    }

    /// Defaults for a client of the master at `master_addr`.
    pub fn new(master_addr: &str) -> ClientConfig {
        ClientConfig {
            master_addr: master_addr.to_string(),
            local_hostname: "127.0.0.1".into(),
            host_id: default_host_id(),
            segment_size: 0,
            stable_segment: None,
            staging_buffer_size: 64 << 20,
            protocol: Protocol::Auto,
            tenant: String::new(),
            rpc_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(1),
            reuse_leases: true,
            rpc_spin: spin_from_env(),
            auth: ClientAuth::Discover,
            task_poll_interval: Duration::from_secs(1),
            serve_rate: None,
            transfer_idle_timeout: tycho_transfer::DEFAULT_IDLE_TIMEOUT,
            encrypt: std::env::var(ENCRYPT_ENV).is_ok_and(|v| v.trim() == "1"),
        }
    }
}

/// Environment variable that, set to `1`, turns on [`ClientConfig::encrypt`].
pub const ENCRYPT_ENV: &str = "TYCHO_ENCRYPT";

/// Longest poll the environment may ask for: past this, sleeping is cheaper than spinning.
const MAX_SPIN: Duration = Duration::from_millis(10);

/// `TYCHO_RPC_SPIN_US`, bounded by [`MAX_SPIN`]; the default when unset or unreadable.
fn spin_from_env() -> Duration {
    let Ok(value) = std::env::var("TYCHO_RPC_SPIN_US") else { return tycho_rpc::DEFAULT_SPIN };
    match value.trim().parse::<u64>() {
        Ok(us) => Duration::from_micros(us).min(MAX_SPIN),
        Err(_) => {
            tracing::warn!(value, "TYCHO_RPC_SPIN_US is not a number of microseconds; using the default");
            tycho_rpc::DEFAULT_SPIN
        }
    }
}

/// The machine's identity: `/etc/machine-id` when present, else the host name.
pub fn default_host_id() -> String {
    if let Ok(id) = std::fs::read_to_string("/etc/machine-id") {
        let id = id.trim();
        if !id.is_empty() {
            return id.to_string();
        }
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Parses sizes such as `1073741824`, `64GB`, `16 MiB`, `512k`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("cannot read size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("unknown size unit {u:?} in {s:?}")),
    };
    Ok((n * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024").unwrap(), 1024);
        assert_eq!(parse_size("64GB").unwrap(), 64 << 30);
        assert_eq!(parse_size("16 MiB").unwrap(), 16 << 20);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GB").is_err());
    }
}
