//! The greeting at the start of every RPC and transfer connection.
//!
//! ```text
//! server -> client  Hello frame: service (u8) | flags (u8, bit 0: secret required)
//!                   | clock (u48, Unix ms) | server nonce (16)
//! client -> server  Hello frame: service (u8) | flags (u8, bit 0: proof, bit 1: client
//!                   credential, bit 2: admin credential) | clock (u48, Unix ms)
//!                   | client nonce (16) | proof (32) | client id (16) | credential proof (32)
//!                   | tenant length (u8) | tenant
//! server -> client  Hello frame: status (i32, 0 or an error code) | 0 x4 | server proof (32)
//! ```
//!
//! Hello frames are ordinary frames (kind 2) of at most [`HELLO_MAX`] bytes, so a peer of
//! another frame version fails on the first header it reads with an error naming both
//! versions. The proofs are HMAC-SHA256 under a key derived from the cluster secret, over
//! both nonces and the service: a recorded greeting cannot be replayed on a new connection,
//! and a connection to one service cannot be passed off on another. The server proves the
//! secret too, so a client never talks to an impostor that took a master's port.
//!
//! Each side also sends its clock, and each refuses a peer whose clock is more than
//! [`CLOCK_SKEW_MS`] from its own (held ranges and capabilities rely on that bound), naming
//! both clocks. A clock of 0 is not checked. The clocks are not covered by the proofs: whoever
//! can alter them can as well cut the connection.

use std::io::{Read, Write};
use std::sync::Arc;

use super::capability::CLOCK_SKEW_MS;
use super::session::Session;
use super::stream::StreamSession;
use super::{mac32, random_bytes, same_mac, ResolvedAuth, Secret, SECRET_FILE_ENV};
use crate::frame::{FrameError, FrameHeader, FrameKind, FRAME_VERSION, HEADER_LEN};
use crate::ErrorCode;

/// Largest greeting frame payload; anything larger is refused before it is buffered.
pub const HELLO_MAX: u32 = 512;
/// Length of a server's opening greeting payload.
pub const SERVER_HELLO_LEN: usize = 24;
/// Length of a client's greeting payload before its tenant name (which takes up to 255 more
/// bytes).
pub const CLIENT_HELLO_LEN: usize = 105;
/// Length of the server's closing answer payload.
pub const SERVER_FINISH_LEN: usize = 40;

/// Which protocol follows the greeting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// Master RPC frames.
    Rpc = 1,
    /// Transfer requests.
    Transfer = 2,
}

impl Service {
    fn from_u8(b: u8) -> Option<Service> {
        match b {
            1 => Some(Service::Rpc),
            2 => Some(Service::Transfer),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Service::Rpc => "master RPC",
            Service::Transfer => "transfer",
        }
    }
}

/// Who a connection speaks for, beyond holding the cluster secret.
#[derive(Clone)]
pub enum Identity {
    /// A registered client of one tenant, with the credential the master issued to it.
    Client {
        /// The client id.
        client: u128,
        /// Its tenant.
        tenant: String,
        /// Its credential ([`credential`]).
        credential: [u8; 32],
    },
    /// An operator's tool with the admin credential ([`admin_credential`]): it may act across
    /// tenants and on other clients' segments.
    Admin {
        /// The admin credential.
        credential: [u8; 32],
    },
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Client { client, tenant, .. } => write!(f, "Client({client:032x}, tenant {tenant:?})"),
            Identity::Admin { .. } => f.write_str("Admin"),
        }
    }
}

/// The credential of client `id` of `tenant`: what the master issues to it at registration and
/// what it proves on every later connection. Any master of the cluster can check it.
pub fn credential(secret: &Secret, id: u128, tenant: &str) -> [u8; 32] {
    secret.derive("client credential v1", &[&id.to_le_bytes(), tenant.as_bytes()])
}

/// The admin credential, which operators' tools derive from the secret they were given.
pub fn admin_credential(secret: &Secret) -> [u8; 32] {
    secret.derive("admin credential v1", &[])
}

/// What a server learned about the peer of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Peer {
    /// The peer proved the cluster secret (false only on servers that do not ask for it).
    pub authenticated: bool,
    /// The client id (and its tenant) whose credential the peer proved, if any.
    pub client: Option<(u128, String)>,
    /// The peer proved the admin credential.
    pub admin: bool,
}

