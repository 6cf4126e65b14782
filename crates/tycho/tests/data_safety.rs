//! Issue 10 with real processes: reads never return foreign bytes when space is reused (after a
//! forced remove, or a remount of a paused node), freed space is usable at once, and batch reads
//! fall back per key.

use std::time::{Duration, Instant};

use tycho_client::{Client, ClientConfig, Protocol};
use tycho_proto::*;
use tycho_testkit::{MasterProc, NodeProc, Proc};

const SIGKILL: i32 = 9;
const SIGSTOP: i32 = 19;
const SIGCONT: i32 = 18;
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

fn client(master: &str, protocol: Protocol) -> Client {
    let mut cfg = ClientConfig::new(master);
    cfg.protocol = protocol;
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
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn value(key: &str, round: u32, len: usize) -> Vec<u8> {
    let mut v = format!("{key}#{round}#").into_bytes();
    let mut x = (round as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ len as u64;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(x as u8);
    }
    v
}

/// Item 6: the Mooncake benchmark loop — fill half the memory, read it back, force-remove it
/// all, repeat — never fails a put or reads an empty value: forced removes free at once, even
/// while the values just read still hold their leases.
#[test]
fn fill_read_force_remove_rounds_never_fail() {
    let (_m, addr) = master(&[]);
    let (_n, _) = node(&addr, "64MB");
    let writer = client(&addr, Protocol::Auto);
    let reader = client(&addr, Protocol::Tcp);
    wait_for("node", 20, || stats(&writer).segments == 1);
    for round in 0..10u32 {
        let keys: Vec<String> = (0..8).map(|i| format!("round/{i}")).collect();
        let vals: Vec<Vec<u8>> = keys.iter().map(|k| value(k, round, 4 << 20)).collect();
        let items: Vec<(&str, &[u8])> = keys.iter().map(|k| k.as_str()).zip(vals.iter().map(|v| &v[..])).collect();
        let res = writer.write_batch(tycho_client::WriteMode::Put, &items, &Default::default(), false);
        assert!(res.iter().all(|r| r.is_ok()), "round {round}: failed puts {res:?}");
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        for (c, name) in [(&writer, "writer"), (&reader, "reader")] {
            let got = c.get_batch(&refs);
            for ((g, want), k) in got.iter().zip(&vals).zip(&keys) {
                assert!(
                    g.as_ref().is_ok_and(|g| g == want),
                    "round {round}: {name} read of {k} was {:?}",
                    g.as_ref().map(|g| g.len())
                );
            }
        }
        assert_eq!(writer.remove_by_regex("round/.*", true), Ok(8));
        assert_eq!(stats(&writer).used_bytes, 0, "round {round}: the forced removes freed everything");
    }
}

/// Item 1: a node paused past the client TTL is expired, then remounts its segment under a new
/// incarnation and new values land on the same offsets. A reader still holding the old replica
/// list gets RANGE_REUSED, never the new bytes; its reused list is dropped and a fresh get sees
/// the object is gone.
#[test]
fn a_reader_across_a_paused_nodes_remount_never_sees_foreign_bytes() {
    let (_m, addr) = master(&["--client-ttl", "1"]);
    let (mut n, _) = node(&addr, "8MB");
    let writer = client(&addr, Protocol::Auto);
    let shm_reader = client(&addr, Protocol::Auto);
    let tcp_reader = client(&addr, Protocol::Tcp);
    wait_for("node", 20, || stats(&writer).segments == 1);
    let old = value("k1", 1, 64 << 10);
    writer.put("k1", &old, &Default::default()).unwrap();
    let lookups: Vec<_> = [&shm_reader, &tcp_reader].iter().map(|c| c.lookup("k1").unwrap()).collect();
    assert_eq!(shm_reader.get("k1").unwrap(), old);
    let before = stats(&writer);

    n.signal(SIGSTOP);
    wait_for("the paused node to expire", 20, || stats(&writer).segments == 0);
    n.signal(SIGCONT);
    wait_for("the node to remount", 20, || stats(&writer).segments == 1);
    assert!(stats(&writer).clients >= before.clients);
    // New values fill the remounted segment from offset 0, where k1's bytes were.
    let new = value("k2", 2, 64 << 10);
    writer.put("k2", &new, &Default::default()).unwrap();
    assert_eq!(writer.lookup("k2").unwrap().replicas()[0].offset, lookups[0].replicas()[0].offset);

    for (c, l) in [&shm_reader, &tcp_reader].iter().zip(&lookups) {
        let mut buf = vec![0u8; old.len()];
        assert_eq!(c.read_lookup(l, &mut buf), Err(ErrorCode::RANGE_REUSED));
        assert_eq!(c.get("k1"), Err(ErrorCode::OBJECT_NOT_FOUND));
    }
    assert_eq!(shm_reader.get("k2").unwrap(), new);
}

/// Item 8: a batch read whose preferred replica is on a dead node reads that key again from its
/// other replica, and the other keys of the batch keep their results.
#[test]
fn a_batch_read_falls_back_per_key_to_another_replica() {
    let (_m, addr) = master(&[]);
    let (mut n1, h1) = node(&addr, "16MB");
    let (_n2, h2) = node(&addr, "16MB");
    let c = client(&addr, Protocol::Tcp);
    wait_for("nodes", 20, || stats(&c).segments == 2);
    let both = ReplicateConfig { replica_num: 2, ..Default::default() };
    let only2 = ReplicateConfig { preferred_segments: vec![h2.clone()], ..Default::default() };
    let (a, b) = (value("a", 1, 100_000), value("b", 1, 100_000));
    c.put("a", &a, &both).unwrap();
    c.put("b", &b, &only2).unwrap();
    let la = c.lookup("a").unwrap();
    assert_eq!(la.replicas().len(), 2);
    assert!(la.replicas().iter().any(|r| r.endpoint == h1));
    n1.signal(SIGKILL);
    // The master has not expired n1 yet: its replica is still listed, and refused or unreachable.
    for _ in 0..5 {
        let got = c.get_batch(&["a", "b"]);
        assert_eq!(got[0].as_ref().ok(), Some(&a));
        assert_eq!(got[1].as_ref().ok(), Some(&b));
    }
}
