//! The transfer server: serves reads and writes of ranges inside registered segments.
//!
//! Every connection starts with the greeting of `tycho_proto::auth::handshake`; with a cluster
//! secret, every request must carry the master's capability for the range it touches.
//!
//! One thread per connection with blocking I/O: bulk transfers are few and long, and a thread
//! that owns its socket moves bytes between socket and segment with no hand-offs. At most
//! [`MAX_CONNECTIONS`] authenticated connections (at most [`MAX_CONNECTIONS_PER_CLIENT`] of
//! one client), plus at most [`ServerLimits::max_greeting`] still in their greeting; when the
//! node is full, the connection idle the longest gives way to a new one (`conns.rs`), so idle
//! sockets never lock a peer out.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use tycho_proto::auth::capability::unix_ms;
use tycho_proto::auth::handshake::{self, Service};
use tycho_proto::auth::stream::{StreamSession, STREAM_TAG_LEN};
use tycho_proto::auth::Secret;
use tycho_proto::ErrorCode;

use crate::conns::Conns;
use crate::guard::Guard;
use crate::local::UnixServer;
use crate::wire::{
    decrypt_sealed, encode_answer, push_body, push_head, recv_sealed, request_flags, sealed_head, send_all_more,
    send_flagged, send_sealed, XferOp, XferRequest, FLAG_ENCRYPT, REQUEST_LEN, SMALL_PAYLOAD,
};

/// Most authenticated connections served at once (one thread each). A client engine keeps at
/// most 16 idle connections per peer.
pub const MAX_CONNECTIONS: usize = 256;

/// Most connections one client (by the client id its greeting proved) holds on one node: its
/// pool's 16 idle ones and its parallel transfers, with room to spare.
pub const MAX_CONNECTIONS_PER_CLIENT: usize = 64;

/// Default for how long a connection must have been idle before it gives way to a new one on
/// a full node ([`ServerLimits::evict_after`]).
pub const DEFAULT_EVICT_AFTER: Duration = Duration::from_secs(1);

/// How long a new connection has to complete its whole greeting, however it sends it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Default for how long an authenticated connection may sit between requests before the
/// server closes it ([`ServerLimits::idle_timeout`]).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Most connections still in their greeting at once ([`ServerLimits::max_greeting`]).
pub const DEFAULT_MAX_GREETING: usize = 32;

/// What a transfer server lets its peers hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// A connection whose greeting is not complete this long after it was accepted is closed.
    pub greeting_timeout: Duration,
    /// Connections in their greeting at once; more are closed as they arrive, so that peers
    /// that never prove the secret hold at most this many threads (for at most
    /// `greeting_timeout`) and the rest of [`MAX_CONNECTIONS`] stays for those that do.
    pub max_greeting: usize,
    /// A connection that sends no byte of a next request for this long is closed (clients
    /// keep their idle connections for less and reconnect when one was closed).
    pub idle_timeout: Duration,
    /// On a full node, a connection idle for this long gives way to a new one.
    pub evict_after: Duration,
    /// Refuse reads and writes whose payload is not encrypted (`ENCRYPTION_REQUIRED`) on an
    /// authenticated connection.
    pub encrypted_only: bool,
}

impl Default for ServerLimits {
    fn default() -> ServerLimits {
        ServerLimits {
            greeting_timeout: HANDSHAKE_TIMEOUT,
            max_greeting: DEFAULT_MAX_GREETING,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            evict_after: DEFAULT_EVICT_AFTER,
            encrypted_only: false,
        }
    }
}
use crate::error::TransferError;
use crate::registry::SegmentRegistry;

