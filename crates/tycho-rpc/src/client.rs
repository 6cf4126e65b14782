//! The calling side of one connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tycho_proto::auth::handshake::{admin_credential, Identity, Service};
use tycho_proto::auth::session::FrameMac;
use tycho_proto::auth::{ClientAuth, ResolvedAuth};
use tycho_proto::frame::{decode_payload, encode_frame, split_frame, FrameKind, DEFAULT_MAX_FRAME, HEADER_LEN};

use crate::RpcError;

/// Settings of a client connection.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Largest response frame accepted.
    pub max_frame: u32,
    /// Deadline for establishing the connection.
    pub connect_timeout: Duration,
    /// How long a [`BlockingClient`](crate::BlockingClient) caller polls for an answer,
    /// yielding between attempts, before it sleeps until the answer arrives. Zero sleeps at once.
    pub spin: Duration,
    /// How connections prove the cluster secret (by default: found as
    /// [`ClientAuth::Discover`] describes).
    pub auth: ClientAuth,
    /// The client identity every connection proves, once the master has issued one.
    pub identity: Option<Identity>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            max_frame: DEFAULT_MAX_FRAME,
            connect_timeout: Duration::from_secs(3),
            spin: DEFAULT_SPIN,
            auth: ClientAuth::Discover,
            identity: None,
        }
    }
}

impl ClientConfig {
    /// Settings of an operator's tool (the `tycho` admin commands, benchmarks) for the server at
    /// `addr`: the secret found as [`ClientAuth::Discover`] finds it, proving the admin
    /// credential derived from it, which may act across tenants and for any client.
    pub fn admin(addr: &str) -> Result<ClientConfig, RpcError> {
        let found = ClientConfig::default().resolve(addr)?;
        let identity = found.secret.as_ref().map(|s| Identity::Admin { credential: admin_credential(s) });
        Ok(ClientConfig { identity, ..ClientConfig::default() })
    }

    /// Resolves the secret for `addr`; an unusable secret file is a connect error.
    pub(crate) fn resolve(&self, addr: &str) -> Result<ResolvedAuth, RpcError> {
        self.auth
            .resolve(addr)
            .map_err(|e| RpcError::Connect { addr: addr.to_string(), source: std::io::Error::other(e) })
    }
}

/// Default [`ClientConfig::spin`]: about one loopback round trip between two CPUs of a small
/// VM, so that most metadata answers are picked up without a wake-up.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

type Waiter = oneshot::Sender<Result<Vec<u8>, RpcError>>;

struct Shared {
    /// The write half, and the key that tags what it sends (with a secret).
    writer: tokio::sync::Mutex<(OwnedWriteHalf, Option<FrameMac>)>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    peer: SocketAddr,
}

impl Shared {
    fn fail_all(&self, why: &str) {
        self.closed.store(true, Ordering::Release);
        let waiters: Vec<_> = self.pending.lock().drain().map(|(_, w)| w).collect();
        for w in waiters {
            let _ = w.send(Err(RpcError::Closed(why.to_string())));
        }
    }
}

/// A connection to one server. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct RpcClient {
    shared: Arc<Shared>,
    _reader: Arc<ReaderTask>,
}

struct ReaderTask(tokio::task::JoinHandle<()>);

impl Drop for ReaderTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Marks the connection dead if a frame write is abandoned half-way (the caller's future was
/// dropped), since the byte stream can no longer be parsed by the peer.
struct WriteGuard<'a> {
    shared: &'a Shared,
    done: bool,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.shared.fail_all("a request write was interrupted");
        }
    }
}

