//! The requesting side: moves bytes between this process's memory and replicas anywhere.
//!
//! For each replica it picks the cheapest transport: the segment is this process's own
//! (one memcpy), another process's on this host (map it, one memcpy), or remote (TCP).
//! Large TCP transfers are split into slices moved over several connections at once.

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tycho_proto::auth::capability::RIGHT_RETIRE;
use tycho_proto::auth::handshake::{self, Identity, Service};
use tycho_proto::auth::stream::{StreamSession, STREAM_TAG_LEN};
use tycho_proto::auth::{ResolvedAuth, Secret};
use tycho_proto::{ErrorCode, ReplicaDesc, SegmentId};

use crate::error::TransferError;
use crate::registry::SegmentRegistry;
use crate::segment::Mapping;
use crate::wire::{
    decode_answer, decrypt_sealed, push_body, push_head, recv_head, recv_sealed, sealed_head, send_all_more,
    send_sealed, XferOp, XferRequest, ANSWER_LEN, FLAG_ENCRYPT, MAX_REQUEST_BYTES, SMALL_PAYLOAD,
};

/// TCP transfers above this size are split into slices of this size.
pub const SLICE_BYTES: usize = 4 << 20;
/// Most slices or batch parts in flight at once from one call.
pub const MAX_PARALLEL: usize = 4;
/// Below this many bytes in total, a batch runs on the caller's thread alone: starting threads
/// costs more than it saves.
const PARALLEL_THRESHOLD: usize = 1 << 20;
/// How long a retire over TCP waits for its answer.
const RETIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long a peer's transfer server has to complete the connection greeting.
const GREETING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// Idle connections kept per peer.
const MAX_IDLE_PER_PEER: usize = 16;
/// How long an idle connection stays in the pool: well within a server's idle timeout
/// ([`crate::server::DEFAULT_IDLE_TIMEOUT`]), so that a pooled connection is seldom one the
/// server has closed (and one that was is replaced transparently).
pub const POOL_IDLE: std::time::Duration = std::time::Duration::from_secs(20);

/// How bytes reach a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The segment belongs to this process.
    Local,
    /// Another process on this host: mapped shared memory.
    SharedMemory,
    /// TCP to the segment's transfer server.
    Tcp,
}

/// One part of a batch: a read of a replica range into memory or a write of memory into it.
pub enum Part<'a> {
    /// Copy `dst.len()` bytes from `replica` at object offset `at` into `dst`.
    Read {
        /// Source replica.
        replica: &'a ReplicaDesc,
        /// Offset inside the object.
        at: u64,
        /// Destination.
        dst: &'a mut [u8],
    },
    /// Copy `src` into `replica` at object offset `at`.
    Write {
        /// Destination replica.
        replica: &'a ReplicaDesc,
        /// Offset inside the object.
        at: u64,
        /// Source.
        src: &'a [u8],
    },
}

impl Part<'_> {
    fn len(&self) -> usize {
        match self {
            Part::Read { dst, .. } => dst.len(),
            Part::Write { src, .. } => src.len(),
        }
    }
}

/// Same-host replicas that go over TCP: those of holders this process cannot reach by socket,
/// and segments their holder does not share.
#[derive(Default)]
struct NoLocal {
    endpoints: std::collections::HashSet<String>,
    segments: std::collections::HashSet<SegmentId>,
}

impl NoLocal {
    fn excludes(&self, r: &ReplicaDesc) -> bool {
        self.endpoints.contains(&r.endpoint) || self.segments.contains(&r.segment)
    }
}

/// Moves bytes to and from replicas.
pub struct TransferEngine {
    host: String,
    force_tcp: bool,
    auth: ResolvedAuth,
    local: Arc<SegmentRegistry>,
    /// Payloads over TCP travel encrypted ([`FLAG_ENCRYPT`]).
    encrypt: bool,
    /// Who this process is, proved in every transfer greeting (nodes count connections per
    /// client).
    identity: Option<Identity>,
    idle: Mutex<HashMap<String, Vec<(Conn, std::time::Instant)>>>,
    mapped: Mutex<HashMap<SegmentId, Arc<Mapping>>>,
    /// Same-host endpoints whose holder has no local socket this process can reach (another
    /// user's process): their replicas go over TCP.
    /// And same-host segments their holder does not share by mapping (segments over a file).
    no_local: Mutex<NoLocal>,
}

