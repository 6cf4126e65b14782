//! `tycho bench master`: metadata-only load against a master, as Mooncake's master_bench.
//!
//! Fake segments are mounted (no memory behind them), keys are pre-populated, then each
//! workload runs N connections × M calls in flight for a fixed time. `--baseline redis`
//! runs `redis-benchmark` with the same concurrency against a `redis-server` started on a
//! free loopback port and prints the ratios.

use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use rand::Rng;
use tycho_proto::*;

use crate::bench::harness::{cpu_of, cpu_self, free_port, machine_cpu, start_master, wait_for_port, ChildGuard};
use crate::master_client::{key_ref, MasterClient};

/// `tycho bench master` flags.
#[derive(Args, Debug, Clone)]
pub struct BenchMasterArgs {
    /// Master to load; when absent, one is started on a free loopback port.
    #[arg(long)]
    master: Option<String>,
    /// Connections.
    #[arg(long, short = 'c', default_value_t = 50)]
    pub connections: usize,
    /// Calls in flight per connection.
    #[arg(long, short = 'm', default_value_t = 1)]
    pub inflight: usize,
    /// Seconds per workload.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Keys pre-populated for the read workloads.
    #[arg(long, default_value_t = 100_000)]
    pub keys: usize,
    /// Keys per batch call.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Workloads to run (comma-separated): put, get, exist, batch-put, batch-get, batch-exist.
    #[arg(long, value_delimiter = ',', default_value = "put,get,exist,batch-put,batch-get,batch-exist")]
    pub workloads: Vec<String>,
    /// Also run redis-benchmark at the same concurrency and print the ratios.
    #[arg(long, value_parser = ["redis"])]
    baseline: Option<String>,
    /// Measure GetReplicaList latency while a client holding this many objects expires.
    #[arg(long)]
    expire_during: bool,
    /// Objects held by the expiring client in `--expire-during`.
    #[arg(long, default_value_t = 1_000_000)]
    expire_objects: usize,
    /// Compare two masters, one with the self-probe on and one with it off, in alternating
    /// rounds of each workload.
    #[arg(long)]
    probe_compare: bool,
    /// Self-probe interval of the probing master in `--probe-compare`, seconds.
    #[arg(long, default_value_t = 5.0)]
    probe_interval: f64,
    /// Rounds per master in `--probe-compare`, `--compare-insecure` and `--against`.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Compare two masters, one with authentication and capabilities (the benchmark then acts
    /// as a registered client) and one started `--insecure`, in alternating rounds of each
    /// workload; prints each workload's median ratio and its spread.
    #[arg(long = "compare-insecure")]
    compare_insecure: bool,
    /// With `--compare-insecure`: start the first master `--insecure` too, to measure the
    /// comparison's own noise (its ratios should straddle 1).
    #[arg(long, requires = "compare_insecure")]
    control: bool,
    /// PutStart+PutEnd against a master logging to etcd (HA, on an etcd the bench starts) and
    /// one without, in alternating rounds, next to etcd's own rate of sequential puts from one
    /// client, measured between them. Both masters run `--insecure`.
    #[arg(long)]
    oplog: bool,
    /// This build's master against the master of another build of the same wire version (the
    /// path of its `tycho` executable), both logging to etcd (HA, on an etcd the bench starts)
    /// and `--insecure`, in alternating rounds of each workload: what a change of the master
    /// costs. For the read gate: build the baseline with
    /// `--features tycho-master/bench-no-read-gate`.
    #[arg(long, value_name = "TYCHO")]
    against: Option<std::path::PathBuf>,
    /// KVPT groups. Above 1 (with one master): a master of G groups against a master of one,
    /// in alternating rounds, by ops per master CPU-second, without and then with the OpLog
    /// (on an etcd the bench starts, whose request counts it reads per gRPC method).
    #[arg(long, alias = "kvpt-groups", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub groups: u32,
    /// Masters. Above 1: a cluster of M masters on an etcd the bench starts, each pinned to
    /// its own core and the primary of its share of the groups (G = M unless `--groups` says
    /// more), against one master serving every group, in alternating rounds.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub masters: u32,
    /// Offer calls at this rate (calls per second over all connections) instead of as fast
    /// as the master answers: each call slot waits for its turn before it calls.
    #[arg(long)]
    pub rate: Option<f64>,
    /// With `--groups` or `--masters`: after each workload's rounds, as many rounds again at
    /// one offered rate for both setups, this fraction of the slower one's median throughput,
    /// so that the two masters' CPU is compared for the same work (0: no such rounds).
    #[arg(long, default_value_t = 0.7, value_parser = parse_fraction)]
    pub paced: f64,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s:?} is not a fraction from 0 to 1")),
    }
}

const VALUE_SIZE: u64 = 4096;
const FAKE_SEGMENT: u64 = 256 << 30;
pub(crate) const FAKE_SEGMENTS: u128 = 4;

pub(crate) struct Stats {
    name: String,
    ops: u64,
    keys: u64,
    secs: f64,
    lat_us: Vec<u32>,
    client_cpu: f64,
    server_cpu: Option<f64>,
    /// CPU seconds the whole machine spent busy (all processes and the kernel) and idle.
    machine: (f64, f64),
}

impl Stats {
    fn pct(&self, p: f64) -> u32 {
        if self.lat_us.is_empty() {
            return 0;
        }
        let i = ((self.lat_us.len() as f64 - 1.0) * p).round() as usize;
        self.lat_us[i]
    }
    fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.secs
    }
    fn keys_per_sec(&self) -> f64 {
        self.keys as f64 / self.secs
    }
}

