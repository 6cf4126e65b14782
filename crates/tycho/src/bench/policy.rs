//! `tycho bench policy`: the hit ratio each eviction policy gives a trace, offline.
//!
//! A trace (Mooncake's FAST'25 format: one JSON object per request with `timestamp` in ms and
//! `hash_ids`, the ids of its prompt's prefix blocks) is replayed against a [`Master`] in this
//! process, one per policy and capacity: the master's own policy, watermark, round size, read
//! leases and allocator decide what stays, on a manual clock that follows the trace's timestamps
//! divided by `--speedup`. Each request is what LMCache's zero-copy mode asks of a store: an
//! existence check of every block, a lookup of the leading run of blocks that exist (the hits),
//! and a put of the missing blocks after it. Beside the master's policies, a block-level model of
//! the same watermark and rounds (no leases) gives FIFO, LRU and Belady's optimum (evict the
//! block whose next use is farthest), the bound no online policy passes.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::io::BufRead;
use std::sync::Arc;

use clap::Args;
use tycho_master::policy::EvictionPolicy;
use tycho_master::{Clock, ManualClock, Master, MasterConfig, WriteMode};
use tycho_proto::{
    BatchKeyQuery, BatchWriteFinish, BatchWriteStart, ClientId, ErrorCode, KeyRef, ReplicateConfig, SegmentDesc,
    SegmentId,
};
use tycho_routing::route_for;

/// `tycho bench policy` flags.
#[derive(Args, Debug, Clone)]
pub struct BenchPolicyArgs {
    /// The trace: JSON lines with `timestamp` (ms) and `hash_ids` (Mooncake's FAST'25 format).
    #[arg(long)]
    trace: std::path::PathBuf,
    /// Effective capacity in blocks: what the store holds below its high watermark. The segment
    /// is this divided by the watermark (0.9), rounded up.
    #[arg(long)]
    capacity: u64,
    /// Also run at these multiples of the capacity.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    scale: Vec<f64>,
    /// Bytes per block.
    #[arg(long, default_value_t = 64 << 10)]
    block_size: u64,
    /// Trace time runs this many times faster than the master's clock (read leases last 10 s of
    /// the master's time, so this decides how much of the trace they cover).
    #[arg(long, default_value_t = 10.0)]
    speedup: f64,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// The master's policies to run.
    #[arg(long, value_delimiter = ',', default_value = "lru,reuse")]
    policies: Vec<EvictionPolicy>,
}

/// One request of the trace.
struct Request {
    at_ms: u64,
    blocks: Vec<u64>,
}