impl RpcClient {
    /// Opens a connection to `addr`.
    pub async fn connect(addr: &str, config: &ClientConfig) -> Result<RpcClient, RpcError> {
        let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| RpcError::Connect {
                addr: addr.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
            })?
            .map_err(|source| RpcError::Connect { addr: addr.to_string(), source })?;
        stream.set_nodelay(true).map_err(|source| RpcError::Connect { addr: addr.to_string(), source })?;
        let peer = stream.peer_addr().map_err(|source| RpcError::Connect { addr: addr.to_string(), source })?;
        let auth = config.resolve(addr)?;
        let mut stream = stream;
        let session =
            crate::greet::connect(&mut stream, Service::Rpc, &auth, config.identity.as_ref(), config.connect_timeout)
                .await
                .map_err(|source| RpcError::Handshake { addr: addr.to_string(), source })?;
        let (seal, check) = session.map(|s| (s.send, s.recv)).unzip();
        let (rd, wr) = stream.into_split();
        let shared = Arc::new(Shared {
            writer: tokio::sync::Mutex::new((wr, seal)),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            peer,
        });
        let reader = tokio::spawn(read_responses(rd, shared.clone(), config.max_frame, check));
        Ok(RpcClient { shared, _reader: Arc::new(ReaderTask(reader)) })
    }

    /// The server's address.
    pub fn peer(&self) -> SocketAddr {
        self.shared.peer
    }

    /// Whether the connection has failed; a closed client fails every call.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// Sends `req` and waits up to `deadline` for the response.
    pub async fn call<Req, Resp>(&self, req: &Req, deadline: Duration) -> Result<Resp, RpcError>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
    {
        let payload = self.call_raw(req, deadline).await?;
        Ok(decode_payload(&payload)?)
    }

    async fn call_raw<Req: Serialize>(&self, req: &Req, deadline: Duration) -> Result<Vec<u8>, RpcError> {
        if self.is_closed() {
            return Err(RpcError::Closed("connection is closed".into()));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let mut frame = Vec::with_capacity(128);
        encode_frame(&mut frame, FrameKind::Request, id, req)?;
        let (tx, rx) = oneshot::channel();
        self.shared.pending.lock().insert(id, tx);
        let shared = &*self.shared;
        let exchange = async move {
            {
                let mut w = shared.writer.lock().await;
                let (w, seal) = &mut *w;
                // Tagged under the lock: frames go out in the order of their sequence numbers.
                let mut frame = frame;
                if let Some(mac) = seal {
                    mac.seal(&mut frame, 0)?;
                }
                let mut guard = WriteGuard { shared, done: false };
                let res = w.write_all(&frame).await;
                guard.done = true;
                if let Err(e) = res {
                    shared.fail_all(&e.to_string());
                }
            }
            match rx.await {
                Ok(r) => r,
                Err(_) => Err(RpcError::Closed("connection reader stopped".into())),
            }
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(r) => r,
            Err(_) => {
                self.shared.pending.lock().remove(&id);
                Err(RpcError::Timeout(deadline))
            }
        }
    }
}

async fn read_responses(mut rd: OwnedReadHalf, shared: Arc<Shared>, max_frame: u32, mut check: Option<FrameMac>) {
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let why = loop {
        let mut used = 0;
        loop {
            match split_frame(&buf[used..], max_frame) {
                Ok(Some((header, body, n))) => {
                    let head: &[u8; HEADER_LEN] = buf[used..used + HEADER_LEN].try_into().expect("header length");
                    let payload = match &mut check {
                        Some(mac) => match mac.open(head, body) {
                            Ok(p) => p,
                            Err(e) => {
                                shared.fail_all(&e.to_string());
                                return;
                            }
                        },
                        None => body,
                    };
                    if header.kind != FrameKind::Response {
                        // A server never sends requests: the stream is not what we think.
                        shared.fail_all("server sent a request frame");
                        return;
                    }
                    let waiter = shared.pending.lock().remove(&header.request_id);
                    if let Some(w) = waiter {
                        let _ = w.send(Ok(payload.to_vec()));
                    }
                    used += n;
                }
                Ok(None) => break,
                Err(e) => {
                    shared.fail_all(&e.to_string());
                    return;
                }
            }
        }
        buf.drain(..used);
        if buf.capacity() - buf.len() < 16 * 1024 {
            buf.reserve(64 * 1024);
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) => break "server closed the connection".to_string(),
            Ok(_) => {}
            Err(e) => break e.to_string(),
        }
    };
    shared.fail_all(&why);
}
