//! The fence of a group's log: the ownership record a primary's batches are committed under.
//! Its format lives here, below the cluster roles that write it (`cluster/ownership.rs`),
//! so that a commit can check it.

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tycho_meta::Revision;
use tycho_proto::envelope::{self, RecordKind};

/// Layout version of a group record: 2 added `caretaken`. A version 1 record reads as one that
/// is not caretaken; a newer one is refused.
pub const GROUP_RECORD_VERSION: u16 = 2;

/// The ownership record a group's batches are committed under.
#[derive(Debug, Clone)]
pub struct Fence {
    /// Its key (`/tycho/{cluster}/kvpt_groups/{rank:05}`).
    pub key: Vec<u8>,
    /// Its mod revision when this master became the group's primary.
    pub mod_revision: Revision,
    /// The primary and epoch this writer commits as. A change of the record that keeps both
    /// (a standby joined or left) renews the fence at the record's new revision; any other
    /// change ends the log. `None`: every change ends it.
    pub owner: Option<(String, u64)>,
}

/// A group's ownership state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupState {
    /// Served by its primary.
    Stable,
    /// Moving to `migrating_to` (the reshard issue).
    Migrating,
}

/// Who serves a group, at which epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// The group.
    pub rank: u32,
    /// The master that serves it.
    pub primary: String,
    /// Masters that replay its log, ready to take over.
    pub standbys: Vec<String>,
    /// Stable or migrating.
    pub state: GroupState,
    /// The target of a migration in progress.
    pub migrating_to: Option<String>,
    /// Raised by one whenever who serves the group changes (its primary); a change of the
    /// standbys, or of the state and migration target while the primary stays, keeps it. Requests and capabilities carry it,
    /// and the primary's OpLog commits only while the record names it at its epoch.
    pub epoch: u64,
    /// The primary serves the group only until a master of its own claims it (it is the
    /// native primary of another group, or was the only master when the group was made).
    pub caretaken: bool,
}

/// A group record as version 1 stored it (no caretaking).
#[derive(Serialize, Deserialize)]
struct GroupRecordV1 {
    rank: u32,
    primary: String,
    standbys: Vec<String>,
    state: GroupState,
    migrating_to: Option<String>,
    epoch: u64,
}

/// Why an ownership call failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum OwnershipError {
    /// The record changed since it was read: here it is now (`None`: absent).
    #[error("the group record changed since it was read")]
    Conflict(Option<Box<(GroupRecord, Revision)>>),
    /// A record cannot be read as this build writes it.
    #[error("unreadable ownership record: {0}")]
    Corrupt(String),
    /// The store failed.
    #[error("coordination store: {0}")]
    Store(String),
}

impl GroupRecord {
    /// The record as stored. One that is not caretaken is stored at version 1, which a build
    /// from before caretaking reads too (a G = 1 cluster upgraded one master at a time).
    pub fn encode(&self) -> Vec<u8> {
        if !self.caretaken {
            let v1 = GroupRecordV1 {
                rank: self.rank,
                primary: self.primary.clone(),
                standbys: self.standbys.clone(),
                state: self.state,
                migrating_to: self.migrating_to.clone(),
                epoch: self.epoch,
            };
            return envelope::seal(RecordKind::Ownership, 1, &postcard::to_stdvec(&v1).expect("records serialize"));
        }
        envelope::seal(
            RecordKind::Ownership,
            GROUP_RECORD_VERSION,
            &postcard::to_stdvec(self).expect("records serialize"),
        )
    }

    /// Reads a stored record (of this version or the first).
    pub fn decode(bytes: &[u8]) -> Result<GroupRecord, OwnershipError> {
        let corrupt = |e: &dyn std::fmt::Display| OwnershipError::Corrupt(e.to_string());
        let (version, payload) =
            envelope::open(RecordKind::Ownership, GROUP_RECORD_VERSION, bytes).map_err(|e| corrupt(&e))?;
        if version == GROUP_RECORD_VERSION {
            return postcard::from_bytes(payload).map_err(|e| corrupt(&e));
        }
        let v1: GroupRecordV1 = postcard::from_bytes(payload).map_err(|e| corrupt(&e))?;
        Ok(GroupRecord {
            rank: v1.rank,
            primary: v1.primary,
            standbys: v1.standbys,
            state: v1.state,
            migrating_to: v1.migrating_to,
            epoch: v1.epoch,
            caretaken: false,
        })
    }
}
