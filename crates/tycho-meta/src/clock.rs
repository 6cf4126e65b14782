//! The time source for lease deadlines, injectable so tests move time by hand.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Where leases read the time. `MemStore` expires leases by it and [`LeaseKeeper`] computes
/// the owner's deadline with it.
///
/// [`LeaseKeeper`]: crate::LeaseKeeper
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current instant; never goes backwards.
    fn now(&self) -> Instant;
}

/// The process's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until [`advance`](ManualClock::advance) moves it.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Instant>,
}

impl ManualClock {
    /// A clock frozen at the current instant.
    pub fn new() -> Arc<ManualClock> {
        Arc::new(ManualClock { now: Mutex::new(Instant::now()) })
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.now.lock() += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.now.lock()
    }
}

/// Tokio's clock: the system clock normally, a virtual one under `tokio::time::pause` (tests
/// then move it with `tokio::time::advance`, and timers and lease deadlines move together).
#[derive(Debug, Default, Clone, Copy)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}
