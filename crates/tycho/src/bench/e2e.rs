//! `tycho bench`: end-to-end put/get/exist through the data path, with the ceilings it is
//! held to measured in the same run (`--baseline`): a single-thread memcpy of the same size
//! with warm buffers, and a raw TCP request/response of the same size over loopback.
//!
//! The bench starts a master and one `tycho node` holding the data, then runs each phase in a
//! separate worker process (itself, in a hidden worker mode), so that writer and reader are
//! always different clients.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use tycho_client::{Client, ClientConfig, Protocol};
use tycho_proto::ReplicateConfig;

use crate::bench::harness::{free_port, wait_for_port, ChildGuard};

/// `tycho bench` flags.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Value sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "4096,65536,1048576,4194304,67108864")]
    sizes: Vec<usize>,
    /// Seconds per read phase.
    #[arg(long, default_value_t = 2.0)]
    duration: f64,
    /// Concurrent reader processes in the multi-client phase (1 MiB values).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Transports to measure: auto (shared memory on this host) and/or tcp.
    #[arg(long, value_delimiter = ',', default_value = "auto,tcp")]
    protocols: Vec<String>,
    /// Also measure memcpy and raw TCP ceilings and print the ratios.
    #[arg(long)]
    baseline: bool,
    /// Run master, node and clients without authentication or capabilities.
    #[arg(long)]
    insecure: bool,
    /// Run the whole benchmark this many times with authentication and capabilities and as
    /// often with `--insecure`, alternating, and print each row's median ratio (secure over
    /// insecure) with its spread.
    #[arg(long = "compare-insecure", value_name = "ROUNDS")]
    compare_insecure: Option<usize>,
    /// With `--compare-insecure`: run the "secure" rounds `--insecure` too, to measure the
    /// comparison's own noise (its ratios should straddle 1).
    #[arg(long, requires = "compare_insecure")]
    control: bool,
    /// With `--compare-insecure`: which phases run on both clusters side by side, each phase on
    /// one right after the other (the two figures of a row seconds apart), rather than one whole
    /// cluster's run after the other (a minute apart). `tcp`: the TCP phases paired, the
    /// shared-memory ones (`auto` and the multi-reader phase) one cluster after the other, size
    /// by size; `all`; `none`. See docs/security.md for why `tcp` is the default.
    #[arg(long, value_enum, default_value_t = Pairing::Tcp, requires = "compare_insecure")]
    pairing: Pairing,
    /// `--pairing all` (kept for earlier command lines).
    #[arg(long, requires = "compare_insecure", conflicts_with = "pairing")]
    paired: bool,
    /// Leave out the multi-reader phase (internal: set for the part of a comparison that
    /// measures TCP only).
    #[arg(skip)]
    no_multi: bool,
    /// Worker mode (internal): role, master, protocol, prefix, size, count, seconds.
    #[arg(long, hide = true, num_args = 7)]
    worker: Option<Vec<String>>,
}

/// Which phases of `--compare-insecure` run on both clusters side by side.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// TCP phases paired; shared-memory phases one cluster after the other.
    Tcp,
    /// Every phase paired.
    All,
    /// One whole run after the other.
    None,
}

/// Bytes written per size: enough objects to average over, bounded for big values.
const BYTES_PER_SIZE: usize = 256 << 20;

/// Objects of 1 MiB the multi-client phase reads. Their 256 MiB are many times any last-level
/// cache: with 64 (twice this VM's 32 MiB L3) the phase measured 22 or 31 GB/s depending on
/// where the node's memory happened to land, the same for every phase of one node and random
/// from node to node, in both modes.
const MULTI_OBJECTS: usize = 256;

struct Measured {
    ops: u64,
    bytes: u64,
    secs: f64,
    p50_us: u64,
    p99_us: u64,
}

