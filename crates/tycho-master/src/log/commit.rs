//! Commit-time fencing of a group's OpLog, without I/O: the decisions of committing one batch,
//! as a state machine that says what to send or read next and is told what came back. The
//! OpLog's commit task ([`crate::log::oplog`]) drives it against the coordination store; the deterministic
//! simulation (`tests/sim.rs`) drives the same machine through a scheduler that delays,
//! reorders and loses its messages.
//!
//! A batch is committed by one transaction that puts it under its own key and holds only while
//! the group's ownership record is where this writer became primary (see [`crate::log::oplog`] for
//! the layout). Any other outcome is settled by reading the batch's key back:
//!
//! - It holds exactly this batch: an attempt landed (its answer was lost, or arrived after the
//!   read-back that sent the batch again); committed.
//! - It holds another batch: another writer appended; fenced for good.
//! - It is absent and the answer was lost: nothing landed; send it again, under the same
//!   sequence numbers (the log never has a gap or a record twice).
//! - It is absent and the compares failed: the ownership record changed, or the transaction
//!   carried other groups' batches too ([`crate::log::oplog::TxnCombiner`]) and one of theirs failed.
//!   Read the record: still this primary at this epoch (a standby joined or left, a reshard set
//!   the group migrating or lifted that, or nothing changed) renews the fence at its revision and
//!   sends again; anything else fences the writer.
//!
//! The transaction does not also check that the batch's key is free: while the fence holds, no
//! other writer can put it. Every writer opens right after the compare-and-swap that named it
//! primary and raised the epoch (group records are never deleted, so an epoch is never reused),
//! and renews only to revisions that keep its primary and epoch; the one other put of the key
//! is this writer's own earlier attempt, landing late with the same bytes.

use tycho_meta::{Compare, KeyValue, MetaError, MetaResult, Revision, Txn, TxnOp, TxnResponse};

use crate::log::fence::{Fence, GroupRecord, GroupState};
use crate::log::layout::{LogError, LogKeys};

/// What the machine needs done next.
#[derive(Debug)]
pub enum Io {
    /// Send this transaction; answer [`Reply::Sent`].
    Send(Txn),
    /// Read this key (the batch's, or the ownership record), after the writer's back-off pause
    /// when `pause` (the store did not answer); answer [`Reply::Read`].
    Read {
        /// The key.
        key: Vec<u8>,
        /// Pause first.
        pause: bool,
    },
    /// The batch is committed (`Ok`), or the log ends here (`Err`).
    Done(Result<(), LogError>),
}

/// What came back.
#[derive(Debug)]
pub enum Reply {
    /// The transaction's answer (an unavailable store: the outcome is unknown).
    Sent(MetaResult<TxnResponse>),
    /// The key read (`None`: absent). The driver retries a store that does not answer.
    Read(Result<Option<KeyValue>, LogError>),
}

/// Where the batch in hand stands.
#[derive(Debug)]
enum Phase {
    /// Its transaction is out.
    Sending,
    /// Its key is being read back (`unknown`: the transaction went unanswered).
    Batch { unknown: bool },
    /// The ownership record changed: does it still name this writer?
    Record,
}

#[derive(Debug)]
struct Pending {
    first_seq: u64,
    last: u64,
    encoded: Vec<u8>,
    phase: Phase,
}

/// The fencing state of one group's log writer, carried from batch to batch.
#[derive(Debug)]
pub struct BatchCommit {
    keys: LogKeys,
    fence: Fence,
    group: u32,
    durable: u64,
    pending: Option<Pending>,
}

impl BatchCommit {
    /// A writer of `keys` under `fence` whose log ends at record `durable`.
    pub fn new(keys: LogKeys, fence: Fence, group: u32, durable: u64) -> BatchCommit {
        BatchCommit { keys, fence, group, durable, pending: None }
    }

    /// The last committed record's sequence number.
    pub fn durable(&self) -> u64 {
        self.durable
    }

    /// Whether a failed compare is settled by reading the ownership record back (the fence
    /// names its owner): only such a writer may share transactions with other groups, whose
    /// failures it must survive.
    pub fn renewable(&self) -> bool {
        self.fence.owner.is_some()
    }

    /// The revision the ownership record is expected at.
    pub fn fence_revision(&self) -> Revision {
        self.fence.mod_revision
    }

    /// Starts committing the batch of records `first_seq..=last`, sealed as `encoded`.
    pub fn begin(&mut self, first_seq: u64, last: u64, encoded: Vec<u8>) -> Io {
        debug_assert_eq!(first_seq, self.durable + 1, "batches continue the log");
        debug_assert!(self.pending.is_none(), "one batch at a time");
        self.pending = Some(Pending { first_seq, last, encoded, phase: Phase::Sending });
        self.send()
    }

