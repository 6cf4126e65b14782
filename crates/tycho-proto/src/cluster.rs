//! The one cluster record clients read as well as masters: a master's leased registration
//! under `/tycho/{cluster}/masters/{id}`, from which a client given the coordination store's
//! address (`etcd://...`) learns where the masters are.

use serde::{Deserialize, Serialize};

use crate::envelope::{self, EnvelopeError, RecordKind};

/// Layout version of a registration (and of the group records next to it).
pub const OWNERSHIP_VERSION: u16 = 1;

/// A cluster's name when none is given.
pub const DEFAULT_CLUSTER: &str = "tycho";

/// The key prefix under which the masters of cluster `name` register.
pub fn masters_prefix(name: &str) -> String {
    format!("/tycho/{name}/masters/")
}

/// The first key after every key that starts with `prefix` (etcd's `range_end` of a prefix
/// scan): `prefix` with its last byte below 0xff raised by one and what follows dropped; the
/// whole keyspace's end (`[0]`) when every byte is 0xff or there is none.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// A master's role in a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Serves the group.
    Primary,
    /// Replays the group's log.
    Standby,
    /// Waits for a role.
    Idle,
}

/// A master's leased registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterRegistration {
    /// Its id.
    pub id: String,
    /// Where clients reach it.
    pub address: String,
    /// What it does now.
    pub role: Role,
    /// When it registered (Unix ms).
    pub registered_at_ms: u64,
}

/// Why a registration could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistrationError {
    /// The envelope (magic, kind, version, checksum) did not open.
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    /// The payload is not a registration of this version.
    #[error("malformed registration: {0}")]
    Malformed(String),
}

impl MasterRegistration {
    /// The registration as stored: sealed in the versioned, checksummed envelope.
    pub fn encode(&self) -> Vec<u8> {
        let payload = postcard::to_stdvec(self).expect("registrations serialize");
        envelope::seal(RecordKind::Ownership, OWNERSHIP_VERSION, &payload)
    }

    /// Reads a stored registration; refuses a newer version or damaged bytes.
    pub fn decode(bytes: &[u8]) -> Result<MasterRegistration, RegistrationError> {
        let (_, payload) = envelope::open(RecordKind::Ownership, OWNERSHIP_VERSION, bytes)?;
        postcard::from_bytes(payload).map_err(|e| RegistrationError::Malformed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_reads_back_and_damage_is_refused() {
        let r = MasterRegistration { id: "m1".into(), address: "h:1".into(), role: Role::Idle, registered_at_ms: 7 };
        assert_eq!(MasterRegistration::decode(&r.encode()), Ok(r.clone()));
        let mut bad = r.encode();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(MasterRegistration::decode(&bad).is_err());
        assert!(MasterRegistration::decode(&[]).is_err());
    }
}