/// Why a greeting failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The connection failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer speaks another frame version.
    #[error("the peer speaks Tycho frame version {peer}, this build speaks {ours}; run the same Tycho release on both sides")]
    Version {
        /// The peer's version.
        peer: u8,
        /// This build's.
        ours: u8,
    },
    /// The peer's bytes are not a Tycho greeting.
    #[error("the peer does not greet in the Tycho protocol: {0}")]
    NotTycho(String),
    /// The server closed the connection before it greeted.
    #[error(
        "the server closed the connection before greeting; it may run a Tycho older than frame version {FRAME_VERSION}"
    )]
    ClosedEarly,
    /// The port serves another protocol.
    #[error("the port serves the {found} protocol, not {wanted}")]
    WrongService {
        /// What the server offers.
        found: &'static str,
        /// What the client asked for.
        wanted: &'static str,
    },
    /// The server requires the cluster secret and this process has none.
    #[error(
        "the server requires the cluster secret and this process has none: set {SECRET_FILE_ENV}=<path of a copy of the \
         master's secret file> (or TYCHO_SECRET=<the secret>); see docs/security.md"
    )]
    SecretRequired,
    /// The server refused the client's proof.
    #[error("the server refused this connection: {0} ({hint})", hint = .0.hint())]
    Refused(ErrorCode),
    /// The client's proof is wrong (seen by a server).
    #[error("the peer's proof of the cluster secret is wrong")]
    BadClientProof,
    /// The client's credential proof is wrong (seen by a server).
    #[error("the peer's client credential is wrong")]
    BadCredential,
    /// The peer sent no proof though the secret is required (seen by a server).
    #[error("the peer did not present the cluster secret")]
    MissingProof,
    /// The server could not prove the secret: another cluster's server, or an impostor.
    #[error("the server could not prove it holds this cluster secret ({origin}): it belongs to another cluster or is an impostor")]
    BadServerProof {
        /// Where the client's secret came from.
        origin: String,
    },
    /// The peer's clock is further from this host's than held ranges allow.
    #[error(
        "the peer's clock reads {theirs} ms since the Unix epoch and this host's {ours}: {apart} ms apart, more than \
         the {CLOCK_SKEW_MS} ms Tycho's held ranges allow (or the greeting waited over {GREETING_DELAY_MS} ms more); \
         synchronize the hosts' clocks (NTP)",
        apart = .theirs.abs_diff(*.ours)
    )]
    ClockSkew {
        /// This host's clock, Unix ms.
        ours: u64,
        /// The peer's, Unix ms.
        theirs: u64,
    },
    /// A client holding a secret (given or found) reached a server that asks for none.
    #[error(
        "the server asks for no cluster secret (an --insecure server, or an impostor on its port) but this client \
         holds one ({origin}), so it sends nothing there; set TYCHO_INSECURE=1 to talk to an --insecure cluster"
    )]
    ServerInsecure {
        /// Where the client's secret came from.
        origin: String,
    },
}

impl HandshakeError {
    /// The typed code a caller reports for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            HandshakeError::Io(_) | HandshakeError::ClosedEarly => ErrorCode::RPC_FAIL,
            HandshakeError::Version { .. } | HandshakeError::NotTycho(_) | HandshakeError::WrongService { .. } => {
                ErrorCode::INVALID_VERSION
            }
            HandshakeError::SecretRequired | HandshakeError::MissingProof => ErrorCode::AUTH_REQUIRED,
            HandshakeError::ClockSkew { .. } => ErrorCode::CLOCK_SKEW,
            HandshakeError::Refused(c) => *c,
            HandshakeError::BadClientProof
            | HandshakeError::BadCredential
            | HandshakeError::BadServerProof { .. }
            | HandshakeError::ServerInsecure { .. } => ErrorCode::AUTH_FAILED,
        }
    }
}

impl From<FrameError> for HandshakeError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::UnsupportedVersion(v) => HandshakeError::Version { peer: v, ours: FRAME_VERSION },
            other => HandshakeError::NotTycho(other.to_string()),
        }
    }
}

