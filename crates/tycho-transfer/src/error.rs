use thiserror::Error;
use tycho_proto::ErrorCode;

/// Why a transfer failed.
#[derive(Debug, Error)]
pub enum TransferError {
    /// A socket or mapping operation failed.
    #[error("transfer I/O failed: {0}")]
    Io(#[from] std::io::Error),
    /// The range does not lie inside the segment, or is empty.
    #[error("invalid range: {0}")]
    InvalidRange(String),
    /// The peer does not serve this segment.
    #[error("segment not served by this peer")]
    SegmentNotFound,
    /// The peer refused the request with a code.
    #[error("peer refused the transfer: {0}")]
    Remote(ErrorCode),
    /// The peer sent something that is not the transfer protocol.
    #[error("transfer protocol error: {0}")]
    Protocol(String),
    /// A message's tag did not check: the connection was tampered with (or the peer holds other
    /// keys); it is closed, and what the message carried is not used.
    #[error("transfer message tag did not check ({0}): the connection was closed")]
    BadTag(&'static str),
    /// The connection greeting failed (another version, a missing or wrong secret).
    #[error("transfer greeting: {0}")]
    Handshake(#[from] tycho_proto::auth::handshake::HandshakeError),
}

impl TransferError {
    pub(crate) fn out_of_range(offset: u64, len: usize, size: usize) -> TransferError {
        TransferError::InvalidRange(format!("{len} bytes at offset {offset} do not fit in a segment of {size} bytes"))
    }

    /// The wire code a caller reports.
    pub fn code(&self) -> ErrorCode {
        match self {
            TransferError::Io(_) | TransferError::Protocol(_) | TransferError::BadTag(_) => ErrorCode::TRANSFER_FAIL,
            TransferError::InvalidRange(_) => ErrorCode::INVALID_PARAMS,
            TransferError::SegmentNotFound => ErrorCode::SEGMENT_NOT_FOUND,
            TransferError::Remote(c) => *c,
            TransferError::Handshake(e) => match e.code() {
                ErrorCode::RPC_FAIL => ErrorCode::TRANSFER_FAIL,
                c => c,
            },
        }
    }
}
