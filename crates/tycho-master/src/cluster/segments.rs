//! The cluster's stable segments in the coordination store: a descriptor per segment under
//! `segments/{id}`, written by the masters as their owners name them, and the static VSegment
//! quota under `vsegment/partition-quota/current`, written once by `tycho plan-quota`
//! (docs/vsegment.md).

use std::sync::Arc;
use std::time::Duration;

use tycho_meta::{MetaStore, RangeRequest};
use tycho_proto::quota::{PartitionQuota, QuotaError, StableSegment};
use tycho_proto::ErrorCode;

use crate::cluster::ownership::ClusterKeys;
use crate::state::master::{SegmentDirectory, StoreFuture};

/// How long a descriptor's write may take before the owner's request fails (retryably).
const STORE_DEADLINE: Duration = Duration::from_secs(5);

/// Most descriptors one listing reads.
pub const MAX_LISTED_SEGMENTS: usize = tycho_proto::quota::MAX_PLAN_SEGMENTS;

/// The descriptors of a cluster's stable segments in its coordination store.
#[derive(Debug, Clone)]
pub struct EtcdSegmentDirectory {
    store: Arc<dyn MetaStore>,
    keys: ClusterKeys,
}

impl EtcdSegmentDirectory {
    /// The descriptors of the cluster `keys` names, in `store`.
    pub fn new(store: Arc<dyn MetaStore>, keys: ClusterKeys) -> EtcdSegmentDirectory {
        EtcdSegmentDirectory { store, keys }
    }
}

impl SegmentDirectory for EtcdSegmentDirectory {
    fn store(&self, desc: StableSegment) -> StoreFuture {
        let (store, key) = (self.store.clone(), self.keys.segment(desc.id));
        Box::pin(async move {
            match tokio::time::timeout(STORE_DEADLINE, store_descriptor(&*store, &key, &desc)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(Stored::Moved(old))) => {
                    tracing::warn!(
                        segment = %desc.name, described_on = %old.host, medium = %old.medium, claimed_on = %desc.host,
                        key = %String::from_utf8_lossy(&key),
                        "a stable segment's name is bound to the host and medium it was first described with: refused \
                         (to move it, drain the cluster and delete its descriptor)"
                    );
                    Err(ErrorCode::INVALID_PARAMS)
                }
                Ok(Err(Stored::Store(e))) => {
                    tracing::warn!(segment = %desc.name, error = %e, "could not store a stable segment's descriptor");
                    Err(ErrorCode::ETCD_OPERATION_ERROR)
                }
                Err(_) => {
                    tracing::warn!(segment = %desc.name, "storing a stable segment's descriptor took over {STORE_DEADLINE:?}");
                    Err(ErrorCode::ETCD_OPERATION_ERROR)
                }
            }
        })
    }
}

/// Why a descriptor was not stored.
enum Stored {
    /// The name is described on another host or medium.
    Moved(StableSegment),
    /// The store failed, or another master changed the descriptor meanwhile (retryable).
    Store(String),
}

/// Stores `desc` under `key`: created when the segment first mounts, replaced only when a
/// restart on the same host and medium changed it (another endpoint or size), left alone when
/// it is the same. A descriptor naming another host or medium stays: the name is bound to the
/// host it was first described on (a plan's distinct hosts rest on it).
async fn store_descriptor(store: &dyn MetaStore, key: &[u8], desc: &StableSegment) -> Result<(), Stored> {
    let value = desc.encode();
    let current = store.get(key).await.map_err(|e| Stored::Store(e.to_string()))?;
    let written = match current.kv {
        None => store.create_if_absent(key, &value, None).await,
        Some(kv) if kv.value == value => return Ok(()),
        Some(kv) => {
            if let Ok(old) = StableSegment::decode(&kv.value) {
                if old.host != desc.host || old.medium != desc.medium {
                    return Err(Stored::Moved(old));
                }
            }
            store.compare_and_swap(key, kv.mod_revision, &value, None).await
        }
    };
    written.map(|_| ()).map_err(|e| Stored::Store(e.to_string()))
}

/// How often a master looks for the cluster's VSegment quota until it is published.
const QUOTA_POLL: Duration = Duration::from_secs(1);

/// Reads the cluster's VSegment quota into a master once it is published (then stops: a quota
/// is immutable). Stops when dropped.
pub struct QuotaReader(tokio::task::JoinHandle<()>);

impl QuotaReader {
    /// Starts looking for the quota of the cluster `keys` names, every [`QUOTA_POLL`].
    pub fn start(
        master: Arc<crate::state::master::Master>,
        store: Arc<dyn MetaStore>,
        keys: ClusterKeys,
    ) -> QuotaReader {
        QuotaReader(tokio::spawn(async move {
            let mut warned = false;
            loop {
                match read_quota(&*store, &keys).await {
                    Ok(Some((quota, _))) => {
                        if master.set_quota(Arc::new(quota)) {
                            tracing::info!(
                                "read the VSegment quota: its extents are set aside from whole-segment replicas"
                            );
                        }
                        return;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        // A damaged quota stays damaged: said once, and looked at again.
                        if !warned {
                            tracing::error!(error = %e, "cannot read the VSegment quota");
                            warned = true;
                        }
                    }
                }
                tokio::time::sleep(QUOTA_POLL).await;
            }
        }))
    }
}

