//! CLI commands that read or change master metadata: `stat`, `ls`, `exist`, `rm`, `segments`;
//! and the cluster's layout from a master's admin HTTP: `groups`, `masters`.

use std::time::Duration;

use clap::Args;
use tycho_proto::{ErrorCode, KeyQuery, KeyRef, RemoveKey, Request, Response};

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
    /// The cluster secret's file, from which the admin token the admin server asks for is
    /// derived (else `TYCHO_SECRET_FILE`, `TYCHO_SECRET`, or the secret the masters on this
    /// host keep in the runtime directory when they all keep the same one; none for an
    /// `--insecure` cluster).
    #[arg(long)]
    pub secret_file: Option<std::path::PathBuf>,
}

impl HttpTarget {
    /// The admin token to show, if a secret is to be had.
    fn bearer(&self) -> Result<Option<String>, String> {
        admin_bearer(self.secret_file.as_deref())
    }
}

/// The body of `GET path` from the HTTP server at `addr` (a master's admin server, etcd's
/// metrics). HTTP/1.0, so that the answer is never chunked.
pub fn http_get(addr: &str, path: &str) -> Result<String, String> {
    http_call(addr, "GET", path, None)
}

/// The body of `method path` from the HTTP server at `addr`, sending `bearer` as the
/// `Authorization` if given; an answer other than 200 is an error carrying its body.
pub(crate) fn http_call(addr: &str, method: &str, path: &str, bearer: Option<&str>) -> Result<String, String> {
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
    let auth = bearer.map_or(String::new(), |b| format!("Authorization: Bearer {b}\r\n"));
    write!(s, "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}Content-Length: 0\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| format!("reading from {addr}: {e}"))?;
    let (head, body) = out.split_once("\r\n\r\n").ok_or_else(|| format!("{addr} answered no HTTP"))?;
    let status = head.lines().next().unwrap_or("");
    if !(status.starts_with("HTTP/1.") && status.split_whitespace().nth(1) == Some("200")) {
        return Err(format!("{addr}{path}: {status} {}", body.trim()));
    }
    Ok(body.to_string())
}

/// The JSON body of `GET path` on the admin server at `addr`, showing `bearer`.
fn http_json(addr: &str, path: &str, bearer: Option<&str>) -> Result<serde_json::Value, String> {
    let body = http_call(addr, "GET", path, bearer)?;
    serde_json::from_str(&body).map_err(|e| format!("{addr}{path}: not JSON: {e}"))
}

/// `tycho groups`.
pub fn groups(t: HttpTarget) -> i32 {
    let rows = match t.bearer().and_then(|b| http_json(&t.admin, "/kvpt_groups", b.as_deref())) {
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
            tycho_routing::epoch_in_incarnation(r["epoch"].as_u64().unwrap_or(0)),
            r["state"].as_str().unwrap_or("?"),
            if r["caretaken"] == true { "yes" } else { "no" },
            if standbys.is_empty() { "-".to_string() } else { standbys.join(",") }
        );
    }
    0
}

/// `tycho reshard`.
#[derive(Args, Debug)]
pub struct ReshardArgs {
    #[command(flatten)]
    target: HttpTarget,
    /// The group to move.
    #[arg(long)]
    rank: u32,
    /// The id of the master to move it to (`tycho masters` lists them).
    #[arg(long = "target")]
    to: String,
    /// Seconds the whole move may take; past them it is abandoned and the group stays where it
    /// is.
    #[arg(long, default_value_t = 120.0)]
    deadline: f64,
}

/// The cluster secret as an operator gave it (`--secret-file`, else `TYCHO_SECRET_FILE`, else
/// `TYCHO_SECRET`), if any.
fn given_secret(file: Option<&std::path::Path>) -> Result<Option<tycho_proto::auth::Secret>, String> {
    use tycho_proto::auth::{files, Secret, SECRET_ENV, SECRET_FILE_ENV};
    let file = file.map(|f| f.to_path_buf()).or_else(|| std::env::var_os(SECRET_FILE_ENV).map(Into::into));
    if let Some(f) = file.filter(|f| !f.as_os_str().is_empty()) {
        return files::load(&f).map(Some).map_err(|e| format!("cluster secret: {e}"));
    }
    if let Some(t) = std::env::var(SECRET_ENV).ok().filter(|t| !t.trim().is_empty()) {
        return Secret::from_text(t.as_bytes()).map(Some).map_err(|e| format!("{SECRET_ENV}: {e}"));
    }
    Ok(local_secret())
}

