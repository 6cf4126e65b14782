//! Object state: the objects, segments, tasks and use order of the groups a master serves,
//! and every RPC's logic over them ([`master::Master`]). It writes records to the log
//! ([`crate::log`]) and sees nothing above it.
//!
//! - [`master`] (with `master/`): the RPC logic, a group's state ([`master::Group`]), applying
//!   records, export to snapshots, fan-out and tasks.
//! - [`object`], [`segment`], [`alloc`]: object metadata in shards, mounted segments and their
//!   range allocators.
//! - [`evict`], [`policy`], [`heat`]: eviction rounds, the use order they rank by, and the
//!   hot-key window of fan-out.
//! - [`task`]: a group's task table; [`config`] and [`clock`]: the master's settings and time.

pub(crate) mod alloc;
pub(crate) mod clock;
pub(crate) mod config;
pub(crate) mod evict;
pub mod heat;
pub(crate) mod master;
pub(crate) mod object;
pub mod policy;
pub(crate) mod segment;
pub mod task;
