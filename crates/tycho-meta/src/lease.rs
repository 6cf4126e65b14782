//! Leases, and the keeper that renews one on its own task and tells its owner how long the
//! lease can still be relied on.
//!
//! The rule: after a renewal sent at local time `t` is acknowledged with TTL `T`, the owner may
//! act on the lease until `t + T/2`, and no later unless a later renewal succeeds. Measuring
//! from the *send* time covers a slow or delayed answer; halving the TTL leaves room for clock
//! rate differences and for the owner to notice and stop. A renewal that comes back after the
//! deadline has passed does not revive the lease: the owner may already have acted on its
//! loss, so the lease is [`LeaseState::Lost`] for good and the owner must start over.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::clock::Clock;
use crate::error::{MetaError, MetaResult};
use crate::kv::LeaseId;
use crate::store::MetaStore;

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    /// Its id.
    pub id: LeaseId,
    /// The TTL the store granted (at least the one asked for).
    pub ttl: Duration,
}

/// What the store knows about a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// Its id.
    pub id: LeaseId,
    /// The TTL it was granted with.
    pub granted_ttl: Duration,
    /// Time left before it expires unless renewed (as the store sees it).
    pub remaining: Duration,
    /// The keys attached to it.
    pub keys: Vec<Vec<u8>>,
}

/// Why a lease can no longer be relied on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseLost {
    /// The store reported the lease gone.
    Expired,
    /// No renewal was confirmed before the local deadline.
    DeadlinePassed,
    /// The owner revoked it.
    Revoked,
}

/// What the owner of a lease may believe, as published by its [`LeaseKeeper`].
#[derive(Debug, Clone)]
pub enum LeaseState {
    /// The last renewal succeeded; the owner may act on the lease until `deadline`.
    Held {
        /// Send time of the last acknowledged renewal + half the acknowledged TTL.
        deadline: Instant,
    },
    /// Renewals are failing. The owner may still act until `deadline` — no later; the keeper
    /// keeps trying and returns to `Held` if a renewal succeeds in time.
    Renewing {
        /// The deadline of the last acknowledged renewal.
        deadline: Instant,
        /// The last renewal's failure.
        error: MetaError,
    },
    /// The lease is gone or can no longer be trusted. Final.
    Lost(LeaseLost),
}

impl LeaseState {
    /// Until when the owner may act, if at all.
    pub fn deadline(&self) -> Option<Instant> {
        match self {
            LeaseState::Held { deadline } | LeaseState::Renewing { deadline, .. } => Some(*deadline),
            LeaseState::Lost(_) => None,
        }
    }

    /// Whether the owner may act at `now`. Owners must check this with the current time
    /// rather than wait to be told: a state is only as fresh as its deadline.
    pub fn is_valid_at(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|d| now < d)
    }
}

/// Renews one lease on its own task and publishes [`LeaseState`] to the owner.
///
/// Dropping the keeper stops renewing (the lease then expires on the store); call
/// [`revoke`](LeaseKeeper::revoke) to end it at once.
#[derive(Debug)]
pub struct LeaseKeeper {
    id: LeaseId,
    ttl: Duration,
    store: Arc<dyn MetaStore>,
    clock: Arc<dyn Clock>,
    state: Arc<watch::Sender<LeaseState>>,
    task: JoinHandle<()>,
}

impl LeaseKeeper {
    /// Grants a lease of `ttl` and starts keeping it alive.
    pub async fn grant(store: Arc<dyn MetaStore>, ttl: Duration, clock: Arc<dyn Clock>) -> MetaResult<LeaseKeeper> {
        let sent = clock.now();
        let grant = store.lease_grant(ttl).await?;
        Ok(LeaseKeeper::start(store, grant, sent, clock))
    }

