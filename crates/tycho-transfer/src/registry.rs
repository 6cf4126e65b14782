//! The segments this process serves.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use tycho_proto::SegmentId;

use crate::Mapping;

/// Segments registered for serving, by id. The transfer server serves only ranges inside
/// these; an unregistered segment is refused.
#[derive(Default)]
pub struct SegmentRegistry {
    segments: RwLock<HashMap<SegmentId, Arc<Mapping>>>,
    /// Reads the transfer server has answered with bytes that passed their check (peers that
    /// map a segment on the same host read without asking, and are not counted).
    served: std::sync::atomic::AtomicU64,
}

impl SegmentRegistry {
    /// Starts serving `mapping` as `id`.
    pub fn register(&self, id: SegmentId, mapping: Arc<Mapping>) {
        self.segments.write().insert(id, mapping);
    }

    /// Counts a read the transfer server served.
    pub(crate) fn note_served(&self) {
        self.served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many reads the transfer server has served from these segments (see the field).
    pub fn reads_served(&self) -> u64 {
        self.served.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops serving `id`.
    pub fn unregister(&self, id: SegmentId) -> Option<Arc<Mapping>> {
        self.segments.write().remove(&id)
    }

    /// The mapping of `id`, if served.
    pub fn get(&self, id: SegmentId) -> Option<Arc<Mapping>> {
        self.segments.read().get(&id).cloned()
    }
}