impl TransferEngine {
    /// An engine for a process on `host` that serves `local`; `force_tcp` disables the
    /// shared-memory transports (for tests and benchmarks). With a `secret`, every connection
    /// to a peer proves it, and the peer must prove it back.
    pub fn new(
        host: &str,
        force_tcp: bool,
        local: Arc<SegmentRegistry>,
        secret: Option<Arc<Secret>>,
    ) -> TransferEngine {
        TransferEngine {
            host: host.to_string(),
            force_tcp,
            auth: ResolvedAuth { secret, origin: "the client's cluster secret".into() },
            encrypt: false,
            identity: None,
            local,
            idle: Mutex::new(HashMap::new()),
            mapped: Mutex::new(HashMap::new()),
            no_local: Mutex::new(NoLocal::default()),
        }
    }

    /// Encrypts payloads over TCP (on an authenticated connection: without a secret there are no
    /// keys, and an encrypted request is refused).
    pub fn with_encryption(mut self, encrypt: bool) -> TransferEngine {
        self.encrypt = encrypt;
        self
    }

    /// Proves `identity` (a registered client's id and credential) in every transfer greeting.
    pub fn with_identity(mut self, identity: Option<Identity>) -> TransferEngine {
        self.identity = identity;
        self
    }

    /// The transport a transfer to `r` would use.
    pub fn transport_for(&self, r: &ReplicaDesc) -> Transport {
        if self.force_tcp {
            Transport::Tcp
        } else if self.local.get(r.segment).is_some() {
            Transport::Local
        } else if r.host == self.host && !self.no_local.lock().excludes(r) {
            Transport::SharedMemory
        } else {
            Transport::Tcp
        }
    }

    /// Runs every part; succeeds only if all of them do. Parts run in parallel when the batch
    /// is large enough to gain from it. A batch larger than [`streaming_threshold`](crate::copy::streaming_threshold) in total copies
    /// with streaming stores, as one part of that size does.
    pub fn run(&self, parts: Vec<Part<'_>>) -> Result<(), TransferError> {
        let total: usize = parts.iter().map(Part::len).sum();
        let streaming = total >= crate::copy::streaming_threshold();
        if parts.len() <= 1 || total < PARALLEL_THRESHOLD {
            return parts.into_iter().try_for_each(|p| self.run_part(p, streaming));
        }
        in_parallel(parts, |p| self.run_part(p, streaming))
    }

    /// Runs every part, as [`run`](Self::run) does, and reports each part's own result, so that
    /// a batch read can retry only the objects whose parts failed.
    pub fn run_each(&self, parts: Vec<Part<'_>>) -> Vec<Result<(), TransferError>> {
        let total: usize = parts.iter().map(Part::len).sum();
        let streaming = total >= crate::copy::streaming_threshold();
        if parts.len() <= 1 || total < PARALLEL_THRESHOLD {
            return parts.into_iter().map(|p| self.run_part(p, streaming)).collect();
        }
        each_in_parallel(parts, |p| self.run_part(p, streaming))
    }

    /// Reads `dst.len()` bytes of `replica` starting at object offset `at`.
    pub fn read(&self, replica: &ReplicaDesc, at: u64, dst: &mut [u8]) -> Result<(), TransferError> {
        let streaming = dst.len() >= crate::copy::streaming_threshold();
        self.run_part(Part::Read { replica, at, dst }, streaming)
    }

    /// Writes `src` into `replica` at object offset `at`.
    pub fn write(&self, replica: &ReplicaDesc, at: u64, src: &[u8]) -> Result<(), TransferError> {
        self.run_part(Part::Write { replica, at, src }, src.len() >= crate::copy::streaming_threshold())
    }

