//! A blocking caller for threads that are not async: the call is written and its answer read
//! on the caller's own thread, with no hand-off to another thread. On a small VM every
//! cross-thread wake-up costs tens of microseconds, which is the whole budget of a metadata
//! call. Each call takes an idle connection from the pool (or opens one), so concurrent
//! callers use separate connections.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tycho_proto::frame::{decode_payload, encode_frame, FrameHeader, FrameKind, HEADER_LEN};

use crate::{ClientConfig, RpcError};

/// Most idle connections kept per pool.
const MAX_IDLE: usize = 64;

/// A pool of blocking connections to one server.
pub struct BlockingClient {
    addr: String,
    config: ClientConfig,
    idle: Mutex<Vec<Conn>>,
}

struct Conn {
    stream: TcpStream,
    next_id: u64,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
}

impl BlockingClient {
    /// A pool for `addr`; connections open lazily.
    pub fn new(addr: &str, config: ClientConfig) -> BlockingClient {
        BlockingClient { addr: addr.to_string(), config, idle: Mutex::new(Vec::new()) }
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

    /// Drops every idle connection (after the server restarted, for example).
    pub fn reset(&self) {
        self.idle.lock().clear();
    }

    fn connect(&self) -> Result<Conn, RpcError> {
        let err = |source| RpcError::Connect { addr: self.addr.clone(), source };
        let addr = self
            .addr
            .to_socket_addrs()
            .map_err(err)?
            .next()
            .ok_or_else(|| err(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))?;
        let stream = TcpStream::connect_timeout(&addr, self.config.connect_timeout).map_err(err)?;
        stream.set_nodelay(true).map_err(err)?;
        Ok(Conn { stream, next_id: 1, rbuf: Vec::with_capacity(4096), wbuf: Vec::with_capacity(4096) })
    }

    /// Sends `req` and waits up to `deadline` for the answer.
    pub fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        req: &Req,
        deadline: Duration,
    ) -> Result<Resp, RpcError> {
        let idle = self.idle.lock().pop();
        let mut conn = match idle {
            Some(c) => c,
            None => self.connect()?,
        };
        match self.exchange(&mut conn, req, deadline) {
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
        deadline: Duration,
    ) -> Result<Resp, RpcError> {
        let io = |e: std::io::Error| {
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                RpcError::Timeout(deadline)
            } else {
                RpcError::Closed(e.to_string())
            }
        };
        let id = conn.next_id;
        conn.next_id += 1;
        conn.wbuf.clear();
        encode_frame(&mut conn.wbuf, FrameKind::Request, id, req)?;
        let end = Instant::now() + deadline;
        conn.stream.set_write_timeout(Some(deadline)).map_err(io)?;
        conn.stream.write_all(&conn.wbuf).map_err(io)?;
        let mut head = [0u8; HEADER_LEN];
        read_until(&mut conn.stream, &mut head, end).map_err(io)?;
        let header = FrameHeader::decode(&head, self.config.max_frame)?;
        conn.rbuf.resize(header.len as usize, 0);
        read_until(&mut conn.stream, &mut conn.rbuf, end).map_err(io)?;
        // One call at a time per connection, and a connection whose call failed is dropped,
        // so the next frame must be this call's answer.
        if header.kind != FrameKind::Response || header.request_id != id {
            return Err(RpcError::Closed(format!("unexpected frame id {} (wanted {id})", header.request_id)));
        }
        Ok(decode_payload(&conn.rbuf)?)
    }
}

fn read_until(stream: &mut TcpStream, buf: &mut [u8], end: Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