/// Runs the replay; returns the process exit code.
pub fn run(args: BenchPolicyArgs) -> i32 {
    match replay_all(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn replay_all(args: &BenchPolicyArgs) -> Result<(), String> {
    if args.capacity == 0 || args.block_size == 0 || args.speedup.is_nan() || args.speedup <= 0.0 {
        return Err("--capacity, --block-size and --speedup must be positive".into());
    }
    let trace = read_trace(&args.trace, args.limit)?;
    let asked: u64 = trace.iter().map(|r| r.blocks.len() as u64).sum();
    let distinct = trace.iter().flat_map(|r| &r.blocks).collect::<HashSet<_>>().len();
    let watermark = MasterConfig::default().eviction_high_watermark_ratio;
    println!(
        "trace {}: {} requests, {asked} blocks asked, {distinct} distinct; blocks of {} B; master clock = trace time / {}",
        args.trace.display(),
        trace.len(),
        args.block_size,
        args.speedup
    );
    println!("hit ratio: blocks served from the store (the leading run of each request) / blocks asked");
    println!();
    println!(
        "{:>9} {:>9} | {:>7} {:>7} {:>7} | {}",
        "capacity",
        "segment",
        "fifo",
        "lru",
        "belady",
        args.policies.iter().map(|p| format!("{:>8}", format!("{p}(m)"))).collect::<Vec<_>>().join(" ")
    );
    for scale in &args.scale {
        let capacity = (args.capacity as f64 * scale).round() as u64;
        let segment = (capacity as f64 / watermark).ceil() as u64;
        let model = |kind| Model::run(kind, &trace, segment, watermark).hit_ratio(asked);
        let (fifo, lru, belady) = (model(ModelKind::Fifo), model(ModelKind::Lru), model(ModelKind::Belady));
        let master: Vec<f64> = args
            .policies
            .iter()
            .map(|p| replay_master(*p, &trace, segment, args).map(|hits| hits as f64 / asked as f64))
            .collect::<Result<_, _>>()?;
        println!(
            "{capacity:>9} {segment:>9} | {fifo:>7.4} {lru:>7.4} {belady:>7.4} | {}",
            master.iter().map(|h| format!("{h:>8.4}")).collect::<Vec<_>>().join(" ")
        );
        for (p, h) in args.policies.iter().zip(&master) {
            if belady > lru {
                println!(
                    "{:>21}{p}(m): {:.2} of the gap from the model's LRU to Belady closed",
                    "",
                    (h - lru) / (belady - lru)
                );
            }
        }
    }
    println!();
    println!("(m): the master's own policy, leases and rounds; fifo, lru, belady: the block-level model (no leases)");
    Ok(())
}

fn read_trace(path: &std::path::Path, limit: Option<usize>) -> Result<Vec<Request>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open the trace {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| format!("{}:{}: {what}", path.display(), n + 1);
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| bad(&e.to_string()))?;
        let at_ms = v["timestamp"].as_u64().ok_or_else(|| bad("no integer `timestamp`"))?;
        let blocks = v["hash_ids"]
            .as_array()
            .ok_or_else(|| bad("no `hash_ids` list"))?
            .iter()
            .map(|b| b.as_u64().ok_or_else(|| bad("a hash id that is not an integer")))
            .collect::<Result<Vec<u64>, _>>()?;
        out.push(Request { at_ms, blocks });
    }
    if out.is_empty() {
        return Err(format!("{} holds no request", path.display()));
    }
    Ok(out)
}

const TENANT: &str = "bench-policy";
const CLIENT: ClientId = ClientId(1);
/// How often production housekeeping runs (and so checks the watermark), ms.
const TICK_MS: u64 = 100;

