//! The transfer server: serves reads and writes of ranges inside registered segments.
//!
//! One thread per connection with blocking I/O: bulk transfers are few and long, and a
//! thread that owns its socket moves bytes between socket and segment with no hand-offs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tycho_proto::ErrorCode;

use crate::wire::{encode_answer, XferOp, XferRequest, REQUEST_LEN};
use crate::{SegmentRegistry, TransferError};

/// A running transfer server.
pub struct TransferServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl TransferServer {
    /// Binds `bind` and serves `registry` until dropped.
    pub fn start(bind: &str, registry: Arc<SegmentRegistry>) -> std::io::Result<TransferServer> {
        let listener = TcpListener::bind(bind)?;
        Self::serve(listener, registry)
    }

    /// Serves `registry` on an already bound listener.
    pub fn serve(listener: TcpListener, registry: Arc<SegmentRegistry>) -> std::io::Result<TransferServer> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new().name("tycho-xfer-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(stream) = conn else { continue };
                let registry = registry.clone();
                let stop = stop2.clone();
                let _ = std::thread::Builder::new().name("tycho-xfer".into()).spawn(move || {
                    if let Err(e) = serve_connection(stream, &registry, &stop) {
                        tracing::debug!(error = %e, "transfer connection closed");
                    }
                });
            }
        })?;
        Ok(TransferServer { addr, stop, accept: Some(accept) })
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

fn serve_connection(mut stream: TcpStream, registry: &SegmentRegistry, stop: &AtomicBool) -> Result<(), TransferError> {
    stream.set_nodelay(true)?;
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
        let checked = match &seg {
            None => Err(ErrorCode::SEGMENT_NOT_FOUND),
            Some(_) if req.len == 0 => Err(ErrorCode::INVALID_PARAMS),
            Some(m) => match req.offset.checked_add(req.len) {
                Some(end) if end <= m.len() as u64 => Ok(m),
                _ => Err(ErrorCode::INVALID_PARAMS),
            },
        };
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
