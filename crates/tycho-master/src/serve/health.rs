//! HealthCheck (spec 02): can every metadata shard be read-locked within a budget?
//!
//! A master can accept connections and answer Ping (which touches no shard) while every
//! data-plane call waits behind a shard's write lock. HealthCheck contends for each shard's
//! read lock like a data-plane call would, one shard at a time and never holding two, so it
//! sees that condition without adding to it.

use std::time::{Duration, Instant};

use tycho_proto::HealthReport;

use crate::state::master::Master;

/// Default time HealthCheck may spend waiting on write-locked shards; below the probe's 3 s
/// timeout so that a slow verdict still arrives as a verdict.
pub const HEALTH_CHECK_BUDGET: Duration = Duration::from_secs(2);
/// Pause between attempts on a write-locked shard.
const RETRY_BACKOFF: Duration = Duration::from_millis(10);

impl Master {
    /// One pass that never waits: `Some(report)` when every shard was free, `None` when some
    /// shard was write-locked and the caller should run [`Master::health_check`].
    pub fn health_check_now(&self) -> Option<HealthReport> {
        let mut checked = 0;
        for shard in self.all_shards() {
            // Take and drop at once: only one shard is held, and only for an instant.
            drop(shard.try_read()?);
            checked += 1;
        }
        Some(HealthReport { ok: true, shards_checked: checked, shards_blocked: 0 })
    }

    /// Walks every shard, retrying a write-locked one every 10 ms until `budget` runs out.
    /// Blocks the calling thread for up to `budget`.
    pub fn health_check(&self, budget: Duration) -> HealthReport {
        let start = Instant::now();
        let mut checked = 0;
        for (i, shard) in self.all_shards().enumerate() {
            loop {
                if let Some(guard) = shard.try_read() {
                    drop(guard);
                    checked += 1;
                    break;
                }
                let spent = start.elapsed();
                if spent >= budget {
                    return HealthReport { ok: false, shards_checked: checked, shards_blocked: i as u64 };
                }
                std::thread::sleep(RETRY_BACKOFF.min(budget - spent));
            }
        }
        HealthReport { ok: true, shards_checked: checked, shards_blocked: 0 }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::state::clock::ManualClock;
    use crate::state::config::MasterConfig;
    use crate::state::object::SHARD_COUNT;

    fn master() -> Master {
        Master::new(MasterConfig::default(), Arc::new(ManualClock::new(1)))
    }

    #[test]
    fn ok_when_no_lock_is_held() {
        let m = master();
        let t = Instant::now();
        let r = m.health_check(HEALTH_CHECK_BUDGET);
        assert_eq!(r, HealthReport { ok: true, shards_checked: SHARD_COUNT as u64, shards_blocked: 0 });
        assert!(t.elapsed() < Duration::from_millis(500), "took {:?}", t.elapsed());
        assert_eq!(m.health_check_now(), Some(r));
    }

    #[test]
    fn detects_a_write_locked_shard_and_recovers() {
        let m = master();
        let guard = m.group(0).unwrap().shards().shard(0).write();
        assert_eq!(m.health_check_now(), None);
        let r = m.health_check(Duration::from_millis(200));
        assert_eq!(r, HealthReport { ok: false, shards_checked: 0, shards_blocked: 0 });
        drop(guard);
        let r = m.health_check(Duration::from_millis(200));
        assert_eq!(r, HealthReport { ok: true, shards_checked: SHARD_COUNT as u64, shards_blocked: 0 });
    }

    #[test]
    fn reports_the_first_blocked_shard_and_waits_for_a_brief_holder() {
        let m = Arc::new(master());
        let held = m.group(0).unwrap().shards().shard(700).write();
        let r = m.health_check(Duration::from_millis(100));
        assert_eq!((r.ok, r.shards_checked, r.shards_blocked), (false, 700, 700));
        drop(held);
        // A holder that lets go within the budget does not fail the check.
        let m2 = m.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let holder = std::thread::spawn(move || {
            let g = m2.group(0).unwrap().shards().shard(5).write();
            tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            drop(g);
        });
        rx.recv().unwrap();
        assert!(m.health_check(Duration::from_secs(2)).ok);
        holder.join().unwrap();
    }
}
