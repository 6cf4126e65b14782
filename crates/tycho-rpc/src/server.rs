//! The serving side: accept loop and one task per connection.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tycho_proto::auth::handshake::{Peer, Service as Protocol};
use tycho_proto::auth::session::FrameMac;
use tycho_proto::auth::Secret;
use tycho_proto::frame::{
    decode_payload, encode_frame, split_frame, FrameError, FrameHeader, FrameKind, DEFAULT_MAX_REQUEST_FRAME,
    HEADER_LEN,
};

/// A handler's answer: ready now, or a future to be driven off the connection's task.
pub enum Reply<R> {
    /// The response, computed inline.
    Ready(R),
    /// The response will come from this future; it is spawned so that the connection keeps
    /// serving other requests meanwhile.
    Later(Pin<Box<dyn Future<Output = R> + Send + 'static>>),
}

/// What a server does with requests.
pub trait Service: Send + Sync + 'static {
    /// The request message.
    type Request: DeserializeOwned + Send + 'static;
    /// The response message.
    type Response: Serialize + Send + 'static;
    /// Handles one request from the connection's `peer` (what its greeting proved). Must not
    /// block: long work goes into [`Reply::Later`].
    fn call(&self, req: Self::Request, peer: &Peer) -> Reply<Self::Response>;
    /// The response to a request whose frame was valid but whose payload did not decode.
    fn malformed(&self, err: &FrameError) -> Self::Response;
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Largest request frame accepted; a larger one closes the connection.
    pub max_frame: u32,
    /// The cluster secret every connection must prove; `None` serves without authentication
    /// (`--insecure`, and unit tests).
    pub secret: Option<Arc<Secret>>,
    /// Most connections served at once; more are closed as they arrive.
    pub max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig { max_frame: DEFAULT_MAX_REQUEST_FRAME, secret: None, max_connections: DEFAULT_MAX_CONNECTIONS }
    }
}

/// Default [`ServerConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Once a frame has started arriving, the rest of it must arrive within this long, so that a
/// peer cannot hold a connection's buffer with a frame it never finishes.
pub const FRAME_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// On shutdown, how long a connection waits for the answers of requests it already took, so
/// that a master giving up its role tells their callers so instead of dropping them.
pub const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A running server.
pub struct ServerHandle {
    local_addr: SocketAddr,
    stop: watch::Sender<bool>,
    connections: Arc<AtomicU64>,
    /// Told whenever a connection ends.
    ended: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Connections currently open.
    pub fn open_connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Stops accepting and reading requests, and closes every connection once the answers of
    /// the requests it took are written (waiting for them at most [`DRAIN_GRACE`]).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let deadline = tokio::time::Instant::now() + DRAIN_GRACE + std::time::Duration::from_millis(500);
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if self.connections.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return;
            }
        }
    }
}

