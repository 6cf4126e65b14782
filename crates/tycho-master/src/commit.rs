//! Commit-time fencing of a group's OpLog, without I/O: the decisions of committing one batch,
//! as a state machine that says what to send or read next and is told what came back. The
//! OpLog's commit task ([`crate::oplog`]) drives it against the coordination store; the deterministic
//! simulation (`tests/sim.rs`) drives the same machine through a scheduler that delays,
//! reorders and loses its messages.
//!
//! A batch is committed by one transaction that holds only while the group's ownership record
//! is where this writer became primary and the durable prefix is where its last commit left it
//! (see [`crate::oplog`] for the layout). Any other outcome is settled by reading back:
//!
//! - the transaction failed its compares, or its answer was lost: read the durable prefix.
//!   - The prefix moved past the batch, and the batch key holds exactly this batch: an earlier
//!     attempt landed (its answer was lost); committed.
//!   - The prefix moved otherwise: another writer appended; fenced for good.
//!   - The prefix is where it was and the answer was lost: nothing landed; send it again, under
//!     the same sequence numbers (the log never has a gap or a record twice).
//!   - The prefix is where it was and the compares failed: the ownership record changed, or
//!     the transaction carried other groups' batches too ([`crate::oplog::TxnCombiner`]) and
//!     one of theirs failed. Read the record: still this primary at this epoch (a standby
//!     joined or left, a reshard set the group migrating or lifted that, or nothing changed)
//!     renews the fence at its revision and sends again; anything else fences the writer.

use tycho_meta::{Compare, KeyValue, MetaError, MetaResult, Revision, Txn, TxnOp, TxnResponse};

use crate::oplog::{encode_prefix, Fence, LogError, LogKeys};
use crate::ownership::{GroupRecord, GroupState};

/// What the machine needs done next.
#[derive(Debug)]
pub enum Io {
    /// Send this transaction; answer [`Reply::Sent`].
    Send(Txn),
    /// Read the durable prefix, after the writer's back-off pause when `pause` (the store did
    /// not answer); answer [`Reply::Prefix`].
    ReadPrefix {
        /// Pause first.
        pause: bool,
    },
    /// Read this key (the batch, or the ownership record); answer [`Reply::Read`].
    Read(Vec<u8>),
    /// The batch is committed (`Ok`), or the log ends here (`Err`).
    Done(Result<(), LogError>),
}

/// What came back.
#[derive(Debug)]
pub enum Reply {
    /// The transaction's answer (an unavailable store: the outcome is unknown).
    Sent(MetaResult<TxnResponse>),
    /// The durable prefix and its mod revision (0 and 0 for an empty log).
    Prefix(Result<(u64, Revision), LogError>),
    /// The key read (`None`: absent). The driver retries a store that does not answer.
    Read(Result<Option<KeyValue>, LogError>),
}

/// Where the batch in hand stands.
#[derive(Debug)]
enum Phase {
    /// Its transaction is out.
    Sending,
    /// The prefix is being read back (`unknown`: the transaction went unanswered).
    Prefix { unknown: bool },
    /// The prefix moved past the batch, to `durable` at `rev`: is the batch the one in the log?
    Batch { durable: u64, rev: Revision, unknown: bool },
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
    durable_rev: Revision,
    pending: Option<Pending>,
}

impl BatchCommit {
    /// A writer of `keys` under `fence` whose log's durable prefix is `durable`, last written
    /// at `durable_rev`.
    pub fn new(keys: LogKeys, fence: Fence, group: u32, durable: u64, durable_rev: Revision) -> BatchCommit {
        BatchCommit { keys, fence, group, durable, durable_rev, pending: None }
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
            (Phase::Sending, Reply::Sent(Ok(r))) if r.succeeded => self.committed(r.revision),
            (Phase::Sending, Reply::Sent(Ok(_))) => {
                p.phase = Phase::Prefix { unknown: false };
                Io::ReadPrefix { pause: false }
            }
            (Phase::Sending, Reply::Sent(Err(e))) if e.is_unavailable() || matches!(e, MetaError::Other(_)) => {
                tracing::warn!(group = self.group, error = %e, "OpLog commit outcome unknown; reading it back");
                p.phase = Phase::Prefix { unknown: true };
                Io::ReadPrefix { pause: true }
            }
            (Phase::Sending, Reply::Sent(Err(e))) => self.done(Err(LogError::Refused(e.to_string()))),
            (
                Phase::Prefix { .. } | Phase::Batch { .. } | Phase::Record,
                Reply::Prefix(Err(e)) | Reply::Read(Err(e)),
            ) => self.done(Err(e)),
            (Phase::Prefix { unknown }, Reply::Prefix(Ok((durable, rev)))) => {
                // (Another writer may have appended after the batch already: it is committed
                // all the same, and this writer's next batch finds the prefix moved.)
                if durable >= p.last && rev != self.durable_rev {
                    p.phase = Phase::Batch { durable, rev, unknown };
                    return Io::Read(self.keys.batch(p.first_seq));
                }
                self.settle(durable, rev, unknown)
            }
            (Phase::Batch { durable, rev, unknown }, Reply::Read(Ok(kv))) => {
                if kv.is_some_and(|kv| kv.value == p.encoded) {
                    // An earlier attempt went through; its answer was lost, or arrived after
                    // the read-back that sent the batch again.
                    let last = p.last;
                    self.durable = last;
                    self.durable_rev = rev;
                    return self.done(Ok(()));
                }
                self.settle(durable, rev, unknown)
            }
            (Phase::Record, Reply::Read(Ok(kv))) => match self.renew(kv) {
                Ok(()) => self.send(),
                Err(e) => self.done(Err(e)),
            },
            (phase, reply) => {
                self.done(Err(LogError::Refused(format!("commit machine: {reply:?} does not answer {phase:?}"))))
            }
        }
    }

    /// The prefix read back is at `durable`, `rev`, and the batch is not in the log.
    fn settle(&mut self, durable: u64, rev: Revision, unknown: bool) -> Io {
        if durable != self.durable || rev != self.durable_rev {
            let expected = self.durable;
            return self.done(Err(LogError::Fenced(format!(
                "the log's durable prefix moved to {durable} under this writer (expected {expected})"
            ))));
        }
        if unknown {
            return self.send();
        }
        // The prefix is in place, so the ownership record failed its compare.
        if self.fence.owner.is_none() {
            return self.done(Err(LogError::Fenced("the ownership record changed".into())));
        }
        if let Some(p) = self.pending.as_mut() {
            p.phase = Phase::Record;
        }
        Io::Read(self.fence.key.clone())
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

    /// The batch's transaction, under the current fence and prefix.
    fn send(&mut self) -> Io {
        let Some(p) = self.pending.as_mut() else {
            return Io::Done(Err(LogError::Closed));
        };
        p.phase = Phase::Sending;
        Io::Send(
            Txn::new()
                .when([
                    Compare::mod_revision_eq(self.fence.key.clone(), self.fence.mod_revision),
                    Compare::mod_revision_eq(self.keys.durable(), self.durable_rev),
                ])
                .and_then([
                    TxnOp::put(self.keys.batch(p.first_seq), p.encoded.clone()),
                    TxnOp::put(self.keys.durable(), encode_prefix(p.last)),
                ]),
        )
    }

    fn committed(&mut self, revision: Revision) -> Io {
        if let Some(p) = &self.pending {
            self.durable = p.last;
            self.durable_rev = revision;
        }
        self.done(Ok(()))
    }

    fn done(&mut self, r: Result<(), LogError>) -> Io {
        self.pending = None;
        Io::Done(r)
    }
}
