//! RPC-level tests against a real `tycho master` process on a free loopback port.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tycho_proto::*;
use tycho_rpc::{ClientConfig, RpcClient};
use tycho_testkit::MasterProc;

fn start_master(extra: &[&str]) -> MasterProc {
    MasterProc::start(env!("CARGO_BIN_EXE_tycho"), extra)
}

struct C {
    rpc: RpcClient,
}

impl C {
    async fn connect(addr: &str) -> C {
        // An operator's connection (the admin credential): these tests speak for made-up
        // clients; security.rs covers what ordinary clients may do.
        C { rpc: RpcClient::connect(addr, &ClientConfig::admin(addr).unwrap()).await.unwrap() }
    }
    async fn call(&self, r: Request) -> Response {
        self.rpc.call(&r, Duration::from_secs(60)).await.unwrap()
    }
}

fn kr(key: &str) -> KeyRef {
    KeyRef { key: key.into(), route: tycho_routing::route_for("", key, 1) }
}

fn seg(id: u128, endpoint: &str, size: u64) -> SegmentDesc {
    SegmentDesc {
        id: SegmentId(id),
        name: format!("seg-{id}"),
        base: 0,
        size,
        endpoint: endpoint.into(),
        host: "host-a".into(),
        incarnation: 1,
    }
}

/// The write id these tests use for a key (one write per key at a time).
fn wid(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3)) | 1
}

fn start(client: ClientId, key: &str, size: u64, replicas: u32) -> WriteStart {
    WriteStart {
        client,
        tenant: String::new(),
        key: kr(key),
        size,
        config: ReplicateConfig { replica_num: replicas, ..Default::default() },
        write_id: wid(key),
    }
}

fn fin(client: ClientId, key: &str) -> WriteFinish {
    WriteFinish { client, tenant: String::new(), key: kr(key), write_id: wid(key) }
}

fn q(key: &str) -> KeyQuery {
    KeyQuery { tenant: String::new(), key: kr(key) }
}

async fn put(c: &C, client: ClientId, key: &str, size: u64, replicas: u32) -> Vec<ReplicaDesc> {
    let Response::WriteStarted(r) = c.call(Request::PutStart(start(client, key, size, replicas))).await else {
        panic!("put start of {key} failed")
    };
    assert_eq!(c.call(Request::PutEnd(fin(client, key))).await, Response::Committed(vec![]));
    r
}

