//! `tycho node`: a daemon that contributes a segment to a store and serves it.

use clap::Args;
use tycho_client::{parse_size, Client, ClientConfig, Protocol};

/// `tycho node` flags.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Master RPC address.
    #[arg(long, alias = "master_server_address", default_value = "127.0.0.1:50051", env = "MASTER_SERVER")]
    pub master: String,
    /// Memory to contribute: bytes, or a size such as 64GB or 512MiB.
    #[arg(long = "segment-size", alias = "global_segment_size", default_value = "1GB", value_parser = parse_size)]
    pub segment_size: u64,
    /// Where this node's transfer server listens: host:port, or host to pick a port in 12300-14300.
    #[arg(long = "local-hostname", alias = "local_hostname", default_value = "127.0.0.1", env = "LOCAL_HOSTNAME")]
    pub local_hostname: String,
    /// Identity of this machine (default: /etc/machine-id); same-host peers use shared memory.
    #[arg(long = "host-id")]
    pub host_id: Option<String>,
    /// A stable name for this node's segment (letters, digits, `.`, `_`, `-`, `:`): its id is
    /// derived from the name, so that it is the same segment after a restart, and the cluster
    /// keeps a descriptor of it, so that `tycho plan-quota` can give VSegment extents on it
    /// (docs/vsegment.md). A node restarted under its name waits for its earlier run to
    /// expire from the masters (at most a minute) before it mounts again, empty.
    #[arg(long = "stable-id", value_name = "NAME", value_parser = stable_name)]
    pub stable_id: Option<String>,
    /// auto (shared memory on the same host, else TCP) or tcp.
    #[arg(long, default_value = "auto")]
    pub protocol: Protocol,
    /// Most bytes per second the node sends for reads over TCP, e.g. 200MB, and most it takes
    /// in for writes (each direction capped apart; default: no cap). For benchmarks that need
    /// one node to be the bottleneck (`tycho bench hot`).
    #[arg(long = "max-serve-rate", value_parser = parse_size)]
    pub max_serve_rate: Option<u64>,
    /// Seconds a peer's transfer connection may sit without a request before the node closes
    /// it (clients keep idle connections for 20 s and reconnect transparently).
    #[arg(long = "transfer-idle-timeout", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub transfer_idle_timeout: u64,
    /// Encrypt value bytes on TCP transfers this node makes, and refuse peers' transfers to and
    /// from its segment that are not encrypted (ENCRYPTION_REQUIRED); clients turn it on with
    /// TYCHO_ENCRYPT=1, which this flag's default follows. Needs the cluster secret.
    #[arg(long)]
    pub encrypt: bool,
    /// Where Python processes of this user on this host attach to the node with
    /// `setup_dummy(..., server_address="127.0.0.1:PORT")` (Mooncake's real-client port): a
    /// Unix socket named after the port in the runtime directory, not a TCP port. 0: none.
    /// (Default 50052: a node then does without when it cannot listen there.)
    #[arg(long)]
    pub port: Option<u16>,
    /// Accepted for `mooncake_client` command lines, and ignored: Tycho has no metadata server
    /// and picks its transports itself.
    #[arg(long = "metadata_server", hide = true)]
    pub metadata_server: Option<String>,
    /// Ignored (see `--metadata_server`).
    #[arg(long = "device_names", hide = true)]
    pub device_names: Option<String>,
    /// Ignored (see `--metadata_server`).
    #[arg(long = "threads", hide = true)]
    pub threads: Option<u32>,
    /// Cluster secret and authentication.
    #[command(flatten)]
    pub security: crate::security::SecurityArgs,
}

impl NodeArgs {
    /// The client configuration of a node.
    pub fn client_config(&self) -> Result<ClientConfig, String> {
        let mut cfg = ClientConfig::new(&self.master);
        cfg.auth = self.security.client_auth()?;
        cfg.segment_size = self.segment_size;
        cfg.stable_segment = self.stable_id.clone();
        if self.stable_id.is_some() && self.segment_size == 0 {
            return Err("--stable-id names the node's segment: give it a --segment-size above 0".into());
        }
        cfg.local_hostname = self.local_hostname.clone();
        if let Some(h) = &self.host_id {
            cfg.host_id = h.clone();
        }
        cfg.protocol = self.protocol;
        cfg.staging_buffer_size = 0;
        cfg.serve_rate = self.max_serve_rate;
        cfg.transfer_idle_timeout = std::time::Duration::from_secs(self.transfer_idle_timeout);
        cfg.encrypt |= self.encrypt;
        // TYCHO_ENCRYPT=1 in the environment means nothing without a secret; the flag is an error.
        if self.encrypt && self.security.insecure {
            return Err("--encrypt needs the cluster secret: the keys come from the connection greeting".into());
        }
        Ok(cfg)
    }
}