/// Replays the trace against a master running `policy` with one segment of `segment` blocks;
/// returns the blocks served.
fn replay_master(
    policy: EvictionPolicy,
    trace: &[Request],
    segment: u64,
    args: &BenchPolicyArgs,
) -> Result<u64, String> {
    let cfg = MasterConfig { eviction_policy: policy, ..MasterConfig::default() };
    let clock = Arc::new(ManualClock::new(0));
    let m = Master::new(cfg, clock.clone() as Arc<dyn Clock>);
    let desc = SegmentDesc {
        id: SegmentId(1),
        name: "bench".into(),
        base: 0,
        size: segment * args.block_size,
        endpoint: "127.0.0.1:1".into(),
        host: "bench".into(),
        incarnation: 1,
    };
    m.mount_segment(CLIENT, desc).map_err(|e| format!("mount: {e:?}"))?;
    let (mut hits, mut next_tick, mut write_id) = (0u64, 0u64, 0u64);
    let start = trace[0].at_ms;
    for r in trace {
        // The master's clock follows the trace; housekeeping runs every TICK_MS of it.
        let at = ((r.at_ms - start) as f64 / args.speedup) as u64;
        while next_tick <= at {
            clock.advance(next_tick.saturating_sub(clock.now_ms()));
            m.ping(CLIENT);
            m.tick();
            next_tick += TICK_MS;
        }
        clock.advance(at.saturating_sub(clock.now_ms()));
        let keys: Vec<KeyRef> = r.blocks.iter().map(|b| key_ref(*b)).collect();
        let exist = m.batch_exist_key(&BatchKeyQuery { tenant: TENANT.into(), keys: keys.clone() });
        let lead = exist.iter().take_while(|e| matches!(e, Ok(true))).count();
        if lead > 0 {
            let got = m.batch_get_replica_list(&BatchKeyQuery { tenant: TENANT.into(), keys: keys[..lead].to_vec() });
            hits += got.iter().take_while(|g| g.is_ok()).count() as u64;
        }
        let missing: Vec<KeyRef> = keys[lead..]
            .iter()
            .zip(&exist[lead..])
            .filter(|(_, e)| !matches!(e, Ok(true)))
            .map(|(k, _)| k.clone())
            .collect();
        if missing.is_empty() {
            continue;
        }
        let write_ids: Vec<u64> = missing
            .iter()
            .map(|_| {
                write_id += 1;
                write_id
            })
            .collect();
        let start = BatchWriteStart {
            client: CLIENT,
            tenant: TENANT.into(),
            items: missing.iter().map(|k| (k.clone(), args.block_size)).collect(),
            config: ReplicateConfig::default(),
            write_ids: write_ids.clone(),
        };
        let started = m.batch_write_start(WriteMode::Put, &start);
        let (keys, write_ids): (Vec<KeyRef>, Vec<u64>) = started
            .iter()
            .zip(missing.into_iter().zip(write_ids))
            .filter_map(|(s, kw)| match s {
                Ok(_) => Some(kw),
                Err(ErrorCode::NO_AVAILABLE_HANDLE) | Err(ErrorCode::OBJECT_ALREADY_EXISTS) => None,
                Err(e) => {
                    eprintln!("put start: {e:?}");
                    None
                }
            })
            .unzip();
        let finish = BatchWriteFinish { client: CLIENT, tenant: TENANT.into(), keys, write_ids };
        if let Some(e) = m.batch_write_finish(&finish, true).into_iter().find_map(Result::err) {
            return Err(format!("put end failed: {e:?}"));
        }
    }
    Ok(hits)
}

fn key_ref(block: u64) -> KeyRef {
    let key = format!("model@{block}");
    KeyRef { route: route_for(TENANT, &key, 1), key }
}

/// The block-level model's policies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ModelKind {
    Fifo,
    Lru,
    Belady,
}

/// A store of whole blocks with the master's watermark and rounds, and no leases: a put into a
/// full store evicts what a round asked for bytes would (at least 1 % of the capacity); after
/// each request, above the watermark, a round evicts `eviction_ratio` of the blocks.
struct Model {
    kind: ModelKind,
    /// Block -> its rank (insertion number for FIFO, last use for LRU).
    rank: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    /// Belady: the blocks by their next use (farthest first), stale entries skipped.
    next_use: BinaryHeap<(u64, u64)>,
    /// Belady: each block's next use as the heap should hold it.
    next_of: HashMap<u64, u64>,
    clock: u64,
    hits: u64,
}

impl Model {
    fn run(kind: ModelKind, trace: &[Request], segment: u64, watermark: f64) -> Model {
        let cfg = MasterConfig::default();
        // Belady needs, at each use of a block, the position of its next use.
        let positions: Vec<u64> = if kind == ModelKind::Belady { next_uses(trace) } else { Vec::new() };
        let mut m = Model {
            kind,
            rank: HashMap::new(),
            order: BTreeMap::new(),
            next_use: BinaryHeap::new(),
            next_of: HashMap::new(),
            clock: 0,
            hits: 0,
        };
        let mut pos = 0usize;
        for r in trace {
            let lead = r.blocks.iter().take_while(|b| m.rank.contains_key(b)).count();
            m.hits += lead as u64;
            let missing: HashSet<u64> = r.blocks[lead..].iter().filter(|b| !m.rank.contains_key(b)).copied().collect();
            let room = segment.saturating_sub(m.rank.len() as u64);
            if (missing.len() as u64) > room {
                m.evict((missing.len() as u64 - room).max(segment / 100) as usize);
            }
            // Uses back to front, as the master numbers a batch.
            for (i, b) in r.blocks.iter().enumerate().rev() {
                let next = positions.get(pos + i).copied().unwrap_or(u64::MAX);
                if m.rank.contains_key(b) || missing.contains(b) {
                    m.used(*b, next);
                }
            }
            pos += r.blocks.len();
            let len = m.rank.len() as f64;
            if len > segment as f64 * watermark {
                m.evict((len * cfg.eviction_ratio).ceil() as usize);
            }
        }
        m
    }

