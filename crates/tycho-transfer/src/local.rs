//! Same-host mappings: a peer of the same OS user asks a segment's holder for its memfd over a
//! Unix socket, presenting the master's capability for a range of it, and maps what it gets.
//!
//! The socket lives in the user's runtime directory (mode 0700, see
//! `tycho_proto::auth::files`), named after the holder's transfer port: `xfer-<port>.sock`. A
//! peer finds it from the replica's endpoint alone; no path comes from the network, and other
//! users cannot reach another user's directory. Both sides check the other's uid with
//! `SO_PEERCRED`. The holder passes the memfd with `SCM_RIGHTS`: read-only for a read grant,
//! writable for a write grant. A mapping covers the whole segment and cannot be revoked range by
//! range, so this trusts the process (same user, holding the secret), not a grant; read-only
//! mappings keep a reader's bugs from scribbling over the segment, but a hostile process of the
//! same user could reopen the memfd writable through `/proc`, or ptrace the holder.
//!
//! ```text
//! request:  a transfer request header (wire.rs), op read or write, naming the granted range
//! answer:   a transfer answer (status, segment length); on success with the memfd attached
//! ```

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tycho_proto::auth::files;
use tycho_proto::{ErrorCode, ReplicaDesc};

use crate::error::TransferError;
use crate::guard::Guard;
use crate::registry::SegmentRegistry;
use crate::segment::Mapping;
use crate::wire::{decode_answer, encode_answer, XferOp, XferRequest, ANSWER_LEN, REQUEST_LEN};

/// How long either side waits on the other before giving up on one exchange.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);

/// The socket of the holder whose transfer server listens on `port`.
pub fn socket_path(port: u16) -> PathBuf {
    files::runtime_dir().join(format!("xfer-{port}.sock"))
}

/// This process's uid.
pub fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// The uid and pid of the process at the other end of `s`.
pub fn peer_cred(s: &UnixStream) -> std::io::Result<(u32, i32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.uid, cred.pid))
}

/// A control buffer with room for one descriptor.
fn fd_control() -> Vec<u8> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    vec![0u8; unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize]
}

/// A message header over one buffer (`iov`) and a control buffer; both must outlive its use.
fn msg_header(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    msg
}

/// Sends `bytes` with `fd` attached.
fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: &OwnedFd) -> std::io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut control = fd_control();
    let msg = msg_header(&mut iov, &mut control);
    // SAFETY: the control buffer has room for one cmsg carrying one int (CMSG_SPACE above).
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd.as_raw_fd());
    }
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "short send"));
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes and the descriptor attached to them, if any.
fn recv_with_fd(s: &UnixStream, buf: &mut [u8]) -> std::io::Result<Option<OwnedFd>> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = fd_control();
    let mut msg = msg_header(&mut iov, &mut control);
    // SAFETY: msg points at live buffers; MSG_CMSG_CLOEXEC keeps a received fd from leaking
    // into children.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_WAITALL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: walking the control messages the kernel wrote into `control`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if (n as usize) < buf.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short answer"));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other("descriptor truncated"));
    }
    Ok(fd)
}

/// The holder's side: hands out memfds of registered segments to peers that present a grant.
/// A Unix socket in the runtime directory, served one short exchange at a time by a thread
/// of its own, until dropped (which removes the socket file it bound, and only that one).
pub struct UnixServer {
    path: PathBuf,
    /// Identity of the socket file bound, so that only this one is removed at the end.
    file: Option<(u64, u64)>,
    /// The listening socket, shut down to wake the accept loop.
    listener: OwnedFd,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl UnixServer {
    /// Listens on `path` (inside the runtime directory, created if missing) and calls `serve`
    /// for each connection in turn, on a thread named `name`. A socket file left at `path` by
    /// an earlier process is replaced: the caller holds what the name stands for now.
    pub fn bind(
        path: PathBuf,
        name: &str,
        serve: impl Fn(&UnixStream) -> Result<(), TransferError> + Send + 'static,
    ) -> Result<UnixServer, TransferError> {
        files::ensure_runtime_dir().map_err(|e| TransferError::Protocol(e.to_string()))?;
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        let file = identity(&path);
        let wake = OwnedFd::from(listener.try_clone()?);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        // One thread serves every request in turn: each is one short exchange with a deadline.
        let thread = std::thread::Builder::new().name(name.into()).spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(s) = conn else {
                    // Out of descriptors and the like: do not spin.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let _ = s.set_read_timeout(Some(EXCHANGE_TIMEOUT));
                let _ = s.set_write_timeout(Some(EXCHANGE_TIMEOUT));
                if let Err(e) = serve(&s) {
                    tracing::debug!(error = %e, "a request on a local socket failed");
                }
            }
        })?;
        Ok(UnixServer { path, file, listener: wake, stop, thread: Some(thread) })
    }

    /// The holder's side of same-host mappings: the socket of transfer port `port`.
    pub(crate) fn mappings(
        port: u16,
        registry: Arc<SegmentRegistry>,
        guard: Arc<Guard>,
    ) -> Result<UnixServer, TransferError> {
        Self::bind(socket_path(port), "tycho-xfer-local", move |s| serve_one(s, &registry, &guard))
    }
}

