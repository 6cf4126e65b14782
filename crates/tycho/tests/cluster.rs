//! The partitioned metadata plane (issue 13) with real processes: masters of one cluster on a
//! real etcd (started by the test on free ports, stopped with it), each deciding its roles in G
//! KVPT groups by the same rules, read back through every master's `/kvpt_groups`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tycho_client::{Client, ClientAuth, ClientConfig, Protocol};
use tycho_testkit::{EtcdServer, MasterProc, NodeProc, TempDir};

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

impl Cluster {
    /// A node (64 MB) of the cluster started at `master`, and a client given only that
    /// address, once a put through it succeeds (the node's segment is mounted).
    fn node_and_client(&self, master: &str) -> (NodeProc, Client) {
        let node = NodeProc::start_env(TYCHO, master, "64MB", &["--secret-file", self.secret.to_str().unwrap()], &[]);
        let client = self.client(master);
        let deadline = Instant::now() + ROLE_WAIT;
        while client.put("probe/segment", b"x", &Default::default()).is_err() {
            assert!(Instant::now() < deadline, "the node's segment never became usable");
            std::thread::sleep(Duration::from_millis(50));
        }
        (node, client)
    }

    /// A client of the cluster given only `master`'s address, contributing no memory.
    fn client(&self, master: &str) -> Client {
        self.client_with(master, |_| {})
    }

    /// [`Cluster::client`] with its settings changed by `f`.
    fn client_with(&self, master: &str, f: impl FnOnce(&mut ClientConfig)) -> Client {
        client_of(master, &self.secret, f)
    }

    /// Four masters of a G = 4 cluster, each the primary of one group.
    fn four_primaries(&self) -> Vec<MasterProc> {
        let mut masters = vec![self.master("primary of groups 0", &["--kvpt-groups", "4"])];
        wait_groups(&masters[0], "the first master creates every group", |g| g.len() == 4);
        for n in 1..4 {
            masters.push(self.master("", &[]));
            // One claim at a time: a master that started before the one before it had claimed
            // its group could take that group and leave it the next one.
            let joined = masters[n].rpc.clone();
            wait_groups(&masters[0], &format!("master {n} claims group {n}"), |g| g[n].0 == joined && !g[n].3);
        }
        let ids: Vec<String> = masters.iter().map(|m| m.rpc.clone()).collect();
        wait_groups(&masters[0], "every group has a primary of its own", |g| {
            g.iter().enumerate().all(|(r, row)| row.0 == ids[r] && !row.3)
        });
        masters
    }
}

/// A client of `master` holding the secret in file `secret`, with no segment, over TCP, with
/// its settings then changed by `f`.
fn client_of(master: &str, secret: &std::path::Path, f: impl FnOnce(&mut ClientConfig)) -> Client {
    let mut cfg = ClientConfig::new(master);
    cfg.auth = ClientAuth::Secret(std::sync::Arc::new(tycho_proto::auth::files::load(secret).unwrap()));
    cfg.segment_size = 0;
    cfg.protocol = Protocol::Tcp;
    f(&mut cfg);
    Client::connect(cfg).unwrap()
}

/// The first `n` keys `prefix{i}` (default tenant) of group `rank` of `groups`.
fn keys_of_group(prefix: &str, rank: u32, groups: u32, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .filter(|k| tycho_routing::kvpt_to_rank(tycho_routing::partition_of("", k), groups) == rank)
        .take(n)
        .collect()
}

