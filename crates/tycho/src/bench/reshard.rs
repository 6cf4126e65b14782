//! `tycho bench reshard`: what moving a KVPT group costs the clients that use it.
//!
//! On an etcd it starts, two masters of two groups, with snapshots in a temporary directory:
//! the first serves group 0, the second claims group 1. One client (fake segments, as in
//! `tycho bench master`: metadata only, no bytes move) writes `--objects` objects into group 0;
//! then each round runs the same load twice, first for `--duration` seconds without a reshard,
//! then while group 0 moves to the other master (so the rounds move it back and forth; each
//! move bootstraps the target from the group's latest snapshot and log). The load:
//! `--readers` connections reading random objects of the group (GetReplicaList) and
//! `--writers` connections writing new ones (PutStart + PutEnd), each routed by a route cache
//! that it refreshes from both masters on KVPT_NOT_OWNED, STALE_EPOCH or KVPT_MIGRATING, and
//! retried after a back-off of 20 ms doubling to 500 ms (as `tycho-client` does), within 15 s;
//! except that a writer refused with KVPT_MIGRATING tries again every 5 ms, to see when the
//! freeze ends.
//!
//! Per round it prints the reshard's total time (from the request until the request is
//! cleared and the routes name the target) and when the routes first named the target; the
//! write freeze as the writers saw it (from the first KVPT_MIGRATING to the first write
//! acknowledged after the last one) and the
//! longest pause between two acknowledged writes, with and without the reshard; and the read
//! p50 / p99 / max with and without it. Then the medians over the rounds, with their spread.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use rand::Rng;
use tycho_proto::*;
use tycho_routing::RouteCache;

use crate::bench::harness::{free_port, start_master_with, ChildGuard};
use crate::bench::master::{keep_alive, mount_fake, populate, FAKE_SEGMENTS};
use crate::master_client::{key_ref, MasterClient};

/// `tycho bench reshard` flags.
#[derive(Args, Debug, Clone)]
pub struct BenchReshardArgs {
    /// Objects in the group that moves, written before the first round.
    #[arg(long, default_value_t = 1_000_000)]
    objects: usize,
    /// Rounds (each a window without a reshard, then a reshard).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Connections reading objects of the group.
    #[arg(long, default_value_t = 4)]
    readers: usize,
    /// Connections writing new objects into the group.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Seconds of the window without a reshard in each round.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// The masters' `--snapshot-every` (records of log between two snapshots).
    #[arg(long, default_value_t = 100_000)]
    snapshot_every: u64,
    /// Keep the masters' logs (`master-0.log`, `master-1.log`) in this directory; by default
    /// they go to a temporary one, removed at the end.
    #[arg(long)]
    log_dir: Option<PathBuf>,
}

/// The group that moves.
const RANK: u32 = 0;
/// The cluster's groups.
const GROUPS: u32 = 2;
/// Value size the writes declare (nothing is transferred).
const VALUE_SIZE: u64 = 4096;
/// How long one call keeps retrying routing refusals.
const RETRY_BUDGET: Duration = Duration::from_secs(15);
/// How often a writer refused with KVPT_MIGRATING tries again.
const PROBE: Duration = Duration::from_millis(5);
/// How long a reshard may take before the bench gives up on it.
const RESHARD_WAIT: Duration = Duration::from_secs(180);