fn hello_frame(payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    let header = FrameHeader { kind: FrameKind::Hello, len: payload.len() as u32, request_id: 0 };
    header.encode((&mut out[..HEADER_LEN]).try_into().expect("header length"));
    out.extend_from_slice(payload);
    out
}

/// Parses a greeting frame held whole in `buf` (header and payload); used by the decoders and
/// the fuzz targets.
pub fn split_hello(buf: &[u8]) -> Result<&[u8], HandshakeError> {
    let head: &[u8; HEADER_LEN] =
        buf.first_chunk().ok_or_else(|| HandshakeError::NotTycho(format!("{} bytes of greeting", buf.len())))?;
    let h = FrameHeader::decode(head, HELLO_MAX)?;
    if h.kind != FrameKind::Hello {
        return Err(HandshakeError::NotTycho(format!("a {:?} frame where a greeting belongs", h.kind)));
    }
    buf.get(HEADER_LEN..HEADER_LEN + h.len as usize)
        .ok_or_else(|| HandshakeError::NotTycho("truncated greeting".into()))
}

/// Reads one greeting frame and returns its payload.
pub fn read_hello<R: Read>(r: &mut R) -> Result<Vec<u8>, HandshakeError> {
    let mut head = [0u8; HEADER_LEN];
    r.read_exact(&mut head)?;
    let h = FrameHeader::decode(&head, HELLO_MAX)?;
    if h.kind != FrameKind::Hello {
        return Err(HandshakeError::NotTycho(format!("a {:?} frame where a greeting belongs", h.kind)));
    }
    let mut payload = vec![0u8; h.len as usize];
    r.read_exact(&mut payload)?;
    Ok(payload)
}

/// This host's clock in Unix ms, as the greeting carries it. Builds with the `failpoints`
/// feature (tests only) add `TYCHO_TEST_CLOCK_OFFSET_MS` to it, to play a host whose clock is
/// off.
pub fn clock_ms() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    #[cfg(feature = "failpoints")]
    if let Some(off) = std::env::var("TYCHO_TEST_CLOCK_OFFSET_MS").ok().and_then(|v| v.parse::<i64>().ok()) {
        return now.saturating_add_signed(off);
    }
    now
}

/// Writes `ms` into a greeting's 6 clock bytes.
fn put_clock(dst: &mut [u8], ms: u64) {
    dst.copy_from_slice(&ms.to_le_bytes()[..6]);
}

/// How long a greeting frame may have waited before it is read (a peer's accept queue, a
/// stalled process; the greeting's own deadline): a clock that far behind is its delay, not
/// skew.
pub const GREETING_DELAY_MS: u64 = 5_000;

/// Refuses a peer whose greeting's clock (6 bytes, 0: not sent) is more than
/// [`CLOCK_SKEW_MS`] ahead of `ours`, or more than that plus [`GREETING_DELAY_MS`] behind (the
/// frame may have waited that long).
fn check_clock(bytes: &[u8], ours: u64) -> Result<(), HandshakeError> {
    let mut le = [0u8; 8];
    le[..6].copy_from_slice(bytes);
    let theirs = u64::from_le_bytes(le);
    let ahead = theirs > ours.saturating_add(CLOCK_SKEW_MS);
    let behind = theirs.saturating_add(CLOCK_SKEW_MS + GREETING_DELAY_MS) < ours;
    if theirs != 0 && (ahead || behind) {
        return Err(HandshakeError::ClockSkew { ours, theirs });
    }
    Ok(())
}

fn conn_key(secret: &Secret) -> [u8; 32] {
    secret.derive("connection v1", &[])
}

/// The server's half of a greeting in progress.
pub struct ServerSide {
    service: Service,
    nonce: [u8; 16],
    secret: Option<Arc<Secret>>,
}

impl ServerSide {
    /// Starts a greeting; returns the frame to send first.
    pub fn start(service: Service, secret: Option<Arc<Secret>>) -> Result<(ServerSide, Vec<u8>), HandshakeError> {
        let mut nonce = [0u8; 16];
        random_bytes(&mut nonce).map_err(|e| HandshakeError::Io(std::io::Error::other(e.to_string())))?;
        let mut p = [0u8; SERVER_HELLO_LEN];
        p[0] = service as u8;
        p[1] = u8::from(secret.is_some());
        put_clock(&mut p[2..8], clock_ms());
        p[8..24].copy_from_slice(&nonce);
        Ok((ServerSide { service, nonce, secret }, hello_frame(&p)))
    }

