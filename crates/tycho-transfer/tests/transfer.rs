//! Transfer server and engine over real loopback TCP and real shared memory.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use tycho_proto::{ErrorCode, ReplicaDesc, SegmentId};
use tycho_transfer::wire::{decode_answer, XferOp, XferRequest, ANSWER_LEN};
use tycho_transfer::*;

struct Peer {
    registry: Arc<SegmentRegistry>,
    server: TransferServer,
    mapping: Arc<Mapping>,
}

fn peer(size: usize) -> Peer {
    let registry = Arc::new(SegmentRegistry::default());
    let mapping = Arc::new(Mapping::create("test", size).unwrap());
    registry.register(SegmentId(1), mapping.clone());
    let server = TransferServer::start("127.0.0.1:0", registry.clone()).unwrap();
    Peer { registry, server, mapping }
}

fn replica(p: &Peer, offset: u64, len: u64, host: &str) -> ReplicaDesc {
    ReplicaDesc {
        segment: SegmentId(1),
        offset,
        len,
        endpoint: p.server.local_addr().to_string(),
        host: host.into(),
        shm_path: p.mapping.peer_path(),
        incarnation: p.mapping.incarnation(),
        gen: 1,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn tcp_and_shared_memory_move_the_same_bytes() {
    let p = peer(64 << 20);
    let tcp = TransferEngine::new("here", true, Arc::new(SegmentRegistry::default()));
    let shm = TransferEngine::new("here", false, Arc::new(SegmentRegistry::default()));
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
    let mut s = TcpStream::connect(p.server.local_addr()).unwrap();
    let mut answer = [0u8; ANSWER_LEN];
    let mut ask = |op, segment, offset, len, payload: &[u8]| {
        let req = XferRequest { op, segment: SegmentId(segment), offset, len, incarnation: 0, gen: 1 };
        s.write_all(&req.encode()).unwrap();
        s.write_all(payload).unwrap();
        s.read_exact(&mut answer).unwrap();
        decode_answer(&answer)
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
    let n = ask(XferOp::Read, 1, 0, 4, b"").unwrap();
    assert_eq!(n, 4);
    let mut got = [0u8; 4];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"wxyz");
    let mut trailer = [0u8; ANSWER_LEN];
    s.read_exact(&mut trailer).unwrap();
    assert_eq!(decode_answer(&trailer).unwrap(), 4);
}

/// A range freed and handed to a new write while a reader still holds the old descriptor:
/// the old reader fails with RANGE_REUSED over TCP and over shared memory, never with foreign
/// bytes; the new descriptor reads the new bytes. A remount fails every old descriptor.
#[test]
fn reads_of_a_reused_range_fail_instead_of_returning_foreign_bytes() {
    let p = peer(1 << 20);
    let tcp = TransferEngine::new("here", true, Arc::new(SegmentRegistry::default()));
    let shm = TransferEngine::new("here", false, Arc::new(SegmentRegistry::default()));
    let old = replica(&p, 4096, 8192, "here");
    shm.write(&old, 0, &pattern(8192, 1)).unwrap();
    let mut out = vec![0u8; 8192];
    tcp.read(&old, 0, &mut out).unwrap();
    assert_eq!(out, pattern(8192, 1));
    // The object goes; a 100-byte value of generation 2 lands in the middle of its range.
    let new = ReplicaDesc { offset: 8192, len: 100, gen: 2, ..old.clone() };
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
    let fresh = ReplicaDesc { incarnation: inc, gen: 1, ..new };
    tcp.write(&fresh, 0, &pattern(100, 3)).unwrap();
    shm.read(&fresh, 0, &mut v).unwrap();
    assert_eq!(v, pattern(100, 3));
}

#[test]
fn unregistered_segment_is_refused() {
    let p = peer(1 << 20);
    let engine = TransferEngine::new("there", true, Arc::new(SegmentRegistry::default()));
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
    let engine = TransferEngine::new("there", true, Arc::new(SegmentRegistry::default()));
    let r = replica(&p, 0, 10, "here");
    engine.write(&r, 0, b"0123456789").unwrap();
    let mut bad = TcpStream::connect(p.server.local_addr()).unwrap();
    bad.write_all(&[0xee; 48]).unwrap();
    let mut buf = Vec::new();
    assert_eq!(bad.read_to_end(&mut buf).unwrap(), 0, "server closes the garbage connection");
    let mut out = [0u8; 10];
    engine.read(&r, 0, &mut out).unwrap();
    assert_eq!(&out, b"0123456789");
}

#[test]
fn engine_checks_object_bounds_before_sending() {
    let p = peer(1 << 20);
    let engine = TransferEngine::new("there", true, Arc::new(SegmentRegistry::default()));
    let r = replica(&p, 0, 10, "here");
    assert_eq!(engine.write(&r, 5, &[0; 10]).unwrap_err().code(), ErrorCode::INVALID_PARAMS);
    assert_eq!(engine.write(&r, 0, &[]).unwrap_err().code(), ErrorCode::INVALID_PARAMS);
}

#[test]
fn batch_succeeds_only_if_every_part_does() {
    let p = peer(8 << 20);
    let engine = TransferEngine::new("there", true, Arc::new(SegmentRegistry::default()));
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
    let missing = ReplicaDesc { segment: SegmentId(99), ..a.clone() };
    let err = engine
        .run(vec![
            Part::Read { replica: &a, at: 0, dst: &mut ra },
            Part::Read { replica: &missing, at: 0, dst: &mut rb },
        ])
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::SEGMENT_NOT_FOUND);
}
