//! Stable segments (issue 48): segments that keep their id across restarts of their owner and
//! may hold VSegment extents. Their owner names them with [`tycho_proto::Request::StableSegment`];
//! a master checks the claim against what it has mounted and stores the cluster's descriptor
//! through its [`SegmentDirectory`]. Once the cluster's VSegment quota is published, a primary
//! keeps ordinary replicas out of its extents (fences in each segment's slice).

use std::sync::Arc;

use tycho_proto::quota::{check_stable_name, stable_segment_id, Medium, PartitionQuota, StableSegment};
use tycho_proto::{ClientId, ErrorCode, SegmentId, WireResult};

use super::Master;
use crate::state::master::group::Group;
use crate::state::segment::MountedSegment;

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

impl Master {
    /// Takes the cluster's published VSegment quota: from now on, no ordinary replica of a
    /// group this master serves is placed in the quota's extents (of any group: all of them
    /// are set aside). Refused (false, with the reason logged) for a plan of another group
    /// count; a second quota changes nothing (a plan is immutable).
    pub fn set_quota(&self, quota: Arc<PartitionQuota>) -> bool {
        let groups = self.cfg.group_count.max(1);
        if quota.groups != groups {
            tracing::error!(
                planned = quota.groups,
                groups,
                "the published VSegment quota is for another group count: not used"
            );
            return false;
        }
        let _fencing = self.fencing.lock();
        if self.quota.set(quota).is_err() {
            return false;
        }
        for group in self.serving() {
            self.fence_group(group);
        }
        true
    }

    /// The quota's extents on segment `id` (offset, length), none before the quota is read.
    pub(super) fn quota_ranges(&self, id: tycho_proto::SegmentId) -> Vec<(u64, u64)> {
        self.quota.get().map_or_else(Vec::new, |q| {
            q.extents.iter().filter(|e| e.segment == id).map(|e| (e.offset, e.len)).collect()
        })
    }

    /// Bytes of the quota's extents set aside from replicas so far, in the groups this master
    /// serves.
    pub fn fenced_bytes(&self) -> u64 {
        self.serving().map(|g| g.segments.live().iter().map(|s| s.fenced()).sum::<u64>()).sum()
    }

    /// The cluster's VSegment quota, once read.
    pub fn quota(&self) -> Option<&Arc<PartitionQuota>> {
        self.quota.get()
    }

    /// Keeps the ordinary replicas of `group` out of the quota's extents on its segments: on
    /// the group's primary only (a standby follows the primary's allocations in the log).
    pub(super) fn fence_group(&self, group: &Group) {
        if self.quota.get().is_some() {
            for seg in group.segments.live().iter() {
                self.fence_segment(seg);
            }
        }
    }

    /// [`Master::fence_group`] for one segment.
    pub(super) fn fence_segment(&self, seg: &MountedSegment) {
        let ranges = self.quota_ranges(seg.desc.id);
        if !ranges.is_empty() {
            let taken = seg.fence(&ranges);
            tracing::debug!(segment = %seg.desc.id, group = seg.rank(), taken, "set the VSegment quota's extents aside");
        }
    }
}