    /// Checks the client's greeting payload; returns the frame to answer with (sent whether or
    /// not the client is accepted, so that it learns why) and the verdict.
    pub fn finish(&self, payload: &[u8]) -> (Vec<u8>, Result<Peer, HandshakeError>) {
        let verdict = self.check(payload);
        let mut p = [0u8; SERVER_FINISH_LEN];
        match &verdict {
            Ok(_) => {
                if let (Some(secret), Some(cn)) = (&self.secret, payload.get(8..24)) {
                    let proof = mac32(&conn_key(secret), "server hello v1", &[&[self.service as u8], cn, &self.nonce]);
                    p[8..40].copy_from_slice(&proof);
                }
            }
            Err(e) => p[0..4].copy_from_slice(&e.code().as_i32().to_le_bytes()),
        }
        (hello_frame(&p), verdict)
    }

    /// The keys of the connection whose client greeted with `client_hello` (`None`: this
    /// server asks for no secret, and frames go untagged).
    pub fn session(&self, client_hello: &[u8]) -> Option<Session> {
        let secret = self.secret.as_ref()?;
        let cn = client_hello.get(8..24)?;
        Some(Session::derive(secret, self.service as u8, cn, &self.nonce, false))
    }

    /// The transfer keys of the connection whose client greeted with `client_hello` (`None`:
    /// this server asks for no secret, and messages go untagged).
    pub fn stream_session(&self, client_hello: &[u8]) -> Option<StreamSession> {
        let secret = self.secret.as_ref()?;
        let cn = client_hello.get(8..24)?;
        Some(StreamSession::derive(secret, self.service as u8, cn, &self.nonce, false))
    }

    fn check(&self, payload: &[u8]) -> Result<Peer, HandshakeError> {
        let bad = || HandshakeError::NotTycho(format!("client greeting of {} bytes", payload.len()));
        let p: &[u8; CLIENT_HELLO_LEN] =
            payload.get(..CLIENT_HELLO_LEN).and_then(|p| p.try_into().ok()).ok_or_else(bad)?;
        let tenant = &payload[CLIENT_HELLO_LEN..];
        if tenant.len() != p[104] as usize {
            return Err(bad());
        }
        let tenant = std::str::from_utf8(tenant).map_err(|_| HandshakeError::NotTycho("tenant is not UTF-8".into()))?;
        let service = Service::from_u8(p[0]).ok_or_else(|| HandshakeError::NotTycho(format!("service {}", p[0])))?;
        if service != self.service {
            return Err(HandshakeError::WrongService { found: self.service.name(), wanted: service.name() });
        }
        check_clock(&p[2..8], clock_ms())?;
        let Some(secret) = &self.secret else {
            return Ok(Peer::default());
        };
        let (flags, cn) = (p[1], &p[8..24]);
        if flags & 1 == 0 {
            return Err(HandshakeError::MissingProof);
        }
        let want = mac32(&conn_key(secret), "client hello v1", &[&[p[0]], &self.nonce, cn]);
        if !same_mac(&want, &p[24..56]) {
            return Err(HandshakeError::BadClientProof);
        }
        let mut peer = Peer { authenticated: true, ..Peer::default() };
        match flags & 6 {
            0 => {}
            2 => {
                let id = u128::from_le_bytes(p[56..72].try_into().expect("16 bytes"));
                let want = mac32(&credential(secret, id, tenant), "credential v1", &[&self.nonce, cn]);
                if !same_mac(&want, &p[72..104]) {
                    return Err(HandshakeError::BadCredential);
                }
                peer.client = Some((id, tenant.to_string()));
            }
            4 => {
                let want = mac32(&admin_credential(secret), "admin v1", &[&self.nonce, cn]);
                if !same_mac(&want, &p[72..104]) {
                    return Err(HandshakeError::BadCredential);
                }
                peer.admin = true;
            }
            _ => return Err(HandshakeError::NotTycho("a greeting with two identities".into())),
        }
        Ok(peer)
    }
}

/// The client's half of a greeting in progress.
pub struct ClientSide {
    service: Service,
    nonce: [u8; 16],
    server_nonce: [u8; 16],
    secret: Option<Arc<Secret>>,
    origin: String,
}

