//! Stable segments (issue 48): segments that keep their id across restarts of their owner and
//! may hold VSegment extents. Their owner names them with [`tycho_proto::Request::StableSegment`];
//! a master checks the claim against what it has mounted and stores the cluster's descriptor
//! through its [`SegmentDirectory`].

use std::sync::Arc;

use tycho_proto::quota::{check_stable_name, stable_segment_id, Medium, StableSegment};
use tycho_proto::{ClientId, ErrorCode, SegmentId, WireResult};

use super::Master;

/// A stored descriptor, or why not.
pub type StoreFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ErrorCode>> + Send>>;

/// Where a master keeps the cluster's descriptors of stable segments (the coordination store,
/// under `segments/{id}`).
pub trait SegmentDirectory: Send + Sync {
    /// Stores `desc` (replacing an older descriptor of the same segment).
    fn store(&self, desc: StableSegment) -> StoreFuture;
}

impl Master {
    /// Stores stable segments' descriptors in `dir` from now on. Set once, before serving.
    pub fn set_segment_directory(&self, dir: Arc<dyn SegmentDirectory>) {
        let _ = self.segment_directory.set(dir);
    }

    /// Where stable segments' descriptors go (`None`: a master without a coordination store).
    pub fn segment_directory(&self) -> Option<&Arc<dyn SegmentDirectory>> {
        self.segment_directory.get()
    }

    /// The descriptor of `client`'s segment `segment` as the stable segment `name`: refused
    /// (INVALID_PARAMS) unless `segment` is the stable id of a valid `name`, and
    /// (SEGMENT_NOT_FOUND) unless `client` has it mounted in a group this master holds.
    pub fn stable_descriptor(
        &self,
        client: ClientId,
        segment: SegmentId,
        name: &str,
        medium: Medium,
    ) -> WireResult<StableSegment> {
        if check_stable_name(name).is_err() || stable_segment_id(name) != segment {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mounted = self
            .groups()
            .find_map(|g| g.segments.get(segment).filter(|s| s.client == client && s.is_alive()))
            .ok_or(ErrorCode::SEGMENT_NOT_FOUND)?;
        let desc = StableSegment {
            id: segment,
            name: name.to_owned(),
            host: mounted.desc.host.clone(),
            size: mounted.desc.size,
            medium,
            endpoint: mounted.desc.endpoint.clone(),
        };
        // Only what a reader accepts is stored: one unreadable descriptor would stop the
        // planner (an empty host, say).
        desc.check().map_err(|_| ErrorCode::INVALID_PARAMS)?;
        Ok(desc)
    }
}
