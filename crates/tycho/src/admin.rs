//! CLI commands that read or change master metadata: `stat`, `ls`, `exist`, `rm`, `segments`;
//! and the cluster's layout from a master's admin HTTP: `groups`, `masters`.

use clap::Args;
use tycho_proto::{ErrorCode, KeyQuery, RemoveKey, Request, Response};

use crate::master_client::{key_ref, MasterClient};

/// Which master to talk to.
#[derive(Args, Debug)]
pub struct Target {
    /// Master RPC address.
    #[arg(long, default_value = "127.0.0.1:50051", env = "MASTER_SERVER")]
    pub master: String,
}

/// Which master's admin HTTP server to ask.
#[derive(Args, Debug)]
pub struct HttpTarget {
    /// The master's admin HTTP address (its `--metrics-port`).
    #[arg(long, default_value = "127.0.0.1:9003", env = "TYCHO_ADMIN")]
    pub admin: String,
}

/// The JSON body of `GET path` on the admin server at `addr`.
fn http_json(addr: &str, path: &str) -> Result<serde_json::Value, String> {
    use std::io::{Read, Write};
    let timeout = std::time::Duration::from_secs(10);
    let sock = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .ok()
        .and_then(|mut all| all.next())
        .ok_or_else(|| format!("cannot resolve {addr}; is --admin HOST:PORT right?"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, timeout).map_err(|e| {
        format!("cannot reach the admin server at {addr}: {e}; is the master running? (--admin HOST:PORT)")
    })?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| format!("reading from {addr}: {e}"))?;
    let (head, body) = out.split_once("\r\n\r\n").ok_or_else(|| format!("{addr} answered no HTTP"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("{addr}{path}: {} {}", head.lines().next().unwrap_or(""), body.trim()));
    }
    serde_json::from_str(body).map_err(|e| format!("{addr}{path}: not JSON: {e}"))
}

/// `tycho groups`.
pub fn groups(t: HttpTarget) -> i32 {
    let rows = match http_json(&t.admin, "/kvpt_groups") {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    println!("{:>5}  {:<28} {:>6}  {:<10} {:<9} standbys", "group", "primary", "epoch", "state", "caretaken");
    for r in rows.as_array().into_iter().flatten() {
        let standbys: Vec<&str> = r["standbys"].as_array().into_iter().flatten().filter_map(|s| s.as_str()).collect();
        println!(
            "{:>5}  {:<28} {:>6}  {:<10} {:<9} {}",
            r["rank"].as_u64().unwrap_or(0),
            r["primary"].as_str().unwrap_or("?"),
            r["epoch"].as_u64().unwrap_or(0),
            r["state"].as_str().unwrap_or("?"),
            if r["caretaken"] == true { "yes" } else { "no" },
            if standbys.is_empty() { "-".to_string() } else { standbys.join(",") }
        );
    }
    0
}

/// `tycho masters`.
pub fn masters(t: HttpTarget) -> i32 {
    let rows = match http_json(&t.admin, "/masters") {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let rows = rows.as_array().cloned().unwrap_or_default();
    if rows.is_empty() {
        println!("(a master without a cluster: no registrations)");
        return 0;
    }
    println!("{:<28} {:<28} {:>10}  registered (Unix ms)", "id", "address", "order");
    for r in rows {
        let me = if r["this"] == true { "  (answering)" } else { "" };
        println!(
            "{:<28} {:<28} {:>10}  {}{me}",
            r["id"].as_str().unwrap_or("?"),
            r["address"].as_str().unwrap_or("?"),
            r["revision"].as_i64().unwrap_or(0),
            r["registered_at_ms"].as_u64().unwrap_or(0)
        );
    }
    0
}

/// `tycho ls`.
#[derive(Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    target: Target,
    /// Only keys matching this regular expression (whole key).
    #[arg(long)]
    regex: Option<String>,
    /// Only keys of this tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// At most this many keys.
    #[arg(long, default_value_t = 1000)]
    limit: u32,
}

/// A command on one key.
#[derive(Args, Debug)]
pub struct KeyArgs {
    #[command(flatten)]
    target: Target,
    /// Tenant of the key.
    #[arg(long, default_value = "")]
    tenant: String,
    /// The key.
    key: String,
}

/// `tycho rm`.
#[derive(Args, Debug)]
pub struct RmArgs {
    #[command(flatten)]
    target: Target,
    /// Tenant of the key(s).
    #[arg(long, default_value = "")]
    tenant: String,
    /// Remove every key matching this regular expression.
    #[arg(long, conflicts_with_all = ["all", "key"])]
    regex: Option<String>,
    /// Remove every object; with a non-empty --tenant, every object of that tenant.
    #[arg(long, conflicts_with = "key")]
    all: bool,
    /// Remove even objects under a read lease.
    #[arg(long)]
    force: bool,
    /// The key to remove.
    #[arg(required_unless_present_any = ["regex", "all"])]
    key: Option<String>,
}

fn report(code: ErrorCode) -> i32 {
    eprintln!("error: {}: {}", code, code.hint());
    1
}

fn with_master<F, Fut>(addr: &str, f: F) -> i32
where
    F: FnOnce(MasterClient) -> Fut,
    Fut: std::future::Future<Output = Result<i32, ErrorCode>>,
{
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let client = match MasterClient::connect(addr).await {
            Ok(c) => c,
            Err(code) => {
                eprintln!("error: cannot reach the master at {addr}: {code}; is it running? (--master ADDR)");
                return 1;
            }
        };
        f(client).await.unwrap_or_else(report)
    })
}