impl ClientSide {
    /// Answers the server's opening greeting; returns the frame to send.
    pub fn answer(
        service: Service,
        server_hello: &[u8],
        auth: &ResolvedAuth,
        identity: Option<&Identity>,
    ) -> Result<(ClientSide, Vec<u8>), HandshakeError> {
        let h: &[u8; SERVER_HELLO_LEN] = server_hello
            .try_into()
            .map_err(|_| HandshakeError::NotTycho(format!("server greeting of {} bytes", server_hello.len())))?;
        let found = Service::from_u8(h[0]).ok_or_else(|| HandshakeError::NotTycho(format!("service {}", h[0])))?;
        if found != service {
            return Err(HandshakeError::WrongService { found: found.name(), wanted: service.name() });
        }
        let now = clock_ms();
        check_clock(&h[2..8], now)?;
        let required = h[1] & 1 != 0;
        let sn = &h[8..24];
        let secret = match (&auth.secret, required) {
            (None, true) => return Err(HandshakeError::SecretRequired),
            // A client that holds a secret, however it found it, talks only to a server that
            // proves it: one that asks for none may be an impostor on the port, and would get
            // the client's keys and values (TYCHO_INSECURE=1 is how to reach an --insecure one).
            (Some(_), false) => return Err(HandshakeError::ServerInsecure { origin: auth.origin.clone() }),
            (Some(s), true) => Some(s.clone()),
            (None, false) => None,
        };
        let mut nonce = [0u8; 16];
        random_bytes(&mut nonce).map_err(|e| HandshakeError::Io(std::io::Error::other(e.to_string())))?;
        let mut p = vec![0u8; CLIENT_HELLO_LEN];
        p[0] = service as u8;
        put_clock(&mut p[2..8], now);
        p[8..24].copy_from_slice(&nonce);
        if let Some(s) = &secret {
            p[1] |= 1;
            p[24..56].copy_from_slice(&mac32(&conn_key(s), "client hello v1", &[&[service as u8], sn, &nonce]));
            match identity {
                None => {}
                Some(Identity::Client { client, tenant, credential }) => {
                    let t = tenant.as_bytes();
                    if t.len() > crate::MAX_TENANT_LEN {
                        return Err(HandshakeError::NotTycho(format!("a tenant name of {} bytes", t.len())));
                    }
                    p[1] |= 2;
                    p[56..72].copy_from_slice(&client.to_le_bytes());
                    p[72..104].copy_from_slice(&mac32(credential, "credential v1", &[sn, &nonce]));
                    p[104] = t.len() as u8;
                    p.extend_from_slice(t);
                }
                Some(Identity::Admin { credential }) => {
                    p[1] |= 4;
                    p[72..104].copy_from_slice(&mac32(credential, "admin v1", &[sn, &nonce]));
                }
            }
        }
        let server_nonce = sn.try_into().expect("16 bytes");
        Ok((ClientSide { service, nonce, server_nonce, secret, origin: auth.origin.clone() }, hello_frame(&p)))
    }

    /// Checks the server's closing answer; true when the connection is authenticated.
    pub fn finish(&self, payload: &[u8]) -> Result<bool, HandshakeError> {
        let p: &[u8; SERVER_FINISH_LEN] = payload
            .try_into()
            .map_err(|_| HandshakeError::NotTycho(format!("server answer of {} bytes", payload.len())))?;
        let status = i32::from_le_bytes(p[0..4].try_into().expect("4 bytes"));
        if status != 0 {
            let code = ErrorCode::from_i32(status).unwrap_or(ErrorCode::AUTH_FAILED);
            return Err(HandshakeError::Refused(code));
        }
        let Some(secret) = &self.secret else { return Ok(false) };
        let want =
            mac32(&conn_key(secret), "server hello v1", &[&[self.service as u8], &self.nonce, &self.server_nonce]);
        if !same_mac(&want, &p[8..40]) {
            return Err(HandshakeError::BadServerProof { origin: self.origin.clone() });
        }
        Ok(true)
    }

    /// The keys of the connection (`None` without a secret: frames go untagged).
    pub fn session(&self) -> Option<Session> {
        let secret = self.secret.as_ref()?;
        Some(Session::derive(secret, self.service as u8, &self.nonce, &self.server_nonce, true))
    }