    /// Keeps alive a lease granted by a request sent at `sent` (a time from `clock`).
    pub fn start(store: Arc<dyn MetaStore>, grant: LeaseGrant, sent: Instant, clock: Arc<dyn Clock>) -> LeaseKeeper {
        let deadline = sent + grant.ttl / 2;
        let state = Arc::new(watch::Sender::new(LeaseState::Held { deadline }));
        let renewer = Renewer { store: store.clone(), clock: clock.clone(), id: grant.id, state: state.clone() };
        let task = tokio::spawn(renewer.run(sent, grant.ttl));
        LeaseKeeper { id: grant.id, ttl: grant.ttl, store, clock, state, task }
    }

    /// The lease id, to attach keys to.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The TTL the store granted.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// A receiver of every state change.
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.subscribe()
    }

    /// The state now: the published one, downgraded to `Lost(DeadlinePassed)` if its deadline
    /// has passed on the clock even though the keeper task has not said so yet.
    pub fn state(&self) -> LeaseState {
        let state = self.state.borrow().clone();
        match state.deadline() {
            Some(deadline) if self.clock.now() >= deadline => LeaseState::Lost(LeaseLost::DeadlinePassed),
            _ => state,
        }
    }

    /// Whether the owner may act on the lease right now.
    pub fn is_valid(&self) -> bool {
        self.state.borrow().is_valid_at(self.clock.now())
    }

    /// Stops renewing and revokes the lease (its keys are deleted).
    pub async fn revoke(self) -> MetaResult<()> {
        self.task.abort();
        self.state.send_replace(LeaseState::Lost(LeaseLost::Revoked));
        self.store.lease_revoke(self.id).await
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The keeper's task.
struct Renewer {
    store: Arc<dyn MetaStore>,
    clock: Arc<dyn Clock>,
    id: LeaseId,
    state: Arc<watch::Sender<LeaseState>>,
}

impl Renewer {
    async fn run(self, mut last_sent: Instant, mut ttl: Duration) {
        let mut deadline = last_sent + ttl / 2;
        // Renew three times per TTL so that one lost renewal still leaves a margin; after a
        // failure, retry often until the deadline.
        let retry = (ttl / 10).clamp(Duration::from_millis(50), Duration::from_millis(500));
        let mut next = last_sent + ttl / 3;
        loop {
            tokio::time::sleep(next.saturating_duration_since(self.clock.now())).await;
            let sent = self.clock.now();
            if sent >= deadline {
                return self.lose(LeaseLost::DeadlinePassed);
            }
            // A renewal that cannot finish before the deadline is worthless: give up on it then.
            let wait = deadline.saturating_duration_since(sent);
            match tokio::time::timeout(wait, self.store.lease_keep_alive_once(self.id)).await {
                Ok(Ok(acked)) => {
                    if self.clock.now() >= deadline {
                        // Too late: the owner may already have acted on the lease's loss.
                        return self.lose(LeaseLost::DeadlinePassed);
                    }
                    ttl = acked;
                    last_sent = sent;
                    deadline = last_sent + ttl / 2;
                    next = last_sent + ttl / 3;
                    self.publish(LeaseState::Held { deadline });
                }
                Ok(Err(MetaError::LeaseNotFound { .. })) => return self.lose(LeaseLost::Expired),
                Ok(Err(error)) => {
                    tracing::warn!(lease = self.id, %error, "lease renewal failed; still valid until the deadline");
                    self.publish(LeaseState::Renewing { deadline, error });
                    next = (self.clock.now() + retry).min(deadline);
                }
                Err(_) => return self.lose(LeaseLost::DeadlinePassed),
            }
        }
    }

    /// Publishes a state unless the lease is already lost (a loss is final).
    fn publish(&self, new: LeaseState) {
        self.state.send_if_modified(|state| {
            if matches!(state, LeaseState::Lost(_)) {
                return false;
            }
            *state = new;
            true
        });
    }

    fn lose(&self, why: LeaseLost) {
        tracing::warn!(lease = self.id, ?why, "lease lost");
        self.publish(LeaseState::Lost(why));
    }
}
