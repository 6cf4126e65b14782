//! The Tycho master: object metadata of the KVPT groups it owns.
//!
//! [`Master`] holds the logic of every RPC and is independent of the transport;
//! [`MasterRpc`] serves it over `tycho-rpc`; [`run_housekeeping`] drives its timers.

mod cluster;
mod histogram;
mod log;
mod serve;
mod state;

pub use cluster::{compaction, cvm, ha, ownership, reshard, segments, snapshot_peers, standby};
pub use log::{commit, oplog, record, snapshot};
pub use state::{heat, policy, task};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use serve::admin::{
    probe_target, start_admin, AdminConfig, AdminHandle, ClusterView, ProbeConfig, ProbeState, DEFAULT_PROBE_INTERVAL,
    DEFAULT_PROBE_TIMEOUT,
};
pub use serve::health::HEALTH_CHECK_BUDGET;
pub use serve::metrics::{RpcMetrics, RpcSnapshot, LATENCY_BUCKETS};
pub use serve::rpc::{MasterRpc, MAX_CONCURRENT_SCANS};
pub use state::clock::{Clock, ManualClock, SystemClock, MANUAL_UNIX_OFFSET_MS};
pub use state::config::*;
pub use state::evict::{RoundRequest, EVICTION_WAIT};
pub use state::master::{
    Counters, EvictQueue, EvictReason, FanoutCounters, Group, KeyCursor, Master, ObjectGauges, ReplayError, Suppressed,
    WriteMode, MAX_LIST_BYTES, MAX_LIST_KEYS, MAX_REGEX_LEN, RESPONSIVE_INTERVAL_MS, STALL_MS,
};
pub use state::object::SHARD_COUNT;
pub use state::segment::HELD_PAST_EXPIRY_MS;

/// Calls [`Master::tick`] every `interval` on a dedicated thread until `stop` is set, and runs
/// the background evictor ([`Master::run_evictor`]) on another.
pub fn run_housekeeping(master: Arc<Master>, interval: Duration, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("tycho-housekeeping".into())
        .spawn(move || {
            std::thread::scope(|s| {
                std::thread::Builder::new()
                    .name("tycho-evictor".into())
                    .spawn_scoped(s, || master.run_evictor())
                    .expect("spawn evictor thread");
                while !stop.load(Ordering::Relaxed) {
                    master.tick();
                    // Nobody waits for what housekeeping logs: forget it (and the logs it names).
                    drop(Master::take_logged());
                    std::thread::sleep(interval);
                }
                master.stop_evictor();
            })
        })
        .expect("spawn housekeeping thread")
}
