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
}

impl SegmentRegistry {
    /// Starts serving `mapping` as `id`.
    pub fn register(&self, id: SegmentId, mapping: Arc<Mapping>) {
        self.segments.write().insert(id, mapping);
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
