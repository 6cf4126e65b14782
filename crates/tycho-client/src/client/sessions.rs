//! Put and get sessions (Mooncake's `batch_put_session_*` and `batch_get_session_*`).
//!
//! A put session reserves objects without moving bytes: its start is an ordinary batch
//! PutStart, whose write ids and replica ranges the client keeps; ranged writes then copy into
//! those ranges (as many as the caller likes, in any order); its end commits the writes (one
//! batch PutEnd), its revoke drops them. Bytes of a session's object that no ranged write
//! covered are written as zeros before the end, so that a value never shows what the range
//! held before (another object's bytes). Each session has its own lock: a ranged write holds it
//! while its bytes move, and an end or revoke takes it (waiting for a write in flight) and
//! closes the session, so that no write lands after the end's zero-fill or after a revoke freed
//! the ranges. A session lasts at most [`MAX_SESSION_AGE`] (the master's default discard
//! timeout, past which another writer may take the key over and write grants expire): older,
//! its writes are refused and its end revokes it, both with WRITE_DROPPED. A client that
//! closes revokes the sessions it has open.
//!
//! A get session asks the master for its keys' replicas once and keeps the lists for this
//! client's reads, which reuse them as they reuse any list they got (for up to half the read
//! lease, at most 1 s; see `ClientConfig::reuse_leases`) and ask the master again after; its
//! end forgets them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tycho_proto::*;
use tycho_transfer::Part;

use super::{new_write_id, Client, Inner, LEASE_CACHE_ENTRIES, MAX_BATCH_KEYS, QUICK_CLOSE_TIMEOUT};

/// Longest a put session stays usable (the master's default discard timeout).
pub const MAX_SESSION_AGE: Duration = Duration::from_secs(30);

/// Zeros written at once when an end fills what no ranged write covered.
const ZERO_CHUNK: usize = 4 << 20;

/// One object of an open put session.
pub(super) struct PutSession {
    write_id: u64,
    size: u64,
    started: Instant,
    replicas: Vec<ReplicaDesc>,
    /// Ranges written so far, as (start, end) byte offsets, sorted and merged.
    written: Vec<(u64, u64)>,
    /// Set by the end or revoke that took the session: later writes are refused.
    closed: bool,
}

/// The put sessions of a client, by key; each behind its own lock.
pub(super) type PutSessions = HashMap<String, Arc<Mutex<PutSession>>>;

