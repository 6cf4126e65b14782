//! `tycho put`, `tycho get`, and copy and move tasks: `tycho copy`, `tycho move`, `tycho task`.

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

/// `tycho copy`.
#[derive(Args, Debug)]
pub struct CopyArgs {
    #[command(flatten)]
    conn: Conn,
    /// Segments (by name, as `tycho segments` lists them) to put a replica on.
    #[arg(long = "to", required = true, value_delimiter = ',')]
    targets: Vec<String>,
    /// Wait until the task ends; fail if it fails.
    #[arg(long)]
    wait: bool,
    /// The key.
    key: String,
}

/// `tycho move`.
#[derive(Args, Debug)]
pub struct MoveArgs {
    #[command(flatten)]
    conn: Conn,
    /// The segment whose replica moves.
    #[arg(long = "from")]
    source: String,
    /// The segment it moves to.
    #[arg(long = "to")]
    target: String,
    /// Wait until the task ends; fail if it fails.
    #[arg(long)]
    wait: bool,
    /// The key.
    key: String,
}

/// `tycho task`.
#[derive(Args, Debug)]
pub struct TaskArgs {
    #[command(flatten)]
    conn: Conn,
    /// Wait until the task ends; fail if it fails.
    #[arg(long)]
    wait: bool,
    /// The task's id, as `tycho copy` and `tycho move` print it (32 hex digits).
    id: String,
}

/// How long `--wait` waits for a task: past its default pending and processing timeouts
/// (300 s each), it has ended.
const TASK_WAIT: std::time::Duration = std::time::Duration::from_secs(630);

/// Prints task `id` (waiting for its end with `wait`); 0 unless it failed or cannot be read.
fn show_task(c: &Client, id: u128, wait: bool) -> i32 {
    let deadline = std::time::Instant::now() + TASK_WAIT;
    loop {
        let t = match c.query_task(id) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        if wait && !t.status.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(200));
            continue;
        }
        println!("task     {:032x}", t.id);
        println!("type     {:?}", t.kind);
        println!("status   {:?}", t.status);
        println!("key      {}", t.key);
        println!("source   {}", t.source);
        println!("targets  {}", t.targets.join(","));
        println!("client   {}", t.assigned);
        println!("created  {} ms", t.created_ms);
        println!("updated  {} ms", t.updated_ms);
        if !t.message.is_empty() {
            println!("message  {}", t.message);
        }
        return i32::from(t.status == tycho_proto::TaskStatus::Failed || (wait && !t.status.is_finished()));
    }
}

/// Creates a task with `create` and prints its id (and, with `wait`, how it ended).
fn task_command(conn: &Conn, wait: bool, create: impl FnOnce(&Client) -> Result<u128, ErrorCode>) -> i32 {
    let c = match client(conn, 0) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let code = match create(&c) {
        Ok(id) if wait => show_task(&c, id, true),
        Ok(id) => {
            println!("{id:032x}");
            0
        }
        Err(e) => fail(e),
    };
    let _ = c.close();
    code
}

/// Asks for copies of a key on more segments.
pub fn copy(a: CopyArgs) -> i32 {
    task_command(&a.conn, a.wait, |c| c.create_copy_task(&a.key, &a.targets))
}

/// Asks for a key's replica to move to another segment.
pub fn move_replica(a: MoveArgs) -> i32 {
    task_command(&a.conn, a.wait, |c| c.create_move_task(&a.key, &a.source, &a.target))
}

/// Shows a task.
pub fn task(a: TaskArgs) -> i32 {
    let Ok(id) = u128::from_str_radix(a.id.trim_start_matches("0x"), 16) else {
        eprintln!("error: {} is not a task id (32 hex digits)", a.id);
        return 1;
    };
    let c = match client(&a.conn, 0) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let code = show_task(&c, id, a.wait);
    let _ = c.close();
    code
}
