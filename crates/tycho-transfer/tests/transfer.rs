//! Transfer server and engine over real loopback TCP and real shared memory.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use tycho_proto::auth::capability::{
    unix_ms, Capability, SegmentKey, CLOCK_SKEW_MS, RIGHT_READ, RIGHT_RETIRE, RIGHT_WRITE,
};
use tycho_proto::auth::handshake::{self, Service};
use tycho_proto::auth::stream::StreamSession;
use tycho_proto::auth::{ResolvedAuth, Secret};
use tycho_proto::{ErrorCode, ReplicaDesc, SegmentId};
use tycho_transfer::wire::{
    answer_len, decode_answer, recv_head, sealed_head, XferOp, XferRequest, ANSWER_LEN, REQUEST_LEN,
};
use tycho_transfer::*;

fn secret() -> Arc<Secret> {
    Arc::new(Secret::from_text(b"transfer-test-cluster-secret-of-enough-length").unwrap())
}

/// An engine of a process on `host` holding the cluster secret.
fn engine(host: &str, force_tcp: bool) -> TransferEngine {
    TransferEngine::new(host, force_tcp, Arc::new(SegmentRegistry::default()), Some(secret()))
}

/// A capability for `len` bytes at `offset` of segment 1 in incarnation `inc`, allocated under
/// generation 1, as a master would mint it.
fn grant(inc: u32, offset: u64, len: u64, rights: u8, expires_ms: u64, epoch: u64) -> Capability {
    grant_on(1, inc, offset, len, rights, expires_ms, epoch)
}

/// [`grant`] on segment `seg`.
fn grant_on(seg: u128, inc: u32, offset: u64, len: u64, rights: u8, expires_ms: u64, epoch: u64) -> Capability {
    grant_gen(seg, inc, offset, len, 1, rights, expires_ms, epoch)
}

/// [`grant_on`] for a range allocated under generation `gen`.
#[allow(clippy::too_many_arguments)]
fn grant_gen(
    seg: u128,
    inc: u32,
    offset: u64,
    len: u64,
    gen: u32,
    rights: u8,
    expires_ms: u64,
    epoch: u64,
) -> Capability {
    let base = Capability { rights, expires_ms, epoch, group: 0, tenant: 0, mac: [0; 16] };
    SegmentKey::new(&secret(), SegmentId(seg), inc).mint(offset, len, gen, base)
}

/// A raw connection that has passed the greeting with the cluster secret, with its keys.
struct Raw {
    s: TcpStream,
    keys: StreamSession,
    /// The bytes of the last read answered with its trailer.
    body: Vec<u8>,
}

fn raw(p: &Peer) -> Raw {
    let mut s = TcpStream::connect(p.server.local_addr()).unwrap();
    let auth = ResolvedAuth { secret: Some(secret()), origin: "test".into() };
    let keys = handshake::connect_stream(&mut s, Service::Transfer, &auth, None).unwrap().expect("authenticated");
    Raw { s, keys, body: Vec::new() }
}

impl Raw {
    /// Sends a request, sealed, and for a write its payload.
    fn send(&mut self, req: &XferRequest, payload: &[u8]) {
        let (msg, n) = sealed_head(&req.encode(), Some(&mut self.keys.send));
        self.s.write_all(&msg[..n]).unwrap();
        if req.op == XferOp::Write {
            let mut sealer = self.keys.send.begin(&[]);
            sealer.absorb(payload);
            self.s.write_all(payload).unwrap();
            self.s.write_all(&sealer.finish()).unwrap();
        }
    }

    /// A request and its answer, every tag checked; a read's bytes land in `body` (and its
    /// trailer's verdict is the result).
    fn ask(&mut self, req: &XferRequest, payload: &[u8]) -> Result<u64, TransferError> {
        self.send(req, payload);
        let mut answer = [0u8; ANSWER_LEN];
        self.s.read_exact(&mut answer).unwrap();
        let body = if req.op == XferOp::Read { answer_len(&answer) } else { 0 };
        let mut sealer = self.keys.recv.begin(&answer);
        self.body = vec![0u8; body as usize];
        self.s.read_exact(&mut self.body).unwrap();
        sealer.absorb(&self.body);
        let mut tag = [0u8; 16];
        self.s.read_exact(&mut tag).unwrap();
        assert!(sealer.check(&tag), "the answer's tag");
        let n = decode_answer(&answer)?;
        if req.op == XferOp::Read {
            let trailer = recv_head::<ANSWER_LEN>(&mut self.s, Some(&mut self.keys.recv)).unwrap();
            return decode_answer(&trailer);
        }
        Ok(n)
    }
}