    /// Retires the range of `replica` (its value was replaced): readers holding its descriptor
    /// fail their generation check from now on.
    pub fn retire(&self, replica: &ReplicaDesc) -> Result<(), TransferError> {
        let len = usize::try_from(replica.len).map_err(|_| TransferError::InvalidRange("replica too large".into()))?;
        let mapped = match self.transport_for(replica) {
            Transport::Local => Some(self.local.get(replica.segment).ok_or(TransferError::SegmentNotFound)?),
            // A retire grant does not map a peer's segment writable (that takes a write grant):
            // its holder retires the range over TCP, or over a writable mapping already held.
            Transport::SharedMemory if replica.cap.rights & RIGHT_RETIRE == 0 => self.map_peer(replica, true)?,
            Transport::SharedMemory => self.cached_writable(replica),
            Transport::Tcp => None,
        };
        if let Some(m) = mapped {
            return m.retire(replica.offset, len, replica.incarnation, replica.gen);
        }
        let head = request(XferOp::Retire, replica, replica.offset, replica.len).encode();
        // A holder that does not answer (paused, partitioned) must not hold up the write that
        // retires: give up after a while; the connection is then dropped.
        let retire = |mut c: Conn| -> Result<(), Failure> {
            let unanswered = |e: std::io::Error| Failure::Unanswered(TransferError::Io(e));
            c.stream().set_read_timeout(Some(RETIRE_TIMEOUT)).map_err(unanswered)?;
            let (msg, n) = sealed_head(&head, c.keys.as_mut().map(|k| &mut k.send));
            c.stream().write_all(&msg[..n]).map_err(unanswered)?;
            let answer = c.recv_answer().map_err(Failure::first)?;
            c.stream().set_read_timeout(None).map_err(answered)?;
            let r = decode_answer(&answer).map(drop);
            self.release(&replica.endpoint, c);
            r.map_err(Failure::Answered)
        };
        let (c, pooled) = self.connection(&replica.endpoint)?;
        match retire(c) {
            // The peer closed the pooled connection while it sat idle: once more, on a new one.
            Err(Failure::Unanswered(_)) if pooled => retire(self.connect(&replica.endpoint)?),
            other => other,
        }
        .map_err(Failure::into_inner)
    }

    fn run_part(&self, part: Part<'_>, streaming: bool) -> Result<(), TransferError> {
        let (replica, at, len) = match &part {
            Part::Read { replica, at, dst } => (*replica, *at, dst.len()),
            Part::Write { replica, at, src } => (*replica, *at, src.len()),
        };
        if len == 0 || at.checked_add(len as u64).is_none_or(|end| end > replica.len) {
            return Err(TransferError::InvalidRange(format!(
                "{len} bytes at {at} of an object of {} bytes",
                replica.len
            )));
        }
        let offset = replica.offset + at;
        match self.transport_for(replica) {
            Transport::Local => {
                let m = self.local.get(replica.segment).ok_or(TransferError::SegmentNotFound)?;
                copy_checked(&m, replica, offset, part, streaming)
            }
            Transport::SharedMemory => {
                let write = matches!(part, Part::Write { .. });
                match self.map_peer(replica, write)? {
                    Some(m) => copy_checked(&m, replica, offset, part, streaming),
                    None => self.tcp(replica, offset, part),
                }
            }
            Transport::Tcp => self.tcp(replica, offset, part),
        }
    }