impl Drop for UnixServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Shutting the listening socket down makes a blocked accept return at once (the socket
        // file may be gone, so connecting to it is no way to wake it).
        // SAFETY: shutdown on a socket fd this value owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if self.file.is_some() && identity(&self.path) == self.file {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn serve_one(s: &UnixStream, registry: &SegmentRegistry, guard: &Guard) -> Result<(), TransferError> {
    let refuse = |code: ErrorCode| -> Result<(), TransferError> {
        (&*s).write_all(&encode_answer(Err(code)))?;
        Ok(())
    };
    let (peer_uid, _) = peer_cred(s)?;
    if peer_uid != uid() {
        return refuse(ErrorCode::PERMISSION_DENIED);
    }
    let mut head = [0u8; REQUEST_LEN];
    (&*s).read_exact(&mut head)?;
    let req = XferRequest::decode(&head)?;
    if req.op == XferOp::Retire {
        return refuse(ErrorCode::INVALID_PARAMS);
    }
    // The request names the granted range itself.
    let whole = XferRequest { offset: req.grant_offset, len: req.grant_len, ..req };
    if let Err(code) = guard.authorize(&whole, &mut Default::default()) {
        return refuse(code);
    }
    let Some(m) = registry.get(req.segment) else { return refuse(ErrorCode::SEGMENT_NOT_FOUND) };
    if m.incarnation_of(req.grant_offset, req.grant_len as usize) != req.incarnation {
        return refuse(ErrorCode::RANGE_REUSED);
    }
    if !m.is_shareable() {
        // A segment over a user's file: the peer goes over TCP (see `Mapping::over_file`).
        return refuse(ErrorCode::NOT_SUPPORTED);
    }
    let fd = m.fd_for_peer(req.op == XferOp::Write)?;
    send_with_fd(s, &encode_answer(Ok(m.len() as u64)), &fd)?;
    Ok(())
}

/// The peer's side: asks the holder of `r` on this host for a mapping of its segment, writable
/// if `write`. `Ok(None)` when the holder has no socket this process can reach (another user's
/// process, another runtime directory, or no longer running): the caller goes over TCP.
pub(crate) fn request_mapping(r: &ReplicaDesc, write: bool) -> Result<Option<Mapping>, TransferError> {
    let Some(port) = r.endpoint.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()) else {
        return Ok(None);
    };
    let s = match UnixStream::connect(socket_path(port)) {
        Ok(s) => s,
        Err(_) => return Ok(None),
    };
    let (holder_uid, holder_pid) = peer_cred(&s)?;
    if holder_uid != uid() {
        return Ok(None);
    }
    s.set_read_timeout(Some(EXCHANGE_TIMEOUT))?;
    s.set_write_timeout(Some(EXCHANGE_TIMEOUT))?;
    let op = if write { XferOp::Write } else { XferOp::Read };
    let req = XferRequest {
        op,
        segment: r.segment,
        offset: r.offset,
        len: r.len,
        incarnation: r.incarnation,
        gen: r.gen,
        grant_offset: r.offset,
        grant_len: r.len,
        cap: r.cap,
    };
    (&s).write_all(&req.encode())?;
    let mut answer = [0u8; ANSWER_LEN];
    let fd = recv_with_fd(&s, &mut answer)?;
    decode_answer(&answer)?;
    let fd = fd.ok_or_else(|| TransferError::Protocol("the holder answered without a descriptor".into()))?;
    match Mapping::from_fd(fd, write, holder_pid) {
        // A holder of another build (its segment layout differs, as during a rolling upgrade):
        // TCP instead, which both understand.
        Err(TransferError::InvalidRange(why)) if why.contains("generation layout version") => {
            tracing::debug!(%why, "a same-host peer of another build: over TCP");
            Ok(None)
        }
        r => r.map(Some),
    }
}