    fn hit_ratio(&self, asked: u64) -> f64 {
        self.hits as f64 / asked as f64
    }

    /// Block `b` is used (or put); `next` is the position of its next use.
    fn used(&mut self, b: u64, next: u64) {
        self.clock += 1;
        match self.kind {
            ModelKind::Fifo => {
                if !self.rank.contains_key(&b) {
                    self.rank.insert(b, self.clock);
                    self.order.insert(self.clock, b);
                }
            }
            ModelKind::Lru => {
                if let Some(old) = self.rank.insert(b, self.clock) {
                    self.order.remove(&old);
                }
                self.order.insert(self.clock, b);
            }
            ModelKind::Belady => {
                self.rank.insert(b, 0);
                self.next_of.insert(b, next);
                self.next_use.push((next, b));
            }
        }
    }

    fn evict(&mut self, n: usize) {
        for _ in 0..n.min(self.rank.len()) {
            let victim = match self.kind {
                ModelKind::Fifo | ModelKind::Lru => self.order.pop_first().map(|(_, b)| b),
                ModelKind::Belady => loop {
                    let Some((next, b)) = self.next_use.pop() else { break None };
                    if self.next_of.get(&b) == Some(&next) {
                        self.next_of.remove(&b);
                        break Some(b);
                    }
                },
            };
            match victim {
                Some(b) => {
                    self.rank.remove(&b);
                }
                None => break,
            }
        }
    }
}

/// For each block position of the trace (requests concatenated), the position of the same
/// block's next use, or `u64::MAX`.
fn next_uses(trace: &[Request]) -> Vec<u64> {
    let all: Vec<u64> = trace.iter().flat_map(|r| r.blocks.iter().copied()).collect();
    let mut out = vec![u64::MAX; all.len()];
    let mut seen: HashMap<u64, u64> = HashMap::new();
    for (i, b) in all.iter().enumerate().rev() {
        if let Some(n) = seen.insert(*b, i as u64) {
            out[i] = n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(reqs: &[&[u64]]) -> Vec<Request> {
        reqs.iter().enumerate().map(|(i, b)| Request { at_ms: i as u64, blocks: b.to_vec() }).collect()
    }

    #[test]
    fn the_model_counts_leading_runs_only() {
        // Block 2 of the second request is new, so block 3 after it is no hit.
        let t = trace(&[&[1, 3], &[1, 2, 3]]);
        let m = Model::run(ModelKind::Lru, &t, 100, 0.9);
        assert_eq!(m.hits, 1);
    }

    #[test]
    fn belady_keeps_what_is_used_next() {
        // Room for 2 blocks (the watermark never reached): block 9 is never used again, block 1 is.
        let t = trace(&[&[1], &[9], &[5], &[1]]);
        let b = Model::run(ModelKind::Belady, &t, 2, 1.0);
        let f = Model::run(ModelKind::Fifo, &t, 2, 1.0);
        assert_eq!(b.hits, 1);
        assert_eq!(f.hits, 0);
    }

    #[test]
    fn the_master_replay_serves_a_repeated_prefix() {
        let t = trace(&[&[1, 2, 3], &[1, 2, 4], &[1, 2, 3]]);
        let args = BenchPolicyArgs {
            trace: "unused".into(),
            capacity: 100,
            scale: vec![1.0],
            block_size: 4096,
            speedup: 1.0,
            limit: None,
            policies: vec![EvictionPolicy::Reuse],
        };
        // 2 hits in the second request, 3 in the third.
        assert_eq!(replay_master(EvictionPolicy::Reuse, &t, 100, &args), Ok(5));
    }
}
