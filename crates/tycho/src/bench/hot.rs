//! `tycho bench hot`: what hot-replica fan-out buys the readers of one hot object.
//!
//! Each run starts a master (fan-out `off` or `enforce`) and two nodes of two "hosts"
//! (`--host-id`), each of which sends read bytes at no more than `--serve-rate` per second
//! (`tycho node --max-serve-rate`: the stand-in for a node whose network is the bottleneck).
//! One `--size` object is written to the first node and read 16 times to make it hot; with
//! fan-out on, the run waits (bounded) until the master has had it copied to the other node.
//! Then `--readers` reader processes (on a third "host": every read goes over TCP) read it
//! for `--duration` seconds, each checking every byte, and the run reports their aggregate
//! throughput and how many reads each node served (as the nodes count them).
//!
//! Each round runs both modes, in alternating order; the summary gives the median of the
//! per-round ratios (enforce over off) with their spread. With one node capped, the ratio is
//! about the number of replicas, as long as the readers could read faster than one node
//! serves and each replica has a reader (readers pick replicas by rendezvous hashing of their
//! random ids: with R readers, all pick the same one of two replicas once in 2^(R-1) runs).

use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdout, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use clap::Args;
use tycho_client::{parse_size, Client, ClientConfig, Protocol};
use tycho_proto::ReplicateConfig;

use crate::bench::harness::{free_port, wait_for_port, ChildGuard};

/// `tycho bench hot` flags.
#[derive(Args, Debug, Clone)]
pub struct BenchHotArgs {
    /// Reader processes.
    #[arg(long, default_value_t = 8)]
    readers: usize,
    /// Seconds the readers read in each run.
    #[arg(long, default_value_t = 4.0)]
    duration: f64,
    /// Rounds (each runs fan-out off and enforce once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Size of the hot object.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    size: u64,
    /// Most read bytes per second each node sends.
    #[arg(long = "serve-rate", default_value = "100MB", value_parser = parse_size)]
    serve_rate: u64,
    /// Exit with 1 when the median ratio of enforce over off is below this (0: never).
    #[arg(long = "min-ratio", default_value_t = 0.0)]
    min_ratio: f64,
    /// (Internal) run as a reader: master address, key, size, seconds.
    #[arg(long, num_args = 4, hide = true)]
    reader: Option<Vec<String>>,
}

const KEY: &str = "bench-hot/prefix";
const READY: &str = "READY";
/// How long a run waits for a node to mount, or for fan-out's copy.
const WAIT: Duration = Duration::from_secs(30);

/// Entry point; returns the exit code.
pub fn run(args: BenchHotArgs) -> i32 {
    let result = match &args.reader {
        Some(r) => reader(r),
        None => orchestrate(&args),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// The bytes of the hot object.
fn value(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i.wrapping_mul(31) ^ (i >> 12)) as u8).collect()
}

fn reader(a: &[String]) -> Result<(), String> {
    let [master, key, size, secs] = a else { return Err("bad reader arguments".into()) };
    let size: usize = size.parse().map_err(|_| "size")?;
    let secs: f64 = secs.parse().map_err(|_| "secs")?;
    let mut cfg = ClientConfig::new(master);
    cfg.protocol = Protocol::Tcp;
    cfg.host_id = format!("bench-hot-reader-{}", std::process::id());
    cfg.staging_buffer_size = size as u64;
    let client = Client::connect(cfg).map_err(|e| format!("connect: {e}"))?;
    let expected = value(size);
    let mut buf = vec![0u8; size];
    client.get_into(key, &mut buf).map_err(|e| format!("warm-up read: {e}"))?;
    println!("{READY}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).map_err(|e| format!("waiting for the start: {e}"))?;
    let (start, mut reads) = (Instant::now(), 0u64);
    while start.elapsed().as_secs_f64() < secs {
        let n = client.get_into(key, &mut buf).map_err(|e| format!("read: {e}"))?;
        if n != size || buf != expected {
            return Err(format!("read {n} bytes that are not the object's"));
        }
        reads += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let _ = client.close();
    println!("reads {reads} bytes {} secs {elapsed:.3}", reads * size as u64);
    Ok(())
}

/// The lines a child prints, read on a thread of their own so that every wait for one is
/// bounded (a child that stalls without exiting cannot hang the benchmark).
fn lines_of(stdout: ChildStdout) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits up to `wait` for a line of `lines` that `pick` takes; the lines passed over are kept
/// for the error.
fn wait_line<T>(
    lines: &Receiver<String>,
    wait: Duration,
    mut pick: impl FnMut(&str) -> Option<T>,
) -> Result<T, String> {
    let deadline = Instant::now() + wait;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => match pick(&line) {
                Some(v) => return Ok(v),
                None => seen.push(line),
            },
            Err(e) => return Err(format!("{e} after: {seen:?}")),
        }
    }
}