/// The secret the masters of this user on this host keep in the runtime directory, when they
/// all keep the same one (`tycho up`, or masters of one cluster); else none (an operator then
/// names it with `--secret-file`).
fn local_secret() -> Option<tycho_proto::auth::Secret> {
    let dir = tycho_proto::auth::files::runtime_dir();
    let mut found: Option<tycho_proto::auth::Secret> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("master-") && name.ends_with(".secret")) {
            continue;
        }
        let secret = tycho_proto::auth::files::load(&entry.path()).ok()?;
        match &found {
            Some(f) if f.key() != secret.key() => return None,
            Some(_) => {}
            None => found = Some(secret),
        }
    }
    found
}

/// The admin token derived from the secret an operator gave, if any.
fn admin_bearer(file: Option<&std::path::Path>) -> Result<Option<String>, String> {
    Ok(given_secret(file)?.map(|s| tycho_proto::auth::admin_http_token(&s)))
}

/// `tycho admin-token`.
#[derive(Args, Debug)]
pub struct TokenArgs {
    /// The cluster secret's file (else `TYCHO_SECRET_FILE` or `TYCHO_SECRET`).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
}

/// `tycho admin-token`: prints the admin token of the cluster secret, what the admin HTTP
/// server's listings and reshard requests ask for as `Authorization: Bearer <token>`.
pub fn admin_token(a: TokenArgs) -> i32 {
    match given_secret(a.secret_file.as_deref()) {
        Ok(Some(s)) => {
            println!("{}", tycho_proto::auth::admin_http_token(&s));
            0
        }
        Ok(None) => {
            eprintln!("error: no cluster secret given: pass --secret-file PATH or set TYCHO_SECRET_FILE");
            1
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// `tycho etcd-defrag`'s arguments.
#[derive(clap::Args, Debug)]
pub struct DefragArgs {
    /// etcd client URLs, comma-separated (the masters' `--etcd-endpoints`); every member of that
    /// etcd cluster is defragmented, one at a time.
    #[arg(long = "etcd-endpoints", value_delimiter = ',', required = true, value_name = "URLS")]
    etcd_endpoints: Vec<String>,
    /// Pause between two members, in seconds.
    #[arg(long, default_value_t = 10)]
    between_secs: u64,
    /// TLS and authentication to etcd.
    #[command(flatten)]
    etcd_access: crate::master_cmd::EtcdAccess,
}

/// `tycho etcd-defrag`: defragments the etcd cluster's members one after the other (opt-in:
/// the masters compact etcd's history themselves, which bounds what etcd keeps in use but not
/// the size of its database file; a defragmentation returns the rest to the disk and stalls the
/// member it runs on meanwhile). Prints each member's sizes and the stall a reader saw.
pub fn etcd_defrag(a: DefragArgs) -> i32 {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let options = match a.etcd_access.options(&a.etcd_endpoints) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let mb = |b: u64| b as f64 / 1e6;
    let ran = rt.block_on(tycho_meta::defragment_members(&options, Duration::from_secs(a.between_secs), |d| {
        println!(
            "{} ({}): {:.1} MB -> {:.1} MB ({:.1} MB in use before); defragmented in {} ms; longest read meanwhile {} ms",
            d.name,
            d.endpoint,
            mb(d.size_before),
            mb(d.size_after),
            mb(d.in_use_before),
            d.took.as_millis(),
            d.longest_read.as_millis()
        )
    }));
    match ran {
        Ok(done) if done.is_empty() => {
            eprintln!("error: the etcd cluster at {} lists no member", a.etcd_endpoints.join(","));
            1
        }
        Ok(_) => 0,
        Err(e) => {
            eprintln!("error: etcd at {}: {e}", a.etcd_endpoints.join(","));
            1
        }
    }
}

/// `tycho reshard`: asks a master to move a group, then follows the move (the target carries
/// it out from the request stored in the cluster; this command only watches) until the group
/// is served by the target (exit 0) or the move is abandoned (exit 1).
pub fn reshard(a: ReshardArgs) -> i32 {
    match reshard_watch(&a) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn reshard_watch(a: &ReshardArgs) -> Result<bool, String> {
    use std::time::{Duration, Instant};
    let admin = &a.target.admin;
    let bearer = a.target.bearer()?;
    let deadline_ms = (a.deadline * 1000.0) as u64;
    let path = format!("/reshard?rank={}&target={}&deadline_ms={deadline_ms}", a.rank, a.to);
    let intent: serde_json::Value = serde_json::from_str(&http_call(admin, "POST", &path, bearer.as_deref())?)
        .map_err(|e| format!("{admin}/reshard: not JSON: {e}"))?;
    let source = intent["source"].as_str().unwrap_or("?").to_string();
    let started = Instant::now();
    const STEPS: usize = 5;
    let mut shown = 0;
    let mut show = |step: usize, what: String| {
        while shown < step {
            shown += 1;
            let bar: String = (0..STEPS).map(|i| if i < shown { '#' } else { '.' }).collect();
            let what = if shown == step { what.clone() } else { "(passed between two looks)".into() };
            println!("[{bar}] {:>6.2}s  {what}", started.elapsed().as_secs_f64());
        }
    };
    show(1, format!("requested: group {} from {source} to {}", a.rank, a.to));
    // The intent's own deadline bounds the move; the command looks a little longer.
    let give_up = started + Duration::from_millis(deadline_ms) + Duration::from_secs(15);
    loop {
        if Instant::now() > give_up {
            return Err(format!("the move neither finished nor was abandoned within {:.0}s", a.deadline + 15.0));
        }
        // The request first: the record changes before the request goes, so a move that ends
        // between the two reads is seen switched, never abandoned.
        let intents = http_json(admin, "/reshard", bearer.as_deref())?;
        let groups = http_json(admin, "/kvpt_groups", bearer.as_deref())?;
        let record = groups.as_array().into_iter().flatten().find(|g| g["rank"].as_u64() == Some(a.rank as u64));
        let intent = intents.as_array().into_iter().flatten().find(|i| i["rank"].as_u64() == Some(a.rank as u64));
        let Some(record) = record else { return Err(format!("group {} has no record", a.rank)) };
        let primary = record["primary"].as_str().unwrap_or("?");
        if primary == a.to {
            show(
                5,
                format!(
                    "switched: {} serves group {} at epoch {}",
                    a.to,
                    a.rank,
                    tycho_routing::epoch_in_incarnation(record["epoch"].as_u64().unwrap_or(0))
                ),
            );
            if intent.is_none() {
                println!("done in {:.2}s", started.elapsed().as_secs_f64());
                return Ok(true);
            }
        } else if intent.is_none() {
            println!("abandoned: group {} stays with {primary} (see its log for why)", a.rank);
            return Ok(false);
        } else if let Some(at) = intent.and_then(|i| i["frozen_at"].as_u64()) {
            show(4, format!("{source} froze the group's writes; its log holds them up to record {at}: switching"));
        } else if record["state"] == "Migrating" {
            show(3, format!("{} caught up: the group is migrating, {source} freezes new writes", a.to));
        } else if record["standbys"].as_array().into_iter().flatten().any(|s| s.as_str() == Some(a.to.as_str())) {
            show(2, format!("{} joined the standbys: catching up with the log", a.to));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `tycho masters`.
pub fn masters(t: HttpTarget) -> i32 {
    let rows = match t.bearer().and_then(|b| http_json(&t.admin, "/masters", b.as_deref())) {
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

/// The masters a command talks to. In a cluster whose route table names the primaries of
/// several groups, each primary answers for its own groups only: listings and figures are
/// gathered from every one of them, and a key's command goes to its group's primary.
/// Otherwise the master given answers for everything.
struct Fleet {
    routes: tycho_routing::RouteCache,
    /// The master given, or every primary the table names that answered.
    masters: Vec<(String, MasterClient)>,
    /// Primaries the table names that could not be reached (a failover under way, say).
    missing: Vec<String>,
}

impl Fleet {
    async fn connect(addr: &str) -> Result<Fleet, String> {
        let given = MasterClient::connect(addr)
            .await
            .map_err(|code| format!("cannot reach the master at {addr}: {code}; is it running? (--master ADDR)"))?;
        let mut routes = tycho_routing::RouteCache::new();
        if let Ok(Response::Routes(t)) = given.call(&Request::Routes).await {
            routes.learn(&t);
        }
        let mut masters = vec![(addr.to_string(), given)];
        let mut missing = Vec::new();
        if routes.partitioned() {
            let given = masters.pop().expect("the given master");
            for owner in routes.owners() {
                if owner == given.0 {
                    masters.push(given.clone());
                    continue;
                }
                match MasterClient::connect(&owner).await {
                    Ok(c) => masters.push((owner, c)),
                    Err(code) => missing.push(format!("{owner} ({code})")),
                }
            }
            if masters.is_empty() {
                return Err(format!("cannot reach any primary: {}", missing.join(", ")));
            }
        }
        Ok(Fleet { routes, masters, missing })
    }

    /// The master to ask about `key`, and the key's reference under its group's epoch; RPC_FAIL
    /// when its group's primary could not be reached.
    fn for_key(&self, tenant: &str, key: &str) -> Result<(&MasterClient, KeyRef), ErrorCode> {
        let mut k = key_ref(tenant, key);
        k.route.epoch = self.routes.epoch_of(k.route.partition_id);
        let owner = self.routes.owner_of(k.route.partition_id);
        match self.masters.iter().find(|(a, _)| a == owner) {
            Some((_, c)) => Ok((c, k)),
            None if !self.routes.partitioned() => Ok((&self.masters[0].1, k)),
            None => {
                eprintln!("error: the primary of this key's group, {owner}, cannot be reached");
                Err(ErrorCode::RPC_FAIL)
            }
        }
    }

    /// Exit code of a command gathered over the primaries: 1, with a warning, when some
    /// could not be reached (what was printed leaves their groups out).
    fn partial(&self) -> i32 {
        if self.missing.is_empty() {
            return 0;
        }
        eprintln!("warning: primaries not reached, their groups are left out above: {}", self.missing.join(", "));
        1
    }

    /// `req`'s answer from every master.
    async fn each(&self, req: &Request) -> Result<Vec<Response>, ErrorCode> {
        let mut out = Vec::with_capacity(self.masters.len());
        for (_, c) in &self.masters {
            out.push(c.call(req).await?);
        }
        Ok(out)
    }
}

fn with_master<F, Fut>(addr: &str, f: F) -> i32
where
    F: FnOnce(Fleet) -> Fut,
    Fut: std::future::Future<Output = Result<i32, ErrorCode>>,
{
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let fleet = match Fleet::connect(addr).await {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: {e}");
                return 1;
            }
        };
        f(fleet).await.unwrap_or_else(report)
    })
}

/// `tycho stat`: over every primary of a cluster, the sums (each serves its own slices and
/// objects); clients and segments are counted once (every primary has them all).
pub fn stat(t: Target) -> i32 {
    with_master(&t.master, |f| async move {
        let mut all = Vec::new();
        for r in f.each(&Request::Stats).await? {
            let Response::Stats(s) = r else { return Err(ErrorCode::INTERNAL_ERROR) };
            all.push(s);
        }
        let s = tycho_client::aggregate::merge_stats(all);
        let (capacity, used, objects, clients, segments) =
            (s.capacity_bytes, s.used_bytes, s.objects, s.clients, s.segments);
        let pct = if capacity > 0 { 100.0 * used as f64 / capacity as f64 } else { 0.0 };
        println!("capacity  {capacity} bytes");
        println!("used      {used} bytes ({pct:.1}%)");
        println!("objects   {objects}");
        println!("clients   {clients}");
        println!("segments  {segments}");
        if f.masters.len() > 1 {
            println!("primaries {}", f.masters.len());
        }
        Ok(f.partial())
    })
}

/// `tycho segments`: each segment once, with the bytes used in it on every primary.
pub fn segments(t: Target) -> i32 {
    with_master(&t.master, |f| async move {
        let mut lists = Vec::new();
        for r in f.each(&Request::ListSegments).await? {
            let Response::Segments(list) = r else { return Err(ErrorCode::INTERNAL_ERROR) };
            lists.push(list);
        }
        let all = tycho_client::aggregate::merge_segments(lists);
        println!("{:<34} {:<24} {:>16} {:>16}", "segment", "name", "size", "used");
        for s in all {
            println!("{:<34} {:<24} {:>16} {:>16}", s.desc.id.to_string(), s.desc.name, s.desc.size, s.used);
        }
        Ok(f.partial())
    })
}

/// `tycho ls`: the keys of every primary, sorted, at most `--limit`.
pub fn ls(a: LsArgs) -> i32 {
    with_master(&a.target.master, |f| async move {
        let req = Request::ListKeys { tenant: a.tenant, regex: a.regex, limit: a.limit };
        let mut lists = Vec::new();
        for r in f.each(&req).await? {
            let Response::Keys(k) = r else { return Err(ErrorCode::INTERNAL_ERROR) };
            lists.push(k);
        }
        let keys = tycho_client::aggregate::merge_keys(lists, u64::from(a.limit));
        for k in keys {
            let state = if k.complete { "" } else { " (writing)" };
            let tenant = if k.tenant.is_empty() { String::new() } else { format!("{}/", k.tenant) };
            println!("{tenant}{}\t{} bytes\t{} replica(s){state}", k.key, k.size, k.replicas);
        }
        Ok(f.partial())
    })
}

/// `tycho exist`: prints 1 or 0; exit code 0 if the key exists, 1 if not.
pub fn exist(a: KeyArgs) -> i32 {
    with_master(&a.target.master, |f| async move {
        let (c, key) = f.for_key(&a.tenant, &a.key)?;
        let req = Request::ExistKey(KeyQuery { key, tenant: a.tenant.clone() });
        let Response::Exists(found) = c.call(&req).await? else { return Err(ErrorCode::INTERNAL_ERROR) };
        println!("{}", u8::from(found));
        Ok(if found { 0 } else { 1 })
    })
}

/// `tycho rm`: a key at its group's primary; `--all` and `--regex` at every primary.
pub fn rm(a: RmArgs) -> i32 {
    with_master(&a.target.master, |f| async move {
        let every = if a.all && a.tenant.is_empty() {
            Some(Request::RemoveAll { force: a.force })
        } else if a.all {
            // `(?s)`: keys may contain newlines, which `.` alone does not match.
            Some(Request::RemoveByRegex { tenant: a.tenant.clone(), regex: "(?s).*".into(), force: a.force })
        } else {
            a.regex.clone().map(|regex| Request::RemoveByRegex { tenant: a.tenant.clone(), regex, force: a.force })
        };
        let every_removed = every.is_some();
        let removed = match every {
            Some(req) => {
                let mut n = 0;
                for r in f.each(&req).await? {
                    n += match r {
                        Response::Removed(k) => k,
                        _ => return Err(ErrorCode::INTERNAL_ERROR),
                    };
                }
                n
            }
            None => {
                let key = a.key.as_deref().expect("clap requires a key");
                let (c, key) = f.for_key(&a.tenant, key)?;
                c.call(&Request::Remove(RemoveKey { key, tenant: a.tenant.clone(), force: a.force })).await?;
                1
            }
        };
        println!("removed {removed}");
        Ok(if every_removed { f.partial() } else { 0 })
    })
}
