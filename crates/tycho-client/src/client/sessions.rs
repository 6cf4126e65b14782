//! Put and get sessions (Mooncake's `batch_put_session_*` and `batch_get_session_*`).
//!
//! A put session reserves objects without moving bytes: its start is an ordinary batch
//! PutStart, whose write ids and replica ranges the client keeps; ranged writes then copy into
//! those ranges (as many as the caller likes, in any order); its end commits the writes (one
//! batch PutEnd), its revoke drops them. Bytes of a session's object that no ranged write
//! covered are written as zeros before the end, so that a value never shows what the range
//! held before (another object's bytes). While a session is open the master holds its writes
//! as any pending write: past the discard timeout another writer may take the key over, and
//! the end then fails as a late PutEnd does.
//!
//! A get session asks the master for its keys' replicas once and keeps the lists for this
//! client's reads, which reuse them while their lease allows (as they reuse any list they got,
//! see `ClientConfig::reuse_leases`) and ask the master again after; its end forgets them.

use std::collections::HashMap;
use std::sync::Arc;

use tycho_proto::*;
use tycho_transfer::Part;

use super::{new_write_id, Client, LEASE_CACHE_ENTRIES, MAX_BATCH_KEYS};

/// One object of an open put session.
pub(super) struct PutSession {
    write_id: u64,
    size: u64,
    replicas: Vec<ReplicaDesc>,
    /// Ranges written so far, as (start, end) byte offsets, unsorted.
    written: Vec<(u64, u64)>,
}

/// The put sessions of a client, by key.
pub(super) type PutSessions = HashMap<String, PutSession>;

/// Per key, whether it had a session (an error if not), and the sessions taken with their
/// keys' places.
type Taken = (Vec<Result<(), ErrorCode>>, Vec<(usize, PutSession)>);

