//! `tycho bench master --groups G [--masters M]`: what the partitioned plane costs and gives.
//!
//! - `--groups G` (one master): a master of G KVPT groups against a master of one, in
//!   alternating rounds of each workload, by calls per master CPU-second (the master's own
//!   user + system time over the round), first without the OpLog and then with it, on an etcd
//!   the bench starts. With the OpLog it also reads etcd's own request counters
//!   (`grpc_server_started_total` of unary calls, by gRPC method: keep-alives and watches are
//!   streams and not counted) and the master's committed log batches around each round, so that
//!   each etcd request on the request path is accounted for.
//! - `--masters M`: a cluster of M masters on that etcd, each pinned to its own core and the
//!   primary of its share of the groups, against one master serving every group, both with the
//!   OpLog; the load goes to each key's primary.

use std::collections::BTreeMap;
use std::process::Command;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tycho_proto::*;
use tycho_routing::RouteCache;

use crate::bench::harness::{cpu_of, free_port, start_master_with, switches_of, ChildGuard};
use crate::bench::master::{
    drive, keep_alive, mount_fake, paired, populate, remove_written, BenchMasterArgs, Routing, FAKE_SEGMENTS,
};
use crate::master_client::{key_ref, MasterClient};

/// One master process of a measured setup.
struct Proc {
    _guard: ChildGuard,
    pid: u32,
    addr: String,
    admin: String,
}

/// One master's share of the load: its keys for the read workloads and, in a cluster of
/// several, which groups it writes to.
type Share = (Rc<Vec<KeyRef>>, Option<Rc<Routing>>);

/// The masters of one setup, with where each key goes.
struct Setup {
    name: String,
    procs: Vec<Proc>,
    /// Per master: its keys for the read workloads and, in a cluster of several, which groups
    /// it writes to.
    targets: Vec<Share>,
}

/// Counters read before and after a round, and their difference over it: etcd's unary requests
/// by gRPC method, the masters' committed log batches and their commit times added up (each
/// batch of a shared transaction counts it), seconds.
#[derive(Default)]
struct Counters {
    etcd: BTreeMap<String, f64>,
    batches: f64,
    commit_secs: f64,
}

impl Counters {
    /// What changed since `before` (etcd methods that did not move are left out).
    fn since(self, before: &Counters) -> Counters {
        let mut etcd = self.etcd;
        for (k, v) in etcd.iter_mut() {
            *v -= before.etcd.get(k).copied().unwrap_or(0.0);
        }
        etcd.retain(|_, v| *v > 0.0);
        Counters { etcd, batches: self.batches - before.batches, commit_secs: self.commit_secs - before.commit_secs }
    }
}

/// What one round of one workload on one setup measured.
struct Round {
    ops: u64,
    secs: f64,
    /// The setup's masters' CPU time over the round, seconds.
    cpu: f64,
    /// The setup's masters' context switches over the round, every thread's.
    switches: u64,
    /// etcd and log counters over the round.
    log: Counters,
}

impl Round {
    fn per_cpu_second(&self) -> f64 {
        self.ops as f64 / self.cpu.max(1e-9)
    }
    fn switches_per_call(&self) -> f64 {
        self.switches as f64 / self.ops.max(1) as f64
    }
    fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.secs
    }
    /// The masters' CPU use over the round, in cores: well under what the masters could use
    /// means they waited (on etcd, or on the load generator) rather than worked.
    fn cores(&self) -> f64 {
        self.cpu / self.secs.max(1e-9)
    }
    /// Mean time to commit one log batch, milliseconds (0 without a log).
    fn commit_ms(&self) -> f64 {
        if self.log.batches > 0.0 {
            self.log.commit_secs / self.log.batches * 1e3
        } else {
            0.0
        }
    }
}

/// Entry point of both comparisons.
pub fn run(args: &BenchMasterArgs) -> Result<(), String> {
    if args.masters > 1 {
        return masters_compare(args);
    }
    groups_compare(args)
}

/// Starts a master of `groups` groups (on `etcd` in cluster `cluster` when given), pinned to
/// `core` when given.
fn start(groups: u32, etcd: Option<&str>, cluster: &str, core: Option<usize>) -> Result<Proc, String> {
    let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    let metrics = free_port();
    cmd.args(["master", "--insecure", "--metrics-port", &metrics.to_string()]);
    cmd.args(["--kvpt-groups", &groups.to_string()]);
    if let Some(endpoint) = etcd {
        // A long registration lease: the load saturates the machine, and a master whose
        // renewals starve would stand down in the middle of a round.
        cmd.args(["--etcd-endpoints", endpoint, "--cluster-name", cluster, "--ha-lease-ttl", "30"]);
    }
    if let Some(core) = core {
        pin(&mut cmd, core);
    }
    let (guard, addr) = start_master_with(10, cmd)?;
    let pid = guard.0.id();
    Ok(Proc { _guard: guard, pid, addr, admin: format!("127.0.0.1:{metrics}") })
}

