//! Cluster roles: who serves which group, and the loops that act on it. They drive the log
//! ([`crate::log`]: writers, followers, snapshots) and object state ([`crate::state`]: the
//! master a role serves or replays into), and nothing below imports them.
//!
//! - [`ownership`]: group records and master registrations in the coordination store.
//! - [`cvm`]: the pure rules by which a master decides its role per group.
//! - [`ha`]: the role loop that applies them; [`standby`]: following a group's log and
//!   promotion; [`reshard`]: operators' requests to move a group.
//! - [`compaction`]: publishing snapshots and cutting the log behind them;
//!   [`snapshot_peers`]: snapshots kept by each master and fetched from the others.
//! - [`segments`]: stable segments' descriptors and the static VSegment quota.

pub mod compaction;
pub mod cvm;
pub mod ha;
pub mod ownership;
pub mod reshard;
pub mod segments;
pub mod snapshot_peers;
pub mod standby;