impl Drop for QuotaReader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why the cluster's stable segments or quota could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The coordination store failed.
    #[error("coordination store: {0}")]
    Store(String),
    /// A record does not open as this build writes it.
    #[error("{key}: {why}")]
    Corrupt {
        /// The record's key.
        key: String,
        /// What is wrong with it.
        why: QuotaError,
    },
    /// More descriptors than a plan may cover.
    #[error("more than {MAX_LISTED_SEGMENTS} stable segments")]
    TooMany,
}

/// Every stable segment's descriptor, in key order.
pub async fn list_segments(store: &dyn MetaStore, keys: &ClusterKeys) -> Result<Vec<StableSegment>, ReadError> {
    let mut out = Vec::new();
    let mut req = RangeRequest::prefix(keys.segments(), 256);
    loop {
        let page = store.range(req.clone()).await.map_err(|e| ReadError::Store(e.to_string()))?;
        for kv in &page.kvs {
            let desc = StableSegment::decode(&kv.value)
                .map_err(|why| ReadError::Corrupt { key: String::from_utf8_lossy(&kv.key).into_owned(), why })?;
            out.push(desc);
            if out.len() > MAX_LISTED_SEGMENTS {
                return Err(ReadError::TooMany);
            }
        }
        match req.next_page(&page) {
            Some(next) => req = next,
            None => return Ok(out),
        }
    }
}

/// The published quota, with the revision that created it (`None`: none is published).
pub async fn read_quota(store: &dyn MetaStore, keys: &ClusterKeys) -> Result<Option<(PartitionQuota, i64)>, ReadError> {
    let key = keys.quota();
    let got = store.get(&key).await.map_err(|e| ReadError::Store(e.to_string()))?;
    let Some(kv) = got.kv else { return Ok(None) };
    let quota = PartitionQuota::decode(&kv.value)
        .map_err(|why| ReadError::Corrupt { key: String::from_utf8_lossy(&key).into_owned(), why })?;
    Ok(Some((quota, kv.create_revision)))
}

/// Publishes `quota` unless a quota is published already: `Ok(None)` once written, or
/// `Ok(Some(revision))`, the revision that created the quota in place, which stays.
pub async fn publish_quota(
    store: &dyn MetaStore,
    keys: &ClusterKeys,
    quota: &PartitionQuota,
) -> Result<Option<i64>, ReadError> {
    match store.create_if_absent(&keys.quota(), &quota.encode(), None).await {
        Ok(_) => Ok(None),
        Err(tycho_meta::MetaError::CompareFailed { current: Some(kv), .. }) => Ok(Some(kv.create_revision)),
        Err(e) => Err(ReadError::Store(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tycho_proto::quota::{plan, stable_segment_id, Medium, Profile};

    fn desc(name: &str, host: &str) -> StableSegment {
        StableSegment {
            id: stable_segment_id(name),
            name: name.into(),
            host: host.into(),
            size: 64 << 20,
            medium: Medium::Dram,
            endpoint: "127.0.0.1:1".into(),
        }
    }

    #[tokio::test]
    async fn descriptors_are_stored_listed_and_a_quota_is_published_once() {
        let store: Arc<dyn MetaStore> = Arc::new(tycho_meta::MemStore::new());
        let keys = ClusterKeys::new("c");
        let dir = EtcdSegmentDirectory::new(store.clone(), keys.clone());
        for (n, h) in [("b", "h2"), ("a", "h1")] {
            dir.store(desc(n, h)).await.unwrap();
        }
        // The same again: left alone.
        let key = keys.segment(stable_segment_id("a"));
        let before = store.get(&key).await.unwrap().kv.unwrap().mod_revision;
        dir.store(desc("a", "h1")).await.unwrap();
        assert_eq!(
            store.get(&key).await.unwrap().kv.unwrap().mod_revision,
            before,
            "an unchanged descriptor is not rewritten"
        );
        // Again, with another endpoint (a restart): replaced.
        dir.store(StableSegment { endpoint: "127.0.0.1:2".into(), ..desc("a", "h1") }).await.unwrap();
        // On another host or medium: refused, the first stays.
        assert_eq!(dir.store(desc("a", "h9")).await, Err(ErrorCode::INVALID_PARAMS));
        let file = StableSegment { medium: Medium::File, ..desc("a", "h1") };
        assert_eq!(dir.store(file).await, Err(ErrorCode::INVALID_PARAMS));
        let listed = list_segments(&*store, &keys).await.unwrap();
        assert_eq!(listed.len(), 2);
        assert!(listed.iter().any(|d| d.name == "a" && d.endpoint == "127.0.0.1:2"));
        let profile = Profile {
            name: "p".into(),
            members: 2,
            extent: 8 << 20,
            stripe: 1 << 20,
            medium: Medium::Dram,
            per_segment: 1,
        };
        let q = plan(1, &listed, &[profile], 5).unwrap();
        assert_eq!(read_quota(&*store, &keys).await.unwrap(), None);
        assert_eq!(publish_quota(&*store, &keys, &q).await.unwrap(), None);
        let (read, created) = read_quota(&*store, &keys).await.unwrap().unwrap();
        assert_eq!(read, q);
        let again = PartitionQuota { planned_ms: 6, ..q };
        assert_eq!(publish_quota(&*store, &keys, &again).await.unwrap(), Some(created));
        assert_eq!(read_quota(&*store, &keys).await.unwrap().unwrap().0.planned_ms, 5);
        // A damaged descriptor is named, not skipped.
        store.put(&keys.segment(stable_segment_id("z")), b"junk", None).await.unwrap();
        assert!(matches!(list_segments(&*store, &keys).await, Err(ReadError::Corrupt { .. })));
    }
}