/// `tycho stat`.
pub fn stat(t: Target) -> i32 {
    with_master(&t.master, |c| async move {
        let Response::Stats(s) = c.call(&Request::Stats).await? else { return Err(ErrorCode::INTERNAL_ERROR) };
        let pct = if s.capacity_bytes > 0 { 100.0 * s.used_bytes as f64 / s.capacity_bytes as f64 } else { 0.0 };
        println!("capacity  {} bytes", s.capacity_bytes);
        println!("used      {} bytes ({pct:.1}%)", s.used_bytes);
        println!("objects   {}", s.objects);
        println!("clients   {}", s.clients);
        println!("segments  {}", s.segments);
        Ok(0)
    })
}

/// `tycho segments`.
pub fn segments(t: Target) -> i32 {
    with_master(&t.master, |c| async move {
        let Response::Segments(list) = c.call(&Request::ListSegments).await? else {
            return Err(ErrorCode::INTERNAL_ERROR);
        };
        println!("{:<34} {:<24} {:>16} {:>16}", "segment", "name", "size", "used");
        for s in list {
            println!("{:<34} {:<24} {:>16} {:>16}", s.desc.id.to_string(), s.desc.name, s.desc.size, s.used);
        }
        Ok(0)
    })
}

/// `tycho ls`.
pub fn ls(a: LsArgs) -> i32 {
    with_master(&a.target.master, |c| async move {
        let req = Request::ListKeys { tenant: a.tenant, regex: a.regex, limit: a.limit };
        let Response::Keys(keys) = c.call(&req).await? else { return Err(ErrorCode::INTERNAL_ERROR) };
        for k in keys {
            let state = if k.complete { "" } else { " (writing)" };
            let tenant = if k.tenant.is_empty() { String::new() } else { format!("{}/", k.tenant) };
            println!("{tenant}{}\t{} bytes\t{} replica(s){state}", k.key, k.size, k.replicas);
        }
        Ok(0)
    })
}

/// `tycho exist`: prints 1 or 0; exit code 0 if the key exists, 1 if not.
pub fn exist(a: KeyArgs) -> i32 {
    with_master(&a.target.master, |c| async move {
        let req = Request::ExistKey(KeyQuery { key: key_ref(&a.tenant, &a.key), tenant: a.tenant });
        let Response::Exists(found) = c.call(&req).await? else { return Err(ErrorCode::INTERNAL_ERROR) };
        println!("{}", u8::from(found));
        Ok(if found { 0 } else { 1 })
    })
}

/// `tycho rm`.
pub fn rm(a: RmArgs) -> i32 {
    with_master(&a.target.master, |c| async move {
        let req = if a.all && a.tenant.is_empty() {
            Request::RemoveAll { force: a.force }
        } else if a.all {
            // `(?s)`: keys may contain newlines, which `.` alone does not match.
            Request::RemoveByRegex { tenant: a.tenant, regex: "(?s).*".into(), force: a.force }
        } else if let Some(regex) = a.regex {
            Request::RemoveByRegex { tenant: a.tenant, regex, force: a.force }
        } else {
            let key = a.key.expect("clap requires a key");
            Request::Remove(RemoveKey { key: key_ref(&a.tenant, &key), tenant: a.tenant, force: a.force })
        };
        match c.call(&req).await? {
            Response::Removed(n) => println!("removed {n}"),
            _ => println!("removed 1"),
        }
        Ok(0)
    })
}
