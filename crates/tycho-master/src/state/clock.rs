//! The time source every timer in the master reads: leases, TTLs, liveness, eviction.
//! Production uses a monotonic clock; tests use [`ManualClock`] and move time by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Milliseconds on a monotonic timeline.
pub trait Clock: Send + Sync + 'static {
    /// Current time in milliseconds.
    fn now_ms(&self) -> u64;

    /// Where this timeline sits on the Unix one: Unix milliseconds at `now_ms() == 0`. Times
    /// that leave the master (log records, which another master replays) are Unix times; each
    /// master converts them with its own offset, read once.
    fn unix_offset_ms(&self) -> u64;

    /// Unix milliseconds now, as the hosts that check capabilities read their own clocks:
    /// capability expiries are minted and waited out on this reading.
    fn unix_now_ms(&self) -> u64 {
        self.now_ms().saturating_add(self.unix_offset_ms())
    }
}

/// The Unix time a [`ManualClock`]'s zero stands for, the same for every manual clock, so that
/// masters of one test agree on record times exactly.
pub const MANUAL_UNIX_OFFSET_MS: u64 = 1_700_000_000_000;

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

    fn unix_offset_ms(&self) -> u64 {
        let age = self.start.elapsed();
        let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (unix.saturating_sub(age).as_millis() as u64).saturating_sub(1)
    }

    fn unix_now_ms(&self) -> u64 {
        // The wall clock itself, not the monotonic one shifted: a stepped wall clock moves the
        // holders' checks too.
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
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

    fn unix_offset_ms(&self) -> u64 {
        MANUAL_UNIX_OFFSET_MS
    }
}
