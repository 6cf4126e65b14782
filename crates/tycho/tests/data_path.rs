//! The data path with real processes: a master, `tycho node` daemons and in-test clients.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tycho_client::{Client, ClientConfig, Protocol, WriteMode};
use tycho_proto::*;
use tycho_testkit::{MasterProc, NodeProc, Proc};

const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;
const TYCHO: &str = env!("CARGO_BIN_EXE_tycho");

fn master(extra: &[&str]) -> (MasterProc, String) {
    let m = MasterProc::start(TYCHO, extra);
    let addr = m.rpc.clone();
    (m, addr)
}

fn node(master: &str, size: &str) -> (Proc, String) {
    let n = NodeProc::start(TYCHO, master, size);
    (n.proc, n.hostname)
}

fn client(master: &str, protocol: Protocol, segment: u64) -> Client {
    let mut cfg = ClientConfig::new(master);
    cfg.protocol = protocol;
    cfg.segment_size = segment;
    cfg.staging_buffer_size = 64 << 20;
    Client::connect(cfg).unwrap()
}

fn stats(c: &Client) -> MasterStats {
    match c.call(&Request::Stats).unwrap() {
        Response::Stats(s) => s,
        other => panic!("{other:?}"),
    }
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A payload that carries its key and a checksum, so a reader can tell torn or foreign bytes.
fn payload(key: &str, generation: u64, len: usize) -> Vec<u8> {
    let mut body: Vec<u8> = format!("{key}#{generation}#").into_bytes();
    let mut x = generation.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ len as u64;
    while body.len() < len - 4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        body.push(x as u8);
    }
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    body
}

fn verify(key: &str, bytes: &[u8]) -> bool {
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    crc32c::crc32c(body) == u32::from_le_bytes(crc.try_into().unwrap())
        && body.starts_with(format!("{key}#").as_bytes())
}

#[test]
fn replicas_survive_a_killed_node_and_expire_with_it() {
    let (_m, addr) = master(&["--client-ttl", "2"]);
    let (mut n1, h1) = node(&addr, "64MB");
    let (_n2, h2) = node(&addr, "64MB");
    let c = client(&addr, Protocol::Auto, 0);
    wait_for("two nodes", 20, || stats(&c).segments == 2);

    let two = ReplicateConfig { replica_num: 2, ..Default::default() };
    let value = payload("both", 1, 1 << 20);
    c.put("both", &value, &two).unwrap();
    let replicas = c.replicas("both").unwrap();
    let mut endpoints: Vec<_> = replicas.iter().map(|r| r.endpoint.clone()).collect();
    endpoints.sort();
    let mut want = vec![h1.clone(), h2.clone()];
    want.sort();
    assert_eq!(endpoints, want, "one replica on each node");

    // Objects placed only on node 1.
    let on_n1 = ReplicateConfig { preferred_segments: vec![h1.clone()], ..Default::default() };
    for i in 0..10 {
        let key = format!("only-n1/{i}");
        c.put(&key, &payload(&key, 1, 4096), &on_n1).unwrap();
        assert_eq!(c.replicas(&key).unwrap()[0].endpoint, h1);
    }

    n1.signal(SIGKILL);
    // Still readable, from the surviving replica, right away.
    let tcp = client(&addr, Protocol::Tcp, 0);
    assert_eq!(tcp.get("both").unwrap(), value);
    // After the client TTL the master drops node 1's replicas.
    wait_for("node 1 to expire", 20, || stats(&c).segments == 1);
    let left = c.replicas("both").unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].endpoint, h2);
    assert_eq!(c.get("both").unwrap(), value);
    for i in 0..10 {
        assert_eq!(c.get(&format!("only-n1/{i}")), Err(ErrorCode::OBJECT_NOT_FOUND));
        assert_eq!(c.exists(&format!("only-n1/{i}")), Ok(false));
    }
}

