//! The transfer server: serves reads and writes of ranges inside registered segments.
//!
//! Every connection starts with the greeting of `tycho_proto::auth::handshake`; with a cluster
//! secret, every request must carry the master's capability for the range it touches.
//!
//! One thread per connection with blocking I/O, at most [`MAX_CONNECTIONS`] of them: bulk transfers are few and long, and a
//! thread that owns its socket moves bytes between socket and segment with no hand-offs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use std::collections::HashMap;

use parking_lot::Mutex;
use tycho_proto::auth::capability::{unix_ms, SegmentKey, RIGHT_READ, RIGHT_WRITE};
use tycho_proto::auth::handshake::{self, Service};
use tycho_proto::auth::Secret;
use tycho_proto::{ErrorCode, SegmentId};

use crate::local::LocalServer;
use crate::wire::{encode_answer, XferOp, XferRequest, REQUEST_LEN};

/// Most connections served at once (one thread each); more are closed as they arrive. A
/// client engine keeps at most 16 idle connections per peer.
pub const MAX_CONNECTIONS: usize = 256;

/// How long a new connection has to complete its greeting.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
use crate::{SegmentRegistry, TransferError};

/// A running transfer server.
pub struct TransferServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
    /// Hands the memfds of registered segments to same-host peers of this user.
    _local: Option<LocalServer>,
}

impl TransferServer {
    /// Binds `bind` and serves `registry` until dropped; see [`serve`](Self::serve).
    pub fn start(
        bind: &str,
        registry: Arc<SegmentRegistry>,
        secret: Option<Arc<Secret>>,
    ) -> std::io::Result<TransferServer> {
        let listener = TcpListener::bind(bind)?;
        Self::serve(listener, registry, secret)
    }

    /// Serves `registry` on an already bound listener. With a `secret`, every connection must
    /// prove it and every request must carry a capability for its range minted under it;
    /// without one (`--insecure`), neither is checked.
    pub fn serve(
        listener: TcpListener,
        registry: Arc<SegmentRegistry>,
        secret: Option<Arc<Secret>>,
    ) -> std::io::Result<TransferServer> {
        let guard = Arc::new(Guard { secret, epochs: Mutex::new(HashMap::new()) });
        let addr = listener.local_addr()?;
        let local = match LocalServer::start(addr.port(), registry.clone(), guard.clone()) {
            Ok(l) => Some(l),
            Err(e) => {
                // Peers on this host then go over TCP; nothing else is lost.
                tracing::warn!(error = %e, "no local socket for same-host peers");
                None
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let active = Arc::new(AtomicUsize::new(0));
        let accept = std::thread::Builder::new().name("tycho-xfer-accept".into()).spawn(move || {
            let mut refused = 0u64;
            for conn in listener.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = conn else {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                };
                if active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                    // Logged at the 1st, 2nd, 4th, 8th... refusal: a flood does not flood the log.
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            limit = MAX_CONNECTIONS,
                            refused,
                            "transfer connection limit reached; closing new ones"
                        );
                    }
                    continue;
                }
                active.fetch_add(1, Ordering::AcqRel);
                let registry = registry.clone();
                let stop = stop2.clone();
                let guard = guard.clone();
                let count = active.clone();
                let spawned = std::thread::Builder::new().name("tycho-xfer".into()).spawn(move || {
                    if let Err(e) = serve_connection(stream, &registry, &guard, &stop) {
                        tracing::debug!(error = %e, "transfer connection closed");
                    }
                    count.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    active.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
        Ok(TransferServer { addr, stop, accept: Some(accept), _local: local })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TransferServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Reads and discards `len` bytes, so a refused write leaves the stream in step.
fn drain(stream: &mut TcpStream, mut len: u64) -> std::io::Result<()> {
    let mut sink = [0u8; 64 * 1024];
    while len > 0 {
        let n = len.min(sink.len() as u64) as usize;
        stream.read_exact(&mut sink[..n])?;
        len -= n as u64;
    }
    Ok(())
}

/// What every connection of one server checks requests against.
pub(crate) struct Guard {
    secret: Option<Arc<Secret>>,
    /// Highest group epoch seen on a write capability, per group: a write granted under an
    /// older epoch comes from a master that no longer owns the group.
    epochs: Mutex<HashMap<u16, u64>>,
}

impl Guard {
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
        let rights = if req.op == XferOp::Read { RIGHT_READ } else { RIGHT_WRITE };
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

fn serve_connection(
    mut stream: TcpStream,
    registry: &SegmentRegistry,
    guard: &Guard,
    stop: &AtomicBool,
) -> Result<(), TransferError> {
    stream.set_nodelay(true)?;
    // The greeting must complete within the timeout: a peer that connects and says nothing
    // does not keep this thread.
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    handshake::serve(&mut stream, Service::Transfer, guard.secret.clone())?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    let mut keys = HashMap::new();
    let mut head = [0u8; REQUEST_LEN];
    loop {
        if let Err(e) = stream.read_exact(&mut head) {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                return Ok(());
            }
            return Err(e.into());
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Not this protocol: nothing after it can be trusted, so the connection closes.
        let req = XferRequest::decode(&head)?;
        let seg = registry.get(req.segment);
        let checked = guard.authorize(&req, &mut keys).and_then(|()| match &seg {
            None => Err(ErrorCode::SEGMENT_NOT_FOUND),
            Some(_) if req.len == 0 => Err(ErrorCode::INVALID_PARAMS),
            Some(m) => match req.offset.checked_add(req.len) {
                Some(end) if end <= m.len() as u64 => Ok(m),
                _ => Err(ErrorCode::INVALID_PARAMS),
            },
        });
        let m = match checked {
            Ok(m) => m,
            Err(code) => {
                if req.op == XferOp::Write {
                    drain(&mut stream, req.len)?;
                }
                stream.write_all(&encode_answer(Err(code)))?;
                continue;
            }
        };
        let len = req.len as usize;
        match req.op {
            XferOp::Read => {
                // A range already given to a later allocation (its generation moved on) sends
                // nothing: a grant, bound to the generation it was minted for, reaches only
                // its own object's bytes.
                if let Err(e) = m.verify(req.offset, len, req.incarnation, req.gen) {
                    stream.write_all(&encode_answer(Err(e.code())))?;
                    continue;
                }
                // SAFETY: the range was checked above. A writer may reuse it while the bytes
                // are sent; the trailer below then tells the reader to throw them away.
                let bytes = unsafe { m.slice(req.offset, len)? };
                stream.write_all(&encode_answer(Ok(req.len)))?;
                stream.write_all(bytes)?;
                let verdict = m.verify(req.offset, len, req.incarnation, req.gen).map(|()| req.len);
                stream.write_all(&encode_answer(verdict.map_err(|e| e.code())))?;
            }
            XferOp::Retire => {
                let verdict = m.retire(req.offset, len, req.incarnation, req.gen).map(|()| req.len);
                stream.write_all(&encode_answer(verdict.map_err(|e| e.code())))?;
            }
            XferOp::Write => {
                if let Err(e) = m.stamp(req.offset, len, req.incarnation, req.gen) {
                    // The range belongs to an earlier incarnation: refuse, stay in step.
                    drain(&mut stream, req.len)?;
                    stream.write_all(&encode_answer(Err(e.code())))?;
                    continue;
                }
                // SAFETY: checked range; the master gives it to exactly one writer at a time.
                let dst = unsafe { m.slice_mut(req.offset, len)? };
                stream.read_exact(dst)?;
                stream.write_all(&encode_answer(Ok(req.len)))?;
            }
        }
    }
}
