//! Per-RPC request, failure and latency series, kept in atomics so that recording costs a few
//! nanoseconds on the request path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tycho_proto::{ErrorCode, Request, Response};

pub use crate::histogram::{LatencyHistogram, LATENCY_BUCKETS};

struct Series {
    requests: AtomicU64,
    failures: AtomicU64,
    /// Calls answered with an error, by code (index in [`ErrorCode::ALL`]).
    by_code: Vec<AtomicU64>,
    failed_items: AtomicU64,
    latency: LatencyHistogram,
}

impl Default for Series {
    fn default() -> Series {
        Series {
            requests: AtomicU64::default(),
            failures: AtomicU64::default(),
            by_code: ErrorCode::ALL.iter().map(|_| AtomicU64::default()).collect(),
            failed_items: AtomicU64::default(),
            latency: LatencyHistogram::default(),
        }
    }
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
    /// Calls answered with an error, by code (those with none left out).
    pub by_code: Vec<(ErrorCode, u64)>,
    /// Keys of batch calls that failed on their own while the call as a whole answered.
    pub failed_items: u64,
    /// Sum of latencies, seconds.
    pub sum_seconds: f64,
    /// Cumulative counts per bucket of [`LATENCY_BUCKETS`].
    pub cumulative: Vec<u64>,
}

impl RpcMetrics {
    /// Records one call of RPC `index` that was answered with `resp`.
    pub fn record(&self, index: usize, elapsed: Duration, resp: &Response) {
        let s = &self.series[index];
        s.requests.fetch_add(1, Ordering::Relaxed);
        if let Some(code) = resp.error_code() {
            s.failures.fetch_add(1, Ordering::Relaxed);
            if let Some(i) = ErrorCode::ALL.iter().position(|c| *c == code) {
                s.by_code[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        let items = failed_items(resp);
        if items > 0 {
            s.failed_items.fetch_add(items, Ordering::Relaxed);
        }
        s.latency.record(elapsed);
    }

    /// Every RPC's figures.
    pub fn snapshot(&self) -> Vec<RpcSnapshot> {
        self.series
            .iter()
            .zip(Request::NAMES)
            .map(|(s, name)| RpcSnapshot {
                name,
                requests: s.requests.load(Ordering::Relaxed),
                failures: s.failures.load(Ordering::Relaxed),
                by_code: ErrorCode::ALL
                    .iter()
                    .zip(&s.by_code)
                    .map(|(c, n)| (*c, n.load(Ordering::Relaxed)))
                    .filter(|(_, n)| *n > 0)
                    .collect(),
                failed_items: s.failed_items.load(Ordering::Relaxed),
                sum_seconds: s.latency.sum_seconds(),
                cumulative: s.latency.cumulative(),
            })
            .collect()
    }
}

/// Keys of a batch answer that carry an error.
fn failed_items(resp: &Response) -> u64 {
    let errors = match resp {
        Response::BatchWriteStarted(r) => r.iter().filter(|x| x.is_err()).count(),
        Response::BatchDone(r) => r.iter().filter(|x| x.is_err()).count(),
        Response::BatchCommitted(r) => r.iter().filter(|x| x.is_err()).count(),
        Response::BatchReplicas(r) => r.iter().filter(|x| x.is_err()).count(),
        Response::BatchExists(r) => r.iter().filter(|x| x.is_err()).count(),
        _ => 0,
    };
    errors as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_call_errors_and_per_key_errors_are_counted_apart() {
        let m = RpcMetrics::default();
        let batch = Request::NAMES.iter().position(|n| *n == "batch_exist_key").expect("batch_exist_key");
        let t = Duration::from_micros(30);
        m.record(batch, t, &Response::BatchExists(vec![Ok(true), Err(ErrorCode::INVALID_KEY), Ok(false)]));
        m.record(batch, t, &Response::Error(ErrorCode::CLIENT_NOT_FOUND));
        m.record(batch, t, &Response::BatchExists(vec![Ok(true)]));
        let s = &m.snapshot()[batch];
        assert_eq!((s.requests, s.failures, s.failed_items), (3, 1, 1));
        assert_eq!(s.by_code, vec![(ErrorCode::CLIENT_NOT_FOUND, 1)], "the call's code, not the key's");
        assert_eq!(s.cumulative.last().copied(), Some(3));
    }
}