impl Measured {
    fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
    fn ops_s(&self) -> f64 {
        self.ops as f64 / self.secs
    }
    fn from_latencies(mut lat: Vec<u64>, bytes: u64, secs: f64) -> Measured {
        lat.sort_unstable();
        let pct = |p: f64| lat.get(((lat.len().max(1) - 1) as f64 * p) as usize).copied().unwrap_or(0);
        Measured { ops: lat.len() as u64, bytes, secs, p50_us: pct(0.5), p99_us: pct(0.99) }
    }
    fn line(&self) -> String {
        format!("RESULT {} {} {} {} {}", self.ops, self.bytes, self.secs, self.p50_us, self.p99_us)
    }
    fn parse(s: &str) -> Option<Measured> {
        let f: Vec<&str> = s.strip_prefix("RESULT ")?.split_whitespace().collect();
        Some(Measured {
            ops: f.first()?.parse().ok()?,
            bytes: f.get(1)?.parse().ok()?,
            secs: f.get(2)?.parse().ok()?,
            p50_us: f.get(3)?.parse().ok()?,
            p99_us: f.get(4)?.parse().ok()?,
        })
    }
}

/// Entry point; returns the exit code.
pub fn run(args: BenchArgs) -> i32 {
    let result = match (&args.worker, args.compare_insecure) {
        (Some(w), _) => worker(w).map(|m| println!("{}", m.line())),
        (None, Some(rounds)) => compare_insecure(&args, rounds.max(1)),
        (None, None) => orchestrate(&args, &[Mode { label: "", insecure: args.insecure }]).map(drop),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn worker(w: &[String]) -> Result<Measured, String> {
    let [role, master, protocol, prefix, size, count, secs] = w else { return Err("bad worker arguments".into()) };
    let size: usize = size.parse().map_err(|_| "size")?;
    let count: usize = count.parse().map_err(|_| "count")?;
    let secs: f64 = secs.parse().map_err(|_| "secs")?;
    let mut cfg = ClientConfig::new(master);
    cfg.protocol = protocol.parse()?;
    cfg.staging_buffer_size = size as u64;
    let client = Client::connect(cfg).map_err(|e| format!("connect: {e}"))?;
    let mut buf: Vec<u8> = (0..size).map(|i| (i * 31) as u8).collect();
    // One untimed call first: connections open and the peer's segment is mapped once per
    // process, which is not what the phase measures.
    match role.as_str() {
        "put" => client.put(&format!("{prefix}/warmup"), &buf, &ReplicateConfig::default()),
        _ => client.get_into(&format!("{prefix}/0"), &mut buf).map(|_| ()),
    }
    .map_err(|e| format!("warm-up: {e}"))?;
    // Say so and wait for the word to start: the readers of the multi-client phase measure the
    // same window, not one stretched by the others' start-up (process, handshakes, mappings).
    println!("{READY}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).map_err(|e| format!("waiting for the start: {e}"))?;
    let mut lat = Vec::new();
    let mut bytes = 0u64;
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    match role.as_str() {
        "put" => {
            // Passes over the same `count` keys until `secs` have gone by (at least one): a
            // pass of small or few values lasts milliseconds, too short to measure alone. The
            // keys of a finished pass are removed, untimed, before the next one writes them
            // again; the last pass's stay for the read phases.
            let mut timed = Duration::ZERO;
            for pass in 0.. {
                if pass > 0 {
                    if timed.as_secs_f64() >= secs {
                        break;
                    }
                    for i in 0..count {
                        client.remove(&format!("{prefix}/{i}"), true).map_err(|e| format!("remove: {e}"))?;
                    }
                }
                let started = Instant::now();
                for i in 0..count {
                    let t = Instant::now();
                    client
                        .put(&format!("{prefix}/{i}"), &buf, &ReplicateConfig::default())
                        .map_err(|e| format!("put: {e}"))?;
                    lat.push(t.elapsed().as_micros() as u64);
                    bytes += size as u64;
                }
                timed += started.elapsed();
            }
            let _ = client.close();
            return Ok(Measured::from_latencies(lat, bytes, timed.as_secs_f64()));
        }
        "get" | "exist" => {
            let mut i = 0;
            while Instant::now() < end {
                let key = format!("{prefix}/{}", i % count);
                let t = Instant::now();
                if role == "get" {
                    let n = client.get_into(&key, &mut buf).map_err(|e| format!("get {key}: {e}"))?;
                    bytes += n as u64;
                } else if !client.exists(&key).map_err(|e| format!("exist: {e}"))? {
                    return Err(format!("{key} missing"));
                }
                lat.push(t.elapsed().as_micros() as u64);
                i += 1;
            }
        }
        r => return Err(format!("unknown role {r}")),
    }
    let secs = start.elapsed().as_secs_f64();
    let _ = client.close();
    Ok(Measured::from_latencies(lat, bytes, secs))
}

/// What a worker prints once warmed up; it then waits for a line on its standard input.
const READY: &str = "READY";

/// Worker processes started together: each warms up, then all are told to start at once.
/// `insecure`: they run without authentication (for a cluster started `--insecure`).
fn run_workers(all: &[Vec<String>], insecure: bool) -> Result<Vec<Measured>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::new();
    for args in all {
        let mut cmd = Command::new(&exe);
        match insecure {
            true => cmd.env(tycho_proto::auth::INSECURE_ENV, "1"),
            false => cmd.env_remove(tycho_proto::auth::INSECURE_ENV),
        };
        let child = cmd
            .arg("bench")
            .arg("--worker")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start a worker: {e}"))?;
        children.push(ChildGuard(child));
    }
    let mut outputs = Vec::new();
    for child in &mut children {
        let stdout = child.0.stdout.take().expect("piped");
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let mut seen = Vec::new();
        loop {
            match lines.next() {
                Some(Ok(l)) if l == READY => break,
                Some(Ok(l)) => seen.push(l),
                _ => return Err(format!("worker failed before starting: {}", seen.join("\n"))),
            }
        }
        outputs.push(lines);
    }
    for child in &mut children {
        let mut stdin = child.0.stdin.take().expect("piped");
        stdin.write_all(b"go\n").map_err(|e| format!("cannot start a worker: {e}"))?;
    }
    let mut measured = Vec::new();
    for (child, lines) in children.iter_mut().zip(outputs) {
        let text: Vec<String> = lines.map_while(Result::ok).collect();
        let _ = child.0.wait();
        let m = text.iter().find_map(|l| Measured::parse(l));
        measured.push(m.ok_or_else(|| format!("worker failed: {}", text.join("\n")))?);
    }
    Ok(measured)
}

fn run_phase(
    role: &str,
    cluster: &Cluster,
    protocol: &str,
    prefix: &str,
    size: usize,
    count: usize,
    secs: f64,
) -> Result<Measured, String> {
    let args: Vec<String> =
        [role, &cluster.master, protocol, prefix, &size.to_string(), &count.to_string(), &secs.to_string()]
            .map(String::from)
            .to_vec();
    Ok(run_workers(&[args], cluster.insecure)?.remove(0))
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn progress(msg: &str) {
    eprint!("\r\x1b[2K  .. {msg}");
    let _ = std::io::stderr().flush();
}

/// One run's rows: name and ops/s (GB/s for the multi-reader rows).
type Rows = Vec<(String, f64)>;

/// Runs the benchmark `rounds` times with authentication and capabilities and as often
/// `--insecure` (both `--insecure` with `--control`), which goes first alternating by round, and
/// prints the median ratio of every row (ops/s, secure over insecure) with its spread. Each run
/// has a cluster of its own; with `--paired` the two clusters of a round run side by side and
/// take each phase in turn.
fn compare_insecure(args: &BenchArgs, rounds: usize) -> Result<(), String> {
    let mut pairs: Vec<(Rows, Rows)> = Vec::new();
    let first_label = if args.control { "control (--insecure)" } else { "secure" };
    for round in 0..rounds {
        // Alternate which mode goes first, so that what the first run of a phase pays (or
        // leaves behind) hits both alike.
        let secure_first = round % 2 == 0;
        let order = if secure_first { [first_label, "--insecure"] } else { ["--insecure", first_label] };
        println!("== round {} of {rounds}: {} first", round + 1, order[0]);
        let secure = Mode { label: first_label, insecure: args.control };
        let open = Mode { label: "--insecure", insecure: true };
        let modes = if secure_first { [secure, open] } else { [open, secure] };
        // Each mode's rows, part after part.
        let mut rows: [Rows; 2] = Default::default();
        for (part, paired) in parts(args) {
            let got = match paired {
                true => orchestrate(&part, &modes)?,
                false => {
                    let mut both = orchestrate(&part, &modes[..1])?;
                    both.extend(orchestrate(&part, &modes[1..])?);
                    both
                }
            };
            for (mode, got) in rows.iter_mut().zip(got) {
                mode.extend(got);
            }
        }
        let [first, second] = rows;
        pairs.push(if secure_first { (first, second) } else { (second, first) });
    }
    let how = match pairing(args) {
        Pairing::Tcp => ", TCP phases paired",
        Pairing::All => ", phases paired",
        Pairing::None => "",
    };
    println!(
        "\n{first_label} vs --insecure, {rounds} alternating rounds{how} (ratio of ops/s; median, then min..max):"
    );
    let names: Vec<String> = pairs[0].0.iter().map(|(n, _)| n.clone()).collect();
    let mut worst = f64::INFINITY;
    for name in names {
        let mut ratios: Vec<f64> = pairs
            .iter()
            .filter_map(|(s, i)| {
                let a = s.iter().find(|(n, _)| *n == name)?.1;
                let b = i.iter().find(|(n, _)| *n == name)?.1;
                (b > 0.0).then(|| a / b)
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        let Some(&lo) = ratios.first() else { continue };
        let hi = ratios[ratios.len() - 1];
        let median = ratios[ratios.len() / 2];
        worst = worst.min(median);
        println!("  {name:<28} {median:>6.3}   {lo:.3}..{hi:.3}");
    }
    println!("lowest median ratio: {worst:.3}");
    Ok(())
}

fn pairing(args: &BenchArgs) -> Pairing {
    if args.paired {
        Pairing::All
    } else {
        args.pairing
    }
}

/// The parts of a comparison round, each with whether its two clusters run side by side.
/// Under `--pairing tcp`, the TCP phases are paired: they move with the state of the machine's
/// CPUs, which on the development VM changes every few tens of seconds for every process at once
/// (docs/security.md). The shared-memory phases run one cluster after the other, as they move
/// with where a node's memory lands too, and measured wider apart with two nodes alive at once;
/// but one size at a time, each size on fresh clusters, so that the two figures of a row are
/// seconds apart rather than a whole run; the multi-reader phase last, the same way.
fn parts(args: &BenchArgs) -> Vec<(BenchArgs, bool)> {
    match pairing(args) {
        Pairing::All => vec![(args.clone(), true)],
        Pairing::None => vec![(args.clone(), false)],
        Pairing::Tcp => {
            let (tcp, rest): (Vec<String>, Vec<String>) = args.protocols.iter().cloned().partition(|p| p == "tcp");
            let mut parts = Vec::new();
            if !tcp.is_empty() {
                parts.push((BenchArgs { protocols: tcp, no_multi: true, ..args.clone() }, true));
            }
            if !rest.is_empty() {
                for &size in &args.sizes {
                    let one = BenchArgs { protocols: rest.clone(), sizes: vec![size], no_multi: true, ..args.clone() };
                    parts.push((one, false));
                }
            }
            parts.push((BenchArgs { protocols: Vec::new(), sizes: Vec::new(), ..args.clone() }, false));
            parts
        }
    }
}

/// One cluster of a run: whether it runs without authentication, and its name in the output.
#[derive(Clone, Copy)]
struct Mode {
    label: &'static str,
    insecure: bool,
}

/// A master and one node holding the data, started for one [`Mode`].
struct Cluster {
    master: String,
    insecure: bool,
    admin: Client,
    _master: ChildGuard,
    _node: ChildGuard,
}

impl Cluster {
    fn start(args: &BenchArgs, insecure: bool) -> Result<Cluster, String> {
        let port = free_port();
        let master = format!("127.0.0.1:{port}");
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let flag: &[&str] = if insecure { &["--insecure"] } else { &[] };
        let master_proc = ChildGuard(
            Command::new(&exe)
                .args(["master", "--rpc-address", "127.0.0.1", "--rpc-port", &port.to_string(), "--metrics-port", "0"])
                .args(flag)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| e.to_string())?,
        );
        wait_for_port(port, "master")?;
        // The node holds every phase's objects at once, with room to stay under the eviction
        // mark: each phase writes into memory no earlier phase used. (Reading back space that
        // an earlier phase had just used and freed measured up to 40 % slower on the
        // development VM, for reasons of placement, not of the data path; keeping the phases
        // apart keeps the rows comparable from run to run and with earlier versions.)
        let all: usize = args.sizes.iter().map(|&s| (BYTES_PER_SIZE / s).clamp(4, 2000) * s + s).sum();
        let held = all * args.protocols.len() + (MULTI_OBJECTS + 64) * (1 << 20);
        let node_bytes = (held + held / 4).to_string();
        let node = ChildGuard(
            Command::new(&exe)
                .args(["node", "--master", &master, "--segment-size", &node_bytes, "--port", "0"])
                .args(flag)
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| e.to_string())?,
        );
        // The admin client authenticates as the cluster does (the variable is read at connect).
        match insecure {
            true => std::env::set_var(tycho_proto::auth::INSECURE_ENV, "1"),
            false => std::env::remove_var(tycho_proto::auth::INSECURE_ENV),
        }
        let admin = Client::connect(ClientConfig::new(&master)).map_err(|e| e.to_string());
        std::env::remove_var(tycho_proto::auth::INSECURE_ENV);
        let admin = admin?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while admin.call(&tycho_proto::Request::ListSegments).ok().and_then(|r| match r {
            tycho_proto::Response::Segments(s) => Some(s.len()),
            _ => None,
        }) != Some(1)
        {
            if Instant::now() > deadline {
                return Err("the node did not mount its segment".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!(
            "tycho bench: master {master}, one node of {node_bytes} bytes; writer and reader are separate processes"
        );
        Ok(Cluster { master, insecure, admin, _master: master_proc, _node: node })
    }
}

/// Runs every phase on one cluster per mode, each phase on every cluster in `modes`' order
/// before the next phase; returns each mode's rows, in that order.
fn orchestrate(args: &BenchArgs, modes: &[Mode]) -> Result<Vec<Rows>, String> {
    let clusters = modes.iter().map(|m| Cluster::start(args, m.insecure)).collect::<Result<Vec<_>, _>>()?;
    // Each phase once on every cluster, in order.
    let each = |phase: &dyn Fn(&Cluster) -> Result<Measured, String>| -> Result<Vec<Measured>, String> {
        clusters.iter().map(phase).collect()
    };
    let label = |i: usize| if modes.len() > 1 { format!("{:<12} ", modes[i].label) } else { String::new() };
    println!(
        "{}{:<6} {:<8} {:<6} {:>10} {:>9} {:>9} {:>9}",
        if modes.len() > 1 { format!("{:<12} ", "mode") } else { String::new() },
        "proto",
        "size",
        "op",
        "ops/s",
        "GB/s",
        "p50 us",
        "p99 us"
    );
    // Per mode: protocol, size, op and what was measured.
    let mut rows: Vec<Vec<(String, usize, String, Measured)>> = modes.iter().map(|_| Vec::new()).collect();
    let mut record = |proto: &str, size: usize, op: &str, measured: Vec<Measured>, note: &str| {
        for (i, m) in measured.into_iter().enumerate() {
            println!(
                "{}{:<6} {:<8} {:<6} {:>10.0} {:>9.2} {:>9} {:>9}{note}",
                label(i),
                proto,
                human(size),
                op,
                m.ops_s(),
                m.gbps(),
                m.p50_us,
                m.p99_us
            );
            rows[i].push((proto.to_string(), size, op.to_string(), m));
        }
    };
    for proto in &args.protocols {
        proto.parse::<Protocol>()?;
        for &size in &args.sizes {
            let count = (BYTES_PER_SIZE / size).clamp(4, 2000);
            let prefix = format!("bench/{proto}/{size}");
            let (d, h) = (args.duration, human(size));
            for (op, secs) in [("put", d), ("get", d), ("exist", d / 2.0)] {
                progress(&format!("{proto} {h}: {op} for {secs}s"));
                let measured = each(&|c| run_phase(op, c, proto, &prefix, size, count, secs))?;
                eprint!("\r\x1b[2K");
                record(proto, size, op, measured, "");
            }
            if proto == "auto" && size == 4 << 20 && args.baseline {
                // The same object over and over: source and destination stay in cache, as in
                // the warm memcpy it is compared with.
                progress("auto 4 MiB: get of one hot object");
                let hot = each(&|c| run_phase("get", c, proto, &prefix, size, 1, d))?;
                eprint!("\r\x1b[2K");
                record("auto-hot", size, "get", hot, "  (one hot object)");
            }
        }
    }
    // Several reader processes at once against one stream (left out of a TCP-only part).
    let multi: Vec<Option<(f64, f64)>> = match args.no_multi {
        true => clusters.iter().map(|_| None).collect(),
        false => {
            let size = 1 << 20;
            let prefix = "bench/multi";
            let count = MULTI_OBJECTS;
            progress("multi-client: put");
            each(&|c| run_phase("put", c, "auto", prefix, size, count, 0.0))?;
            progress("multi-client: 1 reader");
            let one = each(&|c| run_phase("get", c, "auto", prefix, size, count, args.duration))?;
            progress(&format!("multi-client: {} readers", args.clients));
            // The readers' GB/s in aggregate, per cluster.
            let many = clusters
                .iter()
                .map(|c| {
                    let secs = args.duration.to_string();
                    let reader: Vec<String> =
                        ["get", &c.master, "auto", prefix, &size.to_string(), &count.to_string(), &secs]
                            .map(String::from)
                            .to_vec();
                    Ok(run_workers(&vec![reader; args.clients], c.insecure)?.iter().map(Measured::gbps).sum::<f64>())
                })
                .collect::<Result<Vec<f64>, String>>()?;
            eprint!("\r\x1b[2K");
            one.iter().zip(many).map(|(one, many)| Some((one.gbps(), many))).collect()
        }
    };
    let mut out = Vec::new();
    for (i, c) in clusters.iter().enumerate() {
        let mut mode: Rows =
            rows[i].iter().map(|(p, size, op, m)| (format!("{p} {} {op}", human(*size)), m.ops_s())).collect();
        if let Some((one, aggregate)) = multi[i] {
            println!(
                "{}get 1 MiB: 1 reader {one:.2} GB/s; {} concurrent readers {aggregate:.2} GB/s in aggregate",
                label(i),
                args.clients
            );
            mode.push(("get 1 MiB, 1 reader".into(), one));
            mode.push((format!("get 1 MiB, {} readers", args.clients), aggregate));
        }
        if args.baseline {
            baseline(args, &rows[i], multi[i])?;
        }
        c.admin.remove_by_regex("bench/.*", true).map_err(|e| format!("cleanup: {e}"))?;
        out.push(mode);
    }
    Ok(out)
}

/// GB/s of a single-thread copy of `size` bytes between two warm buffers.
fn memcpy_gbps(size: usize, secs: f64) -> f64 {
    let src: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let (start, mut bytes) = (Instant::now(), 0u64);
    while start.elapsed().as_secs_f64() < secs {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        bytes += size as u64;
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// GB/s of a single-thread copy of `size` bytes from a rotating set of `set` bytes of source
/// buffers into one destination: the memory traffic of reading a set of objects.
fn memcpy_rotating_gbps(size: usize, set: usize, secs: f64) -> f64 {
    let n = (set / size).max(1);
    let srcs: Vec<Vec<u8>> = (0..n).map(|k| vec![k as u8; size]).collect();
    let mut dst = vec![0u8; size];
    let (start, mut bytes, mut i) = (Instant::now(), 0u64, 0);
    while start.elapsed().as_secs_f64() < secs {
        dst.copy_from_slice(std::hint::black_box(&srcs[i % n]));
        std::hint::black_box(&mut dst);
        bytes += size as u64;
        i += 1;
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// GB/s of a raw TCP exchange over loopback: a 16-byte request, `size` bytes back.
fn raw_tcp_gbps(size: usize, secs: f64) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let data = vec![7u8; size];
        let mut req = [0u8; 16];
        while s.read_exact(&mut req).is_ok() {
            if s.write_all(&data).is_err() {
                break;
            }
        }
    });
    let mut c = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    c.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; size];
    let (start, mut bytes) = (Instant::now(), 0u64);
    while start.elapsed().as_secs_f64() < secs {
        c.write_all(&[0u8; 16]).map_err(|e| e.to_string())?;
        c.read_exact(&mut buf).map_err(|e| e.to_string())?;
        bytes += size as u64;
    }
    let gbps = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
    drop(c);
    let _ = server.join();
    Ok(gbps)
}

/// The ceilings of `rows`, and of the multi-reader phase's figures (one reader, all of them)
/// when it ran.
fn baseline(
    args: &BenchArgs,
    rows: &[(String, usize, String, Measured)],
    multi: Option<(f64, f64)>,
) -> Result<(), String> {
    let find = |proto: &str, size: usize, op: &str| {
        rows.iter().find(|(p, s, o, _)| p == proto && *s == size && o == op).map(|(_, _, _, m)| m.gbps())
    };
    println!("baseline (same run):");
    let check = |what: &str, ours: f64, ceiling: f64, goal: f64| {
        let r = ours / ceiling;
        let verdict = if r >= goal { "meets" } else { "BELOW" };
        println!("  {what:<52} {ours:>6.2} / {ceiling:>6.2} GB/s = {r:.2}  (goal >= {goal}: {verdict})");
    };
    let secs = args.duration;
    if let Some(ours) = find("auto", 4 << 20, "get") {
        check("get 4 MiB, other client, shm vs memcpy (warm, cached)", ours, memcpy_gbps(4 << 20, secs), 0.7);
        check(
            "get 4 MiB, other client, shm vs memcpy (same 256 MiB set)",
            ours,
            memcpy_rotating_gbps(4 << 20, BYTES_PER_SIZE, secs),
            0.7,
        );
    }
    if let Some(ours) = find("auto-hot", 4 << 20, "get") {
        check("get 4 MiB, one hot object, shm vs memcpy (warm)", ours, memcpy_gbps(4 << 20, secs), 0.7);
    }
    if let Some(ours) = find("tcp", 4 << 20, "get") {
        check("get 4 MiB, other client, TCP vs raw TCP", ours, raw_tcp_gbps(4 << 20, secs)?, 0.75);
    }
    if let Some(ours) = find("auto", 64 << 20, "put") {
        check("put 64 MiB into a same-host client vs memcpy", ours, memcpy_gbps(64 << 20, secs), 0.7);
    }
    if let Some((one, many)) = multi {
        check(&format!("{} concurrent gets of 1 MiB vs 1 stream", args.clients), many, one, 1.0);
    }
    for &size in &args.sizes {
        println!(
            "  {:<8} memcpy {:>6.2} GB/s, raw TCP {:>6.2} GB/s",
            human(size),
            memcpy_gbps(size, secs / 4.0),
            raw_tcp_gbps(size, secs / 4.0)?
        );
    }
    Ok(())
}
