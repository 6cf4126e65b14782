//! What the integration tests share: a store under test, and time control for its leases.

#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tycho_meta::{ManualClock, MemConfig, MemStore, MetaStore};

/// A store under test, and how to let time pass for its leases.
pub struct Subject {
    /// The store.
    pub store: Arc<dyn MetaStore>,
    /// Which backend, for messages.
    pub name: &'static str,
    time: Time,
    #[cfg(feature = "etcd")]
    pub etcd: Option<tycho_testkit::EtcdServer>,
}

enum Time {
    /// MemStore: leases expire by a clock the test moves.
    Manual(Arc<ManualClock>),
    /// etcd: leases expire in real time; tests poll with a deadline.
    Real,
}

impl Subject {
    /// A MemStore on a manual clock.
    pub fn mem() -> Subject {
        let clock = ManualClock::new();
        let store = MemStore::with_clock(clock.clone(), MemConfig::default());
        Subject {
            store: Arc::new(store),
            name: "mem",
            time: Time::Manual(clock),
            #[cfg(feature = "etcd")]
            etcd: None,
        }
    }

    /// A fresh etcd process and an EtcdStore connected to it.
    #[cfg(feature = "etcd")]
    pub async fn etcd() -> Subject {
        let etcd =
            tokio::task::spawn_blocking(tycho_testkit::EtcdServer::start_new).await.unwrap().expect("etcd starts");
        let store = connect(&etcd).await;
        Subject { store: Arc::new(store), name: "etcd", time: Time::Real, etcd: Some(etcd) }
    }

    /// Lets `ttl` (and a margin) pass for the store's leases: moves the manual clock, or does
    /// nothing for etcd, whose tests then poll with [`Subject::eventually`].
    pub fn let_leases_age(&self, ttl: Duration) {
        match &self.time {
            Time::Manual(clock) => clock.advance(ttl + Duration::from_secs(1)),
            Time::Real => {}
        }
    }

    /// Polls `check` until it returns true. MemStore gets one second (there is nothing to wait
    /// for but its own tasks); etcd gets `real` (lease expiry runs on its timer).
    pub async fn eventually<F, Fut>(&self, real: Duration, what: &str, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let limit = match self.time {
            Time::Manual(_) => Duration::from_secs(1),
            Time::Real => real,
        };
        let deadline = Instant::now() + limit;
        loop {
            if check().await {
                return;
            }
            assert!(Instant::now() < deadline, "[{}] not within {limit:?}: {what}", self.name);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// An EtcdStore on `etcd`.
#[cfg(feature = "etcd")]
pub async fn connect(etcd: &tycho_testkit::EtcdServer) -> tycho_meta::EtcdStore {
    let mut options = tycho_meta::EtcdOptions::new([etcd.endpoint()]);
    options.request_timeout = Duration::from_secs(3);
    tycho_meta::EtcdStore::connect(options).await.expect("connects to etcd")
}

/// Awaits `fut` for at most ten seconds.
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}