    /// A mapping of a same-host peer's segment, writable if `write`; `None` when the peer
    /// cannot hand one to this process (the caller goes over TCP).
    fn map_peer(&self, r: &ReplicaDesc, write: bool) -> Result<Option<Arc<Mapping>>, TransferError> {
        // Keyed by segment id: the memfd a holder passes is the segment's memory itself.
        if let Some(m) = self.mapped.lock().get(&r.segment) {
            let fits = m.len() as u64 >= r.offset + r.len;
            if fits && (m.is_writable() || !write) && m.peer_still_open() {
                return Ok(Some(m.clone()));
            }
        }
        let answer = crate::local::request_mapping(r, write);
        if let Err(TransferError::Remote(ErrorCode::NOT_SUPPORTED)) = answer {
            // The holder does not share this segment (it lies over a file): TCP for it alone.
            self.no_local.lock().segments.insert(r.segment);
            return Ok(None);
        }
        let Some(m) = answer? else {
            self.no_local.lock().endpoints.insert(r.endpoint.clone());
            return Ok(None);
        };
        let m = Arc::new(m);
        let mut mapped = self.mapped.lock();
        // A new segment is a good moment to let go of segments whose owners let them go, so
        // their memory is not kept alive by this process.
        mapped.retain(|_, old| old.peer_still_open());
        mapped.insert(r.segment, m.clone());
        Ok(Some(m))
    }

    /// A writable mapping of `r`'s segment this engine already holds, if any.
    fn cached_writable(&self, r: &ReplicaDesc) -> Option<Arc<Mapping>> {
        let mapped = self.mapped.lock();
        let m = mapped.get(&r.segment)?;
        (m.is_writable() && m.len() as u64 >= r.offset + r.len && m.peer_still_open()).then(|| m.clone())
    }

    /// How many same-host peers' segments this engine has mapped.
    pub fn local_mappings(&self) -> usize {
        self.mapped.lock().len()
    }

    /// Forgets cached peer mappings (a peer restarted and its paths now name other memory).
    pub fn forget_mappings(&self) {
        self.mapped.lock().clear();
        *self.no_local.lock() = NoLocal::default();
    }

    fn tcp(&self, r: &ReplicaDesc, offset: u64, part: Part<'_>) -> Result<(), TransferError> {
        let len = part.len();
        if len <= SLICE_BYTES {
            return self.tcp_one(r, offset, part);
        }
        // Split into slices and move them over several connections at once.
        let mut slices = Vec::new();
        match part {
            Part::Read { dst, .. } => {
                for (i, chunk) in dst.chunks_mut(SLICE_BYTES).enumerate() {
                    slices.push((offset + (i * SLICE_BYTES) as u64, Part::Read { replica: r, at: 0, dst: chunk }));
                }
            }
            Part::Write { src, .. } => {
                for (i, chunk) in src.chunks(SLICE_BYTES).enumerate() {
                    slices.push((offset + (i * SLICE_BYTES) as u64, Part::Write { replica: r, at: 0, src: chunk }));
                }
            }
        }
        in_parallel(slices, |(off, p)| self.tcp_one(r, off, p))
    }

    /// A connection to `endpoint`: the most recently used idle one that has not been idle for
    /// [`POOL_IDLE`] (the flag: it was pooled), else a new one.
    fn connection(&self, endpoint: &str) -> Result<(Conn, bool), TransferError> {
        {
            let mut idle = self.idle.lock();
            if let Some(list) = idle.get_mut(endpoint) {
                // Oldest first: those past the pool's limit go.
                list.retain(|(_, since)| since.elapsed() < POOL_IDLE);
                if let Some((c, _)) = list.pop() {
                    return Ok((c, true));
                }
            }
        }
        Ok((self.connect(endpoint)?, false))
    }

