//! A blocking caller for threads that are not async: the call is written and its answer read
//! on the caller's own thread, with no hand-off to another thread. On a small VM every
//! cross-thread wake-up costs tens of microseconds, which is the whole budget of a metadata
//! call. Each call takes an idle connection from the pool (or opens one), so concurrent
//! callers use separate connections.
//!
//! Sockets are non-blocking. After sending, the caller polls for the answer for a short,
//! bounded time ([`ClientConfig::spin`]), yielding the CPU between attempts, before it sleeps
//! in `poll(2)`: a metadata answer usually arrives within that time, and a caller that never
//! went to sleep needs no wake-up. Yielding lets a server that shares the caller's CPU run.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tycho_proto::auth::handshake::{self, Service};
use tycho_proto::auth::session::Session;
use tycho_proto::auth::ResolvedAuth;
use tycho_proto::frame::{decode_payload, encode_frame, FrameHeader, FrameKind, HEADER_LEN};

use crate::{ClientConfig, RpcError};

/// Most idle connections kept per pool.
const MAX_IDLE: usize = 64;

/// Largest read or write buffer a pooled connection keeps between calls.
const KEEP_BUFFER: usize = 1 << 20;

/// A pool of blocking connections to one server.
pub struct BlockingClient {
    addr: String,
    config: ClientConfig,
    idle: Mutex<Vec<Conn>>,
    authenticated: std::sync::atomic::AtomicBool,
    /// How the first successful greeting went; later connections authenticate the same way,
    /// so that a secret file changing underneath does not split one client's connections.
    settled: Mutex<Option<ResolvedAuth>>,
}

struct Conn {
    stream: TcpStream,
    /// The keys that tag this connection's frames (with a secret).
    session: Option<Session>,
    next_id: u64,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
}

impl BlockingClient {
    /// A pool for `addr`; connections open lazily.
    pub fn new(addr: &str, config: ClientConfig) -> BlockingClient {
        BlockingClient {
            addr: addr.to_string(),
            config,
            idle: Mutex::new(Vec::new()),
            authenticated: std::sync::atomic::AtomicBool::new(false),
            settled: Mutex::new(None),
        }
    }

    /// The server address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Opens a connection now, to report an unreachable server early.
    pub fn check(&self) -> Result<(), RpcError> {
        let c = self.connect()?;
        self.idle.lock().push(c);
        Ok(())
    }

    /// Whether the last connection opened proved the cluster secret both ways (false against
    /// a server that runs without authentication).
    pub fn authenticated(&self) -> bool {
        self.authenticated.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The cluster secret this client's connections prove, once one has connected (`None`
    /// against a server that runs without authentication).
    pub fn secret(&self) -> Option<std::sync::Arc<tycho_proto::auth::Secret>> {
        self.settled.lock().as_ref().and_then(|a| a.secret.clone())
    }

    /// The settings connections are opened with.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Drops every idle connection (after the server restarted, for example).
    pub fn reset(&self) {
        self.idle.lock().clear();
    }

    fn connect(&self) -> Result<Conn, RpcError> {
        self.connect_within(self.config.connect_timeout)
    }

    /// Opens a connection whose TCP connect and greeting each take at most `limit`.
    fn connect_within(&self, limit: Duration) -> Result<Conn, RpcError> {
        let err = |source| RpcError::Connect { addr: self.addr.clone(), source };
        let addr = self
            .addr
            .to_socket_addrs()
            .map_err(err)?
            .next()
            .ok_or_else(|| err(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))?;
        let settled = self.settled.lock().clone();
        let auth = match settled {
            Some(a) => a,
            None => self.config.resolve(&self.addr)?,
        };
        let mut stream = TcpStream::connect_timeout(&addr, limit).map_err(err)?;
        stream.set_nodelay(true).map_err(err)?;
        // The greeting runs blocking, bounded by the same limit (a stopped process's kernel
        // still accepts connections: the greeting is where it goes silent).
        stream.set_read_timeout(Some(limit)).map_err(err)?;
        stream.set_write_timeout(Some(limit)).map_err(err)?;
        let session = handshake::connect_session(&mut stream, Service::Rpc, &auth, self.config.identity.as_ref())
            .map_err(|source| RpcError::Handshake { addr: self.addr.clone(), source })?;
        let authenticated = session.is_some();
        self.authenticated.store(authenticated, std::sync::atomic::Ordering::Relaxed);
        // Later connections prove the same secret (or none, where none was found).
        self.settled.lock().get_or_insert(auth);
        stream.set_read_timeout(None).map_err(err)?;
        stream.set_write_timeout(None).map_err(err)?;
        stream.set_nonblocking(true).map_err(err)?;
        Ok(Conn { stream, session, next_id: 1, rbuf: Vec::with_capacity(4096), wbuf: Vec::with_capacity(4096) })
    }

    /// Sends `req` and waits up to `deadline` for the answer.
    pub fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        req: &Req,
        deadline: Duration,
    ) -> Result<Resp, RpcError> {
        self.call_within(req, deadline, deadline)
    }