    /// The transfer keys of the connection (`None` without a secret: messages go untagged).
    pub fn stream_session(&self) -> Option<StreamSession> {
        let secret = self.secret.as_ref()?;
        Some(StreamSession::derive(secret, self.service as u8, &self.nonce, &self.server_nonce, true))
    }
}

/// Runs the server side of a greeting on a blocking stream.
pub fn serve<S: Read + Write>(
    s: &mut S,
    service: Service,
    secret: Option<Arc<Secret>>,
) -> Result<Peer, HandshakeError> {
    serve_session(s, service, secret).map(|(peer, _)| peer)
}

/// [`serve`], with the keys that tag the connection's frames after the greeting (`None`
/// without a secret).
pub fn serve_session<S: Read + Write>(
    s: &mut S,
    service: Service,
    secret: Option<Arc<Secret>>,
) -> Result<(Peer, Option<Session>), HandshakeError> {
    serve_keyed(s, service, secret, ServerSide::session)
}

/// [`serve`], with the keys that seal a transfer connection's messages after the greeting
/// (`None` without a secret).
pub fn serve_stream<S: Read + Write>(
    s: &mut S,
    service: Service,
    secret: Option<Arc<Secret>>,
) -> Result<(Peer, Option<StreamSession>), HandshakeError> {
    serve_keyed(s, service, secret, ServerSide::stream_session)
}

fn serve_keyed<S: Read + Write, K>(
    s: &mut S,
    service: Service,
    secret: Option<Arc<Secret>>,
    keys: impl FnOnce(&ServerSide, &[u8]) -> Option<K>,
) -> Result<(Peer, Option<K>), HandshakeError> {
    let (side, hello) = ServerSide::start(service, secret)?;
    s.write_all(&hello)?;
    let payload = read_hello(s)?;
    let (answer, verdict) = side.finish(&payload);
    s.write_all(&answer)?;
    let peer = verdict?;
    Ok((peer, keys(&side, &payload)))
}

/// Runs the client side of a greeting on a blocking stream; true when the connection is
/// authenticated.
pub fn connect<S: Read + Write>(
    s: &mut S,
    service: Service,
    auth: &ResolvedAuth,
    identity: Option<&Identity>,
) -> Result<bool, HandshakeError> {
    connect_session(s, service, auth, identity).map(|session| session.is_some())
}

/// [`connect`], with the keys that tag the connection's frames after the greeting (`None`
/// when it is not authenticated).
pub fn connect_session<S: Read + Write>(
    s: &mut S,
    service: Service,
    auth: &ResolvedAuth,
    identity: Option<&Identity>,
) -> Result<Option<Session>, HandshakeError> {
    connect_keyed(s, service, auth, identity, ClientSide::session)
}

/// [`connect`], with the keys that seal a transfer connection's messages after the greeting
/// (`None` when it is not authenticated).
pub fn connect_stream<S: Read + Write>(
    s: &mut S,
    service: Service,
    auth: &ResolvedAuth,
    identity: Option<&Identity>,
) -> Result<Option<StreamSession>, HandshakeError> {
    connect_keyed(s, service, auth, identity, ClientSide::stream_session)
}

