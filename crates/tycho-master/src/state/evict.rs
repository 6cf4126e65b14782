//! The single-flight coordinator of eviction rounds.
//!
//! Eviction never runs on an RPC worker while a background evictor thread is running: a write
//! that finds no room asks for a round and waits, bounded, for one that started after its
//! request to finish (its caller then retries the allocation once); the housekeeping tick asks
//! for a round above the high watermark without waiting. Requests that arrive while a round
//! runs are merged into the next one. Without the background thread (unit tests, which drive
//! time by hand) the caller runs the round itself, still one at a time.

use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// How long a write that found no room waits for an eviction round.
pub const EVICTION_WAIT: Duration = Duration::from_secs(2);

/// What the next round must do.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RoundRequest {
    /// Free at least this many bytes (an allocation failed); 0 for none.
    pub bytes: u64,
    /// Evict the configured ratio of objects (the high watermark was crossed).
    pub watermark: bool,
    /// Evict only objects of this KVPT group (the one whose slices were full); `None`: any.
    pub group: Option<u32>,
}

impl RoundRequest {
    fn merge(&mut self, other: RoundRequest) {
        self.group = if self.is_empty() || self.group == other.group { other.group } else { None };
        self.bytes = self.bytes.max(other.bytes);
        self.watermark |= other.watermark;
    }

    fn is_empty(&self) -> bool {
        self.bytes == 0 && !self.watermark
    }
}

#[derive(Default)]
struct State {
    next: RoundRequest,
    started: u64,
    finished: u64,
    /// Bytes freed by all finished rounds.
    freed: u64,
    background: bool,
    stopping: bool,
}

/// Coordinates eviction rounds.
#[derive(Default)]
pub struct Evictor {
    state: Mutex<State>,
    changed: Condvar,
    /// Held while a round runs inline (no background thread).
    inline: Mutex<()>,
}

impl Evictor {
    /// Whether a background thread runs the rounds.
    pub fn is_background(&self) -> bool {
        self.state.lock().background
    }

    /// Asks for a round without waiting (background mode only; returns false otherwise).
    pub fn request(&self, r: RoundRequest) -> bool {
        let mut s = self.state.lock();
        if !s.background {
            return false;
        }
        s.next.merge(r);
        self.changed.notify_all();
        true
    }

    /// Asks for a round and waits up to `wait` for one that started after this request to
    /// finish; returns whether any round finished meanwhile freed bytes. In inline mode runs
    /// the round with `run` (one at a time).
    pub fn request_and_wait(&self, r: RoundRequest, wait: Duration, run: impl FnOnce(RoundRequest) -> u64) -> bool {
        let mut s = self.state.lock();
        if !s.background {
            drop(s);
            let _one = self.inline.lock();
            return run(r) > 0;
        }
        s.next.merge(r);
        let target = s.started + 1;
        let freed_before = s.freed;
        self.changed.notify_all();
        let deadline = std::time::Instant::now() + wait;
        while s.finished < target && !s.stopping {
            if self.changed.wait_until(&mut s, deadline).timed_out() {
                break;
            }
        }
        s.freed > freed_before
    }

    /// The background thread's loop: runs rounds as they are asked for until [`stop`](Self::stop).
    pub fn run(&self, mut round: impl FnMut(RoundRequest) -> u64) {
        let mut s = self.state.lock();
        s.background = true;
        loop {
            while s.next.is_empty() && !s.stopping {
                self.changed.wait(&mut s);
            }
            if s.stopping {
                s.background = false;
                self.changed.notify_all();
                return;
            }
            let req = std::mem::take(&mut s.next);
            s.started += 1;
            drop(s);
            let freed = round(req);
            s = self.state.lock();
            s.finished += 1;
            s.freed += freed;
            self.changed.notify_all();
        }
    }

    /// Makes [`run`](Self::run) return and releases every waiter.
    pub fn stop(&self) {
        let mut s = self.state.lock();
        s.stopping = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[test]
    fn inline_mode_runs_the_round_in_the_caller() {
        let e = Evictor::default();
        assert!(!e.request(RoundRequest { bytes: 1, ..Default::default() }));
        assert!(e.request_and_wait(RoundRequest { bytes: 10, ..Default::default() }, EVICTION_WAIT, |r| r.bytes));
        assert!(!e.request_and_wait(RoundRequest::default(), EVICTION_WAIT, |_| 0));
    }

    #[test]
    fn background_rounds_merge_requests_and_wake_waiters() {
        let e = Arc::new(Evictor::default());
        let rounds = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let worker = {
            let (e, rounds, seen) = (e.clone(), rounds.clone(), seen.clone());
            std::thread::spawn(move || {
                e.run(|r| {
                    rounds.fetch_add(1, Ordering::SeqCst);
                    seen.lock().push(r);
                    r.bytes
                })
            })
        };
        while !e.is_background() {
            std::thread::yield_now();
        }
        let waiters: Vec<_> = (1..=4u64)
            .map(|i| {
                let e = e.clone();
                std::thread::spawn(move || {
                    e.request_and_wait(
                        RoundRequest { bytes: i * 100, ..Default::default() },
                        Duration::from_secs(30),
                        |_| unreachable!("background mode never runs inline"),
                    )
                })
            })
            .collect();
        for w in waiters {
            assert!(w.join().unwrap(), "each waiter sees a round that freed bytes");
        }
        // Four requests, at most four rounds, at least one; every round asked for something.
        let n = rounds.load(Ordering::SeqCst);
        assert!((1..=4).contains(&n), "{n} rounds");
        assert!(seen.lock().iter().all(|r| !r.is_empty()));
        assert_eq!(seen.lock().iter().map(|r| r.bytes).max(), Some(400));
        e.stop();
        worker.join().unwrap();
        assert!(!e.is_background());
    }
}
