//! Where a group's log lives in the coordination store, the layout record that marks its
//! format, and how the log's operations fail.

use thiserror::Error;
use tycho_proto::envelope::{self, RecordKind};
use tycho_proto::ErrorCode;

/// Layout version of a group's log, stored under [`LogKeys::layout`]. Version 1 kept the durable
/// prefix there (an 8-byte sequence number) and wrote it with every batch; version 2 keeps no
/// prefix, and the record holds nothing else.
const LAYOUT_VERSION: u16 = 2;

/// Where one group's log lives in the store.
#[derive(Debug, Clone)]
pub struct LogKeys {
    prefix: String,
}

impl LogKeys {
    /// The log of group `rank` of cluster `cluster`.
    pub fn new(cluster: &str, rank: u32) -> LogKeys {
        LogKeys { prefix: format!("/tycho/{cluster}/oplog/{rank:05}/") }
    }

    /// The key of the batch whose first record is `first_seq`.
    pub fn batch(&self, first_seq: u64) -> Vec<u8> {
        format!("{}b/{first_seq:020}", self.prefix).into_bytes()
    }

    /// The prefix of every batch key, in sequence order.
    pub fn batches(&self) -> Vec<u8> {
        format!("{}b/", self.prefix).into_bytes()
    }

    /// The first record of the batch stored under `key` (`None`: not a batch key of this log).
    pub fn first_seq_of(&self, key: &[u8]) -> Option<u64> {
        let rest = key.strip_prefix(self.batches().as_slice())?;
        std::str::from_utf8(rest).ok()?.parse().ok()
    }

    /// The log's layout record (the key where layout 1 kept its durable prefix).
    pub fn layout(&self) -> Vec<u8> {
        format!("{}durable", self.prefix).into_bytes()
    }
}

/// The layout record as every writer stores it: sealed at layout version 2 and empty, so
/// that a reader of layout 1 (which expects its prefix there) refuses it as a newer version.
pub fn log_layout() -> Vec<u8> {
    envelope::seal(RecordKind::LogPrefix, LAYOUT_VERSION, &[])
}

/// Why a record is not (or will not be) durable.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum LogError {
    /// Too many records wait already; retry shortly.
    #[error("the OpLog is busy: too many records wait to be committed")]
    Busy,
    /// The group's ownership record or log changed under this writer: another master owns it.
    #[error("fenced: {0}")]
    Fenced(String),
    /// The log in the store cannot be read as this build writes it.
    #[error("corrupt OpLog: {0}")]
    Corrupt(String),
    /// The writer was closed.
    #[error("the OpLog writer is closed")]
    Closed,
    /// The writer was stopped while the record's batch was being committed: whether it is in
    /// the log is unknown (the new owner's log says).
    #[error("the OpLog writer stopped while this record's batch was being committed: its outcome is unknown")]
    Interrupted,
    /// The store refused the request itself (too large, invalid): a bug, not a transient.
    #[error("the store refused a log batch: {0}")]
    Refused(String),
}

impl LogError {
    /// The code a client is answered with.
    pub fn code(&self) -> ErrorCode {
        match self {
            // A closed log is one this master stopped writing because it gives the group up
            // (a hand-over, a lost lease): the mutation belongs with the next owner.
            LogError::Fenced(_) | LogError::Closed => ErrorCode::KVPT_NOT_OWNED,
            LogError::Busy => ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS,
            // Like a lost answer: not a code a client resends on (the write may have landed).
            LogError::Interrupted | LogError::Corrupt(_) | LogError::Refused(_) => ErrorCode::INTERNAL_ERROR,
        }
    }
}