/// A running transfer server.
pub struct TransferServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
    /// Hands the memfds of registered segments to same-host peers of this user.
    _local: Option<UnixServer>,
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
        Self::serve_with(listener, registry, secret, ServerLimits::default())
    }

    /// [`serve`](Self::serve) under `limits`.
    pub fn serve_with(
        listener: TcpListener,
        registry: Arc<SegmentRegistry>,
        secret: Option<Arc<Secret>>,
        limits: ServerLimits,
    ) -> std::io::Result<TransferServer> {
        let guard = Arc::new(Guard::new(secret));
        let addr = listener.local_addr()?;
        let local = match UnixServer::mappings(addr.port(), registry.clone(), guard.clone()) {
            Ok(l) => Some(l),
            Err(e) => {
                // Peers on this host then go over TCP; nothing else is lost.
                tracing::warn!(error = %e, "no local socket for same-host peers");
                None
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let greeting = Arc::new(AtomicUsize::new(0));
        let conns = Arc::new(Conns::new(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT, limits.evict_after));
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
                if greeting.load(Ordering::Acquire) >= limits.max_greeting {
                    // Logged at the 1st, 2nd, 4th, 8th... refusal: a flood does not flood the log.
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            limit = limits.max_greeting,
                            refused,
                            "too many transfer connections in their greeting; closing new ones"
                        );
                    }
                    continue;
                }
                greeting.fetch_add(1, Ordering::AcqRel);
                let registry = registry.clone();
                let stop = stop2.clone();
                let guard = guard.clone();
                let conns = conns.clone();
                let greeting = Counted(greeting.clone());
                let _ = std::thread::Builder::new().name("tycho-xfer".into()).spawn(move || {
                    let served =
                        Served { registry: &registry, guard: &guard, stop: &stop, limits: &limits, conns: &conns };
                    if let Err(e) = serve_connection(stream, &served, greeting) {
                        tracing::debug!(error = %e, "transfer connection closed");
                    }
                });
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

/// Reads and discards `len` bytes (and their tag, which must check), so a refused write leaves
/// the stream in step.
fn drain(stream: &mut TcpStream, mut len: u64, keys: Option<&mut StreamSession>) -> Result<(), TransferError> {
    let mut sealer = keys.map(|k| k.recv.begin(&[]));
    let mut sink = [0u8; 64 * 1024];
    while len > 0 {
        let n = len.min(sink.len() as u64) as usize;
        match stream.read(&mut sink[..n]) {
            Ok(0) => return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into()),
            Ok(got) => {
                len -= got as u64;
                if let Some(s) = sealer.as_mut() {
                    s.absorb(&sink[..got]);
                }
            }
            Err(e) if waited(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(mut s) = sealer {
        let mut tag = [0u8; STREAM_TAG_LEN];
        read_fully(stream, &mut tag)?;
        if !s.check(&tag) {
            return Err(TransferError::BadTag("a refused write's bytes"));
        }
    }
    Ok(())
}

/// `read_exact` through the connection's short receive timeouts.
fn read_fully(stream: &mut TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match stream.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if waited(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether `e` only says that a socket timeout elapsed (or a signal came) before anything moved.
fn waited(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    matches!(e.kind(), WouldBlock | TimedOut | Interrupted)
}

/// The socket timeouts of one connection, kept short enough that no send or receive that
/// starts before a transfer's deadline moves a byte after it.
///
/// A transfer under a capability must end by the capability's deadline: after it the master
/// may give the range to another tenant, and a peer that reads (or writes) slowly on purpose
/// would otherwise keep moving bytes of the next object. Each send or receive call starts only
/// before the deadline, with a socket timeout no longer than the time left, so it returns by
/// the deadline; the transfer is then cut off and the connection closed. Timeouts are set with
/// room to spare (half the time left) so that most calls need no extra system call.
struct Cutoff {
    send: Option<Duration>,
    recv: Option<Duration>,
    /// How long a receive without a deadline may go without a byte.
    idle: Duration,
}

/// The receive timeout a connection waits for its next request in: each one that passes
/// checks whether the server stops and how long the connection has been idle.
const IDLE_POLL: Duration = Duration::from_secs(1);

/// Shortest socket timeout left in place while a connection waits for its next request: a
/// shorter one, left by a transfer near its deadline, is replaced first.
const IDLE_TIMEOUT_FLOOR: Duration = Duration::from_millis(500);

impl Cutoff {
    /// Replaces timeouts shorter than [`IDLE_TIMEOUT_FLOOR`] before the connection waits for
    /// its next request (a system call only after a transfer that ran close to its deadline).
    fn relax(&mut self, stream: &TcpStream) -> std::io::Result<()> {
        if self.send.is_some_and(|t| t < IDLE_TIMEOUT_FLOOR) {
            stream.set_write_timeout(None)?;
            self.send = None;
        }
        if self.recv.is_none_or(|t| t < IDLE_TIMEOUT_FLOOR) {
            stream.set_read_timeout(Some(IDLE_POLL))?;
            self.recv = Some(IDLE_POLL);
        }
        Ok(())
    }

    /// Makes `timeout` (the connection's send or receive timeout, set by `set`) end no later
    /// than `deadline` for a call starting now; an error once the deadline has passed.
    fn arm(
        timeout: &mut Option<std::time::Duration>,
        deadline: u64,
        set: impl FnOnce(Option<std::time::Duration>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let now = unix_ms();
        if now >= deadline {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the capability's deadline passed"));
        }
        let left = deadline - now;
        let fits = timeout.is_some_and(|t| {
            let t = t.as_millis() as u64;
            t <= left && t.saturating_mul(4) >= left
        });
        if !fits {
            let t = std::time::Duration::from_millis((left / 2).max(1));
            set(Some(t))?;
            *timeout = Some(t);
        }
        Ok(())
    }

    /// Sends all of `buf` as a part of an answer that goes on ([`send_more`]), each call armed
    /// against `deadline` (none: no limit).
    fn send(&mut self, stream: &mut TcpStream, buf: &[u8], deadline: Option<u64>) -> std::io::Result<()> {
        self.send_with(stream, buf, deadline, true)
    }

    /// [`send`](Self::send) for the end of an answer (`more` false: the kernel sends at once).
    fn send_with(
        &mut self,
        stream: &mut TcpStream,
        mut buf: &[u8],
        deadline: Option<u64>,
        more: bool,
    ) -> std::io::Result<()> {
        while !buf.is_empty() {
            if let Some(deadline) = deadline {
                Self::arm(&mut self.send, deadline, |t| stream.set_write_timeout(t))?;
            }
            match send_flagged(stream, buf, more) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if waited(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Fills `buf`, each call armed against `deadline` (none: only a peer that sends nothing
    /// for the idle timeout is cut off).
    fn recv(&mut self, stream: &mut TcpStream, mut buf: &mut [u8], deadline: Option<u64>) -> std::io::Result<()> {
        let mut moved = Instant::now();
        while !buf.is_empty() {
            match deadline {
                Some(deadline) => Self::arm(&mut self.recv, deadline, |t| stream.set_read_timeout(t))?,
                None if moved.elapsed() >= self.idle => {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the peer stopped sending"));
                }
                None => {
                    if self.recv.is_none() {
                        stream.set_read_timeout(Some(IDLE_POLL))?;
                        self.recv = Some(IDLE_POLL);
                    }
                }
            }
            match stream.read(buf) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    moved = Instant::now();
                }
                Err(e) if waited(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Reads the next request's header (and its tag, on an authenticated connection) into `head`.
/// `Ok(false)` when the peer closed the connection between requests, when the server stops, or
/// when no byte of a request came for `idle` (the peer keeps an idle connection for less, and
/// opens a new one when this one was closed). A peer that stops halfway through a header for
/// `idle` is cut off.
fn read_head(stream: &mut TcpStream, head: &mut [u8], stop: &AtomicBool, idle: Duration) -> std::io::Result<bool> {
    let mut got = 0;
    let mut moved = Instant::now();
    while got < head.len() {
        match stream.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                moved = Instant::now();
            }
            Err(e) if waited(&e) => {
                if stop.load(Ordering::Relaxed) {
                    return Ok(false);
                }
                if moved.elapsed() >= idle {
                    if got == 0 {
                        return Ok(false);
                    }
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "a request header stalled"));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// One in a shared count while it lives.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A stream whose reads and writes all end by one instant: a peer that trickles its greeting a
/// byte at a time cannot stretch it past the deadline, as a timeout per read would let it.
struct ByDeadline<'a> {
    stream: &'a TcpStream,
    end: Instant,
}

impl ByDeadline<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the greeting did not complete in time"));
        }
        Ok(left)
    }
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for ByDeadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What every connection of one server shares.
struct Served<'a> {
    registry: &'a SegmentRegistry,
    guard: &'a Guard,
    stop: &'a AtomicBool,
    limits: &'a ServerLimits,
    conns: &'a Conns,
}

/// A connection's place in the table, given back when it ends.
struct Admitted<'a> {
    conns: &'a Conns,
    id: u64,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.conns.leave(self.id);
    }
}

fn serve_connection(stream: TcpStream, served: &Served<'_>, greeting: Counted) -> Result<(), TransferError> {
    stream.set_nodelay(true)?;
    // The whole greeting must complete by its deadline: a peer that connects and says nothing,
    // or says it slowly, does not keep this thread.
    let end = Instant::now() + served.limits.greeting_timeout;
    let secret = served.guard.secret().cloned();
    let (peer, keys) = handshake::serve_stream(&mut ByDeadline { stream: &stream, end }, Service::Transfer, secret)?;
    drop(greeting);
    let id = match served.conns.admit(&stream, peer.client.as_ref().map(|(id, _)| *id)) {
        Ok(id) => id,
        Err(why) => {
            tracing::debug!(?why, "transfer connection refused after its greeting");
            return Ok(());
        }
    };
    let admitted = Admitted { conns: served.conns, id };
    serve_requests(stream, served, keys, &admitted)
}

fn serve_requests(
    mut stream: TcpStream,
    served: &Served<'_>,
    mut keys: Option<StreamSession>,
    admitted: &Admitted<'_>,
) -> Result<(), TransferError> {
    let Served { registry, guard, stop, limits, conns } = *served;
    // Between requests the connection waits in short timeouts, so that it sees the server stop
    // and notices when it has been idle too long.
    stream.set_read_timeout(Some(IDLE_POLL))?;
    stream.set_write_timeout(None)?;
    let mut seg_keys = HashMap::new();
    let mut buf = [0u8; REQUEST_LEN + STREAM_TAG_LEN];
    let sealed = if keys.is_some() { STREAM_TAG_LEN } else { 0 };
    let mut scratch = Vec::new();
    let mut cutoff = Cutoff { send: None, recv: Some(IDLE_POLL), idle: limits.idle_timeout };
    loop {
        cutoff.relax(&stream)?;
        if !conns.set_idle(admitted.id, true) {
            return Ok(());
        }
        if !read_head(&mut stream, &mut buf[..REQUEST_LEN + sealed], stop, limits.idle_timeout)? {
            return Ok(());
        }
        // Closed to make room while it waited: its client sends the request again elsewhere.
        if stop.load(Ordering::Relaxed) || !conns.set_idle(admitted.id, false) {
            return Ok(());
        }
        let head: [u8; REQUEST_LEN] = buf[..REQUEST_LEN].try_into().expect("a request header");
        if let Some(k) = keys.as_mut() {
            // Injected, replayed, reordered or altered: nothing after it can be trusted.
            if !k.recv.open_head(&head, &buf[REQUEST_LEN..REQUEST_LEN + STREAM_TAG_LEN]) {
                return Err(TransferError::BadTag("a request header"));
            }
        }
        // Not this protocol: nothing after it can be trusted, so the connection closes.
        let req = XferRequest::decode(&head)?;
        let encrypt = request_flags(&head) & FLAG_ENCRYPT != 0;
        let seg = registry.get(req.segment);
        let checked = guard.authorize(&req, &mut seg_keys).and_then(|()| match &seg {
            None => Err(ErrorCode::SEGMENT_NOT_FOUND),
            Some(_) if req.len == 0 => Err(ErrorCode::INVALID_PARAMS),
            // Encryption needs the connection's keys; a node that insists on it refuses the rest.
            Some(_) if encrypt && keys.is_none() => Err(ErrorCode::INVALID_PARAMS),
            Some(_) if limits.encrypted_only && !encrypt && keys.is_some() && req.op != XferOp::Retire => {
                Err(ErrorCode::ENCRYPTION_REQUIRED)
            }
            Some(m) => match req.offset.checked_add(req.len) {
                Some(end) if end <= m.len() as u64 => Ok(m),
                _ => Err(ErrorCode::INVALID_PARAMS),
            },
        });
        let m = match checked {
            Ok(m) => m,
            Err(code) => {
                if req.op == XferOp::Write {
                    drain(&mut stream, req.len, keys.as_mut())?;
                }
                answer(&mut stream, keys.as_mut(), Err(code))?;
                continue;
            }
        };
        let len = req.len as usize;
        // With a secret, the bytes move before the capability's deadline or not at all.
        let deadline = guard.secret().map(|_| req.cap.deadline_ms());
        match req.op {
            XferOp::Read => {
                // A range already given to a later allocation (its generation moved on) sends
                // nothing: a grant, bound to the generation it was minted for, reaches only
                // its own object's bytes.
                if let Err(e) = m.verify(req.offset, len, req.incarnation, req.gen) {
                    answer(&mut stream, keys.as_mut(), Err(e.code()))?;
                    continue;
                }
                registry.pace_read(req.len);
                // SAFETY: the range was checked above. A writer may reuse it while the bytes
                // are sent; the trailer below then tells the reader to throw them away.
                let bytes = unsafe { m.slice(req.offset, len)? };
                let head = encode_answer(Ok(req.len));
                let mut sealer = keys.as_mut().map(|k| k.send.begin(&head));
                if len <= SMALL_PAYLOAD {
                    // One buffer and one call: the answer, a copy of the bytes (so the bytes
                    // hashed are the bytes sent), their tag, the trailer and its tag.
                    scratch.clear();
                    scratch.extend_from_slice(&head);
                    push_body(&mut scratch, bytes, sealer.as_mut(), encrypt);
                    let verdict = m.verify(req.offset, len, req.incarnation, req.gen).map(|()| req.len);
                    if verdict.is_ok() {
                        registry.note_served();
                    }
                    let trailer = encode_answer(verdict.map_err(|e| e.code()));
                    push_head(&mut scratch, &trailer, keys.as_mut().map(|k| &mut k.send));
                    cutoff.send_with(&mut stream, &scratch, deadline, false)?;
                    continue;
                }
                // Head and bytes (and tag) go with MSG_MORE, the trailer ends the answer.
                send_all_more(&stream, &head)?;
                match sealer.as_mut() {
                    None => cutoff.send(&mut stream, bytes, deadline)?,
                    Some(sealer) => {
                        send_sealed(bytes, sealer, encrypt, &mut scratch, |piece| {
                            cutoff.send(&mut stream, piece, deadline)
                        })?;
                        cutoff.send(&mut stream, &sealer.finish(), deadline)?;
                    }
                }
                let verdict = m.verify(req.offset, len, req.incarnation, req.gen).map(|()| req.len);
                if verdict.is_ok() {
                    registry.note_served();
                }
                answer(&mut stream, keys.as_mut(), verdict.map_err(|e| e.code()))?;
            }
            XferOp::Retire => {
                let verdict = m.retire(req.offset, len, req.incarnation, req.gen).map(|()| req.len);
                answer(&mut stream, keys.as_mut(), verdict.map_err(|e| e.code()))?;
            }
            XferOp::Write => {
                if let Err(e) = m.stamp(req.offset, len, req.incarnation, req.gen) {
                    // The range belongs to an earlier incarnation: refuse, stay in step.
                    drain(&mut stream, req.len, keys.as_mut())?;
                    answer(&mut stream, keys.as_mut(), Err(e.code()))?;
                    continue;
                }
                registry.pace_write(req.len);
                // SAFETY: checked range; the master gives it to exactly one writer at a time.
                let dst = unsafe { m.slice_mut(req.offset, len)? };
                match keys.as_mut() {
                    None => cutoff.recv(&mut stream, dst, deadline)?,
                    Some(k) => {
                        let mut sealer = k.recv.begin(&[]);
                        recv_sealed(dst, &mut sealer, |piece| cutoff.recv(&mut stream, piece, deadline))?;
                        let mut tag = [0u8; STREAM_TAG_LEN];
                        cutoff.recv(&mut stream, &mut tag, deadline)?;
                        // Altered bytes stay unanswered: the writer's put fails, and the master
                        // never commits (or serves) what this range now holds.
                        if !sealer.check(&tag) {
                            return Err(TransferError::BadTag("a write's bytes"));
                        }
                        if encrypt {
                            decrypt_sealed(dst, &mut sealer);
                        }
                    }
                }
                answer(&mut stream, keys.as_mut(), Ok(req.len))?;
            }
        }
    }
}

/// Sends an answer (or a read's trailer), sealed on an authenticated connection.
fn answer(
    stream: &mut TcpStream,
    keys: Option<&mut StreamSession>,
    status: Result<u64, ErrorCode>,
) -> std::io::Result<()> {
    let (msg, n) = sealed_head(&encode_answer(status), keys.map(|k| &mut k.send));
    stream.write_all(&msg[..n])
}