    fn connect(&self, endpoint: &str) -> Result<Conn, TransferError> {
        let mut s = TcpStream::connect(endpoint)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(GREETING_TIMEOUT))?;
        s.set_write_timeout(Some(GREETING_TIMEOUT))?;
        let keys = handshake::connect_stream(&mut s, Service::Transfer, &self.auth, self.identity.as_ref())?;
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)?;
        Ok(Conn::new(s, keys))
    }

    fn release(&self, endpoint: &str, c: Conn) {
        let mut idle = self.idle.lock();
        let list = idle.entry(endpoint.to_string()).or_default();
        if list.len() < MAX_IDLE_PER_PEER {
            list.push((c, std::time::Instant::now()));
        }
    }

    /// One request on one connection; `offset` is inside the segment. A pooled connection the
    /// peer closed while it sat idle fails before any answer comes: the request goes again, once,
    /// on a new connection (a read or write of the same range under the same grant does the same
    /// thing twice).
    fn tcp_one(&self, r: &ReplicaDesc, offset: u64, mut part: Part<'_>) -> Result<(), TransferError> {
        let (c, pooled) = self.connection(&r.endpoint)?;
        match self.exchange(c, r, offset, &mut part) {
            Err(Failure::Unanswered(e)) if pooled => {
                tracing::debug!(peer = %r.endpoint, error = %e, "a pooled transfer connection was closed; reconnecting");
                let c = self.connect(&r.endpoint)?;
                self.exchange(c, r, offset, &mut part).map_err(Failure::into_inner)
            }
            other => other.map_err(Failure::into_inner),
        }
    }

    fn exchange(&self, mut c: Conn, r: &ReplicaDesc, offset: u64, part: &mut Part<'_>) -> Result<(), Failure> {
        let len = part.len() as u64;
        debug_assert!(len <= MAX_REQUEST_BYTES);
        let op = if matches!(part, Part::Read { .. }) { XferOp::Read } else { XferOp::Write };
        let mut head = request(op, r, offset, len).encode();
        let encrypt = self.encrypt && c.keys.is_some();
        if encrypt {
            head[7] |= FLAG_ENCRYPT;
        }
        let unanswered = |e: std::io::Error| Unanswered(TransferError::Io(e));
        c.out.clear();
        push_head(&mut c.out, &head, c.keys.as_mut().map(|k| &mut k.send));
        match part {
            Part::Read { dst, .. } => {
                c.stream().write_all(&c.out).map_err(unanswered)?;
                let mut answer = [0u8; ANSWER_LEN];
                c.reader.read_exact(&mut answer).map_err(unanswered)?;
                // On an authenticated connection the answer's bytes are the body of its message.
                let mut sealer = c.keys.as_mut().map(|k| k.recv.begin(&answer));
                let n = decode_answer(&answer);
                match (n, sealer.as_mut()) {
                    (Ok(n), _) if n != len => {
                        return Err(Answered(TransferError::Protocol(format!("asked for {len} bytes, peer sends {n}"))))
                    }
                    (Ok(_), None) => {
                        c.reader.read_exact(dst).map_err(answered)?;
                        let trailer = recv_head::<ANSWER_LEN>(&mut c.reader, None).map_err(Answered)?;
                        if let Err(e) = decode_answer(&trailer) {
                            // The bytes are not the object's; the connection stays in step.
                            self.release(&r.endpoint, c);
                            return Err(Answered(e));
                        }
                    }
                    (Ok(_), Some(sealer)) => {
                        recv_sealed(dst, sealer, |piece| c.reader.read_exact(piece)).map_err(answered)?;
                        let mut tag = [0u8; STREAM_TAG_LEN];
                        c.reader.read_exact(&mut tag).map_err(answered)?;
                        let bytes_ok = sealer.check(&tag);
                        let keys = c.keys.as_mut().map(|k| &mut k.recv);
                        let trailer = recv_head::<ANSWER_LEN>(&mut c.reader, keys).map_err(Answered)?;
                        if let Err(e) = decode_answer(&trailer) {
                            // The range was reused while it was sent: thrown away, the
                            // connection in step.
                            self.release(&r.endpoint, c);
                            return Err(Answered(e));
                        }
                        if !bytes_ok {
                            return Err(Answered(TransferError::BadTag("a read's bytes")));
                        }
                        if encrypt {
                            decrypt_sealed(dst, sealer);
                        }
                    }
                    (Err(e), sealer) => {
                        if let Some(sealer) = sealer {
                            let mut tag = [0u8; STREAM_TAG_LEN];
                            c.reader.read_exact(&mut tag).map_err(answered)?;
                            if !sealer.check(&tag) {
                                return Err(Answered(TransferError::BadTag("an answer")));
                            }
                        }
                        // A refusal leaves the connection in step: keep it.
                        self.release(&r.endpoint, c);
                        return Err(Answered(e));
                    }
                }
            }
            Part::Write { src, .. } => {
                let mut sealer = c.keys.as_mut().map(|k| k.send.begin(&[]));
                if src.len() <= SMALL_PAYLOAD {
                    // Head, bytes and tag in one call.
                    let mut out = std::mem::take(&mut c.out);
                    push_body(&mut out, src, sealer.as_mut(), encrypt);
                    let sent = c.stream().write_all(&out);
                    c.out = out;
                    sent.map_err(unanswered)?;
                } else {
                    // The head goes with the bytes, so the node wakes once for both.
                    let stream = c.reader.get_ref();
                    send_all_more(stream, &c.out).map_err(unanswered)?;
                    match sealer.as_mut() {
                        None => (&*stream).write_all(src).map_err(unanswered)?,
                        Some(sealer) => {
                            send_sealed(src, sealer, encrypt, &mut c.scratch, |piece| send_all_more(stream, piece))
                                .map_err(unanswered)?;
                            (&*stream).write_all(&sealer.finish()).map_err(unanswered)?;
                        }
                    }
                }
                let answer = c.recv_answer().map_err(Failure::first)?;
                if let Err(e) = decode_answer(&answer) {
                    self.release(&r.endpoint, c);
                    return Err(Answered(e));
                }
            }
        }
        self.release(&r.endpoint, c);
        Ok(())
    }
}