/// Serves `service` on `listener` until the handle is shut down.
pub fn serve<S: Service>(
    listener: TcpListener,
    service: Arc<S>,
    config: ServerConfig,
) -> std::io::Result<ServerHandle> {
    let local_addr = listener.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);
    let connections = Arc::new(AtomicU64::new(0));
    let open = connections.clone();
    let ended = Arc::new(tokio::sync::Notify::new());
    let notify = ended.clone();
    let task = tokio::spawn(async move {
        let mut stop_rx = stop_rx;
        let mut refused = 0u64;
        loop {
            tokio::select! {
                _ = stop_rx.changed() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        if open.load(Ordering::Relaxed) >= config.max_connections as u64 {
                            // Logged at the 1st, 2nd, 4th... refusal, so that a flood does not flood the log.
                            refused += 1;
                            if refused.is_power_of_two() {
                                tracing::warn!(%peer, limit = config.max_connections, refused, "connection limit reached; closing new connections");
                            }
                            drop(stream);
                            continue;
                        }
                        let svc = service.clone();
                        let cfg = config.clone();
                        let stop = stop_rx.clone();
                        let open = open.clone();
                        let notify = notify.clone();
                        open.fetch_add(1, Ordering::Relaxed);
                        tokio::spawn(async move {
                            // Counts the connection out however its task ends (a panicking
                            // handler included), so that shutdown does not wait for it.
                            struct Open(Arc<AtomicU64>, Arc<tokio::sync::Notify>);
                            impl Drop for Open {
                                fn drop(&mut self) {
                                    self.0.fetch_sub(1, Ordering::AcqRel);
                                    self.1.notify_waiters();
                                }
                            }
                            let _open = Open(open, notify);
                            match serve_connection(stream, svc, cfg, stop).await {
                                Err(ConnError::Handshake(e)) => tracing::info!(%peer, error = %e, "connection refused"),
                                Err(e) => tracing::debug!(%peer, error = %e, "connection closed"),
                                Ok(()) => {}
                            }
                        });
                    }
                    Err(e) => {
                        // Out of file descriptors and similar: keep serving existing
                        // connections, try again shortly.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                },
            }
        }
    });
    Ok(ServerHandle { local_addr, stop, connections, ended, task })
}

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("greeting: {0}")]
    Handshake(#[from] tycho_proto::auth::handshake::HandshakeError),
    #[error(transparent)]
    Frame(#[from] FrameError),
}

async fn serve_connection<S: Service>(
    stream: TcpStream,
    service: Arc<S>,
    config: ServerConfig,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ConnError> {
    stream.set_nodelay(true)?;
    let mut stream = stream;
    let (peer, session) = crate::greet::serve(&mut stream, Protocol::Rpc, config.secret.clone()).await?;
    // With a secret, every frame after the greeting is tagged, each way.
    let (mut seal, mut check): (Option<FrameMac>, Option<FrameMac>) = session.map(|s| (s.send, s.recv)).unzip();
    let (mut rd, mut wr) = stream.into_split();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(u64, S::Response)>();
    let mut rbuf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut wbuf: Vec<u8> = Vec::with_capacity(64 * 1024);
    // When the unfinished frame at the front of `rbuf` began to arrive.
    let mut partial_since: Option<tokio::time::Instant> = None;
    // Requests taken whose answers have not come back from their spawned handlers yet.
    let mut pending = 0usize;
    loop {
        // Handle every whole frame already buffered, then write all their answers at once.
        let mut used = 0;
        while let Some((header, body, n)) = split_frame(&rbuf[used..], config.max_frame)? {
            let head: &[u8; HEADER_LEN] = rbuf[used..used + HEADER_LEN].try_into().expect("header length");
            // A frame that does not check closes the connection before anything acts on it.
            let payload = match &mut check {
                Some(mac) => mac.open(head, body)?,
                None => body,
            };
            used += n;
            if header.kind != FrameKind::Request {
                return Err(FrameError::BadKind(header.kind as u8).into());
            }
            let id = header.request_id;
            let reply = match decode_payload::<S::Request>(payload) {
                Ok(req) => service.call(req, &peer),
                Err(e) => Reply::Ready(service.malformed(&e)),
            };
            match reply {
                Reply::Ready(resp) => respond(&mut wbuf, id, &resp, &mut seal)?,
                Reply::Later(fut) => match poll_once(fut, &done_tx, id) {
                    Some(resp) => respond(&mut wbuf, id, &resp, &mut seal)?,
                    None => pending += 1,
                },
            }
        }
        rbuf.drain(..used);
        // A large frame grew the buffer: once it is handled, the memory goes back, so that an
        // idle connection holds 64 KiB whatever it once sent.
        if rbuf.capacity() > 1 << 20 && rbuf.len() <= 64 * 1024 {
            rbuf.shrink_to(64 * 1024);
        }
        partial_since = match (rbuf.is_empty(), used > 0) {
            (true, _) => None,
            (false, true) => Some(tokio::time::Instant::now()),
            (false, false) => partial_since.or_else(|| Some(tokio::time::Instant::now())),
        };
        while let Ok((id, resp)) = done_rx.try_recv() {
            pending -= 1;
            respond(&mut wbuf, id, &resp, &mut seal)?;
        }
        if !wbuf.is_empty() {
            wr.write_all(&wbuf).await?;
            wbuf.clear();
            if wbuf.capacity() > 1 << 20 {
                wbuf.shrink_to(64 * 1024);
            }
        }
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        // A frame larger than the buffer is read into one allocation of its size (its header
        // passed the frame limit), not grown to it by doubling: what a large frame costs is
        // its size once, given back when it is handled.
        if let Some(Ok(h)) = rbuf.first_chunk::<HEADER_LEN>().map(|head| FrameHeader::decode(head, config.max_frame)) {
            let total = HEADER_LEN + h.len as usize;
            if total > rbuf.capacity() {
                rbuf.reserve_exact(total - rbuf.len());
            }
        }
        tokio::select! {
            biased;
            // First, so that a busy connection cannot starve it.
            _ = stop.changed() => {
                // Read nothing more; answer what was taken, within the grace.
                let grace = tokio::time::Instant::now() + DRAIN_GRACE;
                while pending > 0 {
                    match tokio::time::timeout_at(grace, done_rx.recv()).await {
                        Ok(Some((id, resp))) => {
                            pending -= 1;
                            respond(&mut wbuf, id, &resp, &mut seal)?;
                            if tokio::time::timeout_at(grace, wr.write_all(&wbuf)).await.is_err() {
                                break;
                            }
                            wbuf.clear();
                        }
                        _ => break,
                    }
                }
                return Ok(());
            }
            read = rd.read_buf(&mut rbuf) => {
                if read? == 0 {
                    return Ok(());
                }
            }
            Some((id, resp)) = done_rx.recv() => {
                pending -= 1;
                respond(&mut wbuf, id, &resp, &mut seal)?;
            }
            _ = tokio::time::sleep_until(partial_since.map_or_else(tokio::time::Instant::now, |t| t + FRAME_DEADLINE)), if partial_since.is_some() => {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "a frame did not complete in time").into());
            }
        }
    }
}

/// Appends the answer `resp` to request `id` to `wbuf`, tagged when the connection is.
fn respond<R: serde::Serialize>(
    wbuf: &mut Vec<u8>,
    id: u64,
    resp: &R,
    seal: &mut Option<FrameMac>,
) -> Result<(), FrameError> {
    let start = wbuf.len();
    encode_frame(wbuf, FrameKind::Response, id, resp)?;
    if let Some(mac) = seal {
        mac.seal(wbuf, start)?;
    }
    Ok(())
}

/// Polls a handler future once on the connection's task; if it is not ready, spawns it and
/// has it deliver its response through `done`.
fn poll_once<R: Send + 'static>(
    mut fut: Pin<Box<dyn Future<Output = R> + Send + 'static>>,
    done: &mpsc::UnboundedSender<(u64, R)>,
    id: u64,
) -> Option<R> {
    let mut cx = Context::from_waker(Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(r) => Some(r),
        Poll::Pending => {
            let done = done.clone();
            tokio::spawn(async move {
                let r = fut.await;
                let _ = done.send((id, r));
            });
            None
        }
    }
}