struct Peer {
    registry: Arc<SegmentRegistry>,
    server: TransferServer,
    mapping: Arc<Mapping>,
}

fn peer(size: usize) -> Peer {
    let registry = Arc::new(SegmentRegistry::default());
    let mapping = Arc::new(Mapping::create("test", size).unwrap());
    registry.register(SegmentId(1), mapping.clone());
    let server = TransferServer::start("127.0.0.1:0", registry.clone(), Some(secret())).unwrap();
    Peer { registry, server, mapping }
}

fn replica(p: &Peer, offset: u64, len: u64, host: &str) -> ReplicaDesc {
    let inc = p.mapping.incarnation();
    ReplicaDesc {
        cap: grant(inc, offset, len, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1),
        segment: SegmentId(1),
        offset,
        len,
        endpoint: p.server.local_addr().to_string(),
        host: host.into(),
        incarnation: inc,
        gen: 1,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn tcp_and_shared_memory_move_the_same_bytes() {
    let p = peer(64 << 20);
    let tcp = engine("here", true);
    let shm = engine("here", false);
    // 20 MiB: split into slices over several connections.
    let r = replica(&p, 4096, 20 << 20, "here");
    assert_eq!(tcp.transport_for(&r), Transport::Tcp);
    assert_eq!(shm.transport_for(&r), Transport::SharedMemory);
    let data = pattern(20 << 20, 7);
    tcp.write(&r, 0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    shm.read(&r, 0, &mut back).unwrap();
    assert!(back == data);
    let data2 = pattern(20 << 20, 9);
    shm.write(&r, 0, &data2).unwrap();
    back.fill(0);
    tcp.read(&r, 0, &mut back).unwrap();
    assert!(back == data2);
    // A range inside the object.
    let mut mid = vec![0u8; 1000];
    tcp.read(&r, 5000, &mut mid).unwrap();
    assert_eq!(&mid[..], &data2[5000..6000]);
    // Another host's replica goes over TCP even without forcing.
    assert_eq!(shm.transport_for(&replica(&p, 0, 10, "elsewhere")), Transport::Tcp);
}

#[test]
fn bad_requests_are_refused_and_the_connection_survives() {
    let p = peer(1 << 20);
    let mut s = raw(&p);
    let mut ask = |op, segment, offset, len, payload: &[u8]| {
        let cap = grant_on(segment, 0, offset, len, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1);
        let req = XferRequest {
            op,
            segment: SegmentId(segment),
            offset,
            len,
            incarnation: 0,
            gen: 1,
            grant_offset: offset,
            grant_len: len,
            cap,
        };
        s.ask(&req, payload)
    };
    // Out of range, unknown segment, zero length: each refused with a code.
    assert!(matches!(
        ask(XferOp::Write, 1, (1 << 20) - 2, 4, b"abcd"),
        Err(TransferError::Remote(ErrorCode::INVALID_PARAMS))
    ));
    assert!(matches!(ask(XferOp::Write, 2, 0, 4, b"abcd"), Err(TransferError::SegmentNotFound)));
    assert!(matches!(ask(XferOp::Read, 1, 0, 0, b""), Err(TransferError::Remote(ErrorCode::INVALID_PARAMS))));
    // Nothing was written.
    let mut head = [1u8; 4];
    p.mapping.read((1 << 20) - 4, &mut head).unwrap();
    assert_eq!(head, [0; 4]);
    // The same connection still works.
    assert_eq!(ask(XferOp::Write, 1, 0, 4, b"wxyz").unwrap(), 4);
    assert_eq!(ask(XferOp::Read, 1, 0, 4, b"").unwrap(), 4);
    assert_eq!(&s.body, b"wxyz");
}

/// A range freed and handed to a new write while a reader still holds the old descriptor:
/// the old reader fails with RANGE_REUSED over TCP and over shared memory, never with foreign
/// bytes; the new descriptor reads the new bytes. A remount fails every old descriptor.
#[test]
fn reads_of_a_reused_range_fail_instead_of_returning_foreign_bytes() {
    let p = peer(1 << 20);
    let tcp = engine("here", true);
    let shm = engine("here", false);
    let old = replica(&p, 4096, 8192, "here");
    shm.write(&old, 0, &pattern(8192, 1)).unwrap();
    let mut out = vec![0u8; 8192];
    tcp.read(&old, 0, &mut out).unwrap();
    assert_eq!(out, pattern(8192, 1));
    // The object goes; a 100-byte value of generation 2 lands in the middle of its range.
    let cap = grant_gen(1, old.incarnation, 8192, 100, 2, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1);
    let new = ReplicaDesc { offset: 8192, len: 100, gen: 2, cap, ..old.clone() };
    tcp.write(&new, 0, &pattern(100, 2)).unwrap();
    for engine in [&tcp, &shm] {
        let err = engine.read(&old, 0, &mut out).unwrap_err();
        assert_eq!(err.code(), ErrorCode::RANGE_REUSED);
        assert_eq!(err.code().retry_class(), tycho_proto::RetryClass::RetrySame);
        // The part of the old range the new value does not touch still reads.
        engine.read(&old, 0, &mut out[..4096]).unwrap();
        let mut v = vec![0u8; 100];
        engine.read(&new, 0, &mut v).unwrap();
        assert_eq!(v, pattern(100, 2));
    }
    // The owner remounts: descriptors of the old incarnation fail, reads and writes alike.
    let inc = p.mapping.bump_incarnation();
    let mut v = vec![0u8; 100];
    for engine in [&tcp, &shm] {
        assert_eq!(engine.read(&new, 0, &mut v).unwrap_err().code(), ErrorCode::RANGE_REUSED);
        assert_eq!(engine.write(&new, 0, &v).unwrap_err().code(), ErrorCode::RANGE_REUSED);
    }
    let cap = grant(inc, new.offset, new.len, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1);
    let fresh = ReplicaDesc { incarnation: inc, gen: 1, cap, ..new };
    tcp.write(&fresh, 0, &pattern(100, 3)).unwrap();
    shm.read(&fresh, 0, &mut v).unwrap();
    assert_eq!(v, pattern(100, 3));
}

/// A reader that kept its grant after the range went to another object gets not one byte of
/// the new object: the holder checks the grant's generation before it sends, and refuses.
/// (Over a raw connection, which would see any byte the server sent.) The grant cannot be
/// reworded for the new generation: the generation is under its MAC.
#[test]
fn a_kept_grant_reads_nothing_of_the_next_object() {
    let p = peer(1 << 20);
    let e = engine("there", true);
    let old = replica(&p, 8192, 4096, "here");
    e.write(&old, 0, &pattern(4096, 1)).unwrap();
    // The range is reused by generation 2.
    let cap = grant_gen(1, old.incarnation, 8192, 4096, 2, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1);
    let new = ReplicaDesc { gen: 2, cap, ..old.clone() };
    e.write(&new, 0, &pattern(4096, 2)).unwrap();
    let mut s = raw(&p);
    let mut ask = |gen: u32, cap: Capability| {
        let req = XferRequest {
            op: XferOp::Read,
            segment: SegmentId(1),
            offset: 8192,
            len: 4096,
            incarnation: old.incarnation,
            gen,
            grant_offset: 8192,
            grant_len: 4096,
            cap,
        };
        let r = s.ask(&req, b"");
        assert!(r.is_ok() || s.body.is_empty(), "bytes sent with a refusal");
        r
    };
    // The kept grant: refused before any byte (the next thing on the connection is the next
    // answer, not data).
    assert!(matches!(ask(1, old.cap), Err(TransferError::Remote(ErrorCode::RANGE_REUSED))));
    // The kept grant claiming the new generation: its MAC no longer matches.
    assert!(matches!(ask(2, old.cap), Err(TransferError::Remote(ErrorCode::CAPABILITY_INVALID))));
    // The new object's own grant reads its bytes, on the same connection.
    assert_eq!(ask(2, new.cap).unwrap(), 4096);
    assert_eq!(s.body, pattern(4096, 2));
}

#[test]
fn retiring_takes_a_retire_grant_which_neither_writes_nor_reads() {
    let p = peer(1 << 20);
    let e = engine("there", true);
    let r = replica(&p, 4096, 4096, "here");
    e.write(&r, 0, &pattern(4096, 3)).unwrap();
    let retire_cap = grant(r.incarnation, 4096, 4096, RIGHT_RETIRE, unix_ms() + 60_000, 1);
    let retire_only = ReplicaDesc { cap: retire_cap, ..r.clone() };
    // A write grant does not retire; a retire grant neither writes nor reads.
    assert_eq!(e.retire(&r).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    assert_eq!(e.write(&retire_only, 0, &[9; 16]).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    let mut back = vec![0u8; 4096];
    assert_eq!(e.read(&retire_only, 0, &mut back).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    e.read(&r, 0, &mut back).unwrap();
    assert_eq!(back, pattern(4096, 3), "nothing was written");
    // It retires: a reader of the old descriptor fails from then on.
    e.retire(&retire_only).unwrap();
    assert_eq!(e.read(&r, 0, &mut back).unwrap_err().code(), ErrorCode::RANGE_REUSED);
    // Same host: a retire grant maps nothing writable, it retires over TCP.
    let shm = engine("here", false);
    assert_eq!(shm.transport_for(&retire_only), Transport::SharedMemory);
    shm.retire(&retire_only).unwrap();
    assert_eq!(shm.local_mappings(), 0);
}

#[test]
fn a_transfer_is_cut_off_at_its_capability_deadline() {
    // A reader that stops reading keeps the holder's thread blocked in its send; once the
    // capability's deadline passes, no more bytes leave and the connection is closed, long
    // before 32 MiB could have been sent.
    const LEN: usize = 32 << 20;
    let p = peer(LEN);
    let e = engine("there", true);
    let r = replica(&p, 0, LEN as u64, "here");
    e.write(&r, 0, &pattern(LEN, 5)).unwrap();
    // Expired 4.5 s ago by the minting clock: still accepted (clocks may differ by 5 s),
    // and its deadline is 0.5 s from now.
    let expires = unix_ms() + 500 - CLOCK_SKEW_MS;
    let cap = grant(r.incarnation, 0, LEN as u64, RIGHT_READ, expires, 1);
    let deadline = cap.deadline_ms();
    let mut s = raw(&p);
    let req = XferRequest {
        op: XferOp::Read,
        segment: SegmentId(1),
        offset: 0,
        len: LEN as u64,
        incarnation: r.incarnation,
        gen: 1,
        grant_offset: 0,
        grant_len: LEN as u64,
        cap,
    };
    s.send(&req, b"");
    let mut s = s.s;
    let mut answer = [0u8; ANSWER_LEN];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(decode_answer(&answer).unwrap(), LEN as u64, "accepted before its deadline");
    // The slow reader: nothing is read until the deadline has passed.
    while unix_ms() <= deadline + 200 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(got < LEN, "{got} bytes arrived of {LEN}: the send went on past its deadline");
    // The holder serves new connections as before.
    let mut back = vec![0u8; 4096];
    e.read(&r, 0, &mut back).unwrap();
    assert_eq!(back, pattern(4096, 5));
}

#[test]
fn unregistered_segment_is_refused() {
    let p = peer(1 << 20);
    let engine = engine("there", true);
    let r = replica(&p, 0, 100, "here");
    engine.write(&r, 0, &[1; 100]).unwrap();
    p.registry.unregister(SegmentId(1));
    let err = engine.write(&r, 0, &[2; 100]).unwrap_err();
    assert_eq!(err.code(), ErrorCode::SEGMENT_NOT_FOUND);
    let mut out = [0u8; 100];
    assert_eq!(engine.read(&r, 0, &mut out).unwrap_err().code(), ErrorCode::SEGMENT_NOT_FOUND);
}

#[test]
fn garbage_closes_only_its_connection() {
    let p = peer(1 << 20);
    let engine = engine("there", true);
    let r = replica(&p, 0, 10, "here");
    engine.write(&r, 0, b"0123456789").unwrap();
    let mut bad = raw(&p).s;
    bad.write_all(&[0xee; REQUEST_LEN + 16]).unwrap();
    let mut buf = Vec::new();
    assert_eq!(bad.read_to_end(&mut buf).unwrap(), 0, "server closes the garbage connection");
    let mut out = [0u8; 10];
    engine.read(&r, 0, &mut out).unwrap();
    assert_eq!(&out, b"0123456789");
}

#[test]
fn engine_checks_object_bounds_before_sending() {
    let p = peer(1 << 20);
    let engine = engine("there", true);
    let r = replica(&p, 0, 10, "here");
    assert_eq!(engine.write(&r, 5, &[0; 10]).unwrap_err().code(), ErrorCode::INVALID_PARAMS);
    assert_eq!(engine.write(&r, 0, &[]).unwrap_err().code(), ErrorCode::INVALID_PARAMS);
}

#[test]
fn batch_succeeds_only_if_every_part_does() {
    let p = peer(8 << 20);
    let engine = engine("there", true);
    let a = replica(&p, 0, 2 << 20, "here");
    let b = replica(&p, 2 << 20, 2 << 20, "here");
    let (da, db) = (pattern(2 << 20, 1), pattern(2 << 20, 2));
    engine
        .run(vec![Part::Write { replica: &a, at: 0, src: &da }, Part::Write { replica: &b, at: 0, src: &db }])
        .unwrap();
    let (mut ra, mut rb) = (vec![0u8; 2 << 20], vec![0u8; 2 << 20]);
    engine
        .run(vec![Part::Read { replica: &a, at: 0, dst: &mut ra }, Part::Read { replica: &b, at: 0, dst: &mut rb }])
        .unwrap();
    assert!(ra == da && rb == db);
    // A grant names its segment: one for segment 1 does not open segment 99; a real grant for
    // a segment this peer does not serve finds nothing.
    let foreign = ReplicaDesc { segment: SegmentId(99), ..a.clone() };
    let err = engine.run(vec![Part::Read { replica: &foreign, at: 0, dst: &mut rb }]).unwrap_err();
    assert_eq!(err.code(), ErrorCode::CAPABILITY_INVALID);
    let cap = grant_on(99, 0, a.offset, a.len, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1);
    let missing = ReplicaDesc { segment: SegmentId(99), cap, ..a.clone() };
    let err = engine
        .run(vec![
            Part::Read { replica: &a, at: 0, dst: &mut ra },
            Part::Read { replica: &missing, at: 0, dst: &mut rb },
        ])
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::SEGMENT_NOT_FOUND);
}

/// Every request needs the master's capability for a range containing it, with the right it
/// uses, unexpired, and (for writes) from a group epoch no older than one already seen;
/// anything else is refused with a typed code and changes nothing.
#[test]
fn transfers_need_a_capability_for_their_range() {
    let p = peer(1 << 20);
    let e = engine("there", true);
    let good = replica(&p, 8192, 4096, "here");
    e.write(&good, 0, &pattern(4096, 1)).unwrap();
    let mut out = vec![0u8; 4096];
    let refused = |r: &ReplicaDesc, want: ErrorCode| {
        let mut buf = vec![0u8; r.len as usize];
        assert_eq!(e.read(r, 0, &mut buf).unwrap_err().code(), want, "read {r:?}");
        assert_eq!(e.write(r, 0, &pattern(r.len as usize, 9)).unwrap_err().code(), want, "write {r:?}");
    };
    // No capability, a forged one, one for another range or segment generation.
    refused(&ReplicaDesc { cap: Capability::default(), ..good.clone() }, ErrorCode::CAPABILITY_INVALID);
    refused(
        &ReplicaDesc { cap: Capability { mac: [7; 16], ..good.cap }, ..good.clone() },
        ErrorCode::CAPABILITY_INVALID,
    );
    refused(&ReplicaDesc { offset: 0, len: 8192 + 4096, ..good.clone() }, ErrorCode::CAPABILITY_INVALID);
    refused(
        &ReplicaDesc { cap: Capability { expires_ms: u64::MAX, ..good.cap }, ..good.clone() },
        ErrorCode::CAPABILITY_INVALID,
    );
    let other_gen =
        ReplicaDesc { cap: grant(7, 8192, 4096, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1), ..good.clone() };
    refused(&other_gen, ErrorCode::CAPABILITY_INVALID);
    // Expired.
    let expired =
        ReplicaDesc { cap: grant(0, 8192, 4096, RIGHT_READ | RIGHT_WRITE, unix_ms() - 60_000, 1), ..good.clone() };
    refused(&expired, ErrorCode::CAPABILITY_EXPIRED);
    // A read grant does not write; a write grant does not read.
    let read_only = ReplicaDesc { cap: grant(0, 8192, 4096, RIGHT_READ, unix_ms() + 60_000, 1), ..good.clone() };
    e.read(&read_only, 0, &mut out).unwrap();
    assert_eq!(e.write(&read_only, 0, &out).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    assert_eq!(e.retire(&read_only).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    let write_only = ReplicaDesc { cap: grant(0, 8192, 4096, RIGHT_WRITE, unix_ms() + 60_000, 1), ..good.clone() };
    assert_eq!(e.read(&write_only, 0, &mut out).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    // A write granted under a newer epoch fences writes granted under older ones.
    let newer =
        ReplicaDesc { cap: grant(0, 8192, 4096, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 2), ..good.clone() };
    e.write(&newer, 0, &pattern(4096, 2)).unwrap();
    assert_eq!(e.write(&good, 0, &pattern(4096, 3)).unwrap_err().code(), ErrorCode::STALE_EPOCH);
    // None of the refused writes changed a byte.
    e.read(&good, 0, &mut out).unwrap();
    assert_eq!(out, pattern(4096, 2));
}

/// A connection must prove the cluster secret before any request: none, or another
/// cluster's, is refused with its reason; a client that holds a secret refuses a server that
/// cannot prove it.
#[test]
fn connections_must_prove_the_secret() {
    let p = peer(1 << 20);
    let r = replica(&p, 0, 100, "here");
    let mut out = [0u8; 100];
    let none = TransferEngine::new("there", true, Arc::new(SegmentRegistry::default()), None);
    let err = none.read(&r, 0, &mut out).unwrap_err();
    assert_eq!(err.code(), ErrorCode::AUTH_REQUIRED, "{err}");
    assert!(err.to_string().contains("TYCHO_SECRET_FILE"), "{err}");
    let other = Arc::new(Secret::from_text(b"another-cluster-secret-of-enough-length").unwrap());
    let wrong = TransferEngine::new("there", true, Arc::new(SegmentRegistry::default()), Some(other));
    assert_eq!(wrong.read(&r, 0, &mut out).unwrap_err().code(), ErrorCode::AUTH_FAILED);
    // Raw bytes without a greeting: the server answers its greeting, then closes.
    let mut s = TcpStream::connect(p.server.local_addr()).unwrap();
    s.write_all(&[0u8; 200]).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(buf.len() < 100, "only the greeting comes back, no data: {} bytes", buf.len());
    // A server without the secret is refused by a client holding one.
    let registry = Arc::new(SegmentRegistry::default());
    registry.register(SegmentId(1), p.mapping.clone());
    let open = TransferServer::start("127.0.0.1:0", registry, None).unwrap();
    let r2 = ReplicaDesc { endpoint: open.local_addr().to_string(), ..r.clone() };
    assert_eq!(engine("there", true).read(&r2, 0, &mut out).unwrap_err().code(), ErrorCode::AUTH_FAILED);
}

/// A same-host peer of the same user gets the segment's memfd over the holder's local socket
/// only with a grant: read-only for a read grant, writable for a write grant; no path is taken
/// from the descriptor. Without a reachable socket, the same replica goes over TCP.
#[test]
fn same_host_mappings_need_a_grant_and_fall_back_to_tcp_without_a_socket() {
    let p = peer(1 << 20);
    let shm = engine("here", false);
    let rw = replica(&p, 0, 4096, "here");
    shm.write(&rw, 0, &pattern(4096, 5)).unwrap();
    assert_eq!(shm.local_mappings(), 1, "the write went through a mapping");
    assert_eq!(shm.transport_for(&rw), Transport::SharedMemory);
    // A fresh engine with only a read grant maps read-only: it reads, but cannot write.
    let reader = engine("here", false);
    let ro = ReplicaDesc { cap: grant(rw.incarnation, 0, 4096, RIGHT_READ, unix_ms() + 60_000, 1), ..rw.clone() };
    let mut out = vec![0u8; 4096];
    reader.read(&ro, 0, &mut out).unwrap();
    assert_eq!(out, pattern(4096, 5));
    assert_eq!(reader.local_mappings(), 1);
    assert_eq!(reader.write(&ro, 0, &out).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    // No grant, a forged one: no descriptor at all.
    let forger = engine("here", false);
    let none = ReplicaDesc { cap: Capability::default(), ..rw.clone() };
    assert_eq!(forger.read(&none, 0, &mut out).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    let forged = ReplicaDesc { cap: Capability { mac: [1; 16], ..rw.cap }, ..rw.clone() };
    assert_eq!(forger.write(&forged, 0, &out).unwrap_err().code(), ErrorCode::CAPABILITY_INVALID);
    assert_eq!(forger.local_mappings(), 0);
    // Without the holder's socket (as for another user's process), TCP carries the bytes.
    std::fs::remove_file(socket_path(p.server.local_addr().port())).unwrap();
    let other = engine("here", false);
    other.read(&rw, 0, &mut out).unwrap();
    assert_eq!(out, pattern(4096, 5));
    assert_eq!(other.local_mappings(), 0);
    assert_eq!(other.transport_for(&rw), Transport::Tcp);
}

/// A segment over a file is never handed to same-host peers: its holder answers their mapping
/// request NOT_SUPPORTED, and they read and write it over TCP (with their grant) from then on,
/// while the holder's memfd segments are still mapped.
#[test]
fn a_segment_over_a_file_is_reached_over_tcp_on_the_same_host() {
    let path = std::env::temp_dir().join(format!("tycho-transfer-file-{}", std::process::id()));
    let file = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    file.set_len(1 << 20).unwrap();
    let p = peer(1 << 20);
    let over_file = Arc::new(Mapping::over_file("test-file", &file, 0, 1 << 20).unwrap());
    p.registry.register(SegmentId(2), over_file.clone());
    let inc = over_file.incarnation();
    let on_file = ReplicaDesc {
        cap: grant_on(2, inc, 0, 4096, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1),
        segment: SegmentId(2),
        incarnation: inc,
        ..replica(&p, 0, 4096, "here")
    };
    let e = engine("here", false);
    assert_eq!(e.transport_for(&on_file), Transport::SharedMemory, "tried first, as for any same-host peer");
    e.write(&on_file, 0, &pattern(4096, 9)).unwrap();
    assert_eq!(e.local_mappings(), 0, "nothing mapped");
    assert_eq!(e.transport_for(&on_file), Transport::Tcp);
    let mut out = vec![0u8; 4096];
    e.read(&on_file, 0, &mut out).unwrap();
    assert_eq!(out, pattern(4096, 9));
    let mut in_file = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut in_file, 0).unwrap();
    assert_eq!(in_file, pattern(4096, 9), "the bytes are the file's");
    // The holder's memfd segment is still shared by mapping.
    let on_memfd = replica(&p, 0, 4096, "here");
    e.write(&on_memfd, 0, &pattern(4096, 3)).unwrap();
    assert_eq!(e.local_mappings(), 1);
    assert_eq!(e.transport_for(&on_memfd), Transport::SharedMemory);
}

/// A peer on `limits`, holding a segment of `size` bytes.
fn peer_with(size: usize, limits: ServerLimits) -> Peer {
    let registry = Arc::new(SegmentRegistry::default());
    let mapping = Arc::new(Mapping::create("test", size).unwrap());
    registry.register(SegmentId(1), mapping.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let server = TransferServer::serve_with(listener, registry.clone(), Some(secret()), limits).unwrap();
    Peer { registry, server, mapping }
}

/// Reads from `s` until the peer closes it; how long that took (`None`: still open after
/// `limit`).
fn closed_within(s: &mut TcpStream, limit: std::time::Duration) -> Option<std::time::Duration> {
    let started = std::time::Instant::now();
    let mut buf = [0u8; 256];
    loop {
        let left = limit.checked_sub(started.elapsed())?;
        s.set_read_timeout(Some(left.max(std::time::Duration::from_millis(1)))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Some(started.elapsed()),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if started.elapsed() >= limit {
                    return None;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Issue 45, finding 2: the greeting's deadline is for the whole greeting. Peers that trickle
/// it a byte at a time are cut when it passes, however often they send; a client that greets is
/// served meanwhile; past the cap on connections in their greeting, new ones are closed at once,
/// so that such peers never hold more than the cap of the server's threads.
#[test]
fn trickled_greetings_are_cut_at_the_deadline_and_capped_while_clients_are_served() {
    let limits = ServerLimits {
        greeting_timeout: std::time::Duration::from_secs(2),
        max_greeting: 8,
        ..ServerLimits::default()
    };
    let p = peer_with(1 << 20, limits);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Each sends a plausible greeting header one byte every 200 ms: with a timeout per read it
    // would be kept for as long as it went on.
    let trickle = || {
        let s = TcpStream::connect(p.server.local_addr()).unwrap();
        let (mut w, stop) = (s.try_clone().unwrap(), stop.clone());
        std::thread::spawn(move || {
            let head = [0x54u8, 0x59, 5, 2, 200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            for b in head.iter().cycle() {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || w.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        s
    };
    let mut tricklers: Vec<TcpStream> = (0..6).map(|_| trickle()).collect();
    // A client that greets is served while they trickle.
    let client = engine("there", true);
    let r = replica(&p, 0, 4096, "there");
    let data = pattern(4096, 3);
    client.write(&r, 0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    client.read(&r, 0, &mut back).unwrap();
    assert!(back == data);
    // Two more fill the cap (the client's connection finished its greeting and does not
    // count); the next is closed at once.
    tricklers.extend((0..2).map(|_| trickle()));
    let wait = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut ninth = loop {
        // The accept loop counts a connection once its thread starts: until the eighth has,
        // a new one may still be taken.
        let mut s = TcpStream::connect(p.server.local_addr()).unwrap();
        if closed_within(&mut s, std::time::Duration::from_millis(300)).is_some() {
            break s;
        }
        assert!(std::time::Instant::now() < wait, "connections past the greeting cap were kept");
    };
    assert!(closed_within(&mut ninth, std::time::Duration::from_millis(1)).is_some());
    for mut s in tricklers {
        let took = closed_within(&mut s, std::time::Duration::from_secs(10)).expect("a trickler was kept");
        assert!(took < std::time::Duration::from_secs(6), "a trickler was kept {took:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    client.read(&r, 0, &mut back).unwrap();
    assert!(back == data);
}

/// Issue 45, finding 3: an authenticated connection that sends no request for the idle
/// timeout is closed by the server, and a client whose pooled connection was closed that way
/// reconnects without its caller seeing anything.
#[test]
fn idle_connections_are_closed_and_clients_reconnect_transparently() {
    let limits = ServerLimits { idle_timeout: std::time::Duration::from_secs(1), ..ServerLimits::default() };
    let p = peer_with(1 << 20, limits);
    let mut idle = raw(&p).s;
    let took = closed_within(&mut idle, std::time::Duration::from_secs(10)).expect("an idle connection was kept");
    assert!(took >= std::time::Duration::from_millis(900), "closed after {took:?}, before the idle timeout");
    let client = engine("there", true);
    let r = replica(&p, 0, 4096, "there");
    let data = pattern(4096, 5);
    client.write(&r, 0, &data).unwrap();
    // The connection the write left in the pool is closed while it waits there.
    let mut probe = raw(&p).s;
    assert!(closed_within(&mut probe, std::time::Duration::from_secs(10)).is_some());
    let mut back = vec![0u8; data.len()];
    client.read(&r, 0, &mut back).unwrap();
    assert!(back == data);
    client.write(&r, 0, &pattern(4096, 6)).unwrap();
    client.read(&r, 0, &mut back).unwrap();
    assert!(back == pattern(4096, 6));
}

/// Issue 45, finding 4: a process holding the secret never talks to a peer that asks for none
/// (an impostor on a node's port): the write fails in the greeting and no byte of it reaches
/// the impostor's segment.
#[test]
fn an_impostor_node_that_asks_for_no_secret_gets_no_bytes() {
    let registry = Arc::new(SegmentRegistry::default());
    let mapping = Arc::new(Mapping::create("impostor", 1 << 20).unwrap());
    registry.register(SegmentId(1), mapping.clone());
    let server = TransferServer::start("127.0.0.1:0", registry, None).unwrap();
    let inc = mapping.incarnation();
    let r = ReplicaDesc {
        cap: grant(inc, 0, 4096, RIGHT_READ | RIGHT_WRITE, unix_ms() + 60_000, 1),
        segment: SegmentId(1),
        offset: 0,
        len: 4096,
        endpoint: server.local_addr().to_string(),
        host: "there".into(),
        incarnation: inc,
        gen: 1,
    };
    let err = engine("here", true).write(&r, 0, &pattern(4096, 1)).unwrap_err();
    assert!(matches!(err, TransferError::Handshake(handshake::HandshakeError::ServerInsecure { .. })), "{err}");
    assert_eq!(err.code(), ErrorCode::AUTH_FAILED);
    let mut seen = vec![0xffu8; 4096];
    // SAFETY: nothing writes the mapping now.
    seen.copy_from_slice(unsafe { mapping.slice(0, 4096) }.unwrap());
    assert!(seen.iter().all(|&b| b == 0), "bytes reached the impostor");
}