#[test]
fn sigterm_unmounts_and_close_drops_objects_stored_only_there() {
    let (_m, addr) = master(&[]);
    let (mut n1, _h1) = node(&addr, "32MB");
    let observer = client(&addr, Protocol::Auto, 0);
    wait_for("node", 20, || stats(&observer).segments == 1);
    let owner = client(&addr, Protocol::Auto, 32 << 20);
    assert_eq!(stats(&observer).segments, 2);
    let mine = ReplicateConfig { preferred_segments: vec![owner.hostname().to_string()], ..Default::default() };
    owner.put("mine", &payload("mine", 1, 10_000), &mine).unwrap();
    assert_eq!(owner.replicas("mine").unwrap()[0].endpoint, owner.hostname());
    observer.put("elsewhere", &payload("elsewhere", 1, 10_000), &Default::default()).unwrap();
    // Same-host reader maps the owner's segment.
    assert!(verify("mine", &observer.get("mine").unwrap()));
    owner.close().unwrap();
    assert_eq!(observer.exists("mine"), Ok(false));
    assert_eq!(stats(&observer).segments, 1);
    // Closed clients refuse calls with a clear code.
    assert_eq!(owner.get("elsewhere"), Err(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS));
    // SIGTERM: the node unmounts before exiting, without waiting for the TTL.
    n1.signal(SIGTERM);
    wait_for("node unmount", 5, || stats(&observer).segments == 0);
}

#[test]
fn dropping_the_last_clone_closes_the_client() {
    let (_m, addr) = master(&[]);
    let observer = client(&addr, Protocol::Auto, 0);
    let owner = client(&addr, Protocol::Auto, 16 << 20);
    let clone = owner.clone();
    assert_eq!(stats(&observer).segments, 1);
    drop(owner);
    // A clone still holds the client: its segment stays mounted and usable.
    assert_eq!(stats(&observer).segments, 1);
    clone.put("k", &payload("k", 1, 1000), &Default::default()).unwrap();
    assert!(verify("k", &observer.get("k").unwrap()));
    // The last one unmounts at once, as close() does, without waiting for the client TTL.
    drop(clone);
    assert_eq!(stats(&observer).segments, 0);
    assert_eq!(observer.exists("k"), Ok(false));
}