/// Runs the command's process, and every thread it starts, on CPU `core` only.
fn pin(cmd: &mut Command, core: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec the closure only calls sched_setaffinity on the child
    // itself, with a set built on its stack: no allocation, no locks.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Sums the samples of `metric` in a Prometheus text page whose labels satisfy `keep`, by the
/// value of label `by` ("" sums everything under one key).
fn scrape(page: &str, metric: &str, by: &str, keep: impl Fn(&str) -> bool) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix(metric) else { continue };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once("} ") {
                Some((l, v)) => (l, v),
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(v) => ("", v),
                None => continue,
            },
        };
        if !keep(labels) {
            continue;
        }
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        let key = labels
            .split(',')
            .find_map(|kv| kv.strip_prefix(by).and_then(|r| r.strip_prefix("=\"")).map(|r| r.trim_end_matches('"')))
            .unwrap_or("")
            .to_string();
        *out.entry(if by.is_empty() { String::new() } else { key }).or_insert(0.0) += v;
    }
    out
}

/// etcd's unary requests so far, by gRPC method.
fn etcd_requests(etcd: &str) -> Result<BTreeMap<String, f64>, String> {
    let page = crate::admin::http_get(etcd, "/metrics")?;
    Ok(scrape(&page, "grpc_server_started_total", "grpc_method", |l| l.contains("grpc_type=\"unary\"")))
}

/// Log batches the masters committed so far, and their commit times added up (seconds).
fn batches(procs: &[Proc]) -> Result<(f64, f64), String> {
    let (mut n, mut secs) = (0.0, 0.0);
    for p in procs {
        let page = crate::admin::http_get(&p.admin, "/metrics")?;
        n += scrape(&page, "tycho_oplog_batches_total", "", |_| true).values().sum::<f64>();
        secs += scrape(&page, "tycho_oplog_commit_seconds_sum", "", |_| true).values().sum::<f64>();
    }
    Ok((n, secs))
}

