//! The `tycho` binary: every role and tool behind one command.

mod admin;
mod bench;
mod fuzz;
mod master_client;
mod master_cmd;
mod mooncake_flags;
mod node;
mod objects;
mod quota;
mod security;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tycho: a distributed KV-cache store for LLM inference.
#[derive(Parser)]
#[command(name = "tycho", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a master (object metadata service).
    #[command(args_override_self = true)]
    Master(Box<master_cmd::MasterArgs>),
    /// Run everything a first user needs in one process: a master and a node on loopback.
    Up(master_cmd::UpArgs),
    /// Contribute memory to a store and serve it until SIGTERM.
    Node(node::NodeArgs),
    /// Store a file (or standard input) under a key.
    Put(objects::PutArgs),
    /// Fetch a key to a file or standard output.
    Get(objects::GetArgs),
    /// Copy a key's value onto more segments (a task run by the client holding it).
    Copy(objects::CopyArgs),
    /// Move a key's replica from one segment to another (a task run by the client holding it).
    Move(objects::MoveArgs),
    /// Show a copy or move task.
    Task(objects::TaskArgs),
    /// End-to-end benchmark of the data path; `tycho bench master` for the metadata plane.
    Bench(bench::BenchTop),
    /// Whole-master figures: capacity, used, objects, clients, segments.
    Stat(admin::Target),
    /// List keys.
    Ls(admin::LsArgs),
    /// Whether a key exists.
    Exist(admin::KeyArgs),
    /// Remove a key, the keys matching a regex, or everything.
    Rm(admin::RmArgs),
    /// List mounted segments.
    Segments(admin::Target),
    /// The KVPT groups of the cluster: primary, standbys, epoch, caretaking (docs/cluster.md).
    Groups(admin::HttpTarget),
    /// The live masters of the cluster, oldest first.
    Masters(admin::HttpTarget),
    /// Move a KVPT group to another master, and follow the move (docs/cluster.md).
    Reshard(admin::ReshardArgs),
    /// Print the admin token of the cluster secret, for the admin HTTP server's listings.
    AdminToken(admin::TokenArgs),
    /// Plan the static VSegment quota once: divide the stable segments' space between the KVPT
    /// groups and publish it (docs/vsegment.md).
    PlanQuota(quota::PlanQuotaArgs),
    /// Defragment the etcd cluster's members one at a time, reporting each one's stall (opt-in;
    /// see docs/ha.md).
    EtcdDefrag(admin::DefragArgs),
    /// Feed mutated bytes to every network decoder (see docs/security.md).
    Fuzz(fuzz::FuzzArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    // `tycho master` takes `mooncake_master`'s flags too: those Tycho does not implement are
    // set aside before clap parses the rest.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let mut mooncake = Vec::new();
    if args.get(1).is_some_and(|a| a == "master") {
        let (kept, unhandled) = mooncake_flags::split(args.split_off(2));
        args.extend(kept);
        mooncake = unhandled;
    }
    let cli = Cli::parse_from(args);
    let code = match cli.cmd {
        Command::Master(mut a) => {
            a.mooncake_flags = mooncake;
            master_cmd::run_master(*a)
        }
        Command::Up(a) => master_cmd::run_up(a),
        Command::Node(a) => node::run(a),
        Command::Put(a) => objects::put(a),
        Command::Get(a) => objects::get(a),
        Command::Copy(a) => objects::copy(a),
        Command::Move(a) => objects::move_replica(a),
        Command::Task(a) => objects::task(a),
        Command::Bench(b) => bench::run(b),
        Command::AdminToken(a) => admin::admin_token(a),
        Command::EtcdDefrag(a) => admin::etcd_defrag(a),
        Command::PlanQuota(a) => quota::plan_quota(a),
        Command::Stat(t) => admin::stat(t),
        Command::Ls(a) => admin::ls(a),
        Command::Exist(a) => admin::exist(a),
        Command::Rm(a) => admin::rm(a),
        Command::Segments(t) => admin::segments(t),
        Command::Groups(t) => admin::groups(t),
        Command::Masters(t) => admin::masters(t),
        Command::Reshard(a) => admin::reshard(a),
        Command::Fuzz(a) => fuzz::run(a),
    };
    std::process::exit(code);
}
