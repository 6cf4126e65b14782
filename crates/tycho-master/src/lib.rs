//! The Tycho master: object metadata of the KVPT groups it owns.
//!
//! [`Master`] holds the logic of every RPC and is independent of the transport;
//! [`MasterRpc`] serves it over `tycho-rpc`; [`run_housekeeping`] drives its timers.

mod admin;
mod alloc;
mod clock;
pub mod commit;
pub mod compaction;
mod config;
pub mod cvm;
mod evict;
pub mod ha;
mod health;
pub mod heat;
mod master;
mod metrics;
mod object;
pub mod oplog;
pub mod ownership;
pub mod policy;
pub mod record;
pub mod reshard;
mod rpc;
mod segment;
pub mod snapshot;
pub mod standby;
pub mod task;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use admin::{
    probe_target, start_admin, AdminConfig, AdminHandle, ClusterView, ProbeConfig, ProbeState, DEFAULT_PROBE_INTERVAL,
    DEFAULT_PROBE_TIMEOUT,
};
pub use clock::{Clock, ManualClock, SystemClock, MANUAL_UNIX_OFFSET_MS};
pub use config::*;
pub use evict::{RoundRequest, EVICTION_WAIT};
pub use health::HEALTH_CHECK_BUDGET;
pub use master::{
    Counters, EvictQueue, EvictReason, FanoutCounters, Group, KeyCursor, Master, ObjectGauges, ReplayError, Suppressed,
    WriteMode, MAX_LIST_BYTES, MAX_LIST_KEYS, MAX_REGEX_LEN, RESPONSIVE_INTERVAL_MS, STALL_MS,
};
pub use metrics::{RpcMetrics, RpcSnapshot, LATENCY_BUCKETS};
pub use object::SHARD_COUNT;
pub use rpc::{MasterRpc, MAX_CONCURRENT_SCANS};
pub use segment::HELD_PAST_EXPIRY_MS;

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