/// A value for key `k`, `len` bytes.
fn value_of(k: &str, len: usize) -> Vec<u8> {
    let seed = k.bytes().fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

/// Objects a master holds, from its `Stats`.
/// A client's load: fresh keys written one after the other, and every other round an
/// acknowledged key read back, until stopped; what was acknowledged and what failed.
struct Load {
    stop: std::sync::atomic::AtomicBool,
    acked: std::sync::Mutex<Vec<String>>,
    errors: std::sync::Mutex<Vec<(String, tycho_proto::ErrorCode)>>,
}

impl Load {
    fn new() -> Load {
        Load { stop: Default::default(), acked: Default::default(), errors: Default::default() }
    }

    /// Writes `{prefix}/{i}` (values of `len` bytes) until [`Load::stop`].
    fn run(&self, client: &Client, prefix: &str, len: usize) {
        let mut i = 0;
        while !self.stop.load(std::sync::atomic::Ordering::Relaxed) {
            let k = format!("{prefix}/{i}");
            i += 1;
            match client.put(&k, &value_of(&k, len), &Default::default()) {
                Ok(()) => self.acked.lock().unwrap().push(k),
                Err(e) => self.errors.lock().unwrap().push((k, e)),
            }
            let back = self.acked.lock().unwrap().get(i / 2).cloned();
            if let Some(k) = back {
                match client.get(&k) {
                    Ok(v) => assert_eq!(v, value_of(&k, len), "{k}"),
                    Err(e) => self.errors.lock().unwrap().push((k, e)),
                }
            }
        }
    }

    fn stop(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn acked(&self) -> usize {
        self.acked.lock().unwrap().len()
    }

    /// Waits until `n` writes were acknowledged (a failed test if not within [`ROLE_WAIT`]).
    fn wait_for(&self, n: usize, what: &str) {
        let deadline = Instant::now() + ROLE_WAIT;
        while self.acked() < n {
            assert!(Instant::now() < deadline, "{what}: {} acknowledged", self.acked());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Runs `f` in the middle of the load (`{prefix}/{i}`, values of `len` bytes): once `lead`
    /// writes were acknowledged, and until `lead` more were after it; then stops the load.
    fn around<T: Send>(&self, client: &Client, prefix: &str, len: usize, lead: usize, f: impl FnOnce() -> T) -> T {
        std::thread::scope(|s| {
            s.spawn(|| self.run(client, prefix, len));
            let _stop = StopOnDrop(self);
            self.wait_for(lead, &format!("load before {prefix}"));
            let out = f();
            self.wait_for(self.acked() + lead, &format!("load after {prefix}"));
            self.stop();
            out
        })
    }
}

/// Stops a [`Load`] when dropped: a load thread in a scope stops when the test's thread panics
/// (the scope would otherwise wait for it forever).
struct StopOnDrop<'a>(&'a Load);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

fn objects(master: &MasterProc, secret: &std::sync::Arc<tycho_proto::auth::Secret>) -> u64 {
    let (_, raw) = common::registered(&master.rpc, secret, "");
    let resp = raw
        .call::<tycho_proto::Request, tycho_proto::Response>(&tycho_proto::Request::Stats, Duration::from_secs(10))
        .unwrap();
    let tycho_proto::Response::Stats(s) = resp else { panic!("no stats: {resp:?}") };
    s.objects
}

/// The write calls (starts, ends, revokes, single and batch) a master answered with an error,
/// as "rpc CODE" and how many (its `tycho_master_rpc_errors_total`).
fn write_errors(m: &MasterProc) -> Vec<(String, u64)> {
    let page = http_get(&m.http, "/metrics");
    let label = |labels: &str, name: &str| {
        labels.split(',').find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\"")?.strip_suffix('"')).map(String::from)
    };
    page.lines()
        .filter_map(|l| l.strip_prefix("tycho_master_rpc_errors_total{")?.split_once("} "))
        .filter_map(|(labels, n)| {
            let rpc = label(labels, "rpc")?;
            let code = label(labels, "code")?;
            rpc.contains("put_").then(|| (format!("{rpc} {code}"), n.trim().parse().unwrap()))
        })
        .collect()
}

/// The body of `GET path` on `http` (host:port), showing the admin token of the clusters'
/// secret (`common::secret_file`'s).
fn http_get(http: &str, path: &str) -> String {
    let token = common::admin_token(common::SECRET_TEXT);
    let (status, body) = common::http_call(http, "GET", path, Some(&token), "");
    assert_eq!(status, 200, "{path}: {body}");
    body
}

/// One group as `/kvpt_groups` lists it: (primary, standbys, epoch, caretaken).
type Row = (String, Vec<String>, u64, bool);

/// The group records `master` reports, by rank, from group 0 up to the first one not created
/// yet (the first master creates them one by one).
fn groups(master: &MasterProc) -> Vec<Row> {
    let rows: serde_json::Value = serde_json::from_str(&http_get(&master.http, "/kvpt_groups")).unwrap();
    rows.as_array()
        .unwrap()
        .iter()
        .enumerate()
        .take_while(|(i, r)| r["rank"].as_u64() == Some(*i as u64))
        .map(|(_, r)| {
            let standbys = r["standbys"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect();
            // (The epoch within the cluster's incarnation: 1 at creation.)
            let epoch = tycho_routing::epoch_in_incarnation(r["epoch"].as_u64().unwrap());
            (r["primary"].as_str().unwrap().to_string(), standbys, epoch, r["caretaken"] == true)
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
    // Every master tells clients who serves each group.
    let secret = std::sync::Arc::new(tycho_proto::auth::files::load(&c.secret).unwrap());
    for m in &masters {
        let (_, raw) = common::registered(&m.rpc, &secret, "");
        let t = Duration::from_secs(10);
        let resp = raw.call::<tycho_proto::Request, tycho_proto::Response>(&tycho_proto::Request::Routes, t).unwrap();
        let tycho_proto::Response::Routes(routes) = resp else { panic!("no routes: {resp:?}") };
        assert_eq!(routes.groups, 4);
        let epochs: Vec<u64> = routes.epochs.iter().map(|&e| tycho_routing::epoch_in_incarnation(e)).collect();
        assert_eq!(epochs, [1, 2, 2, 2]);
        assert!(routes.epochs.iter().all(|&e| e >> 32 == routes.epochs[0] >> 32), "one incarnation: {routes:?}");
        assert_eq!(routes.owners, masters.iter().map(|m| m.rpc.clone()).collect::<Vec<_>>());
    }
    // The same as tables, from the command line.
    let cli = |what: &str| {
        let out = std::process::Command::new(TYCHO)
            .args([what, "--admin", &masters[2].http, "--secret-file", c.secret.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "tycho {what}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let table = cli("groups");
    for (rank, m) in masters.iter().enumerate() {
        let line = table
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{rank} ")))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(line.contains(&m.rpc) && line.contains(" no "), "group {rank}: {line}");
    }
    let table = cli("masters");
    assert!(masters.iter().all(|m| table.contains(&m.rpc)), "{table}");
    assert_eq!(table.matches("(answering)").count(), 1, "{table}");
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

/// A client and a node given one master's address reach all four primaries of a G = 4
/// cluster: the node's segment is mounted on every primary (each allocates in its own slice),
/// each key goes to its group's primary, a batch is split by primary and its answers come back
/// in order, stats and listings answer for the whole cluster, and RemoveAll reaches every
/// primary (with one down, the others remove theirs and the error names it).
#[test]
fn a_client_given_one_master_routes_every_key_to_its_groups_primary() {
    use tycho_proto::{Request, Response};
    let _one = serial();
    let c = Cluster::new("routing");
    let masters = c.four_primaries();
    let secret = std::sync::Arc::new(tycho_proto::auth::files::load(&c.secret).unwrap());
    let _node =
        NodeProc::start_env(TYCHO, &masters[1].rpc, "64MB", &["--secret-file", c.secret.to_str().unwrap()], &[]);
    let client = c.client(&masters[3].rpc);
    let value = |i: usize| -> Vec<u8> { (0..4096 + i).map(|b| (b * 7 + i) as u8).collect() };
    let keys: Vec<String> = (0..200).map(|i| format!("routed/{i}")).collect();
    // The node mounts on every primary once it learned the routes: wait for the first put.
    let deadline = Instant::now() + ROLE_WAIT;
    while let Err(e) = client.put(&keys[0], &value(0), &Default::default()) {
        assert!(Instant::now() < deadline, "no put reached a primary with the node's segment: {e:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for (i, k) in keys.iter().enumerate().skip(1) {
        client.put(k, &value(i), &Default::default()).unwrap_or_else(|e| panic!("put {k}: {e:?}"));
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(client.get(k).unwrap_or_else(|e| panic!("get {k}: {e:?}")), value(i), "{k}");
    }
    // Every primary holds its own groups' keys: about a quarter each.
    let held: Vec<u64> = masters.iter().map(|m| objects(m, &secret)).collect();
    assert_eq!(held.iter().sum::<u64>(), 200, "{held:?}");
    assert!(held.iter().all(|&n| n >= 20), "keys spread over the four primaries: {held:?}");
    // A batch spans every primary; its answers come back in the order asked.
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    for (i, got) in client.get_batch(&names).into_iter().enumerate() {
        assert_eq!(got.unwrap_or_else(|e| panic!("batch get {i}: {e:?}")), value(i));
    }
    let mut asked: Vec<&str> = names.clone();
    asked.push("routed/absent");
    let exist = client.exists_batch(&asked);
    assert!(exist[..200].iter().all(|e| *e == Ok(true)), "{exist:?}");
    assert_eq!(exist[200], Ok(false));
    let batch: Vec<(String, Vec<u8>)> = (0..40).map(|i| (format!("batch/{i}"), value(i))).collect();
    let items: Vec<(&str, &[u8])> = batch.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in client.write_batch(tycho_client::WriteMode::Put, &items, &Default::default(), true) {
        r.unwrap();
    }
    for (k, v) in &batch {
        assert_eq!(&client.get(k).unwrap(), v);
    }
    // The library's stats and listings answer for the whole cluster, not the master in use.
    let Response::Stats(st) = client.call(&Request::Stats).unwrap() else { panic!("no stats") };
    assert_eq!(st.objects, 240, "{st:?}");
    let list = Request::ListKeys { tenant: None, regex: None, limit: 1000 };
    let Response::Keys(listed) = client.call(&list).unwrap() else { panic!("no keys") };
    let mut want: Vec<String> = keys.iter().cloned().chain(batch.iter().map(|(k, _)| k.clone())).collect();
    want.sort();
    assert_eq!(listed.iter().map(|k| k.key.clone()).collect::<Vec<_>>(), want);
    let Response::Segments(segs) = client.call(&Request::ListSegments).unwrap() else { panic!("no segments") };
    assert_eq!(segs.len(), 1, "the node's segment, once: {segs:?}");
    assert_eq!(segs[0].used, st.used_bytes, "its bytes used on every primary");
    // RemoveAll reaches every primary (forced: the reads above leased every object).
    assert_eq!(client.remove_all(false).unwrap(), 0, "leased objects stay without force");
    // With one primary down, the others still remove theirs, and the error says who did what.
    let held: Vec<u64> = masters.iter().map(|m| objects(m, &secret)).collect();
    let mut masters = masters;
    let down = masters.remove(2);
    let down_addr = down.rpc.clone();
    drop(down);
    let partial = client.remove_all(true).expect_err("a primary is down");
    assert_eq!(partial.removed, 240 - held[2], "{partial}");
    assert_eq!(partial.done.len(), 3, "{partial}");
    assert_eq!(partial.failed.len(), 1, "{partial}");
    assert_eq!(partial.failed[0].0, down_addr, "{partial}");
    assert!(masters.iter().all(|m| objects(m, &secret) == 0));
}

/// A client whose route table went stale (it refreshes it only when told: no heartbeat in the
/// test's time) keeps sending a group's keys to the caretaker that served it; once another
/// master claimed the group, the caretaker answers KVPT_NOT_OWNED, and the client reads the
/// route table again and is served by the new primary. A write the caretaker started before
/// the claim cannot be committed there after it (its PutEnd is refused), and nothing of it is
/// committed at the new primary either.
#[test]
fn a_stale_route_is_redirected_and_a_delayed_put_end_at_the_former_primary_is_refused() {
    use tycho_proto::{KeyRef, Request, Response, WriteFinish, WriteStart};
    let _one = serial();
    let c = Cluster::new("stale");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "2"]);
    let _node = NodeProc::start_env(TYCHO, &a.rpc, "64MB", &["--secret-file", c.secret.to_str().unwrap()], &[]);
    let quiet = c.client_with(&a.rpc, |cfg| cfg.heartbeat_interval = Duration::from_secs(3600));
    let ours = keys_of_group("stale/", 1, 2, 3);
    let deadline = Instant::now() + ROLE_WAIT;
    while let Err(e) = quiet.put(&ours[0], &value_of(&ours[0], 1000), &Default::default()) {
        assert!(Instant::now() < deadline, "no put through the caretaker: {e:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A raw client starts a write of a group 1 key at the caretaker.
    let secret = std::sync::Arc::new(tycho_proto::auth::files::load(&c.secret).unwrap());
    let (id, raw) = common::registered(&a.rpc, &secret, "");
    let t = Duration::from_secs(10);
    raw.call::<Request, Response>(&Request::ReMountSegment { client: id, segments: Vec::new() }, t).unwrap();
    // Group 1's epoch while the caretaker serves it (the cluster's first).
    let Response::Routes(before) = raw.call::<Request, Response>(&Request::Routes, t).unwrap() else {
        panic!("no route table")
    };
    let first = before.epochs[1];
    let late = KeyRef { key: ours[2].clone(), route: tycho_routing::route_for("", &ours[2], first) };
    let start = WriteStart {
        client: id,
        tenant: String::new(),
        key: late.clone(),
        size: 512,
        config: Default::default(),
        write_id: 7,
    };
    let started = raw.call::<Request, Response>(&Request::PutStart(start), t).unwrap();
    assert!(matches!(started, Response::WriteStarted(_)), "{started:?}");

    // b joins and claims group 1.
    let b = c.master("primary of groups 1", &[]);
    wait_groups(&a, "b claims group 1", |g| g.len() == 2 && g[1].0 == b.rpc);
    // The delayed PutEnd at the former primary is refused: it no longer owns the group.
    let finish = WriteFinish { client: id, tenant: String::new(), key: late, write_id: 7 };
    let ended = raw.call::<Request, Response>(&Request::PutEnd(finish), t).unwrap();
    match ended {
        Response::Error(code) => assert!(
            matches!(code, tycho_proto::ErrorCode::KVPT_NOT_OWNED | tycho_proto::ErrorCode::STALE_EPOCH),
            "{code:?}"
        ),
        Response::NotOwned(r) => assert_eq!((r.group, r.owner.as_str()), (1, b.rpc.as_str()), "{r:?}"),
        other => panic!("the former primary answered a delayed PutEnd with {other:?}"),
    }
    // Once a's route table names b, a refuses a write of group 1 naming b, and forwards a
    // read sent under the old epoch to b, relaying b's answer.
    let deadline = Instant::now() + ROLE_WAIT;
    let epoch = loop {
        if let Ok(Response::Routes(r)) = raw.call::<Request, Response>(&Request::Routes, t) {
            if r.owners.get(1) == Some(&b.rpc) {
                break r.epochs[1];
            }
        }
        assert!(Instant::now() < deadline, "a's route table never named b");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(epoch > first, "a claim raises the epoch");
    let fresh = KeyRef { key: ours[1].clone(), route: tycho_routing::route_for("", &ours[1], epoch) };
    let write = WriteStart {
        client: id,
        tenant: String::new(),
        key: fresh,
        size: 512,
        config: Default::default(),
        write_id: 8,
    };
    match raw.call::<Request, Response>(&Request::PutStart(write), t).unwrap() {
        Response::NotOwned(r) => {
            assert_eq!((r.group, r.epoch, r.owner.as_str()), (1, epoch, b.rpc.as_str()), "{r:?}")
        }
        other => panic!("a write of a group a does not serve got {other:?}"),
    }
    let stale = KeyRef { key: ours[0].clone(), route: tycho_routing::route_for("", &ours[0], first) };
    let query = tycho_proto::KeyQuery { tenant: String::new(), key: stale };
    match raw.call::<Request, Response>(&Request::GetReplicaList(query.clone()), t).unwrap() {
        Response::Replicas(list) => assert!(!list.replicas.is_empty(), "{list:?}"),
        other => panic!("a stale read was not forwarded to the group's primary: {other:?}"),
    }
    assert_eq!(raw.call::<Request, Response>(&Request::ExistKey(query.clone()), t).unwrap(), Response::Exists(true));
    // The stale client is redirected: its next put of a group 1 key lands at b, and reads too.
    quiet.put(&ours[1], &value_of(&ours[1], 2000), &Default::default()).unwrap();
    // Issue 46: a read at the former primary is never answered from its old state. A value
    // replaced at b since the claim is read at a, under the old epoch and under the new one:
    // forwarded (b's answer, the new size) or refused naming b, never a's old object.
    let (id2, other) = common::registered(&a.rpc, &secret, "");
    other.call::<Request, Response>(&Request::ReMountSegment { client: id2, segments: Vec::new() }, t).unwrap();
    quiet.upsert(&ours[0], &value_of(&ours[0], 1500), &Default::default()).unwrap();
    for route_epoch in [first, epoch] {
        let key = KeyRef { key: ours[0].clone(), route: tycho_routing::route_for("", &ours[0], route_epoch) };
        let at_a = tycho_proto::KeyQuery { tenant: String::new(), key };
        match other.call::<Request, Response>(&Request::GetReplicaList(at_a), t).unwrap() {
            Response::Replicas(list) => assert_eq!(list.size, 1500, "a read at the former primary saw its old state"),
            Response::NotOwned(r) => assert_eq!((r.group, r.owner.as_str()), (1, b.rpc.as_str()), "{r:?}"),
            other => panic!("a read at the former primary got {other:?}"),
        }
    }
    assert_eq!(quiet.get(&ours[0]).unwrap(), value_of(&ours[0], 1500));
    quiet.upsert(&ours[0], &value_of(&ours[0], 1000), &Default::default()).unwrap();
    // A batch of group 1's keys at a: refused per key, with b named as the group's owner.
    let batch = tycho_proto::BatchKeyQuery {
        tenant: String::new(),
        keys: ours[..2]
            .iter()
            .map(|k| KeyRef { key: k.clone(), route: tycho_routing::route_for("", k, epoch) })
            .collect(),
    };
    match other.call::<Request, Response>(&Request::BatchExistKey(batch), t).unwrap() {
        Response::Redirected { answer, owners } => {
            assert_eq!(*answer, Response::BatchExists(vec![Err(tycho_proto::ErrorCode::KVPT_NOT_OWNED); 2]));
            let named: Vec<(u32, u64, &str)> = owners.iter().map(|r| (r.group, r.epoch, r.owner.as_str())).collect();
            assert_eq!(named, vec![(1, epoch, b.rpc.as_str())]);
        }
        other => panic!("a batch of a group a does not serve got {other:?}"),
    }
    assert_eq!(quiet.get(&ours[1]).unwrap(), value_of(&ours[1], 2000));
    assert_eq!(
        quiet.get(&ours[0]).unwrap(),
        value_of(&ours[0], 1000),
        "what the caretaker committed moved with the group"
    );
    assert_eq!(objects(&b, &secret), 3, "b holds the group's two objects and the unfinished write");
    let never = quiet.get(&ours[2]).unwrap_err();
    assert!(
        matches!(never, tycho_proto::ErrorCode::REPLICA_IS_NOT_READY | tycho_proto::ErrorCode::OBJECT_NOT_FOUND),
        "{never:?}"
    );
}

/// Of eight compare-and-swaps of one group record against the same epoch, on a real etcd,
/// exactly one wins; the others learn the winner's record.
#[test]
fn concurrent_promotions_against_one_epoch_have_one_winner() {
    use tycho_master::ownership::{change_group, create_group, ClusterKeys, OwnershipError};
    let _one = serial();
    let etcd = EtcdServer::start_new().expect("etcd starts (scripts/test installs it)");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let store: std::sync::Arc<dyn tycho_meta::MetaStore> = std::sync::Arc::new(
            tycho_meta::EtcdStore::connect(tycho_meta::EtcdOptions::new([etcd.endpoint()])).await.unwrap(),
        );
        let keys = ClusterKeys::new("race");
        let read = create_group(&*store, &keys, 5, "old", false).await.unwrap();
        let tries = (0..8).map(|i| {
            let (store, keys, read) = (store.clone(), keys.clone(), read.clone());
            tokio::spawn(async move { change_group(&*store, &keys, &read, |g| g.primary = format!("m{i}")).await })
        });
        let mut won = Vec::new();
        let mut lost = 0;
        for t in tries {
            match t.await.unwrap() {
                Ok(w) => won.push(w),
                Err(OwnershipError::Conflict(Some(_))) => lost += 1,
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!((won.len(), lost), (1, 7), "{won:?}");
        assert_eq!(won[0].0.epoch, read.0.epoch + 1);
        let now = tycho_master::ownership::read_group(&*store, &keys, 5).await.unwrap().unwrap();
        assert_eq!(now, won[0]);
    });
}

/// G = 2 with four masters: group 1's primary is SIGKILLed under a steady load of single-key
/// puts and reads over both groups, and a batch spanning both is written during the outage.
/// Group 0's operations see no error at all; the batch fails (if at all) only in group 1's
/// slots; group 1's standby takes over, and every acknowledged object is then read back with
/// its bytes.
#[test]
fn killing_one_groups_primary_under_load_costs_only_that_group() {
    let _one = serial();
    let c = Cluster::new("kill");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "2"]);
    let mut b = c.master("primary of groups 1", &[]);
    let _s0 = c.master("standby of group 0", &[]);
    let s1 = c.master("standby of group 1", &[]);
    wait_groups(&a, "both groups paired", |g| g.len() == 2 && g.iter().all(|r| r.1.len() == 1));
    let (_node, client) = c.node_and_client(&a.rpc);
    let group = |k: &str| tycho_routing::kvpt_to_rank(tycho_routing::partition_of("", k), 2);
    let load = Load::new();
    std::thread::scope(|s| {
        s.spawn(|| load.run(&client, "kill", 3000));
        let _stop = StopOnDrop(&load);
        load.wait_for(100, "load before the kill");
        b.proc.signal(libc::SIGKILL);
        // A batch over both groups during the outage.
        let batch: Vec<String> = (0..20).map(|i| format!("kill/batch/{i}")).collect();
        let values: Vec<Vec<u8>> = batch.iter().map(|k| value_of(k, 3000)).collect();
        let items: Vec<(&str, &[u8])> = batch.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        for (k, r) in
            batch.iter().zip(client.write_batch(tycho_client::WriteMode::Put, &items, &Default::default(), true))
        {
            match r {
                Ok(()) => load.acked.lock().unwrap().push(k.clone()),
                Err(e) => assert_eq!(group(k), 1, "a group 0 slot of the batch failed: {k} {e:?}"),
            }
        }
        wait_groups(&a, "group 1's standby takes over", |g| g[1].0 == s1.rpc);
        load.wait_for(load.acked() + 100, "load after the takeover");
        load.stop();
    });
    let errors = load.errors.into_inner().unwrap();
    assert!(errors.iter().all(|(k, _)| group(k) == 1), "group 0 saw errors: {errors:?}");
    let acked = load.acked.into_inner().unwrap();
    println!("{} acknowledged, {} errors (group 1, during its failover)", acked.len(), errors.len());
    let fresh = c.client(&s1.rpc);
    for k in &acked {
        assert_eq!(fresh.get(k).unwrap_or_else(|e| panic!("acknowledged {k} lost: {e:?}")), value_of(k, 3000), "{k}");
    }
}

/// A joining master claims a caretaken group (it catches up as standby, then takes the group
/// over by one compare-and-swap) while a client writes and reads keys of every group: no call
/// fails (a request for the group during the switch is redirected, or told to wait while the
/// new primary replays the log's end), and every acknowledged value is read back from the new
/// primary.
#[test]
fn a_planned_switch_under_load_fails_no_call_and_loses_nothing() {
    let _one = serial();
    let c = Cluster::new("claim-load");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "2"]);
    wait_groups(&a, "a creates both groups", |g| g.len() == 2);
    let (_node, client) = c.node_and_client(&a.rpc);
    let load = Load::new();
    let b = load.around(&client, "claim", 2000, 100, || {
        let b = c.master("", &[]);
        wait_groups(&a, "b claims group 1", |g| g[1].0 == b.rpc && !g[1].3);
        b
    });
    let errors = load.errors.into_inner().unwrap();
    assert!(errors.is_empty(), "calls failed during a planned switch: {errors:?}");
    let acked = load.acked.into_inner().unwrap();
    println!("{} acknowledged, none failed", acked.len());
    let group = |k: &str| tycho_routing::kvpt_to_rank(tycho_routing::partition_of("", k), 2);
    assert!(acked.iter().any(|k| group(k) == 1) && acked.iter().any(|k| group(k) == 0));
    let fresh = c.client(&b.rpc);
    for k in &acked {
        assert_eq!(fresh.get(k).unwrap_or_else(|e| panic!("acknowledged {k} lost: {e:?}")), value_of(k, 2000), "{k}");
    }
}

/// `tycho up --masters 3 --groups 4` runs three masters of a four-group cluster in one process
/// on an in-memory coordination store: every group gets a primary (the first master keeps
/// groups 0 and 3, the others claim 1 and 2), the embedded node is reached through all of them
/// (the self-check passes), and `tycho groups` shows the layout. SIGTERM stops it with status 0.
#[test]
fn tycho_up_runs_several_masters_of_one_cluster() {
    let _one = serial();
    let home = TempDir::new("tycho-up-cluster").unwrap();
    // The runtime directory holds the cluster secret: private to the user, or refused.
    std::fs::set_permissions(home.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut cmd = std::process::Command::new(TYCHO);
    cmd.args(["up", "--masters", "3", "--groups", "4", "--rpc-port", "0", "--metrics-port", "0"])
        .args(["--segment-size", "64MB"])
        .env("TYCHO_RUNTIME_DIR", home.path());
    let mut up = tycho_testkit::Proc::spawn(&mut cmd).unwrap();
    let m0 = up.wait_line("  master m0      RPC ", ROLE_WAIT).unwrap();
    let admin = m0.split("admin http://").nth(1).unwrap().trim().to_string();
    let check = up.wait_line("  self-check     ", ROLE_WAIT).unwrap();
    assert!(check.starts_with("ok"), "{check}");
    // `tycho groups` finds the secret `tycho up` keeps in the runtime directory.
    let out = std::process::Command::new(TYCHO)
        .args(["groups", "--admin", &admin])
        .env("TYCHO_RUNTIME_DIR", home.path())
        .env_remove("TYCHO_SECRET_FILE")
        .env_remove("TYCHO_SECRET")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    let primaries: std::collections::BTreeSet<&str> =
        table.lines().skip(1).map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!((table.lines().count(), primaries.len()), (5, 3), "{table}");
    up.signal(libc::SIGTERM);
    let end = up.wait_line("never printed", ROLE_WAIT).unwrap_err().to_string();
    assert!(end.contains("exit status: 0"), "{end}");
}

#[test]
fn tycho_up_with_etcd_runs_the_masters_as_separate_processes() {
    let _one = serial();
    let etcd = EtcdServer::start_new().expect("etcd starts (scripts/test installs it)");
    let home = TempDir::new("tycho-up-etcd").unwrap();
    std::fs::set_permissions(home.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let runtime = home.path().to_str().unwrap();
    let mut cmd = std::process::Command::new(TYCHO);
    cmd.args(["up", "--masters", "2", "--groups", "2", "--rpc-port", "0", "--metrics-port", "0"])
        .args(["--segment-size", "64MB", "--etcd-endpoints", &etcd.endpoint()])
        .env("TYCHO_RUNTIME_DIR", runtime);
    let mut up = tycho_testkit::Proc::spawn(&mut cmd).unwrap();
    let lines: Vec<String> =
        (0..2).map(|i| up.wait_line(&format!("  master m{i}      RPC "), ROLE_WAIT).unwrap()).collect();
    let pid = |l: &str| l.split("pid ").nth(1).unwrap().trim().parse::<u32>().unwrap();
    let rpc = |l: &str| l.split_whitespace().next().unwrap().to_string();
    let pids = [pid(&lines[0]), pid(&lines[1])];
    assert!(pids[0] != pids[1] && !pids.contains(&up.pid()), "separate processes: {pids:?}, up {}", up.pid());
    let groups: Vec<String> = (0..2).map(|r| up.wait_line(&format!("  group {r}  "), ROLE_WAIT).unwrap()).collect();
    assert!(groups[0].contains("primary m0") && groups[1].contains("primary m1"), "one group each: {groups:?}");
    let check = up.wait_line("  self-check     ", ROLE_WAIT).unwrap();
    assert!(check.starts_with("ok"), "{check}");
    // The CLI finds the secret under either master's port, and aggregates over both primaries.
    let env = [("TYCHO_RUNTIME_DIR", runtime)];
    for k in 0..8 {
        let out = tycho_testkit::run_cli(TYCHO, &rpc(&lines[1]), &["put", &format!("up/{k}"), "-"], &env, b"hello");
        assert!(out.status.success(), "put: {}", tycho_testkit::text(&out.stderr));
    }
    let out = tycho_testkit::run_cli(TYCHO, &rpc(&lines[1]), &["ls"], &env, b"");
    let listed = tycho_testkit::text(&out.stdout);
    assert_eq!(listed.lines().filter(|l| l.starts_with("up/")).count(), 8, "{listed}");
    let out = tycho_testkit::run_cli(TYCHO, &rpc(&lines[0]), &["stat"], &env, b"");
    let stat = tycho_testkit::text(&out.stdout);
    assert!(stat.contains("objects   8") && stat.contains("primaries 2"), "{stat}");
    for k in 0..8 {
        let out = tycho_testkit::run_cli(TYCHO, &rpc(&lines[0]), &["exist", &format!("up/{k}")], &env, b"");
        assert_eq!(tycho_testkit::text(&out.stdout).trim(), "1", "{}", tycho_testkit::text(&out.stderr));
    }
    up.signal(libc::SIGTERM);
    let end = up.wait_line("never printed", ROLE_WAIT).unwrap_err().to_string();
    assert!(end.contains("exit status: 0"), "{end}");
    for p in pids {
        assert!(!std::path::Path::new(&format!("/proc/{p}")).exists(), "master {p} outlived tycho up");
    }
}

/// Group `rank`'s record as `master` reports it (JSON).
fn record(master: &MasterProc, rank: u64) -> serde_json::Value {
    let rows: serde_json::Value = serde_json::from_str(&http_get(&master.http, "/kvpt_groups")).unwrap();
    rows.as_array().unwrap().iter().find(|r| r["rank"].as_u64() == Some(rank)).cloned().expect("the group exists")
}

/// The reshard intents `master` lists.
fn intents(master: &MasterProc) -> Vec<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(&http_get(&master.http, "/reshard")).unwrap().as_array().unwrap().clone()
}

impl Cluster {
    /// Two masters of a G = 2 cluster, each the primary of one group, a node and a client.
    fn two_primaries(&self) -> (MasterProc, MasterProc, NodeProc, Client) {
        let a = self.master("primary of groups 0", &["--kvpt-groups", "2"]);
        let b = self.master("primary of groups 1", &[]);
        wait_groups(&a, "b claims group 1", |g| g.len() == 2 && g[1].0 == b.rpc && !g[1].3);
        let (node, client) = self.node_and_client(&a.rpc);
        (a, b, node, client)
    }

    /// `tycho reshard` of group `rank` to `target` through `admin` (with the cluster secret),
    /// run to its end.
    fn reshard(&self, admin: &MasterProc, rank: u32, target: &str) -> std::process::Output {
        std::process::Command::new(TYCHO)
            .args(["reshard", "--admin", &admin.http, "--rank", &rank.to_string(), "--target", target])
            .args(["--secret-file", self.secret.to_str().unwrap()])
            .output()
            .unwrap()
    }
}

/// Moving a group (online reshard, issue 14) while a client writes and reads keys of both
/// groups: `tycho reshard` prints each step and ends once the target serves the group; no call
/// fails (writes wait out the freeze), every acknowledged value is read back from the target,
/// the group's epoch rose by one, the other group is untouched, and no request is left.
#[test]
fn a_reshard_under_load_moves_a_group_and_fails_no_call_and_loses_nothing() {
    let _one = serial();
    let c = Cluster::new("reshard-load");
    let (a, b, _node, client) = c.two_primaries();
    let before = groups(&a);
    let load = Load::new();
    let out = load.around(&client, "move", 2000, 100, || c.reshard(&b, 1, &a.rpc));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "tycho reshard: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    println!("{stdout}");
    for step in ["requested: group 1", "switched: ", "done in "] {
        assert!(stdout.contains(step), "{step:?} not printed: {stdout}");
    }
    let after = groups(&a);
    assert_eq!((&after[1].0, after[1].2), (&a.rpc, before[1].2 + 1), "{after:?}");
    assert_eq!((&after[0].0, after[0].2), (&before[0].0, before[0].2), "group 0 is untouched: {after:?}");
    assert_eq!(record(&a, 1)["state"], "Stable");
    assert!(intents(&a).is_empty(), "the request is cleared");
    let errors = load.errors.into_inner().unwrap();
    assert!(errors.is_empty(), "calls failed during a reshard: {errors:?}");
    // What the client's writes met on the way (and retried): the freeze at the source, then
    // the route moving to the target (a redirect, or a group still being installed there).
    for m in [&a, &b] {
        let met = write_errors(m);
        println!("write errors answered by {}: {met:?}", m.rpc);
        for (what, _) in &met {
            assert!(
                ["KVPT_MIGRATING", "KVPT_NOT_OWNED", "STALE_EPOCH"].iter().any(|c| what.ends_with(c)),
                "a write met {what} during a reshard: {met:?}"
            );
        }
    }
    let acked = load.acked.into_inner().unwrap();
    let group = |k: &str| tycho_routing::kvpt_to_rank(tycho_routing::partition_of("", k), 2);
    assert!(acked.iter().any(|k| group(k) == 1) && acked.iter().any(|k| group(k) == 0));
    let fresh = c.client(&a.rpc);
    for k in &acked {
        assert_eq!(fresh.get(k).unwrap_or_else(|e| panic!("acknowledged {k} lost: {e:?}")), value_of(k, 2000), "{k}");
    }
    println!("{} acknowledged, none failed", acked.len());
}

/// A reshard request is refused, and nothing recorded, without the cluster secret, for a group
/// or a target that does not exist, for a group its target serves already, and while the group
/// is moving; one past its deadline is abandoned by the group's primary, which keeps it.
#[test]
fn reshard_requests_are_checked_and_one_past_its_deadline_is_abandoned() {
    let _one = serial();
    let c = Cluster::new("reshard-checks");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "2"]);
    let b = c.master("primary of groups 1", &[]);
    let before = wait_groups(&a, "b claims group 1", |g| g.len() == 2 && g[1].0 == b.rpc && !g[1].3);
    let secret = common::admin_token(&std::fs::read_to_string(&c.secret).unwrap());
    let post = |path: &str, bearer: Option<&str>| common::http_call(&a.http, "POST", path, bearer, "");
    let to_a = format!("/reshard?rank=1&target={}", a.rpc);
    assert_eq!(post(&to_a, None).0, 401, "no secret");
    assert_eq!(post(&to_a, Some("a-wrong-secret-of-enough-length")).0, 401, "a wrong secret");
    let (status, body) = post(&format!("/reshard?rank=2&target={}", a.rpc), Some(&secret));
    assert_eq!(status, 404, "{body}");
    let (status, body) = post("/reshard?rank=1&target=nobody:1", Some(&secret));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a live master"), "{body}");
    let (status, body) = post(&format!("/reshard?rank=0&target={}", a.rpc), Some(&secret));
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("primary already"), "{body}");
    assert!(intents(&a).is_empty(), "nothing recorded");
    // Already past its deadline: the source ends it and keeps the group, epoch and all.
    let (status, body) = post(&format!("{to_a}&deadline_ms=0"), Some(&secret));
    assert_eq!(status, 200, "{body}");
    let deadline = Instant::now() + ROLE_WAIT;
    while !intents(&a).is_empty() {
        assert!(Instant::now() < deadline, "the expired request was never cleared");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(groups(&a), before, "the group stays where it was");
    assert_eq!(record(&a, 1)["state"], "Stable");
    // One at a time: a second request while the first holds (or once it is done) is refused.
    let (status, body) = post(&to_a, Some(&secret));
    assert_eq!(status, 200, "{body}");
    let (status, body) = post(&to_a, Some(&secret));
    assert_eq!(status, 409, "{body}");
    wait_groups(&a, "the move ends at a", |g| g[1].0 == a.rpc);
}

/// A target that stops short of the switch (a failpoint: it keeps its lease and follows the log,
/// but never promotes) holds the freeze only up to its limit: the source then lifts it and
/// abandons the move, `tycho reshard` says so and fails, the group stays with its source at its
/// epoch, and the client's writes, which waited out the freeze, all succeed.
#[cfg(feature = "failpoints")]
#[test]
fn a_reshard_whose_target_hangs_at_a_failpoint_is_abandoned_and_the_group_stays_with_its_source() {
    let _one = serial();
    let c = Cluster::new("reshard-hang");
    let (a, b, _node, client) = c.two_primaries();
    let before = groups(&a);
    assert_eq!(common::http_call(&a.http, "PUT", "/fail/reshard::switch", None, "return").0, 200);
    let load = Load::new();
    let out = load.around(&client, "hang", 2000, 50, || c.reshard(&a, 1, &a.rpc));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert_eq!(out.status.code(), Some(1), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("froze the group's writes") && stdout.contains("abandoned"), "{stdout}");
    assert_eq!(groups(&a), before, "the group stays with its source, at its epoch");
    assert_eq!(record(&a, 1)["state"], "Stable");
    assert!(intents(&a).is_empty());
    let errors = load.errors.into_inner().unwrap();
    assert!(errors.is_empty(), "calls failed while the freeze lasted: {errors:?}");
    let fresh = c.client(&b.rpc);
    for k in load.acked.into_inner().unwrap() {
        assert_eq!(fresh.get(&k).unwrap_or_else(|e| panic!("acknowledged {k} lost: {e:?}")), value_of(&k, 2000));
    }
}

/// A master killed (SIGKILL, by a failpoint) at a step of a reshard: the master that took the
/// request right after storing it, the target right after it set the group migrating, or the
/// source right after it froze the group's writes. Whichever it was, the move ends (done,
/// abandoned, or overtaken by the group's failover) with the group stable under one live
/// primary, the request cleared, and every acknowledged object readable; a client that loses
/// no master serving its keys sees no failed call.
#[cfg(feature = "failpoints")]
#[test]
fn a_reshard_ends_with_one_primary_and_every_object_whichever_master_a_failpoint_kills() {
    let _one = serial();
    // (failpoint, victim, target, who serves group 1 at the end, no call may fail)
    let cases = [
        ("reshard::requested", 'c', 'a', 'a', true),
        ("reshard::target_migrating", 'c', 'c', 'b', true),
        ("reshard::source_frozen", 'b', 'c', 'c', false),
    ];
    for (failpoint, victim, target, end, clean) in cases {
        let c = Cluster::new("reshard-kill");
        let a = c.master("primary of groups 0", &["--kvpt-groups", "2"]);
        let b = c.master("primary of groups 1", &[]);
        let s = c.master("standby of group 0", &[]);
        wait_groups(&a, "b claims group 1, the third master backs group 0", |g| {
            g.len() == 2 && g[1].0 == b.rpc && !g[1].3 && g[0].1 == [s.rpc.clone()]
        });
        let (_node, client) = c.node_and_client(&a.rpc);
        let by = |m: char| match m {
            'a' => &a,
            'b' => &b,
            _ => &s,
        };
        let secret = common::admin_token(&std::fs::read_to_string(&c.secret).unwrap());
        assert_eq!(common::http_call(&by(victim).http, "PUT", &format!("/fail/{failpoint}"), None, "return").0, 200);
        // The request goes through the third master when it is the victim, else through a.
        let door = if failpoint == "reshard::requested" { &s } else { &a };
        let load = Load::new();
        load.around(&client, failpoint, 2000, 50, || {
            let path = format!("/reshard?rank=1&target={}", by(target).rpc);
            // (The victim of the first case dies before it answers.)
            let mut sock = std::net::TcpStream::connect(&door.http).unwrap();
            write!(sock, "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer {secret}\r\nContent-Length: 0\r\n\r\n")
                .unwrap();
            let mut answer = String::new();
            let _ = sock.read_to_string(&mut answer);
            let deadline = Instant::now() + ROLE_WAIT;
            loop {
                let rec = record(&a, 1);
                if intents(&a).is_empty() && rec["state"] == "Stable" && rec["primary"] == by(end).rpc.as_str() {
                    break;
                }
                assert!(Instant::now() < deadline, "{failpoint}: the move never ended: {rec} {:?}", intents(&a));
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        // The victim died (its registration ends with its lease); group 1's primary lives.
        let live = || -> Vec<String> {
            let masters: serde_json::Value = serde_json::from_str(&http_get(&a.http, "/masters")).unwrap();
            masters.as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap().to_string()).collect()
        };
        let deadline = Instant::now() + ROLE_WAIT;
        while live().contains(&by(victim).rpc) {
            assert!(Instant::now() < deadline, "{failpoint}: the victim still lives: {:?}", live());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(live().contains(&by(end).rpc), "{failpoint}: group 1's primary is not live");
        assert_eq!(record(&a, 1)["primary"], by(end).rpc.as_str(), "{failpoint}: the group moved again");
        let errors = load.errors.into_inner().unwrap();
        if clean {
            assert!(errors.is_empty(), "{failpoint}: calls failed: {errors:?}");
        }
        let acked = load.acked.into_inner().unwrap();
        let fresh = c.client(&a.rpc);
        for k in &acked {
            let got = fresh.get(k).unwrap_or_else(|e| panic!("{failpoint}: acknowledged {k} lost: {e:?}"));
            assert_eq!(got, value_of(k, 2000), "{k}");
        }
        println!("{failpoint}: group 1 ends with {end}; {} acknowledged, {} calls failed", acked.len(), errors.len());
    }
}

// ---- per-group node liveness (issue 47) ---------------------------------------------------------

/// `name`'s value in `master`'s metrics (0 when absent).
fn metric(master: &MasterProc, name: &str) -> u64 {
    let page = http_get(&master.http, "/metrics");
    page.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0, |n| n.trim().parse::<f64>().unwrap() as u64)
}

/// A node whose heartbeats to one master are lost (a failpoint: after 5 beats, for 6, about 6 s,
/// past the masters' client TTL of 2 s) is expired by that master alone, which drops the node's replicas
/// in its group. Once its pings get through again, the node mounts its segment there under a
/// new incarnation of that group's slice only: every object of the other group stays readable
/// through it, with its bytes, and the other master never expired it.
#[cfg(feature = "failpoints")]
#[test]
fn a_node_cut_off_from_one_master_loses_only_that_masters_groups_replicas_failpoint() {
    let _one = serial();
    let c = Cluster::new("t-slices");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "2", "--client-ttl", "2"]);
    let b = c.master("primary of groups 1", &["--client-ttl", "2"]);
    wait_groups(&a, "b claims group 1", |g| g.len() == 2 && g[1].0 == b.rpc && !g[1].3);
    let cut = format!("client::drop_pings_to=5*off->6*return({})", a.rpc);
    let secret = ["--secret-file", c.secret.to_str().unwrap()];
    let _node = NodeProc::start_env(TYCHO, &a.rpc, "64MB", &secret, &[("FAILPOINTS", &cut)]);
    let client = c.client(&a.rpc);
    let (kept, dropped) = (keys_of_group("kept/", 1, 2, 40), keys_of_group("dropped/", 0, 2, 40));
    // The node's segment is the only memory: every put lands there, in the slice of its group.
    let deadline = Instant::now() + ROLE_WAIT;
    for k in kept.iter().chain(&dropped) {
        while let Err(e) = client.put(k, &value_of(k, 4096), &Default::default()) {
            assert!(Instant::now() < deadline, "put {k}: {e:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // (The node's first 5 beats reach a: these puts are well within them.)
    assert_eq!(metric(&a, "tycho_master_clients_expired_total"), 0, "a expired the node while the test wrote");
    // a expires the node (its pings are lost); b hears from it all along.
    let deadline = Instant::now() + ROLE_WAIT;
    while metric(&a, "tycho_master_clients_expired_total") == 0 {
        assert!(Instant::now() < deadline, "a never expired the node");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Once its pings reach a again, the node mounts its segment there anew: a put of group 0
    // finds memory.
    let deadline = Instant::now() + ROLE_WAIT;
    while let Err(e) = client.put("dropped/after", b"back", &Default::default()) {
        assert!(Instant::now() < deadline, "the node never mounted its segment on a again: {e:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(&b, "tycho_master_clients_expired_total"), 0, "b expired a node that pinged it");
    // Group 1's objects, on the node's slice of b's group, are all there with their bytes.
    let fresh = c.client(&b.rpc);
    for k in &kept {
        let got = fresh.get(k).unwrap_or_else(|e| panic!("{k} of group 1 lost with a's expiry: {e:?}"));
        assert_eq!(got, value_of(k, 4096), "{k}");
    }
    // Group 0's went with the expiry.
    for k in &dropped {
        assert_eq!(fresh.get(k), Err(tycho_proto::ErrorCode::OBJECT_NOT_FOUND), "{k}");
    }
    assert_eq!(fresh.get("dropped/after").unwrap(), b"back");
}

// ---- copy and move tasks (issue 15) ------------------------------------------------------------

/// A master with a secret, alone (no etcd), with `extra` flags, and a way to reach it.
struct Alone {
    master: MasterProc,
    _home: TempDir,
    secret: PathBuf,
}

impl Alone {
    fn new(extra: &[&str]) -> Alone {
        let home = TempDir::new("tycho-tasks").unwrap();
        let secret = secret_file(home.path());
        let mut flags = vec!["--secret-file", secret.to_str().unwrap()];
        flags.extend_from_slice(extra);
        Alone { master: MasterProc::start(TYCHO, &flags), _home: home, secret }
    }

    /// A node of 64 MB with `env` set (FAILPOINTS in a failpoints build).
    fn node(&self, env: &[(&str, &str)]) -> NodeProc {
        NodeProc::start_env(TYCHO, &self.master.rpc, "64MB", &["--secret-file", self.secret.to_str().unwrap()], env)
    }

    fn client(&self) -> Client {
        self.client_with(|_| {})
    }

    /// [`Alone::client`] with its settings changed by `f`.
    fn client_with(&self, f: impl FnOnce(&mut ClientConfig)) -> Client {
        client_of(&self.master.rpc, &self.secret, f)
    }

    /// `tycho <args>` against the master, with the cluster secret.
    fn cli(&self, args: &[&str]) -> std::process::Output {
        let env = [("TYCHO_SECRET_FILE", self.secret.to_str().unwrap())];
        tycho_testkit::run_cli(TYCHO, &self.master.rpc, args, &env, b"")
    }
}

/// Puts `key` (`len` bytes) on segment `on` alone, once that segment is mounted.
fn put_on(client: &Client, key: &str, len: usize, on: &str) {
    let cfg = tycho_proto::ReplicateConfig { preferred_segments: vec![on.to_string()], ..Default::default() };
    let deadline = Instant::now() + ROLE_WAIT;
    loop {
        client.put(key, &value_of(key, len), &cfg).unwrap();
        if replica_segments(client, key) == [on.to_string()] {
            return;
        }
        // Placed elsewhere before the segment was mounted: again.
        assert!(Instant::now() < deadline, "{on} never took {key}");
        client.remove(key, true).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The names of the segments holding `key`'s replicas, sorted.
fn replica_segments(client: &Client, key: &str) -> Vec<String> {
    let Ok(reps) = client.replicas(key) else { return Vec::new() };
    let Ok(tycho_proto::Response::Segments(segs)) = client.call(&tycho_proto::Request::ListSegments) else {
        panic!("no segment list")
    };
    let mut names: Vec<String> =
        reps.iter().filter_map(|r| segs.iter().find(|s| s.desc.id == r.segment).map(|s| s.desc.name.clone())).collect();
    names.sort();
    names
}

/// Waits (bounded) until task `id` has ended; returns it.
fn task_ended(client: &Client, id: u128) -> tycho_proto::TaskInfo {
    let deadline = Instant::now() + ROLE_WAIT;
    loop {
        let t = client.query_task(id).unwrap();
        if t.status.is_finished() {
            return t;
        }
        assert!(Instant::now() < deadline, "task {id:032x} never ended: {t:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Copy and move tasks run by the node that holds the replica, asked for through the client
/// library and the command line: a move leaves the value readable on the target alone, a copy
/// adds a replica that serves the value once the source node is gone, and the pending-task limit
/// refuses more tasks while a stopped node lets its tasks wait.
#[test]
fn copy_and_move_tasks_run_on_the_node_that_holds_the_replica() {
    let _one = serial();
    let s = Alone::new(&["--max-total-pending-tasks", "2"]);
    let mut n1 = s.node(&[]);
    let n2 = s.node(&[]);
    let c = s.client();
    const LEN: usize = 3 << 20;
    put_on(&c, "t/move", LEN, &n1.hostname);
    put_on(&c, "t/copy", LEN, &n1.hostname);

    // A move, from the command line, waiting for its end.
    let out = s.cli(&["move", "t/move", "--from", &n1.hostname, "--to", &n2.hostname, "--wait"]);
    let shown = tycho_testkit::text(&out.stdout);
    assert!(out.status.success(), "{shown}{}", tycho_testkit::text(&out.stderr));
    assert!(shown.contains("status   Success") && shown.contains("type     Move"), "{shown}");
    assert_eq!(replica_segments(&c, "t/move"), std::slice::from_ref(&n2.hostname));
    assert_eq!(c.get("t/move").unwrap(), value_of("t/move", LEN));

    // A copy, through the library.
    let id = c.create_copy_task("t/copy", std::slice::from_ref(&n2.hostname)).unwrap();
    let t = task_ended(&c, id);
    assert_eq!(
        (t.status, t.kind, t.key.as_str()),
        (tycho_proto::TaskStatus::Success, tycho_proto::TaskKind::Copy, "t/copy")
    );
    assert_eq!((t.source.as_str(), t.targets.clone()), (n1.hostname.as_str(), vec![n2.hostname.clone()]));
    let mut both = vec![n1.hostname.clone(), n2.hostname.clone()];
    both.sort();
    assert_eq!(replica_segments(&c, "t/copy"), both);
    let out = s.cli(&["task", &format!("{id:032x}")]);
    assert!(tycho_testkit::text(&out.stdout).contains("status   Success"), "{}", tycho_testkit::text(&out.stdout));
    // A copy to a segment that holds the value already is done at once (as Mooncake's is); one
    // to a segment that does not exist is refused.
    let again = c.create_copy_task("t/copy", std::slice::from_ref(&n2.hostname)).unwrap();
    assert_eq!(c.query_task(again).unwrap().status, tycho_proto::TaskStatus::Success);
    let nowhere = c.create_copy_task("t/copy", &["127.0.0.1:1".to_string()]);
    assert_eq!(nowhere, Err(tycho_proto::ErrorCode::INVALID_PARAMS));

    // The limit: with n1 stopped its tasks wait; two may, the third is refused.
    put_on(&c, "t/limit0", 4096, &n1.hostname);
    put_on(&c, "t/limit1", 4096, &n1.hostname);
    put_on(&c, "t/limit2", 4096, &n1.hostname);
    n1.proc.signal(libc::SIGSTOP);
    let to = std::slice::from_ref(&n2.hostname);
    let waiting = [c.create_copy_task("t/limit0", to).unwrap(), c.create_copy_task("t/limit1", to).unwrap()];
    assert_eq!(c.create_copy_task("t/limit2", to), Err(tycho_proto::ErrorCode::TASK_PENDING_LIMIT_EXCEEDED));
    for id in waiting {
        assert_eq!(c.query_task(id).unwrap().status, tycho_proto::TaskStatus::Pending);
    }
    n1.proc.signal(libc::SIGCONT);
    for id in waiting {
        assert_eq!(task_ended(&c, id).status, tycho_proto::TaskStatus::Success);
    }
    let last = c.create_copy_task("t/limit2", to).unwrap();
    assert_eq!(task_ended(&c, last).status, tycho_proto::TaskStatus::Success);

    // The copy serves the value once its source is gone (n1 unmounts as it stops).
    n1.proc.signal(libc::SIGTERM);
    let deadline = Instant::now() + ROLE_WAIT;
    while replica_segments(&c, "t/copy") != [n2.hostname.clone()] {
        assert!(Instant::now() < deadline, "n1's replica never went away");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.get("t/copy").unwrap(), value_of("t/copy", LEN));
    let metrics = http_get(&s.master.http, "/metrics");
    for line in [
        "tycho_master_tasks_total{type=\"copy\",outcome=\"succeeded\"} 5",
        "tycho_master_tasks_total{type=\"move\",outcome=\"succeeded\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} not in the metrics");
    }
}

#[cfg(feature = "failpoints")]
/// How many times `master` answered `rpc` (its `tycho_master_rpc_requests_total`).
fn rpc_count(master: &MasterProc, rpc: &str) -> u64 {
    let prefix = format!("tycho_master_rpc_requests_total{{rpc=\"{rpc}\"}} ");
    let page = http_get(&master.http, "/metrics");
    page.lines().find_map(|l| l.strip_prefix(prefix.as_str())).map_or(0, |n| n.trim().parse().unwrap())
}

/// A node held at a failpoint just after it started a task's copy: a remove of the object is
/// refused with OBJECT_HAS_REPLICATION_TASK; then the node is SIGKILLed, and the master fails
/// the task once the node's client expires, drops the copy, and frees the target's ranges at
/// the release timeout.
#[cfg(feature = "failpoints")]
#[test]
fn a_task_whose_node_is_killed_mid_copy_fails_and_is_cleaned_up_failpoint() {
    let _one = serial();
    let s = Alone::new(&[
        "--client-ttl",
        "2",
        "--put-start-discard-timeout-sec",
        "1",
        "--put-start-release-timeout-sec",
        "3",
    ]);
    let mut n1 = s.node(&[("FAILPOINTS", "client::task::copy_started=sleep(60000)")]);
    let n2 = s.node(&[]);
    let c = s.client();
    put_on(&c, "t/held", 64 << 10, &n1.hostname);
    let id = c.create_copy_task("t/held", std::slice::from_ref(&n2.hostname)).unwrap();
    let deadline = Instant::now() + ROLE_WAIT;
    while rpc_count(&s.master, "copy_start") == 0 {
        assert!(Instant::now() < deadline, "the node never started the copy");
        std::thread::sleep(Duration::from_millis(20));
    }
    let used_on = |name: &str| -> u64 {
        let Ok(tycho_proto::Response::Segments(segs)) = c.call(&tycho_proto::Request::ListSegments) else { panic!() };
        segs.iter().find(|x| x.desc.name == name).map_or(0, |x| x.used)
    };
    assert!(used_on(&n2.hostname) >= 64 << 10, "the copy's range is reserved on the target");
    assert_eq!(c.query_task(id).unwrap().status, tycho_proto::TaskStatus::Processing);
    assert_eq!(c.remove("t/held", false), Err(tycho_proto::ErrorCode::OBJECT_HAS_REPLICATION_TASK));
    assert_eq!(c.get("t/held").unwrap(), value_of("t/held", 64 << 10), "reads go on during the copy");

    n1.proc.signal(libc::SIGKILL);
    let t = task_ended(&c, id);
    assert_eq!((t.status, t.message.as_str()), (tycho_proto::TaskStatus::Failed, "its client went away"));
    // The copy's range comes back at the release timeout; the object went with its only replica.
    let deadline = Instant::now() + ROLE_WAIT;
    while used_on(&n2.hostname) > 0 {
        assert!(Instant::now() < deadline, "the copy's range on the target was never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.get("t/held"), Err(tycho_proto::ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(task_ended(&c, id).status, tycho_proto::TaskStatus::Failed);
}

/// Stops `node` (SIGTERM) and returns how many reads its transfer server served, as it prints.
fn reads_served(node: &mut NodeProc) -> u64 {
    node.proc.signal(libc::SIGTERM);
    let line = node.proc.wait_line("tycho node: served ", ROLE_WAIT).expect("the node says what it served");
    line.split_whitespace().next().unwrap().parse().unwrap()
}

/// Hot-replica fan-out in enforce mode (issue 16) with real processes: a key read by 64 clients
/// turns hot, the master has the node that holds it copy it to the node of another host, and
/// the readers then spread over the two replicas (rendezvous hashing): each holder serves at
/// least a quarter of all the reads, 1/(2N) for N = 2, as the holders count them.
#[test]
fn a_hot_key_gains_a_replica_on_another_host_and_its_readers_spread() {
    let _one = serial();
    let s = Alone::new(&["--dynamic-replication-mode", "enforce"]);
    let secret = s.secret.to_str().unwrap().to_string();
    let node = |host: &str| {
        let flags = ["--secret-file", secret.as_str(), "--host-id", host];
        NodeProc::start_env(TYCHO, &s.master.rpc, "64MB", &flags, &[])
    };
    let (mut n1, mut n2) = (node("host-1"), node("host-2"));
    let c = s.client();
    const LEN: usize = 64 << 10;
    put_on(&c, "hot/prefix", LEN, &n1.hostname);
    // Readers that ask the master on every read, so that they see the new replica at once.
    let readers: Vec<Client> = (0..64).map(|_| s.client_with(|cfg| cfg.reuse_leases = false)).collect();
    let expected = value_of("hot/prefix", LEN);
    for r in &readers {
        assert_eq!(r.get("hot/prefix").unwrap(), expected);
    }
    let deadline = Instant::now() + ROLE_WAIT;
    let mut both = vec![n1.hostname.clone(), n2.hostname.clone()];
    both.sort();
    while replica_segments(&c, "hot/prefix") != both {
        assert!(Instant::now() < deadline, "the hot key never gained a replica on the other host");
        std::thread::sleep(Duration::from_millis(50));
    }
    const ROUNDS: u64 = 20;
    std::thread::scope(|sc| {
        for r in &readers {
            let expected = &expected;
            sc.spawn(move || {
                for _ in 0..ROUNDS {
                    assert_eq!(&r.get("hot/prefix").unwrap(), expected);
                }
            });
        }
    });
    let metrics = http_get(&s.master.http, "/metrics");
    assert!(metrics.contains("\ntycho_master_fanout_admissions_total 1\n"), "one admission");
    let (one, two) = (reads_served(&mut n1), reads_served(&mut n2));
    let total = one + two;
    println!("reads served: {one} by the first replica, {two} by the copy ({total} in all)");
    assert!(total >= 64 * (ROUNDS + 1), "{total} reads counted");
    assert!(one * 4 >= total && two * 4 >= total, "a replica served less than a quarter: {one} and {two}");
}

/// The ranges etcd has served so far (`etcd_mvcc_range_total` on its metrics page).
fn etcd_ranges(etcd: &EtcdServer) -> f64 {
    let addr = etcd.client_addr().to_string();
    let page = http_get(&addr, "/metrics");
    page.lines()
        .find_map(|l| l.strip_prefix("etcd_mvcc_range_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("etcd_mvcc_range_total on etcd's metrics page")
}

/// Issue 45, finding 7: a flood of `/kvpt_groups` requests does not become a flood of reads on
/// the etcd that carries the OpLog. 16 clients ask 25 times each of a G = 64 master; each
/// request takes the result of a walk of the group records that began after it arrived (so
/// no answer is older than its request), and walks run one at a time: etcd serves far fewer
/// than the 400 × 64 reads one walk per request would cost.
#[test]
fn a_flood_of_group_listings_reads_etcd_a_bounded_number_of_times() {
    let _one = serial();
    let c = Cluster::new("groups-flood");
    let a = c.master("primary of groups 0", &["--kvpt-groups", "64"]);
    wait_groups(&a, "every group created", |g| g.len() == 64);
    let before = etcd_ranges(&c.etcd);
    let http = a.http.clone();
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                for _ in 0..25 {
                    let rows: serde_json::Value = serde_json::from_str(&http_get(&http, "/kvpt_groups")).unwrap();
                    assert_eq!(rows.as_array().unwrap().len(), 64);
                }
            });
        }
    });
    let reads = etcd_ranges(&c.etcd) - before;
    assert!(reads < 400.0 * 64.0 / 4.0, "{reads} etcd reads for 400 listings of 64 groups");
    eprintln!("400 listings of 64 groups: {reads} etcd reads");
}

// ---- stable segments and the VSegment quota (issue 48) ------------------------------------------

/// The stable segments' descriptors the cluster `c` keeps in etcd.
fn stable_segments(c: &Cluster) -> Vec<tycho_proto::quota::StableSegment> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let store = tycho_meta::EtcdStore::connect(tycho_meta::EtcdOptions::new([c.etcd.endpoint()])).await.unwrap();
        tycho_master::segments::list_segments(&store, &tycho_master::ownership::ClusterKeys::new(c.name)).await.unwrap()
    })
}

/// The quota published for the cluster `c`, if any.
fn published_quota(c: &Cluster) -> Option<tycho_proto::quota::PartitionQuota> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let store = tycho_meta::EtcdStore::connect(tycho_meta::EtcdOptions::new([c.etcd.endpoint()])).await.unwrap();
        let keys = tycho_master::ownership::ClusterKeys::new(c.name);
        tycho_master::segments::read_quota(&store, &keys).await.unwrap().map(|(q, _)| q)
    })
}

/// Issue 48: nodes started with `--stable-id` on four hosts are described in etcd (host, size,
/// medium, endpoint). `tycho plan-quota --dry-run` prints the plan and publishes nothing; a
/// profile no group could build a VSegment of is refused with its cause; the plan is published
/// once (every group's extents on distinct hosts, in bounds, apart); the master sets its
/// extents aside, and no replica lands in them while the store fills and evicts; a second plan
/// is refused. A node killed and restarted under its name mounts the same segment id again once
/// its earlier run expired, and its extents are set aside again; a node of that name on
/// another host does not start.
#[test]
fn stable_segments_are_described_and_plan_quota_publishes_one_plan() {
    let _one = serial();
    let c = Cluster::new("quota");
    let m = c.master("primary of groups 0", &["--kvpt-groups", "2", "--client-ttl", "2"]);
    let secret = c.secret.to_str().unwrap().to_owned();
    let start = |i: usize| {
        let (name, host) = (format!("n{i}"), format!("host-{i}"));
        let extra = ["--secret-file", &secret, "--stable-id", &name, "--host-id", &host];
        let mut node = NodeProc::start_env(TYCHO, &m.rpc, "64MB", &extra, &[]);
        let line = node.proc.wait_line("tycho node: stable segment", ROLE_WAIT).unwrap();
        (node, line)
    };
    let mut nodes: Vec<(NodeProc, String)> = (0..4).map(start).collect();
    let described = stable_segments(&c);
    assert_eq!(described.len(), 4, "{described:?}");
    for (i, (node, line)) in nodes.iter().enumerate() {
        let d = described.iter().find(|d| d.name == format!("n{i}")).expect("a descriptor per node");
        assert_eq!(d.id, tycho_proto::quota::stable_segment_id(&d.name));
        assert!(line.contains(&d.id.to_string()), "{line}");
        assert_eq!(
            (d.host.as_str(), d.size, d.medium),
            (format!("host-{i}").as_str(), 64 << 20, tycho_proto::quota::Medium::Dram)
        );
        assert_eq!(d.endpoint, node.hostname);
    }
    let endpoint = c.etcd.endpoint();
    let plan = |extra: &[&str]| {
        let out = std::process::Command::new(TYCHO)
            .args(["plan-quota", "--etcd-endpoints", &endpoint, "--cluster-name", c.name])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let profile = "p:members=2,extent=8MiB,stripe=1MiB,medium=dram,per-segment=2";
    let (ok, said, err) = plan(&["--profile", profile, "--dry-run"]);
    assert!(ok, "{said}{err}");
    assert!(said.contains("profile p: 2 members x 8 MiB extents, 1 MiB stripes, dram, 2 per segment"), "{said}");
    assert!(said.contains("dry run: nothing published"), "{said}");
    assert_eq!(published_quota(&c), None, "a dry run published");
    // Five members on four hosts: no group could build one.
    let (ok, _, err) = plan(&["--profile", "q:members=5,extent=8MiB,stripe=1MiB"]);
    assert!(!ok && err.contains("distinct hosts"), "{err}");
    assert_eq!(published_quota(&c), None, "a refused plan published");
    let (ok, said, err) = plan(&["--profile", profile]);
    assert!(ok, "{said}{err}");
    assert!(said.contains("published the quota of 2 groups over 4 stable segments"), "{said}");
    let q = published_quota(&c).expect("published");
    assert_eq!((q.groups, q.extents.len()), (2, 8));
    for g in 0..2 {
        let mine: Vec<_> = q.extents_of(g, 0).collect();
        let hosts: std::collections::BTreeSet<_> =
            mine.iter().map(|e| &described.iter().find(|d| d.id == e.segment).unwrap().host).collect();
        assert_eq!((mine.len(), hosts.len()), (4, 4), "group {g}: {mine:?}");
        assert!(mine.iter().all(|e| e.offset + e.len <= 64 << 20 && e.len == 8 << 20));
    }
    // The master reads the plan and sets all of it aside from whole-segment replicas: 8
    // extents of 8 MiB, nothing in them yet.
    let fenced = |want: u64, what: &str| {
        let deadline = Instant::now() + ROLE_WAIT;
        while metric(&m, "tycho_master_vsegment_fenced_bytes") != want {
            assert!(
                Instant::now() < deadline,
                "{what}: {} bytes set aside",
                metric(&m, "tycho_master_vsegment_fenced_bytes")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    fenced(64 << 20, "the master never set the quota aside");
    assert_eq!(metric(&m, "tycho_master_vsegment_quota_loaded"), 1);
    // Replicas keep out of it, also once the store is full and evicts: 300 MiB of puts into
    // 192 MiB of room.
    let client = c.client(&m.rpc);
    let value = vec![7u8; 1 << 20];
    for i in 0..300 {
        let key = format!("fill/{i}");
        let deadline = Instant::now() + ROLE_WAIT;
        while let Err(e) = client.put(&key, &value, &Default::default()) {
            assert!(Instant::now() < deadline, "put {key}: {e:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut kept = 0;
    for i in 0..300 {
        let Ok(replicas) = client.replicas(&format!("fill/{i}")) else { continue };
        kept += 1;
        for r in replicas {
            for e in q.extents.iter().filter(|e| e.segment == r.segment) {
                assert!(
                    r.offset + r.len <= e.offset || e.offset + e.len <= r.offset,
                    "fill/{i} at {} in {e:?}",
                    r.offset
                );
            }
        }
    }
    assert!((100..300).contains(&kept), "{kept} of 300 objects kept: the store did not fill and evict");
    let (ok, _, err) = plan(&["--profile", profile]);
    assert!(!ok && err.contains("published quota already"), "{err}");
    assert_eq!(published_quota(&c), Some(q), "a second plan changed the first");
    // A restart under the same name: the same segment, once the killed run expired.
    let (mut first, line) = nodes.remove(0);
    first.proc.signal(9);
    let (mut again, said) = start(0);
    assert_eq!(said, line, "a restarted node mounts the same stable segment");
    let d = stable_segments(&c).into_iter().find(|d| d.name == "n0").unwrap();
    assert_eq!(d.endpoint, again.hostname, "the descriptor follows the restarted node");
    // Its new mount is fenced as it comes: all of the quota set aside again.
    fenced(64 << 20, "the restarted node's extents were not set aside");
    assert_ne!(again.hostname, first.hostname);
    // A node on another host cannot take the name over once it is free: its node does not
    // start, and the descriptor stays.
    again.proc.signal(9);
    let out = std::process::Command::new(TYCHO)
        .args(["node", "--master", &m.rpc, "--segment-size", "64MB", "--local-hostname", "127.0.0.1:0", "--port", "0"])
        .args(["--secret-file", &secret, "--stable-id", "n0", "--host-id", "elsewhere"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("INVALID_PARAMS"), "an n0 on another host started: {err}");
    assert_eq!(stable_segments(&c).into_iter().find(|d| d.name == "n0").unwrap().host, "host-0");
}