/// Runs a node until SIGINT or SIGTERM, then unmounts cleanly.
pub fn run(args: NodeArgs) -> i32 {
    // A failpoints build takes failpoints from FAILPOINTS in the environment (tests only).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cfg = match args.client_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let client = match connect(cfg, args.stable_id.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot start the node against {}: {e}: {}", args.master, e.hint());
            return 1;
        }
    };
    let attach = match listen_for_attaching(&client, args.port) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            let _ = client.close();
            return 1;
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let signals = rt.block_on(async { Signals::install() });
    println!("tycho node serving {} bytes at {} (master {})", args.segment_size, client.hostname(), args.master);
    if let (Some(name), Some(seg)) = (&args.stable_id, client.segments().first()) {
        println!("tycho node: stable segment {name} (id {})", seg.id);
    }
    if let Some((_, port)) = &attach {
        println!("tycho node: processes of this user attach with setup_dummy(..., \"127.0.0.1:{port}\")");
    }
    rt.block_on(signals.wait());
    println!("tycho node: served {} reads over TCP", client.reads_served());
    match client.close() {
        Ok(()) => {
            println!("tycho node: segment unmounted");
            0
        }
        Err(e) => {
            eprintln!("error: unmount failed: {e}");
            1
        }
    }
}

/// A `--stable-id` that may name a stable segment.
fn stable_name(s: &str) -> Result<String, String> {
    tycho_proto::quota::check_stable_name(s).map(|()| s.to_owned()).map_err(|e| e.to_string())
}

/// How long a node of a stable segment waits for its earlier run's mount to expire (masters
/// with a longer `--client-ttl` need the node started again once it expired).
const STABLE_REMOUNT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The node's client. A node of a stable segment that finds its segment mounted still (its
/// earlier run died, and the masters have not expired it yet) tries again until that mount
/// expires, within [`STABLE_REMOUNT_WAIT`].
fn connect(cfg: ClientConfig, stable: Option<&str>) -> Result<Client, tycho_proto::ErrorCode> {
    let deadline = std::time::Instant::now() + STABLE_REMOUNT_WAIT;
    let mut said = false;
    loop {
        match Client::connect(cfg.clone()) {
            Err(tycho_proto::ErrorCode::SEGMENT_ALREADY_EXISTS)
                if stable.is_some() && std::time::Instant::now() < deadline =>
            {
                if !said {
                    eprintln!(
                        "tycho node: segment {} is still mounted by an earlier run; waiting for it to expire",
                        stable.unwrap_or_default()
                    );
                    said = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(250));
            }
            other => return other,
        }
    }
}

/// Where Python processes of this user attach to `client`'s store (Mooncake's dummy clients,
/// `setup_dummy`): the socket of `port`, by default 50052. The port names a socket only processes
/// of this user can reach; a node already listening there keeps it (`None`, with a warning).
/// Failing to listen is an error only for a port given explicitly; 0 is none.
pub fn listen_for_attaching(
    client: &Client,
    port: Option<u16>,
) -> Result<Option<(tycho_client::attach::AttachServer, u16)>, String> {
    let p = port.unwrap_or(tycho_client::attach::DEFAULT_PORT);
    if p == 0 {
        return Ok(None);
    }
    if tycho_client::attach::listening(p) {
        eprintln!(
            "warning: another tycho node of this user listens for attaching processes on port {p}; \
             this one does not (give it --port)"
        );
        return Ok(None);
    }
    match tycho_client::attach::AttachServer::serve(p, client.attach_info()) {
        Ok(s) => Ok(Some((s, p))),
        Err(e) if port.is_none() => {
            eprintln!("warning: cannot listen for attaching processes on port {p}: {e}");
            Ok(None)
        }
        Err(e) => Err(format!("cannot listen for attaching processes on port {p}: {e}")),
    }
}

/// SIGINT and SIGTERM handlers. A process installs them before it prints that it is ready,
/// so that a signal sent right after that line still shuts it down cleanly.
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers; must run inside a Tokio runtime.
    pub fn install() -> Signals {
        use tokio::signal::unix::{signal, SignalKind};
        Signals {
            term: signal(SignalKind::terminate()).expect("SIGTERM handler"),
            int: signal(SignalKind::interrupt()).expect("SIGINT handler"),
        }
    }

    /// Waits for either signal.
    pub async fn wait(mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
    }
}