/// The workloads against one master (several groups or masters: [`crate::bench::scale`]).
pub fn run(args: BenchMasterArgs) -> Result<(), String> {
    if args.probe_compare {
        return probe_compare(&args);
    }
    if args.compare_insecure {
        return compare_insecure(&args);
    }
    if args.oplog {
        return oplog_compare(&args);
    }
    if let Some(other) = &args.against {
        return compare_builds(&args, other);
    }
    let ttl = if args.expire_during { 2 } else { 10 };
    let (child, addr) = match &args.master {
        Some(a) => (None, a.clone()),
        None => {
            let (c, a) = start_master(ttl, &[])?;
            (Some(c), a)
        }
    };
    let server_pid = child.as_ref().map(|c| c.0.id());
    println!(
        "tycho bench master: {addr}, {} connections x {} in flight, {}s per workload, {} keys, batch {}",
        args.connections, args.inflight, args.duration, args.keys, args.batch
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let owner = ClientId(rand::random());
    let keys: Rc<Vec<KeyRef>> = Rc::new((0..args.keys).map(|i| key_ref("", &format!("bench/key/{i:08}"))).collect());
    let pinging = Arc::new(AtomicBool::new(true));
    rt.block_on(async {
        let c = MasterClient::connect(&addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
        prepare(&c, owner, &keys, &pinging).await?;
        let mut results = Vec::new();
        for w in &args.workloads {
            let st = run_workload(&addr, w, &args, owner, keys.clone(), server_pid).await?;
            print_row(&st);
            results.push(st);
        }
        if args.expire_during {
            expire_during(&addr, &args, keys.clone(), server_pid).await?;
        }
        if args.baseline.is_some() {
            redis_baseline(&args, &results)?;
        }
        Ok::<(), String>(())
    })?;
    pinging.store(false, Ordering::Relaxed);
    drop(child);
    Ok(())
}

fn fake_segment_name(client: ClientId, n: u128) -> String {
    format!("bench-{client}-{n}")
}

pub(crate) async fn mount_fake(c: &MasterClient, client: ClientId, n: u128) -> Result<(), String> {
    let desc = SegmentDesc {
        id: SegmentId(client.0 ^ (n + 1)),
        name: fake_segment_name(client, n),
        base: n as u64 * FAKE_SEGMENT,
        size: FAKE_SEGMENT,
        endpoint: format!("fake-{client}:{n}"),
        host: "bench".into(),
        incarnation: 1,
    };
    c.call(&Request::MountSegment { client, segment: desc }).await.map_err(|e| format!("mount: {e}"))?;
    Ok(())
}

/// Makes `owner` hold the fake segments, pinging the master while `alive` is set, and writes
/// `keys` for the read workloads.
async fn prepare(c: &MasterClient, owner: ClientId, keys: &[KeyRef], alive: &Arc<AtomicBool>) -> Result<(), String> {
    for s in 0..FAKE_SEGMENTS {
        mount_fake(c, owner, s).await?;
    }
    keep_alive(c.clone(), owner, alive.clone());
    populate(c, owner, keys, 1000, ReplicateConfig::default()).await
}

pub(crate) fn keep_alive(c: MasterClient, client: ClientId, on: Arc<AtomicBool>) {
    tokio::spawn(async move {
        while on.load(Ordering::Relaxed) {
            let _ = c.call(&Request::Ping { client }).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
}

pub(crate) async fn populate(
    c: &MasterClient,
    client: ClientId,
    keys: &[KeyRef],
    batch: usize,
    config: ReplicateConfig,
) -> Result<(), String> {
    for chunk in keys.chunks(batch) {
        let items = chunk.iter().map(|k| (k.clone(), VALUE_SIZE)).collect();
        let write_ids: Vec<u64> = chunk.iter().map(|_| rand::random::<u64>() | 1).collect();
        let start = BatchWriteStart {
            client,
            tenant: String::new(),
            items,
            config: config.clone(),
            write_ids: write_ids.clone(),
        };
        let Response::BatchWriteStarted(res) =
            c.call(&Request::BatchPutStart(start)).await.map_err(|e| format!("populate: {e}"))?
        else {
            return Err("populate: unexpected reply".into());
        };
        if let Some(Err(e)) = res.iter().find(|r| r.is_err()) {
            return Err(format!("populate: {e}"));
        }
        let end = BatchWriteFinish { client, tenant: String::new(), keys: chunk.to_vec(), write_ids };
        c.call(&Request::BatchPutEnd(end)).await.map_err(|e| format!("populate: {e}"))?;
    }
    Ok(())
}

/// Which groups a connection writes to, and their epochs (the keys of a master of a cluster).
pub(crate) struct Routing {
    /// The cluster's routes.
    pub cache: tycho_routing::RouteCache,
    /// Whether each group (by rank) is this connection's master's.
    pub mine: Vec<bool>,
}

impl Routing {
    /// `key`'s reference with its group's epoch, if its group is this connection's.
    pub fn tag(&self, key: &str) -> Option<KeyRef> {
        let mut k = key_ref("", key);
        let rank = self.cache.rank_of(k.route.partition_id) as usize;
        if !self.mine.get(rank).copied().unwrap_or(false) {
            return None;
        }
        k.route.epoch = self.cache.epoch_of(k.route.partition_id);
        Some(k)
    }
}

/// The next key a write workload writes: `{prefix}/{seq}`, skipping keys of other masters'
/// groups when `routing` says which are this connection's.
fn next_key(prefix: &str, seq: &mut u64, routing: Option<&Routing>) -> KeyRef {
    loop {
        *seq += 1;
        let name = format!("{prefix}/{seq}");
        match routing {
            None => return key_ref("", &name),
            Some(r) => {
                if let Some(k) = r.tag(&name) {
                    return k;
                }
            }
        }
    }
}

/// One call of workload `w`; returns the keys it touched.
#[allow(clippy::too_many_arguments)]
async fn one_op(
    c: &MasterClient,
    w: &str,
    owner: ClientId,
    keys: &[KeyRef],
    batch: usize,
    seq: &mut u64,
    prefix: &str,
    routing: Option<&Routing>,
) -> Result<u64, ErrorCode> {
    let mut rng = rand::thread_rng();
    let mut pick = || keys[rng.gen_range(0..keys.len())].clone();
    let tenant = String::new;
    match w {
        "get" => {
            c.call(&Request::GetReplicaList(KeyQuery { tenant: tenant(), key: pick() })).await?;
            Ok(1)
        }
        "exist" => {
            c.call(&Request::ExistKey(KeyQuery { tenant: tenant(), key: pick() })).await?;
            Ok(1)
        }
        "batch-get" | "batch-exist" => {
            let q = BatchKeyQuery { tenant: tenant(), keys: (0..batch).map(|_| pick()).collect() };
            let req = if w == "batch-get" { Request::BatchGetReplicaList(q) } else { Request::BatchExistKey(q) };
            c.call(&req).await?;
            Ok(batch as u64)
        }
        "put" => {
            let key = next_key(prefix, seq, routing);
            let start = WriteStart {
                client: owner,
                tenant: tenant(),
                key: key.clone(),
                size: VALUE_SIZE,
                config: ReplicateConfig::default(),
                write_id: *seq,
            };
            c.call(&Request::PutStart(start)).await?;
            c.call(&Request::PutEnd(WriteFinish { client: owner, tenant: tenant(), key, write_id: *seq })).await?;
            Ok(1)
        }
        "batch-put" => {
            let ks: Vec<KeyRef> = (0..batch).map(|_| next_key(prefix, seq, routing)).collect();
            let items = ks.iter().map(|k| (k.clone(), VALUE_SIZE)).collect();
            let write_ids: Vec<u64> = (1..=batch as u64).map(|i| *seq * 1000 + i).collect();
            let start = BatchWriteStart {
                client: owner,
                tenant: tenant(),
                items,
                config: ReplicateConfig::default(),
                write_ids: write_ids.clone(),
            };
            c.call(&Request::BatchPutStart(start)).await?;
            let end = BatchWriteFinish { client: owner, tenant: tenant(), keys: ks, write_ids };
            c.call(&Request::BatchPutEnd(end)).await?;
            Ok(batch as u64)
        }
        _ => Err(ErrorCode::INVALID_PARAMS),
    }
}

/// Latency samples with their completion times.
type Samples = Vec<(Instant, u32)>;

/// How far behind its turns a paced call slot may fall and still catch up: the timer's
/// granularity (a millisecond) and then some, so that turns closer together than a tick keep
/// their rate, while a stall (the load generator descheduled) is not made up in one burst.
const CATCH_UP: Duration = Duration::from_millis(5);

/// A paced call slot's next turn after the one at `at`, the slot calling again at `now`: one
/// `interval` on, but never further back than [`CATCH_UP`] (or one interval, if longer).
fn next_turn(at: Instant, interval: Duration, now: Instant) -> Instant {
    let next = at + interval;
    match now.checked_sub(interval.max(CATCH_UP)) {
        Some(floor) if floor > next => floor,
        _ => next,
    }
}

/// Runs workload `w` against the master at `addr` on `args.connections` connections until
/// `until`; returns calls, keys, latencies and failed calls.
pub(crate) async fn drive(
    addr: &str,
    w: &str,
    args: &BenchMasterArgs,
    owner: ClientId,
    keys: Rc<Vec<KeyRef>>,
    until: Rc<dyn Fn() -> bool>,
    routing: Option<Rc<Routing>>,
) -> Result<(u64, u64, Samples, u64), String> {
    let run_id: u32 = rand::random();
    // Every connection is open (and greeted) before the first call: the measurement covers
    // calls only.
    let mut conns = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        conns.push(MasterClient::connect(addr).await.map_err(|e| format!("connect: {e}"))?);
    }
    // Without routes given, a master of a cluster in etcd is asked for its groups' epochs
    // (they start above 1 there: they carry the cluster's incarnation) and serves them all.
    let (routing, keys) = match (routing, conns.first()) {
        (None, Some(c)) => match c.call(&Request::Routes).await {
            Ok(Response::Routes(t)) if t.epochs.iter().any(|&e| e > tycho_routing::INITIAL_GROUP_EPOCH) => {
                let mut cache = tycho_routing::RouteCache::new();
                cache.learn(&t);
                let routing = Routing { cache, mine: vec![true; t.groups as usize] };
                let keys: Vec<KeyRef> = keys.iter().filter_map(|k| routing.tag(&k.key)).collect();
                (Some(Rc::new(routing)), Rc::new(keys))
            }
            _ => (None, keys),
        },
        (routing, _) => (routing, keys),
    };
    let mut tasks = Vec::new();
    // With a rate: each call slot calls once per `interval`, the slots' turns spread over it.
    let slots = (args.connections * args.inflight).max(1);
    let interval = args.rate.filter(|r| *r > 0.0).map(|r| Duration::from_secs_f64(slots as f64 / r));
    for (conn, c) in conns.into_iter().enumerate() {
        for slot in 0..args.inflight {
            let (c, keys, until, w) = (c.clone(), keys.clone(), until.clone(), w.to_string());
            let routing = routing.clone();
            let batch = args.batch;
            let prefix = format!("bench/{w}/{run_id:08x}/{conn}/{slot}");
            let nth = conn * args.inflight + slot;
            tasks.push(tokio::task::spawn_local(async move {
                let (mut ops, mut nkeys, mut errs, mut seq) = (0u64, 0u64, 0u64, 0u64);
                let mut lat: Samples = Vec::with_capacity(1 << 16);
                let mut turn = interval.map(|i| Instant::now() + i.mul_f64(nth as f64 / slots as f64));
                while !until() {
                    if let (Some(i), Some(at)) = (interval, turn.as_mut()) {
                        tokio::time::sleep_until((*at).into()).await;
                        *at = next_turn(*at, i, Instant::now());
                        if until() {
                            break;
                        }
                    }
                    let t0 = Instant::now();
                    match one_op(&c, &w, owner, &keys, batch, &mut seq, &prefix, routing.as_deref()).await {
                        Ok(k) => {
                            let now = Instant::now();
                            lat.push((now, (now - t0).as_micros() as u32));
                            ops += 1;
                            nkeys += k;
                        }
                        Err(_) => errs += 1,
                    }
                }
                (ops, nkeys, lat, errs)
            }));
        }
    }
    let (mut ops, mut nkeys, mut lat, mut errs) = (0, 0, Vec::new(), 0);
    for t in tasks {
        let (o, k, l, e) = t.await.map_err(|e| e.to_string())?;
        ops += o;
        nkeys += k;
        errs += e;
        lat.extend(l);
    }
    Ok((ops, nkeys, lat, errs))
}

async fn run_workload(
    addr: &str,
    w: &str,
    args: &BenchMasterArgs,
    owner: ClientId,
    keys: Rc<Vec<KeyRef>>,
    server_pid: Option<u32>,
) -> Result<Stats, String> {
    let local = tokio::task::LocalSet::new();
    // The clock and the CPU counters start at the first call, once every connection is open
    // (and, on a secure master, authenticated): the figures cover calls only.
    type Start = (Instant, f64, Option<f64>, (f64, f64));
    let started: Rc<std::cell::Cell<Option<Start>>> = Rc::default();
    let duration = Duration::from_secs_f64(args.duration);
    let first = started.clone();
    let until: Rc<dyn Fn() -> bool> = Rc::new(move || {
        let (t0, _, _, _) = first.get().unwrap_or_else(|| {
            first.set(Some((Instant::now(), cpu_self(), server_pid.and_then(cpu_of), machine_cpu())));
            first.get().expect("just set")
        });
        t0.elapsed() >= duration
    });
    let (ops, nkeys, lat, errs) = local.run_until(drive(addr, w, args, owner, keys, until, None)).await?;
    let (t0, cpu0, srv0, m0) =
        started.get().unwrap_or((Instant::now(), cpu_self(), server_pid.and_then(cpu_of), machine_cpu()));
    let secs = t0.elapsed().as_secs_f64();
    if errs > 0 {
        return Err(format!("workload {w}: {errs} calls failed"));
    }
    let mut lat_us: Vec<u32> = lat.into_iter().map(|(_, l)| l).collect();
    lat_us.sort_unstable();
    Ok(Stats {
        name: w.to_string(),
        ops,
        keys: nkeys,
        secs,
        lat_us,
        client_cpu: cpu_self() - cpu0,
        server_cpu: server_pid.and_then(cpu_of).zip(srv0).map(|(a, b)| a - b),
        machine: {
            let m1 = machine_cpu();
            (m1.0 - m0.0, m1.1 - m0.1)
        },
    })
}

fn print_row(s: &Stats) {
    println!(
        "{:<12} {:>11.0} ops/s {:>11.0} keys/s  p50 {:>6}us  p99 {:>6}us  p999 {:>6}us  cpu client {:>5.2}s server {}",
        s.name,
        s.ops_per_sec(),
        s.keys_per_sec(),
        s.pct(0.50),
        s.pct(0.99),
        s.pct(0.999),
        s.client_cpu,
        s.server_cpu.map_or("n/a".to_string(), |c| format!("{c:.2}s")),
    );
}

async fn expire_during(
    addr: &str,
    args: &BenchMasterArgs,
    keys: Rc<Vec<KeyRef>>,
    _pid: Option<u32>,
) -> Result<(), String> {
    let c = MasterClient::connect(addr).await.map_err(|e| e.to_string())?;
    let victim = ClientId(rand::random());
    mount_fake(&c, victim, 0).await?;
    let on = Arc::new(AtomicBool::new(true));
    keep_alive(c.clone(), victim, on.clone());
    let vkeys: Vec<KeyRef> = (0..args.expire_objects).map(|i| key_ref("", &format!("bench/victim/{i:08}"))).collect();
    println!("expire-during: populating {} objects on a second client", vkeys.len());
    // Every object of the victim lives only on its segment, so its expiry sweeps them all.
    let config = ReplicateConfig { preferred_segments: vec![fake_segment_name(victim, 0)], ..Default::default() };
    populate(&c, victim, &vkeys, 1000, config).await?;
    drop(vkeys);
    let Response::Stats(s0) = c.call(&Request::Stats).await.map_err(|e| e.to_string())? else {
        return Err("bad stats reply".into());
    };
    // Stop the victim's heartbeats; the master expires it after the client TTL (2 s).
    on.store(false, Ordering::Relaxed);
    let target = s0.sweep_progress + args.expire_objects as u64;
    let window: Rc<std::cell::RefCell<(Option<Instant>, Option<Instant>)>> = Default::default();
    let w2 = window.clone();
    let poll = c.clone();
    let local = tokio::task::LocalSet::new();
    let until: Rc<dyn Fn() -> bool> = {
        let w = window.clone();
        let give_up = Instant::now() + Duration::from_secs(300);
        Rc::new(move || {
            w.borrow().1.is_some_and(|end| end.elapsed() > Duration::from_secs(1)) || Instant::now() > give_up
        })
    };
    let owner = ClientId(0);
    let (_, _, lat, errs) = local
        .run_until(async move {
            tokio::task::spawn_local(async move {
                loop {
                    if let Ok(Response::Stats(s)) = poll.call(&Request::Stats).await {
                        let mut w = w2.borrow_mut();
                        if s.sweep_progress > s0.sweep_progress && w.0.is_none() {
                            w.0 = Some(Instant::now());
                        }
                        if s.sweep_progress >= target {
                            w.1 = Some(Instant::now());
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
            let gets = BenchMasterArgs { inflight: 1, ..args.clone() };
            drive(addr, "get", &gets, owner, keys, until, None).await
        })
        .await?;
    let (Some(start), Some(end)) = *window.borrow() else { return Err("sweep was not observed".into()) };
    let mut during: Vec<u32> = lat.iter().filter(|(t, _)| *t >= start && *t <= end).map(|(_, l)| *l).collect();
    let mut outside: Vec<u32> = lat.iter().filter(|(t, _)| *t < start || *t > end).map(|(_, l)| *l).collect();
    during.sort_unstable();
    outside.sort_unstable();
    let p99 = |v: &[u32]| if v.is_empty() { 0 } else { v[((v.len() - 1) as f64 * 0.99) as usize] };
    let max = |v: &[u32]| v.last().copied().unwrap_or(0);
    println!(
        "expire-during: sweep of {} objects took {:.0} ms; GetReplicaList during sweep: {} calls, p99 {} us, max {} us; outside: {} calls, p99 {} us; failures {}",
        args.expire_objects,
        (end - start).as_secs_f64() * 1000.0,
        during.len(),
        p99(&during),
        max(&during),
        outside.len(),
        p99(&outside),
        errs
    );
    Ok(())
}

fn redis_benchmark(port: u16, extra: &[&str]) -> Result<Vec<(String, f64)>, String> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "--csv", "-r", "100000", "-d", "64"])
        .args(extra)
        .output()
        .map_err(|e| format!("redis-benchmark: {e} (install Debian redis-tools)"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut rows = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(',').map(|s| s.trim_matches('"')).collect();
        if f.len() >= 2 {
            if let Ok(rps) = f[1].parse::<f64>() {
                rows.push((f[0].to_string(), rps));
            }
        }
    }
    if rows.is_empty() {
        return Err(format!("could not parse redis-benchmark output: {text}"));
    }
    Ok(rows)
}

fn redis_baseline(args: &BenchMasterArgs, results: &[Stats]) -> Result<(), String> {
    let port = free_port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("redis-server: {e} (install Debian redis-server)"))?;
    let _guard = ChildGuard(child);
    wait_for_port(port, "redis-server")?;
    let c = args.connections.to_string();
    let n = (args.duration * 100_000.0).max(100_000.0) as u64;
    let plain = redis_benchmark(port, &["-c", &c, "-n", &n.to_string(), "-t", "set,get"])?;
    let piped =
        redis_benchmark(port, &["-c", &c, "-n", &(n * 4).to_string(), "-t", "get", "-P", &args.batch.to_string()])?;
    let get = plain.iter().find(|r| r.0 == "GET").map(|r| r.1).unwrap_or(0.0);
    let set = plain.iter().find(|r| r.0 == "SET").map(|r| r.1).unwrap_or(0.0);
    let pget = piped.iter().find(|r| r.0 == "GET").map(|r| r.1).unwrap_or(0.0);
    println!("redis baseline (-c {c}): GET {get:.0}/s  SET {set:.0}/s  GET -P {} {pget:.0} keys/s", args.batch);
    let find = |name: &str| results.iter().find(|s| s.name == name);
    let ratio = |ours: f64, theirs: f64, goal: f64, what: &str| {
        let r = ours / theirs;
        let verdict = if r >= goal { "meets" } else { "BELOW" };
        println!("  {what:<40} {ours:>10.0} / {theirs:>10.0} = {r:.2}  (goal >= {goal}: {verdict})");
    };
    if let Some(s) = find("get") {
        ratio(s.ops_per_sec(), get, 0.8, "GetReplicaList ops/s vs redis GET");
    }
    if let Some(s) = find("put") {
        ratio(s.ops_per_sec(), set, 0.4, "PutStart+PutEnd ops/s vs redis SET");
    }
    if let Some(s) = find("batch-get") {
        ratio(s.keys_per_sec(), pget, 0.5, "BatchGetReplicaList keys/s vs GET -P");
    }
    Ok(())
}

/// One round of `w` for a comparison: [`run_workload`], then (untimed) the removal of what a
/// write workload wrote, so that every round starts from the same key count rather than
/// measuring the growth of the metadata maps round after round.
async fn measure(
    addr: &str,
    w: &str,
    args: &BenchMasterArgs,
    owner: ClientId,
    keys: Rc<Vec<KeyRef>>,
    server_pid: Option<u32>,
) -> Result<Stats, String> {
    let stats = run_workload(addr, w, args, owner, keys, server_pid).await?;
    if matches!(w, "put" | "batch-put") {
        remove_written(addr, w).await?;
    }
    Ok(stats)
}

/// Removes (untimed) every object write workload `w` wrote at `addr`; fails if there was none.
pub(crate) async fn remove_written(addr: &str, w: &str) -> Result<u64, String> {
    let c = MasterClient::connect(addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
    // The pattern must match whole keys: `bench/{w}/{run}/{connection}/{slot}/{seq}`.
    let regex = format!("bench/{w}/.*");
    match c.call(&Request::RemoveByRegex { tenant: String::new(), regex, force: true }).await {
        Ok(Response::Removed(n)) if n > 0 => Ok(n),
        Ok(r) => Err(format!("removing what {w} wrote at {addr}: {r:?}")),
        Err(e) => Err(format!("removing what {w} wrote at {addr}: {e}")),
    }
}

/// Runs each workload against a master with the self-probe on and one with it off, in
/// alternating rounds, and prints the means next to the spread between rounds of the same
/// master (the run-to-run noise).
/// A master with authentication and capabilities against one started `--insecure`, round by
/// round. On the secure one the workloads run as a registered client of the default tenant.
/// Runs `a` and `b` once each, `a` first in even rounds and `b` first in odd ones, so that
/// drift over a run and whatever the first run leaves behind hit both alike. Returns `a`'s
/// result, then `b`'s.
pub(crate) async fn paired<T, A, B, FA, FB>(round: usize, a: A, b: B) -> Result<(T, T), String>
where
    A: FnOnce() -> FA,
    B: FnOnce() -> FB,
    FA: std::future::Future<Output = Result<T, String>>,
    FB: std::future::Future<Output = Result<T, String>>,
{
    if round.is_multiple_of(2) {
        let x = a().await?;
        Ok((x, b().await?))
    } else {
        let y = b().await?;
        Ok((a().await?, y))
    }
}

fn compare_insecure(args: &BenchMasterArgs) -> Result<(), String> {
    // The control run compares two insecure masters: the ratio the same comparison shows
    // when nothing differs (its spread is the noise floor).
    let first: &[&str] = if args.control { &["--insecure"] } else { &[] };
    let (secure_guard, secure_addr) = start_master(10, first)?;
    let (open_guard, open_addr) = start_master(10, &["--insecure"])?;
    let label = if args.control { "control" } else { "secure" };
    println!(
        "{} vs --insecure: {} connections x {} in flight, {}s rounds, {} rounds each",
        if args.control { "control: --insecure" } else { "secure" },
        args.connections,
        args.inflight,
        args.duration,
        args.rounds
    );
    compare_masters(args, (label, &secure_guard, &secure_addr), ("insecure", &open_guard, &open_addr))
}

/// `--against`: this build's master and `other`'s, each the primary of a one-master cluster
/// on one etcd, both `--insecure`.
fn compare_builds(args: &BenchMasterArgs, other: &std::path::Path) -> Result<(), String> {
    let etcd = tycho_testkit::EtcdServer::start_new()
        .map_err(|e| format!("cannot start etcd (install etcd-server or set TYCHO_ETCD_BIN): {e}"))?;
    let endpoint = etcd.endpoint();
    // A long registration lease: the load saturates the machine (see `--oplog`).
    let ha = |name: &'static str| {
        ["--insecure", "--etcd-endpoints", &endpoint, "--cluster-name", name, "--ha-lease-ttl", "30"].map(String::from)
    };
    let (this_guard, this_addr) = start_master(10, &ha("bench-this").each_ref().map(String::as_str))?;
    let mut cmd = std::process::Command::new(other);
    cmd.args(["master", "--metrics-port", "0"]).args(ha("bench-other"));
    let (other_guard, other_addr) = crate::bench::harness::start_master_with(10, cmd)?;
    println!(
        "this build vs {}: {} connections x {} in flight, {}s rounds, {} rounds each, both logging to etcd {endpoint}",
        other.display(),
        args.connections,
        args.inflight,
        args.duration,
        args.rounds
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    // (Waits until each serves: an HA master serves once it has created its group.)
    rt.block_on(async {
        for addr in [&this_addr, &other_addr] {
            let c = MasterClient::connect(addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match c.call(&Request::Routes).await {
                    Ok(Response::Routes(t)) if t.epochs.first().is_some_and(|&e| e > 0) => break,
                    r if Instant::now() > deadline => {
                        return Err(format!("the master at {addr} does not serve: {r:?}"))
                    }
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
        Ok::<(), String>(())
    })?;
    compare_masters(args, ("this", &this_guard, &this_addr), ("other", &other_guard, &other_addr))
}

/// Each workload against master `a` and master `b` in alternating rounds: per workload the
/// median ratio of `a`'s rate to `b`'s, its spread, and CPU per call.
fn compare_masters(
    args: &BenchMasterArgs,
    (label, secure_guard, secure_addr): (&str, &ChildGuard, &str),
    (other_label, open_guard, open_addr): (&str, &ChildGuard, &str),
) -> Result<(), String> {
    let (secure_pid, open_pid) = (Some(secure_guard.0.id()), Some(open_guard.0.id()));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let keys: Rc<Vec<KeyRef>> = Rc::new((0..args.keys).map(|i| key_ref("", &format!("bench/key/{i:08}"))).collect());
    let alive = Arc::new(AtomicBool::new(true));
    let mut worst = f64::INFINITY;
    rt.block_on(async {
        let mut owners = Vec::new();
        for addr in [secure_addr, open_addr] {
            let c = MasterClient::connect(addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
            let owner = match c.call(&Request::Register { tenant: String::new() }).await {
                Ok(Response::Registered { client, credential }) if credential != [0; 32] => {
                    let identity = tycho_proto::auth::handshake::Identity::Client {
                        client: client.0,
                        tenant: String::new(),
                        credential,
                    };
                    crate::master_client::act_as(addr, identity);
                    client
                }
                _ => ClientId(rand::random()),
            };
            // Reconnect, as the registered client when there is one.
            let c = MasterClient::connect(addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
            prepare(&c, owner, &keys, &alive).await?;
            owners.push(owner);
        }
        for w in &args.workloads {
            let mut ratios = Vec::new();
            let (mut on, mut off) = (Vec::new(), Vec::new());
            // Master CPU per call, and the load generator's own, microseconds.
            let (mut on_cpu, mut off_cpu) = (Vec::new(), Vec::new());
            let (mut on_load, mut off_load) = (Vec::new(), Vec::new());
            // Idle CPU of the whole machine during each master's rounds, cores.
            let (mut on_idle, mut off_idle) = (Vec::new(), Vec::new());
            for round in 0..args.rounds {
                // Alternate which master goes first.
                let secure = || measure(secure_addr, w, args, owners[0], keys.clone(), secure_pid);
                let open = || measure(open_addr, w, args, owners[1], keys.clone(), open_pid);
                let (a, b) = paired(round, secure, open).await?;
                let per_call = |s: &Stats| s.server_cpu.unwrap_or(0.0) * 1e6 / s.ops.max(1) as f64;
                on_cpu.push(per_call(&a));
                off_cpu.push(per_call(&b));
                let load_per_call = |s: &Stats| s.client_cpu * 1e6 / s.ops.max(1) as f64;
                on_load.push(load_per_call(&a));
                off_load.push(load_per_call(&b));
                // Busy CPU of neither the master nor the load generator, cores.
                let other = |s: &Stats| (s.machine.0 - s.client_cpu - s.server_cpu.unwrap_or(0.0)) / s.secs;
                on_idle.push(a.machine.1 / a.secs);
                off_idle.push(b.machine.1 / b.secs);
                eprintln!(
                    "  {w} round {}: {label} {:.0} ops/s (p99 {} max {} us, idle {:.2} other {:.2} cores), {other_label} {:.0} ops/s (p99 {} max {} us, idle {:.2} other {:.2} cores)",
                    round + 1,
                    a.ops_per_sec(),
                    a.pct(0.99),
                    a.pct(1.0),
                    a.machine.1 / a.secs,
                    other(&a),
                    b.ops_per_sec(),
                    b.pct(0.99),
                    b.pct(1.0),
                    b.machine.1 / b.secs,
                    other(&b),
                );
                on.push(a.ops_per_sec());
                off.push(b.ops_per_sec());
                ratios.push(a.ops_per_sec() / b.ops_per_sec());
            }
            ratios.sort_by(f64::total_cmp);
            let median = ratios[ratios.len() / 2];
            worst = worst.min(median);
            let med = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "{w:<12} {label} {:>9.0} ops/s   {other_label} {:>9.0} ops/s   ratio median {median:.3}   min..max {:.3}..{:.3}   \
                 master cpu/call {:.2} / {:.2} us   load cpu/call {:.2} / {:.2} us   idle {:.2} / {:.2} cores",
                med(&mut on),
                med(&mut off),
                ratios[0],
                ratios[ratios.len() - 1],
                med(&mut on_cpu),
                med(&mut off_cpu),
                med(&mut on_load),
                med(&mut off_load),
                med(&mut on_idle),
                med(&mut off_idle),
            );
        }
        Ok::<(), String>(())
    })?;
    println!("lowest median ratio: {worst:.3}");
    alive.store(false, Ordering::Relaxed);
    Ok(())
}

/// Mounts the fake segments of a new client of `addr`, waiting (bounded) until the master
/// serves (an HA master serves once it has created or taken its group), and keeps it alive.
pub(crate) async fn serving_owner(addr: &str, alive: &Arc<AtomicBool>) -> Result<ClientId, String> {
    let c = MasterClient::connect(addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
    let owner = ClientId(rand::random());
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = mount_fake(&c, owner, 0).await {
        if Instant::now() > deadline {
            return Err(format!("the master at {addr} does not serve: {e}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for s in 1..FAKE_SEGMENTS {
        mount_fake(&c, owner, s).await?;
    }
    keep_alive(c, owner, alive.clone());
    Ok(owner)
}

/// Sequential puts of small values from one client to etcd for `secs`: puts per second.
async fn etcd_put_rate(store: &tycho_meta::EtcdStore, round: usize, secs: f64) -> Result<f64, String> {
    use tycho_meta::MetaStore;
    let value = [0x5au8; 128];
    let (start, mut n) = (Instant::now(), 0u64);
    while start.elapsed().as_secs_f64() < secs {
        store
            .put(format!("/bench-etcd/{round}/{n:010}").as_bytes(), &value, None)
            .await
            .map_err(|e| format!("etcd put: {e}"))?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// `--oplog`: what logging every mutation to etcd costs a master, and whether group commit
/// lifts its write rate well above etcd's own single-client put rate.
fn oplog_compare(args: &BenchMasterArgs) -> Result<(), String> {
    let etcd = tycho_testkit::EtcdServer::start_new()
        .map_err(|e| format!("cannot start etcd (install etcd-server or set TYCHO_ETCD_BIN): {e}"))?;
    let endpoint = etcd.endpoint();
    let (off_guard, off_addr) = start_master(10, &["--insecure"])?;
    // A long registration lease: the load saturates the machine, and a master whose renewals
    // starve would stand down in the middle of a round.
    let ha = ["--insecure", "--etcd-endpoints", &endpoint, "--cluster-name", "bench-oplog", "--ha-lease-ttl", "30"];
    let (on_guard, on_addr) = start_master(10, &ha)?;
    println!(
        "oplog on/off: PutStart+PutEnd, {} connections x {} in flight, {}s rounds, {} rounds each; etcd {endpoint}",
        args.connections, args.inflight, args.duration, args.rounds
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let alive = Arc::new(AtomicBool::new(true));
    let keys: Rc<Vec<KeyRef>> = Rc::new(Vec::new());
    let verdict = rt.block_on(async {
        let store = tycho_meta::EtcdStore::connect(tycho_meta::EtcdOptions::new([endpoint.clone()]))
            .await
            .map_err(|e| format!("etcd: {e}"))?;
        let on_owner = serving_owner(&on_addr, &alive).await?;
        let off_owner = serving_owner(&off_addr, &alive).await?;
        let (mut on, mut off, mut etcd_rates) = (Vec::new(), Vec::new(), Vec::new());
        let (mut on_p99, mut off_p99) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            let with = || measure(&on_addr, "put", args, on_owner, keys.clone(), Some(on_guard.0.id()));
            let without = || measure(&off_addr, "put", args, off_owner, keys.clone(), None);
            let (a, b) = paired(round, with, without).await?;
            let e = etcd_put_rate(&store, round, args.duration).await?;
            eprintln!(
                "  round {}: oplog on {:.0} puts/s (p99 {} us), off {:.0} puts/s (p99 {} us); etcd one client {e:.0} puts/s",
                round + 1,
                a.ops_per_sec(),
                a.pct(0.99),
                b.ops_per_sec(),
                b.pct(0.99)
            );
            on.push(a.ops_per_sec());
            off.push(b.ops_per_sec());
            on_p99.push(a.pct(0.99) as f64);
            off_p99.push(b.pct(0.99) as f64);
            etcd_rates.push(e);
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (on, off, e) = (med(&mut on), med(&mut off), med(&mut etcd_rates));
        println!(
            "put (start+end)  oplog on {on:>9.0} puts/s (p99 {:.0} us)   off {off:>9.0} puts/s (p99 {:.0} us)   on/off {:.3}",
            med(&mut on_p99),
            med(&mut off_p99),
            on / off
        );
        println!("etcd, one client, sequential puts: {e:.0} puts/s; oplog on / etcd = {:.2}", on / e);
        Ok::<bool, String>(on >= 3.0 * e)
    })?;
    alive.store(false, Ordering::Relaxed);
    println!(
        "group commit: {}",
        if verdict {
            "the master logs puts at least 3x faster than one etcd client puts"
        } else {
            "BELOW 3x etcd's single-client put rate"
        }
    );
    // The masters before their etcd.
    drop((on_guard, off_guard));
    drop(etcd);
    Ok(())
}

fn probe_compare(args: &BenchMasterArgs) -> Result<(), String> {
    let interval = args.probe_interval.to_string();
    let (_on, on_addr) = start_master(10, &["--enable-rpc-health-probe", "true", "--rpc-probe-interval", &interval])?;
    let (_off, off_addr) = start_master(10, &["--enable-rpc-health-probe", "false"])?;
    println!(
        "probe on/off: {} connections x {} in flight, {}s rounds, {} rounds each, probe interval {}s",
        args.connections, args.inflight, args.duration, args.rounds, args.probe_interval
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let keys: Rc<Vec<KeyRef>> = Rc::new((0..args.keys).map(|i| key_ref("", &format!("bench/key/{i:08}"))).collect());
    let alive = Arc::new(AtomicBool::new(true));
    rt.block_on(async {
        let mut owners = Vec::new();
        for addr in [&on_addr, &off_addr] {
            let c = MasterClient::connect(addr).await.map_err(|e| format!("cannot reach master: {e}"))?;
            let owner = ClientId(rand::random());
            prepare(&c, owner, &keys, &alive).await?;
            owners.push(owner);
        }
        for w in &args.workloads {
            let (mut on, mut off) = (Vec::new(), Vec::new());
            for round in 0..args.rounds {
                let with = || run_workload(&on_addr, w, args, owners[0], keys.clone(), None);
                let without = || run_workload(&off_addr, w, args, owners[1], keys.clone(), None);
                let (a, b) = paired(round, with, without).await?;
                on.push(a.ops_per_sec());
                off.push(b.ops_per_sec());
            }
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            let spread = |v: &[f64]| {
                let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
                (hi - lo) / mean(v) * 100.0
            };
            let diff = (mean(&on) - mean(&off)) / mean(&off) * 100.0;
            let noise = spread(&on).max(spread(&off));
            let verdict = if diff.abs() < noise { "within noise" } else { "OUTSIDE noise" };
            println!(
                "{w:<12} probe on {:>9.0} ops/s   off {:>9.0} ops/s   difference {diff:+.1}%   run-to-run spread {noise:.1}%   {verdict}",
                mean(&on),
                mean(&off)
            );
        }
        Ok::<(), String>(())
    })?;
    alive.store(false, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paced_slot_keeps_its_rate_and_catches_up_only_so_far() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // On time: one interval on, whenever within the interval it called.
        assert_eq!(next_turn(t0, ms(10), t0), t0 + ms(10));
        assert_eq!(next_turn(t0, ms(10), t0 + ms(9)), t0 + ms(10));
        // Turns closer together than a timer tick: falling a few turns behind is made up.
        let us = Duration::from_micros;
        assert_eq!(next_turn(t0, us(200), t0 + ms(2)), t0 + us(200));
        // A stall is not: the next turn is at most CATCH_UP behind.
        assert_eq!(next_turn(t0, us(200), t0 + ms(100)), t0 + ms(100) - CATCH_UP);
        // An interval longer than CATCH_UP: at most one turn behind.
        assert_eq!(next_turn(t0, ms(10), t0 + ms(100)), t0 + ms(90));
    }
}
