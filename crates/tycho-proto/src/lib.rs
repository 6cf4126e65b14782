//! Tycho's wire protocol.
//!
//! - [`ErrorCode`]: stable numbers (Mooncake's where Mooncake has one) and the
//!   [`RetryClass`] a client applies to each.
//! - [`Request`] / [`Response`]: every master RPC.
//! - [`auth`]: the cluster secret, the connection greeting and data-path capabilities.
//! - [`envelope`]: the versioned, checksummed envelope of persisted and replicated records.
//! - [`quota`]: stable segments and the static per-group VSegment quota.
//! - [`frame`]: the length-prefixed frame that carries them, with a decoder that rejects
//!   oversized, truncated and malformed input with an error.

pub mod auth;
pub mod bounded;
pub mod cluster;
pub mod envelope;
mod error;
pub mod frame;
mod message;
pub mod quota;
mod types;
pub mod vsegment;

pub use error::{ErrorCode, RetryClass, WireResult};
pub use message::*;
pub use types::*;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// Longest tenant name accepted, in bytes.
pub const MAX_TENANT_LEN: usize = 255;
/// Most keys one batch request may name; a master answers more with BATCH_TOO_LARGE, and the
/// client library splits larger batches into requests of at most this many.
pub const MAX_BATCH_KEYS: usize = 8192;