/// A node process, its stdout kept to read what it served when it stops.
struct Node {
    child: ChildGuard,
    lines: Receiver<String>,
    name: String,
}

impl Node {
    fn start(master: &str, host: &str, rate: u64, size: u64) -> Result<Node, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let segment = (size * 4).max(16 << 20).to_string();
        let mut child = ChildGuard(
            Command::new(exe)
                .args(["node", "--master", master, "--segment-size", &segment, "--host-id", host, "--port", "0"])
                .args(["--max-serve-rate", &rate.to_string(), "--protocol", "tcp"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot start a node: {e}"))?,
        );
        let lines = lines_of(child.0.stdout.take().expect("piped"));
        // "tycho node serving N bytes at HOST:PORT (master ...)": its segment's name.
        let name = wait_line(&lines, WAIT, |l| {
            l.starts_with("tycho node serving ")
                .then(|| l.split(" at ").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string))
                .flatten()
        })
        .map_err(|e| format!("the node did not start: {e}"))?;
        Ok(Node { name, child, lines })
    }

    /// Stops the node (SIGTERM) and returns the reads it says it served.
    fn stop(self) -> Result<u64, String> {
        // SAFETY: signals a child this process started and has not reaped.
        unsafe { libc::kill(self.child.0.id() as i32, libc::SIGTERM) };
        wait_line(&self.lines, WAIT, |l| {
            l.strip_prefix("tycho node: served ").and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok())
        })
        .map_err(|e| format!("the node did not say what it served: {e}"))
    }
}

/// One run's figures.
struct Run {
    /// Aggregate read bytes per second.
    throughput: f64,
    reads: u64,
    /// Reads served by the first node and by the second.
    served: (u64, u64),
}

/// The names of the segments that hold `key`.
fn holders(admin: &Client, key: &str) -> Result<Vec<String>, String> {
    let reps = admin.replicas(key).map_err(|e| format!("replicas: {e}"))?;
    let Ok(tycho_proto::Response::Segments(segs)) = admin.call(&tycho_proto::Request::ListSegments) else {
        return Err("no segment list".into());
    };
    let mut names: Vec<String> =
        reps.iter().filter_map(|r| segs.iter().find(|s| s.desc.id == r.segment).map(|s| s.desc.name.clone())).collect();
    names.sort();
    Ok(names)
}

fn segments(admin: &Client) -> usize {
    match admin.call(&tycho_proto::Request::ListSegments) {
        Ok(tycho_proto::Response::Segments(s)) => s.len(),
        _ => 0,
    }
}

