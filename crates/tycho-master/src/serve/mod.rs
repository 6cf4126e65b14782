//! Serving: the master's faces to the outside. RPC over `tycho-rpc` ([`rpc`]), the admin HTTP
//! server with health, metrics and cluster pages ([`admin`], [`health`]) and per-RPC series
//! ([`metrics`]). The top concern: it calls object state and reads cluster records; nothing
//! imports it.

pub(crate) mod admin;
pub(crate) mod health;
pub(crate) mod metrics;
pub(crate) mod rpc;
