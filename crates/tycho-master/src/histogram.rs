//! A latency histogram kept in atomics, shared by the RPC series (serving) and the OpLog's
//! commit figures (the log): a leaf every concern may use.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 14] =
    [10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 500e-3, 2.5];

/// A latency histogram over [`LATENCY_BUCKETS`] with the sum of what it recorded, in atomics.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    sum_ns: AtomicU64,
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
}

impl LatencyHistogram {
    /// Records one latency.
    pub fn record(&self, took: Duration) {
        self.sum_ns.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        if let Some(b) = LATENCY_BUCKETS.iter().position(|&le| secs <= le) {
            self.buckets[b].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The sum of every latency recorded, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Cumulative counts per bucket, as Prometheus exports them.
    pub fn cumulative(&self) -> Vec<u64> {
        let mut acc = 0;
        self.buckets
            .iter()
            .map(|b| {
                acc += b.load(Ordering::Relaxed);
                acc
            })
            .collect()
    }
}