/// Waits (bounded) until the route table of the cluster behind `procs[0]` names a primary for
/// every group, `distinct` different ones, each of them answering as a serving master.
async fn settled_routes(procs: &[Proc], groups: u32, distinct: usize) -> Result<RouteCache, String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut cache = RouteCache::new();
        for p in procs {
            if let Ok(c) = MasterClient::connect(&p.addr).await {
                if let Ok(Response::Routes(t)) = c.call(&Request::Routes).await {
                    cache.learn(&t);
                }
            }
        }
        let t = cache.table();
        let named = t.owners.len() == groups as usize && t.owners.iter().all(|o| !o.is_empty());
        if named && cache.owners().len() == distinct {
            return Ok(cache);
        }
        let last = format!("{:?} at epochs {:?}", t.owners, t.epochs);
        if Instant::now() > deadline {
            return Err(format!("the cluster did not settle on {distinct} primaries within 60 s: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Setup {
    /// Mounts the fake segments of `owner` on every master (waiting, bounded, until each
    /// serves), keeps it alive there, and writes each master's share of `keys`.
    async fn prepare(&self, owner: ClientId, alive: &Arc<AtomicBool>) -> Result<(), String> {
        for (p, (mine, _)) in self.procs.iter().zip(&self.targets) {
            let c = MasterClient::connect(&p.addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while let Err(e) = mount_fake(&c, owner, 0).await {
                if Instant::now() > deadline {
                    return Err(format!("the master at {} does not serve: {e}", p.addr));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for s in 1..FAKE_SEGMENTS {
                mount_fake(&c, owner, s).await?;
            }
            keep_alive(c.clone(), owner, alive.clone());
            populate(&c, owner, mine, 1000, ReplicateConfig::default()).await?;
        }
        Ok(())
    }

    /// One round of workload `w`: every master's connections at once, for `args.duration`.
    async fn round(
        &self,
        w: &str,
        args: &BenchMasterArgs,
        owner: ClientId,
        etcd: Option<&str>,
    ) -> Result<Round, String> {
        let counted = |etcd: Option<&str>| -> Result<Counters, String> {
            match etcd {
                Some(e) => {
                    let (batches, commit_secs) = batches(&self.procs)?;
                    Ok(Counters { etcd: etcd_requests(e)?, batches, commit_secs })
                }
                None => Ok(Counters::default()),
            }
        };
        let local = tokio::task::LocalSet::new();
        // When the round started, with the masters' CPU time and context switches then.
        type Start = (Instant, f64, u64);
        let started: Rc<std::cell::Cell<Option<Start>>> = Rc::default();
        let duration = Duration::from_secs_f64(args.duration);
        let first = started.clone();
        let procs_cpu = {
            let pids: Vec<u32> = self.procs.iter().map(|p| p.pid).collect();
            move || {
                let cpu = pids.iter().filter_map(|&p| cpu_of(p)).sum::<f64>();
                (cpu, pids.iter().map(|&p| switches_of(p)).sum::<u64>())
            }
        };
        let cpu_at_start = procs_cpu.clone();
        let until: Rc<dyn Fn() -> bool> = Rc::new(move || {
            let (t0, _, _) = first.get().unwrap_or_else(|| {
                let (cpu, switches) = cpu_at_start();
                first.set(Some((Instant::now(), cpu, switches)));
                first.get().expect("just set")
            });
            t0.elapsed() >= duration
        });
        let before = counted(etcd)?;
        let mut per = args.clone();
        per.connections = (args.connections / self.procs.len()).max(1);
        per.rate = args.rate.map(|r| r / self.procs.len() as f64);
        let drives = self.procs.iter().zip(&self.targets).map(|(p, (keys, routing))| {
            let (per, until, keys, routing) = (&per, until.clone(), keys.clone(), routing.clone());
            async move { drive(&p.addr, w, per, owner, keys, until, routing).await }
        });
        let results = local.run_until(futures_util::future::try_join_all(drives)).await?;
        let (t0, cpu0, switches0) = started.get().unwrap_or_else(|| {
            let (cpu, switches) = procs_cpu();
            (Instant::now(), cpu, switches)
        });
        let secs = t0.elapsed().as_secs_f64();
        let (cpu1, switches1) = procs_cpu();
        let (cpu, switches) = (cpu1 - cpu0, switches1.saturating_sub(switches0));
        let after = counted(etcd)?;
        let (mut ops, mut errs) = (0, 0);
        for (o, _, _, e) in results {
            ops += o;
            errs += e;
        }
        if errs > 0 {
            return Err(format!("{}: workload {w}: {errs} calls failed", self.name));
        }
        // What a write workload wrote goes, untimed, so that every round starts alike.
        if matches!(w, "put" | "batch-put") {
            for p in &self.procs {
                remove_written(&p.addr, w).await?;
            }
        }
        Ok(Round { ops, secs, cpu, switches, log: after.since(&before) })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() - 1])
}

/// The keys of the read workloads.
fn key_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("bench/key/{i:08}")).collect()
}

/// The lowest median ratios of calls per master CPU-second in a comparison: over the rounds in
/// which each setup was called as fast as it answered, and over those at one offered rate
/// (`None`: none were run).
#[derive(Debug, Clone, Copy)]
struct Lowest {
    free: f64,
    paced: Option<f64>,
}

impl Lowest {
    const NONE: Lowest = Lowest { free: f64::INFINITY, paced: None };

    fn min(self, other: Lowest) -> Lowest {
        let paced = match (self.paced, other.paced) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        Lowest { free: self.free.min(other.free), paced }
    }
}

impl std::fmt::Display for Lowest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.3} called as fast as each answers", self.free)?;
        if let Some(p) = self.paced {
            write!(f, ", {p:.3} at one offered rate")?;
        }
        Ok(())
    }
}

