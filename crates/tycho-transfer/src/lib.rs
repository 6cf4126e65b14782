//! Tycho's data path.
//!
//! - [`Mapping`]: shared memory a segment is made of, or a same-host peer's segment mapped here.
//! - [`SegmentRegistry`]: the segments a process serves.
//! - [`TransferServer`]: serves reads and writes inside registered segments over TCP.
//! - [`TransferEngine`]: moves bytes between local memory and replicas, choosing per replica
//!   between a local copy, mapped shared memory and TCP.

mod conns;
mod copy;
mod engine;
mod error;
mod guard;
pub mod local;
mod registry;
mod segment;
mod server;
pub mod wire;

pub use copy::streaming_threshold;
pub use engine::{Part, TransferEngine, Transport, MAX_PARALLEL, SLICE_BYTES};
pub use error::TransferError;
pub use local::socket_path;
pub use registry::SegmentRegistry;
pub use segment::Mapping;
pub use server::{
    ServerLimits, TransferServer, DEFAULT_EVICT_AFTER, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_GREETING, HANDSHAKE_TIMEOUT,
    MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT,
};
