//! Per-RPC request, failure and latency series, kept in atomics so that recording costs a few
//! nanoseconds on the request path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tycho_proto::Request;

/// Upper bounds of the latency histogram buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 14] =
    [10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 500e-3, 2.5];

#[derive(Default)]
struct Series {
    requests: AtomicU64,
    failures: AtomicU64,
    sum_ns: AtomicU64,
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
}

/// Request, failure and latency series of every RPC.
pub struct RpcMetrics {
    series: Vec<Series>,
}

impl Default for RpcMetrics {
    fn default() -> Self {
        RpcMetrics { series: (0..Request::NAMES.len()).map(|_| Series::default()).collect() }
    }
}

/// One RPC's figures, as exported.
pub struct RpcSnapshot {
    /// RPC name.
    pub name: &'static str,
    /// Calls handled.
    pub requests: u64,
    /// Calls answered with an error.
    pub failures: u64,
    /// Sum of latencies, seconds.
    pub sum_seconds: f64,
    /// Cumulative counts per bucket of [`LATENCY_BUCKETS`].
    pub cumulative: Vec<u64>,
}

impl RpcMetrics {
    /// Records one call of RPC `index`.
    pub fn record(&self, index: usize, elapsed: Duration, failed: bool) {
        let s = &self.series[index];
        s.requests.fetch_add(1, Ordering::Relaxed);
        if failed {
            s.failures.fetch_add(1, Ordering::Relaxed);
        }
        s.sum_ns.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        if let Some(b) = LATENCY_BUCKETS.iter().position(|&le| secs <= le) {
            s.buckets[b].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Every RPC's figures.
    pub fn snapshot(&self) -> Vec<RpcSnapshot> {
        self.series
            .iter()
            .zip(Request::NAMES)
            .map(|(s, name)| {
                let mut acc = 0;
                let cumulative = s
                    .buckets
                    .iter()
                    .map(|b| {
                        acc += b.load(Ordering::Relaxed);
                        acc
                    })
                    .collect();
                RpcSnapshot {
                    name,
                    requests: s.requests.load(Ordering::Relaxed),
                    failures: s.failures.load(Ordering::Relaxed),
                    sum_seconds: s.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
                    cumulative,
                }
            })
            .collect()
    }
}