    /// Sends `req`; the server has `first_byte` (at most `deadline`) to start answering (a
    /// new connection's connect and greeting get the same, at most the connect timeout), and
    /// the whole answer must be in within `deadline`. A server that is stopped or hung is so
    /// found out after `first_byte`, while an answer that is merely long keeps its time.
    pub fn call_within<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        req: &Req,
        first_byte: Duration,
        deadline: Duration,
    ) -> Result<Resp, RpcError> {
        let first_byte = first_byte.min(deadline);
        let idle = self.idle.lock().pop();
        let mut conn = match idle {
            Some(c) => c,
            None => self.connect_within(self.config.connect_timeout.min(first_byte))?,
        };
        match self.exchange(&mut conn, req, first_byte, deadline) {
            Ok(resp) => {
                let mut idle = self.idle.lock();
                if idle.len() < MAX_IDLE {
                    idle.push(conn);
                }
                Ok(resp)
            }
            // The connection is in an unknown state: drop it.
            Err(e) => Err(e),
        }
    }

    fn exchange<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        conn: &mut Conn,
        req: &Req,
        first_byte: Duration,
        deadline: Duration,
    ) -> Result<Resp, RpcError> {
        let mut waited = first_byte;
        let io = |waited: Duration| {
            move |e: std::io::Error| {
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                    RpcError::Timeout(waited)
                } else {
                    RpcError::Closed(e.to_string())
                }
            }
        };
        let id = conn.next_id;
        conn.next_id += 1;
        conn.wbuf.clear();
        encode_frame(&mut conn.wbuf, FrameKind::Request, id, req)?;
        if let Some(s) = &mut conn.session {
            s.send.seal(&mut conn.wbuf, 0)?;
        }
        let whole_end = Instant::now() + deadline;
        write_until(&mut conn.stream, &conn.wbuf, whole_end).map_err(io(deadline))?;
        // From the request sent to the answer's first byte, the shorter deadline.
        let mut end = (Instant::now() + first_byte).min(whole_end);
        // The answer is read in as few reads as it arrived in: up to the buffer's size until the
        // header says where the frame ends, then exactly to that end. The server sends one
        // frame per call, so bytes past the frame mean a broken peer.
        if conn.rbuf.len() < 4096 {
            conn.rbuf.resize(4096, 0);
        }
        let spin_until = (Instant::now() + self.config.spin).min(end);
        let mut filled = 0;
        let mut header: Option<FrameHeader> = None;
        let header = loop {
            let limit = match header {
                Some(h) => HEADER_LEN + h.len as usize,
                None => conn.rbuf.len(),
            };
            if let Some(h) = header.filter(|_| filled >= limit) {
                if filled > limit {
                    return Err(RpcError::Closed(format!("{} bytes after the answer", filled - limit)));
                }
                break h;
            }
            if conn.rbuf.len() < limit {
                conn.rbuf.resize(limit, 0);
            }
            filled +=
                read_some(&mut conn.stream, &mut conn.rbuf[filled..limit], spin_until, end).map_err(io(waited))?;
            if end != whole_end {
                end = whole_end;
                waited = deadline;
            }
            if header.is_none() && filled >= HEADER_LEN {
                let head: &[u8; HEADER_LEN] = conn.rbuf[..HEADER_LEN].try_into().expect("header length");
                header = Some(FrameHeader::decode(head, self.config.max_frame)?);
            }
        };
        let head: &[u8; HEADER_LEN] = conn.rbuf[..HEADER_LEN].try_into().expect("header length");
        let body = &conn.rbuf[HEADER_LEN..HEADER_LEN + header.len as usize];
        // A frame that does not check ends the connection (the caller drops it on an error).
        let payload = match &mut conn.session {
            Some(s) => s.recv.open(head, body)?,
            None => body,
        };
        // One call at a time per connection, and a connection whose call failed is dropped,
        // so the next frame must be this call's answer.
        if header.kind != FrameKind::Response || header.request_id != id {
            return Err(RpcError::Closed(format!("unexpected frame id {} (wanted {id})", header.request_id)));
        }
        let resp = decode_payload(payload);
        // A pooled connection keeps its buffers; do not let one large answer (a key listing)
        // pin its size for the connection's life.
        if conn.rbuf.len() > KEEP_BUFFER {
            conn.rbuf = Vec::new();
        }
        if conn.wbuf.capacity() > KEEP_BUFFER {
            conn.wbuf = Vec::new();
        }
        Ok(resp?)
    }
}

/// Reads what is available into `buf` (at least one byte), polling without sleeping until
/// `spin_until` and then sleeping in `poll(2)` until `end`.
fn read_some(stream: &mut TcpStream, buf: &mut [u8], spin_until: Instant, end: Instant) -> std::io::Result<usize> {
    loop {
        match stream.read(buf) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() < spin_until {
                    std::thread::yield_now();
                } else {
                    wait_ready(stream, libc::POLLIN, end)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Writes all of `buf`, waiting for room in the socket buffer until `end`.
fn write_until(stream: &mut TcpStream, mut buf: &[u8], end: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        match stream.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => wait_ready(stream, libc::POLLOUT, end)?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Sleeps until the socket is ready for `events` or `end` passes (then `TimedOut`).
fn wait_ready(stream: &TcpStream, events: libc::c_short, end: Instant) -> std::io::Result<()> {
    let left = end.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(ErrorKind::TimedOut.into());
    }
    // Round up so that a sub-millisecond remainder still waits rather than spinning.
    let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    let mut fd = libc::pollfd { fd: stream.as_raw_fd(), events, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    let rc = unsafe { libc::poll(&mut fd, 1, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == ErrorKind::Interrupted { Ok(()) } else { Err(e) };
    }
    // Readiness, a timeout (the next read or write says WouldBlock again and the deadline
    // check above ends the call) or an error condition (the next read or write reports it).
    Ok(())
}