async fn stats(c: &C) -> MasterStats {
    match c.call(Request::Stats).await {
        Response::Stats(s) => s,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn object_surface_over_rpc() {
    let m = start_master(&["--default-kv-lease-ttl", "300"]);
    let c = C::connect(&m.rpc).await;
    let a = ClientId(0xA);
    assert_eq!(c.call(Request::ServiceReady).await, Response::ServiceReady(true));

    // Unknown client: NEED_REMOUNT on ping, CLIENT_NOT_FOUND on write; nothing created.
    let Response::Ping(p) = c.call(Request::Ping { client: a }).await else { panic!() };
    assert_eq!(p.status, ClientStatus::NeedRemount);
    assert_eq!(c.call(Request::PutStart(start(a, "k", 10, 1))).await, Response::Error(ErrorCode::CLIENT_NOT_FOUND));
    assert_eq!(
        c.call(Request::ReMountSegment { client: a, segments: vec![seg(1, "e:1", 1 << 20)] }).await,
        Response::Done
    );
    let Response::Ping(p) = c.call(Request::Ping { client: a }).await else { panic!() };
    assert_eq!(p.status, ClientStatus::Ok);

    // Mount is idempotent; conflicts are typed and change nothing.
    assert_eq!(c.call(Request::MountSegment { client: a, segment: seg(1, "e:1", 1 << 20) }).await, Response::Done);
    let overlap = SegmentDesc { base: 4096, ..seg(2, "e:1", 1 << 20) };
    assert_eq!(
        c.call(Request::MountSegment { client: a, segment: overlap }).await,
        Response::Error(ErrorCode::SEGMENT_ALREADY_EXISTS)
    );
    assert_eq!(stats(&c).await.segments, 1);

    // Put-if-absent.
    let r = put(&c, a, "k1", 1000, 1).await;
    assert_eq!((r.len(), r[0].len, r[0].segment), (1, 1000, SegmentId(1)));
    assert_eq!(
        c.call(Request::PutStart(start(a, "k1", 2000, 1))).await,
        Response::Error(ErrorCode::OBJECT_ALREADY_EXISTS)
    );
    let Response::Replicas(l) = c.call(Request::GetReplicaList(q("k1"))).await else { panic!() };
    assert_eq!((l.size, l.lease_ttl_ms), (1000, 300));

    // Upsert replaces.
    let Response::Replicas(before) = c.call(Request::GetReplicaList(q("k1"))).await else { panic!() };
    assert!(matches!(c.call(Request::UpsertStart(start(a, "k1", 2000, 1))).await, Response::WriteStarted(_)));
    // The end names the replaced value's ranges, for the writer to retire.
    let Response::Committed(replaced) = c.call(Request::UpsertEnd(fin(a, "k1"))).await else { panic!() };
    let ranges = |l: &[ReplicaDesc]| l.iter().map(|r| (r.segment, r.offset, r.len, r.gen)).collect::<Vec<_>>();
    assert_eq!(ranges(&replaced), ranges(&before.replicas));
    // Granted for retiring only, where the read list granted reading.
    use tycho_proto::auth::capability::{RIGHT_READ, RIGHT_RETIRE};
    assert_eq!((replaced[0].cap.rights, before.replicas[0].cap.rights), (RIGHT_RETIRE, RIGHT_READ));
    let Response::Replicas(l) = c.call(Request::GetReplicaList(q("k1"))).await else { panic!() };
    assert_eq!(l.size, 2000);

    // The lease blocks remove; force wins; after the lease, plain remove works.
    put(&c, a, "k2", 100, 1).await;
    assert_eq!(c.call(Request::ExistKey(q("k2"))).await, Response::Exists(true));
    let rm = |key: &str, force| Request::Remove(RemoveKey { tenant: String::new(), key: kr(key), force });
    assert_eq!(c.call(rm("k2", false)).await, Response::Error(ErrorCode::OBJECT_HAS_LEASE));
    assert_eq!(c.call(rm("k1", true)).await, Response::Done);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match c.call(rm("k2", false)).await {
            Response::Done => break,
            Response::Error(ErrorCode::OBJECT_HAS_LEASE) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(c.call(Request::ExistKey(q("k2"))).await, Response::Exists(false));
    assert_eq!(c.call(Request::GetReplicaList(q("k2"))).await, Response::Error(ErrorCode::OBJECT_NOT_FOUND));

    // Revoke; another client may not end someone else's write.
    let b = ClientId(0xB);
    assert_eq!(c.call(Request::ReMountSegment { client: b, segments: vec![] }).await, Response::Done);
    assert!(matches!(c.call(Request::PutStart(start(a, "k3", 10, 1))).await, Response::WriteStarted(_)));
    assert_eq!(c.call(Request::PutEnd(fin(b, "k3"))).await, Response::Error(ErrorCode::WRITE_DROPPED));
    assert_eq!(c.call(Request::GetReplicaList(q("k3"))).await, Response::Error(ErrorCode::REPLICA_IS_NOT_READY));
    assert_eq!(c.call(Request::PutRevoke(fin(a, "k3"))).await, Response::Done);
    assert_eq!(c.call(Request::ExistKey(q("k3"))).await, Response::Exists(false));

    // Bad input: typed errors, nothing changes.
    let before = stats(&c).await;
    assert_eq!(c.call(Request::PutStart(start(a, "z", 0, 1))).await, Response::Error(ErrorCode::INVALID_PARAMS));
    assert_eq!(c.call(Request::PutStart(start(a, "", 10, 1))).await, Response::Error(ErrorCode::INVALID_KEY));
    let long = "x".repeat(MAX_KEY_LEN + 1);
    assert_eq!(c.call(Request::PutStart(start(a, &long, 10, 1))).await, Response::Error(ErrorCode::INVALID_KEY));
    let mut bad_pin = start(a, "p", 10, 1);
    bad_pin.config.soft_pin_ttl_ms = Some(1000);
    bad_pin.config.soft_pin_action = SoftPinAction::Preserve;
    assert_eq!(c.call(Request::PutStart(bad_pin)).await, Response::Error(ErrorCode::INVALID_PARAMS));
    let bad_regex = Request::RemoveByRegex { tenant: String::new(), regex: "(".into(), force: false };
    assert_eq!(c.call(bad_regex).await, Response::Error(ErrorCode::INVALID_PARAMS));
    assert_eq!(stats(&c).await, before);

    // Routing: wrong partition and stale epoch are rejected with routing codes.
    let mut wrong = q("k9");
    wrong.key.route.partition_id = wrong.key.route.partition_id.wrapping_add(1) % 16384;
    assert_eq!(c.call(Request::GetReplicaList(wrong)).await, Response::Error(ErrorCode::STALE_ROUTE));
    let mut stale = start(a, "k9", 10, 1);
    stale.key.route.epoch = 0;
    assert_eq!(c.call(Request::PutStart(stale)).await, Response::Error(ErrorCode::STALE_EPOCH));
    let mut ahead = q("k9");
    ahead.key.route.epoch = 2;
    assert_eq!(c.call(Request::ExistKey(ahead)).await, Response::Error(ErrorCode::KVPT_NOT_OWNED));

    // Batch forms answer per key, in order.
    let keys: Vec<String> = (0..50).map(|i| format!("batch/{i}")).collect();
    let mut items: Vec<(KeyRef, u64)> = keys.iter().map(|k| (kr(k), 64)).collect();
    items.push((kr(""), 64));
    let write_ids = items.iter().map(|(k, _)| wid(&k.key)).collect();
    let bs = BatchWriteStart { client: a, tenant: String::new(), items, config: ReplicateConfig::default(), write_ids };
    let Response::BatchWriteStarted(res) = c.call(Request::BatchPutStart(bs)).await else { panic!() };
    assert!(res[..50].iter().all(|r| r.is_ok()));
    assert_eq!(res[50], Err(ErrorCode::INVALID_KEY));
    let be = BatchWriteFinish {
        client: a,
        tenant: String::new(),
        keys: keys.iter().map(|k| kr(k)).collect(),
        write_ids: keys.iter().map(|k| wid(k)).collect(),
    };
    let Response::BatchCommitted(res) = c.call(Request::BatchPutEnd(be)).await else { panic!() };
    assert!(res.iter().all(|r| r.is_ok()));
    let mut probe: Vec<KeyRef> = keys.iter().map(|k| kr(k)).collect();
    probe.insert(10, kr("missing"));
    let bq = BatchKeyQuery { tenant: String::new(), keys: probe.clone() };
    let Response::BatchExists(ex) = c.call(Request::BatchExistKey(bq.clone())).await else { panic!() };
    assert_eq!(ex.iter().filter(|e| **e == Ok(true)).count(), 50);
    assert_eq!(ex[10], Ok(false));
    let Response::BatchReplicas(rl) = c.call(Request::BatchGetReplicaList(bq)).await else { panic!() };
    assert_eq!(rl[10], Err(ErrorCode::OBJECT_NOT_FOUND));
    assert!(rl.iter().enumerate().all(|(i, r)| i == 10 || r.as_ref().is_ok_and(|l| l.size == 64)));

    // Listing, regex removal (leased keys skipped unless forced), remove all.
    let Response::Keys(ks) =
        c.call(Request::ListKeys { tenant: None, regex: Some("batch/.*".into()), limit: 1000 }).await
    else {
        panic!()
    };
    assert_eq!(ks.len(), 50);
    let regex = Request::RemoveByRegex { tenant: String::new(), regex: "batch/1.*".into(), force: false };
    assert_eq!(c.call(regex).await, Response::Removed(0), "all are leased");
    let regex = Request::RemoveByRegex { tenant: String::new(), regex: "batch/1.*".into(), force: true };
    assert_eq!(c.call(regex).await, Response::Removed(11));
    assert_eq!(c.call(Request::RemoveAll { force: true }).await, Response::Removed(39));
    assert_eq!(stats(&c).await.objects, 0);

    // Unmount drops the segment's objects; unmounting again is fine. This connection is an
    // admin's, which may unmount any client's segment (security.rs shows that an ordinary client
    // may unmount only its own).
    put(&c, a, "u1", 10, 1).await;
    assert_eq!(c.call(Request::UnmountSegment { client: b, segment: SegmentId(1) }).await, Response::Done);
    assert_eq!(c.call(Request::UnmountSegment { client: a, segment: SegmentId(1) }).await, Response::Done);
    assert_eq!(c.call(Request::ExistKey(q("u1"))).await, Response::Exists(false));
    let Response::Segments(s) = c.call(Request::ListSegments).await else { panic!() };
    assert!(s.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_garbage_frames_are_refused_without_harm() {
    let m = start_master(&["--max-frame-bytes", "65536"]);
    let good = C::connect(&m.rpc).await;
    let h = frame::FrameHeader { kind: frame::FrameKind::Request, len: 1 << 30, request_id: 1 };
    let mut huge = [0u8; frame::HEADER_LEN];
    h.encode(&mut huge);
    // Reads what the master sends until it closes the connection; the count of bytes.
    async fn until_closed(raw: &mut tokio::net::TcpStream) -> usize {
        let mut rest = Vec::new();
        match tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut rest)).await.unwrap() {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => rest.len(),
            Err(e) => panic!("{e}"),
        }
    }
    let greeting = frame::HEADER_LEN + tycho_proto::auth::handshake::SERVER_HELLO_LEN;
    // Before the greeting: a header announcing 1 GiB, or garbage, is answered by nothing but
    // the master's own greeting, and the connection closes.
    for bytes in [&huge[..], &[0xde; 64][..]] {
        let mut raw = tokio::net::TcpStream::connect(&m.rpc).await.unwrap();
        raw.write_all(bytes).await.unwrap();
        assert_eq!(until_closed(&mut raw).await, greeting);
    }
    // After it: the 1 GiB header closes the connection without being read.
    let mut raw = tokio::net::TcpStream::connect(&m.rpc).await.unwrap();
    let auth = tycho_proto::auth::ClientAuth::Discover.resolve(&m.rpc).unwrap();
    let service = tycho_proto::auth::handshake::Service::Rpc;
    assert!(tycho_rpc::greet::connect(&mut raw, service, &auth, None, Duration::from_secs(5)).await.unwrap().is_some());
    raw.write_all(&huge).await.unwrap();
    assert_eq!(until_closed(&mut raw).await, 0);
    assert_eq!(good.call(Request::ServiceReady).await, Response::ServiceReady(true));
    assert_eq!(stats(&good).await.objects, 0);
}

/// Heartbeats `client` every 200 ms until `on` is cleared.
fn heartbeat(addr: String, client: ClientId, on: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let c = C::connect(&addr).await;
        while on.load(Ordering::Relaxed) {
            let _ = c.call(Request::Ping { client }).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_expires_with_exactly_its_replicas() {
    let m = start_master(&["--client-ttl", "1"]);
    let c = C::connect(&m.rpc).await;
    let (a, b) = (ClientId(0xA), ClientId(0xB));
    c.call(Request::MountSegment { client: a, segment: seg(1, "e:a", 1 << 20) }).await;
    c.call(Request::MountSegment { client: b, segment: seg(2, "e:b", 1 << 20) }).await;
    let b_alive = Arc::new(AtomicBool::new(true));
    let hb = heartbeat(m.rpc.clone(), b, b_alive.clone());
    for i in 0..20 {
        put(&c, a, &format!("both/{i}"), 100, 2).await;
    }
    let pref = |key: &str, name: &str| {
        let mut s = start(a, key, 100, 1);
        s.config.preferred_segments = vec![name.into()];
        s
    };
    for i in 0..20 {
        for (prefix, name) in [("only-a", "seg-1"), ("only-b", "seg-2")] {
            let key = format!("{prefix}/{i}");
            let Response::WriteStarted(r) = c.call(Request::PutStart(pref(&key, name))).await else { panic!() };
            assert_eq!(r[0].endpoint, if name == "seg-1" { "e:a" } else { "e:b" });
            assert_eq!(c.call(Request::PutEnd(fin(a, &key))).await, Response::Committed(vec![]));
        }
    }
    // A never pings; the master expires it after 1 s. Poll until its segment is gone.
    let deadline = Instant::now() + Duration::from_secs(15);
    while stats(&c).await.segments != 1 {
        assert!(Instant::now() < deadline, "client A was not expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = stats(&c).await;
    assert_eq!((s.clients, s.objects), (1, 40));
    for i in 0..20 {
        assert_eq!(c.call(Request::ExistKey(q(&format!("only-a/{i}")))).await, Response::Exists(false));
        assert_eq!(c.call(Request::ExistKey(q(&format!("only-b/{i}")))).await, Response::Exists(true));
        let Response::Replicas(l) = c.call(Request::GetReplicaList(q(&format!("both/{i}")))).await else { panic!() };
        assert_eq!(l.replicas.len(), 1);
        assert_eq!(l.replicas[0].segment, SegmentId(2));
    }
    let Response::Ping(p) = c.call(Request::Ping { client: a }).await else { panic!() };
    assert_eq!(p.status, ClientStatus::NeedRemount);
    b_alive.store(false, Ordering::Relaxed);
    hb.await.unwrap();
}

/// One million objects on a client that expires: GetReplicaList calls of another client keep
/// completing while the sweep is in progress (read from the sweep's own progress counter), and
/// none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_sweep_of_a_million_objects_does_not_stall_reads() {
    const N: usize = 1_000_000;
    let m = start_master(&["--client-ttl", "2"]);
    let c = C::connect(&m.rpc).await;
    let (victim, reader) = (ClientId(0xDEAD), ClientId(0xBEEF));
    c.call(Request::MountSegment { client: victim, segment: seg(1, "e:v", 64 << 30) }).await;
    c.call(Request::MountSegment { client: reader, segment: seg(2, "e:r", 1 << 30) }).await;
    let reader_alive = Arc::new(AtomicBool::new(true));
    let hb_reader = heartbeat(m.rpc.clone(), reader, reader_alive.clone());
    let victim_alive = Arc::new(AtomicBool::new(true));
    let hb_victim = heartbeat(m.rpc.clone(), victim, victim_alive.clone());
    for i in 0..100 {
        let mut s = start(reader, &format!("r/{i}"), 4096, 1);
        s.config.preferred_segments = vec!["seg-2".into()];
        let Response::WriteStarted(_) = c.call(Request::PutStart(s)).await else { panic!() };
        c.call(Request::PutEnd(fin(reader, &format!("r/{i}")))).await;
    }
    for chunk in (0..N).collect::<Vec<_>>().chunks(5000) {
        let keys: Vec<KeyRef> = chunk.iter().map(|i| kr(&format!("v/{i}"))).collect();
        let items = keys.iter().map(|k| (k.clone(), 4096)).collect();
        let config = ReplicateConfig { preferred_segments: vec!["seg-1".into()], ..Default::default() };
        let write_ids: Vec<u64> = keys.iter().map(|k| wid(&k.key)).collect();
        let bs = BatchWriteStart { client: victim, tenant: String::new(), items, config, write_ids: write_ids.clone() };
        let Response::BatchWriteStarted(r) = c.call(Request::BatchPutStart(bs)).await else { panic!() };
        assert!(r.iter().all(|r| r.as_ref().is_ok_and(|d| d[0].segment == SegmentId(1))));
        let be = BatchWriteFinish { client: victim, tenant: String::new(), keys, write_ids };
        c.call(Request::BatchPutEnd(be)).await;
    }
    let s0 = stats(&c).await;
    assert_eq!(s0.objects, (N + 100) as u64);
    victim_alive.store(false, Ordering::Relaxed);
    hb_victim.await.unwrap();

    // Read continuously; after every read, note the sweep's progress.
    let base = s0.sweep_progress;
    let target = base + N as u64;
    let (mut reads, mut during, mut failures) = (0u64, 0u64, 0u64);
    let r = C::connect(&m.rpc).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let key = format!("r/{}", reads % 100);
        match r.call(Request::GetReplicaList(q(&key))).await {
            Response::Replicas(l) if l.replicas.len() == 1 => {}
            other => {
                failures += 1;
                eprintln!("read failed: {other:?}");
            }
        }
        reads += 1;
        let p = stats(&r).await.sweep_progress;
        if p > base && p < target {
            during += 1;
        }
        if p >= target {
            break;
        }
        assert!(Instant::now() < deadline, "sweep did not finish; progress {p} of {target}");
    }
    eprintln!("reads {reads}, completed while the sweep was in progress: {during}, failures {failures}");
    assert_eq!(failures, 0);
    assert!(during > 0, "no read completed while the sweep was in progress");
    let s = stats(&c).await;
    assert_eq!((s.objects, s.segments), (100, 1));
    reader_alive.store(false, Ordering::Relaxed);
    hb_reader.await.unwrap();
}