fn run_once(args: &BenchHotArgs, mode: &str) -> Result<Run, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port = free_port();
    let master = format!("127.0.0.1:{port}");
    let _master = ChildGuard(
        Command::new(&exe)
            .args(["master", "--rpc-address", "127.0.0.1", "--rpc-port", &port.to_string(), "--metrics-port", "0"])
            .args(["--dynamic-replication-mode", mode])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the master: {e}"))?,
    );
    wait_for_port(port, "master")?;
    let first = Node::start(&master, "bench-hot-host-1", args.serve_rate, args.size)?;
    let second = Node::start(&master, "bench-hot-host-2", args.serve_rate, args.size)?;
    let mut cfg = ClientConfig::new(&master);
    cfg.protocol = Protocol::Tcp;
    cfg.host_id = "bench-hot-writer".into();
    cfg.staging_buffer_size = args.size;
    cfg.reuse_leases = false;
    let admin = Client::connect(cfg).map_err(|e| format!("connect: {e}"))?;
    let deadline = Instant::now() + WAIT;
    while segments(&admin) < 2 {
        if Instant::now() > deadline {
            return Err("the nodes did not mount their segments".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let size = args.size as usize;
    let on_first = ReplicateConfig { preferred_segments: vec![first.name.clone()], ..Default::default() };
    admin.put(KEY, &value(size), &on_first).map_err(|e| format!("put: {e}"))?;
    if holders(&admin, KEY)? != [first.name.clone()] {
        return Err(format!("the object is not on {} alone", first.name));
    }
    // Hot: 16 reads in the heat window (10 s at 0.8 reads/s takes 8).
    let mut buf = vec![0u8; size];
    for _ in 0..16 {
        admin.get_into(KEY, &mut buf).map_err(|e| format!("read: {e}"))?;
    }
    let mut both = vec![first.name.clone(), second.name.clone()];
    both.sort();
    if mode == "enforce" {
        let deadline = Instant::now() + WAIT;
        while holders(&admin, KEY)? != both {
            if Instant::now() > deadline {
                return Err("fan-out did not copy the hot object to the other node".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let replicas = holders(&admin, KEY)?.len();
    // The readers, warmed up, start together.
    let mut readers = Vec::new();
    for _ in 0..args.readers {
        let child = Command::new(&exe)
            .args(["bench", "hot", "--reader", &master, KEY, &size.to_string(), &args.duration.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start a reader: {e}"))?;
        readers.push(ChildGuard(child));
    }
    let mut outputs = Vec::new();
    for r in &mut readers {
        let lines = lines_of(r.0.stdout.take().expect("piped"));
        wait_line(&lines, WAIT, |l| (l == READY).then_some(())).map_err(|e| format!("a reader did not start: {e}"))?;
        outputs.push(lines);
    }
    for r in &mut readers {
        r.0.stdin.take().expect("piped").write_all(b"go\n").map_err(|e| format!("cannot start a reader: {e}"))?;
    }
    let (mut bytes, mut reads, mut secs) = (0u64, 0u64, 0f64);
    let window = Duration::from_secs_f64(args.duration) + WAIT;
    for (r, lines) in readers.iter_mut().zip(outputs) {
        let line = wait_line(&lines, window, |l| l.starts_with("reads ").then(|| l.to_string()))
            .map_err(|e| format!("a reader failed: {e}"))?;
        let _ = r.0.wait();
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).ok_or(format!("bad reader line {line}"));
        reads += num(1)? as u64;
        bytes += num(3)? as u64;
        secs = secs.max(num(5)?);
    }
    drop(admin);
    let served = (first.stop()?, second.stop()?);
    println!(
        "  {mode:<7} {replicas} replica(s): {:>8.1} MB/s, {reads} reads; served by the first node {}, by the second {}",
        bytes as f64 / secs / 1e6,
        served.0,
        served.1
    );
    Ok(Run { throughput: bytes as f64 / secs, reads, served })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn orchestrate(args: &BenchHotArgs) -> Result<(), String> {
    println!(
        "tycho bench hot: one {} byte object, {} reader processes for {} s, each node sending at most {} bytes/s",
        args.size, args.readers, args.duration, args.serve_rate
    );
    let mut ratios = Vec::new();
    for round in 0..args.rounds.max(1) {
        println!("round {}:", round + 1);
        let order = if round % 2 == 0 { ["off", "enforce"] } else { ["enforce", "off"] };
        let (mut off, mut on) = (None, None);
        for mode in order {
            let r = run_once(args, mode)?;
            if r.reads == 0 {
                return Err(format!("no read completed with fan-out {mode}"));
            }
            if r.served.0 + r.served.1 < r.reads {
                return Err(format!("the nodes counted {} reads of {}", r.served.0 + r.served.1, r.reads));
            }
            if mode == "off" {
                off = Some(r.throughput);
            } else {
                on = Some(r.throughput);
            }
        }
        let ratio = on.unwrap_or(0.0) / off.unwrap_or(1.0);
        println!("  enforce / off: {ratio:.2}");
        ratios.push(ratio);
    }
    let (lo, hi) = ratios.iter().fold((f64::MAX, f64::MIN), |(a, b), r| (a.min(*r), b.max(*r)));
    let m = median(&mut ratios);
    println!(
        "aggregate read throughput, enforce / off: median {m:.2} over {} round(s) (spread {lo:.2}..{hi:.2})",
        ratios.len()
    );
    if m < args.min_ratio {
        return Err(format!("the median ratio {m:.2} is below --min-ratio {}", args.min_ratio));
    }
    Ok(())
}
