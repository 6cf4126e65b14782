//! `tycho node`: a daemon that contributes a segment to a store and serves it.

use clap::Args;
use tycho_client::{parse_size, Client, ClientConfig, Protocol};

/// `tycho node` flags.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Master RPC address.
    #[arg(long, default_value = "127.0.0.1:50051", env = "MASTER_SERVER")]
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
    /// auto (shared memory on the same host, else TCP) or tcp.
    #[arg(long, default_value = "auto")]
    pub protocol: Protocol,
}

impl NodeArgs {
    /// The client configuration of a node.
    pub fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig::new(&self.master);
        cfg.segment_size = self.segment_size;
        cfg.local_hostname = self.local_hostname.clone();
        if let Some(h) = &self.host_id {
            cfg.host_id = h.clone();
        }
        cfg.protocol = self.protocol;
        cfg.staging_buffer_size = 0;
        cfg
    }
}

/// Runs a node until SIGINT or SIGTERM, then unmounts cleanly.
pub fn run(args: NodeArgs) -> i32 {
    let client = match Client::connect(args.client_config()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot start the node against {}: {e}: {}", args.master, e.hint());
            return 1;
        }
    };
    println!("tycho node serving {} bytes at {} (master {})", args.segment_size, client.hostname(), args.master);
    wait_for_signal();
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

/// Blocks until SIGINT or SIGTERM.
pub fn wait_for_signal() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    });
}