/// Both setups through every workload in alternating rounds (and, unless `--paced 0`, again
/// at one offered rate); prints each workload's figures and returns the lowest median ratios
/// (`a` over `b`) of calls per master CPU-second.
fn compare(args: &BenchMasterArgs, a: &Setup, b: &Setup, etcd: Option<&str>) -> Result<Lowest, String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let alive = Arc::new(AtomicBool::new(true));
    let worst = rt.block_on(async {
        let (oa, ob) = (ClientId(rand::random()), ClientId(rand::random()));
        a.prepare(oa, &alive).await?;
        b.prepare(ob, &alive).await?;
        let mut worst = Lowest::NONE;
        println!(
            "{:<12} {:>13} {:>13} {:>7} {:>13}   {:>11} {:>11} {:>7}   {:>11}   etcd requests per round, mean ({})",
            "workload",
            format!("{} /cpu-s", a.name),
            format!("{} /cpu-s", b.name),
            "ratio",
            "min..max",
            format!("{} ops/s", a.name),
            format!("{} ops/s", b.name),
            "ratio",
            "cores",
            a.name
        );
        for w in &args.workloads {
            let (ra, rb) = rounds(w, args, a, b, (oa, ob), etcd).await?;
            worst.free = worst.free.min(report(w, &ra, &rb, etcd.is_some()));
            if args.paced > 0.0 && args.rate.is_none() {
                // The same work for both: a share of what the slower of them sustained.
                let slower = median(ra.iter().map(Round::ops_per_sec).collect())
                    .min(median(rb.iter().map(Round::ops_per_sec).collect()));
                let rate = (args.paced * slower).max(1.0);
                let mut paced = args.clone();
                paced.rate = Some(rate);
                let (ra, rb) = rounds(w, &paced, a, b, (oa, ob), etcd).await?;
                let m = report(&format!("  @{rate:.0}/s"), &ra, &rb, etcd.is_some());
                worst = worst.min(Lowest { free: f64::INFINITY, paced: Some(m) });
            }
        }
        Ok::<Lowest, String>(worst)
    });
    alive.store(false, Ordering::Relaxed);
    worst
}

/// `args.rounds` rounds of workload `w` on each setup, alternating which goes first; each
/// round's figures go to stderr.
async fn rounds(
    w: &str,
    args: &BenchMasterArgs,
    a: &Setup,
    b: &Setup,
    (oa, ob): (ClientId, ClientId),
    etcd: Option<&str>,
) -> Result<(Vec<Round>, Vec<Round>), String> {
    let (mut ra, mut rb) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let x = || a.round(w, args, oa, etcd);
        let y = || b.round(w, args, ob, etcd);
        let (x, y) = paired(round, x, y).await?;
        eprintln!(
            "  {w}{} round {}: {} {:.0} ops/s, {:.0} per cpu-s, {:.2} cores, commit {:.2} ms, {:.2} switches/call; \
             {} {:.0} ops/s, {:.0} per cpu-s, {:.2} cores, commit {:.2} ms, {:.2} switches/call; etcd {:?} / {:?}, batches {} / {}",
            args.rate.map(|r| format!(" @{r:.0}/s")).unwrap_or_default(),
            round + 1,
            a.name,
            x.ops_per_sec(),
            x.per_cpu_second(),
            x.cores(),
            x.commit_ms(),
            x.switches_per_call(),
            b.name,
            y.ops_per_sec(),
            y.per_cpu_second(),
            y.cores(),
            y.commit_ms(),
            y.switches_per_call(),
            x.log.etcd,
            y.log.etcd,
            x.log.batches,
            y.log.batches
        );
        ra.push(x);
        rb.push(y);
    }
    Ok((ra, rb))
}

/// Prints one row of the table: the median figures of `ra` against `rb`; returns the median
/// ratio of calls per master CPU-second.
fn report(label: &str, ra: &[Round], rb: &[Round], logged: bool) -> f64 {
    let ratios: Vec<f64> = ra.iter().zip(rb).map(|(x, y)| x.per_cpu_second() / y.per_cpu_second()).collect();
    let tput: Vec<f64> = ra.iter().zip(rb).map(|(x, y)| x.ops_per_sec() / y.ops_per_sec()).collect();
    let m = median(ratios.clone());
    let (lo, hi) = spread(ratios);
    // etcd requests per round of `a` (mean), next to its log batches.
    let mut by_method: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in ra {
        for (k, v) in &r.log.etcd {
            by_method.entry(k.clone()).or_default().push(*v);
        }
    }
    let etcd_text = if !logged {
        "-".to_string()
    } else {
        let methods: Vec<String> =
            by_method.into_iter().map(|(k, v)| format!("{k} {:.0}", v.iter().sum::<f64>() / ra.len() as f64)).collect();
        let b = ra.iter().map(|r| r.log.batches).sum::<f64>() / ra.len() as f64;
        let commits = if b > 0.0 {
            let ms = |rs: &[Round]| median(rs.iter().map(Round::commit_ms).collect());
            format!("; commit {:.2} / {:.2} ms", ms(ra), ms(rb))
        } else {
            String::new()
        };
        format!("{}; log batches {b:.0}{commits}", if methods.is_empty() { "none".into() } else { methods.join(", ") })
    };
    println!(
        "{label:<12} {:>13.0} {:>13.0} {m:>7.3} {lo:>6.3}..{hi:<6.3}   {:>11.0} {:>11.0} {:>7.3}   {:>4.2} / {:<4.2}   {etcd_text}",
        median(ra.iter().map(Round::per_cpu_second).collect()),
        median(rb.iter().map(Round::per_cpu_second).collect()),
        median(ra.iter().map(Round::ops_per_sec).collect()),
        median(rb.iter().map(Round::ops_per_sec).collect()),
        median(tput),
        median(ra.iter().map(Round::cores).collect()),
        median(rb.iter().map(Round::cores).collect()),
    );
    m
}