    /// Takes what came back for the last [`Io`] and says what to do next.
    pub fn on(&mut self, reply: Reply) -> Io {
        let Some(p) = self.pending.as_mut() else {
            return Io::Done(Err(LogError::Closed));
        };
        match (std::mem::replace(&mut p.phase, Phase::Sending), reply) {
            (Phase::Sending, Reply::Sent(Ok(r))) if r.succeeded => self.committed(),
            (Phase::Sending, Reply::Sent(Ok(_))) => {
                p.phase = Phase::Batch { unknown: false };
                Io::Read { key: self.keys.batch(p.first_seq), pause: false }
            }
            (Phase::Sending, Reply::Sent(Err(e))) if e.is_unavailable() || matches!(e, MetaError::Other(_)) => {
                tracing::warn!(group = self.group, error = %e, "OpLog commit outcome unknown; reading it back");
                p.phase = Phase::Batch { unknown: true };
                Io::Read { key: self.keys.batch(p.first_seq), pause: true }
            }
            (Phase::Sending, Reply::Sent(Err(e))) => self.done(Err(LogError::Refused(e.to_string()))),
            (Phase::Batch { .. } | Phase::Record, Reply::Read(Err(e))) => self.done(Err(e)),
            (Phase::Batch { unknown }, Reply::Read(Ok(kv))) => match kv {
                // (Another writer may have appended after the batch already: it is committed
                // all the same, and this writer's next batch finds its key taken.)
                Some(kv) if kv.value == p.encoded => self.committed(),
                Some(_) => {
                    let first = p.first_seq;
                    self.done(Err(LogError::Fenced(format!(
                        "another writer committed record {first} of the log under this writer"
                    ))))
                }
                None if unknown => self.send(),
                // Nothing landed, so the ownership record failed its compare.
                None if self.fence.owner.is_none() => {
                    self.done(Err(LogError::Fenced("the ownership record changed".into())))
                }
                None => {
                    p.phase = Phase::Record;
                    Io::Read { key: self.fence.key.clone(), pause: false }
                }
            },
            (Phase::Record, Reply::Read(Ok(kv))) => match self.renew(kv) {
                Ok(()) => self.send(),
                Err(e) => self.done(Err(e)),
            },
            (phase, reply) => {
                self.done(Err(LogError::Refused(format!("commit machine: {reply:?} does not answer {phase:?}"))))
            }
        }
    }

    /// The ownership record as it is now: still this primary at this epoch renews the fence at
    /// its new revision (migrating or not: the primary of a migrating group still commits the
    /// ends of the writes it admitted, until the switch raises the epoch); anything else fences
    /// the writer.
    fn renew(&mut self, kv: Option<KeyValue>) -> Result<(), LogError> {
        let Some((primary, epoch)) = self.fence.owner.clone() else {
            return Err(LogError::Fenced("the ownership record changed".into()));
        };
        let Some(kv) = kv else { return Err(LogError::Fenced("the ownership record is gone".into())) };
        let record = GroupRecord::decode(&kv.value).map_err(|e| {
            LogError::Fenced(format!("the ownership record changed into one this build cannot read: {e}"))
        })?;
        if record.primary != primary || record.epoch != epoch {
            return Err(LogError::Fenced(format!(
                "the group is now {} under {} at epoch {} (this writer: {primary} at epoch {epoch})",
                match record.state {
                    GroupState::Stable => "stable",
                    GroupState::Migrating => "migrating",
                },
                record.primary,
                record.epoch
            )));
        }
        if kv.mod_revision == self.fence.mod_revision {
            tracing::debug!(group = self.group, "a shared transaction failed for another group: sending again");
        } else {
            tracing::info!(
                group = self.group,
                revision = kv.mod_revision,
                "ownership record changed, same primary and epoch: fence renewed"
            );
        }
        self.fence.mod_revision = kv.mod_revision;
        Ok(())
    }

    /// The batch's transaction, under the current fence.
    fn send(&mut self) -> Io {
        let Some(p) = self.pending.as_mut() else {
            return Io::Done(Err(LogError::Closed));
        };
        p.phase = Phase::Sending;
        Io::Send(
            Txn::new()
                .when([Compare::mod_revision_eq(self.fence.key.clone(), self.fence.mod_revision)])
                .and_then([TxnOp::put(self.keys.batch(p.first_seq), p.encoded.clone())]),
        )
    }

    fn committed(&mut self) -> Io {
        if let Some(p) = &self.pending {
            self.durable = p.last;
        }
        self.done(Ok(()))
    }

    fn done(&mut self, r: Result<(), LogError>) -> Io {
        self.pending = None;
        Io::Done(r)
    }
}
