//! What a transfer service checks each request against: the capability a master granted for
//! the range, and the newest group epoch a write has shown. Shared by the TCP server and the
//! same-host socket that hands out segment mappings.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tycho_proto::auth::capability::{unix_ms, SegmentKey, RIGHT_READ, RIGHT_RETIRE, RIGHT_WRITE};
use tycho_proto::auth::Secret;
use tycho_proto::{ErrorCode, SegmentId};

use crate::wire::{XferOp, XferRequest};

/// What every connection of one server checks requests against.
pub(crate) struct Guard {
    secret: Option<Arc<Secret>>,
    /// Highest group epoch seen on a write capability, per group: a write granted under an
    /// older epoch comes from a master that no longer owns the group.
    epochs: Mutex<HashMap<u16, u64>>,
}

impl Guard {
    /// A guard that checks capabilities under `secret` (`None`: an insecure cluster, every
    /// request allowed).
    pub(crate) fn new(secret: Option<Arc<Secret>>) -> Guard {
        Guard { secret, epochs: Mutex::new(HashMap::new()) }
    }

    /// The cluster secret requests are checked under (`None`: an insecure cluster).
    pub(crate) fn secret(&self) -> Option<&Arc<Secret>> {
        self.secret.as_ref()
    }

    /// Whether `req` carries a valid capability for what it does; `keys` caches segment keys
    /// for the connection.
    pub(crate) fn authorize(
        &self,
        req: &XferRequest,
        keys: &mut HashMap<(SegmentId, u32), SegmentKey>,
    ) -> Result<(), ErrorCode> {
        let Some(secret) = &self.secret else { return Ok(()) };
        if !req.within_grant() {
            return Err(ErrorCode::CAPABILITY_INVALID);
        }
        let rights = match req.op {
            XferOp::Read => RIGHT_READ,
            XferOp::Write => RIGHT_WRITE,
            XferOp::Retire => RIGHT_RETIRE,
        };
        if keys.len() > 1024 {
            keys.clear();
        }
        let key = keys
            .entry((req.segment, req.incarnation))
            .or_insert_with(|| SegmentKey::new(secret, req.segment, req.incarnation));
        key.check(req.grant_offset, req.grant_len, req.gen, &req.cap, rights, unix_ms())?;
        if rights == RIGHT_WRITE {
            let mut epochs = self.epochs.lock();
            let seen = epochs.entry(req.cap.group).or_insert(0);
            if req.cap.epoch < *seen {
                return Err(ErrorCode::STALE_EPOCH);
            }
            *seen = req.cap.epoch;
        }
        Ok(())
    }
}
