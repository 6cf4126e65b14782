//! The log: what a group's primary writes to the coordination store and what a standby or a
//! new primary replays. The lowest concern: it sees none of the others, and object state and
//! the cluster roles write and read it.
//!
//! - [`record`]: the records of the log and of snapshots (versioned, checksummed), and the
//!   [`record::RecordSink`] object state hands them to.
//! - [`task_record`]: the persisted form of a group's tasks and dynamic-copy leases.
//! - [`layout`] and [`fence`]: where a group's log lives, how its operations fail, and the
//!   ownership record every commit is fenced on.
//! - [`commit`]: the decisions of one batch's commit, without I/O; [`oplog`] drives them
//!   against the store (the writer, the transaction combiner, the follower).
//! - [`snapshot`]: snapshot files and their stores.

pub mod commit;
pub mod fence;
pub mod layout;
pub mod oplog;
pub mod record;
pub mod snapshot;
pub mod task_record;
