//! The partitioned metadata plane (issue 13) with real processes: masters of one cluster on a
//! real etcd (started by the test on free ports, stopped with it), each deciding its roles in G
//! KVPT groups by the same rules, read back through every master's `/kvpt_groups`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tycho_testkit::{EtcdServer, MasterProc, TempDir};

mod common;
use common::{secret_file, serial};

const TYCHO: &str = env!("CARGO_BIN_EXE_tycho");

/// Bound on each change of roles the test waits for.
const ROLE_WAIT: Duration = Duration::from_secs(30);

/// An etcd, a shared secret, and the flags of the masters of one cluster on them.
struct Cluster {
    etcd: EtcdServer,
    _home: TempDir,
    secret: PathBuf,
    name: &'static str,
}

impl Cluster {
    fn new(name: &'static str) -> Cluster {
        let etcd = EtcdServer::start_new().expect("etcd starts (scripts/test installs it)");
        let home = TempDir::new("tycho-cluster").unwrap();
        let secret = secret_file(home.path());
        Cluster { etcd, _home: home, secret, name }
    }

    fn flags<'a>(&'a self, endpoint: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut flags = vec![
            "--etcd-endpoints",
            endpoint,
            "--cluster-name",
            self.name,
            "--ha-lease-ttl",
            "3",
            "--secret-file",
            self.secret.to_str().unwrap(),
        ];
        flags.extend_from_slice(extra);
        flags
    }

    /// Starts a master of the cluster with `extra` flags and waits until it prints a role that
    /// starts with `role`.
    fn master(&self, role: &str, extra: &[&str]) -> MasterProc {
        let endpoint = self.etcd.endpoint();
        let mut m = MasterProc::start(TYCHO, &self.flags(&endpoint, extra));
        m.proc.wait_line(&format!("tycho master role: {role}"), ROLE_WAIT).unwrap_or_else(|e| panic!("{role}: {e}"));
        m
    }
}

/// The body of `GET path` on `http` (host:port).
fn http_get(http: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP answer: {out:?}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
    body.to_string()
}

/// One group as `/kvpt_groups` lists it: (primary, standbys, epoch, caretaken).
type Row = (String, Vec<String>, u64, bool);

/// Every group record, by rank, as `master` reports them.
fn groups(master: &MasterProc) -> Vec<Row> {
    let rows: serde_json::Value = serde_json::from_str(&http_get(&master.http, "/kvpt_groups")).unwrap();
    rows.as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            assert_eq!(r["rank"].as_u64(), Some(i as u64), "{rows}");
            let standbys = r["standbys"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect();
            (r["primary"].as_str().unwrap().to_string(), standbys, r["epoch"].as_u64().unwrap(), r["caretaken"] == true)
        })
        .collect()
}

/// Waits (bounded) until `master`'s `/kvpt_groups` satisfies `done`; returns what it showed.
fn wait_groups(master: &MasterProc, what: &str, done: impl Fn(&[Row]) -> bool) -> Vec<Row> {
    let deadline = Instant::now() + ROLE_WAIT;
    loop {
        let now = groups(master);
        if done(&now) {
            return now;
        }
        assert!(Instant::now() < deadline, "{what}: the groups stayed {now:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first master of a G = 4 cluster creates every group, native primary of group 0 and
/// caretaker of the others; each master that joins becomes the standby of the lowest caretaken
/// group and claims it, so that with four masters every group has a primary of its own. Every
/// master lists the same records and the same live masters; a master given another G is
/// refused.
#[test]
fn the_first_master_caretakes_every_group_and_joining_masters_claim_one_each() {
    let _one = serial();
    let c = Cluster::new("claims");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "4"]);
    let first = wait_groups(&a, "a creates every group", |g| g.len() == 4);
    for (rank, (primary, standbys, epoch, caretaken)) in first.iter().enumerate() {
        assert_eq!((primary, standbys.len(), *epoch, *caretaken), (&a.rpc, 0, 1, rank != 0), "group {rank}");
    }
    // The others adopt G = 4 from the cluster: no flag needed.
    let mut masters = vec![a];
    for n in 1..4 {
        masters.push(c.master("", &[]));
        let joined = masters[n].rpc.clone();
        let now = wait_groups(&masters[0], &format!("master {n} claims group {n}"), |g| {
            g[n].0 == joined && !g[n].3 && g[n].1.is_empty()
        });
        // Each claim is one ownership change: the epoch rose by one, from the caretaker's.
        assert_eq!(now[n].2, 2, "group {n}: {now:?}");
        for (rank, row) in now.iter().enumerate().skip(n + 1) {
            assert_eq!((&row.0, row.3), (&masters[0].rpc, true), "group {rank} is still caretaken");
        }
    }
    let last = groups(&masters[3]);
    for (rank, m) in masters.iter().enumerate() {
        assert_eq!((&last[rank].0, last[rank].3), (&m.rpc, false), "group {rank}: {last:?}");
        assert_eq!(groups(m), last, "every master lists the same records");
        let listed: serde_json::Value = serde_json::from_str(&http_get(&m.http, "/masters")).unwrap();
        let ids: Vec<&str> = listed.as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
        assert_eq!(ids, masters.iter().map(|m| m.rpc.as_str()).collect::<Vec<_>>(), "oldest first");
    }
    // G is fixed at creation.
    let endpoint = c.etcd.endpoint();
    let out = std::process::Command::new(TYCHO)
        .arg("master")
        .args(c.flags(&endpoint, &["--kvpt-groups", "2", "--rpc-port", "0", "--metrics-port", "0"]))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_exit(out);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the cluster has 4 KVPT groups, not 2"), "{err}");
}

/// With G = 2 and four masters, the third and fourth become the standbys of groups 0 and 1
/// (pairing is one to one); when group 1's primary is killed its standby takes it over, and
/// group 0 is untouched.
#[test]
fn with_more_masters_than_groups_standbys_pair_one_to_one_and_take_over() {
    let _one = serial();
    let c = Cluster::new("pairs");
    let a = c.master("primary of groups 0", &["--groups", "2"]);
    let mut b = c.master("primary of groups 1", &[]);
    let s0 = c.master("standby of group 0", &[]);
    let s1 = c.master("standby of group 1", &[]);
    let paired = wait_groups(&a, "both groups paired", |g| g.iter().all(|r| r.1.len() == 1));
    assert_eq!(paired[0], (a.rpc.clone(), vec![s0.rpc.clone()], 1, false));
    assert_eq!(paired[1], (b.rpc.clone(), vec![s1.rpc.clone()], 2, false));
    b.proc.signal(libc::SIGKILL);
    let after = wait_groups(&a, "group 1's standby takes over", |g| g[1].0 == s1.rpc);
    assert_eq!((after[1].2, after[1].3), (3, false), "{after:?}");
    assert_eq!(after[0], paired[0], "group 0 is untouched");
}

/// Waits (bounded) for a process to exit and collects its standard error.
fn wait_exit(mut child: std::process::Child) -> std::process::Output {
    let deadline = Instant::now() + ROLE_WAIT;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the master did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