/// Adds `[start, end)` to sorted, merged `ranges`, keeping them so.
fn add_range(ranges: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    ranges.push((start, end));
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(s, e) in ranges.iter() {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    *ranges = merged;
}

/// Revokes every put session `inner` has open (its client is closing): one attempt, bounded
/// when `quick`.
pub(super) fn revoke_all(inner: &Inner, quick: bool) {
    let open: Vec<(String, Arc<Mutex<PutSession>>)> = inner.put_sessions.lock().drain().collect();
    if open.is_empty() {
        return;
    }
    let mut keys = Vec::with_capacity(open.len());
    let mut write_ids = Vec::with_capacity(open.len());
    for (key, session) in &open {
        let mut s = session.lock();
        s.closed = true;
        keys.push(inner.key_ref(key));
        write_ids.push(s.write_id);
    }
    for (keys, write_ids) in keys.chunks(MAX_BATCH_KEYS).zip(write_ids.chunks(MAX_BATCH_KEYS)) {
        let finish = BatchWriteFinish {
            client: inner.id,
            tenant: inner.cfg.tenant.clone(),
            keys: keys.to_vec(),
            write_ids: write_ids.to_vec(),
        };
        let req = Request::BatchPutRevoke(finish);
        let _ = if quick {
            inner.master().call::<Request, Response>(&req, QUICK_CLOSE_TIMEOUT).map(drop).map_err(|e| e.code())
        } else {
            inner.call(&req).map(drop)
        };
    }
}

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
    /// moves no bytes. One result per key: OBJECT_ALREADY_EXISTS for a key that exists or is
    /// being written, INVALID_PARAMS for a size of 0, a key given twice, or one in a session
    /// already; INVALID_PARAMS for every key when the lists differ in length.
    pub fn put_session_start(
        &self,
        keys: &[&str],
        sizes: &[u64],
        config: &ReplicateConfig,
    ) -> Vec<Result<(), ErrorCode>> {
        let n = keys.len();
        if sizes.len() != n {
            return vec![Err(ErrorCode::INVALID_PARAMS); n];
        }
        if n > MAX_BATCH_KEYS {
            let chunks = keys.chunks(MAX_BATCH_KEYS).zip(sizes.chunks(MAX_BATCH_KEYS));
            return chunks.flat_map(|(k, s)| self.put_session_start(k, s, config)).collect();
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
        let all: Vec<(usize, u64)> = live.iter().copied().zip(write_ids.iter().copied()).collect();
        let start = BatchWriteStart {
            client: self.inner.id,
            tenant: self.tenant(),
            items: live.iter().map(|&i| (self.key(keys[i]), sizes[i])).collect(),
            config: config.clone(),
            write_ids: write_ids.clone(),
        };
        let started = match self.inner.call(&Request::BatchPutStart(start)) {
            Ok(Response::BatchWriteStarted(r)) if r.len() == live.len() => r,
            other => {
                let e = match other {
                    Err(e) => e,
                    Ok(_) => ErrorCode::INTERNAL_ERROR,
                };
                // The starts may have reached the master: revoke them by id.
                let _ = self.revoke_session_writes(keys, &all);
                live.iter().for_each(|&i| out[i] = Err(e));
                return out;
            }
        };
        let now = Instant::now();
        let mut open = self.inner.put_sessions.lock();
        let mut raced = Vec::new();
        for (&(i, write_id), res) in all.iter().zip(started) {
            match res {
                Ok(replicas) => {
                    let size = sizes[i];
                    let session =
                        PutSession { write_id, size, started: now, replicas, written: Vec::new(), closed: false };
                    open.insert(keys[i].to_string(), Arc::new(Mutex::new(session)));
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
        let _ = self.revoke_session_writes(keys, &raced);
        out
    }

    /// Revokes the writes `(index into keys, write id)`; the master's answer for the call.
    fn revoke_session_writes(&self, keys: &[&str], writes: &[(usize, u64)]) -> Result<(), ErrorCode> {
        if writes.is_empty() {
            return Ok(());
        }
        let finish = BatchWriteFinish {
            client: self.inner.id,
            tenant: self.tenant(),
            keys: writes.iter().map(|&(i, _)| self.key(keys[i])).collect(),
            write_ids: writes.iter().map(|&(_, w)| w).collect(),
        };
        self.inner.call(&Request::BatchPutRevoke(finish)).map(drop)
    }

    /// Writes `ranges` (object offset, bytes) into `key`'s session object, on every replica;
    /// returns the bytes written. INVALID_PARAMS for a key without a session or a range past
    /// the object's end (nothing is written then); WRITE_DROPPED for a session past
    /// [`MAX_SESSION_AGE`]. Writes of one key run one at a time.
    pub fn put_session_write(&self, key: &str, ranges: &[(u64, &[u8])]) -> Result<u64, ErrorCode> {
        self.check_open()?;
        let session = self.inner.put_sessions.lock().get(key).cloned().ok_or(ErrorCode::INVALID_PARAMS)?;
        let mut s = session.lock();
        if s.closed {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        if s.started.elapsed() >= MAX_SESSION_AGE {
            return Err(ErrorCode::WRITE_DROPPED);
        }
        let size = s.size;
        let fits = |&(at, src): &(u64, &[u8])| at.checked_add(src.len() as u64).is_some_and(|end| end <= size);
        if !ranges.iter().all(fits) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let parts: Vec<Part<'_>> = s
            .replicas
            .iter()
            .flat_map(|replica| {
                ranges.iter().filter(|(_, src)| !src.is_empty()).map(move |&(at, src)| Part::Write { replica, at, src })
            })
            .collect();
        self.inner.engine.run(parts).map_err(|e| e.code())?;
        for &(at, src) in ranges.iter().filter(|(_, src)| !src.is_empty()) {
            add_range(&mut s.written, at, at + src.len() as u64);
        }
        Ok(ranges.iter().map(|(_, src)| src.len() as u64).sum())
    }

    /// Ends the put sessions of `keys`: fills what no ranged write covered with zeros, then
    /// commits the objects. One result per key: INVALID_PARAMS for a key without a session,
    /// WRITE_DROPPED (and the session revoked) for one past [`MAX_SESSION_AGE`].
    pub fn put_session_end(&self, keys: &[&str]) -> Vec<Result<(), ErrorCode>> {
        let (mut out, taken) = self.take_sessions(keys);
        let mut ended: Vec<(usize, u64)> = Vec::with_capacity(taken.len());
        let mut failed: Vec<(usize, u64)> = Vec::new();
        let zeros = vec![0u8; ZERO_CHUNK.min(taken.iter().map(|(_, s)| s.size as usize).max().unwrap_or(0))];
        for (i, s) in taken {
            if s.started.elapsed() >= MAX_SESSION_AGE {
                out[i] = Err(ErrorCode::WRITE_DROPPED);
                failed.push((i, s.write_id));
                continue;
            }
            let mut parts: Vec<Part<'_>> = Vec::new();
            for (a, b) in gaps(s.size, &s.written) {
                let mut at = a;
                while at < b {
                    let len = ((b - at) as usize).min(ZERO_CHUNK);
                    parts.extend(s.replicas.iter().map(|replica| Part::Write { replica, at, src: &zeros[..len] }));
                    at += len as u64;
                }
            }
            match self.inner.engine.run(parts) {
                Ok(()) => ended.push((i, s.write_id)),
                Err(e) => {
                    out[i] = Err(e.code());
                    failed.push((i, s.write_id));
                }
            }
        }
        let _ = self.revoke_session_writes(keys, &failed);
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
    /// result per key: INVALID_PARAMS for a key without a session, the master's error when the
    /// revoke did not reach it (the master then drops the writes at its discard timeout).
    pub fn put_session_revoke(&self, keys: &[&str]) -> Vec<Result<(), ErrorCode>> {
        let (mut out, taken) = self.take_sessions(keys);
        let writes: Vec<(usize, u64)> = taken.iter().map(|(i, s)| (*i, s.write_id)).collect();
        if let Err(e) = self.revoke_session_writes(keys, &writes) {
            writes.iter().for_each(|&(i, _)| out[i] = Err(e));
        }
        out
    }

    /// Takes the sessions of `keys` out of the open ones, closed (each after a write of it in
    /// flight ends); INVALID_PARAMS for a key without one.
    fn take_sessions(&self, keys: &[&str]) -> Taken {
        if let Err(e) = self.check_open() {
            return (vec![Err(e); keys.len()], Vec::new());
        }
        let mut out = vec![Ok(()); keys.len()];
        let mut found = Vec::new();
        {
            let mut open = self.inner.put_sessions.lock();
            for (i, k) in keys.iter().enumerate() {
                match open.remove(*k) {
                    Some(s) => found.push((i, s)),
                    None => out[i] = Err(ErrorCode::INVALID_PARAMS),
                }
            }
        }
        let taken = found
            .into_iter()
            .map(|(i, session)| {
                let mut s = session.lock();
                s.closed = true;
                let copy = PutSession {
                    write_id: s.write_id,
                    size: s.size,
                    started: s.started,
                    replicas: std::mem::take(&mut s.replicas),
                    written: std::mem::take(&mut s.written),
                    closed: true,
                };
                (i, copy)
            })
            .collect();
        (out, taken)
    }

    /// Starts a get session: asks the master for the replicas of `keys` once and keeps each
    /// list for this client's reads (see the module). One result per key (OBJECT_NOT_FOUND for
    /// a missing one).
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
    use super::{add_range, gaps};

    #[test]
    fn gaps_are_what_no_write_covered() {
        assert_eq!(gaps(10, &[]), vec![(0, 10)]);
        assert_eq!(gaps(10, &[(0, 10)]), vec![]);
        assert_eq!(gaps(32, &[(16, 24), (0, 4), (2, 8)]), vec![(8, 16), (24, 32)]);
        assert_eq!(gaps(8, &[(0, 4), (0, 4)]), vec![(4, 8)]);
    }

    #[test]
    fn written_ranges_stay_sorted_and_merged() {
        let mut r = Vec::new();
        add_range(&mut r, 16, 24);
        add_range(&mut r, 0, 4);
        add_range(&mut r, 2, 8);
        assert_eq!(r, vec![(0, 8), (16, 24)]);
        add_range(&mut r, 8, 16);
        assert_eq!(r, vec![(0, 24)]);
    }
}
