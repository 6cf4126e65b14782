//! `tycho bench fill`: how much of a segment holds user bytes before the first eviction.
//!
//! For each value size it starts a master and one `tycho node` with a segment of the given size,
//! writes new values in batches from one client until the master's object count drops below
//! what was committed (the first eviction), and reports the user bytes committed before that
//! batch as a fraction of the segment.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use tycho_client::{Client, ClientConfig, WriteMode};
use tycho_proto::{Request, Response};

use crate::bench::harness::{free_port, wait_for_port, ChildGuard};

/// `tycho bench fill` flags.
#[derive(Args, Debug, Clone)]
pub struct BenchFillArgs {
    /// Value sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "600,4096")]
    sizes: Vec<usize>,
    /// Segment size of the node (a number with an optional KB/MB/GB suffix).
    #[arg(long, default_value = "256MB")]
    segment_size: String,
    /// Values per batch put.
    #[arg(long, default_value_t = 256)]
    batch: usize,
}

/// Runs the fill measurement; returns the process exit code.
pub fn run(args: BenchFillArgs) -> i32 {
    match fill_all(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn objects(c: &Client) -> Result<(u64, u64), String> {
    match c.call(&Request::Stats).map_err(|e| e.to_string())? {
        Response::Stats(s) => Ok((s.objects, s.capacity_bytes)),
        _ => Err("unexpected reply to Stats".into()),
    }
}

fn fill_all(args: &BenchFillArgs) -> Result<(), String> {
    println!("{:<10} {:>12} {:>14} {:>10}", "value", "objects", "user bytes", "fill");
    for &size in &args.sizes {
        if size == 0 {
            return Err("value sizes must be positive".into());
        }
        let (count, capacity) = fill_one(args, size)?;
        let bytes = count * size as u64;
        println!("{:<10} {:>12} {:>14} {:>10.3}", format!("{size} B"), count, bytes, bytes as f64 / capacity as f64);
    }
    Ok(())
}

/// Objects committed before the first eviction, and the segment bytes.
fn fill_one(args: &BenchFillArgs, size: usize) -> Result<(u64, u64), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port = free_port();
    let master = format!("127.0.0.1:{port}");
    let _m = ChildGuard(
        Command::new(&exe)
            .args(["master", "--rpc-address", "127.0.0.1", "--rpc-port", &port.to_string(), "--metrics-port", "0"])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?,
    );
    wait_for_port(port, "master")?;
    let _n = ChildGuard(
        Command::new(&exe)
            .args(["node", "--master", &master, "--segment-size", &args.segment_size, "--port", "0"])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?,
    );
    let client = Client::connect(ClientConfig::new(&master)).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let capacity = loop {
        let (_, cap) = objects(&client)?;
        if cap > 0 {
            break cap;
        }
        if Instant::now() > deadline {
            return Err("the node did not mount its segment".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let value = vec![0x5au8; size];
    let mut committed = 0u64;
    let mut next = 0u64;
    // Far more than fits: stop at the first eviction (or the first failed put).
    let limit = capacity / size as u64 * 2;
    while next < limit {
        let keys: Vec<String> = (0..args.batch).map(|i| format!("fill/{}", next + i as u64)).collect();
        next += args.batch as u64;
        let items: Vec<(&str, &[u8])> = keys.iter().map(|k| (k.as_str(), &value[..])).collect();
        let res = client.write_batch(WriteMode::Put, &items, &Default::default(), false);
        let ok = res.iter().filter(|r| r.is_ok()).count() as u64;
        let (now, _) = objects(&client)?;
        if now < committed + ok || ok < res.len() as u64 {
            break;
        }
        committed += ok;
    }
    let _ = client.close();
    Ok((committed, capacity))
}
