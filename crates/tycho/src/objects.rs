//! `tycho put` and `tycho get`.

use std::io::{Read, Write};

use clap::Args;
use tycho_client::{Client, ClientConfig, Protocol};
use tycho_proto::{ErrorCode, ReplicateConfig};

/// Connection flags shared by put and get.
#[derive(Args, Debug)]
pub struct Conn {
    /// Master RPC address.
    #[arg(long, default_value = "127.0.0.1:50051", env = "MASTER_SERVER")]
    master: String,
    /// auto (shared memory on the same host, else TCP) or tcp.
    #[arg(long, default_value = "auto")]
    protocol: Protocol,
    /// Tenant of the key.
    #[arg(long, default_value = "")]
    tenant: String,
}

/// `tycho put`.
#[derive(Args, Debug)]
pub struct PutArgs {
    #[command(flatten)]
    conn: Conn,
    /// Replicas to place.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// Replace an existing value (upsert) instead of keeping it.
    #[arg(long)]
    upsert: bool,
    /// The key.
    key: String,
    /// File to store, or - for standard input.
    file: String,
}

/// `tycho get`.
#[derive(Args, Debug)]
pub struct GetArgs {
    #[command(flatten)]
    conn: Conn,
    /// Write the value here instead of standard output.
    #[arg(short, long)]
    output: Option<String>,
    /// The key.
    key: String,
}

fn client(conn: &Conn, staging: u64) -> Result<Client, i32> {
    let mut cfg = ClientConfig::new(&conn.master);
    cfg.protocol = conn.protocol;
    cfg.tenant = conn.tenant.clone();
    cfg.staging_buffer_size = staging;
    Client::connect(cfg).map_err(|e| {
        eprintln!("error: cannot reach the master at {}: {e}; is it running? (--master ADDR)", conn.master);
        1
    })
}

fn fail(code: ErrorCode) -> i32 {
    eprintln!("error: {code}: {}", code.hint());
    1
}

/// Stores a file under a key.
pub fn put(a: PutArgs) -> i32 {
    let mut data = Vec::new();
    let read = if a.file == "-" {
        std::io::stdin().read_to_end(&mut data)
    } else {
        std::fs::File::open(&a.file).and_then(|mut f| f.read_to_end(&mut data))
    };
    if let Err(e) = read {
        eprintln!("error: cannot read {}: {e}", a.file);
        return 1;
    }
    if data.is_empty() {
        eprintln!("error: refusing to store an empty value (objects must hold at least one byte)");
        return 1;
    }
    let c = match client(&a.conn, data.len() as u64) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let config = ReplicateConfig { replica_num: a.replicas, ..Default::default() };
    // Put keeps an existing value and still succeeds (Mooncake's put-if-absent); ask first so
    // that the message says which happened.
    let existed = !a.upsert && c.exists(&a.key) == Ok(true);
    let r = if a.upsert { c.upsert(&a.key, &data, &config) } else { c.put(&a.key, &data, &config) };
    let _ = c.close();
    match r {
        Ok(()) if existed => {
            eprintln!("{} already holds a value; kept it (--upsert replaces it)", a.key);
            0
        }
        Ok(()) => {
            eprintln!("stored {} bytes under {}", data.len(), a.key);
            0
        }
        Err(e) => fail(e),
    }
}

/// Fetches a key.
pub fn get(a: GetArgs) -> i32 {
    let c = match client(&a.conn, 0) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let r = c.get(&a.key);
    let _ = c.close();
    let data = match r {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    let written = match &a.output {
        Some(path) => std::fs::write(path, &data),
        None => std::io::stdout().write_all(&data),
    };
    match written {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: cannot write the value: {e}");
            1
        }
    }
}
