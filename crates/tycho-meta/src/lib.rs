//! Tycho's coordination store: the [`MetaStore`] trait and its two implementations.
//!
//! Ownership records with epochs, membership leases, reshard intents and the OpLog all live in
//! a strongly consistent store with etcd's data model. [`MetaStore`] is that model — get,
//! paginated range at a fixed revision, put with an optional lease, delete, transactions with
//! compares, leases, and watches from a revision — and every caller is written against it.
//!
//! - [`EtcdStore`] (cargo feature `etcd`) runs it on a real etcd cluster, 3.4 or newer.
//! - [`MemStore`] has the same semantics in one process: unit tests, and `tycho up` with no
//!   etcd. Its lease expiry follows an injected [`Clock`], so tests move time by hand.
//!
//! One conformance suite (`tests/conformance.rs`) runs against both, so the two cannot drift.
//! [`LeaseKeeper`] renews a lease on its own task and tells the owner until when it may still
//! act on it; `docs/meta.md` explains the rules.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::sync::Arc;
//! use tycho_meta::{MemStore, MetaError, MetaStore};
//!
//! let store: Arc<dyn MetaStore> = Arc::new(MemStore::new());
//! let rev = store.create_if_absent(b"kvpt_groups/00000", b"epoch=1", None).await.unwrap();
//! // A second creator loses and learns what is there.
//! match store.create_if_absent(b"kvpt_groups/00000", b"epoch=1", None).await {
//!     Err(MetaError::CompareFailed { current: Some(kv), .. }) => assert_eq!(kv.mod_revision, rev),
//!     other => panic!("{other:?}"),
//! }
//! // Compare-and-swap against the revision we read.
//! store.compare_and_swap(b"kvpt_groups/00000", rev, b"epoch=2", None).await.unwrap();
//! # });
//! ```

mod clock;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "testing")]
pub mod faults;
mod kv;
mod lease;
mod limits;
mod mem;
mod store;
mod txn;
mod watch;

pub use clock::{Clock, ManualClock, SystemClock, TokioClock};
pub use error::{MetaError, MetaResult};
#[cfg(feature = "etcd")]
pub use etcd::{defragment_members, EtcdOptions, EtcdStore, EtcdTls, MemberDefrag, DEFRAG_TIMEOUT};
pub use kv::{prefix_end, DeleteResponse, GetResponse, KeyValue, LeaseId, RangePage, RangeRequest, Revision};
pub use lease::{LeaseGrant, LeaseInfo, LeaseKeeper, LeaseLost, LeaseState};
pub use limits::{Limits, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TXN_OPS};
pub use mem::{MemConfig, MemStore, DEFAULT_HISTORY_REVISIONS};
pub use store::{BoxFuture, MetaStore};
pub use txn::{Compare, CompareOp, CompareTarget, Txn, TxnOp, TxnOpResult, TxnResponse};
pub use watch::{Watch, WatchEvent, WatchRequest};