/// The gaps of `[0, size)` that `written` leaves.
fn gaps(size: u64, written: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut w = written.to_vec();
    w.sort_unstable();
    let (mut out, mut at) = (Vec::new(), 0u64);
    for (s, e) in w {
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < size {
        out.push((at, size));
    }
    out
}

impl Client {
    /// Starts a put session of `keys` with their `sizes`: reserves each object's replicas and
    /// moves no bytes. One result per key: OBJECT_ALREADY_EXISTS for a key that exists,
    /// INVALID_PARAMS for a size of 0, a key given twice, or one in a session already;
    /// INVALID_PARAMS for every key when the lists differ in length.
    pub fn put_session_start(
        &self,
        keys: &[&str],
        sizes: &[u64],
        config: &ReplicateConfig,
    ) -> Vec<Result<(), ErrorCode>> {
        let n = keys.len();
        if sizes.len() != n || n > MAX_BATCH_KEYS {
            return vec![Err(ErrorCode::INVALID_PARAMS); n];
        }
        if let Err(e) = self.check_open() {
            return vec![Err(e); n];
        }
        let mut out: Vec<Result<(), ErrorCode>> = vec![Ok(()); n];
        let mut live = Vec::with_capacity(n);
        {
            let open = self.inner.put_sessions.lock();
            let mut seen = std::collections::HashSet::with_capacity(n);
            for i in 0..n {
                let repeated = !seen.insert(keys[i]);
                if sizes[i] == 0 || repeated || open.contains_key(keys[i]) {
                    out[i] = Err(ErrorCode::INVALID_PARAMS);
                } else {
                    live.push(i);
                }
            }
        }
        if live.is_empty() {
            return out;
        }
        live.iter().for_each(|&i| self.forget_lease(keys[i]));
        let write_ids: Vec<u64> = live.iter().map(|_| new_write_id()).collect();
        let start = BatchWriteStart {
            client: self.inner.id,
            tenant: self.tenant(),
            items: live.iter().map(|&i| (self.key(keys[i]), sizes[i])).collect(),
            config: config.clone(),
            write_ids: write_ids.clone(),
        };
        let started = match self.inner.call(&Request::BatchPutStart(start)) {
            Ok(Response::BatchWriteStarted(r)) if r.len() == live.len() => r,
            Ok(_) => return vec![Err(ErrorCode::INTERNAL_ERROR); n],
            Err(e) => {
                // The starts may have reached the master: revoke them by id.
                if matches!(e, ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT) {
                    let all: Vec<(usize, u64)> = live.iter().copied().zip(write_ids.iter().copied()).collect();
                    self.revoke_session_writes(keys, &all);
                }
                return vec![Err(e); n];
            }
        };
        let mut open = self.inner.put_sessions.lock();
        let mut raced = Vec::new();
        for ((&i, &write_id), res) in live.iter().zip(&write_ids).zip(started) {
            match res {
                Ok(replicas) => {
                    let session = PutSession { write_id, size: sizes[i], replicas, written: Vec::new() };
                    open.insert(keys[i].to_string(), session);
                }
                Err(e) => {
                    // A repeated start that raced its first attempt: that one stands; revoke it.
                    if e == ErrorCode::INVALID_WRITE {
                        raced.push((i, write_id));
                    }
                    out[i] = Err(e);
                }
            }
        }
        drop(open);
        self.revoke_session_writes(keys, &raced);
        out
    }

    fn revoke_session_writes(&self, keys: &[&str], writes: &[(usize, u64)]) {
        if writes.is_empty() {
            return;
        }
        let finish = BatchWriteFinish {
            client: self.inner.id,
            tenant: self.tenant(),
            keys: writes.iter().map(|&(i, _)| self.key(keys[i])).collect(),
            write_ids: writes.iter().map(|&(_, w)| w).collect(),
        };
        let _ = self.inner.call(&Request::BatchPutRevoke(finish));
    }

    /// Writes `ranges` (object offset, bytes) into `key`'s session object, on every replica;
    /// returns the bytes written. INVALID_PARAMS for a key without a session or a range past
    /// the object's end (nothing is written then).
    pub fn put_session_write(&self, key: &str, ranges: &[(u64, &[u8])]) -> Result<u64, ErrorCode> {
        self.check_open()?;
        let (size, replicas) = {
            let open = self.inner.put_sessions.lock();
            let s = open.get(key).ok_or(ErrorCode::INVALID_PARAMS)?;
            (s.size, s.replicas.clone())
        };
        let fits = |&(at, src): &(u64, &[u8])| at.checked_add(src.len() as u64).is_some_and(|end| end <= size);
        if !ranges.iter().all(fits) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let parts: Vec<Part<'_>> = replicas
            .iter()
            .flat_map(|replica| {
                ranges.iter().filter(|(_, src)| !src.is_empty()).map(move |&(at, src)| Part::Write { replica, at, src })
            })
            .collect();
        self.inner.engine.run(parts).map_err(|e| e.code())?;
        let total: u64 = ranges.iter().map(|(_, src)| src.len() as u64).sum();
        if let Some(s) = self.inner.put_sessions.lock().get_mut(key) {
            s.written.extend(ranges.iter().map(|&(at, src)| (at, at + src.len() as u64)));
        }
        Ok(total)
    }

    /// Ends the put sessions of `keys`: fills what no ranged write covered with zeros, then
    /// commits the objects. One result per key: INVALID_PARAMS for a key without a session.
    pub fn put_session_end(&self, keys: &[&str]) -> Vec<Result<(), ErrorCode>> {
        let (mut out, taken) = self.take_sessions(keys);
        let mut ended: Vec<(usize, u64)> = Vec::with_capacity(taken.len());
        let mut failed: Vec<(usize, u64)> = Vec::new();
        for (i, s) in taken {
            let holes = gaps(s.size, &s.written);
            let longest = holes.iter().map(|(a, b)| b - a).max().unwrap_or(0) as usize;
            let zeros = vec![0u8; longest];
            let parts: Vec<Part<'_>> = s
                .replicas
                .iter()
                .flat_map(|replica| {
                    holes.iter().map(|&(a, b)| Part::Write { replica, at: a, src: &zeros[..(b - a) as usize] })
                })
                .collect();
            match self.inner.engine.run(parts) {
                Ok(()) => ended.push((i, s.write_id)),
                Err(e) => {
                    out[i] = Err(e.code());
                    failed.push((i, s.write_id));
                }
            }
        }
        self.revoke_session_writes(keys, &failed);
        if ended.is_empty() {
            return out;
        }
        let finish = BatchWriteFinish {
            client: self.inner.id,
            tenant: self.tenant(),
            keys: ended.iter().map(|&(i, _)| self.key(keys[i])).collect(),
            write_ids: ended.iter().map(|&(_, w)| w).collect(),
        };
        match self.inner.call(&Request::BatchPutEnd(finish)) {
            Ok(Response::BatchCommitted(r)) if r.len() == ended.len() => {
                for ((i, _), res) in ended.iter().zip(r) {
                    out[*i] = res.map(|replaced| self.retire(&replaced));
                }
            }
            Ok(_) => ended.iter().for_each(|&(i, _)| out[i] = Err(ErrorCode::INTERNAL_ERROR)),
            Err(e) => ended.iter().for_each(|&(i, _)| out[i] = Err(e)),
        }
        out
    }

    /// Revokes the put sessions of `keys`: their reservations go, nothing is committed. One
    /// result per key: INVALID_PARAMS for a key without a session.
    pub fn put_session_revoke(&self, keys: &[&str]) -> Vec<Result<(), ErrorCode>> {
        let (out, taken) = self.take_sessions(keys);
        let writes: Vec<(usize, u64)> = taken.iter().map(|(i, s)| (*i, s.write_id)).collect();
        self.revoke_session_writes(keys, &writes);
        out
    }

    /// Takes the sessions of `keys` out of the open ones; INVALID_PARAMS for a key without one.
    fn take_sessions(&self, keys: &[&str]) -> Taken {
        let mut out = vec![Ok(()); keys.len()];
        if let Err(e) = self.check_open() {
            return (vec![Err(e); keys.len()], Vec::new());
        }
        let mut open = self.inner.put_sessions.lock();
        let mut taken = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match open.remove(*k) {
                Some(s) => taken.push((i, s)),
                None => out[i] = Err(ErrorCode::INVALID_PARAMS),
            }
        }
        (out, taken)
    }

    /// Starts a get session: asks the master for the replicas of `keys` once and keeps each
    /// list for this client's reads while its lease allows. One result per key
    /// (OBJECT_NOT_FOUND for a missing one).
    pub fn get_session_start(&self, keys: &[&str]) -> Vec<Result<(), ErrorCode>> {
        let found = self.lookup_batch(keys);
        let mut leases = self.inner.leases.lock();
        found
            .into_iter()
            .map(|r| {
                r.map(|l| {
                    if leases.len() >= LEASE_CACHE_ENTRIES {
                        leases.clear();
                    }
                    leases.insert(l.key, Arc::new((l.list, l.asked)));
                })
            })
            .collect()
    }

    /// Ends a get session: forgets the replica lists of `keys` (the next read asks the master).
    pub fn get_session_end(&self, keys: &[&str]) {
        keys.iter().for_each(|k| self.forget_lease(k));
    }
}

#[cfg(test)]
mod tests {
    use super::gaps;

    #[test]
    fn gaps_are_what_no_write_covered() {
        assert_eq!(gaps(10, &[]), vec![(0, 10)]);
        assert_eq!(gaps(10, &[(0, 10)]), vec![]);
        assert_eq!(gaps(32, &[(16, 24), (0, 4), (2, 8)]), vec![(8, 16), (24, 32)]);
        assert_eq!(gaps(8, &[(0, 4), (0, 4)]), vec![(4, 8)]);
    }
}
