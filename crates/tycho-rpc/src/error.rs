use thiserror::Error;
use tycho_proto::auth::handshake::HandshakeError;
use tycho_proto::{frame::FrameError, ErrorCode};

/// Why a call did not produce a response.
#[derive(Debug, Error)]
pub enum RpcError {
    /// The connection could not be opened.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address tried.
        addr: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The connection failed or was closed while the call was outstanding.
    #[error("connection closed: {0}")]
    Closed(String),
    /// No response before the call's deadline.
    #[error("no response within {0:?}")]
    Timeout(std::time::Duration),
    /// The peer sent bytes that are not a valid frame or message.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The connection's greeting failed: another version, a missing or wrong secret.
    #[error("greeting {addr}: {source}")]
    Handshake {
        /// The server's address.
        addr: String,
        /// The cause.
        source: HandshakeError,
    },
}

impl RpcError {
    /// The wire code a caller reports for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            RpcError::Timeout(_) => ErrorCode::RPC_TIMEOUT,
            RpcError::Handshake { source, .. } => source.code(),
            RpcError::Frame(FrameError::UnsupportedVersion(_)) => ErrorCode::INVALID_VERSION,
            _ => ErrorCode::RPC_FAIL,
        }
    }
}