/// One master process.
struct Master {
    _guard: ChildGuard,
    addr: String,
    admin: String,
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Entry point; returns the exit code.
pub fn run(args: BenchReshardArgs) -> i32 {
    match run_inner(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// Starts a master of the bench's cluster on `etcd`, its snapshots in `dir` and its log in
/// `--log-dir` (else `dir`) as `master-N.log`.
fn start(etcd: &str, dir: &TempDir, n: usize, args: &BenchReshardArgs) -> Result<Master, String> {
    let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    let metrics = free_port();
    let snaps = dir.0.join("snapshots");
    cmd.args(["master", "--insecure", "--metrics-port", &metrics.to_string()]);
    cmd.args(["--kvpt-groups", &GROUPS.to_string(), "--etcd-endpoints", etcd, "--cluster-name", "bench-reshard"]);
    cmd.arg("--snapshot-dir").arg(&snaps).args(["--snapshot-every", &args.snapshot_every.to_string()]);
    let logs = args.log_dir.as_ref().unwrap_or(&dir.0);
    let log =
        std::fs::File::create(logs.join(format!("master-{n}.log"))).map_err(|e| format!("{}: {e}", logs.display()))?;
    cmd.stderr(Stdio::from(log));
    let (guard, addr) = start_master_with(10, cmd)?;
    Ok(Master { _guard: guard, addr, admin: format!("127.0.0.1:{metrics}") })
}

/// The routes as both masters know them (the higher epoch of each group wins).
async fn routes(conns: &[MasterClient]) -> RouteCache {
    let mut cache = RouteCache::new();
    for c in conns {
        if let Ok(Response::Routes(t)) = c.call(&Request::Routes).await {
            cache.learn(&t);
        }
    }
    cache
}

/// Waits (bounded) until the routes name `owners`, group by group.
async fn settled(conns: &[MasterClient], owners: &[&str]) -> Result<RouteCache, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let cache = routes(conns).await;
        if cache.table().owners.iter().map(String::as_str).eq(owners.iter().copied()) {
            return Ok(cache);
        }
        if Instant::now() > deadline {
            return Err(format!("the cluster did not settle on {owners:?} within 60 s: {:?}", cache.table()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `n` key names of group [`RANK`].
fn group_keys(n: usize) -> Vec<String> {
    (0u64..)
        .map(|i| format!("reshard/obj/{i:09}"))
        .filter(|k| tycho_routing::kvpt_to_rank(tycho_routing::partition_of("", k), GROUPS) == RANK)
        .take(n)
        .collect()
}

/// What the load saw, shared by its tasks (one thread).
#[derive(Default)]
struct Seen {
    /// Completed reads and writes: (completion time, latency in µs).
    reads: RefCell<Vec<(Instant, u32)>>,
    writes: RefCell<Vec<(Instant, u32)>>,
    /// When a write was refused with KVPT_MIGRATING.
    migrating: RefCell<Vec<Instant>>,
    /// Refusals the load retried, by call kind and code.
    refusals: RefCell<BTreeMap<String, u64>>,
    /// Calls that failed for good (another error, or the retry budget spent).
    failed: RefCell<Vec<String>>,
}

/// The load's shared state.
struct Load {
    routes: RefCell<RouteCache>,
    /// Where each master is: its address and a connection for the route refreshes.
    masters: Vec<(String, MasterClient)>,
    owner: ClientId,
    keys: Vec<String>,
    stop: Cell<bool>,
    seen: Seen,
}

impl Load {
    /// Calls the primary of group [`RANK`] with `make(routes)`, re-routing and retrying routing
    /// refusals as a client does.
    async fn call(
        &self,
        conns: &[MasterClient],
        kind: &str,
        make: impl Fn(&RouteCache) -> Request,
    ) -> Result<Response, String> {
        let deadline = Instant::now() + RETRY_BUDGET;
        let mut pause = Duration::from_millis(20);
        loop {
            let (owner, req) = {
                let r = self.routes.borrow();
                (r.owner(RANK).to_string(), make(&r))
            };
            let Some(i) = self.masters.iter().position(|(a, _)| *a == owner) else {
                return Err(format!("{kind}: the routes name an unknown master {owner:?}"));
            };
            let code = match conns[i].call(&req).await {
                Ok(resp) => return Ok(resp),
                Err(code @ (ErrorCode::KVPT_NOT_OWNED | ErrorCode::STALE_EPOCH | ErrorCode::KVPT_MIGRATING)) => code,
                Err(code) => return Err(format!("{kind}: {code:?}")),
            };
            *self.seen.refusals.borrow_mut().entry(format!("{kind} {code:?}")).or_insert(0) += 1;
            if kind == "write" && code == ErrorCode::KVPT_MIGRATING {
                self.seen.migrating.borrow_mut().push(Instant::now());
            }
            if Instant::now() >= deadline {
                return Err(format!("{kind}: still {code:?} after {RETRY_BUDGET:?}"));
            }
            let conns: Vec<MasterClient> = self.masters.iter().map(|(_, c)| c.clone()).collect();
            let fresh = routes(&conns).await;
            let moved = self.routes.borrow_mut().learn(fresh.table()) && self.routes.borrow().owner(RANK) != owner;
            if !moved && code == ErrorCode::KVPT_MIGRATING && kind == "write" {
                // The writers probe the freeze: they look again every 5 ms, so that its end
                // shows to within that (the client library backs off from 20 ms to 500 ms).
                tokio::time::sleep(PROBE).await;
            } else if !moved {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }

    /// `key` tagged with its group's epoch as the routes say.
    fn tagged(routes: &RouteCache, key: &str) -> KeyRef {
        let mut k = key_ref("", key);
        k.route.epoch = routes.epoch_of(k.route.partition_id);
        k
    }

    async fn reader(self: Rc<Self>, conns: Vec<MasterClient>) {
        while !self.stop.get() {
            let key = self.keys[rand::thread_rng().gen_range(0..self.keys.len())].clone();
            let t0 = Instant::now();
            let make = |r: &RouteCache| {
                Request::GetReplicaList(KeyQuery { tenant: String::new(), key: Self::tagged(r, &key) })
            };
            match self.call(&conns, "read", make).await {
                Ok(_) => {
                    let now = Instant::now();
                    self.seen.reads.borrow_mut().push((now, (now - t0).as_micros() as u32));
                }
                Err(e) => self.seen.failed.borrow_mut().push(e),
            }
        }
    }

    async fn writer(self: Rc<Self>, conns: Vec<MasterClient>, id: u64) {
        let mut seq = 0u64;
        while !self.stop.get() {
            seq += 1;
            let key = format!("reshard/new/{id}/{seq}");
            if tycho_routing::kvpt_to_rank(tycho_routing::partition_of("", &key), GROUPS) != RANK {
                continue;
            }
            let write_id = (id << 40) | seq;
            let owner = self.owner;
            let t0 = Instant::now();
            let start = |r: &RouteCache| {
                Request::PutStart(WriteStart {
                    client: owner,
                    tenant: String::new(),
                    key: Self::tagged(r, &key),
                    size: VALUE_SIZE,
                    config: ReplicateConfig::default(),
                    write_id,
                })
            };
            let end = |r: &RouteCache| {
                Request::PutEnd(WriteFinish {
                    client: owner,
                    tenant: String::new(),
                    key: Self::tagged(r, &key),
                    write_id,
                })
            };
            let done = match self.call(&conns, "write", start).await {
                Ok(_) => self.call(&conns, "write", end).await,
                Err(e) => Err(e),
            };
            match done {
                Ok(_) => {
                    let now = Instant::now();
                    self.seen.writes.borrow_mut().push((now, (now - t0).as_micros() as u32));
                }
                Err(e) => self.seen.failed.borrow_mut().push(e),
            }
        }
    }
}

/// What one window measured.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    reads: usize,
    p50: u32,
    p99: u32,
    max: u32,
    writes: usize,
    /// The longest time between two acknowledged writes, or from the window's start to the
    /// first (ms).
    write_pause_ms: f64,
}

fn window(seen: &Seen, from: Instant, to: Instant) -> Window {
    let mut lat: Vec<u32> =
        seen.reads.borrow().iter().filter(|(t, _)| *t >= from && *t <= to).map(|&(_, l)| l).collect();
    lat.sort_unstable();
    let pct = |p: f64| if lat.is_empty() { 0 } else { lat[((lat.len() - 1) as f64 * p).round() as usize] };
    let mut done: Vec<Instant> =
        seen.writes.borrow().iter().filter(|(t, _)| *t >= from && *t <= to).map(|&(t, _)| t).collect();
    done.sort_unstable();
    let mut last = from;
    let mut pause = Duration::ZERO;
    for t in done.iter().copied().chain([to]) {
        pause = pause.max(t - last);
        last = t;
    }
    Window {
        reads: lat.len(),
        p50: pct(0.5),
        p99: pct(0.99),
        max: lat.last().copied().unwrap_or(0),
        writes: done.len(),
        write_pause_ms: pause.as_secs_f64() * 1e3,
    }
}

/// What one reshard measured.
struct Round {
    total_ms: f64,
    switch_ms: f64,
    /// From the first KVPT_MIGRATING a writer saw to the last (0 without any).
    frozen_ms: f64,
    migrating: usize,
    without: Window,
    during: Window,
}

/// Polls (the admin calls on a worker thread) until group [`RANK`] is served by `target` and no
/// request is left; returns when the routes first named it and when it was done. A request
/// that ends without the switch is an error.
async fn follow_reshard(conns: &[MasterClient], target: &str, admin: &str) -> Result<(Instant, Instant), String> {
    let deadline = Instant::now() + RESHARD_WAIT;
    let mut switched = None;
    loop {
        let r = routes(conns).await;
        if switched.is_none() && r.owner(RANK) == target {
            switched = Some(Instant::now());
        }
        let admin = admin.to_string();
        let left = tokio::task::spawn_blocking(move || crate::admin::http_get(&admin, "/reshard"))
            .await
            .map_err(|e| e.to_string())??;
        let left: serde_json::Value = serde_json::from_str(&left).map_err(|e| format!("GET /reshard: {e}"))?;
        if left.as_array().is_some_and(|a| a.is_empty()) {
            // The request is gone: done if the routes name the target (a moment after the
            // switch they may not yet: look again), else abandoned.
            match switched {
                Some(at) => return Ok((at, Instant::now())),
                None if routes(conns).await.owner(RANK) == target => {
                    let now = Instant::now();
                    return Ok((now, now));
                }
                None => return Err(format!("the reshard to {target} was abandoned (see the masters' logs)")),
            }
        }
        if Instant::now() > deadline {
            return Err(format!("the reshard to {target} did not finish within {RESHARD_WAIT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn spread(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

fn run_inner(args: &BenchReshardArgs) -> Result<(), String> {
    if args.rounds == 0 || args.objects == 0 || args.readers + args.writers == 0 {
        return Err("--rounds, --objects and --readers + --writers must be positive".into());
    }
    let etcd = tycho_testkit::EtcdServer::start_new()
        .map_err(|e| format!("cannot start etcd (install etcd-server or set TYCHO_ETCD_BIN): {e}"))?;
    let endpoint = etcd.endpoint();
    let dir = TempDir(std::env::temp_dir().join(format!("tycho-bench-reshard-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let a = start(&endpoint, &dir, 0, args)?;
    let conn =
        |m: &Master| rt.block_on(MasterClient::connect(&m.addr)).map_err(|e| format!("cannot reach {}: {e:?}", m.addr));
    let ca = conn(&a)?;
    rt.block_on(settled(std::slice::from_ref(&ca), &[&a.addr, &a.addr]))?;
    let b = start(&endpoint, &dir, 1, args)?;
    let cb = conn(&b)?;
    let both = vec![ca.clone(), cb.clone()];
    let initial = rt.block_on(settled(&both, &[&a.addr, &b.addr]))?;
    println!(
        "tycho bench reshard: etcd {endpoint}, masters {} (group 0) and {} (group 1), snapshots every {} records; \
         {} readers and {} writers on group 0, {} s without a reshard per round, {} rounds",
        a.addr, b.addr, args.snapshot_every, args.readers, args.writers, args.duration, args.rounds
    );
    let owner = ClientId(rand::random());
    let alive = Arc::new(AtomicBool::new(true));
    let keys = group_keys(args.objects);
    rt.block_on(async {
        for c in &both {
            for s in 0..FAKE_SEGMENTS {
                mount_fake(c, owner, s).await?;
            }
            keep_alive(c.clone(), owner, alive.clone());
        }
        let t0 = Instant::now();
        let tagged: Vec<KeyRef> = keys.iter().map(|k| Load::tagged(&initial, k)).collect();
        populate(&ca, owner, &tagged, 1000, ReplicateConfig::default()).await?;
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "wrote {} objects into group 0 in {secs:.1} s ({:.0} objects/s)",
            keys.len(),
            keys.len() as f64 / secs
        );
        Ok::<(), String>(())
    })?;
    let masters = [(a.addr.clone(), a.admin.clone()), (b.addr.clone(), b.admin.clone())];
    let load = Rc::new(Load {
        routes: RefCell::new(initial),
        masters: masters.iter().zip(&both).map(|((addr, _), c)| (addr.clone(), c.clone())).collect(),
        owner,
        keys,
        stop: Cell::new(false),
        seen: Seen::default(),
    });
    let local = tokio::task::LocalSet::new();
    let rounds = local.block_on(&rt, async {
        let mut tasks = Vec::new();
        for i in 0..args.readers + args.writers {
            let mut conns = Vec::new();
            for (addr, _) in &masters {
                conns.push(MasterClient::connect(addr).await.map_err(|e| format!("connect: {e:?}"))?);
            }
            let l = load.clone();
            tasks.push(if i < args.readers {
                tokio::task::spawn_local(l.reader(conns))
            } else {
                tokio::task::spawn_local(l.writer(conns, i as u64))
            });
        }
        println!(
            "\n{:>5} {:>6} {:>9} {:>9} {:>9} {:>6} {:>12} {:>12} {:>22} {:>22}",
            "round",
            "to",
            "total ms",
            "switch ms",
            "frozen ms",
            "MIGR",
            "w-pause ms",
            "w-pause ms",
            "reads p50/p99/max us",
            "reads p50/p99/max us"
        );
        println!(
            "{:>5} {:>6} {:>9} {:>9} {:>9} {:>6} {:>12} {:>12} {:>22} {:>22}",
            "", "", "", "", "", "", "without", "during", "without", "during"
        );
        let mut rounds = Vec::new();
        for round in 0..args.rounds {
            let from = Instant::now();
            tokio::time::sleep(Duration::from_secs_f64(args.duration)).await;
            let without = window(&load.seen, from, Instant::now());
            let source = routes(&both).await.owner(RANK).to_string();
            let (target, target_admin) = masters.iter().find(|(a, _)| *a != source).cloned().expect("two masters");
            let (_, source_admin) = masters.iter().find(|(a, _)| *a == source).cloned().expect("two masters");
            let migrating_before = load.seen.migrating.borrow().len();
            let requested = Instant::now();
            let path = format!("/reshard?rank={RANK}&target={target}");
            tokio::task::spawn_blocking(move || crate::admin::http_call(&source_admin, "POST", &path, None))
                .await
                .map_err(|e| e.to_string())??;
            let (switched, done) = follow_reshard(&both, &target, &target_admin).await?;
            let during = window(&load.seen, requested, done);
            let migrating: Vec<Instant> = load.seen.migrating.borrow()[migrating_before..].to_vec();
            // From the first refusal to the first write acknowledged after the last one.
            let frozen_ms = match (migrating.first(), migrating.last()) {
                (Some(f), Some(l)) => {
                    let thawed = load.seen.writes.borrow().iter().map(|(t, _)| *t).filter(|t| t > l).min();
                    (thawed.unwrap_or(*l) - *f).as_secs_f64() * 1e3
                }
                _ => 0.0,
            };
            let r = Round {
                total_ms: (done - requested).as_secs_f64() * 1e3,
                switch_ms: (switched - requested).as_secs_f64() * 1e3,
                frozen_ms,
                migrating: migrating.len(),
                without,
                during,
            };
            let lat = |w: &Window| format!("{}/{}/{}", w.p50, w.p99, w.max);
            println!(
                "{:>5} {:>6} {:>9.0} {:>9.0} {:>9.1} {:>6} {:>12.1} {:>12.1} {:>22} {:>22}",
                round + 1,
                if target == a.addr { "A" } else { "B" },
                r.total_ms,
                r.switch_ms,
                r.frozen_ms,
                r.migrating,
                r.without.write_pause_ms,
                r.during.write_pause_ms,
                lat(&r.without),
                lat(&r.during)
            );
            rounds.push(r);
        }
        load.stop.set(true);
        for t in tasks {
            t.await.map_err(|e| e.to_string())?;
        }
        Ok::<Vec<Round>, String>(rounds)
    })?;
    alive.store(false, Ordering::Relaxed);
    summarize(&rounds, &load.seen);
    let failed = load.seen.failed.borrow();
    drop((a, b));
    drop(etcd);
    if !failed.is_empty() {
        return Err(format!("{} calls failed: {:?}", failed.len(), &failed[..failed.len().min(5)]));
    }
    println!("no call failed");
    Ok(())
}

fn summarize(rounds: &[Round], seen: &Seen) {
    let show = |name: &str, v: Vec<f64>| {
        let (lo, hi) = spread(&v);
        println!("{name:<44} median {:>9.1}   spread {lo:.1} – {hi:.1}", median(v));
    };
    println!();
    show("reshard total, ms", rounds.iter().map(|r| r.total_ms).collect());
    show("request to the switch, ms", rounds.iter().map(|r| r.switch_ms).collect());
    show("write freeze, first refusal to next ack, ms", rounds.iter().map(|r| r.frozen_ms).collect());
    show("longest write pause during a reshard, ms", rounds.iter().map(|r| r.during.write_pause_ms).collect());
    show("longest write pause without one, ms", rounds.iter().map(|r| r.without.write_pause_ms).collect());
    show("read p99 during a reshard, us", rounds.iter().map(|r| r.during.p99 as f64).collect());
    show("read p99 without one, us", rounds.iter().map(|r| r.without.p99 as f64).collect());
    show(
        "read p99 ratio, during / without",
        rounds.iter().map(|r| r.during.p99 as f64 / (r.without.p99.max(1) as f64)).collect(),
    );
    let reads: usize = rounds.iter().map(|r| r.during.reads + r.without.reads).sum();
    let writes: usize = rounds.iter().map(|r| r.during.writes + r.without.writes).sum();
    println!("measured: {reads} reads and {writes} writes; refusals retried: {:?}", seen.refusals.borrow());
}
