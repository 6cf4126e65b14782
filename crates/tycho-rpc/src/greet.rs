//! The connection greeting ([`tycho_proto::auth::handshake`]) on tokio streams.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tycho_proto::auth::handshake::{self, ClientSide, HandshakeError, Identity, Peer, ServerSide, Service};
use tycho_proto::auth::session::Session;
use tycho_proto::auth::{ResolvedAuth, Secret};
use tycho_proto::frame::{FrameHeader, FrameKind, HEADER_LEN};

/// How long a peer has to complete its greeting; a connection that has not authenticated by
/// then is closed, so idle or half-sent greetings cannot pin server resources.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

async fn read_hello<S: AsyncRead + Unpin>(s: &mut S) -> Result<Vec<u8>, HandshakeError> {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).await?;
    let h = FrameHeader::decode(&head, handshake::HELLO_MAX)?;
    if h.kind != FrameKind::Hello {
        return Err(HandshakeError::NotTycho(format!("a {:?} frame where a greeting belongs", h.kind)));
    }
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload).await?;
    Ok(payload)
}

fn timed_out() -> HandshakeError {
    HandshakeError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "the greeting did not complete in time"))
}

/// The server side of the greeting: the peer, and the keys that tag the connection's frames
/// after it (`None` without a secret).
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    service: Service,
    secret: Option<Arc<Secret>>,
) -> Result<(Peer, Option<Session>), HandshakeError> {
    let run = async {
        let (side, hello) = ServerSide::start(service, secret)?;
        s.write_all(&hello).await?;
        let payload = read_hello(s).await?;
        let (answer, verdict) = side.finish(&payload);
        s.write_all(&answer).await?;
        let peer = verdict?;
        Ok((peer, side.session(&payload)))
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run).await.unwrap_or_else(|_| Err(timed_out()))
}

/// The client side of the greeting: the keys that tag the connection's frames after it, when
/// it is authenticated.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    service: Service,
    auth: &ResolvedAuth,
    identity: Option<&Identity>,
    timeout: Duration,
) -> Result<Option<Session>, HandshakeError> {
    let run = async {
        let hello = match read_hello(s).await {
            Err(HandshakeError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(HandshakeError::ClosedEarly);
            }
            other => other?,
        };
        let (side, reply) = ClientSide::answer(service, &hello, auth, identity)?;
        s.write_all(&reply).await?;
        let authenticated = side.finish(&read_hello(s).await?)?;
        Ok(if authenticated { side.session() } else { None })
    };
    tokio::time::timeout(timeout, run).await.unwrap_or_else(|_| Err(timed_out()))
}