/// Bytes a connection reads ahead: a small read's answer, bytes, tags and trailer arrive in one
/// call.
const READ_AHEAD: usize = SMALL_PAYLOAD + 256;

/// A transfer connection as a client holds it.
struct Conn {
    /// The socket, read through a buffer, written directly ([`stream`](Self::stream)).
    reader: BufReader<TcpStream>,
    /// The keys sealing its messages (`None`: an insecure cluster).
    keys: Option<StreamSession>,
    /// A request being assembled.
    out: Vec<u8>,
    /// Where an encrypted payload is sealed before it is sent.
    scratch: Vec<u8>,
}

impl Conn {
    fn new(stream: TcpStream, keys: Option<StreamSession>) -> Conn {
        Conn { reader: BufReader::with_capacity(READ_AHEAD, stream), keys, out: Vec::new(), scratch: Vec::new() }
    }

    fn stream(&self) -> &TcpStream {
        self.reader.get_ref()
    }

    /// Reads an answer (sealed on an authenticated connection).
    fn recv_answer(&mut self) -> Result<[u8; ANSWER_LEN], TransferError> {
        recv_head(&mut self.reader, self.keys.as_mut().map(|k| &mut k.recv))
    }
}

/// How one exchange failed: before the peer answered anything (the connection may have been
/// closed while it sat in the pool), or after.
enum Failure {
    Unanswered(TransferError),
    Answered(TransferError),
}
use Failure::{Answered, Unanswered};

impl Failure {
    fn into_inner(self) -> TransferError {
        match self {
            Unanswered(e) | Answered(e) => e,
        }
    }

    /// Failing to read the first answer: unanswered if nothing came at all.
    fn first(e: TransferError) -> Failure {
        match e {
            TransferError::Io(_) => Unanswered(e),
            e => Answered(e),
        }
    }
}

fn answered(e: std::io::Error) -> Failure {
    Answered(TransferError::Io(e))
}

/// The request header moving `len` bytes at segment offset `offset` of replica `r`, with the
/// replica's capability.
fn request(op: XferOp, r: &ReplicaDesc, offset: u64, len: u64) -> XferRequest {
    XferRequest {
        op,
        segment: r.segment,
        offset,
        len,
        incarnation: r.incarnation,
        gen: r.gen,
        grant_offset: r.offset,
        grant_len: r.len,
        cap: r.cap,
    }
}

