//! The time source every timer in the master reads: leases, TTLs, liveness, eviction.
//! Production uses a monotonic clock; tests use [`ManualClock`] and move time by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Milliseconds on a monotonic timeline.
pub trait Clock: Send + Sync + 'static {
    /// Current time in milliseconds.
    fn now_ms(&self) -> u64;
}

/// Monotonic wall time, counted from the clock's creation.
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    /// A clock starting now. Its first reading is 1 so that 0 can mean "never".
    pub fn new() -> SystemClock {
        SystemClock { start: Instant::now() }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64 + 1
    }
}

/// A clock that moves only when told to.
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start_ms`.
    pub fn new(start_ms: u64) -> ManualClock {
        ManualClock { now: AtomicU64::new(start_ms) }
    }

    /// Moves time forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}
