//! The benchmark drivers behind `tycho bench`: each starts what it measures (masters, nodes,
//! an etcd) as child processes on loopback and prints its figures. [`harness`] holds what
//! they share; none of them is part of a role.
//!
//! - [`e2e`]: the data path (`tycho bench`, with `--compare-insecure` and Mooncake's wheel);
//! - [`master`] and [`scale`]: metadata-only load on one master, and on several groups or
//!   masters at one offered rate;
//! - [`fill`], [`hot`], [`reshard`], [`policy`]: segment fill before eviction, hot-replica
//!   fan-out, the cost of moving a group, eviction policies on a trace.

use clap::Subcommand;

pub mod e2e;
pub mod fill;
pub mod harness;
pub mod hot;
pub mod master;
pub mod policy;
pub mod reshard;
pub mod scale;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchTop {
    #[command(subcommand)]
    sub: Option<BenchCmd>,
    #[command(flatten)]
    e2e: e2e::BenchArgs,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Metadata-only load against a master (fake segments, no data moved).
    Master(master::BenchMasterArgs),
    /// How much of a segment holds user bytes before the first eviction.
    Fill(fill::BenchFillArgs),
    /// What moving a KVPT group costs its clients: the write freeze, the reshard's total time,
    /// and read latency during it next to without one (two masters on an etcd it starts).
    Reshard(reshard::BenchReshardArgs),
    /// What hot-replica fan-out buys the readers of one hot object: their aggregate throughput
    /// with fan-out off and enforce, each node's serving rate capped.
    Hot(hot::BenchHotArgs),
    /// The hit ratio each eviction policy gives a trace of prefix blocks (Mooncake's FAST'25
    /// format), replayed offline against the master's own policies, beside FIFO, LRU and
    /// Belady's optimum.
    Policy(policy::BenchPolicyArgs),
}

/// Runs the benchmark `top` names; returns the exit code.
pub fn run(top: BenchTop) -> i32 {
    let master = match top.sub {
        None => return e2e::run(top.e2e),
        Some(BenchCmd::Fill(a)) => return fill::run(a),
        Some(BenchCmd::Reshard(a)) => return reshard::run(a),
        Some(BenchCmd::Hot(a)) => return hot::run(a),
        Some(BenchCmd::Policy(a)) => return policy::run(a),
        Some(BenchCmd::Master(a)) => a,
    };
    let result = if master.groups > 1 || master.masters > 1 { scale::run(&master) } else { master::run(master) };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}