/// CPUs this process may run on right now (its affinity mask, not the machine's size): extra
/// threads on a process pinned to one CPU only add switches.
fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `work` on every item with up to [`MAX_PARALLEL`] threads (the caller's among them);
/// succeeds only if every item does.
fn in_parallel<T: Send>(
    items: Vec<T>,
    work: impl Fn(T) -> Result<(), TransferError> + Sync,
) -> Result<(), TransferError> {
    let threads = usable_cpus().min(MAX_PARALLEL).min(items.len());
    if threads <= 1 {
        return items.into_iter().try_for_each(work);
    }
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let next = AtomicUsize::new(0);
    let worker = || -> Result<(), TransferError> {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = slots.get(i) else { return Ok(()) };
            let item = slot.lock().take().expect("each item is taken once");
            work(item)?;
        }
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads).map(|_| s.spawn(worker)).collect();
        let mut result = worker();
        for h in helpers {
            let r = h.join().unwrap_or_else(|_| Err(TransferError::Protocol("transfer thread panicked".into())));
            result = result.and(r);
        }
        result
    })
}

/// Runs `work` on every item with up to [`MAX_PARALLEL`] threads (the caller's among them);
/// one result per item, in order.
fn each_in_parallel<T: Send>(
    items: Vec<T>,
    work: impl Fn(T) -> Result<(), TransferError> + Sync,
) -> Vec<Result<(), TransferError>> {
    let threads = usable_cpus().min(MAX_PARALLEL).min(items.len());
    if threads <= 1 {
        return items.into_iter().map(work).collect();
    }
    let n = items.len();
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    let results: Vec<Mutex<Option<Result<(), TransferError>>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let worker = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = slots.get(i) else { return };
        let item = slot.lock().take().expect("each item is taken once");
        *results[i].lock() = Some(work(item));
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads).map(|_| s.spawn(worker)).collect();
        worker();
        for h in helpers {
            let _ = h.join();
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap_or_else(|| Err(TransferError::Protocol("transfer thread panicked".into()))))
        .collect()
}

/// Copies at or above this size are split between two threads: one core alone cannot
/// saturate the memory bus on this class of machine.
pub const PARALLEL_COPY_BYTES: usize = 8 << 20;

/// A copy between a mapping and memory that honours the range's generation: a write stamps
/// it on its blocks first, a read counts only if they still carry it afterwards. A large copy
/// is split between two threads, each of which stamps or checks its own half.
fn copy_checked(
    m: &Mapping,
    r: &ReplicaDesc,
    offset: u64,
    part: Part<'_>,
    streaming: bool,
) -> Result<(), TransferError> {
    let (inc, gen) = (r.incarnation, r.gen);
    let read = |off: u64, dst: &mut [u8]| -> Result<(), TransferError> {
        m.read_with(off, dst, streaming)?;
        m.verify(off, dst.len(), inc, gen)
    };
    let write = |off: u64, src: &[u8]| -> Result<(), TransferError> {
        m.stamp_with(off, src.len(), inc, gen, streaming)?;
        m.write_with(off, src, streaming)
    };
    let len = part.len();
    if len < PARALLEL_COPY_BYTES || usable_cpus() < 2 {
        return match part {
            Part::Read { dst, .. } => read(offset, dst),
            Part::Write { src, .. } => write(offset, src),
        };
    }
    // Two halves, split on a page boundary (so on a block boundary too); the caller's thread
    // copies one of them.
    let half = (len / 2).next_multiple_of(4096).min(len);
    let joined = |h: std::thread::ScopedJoinHandle<'_, Result<(), TransferError>>| {
        h.join().unwrap_or_else(|_| Err(TransferError::Protocol("copy thread panicked".into())))
    };
    std::thread::scope(|s| match part {
        Part::Read { dst, .. } => {
            let (a, b) = dst.split_at_mut(half);
            let other = s.spawn(move || read(offset + half as u64, b));
            let first = read(offset, a);
            first.and(joined(other))
        }
        Part::Write { src, .. } => {
            let (a, b) = src.split_at(half);
            let other = s.spawn(move || write(offset + half as u64, b));
            let first = write(offset, a);
            first.and(joined(other))
        }
    })
}
