//! The segments this process serves.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use tycho_proto::SegmentId;

use crate::segment::Mapping;

/// Segments registered for serving, by id. The transfer server serves only ranges inside
/// these; an unregistered segment is refused.
#[derive(Default)]
pub struct SegmentRegistry {
    segments: RwLock<HashMap<SegmentId, Arc<Mapping>>>,
    /// Reads the transfer server has answered with bytes that passed their check (peers that
    /// map a segment on the same host read without asking, and are not counted).
    served: std::sync::atomic::AtomicU64,
    /// The cap on the bytes per second the transfer server sends for reads, if any.
    pace: Option<Pacer>,
    /// The same cap on the bytes per second it takes in for writes (a link's two directions
    /// are capped apart, as a network card's are).
    pace_in: Option<Pacer>,
}

/// Spaces transfers out so that the bytes moved one way stay at or below a rate: each takes
/// the next free slot of its length and waits for the slot's end before its bytes move. (A
/// benchmark's stand-in for a node whose network is the bottleneck: `tycho node
/// --max-serve-rate`.)
struct Pacer {
    bytes_per_sec: u64,
    next_free: parking_lot::Mutex<Option<std::time::Instant>>,
}

impl Pacer {
    /// How long a read of `len` bytes waits before it is sent.
    fn reserve(&self, len: u64) -> std::time::Duration {
        let now = std::time::Instant::now();
        let slot = std::time::Duration::from_secs_f64(len as f64 / self.bytes_per_sec as f64);
        let mut next = self.next_free.lock();
        // Idle time is not saved up: a slot starts no earlier than now.
        let start = next.filter(|t| *t > now).unwrap_or(now);
        *next = Some(start + slot);
        (start + slot).saturating_duration_since(now)
    }
}

/// Waits for the slot of `len` bytes under `pacer` (at once without one).
fn wait_for_slot(pacer: Option<&Pacer>, len: u64) {
    if let Some(p) = pacer {
        let wait = p.reserve(len);
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

impl SegmentRegistry {
    /// A registry whose transfer server sends read bytes at no more than `bytes_per_sec`, and
    /// takes in written bytes at no more than as many (none: no cap).
    pub fn with_serve_rate(bytes_per_sec: Option<u64>) -> SegmentRegistry {
        let pacer = || {
            bytes_per_sec
                .filter(|r| *r > 0)
                .map(|bytes_per_sec| Pacer { bytes_per_sec, next_free: parking_lot::Mutex::new(None) })
        };
        SegmentRegistry { pace: pacer(), pace_in: pacer(), ..SegmentRegistry::default() }
    }

    /// Waits for the slot of a read of `len` bytes under the serving cap (at once without one).
    pub(crate) fn pace_read(&self, len: u64) {
        wait_for_slot(self.pace.as_ref(), len);
    }

    /// Waits for the slot of a write of `len` bytes under the cap on what the server takes in
    /// (at once without one), before its bytes are read off the connection.
    pub(crate) fn pace_write(&self, len: u64) {
        wait_for_slot(self.pace_in.as_ref(), len);
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_pacer_spaces_reads_out_at_its_rate_and_saves_up_no_idle_time() {
        let p = Pacer { bytes_per_sec: 1000, next_free: parking_lot::Mutex::new(None) };
        let first = p.reserve(500);
        let second = p.reserve(500);
        // Half a second, then the next half-second slot (less the microseconds in between).
        assert!(first <= Duration::from_millis(500) && first > Duration::from_millis(450), "{first:?}");
        assert!(second <= Duration::from_millis(1000) && second > Duration::from_millis(950), "{second:?}");
        // A slot in the past does not count: after idling, a read waits for its own length.
        *p.next_free.lock() = Some(std::time::Instant::now() - Duration::from_secs(5));
        let after = p.reserve(100);
        assert!(after <= Duration::from_millis(100) && after > Duration::from_millis(50), "{after:?}");
        let none = SegmentRegistry::with_serve_rate(Some(0));
        assert!(none.pace.is_none() && none.pace_in.is_none(), "a rate of 0 is no cap");
        // Reads and writes have a slot line each: a write does not wait behind a read.
        let r = SegmentRegistry::with_serve_rate(Some(1000));
        let read = r.pace.as_ref().unwrap().reserve(500);
        let write = r.pace_in.as_ref().unwrap().reserve(500);
        assert!(read > Duration::from_millis(450) && write <= Duration::from_millis(500), "{read:?} {write:?}");
    }
}