/// A setup of one master serving every group (no routing needed: one master).
fn single(name: &str, p: Proc, keys: &[String]) -> Setup {
    let tagged = Rc::new(keys.iter().map(|k| key_ref("", k)).collect());
    Setup { name: name.into(), procs: vec![p], targets: vec![(tagged, None)] }
}

fn start_etcd() -> Result<tycho_testkit::EtcdServer, String> {
    tycho_testkit::EtcdServer::start_new()
        .map_err(|e| format!("cannot start etcd (install etcd-server or set TYCHO_ETCD_BIN): {e}"))
}

/// `--groups G` with one master.
fn groups_compare(args: &BenchMasterArgs) -> Result<(), String> {
    let g = args.groups;
    let keys = key_names(args.keys);
    println!(
        "one master, G = {g} against G = 1: {} connections x {} in flight, {}s rounds, {} rounds each",
        args.connections, args.inflight, args.duration, args.rounds
    );
    let mut lowest = Lowest::NONE;
    for oplog in [false, true] {
        let etcd = if oplog { Some(start_etcd()?) } else { None };
        let endpoint = etcd.as_ref().map(|e| e.endpoint());
        let metrics = etcd.as_ref().map(|e| e.client_addr().to_string());
        println!(
            "\nOpLog {}",
            if oplog { format!("on (etcd {})", endpoint.as_deref().unwrap_or("")) } else { "off".into() }
        );
        let many = single(&format!("G={g}"), start(g, endpoint.as_deref(), "bench-groups-many", None)?, &keys);
        let one = single("G=1", start(1, endpoint.as_deref(), "bench-groups-one", None)?, &keys);
        let worst = compare(args, &many, &one, metrics.as_deref())?;
        println!("lowest median ratio of calls per master CPU-second, G = {g} over G = 1: {worst}");
        lowest = lowest.min(worst);
        // The masters before their etcd.
        drop((many, one));
        drop(etcd);
    }
    println!("\nlowest median ratio over both: {lowest} (target: at least 0.9)");
    Ok(())
}

/// `--masters M`.
fn masters_compare(args: &BenchMasterArgs) -> Result<(), String> {
    let m = args.masters as usize;
    let g = args.groups.max(args.masters);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let keys = key_names(args.keys);
    let etcd = start_etcd()?;
    let endpoint = etcd.endpoint();
    let metrics = etcd.client_addr().to_string();
    println!(
        "M = {m} masters (one per core of {cores}) against one master, G = {g}, OpLog on (etcd {endpoint}): \
         {} connections x {} in flight, {}s rounds, {} rounds each",
        args.connections, args.inflight, args.duration, args.rounds
    );
    // The cluster: the first master creates the groups, the others claim theirs.
    let mut procs = vec![start(g, Some(&endpoint), "bench-masters", Some(0))?];
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(settled_routes(&procs, g, 1))?;
    for i in 1..m {
        procs.push(start(g, Some(&endpoint), "bench-masters", Some(i % cores))?);
    }
    let routes = rt.block_on(settled_routes(&procs, g, m))?;
    let t = routes.table();
    println!("primaries: {:?} at epochs {:?}", t.owners, t.epochs);
    let targets = procs
        .iter()
        .map(|p| {
            let mine: Vec<bool> = t.owners.iter().map(|o| *o == p.addr).collect();
            let routing = Routing { cache: routes.clone(), mine };
            let keys: Vec<KeyRef> = keys.iter().filter_map(|k| routing.tag(k)).collect();
            (Rc::new(keys), Some(Rc::new(routing)))
        })
        .collect();
    drop(rt);
    let cluster = Setup { name: format!("M={m}"), procs, targets };
    let one = single("M=1", start(g, Some(&endpoint), "bench-masters-one", None)?, &keys);
    let worst = compare(args, &cluster, &one, Some(&metrics))?;
    println!("lowest median ratio of calls per master CPU-second, M = {m} over M = 1: {worst}");
    drop((cluster, one));
    drop(etcd);
    Ok(())
}