fn connect_keyed<S: Read + Write, K>(
    s: &mut S,
    service: Service,
    auth: &ResolvedAuth,
    identity: Option<&Identity>,
    keys: impl FnOnce(&ClientSide) -> Option<K>,
) -> Result<Option<K>, HandshakeError> {
    let hello = match read_hello(s) {
        Err(HandshakeError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(HandshakeError::ClosedEarly);
        }
        other => other?,
    };
    let (side, reply) = ClientSide::answer(service, &hello, auth, identity)?;
    s.write_all(&reply)?;
    let authenticated = side.finish(&read_hello(s)?)?;
    Ok(if authenticated { keys(&side) } else { None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(t: &str) -> Option<Arc<Secret>> {
        Some(Arc::new(Secret::from_text(format!("{t}-of-enough-length").as_bytes()).unwrap()))
    }

    fn auth(s: Option<Arc<Secret>>) -> ResolvedAuth {
        ResolvedAuth { secret: s, origin: "test".into() }
    }

    /// Runs both sides in memory; the server's verdict and the client's.
    fn run(
        server: Option<Arc<Secret>>,
        client: ResolvedAuth,
        identity: Option<&Identity>,
    ) -> (Result<Peer, HandshakeError>, Result<bool, HandshakeError>) {
        let (srv, hello) = ServerSide::start(Service::Rpc, server).unwrap();
        let (cli, reply) = match ClientSide::answer(Service::Rpc, split_hello(&hello).unwrap(), &client, identity) {
            Ok(x) => x,
            Err(e) => return (Ok(Peer::default()), Err(e)),
        };
        let (answer, verdict) = srv.finish(split_hello(&reply).unwrap());
        (verdict, cli.finish(split_hello(&answer).unwrap()))
    }

    #[test]
    fn matching_secrets_authenticate_both_ways() {
        let s = secret("the-cluster-secret");
        let (peer, client) = run(s.clone(), auth(s.clone()), None);
        assert_eq!(peer.unwrap(), Peer { authenticated: true, ..Peer::default() });
        assert!(client.unwrap());
        let cred = credential(s.as_ref().unwrap(), 42, "team-a");
        let id = Identity::Client { client: 42, tenant: "team-a".into(), credential: cred };
        let (peer, _) = run(s.clone(), auth(s.clone()), Some(&id));
        assert_eq!(peer.unwrap(), Peer { authenticated: true, client: Some((42, "team-a".into())), admin: false });
        // Another id, or another tenant, with the same credential: refused.
        for forged in [
            Identity::Client { client: 43, tenant: "team-a".into(), credential: cred },
            Identity::Client { client: 42, tenant: "team-b".into(), credential: cred },
            Identity::Admin { credential: cred },
        ] {
            let (peer, client) = run(s.clone(), auth(s.clone()), Some(&forged));
            assert!(matches!(peer, Err(HandshakeError::BadCredential)), "{forged:?}");
            assert!(matches!(client, Err(HandshakeError::Refused(ErrorCode::AUTH_FAILED))));
        }
        let admin = Identity::Admin { credential: admin_credential(s.as_ref().unwrap()) };
        let (peer, _) = run(s.clone(), auth(s), Some(&admin));
        assert!(peer.unwrap().admin);
    }

    #[test]
    fn a_missing_or_wrong_secret_is_refused_with_its_reason() {
        let s = secret("the-cluster-secret");
        let (_, client) = run(s.clone(), auth(None), None);
        let e = client.unwrap_err();
        assert!(matches!(e, HandshakeError::SecretRequired));
        assert!(e.to_string().contains("TYCHO_SECRET_FILE"), "{e}");
        let (peer, client) = run(s.clone(), auth(secret("another-cluster-secret-of-enough-length")), None);
        assert!(matches!(peer, Err(HandshakeError::BadClientProof)));
        assert_eq!(client.unwrap_err().code(), ErrorCode::AUTH_FAILED);
        // A client holding a secret, given or found, refuses a server without authentication;
        // one without a secret (TYCHO_INSECURE=1, or none found) talks to it.
        let (_, client) = run(None, auth(s), None);
        let e = client.unwrap_err();
        assert!(matches!(e, HandshakeError::ServerInsecure { .. }));
        assert!(e.to_string().contains("TYCHO_INSECURE=1"), "{e}");
        let (peer, client) = run(None, auth(None), None);
        assert_eq!(peer.unwrap(), Peer::default());
        assert!(!client.unwrap());
    }

    /// Issue 47: a peer whose clock is further than CLOCK_SKEW_MS from this host's is refused,
    /// by the client (the server's clock comes first) and by the server, naming both clocks;
    /// within the bound, and without a clock (0), it greets as before.
    #[test]
    fn a_peer_whose_clock_is_off_is_refused_naming_both_clocks() {
        let s = secret("the-cluster-secret");
        let off = |frame: &mut Vec<u8>, by: i64| {
            let at = HEADER_LEN + 2;
            put_clock(&mut frame[at..at + 6], clock_ms().saturating_add_signed(by));
        };
        // The server's clock 6 s ahead, then 11 s behind (more than the skew and a greeting's
        // delay): the client refuses.
        for (by, apart) in [(6_000, 6_000), (-11_000, 11_000)] {
            let (_, mut hello) = ServerSide::start(Service::Rpc, s.clone()).unwrap();
            off(&mut hello, by);
            let e = ClientSide::answer(Service::Rpc, split_hello(&hello).unwrap(), &auth(s.clone()), None)
                .err()
                .expect("refused");
            let HandshakeError::ClockSkew { ours, theirs } = e else { panic!("{e}") };
            assert!(theirs.abs_diff(ours).abs_diff(apart) < 1_000, "{ours} {theirs}");
            let said = e.to_string();
            assert!(said.contains(&ours.to_string()) && said.contains(&theirs.to_string()), "{said}");
            assert_eq!(e.code(), ErrorCode::CLOCK_SKEW);
        }
        // The client's clock 6 s ahead: the server refuses, and says why.
        let (srv, hello) = ServerSide::start(Service::Rpc, s.clone()).unwrap();
        let (cli, mut reply) =
            ClientSide::answer(Service::Rpc, split_hello(&hello).unwrap(), &auth(s.clone()), None).unwrap();
        off(&mut reply, 6_000);
        let (answer, verdict) = srv.finish(split_hello(&reply).unwrap());
        assert!(matches!(verdict, Err(HandshakeError::ClockSkew { .. })), "{verdict:?}");
        assert!(matches!(
            cli.finish(split_hello(&answer).unwrap()),
            Err(HandshakeError::Refused(ErrorCode::CLOCK_SKEW))
        ));
        // 4 s ahead, 9 s behind (a greeting that waited), or no clock at all: accepted.
        for by in [Some(4_000), Some(-9_000), None] {
            let (srv, mut hello) = ServerSide::start(Service::Rpc, s.clone()).unwrap();
            match by {
                Some(by) => off(&mut hello, by),
                None => hello[HEADER_LEN + 2..HEADER_LEN + 8].fill(0),
            }
            let (cli, reply) =
                ClientSide::answer(Service::Rpc, split_hello(&hello).unwrap(), &auth(s.clone()), None).unwrap();
            let (answer, verdict) = srv.finish(split_hello(&reply).unwrap());
            assert!(verdict.is_ok() && cli.finish(split_hello(&answer).unwrap()).unwrap(), "{by:?}");
        }
    }

    #[test]
    fn an_impostor_server_is_found_out() {
        let s = secret("the-cluster-secret");
        let (srv, hello) = ServerSide::start(Service::Rpc, secret("impostors-own-secret")).unwrap();
        let (cli, reply) = ClientSide::answer(Service::Rpc, split_hello(&hello).unwrap(), &auth(s), None).unwrap();
        // The impostor accepts anything and answers status 0 with a proof under its own key.
        let (mut answer, _) = srv.finish(split_hello(&reply).unwrap());
        answer[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&0i32.to_le_bytes());
        assert!(matches!(cli.finish(split_hello(&answer).unwrap()), Err(HandshakeError::BadServerProof { .. })));
    }

    #[test]
    fn other_versions_and_services_are_named() {
        let (_, mut hello) = ServerSide::start(Service::Transfer, None).unwrap();
        let r = ClientSide::answer(Service::Rpc, split_hello(&hello).unwrap(), &auth(None), None);
        assert!(matches!(r, Err(HandshakeError::WrongService { .. })));
        hello[2] = FRAME_VERSION - 1;
        let e = split_hello(&hello).unwrap_err();
        let want = format!("version {}, this build speaks {FRAME_VERSION}", FRAME_VERSION - 1);
        assert!(e.to_string().contains(&want), "{e}");
        assert_eq!(e.code(), ErrorCode::INVALID_VERSION);
    }

    #[test]
    fn garbage_greetings_are_errors_not_panics() {
        let s = secret("the-cluster-secret");
        let (srv, _) = ServerSide::start(Service::Rpc, s.clone()).unwrap();
        for len in [0, 1, 24, 104, 106, 256] {
            let (_, v) = srv.finish(&vec![0xa5; len]);
            assert!(v.is_err(), "{len} bytes");
        }
        for len in [0, 23, 25] {
            assert!(ClientSide::answer(Service::Rpc, &vec![1; len], &auth(s.clone()), None).is_err());
        }
        assert!(split_hello(&[0u8; 5]).is_err());
    }
}
