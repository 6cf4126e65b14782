//! Multiplexed request/response over TCP.
//!
//! One connection carries many calls at once: each request frame has an id, and the response
//! with the same id completes the call, in whatever order responses arrive. The caller writes
//! its frame to the socket itself (no hand-off to a writer task); one reader task per
//! connection routes responses back to their callers.
//!
//! Every connection opens with the greeting of [`tycho_proto::auth::handshake`]: versions are
//! matched and, unless the server runs without a secret, both sides prove the cluster secret.
//!
//! On the server, a handler that can answer at once is run inline on the connection's task,
//! and answers are written in batches; a handler that must wait is spawned, so a slow call
//! does not hold up the calls behind it.

mod blocking;
mod client;
mod error;
pub mod greet;
mod pool;
mod server;

pub use blocking::BlockingClient;
pub use client::{ClientConfig, RpcClient, DEFAULT_SPIN};
pub use error::RpcError;
pub use pool::RpcPool;
pub use server::{
    serve, Reply, ServerConfig, ServerHandle, Service, DEFAULT_MAX_CONNECTIONS, DRAIN_GRACE, FRAME_DEADLINE,
};
