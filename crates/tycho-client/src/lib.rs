//! The Tycho store client: contributes memory (segments) to the store, and puts, gets and
//! removes objects. Bytes move directly between this process and the hosts holding replicas;
//! the master only hands out ranges.

pub mod aggregate;
pub mod attach;
mod client;
mod config;
mod discover;
mod retry;

pub use aggregate::PartialRemoval;
pub use client::{Client, Lookup, WriteMode};
pub use config::{default_host_id, parse_size, ClientAuth, ClientConfig, Protocol};
pub use discover::{
    EtcdAddress, CLUSTER_ENV, ETCDS_SCHEME, ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV, ETCD_PASSWORD_FILE_ENV,
    ETCD_SCHEME, ETCD_USER_ENV,
};
pub use retry::{call_with_retry, is_idempotent, MAX_ATTEMPTS};
pub use tycho_transfer::Mapping;