#[test]
fn get_racing_remove_never_returns_torn_or_foreign_bytes() {
    let (_m, addr) = master(&["--default-kv-lease-ttl", "200"]);
    let (_n1, _) = node(&addr, "64MB");
    let (_n2, _) = node(&addr, "64MB");
    let setup = client(&addr, Protocol::Auto, 0);
    wait_for("nodes", 20, || stats(&setup).segments == 2);
    let keys: Vec<String> = (0..8).map(|i| format!("race/{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let good_reads = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    // Writers: remove (forced, so leases do not hold them back) and re-put new generations.
    for w in 0..2 {
        let (addr, keys, stop) = (addr.clone(), keys.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let c = client(&addr, Protocol::Auto, 0);
            let mut generation = w * 1_000_000;
            while !stop.load(Ordering::Relaxed) {
                for k in &keys {
                    generation += 1;
                    let len = 4096 + (generation as usize % 7) * 100_000;
                    let _ = c.remove(k, true);
                    let _ = c.write(WriteMode::Upsert, k, &[&payload(k, generation, len)], &Default::default());
                }
            }
        }));
    }
    // Readers over shared memory and over TCP.
    for protocol in [Protocol::Auto, Protocol::Tcp] {
        let (addr, keys, stop, good) = (addr.clone(), keys.clone(), stop.clone(), good_reads.clone());
        threads.push(std::thread::spawn(move || {
            let c = client(&addr, protocol, 0);
            while !stop.load(Ordering::Relaxed) {
                for k in &keys {
                    match c.get(k) {
                        Ok(bytes) => {
                            assert!(verify(k, &bytes), "torn or foreign bytes for {k} ({} bytes)", bytes.len());
                            good.fetch_add(1, Ordering::Relaxed);
                        }
                        // RANGE_REUSED: the key was rewritten faster than three attempts could copy
                        // it; the bytes are thrown away, never returned.
                        Err(
                            ErrorCode::OBJECT_NOT_FOUND
                            | ErrorCode::REPLICA_IS_NOT_READY
                            | ErrorCode::LEASE_EXPIRED
                            | ErrorCode::RANGE_REUSED,
                        ) => {}
                        Err(e) => panic!("unexpected error {e}"),
                    }
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(good_reads.load(Ordering::Relaxed) > 50, "too few successful reads to mean anything");
}

#[test]
fn bad_input_gets_clear_errors_and_disturbs_nothing() {
    let (_m, addr) = master(&[]);
    let (_n, _) = node(&addr, "8MB");
    let c = client(&addr, Protocol::Auto, 0);
    wait_for("node", 20, || stats(&c).segments == 1);
    c.put("keep", &payload("keep", 1, 1000), &Default::default()).unwrap();
    let before = stats(&c);
    // Zero-length value.
    assert_eq!(c.put("z", &[], &Default::default()), Err(ErrorCode::INVALID_PARAMS));
    // Larger than any segment.
    let mut big_cfg = ClientConfig::new(&addr);
    big_cfg.staging_buffer_size = 64 << 20;
    let big_client = Client::connect(big_cfg).unwrap();
    assert_eq!(big_client.put("huge", &vec![1u8; 16 << 20], &Default::default()), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    // A staging buffer too small (and zero: this client cannot put), while exists still works.
    let mut small = ClientConfig::new(&addr);
    small.staging_buffer_size = 100;
    let small = Client::connect(small).unwrap();
    assert_eq!(small.put("s", &[1u8; 101], &Default::default()), Err(ErrorCode::BUFFER_OVERFLOW));
    let mut none = ClientConfig::new(&addr);
    none.staging_buffer_size = 0;
    let none = Client::connect(none).unwrap();
    assert_eq!(none.put("n", &[1u8; 1], &Default::default()), Err(ErrorCode::BUFFER_OVERFLOW));
    assert_eq!(none.exists("n"), Ok(false));
    // A registered buffer that was unregistered.
    let buf = vec![7u8; 4096];
    let ptr = buf.as_ptr() as u64;
    c.register_buffer(ptr, 4096).unwrap();
    // SAFETY: buf outlives the calls and nothing else touches it.
    unsafe { c.write_from(WriteMode::Put, "zc", ptr, 4096, &Default::default()) }.unwrap();
    c.unregister_buffer(ptr).unwrap();
    assert_eq!(
        unsafe { c.write_from(WriteMode::Put, "zc2", ptr, 4096, &Default::default()) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(unsafe { c.read_into("zc", ptr, 4096) }, Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(c.unregister_buffer(ptr), Err(ErrorCode::INVALID_PARAMS));
    // A destination buffer too small for the object.
    let mut tiny = [0u8; 10];
    assert_eq!(c.get_into("keep", &mut tiny), Err(ErrorCode::BUFFER_OVERFLOW));
    // Nothing else changed: "keep" and "zc" are the only objects, and still readable.
    let after = stats(&c);
    assert_eq!(after.objects, before.objects + 1);
    assert!(verify("keep", &c.get("keep").unwrap()));
    assert_eq!(c.get("zc").unwrap(), vec![7u8; 4096]);
}

#[test]
fn put_is_put_if_absent_and_batches_round_trip() {
    let (_m, addr) = master(&[]);
    let (_n, _) = node(&addr, "64MB");
    let c = client(&addr, Protocol::Auto, 0);
    wait_for("node", 20, || stats(&c).segments == 1);
    c.put("k", b"first", &Default::default()).unwrap();
    c.put("k", b"second", &Default::default()).unwrap();
    assert_eq!(c.get("k").unwrap(), b"first");
    c.upsert("k", b"third!", &Default::default()).unwrap();
    assert_eq!(c.get("k").unwrap(), b"third!");
    let values: Vec<Vec<u8>> = (0..32).map(|i| payload(&format!("b/{i}"), 1, 100_000 + i)).collect();
    let names: Vec<String> = (0..32).map(|i| format!("b/{i}")).collect();
    let items: Vec<(&str, &[u8])> = names.iter().map(|n| n.as_str()).zip(values.iter().map(|v| v.as_slice())).collect();
    assert!(c.write_batch(WriteMode::Put, &items, &Default::default(), true).iter().all(|r| r.is_ok()));
    let keys: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
    let tcp = client(&addr, Protocol::Tcp, 0);
    for (got, want) in tcp.get_batch(&keys).into_iter().zip(&values) {
        assert_eq!(&got.unwrap(), want);
    }
    assert!(c.exists_batch(&keys).iter().all(|e| *e == Ok(true)));
}

#[test]
fn clients_and_nodes_come_back_after_a_master_restart() {
    let (first, addr) = master(&[]);
    let (_n, _) = node(&addr, "32MB");
    let c = client(&addr, Protocol::Auto, 0);
    wait_for("node", 20, || stats(&c).segments == 1);
    c.put("before", b"v1", &Default::default()).unwrap();
    let first_port = first.port();
    drop(first);
    // While the master is down, calls fail with a transport code rather than hang.
    let err = c.exists("before").unwrap_err();
    assert!(matches!(err, ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT), "{err}");
    // The new master must come back on the same port for the clients to find it. That port is
    // free for a moment in between; unlike a port chosen for a first start, this window is
    // inherent to a restart test.
    let _second = MasterProc::start_on(TYCHO, first_port, &[]);
    // The first write after the restart re-registers the client by itself (CLIENT_NOT_FOUND →
    // remount → retry) rather than failing until the next heartbeat.
    let mut wrote = false;
    for _ in 0..50 {
        match c.put("first-after", b"v0", &Default::default()) {
            Ok(()) => {
                wrote = true;
                break;
            }
            // No segment yet: the node has not remounted.
            Err(ErrorCode::NO_AVAILABLE_HANDLE) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => panic!("put after restart: {e}"),
        }
    }
    assert!(wrote);
    // The node learns NEED_REMOUNT from its next heartbeat and mounts its segment again.
    wait_for("the node to remount", 20, || {
        c.call(&Request::Stats).is_ok_and(|r| matches!(r, Response::Stats(s) if s.segments == 1))
    });
    // A new master starts empty; the same client object works against it.
    assert_eq!(c.exists("before"), Ok(false));
    c.put("after", b"v2", &Default::default()).unwrap();
    assert_eq!(c.get("after").unwrap(), b"v2");
}

#[test]
fn a_hot_object_is_read_without_asking_the_master_again_within_its_lease() {
    let (m, addr) = master(&[]);
    let (_n, _) = node(&addr, "32MB");
    let c = client(&addr, Protocol::Auto, 0);
    wait_for("node", 20, || stats(&c).segments == 1);
    let value = payload("hot", 1, 100_000);
    c.put("hot", &value, &Default::default()).unwrap();
    let mut cfg = ClientConfig::new(&addr);
    cfg.reuse_leases = false;
    let no_reuse = Client::connect(cfg).unwrap();
    assert_eq!(c.get("hot").unwrap(), value);
    assert_eq!(no_reuse.get("hot").unwrap(), value);
    // With the master gone, the next read is served from the list and lease just obtained...
    drop(m);
    assert_eq!(c.get("hot").unwrap(), value);
    // ...but metadata queries always ask the master,
    assert!(c.exists("hot").is_err());
    // and a client that does not reuse leases asks it for every read.
    let err = no_reuse.get("hot").unwrap_err();
    assert!(matches!(err, ErrorCode::RPC_FAIL | ErrorCode::RPC_TIMEOUT), "{err}");
}
